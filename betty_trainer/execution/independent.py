"""Independent minibatching, the data-parallel baseline of cooperative minibatching (cooperative paper §1, Table 1):
each of ``P`` ranks samples and runs its own share of the global batch's seeds, and only the gradients are summed.

Rank ``p`` runs its ``b_p`` seeds with its own plan (micro-batches or layer-wise chunks), which adds
``∇ mean_{i∈V_p} CE_i`` to ``.grad``; scaled by ``b_p / B`` and summed over the ranks, that is
``∇ mean_{i∈V} CE_i``, the gradient of the global batch's mean loss, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from betty_trainer.data.block import Batch
from betty_trainer.data.feature_store import FeatureStore
from betty_trainer.distributed.exchange import collective
from betty_trainer.execution.cooperative import all_reduce_gradients
from betty_trainer.execution.plan import StepPlan, StepResult


@dataclass
class IndependentPlan:
    """A :class:`~betty_trainer.execution.plan.StepPlan`: this rank's share of the global batch run by its own
    ``local`` plan, then the gradients averaged over the ranks by their seed counts (a collective after the
    local plan: the ranks' plans may have different pieces).

    Attributes:
        batch: this rank's share of the global batch (no seeds when the global batch has fewer than ``P``).
        local: the plan of this rank's seeds (``None`` for an empty share: the rank adds no gradient but joins the
            collectives).
        group: the group the gradients are summed over (NCCL on CUDA); ``cpu_group``: the loss and correct
            counts' (gloo).
    """

    batch: Batch
    local: StepPlan | None
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    method: ClassVar[str] = "independent"

    @property
    def pieces(self) -> int:
        return self.local.pieces if self.local is not None else 1

    @property
    def estimate(self) -> int | None:
        return self.local.estimate if self.local is not None else None

    @property
    def work(self) -> float:
        return self.local.work if self.local is not None else 0.0

    @property
    def host_bytes(self) -> int:
        return self.local.host_bytes if self.local is not None else 0

    @property
    def summary(self) -> str:
        how = self.local.summary if self.local is not None else "nothing (no seeds)"
        return f"a share of the seeds as {how}"

    def redundancy(self) -> list[float]:
        return self.local.redundancy() if self.local is not None else [1.0] * len(self.batch.blocks)

    def run(self, model: nn.Module, features: FeatureStore, labels: Tensor, device: torch.device) -> StepResult:
        """The local plan's forward and backward, then ``.grad ← Σ_p (b_p / B) .grad_p`` on every rank; returns the
        global batch's mean loss and correct count.

        Raises:
            TrainingError: see the local plan; or a collective failed because a rank died.
        """
        local = self.batch.output_nodes.numel()
        result = self.local.run(model, features, labels, device) if self.local is not None else StepResult(0.0, 0)
        totals = torch.tensor([result.loss * local, float(result.correct), float(local)], dtype=torch.float64)
        with collective("the all-reduce of the loss", self.cpu_group):
            dist.all_reduce(totals, group=self.cpu_group)
        num_outputs = int(totals[2].item())
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(local / num_outputs)
        all_reduce_gradients(model, self.group)
        return StepResult(totals[0].item() / num_outputs, int(totals[1].item()))

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer, features: FeatureStore, labels: Tensor,
                device: torch.device) -> list[int]:
        return self.local.measure(model, optimizer, features, labels, device) if self.local is not None else []

    def report(self, measured: list[int] | None = None) -> dict:
        local = self.local.report(measured) if self.local is not None else {"num_micro_batches": 0}
        return {**local, "distributed": self.method, "rank": dist.get_rank(self.group),
                "world_size": dist.get_world_size(self.group)}
