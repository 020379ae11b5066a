"""Reference-free gradient check (docs/external.md §5, "Networks the lab has no model of").

For networks the lab has no model of (splines, attention, custom kernels), the only reference is
the program's own loss. The program is an *oracle*: given parameter values it answers the loss
and the gradient of each listed parameter tensor, in its claimed build (float32, …) and,
optionally, in a float64 build. The question: is the gradient it returns the derivative of the
loss it returns?

What the check spends its program calls on, in order:

1. **Noise.** The loss and gradient at 7 points NOISE_ULPS units in the last place apart along a
   random line through the parameters, in the build whose loss is differenced (float64 when
   there is one). A straight-line fit leaves the rounding noise of the loss, σ_L (5 degrees of
   freedom), and of each gradient element, σ_g: "repeat evaluations at nearby points".
2. **Directional derivatives.** Per parameter tensor a random unit direction d, step
   h = u^(1/3)·‖w‖ (the truncation/rounding trade-off of central differences, Nocedal & Wright,
   *Numerical Optimization*, 2nd ed., 2006, §8.1), points w ± h·d. The central quotient's h²
   term is measured with the gradients the program returns at ±h — Simpson's rule, which is the
   Richardson (Romberg) step of the trapezoid rule — so the residual
   R = L(+h) − L(−h) − h·(f₋ + 4f₀ + f₊)/3 (f = g·d) is O(h⁵) for a smooth loss and
   −2h × (error of the claimed directional derivative) for a wrong gradient. Its standard error
   follows from σ_L and σ_g, so each comparison reads "agrees within its bound" (k_crit standard errors
   plus the kink allowance, both printed) or "disagrees by k standard errors beyond the kink allowance"
   (Student t with the noise fit's degrees of freedom).
   **Kinks** (ReLU, max, clamps, spline knots): the two one-sided halves (trapezoids on [−h, 0]
   and [0, h]) agree for a smooth loss; a kink inside one of them breaks that, and a residual
   that does not shrink like a truncation error as h shrinks is not evidence either. The step is
   then shrunk LEVEL_FACTOR× (to h/16 at most) and, failing that, the direction changed. A
   disagreement counts only when it persists with the same size at two usable (kink-free) steps.
   A whole-vector direction (all tensors at once) is checked the same way.
3. **Claimed build against the float64 build** (when both exist): the float64 gradient, settled
   by 2., is the reference. At 7 nearby points (the base and ±h along 3 random whole-vector
   directions on the float32 grid) both builds answer; the difference is the claimed build's
   rounding error plus any bug. Rounding changes from point to point (its spread is measured
   there, and predicted from the float64 build's own noise × u_claimed/u64); a bug persists.
2′. **No float64 build** (or one that does not compute in float64): short differences in float32
   resolve g·d only to ~u^(2/3), far from settling anything. Instead the noise is measured at 12
   points (11 dof) and each tensor moves along one segment, and the exact identity
   L(w + Δ) − L(w − Δ) = ∫₋₁¹ g(w + tΔ)·Δ dt is checked with the program's own gradients at
   uniform nodes (see `Segment`). The segment's length comes from the program's own numbers
   (`segment_length`: the loss difference's rounding k·√2·σ_L is a quarter of SETTLE_RTOL of
   2‖Δ‖·|g·d|), its direction is at 45° between the claimed gradient and a random one
   (`half_aligned`), and its nodes are exact on the float32 grid (`segment_step`). Smooth integrands
   (nested trapezoid sums converging like h²): Simpson, with the coarser Simpson as its error bound;
   kinks (ReLU, max, clamps): each panel is its own identity, and a wrong gradient shifts every
   panel's residual in proportion to its integral (a fit with a Student t); few jumps: the run of
   panels beside them. A tensor whose segment crossed kinks is then moved with its layer along the
   layer's own values (`check_groups`): a weight, its bias and every later 1-D tensor scaled together by
   (1 + t) scale every pre-activation from that layer on, so no ReLU or max-pool changes its branch
   (positive homogeneity) and the segment resolves g·Δ to the loss difference's rounding; each member's
   part of that segment is its resolution (`Share`), and a disagreeing group names the members the other
   evidence does not clear. The calls left go where each bound comes from: a segment bounded by rounding is
   tried longer, one bounded by quadrature gets twice the panels, then a shorter segment, and a tensor
   behind many kinks gets the short stencil of 2. (which crosses few of them); a tensor's verdict is its
   best evidence's.
4. **Localisation.** A direction that fails is restricted to halves of the tensor (rows, then
   columns, … down to single elements) to name where the gradient is wrong; a float32-only
   error is located element by element from 3. at no extra cost.

Verdicts: ``roundoff`` (the gradient is the derivative of the loss, to a stated resolution),
``defect`` (with the tensor and the directional evidence) and ``inconclusive`` (the noise or
kinks leave the question open; the report says what would settle it). Never a pass rate.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
from scipy import stats

from .. import formats
from ..errors import LabInputError

VERDICTS = ("roundoff", "defect", "inconclusive")

#: central differences balance truncation h²|L'''|/6 against rounding u|L|/h at h ∝ u^(1/3)
#: (Nocedal & Wright 2006, §8.1, eq. 8.7); the step is scaled to the tensor's norm
STEP_EXPONENT = 1.0 / 3.0
#: noise points move each element ~64 ulps: enough to re-randomise every rounding, while the
#: loss's curvature over 3·64 ulps, (192u)² relative, stays far below one rounding error u
NOISE_ULPS = 64
NOISE_MULTIPLIERS = (-3, -2, -1, 1, 2, 3)
#: without a float64 build every resolution is k_crit·σ_L/|ΔL|: 12 points (11 dof) bring Student t's 1e-4 quantile
#: from 11.2 (5 dof) to 5.9 for 6 more calls, as much as a segment twice as long (curvature over 6·64 ulps is still
#: (384u)² relative, far below u)
NOISE_MULTIPLIERS_FLOAT32 = (-6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6)
#: whole-vector directions whose ±h points (with the base: 7) both builds answer
COMPARISON_LINES = 3
#: each refinement shrinks the step 4×: a kink at |t| > h/4 leaves the stencil, and a Simpson
#: truncation error falls 4⁴ = 256× (a persisting residual cannot be truncation)
LEVEL_FACTOR = 4
MAX_LEVELS = 3
MAX_DIRECTIONS = 2
#: the halves' trapezoid residuals differ by more than this fraction of the larger: one half holds a
#: kink the other does not (a wrong gradient or a truncation error changes little over one step)
KINK_FRACTION = 0.5
#: kinks inside a stencil (many of them, in float32 steps of ReLU networks) move the Simpson residual by
#: up to the gradient's jumps: one jump J at t* gives J·(2/3 − t*/a)/2 ≤ J/3, while the gradients show
#: |f₊ − 2f₀ + f₋|/2 = J/2 and the halves' difference |ρ₊ − ρ₋|/a ≤ J/2; their sum (× this factor) is
#: added to the uncertainty. For a smooth loss it is O(a²) and vanishes beside a real error.
NONSMOOTH_ALLOWANCE = 1.0
#: a loss "does not respond" to the noise steps when its fitted slope is within this many standard
#: errors of zero while its gradient predicts twice that (10: beyond t₅'s 1e-3 quantile, 6.9)
ALPHA_CRITICAL_FLAT = 10.0
#: two-sided false-alarm probability of one comparison (Student t with the noise fit's dof)
ALPHA = 1e-4
#: a disagreement persists when the residual at the smaller step is within this factor of the larger
#: step's (a truncation error shrinks ≥ 16×, a bug stays)
PERSIST_FACTOR = 2.0
#: a claimed-build error that repeats at every nearby point is rounding only while it is below this
#: many times the rounding spread measured there: errors that re-randomise and errors that do not
#: (roundings of data-only computations) come from the same float arithmetic on the same terms, and
#: grow as √(number of roundings); 30× would need ~900× more roundings in the frozen part
PERSISTENCE_LIMIT = 30.0
#: a tensor is settled when its check resolves the directional derivative to this relative
#: accuracy: a wrong factor, sign, missing term or index moves it far more; float64 differences
#: reach ~1e-10·√n, float32 ones ~1e-3 at best, which cannot settle anything
SETTLE_RTOL = 1e-4
#: float32-only programs: each segment's length is chosen so that the loss difference's rounding takes this share
#: of SETTLE_RTOL (the rest is left to the quadrature, which a shorter segment makes smaller); a quadrature-bounded
#: segment at twice the panels is tried this many times shorter (Simpson's relative error falls 16×, the
#: rounding's doubles)
ROUNDING_SHARE, SEGMENT_SHRINK = 0.25, 2.0
#: a smooth segment whose bound is mostly rounding (g·d curves away along it) is tried again up to this many times
#: longer, within SEGMENT_MAX·‖w‖; the longer one replaces it only if it resolves better
SEGMENT_STRETCH, SEGMENT_MAX = 4.0, 8.0
#: the shortest segment, as a fraction of ‖w‖: 16 panels of it are ~1e-4 of each element apart (~10³ float32 ulps)
SEGMENT_MIN = 1e-3
#: (T₄ − T₂)/(T₈ − T₄) of nested trapezoid sums is 4 when the error is c·h² (a smooth integrand) and ~2 or
#: erratic with jumps (de Boor, "CADRE: an algorithm for numerical quadrature", 1971, the ratio test); Romberg's
#: column j shrinks 4^(j+1)× per halving. The window, as a fraction of that factor, admits the next term's pull
#: at coarse panels
SMOOTH_RATIO = (0.75, 1.4)
#: a group's scaling segment moves each of its tensors between (1 − h) and (1 + h) of itself, h ≤ GROUP_REACH: any
#: h < 1 keeps the signs of the pre-activations it scales; 0.75 leaves them at ≥ 1/4 of themselves, and the loss's
#: curvature along it to the Romberg test at 8 panels
GROUP_REACH = 0.75
#: panels of a scaling segment, whatever the tensors' own segments have: 9 nodes leave its own σ_f (the residual of a
#: cubic through them) 5 degrees of freedom. A cross-entropy along 1 ± 0.05 of its logits is a cubic to its rounding
#: (measured on a ReLU MLP: residual 3.9e-9 against its rounding 1.5e-9; a quadratic leaves 2.9e-7)
GROUP_PANELS, GROUP_FIT_DEGREE = 8, 3
#: a group's reach is set by its smallest part ∫g_m·w_m above this fraction of its largest: a part below 1% would need
#: the group resolved to < 1e-6 of ∫|f| to reach SETTLE_RTOL, below the loss difference's rounding at any reach
GROUP_PART_FLOOR = 1e-2
#: default number of program calls: ≤ 60 for ≤ 10 tensors, 4 more per tensor beyond
BUDGET_BASE, BUDGET_PER_TENSOR = 20, 4

PROGRESS_ENV = "PRECISION_LAB_PROGRESS"


class GradCheckError(LabInputError):
    """A program's answer the check cannot use (shape, dtype, non-finite values): exit code 2."""


def default_budget(n_tensors: int) -> int:
    """Program calls a check may spend: 60 for up to 10 tensors, 4 per tensor beyond."""
    return max(60, BUDGET_BASE + BUDGET_PER_TENSOR * n_tensors)


# ---------------------------------------------------------------------------------------------
# the oracle: a program that answers loss and gradients


@dataclass
class Evaluation:
    """One answer of the program: the loss and each parameter's gradient (as float64 copies)."""

    loss: float
    grads: dict[str, np.ndarray]
    wall_s: float = 0.0


class Oracle(Protocol):
    """What the check needs of a program: `evaluate("claimed" | "float64", params)`."""

    name: str
    claimed_precision: str
    has_float64: bool

    def evaluate(self, build: str, params: dict[str, np.ndarray]) -> Evaluation: ...


def storage_dtype(build: str, claimed_precision: str) -> np.dtype:
    """The dtype a build exchanges arrays in: float64 for the float64 build, else the claim's storage."""
    return np.dtype("float64" if build == "float64" else formats.STORAGE_DTYPE[claimed_precision])


