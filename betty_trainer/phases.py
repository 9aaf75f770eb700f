"""The phases of training that the loop marks for ``torch.profiler`` (``torch.profiler.record_function`` ranges), so
that a profile of a run splits its time into its preparation, sampling, staging, planning, feature gathering
(host→device), the training step, the optimizer update and evaluation, on the CPU and, with CUDA activity recorded,
on the GPU (``benchmarks/epoch_phases.py`` reads them). Outside a profiler a range costs a few microseconds; one is
entered a handful of times per batch.
"""

from __future__ import annotations

PREPARE = "betty::prepare"
"""A run's preparation before its first epoch, once: the data, model, feature store, sampler and planner (the
planner's graph partition for sampled batches included), the run directory and the first batch's plan."""
SAMPLE = "betty::sample"
"""Sampling a round's batches (:meth:`Sampler.sample_many <betty_trainer.sampling.base.Sampler.sample_many>`)."""
STAGE = "betty::stage"
"""Staging a macro-batch's input rows on the device (the feature store's ``prefetch``; BatchGNN §3)."""
PLAN = "betty::plan"
"""Planning a batch: micro-batches or layer-wise chunks under the budget (the planner's ``plan``)."""
STEP = "betty::step"
"""A batch's forward and backward over its micro-batches or chunks (the step plan's ``run``), gathers included.
A failed attempt (a CUDA out-of-memory error) and the redone step are each a range; the re-plan between them
falls outside every range."""
GATHER = "betty::gather"
"""Reading a micro-batch's, chunk's or share's input rows from the feature store (host→device on a GPU)."""
OPTIMIZER = "betty::optimizer"
"""The optimizer's update after a batch."""
EVALUATE = "betty::evaluate"
"""An epoch's evaluation on the validation and test nodes."""

PHASES = (PREPARE, SAMPLE, STAGE, PLAN, STEP, GATHER, OPTIMIZER, EVALUATE)
"""Every phase, in the order a run meets them (``GATHER`` runs inside ``STEP``; ``PREPARE`` once per run)."""
