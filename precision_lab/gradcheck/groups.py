"""Homogeneous groups: a layer's tensors scaled together, so no ReLU or max-pool crosses a kink along the segment."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from .. import formats
from .noise import ALPHA, SETTLE_RTOL, Noise, t_critical
from .points import displaced, dot
from .program import Calls, Evaluation
from .segments import ROUNDING_SHARE, Segment

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


def scale_invariant(name: str, base: dict[str, np.ndarray], at_base: Evaluation, noise: Noise) -> bool:
    """A tensor whose gradient is orthogonal to its values: g·w within k_crit of its rounding σ (√Σ w²σ_g², Student t
    on the noise's dof) or below SETTLE_RTOL of Σ|g_i·w_i|, although w ≠ 0. Weights in front of a normalisation (a bias-free conv before BatchNorm,
    GroupNorm, LayerNorm) are scale-invariant, L(s·w) = L(w), so g·w = 0 by symmetry for the right gradient and for
    one wrong by any factor alike: a segment along w sees no scale error. Its own segment, at 45° to g, decides."""
    value = base[name]
    if not np.any(value):
        return False
    terms = at_base.grads[name] * value
    along = abs(float(np.sum(terms)))
    # within its rounding, or cancelled below SETTLE_RTOL of its terms Σ|g_i·w_i| (an error of 1e-4 per element could
    # flip it: measured 8e-8 and 1.8e-6 for bias-free convs before a GroupNorm, ≥ 3e-3 for every other tensor tried)
    return (along <= t_critical(ALPHA, noise.dof) * noise.direction_sigma({name: value})
            or along <= SETTLE_RTOL * float(np.sum(np.abs(terms))))


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
    # every scaling segment goes through one point: each tensor any of them may move, at its centre; a disagreeing
    # group's members are told apart by their own groups (below), which may move a tensor no open name's group holds
    scaled = {m for n in open_names for g in homogeneous_groups(shapes, n) for k in g
              for other in homogeneous_groups(shapes, k) for m in other}
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
        return {0.0: at_middle[0], **{t: calls("claimed", displaced(middle, displacement, t)) for t in (-1.0, 1.0)}}

    def too_curved(group: tuple[str, ...], reach: float, known: dict[float, Evaluation]) -> bool:
        """Would the loss's curvature along this reach leave the largest part unsettled on `panels` panels? The
        trapezoid on 1 and 2 panels differ by 3× the 2-panel error, which shrinks ~(panels/2)² (de Boor's h²) by
        `panels`; against the (1 − ROUNDING_SHARE) of SETTLE_RTOL of the largest part that is left to quadrature."""
        displacement = {m: scaling_step(base[m], reach, storage)[1] for m in group}
        f = {t: dot(a.grads, displacement) for t, a in known.items()}
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
        answers = [known[float(t)] if float(t) in known else calls("claimed", displaced(middle, displacement, float(t)))
                   for t in nodes]
        losses = np.array([a.loss for a in answers])
        growth = float(np.max(np.abs(losses[[0, -1]]))) / abs(at_base.loss) if at_base.loss else 1.0
        step_norm = math.sqrt(sum(float(np.sum(d * d)) for d in displacement.values()))
        slopes = np.array([dot(a.grads, displacement) for a in answers])
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
    invariant = {m for m in base if scale_invariant(m, base, at_base, noise)}
    for name in open_names:
        if any(name in s.displacement and not kinked(s) for s in done) or name in invariant:
            continue  # a scale-invariant tensor's part of any scaling segment is 0 by symmetry: its own segment decides
        for group in homogeneous_groups(shapes, name):
            if group in tried or calls.left < panels + (0 if at_middle else 1):
                continue
            tried.add(group)
            if not any(np.any(at_base.grads[m] * base[m]) and m not in invariant for m in group):
                continue  # no member has a part along its values (all zero, or invariant under scaling): nothing to see
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


def group_suspects(groups: list[Segment], segments: dict[str, Segment], shares: dict[str, list[Share]]
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
