"""The last failure modes a new user hits (issue 26): a slowly diverging run, a hand-built graph, hand-edited run
files, a user's own files in a run directory, a YAML alias bomb, K above the outputs, and the plan's output."""

from __future__ import annotations

import json
import logging

import pytest

from betty_trainer.config import load_config
from betty_trainer.errors import TrainingError
from betty_trainer.training.checkpoint import load_checkpoint
from betty_trainer.training.trainer import train
from tests.test_cli import assert_one_line_error, betty_in_process
from tests.test_runs import QUICKSTART, SMALL, metrics


def test_a_huge_learning_rate_warns_of_divergence_and_can_stop_the_run(tmp_path, caplog, capsys):
    diverging = SMALL + ["optim.epochs=4", "optim.lr=1e10"]  # loss 4.05, then about 1e22 (Adam keeps it finite)
    with caplog.at_level(logging.WARNING, logger="betty_trainer"):
        train(load_config(QUICKSTART, diverging), run_dir=tmp_path / "warned")
    said = [r.getMessage() for r in caplog.records if "diverging" in r.getMessage()]
    assert len(said) == 1  # once per run, at the first epoch over the limit
    assert said[0].startswith("epoch 1: training loss ") and "over 1000× ln(num_classes) = 1609" in said[0]
    assert "optim.lr=1e+10 is too high" in said[0] and "train.stop_on_divergence=true" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="betty_trainer"):  # a high but sane rate trains without the warning
        train(load_config(QUICKSTART, SMALL + ["optim.epochs=4", "optim.lr=1.0"]), run_dir=tmp_path / "sane")
    assert not [r for r in caplog.records if "diverging" in r.getMessage()]

    stopped = tmp_path / "stopped"
    with pytest.raises(TrainingError, match=r"epoch 1: training loss .* diverging.*stopped \(train.stop_on_divergence"
                                            r"\); last good checkpoint: .*last\.pt \(epoch 0"):
        train(load_config(QUICKSTART, diverging + ["train.stop_on_divergence=true"]), run_dir=stopped)
    assert [m["epoch"] for m in metrics(stopped)] == [0] and load_checkpoint(stopped)["epoch"] == 0
    refused = betty_in_process(capsys, "train", "--config", QUICKSTART, *diverging, "train.stop_on_divergence=true",
                               f"train.run_dir={tmp_path / 'cli'}")
    assert_one_line_error(refused, "epoch 1: training loss", "stop_on_divergence", "last.pt (epoch 0")
