"""Dataset loading: Planetoid counts and split, the restricted unpickler, checksums, the synthetic SBM."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from betty_trainer.config import DatasetConfig
from betty_trainer.datasets import load_dataset, make_sbm, restricted_load
from betty_trainer.errors import DatasetError


def test_cora_matches_the_published_counts(cora):
    assert (cora.num_nodes, cora.num_edges // 2, cora.num_features, cora.num_classes) == (2708, 5278, 1433, 7)
    assert (cora.train_idx.numel(), cora.val_idx.numel(), cora.test_idx.numel()) == (140, 500, 1000)
    assert torch.bincount(cora.y).tolist() == [351, 217, 418, 818, 426, 298, 180]
    assert torch.bincount(cora.y[cora.train_idx]).tolist() == [20] * 7
    assert torch.allclose(cora.x.sum(1), torch.ones(cora.num_nodes))  # row-normalised


def test_citeseer_pads_the_isolated_test_slots(citeseer):
    assert (citeseer.num_nodes, citeseer.num_edges // 2, citeseer.num_features) == (3327, 4552, 3703)
    assert torch.bincount(citeseer.y[citeseer.train_idx]).tolist() == [20] * 6
    splits = torch.cat([citeseer.train_idx, citeseer.val_idx, citeseer.test_idx])
    assert torch.unique(splits).numel() == splits.numel() == 1620
    # the 15 unlisted ids in the test span have no features, no edges and are in no split
    padded = torch.tensor(sorted(set(range(2312, 3327)) - set(citeseer.test_idx.tolist())))
    assert padded.numel() == 15
    assert citeseer.x[padded].abs().sum() == 0


class Evil:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-betty",))


def test_restricted_unpickler_refuses_other_globals():
    with pytest.raises(DatasetError, match="refusing to load shutil.rmtree"):
        restricted_load(pickle.dumps(Evil(), protocol=2), "evil.pkl")


def test_restricted_unpickler_reports_truncation(planetoid_dir):
    data = (planetoid_dir / "ind.cora.x").read_bytes()
    with pytest.raises(DatasetError, match="truncated or corrupt"):
        restricted_load(data[: len(data) // 2], "ind.cora.x")


@pytest.fixture
def cora_copy(planetoid_dir, tmp_path):
    for path in planetoid_dir.glob("ind.cora.*"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def test_tampered_file_fails_checksum(cora_copy):
    target = cora_copy / "ind.cora.test.index"
    target.write_bytes(target.read_bytes().replace(b"2692", b"2693", 1))
    with pytest.raises(DatasetError, match="ind.cora.test.index fails its sha256 check"):
        load_dataset(DatasetConfig(name="cora", data_dir=cora_copy))


def test_truncated_file_without_checksum_gives_parse_error(cora_copy):
    target = cora_copy / "ind.cora.allx"
    target.write_bytes(target.read_bytes()[:1000])
    with pytest.raises(DatasetError, match="ind.cora.allx is truncated or corrupt"):
        load_dataset(DatasetConfig(name="cora", data_dir=cora_copy, verify_checksums=False))


def test_pickle_asking_for_another_class_is_refused(cora_copy):
    (cora_copy / "ind.cora.graph").write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(DatasetError, match="refusing to load shutil.rmtree"):
        load_dataset(DatasetConfig(name="cora", data_dir=cora_copy, verify_checksums=False))


def test_missing_file_and_unknown_dataset(cora_copy):
    (cora_copy / "ind.cora.ty").unlink()
    with pytest.raises(DatasetError, match="missing in"):
        load_dataset(DatasetConfig(name="cora", data_dir=cora_copy))
    with pytest.raises(DatasetError, match="unknown dataset 'ogbn-nope'"):
        load_dataset(DatasetConfig(name="ogbn-nope"))


def test_offline_without_files_says_how_to_point_at_them(tmp_path, monkeypatch):
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BETTY_DATA_DIR", raising=False)
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(DatasetError, match="pass --data-dir or set BETTY_DATA_DIR"):
        load_dataset(DatasetConfig(name="cora"))
    assert not list(tmp_path.rglob("ind.*")), "nothing half-written into the cache"


def test_synthetic_is_deterministic_and_class_informative():
    one, two, other = make_sbm(seed=1), make_sbm(seed=1), make_sbm(seed=2)
    assert torch.equal(one.indices, two.indices) and torch.equal(one.x, two.x)
    assert not torch.equal(one.indices, other.indices)
    same_class = (one.y[one.indices] == one.y[torch.repeat_interleave(torch.arange(one.num_nodes), one.in_degrees())])
    assert same_class.float().mean() > 0.7  # homophily 0.7 plus 1/5 chance matches of the rest
    assert torch.bincount(one.y[one.train_idx]).tolist() == [20] * 5
