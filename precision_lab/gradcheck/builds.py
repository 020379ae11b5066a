"""The claimed build against the float64 build at the same nearby points: rounding changes, a bug repeats."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .. import formats

#: whole-vector directions whose ±h points (with the base: 7) both builds answer
COMPARISON_LINES = 3
#: a claimed-build error that repeats at every nearby point is rounding only while it is below this
#: many times the rounding spread measured there: errors that re-randomise and errors that do not
#: (roundings of data-only computations) come from the same float arithmetic on the same terms, and
#: grow as √(number of roundings); 30× would need ~900× more roundings in the frozen part
PERSISTENCE_LIMIT = 30.0


@dataclass
class BuildComparison:
    """The claimed build's gradient (or loss) minus the float64 build's at the same nearby points."""

    quantity: str
    points: int
    max_abs_err: float  # at the base point
    persistent: float  # max over elements of the error present at every point (same sign, smallest |·|)
    bound_ratio: float  # max over elements of that error ÷ (PERSISTENCE_LIMIT × rounding scale)
    spread_excess: float  # median over elements of the measured spread ÷ the float64-predicted one
    flagged: int = 0
    size: int = 1
    worst: list[dict] = field(default_factory=list)
    pattern: str = ""
    directional: str = ""

    def summary(self) -> dict:
        return {k: getattr(self, k) for k in ("points", "max_abs_err", "persistent", "bound_ratio", "spread_excess",
                                               "flagged", "size", "worst", "pattern", "directional")}


def format_index(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, index)) + "]" if index else ""


def _pattern(name: str, indices: np.ndarray, shape: tuple[int, ...]) -> str:
    """The flagged elements as one index pattern: an axis they share is named, others are ':'."""
    if not len(indices):
        return ""
    axes = []
    for axis in range(len(shape)):
        values = np.unique(indices[:, axis])
        axes.append(str(int(values[0])) if len(values) == 1 and shape[axis] > 1 else ":")
    return f"{name}[{', '.join(axes)}]" if shape else name


def compare_builds(name: str, claimed: np.ndarray, float64: np.ndarray, float64_sigma: np.ndarray,
                   claimed_precision: str, direction: np.ndarray | None = None) -> BuildComparison:
    """Judge the claimed build against the float64 build from answers at P nearby points.

    `claimed` and `float64` are (P, *shape) (point 0 the base); `float64_sigma` is the float64
    build's own rounding noise per element. The rounding scale of an element is the largest of:
    the spread of its error across the points, the float64 noise × u_claimed/u64 (the same
    arithmetic in the claimed format), one unit roundoff of its value and of the tensor's RMS
    gradient (storage rounding). An error that repeats at every point beyond PERSISTENCE_LIMIT
    times that scale is not rounding.
    """
    u = formats.unit_roundoff(claimed_precision)
    ratio_u = u / formats.unit_roundoff("float64")
    difference = claimed - float64
    points = difference.shape[0]
    # the error present at every point: the smallest |difference| where all points share its sign
    same_sign = np.all(difference > 0, axis=0) | np.all(difference < 0, axis=0)
    nearest = np.take_along_axis(difference, np.argmin(np.abs(difference), axis=0)[None], axis=0)[0]
    persistent = np.where(same_sign, nearest, 0.0)
    spread = difference.std(axis=0, ddof=1)
    predicted = float64_sigma * ratio_u
    value = np.abs(float64).mean(axis=0)
    rms = float(np.sqrt(np.mean(float64[0] ** 2)))
    scale = np.maximum.reduce([spread, predicted, u * value, np.full_like(value, u * rms)])
    tiny = np.finfo(np.float64).tiny
    ratio = np.abs(persistent) / (PERSISTENCE_LIMIT * np.maximum(scale, tiny))
    measurable = predicted > 0
    excess = float(np.median(spread[measurable] / predicted[measurable])) if measurable.any() else math.nan
    flagged = np.argwhere(ratio > 1.0)
    order = np.argsort(-ratio.ravel())[: min(5, ratio.size)]
    worst = []
    for flat in order:
        index = np.unravel_index(flat, ratio.shape)
        if ratio[index] <= 1.0 and worst:
            break
        worst.append({"index": [int(i) for i in index], "error": float(persistent[index]),
                      "relative": float(abs(persistent[index]) / value[index]) if value[index] > 0 else math.inf,
                      "bound_ratio": float(ratio[index]), "spread": float(spread[index])})
    comparison = BuildComparison(
        quantity=name, points=points, max_abs_err=float(np.max(np.abs(difference[0]))),
        persistent=float(np.max(np.abs(persistent))), bound_ratio=float(np.max(ratio)), spread_excess=excess,
        flagged=int(len(flagged)), size=int(persistent.size), worst=worst,
        pattern=_pattern(name, flagged, persistent.shape) if len(flagged) else "")
    if direction is not None and difference.ndim > 1:
        projected = np.tensordot(difference, direction, axes=direction.ndim)
        comparison.directional = (f"along a random unit direction of {name} the {claimed_precision} gradient minus the "
                                  f"float64 one is {projected.mean():.3g} at every point (spread {projected.std(ddof=1):.2g} "
                                  f"over {points} points)")
    return comparison


def excess_limit(claimed_precision: str) -> float:
    """Spread ÷ predicted spread beyond which the arithmetic is coarser than claimed: the geometric
    midpoint between 1 and the next coarser format's u ratio (2¹³ from float32 to tf32/fp16)."""
    bits = formats.SIGNIFICAND_BITS[claimed_precision]
    coarser = [p for p in formats.SIGNIFICAND_BITS.values() if p < bits]
    return math.sqrt(2.0 ** (bits - max(coarser))) if coarser else math.inf


def implied_format(claimed_precision: str, excess: float) -> str:
    """The format whose unit roundoff the measured excess points to."""
    u = formats.unit_roundoff(claimed_precision) * excess
    name = min(formats.UNIT_ROUNDOFF, key=lambda f: abs(math.log(formats.UNIT_ROUNDOFF[f] / u)))
    return f"u ≈ 2^{math.log2(u):.1f} ({name})"
