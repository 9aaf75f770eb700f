"""The estimator's description of a built-in model (:class:`~estimator.spec.ModelSpec`), read off the model
instance and the run's config: what the closed-form estimate (:mod:`estimator.estimate`) replays. The device's
part (its BLAS workspaces) is measured here; the model describes the rest itself
(:func:`~betty_trainer.models.capabilities.estimator_spec`)."""

from __future__ import annotations

import torch
from torch import nn

from betty_trainer.config import Config
from betty_trainer.data.graph import Graph
from betty_trainer.errors import PlanningError
from betty_trainer.memory.device import device_workspace
from betty_trainer.models import ARCHITECTURES, architecture_of, build_model
from betty_trainer.models.capabilities import estimator_spec
from estimator.spec import ModelSpec


def model_spec(config: Config, graph: Graph, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of the built-in model ``config.model`` on ``graph`` (built on the meta
    device, so no memory is used; as :func:`spec_of` describes an instance, the built-in model's parameters
    having the default dtype); with ``features.aggregation_cache``, layer 0 reads the cache (BatchGNN §3)."""
    workspace = device_workspace(device, torch.get_default_dtype())
    with torch.device("meta"):
        model = build_model(config.model, graph)
    return estimator_spec(model, ARCHITECTURES[config.model.arch], optimizer=config.optim.optimizer,
                          weight_decay=config.optim.weight_decay != 0, device=device, device_workspace=workspace,
                          aggregation_cache=config.features.aggregation_cache is not False)


def spec_of(model: nn.Module, config: Config, device: torch.device | str = "cpu") -> ModelSpec:
    """The estimator's description of a built-in model **instance** trained on ``device`` as
    :func:`~betty_trainer.training.trainer.train` trains it (:func:`~betty_trainer.models.capabilities.
    estimator_spec`): what the instance declares (kind, widths, parameters, buffers, memory and work terms), the
    optimizer ``config.optim.make_optimizer`` builds (``config.optim.optimizer``, with
    ``config.optim.weight_decay``) and the device's BLAS workspaces, measured once per process
    (:func:`~betty_trainer.memory.device.device_workspace`; 0 on the CPU).

    Raises:
        PlanningError: ``model`` is not a built-in model, an instance of a registered architecture's class
            (:func:`~betty_trainer.models.registry.architecture_of`); custom models are calibrated instead.
    """
    architecture = architecture_of(model)
    if architecture is None:
        raise PlanningError(f"{type(model).__name__} has no closed-form memory estimate; custom models are calibrated")
    workspace = device_workspace(device, next(model.parameters()).dtype)
    return estimator_spec(model, architecture, optimizer=config.optim.optimizer,
                          weight_decay=config.optim.weight_decay != 0, device=device, device_workspace=workspace,
                          aggregation_cache=config.features.aggregation_cache is not False)
