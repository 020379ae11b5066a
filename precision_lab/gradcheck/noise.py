"""Rounding noise of a build, fitted at nearby points, and the Student t statistics its few degrees of freedom need."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from .. import formats
from .points import displaced, dot, tensor_step
from .program import Calls, Evaluation

#: noise points move each element ~64 ulps: enough to re-randomise every rounding, while the
#: loss's curvature over 3·64 ulps, (192u)² relative, stays far below one rounding error u
NOISE_ULPS = 64
NOISE_MULTIPLIERS = (-3, -2, -1, 1, 2, 3)
#: without a float64 build every resolution is k_crit·σ_L/|ΔL|: 12 points (11 dof) bring Student t's 1e-4 quantile
#: from 11.2 (5 dof) to 5.9 for 6 more calls, as much as a segment twice as long (curvature over 6·64 ulps is still
#: (384u)² relative, far below u)
NOISE_MULTIPLIERS_FLOAT32 = (-6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6)
#: a loss "does not respond" to the noise steps when its fitted slope is within this many standard
#: errors of zero while its gradient predicts twice that (10: beyond t₅'s 1e-3 quantile, 6.9)
ALPHA_CRITICAL_FLAT = 10.0
#: two-sided false-alarm probability of one comparison (Student t with the noise fit's dof)
ALPHA = 1e-4
#: a tensor is settled when its check resolves the directional derivative to this relative
#: accuracy: a wrong factor, sign, missing term or index moves it far more; float64 differences
#: reach ~1e-10·√n, float32 ones ~1e-3 at best, which cannot settle anything
SETTLE_RTOL = 1e-4


def t_two_sided_p(k: float, dof: float) -> float:
    """P(|T| > k) for Student's t with `dof` degrees of freedom."""
    return float(2.0 * stats.t.sf(abs(k), dof))


def t_critical(alpha: float, dof: float) -> float:
    """The k with P(|T| > k) = alpha."""
    return float(stats.t.isf(alpha / 2.0, dof))


@dataclass
class Noise:
    """Rounding noise of one build, measured by a straight-line fit through nearby points."""

    build: str
    precision: str
    loss: float  # the loss at the base point
    loss_sigma: float  # σ_L
    dof: int
    grad_sigma: dict[str, np.ndarray]  # σ_g per element
    step_ulps: int = NOISE_ULPS
    slope: float = math.nan  # the fitted loss change per unit step along the noise line
    slope_sigma: float = math.nan
    predicted_slope: float = math.nan  # what the gradient says it is
    identical: bool = False  # the loss is the same number at every noise point while the gradient is not zero
    single_losses: bool = False  # every loss is a float32 number

    @property
    def responsive(self) -> bool:
        """False when the loss ignores steps of a few ulps that its gradient says are far beyond its noise:
        the build rounds its parameters to a coarser format (a "float64" build that computes in float32).
        A float64 build's loss that is the same number at all 7 points says so too, whatever the gradient's
        size: float64 arithmetic re-rounds at every point, so identical results need a coarser format."""
        if self.identical and self.precision == "float64":
            return False
        flat = abs(self.slope) <= ALPHA_CRITICAL_FLAT * self.slope_sigma
        return not (flat and abs(self.predicted_slope) > 2 * ALPHA_CRITICAL_FLAT * max(self.slope_sigma, 1e-300))

    def direction_sigma(self, displacement: dict[str, np.ndarray]) -> float:
        """Noise of g·Δ: √Σ Δᵢ²σ_gᵢ² (elements' roundings taken as independent)."""
        return math.sqrt(sum(float(np.sum((step * self.grad_sigma[name]) ** 2)) for name, step in displacement.items()))

    def summary(self) -> dict:
        return {"build": self.build, "precision": self.precision, "loss": self.loss, "loss_sigma": self.loss_sigma,
                "loss_sigma_in_u": self.loss_sigma / (formats.unit_roundoff(self.precision) * abs(self.loss))
                if self.loss else math.nan, "dof": self.dof,
                "grad_sigma_rms": {k: float(np.sqrt(np.mean(v ** 2))) for k, v in self.grad_sigma.items()}}


def measure_noise(calls: Calls, build: str, precision: str, base: dict[str, np.ndarray], at_base: Evaluation,
                  scales: dict[str, float], rng: np.random.Generator, multipliers=NOISE_MULTIPLIERS) -> Noise:
    """σ_L and σ_g from len(multipliers) points around the base along one random line (linear fit, 5 dof for 6)."""
    storage = np.dtype("float64" if precision == "float64" else "float32")
    relative = NOISE_ULPS * formats.unit_roundoff(precision)
    displacement = {name: tensor_step(value, relative * scales[name], storage, multipliers, rng)
                    for name, value in base.items()}
    evaluations = {0: at_base}
    for m in multipliers:
        evaluations[m] = calls(build, displaced(base, displacement, m))
    t = np.array(sorted(evaluations), dtype=np.float64)
    design = np.stack([np.ones_like(t), t], axis=1)
    projector = np.eye(len(t)) - design @ np.linalg.pinv(design)  # residual maker of a straight-line fit
    dof = len(t) - 2
    losses = np.array([evaluations[m].loss for m in sorted(evaluations)])
    u = formats.unit_roundoff(precision)
    # floor: a loss or gradient returned in a format was rounded to it at least once (≤ u·|value|), even
    # when the program's arithmetic happens to be exact at these points (a polynomial loss, say)
    loss_sigma = max(float(np.sqrt(np.sum((projector @ losses) ** 2) / dof)), u * float(np.max(np.abs(losses))))
    slope = float((np.linalg.pinv(design) @ losses)[1])
    slope_sigma = loss_sigma / math.sqrt(float(np.sum((t - t.mean()) ** 2)))
    grad_sigma = {}
    for name in base:
        stacked = np.stack([evaluations[m].grads[name].ravel() for m in sorted(evaluations)])
        fitted = np.sqrt(np.sum((projector @ stacked) ** 2, axis=0) / dof)
        grad_sigma[name] = np.maximum(fitted, u * np.max(np.abs(stacked), axis=0)).reshape(base[name].shape)
    moving = any(np.any(evaluations[0].grads[name]) for name in base)
    return Noise(build, precision, at_base.loss, loss_sigma, dof, grad_sigma, slope=slope, slope_sigma=slope_sigma,
                 predicted_slope=dot(at_base.grads, displacement),
                 identical=bool(moving and np.all(losses == losses[0])),
                 single_losses=bool(np.all(losses.astype(np.float32).astype(np.float64) == losses)))
