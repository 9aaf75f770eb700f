"""Other real inputs (SNAP .jlg edge lists, MUSAE Facebook, Facebook100 .mat) against the counts their
SOURCE.md verified; the graph-from-arrays API; the power-law generator; the dataset listing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from betty_trainer.config import DatasetConfig
from betty_trainer.data.graph import Graph, csc_from_edges
from betty_trainer.datasets import dataset_status, list_datasets, load_dataset, make_powerlaw
from betty_trainer.datasets import powerlaw as powerlaw_module
from betty_trainer.datasets.registry import DATASETS
from betty_trainer.errors import DatasetError
from tests.conftest import shared_data


def _edge_pairs(graph: Graph) -> torch.Tensor:
    dst = torch.repeat_interleave(torch.arange(graph.num_nodes), graph.in_degrees())
    return torch.stack([graph.indices.long(), dst], 1)


def _is_symmetric(graph: Graph) -> bool:
    pairs = _edge_pairs(graph)
    n = graph.num_nodes
    return torch.equal(torch.sort(pairs[:, 0] * n + pairs[:, 1]).values, torch.sort(pairs[:, 1] * n + pairs[:, 0]).values)


# --- SNAP .jlg -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snap_dir():
    return shared_data("snap-jlg", "soc-slashdot0902-directed.jlg")


def test_snap_directed_graph_drops_its_self_loops_and_keeps_direction(snap_dir):
    graph = load_dataset(DatasetConfig(name="snap-slashdot", data_dir=snap_dir))
    assert (graph.num_nodes, graph.num_edges) == (82_168, 948_464 - 78_303)  # SOURCE.md: 78,303 self-loop lines
    assert not _is_symmetric(graph)
    assert graph.num_classes == 0 and graph.train_idx.numel() == 0 and graph.x.shape == (82_168, 1)
    assert torch.equal(graph.x[:, 0], torch.log1p(graph.in_degrees().float()))
    undirected = load_dataset(DatasetConfig(name="snap-slashdot", data_dir=snap_dir, to_undirected=True))
    assert _is_symmetric(undirected) and undirected.num_edges > graph.num_edges


def test_snap_undirected_graph_has_both_directions_of_each_line(snap_dir):
    graph = load_dataset(DatasetConfig(name="snap-email-enron", data_dir=snap_dir))
    assert (graph.num_nodes, graph.num_edges) == (36_692, 2 * 183_831) and _is_symmetric(graph)


def test_a_truncated_jlg_file_is_named(snap_dir, tmp_path):
    data = (snap_dir / "facebook-combined.jlg").read_bytes()
    (tmp_path / "facebook-combined.jlg").write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="facebook-combined.jlg"):
        load_dataset(DatasetConfig(name="snap-ego-facebook", data_dir=tmp_path, verify_checksums=False))
    with pytest.raises(DatasetError, match="facebook-combined.jlg fails its sha256 check"):
        load_dataset(DatasetConfig(name="snap-ego-facebook", data_dir=tmp_path))


# --- MUSAE Facebook page-page ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def musae():
    return load_dataset(DatasetConfig(name="musae-facebook", data_dir=shared_data("musae-facebook", "facebook.json")))


def test_musae_facebook_matches_its_verified_counts(musae):
    assert (musae.num_nodes, musae.num_edges, musae.num_features, musae.num_classes) == (22_470, 2 * 170_823, 4_714, 4)
    assert torch.bincount(musae.y).tolist() == [6_495, 6_880, 5_768, 3_327]  # company, government, politician, tvshow
    assert _is_symmetric(musae)
    assert torch.allclose(musae.x.sum(1), torch.ones(musae.num_nodes))  # every node has >= 3 features
    splits = torch.cat([musae.train_idx, musae.val_idx, musae.test_idx])
    assert torch.equal(torch.sort(splits).values, torch.arange(musae.num_nodes))
    assert (musae.train_idx.numel(), musae.val_idx.numel()) == (11_235, 5_617)


def test_musae_target_with_a_missing_column_is_named(tmp_path):
    folder = shared_data("musae-facebook", "facebook.json")
    for path in folder.glob("facebook*"):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "facebook_target.csv").write_text("id,facebook_id,page_name\n0,1,x\n")
    with pytest.raises(DatasetError, match="facebook_target.csv lacks the column"):
        load_dataset(DatasetConfig(name="musae-facebook", data_dir=tmp_path, verify_checksums=False))


# --- Facebook100 .mat ------------------------------------------------------------------------------------


def test_facebook100_amherst_matches_its_verified_counts():
    folder = shared_data("facebook100", "Amherst41.mat")
    graph = load_dataset(DatasetConfig(name="fb100-amherst41", data_dir=folder))
    assert (graph.num_nodes, graph.num_edges, graph.num_classes) == (2_235, 2 * 90_954, 2)
    assert torch.bincount(graph.y + 1).tolist() == [203, 1_015, 1_017]  # missing / gender 1 / gender 2
    assert graph.num_features == 5 + 30 + 31 + 35 + 16 + 1_076  # one-hot of six columns, "missing" included
    assert torch.equal(graph.x.sum(1), torch.full((graph.num_nodes,), 6.0))
    labelled = torch.cat([graph.train_idx, graph.val_idx, graph.test_idx])
    assert torch.equal(torch.sort(labelled).values, torch.nonzero(graph.y >= 0).flatten())
    assert _is_symmetric(graph)


def test_a_truncated_mat_file_is_named(tmp_path):
    data = (shared_data("facebook100", "Reed98.mat") / "Reed98.mat").read_bytes()
    (tmp_path / "Reed98.mat").write_bytes(data[:1000])
    with pytest.raises(DatasetError, match="Reed98.mat"):
        load_dataset(DatasetConfig(name="fb100-reed98", data_dir=tmp_path, verify_checksums=False))


# --- graph from arrays / scipy.sparse --------------------------------------------------------------------


def test_csc_from_edges_sorts_and_deduplicates_like_a_reference():
    rng = np.random.default_rng(0)
    src, dst = rng.integers(50, size=400), rng.integers(50, size=400)
    for symmetric in (False, True):
        for drop in (False, True):
            indptr, indices = csc_from_edges(src, dst, 50, symmetric=symmetric, drop_self_loops=drop)
            pairs = {(s, d) for s, d in zip(src.tolist(), dst.tolist()) if not (drop and s == d)}
            if symmetric:
                pairs |= {(d, s) for s, d in pairs}
            expected = sorted(pairs, key=lambda p: (p[1], p[0]))
            got = [(int(s), d) for d in range(50) for s in indices[indptr[d]:indptr[d + 1]]]
            assert got == expected and indices.dtype == np.int32


def test_from_scipy_reads_entry_i_j_as_edge_i_to_j():
    adjacency = sp.csr_matrix((np.array([1.0, 2.0, 0.0, 1.0]), (np.array([0, 0, 1, 2]), np.array([1, 2, 2, 2]))),
                              shape=(3, 3))  # 0→1, 0→2, an explicit zero 1→2, a self loop 2→2
    fields = dict(x=torch.zeros(3, 1), y=torch.zeros(3, dtype=torch.long), train_idx=torch.tensor([0]),
                  val_idx=torch.tensor([1]), test_idx=torch.tensor([2]), num_classes=1)
    graph = Graph.from_scipy(adjacency, **fields)
    assert graph.indptr.tolist() == [0, 0, 1, 2] and graph.indices.tolist() == [0, 0]
    undirected = Graph.from_scipy(adjacency.tocoo(), symmetric=True, **fields)
    assert undirected.indptr.tolist() == [0, 2, 3, 4] and undirected.indices.tolist() == [1, 2, 0, 0]
    with pytest.raises(DatasetError, match="square scipy.sparse"):
        Graph.from_scipy(np.eye(3), **fields)


# --- the power-law generator -----------------------------------------------------------------------------

SMALL = dict(num_nodes=20_000, num_edges=400_000, num_classes=4, num_features=8, exponent=2.5, homophily=0.8,
             feature_signal=1.0, train_fraction=0.1, val_fraction=0.05, test_fraction=0.1, seed=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_powerlaw_is_deterministic_from_its_seed_and_cached(cache, monkeypatch):
    one = make_powerlaw(**SMALL)
    calls = []
    monkeypatch.setattr(powerlaw_module, "write_powerlaw", lambda *a, **k: calls.append(1))
    again = make_powerlaw(**SMALL)
    assert calls == [], "the second call maps the cache instead of generating"
    for field in ("indptr", "indices", "x", "y", "train_idx", "val_idx", "test_idx"):
        assert torch.equal(getattr(one, field), getattr(again, field))
    monkeypatch.undo()
    monkeypatch.setenv("BETTY_CACHE_DIR", str(cache / "elsewhere"))
    fresh = make_powerlaw(**SMALL)  # generated again, in another cache: bit-identical
    assert torch.equal(fresh.indices, one.indices) and torch.equal(fresh.x, one.x)
    reseeded = make_powerlaw(**{**SMALL, "seed": 1})
    assert not torch.equal(reseeded.indices[:1000], one.indices[:1000])


def test_powerlaw_has_heavy_tailed_degrees_class_homophily_and_informative_features(cache):
    graph = make_powerlaw(**SMALL)
    degree = graph.in_degrees().double()
    # at most the edges asked for; merging repeated pairs (hubs) may drop a few, under 10%
    assert 0.9 * SMALL["num_edges"] <= graph.num_edges <= SMALL["num_edges"] and _is_symmetric(graph)
    assert degree.max() > 30 * degree.mean()  # a Poisson graph of this mean would stay below 2x
    pairs = _edge_pairs(graph)
    same = (graph.y[pairs[:, 0]] == graph.y[pairs[:, 1]]).double().mean()
    # an inside draw always matches; an outside draw matches with probability sum_c share_c^2 ~ 1/C
    share = torch.bincount(graph.y).double() / graph.num_nodes
    expected = SMALL["homophily"] + (1 - SMALL["homophily"]) * (share ** 2).sum()
    assert abs(same - expected) < 0.03, (same, expected)  # dedup and hubs bend it a little; sd is ~0.001
    means = torch.stack([graph.x[graph.y == c].mean(0) for c in range(graph.num_classes)])
    nearest = torch.cdist(graph.x, means).argmin(1)
    assert (nearest == graph.y).double().mean() > 0.5  # chance is 0.25
    splits = torch.cat([graph.train_idx, graph.val_idx, graph.test_idx])
    assert torch.unique(splits).numel() == splits.numel() == 5_000


# --- betty-train datasets ---------------------------------------------------------------------------------


def test_listing_shows_where_raw_files_and_converted_caches_are(cache, tmp_path):
    assert [status.name for status in list_datasets()] == list(DATASETS)
    planetoid = shared_data("planetoid", "ind.cora.x")
    assert dataset_status(DATASETS["cora"], planetoid).raw == f"{planetoid} (8/8 files)"
    assert dataset_status(DATASETS["cora"]).raw.endswith("(0/8 files; downloaded when online)")
    assert dataset_status(DATASETS["ogbn-products"]).raw.startswith("not downloaded (http://snap.stanford.edu/")
    assert dataset_status(DATASETS["powerlaw"]).processed == ()
    make_powerlaw(**SMALL)
    (folder, size), = dataset_status(DATASETS["powerlaw"]).processed
    assert folder.parent == cache / "powerlaw" / "processed"
    assert size == sum(path.stat().st_size for path in folder.iterdir())


def test_powerlaw_communities_cluster_edges_in_blocks_of_one_class(cache):
    sparse = {**SMALL, "num_edges": 100_000, "num_communities": 100}  # 200-node blocks, few repeated pairs
    graph = make_powerlaw(**sparse)
    block = torch.from_numpy(powerlaw_module._rng(SMALL["seed"], powerlaw_module._COMMUNITIES).integers(
        100, size=SMALL["num_nodes"]))  # the generator's block of each node, redrawn from its keyed stream
    assert torch.equal(graph.y, block % SMALL["num_classes"])
    pairs = _edge_pairs(graph)
    inside = (block[pairs[:, 0]] == block[pairs[:, 1]]).double().mean()
    # an inside draw stays in the block; an outside draw lands in it with probability ~ its weight share (~1/100);
    # merging repeated pairs (hubs inside a block) lowers the share a little
    assert abs(inside - SMALL["homophily"]) < 0.03, inside  # binomial sd ~0.001; the rest is that modelling slack
