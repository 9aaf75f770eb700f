"""The training loop: sample → partition into micro-batches → accumulate gradients → step (Betty §4.2).

Reads top to bottom (see :func:`train`). One optimizer step per batch; micro-batch
``k`` contributes ``Σ_{i∈V_k} loss_i / |V|``, so the accumulated gradient is the
full batch's gradient.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

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
from betty_trainer.rng import derive_seed
from betty_trainer.sampling import SampleKey
from betty_trainer.sampling.schedule import epoch_seeds, make_sampler, plan_seed
from betty_trainer.training.checkpoint import load_checkpoint, save_checkpoint
from betty_trainer.training.evaluation import evaluate_splits
from betty_trainer.training.rundir import RunDirectory, holds_run_directories, new_run_dir
from betty_trainer.training.step import MicroBatches, micro_batch_backward
from partition import Plan, redundancy

logger = logging.getLogger(__name__)
_INIT_STREAM = 1  # derive_seed(seed, 0, _INIT_STREAM) seeds parameter initialisation; epochs use (seed, epoch)


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


def init_model(config: Config, graph: Graph) -> nn.Module:
    """The built-in model of ``config.model``, initialised from ``config.seed`` alone
    (the caller's global RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, 0, _INIT_STREAM))
        return build_model(config.model, graph)


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
