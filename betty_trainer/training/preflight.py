"""Checks a run makes before it loads any data, shared by ``betty-train validate`` and :func:`train`.

A config that passes :func:`~betty_trainer.config.load_config` is well-formed; these checks go further
and look at this machine and at sizes the schema cannot relate: the dataset name is known, the device
exists, the synthetic graph has room for its split, the memory budget can be resolved, the run directory
is not a file, and the packages optional features need are installed. ``train`` runs the same checks, so a
config ``validate`` accepts does not fail for any of these reasons once data is loading. One more check
needs the graph's feature width and so runs once the data is loaded: :func:`check_model_size`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from betty_trainer.config import Config
from betty_trainer.datasets import DATASETS, require_labels
from betty_trainer.errors import ConfigError
from betty_trainer.memory.budget import resolve_budget
from betty_trainer.models import build_model
from betty_trainer.sampling.schedule import check_macro_batch_budget
from betty_trainer.training.distributed import check_cooperative
from betty_trainer.training.rundir import check_run_dir_path, holds_checkpoint, holds_run, refuse_foreign_files

_STATE_COPIES = 4  # parameters, gradients and Adam's two moments


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
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"invalid config value for 'train.device' ({name!r}): use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no CUDA GPU is available; use train.device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"train.device is {name} but this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                          "use cuda:0 … or train.device=auto")
    return device


def check_config(config: Config, *, dataset: bool = True, run_dir: Path | None = None,
                 strict_device: bool = True) -> list[str]:
    """Every check of a run that needs no data; returns the names of the checks made.

    Args:
        config: the run's config.
        dataset: check ``config.dataset`` (``False`` when the caller passes its own graph).
        run_dir: the run directory to check (default ``config.train.run_dir`` when set).
        strict_device: a CUDA device this machine lacks is an error (``train``, ``plan``); ``False`` reports it
            instead (``validate``: a config may be checked
            on a laptop and run on a GPU node), and the budget is then checked only as far as the config goes.

    Returns:
        What was checked, e.g. ``["dataset name", "device (cpu)", "synthetic split sizes", "budget", ...]``.

    Raises:
        ConfigError: naming the key and the fix. RunDirError: the run directory is or lies under a file, or (without
            ``run_dir``) holds files betty-train did not write.
    """
    checked = []
    run_directory = _check_run_dir(config, run_dir)  # checked first, listed in its place
    if dataset:
        if config.dataset.name not in DATASETS:
            raise ConfigError(f"unknown dataset {config.dataset.name!r} (dataset.name); known: {', '.join(DATASETS)}")
        require_labels(config.dataset.name)  # a structure-only graph cannot be trained: said before reading it
        checked.append("dataset name")
    try:
        device = resolve_device(config.train.device)
        checked.append(f"device ({device})")
    except ConfigError as error:
        if strict_device:
            raise
        device = None
        checked.append(f"device ({config.train.device}: not on this machine, train would refuse it here: {error})")
    if dataset and config.dataset.name == "synthetic":
        synthetic = config.dataset.synthetic
        needed = synthetic.train_per_class * synthetic.num_classes + synthetic.num_val + synthetic.num_test
        if needed > synthetic.num_nodes:
            raise ConfigError(
                f"dataset.synthetic.num_nodes is {synthetic.num_nodes} but its split needs {needed} nodes "
                f"(train_per_class × num_classes + num_val + num_test); raise dataset.synthetic.num_nodes or "
                "lower dataset.synthetic.num_val / num_test")
        checked.append("synthetic split sizes")
    if config.micro_batch.budget is not None:
        if device is not None:
            resolve_budget(config.micro_batch, device)
        check_macro_batch_budget(config)
        checked.append("budget")
    if run_directory is not None:
        checked.append(run_directory)
    if config.distributed.mode == "cooperative":
        check_cooperative(config)
        checked.append("cooperative mode")
    if config.train.tensorboard:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("train.tensorboard=true needs the tensorboard package: pip install tensorboard "
                              "(or set train.tensorboard=false)")
        checked.append("tensorboard")
    return checked


def _check_run_dir(config: Config, run_dir: Path | None) -> str | None:
    """:func:`check_config`'s run directory check: what was checked, or ``None`` without a run directory."""
    path = run_dir if run_dir is not None else config.train.run_dir
    if path is None:
        return None
    check_run_dir_path(Path(path))
    if run_dir is None:  # validate checks what a new run needs
        refuse_foreign_files(Path(path))
    if run_dir is None and holds_run(Path(path)):  # validate: train decides with --resume or --overwrite
        go_on = ("continues it with --resume, " if holds_checkpoint(Path(path))
                 else "cannot resume it (no last.pt yet), ")
        return (f"run directory ({path} holds a run: train {go_on}replaces it with --overwrite, and "
                "refuses it otherwise)")
    return "run directory"


def check_model_size(config: Config, graph, device: torch.device) -> int:
    """Refuse a built-in model whose parameters, gradients and Adam state cannot fit in ``device``'s
    memory (the model is built on the meta device, so nothing is allocated).

    Args:
        config: the run's config (``config.model``).
        graph: the :class:`~betty_trainer.data.graph.Graph` the model is sized for.
        device: where training runs.

    Returns:
        The number of parameters.

    Raises:
        ConfigError: naming ``model.hidden`` / ``model.num_layers``, the bytes needed and the memory there; or
            the model's sizes are past what a tensor can index (e.g. GAT's ``heads × hidden`` rows over 2⁶³).
    """
    available = _memory_bytes(device)
    try:
        with torch.device("meta"):
            model = build_model(config.model, graph)
    except (RuntimeError, OverflowError, TypeError) as error:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:120]
        if not isinstance(error, OverflowError) and "overflow" not in cause.lower():
            raise  # a bug in the architecture's build, not a size: its traceback is the report
        raise ConfigError(f"the model section {config.model.model_dump(exclude={'arch'})} asks for tensors too large "
                          f"to build ({cause}); lower model.hidden, model.num_layers or the architecture's "
                          "own sizes") from None
    numel = sum(p.numel() for layer in model.layers for p in layer.parameters())
    needed = numel * next(model.parameters()).element_size() * _STATE_COPIES
    if available is not None and needed > available:
        raise ConfigError(
            f"model.hidden={config.model.hidden} with model.num_layers={config.model.num_layers} gives {numel:,} "
            f"parameters: {needed / 2**30:.1f} GiB with gradients and Adam state, more than the "
            f"{available / 2**30:.1f} GiB of {device} memory; lower model.hidden or model.num_layers")
    return numel


def _memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
