"""A run's life (issue 12): never lost, best and last checkpoints verified by sha256, resume refusals,
one-line errors for every failure, evaluate and predict, readable logs outside a terminal.

Runs are tiny synthetic ones (600 nodes, a few epochs); one test trains on Cora for the evaluate check.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from rich.console import Console

from betty_trainer.cli import main
from betty_trainer.config import load_config
from betty_trainer.errors import TrainingError
from betty_trainer.training.checkpoint import BEST_NAME, LAST_NAME, checksum_path, load_checkpoint, sha256_hex
from betty_trainer.training.inference import evaluate_run, load_model, load_run, node_logits
from betty_trainer.training.output import EpochProgress, quiet_native_stderr
from betty_trainer.training.trainer import train
from tests.conftest import REPO
from tests.test_cli import QUICK, assert_one_line_error, betty_in_process
from tests.test_datasets import Evil

QUICKSTART = str(REPO / "configs/quickstart.yaml")
SMALL = [q for q in QUICK if not q.startswith("optim.epochs")]  # 600 nodes, no progress bar
FINISHED = ["optim.epochs=6", "optim.lr=1.0"]  # a high rate: validation accuracy peaks before the last epoch
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # what train.device=auto picks


def train_cli(run: Path, *extra: str) -> list[str]:
    return ["train", "--config", QUICKSTART, *SMALL, f"train.run_dir={run}", *extra]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def rewrite_checkpoint(path: Path, state) -> None:
    """Replace a checkpoint by ``state`` (any picklable object) with a matching sha256 file, so only
    the content checks can refuse it."""
    if isinstance(state, bytes):
        data = state
    else:
        import io
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    path.write_bytes(data)
    checksum_path(path).write_text(f"{sha256_hex(data)}  {path.name}\n")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-epoch quickstart run whose best epoch (3) is not its last (copy it before changing it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(QUICKSTART, SMALL + FINISHED), run_dir=run)
    return run


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def test_a_rerun_into_an_existing_run_is_refused_and_overwrite_replaces_it(run_copy, capsys):
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file() and p.name != "run.lock"}
    refused = betty_in_process(capsys, *train_cli(run_copy, "optim.epochs=2"))
    assert_one_line_error(refused, f"run directory {run_copy} already holds a run", "--resume", "--overwrite")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file() and p.name != "run.lock"} == before

    replaced = betty_in_process(capsys, *train_cli(run_copy, "optim.epochs=2", "seed=1"), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert [m["epoch"] for m in metrics(run_copy)] == [0, 1]
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["seed"] == 1
    assert load_checkpoint(run_copy)["epoch"] == 1 and not (run_copy / "resumes.yaml").exists()
    assert not (run_copy / BEST_NAME).exists() or load_checkpoint(run_copy, BEST_NAME)["epoch"] <= 1
    environment = json.loads((run_copy / "environment.json").read_text())
    assert "--overwrite" in environment["command"] and environment["device"] == DEVICE
    assert environment["torch"] == str(torch.__version__) and environment["git"]["commit"]


def test_the_run_directory_records_what_the_run_ran_on(finished):
    environment = json.loads((finished / "environment.json").read_text())
    assert set(environment) >= {"time", "command", "host", "python", "torch", "packages", "device", "git"}
    assert environment["packages"]["betty-trainer"]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert environment["git"]["commit"] == commit.strip()


def test_best_and_last_checkpoints_reload_and_give_the_reported_accuracies_exactly(finished):
    reported = load_checkpoint(finished)["best"]  # what train() returned: TrainResult is built from it
    lines = metrics(finished)
    best_line = max(lines, key=lambda m: m["val_acc"])  # the first epoch with the highest validation accuracy
    assert reported["epoch"] == best_line["epoch"] < lines[-1]["epoch"]  # best and last differ here

    best, accuracy = evaluate_run(finished, "best", "all")
    assert best.epoch == reported["epoch"] and best.metrics == best_line
    assert (accuracy["val"], accuracy["test"]) == (reported["val_acc"], reported["test_acc"])
    assert (accuracy["val"], accuracy["test"]) == (best_line["val_acc"], best_line["test_acc"])
    assert 0 <= accuracy["train"] <= 1  # train_acc in metrics.jsonl is measured in training mode (dropout on)
    last, accuracy = evaluate_run(finished, "last", "all")
    assert last.epoch == lines[-1]["epoch"]
    assert (accuracy["val"], accuracy["test"]) == (lines[-1]["val_acc"], lines[-1]["test_acc"])
    assert accuracy["test"] != reported["test_acc"] or accuracy["val"] != reported["val_acc"]  # a different model

    model = load_model(finished)  # best.pt
    saved = load_checkpoint(finished, BEST_NAME)["model"]
    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())
    assert not model.training


def test_evaluate_on_a_finished_cora_run_prints_the_test_accuracy_training_reported(planetoid_dir, tmp_path, capsys):
    args = ["--config", str(REPO / "configs/cora-sage.yaml"), "--data-dir", str(planetoid_dir), "optim.epochs=8",
            "train.progress=false", "micro_batch.num_micro_batches=2", f"train.run_dir={tmp_path / 'cora'}"]
    trained = betty_in_process(capsys, "train", *args)
    assert trained.returncode == 0, trained.stderr
    reported = trained.stdout.split("final test accuracy ")[1].split()[0]
    evaluated = betty_in_process(capsys, "evaluate", "--run", str(tmp_path / "cora"))
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith(f"test accuracy {reported} (best.pt, epoch ")
    last = metrics(tmp_path / "cora")[-1]
    evaluated_last = betty_in_process(capsys, "evaluate", "--run", str(tmp_path / "cora"), "--checkpoint", "last",
                                      "--split", "val")
    assert evaluated_last.stdout.startswith(f"val accuracy {last['val_acc']:.4f} (last.pt, epoch {last['epoch']}")


@pytest.mark.parametrize("suffix", [".pt", ".csv", ".parquet"])
def test_predict_writes_one_row_per_node_that_reads_back(finished, tmp_path, capsys, suffix):
    output = tmp_path / f"predictions{suffix}"
    result = betty_in_process(capsys, "predict", "--run", str(finished), "--output", str(output))
    assert result.returncode == 0, result.stderr
    run = load_run(finished)
    expected = torch.softmax(node_logits(run), dim=1)
    n, classes = run.graph.num_nodes, run.graph.num_classes
    if suffix == ".pt":
        table = torch.load(output, weights_only=True)
        assert torch.equal(table["node"], torch.arange(n))
        assert torch.equal(table["probabilities"], expected) and torch.equal(table["prediction"], expected.argmax(1))
        return
    if suffix == ".csv":
        with open(output, newline="") as handle:
            rows = list(csv.reader(handle))
        header, rows = rows[0], rows[1:]
        columns = {name: [row[i] for row in rows] for i, name in enumerate(header)}
    else:
        columns = pq.read_table(output).to_pydict()
    assert len(columns["node"]) == n and [int(v) for v in columns["node"]] == list(range(n))
    assert [int(v) for v in columns["prediction"]] == expected.argmax(1).tolist()
    probabilities = torch.tensor([[float(v) for v in columns[f"prob_{c}"]] for c in range(classes)]).T
    assert torch.allclose(probabilities, expected, rtol=1e-6, atol=1e-7)  # float32 written as text and read back


def test_a_partial_metrics_line_is_dropped_and_resume_completes_bit_exactly(tmp_path, capsys):
    overrides = SMALL + ["optim.scheduler=step", "optim.step_size=1"]
    train(load_config(QUICKSTART, overrides + ["optim.epochs=4"]), run_dir=tmp_path / "straight")
    train(load_config(QUICKSTART, overrides + ["optim.epochs=2"]), run_dir=tmp_path / "cut")
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as handle:
        handle.write('{"epoch": 2, "loss": 0.4')  # a crash mid-append
    resumed = betty_in_process(capsys, "train", "--resume", str(tmp_path / "cut"), "optim.epochs=4")
    assert resumed.returncode == 0, resumed.stderr
    assert "warning: dropping the unreadable last line" in resumed.stderr
    assert [m["epoch"] for m in metrics(tmp_path / "cut")] == [0, 1, 2, 3]
    one, two = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "cut")
    for name, tensor in one["model"].items():
        assert torch.equal(tensor, two["model"][name]), name
    assert [m["lr"] for m in metrics(tmp_path / "straight")] == [m["lr"] for m in metrics(tmp_path / "cut")]
    history = yaml.safe_load((tmp_path / "cut" / "resumes.yaml").read_text())
    assert history[0]["from_epoch"] == 2 and history[0]["changes"] == {"optim.epochs": [2, 4]}
    assert "--resume" in history[0]["environment"]["command"]
    assert len({m["lr"] for m in metrics(tmp_path / "cut")}) == 4  # the schedule really changed the rate

    train(load_config(QUICKSTART, SMALL + ["optim.epochs=1", "optim.scheduler=cosine"]), run_dir=tmp_path / "cosine")
    assert_one_line_error(betty_in_process(capsys, "train", "--resume", str(tmp_path / "cosine"), "optim.epochs=4"),
                          "optim.scheduler=cosine anneals over optim.epochs (1 in the run, 4 here)")


def test_a_flipped_byte_in_a_checkpoint_is_refused_on_resume_and_on_load(run_copy, capsys):
    config_before = (run_copy / "config.yaml").read_bytes()
    for name in (LAST_NAME, BEST_NAME):
        data = bytearray((run_copy / name).read_bytes())
        data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of the tensor data
        (run_copy / name).write_bytes(bytes(data))
    refused = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=8")
    assert_one_line_error(refused, f"checkpoint {run_copy / LAST_NAME} does not match its sha256 in last.sha256")
    assert (run_copy / "config.yaml").read_bytes() == config_before
    assert_one_line_error(betty_in_process(capsys, "evaluate", "--run", str(run_copy)),
                          f"checkpoint {run_copy / BEST_NAME} does not match its sha256")


def test_a_checkpoint_written_halfway_is_still_verified(run_copy):
    """The sha256 file lists the old and the new digest while the checkpoint is replaced (crash window)."""
    old = (run_copy / LAST_NAME).read_bytes()
    state = load_checkpoint(run_copy)
    from betty_trainer.training.checkpoint import save_checkpoint

    state["epoch"] = 7
    save_checkpoint(run_copy, state)
    new = (run_copy / LAST_NAME).read_bytes()
    assert (run_copy / "last.sha256").read_text() == f"{sha256_hex(new)}  {LAST_NAME}\n"
    (run_copy / "last.sha256").write_text(f"{sha256_hex(new)}  {LAST_NAME}\n{sha256_hex(old)}  {LAST_NAME}\n")
    assert load_checkpoint(run_copy)["epoch"] == 7
    (run_copy / LAST_NAME).write_bytes(old)  # killed after the first step: the old file with both digests listed
    assert load_checkpoint(run_copy)["epoch"] == 5


def test_a_failed_resume_leaves_config_yaml_unchanged(run_copy, capsys):
    before = (run_copy / "config.yaml").read_bytes()
    refused = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=10", "model.hidden=32")
    assert_one_line_error(refused, "model.hidden is 32 here but 64 in the checkpoint")
    assert (run_copy / "config.yaml").read_bytes() == before
    assert not (run_copy / "resumes.yaml").exists() and [m["epoch"] for m in metrics(run_copy)] == list(range(6))


def files_of(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "run.lock"}


def test_a_run_refused_by_its_budget_loses_nothing(run_copy, tmp_path, capsys):
    """The first batch's plan is made before anything is written: an impossible budget refuses --overwrite without
    removing the old run, refuses a resume without touching config.yaml, and leaves no directory for a new run."""
    before = files_of(run_copy)
    refused = betty_in_process(capsys, *train_cli(run_copy, "optim.epochs=2", "micro_batch.budget=1KiB"),
                               "--overwrite")
    assert_one_line_error(refused, "budget")
    assert files_of(run_copy) == before
    refused = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=10", "micro_batch.budget=1KiB")
    assert_one_line_error(refused, "budget")
    assert files_of(run_copy) == before and not (run_copy / "resumes.yaml").exists()
    new = tmp_path / "new" / "run"
    refused = betty_in_process(capsys, *train_cli(new, "micro_batch.budget=1KiB"))
    assert_one_line_error(refused, "budget")
    assert not (tmp_path / "new").exists()


def test_a_run_without_a_checkpoint_is_not_offered_for_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("environment.json", "config.yaml"):  # what a run that failed in its first epoch leaves
        (run / name).write_text("{}\n")
    refused = betty_in_process(capsys, *train_cli(run))
    assert_one_line_error(refused, "no checkpoint to resume from", "--overwrite")
    assert "--resume" not in refused.stderr


@pytest.mark.parametrize("scheduler", ["none", "step"])
def test_a_resume_applies_the_optim_section_it_is_given(tmp_path, scheduler):
    """optim.lr, optim.weight_decay and the schedule's gamma given at resume are what the resumed epochs use (the
    schedule keeps its position: step: lr·gamma^⌊t/step_size⌋); a plain resume keeps the run's values."""
    base = SMALL + [f"optim.scheduler={scheduler}", "optim.step_size=1", "optim.gamma=0.5"]
    train(load_config(QUICKSTART, base + ["optim.epochs=2"]), run_dir=tmp_path / "run")
    train(load_config(QUICKSTART, base + ["optim.epochs=4", "optim.lr=0.001", "optim.gamma=0.9",
                                          "optim.weight_decay=0.1"]), run_dir=tmp_path / "run", resume=True)
    lrs = [m["lr"] for m in metrics(tmp_path / "run")]
    if scheduler == "none":
        assert lrs == [0.01, 0.01, 0.001, 0.001]
    else:
        # the scheduler multiplies by γ step by step: float64 products in another order, approx's 1e-6 relative
        assert lrs[:2] == [0.01, 0.005] and lrs[2:] == pytest.approx([0.001 * 0.9**2, 0.001 * 0.9**3])
    state = load_checkpoint(tmp_path / "run")
    assert {group["weight_decay"] for group in state["optimizer"]["param_groups"]} == {0.1}
    plain = tmp_path / "plain"
    train(load_config(QUICKSTART, base + ["optim.epochs=2"]), run_dir=plain)
    train(load_config(QUICKSTART, base + ["optim.epochs=3"]), run_dir=plain, resume=True)
    assert [m["lr"] for m in metrics(plain)] == lrs[:2] + ([0.01] if scheduler == "none" else [0.0025])


