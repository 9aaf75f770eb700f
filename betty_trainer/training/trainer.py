"""The training loop: sample → partition into micro-batches → accumulate gradients → step (Betty §4.2).

Reads top to bottom (see :func:`train`). One optimizer step per batch; micro-batch
``k`` contributes ``Σ_{i∈V_k} loss_i / |V|``, so the accumulated gradient is the
full batch's gradient.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor, nn

from betty_trainer.config import Config
from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore, as_feature_store
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import load_dataset
from betty_trainer.errors import ConfigError, TrainingError
from betty_trainer.memory.plan import MicroBatchPlanner, make_planner, plan_report
from betty_trainer.models import build_model, set_dropout_key
from betty_trainer.models.stack import LayerStack
from betty_trainer.sampling import NeighborSampler, SampleKey, Sampler, sample_batch, sample_block
from betty_trainer.training.checkpoint import load_checkpoint, save_checkpoint
from betty_trainer.training.rundir import RunDirectory, holds_run_directories, new_run_dir
from betty_trainer.training.step import MicroBatches, micro_batch_backward
from partition import Plan, redundancy

logger = logging.getLogger(__name__)
_INIT_STREAM = 1  # derive_seed(seed, 0, _INIT_STREAM) seeds parameter initialisation; epochs use (seed, epoch)
_PLAN_STREAM = (0, 2)  # derive_seed(seed, 0, 2) seeds the partitioner
EVAL_CHUNK = 8192  # dst nodes per block (layer-wise evaluation) or seeds per batch (batch evaluation)


@dataclass
class EpochMetrics:
    """One line of ``metrics.jsonl``. Accuracies are fractions in ``[0, 1]``; ``seconds`` is wall time;
    ``host_to_device_bytes`` is what training's feature gathers copied host→device in the epoch (the
    feature store's counter; 0 when training runs on the CPU; evaluation's gathers are not included)."""

    epoch: int
    loss: float
    train_acc: float
    val_acc: float | None
    test_acc: float | None
    micro_batches: int
    input_redundancy: float
    seconds: float
    host_to_device_bytes: int = 0


@dataclass
class TrainResult:
    """Summary of a run: the epoch with the best validation accuracy and its test accuracy."""

    run_dir: Path
    best_epoch: int
    best_val_acc: float
    test_acc: float
    last: EpochMetrics


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (numpy ``SeedSequence``), e.g. ``(seed, epoch)``."""
    return int(np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def init_model(config: Config, graph: Graph) -> nn.Module:
    """The built-in model of ``config.model``, initialised from ``config.seed`` alone
    (the caller's global RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, 0, _INIT_STREAM))
        return build_model(config.model, graph)


def split_seeds(train_idx: Tensor, batch_size: int | None, generator: torch.Generator) -> list[Tensor]:
    """The batches of one epoch: the full batch (``batch_size=None``) or shuffled mini-batches."""
    if batch_size is None or batch_size >= train_idx.numel():
        return [train_idx]
    return list(train_idx[torch.randperm(train_idx.numel(), generator=generator)].split(batch_size))


def make_sampler(config: Config, graph: Graph) -> Sampler:
    """The sampler of ``config.sampling`` on ``graph``: neighbour sampling with ``fanouts`` (input layer
    first; ``None`` everywhere, the default, is the full neighbourhood)."""
    return NeighborSampler(graph, config.sampling.fanouts or [None] * config.model.num_layers)


def epoch_seeds(config: Config, graph: Graph, epoch: int) -> list[Tensor]:
    """The seed nodes of each batch of ``epoch``, in training order: the full batch of training nodes, or
    mini-batches of ``sampling.batch_size`` shuffled by ``(seed, epoch)`` (:func:`split_seeds`)."""
    generator = torch.Generator().manual_seed(derive_seed(config.seed, epoch))
    return split_seeds(graph.train_idx, config.sampling.batch_size, generator)


def plan_seed(config: Config) -> int:
    """The seed of the partitioner's randomness (a 31-bit int, as METIS takes). The same in every epoch,
    so a batch identical to the last one (a full-neighbourhood full batch) reuses its plan, in a resumed
    run as in an uninterrupted one."""
    return derive_seed(config.seed, *_PLAN_STREAM) % 2**31


def first_batch(config: Config, graph: Graph) -> Batch:
    """The batch training starts with (epoch 0, batch 0), as ``train`` samples it: what
    ``betty-train plan`` plans."""
    return make_sampler(config, graph).sample(epoch_seeds(config, graph, 0)[0], SampleKey(config.seed, 0, 0))


def accumulate_gradients(
    model: nn.Module,
    micro_batches: Sequence[Batch],
    features: Tensor | FeatureStore,
    labels: Tensor,
    device: torch.device,
) -> tuple[float, int]:
    """Forward and backward every micro-batch, accumulating ``∇ mean_{i∈V} loss_i`` in ``.grad``.

    Micro-batch ``k`` contributes ``Σ_{i∈V_k} CE_i / |V|`` with ``|V|`` the batch's
    output count (Betty §4.2.3), so the sum equals the full-batch gradient. Each
    micro-batch is released before the next is read, so with
    :class:`~betty_trainer.training.step.MicroBatches` (which builds a micro-batch when it is read)
    one micro-batch is alive at a time.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs, C)`` logits.
        micro_batches: disjoint micro-batches of one batch.
        features: the :class:`~betty_trainer.data.feature_store.FeatureStore` the input rows are
            gathered from, or an ``(N, F)`` tensor (wrapped unpinned, see
            :func:`~betty_trainer.data.feature_store.as_feature_store`).
        labels: ``(N,)`` int64 labels.
        device: where the model runs.

    Returns:
        The batch's mean loss and the number of correctly classified outputs.

    Raises:
        TrainingError: if a loss is NaN or infinite (no gradient of that batch is applied).
    """
    features = as_feature_store(features)
    if isinstance(micro_batches, MicroBatches):
        total = micro_batches.num_outputs  # without building the micro-batches
    else:
        total = sum(mb.output_nodes.numel() for mb in micro_batches)
    loss_sum, correct, index = 0.0, 0, 0
    for micro_batch in micro_batches:  # not enumerate(), whose cached result tuple keeps the previous item alive
        try:
            loss, right = micro_batch_backward(model, micro_batch, features, labels, device, total)
        except TrainingError as error:
            raise TrainingError(f"{error} in micro-batch {index}; try a lower optim.lr") from None
        del micro_batch  # gone before the next one is built
        loss_sum, correct, index = loss_sum + loss, correct + right, index + 1
    return loss_sum, correct


def full_neighbourhood_batches(graph: Graph, nodes: Tensor, num_layers: int,
                               batch_size: int = EVAL_CHUNK) -> Iterator[Batch]:
    """Full-neighbourhood batches over ``nodes`` in chunks of ``batch_size`` seeds, each sampled
    when it is read (for :func:`evaluate`)."""
    return (sample_batch(graph, chunk, [None] * num_layers) for chunk in nodes.split(batch_size))


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], features: Tensor | FeatureStore, labels: Tensor,
             device: torch.device) -> float:
    """Accuracy over the output nodes of ``batches``, in eval mode (no dropout).

    This is batch evaluation (any model); :func:`evaluate_splits` evaluates the built-in
    models layer by layer instead.

    Args:
        model: the model.
        batches: e.g. from :func:`full_neighbourhood_batches`.
        features: the feature store, or an ``(N, F)`` tensor.
        labels: ``(N,)`` int64 labels.
        device: where the model runs.

    Returns:
        Fraction in ``[0, 1]`` of outputs whose argmax logit is the label; ``nan`` with no outputs.
    """
    features = as_feature_store(features)
    was_training = model.training
    model.eval()
    correct, total = 0, 0
    for batch in batches:
        logits = model(batch.to(device).blocks, features.gather(batch.input_nodes, device))
        correct += int((logits.argmax(1).cpu() == labels[batch.output_nodes]).sum())
        total += batch.output_nodes.numel()
    model.train(was_training)
    return correct / total if total else float("nan")


def evaluates_layerwise(model: nn.Module) -> bool:
    """Whether :func:`layerwise_logits` computes ``model``'s function: a
    :class:`~betty_trainer.models.stack.LayerStack` (every built-in model) whose ``forward``
    is the stack's own."""
    return isinstance(model, LayerStack) and type(model).forward is LayerStack.forward


