"""The ``betty-train`` command: configs, overrides, bad input as one-line errors, resume."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from betty_trainer.cli import main
from betty_trainer.config import load_config
from betty_trainer.errors import ConfigError, TrainingError
from betty_trainer.training.checkpoint import load_checkpoint
from betty_trainer.training.trainer import train
from tests.conftest import REPO
from tests.test_datasets import Evil

QUICK = ["optim.epochs=2", "train.progress=false", "dataset.synthetic.num_nodes=600",
         "dataset.synthetic.num_val=100", "dataset.synthetic.num_test=100"]


def betty(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "betty_trainer.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def betty_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """Run ``main()`` in this process (fast); same exit status and streams as the console script."""
    status = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_quickstart_trains_and_writes_a_run_directory(tmp_path):
    result = betty("train", "--config", str(REPO / "configs/quickstart.yaml"), *QUICK,
                   f"train.run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "final test accuracy" in result.stdout
    run = tmp_path / "run"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optim"]["epochs"] == 2 and saved["name"] == "quickstart"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    plan = json.loads((run / "plan.json").read_text())
    assert plan["num_pieces"] == 4 and len(plan["pieces"]) == 4
    assert sum(row["outputs"] for row in plan["pieces"]) == plan["full_batch"]["outputs"]
    assert load_checkpoint(run)["epoch"] == 1


def test_validate_and_print_config(tmp_path):
    ok = betty("validate", "--config", str(REPO / "configs/cora-sage.yaml"), cwd=tmp_path)
    assert ok.returncode == 0 and "well-formed" in ok.stdout
    printed = betty("validate", "--config", str(REPO / "configs/cora-sage.yaml"), "--print-config",
                    "sampling.fanouts=10,25", "train.progress=no", "--data-dir", "some/dir", cwd=tmp_path)
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["sampling"]["fanouts"] == [10, 25]
    assert resolved["train"]["progress"] is False
    assert resolved["dataset"]["data_dir"] == "some/dir"


def test_overrides_parse_as_users_expect():
    config = load_config(None, ["sampling.fanouts=[5, -1]", "train.progress=false", "optim.lr=1e-3",
                                "train.run_dir=runs/x", "sampling.batch_size=null"])
    assert config.sampling.fanouts == [5, -1] and config.train.progress is False
    assert config.optim.lr == 0.001 and config.train.run_dir == Path("runs/x") and config.sampling.batch_size is None


@pytest.mark.parametrize(
    "content, overrides, fragments",
    [
        ("model:\n  hiden: 64\n", [], ["unknown config key 'model.hiden'", "hidden"]),
        ("model:\n  aggregator: max\n", [], ["'model.aggregator'", "'mean', 'gcn', 'pool' or 'lstm'"]),
        ("optim:\n  lr: -1\n", [], ["'optim.lr'", "greater than 0"]),
        ("model: [1, 2\n", [], ["not valid YAML", "line"]),
        ("", ["micro_batch.num_micro_batches=zero"], ["'micro_batch.num_micro_batches'", "integer"]),
        ("", ["sampling.fanouts=10,25,5"], ["sampling.fanouts has 3 entries", "num_layers is 2"]),
        ("", ["seed"], ["must look like key.path=value"]),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path, capsys, content, overrides, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    for command in ("train", "validate"):
        assert_one_line_error(betty_in_process(capsys, command, "--config", str(path), *overrides), *fragments)


def test_bad_config_through_the_console_script(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden: 64\n")
    assert_one_line_error(betty("train", "--config", str(path), cwd=tmp_path), "unknown config key 'model.hiden'")


def test_missing_config_file(tmp_path):
    assert_one_line_error(betty("train", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path), "cannot read config")


@pytest.mark.parametrize("damage, verify, fragments", [
    ("truncate", True, ["ind.cora.allx fails its sha256 check"]),
    ("tamper", True, ["ind.cora.y fails its sha256 check"]),
    ("truncate", False, ["ind.cora.allx is truncated or corrupt"]),
    ("evil", False, ["refusing to load shutil.rmtree"]),
])
def test_bad_dataset_file_is_a_one_line_error(planetoid_dir, tmp_path, damage, verify, fragments):
    data = tmp_path / "data"
    data.mkdir()
    for path in planetoid_dir.glob("ind.cora.*"):
        shutil.copy(path, data / path.name)
    if damage == "truncate":
        (data / "ind.cora.allx").write_bytes((data / "ind.cora.allx").read_bytes()[:5000])
    elif damage == "tamper":
        raw = bytearray((data / "ind.cora.y").read_bytes())
        raw[-40] ^= 1
        (data / "ind.cora.y").write_bytes(bytes(raw))
    else:
        (data / "ind.cora.graph").write_bytes(pickle.dumps(Evil(), protocol=2))
    result = betty("train", "--config", str(REPO / "configs/cora-sage.yaml"), "--data-dir", str(data),
                   f"dataset.verify_checksums={str(verify).lower()}", *QUICK[:2], cwd=tmp_path)
    assert_one_line_error(result, *fragments)


def test_resume_continues_exactly(tmp_path):
    overrides = QUICK[1:] + ["micro_batch.num_micro_batches=3", "sampling.fanouts=5,5", "sampling.batch_size=40"]
    straight = load_config(None, overrides + ["optim.epochs=4"])
    train(straight, run_dir=tmp_path / "straight")
    train(load_config(None, overrides + ["optim.epochs=2"]), run_dir=tmp_path / "resumed")
    result = betty("train", "--resume", str(tmp_path / "resumed"), "optim.epochs=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    one, two = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert two["epoch"] == 3
    for name, tensor in one["model"].items():
        assert torch.equal(tensor, two["model"][name]), name
    assert len((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()) == 4
    finished = betty("train", "--resume", str(tmp_path / "resumed"), cwd=tmp_path)
    assert_one_line_error(finished, "already finished 4 epochs")


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_checkpoint(tmp_path):
    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(32, 5))
            self.calls = 0

        def forward(self, blocks, x):
            self.calls += 1
            out = x[: blocks[-1].num_dst] @ self.weight
            return out * float("nan") if self.calls > 12 else out

    config = load_config(None, QUICK[1:] + ["optim.epochs=5", "model.num_layers=2"])
    with pytest.raises(TrainingError, match="loss is nan"):
        train(config, model=Exploding(), run_dir=tmp_path)
    assert load_checkpoint(tmp_path)["epoch"] >= 0


@pytest.mark.parametrize("failure", ["nan", "collective"])
def test_only_a_non_finite_loss_is_told_to_lower_the_learning_rate(tmp_path, failure):
    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(32, 5))

        def forward(self, blocks, x):
            out = x[: blocks[-1].num_dst] @ self.weight
            if failure == "collective":  # what distributed.exchange raises when another rank died
                raise TrainingError("rank 0: the all-gather of layer 0's rows failed; another rank died")
            return out * float("nan")

    config = load_config(None, QUICK[1:] + ["optim.epochs=1", "model.num_layers=2"])
    with pytest.raises(TrainingError) as error:
        train(config, model=Failing(), run_dir=tmp_path)
    assert ("lower optim.lr" in str(error.value)) == (failure == "nan"), str(error.value)
    assert ("loss is nan" in str(error.value)) == (failure == "nan")


def test_a_checkpoint_written_after_divergence_is_not_offered_as_good(tmp_path, capsys):
    diverging = ["--config", str(REPO / "configs/quickstart.yaml"), *QUICK, "optim.epochs=3", "optim.lr=1e30",
                 f"train.run_dir={tmp_path}"]  # epoch 0's one step makes the weights ~1e30: epoch 1's first loss is nan
    said = betty_in_process(capsys, "train", *diverging)
    assert_one_line_error(said, "epoch 1, batch 0: loss is nan", f"{tmp_path / 'last.pt'} (epoch 0) is not a good "
                          "checkpoint", "start a new run with a lower optim.lr in another train.run_dir",
                          "--overwrite would remove this run's best.pt")
    assert "--resume" not in said.stderr and load_checkpoint(tmp_path)["epoch"] == 0
    resumed = betty_in_process(capsys, "train", "--resume", str(tmp_path), "optim.lr=0.01")  # as the message said
    assert_one_line_error(resumed, "epoch 1, batch 0: loss is nan", "is not a good checkpoint")


def test_resume_needs_a_run_directory(tmp_path):
    assert_one_line_error(betty("train", "--resume", str(tmp_path), cwd=tmp_path), "not a run directory")
    with pytest.raises(ConfigError):
        load_config(None, ["train.device=tpu"]) and train(load_config(None, ["train.device=tpu"]))


@pytest.mark.parametrize("command", ["train", "validate", "plan"])
def test_overrides_on_both_sides_of_an_option_are_all_applied(capsys, command):
    result = betty_in_process(capsys, command, "--config", str(REPO / "configs/quickstart.yaml"), "optim.epochs=3",
                              "--print-config", "train.run_dir=runs/c", "--data-dir", "some/dir", "model.hidden=7",
                              *(["--overwrite"] if command == "train" else []), "optim.epochs=5")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["optim"]["epochs"] == 5  # the last override of a key wins, wherever it stands
    assert resolved["train"]["run_dir"] == "runs/c" and resolved["model"]["hidden"] == 7
    assert resolved["dataset"]["data_dir"] == "some/dir"


def test_every_subcommand_parses_as_documented(tmp_path):
    from betty_trainer.cli import _parser

    parser = _parser()
    train_args = parser.parse_args(["train", "--resume", "r", "optim.epochs=4", "--log-level", "info", "seed=1"])
    assert (train_args.resume, train_args.overrides, train_args.log_level) == (Path("r"), ["optim.epochs=4", "seed=1"],
                                                                               "info")
    evaluate = parser.parse_args(["evaluate", "--run", "r", "--checkpoint", "last", "--split", "all"])
    assert (evaluate.run, evaluate.checkpoint, evaluate.split) == (Path("r"), "last", "all")
    predict = parser.parse_args(["predict", "--output", "p.csv", "--run", "r"])
    assert (predict.run, predict.output, predict.checkpoint) == (Path("r"), Path("p.csv"), "best")
    plan = parser.parse_args(["plan", "a=1", "--config", "c.yaml", "--measure", "b=2", "--output", "x.json"])
    assert (plan.config, plan.overrides, plan.measure, plan.output) == (Path("c.yaml"), ["a=1", "b=2"], True,
                                                                        Path("x.json"))
    assert parser.parse_args(["datasets"]).command == "datasets"
    for bad in (["evaluate", "--run", "r", "seed=1"], ["train", "--bogus", "seed=1"], ["plan", "seed=1"]):
        with pytest.raises(SystemExit) as error:
            parser.parse_args(bad)
        assert error.value.code == 2


def test_datasets_lists_the_files_of_the_data_dir_it_is_given(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one table line per dataset
    monkeypatch.setenv("BETTY_DATA_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for part in ("x", "y", "graph"):
        (data / f"ind.cora.{part}").write_bytes(b"")
    result = betty_in_process(capsys, "datasets", "--data-dir", str(data), "--log-level", "info")
    assert result.returncode == 0, result.stderr
    cora = next(line for line in result.stdout.splitlines() if "│ cora " in line)
    assert f"{data} (3/8 files)" in cora
    from_env = betty_in_process(capsys, "datasets")
    cora = next(line for line in from_env.stdout.splitlines() if "│ cora " in line)
    assert f"{tmp_path / 'elsewhere'} (0/8 files)" in cora


def _interrupting(run_dir):
    def interrupted(*args, **kwargs):
        error = KeyboardInterrupt()
        if run_dir is not None:
            error.run_dir = run_dir
        raise error
    return interrupted


def test_ctrl_c_names_the_run_directory_to_resume(tmp_path, capsys, monkeypatch):
    import betty_trainer.training.trainer as trainer

    run = tmp_path / "my run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"")
    monkeypatch.setattr(trainer, "train", _interrupting(run))
    result = betty_in_process(capsys, "train", "--config", str(REPO / "configs/quickstart.yaml"))
    assert result.returncode == 130
    assert result.stderr.strip() == f"interrupted; continue with: betty-train train --resume '{run}'"


@pytest.mark.parametrize("rank, environment, said", [
    ("0", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "torchrun --nproc-per-node 2 -m betty_trainer train --resume"),
    ("0", {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "torchrun --nnodes 2 --nproc-per-node 4 "),
    ("1", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, None),
])
def test_ctrl_c_of_a_torchrun_job_says_once_how_to_resume_it(tmp_path, capsys, monkeypatch, rank, environment, said):
    import betty_trainer.training.trainer as trainer

    (tmp_path / "last.pt").write_bytes(b"")
    monkeypatch.setattr(trainer, "train", _interrupting(tmp_path))
    for name, value in {"RANK": rank, **environment}.items():
        monkeypatch.setenv(name, value)
    result = betty_in_process(capsys, "train", "--config", str(REPO / "configs/quickstart.yaml"))
    assert result.returncode == 130
    if said is None:  # only rank 0 speaks
        assert result.stderr == ""
    else:
        assert result.stderr.count("\n") == 1 and said in result.stderr and f"--resume {tmp_path}" in result.stderr


@pytest.mark.parametrize("has_dir", [True, False])
def test_ctrl_c_without_a_checkpoint_offers_no_resume(tmp_path, capsys, monkeypatch, has_dir):
    import betty_trainer.training.trainer as trainer

    monkeypatch.setattr(trainer, "train", _interrupting(tmp_path if has_dir else None))
    result = betty_in_process(capsys, "train", "--config", str(REPO / "configs/quickstart.yaml"))
    assert result.returncode == 130
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted") and "RUN_DIR" not in lines[0], lines
    assert "--resume" not in lines[0] and "nothing to resume" in lines[0]
    assert (str(tmp_path) in lines[0]) == has_dir


def test_ctrl_c_in_another_command_says_interrupted(tmp_path, capsys, monkeypatch):
    import betty_trainer.training.inference as inference

    monkeypatch.setattr(inference, "evaluate_run", _interrupting(None))
    result = betty_in_process(capsys, "evaluate", "--run", str(tmp_path))
    assert (result.returncode, result.stderr) == (130, "interrupted\n")


@pytest.mark.parametrize("name", ["best.pt", "last.pt", "last.sha256", "config.yaml", "metrics.jsonl", "plan.json",
                                  "run.lock"])
@pytest.mark.parametrize("command", ["predict", "plan"])
def test_output_never_replaces_a_file_of_a_run_directory(tmp_path, capsys, command, name):
    run = tmp_path / "run"
    run.mkdir()
    for managed in ("environment.json", "config.yaml", "last.pt", "last.sha256", "best.pt", "metrics.jsonl",
                    "plan.json", "run.lock"):
        (run / managed).write_bytes(managed.encode())
    (tmp_path / "link.pt").symlink_to(run / name)
    for output in (run / name, tmp_path / "link.pt"):
        args = (["predict", "--run", str(run), "--output", str(output)] if command == "predict" else
                ["plan", "--config", str(REPO / "configs/quickstart.yaml"), "--output", str(output)])
        assert_one_line_error(betty_in_process(capsys, *args), f"--output {output} is a file of the run directory",
                              "choose another file")
        assert (run / name).read_bytes() == name.encode()


def test_plan_output_may_replace_its_own_earlier_plan_beside_a_users_config(tmp_path, capsys, monkeypatch):
    """A folder with the user's own ``config.yaml`` and an earlier ``plan.json`` is not a run directory (no
    ``environment.json``, checkpoint or lock): ``plan --output plan.json`` writes there, again."""
    shutil.copy(REPO / "configs/quickstart.yaml", tmp_path / "config.yaml")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        result = betty_in_process(capsys, "plan", "--config", "config.yaml", "--output", "plan.json")
        assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["mode"]


def test_evaluate_and_predict_find_a_moved_dataset_with_data_dir(planetoid_dir, tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    for part in planetoid_dir.glob("ind.cora.*"):
        shutil.copy(part, data)
    trained = betty_in_process(capsys, "train", "--config", str(REPO / "configs/cora-sage.yaml"), "--data-dir",
                               str(data), "optim.epochs=1", "train.progress=false", f"train.run_dir={run}")
    assert trained.returncode == 0, trained.stderr
    moved = data.rename(tmp_path / "moved")
    refused = betty_in_process(capsys, "evaluate", "--run", str(run))
    assert_one_line_error(refused, str(data), "--data-dir")
    evaluated = betty_in_process(capsys, "evaluate", "--run", str(run), "--data-dir", str(moved))
    assert evaluated.returncode == 0, evaluated.stderr
    reported = trained.stdout.split("final test accuracy ")[1].split()[0]
    assert evaluated.stdout.startswith(f"test accuracy {reported} (best.pt")
    predicted = betty_in_process(capsys, "predict", "--run", str(run), "--data-dir", str(moved), "--output",
                                 str(tmp_path / "p.pt"))
    assert predicted.returncode == 0, predicted.stderr
    assert torch.load(tmp_path / "p.pt", weights_only=True)["prediction"].numel() == 2708


@pytest.mark.parametrize("overrides, message", [
    (["model.hidden=99999999999999999999999"], "asks for tensors too large to build"),
    ([f"model.hidden={2**62}"], "asks for tensors too large to build"),
    (["model.arch=gat", f"model.heads={2**31 - 1}", f"model.hidden={2**31 - 1}"], "asks for tensors too large to build"),
    (["model.num_layers=99999999999999999999"], "less than or equal to 10000"),
    (["model.num_layers=100000000"], "less than or equal to 10000"),  # built for hours before the bound
])
def test_a_model_too_large_to_index_is_one_line(tmp_path, capsys, overrides, message):
    result = betty_in_process(capsys, "train", "--config", str(REPO / "configs/quickstart.yaml"), *QUICK, *overrides,
                              f"train.run_dir={tmp_path / 'run'}")
    assert_one_line_error(result, message, "model.")
    assert not (tmp_path / "run").exists()
