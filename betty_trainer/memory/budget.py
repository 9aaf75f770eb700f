"""The memory budget of a training step, term by term: as configured or read from the GPU's free memory (NVML),
less the caching allocator's margin, the feature store's device bytes and what a bulk sampler holds on the GPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from betty_trainer.config import MicroBatchConfig
from betty_trainer.errors import ConfigError
from betty_trainer.memory.device import allocator_margin
from betty_trainer.process import allocator_setting


@dataclass(frozen=True)
class BudgetTerms:
    """The terms of the budget a training step is planned against (bytes).

    ``step_bytes = device_bytes − allocator_margin − feature_store_bytes − sampler_bytes``: what one step's estimate (whose
    resident part holds the parameters, the optimizer state and the device workspace,
    :func:`estimator.estimate.model_state_bytes`) may reach.

    Attributes:
        budget: ``micro_batch.budget`` as configured: bytes, ``"auto"`` or ``None`` (no budget: a fixed K).
        device_bytes: the memory the run may hold on the device: the configured bytes, or for ``auto`` NVML's
            free memory plus what this process's caching allocator already reserves (``None`` without a budget).
        nvml_free, process_reserved: the two parts of ``device_bytes`` under ``auto`` (else ``None``).
        allocator: the CUDA caching allocator's setting (:func:`~betty_trainer.process.allocator_setting`;
            ``None`` on the CPU or with PyTorch's defaults).
        allocator_margin: kept free for the allocator's fragmentation (``micro_batch.safety_margin``, or
            :func:`~betty_trainer.memory.device.allocator_margin`; 0 on the CPU).
        feature_store_bytes: what the feature store holds on the device between steps (node cache, staged
            macro-batch: the store's ``max_device_bytes``).
        sampler_bytes: what a bulk sampler holds on the device (``sampling.device: cuda``): the graph structure
            copied there and a draw's peak (:attr:`BulkDraw.device_bytes
            <betty_trainer.sampling.bulk.BulkDraw.device_bytes>`; 0 when sampling runs on the CPU).
    """

    budget: int | str | None
    device_bytes: int | None
    allocator: str | None
    allocator_margin: int
    feature_store_bytes: int = 0
    sampler_bytes: int = 0
    nvml_free: int | None = None
    process_reserved: int | None = None

    @property
    def step_bytes(self) -> int | None:
        """The budget of one training step's estimate, or ``None`` without a budget."""
        if self.device_bytes is None:
            return None
        return self.device_bytes - self.allocator_margin - self.feature_store_bytes - self.sampler_bytes

    def report(self) -> dict:
        """The terms as ``plan.json`` holds them (``step_bytes`` included)."""
        return {**asdict(self), "step_bytes": self.step_bytes}


def resolve_budget(config: MicroBatchConfig, device: torch.device, feature_store_bytes: int = 0,
                   sampler_bytes: int = 0) -> BudgetTerms:
    """The budget's terms: the configured bytes, or for ``auto`` the GPU's free memory (NVML) plus what this
    process's allocator reserves, less the allocator's margin, ``feature_store_bytes`` and ``sampler_bytes``
    (bytes; :class:`BudgetTerms`).

    ``auto`` should be read once CUDA is initialised in this process (the planner's workspace probe,
    :func:`~betty_trainer.memory.device.device_workspace`, does it), so that the CUDA context is not counted as free.

    Raises:
        ConfigError: ``auto`` without a CUDA device, or a margin, feature store and sampler that leave nothing.
    """
    device = torch.device(device)
    setting = allocator_setting() if device.type == "cuda" else None
    if config.budget is None:
        return BudgetTerms(None, None, setting, 0, feature_store_bytes, sampler_bytes)
    nvml_free = reserved = None
    if config.budget == "auto":
        if device.type != "cuda":
            raise ConfigError("micro_batch.budget=auto reads free GPU memory and needs a CUDA device; "
                              "on CPU give a size, e.g. micro_batch.budget=4GiB")
        nvml_free, reserved = _nvml_free(device), torch.cuda.memory_reserved(device)
        total = nvml_free + reserved
    else:
        total = config.budget
    margin = config.safety_margin if config.safety_margin is not None else allocator_margin(total, device, setting)
    terms = BudgetTerms(config.budget, total, setting, margin, feature_store_bytes, sampler_bytes, nvml_free, reserved)
    source = f"the GPU's {total} bytes free" if config.budget == "auto" else f"the {total}-byte micro_batch.budget"
    if margin >= total:
        raise ConfigError(f"the allocator margin ({margin} bytes; micro_batch.safety_margin) takes all of {source}; "
                          "lower micro_batch.safety_margin or free GPU memory")
    if terms.step_bytes <= 0:
        raise ConfigError(f"the feature store's node cache and staged macro-batch ({feature_store_bytes} bytes) and "
                          f"the bulk sampler on the GPU ({sampler_bytes} bytes) take {source} less the {margin}-byte "
                          "allocator margin, leaving nothing for a training step; shrink features.cache.size, "
                          "features.macro_batch_budget or sampling.bulk_memory (or set sampling.device=cpu), or "
                          "raise the budget")
    return terms


def _nvml_free(device: torch.device) -> int:
    """NVML's free memory of ``device`` in bytes (every process's use subtracted), the device found under
    ``CUDA_VISIBLE_DEVICES`` as PyTorch's own NVML queries find it (``torch.cuda._get_nvml_device_index``)."""
    import pynvml

    if device.index is not None:
        index = device.index
    else:  # asking for the current device would initialise CUDA, which is 0 until then
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    nvml_index = getattr(torch.cuda, "_get_nvml_device_index", lambda index: index)(index)
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(nvml_index)).free)
    finally:
        pynvml.nvmlShutdown()
