"""Analytic memory estimator (Betty §4.4.3): per-micro-batch bytes by component and the peak.

Not implemented yet: it is the subject of the memory-estimator issue. Until then
the trainer takes the number of micro-batches ``K`` from the config
(``micro_batch.num_micro_batches``) and nothing in the project reports a memory estimate.
"""
