"""Evaluation: accuracy of a model on node splits, layer by layer over the whole graph for the
built-in models (as DGL's GraphSAGE example infers), or on full-neighbourhood batches for any model."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore, require_store
from betty_trainer.data.graph import Graph
from betty_trainer.errors import TrainingError
from betty_trainer.models.capabilities import projected_layers
from betty_trainer.models.stack import LayerStack, runs_layer_by_layer
from betty_trainer.sampling import sample_batch, sample_block

EVAL_CHUNK = 8192  # dst nodes per block (layer-wise evaluation) or seeds per batch (batch evaluation)
EVALUATION_HOST_MEMORY = ("evaluation holds two layers' outputs of every node in host memory (num_nodes × "
                          "model.hidden values each, and a layer's projection, layerwise_logits), or for a model "
                          "that cannot run layer by layer each chunk's full-neighbourhood batch")
"""Why evaluation runs out of host memory, for the errors that say so."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


def fitting_chunks(compute: Callable[[int], T], chunk_size: int, device: torch.device) -> tuple[T, int]:
    """``compute(chunk_size)``, run again with half the chunk (rounded up) after each CUDA out-of-memory error
    until it fits: evaluation's guard, as a training step's is its re-plan (Betty §4.4.3). A chunk (dst nodes per
    block, or seeds per batch) changes how much one step of evaluation holds on the device, not its result; the
    failed attempt's tensors are dropped with its traceback and the allocator's cached blocks handed back
    (``torch.cuda.empty_cache``) before the next.

    Args:
        compute: ``chunk → result``, e.g. :func:`splits_accuracy` with its other arguments bound.
        chunk_size: the chunk to try first, ≥ 1.
        device: where ``compute`` runs.

    Returns:
        ``compute``'s result and the chunk it ran with (the one to start from next time).

    Raises:
        TrainingError: out of device memory with one node per chunk.
    """
    while True:
        try:
            return compute(chunk_size), chunk_size
        except torch.cuda.OutOfMemoryError:
            if chunk_size == 1:
                raise TrainingError(f"evaluation ran out of memory on {device} with one node per chunk; free device "
                                    "memory, or evaluate on the CPU (CUDA_VISIBLE_DEVICES= hides the GPU from "
                                    "betty-train evaluate and predict)") from None
        if device.type == "cuda":  # out of the handler: the failed attempt's tensors went with its traceback
            torch.cuda.empty_cache()
        chunk_size = (chunk_size + 1) // 2
        logger.warning("evaluation ran out of memory on %s; evaluating again with %d nodes per chunk", device,
                       chunk_size)


def full_neighbourhood_batches(graph: Graph, nodes: Tensor, num_layers: int,
                               batch_size: int = EVAL_CHUNK) -> Iterator[Batch]:
    """Full-neighbourhood batches over ``nodes`` in chunks of ``batch_size`` seeds, each sampled
    when it is read (for :func:`evaluate`)."""
    return (sample_batch(graph, chunk, [None] * num_layers) for chunk in nodes.split(batch_size))


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], features: FeatureStore, labels: Tensor,
             device: torch.device) -> float:
    """Accuracy over the output nodes of ``batches``, in eval mode (no dropout).

    This is batch evaluation (any model); :func:`evaluate_splits` evaluates the built-in
    models layer by layer instead.

    Args:
        model: the model.
        batches: e.g. from :func:`full_neighbourhood_batches`.
        features: the feature store (an ``(N, F)`` tensor ``x`` goes in as ``HostFeatureStore(x)``).
        labels: ``(N,)`` int64 labels.
        device: where the model runs.

    Returns:
        Fraction in ``[0, 1]`` of outputs whose argmax logit is the label; ``nan`` with no outputs.

    Raises:
        TypeError: ``features`` is not a :class:`~betty_trainer.data.feature_store.FeatureStore`.
    """
    require_store(features)
    was_training = model.training
    model.eval()
    correct, total = 0, 0
    try:  # the mode restored on an error too (an out-of-memory error is retried: fitting_chunks)
        for batch in batches:
            logits = model(batch.to(device).blocks, features.gather(batch.input_nodes, device))
            correct += int((logits.argmax(1).cpu() == labels[batch.output_nodes]).sum())
            total += batch.output_nodes.numel()
    finally:
        model.train(was_training)
    return correct / total if total else float("nan")


