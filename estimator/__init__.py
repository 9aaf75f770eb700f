"""Memory estimator (Betty §4.4.3): per-micro-batch bytes by component and the peak, and the measured
peak every estimate is checked against.

- :func:`estimate_micro_batch`: closed-form, op-by-op estimate of one training step of a
  built-in model (GraphSAGE mean/gcn, GCN) from a micro-batch's :class:`LayerCounts`.
- :class:`~estimator.recorder.RecordedModel`: the estimate of any other model, its training step recorded on fake
  tensors at a few sizes and solved exactly (:mod:`estimator.recorder`).
- :class:`CalibratedModel`: the estimate of a model the recorder refuses, fitted to a few measured steps
  (:func:`estimator.calibrate.fit`).
- :func:`measure_peak`: the real peak (``torch.cuda.max_memory_allocated`` or the CPU
  profiler's allocation records).

This package never imports ``betty_trainer``.
"""

from estimator.calibrate import CalibratedModel
from estimator.counts import LayerCounts
from estimator.estimate import COMPONENTS, MemoryEstimate, estimate_micro_batch, model_state_bytes
from estimator.measure import MeasuredPeak, measure_peak
from estimator.spec import ModelSpec

__all__ = ["COMPONENTS", "CalibratedModel", "LayerCounts", "MeasuredPeak", "MemoryEstimate", "ModelSpec",
           "estimate_micro_batch", "measure_peak", "model_state_bytes"]
