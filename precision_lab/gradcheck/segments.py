"""Float32-only programs: the loss difference over a long segment against the gradient integrated along it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import compare
from .noise import ALPHA, SETTLE_RTOL, Noise, t_critical
from .points import displaced, dot, on_grid, random_unit, tensor_step
from .program import Calls, Evaluation

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
    suspect: str = ""  # the panels' fit lies beyond the noise's Student t but within its own (few dof): undecided
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
        scatter = math.sqrt(float(np.sum((residuals - slope * integrals) ** 2)) / (panels - 1))
        floor = rounding / math.sqrt(panels)
        # each σ pays its own Student t: the panels' scatter its panels − 1 dof, the rounding floor the noise line's
        # dof (σ_L, σ_f measured there); the larger bound is a valid 1e-4 test either way (the scatter's t is exact for
        # any size of the scatter, the floor's holds when the panels hold nothing but rounding)
        spread, spread_dof = max((critical(panels - 1) * scatter, scatter, panels - 1),
                                 (critical(self.dof) * floor, floor, self.dof))[1:]
        self.suspect = ""
        if weight > 0:
            # ε is the gradient's relative error along Δ; on the scale of ∫|f| (∫f itself may cancel to ~0)
            standard_error = spread / math.sqrt(weight)
            panel_residual, panel_bound = -slope * self.scale, critical(spread_dof) * standard_error * self.scale
            panel_words = (f"the {panels} panels' residuals against their integrals give a relative error {-slope:.2g} ± "
                           f"{standard_error:.2g} (Student t, {spread_dof} dof)")
            sigmas = abs(slope) / standard_error if standard_error > 0 else math.inf
            if critical(self.dof) < sigmas and abs(panel_residual) <= panel_bound:
                # beyond what the noise line's Student t (the test of every other comparison) allows, within what the
                # panels' few dof allow: neither agreement nor evidence yet; more panels (more dof) decide
                self.suspect = (f"the panels' relative error {-slope:.2g} is {sigmas:.3g}σ from zero, beyond the "
                                f"{critical(self.dof):.3g}σ of the noise's {self.dof} dof but short of the "
                                f"{critical(spread_dof):.3g}σ its {spread_dof} dof need at {ALPHA:g} false alarms: "
                                f"not agreement; more panels decide")
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
            # on 4 panels the ratio compares the 1-panel trapezoid, not yet like h² for a smooth f either: it cannot say kinks
            cause = "kinks" if panels >= 8 else f"kinks, or a curvature {panels} panels do not resolve yet"
            self.statistic = f"the trapezoid sums do not converge like h² (ratio {self.ratio:.3g}): {cause}; {panel_words}"
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
                    self.statistic = f"the trapezoid sums do not converge like h² (ratio {self.ratio:.3g}): {cause}; {words}"
                else:
                    self.statistic += f"; {words}, but the panels do not disagree: a jump beyond its allowance"
        self.outcome = "agree" if abs(self.residual) <= self.bound else "disagree"
        if self.outcome == "agree" and self.suspect and self.rule in ("panels", "jump-free panels"):
            self.outcome = "undecided"  # a residual many σ from zero is not agreement, whatever the bound
            self.statistic += f"; {self.suspect}"

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
        words = {"agree": "agrees within its bound", "undecided": "undecided (neither agreement nor evidence of a defect)",
                 "disagree": f"disagrees ({abs(self.residual) / self.bound if self.bound > 0 else math.inf:.3g}× its bound)"}
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
    if compare.norm(step) >= 0.9 * size or not may_move or not np.all(np.isfinite(value)):
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
    random = random_unit(rng, grad.shape)
    norm = compare.norm(grad)
    if norm == 0 or not np.all(np.isfinite(grad)):
        return random
    along = grad / norm
    across = random - float(np.sum(random * along)) * along
    across_norm = compare.norm(across)
    if across_norm < 1e-8:  # one element: the gradient's own direction
        return along
    return (along + across / across_norm) / math.sqrt(2.0)


def segment_length(loss_sigma: float, critical: float, slope: float) -> float:
    """‖Δ‖ at which the loss difference's rounding takes ROUNDING_SHARE of SETTLE_RTOL: the segment's scale is
    ~2‖Δ‖·|g·d|, its rounding bound k_crit·√2·σ_L, so ‖Δ‖ = k_crit·√2·σ_L / (2·|g·d|·ROUNDING_SHARE·SETTLE_RTOL)."""
    return critical * math.sqrt(2.0) * loss_sigma / (2.0 * slope * ROUNDING_SHARE * SETTLE_RTOL) if slope > 0 else math.inf


def located_reserve(segments: dict[str, Segment], base: dict[str, np.ndarray]) -> int:
    """Calls kept for locating a disagreeing segment's error: a short stencil (±h, and a smaller step at a kink)
    and one ±h pair per halving of the tensor down to an element (log₂ of its size)."""
    wrong = [name for name, s in segments.items() if s.outcome == "disagree"]
    return max((2 * (math.ceil(math.log2(base[name].size)) + 2) for name in wrong), default=0)


def _double_panels(calls: Calls, base: dict[str, np.ndarray], segment: Segment, critical: Callable[[int], float]) -> None:
    """Twice the panels: the program at the midpoints of the segment's panels (its nodes stay exact there)."""
    name = next(iter(segment.displacement))
    midpoints = (segment.nodes[1:] + segment.nodes[:-1]) / 2
    answers = [calls("claimed", displaced({**base, name: segment.centre}, segment.displacement, float(t)))
               for t in midpoints]
    order = np.argsort(np.concatenate([segment.nodes, midpoints]))
    segment.nodes = np.concatenate([segment.nodes, midpoints])[order]
    segment.losses = np.concatenate([segment.losses, [a.loss for a in answers]])[order]
    segment.slopes = np.concatenate([segment.slopes, [dot(a.grads, segment.displacement) for a in answers]])[order]
    segment.evaluate(critical)


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
        answers = {float(t): at_base if t == 0.0 and not moved else calls("claimed", displaced(middle, displacement, float(t)))
                   for t in nodes}
        losses = np.array([answers[float(t)].loss for t in nodes])
        slopes = np.array([dot(answers[float(t)].grads, displacement) for t in nodes])
        growth = float(np.max(np.abs(losses[[0, -1]]))) / abs(at_base.loss) if at_base.loss else 1.0
        fraction = compare.norm(step) / scales[name]
        segment = Segment(f"{name} along a segment of ±{fraction:.2g}‖{name}‖ at 45° to its gradient", displacement,
                          nodes, losses, slopes, noise.loss_sigma * max(1.0, growth), noise.direction_sigma(displacement), noise.dof,
                          fraction=fraction, scale_floor=typical * 2 * compare.norm(step), centre=centre)
        if moved:
            segment.label += f" through a point {float(np.max(np.abs(centre - base[name]))):.2g} from w"
        segment.evaluate(critical)
        return segment

    def first_length(name: str) -> float:
        slope = max(abs(float(np.sum(at_base.grads[name] * units[name]))), typical)
        return segment_length(noise.loss_sigma, critical(noise.dof), slope)

    # every tensor's first segment before any refinement: the calls for the ones still to run are reserved
    segments = {name: run(name, first_length(name), panels * (len(base) - 1 - i)) for i, name in enumerate(base)}
    # an undecided segment (its panels many σ off, within the t of their few dof) gets twice the panels before any
    # scaling segment: a suspicion is decided on the tensor's own evidence first (4 panels: t = 28 at 3 dof, 7.9 at 7)
    for segment in sorted((s for s in segments.values() if s.outcome == "undecided"), key=lambda s: -abs(s.residual)):
        if len(segment.nodes) - 1 < 2 * panels and len(segment.nodes) - 1 <= calls.left:
            _double_panels(calls, base, segment, critical)
    settled = between(segments) if between is not None else set()
    tried = set()
    while True:
        if calls.left - panels < located_reserve(segments, base):
            return segments  # the calls left locate a disagreeing tensor's error (check._locate_float32_only)
        # an undecided segment (its panels many σ off, short of their few dof's t) first, shares or not: it may be a defect
        open_ones = [s for name, s in segments.items() if id(s) not in tried and panels <= calls.left
                     and (s.outcome == "undecided" or s.outcome == "agree" and s.resolution > SETTLE_RTOL
                          and name not in settled)]
        if not open_ones:
            return segments
        segment = max(open_ones, key=lambda s: (s.outcome == "undecided", s.resolution))
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
            _double_panels(calls, base, segment, critical)
            tried.discard(id(segment))
            continue
        else:
            if segment.fraction <= SEGMENT_MIN * 1.01:
                continue
            other = run(name, length / SEGMENT_SHRINK)
        if other.outcome == "disagree" or other.resolution < segment.resolution:
            segments[name] = other
