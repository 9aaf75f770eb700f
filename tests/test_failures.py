"""The last failure modes a new user hits (issue 26): a slowly diverging run, a hand-built graph, hand-edited run
files, a user's own files in a run directory, a YAML alias bomb, K above the outputs, and the plan's output."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from betty_trainer.config import DatasetConfig, load_config
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import load_dataset
from betty_trainer.errors import ConfigError, DatasetError, TrainingError
from betty_trainer.training.checkpoint import BEST_NAME, LAST_NAME, checksum_path, load_checkpoint, save_checkpoint
from betty_trainer.training.trainer import train
from tests import test_runs
from tests.conftest import REPO
from tests.test_cli import assert_one_line_error, betty_in_process
from tests.test_readme import README
from tests.test_runs import QUICKSTART, SMALL, metrics

finished, run_copy = test_runs.finished, test_runs.run_copy  # test_runs' fixtures: a finished 6-epoch run, a copy


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


def own_graph_example() -> str:
    """The README's own-graph example: the ``py`` block after its marker."""
    (block,) = re.findall(r"<!-- own-graph example -->\n```py\n(.*?)```", README, flags=re.S)
    return block


def test_the_readmes_own_graph_example_runs_as_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    exec(compile(own_graph_example(), "README.md", "exec"), {"__name__": "readme"})
    assert "4 nodes, 8 edges, 4 features, 2 classes" in capsys.readouterr().out
    assert len(list((tmp_path / "runs").glob("*/last.pt"))) == 1


def small_graph(**fields) -> Graph:
    given = {"x": torch.zeros(6, 3), "y": torch.tensor([0, 1, 2, 0, 1, -1]), "train_idx": torch.tensor([0, 1]),
             "val_idx": torch.tensor([2, 3]), "test_idx": torch.tensor([4])}
    return Graph.from_edges(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 2, 3, 4, 5]), 6, **(given | fields))


