"""How one batch's forward and backward run: the :class:`~betty_trainer.execution.plan.StepPlan` interface and its
implementations, each beside its executor (micro-batches, layer-wise chunks)."""
