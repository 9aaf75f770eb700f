"""A training run across processes (``distributed.mode``; README › Several GPUs): what :func:`~betty_trainer.
training.trainer.train` does differently when ``torchrun`` starts it ``P`` times.

- Every rank loads the config and the dataset and builds the same model (same seed); :func:`agree` refuses a run
  whose ranks differ before anything is written.
- Sampling and planning per mode: :class:`~betty_trainer.sampling.cooperative.CooperativeSampler` with vertex
  ownership (:func:`~betty_trainer.distributed.ownership.load_owners`), or
  :class:`~betty_trainer.sampling.independent.IndependentSampler`; :class:`~betty_trainer.memory.distributed.
  DistributedPlanner` wraps the planner.
- Rank 0 alone writes the run directory, prints, and evaluates (:func:`leader_value` hands its accuracies to
  the others, so early stopping agrees); every rank's transfer counters are gathered into ``metrics.jsonl``
  (:func:`rank_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from betty_trainer.config import Config
from betty_trainer.data.graph import Graph
from betty_trainer.distributed.exchange import ExchangeTraffic, collective
from betty_trainer.distributed.group import Processes, agree, digest, join
from betty_trainer.distributed.ownership import load_owners
from betty_trainer.errors import ConfigError
from betty_trainer.memory.distributed import DistributedPlanner
from betty_trainer.memory.planner import Planner
from betty_trainer.sampling.base import BlockSampler, Sampler
from betty_trainer.sampling.cooperative import CooperativeSampler
from betty_trainer.sampling.independent import IndependentSampler

T = TypeVar("T")


def join_run(config: Config, device: torch.device) -> Processes | None:
    """This process's place in the run (:func:`~betty_trainer.distributed.group.join`), or ``None`` for a
    single-process run (``distributed.mode: none``). A cooperative config that mode does not run is refused before
    any process group exists (:func:`check_cooperative`).

    Raises:
        ConfigError: see ``join`` and :func:`check_cooperative`.
    """
    settings = config.distributed
    if settings.mode == "none":
        return None
    if settings.mode == "cooperative":
        check_cooperative(config)
    return join(device, settings.backend, settings.timeout_s)


def check_cooperative(config: Config) -> None:
    """Refuse what cooperative mode does not run, in one line each (checked by ``validate`` too).

    Raises:
        ConfigError: naming the key and what to set instead.
    """
    if config.sampling.sampler in ("gns", "bulk-ladies"):
        why = ("GNS's node cache is one process's" if config.sampling.sampler == "gns" else
               "LADIES samples its vertices per batch, which ranks sampling their own dst nodes would multiply")
        raise ConfigError(f"distributed.mode=cooperative samples with full, ns, bulk-ns or labor; {why} (set "
                          "sampling.sampler, or distributed.mode=independent)")
    if config.micro_batch.mode != "micro_batches":
        raise ConfigError("distributed.mode=cooperative runs a rank's share in micro-batch rounds; set "
                          "micro_batch.mode=micro_batches")
    if config.features.macro_batch:
        raise ConfigError("distributed.mode=cooperative stages no macro-batches; set features.macro_batch=0")


def this_rank(config: Config, graph: Graph, dataset_fingerprint: str, sampler: Sampler, planner: Planner,
              processes: Processes | None) -> tuple[Sampler, Planner | DistributedPlanner, ExchangeTraffic]:
    """The sampler and planner of this rank, after the ranks have agreed on the run (:func:`agree_on_run`), and
    the counter of the bytes a cooperative sampler's exchanges send; ``sampler`` and ``planner`` themselves (and a
    counter that stays at zero) in a single process. ``sampler``'s node cache is the wrapped one's (a feature store
    built on ``sampler`` is this rank's).

    Raises:
        ConfigError: the ranks differ in config or dataset, or see :func:`distributed_sampler`.
    """
    traffic = ExchangeTraffic()
    if processes is None:
        return sampler, planner, traffic
    agree_on_run(processes, config, dataset_fingerprint)
    sampler = distributed_sampler(config, graph, sampler, processes, traffic)
    return sampler, distributed_planner(config, planner, sampler, processes), traffic


def distributed_sampler(config: Config, graph: Graph, sampler: Sampler, processes: Processes,
                        traffic: ExchangeTraffic) -> Sampler:
    """The sampler of this rank: ``sampler`` wrapped for ``distributed.mode``; a cooperative one counts the bytes
    its exchanges send in ``traffic``. Rank 0 computes the vertex ownership (METIS can take minutes on a large
    graph) and keeps it on disk; the other ranks read it after.

    Raises:
        ConfigError: a cooperative run whose sampler has no per-layer function.
    """
    if config.distributed.mode == "independent":
        return IndependentSampler(sampler, processes.rank, processes.world_size)
    if not isinstance(sampler, BlockSampler):
        raise ConfigError("distributed.mode=cooperative needs a per-layer sampler (full, ns, bulk-ns, labor)")
    kind, world = config.distributed.ownership, processes.world_size
    if processes.leads:
        owners = load_owners(graph, world, kind, config.seed)
    with collective("waiting for rank 0's vertex ownership", processes.cpu_group):
        dist.barrier(group=processes.cpu_group)
    if not processes.leads:
        owners = load_owners(graph, world, kind, config.seed)
    return CooperativeSampler(sampler, owners, processes.cpu_group, processes.group, traffic)


def distributed_planner(config: Config, planner: Planner, sampler: Sampler, processes: Processes) -> DistributedPlanner:
    """``planner`` wrapped for this rank (:class:`~betty_trainer.memory.distributed.DistributedPlanner`)."""
    cooperative = sampler if isinstance(sampler, CooperativeSampler) else None
    return DistributedPlanner(planner, processes, cooperative, config.micro_batch.num_micro_batches)


def agree_on_run(processes: Processes, config: Config, dataset_fingerprint: str) -> None:
    """Refuse the run unless every rank has the same resolved config and dataset (before anything is written).

    Raises:
        ConfigError: naming what differs and the ranks on each side.
    """
    agree(processes, {"config": digest(config.to_yaml()), "dataset": dataset_fingerprint})


def leader_value(processes: Processes | None, compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0, handed to every rank (a collective: the others wait for it), e.g. the run
    directory's name or the accuracies of rank 0's evaluation; ``compute()`` itself in a single process.

    Raises:
        TrainingError: a rank died before the broadcast (naming this rank).
    """
    if processes is None:
        return compute()
    value = [compute() if processes.leads else None]
    with collective("waiting for rank 0", processes.cpu_group):
        dist.broadcast_object_list(value, src=0, group=processes.cpu_group)
    return value[0]


def rank_metrics(processes: Processes, counters: dict[str, int], exchanged_bytes: int) -> dict:
    """Every rank's epoch counters (a collective): ``ranks``, one dict per rank (``counters``, e.g.
    ``host_to_device_bytes``, and ``exchanged_bytes``: what it sent to the other ranks), and the same fields
    summed over the ranks (counts and bytes).

    Raises:
        TrainingError: a rank died before the gathering (naming this rank).
    """
    mine = {**counters, "exchanged_bytes": exchanged_bytes}
    ranks: list[dict | None] = [None] * processes.world_size
    with collective("the gathering of metrics", processes.cpu_group):
        dist.all_gather_object(ranks, mine, group=processes.cpu_group)
    return {**{name: sum(rank[name] for rank in ranks) for name in mine}, "ranks": ranks}


def finish_together(processes: Processes | None) -> None:
    """Wait until every rank has finished training (a barrier; nothing in a single process), so that no rank tears
    its process group down while another still uses it: gloo aborts a process whose peer leaves mid-connection.

    Raises:
        TrainingError: a rank died before the barrier (naming this rank).
    """
    if processes is not None:
        with collective("waiting for the other ranks to finish", processes.cpu_group):
            dist.barrier(group=processes.cpu_group)