def test_ctrl_c_names_the_run_to_resume(tmp_path, monkeypatch):
    from betty_trainer.training import trainer

    real = trainer.save_checkpoint
    calls = []

    def interrupted(path, state, name):  # the second epoch's last.pt write is cut short by Ctrl-C
        calls.append(name)
        if len(calls) == 4:
            (Path(path) / f"{name}.partial").write_bytes(b"half")
            raise KeyboardInterrupt
        return real(path, state, name)

    monkeypatch.setattr(trainer, "save_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        train(load_config(QUICKSTART, SMALL + ["optim.epochs=4", "optim.lr=1.0"]), run_dir=tmp_path / "run")
    assert caught.value.run_dir == tmp_path / "run"
    monkeypatch.setattr(trainer, "save_checkpoint", real)

    def stopped(*args, **kwargs):  # Ctrl-C while a resume is still loading and planning
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "make_planner", stopped)
    with pytest.raises(KeyboardInterrupt) as caught:
        train(load_config(QUICKSTART, SMALL + ["optim.epochs=4", "optim.lr=1.0"]), run_dir=tmp_path / "run",
              resume=True)
    assert caught.value.run_dir == tmp_path / "run"


def test_an_interrupted_write_leaves_the_old_file_and_no_partial(tmp_path, monkeypatch):
    from betty_trainer.training import rundir

    target = tmp_path / "file"
    target.write_bytes(b"old")
    monkeypatch.setattr(rundir, "_write_all", lambda fd, data: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        rundir.write_bytes(target, b"new")
    assert target.read_bytes() == b"old" and not (tmp_path / "file.partial").exists()


def _evil_checkpoint(run: Path) -> None:
    rewrite_checkpoint(run / LAST_NAME, pickle.dumps(Evil(), protocol=2))


def _keyless_checkpoint(run: Path) -> None:
    rewrite_checkpoint(run / LAST_NAME, {"epoch": 5, "model": {}})


def _non_finite_checkpoint(run: Path) -> None:
    state = load_checkpoint(run)
    name = next(iter(state["model"]))
    state["model"][name].view(-1)[0] = float("inf")
    rewrite_checkpoint(run / LAST_NAME, state)


def _file(run: Path) -> None:
    (run.parent / "a-file").write_text("x")


RESUME = ["train", "--resume", "{run}", "optim.epochs=8"]
TRAIN = ["train", "--config", QUICKSTART, *SMALL, "train.run_dir={tmp}/new"]


@pytest.mark.parametrize("setup, args, fragments", [
    (None, ["train", "--config", QUICKSTART, *SMALL, "dataset.synthetic.num_nodes=100"],
     ["dataset.synthetic.num_nodes is 100 but its split needs 300 nodes"]),
    (None, ["validate", "--config", QUICKSTART, "dataset.synthetic.num_nodes=100"],
     ["dataset.synthetic.num_nodes is 100"]),
    (_file, ["train", "--config", QUICKSTART, *SMALL, "train.run_dir={tmp}/a-file"], ["is a file, not a folder"]),
    (_file, ["train", "--config", QUICKSTART, *SMALL, "train.run_dir={tmp}/a-file/run"],
     ["lies under {tmp}/a-file, which is a file"]),
    (_file, ["validate", "--config", QUICKSTART, "train.run_dir={tmp}/a-file/run"], ["which is a file"]),
    (None, ["plan", "--config", QUICKSTART, *SMALL, "--output", "{tmp}/missing/plan.json"],
     ["--output {tmp}/missing/plan.json: folder {tmp}/missing does not exist"]),
    (None, [*RESUME, "model.hidden=16"], ["cannot resume", "model.hidden is 16 here but 64 in the checkpoint"]),
    (None, [*RESUME, "dataset.synthetic.num_nodes=700"], ["dataset.num_nodes is 700 here but 600 in the checkpoint"]),
    (None, [*RESUME, "model.arch=gcn"], ["model.arch is 'gcn' here but 'sage'"]),
    (None, [*RESUME, "dataset.synthetic.num_val=90"], ["the dataset's content differs from the checkpoint's"]),
    (_keyless_checkpoint, RESUME, ["lacks 'optimizer', 'best', 'identity'"]),
    (_evil_checkpoint, RESUME, ["holds objects other than tensors and plain data; it is refused"]),
    (_non_finite_checkpoint, RESUME, ["is refused: parameter", "1 NaN or infinite value"]),
    (None, [*TRAIN, "train.device=meta"], ["'train.device' ('meta')"]),
    (None, [*TRAIN, "model.hidden=1000000000"], ["model.hidden=1000000000", f"GiB of {DEVICE} memory"]),
    (None, ["evaluate", "--run", "{tmp}"], ["is not a run directory"]),
    (None, ["predict", "--run", "{run}", "--output", "{tmp}/p.txt"], ["use a .pt, .csv or .parquet file"]),
    (None, ["predict", "--run", "{run}", "--output", "{tmp}/missing/p.csv"], ["folder {tmp}/missing does not exist"]),
    (None, [*RESUME, "--overwrite"], ["give one of them"]),
])
def test_every_failure_is_one_error_line_and_exit_status_2(run_copy, tmp_path, capsys, setup, args, fragments):
    if setup is not None:
        setup(run_copy)
    fill = {"run": str(run_copy), "tmp": str(tmp_path)}
    result = betty_in_process(capsys, *(arg.format(**fill) for arg in args))
    assert_one_line_error(result, *(fragment.format(**fill) for fragment in fragments))


def test_validate_runs_the_checks_train_runs_before_loading_data(capsys, tmp_path):
    ok = betty_in_process(capsys, "validate", "--config", QUICKSTART, "micro_batch.budget=4MiB",
                          f"train.run_dir={tmp_path / 'run'}")
    assert ok.returncode == 0, ok.stderr
    for check in ("well-formed", "checked as train would before loading data", "dataset name", f"device ({DEVICE})",
                  "synthetic split sizes", "budget", "run directory"):
        assert check in ok.stdout
    unknown = betty_in_process(capsys, "validate", "--config", QUICKSTART, "dataset.name=nope")
    assert_one_line_error(unknown, "unknown dataset 'nope'")
    unbounded = betty_in_process(capsys, "validate", "--config", QUICKSTART, "features.macro_batch=2",
                                 "micro_batch.budget=8MiB")
    assert_one_line_error(unbounded, "needs features.macro_batch_budget")


def test_validate_says_when_the_run_directory_holds_a_run(finished, capsys):
    shown = betty_in_process(capsys, "validate", "--config", QUICKSTART, f"train.run_dir={finished}")
    assert shown.returncode == 0, shown.stderr
    assert f"{finished} holds a run" in shown.stdout and "--resume" in shown.stdout and "--overwrite" in shown.stdout


def test_diverged_parameters_are_never_saved_and_the_error_names_the_last_good_checkpoint(tmp_path):
    class Diverging(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(32, 5))
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.calls = 0

        def forward(self, blocks, x):
            self.calls += self.training  # training steps only, not evaluation
            if self.calls > 8:  # epoch 2 of 4 micro-batches: a parameter overflows, the loss stays finite
                with torch.no_grad():
                    self.scale.fill_(float("inf"))
            return x[: blocks[-1].num_dst] @ self.weight

    config = load_config(QUICKSTART, SMALL + ["optim.epochs=5"])
    with pytest.raises(TrainingError, match=r"epoch 2: parameter 'scale' has 1 NaN or infinite value after the "
                                            r"optimizer step .*last good checkpoint: .*last\.pt \(epoch 1"):
        train(config, model=Diverging(), run_dir=tmp_path)
    assert load_checkpoint(tmp_path)["epoch"] == 1  # finite, loadable
    assert [m["epoch"] for m in metrics(tmp_path)] == [0, 1]


def test_a_custom_model_with_torch_dropout_warns_when_batches_are_split(tmp_path, caplog):
    class WithDropout(torch.nn.Module):
        def __init__(self, p=0.5):
            super().__init__()
            self.linear = torch.nn.Linear(32, 5)
            self.drop = torch.nn.Dropout(p)

        def forward(self, blocks, x):
            return self.linear(self.drop(x[: blocks[-1].num_dst]))

    config = load_config(QUICKSTART, SMALL + ["optim.epochs=2"])
    with caplog.at_level("WARNING", logger="betty_trainer"):
        train(config, model=WithDropout(), run_dir=tmp_path / "k4")
    warnings = [r.getMessage() for r in caplog.records if "torch.nn dropout" in r.getMessage()]
    assert len(warnings) == 1 and "(drop)" in warnings[0] and "4 micro-batches" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="betty_trainer"):
        train(load_config(QUICKSTART, SMALL + ["optim.epochs=2", "micro_batch.num_micro_batches=1"]),
              model=WithDropout(), run_dir=tmp_path / "k1")
    assert not [r for r in caplog.records if "torch.nn dropout" in r.getMessage()]
    with caplog.at_level("WARNING", logger="betty_trainer"):  # Dropout(0.0) (dgl.nn.SAGEConv holds one) draws nothing
        train(config, model=WithDropout(0.0), run_dir=tmp_path / "p0")
    assert not [r for r in caplog.records if "torch.nn dropout" in r.getMessage()]


