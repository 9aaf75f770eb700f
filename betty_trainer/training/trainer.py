"""The training loop: sample → plan → forward and backward the plan's pieces → one optimizer step (Betty §4.2).

:func:`train` reads top to bottom: setup apart (:func:`_prepare`), then per batch the plan, ``zero_grad``, the
plan's ``run`` (micro-batches or layer-wise chunks: each piece contributes ``Σ_{i∈V_k} loss_i / |V|``, so the
accumulated gradient is the full batch's) and ``optimizer.step()``, with the out-of-memory re-plan as its one
wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import yaml
from rich.console import Console
from torch import nn
from torch.profiler import record_function

from betty_trainer.config import Config
from betty_trainer.data.cache import make_feature_store
from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore, TransferStats
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import load_dataset, no_training_nodes_message
from betty_trainer.distributed.exchange import ExchangeTraffic
from betty_trainer.distributed.group import Processes, leave
from betty_trainer.errors import (
    ConfigError,
    NonFiniteLossError,
    PlanningError,
    TrainingError,
    host_memory_as_one_line,
)
from betty_trainer.execution.plan import StepPlan, StepResult
from betty_trainer.memory.planner import Planner, make_planner
from betty_trainer.models import build_model, set_dropout_key
from betty_trainer.phases import EVALUATE, OPTIMIZER, PLAN, PREPARE, STAGE, STEP
from betty_trainer.process import warn_default_allocator, warn_spinning_openmp
from betty_trainer.rng import derive_seed
from betty_trainer.sampling.base import Sampler
from betty_trainer.sampling.schedule import (
    batch_rounds,
    check_macro_batch_budget,
    epoch_seeds,
    first_batch,
    make_sampler,
    plan_seed,
)
from betty_trainer.training.aggregation import check_aggregation_cache, input_features, without_aggregation_cache
from betty_trainer.training.checkpoint import (
    BEST_NAME,
    CHECKPOINT_NAME,
    FORMAT,
    LAST_NAME,
    checksum_path,
    dataset_identity,
    identity,
    identity_difference,
    load_checkpoint,
    non_finite,
    save_checkpoint,
    split_refusal,
    state_dict_difference,
)
from betty_trainer.training.distributed import finish_together, join_run, leader_value, rank_metrics, this_rank
from betty_trainer.training.evaluation import EVAL_CHUNK, EVALUATION_HOST_MEMORY, fitting_chunks, splits_accuracy
from betty_trainer.training.output import EpochProgress, epoch_status, quiet_native_stderr
from betty_trainer.training.preflight import check_config, check_model_size, resolve_device
from betty_trainer.training.rundir import (
    TENSORBOARD_DIR,
    RunDirectory,
    config_changes,
    environment,
    holds_checkpoint,
    holds_run_directories,
    new_run_dir,
    write_text,
)
from partition import GraphPartition

logger = logging.getLogger(__name__)
_INIT_STREAM = 1  # derive_seed(seed, 0, _INIT_STREAM) seeds parameter initialisation; epochs use (seed, epoch)


@dataclass
class EpochMetrics:
    """One line of ``metrics.jsonl``. Accuracies are fractions in ``[0, 1]``; ``seconds`` is wall time;
    ``host_to_device_bytes`` is what training's feature gathers copied host→device in the epoch (the
    feature store's counter; 0 when training runs on the CPU; evaluation's gathers are not included);
    ``lr`` is the learning rate of the epoch's optimizer steps; ``feature_hits`` and ``feature_misses`` are the
    input rows training's gathers found on the device (a node cache, a staged macro-batch) and read from the
    host, and ``cache_fill_bytes`` the bytes read to fill the node cache (docs/design.md › Feature store). In a
    distributed run (``distributed.mode``) those counters are summed over the ranks, ``exchanged_bytes`` is what the
    ranks sent each other (sampled ids, rows and row gradients of cooperative exchanges; gradients' all-reduce not
    included), and ``ranks`` holds each rank's counters; both are ``None`` in a single process."""

    epoch: int
    loss: float
    train_acc: float
    val_acc: float | None
    test_acc: float | None
    micro_batches: int
    input_redundancy: float
    seconds: float
    host_to_device_bytes: int = 0
    lr: float | None = None
    feature_hits: int = 0
    feature_misses: int = 0
    cache_fill_bytes: int = 0
    exchanged_bytes: int | None = None
    ranks: list[dict] | None = None


@dataclass
class TrainResult:
    """Summary of a run: the epoch with the best validation accuracy (the model in ``best.pt``) and its
    test accuracy, the last epoch's metrics, and whether early stopping ended the run."""

    run_dir: Path
    best_epoch: int
    best_val_acc: float
    test_acc: float
    last: EpochMetrics
    stopped_early: bool = False


