"""Directional derivatives: the stencil w ± a·Δ at shrinking steps, kinks stepped around, agree or disagree."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .noise import ALPHA, Noise, t_critical
from .points import displaced, dot
from .program import BudgetSpent, Calls, Evaluation

#: central differences balance truncation h²|L'''|/6 against rounding u|L|/h at h ∝ u^(1/3)
#: (Nocedal & Wright 2006, §8.1, eq. 8.7); the step is scaled to the tensor's norm
STEP_EXPONENT = 1.0 / 3.0
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
#: a disagreement persists when the residual at the smaller step is within this factor of the larger
#: step's (a truncation error shrinks ≥ 16×, a bug stays)
PERSIST_FACTOR = 2.0


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
        claimed = dot(self.at_base.grads, displacement)
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
            plus = self.calls(self.build, displaced(self.base, direction.displacement, multiplier))
            minus = self.calls(self.build, displaced(self.base, direction.displacement, -multiplier))
        else:
            plus, minus = answers
        a = multiplier
        l0, lp, lm = self.at_base.loss, plus.loss, minus.loss
        f0 = direction.claimed
        fp, fm = dot(plus.grads, direction.displacement), dot(minus.grads, direction.displacement)
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