def exact_cast(value: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """`value` in `dtype`, refusing any rounding (the check builds its points on the build's grid)."""
    cast = np.asarray(value).astype(dtype)
    if not np.array_equal(cast.astype(np.float64), np.asarray(value, np.float64)):
        raise AssertionError(f"internal: point of {name!r} is not representable in {dtype}")
    return cast


def check_evaluation(where: str, evaluation: Evaluation, shapes: dict[str, tuple[int, ...]]) -> Evaluation:
    """Refuse an answer the check cannot use: a missing gradient, a wrong shape, NaN/inf."""
    if not math.isfinite(evaluation.loss):
        raise GradCheckError(f"{where}: the loss is {evaluation.loss} (expected a finite number)")
    for name, shape in shapes.items():
        if name not in evaluation.grads:
            raise GradCheckError(f"{where}: no gradient {name + '.grad'!r} (expected shape {shape})")
        grad = np.asarray(evaluation.grads[name], np.float64)
        if grad.shape != tuple(shape):
            raise GradCheckError(f"{where}: {name + '.grad'!r} has shape {grad.shape}, expected {tuple(shape)} "
                                 f"(the shape of parameter {name!r})")
        if not np.all(np.isfinite(grad)):
            raise GradCheckError(f"{where}: {name + '.grad'!r} holds {int(np.sum(~np.isfinite(grad)))} NaN or "
                                 f"infinite values (expected finite numbers)")
        evaluation.grads[name] = grad
    return evaluation


@dataclass
class FunctionOracle:
    """An in-process program: `function(params, dtype) -> (loss, {name: grad})`, params in `dtype`.

    `float64_function` (default: `function` itself) is the float64 build; `has_float64=False`
    leaves the claimed build alone.
    """

    function: Callable
    name: str = "function"
    claimed_precision: str = "float32"
    has_float64: bool = True
    float64_function: Callable | None = None

    def evaluate(self, build: str, params: dict[str, np.ndarray]) -> Evaluation:
        dtype = storage_dtype(build, self.claimed_precision)
        function = (self.float64_function or self.function) if build == "float64" else self.function
        start = time.perf_counter()
        loss, grads = function({k: exact_cast(v, dtype, k) for k, v in params.items()}, dtype)
        wall = time.perf_counter() - start
        evaluation = Evaluation(float(loss), {k: np.array(v, np.float64) for k, v in grads.items()}, wall)
        return check_evaluation(f"{self.name} ({build} build)", evaluation, {k: v.shape for k, v in params.items()})


# ---------------------------------------------------------------------------------------------
# statistics: Student t (the noise is measured with few degrees of freedom)


def t_two_sided_p(k: float, dof: float) -> float:
    """P(|T| > k) for Student's t with `dof` degrees of freedom."""
    return float(2.0 * stats.t.sf(abs(k), dof))


def t_critical(alpha: float, dof: float) -> float:
    """The k with P(|T| > k) = alpha."""
    return float(stats.t.isf(alpha / 2.0, dof))


# ---------------------------------------------------------------------------------------------
# points on the build's grid


def on_grid(base: np.ndarray, step: np.ndarray, storage: np.dtype, multipliers) -> np.ndarray:
    """`step` rounded so that base + m·step is exact in `storage` for every multiplier m.

    Elements where that fails (a step across a binade boundary, a step below one ulp) do not move.
    """
    storage = np.dtype(storage)
    fractions = [abs(m) for m in multipliers if 0 < abs(m) < 1]
    granularity = 2.0 ** math.ceil(math.log2(1.0 / min(fractions))) if fractions else 1.0
    reach = np.abs(base) + max(abs(m) for m in multipliers) * np.abs(step)
    spacing = np.spacing(reach.astype(storage)).astype(np.float64) * granularity
    quantised = np.round(step / spacing) * spacing
    for m in multipliers:
        point = base + m * quantised
        exact = (point.astype(storage).astype(np.float64) == point) & ((point - base) == m * quantised)
        quantised = np.where(exact, quantised, 0.0)
    return quantised


def _point(base: dict[str, np.ndarray], displacement: dict[str, np.ndarray], multiplier: float) -> dict[str, np.ndarray]:
    return {name: value + multiplier * displacement[name] if name in displacement else value
            for name, value in base.items()}


def _dot(grads: dict[str, np.ndarray], displacement: dict[str, np.ndarray]) -> float:
    return float(sum(np.dot(grads[name].ravel(), step.ravel()) for name, step in displacement.items()))


def tensor_scales(base: dict[str, np.ndarray]) -> dict[str, float]:
    """‖w‖ per tensor, each from itself: a tensor whose norm dwarfs the others' (a bias at −7e4 beside
    weights ~0.1) must not set their steps. An all-zero tensor (a bias at initialisation) takes the
    median RMS element of the non-zero tensors × √n (1 per element when every tensor is zero)."""
    rms = sorted(float(np.sqrt(np.mean(v * v))) for v in base.values() if np.any(v))
    typical = rms[len(rms) // 2] if rms else 1.0
    scales = {}
    for name, value in base.items():
        norm = float(np.linalg.norm(value))
        scales[name] = norm if norm > 0 else typical * math.sqrt(value.size)
    return scales


def tensor_step(value: np.ndarray, size: float, storage: np.dtype, multipliers, rng: np.random.Generator,
                unit: np.ndarray | None = None) -> np.ndarray:
    """A random direction (`unit` when given) of norm ≈ `size` over one tensor, exact on the build's grid at every
    multiplier; never all zero: a size below the elements' ulps is raised until some of them move."""
    for _ in range(64):
        step = on_grid(value, size * (_unit(rng, value.shape) if unit is None else unit), storage, multipliers)
        if np.any(step):
            return step
        size *= 4.0
    raise GradCheckError(f"no step of a tensor of shape {value.shape} is exact in {storage} (non-finite values?)")


def _unit(rng: np.random.Generator, shape) -> np.ndarray:
    z = rng.standard_normal(shape)
    norm = float(np.linalg.norm(z))
    return z / norm if norm > 0 else z


# ---------------------------------------------------------------------------------------------
# calls


class BudgetSpent(Exception):
    """Raised inside the check when the next call would exceed the budget (caught there)."""


class Calls:
    """Counts and times the program calls; caches the answer at the base point."""

    def __init__(self, oracle: Oracle, budget: int, progress: bool):
        self.oracle, self.budget = oracle, budget
        self.counts = {"claimed": 0, "float64": 0}
        self.program_s = 0.0
        self.bar = None
        if progress and os.environ.get(PROGRESS_ENV) != "0":
            from tqdm import tqdm

            self.bar = tqdm(desc=f"gradient check {oracle.name} (≤ {budget} calls)", unit="call", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5, leave=False, disable=None)  # None: off when not a terminal

    @property
    def used(self) -> int:
        return sum(self.counts.values())

    @property
    def left(self) -> int:
        return self.budget - self.used

    def __call__(self, build: str, params: dict[str, np.ndarray]) -> Evaluation:
        if self.left <= 0:
            raise BudgetSpent
        evaluation = self.oracle.evaluate(build, params)
        self.counts[build] += 1
        self.program_s += evaluation.wall_s
        if self.bar is not None:
            self.bar.update(1)
        return evaluation

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# noise


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
        evaluations[m] = calls(build, _point(base, displacement, m))
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
                 predicted_slope=_dot(at_base.grads, displacement),
                 identical=bool(moving and np.all(losses == losses[0])),
                 single_losses=bool(np.all(losses.astype(np.float32).astype(np.float64) == losses)))


# ---------------------------------------------------------------------------------------------
# one direction: levels of steps


@dataclass
class Level:
    """The stencil w ± a·Δ around the base, and what it says about g·Δ."""

    multiplier: float  # a
    step: float  # ‖a·Δ‖
    claimed: float  # f₀ = g(w)·Δ, the claimed directional derivative (per unit multiplier)
    error: float  # ê: the claimed derivative minus the loss's (Simpson/Richardson), per unit multiplier
    error_sigma: float
    central_error: float  # (L(+) − L(−))/2a − f₀: the plain central quotient's disagreement
    central_sigma: float  # its rounding part, σ_L/(√2·a)
    truncation: float  # the h² term of the central quotient measured from the gradients, (f₊ − 2f₀ + f₋)/6
    kink: float  # ρ₊ − ρ₋: the one-sided trapezoid residuals' difference
    kink_sigma: float
    critical: float  # k of the t test
    allowance: float = 0.0  # what kinks crossed by the stencil could add to the residual (see Checker)
    status: str = ""  # agree | disagree | kinked

    @property
    def k(self) -> float:
        """Standard errors by which the residual exceeds what kinks could explain (0 when it does not)."""
        excess = max(abs(self.error) - self.allowance, 0.0)
        return excess / self.error_sigma if self.error_sigma > 0 else (math.inf if excess else 0.0)

    @property
    def bound(self) -> float:
        """The largest residual that is still agreement: k_crit standard errors plus the kink allowance."""
        return self.critical * self.error_sigma + self.allowance

    @property
    def kink_k(self) -> float:
        return abs(self.kink) / self.kink_sigma if self.kink_sigma > 0 else (math.inf if self.kink else 0.0)


@dataclass
class Direction:
    """One random direction Δ (over one tensor, a region of it, or all tensors) and its levels."""

    label: str
    displacement: dict[str, np.ndarray]
    build: str
    claimed: float  # f₀
    scale: float  # the typical size of g·Δ: max(|f₀|, ‖g_S‖·‖Δ‖/√n_S)
    levels: list[Level] = field(default_factory=list)
    outcome: str = "open"  # open | agree | disagree | undecided | budget
    reason: str = ""
    deciding: Level | None = None
    richardson: float | None = None  # (16·C(h/4) − C(h))/15 − f₀ when two levels exist

    @property
    def relative_error(self) -> float:
        return self.deciding.error / self.scale if self.deciding and self.scale > 0 else math.nan

    @property
    def resolution(self) -> float:
        """The smallest relative error of g·Δ this direction could have seen (k_crit standard errors)."""
        if self.deciding is None or self.scale <= 0:
            return math.inf
        return self.deciding.bound / self.scale

    def norm(self) -> float:
        return math.sqrt(sum(float(np.sum(v * v)) for v in self.displacement.values()))

    def evidence(self) -> str:
        """One line: what the loss says along this direction against what the gradient says."""
        level = self.deciding or (self.levels[-1] if self.levels else None)
        if level is None:
            return f"{self.label}: not evaluated"
        steps = _step_names(range(len(self.levels)))
        norm = self.norm()
        derivative = (self.claimed - level.error) / norm
        words = {"agree": "agrees within its bound", "disagree": f"disagrees by {level.k:.3g} standard errors beyond the kink allowance",
                 "undecided": "inconclusive", "budget": "budget spent",
                 "open": "not followed up (a tensor explains the disagreement)"}[self.outcome]
        text = (f"{self.label}: the loss changes at {derivative:.10g}, the gradient says {self.claimed / norm:.10g}"
                f" (difference {level.error / norm:.3g}, bound {level.bound / norm:.3g} = {level.critical:.3g}σ with σ = "
                f"{level.error_sigma / norm:.2g}" + (f", plus {level.allowance / norm:.2g} for kinks" if level.allowance else "")
                + f"; relative "
                f"{level.error / self.scale:.2g}; steps {steps}, h = {self.levels[0].step:.3g}): {words}")
        return text + (f"; {self.reason}" if self.reason else "")

    def summary(self) -> dict:
        return {"label": self.label, "build": self.build, "outcome": self.outcome, "reason": self.reason,
                "claimed": self.claimed, "from_loss": self.claimed - self.deciding.error if self.deciding else None,
                "error": self.deciding.error if self.deciding else None,
                "error_sigma": self.deciding.error_sigma if self.deciding else None,
                "k": self.deciding.k if self.deciding else None, "relative_error": self.relative_error,
                "resolution": self.resolution, "richardson_error": self.richardson,
                "levels": [{"step": lv.step, "status": lv.status, "error": lv.error, "sigma": lv.error_sigma,
                            "k": lv.k, "kink_k": lv.kink_k, "central_error": lv.central_error,
                            "truncation": lv.truncation} for lv in self.levels]}


class Checker:
    """Runs directions through their levels on one build (float64 when there is one)."""

    def __init__(self, calls: Calls, build: str, base: dict[str, np.ndarray], at_base: Evaluation, noise: Noise,
                 loss_sigma: float):
        self.calls, self.build, self.base, self.at_base, self.noise = calls, build, base, at_base, noise
        self.loss_sigma = loss_sigma
        self.critical = t_critical(ALPHA, noise.dof)
        total = sum(v.size for v in base.values())
        self.global_typical = math.sqrt(sum(float(np.sum(g * g)) for g in at_base.grads.values()) / max(total, 1))

    def direction(self, label: str, displacement: dict[str, np.ndarray]) -> Direction:
        claimed = _dot(self.at_base.grads, displacement)
        support = sum(int(np.count_nonzero(v)) for v in displacement.values())
        g_norm = math.sqrt(sum(float(np.sum((self.at_base.grads[k] * (v != 0)) ** 2)) for k, v in displacement.items()))
        norm = math.sqrt(sum(float(np.sum(v * v)) for v in displacement.values()))
        typical = g_norm * norm / math.sqrt(max(support, 1))
        # a tensor whose gradient is (near) zero is judged against the model's typical gradient size
        scale = max(abs(claimed), typical, self.global_typical * norm)
        return Direction(label, displacement, self.build, claimed, scale if scale > 0 else 1e-300)

    def evaluate_level(self, direction: Direction, multiplier: float,
                       answers: tuple[Evaluation, Evaluation] | None = None) -> Level:
        """The stencil ±multiplier·Δ (`answers`: the two evaluations when already in hand)."""
        if answers is None:
            plus = self.calls(self.build, _point(self.base, direction.displacement, multiplier))
            minus = self.calls(self.build, _point(self.base, direction.displacement, -multiplier))
        else:
            plus, minus = answers
        a = multiplier
        l0, lp, lm = self.at_base.loss, plus.loss, minus.loss
        f0 = direction.claimed
        fp, fm = _dot(plus.grads, direction.displacement), _dot(minus.grads, direction.displacement)
        sigma_l, sigma_f = self.loss_sigma, self.noise.direction_sigma(direction.displacement)
        residual = (lp - lm) - a * (fm + 4.0 * f0 + fp) / 3.0  # Simpson: −2a·(claimed − true) + O(a⁵)
        residual_sigma = math.sqrt(2.0 * sigma_l ** 2 + 2.0 * (a * sigma_f) ** 2)
        rho_plus, rho_minus = (lp - l0) - a * (f0 + fp) / 2.0, (l0 - lm) - a * (fm + f0) / 2.0  # trapezoid residuals
        kink = rho_plus - rho_minus
        kink_sigma = math.sqrt(6.0 * sigma_l ** 2 + 0.5 * (a * sigma_f) ** 2)
        level = Level(multiplier=a, step=a * direction.norm(), claimed=f0, error=-residual / (2.0 * a),
                      error_sigma=residual_sigma / (2.0 * a), central_error=(lp - lm) / (2.0 * a) - f0,
                      central_sigma=sigma_l / (math.sqrt(2.0) * a), truncation=(fp - 2.0 * f0 + fm) / 6.0,
                      kink=kink, kink_sigma=kink_sigma, critical=self.critical,
                      allowance=NONSMOOTH_ALLOWANCE * (abs(fp - 2.0 * f0 + fm) / 2.0 + abs(kink) / a))
        # a kink puts its jump into one half only; a wrong gradient (or truncation) shows in both alike
        one_sided = abs(kink) > KINK_FRACTION * max(abs(rho_plus), abs(rho_minus))
        if level.kink_k > self.critical and one_sided:
            level.status = "kinked"
        elif abs(level.error) > level.bound:
            level.status = "disagree"
        else:
            level.status = "agree"
        return level

    def advance(self, direction: Direction, answers: tuple[Evaluation, Evaluation] | None = None) -> None:
        """Evaluate the next level of an open direction and decide if the levels allow."""
        index = len(direction.levels)
        try:
            level = self.evaluate_level(direction, LEVEL_FACTOR ** -index, answers)
        except BudgetSpent:
            direction.outcome, direction.reason = "budget", "the call budget ran out before a usable step"
            return
        direction.levels.append(level)
        if len(direction.levels) >= 2:
            big, small = direction.levels[-2], direction.levels[-1]
            r = LEVEL_FACTOR ** 2
            direction.richardson = (r * small.central_error - big.central_error) / (r - 1)
        _decide(direction)


def _consistent(a: Level, b: Level) -> bool:
    """The two steps' residuals differ by less than their combined uncertainty allows."""
    return abs(a.error - b.error) <= a.critical * math.hypot(a.error_sigma, b.error_sigma) + a.allowance + b.allowance


def _persistent(big: Level, small: Level) -> bool:
    """Both steps disagree, with the same sign and about the same size (truncation would shrink ≥ 16×)."""
    return (big.status == small.status == "disagree" and np.sign(big.error) == np.sign(small.error)
            and 1.0 / PERSIST_FACTOR <= abs(small.error) / abs(big.error) <= PERSIST_FACTOR)


def _step_names(indices) -> str:
    return ", ".join(f"h/{LEVEL_FACTOR ** i}" if i else "h" for i in indices)


def _decide(direction: Direction) -> None:
    """Agree, disagree, or ask for a smaller step (kinks, truncation, an uninformative agreement)."""
    levels = direction.levels
    usable = [lv for lv in levels if lv.status != "kinked"]
    kinked = [i for i, lv in enumerate(levels) if lv.status == "kinked"]
    notes = []
    if kinked:
        notes.append(f"the one-sided quotients disagree at step {_step_names(kinked)} "
                     f"(a kink inside the stencil: not evidence)")
    current = usable[-1] if usable else None
    earlier = [lv for lv in usable[:-1] if lv.status == "disagree"]
    if current is not None and current.status == "agree":
        if not earlier:
            direction.outcome, direction.deciding = "agree", current
        elif not _consistent(current, earlier[-1]):
            direction.outcome, direction.deciding = "agree", current
            notes.append(f"the residual at the larger step shrank {abs(earlier[-1].error / current.error) if current.error else math.inf:.3g}× "
                         f"with the step: truncation, not a wrong gradient")
        # else: too noisy to tell the larger step's disagreement from zero: a smaller step decides
    elif current is not None and earlier and _persistent(earlier[-1], current):
        direction.outcome, direction.deciding = "disagree", current
        notes.append(f"the disagreement persists at {len([lv for lv in usable if lv.status == 'disagree'])} usable steps")
    if direction.outcome == "open" and len(levels) >= MAX_LEVELS:
        direction.outcome, direction.deciding = "undecided", current or levels[-1]
        notes.append("no usable step settles it" if usable else "every step straddles a kink")
    direction.reason = "; ".join(notes)


# ---------------------------------------------------------------------------------------------
# localisation: halves of a failing direction


@dataclass
class Region:
    """A set of parameter elements: per tensor, a box of index ranges."""

    boxes: dict[str, tuple[tuple[int, int], ...]]

    @classmethod
    def whole(cls, names, shapes) -> "Region":
        return cls({name: tuple((0, n) for n in shapes[name]) for name in names})

    def restrict(self, displacement: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        restricted = {}
        for name, box in self.boxes.items():
            if name not in displacement:
                continue
            masked = np.zeros_like(displacement[name])
            index = tuple(slice(a, b) for a, b in box)
            masked[index] = displacement[name][index]
            restricted[name] = masked
        return restricted

    def size(self) -> int:
        return sum(math.prod(b - a for a, b in box) for box in self.boxes.values())

    def describe(self, shapes: dict[str, tuple[int, ...]]) -> str:
        parts = []
        for name, box in self.boxes.items():
            if all(b - a == n for (a, b), n in zip(box, shapes[name])):
                parts.append(name if not box else f"{name} (whole tensor)")
                continue
            axes = [str(a) if b - a == 1 else (":" if b - a == n else f"{a}:{b}") for (a, b), n in zip(box, shapes[name])]
            parts.append(f"{name}[{', '.join(axes)}]")
        return " + ".join(parts)

    def splits(self) -> list[tuple[str, "Region", "Region"]]:
        """Ways to halve the region: by tensors first, then along each axis with more than one index."""
        names = list(self.boxes)
        if len(names) > 1:
            half = len(names) // 2
            return [("tensors", Region({n: self.boxes[n] for n in names[:half]}),
                     Region({n: self.boxes[n] for n in names[half:]}))]
        name, box = names[0], self.boxes[names[0]]
        ways = []
        for axis, (a, b) in enumerate(box):
            if b - a > 1:
                mid = (a + b) // 2
                ways.append((f"axis {axis}", Region({name: box[:axis] + ((a, mid),) + box[axis + 1:]}),
                             Region({name: box[:axis] + ((mid, b),) + box[axis + 1:]})))
        return ways


@dataclass
class Located:
    """Where a failing direction's error lies, with the directional evidence of the last split."""

    region: str
    error: float  # ê of the region (per unit multiplier of the parent direction)
    sigma: float
    note: str = ""
    element_error: float | None = None  # a single element: how far its gradient is off
    tensors: list[str] = field(default_factory=list)  # the tensors the region touches


def localise(checker: Checker, parent: Direction, shapes: dict[str, tuple[int, ...]]) -> list[Located]:
    """Halve the failing direction's support until the error is named (an element, row, column …)."""
    level = parent.deciding
    multiplier = level.multiplier
    region = Region.whole(list(parent.displacement), shapes)
    error, sigma = level.error, level.error_sigma
    found: list[Located] = []
    while True:
        if region.size() == 1:
            (name, box), = region.boxes.items()
            index = tuple(a for a, _ in box)
            step = parent.displacement[name][index]
            claimed = float(checker.at_base.grads[name][index])
            note, wrong_by = "a single element", None
            if step != 0:
                wrong_by = error / step
                note += (f": its gradient {claimed:.8g} is off by {wrong_by:.3g} "
                         f"({abs(wrong_by / claimed) if claimed else math.inf:.2g} relative; the loss says "
                         f"{claimed - wrong_by:.8g})")
            found.append(Located(region.describe(shapes), error, sigma, note, wrong_by, list(region.boxes)))
            return found
        moved = False
        spread_axes = []
        for way, first, second in region.splits():
            try:
                probe = checker.direction(f"{parent.label} restricted to {first.describe(shapes)}",
                                          first.restrict(parent.displacement))
                if not any(np.any(v) for v in probe.displacement.values()):
                    region, moved = second, True  # the first half does not move along this direction
                    break
                measured = checker.evaluate_level(probe, multiplier)
            except BudgetSpent:
                found.append(Located(region.describe(shapes), error, sigma, "the call budget ran out here",
                                     tensors=list(region.boxes)))
                return found
            if measured.status == "kinked":
                continue  # a kink along this half: try the next way of splitting
            e1, s1 = measured.error, measured.error_sigma
            e2, s2 = error - e1, math.hypot(sigma, s1)
            in_first = abs(e1) > measured.bound
            in_second = abs(e2) > checker.critical * s2 + measured.allowance
            if in_first and not in_second:
                region, error, sigma, moved = first, e1, s1, True
            elif in_second and not in_first:
                region, error, sigma, moved = second, e2, s2, True
            elif in_first and in_second:
                spread_axes.append(way)
                continue
            else:
                found.append(Located(region.describe(shapes), error, sigma, f"neither half of {way} carries the error alone",
                                     tensors=list(region.boxes)))
                return found
            break
        if not moved:
            note = f"spread along {', '.join(spread_axes)}" if spread_axes else "cannot be split further"
            found.append(Located(region.describe(shapes), error, sigma, note, tensors=list(region.boxes)))
            return found


# ---------------------------------------------------------------------------------------------
# claimed build against the float64 build


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


def _format_index(index: tuple[int, ...]) -> str:
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


# ---------------------------------------------------------------------------------------------
# the verdict


@dataclass
class TensorVerdict:
    """One parameter tensor: verdict, the numbers the diagnose JSON needs, and the evidence."""

    name: str
    shape: tuple[int, ...]
    verdict: str = "inconclusive"
    max_abs_err: float = math.nan
    bound_ratio: float = math.nan
    evidence: list[str] = field(default_factory=list)
    directions: list[Direction] = field(default_factory=list)
    comparison: BuildComparison | None = None
    located: list[Located] = field(default_factory=list)
    settle: str = ""
    segment: "Segment | None" = None  # the float32-only check's segment
    shares: list["Share"] = field(default_factory=list)  # its parts of group scaling segments (float32-only)

    def summary(self) -> dict:
        evidence = [x for x in [self.segment, *self.shares, *self.directions] if x is not None and x.deciding is not None]
        # a defect states its finest disagreement; a roundoff or open tensor its finest agreement, not a group that
        # another member failed
        wanted = "disagree" if self.verdict == "defect" else "agree"
        evidence = [x for x in evidence if x.outcome == wanted] or evidence
        deciding = min(evidence, key=lambda x: x.resolution if x.outcome == wanted else math.inf, default=None)
        return {"verdict": self.verdict, "max_abs_err": self.max_abs_err, "bound_ratio": self.bound_ratio,
                "layout_fix": None, "shape": list(self.shape),
                "directional_error": deciding.relative_error if deciding else None,
                "resolution": deciding.resolution if deciding else None,
                "evidence": list(self.evidence), "located": [vars(x) for x in self.located],
                "what_would_settle_it": self.settle or None,
                "directions": [d.summary() for d in self.directions],
                "segment": self.segment.summary() if self.segment else None,
                "scaling_segments": [x.summary() for x in self.shares],
                "build_comparison": self.comparison.summary() if self.comparison else None}


@dataclass
class GradCheck:
    """The result of a reference-free gradient check."""

    candidate: str
    claimed_precision: str
    has_float64: bool
    verdict: str
    tensors: dict[str, TensorVerdict]
    whole: list[Direction]
    loss: BuildComparison | None
    noise: dict[str, Noise]
    calls: dict[str, int]
    budget: int
    wall_s: float
    program_s: float
    seed: int
    notes: list[str] = field(default_factory=list)
    #: sets of tensors one of which is wrong, where the check cannot tell which (a scaling segment of several)
    defect_in_one_of: list[list[str]] = field(default_factory=list)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def headline(self) -> str:
        bad = [t for t in self.tensors.values() if t.verdict == self.verdict and self.verdict != "roundoff"]
        if self.verdict == "defect":
            names = [t.name for t in bad] + [f"one of {' or '.join(group)}" for group in self.defect_in_one_of]
            return f"defect in {', '.join(names) or 'the whole gradient'}"
        if self.verdict == "inconclusive":
            return f"inconclusive for {', '.join(t.name for t in bad)}: {bad[0].settle}" if bad else "inconclusive"
        resolution = max((t.summary()["resolution"] for t in self.tensors.values()
                          if t.summary()["resolution"] is not None), default=math.nan)
        return f"roundoff: every gradient is the derivative of the loss (to {resolution:.2g} relative or better)"

    def cost(self) -> str:
        parts = [f"{n} {build}" for build, n in self.calls.items() if n]
        return (f"{self.total_calls} program calls ({', '.join(parts)}; budget {self.budget}), "
                f"wall time {self.wall_s:.1f} s ({self.program_s:.1f} s inside the program)")

    def to_text(self) -> str:
        lines = [f"candidate {self.candidate}  (opaque; claimed {self.claimed_precision}; "
                 f"float64 build: {'yes' if self.has_float64 else 'no'})",
                 f"verdict: {self.headline()}"]
        for tensor in self.tensors.values():
            resolution = tensor.summary()["resolution"]
            reached = (f"  {'to' if tensor.verdict == 'roundoff' else 'resolution'} {resolution:.2g} relative"
                       if resolution is not None and math.isfinite(resolution) else "")
            lines.append(f"  {tensor.name:<24} {tensor.verdict:<13} max|err| {tensor.max_abs_err:9.3g}  "
                         f"err/bound {tensor.bound_ratio:9.3g}{reached}")
            lines += [f"      {text}" for text in tensor.evidence]
        for direction in self.whole:
            lines.append(f"  whole gradient: {direction.evidence()}")
        if self.loss is not None:
            lines.append(f"  loss: {self.claimed_precision} − float64 build: {self.loss.max_abs_err:.3g} at the base point, "
                         f"repeating part {self.loss.persistent:.3g} (err/bound {self.loss.bound_ratio:.3g})")
        for build, noise in self.noise.items():
            info = noise.summary()
            lines.append(f"  noise ({build} build, {noise.precision}): σ_loss = {noise.loss_sigma:.3g} "
                         f"= {info['loss_sigma_in_u']:.3g}·u·|loss| (measured, {noise.dof} dof)")
        lines += [f"  - {note}" for note in self.notes]
        lines.append(f"cost: {self.cost()}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return _json_safe({
            "candidate": self.candidate, "kind": "opaque", "verdict": self.verdict,
            "claimed_precision": self.claimed_precision, "has_float64": self.has_float64,
            "headline": self.headline(),
            "parameters": {name: t.summary() for name, t in self.tensors.items()},
            "whole_gradient": [d.summary() for d in self.whole],
            "forward": {"loss": self.loss.summary() if self.loss else None},
            "noise": {build: n.summary() for build, n in self.noise.items()},
            "cost": {"calls": self.total_calls, "calls_by_build": dict(self.calls), "budget": self.budget,
                     "wall_s": self.wall_s, "program_s": self.program_s},
            "seed": self.seed, "notes": list(self.notes),
            "defect_in_one_of": [list(g) for g in self.defect_in_one_of]})

    def to_frame(self):
        import pandas as pd

        rows = []
        for tensor in self.tensors.values():
            summary = tensor.summary()
            rows.append({"candidate": self.candidate, "tensor": tensor.name, "verdict": tensor.verdict,
                         "max_abs_err": tensor.max_abs_err, "bound_ratio": tensor.bound_ratio,
                         "directional_error": summary["directional_error"], "resolution": summary["resolution"],
                         "located": "; ".join(x.region for x in tensor.located),
                         "evidence": " | ".join(tensor.evidence)})
        return pd.DataFrame(rows)


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    return value


# ---------------------------------------------------------------------------------------------
# float32-only programs: the loss difference over a long segment against the integrated gradient


@dataclass
class Segment:
    """One tensor moved along w + t·Δ, t ∈ [−1, 1] (‖Δ‖ from `segment_length`), on `panels` uniform panels.

    The identity L(w + Δ) − L(w − Δ) = ∫₋₁¹ g(w + tΔ)·Δ dt holds for any loss that is continuous
    along the segment (kinks included). Over a long segment the loss difference is of the size of
    the loss, so its rounding is ~u relative; the integral comes from the program's gradients at
    the nodes.
    """

    label: str
    displacement: dict[str, np.ndarray]
    nodes: np.ndarray  # t
    losses: np.ndarray  # L(w + tΔ)
    slopes: np.ndarray  # f(t) = g(w + tΔ)·Δ
    loss_sigma: float  # σ of the loss rounding at the ends (measured at the base, scaled by |L|)
    slope_sigma: float  # σ of f (measured at the base)
    dof: int  # degrees of freedom of those σ
    rule: str = ""  # "Simpson" (smooth: the trapezoid sums converge like h²) or "panels" (kinks)
    integral: float = math.nan  # the rule's ∫f
    residual: float = math.nan  # ΔL − ∫f: −(the claimed gradient's error)·Δ integrated, plus quadrature error
    bound: float = math.nan  # the largest |residual| that is agreement
    scale: float = math.nan  # ∫|f|: what relative errors are relative to
    ratio: float = math.nan  # (T₄ − T₂)/(T₈ − T₄): 4 for a smooth integrand
    statistic: str = ""
    outcome: str = "open"
    fraction: float = math.nan  # ‖Δ‖/‖w‖ asked for
    rounding_bound: float = math.nan  # the rounding part of the bound (smooth rules)
    quadrature: float = math.nan  # the quadrature part of the bound (smooth rules)
    scale_floor: float = 0.0  # the model's RMS gradient element × the segment's length
    centre: np.ndarray | None = None  # the tensor's value at t = 0 (w, or w on a coarser grid: see segment_step)
    parts: dict[str, float] = field(default_factory=dict)  # a group segment's |∫ g_m·Δ_m| per member (check_groups)

    @property
    def resolution(self) -> float:
        """The smallest relative error of the tensor's gradient along Δ this segment can see."""
        return self.bound / self.scale if self.scale > 0 else math.inf

    @property
    def relative_error(self) -> float:
        return self.residual / self.scale if self.scale > 0 else math.nan

    @property
    def deciding(self):  # the segment decides by itself (TensorVerdict.summary looks for a deciding direction)
        return self if self.outcome in ("agree", "disagree") else None

    def norm(self) -> float:
        return math.sqrt(sum(float(np.sum(v * v)) for v in self.displacement.values()))

    def evaluate(self, critical: Callable[[int], float]) -> None:
        """Integrate f (Romberg as deep as its convergence is verified), bound the quadrature error, decide."""
        t, f, losses = self.nodes, self.slopes, self.losses
        panels = len(t) - 1
        width = 2.0 / panels
        levels = int(round(math.log2(panels)))
        # Romberg tableau: column 0 the trapezoid sums on 1, 2, 4, … panels (nested), column j error ∝ h^(2j+2)
        table = [[(2.0 / m) * (f[0] / 2 + f[panels // m: -1: panels // m].sum() + f[-1] / 2)]
                 for m in (2 ** i for i in range(levels + 1))]
        for i in range(1, levels + 1):
            for j in range(1, i + 1):
                table[i].append((4 ** j * table[i][j - 1] - table[i - 1][j - 1]) / (4 ** j - 1))
        delta_l = float(losses[-1] - losses[0])
        # ∫|f|, or for a tensor whose gradient is (near) zero the model's typical gradient over the segment
        self.scale = max(width * float(np.sum(np.abs(f[1:]) + np.abs(f[:-1]))) / 2, self.scale_floor)
        fine = table[levels][0]

        def ratio(j: int) -> float:  # how much column j's differences shrink per halving at the finest level
            a, b, c = table[levels - 2][j], table[levels - 1][j], table[levels][j]
            return (b - a) / (c - b) if c != b else math.inf
        self.ratio = ratio(0)
        # rounding of ΔL (two loss roundings) and of the weighted gradient sum (one σ_f per node)
        rounding = math.sqrt(2.0 * self.loss_sigma ** 2 + (width * self.slope_sigma) ** 2 * panels)
        # every panel holds its own identity, r = L(t₊) − L(t₋) − (f₋ + f₊)·w/2, less its curvature term w³f''/12
        # (f'' from the neighbouring second differences: Gregory's correction). The jumps of f scatter them about
        # zero for a right gradient; a gradient wrong by a factor (1 + ε) along Δ shifts each by −ε × the panel's
        # integral: the fit of r on the panel integrals through the origin, Student t with panels − 1 dof
        integrals = width * (f[1:] + f[:-1]) / 2
        second = f[2:] - 2 * f[1:-1] + f[:-2]  # at interior nodes 1 … panels − 1
        padded = np.concatenate([[second[0]], second, [second[-1]]]) if len(second) else np.zeros(panels + 1)
        curvature = width * (padded[:-1] + padded[1:]) / 2 / 12
        residuals = np.diff(losses) - integrals + curvature
        weight = float(np.sum(integrals ** 2))
        slope = float(np.sum(residuals * integrals)) / weight if weight > 0 else 0.0
        spread = math.sqrt(float(np.sum((residuals - slope * integrals) ** 2)) / (panels - 1))
        spread = max(spread, rounding / math.sqrt(panels))
        if weight > 0:
            # ε is the gradient's relative error along Δ; on the scale of ∫|f| (∫f itself may cancel to ~0)
            standard_error = spread / math.sqrt(weight)
            panel_residual, panel_bound = -slope * self.scale, critical(panels - 1) * standard_error * self.scale
            panel_words = (f"the {panels} panels' residuals against their integrals give a relative error {-slope:.2g} ± "
                           f"{standard_error:.2g} (Student t, {panels - 1} dof)")
        else:  # the gradient says the loss does not change along Δ: then ΔL must be rounding (the panels' scatter
            # is the loss's own change here, not rounding: it would vouch for a gradient left at zero)
            panel_residual, panel_bound = delta_l, critical(self.dof) * rounding
            panel_words = f"g·Δ is 0 at every node; the loss changes by {delta_l:.3g} (Student t, {panels - 1} dof)"
        depth = 0
        while depth + 1 <= levels - 1 and SMOOTH_RATIO[0] <= ratio(depth) / 4 ** (depth + 1) <= SMOOTH_RATIO[1]:
            depth += 1  # column `depth` − 1 converges at its order: column `depth` is valid, with its own ratio
        # the nested sums agree within their own rounding (f linear along Δ: a read-out layer) count as converged:
        # two sums' difference has σ ≤ 2√2·σ_f/√(panels they have)
        coarse_panels = max(panels // 4, 1)
        agreeing = all(abs(a - b) <= critical(self.dof) * 2 * math.sqrt(2) * self.slope_sigma / math.sqrt(coarse_panels)
                       for a, b in ((fine, table[levels - 1][0]), (table[levels - 1][0], table[levels - 2][0])))
        fast = depth == 0 and (self.ratio > 4 * SMOOTH_RATIO[1] or agreeing)
        if fast:
            # the sums converge faster than h² (a smooth f before its asymptotic regime; jumps or kinks converge
            # slower): the distance to the sum on half the panels bounds the finer sum's error
            depth = 0
            value, quadrature = fine, abs(fine - table[levels - 1][0])
            self.rule, self.integral, self.residual = "trapezoid", value, delta_l - value
            self.rounding_bound, self.quadrature = critical(self.dof) * rounding, quadrature
            self.bound = self.rounding_bound + quadrature
            self.statistic = (f"the trapezoid sums converge {self.ratio:.3g}× per halving "
                              + ("(they agree within their rounding)" if agreeing else "(faster than h²)")
                              + f": trapezoid on {panels} panels, quadrature error ≤ {quadrature:.2g} (the sum on "
                              f"{panels // 2})")
            if abs(self.residual) > self.bound and abs(panel_residual) <= panel_bound:
                self.statistic += f"; but {panel_words}: not evidence"
                self.rule, self.residual, self.bound = "panels", panel_residual, max(panel_bound, abs(self.residual))
        elif depth:
            # the coarser value of the deepest verified column bounds the finer one's error (Richardson's /(4^j − 1)
            # (Lyness, J. ACM 16(3), 1969) called right KAN and normalisation gradients defects at 8 panels)
            value, quadrature = table[levels][depth], abs(table[levels][depth] - table[levels - 1][depth])
            name = {1: "Simpson", 2: "Boole"}.get(depth, f"Romberg column {depth}")
            self.rule, self.integral, self.residual = name, value, delta_l - value
            self.rounding_bound, self.quadrature = critical(self.dof) * rounding, quadrature
            self.bound = self.rounding_bound + quadrature
            self.statistic = (f"the trapezoid sums converge like h² (ratio {self.ratio:.3g}, 4 for a smooth f): {name} on "
                              f"{panels} panels, quadrature error ≤ {quadrature:.2g} (the same rule on {panels // 2})")
            # a ratio near 4 can happen by chance with many kinks (a ReLU layer): a disagreement must also show
            # in the panels, which do not assume smoothness
            if abs(self.residual) > self.bound and abs(panel_residual) <= panel_bound:
                self.statistic += f"; but {panel_words}: kinks that look smooth at {panels} panels, not evidence"
                self.rule, self.residual, self.bound = "panels", panel_residual, max(panel_bound, abs(self.residual))
        else:
            self.rule, self.integral, self.residual, self.bound = "panels", fine, panel_residual, panel_bound
            self.statistic = (f"the trapezoid sums do not converge like h² (ratio {self.ratio:.3g}): kinks; "
                              f"{panel_words}")
            block = self._jump_free_block(residuals, integrals, curvature, critical)
            if block is not None and block[3] / block[4] < panel_bound / self.scale:
                first, last, block_residual, block_bound, block_scale = block
                words = (f"panels {first + 1}–{last + 1} of {panels}, whose gradients show no jump beyond their "
                         f"allowance, give ΔL − ∫f = {block_residual:.3g} (bound {block_bound:.3g}: rounding plus each "
                         f"panel's |jump|·w/2; relative {block_residual / block_scale:.2g})")
                # a disagreement is evidence only when the panels show it too: many small jumps of both signs can
                # hide from the differences (measured: a ReLU conv net's right gradient "disagreed" in 3 of 20 runs)
                if abs(block_residual) <= block_bound or abs(panel_residual) > panel_bound:
                    # the relative error and bound of the block, on the whole segment's scale
                    self.rule, self.integral = "jump-free panels", float(np.sum(integrals[first:last + 1]))
                    self.residual = block_residual * self.scale / block_scale
                    self.bound = block_bound * self.scale / block_scale
                    self.statistic = (f"the trapezoid sums do not converge like h² (ratio {self.ratio:.3g}): kinks; "
                                      f"{words}")
                else:
                    self.statistic += f"; {words}, but the panels do not disagree: a jump beyond its allowance"
        self.outcome = "agree" if abs(self.residual) <= self.bound else "disagree"

    def _jump_free_block(self, residuals: np.ndarray, integrals: np.ndarray, curvature: np.ndarray,
                         critical: Callable[[int], float]) -> tuple[int, int, float, float, float] | None:
        """The run of contiguous panels whose identity resolves g·Δ best, with jumps of f allowed for.

        A jump J of f inside panel i (a kink crossed: a clamp, a ReLU) puts J into the difference f_{i+1} − f_i
        and into neither neighbour's, so |d_i − (d_{i−1} + d_{i+1})/2| ≈ |J| (≈ |J|/2 in the neighbours, ~f‴·w³
        for a smooth f); the trapezoid's error from it is J·(w/2 − (τ − t_i)), at most |J|·w/2. Each panel
        carries that allowance, plus its curvature correction (which a neighbouring jump corrupts). Few jumps
        (a clamp, a small ReLU net) leave most panels with no allowance beyond one panel's rounding bound; many
        small jumps of both signs (10⁴ ReLUs) can cancel in a difference and hide, but not in half the panels
        at once: only a run of at least half the panels, each within its rounding, is used. Its bound is the
        rounding of its two end losses and its nodes' slopes plus its panels' allowances; the run with the
        smallest bound relative to its ∫|f| is chosen on bounds alone (not on residuals).
        Returns (first, last, residual, bound, ∫|f| over the run), None when no run qualifies."""
        panels = len(residuals)
        if panels < 3:
            return None
        width = 2.0 / panels
        d = np.diff(self.slopes)
        neighbours = np.concatenate([[d[1]], (d[:-2] + d[2:]) / 2, [d[-2]]])
        allowance = np.abs(d - neighbours) * width / 2 + np.abs(curvature)
        one_panel = critical(self.dof) * math.sqrt(2.0 * self.loss_sigma ** 2 + 2.0 * (width * self.slope_sigma) ** 2)
        quiet = allowance <= one_panel
        best = None
        for first in range(panels):
            for last in range(first + max(panels // 2, 3) - 1, panels):
                if not quiet[first:last + 1].all():
                    break
                count = last - first + 1
                rounding = math.sqrt(2.0 * self.loss_sigma ** 2 + (width * self.slope_sigma) ** 2 * (count + 1))
                bound = critical(self.dof) * rounding + float(np.sum(allowance[first:last + 1]))
                scale = max(float(np.sum(np.abs(integrals[first:last + 1]))), self.scale_floor * count / panels)
                if scale > 0 and (best is None or bound / scale < best[3] / best[4]):
                    best = (first, last, float(np.sum(residuals[first:last + 1])), bound, scale)
        return best

    def evidence(self) -> str:
        words = {"agree": "agrees within its bound", "disagree": f"disagrees ({abs(self.residual) / self.bound if self.bound > 0 else math.inf:.3g}× its bound)"}
        return (f"{self.label}: over a segment of length {2 * self.norm():.3g} the loss changes by "
                f"{self.losses[-1] - self.losses[0]:.10g}, the gradient integrates to {self.integral:.10g} (difference "
                f"{self.residual:.3g}, bound {self.bound:.3g} = rounding and quadrature; relative "
                f"{self.relative_error:.2g}, resolution {self.resolution:.2g}; {self.statistic}): "
                f"{words.get(self.outcome, self.outcome)}")

    def summary(self) -> dict:
        return {"label": self.label, "build": "claimed", "outcome": self.outcome, "rule": self.rule,
                "loss_change": float(self.losses[-1] - self.losses[0]), "integral": self.integral,
                "residual": self.residual, "bound": self.bound, "relative_error": self.relative_error,
                "resolution": self.resolution, "ratio": self.ratio, "segment_length": 2 * self.norm(),
                "nodes": len(self.nodes), "statistic": self.statistic,
                **({"tensors": list(self.displacement), "parts": dict(self.parts)} if self.parts else {})}


@dataclass
class Share:
    """One tensor's part of a group segment (`check_groups`): the group's bound on ΔL − ∫f against that tensor's own
    ∫ g_m·Δ_m. A wrong gradient of the tensor along its own values moves the residual by its error times that part,
    so the part's resolution is bound ÷ part, with the other members' parts taken as right (an error of one member
    hidden by an opposite error of another is the one thing it cannot see)."""

    name: str
    segment: Segment

    @property
    def part(self) -> float:
        return self.segment.parts.get(self.name, 0.0)

    @property
    def outcome(self) -> str:
        return self.segment.outcome

    @property
    def resolution(self) -> float:
        return self.segment.bound / self.part if self.part > 0 else math.inf

    @property
    def relative_error(self) -> float:
        return self.segment.residual / self.part if self.part > 0 else math.nan

    @property
    def deciding(self):
        return self if self.outcome in ("agree", "disagree") else None

    def evidence(self) -> str:
        others = [n for n in self.segment.displacement if n != self.name]
        return (f"{self.name}'s part of the scaling segment with {', '.join(others) or 'nothing else'}: "
                f"∫g·Δ = {self.part:.3g} of ∫|f| = {self.segment.scale:.3g}, so its bound {self.segment.bound:.3g} "
                f"resolves {self.name}'s gradient along its own values to {self.resolution:.2g} relative "
                f"(the other parts taken as right): {self.segment.evidence()}")

    def summary(self) -> dict:
        return {"tensor": self.name, "part": self.part, "outcome": self.outcome, "resolution": self.resolution,
                "relative_error": self.relative_error, "group": self.segment.summary()}


def segment_panels(budget_left: int, tensors: int) -> int:
    """Panels per tensor segment the budget allows (8, else 4): one call per node, the base is shared."""
    for panels in (8, 4):
        if panels * tensors <= budget_left:
            return panels
    return 0


def segment_step(value: np.ndarray, size: float, storage: np.dtype, multipliers, unit: np.ndarray,
                 may_move: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(centre, step): centre + m·step exact in `storage` for every multiplier m, ‖step‖ ≈ size along `unit`.

    The centre is w itself when that keeps ≥ 90% of the step (see on_grid). A step longer than the elements
    (a bias of 0.1 moved by 0.3) cannot start from w: w's last bits are lost at |w + m·step| > 2|w|, so
    on_grid drops those elements and the segment shrinks to the few that stay. Then the centre is w rounded
    to the step's grid (the spacing at |w| + |step|), a point a few ulps of the segment's reach from w: the
    identity holds through any point, and every node is exact (one more call, for the centre; with
    `may_move` False, when the budget has no call to spare, the shrunk step from w)."""
    step = on_grid(value, size * unit, storage, multipliers)
    if np.linalg.norm(step) >= 0.9 * size or not may_move or not np.all(np.isfinite(value)):
        return value, (step if np.any(step) else tensor_step(value, size, storage, multipliers,
                                                             np.random.default_rng(0), unit=unit))
    fractions = [abs(m) for m in multipliers if 0 < abs(m) < 1]
    granularity = 2.0 ** math.ceil(math.log2(1.0 / min(fractions))) if fractions else 1.0
    reach = np.abs(value) + max(abs(m) for m in multipliers) * np.abs(size * unit)
    spacing = np.spacing(reach.astype(storage)).astype(np.float64) * granularity
    centre = np.round(value / spacing) * spacing
    step = np.round(size * unit / spacing) * spacing
    for m in multipliers:
        point = centre + m * step
        exact = (point.astype(storage).astype(np.float64) == point) & ((point - centre) == m * step)
        step = np.where(exact, step, 0.0)
    if not np.any(step):
        return value, tensor_step(value, size, storage, multipliers, np.random.default_rng(0), unit=unit)
    return centre, step


def half_aligned(grad: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A unit direction at 45° between the claimed gradient and a random direction orthogonal to it.

    A scale error of the gradient (1.01×) shifts the segment's residual by 1% of ∫g·Δ: along a random direction
    g·Δ is ~‖g‖‖Δ‖/√n and may cancel along the segment (a 1% slip in a 6-element bias then moved the residual by
    half its bound); here g·Δ = ‖g‖‖Δ‖/√2 at the base, for every seed. The random half keeps errors orthogonal to
    g visible. The direction is fixed before any call along it, so it does not bias the test."""
    random = _unit(rng, grad.shape)
    norm = float(np.linalg.norm(grad))
    if norm == 0 or not np.all(np.isfinite(grad)):
        return random
    along = grad / norm
    across = random - float(np.sum(random * along)) * along
    across_norm = float(np.linalg.norm(across))
    if across_norm < 1e-8:  # one element: the gradient's own direction
        return along
    return (along + across / across_norm) / math.sqrt(2.0)


def segment_length(loss_sigma: float, critical: float, slope: float) -> float:
    """‖Δ‖ at which the loss difference's rounding takes ROUNDING_SHARE of SETTLE_RTOL: the segment's scale is
    ~2‖Δ‖·|g·d|, its rounding bound k_crit·√2·σ_L, so ‖Δ‖ = k_crit·√2·σ_L / (2·|g·d|·ROUNDING_SHARE·SETTLE_RTOL)."""
    return critical * math.sqrt(2.0) * loss_sigma / (2.0 * slope * ROUNDING_SHARE * SETTLE_RTOL) if slope > 0 else math.inf


def scaling_step(value: np.ndarray, reach: float, storage: np.dtype,
                 granularity: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(centre, step) with step = reach·centre up to one grid spacing per element, centre + m·step exact in `storage`
    for every multiple m of 1/granularity in [−1, 1]: the scaling c → (1 + m·reach)·c on the float32 grid. The
    grid is `granularity` ulps at |w|·(1 + GROUP_REACH) (1% above, so no point crosses into the next binade), the
    same for every reach ≤ GROUP_REACH: every scaling segment of a tensor goes through the same centre, w rounded
    to that grid (≤ 16 ulps of w away), and they share its call. Unlike `on_grid`, no element is dropped: a weight
    left unscaled moves its units' pre-activations off the scaling and puts kinks back (measured: 2 of
    conv.weight's 36 elements dropped gave the ReLU example ~10² kinks)."""
    spacing = np.spacing((np.abs(value) * (1.0 + GROUP_REACH) * 1.01).astype(storage)).astype(np.float64) * granularity
    centre = np.round(value / spacing) * spacing
    step = np.round(reach * centre / spacing) * spacing
    return centre, step


def _vector(shape: tuple[int, ...]) -> bool:
    """A bias-like tensor: one axis (a (1, C) tensor is a one-output linear layer's weight as often as a bias)."""
    return len(shape) == 1


def _matrix(shape: tuple[int, ...]) -> bool:
    """A weight: two axes or more."""
    return len(shape) >= 2


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def homogeneous_groups(shapes: dict[str, tuple[int, ...]], name: str) -> list[tuple[str, ...]]:
    """Tensors that, scaled together by (1 + t), scale a ReLU network's pre-activations by (1 + t) from `name`'s layer
    on, so that no ReLU, max-pool or leaky ReLU changes its branch along the segment: the layer's weight W (≥ 2-D),
    its bias and every later 1-D tensor (later biases, a normalisation's scale and shift),
    then the layer alone. W's bias is the bias-like tensor next to it, after or before (a sorted pytree puts
    `Dense_0/bias` before `Dense_0/kernel`), with as many elements as W has outputs (its first axis or its last:
    OIHW or HWIO), the one whose name shares more of W's first. A 1-D `name` that is no weight's bias (a
    normalisation's scale) joins the groups of the weight before it. The tensors are in the program's order; a
    group that is not homogeneous for the program (a clamp, a PReLU slope, a bias that is not one) is found out by
    its segment's convergence (`Segment.evaluate`), never assumed."""
    order = list(shapes)

    def bias_of(j: int) -> int | None:
        outputs = {shapes[order[j]][0], shapes[order[j]][-1]}
        near = [k for k in (j + 1, j - 1) if 0 <= k < len(order) and _vector(shapes[order[k]])
                and math.prod(shapes[order[k]]) in outputs]
        return max(near, key=lambda k: (_common_prefix(order[k], order[j]), k > j), default=None)

    def groups_of(j: int) -> list[tuple[str, ...]]:
        bias = bias_of(j)
        layer = [order[j]] + ([order[bias]] if bias is not None else [])
        later = [order[k] for k in range(j + 1, len(order)) if k != bias and _vector(shapes[order[k]])]
        return [tuple(layer + later), tuple(layer)] if later else [tuple(layer)]

    i = order.index(name)
    if _matrix(shapes[name]):
        return groups_of(i)
    if not _vector(shapes[name]):  # a scalar is no layer's
        return []
    owner = next((j for j in (i - 1, i + 1) if 0 <= j < len(order) and _matrix(shapes[order[j]]) and bias_of(j) == i),
                 None)
    if owner is not None:
        return groups_of(owner)
    earlier = [j for j in range(i - 1, -1, -1) if _matrix(shapes[order[j]])]
    return [g for g in groups_of(earlier[0]) if name in g][:1] if earlier else []


def check_groups(calls: Calls, base: dict[str, np.ndarray], at_base: Evaluation, noise: Noise,
                 segments: dict[str, Segment], panels: int, storage: np.dtype) -> list[Segment]:
    """Scaling segments for the tensors whose own segment crossed kinks (float32-only).

    Along w_G → (1 + t)·w_G for a group G from `homogeneous_groups`, a network of ReLUs, max-pools and linear
    layers scales every pre-activation from G's layer on by (1 + t): no unit changes sign and no max-pool its
    winner, so the loss has no kink along it (positive homogeneity) and the segment identity resolves g·Δ to the
    loss difference's rounding, ~u·cond, instead of the ~1e-3 – 1e-2 that thousands of kinks leave. Its reach h is
    the one at which the rounding bound takes ROUNDING_SHARE of SETTLE_RTOL of the smallest member's ∫g·w (≤
    GROUP_REACH), or, when two calls at its ends say the loss is too curved there (`too_curved`), the one its
    largest member needs. Each member's part ∫ g_m·Δ_m is kept (`Share`). The last layers go first. A group that
    is not homogeneous for this program shows kinks in the ratio test, and the next candidate (the layer alone)
    is tried while calls last.
    A group that disagrees cannot say which member is wrong: each of its weights is then scaled alone (its units
    cross zero only where the bias outweighs the rest of the pre-activation: few kinks), with the calls left."""
    critical = lambda dof: t_critical(ALPHA, dof)
    shapes = {name: value.shape for name, value in base.items()}
    total = sum(v.size for v in base.values())
    typical = math.sqrt(sum(float(np.sum(g * g)) for g in at_base.grads.values()) / max(total, 1))
    # the last layers first: fewer nonlinearities after them, so their groups are the likelier to be homogeneous
    # (a GELU before a ReLU breaks the first layer's group, not the second's)
    open_names = [n for n in reversed(segments) if segments[n].outcome == "agree" and segments[n].resolution > SETTLE_RTOL]
    # every scaling segment goes through one point: each tensor any of them may move, at its centre
    scaled = {m for n in open_names for g in homogeneous_groups(shapes, n) for m in g}
    middle = {**base, **{m: scaling_step(base[m], 0.0, storage)[0] for m in scaled}}
    at_middle: list[Evaluation] = [at_base] if all(np.array_equal(middle[m], base[m]) for m in scaled) else []

    def reach_for(group: tuple[str, ...], for_largest: bool = False) -> float:
        parts = {m: abs(float(np.sum(at_base.grads[m] * base[m]))) for m in group}
        largest = max(parts.values())
        smallest = largest if for_largest else min(v for v in parts.values() if v >= GROUP_PART_FLOOR * largest)
        if smallest <= 0:  # g·w sums to 0 (its terms cancel): no part asks for a length; the longest
            return GROUP_REACH
        return min(critical(noise.dof) * math.sqrt(2.0) * noise.loss_sigma
                   / (2.0 * smallest * ROUNDING_SHARE * SETTLE_RTOL), GROUP_REACH)

    def ends(group: tuple[str, ...], reach: float) -> dict[float, Evaluation]:
        """The answers at t = ±1 (nodes of the segment on any number of panels) and at its centre."""
        displacement = {m: scaling_step(base[m], reach, storage)[1] for m in group}
        if not at_middle:
            at_middle.append(calls("claimed", middle))
        return {0.0: at_middle[0], **{t: calls("claimed", _point(middle, displacement, t)) for t in (-1.0, 1.0)}}

    def too_curved(group: tuple[str, ...], reach: float, known: dict[float, Evaluation]) -> bool:
        """Would the loss's curvature along this reach leave the largest part unsettled on `panels` panels? The
        trapezoid on 1 and 2 panels differ by 3× the 2-panel error, which shrinks ~(panels/2)² (de Boor's h²) by
        `panels`; against the (1 − ROUNDING_SHARE) of SETTLE_RTOL of the largest part that is left to quadrature."""
        displacement = {m: scaling_step(base[m], reach, storage)[1] for m in group}
        f = {t: _dot(a.grads, displacement) for t, a in known.items()}
        one, two = f[-1.0] + f[1.0], f[-1.0] / 2 + f[0.0] + f[1.0] / 2
        largest = max(abs(float(np.sum(known[0.0].grads[m] * displacement[m]))) for m in group)
        return abs(two - one) / 3 / (panels / 2) ** 2 > (1 - ROUNDING_SHARE) * SETTLE_RTOL * 2 * largest

    def scale(group: tuple[str, ...], panels: int, reach: float,
              known: dict[float, Evaluation] | None = None) -> Segment:
        nodes = np.linspace(-1.0, 1.0, panels + 1)
        displacement = {m: scaling_step(base[m], reach, storage)[1] for m in group}
        if not at_middle:
            at_middle.append(calls("claimed", middle))
        known = {0.0: at_middle[0], **(known or {})}
        answers = [known[float(t)] if float(t) in known else calls("claimed", _point(middle, displacement, float(t)))
                   for t in nodes]
        losses = np.array([a.loss for a in answers])
        growth = float(np.max(np.abs(losses[[0, -1]]))) / abs(at_base.loss) if at_base.loss else 1.0
        step_norm = math.sqrt(sum(float(np.sum(d * d)) for d in displacement.values()))
        slopes = np.array([_dot(a.grads, displacement) for a in answers])
        # σ_f from the segment's own nodes (8 panels or more): the residual of a cubic through them (n − 4 dof),
        # which is rounding plus whatever of f is not cubic, so never below the rounding. The noise line's σ_g
        # can be inflated ~10³× by one kink it crossed (measured: 1 seed in 4 on the ReLU example, 10⁴× on a
        # PyTorch CNN). Scaled by the ratio of Student t critical values, so that the bound pays for its fewer
        # degrees of freedom. On fewer nodes (a 4-panel attribution segment) the noise line's σ_g
        dof = len(nodes) - GROUP_FIT_DEGREE - 1
        if len(nodes) >= 9:
            fit = np.polynomial.polynomial.polyfit(nodes, slopes, GROUP_FIT_DEGREE)
            slope_sigma = math.sqrt(float(np.sum((slopes - np.polynomial.polynomial.polyval(nodes, fit)) ** 2)) / dof)
            slope_sigma = (max(slope_sigma, formats.unit_roundoff(noise.precision) * float(np.max(np.abs(slopes))))
                           * critical(dof) / critical(noise.dof))
        else:
            slope_sigma = noise.direction_sigma(displacement)
        what = (f"{', '.join(group)} scaled together" if len(group) > 1 else f"{group[0]} scaled alone")
        segment = Segment(f"{what} by 1 ± {reach:.2g}", displacement, nodes, losses, slopes,
                          noise.loss_sigma * max(1.0, growth), slope_sigma, noise.dof,
                          fraction=reach, scale_floor=typical * 2 * step_norm, centre=None)
        width = float(nodes[1] - nodes[0])
        for m in group:
            part = np.array([float(np.sum(a.grads[m] * displacement[m])) for a in answers])
            segment.parts[m] = abs(width * (float(np.sum(part)) - (part[0] + part[-1]) / 2))
        segment.evaluate(critical)
        return segment

    def kinked(segment: Segment) -> bool:
        return segment.rule in ("panels", "jump-free panels")

    done: list[Segment] = []
    tried: set[tuple[str, ...]] = set()
    for name in open_names:
        if any(name in s.displacement and not kinked(s) for s in done):
            continue
        for group in homogeneous_groups(shapes, name):
            if group in tried or calls.left < panels + (0 if at_middle else 1):
                continue
            tried.add(group)
            if not any(np.any(at_base.grads[m] * base[m]) for m in group):
                continue
            reach, shorter, known = reach_for(group), reach_for(group, for_largest=True), None
            if shorter < reach and calls.left >= panels + 2:
                # two calls at the long reach's ends first (its own nodes): a loss too curved there (a cross-entropy
                # over 1 ± 0.75 of its logits) takes the reach the largest part needs instead
                known = ends(group, reach)
                if too_curved(group, reach, known):
                    reach, known = shorter, None
            done.append(scale(group, panels, reach, known))
            if not kinked(done[-1]):
                # a reach long enough for the small parts may leave the loss too curved along it (a cross-entropy over
                # 1 ± 0.75 of its logits): then the reach its largest part needs, with the calls left
                first, heaviest = done[-1], max(done[-1].parts, key=done[-1].parts.get)
                shorter = reach_for(group, for_largest=True)
                if (first.outcome == "agree" and Share(heaviest, first).resolution > SETTLE_RTOL
                        and shorter < first.fraction and calls.left >= panels):
                    done.append(scale(group, panels, shorter))
                break
    for group in [s for s in done if s.outcome == "disagree" and sum(p > 0 for p in s.parts.values()) > 1]:
        # another group holding a suspect but fewer of the others tells them apart (a layer's bias is in every group
        # upstream of it: the group of its own layer does not hold the upstream layers)
        need = _implied_errors(group)
        suspects = [m for m in need if segments[m].outcome == "disagree" or not _excludes(segments[m], need[m])]
        others = [g for m in suspects for g in homogeneous_groups(shapes, m) if g not in tried]
        if len(suspects) > 1 and others:
            other = min(others, key=lambda g: sum(m in g for m in suspects))
            if sum(m in other for m in suspects) < len(suspects) and calls.left >= panels:
                tried.add(other)
                done.append(scale(other, panels, reach_for(other)))
    for group in [s for s in done if s.outcome == "disagree" and sum(p > 0 for p in s.parts.values()) > 1]:
        for m in (m for m in group.parts if _matrix(shapes[m]) and (m,) not in tried):
            tried.add((m,))
            # 8 panels at least: on 4, the kinks leave the panels' fit 3 dof (measured: 5e-3 on the ReLU example)
            few = next((k for k in (2 * panels, panels) if calls.left >= k), 0)
            if few and np.any(at_base.grads[m] * base[m]):
                done.append(scale((m,), few, reach_for((m,))))
    return done


def check_segments(calls: Calls, base: dict[str, np.ndarray], at_base: Evaluation, noise: Noise,
                   scales: dict[str, float], rng: np.random.Generator, panels: int, storage: np.dtype,
                   between: Callable[[dict[str, Segment]], set[str]] | None = None) -> dict[str, Segment]:
    """One segment per tensor (the float32-only check): `panels` uniform panels, nodes at t = j/(panels/2), its
    length chosen from the program's own numbers (`segment_length`: the measured σ_L and g·d at the base), above
    SEGMENT_MIN·‖w‖ and below SEGMENT_MAX × the larger of ‖w‖ and the model's own scale. Then, while calls last, the least resolved segment is refined where its bound
    comes from: rounding → a longer segment (by what the bound asks, ≤ SEGMENT_STRETCH×); quadrature → twice the
    panels, then a segment SEGMENT_SHRINK× shorter (Simpson's error falls with the 4th power of the length, the
    rounding's share grows with its 1st). `between` runs after the first segments and before the refinement, and
    returns the tensors it settled (the refinement leaves them alone)."""
    critical = lambda dof: t_critical(ALPHA, dof)
    total = sum(v.size for v in base.values())
    typical = math.sqrt(sum(float(np.sum(g * g)) for g in at_base.grads.values()) / max(total, 1))
    nodes_fine = list(np.linspace(-1.0, 1.0, 2 * panels + 1))
    units = {name: half_aligned(at_base.grads[name], rng) for name in base}
    # the longest segment: SEGMENT_MAX × the tensor's norm, or × the RMS element of the largest non-zero tensor (a
    # weight matrix: the model's own scale) × √n when that is larger: a bias near zero (1e-6) must get the length its
    # loss asks for, not one set by its tiny ‖b‖, and a bias at −7e4 beside weights ~0.1 must not set the weights'
    nonzero = [v for v in base.values() if np.any(v)]
    typical_rms = float(np.sqrt(np.mean(max(nonzero, key=np.size) ** 2))) if nonzero else 1.0
    longest = {name: SEGMENT_MAX * max(scales[name], typical_rms * math.sqrt(value.size)) for name, value in base.items()}

    def run(name: str, length: float, reserved: int = 0) -> Segment:
        """The segment of `name` (panels calls, one more for a moved centre if the calls beyond `reserved` allow)."""
        length = min(max(length, SEGMENT_MIN * scales[name]), longest[name])
        nodes = np.linspace(-1.0, 1.0, panels + 1)
        # exact at the nodes of twice as many panels too (the refinement below)
        centre, step = segment_step(base[name], length, storage, nodes_fine, units[name],
                                    may_move=calls.left - reserved > panels)
        displacement = {name: step}
        middle = {**base, name: centre}
        moved = not np.array_equal(centre, base[name])
        answers = {float(t): at_base if t == 0.0 and not moved else calls("claimed", _point(middle, displacement, float(t)))
                   for t in nodes}
        losses = np.array([answers[float(t)].loss for t in nodes])
        slopes = np.array([_dot(answers[float(t)].grads, displacement) for t in nodes])
        growth = float(np.max(np.abs(losses[[0, -1]]))) / abs(at_base.loss) if at_base.loss else 1.0
        fraction = float(np.linalg.norm(step)) / scales[name]
        segment = Segment(f"{name} along a segment of ±{fraction:.2g}‖{name}‖ at 45° to its gradient", displacement,
                          nodes, losses, slopes, noise.loss_sigma * max(1.0, growth), noise.direction_sigma(displacement), noise.dof,
                          fraction=fraction, scale_floor=typical * 2 * float(np.linalg.norm(step)), centre=centre)
        if moved:
            segment.label += f" through a point {float(np.max(np.abs(centre - base[name]))):.2g} from w"
        segment.evaluate(critical)
        return segment

    def first_length(name: str) -> float:
        slope = max(abs(float(np.sum(at_base.grads[name] * units[name]))), typical)
        return segment_length(noise.loss_sigma, critical(noise.dof), slope)

    # every tensor's first segment before any refinement: the calls for the ones still to run are reserved
    segments = {name: run(name, first_length(name), panels * (len(base) - 1 - i)) for i, name in enumerate(base)}
    settled = between(segments) if between is not None else set()
    tried = set()
    while True:
        open_ones = [s for name, s in segments.items() if s.outcome == "agree" and s.resolution > SETTLE_RTOL
                     and id(s) not in tried and panels <= calls.left and name not in settled]
        if not open_ones:
            return segments
        segment = max(open_ones, key=lambda s: s.resolution)
        tried.add(id(segment))
        name = next(iter(segment.displacement))
        length = segment.norm()
        if segment.rule == "panels" and len(segment.nodes) - 1 >= 2 * panels:
            # kinks at twice the panels: many small jumps add like a random walk, so more panels halve the scatter
            # at best (measured on the ReLU nets: median worst resolution 1.7e-2 → 1.6e-2, 2.8e-3 → 2.2e-3 at 16
            # panels); the calls left go to short stencils (_float32_only)
            continue
        if segment.rule != "panels" and segment.rounding_bound > segment.quadrature:
            if length >= 0.99 * longest[name]:
                continue
            stretch = min(max(segment.rounding_bound / (ROUNDING_SHARE * SETTLE_RTOL * segment.scale), 2.0),
                          SEGMENT_STRETCH)
            other = run(name, length * stretch)
        elif len(segment.nodes) - 1 < 2 * panels:
            midpoints = (segment.nodes[1:] + segment.nodes[:-1]) / 2
            answers = [calls("claimed", _point({**base, name: segment.centre}, segment.displacement, float(t)))
                       for t in midpoints]
            order = np.argsort(np.concatenate([segment.nodes, midpoints]))
            segment.nodes = np.concatenate([segment.nodes, midpoints])[order]
            segment.losses = np.concatenate([segment.losses, [a.loss for a in answers]])[order]
            segment.slopes = np.concatenate([segment.slopes, [_dot(a.grads, segment.displacement) for a in answers]])[order]
            segment.evaluate(critical)
            tried.discard(id(segment))
            continue
        else:
            if segment.fraction <= SEGMENT_MIN * 1.01:
                continue
            other = run(name, length / SEGMENT_SHRINK)
        if other.outcome == "disagree" or other.resolution < segment.resolution:
            segments[name] = other


# ---------------------------------------------------------------------------------------------
# the check


def check_gradients(oracle: Oracle, base: dict[str, np.ndarray], seed: int = 0, max_calls: int | None = None,
                    progress: bool = False) -> GradCheck:
    """Is `oracle`'s gradient the derivative of its loss at `base`? See the module docstring.

    `base` holds the parameters (float64 arrays of values the claimed build can represent).
    """
    started = time.perf_counter()
    base = {name: np.asarray(value, np.float64) for name, value in base.items()}
    shapes = {name: value.shape for name, value in base.items()}
    budget = max_calls if max_calls is not None else default_budget(len(base))
    rng = np.random.default_rng(seed)
    claimed = oracle.claimed_precision
    has_float64 = bool(oracle.has_float64) and claimed != "float64"
    fd_build = "float64" if has_float64 else "claimed"
    fd_precision = "float64" if has_float64 else claimed
    fd_storage = np.dtype("float64" if fd_precision == "float64" else "float32")
    claimed_storage = storage_dtype("claimed", claimed)
    float32_only = not has_float64 and claimed != "float64"
    noise_multipliers = NOISE_MULTIPLIERS_FLOAT32 if float32_only else NOISE_MULTIPLIERS
    minimum = 1 + len(noise_multipliers) + (2 * len(base) + 2 * COMPARISON_LINES + 1 + 2 * COMPARISON_LINES
                                            if has_float64 else 2 * len(base) + 2 if claimed == "float64"
                                            else 4 * len(base))
    if budget < minimum:
        raise LabInputError(f"a call budget of {budget} is below the {minimum} calls a check of {len(base)} "
                            f"tensors needs (raise --max-calls)")
    calls = Calls(oracle, budget, progress)
    notes: list[str] = []
    try:
        at_base = calls(fd_build, base)
        scales = tensor_scales(base)
        noise = {fd_build: measure_noise(calls, fd_build, fd_precision, base, at_base, scales, rng, noise_multipliers)}
        if not noise[fd_build].responsive and fd_build == "float64" and claimed != "float64":
            # a float64 build that is not one is not trusted: the claimed build alone, as without one
            notes.append(_unresponsive_words(noise["float64"], "float64", "float64"))
            at_base = calls("claimed", base)
            noise["claimed"] = measure_noise(calls, "claimed", claimed, base, at_base, scales, rng,
                                             NOISE_MULTIPLIERS_FLOAT32)
            if noise["claimed"].responsive:
                return _float32_only(oracle, calls, base, at_base, noise, scales, rng, budget, started, seed, notes)
            fd_build, fd_precision = "claimed", claimed
        if not noise[fd_build].responsive:
            return _unresponsive(oracle, noise, fd_build, fd_precision, shapes, calls, budget, started, seed)
        if not has_float64 and claimed != "float64":  # a float64 claim is differenced in float64 itself (~1e-10)
            return _float32_only(oracle, calls, base, at_base, noise, scales, rng, budget, started, seed, notes)
        step = formats.unit_roundoff(fd_precision) ** STEP_EXPONENT
        multipliers = [s * LEVEL_FACTOR ** -i for i in range(MAX_LEVELS) for s in (1, -1)]

        # the whole-vector directions: on the claimed build's grid when both builds answer there
        whole_grid = claimed_storage if has_float64 else fd_storage
        whole_multipliers = (1, -1) if has_float64 else multipliers
        whole_steps = [{name: tensor_step(value, step * scales[name], whole_grid, whole_multipliers, rng)
                        for name, value in base.items()} for _ in range(COMPARISON_LINES if has_float64 else 1)]
        tensor_steps = {name: {name: tensor_step(value, step * scales[name], fd_storage, multipliers, rng)}
                        for name, value in base.items()}

        # the claimed build at the same points: its noise and its errors against float64
        compared = None
        if has_float64:
            points = [base] + [_point(base, s, m) for s in whole_steps for m in (1, -1)]
            claimed_answers = [calls("claimed", p) for p in points]
            float64_answers = [at_base]
            checker_points = {}
            for s_index, s in enumerate(whole_steps):
                for m in (1, -1):
                    answer = calls("float64", _point(base, s, m))
                    float64_answers.append(answer)
                    checker_points[(s_index, m)] = answer
            compared = (claimed_answers, float64_answers)
            claimed_losses = np.array([a.loss for a in claimed_answers]) - np.array([a.loss for a in float64_answers])
            spread = float(np.std(claimed_losses, ddof=1))
            noise["claimed"] = Noise("claimed", claimed, claimed_answers[0].loss, spread, len(points) - 1, {})
        # the loss noise the differences use: measured on their build; with a claimed build beside
        # it, never below that build's measured noise scaled by u64/u_claimed (the same arithmetic)
        loss_sigma = noise[fd_build].loss_sigma
        if has_float64:
            scaled = noise["claimed"].loss_sigma * formats.unit_roundoff("float64") / formats.unit_roundoff(claimed)
            loss_sigma = max(loss_sigma, scaled)
        checker = Checker(calls, fd_build, base, at_base, noise[fd_build], loss_sigma)

        # directions: level 0 for every one first (the mandatory calls), then refinements
        tensor_directions = {name: [checker.direction(f"{name} along a random unit direction", tensor_steps[name])]
                             for name in base}
        whole = [checker.direction(f"all tensors along random direction {i + 1}", s) for i, s in enumerate(whole_steps)]
        if has_float64:  # their level-0 points were evaluated above: reuse them
            for i, direction in enumerate(whole):
                checker.advance(direction, (checker_points[(i, 1)], checker_points[(i, -1)]))
        for name in base:
            checker.advance(tensor_directions[name][0])
        if not has_float64:
            for direction in whole:
                checker.advance(direction)
        _refine(checker, tensor_directions, whole, base, scales, step, fd_storage, multipliers, rng)

        tensors = {name: TensorVerdict(name, shapes[name], directions=tensor_directions[name]) for name in base}
        loss_comparison = None
        if compared is not None:
            claimed_answers, float64_answers = compared
            loss_comparison = compare_builds("loss", np.array([a.loss for a in claimed_answers]),
                                             np.array([a.loss for a in float64_answers]),
                                             np.array(noise["float64"].loss_sigma), claimed)
            for name in base:
                tensors[name].comparison = compare_builds(
                    name, np.stack([a.grads[name] for a in claimed_answers]),
                    np.stack([a.grads[name] for a in float64_answers]), noise["float64"].grad_sigma[name], claimed,
                    direction=tensor_steps[name][name] / max(np.linalg.norm(tensor_steps[name][name]), 1e-300))
        for tensor in tensors.values():
            _judge_tensor(tensor, claimed, has_float64)
        # a failing whole-vector direction no tensor explains: find the tensor by halving it
        whole_failing = [d for d in whole if d.outcome == "disagree"]
        if whole_failing and not any(t.verdict == "defect" for t in tensors.values()):
            located = localise(checker, whole_failing[0], shapes)
            for found in located:
                for n in found.tensors:
                    tensors[n].verdict = "defect"
                    tensors[n].evidence.append(f"found by halving a failing whole-vector direction: {found.region} "
                                               f"({found.note})")
            notes.append("a whole-vector direction disagrees: " + whole_failing[0].evidence())
        # locate each defect the finite differences found
        for tensor in tensors.values():
            failing = [d for d in tensor.directions if d.outcome == "disagree"]
            if failing and calls.left >= 2:
                tensor.located = localise(checker, failing[-1], shapes)
                tensor.evidence += [f"located: {x.region} ({x.note})" for x in tensor.located]
                singles = [abs(x.element_error) for x in tensor.located if x.element_error is not None]
                tensor.max_abs_err = max([tensor.max_abs_err, *singles])
        if loss_comparison is not None and loss_comparison.bound_ratio > 1:
            notes.append(f"the {claimed} build's loss differs from the float64 build's by {loss_comparison.persistent:.3g} "
                         f"at every point ({loss_comparison.bound_ratio:.3g}× the rounding bound): the builds compute "
                         f"different losses")
        if has_float64:
            measured = noise["float64"].loss_sigma
            expected = noise["claimed"].loss_sigma * formats.unit_roundoff("float64") / formats.unit_roundoff(claimed)
            if expected > 0 and measured > excess_limit("float64" if claimed == "float64" else claimed) * expected:
                notes.append(f"the float64 build's loss noise ({measured:.3g}) is {measured / expected:.3g}× the "
                             f"{claimed} build's scaled by u64/u_{claimed}: does it really compute in float64?")
    finally:
        calls.close()
    verdicts = [t.verdict for t in tensors.values()]
    if loss_comparison is not None and loss_comparison.bound_ratio > 1:
        verdicts.append("defect")
    verdict = "defect" if "defect" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "roundoff")
    return GradCheck(oracle.name, claimed, has_float64, verdict, tensors, whole, loss_comparison, noise,
                     dict(calls.counts), budget, time.perf_counter() - started, calls.program_s, seed, notes)


def _float32_only(oracle, calls, base, at_base, noise, scales, rng, budget, started, seed, notes) -> GradCheck:
    """No float64 build: one long segment per tensor (see Segment), the verdict at the resolution it reaches."""
    claimed = oracle.claimed_precision
    storage = np.dtype(formats.STORAGE_DTYPE[claimed]) if claimed != "float64" else np.dtype("float64")
    panels = segment_panels(calls.left, len(base))
    try:
        if not panels:
            raise BudgetSpent
        groups: list[Segment] = []

        def scale_groups(first: dict[str, Segment]) -> set[str]:
            # scaling segments before any refinement: the tensors behind kinks need them most
            groups.extend(check_groups(calls, base, at_base, noise["claimed"], first, GROUP_PANELS, storage))
            return {m for g in groups if g.outcome == "agree" for m in g.parts if Share(m, g).resolution <= SETTLE_RTOL}
        segments = check_segments(calls, base, at_base, noise["claimed"], scales, rng, panels, storage,
                                  between=scale_groups)
    except BudgetSpent:
        words = f"{calls.left} calls left: too few for a segment of 4 panels per tensor (raise --max-calls)"
        tensors = {name: TensorVerdict(name, value.shape, "inconclusive", settle=words) for name, value in base.items()}
        calls.close()
        return GradCheck(oracle.name, claimed, False, "inconclusive", tensors, [], None, noise, dict(calls.counts),
                         budget, time.perf_counter() - started, calls.program_s, seed, notes + [words])
    # kinks the segments do not resolve: the short stencil of the float64 path (h = u^(1/3)·‖w‖, kinks stepped
    # around), which crosses few of them, with the calls left
    directions: dict[str, list[Direction]] = {name: [] for name in base}
    checker = Checker(calls, "claimed", base, at_base, noise["claimed"], noise["claimed"].loss_sigma)
    step = formats.unit_roundoff(claimed) ** STEP_EXPONENT
    multipliers = [m * LEVEL_FACTOR ** -i for i in range(MAX_LEVELS) for m in (1, -1)]
    shares: dict[str, list[Share]] = {name: [Share(name, g) for g in groups if g.parts.get(name, 0.0) > 0]
                                      for name in base}
    # the tensors a share settled too: a share sees the gradient only along the tensor's own values
    kinked = sorted((s for s in segments.values() if s.rule == "panels" and s.outcome == "agree"
                     and s.resolution > SETTLE_RTOL), key=lambda s: -s.resolution)
    try:
        for segment in kinked:
            name = next(iter(segment.displacement))
            if calls.left < 2:
                break
            direction = checker.direction(f"{name} along a random unit direction (short stencil)",
                                          {name: tensor_step(base[name], step * scales[name], storage, multipliers, rng)})
            directions[name].append(direction)
            while direction.outcome == "open" and calls.left >= 2:
                checker.advance(direction)
    finally:
        calls.close()
    named, unexplained, either = _group_suspects(groups, segments, shares)
    undecided = [group for group, _ in either]
    notes = notes + [words for _, words in either]
    tensors = {}
    for name, segment in segments.items():
        # a share sees the gradient only along the tensor's values: the gradient of its zero elements not at all
        zero = base[name] == 0
        norm = float(np.linalg.norm(at_base.grads[name]))
        blind = float(np.linalg.norm(at_base.grads[name][zero])) / norm if norm > 0 and zero.any() else 0.0
        tensor = TensorVerdict(name, base[name].shape, segment=segment, evidence=[segment.evidence()],
                               directions=directions[name], shares=shares[name] if blind <= SETTLE_RTOL else [])
        tensor.evidence += [d.evidence() for d in directions[name]] + [x.evidence() for x in shares[name]]
        if blind > SETTLE_RTOL and shares[name]:
            tensor.evidence.append(f"{blind:.2g} of {name}'s gradient norm is on elements whose value is 0, which its "
                                   f"scaling segments do not move: they do not settle it")
        tensor.max_abs_err = abs(segment.residual) / (2 * segment.norm()) if segment.norm() > 0 else math.nan
        tensor.bound_ratio = abs(segment.residual) / segment.bound if segment.bound > 0 else math.inf
        short = [d for d in directions[name] if d.outcome in ("agree", "disagree")]
        resolution = min([segment.resolution] + [d.resolution for d in short if d.outcome == "agree"]
                         + [x.resolution for x in tensor.shares if x.outcome == "agree"])
        if segment.outcome == "disagree" or any(d.outcome == "disagree" for d in short) or name in named:
            tensor.verdict = "defect"
            for d in (d for d in short if d.outcome == "disagree"):
                tensor.max_abs_err = abs(d.deciding.error) / d.norm()
                tensor.bound_ratio = abs(d.deciding.error) / d.deciding.bound if d.deciding.bound > 0 else math.inf
            for group, words in named.get(name, []):
                reach = float(np.linalg.norm(group.displacement[name]))
                tensor.max_abs_err = abs(group.residual) / (2 * reach) if reach > 0 else math.nan
                tensor.bound_ratio = abs(group.residual) / group.bound if group.bound > 0 else math.inf
                tensor.evidence.append(words)
        elif resolution <= SETTLE_RTOL:
            tensor.verdict = "roundoff"
        else:
            tensor.verdict = "inconclusive"
            tensor.settle = (f"the {claimed} build alone resolves the gradient only to {resolution:.2g} relative "
                             f"(settled needs {SETTLE_RTOL:g}; {segment.statistic}): give the candidate a "
                             f"command_float64 (the same program in double precision), or more calls (--max-calls)")
        tensors[name] = tensor
    for name in {m for group in undecided for m in group}:
        if tensors[name].verdict != "defect":
            tensors[name].verdict = "inconclusive"
            words = next(w for g, w in either if name in g)
            tensors[name].evidence.append(words)
            tensors[name].settle = f"{words}: more calls (--max-calls) for a segment that tells them apart"
    verdicts = [t.verdict for t in tensors.values()] + ["defect"] * bool(unexplained or undecided)
    verdict = "defect" if "defect" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "roundoff")
    return GradCheck(oracle.name, claimed, False, verdict, tensors, [], None, noise, dict(calls.counts), budget,
                     time.perf_counter() - started, calls.program_s, seed, notes + unexplained, undecided)


def _implied_errors(group: Segment) -> dict[str, float]:
    """The relative error along its own values each member of a disagreeing group would need to explain it alone:
    |residual| ÷ its part; unbounded for a member the segment moves whose claimed part is 0 (a gradient left at
    zero explains any residual), none for a member it does not move (an all-zero tensor)."""
    return {m: abs(group.residual) / part if part > 0 else math.inf for m, part in group.parts.items()
            if part > 0 or np.any(group.displacement[m])}


def _excludes(evidence, need: float) -> bool:
    """An agreeing segment bounds its tensor's relative error by |its residual| + its bound: below `need`, it
    excludes an error that large (as a scale error)."""
    return (evidence.outcome == "agree" and math.isfinite(need)
            and abs(evidence.relative_error) + evidence.resolution < need)


def _group_suspects(groups: list[Segment], segments: dict[str, Segment], shares: dict[str, list[Share]]
                    ) -> tuple[dict[str, list[tuple[Segment, str]]], list[str], list[tuple[list[str], str]]]:
    """The tensors a disagreeing scaling segment names. Its residual could come from any member m, whose gradient
    would then be wrong along its own values by |residual| ÷ m's part; m is cleared when its own segment, or another
    scaling segment, agrees at a finer resolution than that (an error of that size, as a scale error, would have
    shown there). The others are named when one tensor is left (or one is suspected by every disagreeing group);
    when several are, none is named a defect and they are reported as one set (`undecided`: one of them is wrong);
    when every member is cleared, the disagreement is reported as the whole gradient's (`unexplained`)."""
    named: dict[str, list[tuple[Segment, str]]] = {}
    unexplained: list[str] = []
    suspected: list[tuple[Segment, list[str], dict[str, float], dict[str, str]]] = []
    for group in (g for g in groups if g.outcome == "disagree"):
        need = _implied_errors(group)

        def cleared(m: str) -> str:
            if segments[m].outcome == "disagree":
                return ""
            own = [segments[m]] + [x for x in shares[m] if x.segment is not group]
            evidence = [x for x in own if _excludes(x, need[m])]
            best = min(evidence, key=lambda x: abs(x.relative_error) + x.resolution, default=None)
            return (f"{m} would need {need[m]:.2g} relative along its values, and its own evidence allows at most "
                    f"{abs(best.relative_error) + best.resolution:.2g}") if best else ""
        if not need:
            continue
        reasons = {m: cleared(m) for m in need}
        # a member whose own segment disagrees explains the group by itself
        own = [m for m in need if segments[m].outcome == "disagree"]
        for m in need:
            if own and m not in own and not reasons[m]:
                reasons[m] = f"{', '.join(own)} disagree{'s' if len(own) == 1 else ''} on {'its' if len(own) == 1 else 'their'} own segment"
        suspects = [m for m in need if not reasons[m]]
        if suspects:
            suspected.append((group, suspects, need, reasons))
        else:
            unexplained.append(f"the scaling segment of {', '.join(group.displacement)} disagrees and no single tensor "
                               f"of it explains that: {'; '.join(reasons.values())}; {group.evidence()}")
    # one wrong tensor in several disagreeing groups (a layer's bias is in every group upstream of it): the tensors
    # every one of them suspects explain them all
    common = set.intersection(*(set(s) for _, s, _, _ in suspected)) if suspected else set()
    undecided: list[tuple[list[str], str]] = []
    for group, suspects, need, reasons in suspected:
        chosen = [m for m in suspects if m in common] or suspects
        if len(chosen) > 1:  # one of them is wrong and nothing here tells which: none is named a defect
            if sorted(chosen) not in [u[0] for u in undecided]:
                needs = ", ".join(f"{m} {need[m]:.2g}" for m in chosen)
                undecided.append((sorted(chosen), f"one of {' or '.join(sorted(chosen))} is wrong: the scaling segment "
                                  f"of {', '.join(group.displacement)} disagrees, and the relative error each would need "
                                  f"along its values ({needs}) is excluded by nothing within the calls"))
            continue
        for m in chosen:
            others = [f"{n}: cleared ({reasons[n]})" if reasons[n] else
                      f"{n} is not cleared" + ("" if n in common or not common else
                                               f", but {', '.join(sorted(common))} explain{'s' if len(common) == 1 else ''} "
                                               f"every disagreeing scaling segment") for n in need if n != m]
            wrong_by = (f"would be wrong by {need[m]:.2g} relative along its values" if math.isfinite(need[m]) else
                        "gives it no part along its values (∫g·Δ = 0): left at zero, it explains any residual")
            named.setdefault(m, []).append((group, (
                f"named by the scaling segment of {', '.join(group.displacement)}, which disagrees: {m}'s gradient "
                f"{wrong_by}" + (f"; {'; '.join(others)}" if others else ""))))
    return named, unexplained, undecided


def _unresponsive_words(measured: Noise, build: str, precision: str) -> str:
    """What the unresponsive build does, in one sentence."""
    if build == "float64" and measured.identical:
        coarser = "it computes in float32" if measured.single_losses else "it computes in a coarser format than float64"
        return (f"command_float64's loss {measured.loss:.17g} does not change at float64 resolution (the same number at "
                f"all {measured.dof + 2} points {NOISE_ULPS} float64 ulps apart, its gradient says it moves by "
                f"{abs(measured.predicted_slope):.3g} per step): {coarser}; its answers are not used")
    return (f"the {build} build's loss does not change along steps of {NOISE_ULPS} {precision} ulps (fitted slope "
            f"{measured.slope:.3g} ± {measured.slope_sigma:.2g}) although its gradient says {measured.predicted_slope:.3g}: "
            f"it rounds its parameters to a coarser format than {precision}")


def _unresponsive(oracle, noise, build, precision, shapes, calls, budget, started, seed) -> GradCheck:
    """The differenced build ignores small steps of its parameters: nothing can be judged with it."""
    words = _unresponsive_words(noise[build], build, precision)
    settle = ("make command_float64 compute in float64 throughout (or drop it)" if build == "float64"
              else f"make the program compute in {precision} as claimed")
    tensors = {name: TensorVerdict(name, shape, "inconclusive", math.nan, math.nan, [words], settle=settle)
               for name, shape in shapes.items()}
    calls.close()
    return GradCheck(oracle.name, oracle.claimed_precision, bool(oracle.has_float64), "inconclusive", tensors, [], None,
                     noise, dict(calls.counts), budget, time.perf_counter() - started, calls.program_s, seed, [words])


def _refine(checker: Checker, tensor_directions: dict[str, list[Direction]], whole: list[Direction],
            base, scales, step, storage, multipliers, rng) -> None:
    """While calls last: smaller steps for open tensor directions, new directions for undecided ones;
    then, if no tensor disagrees, the whole-vector directions (a tensor that disagrees explains them)."""
    while checker.calls.left >= 2:
        open_ones = [ds[-1] for ds in tensor_directions.values() if ds[-1].outcome == "open"]
        retry = [name for name, ds in tensor_directions.items()
                 if ds[-1].outcome == "undecided" and len(ds) < MAX_DIRECTIONS]
        if not open_ones and retry:
            for name in retry:
                displacement = {name: tensor_step(base[name], step * scales[name], storage, multipliers, rng)}
                direction = checker.direction(f"{name} along a second random unit direction", displacement)
                tensor_directions[name].append(direction)
                open_ones.append(direction)
        if not open_ones and not any(ds[-1].outcome == "disagree" for ds in tensor_directions.values()):
            open_ones = [d for d in whole if d.outcome == "open"]
        if not open_ones:
            return
        for direction in open_ones:
            if checker.calls.left < 2:
                return
            checker.advance(direction)


def _judge_tensor(tensor: TensorVerdict, claimed: str, has_float64: bool) -> None:
    """Combine the finite-difference directions and the build comparison into the tensor's verdict."""
    build = "float64" if has_float64 else claimed
    decided = [d for d in tensor.directions if d.outcome in ("agree", "disagree")]
    final = decided[-1] if decided else tensor.directions[-1]
    tensor.evidence += [d.evidence() for d in tensor.directions]
    level = final.deciding
    # the gradient's error along the tested unit direction: a lower bound on the error vector's norm
    fd_abs = abs(level.error) / final.norm() if level is not None and final.norm() > 0 else math.nan
    fd_ratio = abs(level.error) / level.bound if level is not None and level.bound > 0 else math.nan
    if final.outcome == "disagree":
        fd_verdict = "defect"
    elif final.outcome == "agree" and final.resolution <= SETTLE_RTOL:
        fd_verdict = "roundoff"
    else:
        fd_verdict = "inconclusive"
        if final.outcome == "agree":
            tensor.settle = (f"the {build} differences resolve g·d only to {final.resolution:.2g} relative "
                             f"(settled needs {SETTLE_RTOL:g}): "
                             + ("give the candidate a command_float64 (the same program in double precision)"
                                if not has_float64 else "a loss with less rounding noise, or more calls (--max-calls)"))
        else:
            tensor.settle = (f"{final.reason or final.outcome}: more calls (--max-calls) for more directions, or a "
                             f"float64 build")
    tensor.verdict, tensor.max_abs_err, tensor.bound_ratio = fd_verdict, fd_abs, fd_ratio
    comparison = tensor.comparison
    if comparison is None:
        return
    tensor.max_abs_err = max(comparison.max_abs_err, fd_abs if fd_verdict == "defect" else 0.0)
    tensor.bound_ratio = max(comparison.bound_ratio, fd_ratio if math.isfinite(fd_ratio) else 0.0)
    limit = excess_limit(claimed)
    if comparison.bound_ratio > 1:
        worst = comparison.worst[0]
        tensor.verdict = "defect"
        tensor.evidence.append(
            f"the {claimed} build's gradient differs from the float64 build's at every one of {comparison.points} nearby "
            f"points: {comparison.flagged} of {comparison.size} elements beyond {PERSISTENCE_LIMIT:g}× their rounding "
            f"spread, worst {tensor.name}{_format_index(tuple(worst['index']))} by {worst['error']:.3g} "
            f"({worst['relative']:.2g} relative, {worst['bound_ratio'] * PERSISTENCE_LIMIT:.3g}× its spread)"
            + (f"; pattern {comparison.pattern}" if comparison.pattern else "")
            + (f"; {comparison.directional}" if comparison.directional else ""))
        tensor.located = tensor.located or [Located(comparison.pattern or tensor.name, worst["error"], worst["spread"],
                                                    f"{comparison.flagged} element(s), {claimed} build only",
                                                    tensors=[tensor.name])]
    elif math.isfinite(comparison.spread_excess) and comparison.spread_excess > limit:
        tensor.verdict = "defect"
        tensor.evidence.append(
            f"the {claimed} build's rounding spread is {comparison.spread_excess:.3g}× what {claimed} arithmetic gives "
            f"(the float64 build's noise × u_{claimed}/u64; limit {limit:.3g}): it computes with "
            f"{implied_format(claimed, comparison.spread_excess)}, coarser than claimed")
    else:
        tensor.evidence.append(
            f"{claimed} build against float64 build at {comparison.points} nearby points: max|err| "
            f"{comparison.max_abs_err:.3g}, repeating part {comparison.persistent:.3g} ({comparison.bound_ratio:.3g} of "
            f"the bound {PERSISTENCE_LIMIT:g}× its rounding spread), spread {comparison.spread_excess:.3g}× the "
            f"float64-predicted: rounding")