def init_model(config: Config, graph: Graph) -> nn.Module:
    """The built-in model of ``config.model``, initialised from ``config.seed`` alone
    (the caller's global RNG state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(config.seed, 0, _INIT_STREAM))
        return build_model(config.model, graph)


@holds_run_directories  # the run directory's lock is released when train() returns or raises
def train(
    config: Config,
    *,
    model: nn.Module | None = None,
    graph: Graph | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
    console: Console | None = None,
) -> TrainResult:
    """Train a model with micro-batch gradient accumulation, writing a run directory.

    The run directory holds ``config.yaml`` (resolved config), ``environment.json`` (device, versions,
    git commit, command line), ``metrics.jsonl`` (one :class:`EpochMetrics` per epoch), ``plan.json``
    (the first batch's micro-batch plan), ``last.pt`` (replaced atomically after every epoch) and
    ``best.pt`` (the model chosen on validation accuracy), each checkpoint with its sha256 beside it
    (:mod:`betty_trainer.training.checkpoint`), and after a resume ``resumes.yaml``. Nothing is written
    before every check has passed and the data, the model and (on resume) the checkpoint are loaded,
    so a refused run leaves the directory as it was. ``resume=True`` continues from ``last.pt`` and
    gives the same parameters as an uninterrupted run (sampling and dropout are keyed by
    ``(seed, epoch, step)``, not by RNG state).

    Optional (off by default): a learning-rate schedule (``optim.scheduler``), early stopping when
    validation accuracy has not improved for ``train.patience`` epochs, and TensorBoard scalars in
    ``<run_dir>/tensorboard`` (``train.tensorboard``).

    Args:
        config: the run configuration.
        model: a custom ``nn.Module`` with ``forward(blocks, x)``; default: built from ``config.model``.
            Dropout must be :class:`~betty_trainer.models.NodeDropout` for micro-batches to give the
            full batch's gradient (``torch.nn.Dropout`` draws new masks per micro-batch: a warning).
        graph: a graph to train on; default: loaded from ``config.dataset``.
        run_dir: overrides ``config.train.run_dir``.
        resume: continue the run in ``run_dir``.
        overwrite: a new run may replace the run ``run_dir`` holds (its files are removed once training
            starts).
        command: the command line recorded in ``environment.json`` (default ``sys.argv``).
        console: where progress is printed (default: a ``rich`` console on stdout).

    Returns:
        A :class:`TrainResult` (model chosen on validation accuracy).

    Raises:
        BettyError: bad dataset or config, NaN loss or diverged parameters (:class:`TrainingError`,
            naming the last good checkpoint), a step or an evaluation out of host memory (:class:`TrainingError`,
            naming the last good checkpoint; a failed step's epoch is not saved, an epoch whose evaluation fails
            is, not evaluated), evaluation out of device memory with one node per chunk, unusable checkpoint, or a
            resume whose model or dataset differs from the checkpoint's.
        RunDirError: the run directory already holds a run (without ``resume`` or ``overwrite``), is held
            by another run (its ``run.lock`` names the holder), is a file, is read-only, or its disk is full
            (the last good checkpoint is kept).
    """
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite replaces it; give one of them")
    warn_spinning_openmp()
    device = resolve_device(config.train.device)
    warn_default_allocator(device.type)
    processes = join_run(config, device)  # None in one process; under torchrun rank 0 alone writes and prints
    with record_function(PREPARE):
        directory, path, run = _open(config, model, graph, run_dir, resume, overwrite, device, processes)
    device, console = run.device, console if console is not None and directory is not None else Console(
        quiet=directory is None)  # ranks other than 0 print nothing
    if directory is not None:
        _start(directory, config, run, device, overwrite, command)
    _print_start(console, config, run.graph, device, run.model, path, run.start_epoch, resume)
    graph = run.graph
    board = _tensorboard(config, path) if directory is not None else None
    last, stopped_early, best, warned, diverging = None, False, run.best, False, False
    run.model.train()
    try:
        with EpochProgress(console, f"{graph.name} · {config.micro_batch.partitioner}", config.optim.epochs,
                           run.start_epoch, live=config.train.progress) as progress:
            for epoch in range(run.start_epoch, config.optim.epochs):
                scalars = BOARD_SCALARS
                if run.unevaluated is not None:  # trained before the resume, whose evaluation failed then
                    unevaluated, run.unevaluated, run.start_epoch = run.unevaluated, None, epoch + 1
                    scalars = EVALUATION_SCALARS  # its training's are on the board already
                else:
                    unevaluated, warned = _train_epoch(config, run, epoch, directory, console, path, warned)
                diverging = _check_divergence(config, graph, unevaluated, path, diverging)  # its loss alone
                accuracy = _evaluate_or_save(config, run, epoch, path, directory, unevaluated, best, board, scalars)
                last = replace(unevaluated, val_acc=accuracy.get("val"), test_acc=accuracy.get("test"))
                best = _end_epoch(directory, run, last, best, board, scalars=scalars)
                progress.advance(epoch, epoch_status(last, best))
                if _patience_exhausted(config, epoch, best) and last.val_acc is not None:
                    stopped_early = True
                    console.print(f"early stopping after epoch {epoch}: validation accuracy has not improved for "
                                  f"{epoch - best['epoch']} epoch(s) (train.patience={config.train.patience})",
                                  highlight=False, soft_wrap=True)
                    break
        finish_together(run.processes)  # no rank leaves while rank 0 still writes its last checkpoint
    except KeyboardInterrupt as error:
        _name_run(error, path)
        raise
    finally:
        if board is not None:
            board.close()
        leave()

    if last is None:
        raise TrainingError(f"run in {path} already finished {config.optim.epochs} epochs; raise optim.epochs to continue")
    return TrainResult(path, best["epoch"], best["val_acc"], best["test_acc"], last, stopped_early)


def _open(config: Config, model: nn.Module | None, graph: Graph | None, run_dir: Path | None, resume: bool,
          overwrite: bool, device: torch.device, processes: Processes | None) -> tuple[RunDirectory | None, Path, _Run]:
    """Check the config, hold the run directory (rank 0 alone in a distributed run; the others get ``None``) and
    prepare the run (:func:`_prepare`). A refusal leaves the directory as it was and the process group left."""
    leads, device = (True, device) if processes is None else (processes.leads, processes.device)
    path = Path(run_dir or leader_value(processes, lambda: str(new_run_dir(config))))
    check_config(config, dataset=graph is None, run_dir=path)
    directory = RunDirectory.open(path, create=not resume, overwrite=overwrite) if leads else None  # refused if held
    try:  # every check, and the data, model and checkpoint loaded, before anything is written
        return directory, path, _prepare(config, model, graph, path, resume, device, processes)
    except BaseException as error:  # refused before the run started: nothing written, a directory made for it removed
        _name_run(error, path)
        if directory is not None:
            directory.abandon()
        leave()
        raise


@dataclass
class _Run:
    """What a run holds once it is set up (:func:`_prepare`)."""

    graph: Graph
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    sampler: Sampler
    features: FeatureStore
    evaluation_features: FeatureStore
    planner: Planner
    identity: dict
    device: torch.device
    processes: Processes | None = None
    traffic: ExchangeTraffic = field(default_factory=ExchangeTraffic)  # bytes sent to other ranks (cooperative)
    start_epoch: int = 0
    best: dict = field(default_factory=lambda: _no_best())
    resumed_from: int | None = None
    evaluation_chunk: int = EVAL_CHUNK  # nodes per chunk of the last evaluation (halved after an out-of-memory error)
    unevaluated: EpochMetrics | None = None  # on resume, the checkpoint's epoch whose evaluation failed: evaluated first


def feature_store(config: Config, graph: Graph, device: torch.device, sampler: Sampler,
                  host: HostFeatureStore | None = None) -> FeatureStore:
    """The feature store ``config.features`` names for a run on ``device`` (:func:`~betty_trainer.data.cache.
    make_feature_store`; a ``gns`` cache holds ``sampler``'s node cache) over ``host``, the host store of the rows
    training gathers (default: one of :func:`~betty_trainer.training.aggregation.input_features`, ``graph.x`` or
    with ``features.aggregation_cache`` the cache's rows).

    Raises:
        ConfigError: macro-batches under a budget without ``features.macro_batch_budget``
            (:func:`~betty_trainer.sampling.schedule.check_macro_batch_budget`); see ``make_feature_store``.
    """
    check_macro_batch_budget(config)
    features = config.features
    if host is None:
        host = HostFeatureStore(input_features(config, graph), pin=device.type == "cuda")
    return make_feature_store(graph, device, features.cache.kind, features.cache.size,
                              macro_batch=features.macro_batch > 0, stage_budget=features.macro_batch_budget,
                              node_source=sampler.node_cache, host=host)


def data_path(config: Config, graph: Graph, device: torch.device, model: nn.Module | None, host: HostFeatureStore,
              epoch: int = 0) -> tuple[Sampler, FeatureStore, Planner, bool]:
    """A run's sampler, feature store (over ``host``, the host store of ``graph.x``, or with the aggregation cache
    over its rows) and planner (of the built-in model when ``model`` is ``None``), and whether layer 0 reads the
    aggregation cache.

    With ``features.aggregation_cache: true`` under ``micro_batch.mode: auto`` the cache is kept only where the
    estimate says it helps (BatchGNN App. C: it reads more where layer 0's dst nodes are about as many as its src
    nodes): epoch ``epoch``'s first batch is planned with and without it, and the run takes the cache unless the plan
    without it is estimated lower (without a budget: its peak; under one: its work, both fitting) or only that one
    fits. The cache is exact, so either way the run computes the same gradients; the choice is logged.
    ``approximate``, which changes what layer 0 computes, is never switched off.

    Raises:
        ConfigError, CalibrationError: see :func:`feature_store` and :func:`~betty_trainer.memory.planner.make_planner`.
    """
    def build(run_config: Config, partition: GraphPartition | None = None) -> tuple[Sampler, FeatureStore, Planner]:
        sampler = make_sampler(run_config, graph)
        cached = run_config.features.aggregation_cache is not False
        features = feature_store(run_config, graph, device, sampler, None if cached else host)
        with quiet_native_stderr():  # calibrating a custom model profiles steps; the profiler's chatter is hidden
            return sampler, features, make_planner(run_config, graph, model, device, features, plan_seed(run_config),
                                                   partition, sampler.bulk_draw)

    chosen, cached = build(config), config.features.aggregation_cache is not False
    if config.features.aggregation_cache is True and config.micro_batch.mode == "auto":
        plain_config = without_aggregation_cache(config)
        plain = build(plain_config, chosen[2].graph_partition)  # the cache changes no METIS cut of the graph
        with_cache, without = (_first_plan(run_config, graph, path, epoch)
                               for run_config, path in ((config, chosen), (plain_config, plain)))
        budget = chosen[2].budget is not None
        if with_cache is not None and without is not None:
            cached = with_cache.work <= without.work if budget else with_cache.estimate <= without.estimate
        else:
            cached = without is None
        logger.info("micro_batch.mode=auto %s the aggregation cache: epoch %d's first batch is estimated at %s with "
                    "it and %s without it", "keeps" if cached else "leaves out", epoch, _estimated(with_cache),
                    _estimated(without))
        chosen = chosen if cached else plain
    return (*chosen, cached)


def _estimated(plan: StepPlan | None) -> str:
    return "no plan fitting" if plan is None else f"{(plan.estimate or 0) / 2**20:.1f} MiB (work {plan.work:.3g})"


def _first_plan(config: Config, graph: Graph, path: tuple[Sampler, FeatureStore, Planner], epoch: int) -> StepPlan | None:
    """Epoch ``epoch``'s first batch planned on ``path`` (its sampler and planner), or ``None`` where no plan fits."""
    sampler, _, planner = path
    try:
        return planner.plan(first_batch(config, graph, sampler, epoch))
    except PlanningError:
        return None


def _prepare(config: Config, model: nn.Module | None, graph: Graph | None, path: Path, resume: bool,
             device: torch.device, processes: Processes | None = None) -> _Run:
    """Load the checkpoint (on resume, verified before any data is read) and the data, build the sampler, feature
    store and planner, plan the first batch (an impossible budget is refused here), then build the model and its
    optimizer and restore them on resume. Writes nothing. In a distributed run (``processes``) the ranks agree on
    the config and dataset first, and the sampler and planner are this rank's."""
    state = load_checkpoint(path) if resume else None
    if state is not None:
        _check_resumable(config, state, path)
        _check_best(path, state)
    split = config.dataset.split if graph is None else None  # a graph given from Python carries its own split
    if state is not None and graph is None:
        refusal = split_refusal(state["identity"], split)
        if refusal is not None:
            raise TrainingError(f"cannot resume {path}: {refusal}")
    graph = graph if graph is not None else load_dataset(config.dataset)
    if graph.train_idx.numel() == 0:
        raise ConfigError(no_training_nodes_message(graph.name))
    builtin = model is None
    check_aggregation_cache(config, model)
    if builtin:
        check_model_size(config, graph, device)
    dataset, epoch = dataset_identity(graph, split), state["epoch"] + 1 if state is not None else 0
    host = HostFeatureStore(graph.x, pin=device.type == "cuda")  # evaluation's; training's too without the cache
    sampler, features, planner, _ = data_path(config, graph, device, model, host, epoch)
    sampler, planner, traffic = this_rank(config, graph, dataset["fingerprint"], sampler, planner, processes)
    # the first batch's plan: an impossible budget is refused before the model is allocated
    planner.plan(first_batch(config, graph, sampler, epoch))
    model = _allocate(lambda: (model if model is not None else init_model(config, graph)).to(device), device)
    optimizer = config.optim.make_optimizer(model.parameters())
    if builtin and config.model.arch == "gcn" and config.sampling.sampler == "gns":
        logger.warning("GCN sums its neighbours, and GNS's importance weights leave a weighted sum biased upward on "
                       "the rows whose count of cached neighbours crosses the fanout from cache to cache (median "
                       "+13% on those rows, Amazon Computers, fanout 10; README › GNS); SAGE's mean is close to "
                       "unbiased under GNS (model.arch=sage)")
    model_id = config.model.model_dump(mode="json") if builtin else {"custom": qualified_name(model)}
    # evaluation reads every node's rows: through the host store, so an LRU cache keeps the training working set
    run = _Run(graph, model, optimizer, make_scheduler(config, optimizer), sampler, features, host, planner,
               identity(dataset, model_id, model.state_dict()), device, processes, traffic)
    if processes is not None:
        run.identity["distributed"] = {"mode": config.distributed.mode, "world_size": processes.world_size}
    if state is not None:
        _restore(config, run, state, path)
    return run


def _restore(config: Config, run: _Run, state: dict, path: Path) -> None:
    """Load the checkpoint ``state`` of the run in ``path`` (its model, optimizer and schedule) into ``run`` after
    checking that they belong to it."""
    scheduler = run.scheduler
    saved_world = state["identity"].get("distributed", {"mode": "none", "world_size": 1})
    world = run.identity.get("distributed", {"mode": "none", "world_size": 1})
    if saved_world != world:
        raise TrainingError(f"cannot resume {path}: it trained with distributed.mode={saved_world['mode']} on "
                            f"{saved_world['world_size']} process(es), this is {world['mode']} on {world['world_size']}; "
                            "resume with the run's mode and number of processes (torchrun --nproc-per-node)")
    difference = identity_difference(state["identity"], run.identity)
    if difference is not None:
        raise TrainingError(f"cannot resume {path}: {difference}; resume with the run's own model and dataset, "
                            "or start a new run (--overwrite, or another train.run_dir)")
    if isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR) and state.get("scheduler") \
            and state["scheduler"].get("T_max") != config.optim.epochs:
        raise TrainingError(f"cannot resume {path}: optim.scheduler=cosine anneals over optim.epochs "
                            f"({state['scheduler'].get('T_max')} in the run, {config.optim.epochs} here); "
                            "resume with the run's optim.epochs, or start a new run")
    if (state.get("scheduler") is None) != (scheduler is None):
        raise TrainingError(f"cannot resume {path}: optim.scheduler differs from the run's "
                            f"({config.optim.scheduler!r} here); resume with the run's optim.scheduler")
    misfit = state_dict_difference(run.model.state_dict(), state["model"])
    if misfit is not None:
        raise TrainingError(f"cannot resume {path}: {CHECKPOINT_NAME} does not fit this model ({misfit}); start a "
                            "new run")
    try:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise TrainingError(f"cannot resume {path}: {CHECKPOINT_NAME} does not fit this model "
                            f"({str(error).strip().splitlines()[0]}); start a new run") from None
    run.start_epoch, run.best, run.resumed_from = state["epoch"] + 1, state["best"], state["epoch"]
    if state.get("unevaluated") is not None:  # its training was saved, its evaluation failed: the resume evaluates it
        try:
            run.unevaluated = EpochMetrics(**state["unevaluated"])
        except TypeError as error:
            raise TrainingError(f"cannot resume {path}: {CHECKPOINT_NAME}'s unevaluated epoch metrics do not fit "
                                f"({error}); start a new run") from None
        if run.unevaluated.epoch != state["epoch"]:
            raise TrainingError(f"cannot resume {path}: {CHECKPOINT_NAME} holds epoch {state['epoch']}'s training but "
                                f"unevaluated metrics of epoch {run.unevaluated.epoch!r}; start a new run")
        run.start_epoch, run.resumed_from = state["epoch"], state["epoch"] - 1
    apply_optim_config(config, run.optimizer, scheduler)


def _start(directory: RunDirectory, config: Config, run: _Run, device: torch.device, overwrite: bool,
           command: Sequence[str] | None) -> None:
    """Everything is checked and loaded: the run really starts (or resumes) here, and its files are written."""
    if run.resumed_from is not None:
        _truncate_metrics(directory.path / "metrics.jsonl", run.resumed_from)
        _record_resume(directory, config, run.start_epoch, environment(device, command))
    else:
        if overwrite:
            directory.clear()
        directory.write_text("environment.json", json.dumps(environment(device, command), indent=2) + "\n")
        directory.write_text("metrics.jsonl", "")
    directory.write_text("config.yaml", config.to_yaml())


TRAINING_HOST_MEMORY = "lower model.hidden or sampling.batch_size, or raise micro_batch.num_micro_batches"
"""What to do when a training step runs out of host memory."""


@contextlib.contextmanager
def _named_failures(where: str, path: Path, epoch: int, since_checkpoint: int) -> Iterator[None]:
    """A batch's :class:`TrainingError` or host out-of-memory error as a :class:`TrainingError` naming the batch
    and the last good checkpoint (:func:`_last_good`); only a NaN or infinite loss (:class:`NonFiniteLossError`) is
    told to try a lower learning rate, and, when ``since_checkpoint`` (the optimizer steps taken since ``last.pt``
    was written) is 0, that ``last.pt`` itself gives this loss. Running out of host memory
    (:func:`~betty_trainer.errors.host_allocation_failure`) says what to lower (:data:`TRAINING_HOST_MEMORY`). A CUDA
    out-of-memory error passes: the loop re-plans."""
    try:
        with host_memory_as_one_line(lambda cause: f"out of host memory ({cause}); {TRAINING_HOST_MEMORY}"):
            yield
    except torch.cuda.OutOfMemoryError:
        raise
    except NonFiniteLossError as error:
        if since_checkpoint == 0 and epoch > 0 and holds_checkpoint(path):
            raise NonFiniteLossError(f"{where}: {error}; {_diverged_before(path, epoch)}") from None
        raise NonFiniteLossError(f"{where}: {error}; try a lower optim.lr; {_last_good(path, epoch)}") from None
    except TrainingError as error:  # the host out-of-memory one included
        raise TrainingError(f"{where}: {error}; {_last_good(path, epoch)}") from None



def _replan(planner: Planner, plan: StepPlan, where: str, device: torch.device) -> StepPlan:
    """The plan of a batch whose ``plan`` ran out of device memory: at least twice the pieces (Betty §4.4.3), at
    most one output node per piece. Under ``micro_batch.mode=auto`` the planner again keeps, of micro-batches and
    layer-wise chunks at that count, the plan of less estimated work that fits the budget. The caller has already
    dropped the failed attempt's tensors and partial gradients; the cached blocks they leave are handed back to the
    device here (``torch.cuda.empty_cache``), and the batch is redone from its start, so the optimizer step still
    happens once, with the whole batch's gradient.

    Raises:
        TrainingError: the plan had one output node per piece already.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
    outputs = plan.batch.output_nodes.numel()
    if plan.pieces >= outputs:
        raise TrainingError(f"{where}: out of memory even with one output node per micro-batch") from None
    pieces = min(2 * plan.pieces, outputs)
    logger.warning("%s: out of memory with K=%d; re-planning with K ≥ %d", where, plan.pieces, pieces)
    return planner.plan(plan.batch, pieces)


@dataclass
class _EpochTotals:
    """An epoch's sums over its batches, for its :class:`EpochMetrics`."""

    gathered_before: TransferStats
    exchanged_before: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    pieces: int = 0
    input_redundancy: float = 0.0

    @classmethod
    def start(cls, run: _Run) -> _EpochTotals:
        return cls(run.features.stats.snapshot(), run.traffic.total)

    def add(self, plan: StepPlan, result: StepResult, outputs: int) -> None:
        self.loss_sum += result.loss * outputs
        self.correct += result.correct
        self.pieces = max(self.pieces, plan.pieces)
        self.input_redundancy = max(self.input_redundancy, plan.redundancy()[0])

    def metrics(self, epoch: int, run: _Run, stats: TransferStats, seconds: float, lr: float) -> EpochMetrics:
        """The epoch's :class:`EpochMetrics` before its evaluation (no accuracies), from the training store's counters
        ``stats`` at the epoch's end; in a distributed run the transfer counters are every rank's, summed, and per
        rank under ``ranks`` (a collective)."""
        gathered, trained = stats - self.gathered_before, run.graph.train_idx.numel()
        counters = {"host_to_device_bytes": gathered.host_to_device_bytes, "feature_hits": gathered.hits,
                    "feature_misses": gathered.misses, "cache_fill_bytes": gathered.cache_fill_bytes}
        if run.processes is not None:
            counters = rank_metrics(run.processes, counters, run.traffic.total - self.exchanged_before)
        return EpochMetrics(epoch, self.loss_sum / trained, self.correct / trained, None, None, self.pieces,
                            self.input_redundancy, seconds, lr=lr, **counters)



def _train_epoch(config: Config, run: _Run, epoch: int, directory: RunDirectory | None, console: Console, path: Path,
                 warned: bool) -> tuple[EpochMetrics, bool]:
    """Train epoch ``epoch``: every batch planned and stepped (a CUDA out-of-memory error re-plans the batch with more
    pieces and redoes it from its start), then the scheduler's step; the first batch's plan of the first epoch this
    process trains (``run.start_epoch``) is shown. Returns the epoch's metrics before its evaluation, and whether
    torch's dropout has been warned about (``warned``, said once).

    Raises:
        TrainingError: a step failed (:func:`_named_failures`), or the parameters are not finite after the epoch.
    """
    model, optimizer, planner, features, graph, device = (run.model, run.optimizer, run.planner, run.features,
                                                          run.graph, run.device)
    started, lr, steps = time.perf_counter(), optimizer.param_groups[0]["lr"], 0
    totals, seed_batches = _EpochTotals.start(run), epoch_seeds(config, graph, epoch)
    for batch_round in batch_rounds(config, run.sampler, seed_batches, epoch, features.row_bytes):
        with record_function(STAGE):  # a macro-batch's rows, staged on the device at once
            features.prefetch(batch_round.staged_nodes)
        for key, seeds, batch in batch_round.batches:
            features.begin_batch(key)  # a GNS cache takes the batch's node set
            set_dropout_key(model, config.seed, epoch * len(seed_batches) + key.step)
            with record_function(PLAN):
                where, plan = f"epoch {epoch}, batch {key.step}", planner.plan(batch)
            optimizer.zero_grad(set_to_none=True)
            while True:  # a CUDA out-of-memory error re-plans with more pieces and redoes the batch
                try:
                    with _named_failures(where, path, epoch, since_checkpoint=steps), record_function(STEP):
                        result = plan.run(model, features, graph.y, device)
                    break
                except torch.cuda.OutOfMemoryError:
                    pass  # leaving the handler drops the traceback, and with it the failed piece's tensors
                optimizer.zero_grad(set_to_none=True)  # the failed attempt's partial gradients
                plan = _replan(planner, plan, where, device)
            with record_function(OPTIMIZER):
                optimizer.step()
            steps += 1
            if epoch == run.start_epoch and key.step == 0:  # the first batch's plan, as `betty-train plan` shows it
                _record_plan(directory, console, planner, plan, write=epoch == 0)
            warned = warned or (plan.pieces > 1 and _warn_torch_dropout(model, plan.pieces))
            totals.add(plan, result, seeds.numel())
        features.release()
    if run.scheduler is not None:
        run.scheduler.step()
    diverged = non_finite(model.state_dict())
    if diverged:
        raise TrainingError(f"epoch {epoch}: {diverged} after the optimizer step (training diverged); "
                            f"try a lower optim.lr; {_last_good(path, epoch)}")
    counters, seconds = features.stats.snapshot(), time.perf_counter() - started  # before evaluation's
    return totals.metrics(epoch, run, counters, seconds, lr), warned


def _evaluate_or_save(config: Config, run: _Run, epoch: int, path: Path, directory: RunDirectory | None,
                      unevaluated: EpochMetrics, best: dict, board, scalars: Sequence[str]) -> dict[str, float]:
    """:func:`_evaluate`; where it fails, the epoch's training is saved first, not evaluated (its metrics line, and
    ``last.pt`` marked so that ``--resume`` evaluates this epoch before training the next: :func:`_end_epoch`, logging
    those of ``scalars`` that are not :data:`EVALUATION_SCALARS`, none for an epoch the resume evaluates again), and
    the error names that ``last.pt``; where the save fails too, the error says so and names the last good one.

    Raises:
        TrainingError: evaluation ran out of host memory, or of device memory with one node per chunk (the
            message names the checkpoint to resume from).
    """
    try:
        with host_memory_as_one_line(lambda cause: f"out of host memory ({cause}); {EVALUATION_HOST_MEMORY}; lower "
                                                   "model.hidden, or free host memory"), record_function(EVALUATE):
            return _evaluate(config, run, epoch, run.device)
    except TrainingError as error:  # its message is all that is kept: the evaluation's tensors go with its frames
        failure: str | Exception = str(error)
    except Exception as error:  # noqa: BLE001 - any failure saves the epoch's training first
        failure = error
        for link in (error, error.__context__, error.__cause__):  # re-raised with its traceback, without its locals
            if link is not None and link.__traceback__ is not None:
                traceback.clear_frames(link.__traceback__)
    try:
        _end_epoch(directory, run, unevaluated, best, board, evaluated=False,
                   scalars=[name for name in scalars if name not in EVALUATION_SCALARS])
    except Exception as error:  # noqa: BLE001 - the save's own failure is named with the evaluation's
        saved = f"epoch {epoch}'s training could not be saved ({type(error).__name__}: {error}); {_last_good(path, epoch)}"
    else:
        saved = (f"epoch {epoch}'s training is saved in {path / LAST_NAME}, not evaluated; continue with betty-train "
                 f"train --resume {path}, which evaluates it first")
    if isinstance(failure, str):
        raise TrainingError(f"epoch {epoch}, evaluation: {failure}; {saved}") from None
    logger.error("epoch %d, evaluation failed; %s", epoch, saved)
    raise failure


def _evaluate(config: Config, run: _Run, epoch: int, device: torch.device) -> dict[str, float]:
    """Validation and test accuracy every ``train.eval_every`` epochs and at the last; ``{}`` otherwise. Evaluated in
    chunks halved after each CUDA out-of-memory error (:func:`~betty_trainer.training.evaluation.fitting_chunks`), from
    the chunk the last evaluation ran with (``run.evaluation_chunk``).

    Raises:
        TrainingError: out of device memory with one node per chunk.
    """
    if (epoch + 1) % config.train.eval_every != 0 and epoch + 1 != config.optim.epochs:
        return {}
    splits = {"val": run.graph.val_idx, "test": run.graph.test_idx}
    accuracy = functools.partial(splits_accuracy, run.model, run.graph, run.evaluation_features, device, splits,
                                 config.model.num_layers)
    result, run.evaluation_chunk = leader_value(run.processes, lambda: fitting_chunks(accuracy, run.evaluation_chunk,
                                                                                      device))
    return result


EVALUATION_SCALARS = ("val_acc", "test_acc")
"""The metrics an epoch's evaluation gives (``None`` where it did not run)."""
BOARD_SCALARS = ("loss", "train_acc", *EVALUATION_SCALARS, "lr", "micro_batches", "input_redundancy", "seconds")
"""The metrics ``train.tensorboard=true`` logs per epoch, at the epoch's number as the step."""


def _end_epoch(directory: RunDirectory | None, run: _Run, last: EpochMetrics, best: dict, board,
               evaluated: bool = True, scalars: Sequence[str] = BOARD_SCALARS) -> dict:
    """Append the epoch's metrics, save ``best.pt`` when validation accuracy improved and ``last.pt`` always, log
    ``scalars`` to TensorBoard; returns the best-so-far. A rank other than 0 (``directory`` ``None``) only follows the
    best. Not ``evaluated`` (its evaluation failed), ``last.pt`` also holds the metrics line as ``unevaluated``: a
    resume evaluates that epoch before training the next (:func:`_restore`), and its caller passes
    :data:`EVALUATION_SCALARS` for it then, so that no step has two points on the board (a run whose first part had
    ``train.tensorboard`` off has none of that epoch's training scalars)."""
    improved = last.val_acc is not None and last.val_acc > best["val_acc"]
    if improved:
        best = {"epoch": last.epoch, "val_acc": last.val_acc, "test_acc": last.test_acc}
    if directory is None:
        return best
    directory.append_line("metrics.jsonl", json.dumps(asdict(last)))
    model, epoch, path = run.model, last.epoch, directory.path
    if improved:
        save_checkpoint(path, {"format": FORMAT, "kind": "best", "epoch": epoch, "model": model.state_dict(),
                                   "metrics": asdict(last), "identity": run.identity}, BEST_NAME)
    save_checkpoint(path, {"format": FORMAT, "kind": "last", "epoch": epoch, "model": model.state_dict(),
                               "optimizer": run.optimizer.state_dict(),
                               "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
                               "best": best, "identity": run.identity,
                               **({} if evaluated else {"unevaluated": asdict(last)})}, LAST_NAME)
    if board is not None:
        _log_tensorboard(board, last, scalars)
    return best


def make_scheduler(config: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate scheduler of ``config.optim.scheduler`` (stepped once per epoch), or ``None``.

    ``step``: ``StepLR(step_size, gamma)``; ``cosine``: ``CosineAnnealingLR(T_max=optim.epochs,
    eta_min=optim.min_lr)``.
    """
    optim = config.optim
    if optim.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=optim.step_size, gamma=optim.gamma)
    if optim.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=optim.epochs, eta_min=optim.min_lr)
    return None


def apply_optim_config(config: Config, optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    """On resume, make the checkpoint's optimizer and schedule follow the config's ``optim`` section where it
    changed (``optim.lr``, ``optim.weight_decay``, ``optim.gamma``, ``optim.step_size``, ``optim.min_lr``); Adam's
    moments and the schedule's position are kept. With a schedule, the next epoch's learning rate is the
    schedule's closed form at its position for the new values (``step``: ``lr·gamma^⌊t/step_size⌋``;
    ``cosine``: ``min_lr + (lr − min_lr)(1 + cos(πt/T))/2``). Nothing is touched when nothing changed, so a
    plain resume stays bit-exact."""
    optim = config.optim
    for group in optimizer.param_groups:
        group["weight_decay"] = optim.weight_decay
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = optim.lr
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.StepLR):
        changed = (scheduler.base_lrs[0], scheduler.gamma, scheduler.step_size) != (optim.lr, optim.gamma,
                                                                                    optim.step_size)
        scheduler.gamma, scheduler.step_size = optim.gamma, optim.step_size
        lr = optim.lr * optim.gamma ** (scheduler.last_epoch // optim.step_size)
    else:  # CosineAnnealingLR over optim.epochs (a different T_max is refused before this)
        changed = (scheduler.base_lrs[0], scheduler.eta_min) != (optim.lr, optim.min_lr)
        scheduler.eta_min = optim.min_lr
        lr = optim.min_lr + (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * scheduler.last_epoch
                                                                       / scheduler.T_max)) / 2
    if changed:
        scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"], group["lr"] = optim.lr, lr


def _patience_exhausted(config: Config, epoch: int, best: dict) -> bool:
    patience = config.train.patience
    return patience is not None and best["epoch"] >= 0 and epoch - best["epoch"] >= patience


def _check_resumable(config: Config, state: dict, path: Path) -> None:
    """Refuse a resume that cannot train another epoch, before any data is loaded (one whose last epoch's evaluation
    failed can always go on: it evaluates that epoch first)."""
    pending = state.get("unevaluated") is not None  # that epoch is still to evaluate: the resume starts with it
    if state["epoch"] + (0 if pending else 1) >= config.optim.epochs:
        raise TrainingError(f"run in {path} already finished {config.optim.epochs} epochs; "
                            "raise optim.epochs to continue")
    if not pending and _patience_exhausted(config, state["epoch"], state["best"]):
        raise TrainingError(f"run in {path} stopped early at epoch {state['epoch']} (validation accuracy has not "
                            f"improved since epoch {state['best']['epoch']}); raise train.patience to continue")


def _check_best(path: Path, state: dict) -> None:
    """Verify the run's ``best.pt`` as ``last.pt`` is verified, so that a resumed run cannot end with its best model
    unreadable. Without a ``best.pt`` (deleted by the user), the best model is chosen again from the epochs still
    to run: ``state["best"]`` is reset.

    Raises:
        TrainingError: ``best.pt`` fails a check of :func:`load_checkpoint` (the message says what to do).
    """
    if not (path / BEST_NAME).exists():
        if state["best"]["epoch"] >= 0:
            logger.warning("%s has no %s (epoch %d was best); the best model is chosen from the epochs still to run",
                           path, BEST_NAME, state["best"]["epoch"])
            state["best"] = _no_best()
        return
    try:
        load_checkpoint(path, BEST_NAME)
    except TrainingError as error:
        raise TrainingError(f"cannot resume: {error}; restore {BEST_NAME} from a copy, or delete {BEST_NAME} and "
                            f"{checksum_path(path / BEST_NAME).name} to resume choosing the best model from the "
                            "epochs still to run") from None


def _no_best() -> dict:
    """The best-so-far before any epoch was evaluated."""
    return {"epoch": -1, "val_acc": -1.0, "test_acc": float("nan")}


def _allocate(build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """``build()``, with an allocation failure as a one-line error."""
    try:
        with host_memory_as_one_line(lambda cause: f"cannot allocate the model on {device} ({cause}); lower "
                                     "model.hidden or model.num_layers"):
            return build()
    except torch.OutOfMemoryError as error:
        raise TrainingError(f"cannot allocate the model on {device}: {str(error).splitlines()[0]}; "
                            "lower model.hidden or model.num_layers") from None


DIVERGENCE_FACTOR = 1000.0
"""An epoch's mean training loss above this many times ln(num_classes) (the cross-entropy of a uniform guess,
what an untrained model scores) is taken as divergence."""


def _check_divergence(config: Config, graph: Graph, metrics: EpochMetrics, path: Path, warned: bool) -> bool:
    """Warn once (``warning:`` line) when the epoch's training loss exceeds :data:`DIVERGENCE_FACTOR` × ln(C),
    C = ``graph.num_classes`` (at least 2); returns whether the run has warned. The loss is finite (a NaN or
    infinite one is refused in the step), so this catches the slow blow-up of a too-high learning rate, which
    under Adam can keep the accuracy near normal while the loss reaches 1e21.

    Raises:
        TrainingError: the loss diverged and ``train.stop_on_divergence`` is set; names the last good ``last.pt``
            (the diverged epoch is not saved).
    """
    limit = DIVERGENCE_FACTOR * math.log(max(graph.num_classes, 2))
    if not metrics.loss > limit:
        return warned
    said = (f"epoch {metrics.epoch}: training loss {metrics.loss:.3g} is over {DIVERGENCE_FACTOR:g}× "
            f"ln(num_classes) = {limit:.4g}: training is diverging, most likely optim.lr={config.optim.lr:g} is too "
            "high (under Adam the accuracy can look normal meanwhile)")
    if config.train.stop_on_divergence:
        raise TrainingError(f"{said}; stopped (train.stop_on_divergence); {_last_good(path, metrics.epoch)}")
    if not warned:
        logger.warning("%s; set train.stop_on_divergence=true to stop such a run", said)
    return True


def _last_good(path: Path, epoch: int) -> str:
    """Where the run can go on from when epoch ``epoch`` fails (the checkpoints hold earlier epochs only)."""
    if epoch == 0 or not holds_checkpoint(path):
        return "no checkpoint was written yet"
    return f"last good checkpoint: {path / LAST_NAME} (epoch {epoch - 1}; continue with betty-train train --resume {path})"


def _diverged_before(path: Path, epoch: int) -> str:
    """What to do when the first batch after ``last.pt`` (epoch ``epoch - 1``) has a NaN or infinite loss: that loss
    was computed with the checkpoint's own parameters (no optimizer step came between), so the checkpoint is no good
    and a resume, whatever its learning rate, computes the same loss again (resumes are bit-exact)."""
    return (f"{path / LAST_NAME} (epoch {epoch - 1}) is not a good checkpoint: this loss comes from its own parameters "
            "(training diverged before it was written), so a resume would stop here again whatever optim.lr; start "
            "a new run with a lower optim.lr in another train.run_dir (--overwrite would remove this run's best.pt too)")


def _record_resume(run: RunDirectory, config: Config, start_epoch: int, env: dict) -> None:
    """Append this resume (its epoch, the config keys it changed, its environment) to ``resumes.yaml``."""
    saved = run.path / "config.yaml"
    before = yaml.safe_load(saved.read_text()) if saved.is_file() else {}
    history = []
    if (run.path / "resumes.yaml").is_file():
        history = yaml.safe_load((run.path / "resumes.yaml").read_text()) or []
    history.append({"from_epoch": start_epoch,
                    "changes": config_changes(before or {}, config.model_dump(mode="json")),
                    "environment": env})
    run.write_text("resumes.yaml", yaml.safe_dump(history, sort_keys=False))


def _warn_torch_dropout(model: nn.Module, k: int) -> bool:
    """Warn once when ``model`` holds a ``torch.nn`` dropout layer with ``p > 0`` (``dgl.nn.SAGEConv`` always holds
    a ``Dropout(0.0)``, which draws nothing) and a batch runs as ``k > 1`` micro-batches."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0]
    if names:
        logger.warning(
            "the model uses torch.nn dropout (%s) and batches run as %d micro-batches: each micro-batch draws its "
            "own masks, so the gradient is not the full batch's and --resume is not bit-exact; use "
            "betty_trainer.NodeDropout, whose mask is keyed by node id", ", ".join(names), k)
    return True