def test_gcn_with_the_gns_sampler_warns_of_the_sum_bias(tmp_path, caplog):
    gns = ["sampling.sampler=gns", "sampling.fanouts=[3,3]", "sampling.batch_size=64", "optim.epochs=1"]
    with caplog.at_level("WARNING", logger="betty_trainer"):
        train(load_config(QUICKSTART, SMALL + gns + ["model.arch=gcn"]), run_dir=tmp_path / "gcn")
    said = [r.getMessage() for r in caplog.records if "GNS's importance weights" in r.getMessage()]
    assert said and "+13% on those rows" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="betty_trainer"):
        train(load_config(QUICKSTART, SMALL + gns + ["model.arch=sage"]), run_dir=tmp_path / "sage")
    assert not [r for r in caplog.records if "GNS's importance weights" in r.getMessage()]


def test_early_stopping_and_the_lr_scheduler(tmp_path, capsys):
    config = load_config(QUICKSTART, SMALL + ["optim.epochs=12", "train.patience=1", "optim.lr=1.0",
                                              "optim.scheduler=step", "optim.step_size=2", "optim.gamma=0.5"])
    result = train(config, run_dir=tmp_path / "run")
    lines = metrics(tmp_path / "run")
    assert result.stopped_early and len(lines) < 12
    assert lines[-1]["epoch"] - result.best_epoch == 1  # stopped as soon as patience ran out
    assert lines[-1]["val_acc"] <= result.best_val_acc
    assert [m["lr"] for m in lines] == [1.0 * 0.5 ** (epoch // 2) for epoch in range(len(lines))]
    refused = betty_in_process(capsys, "train", "--resume", str(tmp_path / "run"))
    assert_one_line_error(refused, "stopped early at epoch", "raise train.patience to continue")


def test_tensorboard_is_off_by_default_and_asks_for_its_package(tmp_path, finished, capsys, monkeypatch):
    assert not (finished / "tensorboard").exists()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        real_find_spec(name, *a))
    result = betty_in_process(capsys, *train_cli(tmp_path / "run", "optim.epochs=1", "train.tensorboard=true"))
    assert_one_line_error(result, "train.tensorboard=true needs the tensorboard package: pip install tensorboard")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("*.yaml"))


