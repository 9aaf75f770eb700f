"""The estimator's description of a built-in model (:class:`~estimator.spec.ModelSpec`), read off the model
instance and the run's config: what the closed-form estimate (:mod:`estimator.estimate`) replays. The device's
part (its BLAS workspaces) is measured here; the model describes the rest itself
(:func:`estimator_spec`)."""

from __future__ import annotations

import torch
from torch import nn

from betty_trainer.config import Config
from betty_trainer.data.graph import Graph
from betty_trainer.errors import PlanningError
from betty_trainer.memory.device import device_workspace
from betty_trainer.models import ARCHITECTURES, architecture_of, build_model
from betty_trainer.models.recorded_terms import model_terms
from betty_trainer.models.registry import Architecture
from betty_trainer.models.stack import LayerStack
from betty_trainer.rng import compiled_kernels
from estimator.spec import ModelSpec, adam_uses_foreach


def model_spec(config: Config, graph: Graph, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of the built-in model ``config.model`` on ``graph`` (built on the meta
    device, so no memory is used; as :func:`spec_of` describes an instance, the built-in model's parameters
    having the default dtype); with ``features.aggregation_cache``, layer 0 reads the cache (BatchGNN §3).

    Raises:
        RecordingRefused: a torch the memory recorder is not tested with (:func:`estimator_spec`).
    """
    workspace = device_workspace(device, torch.get_default_dtype())
    with torch.device("meta"):
        model = build_model(config.model, graph)
    return estimator_spec(model, ARCHITECTURES[config.model.arch], optimizer=config.optim.optimizer,
                          weight_decay=config.optim.weight_decay != 0, device=device, device_workspace=workspace,
                          aggregation_cache=config.features.aggregation_cache is not False)


def spec_of(model: nn.Module, config: Config, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of a built-in model **instance** trained on ``device`` as
    :func:`~betty_trainer.training.trainer.train` trains it (:func:`estimator_spec`): what the instance declares
    (kind, widths, parameters, buffers, memory and work terms), the optimizer ``config.optim.make_optimizer``
    builds (``config.optim.optimizer``, with ``config.optim.weight_decay``) and the device's BLAS workspaces, measured
    once per process (:func:`~betty_trainer.memory.device.device_workspace`; 0 on the CPU).

    Raises:
        PlanningError: ``model`` is not a built-in model, an instance of a registered architecture's class
            (:func:`~betty_trainer.models.registry.architecture_of`); custom models are calibrated instead.
        RecordingRefused: a torch the memory recorder is not tested with (:func:`estimator_spec`).
    """
    architecture = architecture_of(model)
    if architecture is None:
        raise PlanningError(f"{type(model).__name__} has no closed-form memory estimate; custom models are calibrated")
    workspace = device_workspace(device, next(model.parameters()).dtype)
    return estimator_spec(model, architecture, optimizer=config.optim.optimizer,
                          weight_decay=config.optim.weight_decay != 0, device=device, device_workspace=workspace,
                          aggregation_cache=config.features.aggregation_cache is not False)


def estimator_spec(model: LayerStack, architecture: Architecture, *, optimizer: str, weight_decay: bool,
                   device: torch.device | str, device_workspace: int, aggregation_cache: bool = False) -> ModelSpec:
    """What a built-in model declares to the estimator (:class:`~estimator.spec.ModelSpec`): its architecture's
    name and work terms, its widths, aggregator, heads and dropout, its parameter tensors (in
    ``model.parameters()`` order) and buffers read off the instance, its memory terms recorded from its code (every
    layer's and its projected layers': :func:`~betty_trainer.models.recorded_terms.model_terms`); with the
    training's ``optimizer`` (and ``weight_decay``) on the foreach or single-tensor path PyTorch picks for
    ``device``, the kernels dropout and aggregation use there, and the ``device_workspace`` bytes the caller
    measured; with ``aggregation_cache``, layer 0 reads the input-feature aggregation cache (its
    ``aggregated_width``: :attr:`~estimator.spec.ModelSpec.aggregated_width`). The spec counts a gather of the
    input rows (:attr:`~estimator.spec.ModelSpec.features_in_place` is ``False``: an upper bound);
    ``make_planner`` sets what the run's feature store does.

    Raises:
        RecordingRefused: a torch the memory recorder is not tested with
            (:func:`~estimator.recorder.check_torch`).
    """
    first, terms = model.layers[0], model_terms(model)
    parameter = next(model.parameters())
    return ModelSpec(
        architecture.name, model.widths,
        aggregator=getattr(first, "aggregator", "mean"), heads=getattr(first, "heads", 1), dropout=model.dropout.p,
        dtype_bytes=parameter.element_size(), optimizer=optimizer,
        parameter_numels=tuple(tuple(p.numel() for p in layer.parameters()) for layer in model.layers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        weight_decay=weight_decay, foreach=adam_uses_foreach(device),
        compiled_kernels=compiled_kernels(device, parameter.dtype), device_workspace=device_workspace,
        aggregated_width=model.aggregated_width if aggregation_cache else None,
        forward_terms=terms.memory_terms, layer_terms=terms.layer_memory_terms, projections=terms.projections,
        layer_work=architecture.work)