def _name_run(error: BaseException, path: Path) -> None:
    """Attach the run directory to a Ctrl-C (``KeyboardInterrupt.run_dir``) when it holds a checkpoint to resume
    from, so the CLI can print the command that continues it."""
    if isinstance(error, KeyboardInterrupt) and holds_checkpoint(path):
        error.run_dir = path


def qualified_name(model: nn.Module) -> str:
    """``module.Class`` of a custom model: what a run's identity and a dry run's report name it by."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _print_start(console: Console, config: Config, graph: Graph, device: torch.device, model: nn.Module,
                 path: Path, start_epoch: int, resume: bool) -> None:
    state = f"resuming at epoch {start_epoch}" if resume else "new run"
    budget = config.micro_batch.budget
    split = (f"K = {config.micro_batch.num_micro_batches}" if budget is None else
             f"the smallest K under a budget of {budget if budget == 'auto' else f'{budget / 2**20:.1f} MiB'}")
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"run directory {path} ({state})",
        f"device {device} · torch {torch.__version__} · dataset {graph.name}: {graph.num_nodes:,} nodes, "
        f"{graph.indices.numel():,} edges, {graph.num_features} features, {graph.num_classes} classes; "
        f"{graph.train_idx.numel()} train / {graph.val_idx.numel()} val / {graph.test_idx.numel()} test nodes",
        f"model {type(model).__name__} ({params:,} parameters) · {config.optim.epochs} epochs · "
        f"micro_batch.mode {config.micro_batch.mode}: {split} ({config.micro_batch.partitioner})",
    ]
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def _record_plan(directory: RunDirectory | None, console: Console, planner: Planner, plan: StepPlan,
                 write: bool) -> None:
    """Print the first batch's plan (and, ``write``, save its report as ``plan.json``), as ``betty-train plan``
    shows it. In a distributed run every rank calls it (the report gathers every rank's plan); rank 0 writes."""
    if write:
        report = planner.report(plan)
        if directory is not None:
            directory.write_text("plan.json", json.dumps(report, indent=2))
    peak = f", estimated peak {plan.estimate / 2**20:.2f} MiB" if plan.estimate else ""
    console.print(f"first batch: {plan.batch.output_nodes.numel()} outputs, {plan.summary}{peak}, input redundancy "
                  f"{plan.redundancy()[0]:.3f}", highlight=False, soft_wrap=True)


def _tensorboard(config: Config, path: Path):
    if not config.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(path / TENSORBOARD_DIR))