@pytest.mark.parametrize("fields, message", [
    ({"num_classes": 2}, "node 2 has label 2, outside [0, num_classes=2)"),
    ({"y": torch.tensor([0, 1, 2, 0, 1, -2])}, "node 5 has label -2, outside"),
    ({"y": torch.tensor([0.0, 1, 2, 0, 1, 1])}, "y has dtype torch.float32, expected integer class labels"),
    ({"x": torch.zeros(6, 3).index_put_((torch.tensor([4]), torch.tensor([2])), torch.tensor(float("nan")))},
     "feature x[4, 2] is nan"),
    ({"x": torch.zeros(5, 3)}, "x has shape (5, 3), expected (6, F)"),
    ({"y": torch.tensor([0, 1, 2])}, "y has shape (3,), expected (6,)"),
    ({"test_idx": torch.tensor([6])}, "test_idx holds node ids outside [0, 6)"),
    ({"test_idx": torch.tensor([5])}, "test_idx holds node 5, which has no label (-1)"),
    ({"test_idx": torch.tensor([1])}, "node 1 is in both train_idx and test_idx"),
    ({"val_idx": torch.tensor([2, 3, 2])}, "node 2 is twice in val_idx"),
    ({"train_idx": torch.tensor([[0, 1]])}, "train_idx must be a 1-D integer tensor"),
])
def test_a_graph_built_from_python_is_checked_in_one_line(fields, message):
    with pytest.raises(DatasetError, match=re.escape(message)) as raised:
        small_graph(**fields)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("indptr, message", [
    ([0, 3, 1, 4], "indptr decreases at node 1 (in-degree -2)"),
    ([1, 2, 3, 4], "indptr must start at 0"),
])
def test_a_csc_pointer_that_does_not_start_at_0_or_decreases_is_refused(indptr, message):
    """A decreasing pointer gives negative in-degrees, which the compiled kernels read past their arrays with (a
    native heap corruption in training, found by the failure audit)."""
    with pytest.raises(DatasetError, match=re.escape(message)) as raised:
        Graph(torch.tensor(indptr), torch.tensor([0, 1, 2, 0]), torch.zeros(3, 2), torch.tensor([0, 1, 0]),
              torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    assert "\n" not in str(raised.value)


def test_a_graph_takes_numpy_arrays_and_infers_num_classes():
    graph = small_graph(x=np.zeros((6, 3), dtype=np.float32), y=np.array([0, 1, 2, 0, 1, -1]),
                        train_idx=np.array([0, 1]))
    assert graph.num_classes == 3 and isinstance(graph.x, torch.Tensor) and isinstance(graph.train_idx, torch.Tensor)
    assert torch.equal(graph.y, torch.tensor([0, 1, 2, 0, 1, -1]))


@pytest.mark.parametrize("edit, fragments", [
    (lambda line: line.replace('"epoch": 1,', '"epoch": "1",'), ["line 2: field 'epoch' is \"1\", expected an integer"]),
    (lambda line: "[1, 2]", ["line 2 is not a metrics record"]),
    (lambda line: line[:20], ["line 2 is not JSON"]),
])
def test_resume_names_a_hand_edited_metrics_line(run_copy, capsys, edit, fragments):
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    lines[1] = edit(lines[1])
    (run_copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    refused = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=8")
    assert_one_line_error(refused, "metrics.jsonl", *fragments, "to resume")


def test_resume_verifies_best_pt_and_can_go_on_without_it(run_copy, capsys, caplog):
    best = run_copy / BEST_NAME
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 1
    best.write_bytes(bytes(data))
    refused = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=8")
    assert_one_line_error(refused, "cannot resume: checkpoint", "best.pt does not match its sha256",
                          "delete best.pt and best.sha256 to resume")
    best.unlink()
    checksum_path(best).unlink()
    with caplog.at_level(logging.WARNING, logger="betty_trainer"):
        resumed = betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=8")
    assert resumed.returncode == 0, resumed.stderr
    assert any("has no best.pt (epoch 3 was best)" in r.getMessage() for r in caplog.records)
    assert load_checkpoint(run_copy, BEST_NAME)["epoch"] >= 6  # chosen again from the epochs that ran


@pytest.mark.parametrize("part, source, fragment", [
    ("x", "ind.citeseer.x", "feature columns disagree (ind.cora.x: 3703, ind.cora.tx: 1433, ind.cora.allx: 1433)"),
    ("ty", "ind.citeseer.ty", "classes disagree (ind.cora.y: 7, ind.cora.ty: 6, ind.cora.ally: 7)"),
    ("x", "ind.cora.tx", "ind.cora.x has 1000 rows, ind.cora.y 140"),
])
def test_planetoid_files_that_disagree_are_refused_without_checksums(planetoid_dir, tmp_path, part, source, fragment):
    for path in planetoid_dir.glob("ind.cora.*"):
        (tmp_path / path.name).symlink_to(path)
    (tmp_path / f"ind.cora.{part}").unlink()
    (tmp_path / f"ind.cora.{part}").symlink_to(planetoid_dir / source)
    with pytest.raises(DatasetError, match=re.escape(fragment)):
        load_dataset(DatasetConfig(name="cora", data_dir=tmp_path, verify_checksums=False))


def test_a_folder_holding_the_users_own_files_is_not_a_run_and_is_never_overwritten(tmp_path, run_copy, capsys):
    own = tmp_path / "mine"
    own.mkdir()
    (own / "config.yaml").write_text("# my notes\nname: mine\n")
    before = sorted(own.iterdir())
    for extra in ([], ["--overwrite"]):
        refused = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, f"train.run_dir={own}", *extra)
        assert_one_line_error(refused, f"{own} holds files betty-train did not write (config.yaml)", "--overwrite too")
    assert sorted(own.iterdir()) == before and (own / "config.yaml").read_text() == "# my notes\nname: mine\n"
    refused = betty_in_process(capsys, "validate", "--config", QUICKSTART, f"train.run_dir={own}")
    assert_one_line_error(refused, "holds files betty-train did not write (config.yaml)")

    (run_copy / "notes.txt").write_text("kept")  # a user's file beside a run: --overwrite refuses rather than mix
    refused = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, f"train.run_dir={run_copy}",
                               "--overwrite")
    assert_one_line_error(refused, "(notes.txt)")
    (run_copy / "notes.txt").unlink()
    replaced = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, "optim.epochs=1",
                                f"train.run_dir={run_copy}", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    trained = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, "optim.epochs=1", f"train.run_dir={empty}")
    assert trained.returncode == 0, trained.stderr


