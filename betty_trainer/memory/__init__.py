"""The memory plan of a batch: a model's estimate (closed form, or calibrated for a custom model), the budget, the
work model, and the planner that searches the micro-batches or layer-wise chunks that fit."""
