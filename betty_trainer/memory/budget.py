"""The memory budget of a training step: as configured, or read from the GPU's free memory (NVML)."""

from __future__ import annotations

import torch

from betty_trainer.config import MicroBatchConfig
from betty_trainer.errors import ConfigError


def resolve_budget(config: MicroBatchConfig, device: torch.device) -> int | None:
    """The budget in bytes: as configured, or for ``auto`` the GPU's free memory (NVML) minus
    ``safety_margin``; ``None`` without a budget.

    Raises:
        ConfigError: ``auto`` without a CUDA device, or a margin that leaves nothing.
    """
    if config.budget != "auto":
        return config.budget
    if device.type != "cuda":
        raise ConfigError("micro_batch.budget=auto reads free GPU memory and needs a CUDA device; "
                          "on CPU give a size, e.g. micro_batch.budget=4GiB")
    import pynvml

    pynvml.nvmlInit()
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free
    finally:
        pynvml.nvmlShutdown()
    if free <= config.safety_margin:
        raise ConfigError(f"the GPU has {free} bytes free, not more than micro_batch.safety_margin "
                          f"({config.safety_margin}); lower the margin or free GPU memory")
    return free - config.safety_margin
