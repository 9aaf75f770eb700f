"""A synthetic node-classification graph: a planted-partition stochastic block model.

Needs no files, so it is the default dataset of the quickstart and of tests that
need a graph of a chosen size. Deterministic from its seed.
"""

from __future__ import annotations

import torch

from betty_trainer.data.graph import Graph


def make_sbm(
    num_nodes: int = 2000,
    num_classes: int = 5,
    num_features: int = 32,
    avg_degree: float = 10.0,
    homophily: float = 0.7,
    feature_signal: float = 0.2,
    train_per_class: int = 20,
    num_val: int = 500,
    num_test: int = 1000,
    seed: int = 0,
) -> Graph:
    """Sample an undirected planted-partition graph with class-informative Gaussian features.

    Each node gets a uniform class. ``num_nodes · avg_degree / 2`` edges are drawn:
    a uniform endpoint ``u``, and with probability ``homophily`` a uniform node of
    ``u``'s class, else a uniform node. Features are ``N(μ_c, I)`` with class means
    ``μ_c`` whose coordinates are i.i.d. ``N(0, feature_signal²)``.
    Split: ``train_per_class`` per class, then ``num_val`` and ``num_test`` nodes at random.

    Returns:
        A :class:`Graph` (float32 ``x`` ``(N, num_features)``, int64 ``y``).

    Raises:
        ValueError: if the split asks for more nodes than exist.
    """
    if train_per_class * num_classes + num_val + num_test > num_nodes:
        raise ValueError(
            f"synthetic split needs {train_per_class * num_classes + num_val + num_test} nodes, graph has {num_nodes}"
        )
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(num_classes, (num_nodes,), generator=generator)
    by_class = torch.argsort(y, stable=True)
    class_start = torch.cumsum(torch.bincount(y, minlength=num_classes), 0) - torch.bincount(y, minlength=num_classes)
    class_size = torch.bincount(y, minlength=num_classes)

    num_edges = int(num_nodes * avg_degree / 2)
    u = torch.randint(num_nodes, (num_edges,), generator=generator)
    inside = torch.rand(num_edges, generator=generator) < homophily
    offset = (torch.rand(num_edges, generator=generator) * class_size[y[u]]).long()
    v = torch.where(inside, by_class[class_start[y[u]] + offset], torch.randint(num_nodes, (num_edges,), generator=generator))

    means = torch.randn(num_classes, num_features, generator=generator) * feature_signal
    x = means[y] + torch.randn(num_nodes, num_features, generator=generator)

    order = torch.randperm(num_nodes, generator=generator)
    rank_in_class = torch.empty(num_nodes, dtype=torch.long)
    sorted_y, position = torch.sort(y[order], stable=True)
    rank_in_class[order[position]] = torch.arange(num_nodes) - class_start[sorted_y]
    is_train = rank_in_class < train_per_class
    rest = order[~is_train[order]]
    return Graph.from_edges(
        u, v, num_nodes,
        x=x, y=y,
        train_idx=torch.sort(torch.nonzero(is_train).flatten()).values,
        val_idx=torch.sort(rest[:num_val]).values,
        test_idx=torch.sort(rest[num_val:num_val + num_test]).values,
        num_classes=num_classes, name="synthetic",
    )
