"""The power-law generator's nested blocks (``class_homophily``): blocks inside classes, as Table 6's graph uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from betty_trainer.datasets import powerlaw as powerlaw_module
from betty_trainer.errors import DatasetError

PARAMS = dict(num_nodes=20_000, num_edges=100_000, num_classes=4, num_features=8, exponent=2.5, homophily=0.8,
              feature_signal=1.0, train_fraction=0.1, val_fraction=0.05, test_fraction=0.1, seed=0,
              num_communities=100)


def _arrays(folder):
    return {name: np.load(folder / f"{name}.npy") for name in ("indptr", "indices", "x", "y", "train_idx")}


def _pairs(arrays):
    dst = np.repeat(np.arange(arrays["indptr"].size - 1), np.diff(arrays["indptr"]))
    return arrays["indices"].astype(np.int64), dst


def test_class_homophily_zero_is_the_graph_without_it(tmp_path):
    plain = powerlaw_module.write_powerlaw(tmp_path / "plain", **PARAMS)
    zero = powerlaw_module.write_powerlaw(tmp_path / "zero", **PARAMS, class_homophily=0.0)
    for name, array in _arrays(plain).items():
        assert np.array_equal(array, _arrays(zero)[name]), name


def test_pairs_leaving_their_block_stay_in_its_class_with_class_homophily(tmp_path):
    block = powerlaw_module._rng(PARAMS["seed"], powerlaw_module._COMMUNITIES).integers(
        PARAMS["num_communities"], size=PARAMS["num_nodes"])  # the generator's blocks, redrawn from their stream
    shares = {}
    for class_homophily in (0.0, 0.8):
        folder = powerlaw_module.write_powerlaw(tmp_path / str(class_homophily), **PARAMS,
                                                class_homophily=class_homophily)
        arrays = _arrays(folder)
        assert np.array_equal(arrays["y"], block % PARAMS["num_classes"])
        src, dst = _pairs(arrays)
        in_block = block[src] == block[dst]
        in_class = (block[src] % PARAMS["num_classes"]) == (block[dst] % PARAMS["num_classes"])
        # of the pairs outside their block, the share inside the class: a class_homophily share stays there, the
        # rest lands anywhere and so in the class with probability ~ its weight share (~1/4)
        shares[class_homophily] = (in_class & ~in_block).sum() / (~in_block).sum()
        # binomial sd ~0.003 on these pairs; merging repeated pairs inside a block (hubs) lowers the share a little
        assert abs(in_block.mean() - PARAMS["homophily"]) < 0.04, in_block.mean()
    expected = {h: h + (1 - h) * 0.25 for h in shares}
    # ~18k pairs outside their block: a binomial share's standard deviation is under 0.004; weight shares of the
    # classes vary by a few percent (hubs), and merged duplicate pairs move both a little
    for h, share in shares.items():
        assert abs(share - expected[h]) < 0.03, (h, share, expected[h])


@pytest.mark.parametrize("bad", [dict(class_homophily=1.5), dict(class_homophily=-0.1),
                                 dict(class_homophily=0.5, num_communities=0)])
def test_bad_class_homophily_is_refused_naming_the_key(tmp_path, bad):
    with pytest.raises(DatasetError, match="class_homophily"):
        powerlaw_module.write_powerlaw(tmp_path / "bad", **{**PARAMS, **bad})


def test_nested_graph_is_symmetric_without_self_loops(tmp_path):
    arrays = _arrays(powerlaw_module.write_powerlaw(tmp_path / "g", **PARAMS, class_homophily=0.8))
    src, dst = _pairs(arrays)
    n = PARAMS["num_nodes"]
    assert (src != dst).all()
    assert torch.equal(torch.sort(torch.from_numpy(src * n + dst)).values, torch.sort(torch.from_numpy(dst * n + src)).values)


def test_make_powerlaw_without_nesting_keeps_the_cache_of_the_graph_from_before(tmp_path, monkeypatch):
    monkeypatch.setenv("BETTY_CACHE_DIR", str(tmp_path))
    small = {key: value for key, value in PARAMS.items() if key != "num_communities"}
    powerlaw_module.make_powerlaw(**small)
    monkeypatch.setattr(powerlaw_module, "write_powerlaw", lambda *args, **kwargs: pytest.fail("regenerated"))
    again = powerlaw_module.make_powerlaw(**small, class_homophily=0.0)  # the config's default: served from the cache
    assert again.num_nodes == PARAMS["num_nodes"]
