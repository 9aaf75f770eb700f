"""Planning a rank's step in a distributed run (``distributed.mode``): the step plans of
:mod:`betty_trainer.execution.cooperative` and :mod:`betty_trainer.execution.independent`.

- ``independent``: this rank's share of the seeds is a batch of its own, planned by the single-process
  :class:`~betty_trainer.memory.planner.Planner` (micro-batches or layer-wise chunks, a budget, out-of-memory
  re-plans: none of it needs the other ranks, as the collectives come after the local plan) and wrapped in an
  :class:`~betty_trainer.execution.independent.IndependentPlan`.
- ``cooperative``: the share runs in ``micro_batch.num_micro_batches`` rounds, the same on every rank so the
  collectives match (cooperative paper §3.1 with Betty §4.2's accumulation across the ranks).
"""

from __future__ import annotations

import torch.distributed as dist

from betty_trainer.data.block import Batch
from betty_trainer.distributed.group import Processes
from betty_trainer.distributed.share import CooperativeBatch
from betty_trainer.errors import TrainingError
from betty_trainer.execution.cooperative import CooperativePlan
from betty_trainer.execution.independent import IndependentPlan
from betty_trainer.execution.plan import StepPlan
from betty_trainer.memory.planner import Planner
from betty_trainer.sampling.cooperative import CooperativeSampler


class DistributedPlanner:
    """The planner of one rank (``plan`` and ``report``, as :class:`~betty_trainer.memory.planner.Planner`'s).

    Args:
        local: the single-process planner (independent mode plans this rank's batch with it).
        processes: this rank's place in the run.
        sampler: the cooperative sampler (cooperative mode; ``None`` for independent).
        rounds: micro-batch rounds of every cooperative step.
    """

    def __init__(self, local: Planner, processes: Processes, sampler: CooperativeSampler | None = None,
                 rounds: int = 1) -> None:
        self.local, self.processes, self.sampler, self.rounds = local, processes, sampler, rounds

    def plan(self, batch: Batch | CooperativeBatch, min_pieces: int = 1) -> StepPlan:
        """This rank's plan of ``batch`` (its share of a global batch).

        Raises:
            PlanningError: independent mode: see :meth:`Planner.plan`.
            TrainingError: cooperative mode asked for more rounds than configured (after an out-of-memory error:
                the ranks cannot agree on a re-plan mid-step).
        """
        processes = self.processes
        if self.sampler is None:
            return IndependentPlan(self.local.plan(batch, min_pieces), processes.group, processes.cpu_group)
        if min_pieces > self.rounds:
            raise TrainingError(f"rank {processes.rank} ran out of device memory in a cooperative step of "
                                f"{self.rounds} round(s); raise micro_batch.num_micro_batches (the ranks cannot "
                                "re-plan one step together)")
        shares = [batch] if self.rounds == 1 else list(self.sampler.rounds(batch.seeds, batch.key, self.rounds))
        return CooperativePlan(batch, shares, processes.rank, processes.world_size)

    def report(self, plan: StepPlan, measured: list[int] | None = None) -> dict:
        """``plan.json``'s content on rank 0: every rank's plan report (a collective over the ranks' CPU group),
        under ``ranks``, beside the budget's terms."""
        reports: list[dict | None] = [None] * self.processes.world_size
        dist.all_gather_object(reports, plan.report(measured), group=self.processes.cpu_group)
        local = self.local.report(plan, measured)
        return {"mode": plan.method, "world_size": self.processes.world_size, "ranks": reports,
                "memory_terms": local["memory_terms"]}
