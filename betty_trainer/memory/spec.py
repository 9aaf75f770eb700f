"""The estimator's description of a built-in model (:class:`~estimator.spec.ModelSpec`), read off the model
instance and the run's config: what the closed-form estimate (:mod:`estimator.estimate`) replays."""

from __future__ import annotations

import torch
from torch import nn

from betty_trainer.config import Config
from betty_trainer.data.graph import Graph
from betty_trainer.errors import PlanningError
from betty_trainer.memory.device import device_workspace
from betty_trainer.models import architecture_of, build_model
from betty_trainer.models.capabilities import projected_terms
from betty_trainer.rng import compiled_kernels
from estimator.spec import ModelSpec, adam_uses_foreach


def model_spec(config: Config, graph: Graph, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of the built-in model ``config.model`` on ``graph`` (built on the meta
    device, so no memory is used; see :func:`spec_of`)."""
    with torch.device("meta"):
        model = build_model(config.model, graph)
    return spec_of(model, config, device)


def spec_of(model: nn.Module, config: Config, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of a built-in model **instance** trained on ``device`` as
    :func:`~betty_trainer.training.trainer.train` trains it: its kind, widths, aggregator, heads, dropout,
    parameter tensors (in ``model.parameters()`` order) and buffers read off the instance; the optimizer
    ``config.optim.make_optimizer`` builds (Adam, with ``config.optim.weight_decay``) on the foreach or
    single-tensor path PyTorch picks for the device;
    the kernels dropout and aggregation use there; the device's BLAS workspaces, measured once per process
    (:func:`~betty_trainer.memory.device.device_workspace`; 0 on the CPU); and the model's own memory terms (each layer's
    ``memory_terms`` beside its ``forward``), which the estimate replays.

    Raises:
        PlanningError: ``model`` is not a built-in model, an instance of a registered architecture's class
            (:func:`~betty_trainer.models.registry.architecture_of`); custom models are calibrated instead.
    """
    architecture = architecture_of(model)
    if architecture is None:
        raise PlanningError(f"{type(model).__name__} has no closed-form memory estimate; custom models are calibrated")
    first = model.layers[0]
    parameter = next(model.parameters())
    workspace = device_workspace(device, parameter.dtype)
    projections = tuple(projected_terms(model))
    return ModelSpec(
        architecture.name, model.widths,
        aggregator=getattr(first, "aggregator", "mean"), heads=getattr(first, "heads", 1), dropout=model.dropout.p,
        dtype_bytes=parameter.element_size(), optimizer=config.optim.optimizer,
        parameter_numels=tuple(tuple(p.numel() for p in layer.parameters()) for layer in model.layers),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        weight_decay=config.optim.weight_decay != 0, foreach=adam_uses_foreach(device),
        compiled_kernels=compiled_kernels(device, parameter.dtype), device_workspace=workspace,
        forward_terms=model.memory_terms, layer_terms=model.layer_memory_terms, projections=projections,
        layer_work=architecture.work)
