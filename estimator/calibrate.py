"""Memory estimate of a model the closed form does not cover, fitted to measured peaks (docs/design.md › Memory estimate).

A training step's memory is live tensors whose sizes are linear in the
micro-batch's counts (rows of src nodes, dst nodes or edges times fixed widths),
so the bytes a step adds above the model's state are, for one model, approximately

    step(x) = max(floor, c0 + Σ_l (α_l·S_l + β_l·D_l + γ_l·E_l))

with ``S_l, D_l, E_l`` layer ``l``'s src nodes, dst nodes and edges. The first
term is the optimizer step (the optimizer's temporaries, the same for every
micro-batch), the second the forward/backward peak. That peak
is exactly a maximum of linear functions (what is live at each moment of the
step; which moment wins depends on the sizes), approximated here by one; the fit's
residual and a held-out sample bound the error. The peak of a step is then

    peak = resident + block_structure + step(x),    block_structure = 8·Σ_l (S_l + D_l + 1 + E_l)

:func:`fit` finds ``floor`` (the smallest measured step) and the coefficients (non-negative
least squares on the relative error, over the samples above the floor) from a few
measured steps; :meth:`CalibratedModel.estimate` evaluates it for any micro-batch.

This module never imports ``betty_trainer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from estimator.counts import LayerCounts, block_structure_bytes

FIT_TOLERANCE = 0.05  # largest relative error of the fitted peak on a calibration sample
FLOOR_MARGIN = 0.02  # a sample within this fraction of the floor may be the optimizer step's peak


class FitError(ValueError):
    """The measured peaks do not follow the model ``peak = resident + blocks + step(counts)`` (see the module)."""


class SamplesTooSmallError(FitError):
    """Too few samples rise above the optimizer step's floor to fit the coefficients: larger micro-batches are needed."""


@dataclass(frozen=True)
class CalibratedModel:
    """Fitted per-layer memory coefficients of one model and optimizer (see the module for the formula).

    Attributes:
        resident_bytes: bytes live before a step: parameters, buffers, optimizer state and,
            as the fitted steps accumulate, the parameter gradients.
        floor_bytes: bytes a step adds at the least (the optimizer step's temporaries),
            block structure excluded.
        intercept_bytes: ``c0``, bytes of the forward/backward peak independent of the counts.
        src_bytes: ``α_l``, bytes per src node of layer ``l`` (input layer first).
        dst_bytes: ``β_l``, bytes per dst node. Where ``D_l`` equals ``S_{l+1}`` in every
            sample (always, for sampled batches) the two are one unknown and ``β_l`` is 0.
        edge_bytes: ``γ_l``, bytes per edge.
        max_relative_error: the largest ``|fitted − measured| / measured`` peak over the
            calibration samples.
        first_saving_bytes: how much less a batch's first micro-batch peaks than the fitted
            (accumulating) case, which has the earlier micro-batches' gradients resident: the
            smallest difference measured on the calibration's largest samples, so never more than
            the saving really is.
    """

    resident_bytes: int
    floor_bytes: int
    intercept_bytes: float
    src_bytes: tuple[float, ...]
    dst_bytes: tuple[float, ...]
    edge_bytes: tuple[float, ...]
    max_relative_error: float
    first_saving_bytes: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.src_bytes)

    def step_bytes(self, layers: Sequence[LayerCounts]) -> int:
        """``step(x)``: bytes a step adds above the resident bytes and the block structure.

        Raises:
            ValueError: if the number of layers differs from the model's.
        """
        if len(layers) != self.num_layers:
            raise ValueError(f"the micro-batch has {len(layers)} layers but the model was calibrated with {self.num_layers}")
        linear = self.intercept_bytes + sum(
            a * c.num_src + b * c.num_dst + g * c.num_edges
            for a, b, g, c in zip(self.src_bytes, self.dst_bytes, self.edge_bytes, layers)
        )
        return max(self.floor_bytes, math.ceil(linear))

    def estimate(self, layers: Sequence[LayerCounts], accumulate: bool = True) -> int:
        """Estimated peak bytes of a training step of the micro-batch with counts ``layers``
        (input layer first): resident + block structure + :meth:`step_bytes`, less
        ``first_saving_bytes`` for a batch's first micro-batch (``accumulate=False``).

        Raises:
            ValueError: if the number of layers differs from the model's.
        """
        peak = self.resident_bytes + block_structure_bytes(layers) + self.step_bytes(layers)
        return peak if accumulate else peak - self.first_saving_bytes


