"""Your own split (issue 26, case 9): ``dataset.split`` names an ``.npz`` or an OGB-style split folder, bad files are
refused in one line naming the file, and a run trained on it evaluates, predicts and resumes, or says which file it
needs; a :class:`Graph` takes numpy arrays (or lists) wherever it takes tensors."""

from __future__ import annotations

import gzip
import re

import numpy as np
import pytest
import torch

from betty_trainer.config import DatasetConfig, load_config
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import apply_split, load_dataset, split_sha256
from betty_trainer.errors import DatasetError
from betty_trainer.training.inference import load_run
from tests.conftest import REPO
from tests.test_cli import assert_one_line_error, betty_in_process
from tests.test_runs import QUICKSTART, SMALL

CORA_SPLIT = {"train_idx": np.arange(0, 300), "val_idx": np.arange(300, 500), "test_idx": np.arange(500, 1500)}


def test_a_run_on_its_own_cora_split_evaluates_predicts_and_resumes_and_names_a_changed_or_missing_file(
        planetoid_dir, tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    np.savez(work / "split.npz", **CORA_SPLIT)
    monkeypatch.chdir(work)  # a relative dataset.split, then evaluate/predict/resume from another directory
    run = tmp_path / "run"
    trained = betty_in_process(capsys, "train", "--config", str(REPO / "configs/cora-sage.yaml"), "--data-dir",
                               str(planetoid_dir), "dataset.split=split.npz", "optim.epochs=2", "train.progress=false",
                               "micro_batch.num_micro_batches=2", f"train.run_dir={run}")
    assert trained.returncode == 0, trained.stderr
    monkeypatch.chdir(elsewhere)
    graph = load_run(run).graph
    assert [graph.train_idx.numel(), graph.val_idx.numel(), graph.test_idx.numel()] == [300, 200, 1000]
    reported = trained.stdout.split("final test accuracy ")[1].split()[0]
    evaluated = betty_in_process(capsys, "evaluate", "--run", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith(f"test accuracy {reported} (best.pt, epoch ")
    predicted = betty_in_process(capsys, "predict", "--run", str(run), "--output", str(tmp_path / "p.csv"))
    assert predicted.returncode == 0, predicted.stderr
    resumed = betty_in_process(capsys, "train", "--resume", str(run), "optim.epochs=3")
    assert resumed.returncode == 0, resumed.stderr

    np.savez(work / "split.npz", **(CORA_SPLIT | {"train_idx": np.arange(0, 290)}))  # the file changed
    for command in (["train", "--resume", str(run), "optim.epochs=4"], ["evaluate", "--run", str(run)],
                    ["predict", "--run", str(run), "--output", str(tmp_path / "q.csv")]):
        refused = betty_in_process(capsys, *command)
        assert_one_line_error(refused, f"the split file {work / 'split.npz'} (dataset.split) has sha256",
                              "the split changed since training")
    (work / "split.npz").unlink()
    for command in (["train", "--resume", str(run), "optim.epochs=4"], ["evaluate", "--run", str(run)]):
        refused = betty_in_process(capsys, *command)
        assert_one_line_error(refused, f"the run was trained on the split file {work / 'split.npz'}", "is missing")
    assert load_run(run, graph=graph).graph is graph  # a graph given from Python needs no file


def _write_csv(path, ids) -> None:
    text = "".join(f"{i}\n" for i in ids).encode()
    path.write_bytes(gzip.compress(text) if path.name.endswith(".gz") else text)


def test_an_ogb_style_split_folder_is_read_gzipped_or_not_and_hashed(planetoid_dir, tmp_path):
    folder = tmp_path / "split"
    folder.mkdir()
    for name, ids in zip(("train.csv.gz", "valid.csv", "test.csv"), CORA_SPLIT.values()):
        _write_csv(folder / name, ids[::-1])
    graph = load_dataset(DatasetConfig(name="cora", data_dir=planetoid_dir, split=folder))
    for field, ids in CORA_SPLIT.items():
        assert torch.equal(getattr(graph, field), torch.from_numpy(ids[::-1].copy()))
    before = split_sha256(folder)
    _write_csv(folder / "test.csv", CORA_SPLIT["test_idx"][:-1])
    assert split_sha256(folder) != before


def _npz(**arrays):
    return lambda path: np.savez(path, **(CORA_SPLIT | arrays))


def _without(field):
    return lambda path: np.savez(path, **{key: ids for key, ids in CORA_SPLIT.items() if key != field})


@pytest.mark.parametrize("write, fragments", [
    (_without("val_idx"), ["lacks the array 'val_idx' (it holds train_idx, test_idx)"]),
    (_npz(train_idx=np.arange(10.0)), ["train_idx is float64 of shape (10,), expected a 1-D array of integer"]),
    (_npz(test_idx=np.array([5, 2708])), ["test_idx holds node 2708, outside [0, 2708)"]),
    (_npz(test_idx=np.array([5, -1])), ["test_idx holds node -1, outside [0, 2708)"]),
    (_npz(test_idx=np.array([299, 1000])), ["node 299 is in both train_idx and test_idx"]),
    (_npz(val_idx=np.array([300, 301, 300])), ["node 300 is twice in val_idx"]),
    (_npz(val_idx=np.array([[300, 301]])), ["val_idx is int64 of shape (1, 2)"]),
    (_npz(val_idx=np.array([300, "x"], dtype=object)), ["holds an object array, which is never unpickled"]),
    (lambda path: path.write_text("train_idx: [1, 2]\n"), ["cannot read", "as an .npz of integer arrays"]),
    (lambda path: np.save(path.with_suffix(".npy"), np.arange(3)) or path.with_suffix(".npy").rename(path),
     ["is one array, not an .npz"]),
    (lambda path: None, ["does not exist"]),
])
def test_a_bad_split_file_is_refused_in_one_line_naming_it(cora, tmp_path, write, fragments):
    path = tmp_path / "split.npz"
    write(path)
    with pytest.raises(DatasetError) as raised:
        apply_split(cora, path)
    message = str(raised.value)
    assert message.startswith(f"dataset.split: {path}") or f"dataset.split: cannot read {path}" in message
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_a_split_folder_missing_a_part_or_holding_text_is_named(cora, tmp_path):
    folder = tmp_path / "split"
    folder.mkdir()
    _write_csv(folder / "train.csv", [0, 1])
    _write_csv(folder / "test.csv", [2, 3])
    with pytest.raises(DatasetError, match=re.escape(f"split folder {folder} has no valid.csv (nor valid.csv.gz)")):
        apply_split(cora, folder)
    (folder / "valid.csv").write_text("4\nfive\n")
    with pytest.raises(DatasetError, match=re.escape(str(folder / "valid.csv"))):
        apply_split(cora, folder)
    _write_csv(folder / "valid.csv", [4, 9999])
    with pytest.raises(DatasetError, match=re.escape(f"{folder / 'valid.csv'} names nodes outside [0, 2708)")):
        apply_split(cora, folder)


def test_train_refuses_a_bad_split_in_one_line_before_writing_a_run(tmp_path, capsys):
    np.savez(tmp_path / "split.npz", train_idx=np.array([0, 1]), val_idx=np.array([1]), test_idx=np.array([2]))
    run = tmp_path / "run"
    refused = betty_in_process(capsys, "train", "--config", QUICKSTART, *SMALL, f"dataset.split={tmp_path / 'split.npz'}",
                               f"train.run_dir={run}")
    assert_one_line_error(refused, f"dataset.split: {tmp_path / 'split.npz'} does not fit 'synthetic'",
                          "node 1 is in both train_idx and val_idx")
    assert not run.exists()


def test_a_relative_split_path_is_saved_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(QUICKSTART, ["dataset.split=splits/mine.npz"])
    assert config.dataset.split == tmp_path / "splits" / "mine.npz"
    assert f"split: {tmp_path / 'splits' / 'mine.npz'}" in config.to_yaml()


@pytest.mark.parametrize("fields", [
    {"x": np.zeros((6, 3))},  # float64 features
    {"x": np.zeros((6, 3), dtype=np.int64)},
    {"train_idx": np.array([1, 0], dtype=np.uint32)},
    {"train_idx": [0, 1], "test_idx": (4,)},
    {"train_idx": np.array([1, 0])[::-1], "y": np.array([-1, 1, 0, 2, 1, 0])[::-1]},  # negative strides
])
def test_a_graph_takes_numpy_arrays_and_lists_wherever_it_takes_tensors(fields):
    given = {"x": torch.zeros(6, 3), "y": torch.tensor([0, 1, 2, 0, 1, -1]), "train_idx": torch.tensor([0, 1]),
             "val_idx": np.array([2, 3]), "test_idx": np.array([4])}
    graph = Graph.from_edges(np.array([0, 1, 2, 3, 4]), np.array([1, 2, 3, 4, 5]), 6, **(given | fields))
    assert graph.x.dtype == torch.float32 and graph.y.dtype == torch.int64
    assert all(isinstance(getattr(graph, f), torch.Tensor) and getattr(graph, f).dtype == torch.int64
               for f in ("train_idx", "val_idx", "test_idx"))
    assert graph.train_idx.tolist() == [0, 1] or graph.train_idx.tolist() == [1, 0]


def test_a_graph_refuses_an_object_array_in_one_line():
    with pytest.raises(DatasetError, match="train_idx must be a tensor or numpy array of numbers, got ndarray"):
        Graph.from_edges(np.array([0]), np.array([1]), 2, x=np.zeros((2, 1)), y=np.array([0, 1]),
                         train_idx=np.array([0, None], dtype=object), val_idx=[], test_idx=[])
