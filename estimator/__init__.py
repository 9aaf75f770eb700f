"""Analytic memory estimator (Betty §4.4.3): per-micro-batch bytes by component and the peak.

Not implemented yet: it is the subject of the memory-estimator issue. Until then
the trainer takes the number of micro-batches ``K`` from the config
(``micro_batch.num_micro_batches``) and nothing in the project reports a memory estimate.
The ground truth estimates will be checked against is :func:`measure_peak`.
"""

from estimator.measure import MeasuredPeak, measure_peak

__all__ = ["MeasuredPeak", "measure_peak"]