@torch.no_grad()
def layerwise_logits(model: LayerStack, graph: Graph, features: Tensor | FeatureStore, device: torch.device,
                     nodes: Tensor | None = None, chunk_size: int = EVAL_CHUNK) -> Tensor:
    """Logits of ``nodes`` computed one layer at a time over the whole graph, in eval mode.

    Layer ``l`` of an ``L``-layer stack is computed for every node of the graph (the
    output layer only for ``nodes``), ``chunk_size`` dst nodes at a time: a one-layer block
    holding each chunk's full in-neighbourhood reads the previous layer's output of all
    nodes (layer 0: the features, gathered from ``features``). Every node's hidden
    representation is computed once per layer, not once per evaluation batch whose
    ``L``-hop neighbourhood holds it, and no multi-layer batch is built (the layer-wise
    inference of DGL's GraphSAGE example). The result equals ``model`` applied to
    full-neighbourhood batches of ``nodes`` up to floating-point reassociation. Each
    layer's output for all nodes is kept in host memory (pinned when ``device`` is CUDA):
    ``N × hidden`` values, two layers at a time.

    Args:
        model: a :class:`~betty_trainer.models.stack.LayerStack` (see :func:`evaluates_layerwise`).
        graph: the graph (its CSC in-edges give the neighbourhoods).
        features: the feature store, or an ``(N, F)`` tensor.
        device: where the model runs.
        nodes: ``(n,)`` int64 ids whose logits are returned; default: every node.
        chunk_size: dst nodes per one-layer block.

    Returns:
        ``(n, C)`` logits on the CPU, in the order of ``nodes``.

    Raises:
        ValueError: if ``nodes`` is empty or ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    nodes = torch.arange(graph.num_nodes) if nodes is None else nodes
    if nodes.numel() == 0:
        raise ValueError("layerwise_logits needs at least one node")
    store, pin = as_feature_store(features), device.type == "cuda"
    last = len(model.layers) - 1
    was_training = model.training
    model.eval()
    try:
        for index in range(last + 1):
            dst = nodes if index == last else torch.arange(graph.num_nodes)
            out = None
            for chunk in dst.split(chunk_size):
                block = sample_block(graph, chunk, None)
                h = model.layer_forward(index, block.to(device), store.gather(block.src_nodes, device))
                if out is None:
                    out, start = torch.empty(dst.numel(), h.shape[1], dtype=h.dtype, pin_memory=pin), 0
                out[start:start + chunk.numel()].copy_(h)
                start += chunk.numel()
            store = HostFeatureStore(out, pin=pin)  # this layer's output is the next layer's input
    finally:
        model.train(was_training)
    return out


def evaluate_splits(model: nn.Module, graph: Graph, features: Tensor | FeatureStore, device: torch.device,
                    splits: Mapping[str, Tensor], num_layers: int, chunk_size: int = EVAL_CHUNK) -> dict[str, float]:
    """Accuracy of ``model`` on each split of node ids, in eval mode (no dropout).

    Built-in models (:func:`evaluates_layerwise`) are evaluated layer by layer, once for all
    splits together (:func:`layerwise_logits`); any other model on full-neighbourhood
    batches of each split, sampled one chunk at a time (:func:`full_neighbourhood_batches`,
    :func:`evaluate`). Both compute the same logits.

    Args:
        model: the model.
        graph: the graph (labels ``graph.y``).
        features: the feature store, or an ``(N, F)`` tensor.
        device: where the model runs.
        splits: name → ``(n,)`` int64 node ids, e.g. ``{"val": graph.val_idx, "test": graph.test_idx}``.
        num_layers: blocks per batch (batch evaluation only).
        chunk_size: dst nodes per block (layer-wise) or seeds per batch.

    Returns:
        name → fraction in ``[0, 1]`` of the split's nodes whose argmax logit is the label;
        ``nan`` for an empty split.
    """
    features = as_feature_store(features)
    if not evaluates_layerwise(model):
        return {name: evaluate(model, full_neighbourhood_batches(graph, nodes, num_layers, chunk_size),
                               features, graph.y, device) for name, nodes in splits.items()}
    accuracy = {name: float("nan") for name in splits}
    present = {name: nodes for name, nodes in splits.items() if nodes.numel()}
    if present:
        logits = layerwise_logits(model, graph, features, device, torch.cat(list(present.values())), chunk_size)
        for (name, nodes), part in zip(present.items(), logits.split([n.numel() for n in present.values()])):
            accuracy[name] = int((part.argmax(1) == graph.y[nodes]).sum()) / nodes.numel()
    return accuracy


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` when available, else ``cpu``.

    Raises:
        ConfigError: for an unknown device or CUDA requested without a GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"invalid config value for 'train.device' ({name!r}): use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no CUDA GPU is available; use train.device=cpu")
    return device


@holds_run_directories  # the run directory's lock is released when train() returns or raises
def train(
    config: Config,
    *,
    model: nn.Module | None = None,
    graph: Graph | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
) -> TrainResult:
    """Train a model with micro-batch gradient accumulation, writing a run directory.

    The run directory holds ``config.yaml`` (resolved config), ``metrics.jsonl``
    (one :class:`EpochMetrics` per epoch), ``plan.json`` (the first batch's micro-batch
    plan) and ``checkpoint.pt`` (replaced atomically after every epoch). ``resume=True``
    continues from that checkpoint and gives the same parameters as an uninterrupted run
    (sampling and dropout are keyed by ``(seed, epoch, step)``, not by RNG state).

    Args:
        config: the run configuration.
        model: a custom ``nn.Module`` with ``forward(blocks, x)``; default: built from ``config.model``.
        graph: a graph to train on; default: loaded from ``config.dataset``.
        run_dir: overrides ``config.train.run_dir``.
        resume: continue the run in ``run_dir``.

    Returns:
        A :class:`TrainResult` (model chosen on validation accuracy).

    Raises:
        BettyError: bad dataset or config, NaN loss (:class:`TrainingError`), unusable checkpoint.
        RunDirError: the run directory is held by another run (its ``run.lock`` names the holder),
            is read-only, or its disk is full (the last good checkpoint is kept).
    """
    device = resolve_device(config.train.device)
    graph = graph if graph is not None else load_dataset(config.dataset)
    if graph.train_idx.numel() == 0:
        raise ConfigError(f"dataset {graph.name!r} has no training nodes")
    planner = make_planner(config, graph, model, device)
    model = (model if model is not None else init_model(config, graph)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    sampler = make_sampler(config, graph)
    features = HostFeatureStore(graph.x, pin=device.type == "cuda")
    splits = {"val": graph.val_idx, "test": graph.test_idx}

    run = RunDirectory.open(run_dir or new_run_dir(config), create=not resume)  # refused if another run holds it
    run_dir, metrics_path = run.path, run.path / "metrics.jsonl"
    start_epoch, best = 0, {"epoch": -1, "val_acc": -1.0, "test_acc": float("nan")}
    if resume:
        state = load_checkpoint(run_dir)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        _truncate_metrics(metrics_path, state["epoch"])
    else:
        run.write_text("metrics.jsonl", "")
    run.write_text("config.yaml", config.to_yaml())

    last = None
    model.train()
    with _progress(config.train.progress) as progress:
        task = progress.add_task(f"{graph.name} · {config.micro_batch.partitioner}", total=config.optim.epochs,
                                 completed=start_epoch, status="")
        for epoch in range(start_epoch, config.optim.epochs):
            started = time.perf_counter()
            seed_batches = epoch_seeds(config, graph, epoch)
            loss_sum, correct, k_used, input_redundancy = 0.0, 0, 0, 0.0
            moved_before = features.stats.host_to_device_bytes
            for index, seeds in enumerate(seed_batches):
                batch = sampler.sample(seeds, SampleKey(config.seed, epoch, index))
                set_dropout_key(model, config.seed, epoch * len(seed_batches) + index)
                outcome = _train_batch(model, optimizer, planner, batch, features, graph.y, device,
                                       plan_seed(config), where=f"epoch {epoch}, batch {index}",
                                       run_dir=run_dir)
                optimizer.step()
                if epoch == 0 and index == 0:  # the plan of the first batch, as `betty-train plan` prints it
                    report = plan_report(planner, batch, outcome.batches, outcome.plan)
                    run.write_text("plan.json", json.dumps(report, indent=2))
                loss_sum += outcome.loss * seeds.numel()
                correct += outcome.correct
                k_used = max(k_used, len(outcome.batches))
                input_redundancy = max(input_redundancy, redundancy(batch.blocks, outcome.plan.layers)[0])
            moved = features.stats.host_to_device_bytes - moved_before

            evaluate_now = (epoch + 1) % config.train.eval_every == 0 or epoch + 1 == config.optim.epochs
            accuracy = evaluate_splits(model, graph, features, device, splits, config.model.num_layers) if evaluate_now else {}
            val_acc, test_acc = accuracy.get("val"), accuracy.get("test")
            if val_acc is not None and val_acc > best["val_acc"]:
                best = {"epoch": epoch, "val_acc": val_acc, "test_acc": test_acc}
            last = EpochMetrics(epoch, loss_sum / graph.train_idx.numel(), correct / graph.train_idx.numel(),
                                val_acc, test_acc, k_used, input_redundancy, time.perf_counter() - started,
                                host_to_device_bytes=moved)
            run.append_line("metrics.jsonl", json.dumps(asdict(last)))
            save_checkpoint(run_dir, {"epoch": epoch, "model": model.state_dict(),
                                      "optimizer": optimizer.state_dict(), "best": best})
            progress.update(task, advance=1, status=_status(last, best))

    if last is None:
        raise TrainingError(f"run in {run_dir} already finished {config.optim.epochs} epochs; raise optim.epochs to continue")
    return TrainResult(run_dir, best["epoch"], best["val_acc"], best["test_acc"], last)


@dataclass
class _BatchOutcome:
    batches: MicroBatches
    plan: Plan
    loss: float
    correct: int


def _train_batch(model: nn.Module, optimizer: torch.optim.Optimizer, planner: MicroBatchPlanner, batch: Batch,
                 features: FeatureStore, labels: Tensor, device: torch.device, seed: int, where: str,
                 run_dir: Path) -> _BatchOutcome:
    """Plan, accumulate gradients over the micro-batches, each built when it runs (no optimizer step).

    A CUDA out-of-memory error in a micro-batch discards that batch's partial
    gradients, re-plans with more micro-batches and redoes the batch (Betty §4.4.3),
    so the step still happens once, with the gradient of the whole batch.
    """
    min_k = 1
    while True:
        micro_batches, plan = planner.plan(batch, seed, min_k)
        optimizer.zero_grad(set_to_none=True)
        try:
            loss, correct = accumulate_gradients(model, micro_batches, features, labels, device)
            return _BatchOutcome(micro_batches, plan, loss, correct)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if plan.k >= batch.output_nodes.numel():
                raise TrainingError(f"{where}: out of memory even with one output node per micro-batch") from None
            min_k = plan.k + 1
            logger.warning("%s: out of memory with K=%d micro-batches; re-planning with K ≥ %d", where, plan.k, min_k)
        except TrainingError as error:
            raise TrainingError(f"{where}: {error}; last checkpoint: {run_dir}") from None


def _status(metrics: EpochMetrics, best: dict) -> str:
    val = "-" if metrics.val_acc is None else f"{metrics.val_acc:.3f}"
    return f"loss {metrics.loss:.4f} · val {val} · best val {best['val_acc']:.3f} (test {best['test_acc']:.3f})"


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("epochs"),
        TimeElapsedColumn(), TextColumn("{task.fields[status]}"), disable=not enabled,
    )


def _truncate_metrics(path: Path, last_epoch: int) -> None:
    """Drop metric lines written after the checkpoint's epoch (a crash between the two writes)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["epoch"] <= last_epoch]
    path.write_text("".join(line + "\n" for line in kept))
