"""The processes of a distributed run: joining them (``torchrun``'s environment), agreeing before training, and
leaving.

``torchrun`` (``torch.distributed.run``) starts the processes and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`join` reads them through ``init_process_group``'s ``env://`` method, so one
node (``--nproc-per-node P``) and several (``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``) work
alike. Without that environment a run is a world of one process (a ``HashStore``), which runs the same code.

The main group moves rows and gradients on the training device (NCCL on CUDA, gloo on the CPU); sampled ids,
metrics and agreement checks are CPU tensors or objects, so they go over a gloo group (the main group itself on
the CPU).

``torch.distributed.nn.functional`` is imported here, before :func:`join` makes a group: its functions' default
``group`` arguments hold whatever ``dist.group.WORLD`` was when it was first imported, and torch imports it
lazily (``torch._dynamo``, which fake tensors and ``torch.library`` pull in). Imported after the group was
made, those defaults keep the group's Python object alive after :func:`leave`, so gloo tore the group down
at interpreter finalisation and a rank could abort after its run had finished ("terminate called without an
active exception", SIGABRT).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (imported before any group exists: see the module docstring)

from betty_trainer.distributed.exchange import collective
from betty_trainer.errors import ConfigError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` sets for every process it starts (``env://`` initialisation reads them)."""


@dataclass
class Processes:
    """This process's place in a distributed run.

    Attributes:
        rank: this process's rank, ``0 ≤ rank < world_size``; rank 0 alone writes the run directory and prints.
        world_size: ``P``, the processes in the run.
        local_rank: this process's index on its node (its GPU on CUDA).
        group: the main process group (NCCL on CUDA, gloo on the CPU): rows, row gradients and parameter
            gradients.
        cpu_group: a gloo group of the same processes (the main group on the CPU): sampled ids, metrics and
            agreement checks.
        device: the device this process trains on (``cuda:<local_rank>`` on CUDA).
    """

    rank: int
    world_size: int
    local_rank: int
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    device: torch.device

    @property
    def leads(self) -> bool:
        """Whether this is rank 0, the process that writes the run directory, prints and evaluates."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether ``torchrun`` (or a launcher setting the same variables) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def join(device: torch.device, backend: str = "auto", timeout_s: float = 600.0) -> Processes:
    """Join the run's processes (a collective over all of them) and pick this process's device.

    Args:
        device: the configured training device (``cuda`` trains on ``cuda:<LOCAL_RANK>``).
        backend: ``nccl``, ``gloo``, or ``auto`` (NCCL on CUDA, gloo on the CPU).
        timeout_s: seconds a collective waits for the others before failing.

    Returns:
        The :class:`Processes`.

    Raises:
        ConfigError: NCCL on the CPU, fewer GPUs on this node than processes, or a process group already
            initialised by the caller with another world.
    """
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend=nccl needs train.device=cuda; use gloo (or auto) on the CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"process {local_rank} on this node has no GPU: {torch.cuda.device_count()} visible; "
                              "start at most that many processes per node (torchrun --nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if launched_by_torchrun():
            dist.init_process_group(backend, timeout=timeout)
        else:  # a world of one process runs the same code
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return Processes(dist.get_rank(), dist.get_world_size(), local_rank, group, cpu_group, device)


def leave() -> None:
    """Leave the process group :func:`join` made (no collective; safe after a failure)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def digest(text: str) -> str:
    """16 hex digits of the sha256 of ``text`` (what :func:`agree` compares)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree(processes: Processes, values: dict[str, str]) -> None:
    """Refuse to train unless every process holds the same ``values`` (a collective over ``cpu_group``).

    Args:
        values: what must agree, by name (e.g. ``{"config": digest(yaml), "dataset": fingerprint}``).

    Raises:
        ConfigError: on every process, naming the first value that differs and the ranks on each side.
        TrainingError: a process died before agreeing.
    """
    gathered: list[dict[str, str] | None] = [None] * processes.world_size
    with collective("the agreement on config and dataset", processes.cpu_group):
        dist.all_gather_object(gathered, values, group=processes.cpu_group)
    for name in values:
        seen: dict[str, list[int]] = {}
        for rank, theirs in enumerate(gathered):
            seen.setdefault(theirs.get(name, "missing"), []).append(rank)
        if len(seen) > 1:
            sides = "; ".join(f"rank {ranks[0]} has {value}" if len(ranks) == 1 else
                              f"ranks {', '.join(map(str, ranks))} have {value}" for value, ranks in seen.items())
            raise ConfigError(f"the processes of this run differ in their {name} ({sides}); start every process "
                              "with the same config and dataset")