def test_tensorboard_logs_the_metrics_of_every_epoch(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(load_config(QUICKSTART, SMALL + ["optim.epochs=2", "train.tensorboard=true"]), run_dir=tmp_path / "run")
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    lines = metrics(tmp_path / "run")
    for name in ("loss", "val_acc", "test_acc", "lr"):
        events = board.Scalars(name)
        assert [e.step for e in events] == [0, 1]
        assert [e.value for e in events] == pytest.approx([m[name] for m in lines], rel=1e-6)  # stored as float32


def test_a_run_under_nohup_logs_one_line_per_epoch_with_the_run_directory_first_and_no_profiler_noise(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as handle:  # stdout and stderr into a file, as `nohup … > log 2>&1`
        status = subprocess.run([sys.executable, "-m", "betty_trainer.cli", "train", "--config", QUICKSTART,
                                 *[q for q in SMALL if q != "train.progress=false"], "optim.epochs=3",
                                 f"train.run_dir={tmp_path / 'run'}"], cwd=tmp_path, stdout=handle,
                                stderr=subprocess.STDOUT, timeout=300).returncode
    lines = log.read_text().splitlines()
    assert status == 0, lines
    assert lines[0] == f"run directory {tmp_path / 'run'} (new run)"
    assert lines[1].startswith(f"device {DEVICE} · torch ")
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(" · ")[0] for line in epochs] == ["epoch 0 (1/3 done)", "epoch 1 (2/3 done)",
                                                         "epoch 2 (3/3 done)"]
    assert all("ETA" in line for line in epochs)
    assert lines[-1].startswith("final test accuracy ")
    assert all(len(line) < 400 for line in lines)



def test_plan_measure_prints_no_profiler_chatter(tmp_path, capfd):
    status = main(["plan", "--config", QUICKSTART, *SMALL, "--measure", "--output", str(tmp_path / "plan.json")])
    out, err = capfd.readouterr()  # what reached file descriptors 1 and 2, native writes included
    assert status == 0, err
    assert "USDT" not in err + out and "profiler_st" not in err + out
    assert "measured" in out


def test_quiet_native_stderr_hides_profiler_lines_and_passes_the_others_on(capfd):
    with quiet_native_stderr():
        os.write(2, b"USDT:2026-11-22 15:57:49 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a native warning\n")
        print("a python line", file=sys.stderr)
    assert sorted(capfd.readouterr().err.splitlines()) == ["a native warning", "a python line"]


def test_log_level_sends_the_package_messages_to_stderr(capsys, monkeypatch):
    def checks_that_log(config, **kwargs):
        logging.getLogger("betty_trainer.memory.planner").info("calibrated in 1 s")
        logging.getLogger("betty_trainer.memory.planner").warning("re-planning with K ≥ 5")
        logging.getLogger("estimator.calibrate").debug("a detail")
        return ["nothing"]

    monkeypatch.setattr("betty_trainer.training.preflight.check_config", checks_that_log)
    level = logging.getLogger("betty_trainer").level
    assert main(["validate", "--config", QUICKSTART]) == 0
    assert capsys.readouterr().err == "warning: re-planning with K ≥ 5\n"  # the default level: warning
    assert main(["validate", "--config", QUICKSTART, "--log-level", "info"]) == 0
    assert capsys.readouterr().err == "info: calibrated in 1 s\nwarning: re-planning with K ≥ 5\n"
    assert main(["validate", "--config", QUICKSTART, "--log-level", "debug"]) == 0
    assert capsys.readouterr().err.endswith("debug: a detail\n")
    assert logging.getLogger("betty_trainer").level == level  # main() leaves logging as it was


def test_on_a_terminal_the_progress_is_a_live_bar_with_an_eta():
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    with EpochProgress(console, "synthetic", total=4, completed=1) as progress:
        progress.advance(1, "loss 1.0")
    shown = console.file.getvalue()
    assert "ETA" in shown and "2/4" in shown and "done)" not in shown  # the bar, not the plain lines
    plain = Console(file=io.StringIO(), force_terminal=False, width=80)
    with EpochProgress(plain, "synthetic", total=4, completed=1) as progress:
        progress.advance(1, "loss 1.0 · " + "x" * 100)
    assert plain.file.getvalue().startswith("epoch 1 (2/4 done) · loss 1.0 · ") and plain.file.getvalue().count("\n") == 1


def test_host_memory_running_out_mid_step_is_one_error_line(tmp_path, capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 128000000000 bytes. Error code 12")

    monkeypatch.setattr("betty_trainer.execution.micro_batches.micro_batch_backward", out_of_memory)
    result = betty_in_process(capsys, *train_cli(tmp_path / "run", "optim.epochs=1"))
    assert_one_line_error(result, "epoch 0, batch 0: out of host memory", "raise micro_batch.num_micro_batches",
                          "no checkpoint was written yet")


def test_a_run_of_an_earlier_version_is_named_as_such(tmp_path, capsys):
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(QUICKSTART, SMALL).to_yaml())
    torch.save({"epoch": 0}, run / "checkpoint.pt")
    assert_one_line_error(betty_in_process(capsys, "train", "--resume", str(run)),
                          "holds a checkpoint.pt of an earlier betty-train", "start a new run")
    assert_one_line_error(betty_in_process(capsys, *train_cli(run)), "already holds a run", "checkpoint.pt")


def test_the_status_names_no_best_before_the_first_evaluation_and_then_the_epoch_the_final_line_names(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    config = load_config(QUICKSTART, [*QUICK[1:], "optim.epochs=3", "train.eval_every=2"])
    result = train(config, run_dir=tmp_path / "run", console=console)
    epochs = [line for line in console.file.getvalue().splitlines() if line.startswith("epoch ")]
    assert " · val - · best val - · ETA " in epochs[0] and "nan" not in epochs[0] and "-1.000" not in epochs[0]
    assert f"best val {result.best_val_acc:.3f} (epoch {result.best_epoch}, test {result.test_acc:.3f})" in epochs[-1]


def test_evaluating_a_custom_model_run_from_the_cli_points_to_the_python_api(tmp_path, capsys):
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(32, 5)

        def forward(self, blocks, x):
            return self.linear(x[: blocks[-1].num_dst])

    train(load_config(QUICKSTART, SMALL + ["optim.epochs=1"]), model=Linear(), run_dir=tmp_path / "run")
    refused = betty_in_process(capsys, "evaluate", "--run", str(tmp_path / "run"))
    assert_one_line_error(refused, "was trained with the custom model", "betty_trainer.load_model(", "model=Linear(")
