"""Calibrate the memory estimate of a custom model (docs/design.md › Memory estimate: "custom models get
coefficients by tracing them at a few sizes … and fitting, so the estimate stays analytic").

:func:`calibrate_model` runs real training steps of a copy of the model on a few
synthetic micro-batches of different sizes, measures each peak with
:func:`~betty_trainer.execution.micro_batches.measure_training_step`, fits the per-layer
coefficients of :func:`estimator.calibrate.fit`, and checks the fit on a held-out
micro-batch. From then on the estimate is the fitted formula: no tensor is allocated.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.errors import CalibrationError
from betty_trainer.execution.micro_batches import measure_training_step, training_state
from betty_trainer.sampling import sample_batch
from estimator.calibrate import CalibratedModel, FitError, SamplesTooSmallError, fit
from estimator.counts import LayerCounts, block_structure_bytes, counts_of
from estimator.measure import storage_bytes

HOLDOUT_TOLERANCE = 0.10  # largest relative error allowed on the held-out micro-batch's peak
MAX_INPUT_BYTES = 256 * 2**20  # input features of a synthetic micro-batch, bounded by seeds × Π(fanout + 1) rows
GROWTH = 4  # seed counts grow by this factor while too few samples rise above the optimizer step's floor

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def synthetic_designs(num_layers: int) -> list[tuple[int, list[int]]]:
    """``(seed nodes, fanouts input layer first)`` of the synthetic micro-batches.

    The first is the smallest (near the optimizer step's floor); the last is held out.
    Uniform and alternating fanouts and several seed counts make the src, dst and edge
    counts of each layer vary independently enough to tell their coefficients apart.
    """
    uniform = lambda k: [k] * num_layers  # noqa: E731
    alternate = lambda a, b: [a if layer % 2 == 0 else b for layer in range(num_layers)]  # noqa: E731
    return [
        (2, uniform(1)),
        (16, uniform(2)), (128, uniform(2)),
        (32, uniform(5)), (96, uniform(5)),
        (16, uniform(10)), (64, uniform(10)),
        (48, alternate(2, 10)), (160, alternate(2, 10)),
        (48, alternate(10, 2)), (160, alternate(10, 2)),
        (8, uniform(25)),
        (80, uniform(3)),
    ]


def synthetic_batches(graph: Graph, num_layers: int, scale: int = 1, seed: int = 0,
                      weighted: Sequence[bool] = ()) -> list[Batch]:
    """The micro-batches of :func:`synthetic_designs` on ``graph`` with ``scale`` times the seeds:
    seeds drawn uniformly from all nodes (deterministic for ``scale`` and ``seed``), at most all
    nodes, and at most so many that ``seeds × Π(fanout + 1)`` input rows of features take
    :data:`MAX_INPUT_BYTES`. The blocks ``weighted`` names (per layer, input layer first; none by default) carry
    ``(E,)`` float32 edge weights drawn uniformly from ``[0.5, 1.5)``, as LABOR's, GNS's and LADIES' sampled layers
    carry importance weights."""
    generator = torch.Generator().manual_seed(seed + scale)
    max_rows = max(1, MAX_INPUT_BYTES // (graph.x.element_size() * max(graph.num_features, 1)))
    weighted = tuple(weighted) or (False,) * num_layers
    batches = []
    for num_seeds, fanouts in synthetic_designs(num_layers):
        cap = max(1, max_rows // math.prod(f + 1 for f in fanouts))
        seeds = torch.randperm(graph.num_nodes, generator=generator)[: min(num_seeds * scale, cap)]
        batch = sample_batch(graph, seeds, fanouts, generator)
        batches.append(Batch([dataclasses.replace(block, edge_weight=torch.rand(block.num_edges, generator=generator)
                                                  + 0.5) if weighs else block
                              for block, weighs in zip(batch.blocks, weighted, strict=True)]))
    return batches


def synthetic_rounds(graph: Graph, num_layers: int, weighted: Sequence[bool] = ()) -> Iterator[list[Batch]]:
    """The calibration's rounds of :func:`synthetic_batches` (``weighted`` as there): ``scale`` 1, then
    :data:`GROWTH` times the last (a round is drawn when the fit asks for larger micro-batches)."""
    scale = 1
    while True:
        yield synthetic_batches(graph, num_layers, scale, weighted=weighted)
        scale *= GROWTH


def calibrate_model(
    model: nn.Module,
    graph: Graph,
    num_layers: int,
    optimizer_factory: OptimizerFactory = torch.optim.Adam,
    device: torch.device | str = "cpu",
    weighted: Sequence[bool] = (),
) -> CalibratedModel:
    """Fit the memory estimate of ``model`` trained with ``optimizer_factory`` on ``graph``.

    A deep copy of ``model`` is moved to ``device`` and trained for one step on the first
    synthetic micro-batch (so the optimizer's state is resident, as in training; the
    step also checks the output shape); then one measured step per micro-batch of
    :func:`synthetic_batches` gives ``(counts, peak bytes)`` samples, all but the last are
    fitted (:func:`estimator.calibrate.fit`) and the last must be predicted within
    :data:`HOLDOUT_TOLERANCE`. While too few samples rise above the optimizer step's
    floor (large parameters, small activations) the seed counts grow :data:`GROWTH`-fold
    and the new samples join the fit. Neither ``model`` nor the global random state is
    changed; on CUDA the copy's cached memory is released afterwards. 0.2–3 s on Cora and
    CiteSeer on an idle 2-core CPU (the profiler's start-up dominates; several times that
    when the CPU is busy).

    The measured steps gather ``graph.x`` and ``graph.y``; peaks are those of
    :func:`~betty_trainer.execution.micro_batches.measure_training_step` with ``accumulate=True`` (a batch's
    micro-batches after the first, which hold the gradients of the earlier ones: the
    costlier case, so the fit covers every micro-batch), expressed with the model state
    (parameters, their gradients, buffers, optimizer state) as the resident bytes and
    the blocks' structure counted in the step on every device.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs, graph.num_classes)`` logits.
        graph: the graph (features ``(N, F)``, int64 labels ``(N,)``).
        num_layers: number of blocks the model takes.
        optimizer_factory: builds the training optimizer from parameters, e.g.
            ``lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=5e-4)`` (weight decay
            allocates a temporary per parameter in the step).
        device: where the model trains: ``cpu``, ``cuda`` or ``cuda:N``.
        weighted: per block (input layer first), whether the micro-batches it estimates carry ``(E,)`` float32 edge
            weights (LABOR's, GNS's and LADIES' sampled layers); the synthetic micro-batches carry them alike
            (:func:`synthetic_batches`), so a model that keeps per-edge tensors of its weights is fitted with them.
            None by default.

    Returns:
        The :class:`~estimator.calibrate.CalibratedModel`.

    Raises:
        ValueError: ``weighted`` names another number of blocks than ``num_layers``.
        CalibrationError: the model cannot be copied, has no parameters, its forward or
            backward fails on a synthetic micro-batch (naming the exception), its output
            has the wrong shape, or its peaks do not follow the counts (naming the sample
            and the numbers).
    """
    device = torch.device(device)
    if weighted and len(weighted) != num_layers:
        raise ValueError(f"weighted gives {len(weighted)} blocks for a model of {num_layers}")
    # the caller's RNG is untouched, and its autograd mode does not reach the measured training steps
    with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode(False),
          torch.enable_grad()):
        calibrated = _calibrate(model, graph, num_layers, optimizer_factory, device, weighted)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the copy's cached blocks back (budget=auto reads free GPU memory)
    return calibrated


def _calibrate(model: nn.Module, graph: Graph, num_layers: int, optimizer_factory: OptimizerFactory,
               device: torch.device, weighted: Sequence[bool]) -> CalibratedModel:
    name = type(model).__name__
    try:
        trained = copy.deepcopy(model).to(device)
    except Exception as error:  # noqa: BLE001 - any failure to copy means we cannot calibrate on a copy
        raise CalibrationError(f"cannot calibrate {name}: copying it failed ({type(error).__name__}: {error})") from error
    trained.train()
    parameters = list(trained.parameters())
    if not parameters:
        raise CalibrationError(f"cannot calibrate {name}: it has no parameters to train")
    optimizer = optimizer_factory(parameters)
    rounds = synthetic_rounds(graph, num_layers, weighted)
    batches = next(rounds)
    _warm_up(trained, optimizer, batches[0], graph, device, name)
    features = HostFeatureStore(graph.x, pin=False)
    # measured steps accumulate (a batch's later micro-batches, the costlier case): gradients are resident
    resident = storage_bytes(training_state(trained, optimizer)) + storage_bytes(trained.parameters())
    without_gradients = resident - storage_bytes(trained.parameters())
    samples = []
    while True:  # each round measures its micro-batches, then fits; too few above the floor grows the seeds
        # every micro-batch as a later one of its batch (gradients resident), then the largest two both ways: a
        # batch's first micro-batch has no gradients resident, and how much less it needs is measured on them
        largest = sorted(batches, key=lambda b: b.input_nodes.numel())[-2:]
        steps = [(batch, resident, True) for batch in batches] + [
            step for batch in largest for step in ((batch, resident, True), (batch, without_gradients, False))]
        measured = _measure(trained, optimizer, steps, graph, features, device, name)
        pairs = measured[len(batches):]
        saving = min(pairs[index][1] - pairs[index + 1][1] for index in range(0, len(pairs), 2))
        measured = measured[:len(batches)]
        samples += measured[:-1]  # the last is held out
        try:
            calibrated = fit(samples, resident)
            break
        except SamplesTooSmallError as error:
            grown = next(rounds)
            if [b.output_nodes.numel() for b in grown] == [b.output_nodes.numel() for b in batches]:
                raise CalibrationError(f"cannot calibrate the memory of {name}: {error}; the synthetic micro-batches "
                                       "cannot grow further on this graph") from None
            batches = grown
        except FitError as error:
            raise CalibrationError(f"cannot calibrate the memory of {name}: {error}") from None
    layers, peak = measured[-1]
    predicted = calibrated.estimate(layers)
    error = (predicted - peak) / peak
    if abs(error) > HOLDOUT_TOLERANCE:
        raise CalibrationError(
            f"cannot calibrate the memory of {name}: the fit misses a held-out micro-batch by {error:+.1%} "
            f"(allowed ±{HOLDOUT_TOLERANCE:.0%}; estimated {predicted} bytes, measured {peak}); its peak "
            "does not follow the node and edge counts")
    return dataclasses.replace(calibrated, first_saving_bytes=max(0, saving))


def _describe(batch: Batch) -> str:
    return "a synthetic micro-batch with src/dst/edges per layer " + ", ".join(
        f"{b.num_src}/{b.num_dst}/{b.num_edges}" for b in batch.blocks)


def _warm_up(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, graph: Graph, device: torch.device,
             name: str) -> None:
    """One unmeasured training step that creates the optimizer state and checks the logits' shape (its input
    rows indexed from ``graph.x``, before any feature store exists)."""
    x = graph.x[batch.input_nodes].to(device)
    y = graph.y[batch.output_nodes].to(device)
    try:
        logits = model(batch.to(device).blocks, x)
    except Exception as error:  # noqa: BLE001 - the user's forward may raise anything; name it
        raise CalibrationError(f"cannot calibrate {name}: its forward failed on {_describe(batch)} "
                               f"({type(error).__name__}: {error})") from error
    expected = (batch.output_nodes.numel(), graph.num_classes)
    if not isinstance(logits, Tensor) or tuple(logits.shape) != expected or not logits.is_floating_point():
        got = f"a {type(logits).__name__}" if not isinstance(logits, Tensor) else f"{tuple(logits.shape)} {logits.dtype}"
        raise CalibrationError(f"cannot calibrate {name}: forward must return float logits of shape {expected} "
                               f"(outputs × classes) on {_describe(batch)}, got {got}")
    try:
        F.cross_entropy(logits, y).backward()
    except Exception as error:  # noqa: BLE001
        raise CalibrationError(f"cannot calibrate {name}: backward failed on {_describe(batch)} "
                               f"({type(error).__name__}: {error})") from error
    optimizer.step()


def _measure(model: nn.Module, optimizer: torch.optim.Optimizer, steps: list[tuple[Batch, int, bool]], graph: Graph,
             features: FeatureStore, device: torch.device, name: str) -> list[tuple[list[LayerCounts], int]]:
    """``(counts, peak bytes)`` of each measured step, in order: ``steps`` are ``(micro-batch, resident bytes,
    accumulate)``, with ``resident`` bytes live before the step and the block structure allocated in the step (on
    CPU it is already resident; counted here instead). ``accumulate``: as a later micro-batch of a batch
    (gradients resident) or as the first."""
    results = []
    for batch, resident, accumulate in steps:
        try:
            measured = measure_training_step(model, optimizer, batch, features, graph.y, device, accumulate=accumulate)
        except Exception as error:  # noqa: BLE001
            raise CalibrationError(f"cannot calibrate {name}: a training step failed on {_describe(batch)} "
                                   f"({type(error).__name__}: {error})") from error
        layers = counts_of(batch.blocks)
        blocks = block_structure_bytes(layers) if device.type == "cpu" else 0
        results.append((layers, resident + blocks + measured.peak_bytes - measured.resident_bytes))
    return results