def _log_tensorboard(board, metrics: EpochMetrics, scalars: Sequence[str]) -> None:
    """Add each of ``scalars`` (names of :class:`EpochMetrics` fields) that is not ``None`` at ``metrics.epoch``."""
    for name in scalars:
        value = getattr(metrics, name)
        if value is not None:
            board.add_scalar(name, value, metrics.epoch)
    board.flush()


def _truncate_metrics(path: Path, last_epoch: int) -> None:
    """Drop metric lines written after the checkpoint's epoch (a crash between the two writes), and an
    unparseable last line (a crash mid-append on a file system that does not cut it back).

    Raises:
        TrainingError: a line before the last is not JSON (the file was edited or damaged).
    """
    if not path.exists():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                logger.warning("dropping the unreadable last line of %s (a write cut short)", path)
                break
            raise TrainingError(f"{path} line {number} is not JSON; repair or remove that line to resume") from None
        if not isinstance(record, dict) or "epoch" not in record:
            raise TrainingError(f"{path} line {number} is not a metrics record; repair or remove it to resume")
        if type(record["epoch"]) is not int:
            raise TrainingError(f"{path} line {number}: field 'epoch' is {json.dumps(record['epoch'])}, expected an "
                                "integer; repair or remove that line to resume")
        if record["epoch"] <= last_epoch:
            kept.append(line)
    write_text(path, "".join(line + "\n" for line in kept))