def fit(
    samples: Sequence[tuple[Sequence[LayerCounts], int]],
    resident_bytes: int,
    tolerance: float = FIT_TOLERANCE,
) -> CalibratedModel:
    """Fit a :class:`CalibratedModel` to measured training steps.

    ``floor`` is the smallest measured step (if even that sample is above the optimizer
    step's peak, micro-batches smaller than it are overestimated); the samples more than
    :data:`FLOOR_MARGIN` above it are on the forward/backward line, whose coefficients are the non-negative
    least-squares solution (``scipy.optimize.nnls``) of the relative residuals. A count
    that is a linear combination of others in every sample (``D_l = S_{l+1}``, or a
    count constant across samples) is not identifiable and gets coefficient 0.

    Args:
        samples: ``(layers, peak_bytes)`` per measured step: the micro-batch's counts,
            input layer first, and the measured peak (bytes) with ``resident_bytes`` live before it.
        resident_bytes: bytes live before every step (parameters, buffers, optimizer state).
        tolerance: the largest relative error allowed on a sample's peak.

    Returns:
        The :class:`CalibratedModel`.

    Raises:
        ValueError: no samples, or samples with different numbers of layers.
        FitError: a peak below ``resident_bytes`` plus the block structure, or a
            fitted peak off by more than ``tolerance`` (the message names the sample and the numbers).
        SamplesTooSmallError: too few samples above the floor to over-determine the fit.
    """
    if not samples:
        raise ValueError("fit needs at least one measured sample")
    num_layers = len(samples[0][0])
    if any(len(layers) != num_layers for layers, _ in samples):
        raise ValueError("every sample must have the same number of layers")
    from scipy.optimize import nnls  # half a second to import; only calibration needs it

    steps = np.array([peak - resident_bytes - block_structure_bytes(layers) for layers, peak in samples], dtype=float)
    for (layers, peak), step in zip(samples, steps):
        if step < 0:
            raise FitError(f"a measured peak ({peak} bytes) is below the resident bytes ({resident_bytes}) "
                                   f"plus the block structure ({block_structure_bytes(layers)}) of {_describe(layers)}; "
                                   "the resident bytes do not match the measured model")
    floor = float(steps.min())
    design = np.array([_features(layers) for layers, _ in samples], dtype=float)
    on_line = steps > floor * (1 + FLOOR_MARGIN)
    columns = _independent_columns(design[on_line]) if on_line.any() else [0]
    if on_line.sum() <= len(columns):
        raise SamplesTooSmallError(f"{int(on_line.sum())} of {len(samples)} samples lie above the optimizer step's "
                                   f"floor ({int(floor)} bytes), too few to fit and check {len(columns)} coefficients; "
                                   "calibrate with larger micro-batches")
    chosen = design[on_line][:, columns]
    scale = np.abs(chosen).max(axis=0)
    weights = 1.0 / steps[on_line]  # relative residuals: small samples count as much as large ones
    solution, _ = nnls(chosen / scale * weights[:, None], steps[on_line] * weights)
    coefficients = np.zeros(design.shape[1])
    coefficients[columns] = solution / scale
    fitted = np.maximum(floor, design @ coefficients)

    peaks = np.array([peak for _, peak in samples], dtype=float)
    errors = np.abs(fitted - steps) / peaks
    worst = int(errors.argmax())
    if errors[worst] > tolerance:
        layers, peak = samples[worst]
        raise FitError(
            f"the measured peaks are not a linear function of the micro-batch's node and edge counts: the best fit is "
            f"off by {errors[worst]:.1%} (allowed {tolerance:.0%}) on {_describe(layers)} (measured {peak} bytes, "
            f"fitted {int(peak - steps[worst] + fitted[worst])}); does the model allocate memory whose size depends "
            "on something else (random sizes, data-dependent shapes, caches kept between steps)?")
    per_layer = coefficients[1:].reshape(num_layers, 3)
    return CalibratedModel(
        resident_bytes=resident_bytes,
        floor_bytes=math.ceil(floor),
        intercept_bytes=float(coefficients[0]),
        src_bytes=tuple(per_layer[:, 0].tolist()),
        dst_bytes=tuple(per_layer[:, 1].tolist()),
        edge_bytes=tuple(per_layer[:, 2].tolist()),
        max_relative_error=float(errors[worst]),
    )


def _features(layers: Sequence[LayerCounts]) -> list[int]:
    """``[1, S_0, D_0, E_0, S_1, …]``: one row of the design matrix."""
    return [1] + [n for c in layers for n in (c.num_src, c.num_dst, c.num_edges)]


def _independent_columns(design: np.ndarray) -> list[int]:
    """Indices of a maximal set of linearly independent columns of ``[1, S_0, D_0, E_0, …]``, taken
    in the order intercept, src counts, edge counts, dst counts (so ``D_l = S_{l+1}`` keeps ``α_{l+1}``)."""
    scaled = design / np.maximum(np.abs(design).max(axis=0), 1)
    order = [0, *range(1, design.shape[1], 3), *range(3, design.shape[1], 3), *range(2, design.shape[1], 3)]
    kept: list[int] = []
    for column in order:
        if np.linalg.matrix_rank(scaled[:, kept + [column]]) == len(kept) + 1:
            kept.append(column)
    return sorted(kept)


def _describe(layers: Sequence[LayerCounts]) -> str:
    """``"the micro-batch with src/dst/edges per layer 30/10/40, 10/2/12"``."""
    return "the micro-batch with src/dst/edges per layer " + ", ".join(
        f"{c.num_src}/{c.num_dst}/{c.num_edges}" for c in layers)
