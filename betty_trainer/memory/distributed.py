"""Planning a rank's step in a distributed run (``distributed.mode``): the step plans of
:mod:`betty_trainer.execution.cooperative` and :mod:`betty_trainer.execution.independent`.

- ``independent``: this rank's share of the seeds is a batch of its own, planned by the single-process
  :class:`~betty_trainer.memory.planner.Planner` (micro-batches or layer-wise chunks, a budget, out-of-memory
  re-plans: none of it needs the other ranks, as the collectives come after the local plan) and wrapped in an
  :class:`~betty_trainer.execution.independent.IndependentPlan`.
- ``cooperative``: the share runs in micro-batch rounds, the same number on every rank so the collectives match
  (cooperative paper §3.1 with Betty §4.2's accumulation across the ranks): ``micro_batch.num_micro_batches``, or
  under ``micro_batch.budget`` the fewest (doubling from one) whose every round fits on every rank, agreed by an
  all-reduce. A round's estimate is :func:`estimator.cooperative.estimate_cooperative_share`: the built-in model's
  layers with the exchanges' buffers between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from betty_trainer.data.block import Batch
from betty_trainer.distributed.exchange import collective
from betty_trainer.distributed.group import Processes
from betty_trainer.distributed.share import CooperativeBatch
from betty_trainer.errors import ConfigError, PlanningError, TrainingError
from betty_trainer.execution.cooperative import CooperativePlan
from betty_trainer.execution.independent import IndependentPlan
from betty_trainer.execution.plan import StepPlan
from betty_trainer.memory.planner import Planner
from betty_trainer.sampling.cooperative import CooperativeSampler
from estimator.estimate import MemoryEstimate


class DistributedPlanner:
    """The planner of one rank (``plan`` and ``report``, as :class:`~betty_trainer.memory.planner.Planner`'s).

    Raises:
        ConfigError: cooperative rounds under a budget without a built-in model's estimate.

    Args:
        local: the single-process planner (independent mode plans this rank's batch with it).
        processes: this rank's place in the run.
        sampler: the cooperative sampler (cooperative mode; ``None`` for independent).
        rounds: micro-batch rounds of every cooperative step.
    """

    def __init__(self, local: Planner, processes: Processes, sampler: CooperativeSampler | None = None,
                 rounds: int = 1) -> None:
        if sampler is not None and local.budget is not None and self._estimate_of(local) is None:
            raise ConfigError("distributed.mode=cooperative under micro_batch.budget needs a built-in model's estimate "
                              "of a share; set micro_batch.num_micro_batches instead for a custom model")
        self.local, self.processes, self.sampler, self.rounds = local, processes, sampler, rounds

    def plan(self, batch: Batch | CooperativeBatch, min_pieces: int = 1) -> StepPlan:
        """This rank's plan of ``batch`` (its share of a global batch).

        Raises:
            PlanningError: independent mode: see :meth:`Planner.plan`; cooperative: a budget no rounds fit.
            TrainingError: cooperative mode asked for more rounds than configured (after an out-of-memory error:
                the ranks cannot agree on a re-plan mid-step).
        """
        processes = self.processes
        if self.sampler is None:
            local = self.local.plan(batch, min_pieces) if batch.output_nodes.numel() else None
            return IndependentPlan(batch, local, processes.group, processes.cpu_group)
        if min_pieces > 1:
            raise TrainingError(f"rank {processes.rank} ran out of device memory in a cooperative step; raise "
                                "micro_batch.num_micro_batches or lower micro_batch.budget (the ranks cannot re-plan "
                                "one step together)")
        budget, started, tried = self.local.budget, time.perf_counter(), []
        rounds = self.rounds if budget is None else 1
        while True:
            shares = [batch] if rounds == 1 else list(self.sampler.rounds(batch.seeds, batch.key, rounds))
            plan = CooperativePlan(batch, shares, processes.rank, processes.world_size, self._itemise, budget, tried,
                                   feature_store_bytes=self.local.feature_store_bytes)
            if budget is not None:
                tried.append((rounds, max(estimate.peak_bytes for estimate in plan.estimates)))
            if budget is None or self._all_fit(tried[-1][1], budget):
                plan.seconds = time.perf_counter() - started
                return plan
            if rounds >= batch.seeds.numel():
                raise PlanningError(f"memory budget {budget} bytes is impossible for a cooperative step: with one seed "
                                    f"of the global batch per round, some rank's share needs more; raise the budget")
            rounds = min(2 * rounds, batch.seeds.numel())

    @property
    def _itemise(self) -> Callable[[CooperativeBatch, bool], MemoryEstimate] | None:
        return self._estimate_of(self.local)

    @staticmethod
    def _estimate_of(local: Planner) -> Callable[[CooperativeBatch, bool], MemoryEstimate] | None:
        """A round's itemised estimate from ``local``'s closed form, or ``None`` (a custom model)."""
        estimator = local.estimator
        if estimator is None or not estimator.closed_form:
            return None
        return lambda share, accumulate: estimator.cooperative_share(share.blocks, share.exchange_counts(), accumulate)

    def _all_fit(self, largest: int, budget: int) -> bool:
        """Whether every rank's rounds fit ``budget`` (``largest``: this rank's largest round estimate; a collective:
        each rank's answer, all-reduced), so every rank doubles its rounds together and the collectives match."""
        misses = torch.tensor([int(largest > budget)])
        with collective("the agreement on micro-batch rounds", self.processes.cpu_group):
            dist.all_reduce(misses, group=self.processes.cpu_group)
        return int(misses) == 0

    def report(self, plan: StepPlan, measured: list[int] | None = None) -> dict:
        """``plan.json``'s content on rank 0: every rank's plan report (a collective over the ranks' CPU group),
        under ``ranks``, beside the budget's terms and a bulk sampler's draw (:meth:`Planner.memory_report`)."""
        reports: list[dict | None] = [None] * self.processes.world_size
        with collective("the gathering of plans", self.processes.cpu_group):
            dist.all_gather_object(reports, plan.report(measured), group=self.processes.cpu_group)
        return {"mode": plan.method, "world_size": self.processes.world_size, "ranks": reports,
                **self.local.memory_report()}