def test_a_yaml_alias_bomb_is_refused_in_one_line_at_once(tmp_path, capsys):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10⁹ values once expanded
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\nname: *a8\n")
    assert bomb.stat().st_size < 600
    started = time.perf_counter()
    refused = betty_in_process(capsys, "validate", "--config", str(bomb))
    assert time.perf_counter() - started < 5
    assert_one_line_error(refused, "bomb.yaml", "expands to over 10,000 values through YAML aliases")
    with pytest.raises(ConfigError, match="expands to over 10,000 values"):
        load_config(bomb)
    aliased = tmp_path / "aliased.yaml"  # aliases a config really uses stay allowed
    aliased.write_text("name: &n quick\nmodel: {arch: sage, hidden: 16}\noptim: &o {lr: 0.1}\n")
    assert load_config(aliased).name == "quick" and load_config(aliased).optim.lr == 0.1


@pytest.mark.parametrize("mode, partitioner, said", [
    ("micro_batches", "range", "asks for 5000 micro-batches; the batch has 100 output nodes, at most one per piece; "
                               "range made 100, so 100 run"),
    ("micro_batches", "reg", "asks for 5000 micro-batches; the batch has 100 output nodes, at most one per piece; "
                             "reg made {k} (it left parts empty; micro_batch.partitioner=range or random give exactly "
                             "min(K, 100)), so {k} run"),
    ("layerwise", "reg", "asks for 5000 chunks per layer; the batch has 512 dst nodes in its largest layer, at most "
                         "one per piece; {made} made {k} (it left parts empty; micro_batch.partitioner=range or random "
                         "give exactly min(K, 512)), so {k} run"),
])
def test_k_above_the_outputs_says_what_was_asked_and_what_runs(tmp_path, caplog, mode, partitioner, said):
    config = load_config(QUICKSTART, SMALL + ["optim.epochs=1", "micro_batch.num_micro_batches=5000",
                                              f"micro_batch.mode={mode}", f"micro_batch.partitioner={partitioner}"])
    with caplog.at_level(logging.WARNING, logger="betty_trainer"):
        train(config, run_dir=tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if "num_micro_batches asks for" in r.getMessage()]
    pieces = metrics(tmp_path)[0]["micro_batches"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert partitioner in plan.get("partitioner_per_layer", [plan["partitioner"]])
    # what split each layer: a layer-wise plan's layers run off the whole block are split by range (on the CPU)
    assert warning == "micro_batch.num_micro_batches " + said.format(k=pieces, made=plan["partitioner"])


def test_plan_hides_components_the_model_lacks_and_writes_plan_json_only_with_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    plan = ["plan", "--config", QUICKSTART, *SMALL]

    def header(*extra: str) -> list[str]:
        result = betty_in_process(capsys, *plan, *extra)
        assert result.returncode == 0, result.stderr
        line = next(line for line in result.stdout.splitlines() if "est. peak" in line)
        return [cell.strip() for cell in line.split("┃")[1:-1]]

    shown = header()
    assert list(tmp_path.iterdir()) == []  # no plan.json left in the working directory
    assert "dropout" not in shown  # NodeDropout's masks hold no bytes at the peak: an all-zero column
    assert header("--output", "mine.json") == shown and [p.name for p in tmp_path.iterdir()] == ["mine.json"]
    rows = [row["estimate"]["at_peak"] for row in json.loads((tmp_path / "mine.json").read_text())["pieces"]]
    for name, column in {"input_features": "features", "hidden_outputs": "hidden", "dropout_masks": "dropout",
                         "aggregator_intermediates": "aggr.", "gradients": "grads"}.items():
        assert (column in shown) == any(at_peak[name] for at_peak in rows), column
    assert "written to mine.json" in betty_in_process(capsys, *plan, "--output", "mine.json").stdout


def board_points(run: Path) -> Counter:
    """How many times each ``(tag, step)`` scalar was written to the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points = Counter()
    for file in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(file)).Load():
            points.update((value.tag, event.step) for value in event.summary.value)
    return points


NO_HOST_MEMORY = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 400000000000 bytes. Error code 12 (Cannot allocate memory)")


def test_evaluation_out_of_host_memory_is_one_line_in_train_evaluate_and_predict(tmp_path, run_copy, capsys,
                                                                                  monkeypatch):
    import betty_trainer.training.evaluation as evaluation

    sample_block, calls = evaluation.sample_block, []

    def failing_after_one_evaluation(graph, chunk, fanout):  # layerwise_logits' first allocation of each layer
        calls.append(chunk)
        if len(calls) > 2:  # quickstart's 2 layers: epoch 0's evaluation passes, epoch 1's fails
            raise RuntimeError(NO_HOST_MEMORY)
        return sample_block(graph, chunk, fanout)

    monkeypatch.setattr(evaluation, "sample_block", failing_after_one_evaluation)
    run = tmp_path / "new"
    trained = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, "optim.epochs=2", "model.num_layers=2",
                               f"train.run_dir={run}", "train.tensorboard=true")
    assert_one_line_error(trained, "epoch 1, evaluation: out of host memory (", "can't allocate memory",
                          "num_nodes × model.hidden", f"epoch 1's training is saved in {run / 'last.pt'}, not evaluated; "
                          f"continue with betty-train train --resume {run}, which evaluates it first")
    state = load_checkpoint(run)
    assert state["epoch"] == 1 and state["unevaluated"]["val_acc"] is None and "optim.lr" not in trained.stderr
    assert [(m["epoch"], m["val_acc"] is None) for m in metrics(run)] == [(0, False), (1, True)]
    trained_1 = state["model"]
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml", "last.pt")}
    refused = betty_in_process(capsys, "train", "--resume", str(run), "optim.epochs=1")  # epoch 1 is past the end
    assert_one_line_error(refused, "already finished 1 epochs")
    assert {name: (run / name).read_bytes() for name in before} == before and not (run / "resumes.yaml").exists()
    mismatched = tmp_path / "mismatched"  # a checkpoint whose unevaluated metrics are another epoch's
    shutil.copytree(run, mismatched)
    save_checkpoint(mismatched, {**state, "unevaluated": {**state["unevaluated"], "epoch": 0}}, LAST_NAME)
    refused = betty_in_process(capsys, "train", "--resume", str(mismatched))
    assert_one_line_error(refused, f"cannot resume {mismatched}", "holds epoch 1's training but unevaluated metrics "
                          "of epoch 0; start a new run")
    failed_again = betty_in_process(capsys, "train", "--resume", str(run))  # epoch 1's evaluation fails once more
    assert_one_line_error(failed_again, "epoch 1, evaluation: out of host memory (")
    assert load_checkpoint(run)["unevaluated"]["epoch"] == 1
    calls.clear()  # evaluation works again: the resume evaluates epoch 1, the run's last, and trains nothing
    resumed = betty_in_process(capsys, "train", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    lines = metrics(run)
    assert [(m["epoch"], m["val_acc"] is None) for m in lines] == [(0, False), (1, False)]
    assert lines[1]["loss"] == state["unevaluated"]["loss"]  # the saved epoch's training, now with its accuracies
    after = load_checkpoint(run)
    assert after["epoch"] == 1 and "unevaluated" not in after
    assert all(torch.equal(after["model"][name], tensor) for name, tensor in trained_1.items())
    assert "final test accuracy" in resumed.stdout
    points = board_points(run)  # epoch 1's training logged when it was saved, its accuracies by the resume: once each
    assert {tag for tag, step in points if step == 1} == {tag for tag, step in points if step == 0} >= {"loss", "val_acc"}
    assert set(points.values()) == {1}, points
    calls.append(None)  # from now on every evaluation fails
    evaluated = betty_in_process(capsys, "evaluate", "--run", str(run_copy))
    assert_one_line_error(evaluated, f"evaluating {run_copy / 'best.pt'}: out of host memory (",
                          "free host memory")
    predicted = betty_in_process(capsys, "predict", "--run", str(run_copy), "--output", str(tmp_path / "p.csv"))
    assert_one_line_error(predicted, f"predicting with {run_copy / 'best.pt'}: out of host memory (")
    assert not (tmp_path / "p.csv").exists()


def test_evaluation_out_of_device_memory_in_training_halves_its_chunk_once_for_the_run(tmp_path, capsys, monkeypatch,
                                                                                       caplog):
    """Chunks of more than 300 dst nodes run out of device memory (injected where a chunk's layer runs, on the
    600-node graph): the first evaluation halves 8192 down to 256 (five warnings), every later one starts there,
    and the run's accuracies are those of a run without the error."""
    from tests.test_evaluation import out_of_memory_above

    common = ["train", "--config", QUICKSTART, *SMALL, "optim.epochs=3", "model.num_layers=2"]
    plain = betty_in_process(capsys, *common, f"train.run_dir={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr
    chunks = out_of_memory_above(300, monkeypatch)
    with caplog.at_level("WARNING", logger="betty_trainer"):
        retried = betty_in_process(capsys, *common, f"train.run_dir={tmp_path / 'retried'}")
    assert retried.returncode == 0, retried.stderr
    said = [r.getMessage() for r in caplog.records if "evaluation ran out of memory" in r.getMessage()]
    assert [line[line.index("with"):] for line in said] == [f"with {n} nodes per chunk"
                                                            for n in (4096, 2048, 1024, 512, 256)]
    assert chunks[:5] == [600] * 4 + [512] and max(chunks[5:]) == 256  # then every layer in chunks of ≤ 256
    accuracies = [[(m["val_acc"], m["test_acc"]) for m in metrics(tmp_path / name)] for name in ("plain", "retried")]
    assert accuracies[0] == accuracies[1] and None not in accuracies[0][0]


def test_a_rehashed_checkpoint_whose_shapes_do_not_fit_names_the_parameter_in_one_line(run_copy, tmp_path, capsys):
    from tests.test_runs import rewrite_checkpoint

    for name in (BEST_NAME, "last.pt"):
        state = torch.load(run_copy / name, weights_only=True)
        key = next(iter(state["model"]))
        shape = list(state["model"][key].shape)
        state["model"][key] = torch.zeros(shape[0] + 1, *shape[1:])
        rewrite_checkpoint(run_copy / name, state)
    wrong = f"parameter {key!r} has shape {[shape[0] + 1, *shape[1:]]} in the checkpoint but {shape} in the model"
    assert_one_line_error(betty_in_process(capsys, "evaluate", "--run", str(run_copy)),
                          f"cannot load {run_copy / BEST_NAME}: {wrong}")
    assert_one_line_error(betty_in_process(capsys, "predict", "--run", str(run_copy), "--output",
                                           str(tmp_path / "p.csv")), wrong)
    assert_one_line_error(betty_in_process(capsys, "train", "--resume", str(run_copy), "optim.epochs=8"),
                          f"cannot resume {run_copy}: last.pt does not fit this model ({wrong}); start a new run")


def test_an_epoch_whose_evaluation_failed_is_saved_after_the_evaluation_s_tensors_are_freed(tmp_path, capsys,
                                                                                            monkeypatch):
    """The save of an epoch whose evaluation ran out of host memory must not hold the evaluation's tensors (its
    frames, kept by the exception): a tensor the failing evaluation allocated is gone when the epoch is saved."""
    import weakref

    import betty_trainer.training.evaluation as evaluation
    from betty_trainer.training import trainer as trainer_module

    held, alive_at_save = [], []

    def failing(graph, chunk, fanout):
        scratch = torch.ones(1000)  # a local of the failing frame
        held.append(weakref.ref(scratch))
        raise RuntimeError(NO_HOST_MEMORY)

    end_epoch = trainer_module._end_epoch

    def saving(*args, **kwargs):
        if not kwargs.get("evaluated", True):
            alive_at_save.append(held[-1]() is not None)
        return end_epoch(*args, **kwargs)

    monkeypatch.setattr(evaluation, "sample_block", failing)
    monkeypatch.setattr(trainer_module, "_end_epoch", saving)
    trained = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, "optim.epochs=1",
                               f"train.run_dir={tmp_path / 'run'}")
    assert_one_line_error(trained, "epoch 0, evaluation: out of host memory (", "epoch 0's training is saved")
    assert alive_at_save == [False]