@torch.no_grad()
def layerwise_logits(model: LayerStack, graph: Graph, features: FeatureStore, device: torch.device,
                     nodes: Tensor | None = None, chunk_size: int = EVAL_CHUNK) -> Tensor:
    """Logits of ``nodes`` computed one layer at a time over the whole graph, in eval mode.

    Layer ``l`` of an ``L``-layer stack is computed for every node of the graph (the
    output layer only for ``nodes``), ``chunk_size`` dst nodes at a time: a one-layer block
    holding each chunk's full in-neighbourhood reads the previous layer's output of all
    nodes (layer 0: the features, gathered from ``features``). Every node's hidden
    representation is computed once per layer, not once per evaluation batch whose
    ``L``-hop neighbourhood holds it, and no multi-layer batch is built (the layer-wise
    inference of DGL's GraphSAGE example). A layer that projects first
    (:func:`~betty_trainer.models.capabilities.projected_layers`: ``project`` row by row, then ``propagate``) is
    projected once for every node when its dst nodes take several chunks, and each chunk propagates its src rows
    of the projection: a node's ``W·h`` is computed once per layer, not once per chunk whose block reads it (and
    a layer reading its dst nodes' own rows reads each node's input row twice in all). The result equals
    ``model`` applied to full-neighbourhood batches of ``nodes`` up to floating-point reassociation. Each
    layer's output for all nodes is kept in host memory (pinned when ``device`` is CUDA):
    ``N × hidden`` values, two layers at a time; a projected layer's ``N × projected_width`` takes the place of
    the previous layer's output where ``propagate`` reads the projection alone (GAT), and is kept beside it where
    it reads the dst nodes' input rows too (SAGE mean).

    Args:
        model: a :class:`~betty_trainer.models.stack.LayerStack` (see :func:`~betty_trainer.models.stack.runs_layer_by_layer`).
        graph: the graph (its CSC in-edges give the neighbourhoods).
        features: the feature store (an ``(N, F)`` tensor ``x`` goes in as ``HostFeatureStore(x)``).
        device: where the model runs.
        nodes: ``(n,)`` int64 ids whose logits are returned; default: every node.
        chunk_size: dst nodes per one-layer block.

    Returns:
        ``(n, C)`` logits on the CPU, in the order of ``nodes``.

    Raises:
        ValueError: if ``nodes`` is empty or ``chunk_size < 1``.
        TypeError: ``features`` is not a :class:`~betty_trainer.data.feature_store.FeatureStore`.
    """
    require_store(features)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    nodes = torch.arange(graph.num_nodes) if nodes is None else nodes
    if nodes.numel() == 0:
        raise ValueError("layerwise_logits needs at least one node")
    store, pin = features, device.type == "cuda"
    last = len(model.layers) - 1
    projects = projected_layers(model)
    was_training = model.training
    model.eval()
    try:
        for index in range(last + 1):
            dst = nodes if index == last else torch.arange(graph.num_nodes)
            # projected once for all nodes where the dst nodes take several chunks (with one, its src rows are
            # every node once anyway)
            z = None
            if projects[index] and dst.numel() > chunk_size:  # the rows the chunks' blocks read: every node, or
                rows = torch.arange(graph.num_nodes) if dst.numel() == graph.num_nodes else \
                    sample_block(graph, dst, None).src_nodes  # the in-neighbourhood of the output layer's nodes
                z = _projected(model.layers[index], store, rows, graph.num_nodes, chunk_size, device, pin)
                if not model.layers[index].reads_dst_input:
                    store = None  # the chunks read the projection alone: the previous layer's output can go
            out = None
            for chunk in dst.split(chunk_size):
                block = sample_block(graph, chunk, None)
                h = _layer_rows(model, index, block, store, z, device)
                if out is None:
                    out, start = torch.empty(dst.numel(), h.shape[1], dtype=h.dtype, pin_memory=pin), 0
                out[start:start + chunk.numel()].copy_(h)
                start += chunk.numel()
            del z
            store = HostFeatureStore(out, pin=pin)  # this layer's output is the next layer's input
    finally:
        model.train(was_training)
    return out


