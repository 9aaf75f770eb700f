"""Dataset loading: Planetoid counts and split, the restricted unpickler, checksums, the synthetic SBM."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest
import torch

from betty_trainer.config import DatasetConfig
from betty_trainer.datasets import load_dataset, make_sbm, read_npz, restricted_load, stratified_split
from betty_trainer.errors import DatasetError
from tests.conftest import shared_data


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


# --- gnn-benchmark .npz datasets (Amazon Computers/Photo, Coauthor CS/Physics) ---------------------------



@pytest.fixture(scope="module")
def npz_dir():
    return shared_data("graphdata-npz", "amazon_photo.npz")


@pytest.fixture(scope="module")
def computers(npz_dir):
    return load_dataset(DatasetConfig(name="amazon-computers", data_dir=npz_dir))


def _edge_keys(graph, reverse=False):
    dst = torch.repeat_interleave(torch.arange(graph.num_nodes), graph.in_degrees())
    src = graph.indices.long()  # stored as int32: the keys need int64
    return torch.sort(src * graph.num_nodes + dst if reverse else dst * graph.num_nodes + src).values


def test_amazon_computers_matches_the_published_counts(computers):
    assert (computers.num_nodes, computers.num_edges, computers.num_features, computers.num_classes) == (
        13752, 491722, 767, 10)
    assert torch.bincount(computers.y).tolist() == [436, 2142, 1414, 542, 5158, 308, 487, 818, 2156, 291]
    assert computers.x.dtype == torch.float32 and computers.x.shape == (13752, 767)
    nonzero_rows = computers.x.sum(1) > 0
    assert torch.allclose(computers.x.sum(1)[nonzero_rows], torch.ones(int(nonzero_rows.sum())))


def test_npz_graph_is_symmetric_without_self_loops(computers, npz_dir):
    assert torch.equal(_edge_keys(computers), _edge_keys(computers, reverse=True))
    dst = torch.repeat_interleave(torch.arange(computers.num_nodes), computers.in_degrees())
    assert not bool((dst == computers.indices).any())
    # every stored (one-directional) edge is present, in both directions
    raw = read_npz(npz_dir / "amazon_cs.npz")["adj_matrix"].tocoo()
    off_diagonal = raw.row != raw.col
    stored = torch.from_numpy(raw.col[off_diagonal] * computers.num_nodes + raw.row[off_diagonal]).long()
    keys = _edge_keys(computers)
    assert bool(torch.isin(stored, keys).all())
    assert computers.num_edges == 2 * 245861  # the undirected edge count of SOURCE.md


def test_npz_split_is_stratified_disjoint_and_seeded(computers):
    train, val, test = computers.train_idx, computers.val_idx, computers.test_idx
    everything = torch.cat([train, val, test])
    assert torch.equal(torch.sort(everything).values, torch.arange(computers.num_nodes))  # disjoint and covering
    assert torch.bincount(computers.y[train], minlength=10).tolist() == [20] * 10
    assert torch.bincount(computers.y[val], minlength=10).tolist() == [30] * 10
    again = stratified_split(computers.y, 10, seed=0)
    other = stratified_split(computers.y, 10, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(again, (train, val, test)))
    assert not torch.equal(other[0], train)


def test_stratified_split_of_a_small_class_fills_train_first():
    labels = torch.tensor([0] * 25 + [1] * 60)
    train, val, test = stratified_split(labels, 2, seed=3, train_per_class=20, val_per_class=30)
    assert torch.bincount(labels[train]).tolist() == [20, 20]
    assert torch.bincount(labels[val], minlength=2).tolist() == [5, 30]
    assert torch.bincount(labels[test], minlength=2).tolist() == [0, 10]


@pytest.fixture
def photo_copy(npz_dir, tmp_path):
    shutil.copy(npz_dir / "amazon_photo.npz", tmp_path / "amazon_photo.npz")
    return tmp_path


def test_tampered_npz_fails_checksum_in_one_line(photo_copy):
    target = photo_copy / "amazon_photo.npz"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="amazon_photo.npz fails its sha256 check") as caught:
        load_dataset(DatasetConfig(name="amazon-photo", data_dir=photo_copy))
    assert "\n" not in str(caught.value)


def test_truncated_npz_without_checksum_gives_one_line_error(photo_copy):
    target = photo_copy / "amazon_photo.npz"
    target.write_bytes(target.read_bytes()[:100_000])
    with pytest.raises(DatasetError, match="amazon_photo.npz") as caught:
        load_dataset(DatasetConfig(name="amazon-photo", data_dir=photo_copy, verify_checksums=False))
    assert "\n" not in str(caught.value)


def test_malicious_pickle_inside_an_npz_is_refused(tmp_path, monkeypatch):
    evil = np.empty((), dtype=object)
    evil[()] = Evil()
    np.savez(tmp_path / "amazon_photo.npz", adj_matrix=evil, node_attr=evil, node_label=np.zeros(3, np.int32))
    calls = []
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: calls.append(args))
    with pytest.raises(DatasetError, match="adj_matrix.npy: refusing to load shutil.rmtree"):
        load_dataset(DatasetConfig(name="amazon-photo", data_dir=tmp_path, verify_checksums=False))
    assert calls == []
    # the same archive through numpy's own loader would have called it
    np.load(tmp_path / "amazon_photo.npz", allow_pickle=True)["adj_matrix"]
    assert calls == [("/nonexistent-betty",)]


def test_structure_only_datasets_are_the_ones_without_labels_or_splits():
    from betty_trainer.datasets import DATASETS

    snap = shared_data("snap-jlg", "as-caida20071105.jlg")
    assert {name for name, spec in DATASETS.items() if spec.structure_only} == \
        {name for name in DATASETS if name.startswith("snap-")}
    graph = load_dataset(DatasetConfig(name="snap-as-caida", data_dir=snap))
    assert graph.train_idx.numel() == graph.val_idx.numel() == graph.test_idx.numel() == 0
    assert bool((graph.y == -1).all()) and graph.num_classes == 0
    assert not DATASETS["cora"].structure_only


def test_the_listing_says_which_datasets_are_structure_only(tmp_path, capsys, monkeypatch):
    from tests.test_cli import betty_in_process

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BETTY_DATA_DIR", raising=False)
    result = betty_in_process(capsys, "datasets")
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    assert "structure only" in rows["snap-as-caida"] and "structure only" not in rows["cora"]
    assert "not train or plan" in rows["snap-as-caida"]
    assert "structure only" in result.stdout.splitlines()[-2] + result.stdout.splitlines()[-1]


@pytest.mark.parametrize("command", ["train", "plan", "validate"])
def test_train_plan_and_validate_refuse_a_structure_only_dataset_before_loading_it(tmp_path, capsys, command):
    from tests.conftest import REPO
    from tests.test_cli import assert_one_line_error, betty_in_process

    output = ["--output", str(tmp_path / "plan.json")] if command == "plan" else []
    result = betty_in_process(capsys, command, "--config", str(REPO / "configs/quickstart.yaml"), "--data-dir",
                              str(tmp_path), "dataset.name=snap-as-caida", *output)
    assert_one_line_error(result, "dataset 'snap-as-caida' is structure only", "no labels",
                          "python benchmarks/sampling.py --graph snap-as-caida", "betty-train datasets")


def test_the_no_training_nodes_message_names_what_a_structure_only_dataset_is_for():
    from betty_trainer.datasets import no_training_nodes_message, structure_only_message

    assert no_training_nodes_message("snap-slashdot") == structure_only_message("snap-slashdot")
    assert "benchmarks/sampling.py --graph snap-slashdot" in no_training_nodes_message("snap-slashdot")
    mine = no_training_nodes_message("my-graph")
    assert mine.startswith("dataset 'my-graph' has no training nodes") and "train_idx" in mine
    assert "\n" not in mine + structure_only_message("snap-slashdot")


def _cache_test_graph():
    return make_sbm(num_nodes=200, num_classes=3, num_features=4, num_val=20, num_test=20, seed=0)


@pytest.mark.parametrize("damage", [b"", b"\x93NUMPY"])
def test_an_empty_or_truncated_cache_file_is_rebuilt(tmp_path, monkeypatch, damage):
    from betty_trainer.datasets.aggregation import aggregation_dir, aggregation_table
    from betty_trainer.datasets.cache import load_cached, save_graph
    from betty_trainer.distributed.ownership import load_owners

    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path / "cache"))
    graph = _cache_test_graph()
    table = aggregation_table(graph, "test", lambda block, x: x * 2)
    (aggregation_dir(graph, "test") / "table.npy").write_bytes(damage)
    assert torch.equal(aggregation_table(graph, "test", lambda block, x: x * 2), table)
    owners = load_owners(graph, 2)
    for stored in (tmp_path / "cache" / graph.name / "ownership").glob("*.npy"):
        stored.write_bytes(damage)
    assert torch.equal(load_owners(graph, 2), owners)
    folder = save_graph(graph, tmp_path / "converted", {"test": 1})
    (folder / "x.npy").write_bytes(damage)
    assert load_cached(folder, {"test": 1}) is None  # the caller converts the dataset again


def test_a_cached_graph_whose_arrays_disagree_is_rebuilt(tmp_path, caplog):
    from betty_trainer.datasets.cache import load_cached, save_graph

    folder = save_graph(_cache_test_graph(), tmp_path / "converted", {"test": 1})
    indptr = np.load(folder / "indptr.npy")
    np.save(folder / "indptr.npy", indptr[::-1].copy())  # same size and header, not a graph
    assert load_cached(folder, {"test": 1}) is None
    assert f"cache {folder} is corrupt (invalid graph" in caplog.text and "rebuilding" in caplog.text


def test_a_cache_dir_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from betty_trainer.datasets.aggregation import aggregation_table
    from betty_trainer.distributed.ownership import load_owners
    from tests.test_cli import assert_one_line_error, betty_in_process
    from tests.test_runs import QUICKSTART

    cache = tmp_path / "a file"
    cache.write_text("not a folder")
    monkeypatch.setenv("BETTY_CACHE_DIR", str(cache))
    graph = _cache_test_graph()
    for build in (lambda: aggregation_table(graph, "test", lambda block, x: x), lambda: load_owners(graph, 2)):
        with pytest.raises(DatasetError, match=f"cannot write the cache folder {cache}/.*Not a directory.*"
                                               "BETTY_CACHE_DIR .* must be a writable folder"):
            build()
    result = betty_in_process(capsys, "train", "--config", QUICKSTART, "dataset.name=powerlaw",
                              "dataset.powerlaw.num_nodes=300", "dataset.powerlaw.num_edges=1500",
                              f"train.run_dir={tmp_path / 'run'}")
    assert_one_line_error(result, f"cannot write the cache folder {cache}/powerlaw/processed/", "(ENOTDIR)",
                          "BETTY_CACHE_DIR")
