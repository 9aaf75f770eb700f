"""The recorded memory estimate of a custom model (issue 24): its real training step, run on fake tensors at a few
sizes (:mod:`estimator.recorder`), solved into an exact closed form.

:func:`record_model` records the step :func:`~betty_trainer.execution.micro_batches.measure_training_step`
measures (gather, forward, loss, backward, accuracy, optimizer step) with the same code, so the estimate counts
what that measurement counts. A model the recorder refuses raises
:class:`~estimator.recorder.RecordingRefused`; :class:`WeightedEstimates` then falls back to calibration
(:func:`betty_trainer.memory.custom.calibrate_model`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.execution.micro_batches import measured_step_resident, micro_batch_backward
from betty_trainer.memory.custom import calibrate_model
from betty_trainer.models.recorded_terms import fake_block
from estimator.calibrate import CalibratedModel
from estimator.counts import LayerCounts
from estimator.recorder import (
    KeptRecordings,
    RecordedModel,
    Recorder,
    Recording,
    RecordingRefused,
    distinct_storage_bytes,
    recording_sizes,
    solve,
)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
logger = logging.getLogger(__name__)


def record_model(
    model: nn.Module,
    graph: Graph,
    num_layers: int,
    optimizer_factory: OptimizerFactory = torch.optim.Adam,
    device: torch.device | str = "cpu",
    weighted: Sequence[bool] = (),
) -> RecordedModel:
    """The exact closed form of ``model``'s training step on ``graph`` with ``optimizer_factory``'s optimizer,
    recorded once per process for each key of :func:`recording_key` (a later call with an equal key returns the
    same :class:`~estimator.recorder.RecordedModel` while it is among the most recently used:
    :class:`~estimator.recorder.KeptRecordings`).

    A fake copy of the model (:meth:`~estimator.recorder.Recorder.fake_module`: no real tensor is copied or
    allocated) takes one unrecorded step, so the optimizer's state exists as in training; then the step is
    recorded at each size of :func:`~estimator.recorder.recording_sizes`, both as a batch's first micro-batch and
    as a later one (gradients resident), and solved (:func:`~estimator.recorder.solve`). ``model``, its
    gradients and the global random state are untouched. Tens of milliseconds per recorded step.

    Args:
        model: ``forward(blocks, x)`` returning ``(num_outputs, graph.num_classes)`` logits.
        graph: the graph (features ``(N, F)``, int64 labels ``(N,)``); only shapes and dtypes are read.
        num_layers: number of blocks the model takes.
        optimizer_factory: builds the training optimizer from parameters.
        device: where the model trains; only ``cpu`` is recorded.
        weighted: per block, whether it carries ``(E,)`` float32 edge weights (recorded with fake ones; none by
            default). The estimate holds for micro-batches weighted alike (:attr:`RecordedModel.weighted`;
            :class:`WeightedEstimates` records each pattern a run meets).

    Returns:
        The :class:`~estimator.recorder.RecordedModel` (bytes as the CPU measurement counts them).

    Raises:
        ValueError: ``weighted`` names another number of blocks than ``num_layers``.
        RecordingRefused: the model cannot be recorded exactly (the message names why in one line): another device
            than the CPU, a forward that reads tensor values, data-dependent shapes, kernels outside PyTorch's
            operators, or bytes not linear in the counts.
    """
    device = torch.device(device)
    if device.type != "cpu":
        raise RecordingRefused(f"the recorder models the CPU allocator; {device} rounds and caches blocks")
    if weighted and len(weighted) != num_layers:
        raise ValueError(f"weighted gives {len(weighted)} blocks for a model of {num_layers}")
    parameters = list(model.parameters())
    if not parameters:
        raise RecordingRefused(f"{type(model).__name__} has no parameters to train")
    pattern = tuple(weighted) or (False,) * num_layers
    key = (*recording_key(model, graph, num_layers, optimizer_factory(parameters), device), pattern)  # no state yet
    return _RECORDED.get(key, lambda: _record(model, graph, num_layers, optimizer_factory, device, pattern))


_RECORDED: KeptRecordings[RecordedModel] = KeptRecordings()


class WeightedEstimates:
    """A custom model's estimate for micro-batches of any pattern of edge-weighted blocks (LABOR, GNS and LADIES
    weigh the layers they sample), made per pattern when a micro-batch of it is first estimated and kept: recorded
    (:func:`record_model`: exact), or where the recorder refuses the model calibrated
    (:func:`~betty_trainer.memory.custom.calibrate_model`, on synthetic micro-batches weighted as the pattern, so a
    model that keeps per-edge tensors of its weights is fitted with them; within its held-out error, not to the
    byte). The unweighted pattern is made at construction; where the recorder refuses it, every pattern is
    calibrated without trying the recorder again (the reason is logged once), and where it refuses only a weighted
    pattern (say, a mask on the weights' values) that pattern is calibrated (logged with the reason). Each
    estimate made after construction is logged with the time it took.

    Args:
        model, graph, num_layers, optimizer_factory, device: as :func:`record_model`'s.

    Raises:
        CalibrationError: a pattern the recorder refused cannot be calibrated (the message names the cause).
    """

    def __init__(self, model: nn.Module, graph: Graph, num_layers: int, optimizer_factory: OptimizerFactory,
                 device: torch.device | str):
        self._args = (model, graph, num_layers, optimizer_factory, device)
        self.recorded = True  # the unweighted pattern was recorded; else every pattern is calibrated
        self._estimates: dict[tuple[bool, ...], RecordedModel | CalibratedModel] = {}
        self.unweighted = self._make((False,) * num_layers)

    @property
    def resident_bytes(self) -> int:
        """Bytes live before a step, block structure aside (the same for every pattern)."""
        return self.unweighted.resident_bytes

    def estimate(self, layers: Sequence[LayerCounts], accumulate: bool = True) -> int:
        """The estimate (:meth:`RecordedModel.estimate <estimator.recorder.RecordedModel.estimate>` or
        :meth:`CalibratedModel.estimate <estimator.calibrate.CalibratedModel.estimate>`) of ``layers``' pattern of
        edge weights, made on first use."""
        pattern = tuple(layer.weighted for layer in layers)
        if pattern not in self._estimates:
            started = time.perf_counter()
            self._make(pattern)
            logger.info("estimated %s on blocks with edge weights %s in %.2f s", type(self._args[0]).__name__,
                        list(pattern), time.perf_counter() - started)
        return self._estimates[pattern].estimate(layers, accumulate)

    def _make(self, pattern: tuple[bool, ...]) -> RecordedModel | CalibratedModel:
        """Record ``pattern``, or where the recorder refuses the model calibrate it (see the class docstring)."""
        name = type(self._args[0]).__name__
        if self.recorded:
            try:
                self._estimates[pattern] = record_model(*self._args, weighted=pattern)
                return self._estimates[pattern]
            except RecordingRefused as refusal:
                logger.info("the memory recorder refused %s on blocks with edge weights %s (%s); calibrating it "
                            "instead", name, list(pattern), refusal)
                self.recorded = any(pattern)  # refused unweighted: every pattern is calibrated from now on
        self._estimates[pattern] = calibrate_model(*self._args, weighted=pattern)
        return self._estimates[pattern]


def recording_key(model: nn.Module, graph: Graph, num_layers: int, optimizer: torch.optim.Optimizer,
                  device: torch.device) -> tuple:
    """What a recorded step depends on: the model's class and ``repr`` (its modules with the widths and settings
    they print, e.g. ``Dropout(p=0.5)``), every parameter's and buffer's name, shape, dtype and ``requires_grad``,
    the features' width and dtype, the labels' dtype, the number of layers, the optimizer's class and settings
    (``defaults``) and the device type. A model whose memory depends on an attribute its ``repr`` does not show
    (a plain Python flag) should print it (``extra_repr``), or instances that differ in it share one recording."""
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in (*model.named_parameters(), *model.named_buffers()))
    return (type(model), repr(model), tensors, tuple(graph.x.shape[1:]), graph.x.dtype, graph.y.dtype, num_layers,
            type(optimizer), repr(sorted(optimizer.defaults.items())), device.type)


def _record(model: nn.Module, graph: Graph, num_layers: int, optimizer_factory: OptimizerFactory,
            device: torch.device, weighted: tuple[bool, ...]) -> RecordedModel:
    """:func:`record_model`'s recording (see there), uncached."""
    name = type(model).__name__
    sizes = recording_sizes(num_layers, weighted)
    # a training step whatever the caller's autograd mode (train() inside torch.no_grad() records all the same)
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(), Recorder() as recorder:
        fake = recorder.fake_module(model).train()  # a training step, whatever mode the model is in now (dropout)
        optimizer = optimizer_factory(list(fake.parameters()))
        features, labels = HostFeatureStore(recorder.fake(graph.x), pin=False, in_place=False), recorder.fake(graph.y)
        in_forward = []  # non-empty while the model's forward runs: a read of a tensor's value there is refused
        fake.register_forward_pre_hook(lambda *_: in_forward.append(True))
        fake.register_forward_hook(lambda *_: in_forward.clear(), always_call=True)

        def step(layers: Sequence[LayerCounts], accumulate: bool) -> tuple[Recording, int]:
            """One recorded step of a fake micro-batch with ``layers``, and the bytes resident before it."""
            batch = _fake_batch(layers)
            resident = measured_step_resident(fake, optimizer, batch.blocks, device, accumulate)
            resident_bytes = distinct_storage_bytes([t for t in resident if not _is_block_tensor(t, batch)])

            def run() -> None:  # measure_training_step's step
                micro_batch_backward(fake, batch, features, labels, device, batch.output_nodes.numel())
                optimizer.step()

            recording = recorder.record(run, lambda: f"the forward of {name}" if in_forward else None)
            return recording, resident_bytes

        step(sizes[0], False)  # the optimizer's state is made, as after training's first step
        solved, resident = {}, {}
        for accumulate in (False, True):
            recordings = [step(layers, accumulate) for layers in sizes]
            solved[accumulate] = solve([recording for recording, _ in recordings], sizes)
            resident[accumulate] = recordings[0][1]
        allocations = len(recordings[0][0].nbytes)
    return RecordedModel(num_layers=num_layers, resident_bytes=resident[True],
                         first_saving_bytes=resident[True] - resident[False], accumulating=solved[True],
                         first=solved[False], allocations=allocations, weighted=weighted)


def _fake_batch(layers: Sequence[LayerCounts]) -> Batch:
    """A batch of :func:`~betty_trainer.models.recorded_terms.fake_block` of ``layers``' counts."""
    return Batch([fake_block(c) for c in layers])


def _is_block_tensor(tensor: torch.Tensor, batch: Batch) -> bool:
    return any(tensor is t for block in batch.blocks for t in block.tensors())
