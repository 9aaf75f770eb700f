"""The memory plan of a batch: a model's estimate (closed form, or calibrated for a custom model), the
budget, and the K search of :mod:`partition` composed into micro-batches."""