def _projected(layer: nn.Module, store: FeatureStore, rows: Tensor, num_nodes: int, chunk_size: int,
               device: torch.device, pin: bool) -> FeatureStore:
    """``z = project(h)`` of the nodes ``rows`` (:class:`~betty_trainer.models.capabilities.ProjectedLayer`),
    ``chunk_size`` at a time, kept in host memory as ``(N, projected_width)`` rows by node id (the others are never
    read): each node is projected once per layer, where a chunk's forward would project every src row of its block
    again (a node is a src row of every chunk holding one of its out-neighbours)."""
    z = None
    for part in rows.split(chunk_size):
        projected = layer.project(store.gather(part, device))
        if z is None:
            z = torch.empty(num_nodes, projected.shape[1], dtype=projected.dtype, pin_memory=pin)
        z.index_copy_(0, part, projected.to(z.device))
    return HostFeatureStore(z, pin=pin)


def _layer_rows(model: LayerStack, index: int, block: Block, store: FeatureStore, z: FeatureStore | None,
                device: torch.device) -> Tensor:
    """Layer ``index``'s output rows of ``block``'s dst nodes (``block`` on the CPU, its node ids read there) in eval
    mode: :meth:`LayerStack.layer_forward` on the gathered src rows, or for a projected layer (``z``: the nodes'
    projection) its ``propagate`` on the src nodes' rows of ``z`` (and the dst nodes' input rows where it reads
    them), then the stack's ReLU."""
    on_device = block.to(device)
    if z is None:
        return model.layer_forward(index, on_device, store.gather(block.src_nodes, device))
    layer = model.layers[index]
    rows = z.gather(block.src_nodes, device)
    h = layer.propagate(on_device, rows, store.gather(block.src_nodes[: block.num_dst], device)) \
        if layer.reads_dst_input else layer.propagate(on_device, rows)
    return F.relu(h) if index < len(model.layers) - 1 else h


def evaluate_splits(model: nn.Module, graph: Graph, features: FeatureStore, device: torch.device,
                    splits: Mapping[str, Tensor], num_layers: int, chunk_size: int = EVAL_CHUNK) -> dict[str, float]:
    """:func:`splits_accuracy` with ``chunk_size`` halved after each CUDA out-of-memory error until it fits
    (:func:`fitting_chunks`); the accuracies do not depend on the chunk.

    Raises:
        TrainingError: out of device memory with one node per chunk.
    """
    bound = functools.partial(splits_accuracy, model, graph, features, device, splits, num_layers)
    return fitting_chunks(bound, chunk_size, device)[0]


def splits_accuracy(model: nn.Module, graph: Graph, features: FeatureStore, device: torch.device,
                    splits: Mapping[str, Tensor], num_layers: int, chunk_size: int = EVAL_CHUNK) -> dict[str, float]:
    """Accuracy of ``model`` on each split of node ids, in eval mode (no dropout).

    Built-in models (:func:`~betty_trainer.models.stack.runs_layer_by_layer`) are evaluated layer by layer, once for all
    splits together (:func:`layerwise_logits`); any other model on full-neighbourhood
    batches of each split, sampled one chunk at a time (:func:`full_neighbourhood_batches`,
    :func:`evaluate`). Both compute the same logits.

    Args:
        model: the model.
        graph: the graph (labels ``graph.y``).
        features: the feature store (an ``(N, F)`` tensor ``x`` goes in as ``HostFeatureStore(x)``).
        device: where the model runs.
        splits: name → ``(n,)`` int64 node ids, e.g. ``{"val": graph.val_idx, "test": graph.test_idx}``.
        num_layers: blocks per batch (batch evaluation only).
        chunk_size: dst nodes per block (layer-wise) or seeds per batch.

    Returns:
        name → fraction in ``[0, 1]`` of the split's nodes whose argmax logit is the label;
        ``nan`` for an empty split.
    """
    if not runs_layer_by_layer(model):
        return {name: evaluate(model, full_neighbourhood_batches(graph, nodes, num_layers, chunk_size),
                               features, graph.y, device) for name, nodes in splits.items()}
    accuracy = {name: float("nan") for name in splits}
    present = {name: nodes for name, nodes in splits.items() if nodes.numel()}
    if present:
        logits = layerwise_logits(model, graph, features, device, torch.cat(list(present.values())), chunk_size)
        for (name, nodes), part in zip(present.items(), logits.split([n.numel() for n in present.values()])):
            accuracy[name] = int((part.argmax(1) == graph.y[nodes]).sum()) / nodes.numel()
    return accuracy
