"""The built-in architectures: one :class:`Architecture` record per ``model.arch`` name, registered by the
model's own file, from which the config's choices and sections, the estimator's model description and the
planner's work model are read. A new built-in architecture is one module in ``betty_trainer/models/`` that
calls :func:`register` (``betty_trainer.models`` imports every module of the package), plus its tests and docs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

from estimator.work import LayerSize, Work


@dataclass(frozen=True)
class Architecture:
    """A built-in architecture, as the config, the estimator and the planner know it.

    Attributes:
        name: its ``model.arch`` value.
        title: what the config section's docstring calls it (the model and its paper).
        model: the ``nn.Module`` class :attr:`build` returns (the estimator recognises an instance by it).
        build: ``(model config section, graph) -> model``, sized for the graph.
        keys: the config keys only this architecture has, as pydantic fields: name → ``(annotation,
            pydantic.Field(...))`` (SAGE's ``aggregator``, GAT's ``heads``); every architecture also has
            ``hidden``, ``num_layers`` and ``dropout``.
        work: ``(spec, LayerSize) -> Work``: one layer's multiply-adds per pass, which ``micro_batch.mode=auto``
            compares (:func:`estimator.work.step_work`, through ``ModelSpec.layer_work``), written beside the
            layer's forward and memory terms. ``spec`` is the model's ``estimator.spec.ModelSpec`` (its aggregator,
            heads).
    """

    name: str
    title: str
    model: type[nn.Module]
    build: Callable[[Any, Any], nn.Module]
    work: Callable[[Any, LayerSize], Work]
    keys: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {}
"""Every registered architecture by ``model.arch`` name, in registration order."""


def register(architecture: Architecture) -> Architecture:
    """Add ``architecture`` to :data:`ARCHITECTURES` (a model module calls this once, at import).

    Raises:
        ValueError: the name or the model class is registered already.
    """
    if architecture.name in ARCHITECTURES:
        raise ValueError(f"architecture {architecture.name!r} is registered already")
    if any(known.model is architecture.model for known in ARCHITECTURES.values()):
        raise ValueError(f"{architecture.model.__name__} is registered already")
    ARCHITECTURES[architecture.name] = architecture
    return architecture


def architecture_of(model: nn.Module) -> Architecture | None:
    """The registered architecture whose class ``model`` is exactly (a subclass is a custom model), else ``None``."""
    return next((known for known in ARCHITECTURES.values() if type(model) is known.model), None)


def as_built(model: nn.Module) -> bool:
    """Whether ``model`` is a built-in model as :attr:`Architecture.build` makes it, which never writes its input
    features (what a step that reads them in place relies on): its class registered exactly
    (:func:`architecture_of`), every submodule a class of ``betty_trainer.models`` or a ``Linear``/``ModuleList``, no
    module with a method set on the instance or a forward pre-hook. A layer swapped in by the user, a subclass or a
    patched method makes it a custom model here."""
    return architecture_of(model) is not None and all(
        (type(module).__module__.startswith("betty_trainer.models.") or type(module) in (nn.Linear, nn.ModuleList))
        and not module._forward_pre_hooks and not any(callable(value) for value in vars(module).values())
        for module in model.modules())
