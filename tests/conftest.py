"""Shared fixtures. Real datasets come from ../shared/datasets (or $BETTY_TEST_DATA).

Outside CI a missing data folder skips the tests that need it; in CI (``CI`` set)
it fails them, so CI always exercises the real files.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from betty_trainer.config import DatasetConfig
from betty_trainer.datasets import load_dataset

REPO = Path(__file__).resolve().parents[1]
DATASETS = Path(os.environ.get("BETTY_TEST_DATA", REPO.parent / "shared" / "datasets"))


def shared_data(folder: str, probe: str) -> Path:
    """``DATASETS / folder``, which must hold ``probe``. If it does not, the calling test fails in CI
    (``CI`` set: CI must exercise the real files) and is skipped elsewhere."""
    path = DATASETS / folder
    if not (path / probe).is_file():
        message = f"{probe} not found in {path} (set BETTY_TEST_DATA to the shared datasets folder)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def planetoid_dir() -> Path:
    return shared_data("planetoid", "ind.cora.x")


@pytest.fixture(scope="session")
def cora(planetoid_dir):
    return load_dataset(DatasetConfig(name="cora", data_dir=planetoid_dir))


@pytest.fixture(scope="session")
def citeseer(planetoid_dir):
    return load_dataset(DatasetConfig(name="citeseer", data_dir=planetoid_dir))


@pytest.fixture(scope="session")
def cora64(cora):
    """Cora with only its first 64 feature columns: for the LSTM aggregator, whose input-layer LSTM
    is as wide as the features (1433 on Cora: ~33 MFLOP per edge and step) and too slow for tests."""
    return dataclasses.replace(cora, x=cora.x[:, :64].contiguous())


@pytest.fixture(scope="session")
def computers8(computers):
    """Amazon Computers with only its first 8 feature columns: the blocks' structure (491,722 edges) is then
    a large part of a step's memory, so an index copy the estimate misses shows (GCN's ``norm[indices]``)."""
    return dataclasses.replace(computers, x=computers.x[:, :8].contiguous())


@pytest.fixture(scope="session")
def computers():
    """Amazon Computers (13,752 nodes, 491,722 directed edges, mean in-degree 36; graphdata-npz)."""
    return load_dataset(DatasetConfig(name="amazon-computers", data_dir=shared_data("graphdata-npz", "amazon_cs.npz")))


@pytest.fixture(scope="session")
def cornell5():
    """Facebook100 Cornell5 (18,660 nodes, 2 · 790,777 directed edges; facebook100)."""
    return load_dataset(DatasetConfig(name="fb100-cornell5", data_dir=shared_data("facebook100", "Cornell5.mat")))
