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
   best evidence's. A panels' fit many σ off but within the t of its few dof is `undecided` (never
   agreement) and gets twice the panels first; weights in front of a normalisation (g·w = 0 by symmetry)
   get no scaling segment; the default budget is `float32_only_budget` (an 8-panel segment per tensor).
4. **Localisation.** A direction that fails is restricted to halves of the tensor (rows, then
   columns, … down to single elements) to name where the gradient is wrong; a float32-only
   error is located element by element from 3. at no extra cost. Without a float64 build, a disagreeing
   segment's direction is halved with the short stencil of 2. where it resolves the error
   (`_locate_float32_only`, with calls kept from the refinement for it).

Verdicts (decided by precision_lab.decision.decide, gradcheck.decided): ``roundoff`` (the gradient
is the derivative of the loss, to a stated resolution), ``defect`` (with the tensor and the
directional evidence) and ``inconclusive`` (the noise or kinks leave the question open; the report
says what would settle it). Never a pass rate.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .. import compare, formats
from ..errors import LabInputError
from .builds import COMPARISON_LINES, PERSISTENCE_LIMIT, compare_builds, excess_limit, format_index, implied_format
from .decided import decide_check, persists
from .groups import GROUP_PANELS, Share, check_groups, group_suspects, scale_invariant
from .localise import Located, localise
from .noise import NOISE_MULTIPLIERS, NOISE_MULTIPLIERS_FLOAT32, NOISE_ULPS, Noise, measure_noise
from .points import displaced, tensor_scales, tensor_step
from .program import BudgetSpent, Calls, Oracle, default_budget, float32_only_budget, storage_dtype
from .noise import SETTLE_RTOL
from .results import GradCheck, TensorVerdict
from .segments import Segment, check_segments, located_reserve, segment_panels
from .stencils import LEVEL_FACTOR, MAX_DIRECTIONS, MAX_LEVELS, STEP_EXPONENT, Checker, Direction


def check_gradients(oracle: Oracle, base: dict[str, np.ndarray], seed: int = 0, max_calls: int | None = None,
                    progress: bool = False) -> GradCheck:
    """Is `oracle`'s gradient the derivative of its loss at `base`? See the module docstring.

    `base` holds the parameters (float64 arrays of values the claimed build can represent).
    """
    started = time.perf_counter()
    base = {name: np.asarray(value, np.float64) for name, value in base.items()}
    shapes = {name: value.shape for name, value in base.items()}
    rng = np.random.default_rng(seed)
    claimed = oracle.claimed_precision
    has_float64 = bool(oracle.has_float64) and claimed != "float64"
    float32_budget = float32_only_budget(len(base), len(NOISE_MULTIPLIERS_FLOAT32))
    budget = (max_calls if max_calls is not None else
              float32_budget if not has_float64 and claimed != "float64" else default_budget(len(base)))
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
            if max_calls is None:  # the float32-only check's own default
                calls.budget = budget = max(budget, float32_budget)
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
            points = [base] + [displaced(base, s, m) for s in whole_steps for m in (1, -1)]
            claimed_answers = [calls("claimed", p) for p in points]
            float64_answers = [at_base]
            checker_points = {}
            for s_index, s in enumerate(whole_steps):
                for m in (1, -1):
                    answer = calls("float64", displaced(base, s, m))
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
                    direction=tensor_steps[name][name] / max(compare.norm(tensor_steps[name][name]), 1e-300))
        for tensor in tensors.values():
            _judge_tensor(tensor, claimed, has_float64)
        # a failing whole-vector direction no tensor explains: find the tensor by halving it
        whole_failing = [d for d in whole if d.outcome == "disagree"]
        if whole_failing and not any(t.verdict == "defect" or persists(t.comparison) for t in tensors.values()):
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
    decision = decide_check(oracle.name, claimed, tensors, loss_comparison)
    return GradCheck(oracle.name, claimed, has_float64, decision.verdict, tensors, whole, loss_comparison, noise,
                     dict(calls.counts), budget, time.perf_counter() - started, calls.program_s, seed, notes,
                     decision=decision)


def _float32_only(oracle, calls, base, at_base, noise, scales, rng, budget, started, seed, notes) -> GradCheck:
    """No float64 build: one long segment per tensor (see Segment), the verdict at the resolution it reaches."""
    claimed = oracle.claimed_precision
    storage = np.dtype(formats.STORAGE_DTYPE[claimed]) if claimed != "float64" else np.dtype("float64")
    # first segments as within the common default budget: 4 panels settle most smooth tensors, and the float32-only
    # budget's calls beyond it double the panels only where a segment needs them (an undecided fit first)
    panels = segment_panels(calls.left - max(budget - default_budget(len(base)), 0), len(base))
    try:
        if not panels:
            raise BudgetSpent
        groups: list[Segment] = []

        def scale_groups(first: dict[str, Segment]) -> set[str]:
            # scaling segments before any refinement: the tensors behind kinks need them most; a tensor whose own
            # segment disagrees is a defect already, and the calls to locate its error are kept from them
            reserve = located_reserve(first, base)
            calls.budget -= reserve
            try:
                groups.extend(check_groups(calls, base, at_base, noise["claimed"], first, GROUP_PANELS, storage))
            finally:
                calls.budget += reserve
            return {m for g in groups if g.outcome == "agree" for m in g.parts if Share(m, g).resolution <= SETTLE_RTOL}
        segments = check_segments(calls, base, at_base, noise["claimed"], scales, rng, panels, storage,
                                  between=scale_groups)
    except BudgetSpent:
        words = f"{calls.left} calls left: too few for a segment of 4 panels per tensor (raise --max-calls)"
        tensors = {name: TensorVerdict(name, value.shape, "inconclusive", settle=words) for name, value in base.items()}
        calls.close()
        decision = decide_check(oracle.name, claimed, tensors)
        return GradCheck(oracle.name, claimed, False, decision.verdict, tensors, [], None, noise, dict(calls.counts),
                         budget, time.perf_counter() - started, calls.program_s, seed, notes + [words],
                         decision=decision)
    # kinks the segments do not resolve: the short stencil of the float64 path (h = u^(1/3)·‖w‖, kinks stepped
    # around), which crosses few of them, with the calls left
    directions: dict[str, list[Direction]] = {name: [] for name in base}
    checker = Checker(calls, "claimed", base, at_base, noise["claimed"], noise["claimed"].loss_sigma)
    step = formats.unit_roundoff(claimed) ** STEP_EXPONENT
    multipliers = [m * LEVEL_FACTOR ** -i for i in range(MAX_LEVELS) for m in (1, -1)]
    invariant = {name for name in base if scale_invariant(name, base, at_base, noise["claimed"])}
    # a scale-invariant tensor's part of a scaling segment is rounding: no share of it speaks for its gradient
    shares: dict[str, list[Share]] = {name: [Share(name, g) for g in groups if g.parts.get(name, 0.0) > 0
                                             and name not in invariant] for name in base}
    # the tensors a share settled too: a share sees the gradient only along the tensor's own values
    kinked = sorted((s for s in segments.values() if s.rule == "panels" and s.outcome in ("agree", "undecided")
                     and s.resolution > SETTLE_RTOL), key=lambda s: -s.resolution)
    reserve = located_reserve(segments, base)  # kept for locating a disagreeing tensor's error
    try:
        for segment in kinked:
            name = next(iter(segment.displacement))
            if calls.left < 2 + reserve:
                break
            direction = checker.direction(f"{name} along a random unit direction (short stencil)",
                                          {name: tensor_step(base[name], step * scales[name], storage, multipliers, rng)})
            directions[name].append(direction)
            while direction.outcome == "open" and calls.left >= 2 + reserve:
                checker.advance(direction)
    finally:
        calls.close()
    named, unexplained, either = group_suspects(groups, segments, shares)
    undecided = [group for group, _ in either]
    notes = notes + [words for _, words in either]
    tensors = {}
    for name, segment in segments.items():
        # a share sees the gradient only along the tensor's values: the gradient of its zero elements not at all
        zero = base[name] == 0
        norm = compare.norm(at_base.grads[name])
        blind = compare.norm(at_base.grads[name][zero]) / norm if norm > 0 and zero.any() else 0.0
        tensor = TensorVerdict(name, base[name].shape, segment=segment, evidence=[segment.evidence()],
                               directions=directions[name], shares=shares[name] if blind <= SETTLE_RTOL else [])
        tensor.evidence += [d.evidence() for d in directions[name]] + [x.evidence() for x in shares[name]]
        if name in invariant:
            tensor.evidence.append(
                f"{name} is scale-invariant (g·w = {float(np.sum(at_base.grads[name] * base[name])):.3g}, within its "
                f"rounding: a normalisation follows it): a segment along its own values carries no information, for a "
                f"right gradient or one wrong by any factor, so its own segment at 45° to its gradient decides")
        if blind > SETTLE_RTOL:  # whether or not a scaling segment ran: none could settle it
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
                reach = compare.norm(group.displacement[name])
                tensor.max_abs_err = abs(group.residual) / (2 * reach) if reach > 0 else math.nan
                tensor.bound_ratio = abs(group.residual) / group.bound if group.bound > 0 else math.inf
                tensor.evidence.append(words)
        elif segment.outcome == "undecided":  # its own segment many σ off: no share may call it roundoff
            tensor.verdict = "inconclusive"
            tensor.settle = (f"{segment.suspect} (--max-calls: {len(segment.nodes) - 1} panels were what the calls "
                             f"allowed)")
        elif resolution <= SETTLE_RTOL:
            tensor.verdict = "roundoff"
        else:
            tensor.verdict = "inconclusive"
            tensor.settle = (f"the {claimed} build alone resolves the gradient only to {resolution:.2g} relative "
                             f"(settled needs {SETTLE_RTOL:g}; {segment.statistic}): give the candidate a "
                             f"command_float64 (the same program in double precision), or more calls (--max-calls)")
        tensors[name] = tensor
    _locate_float32_only(calls, checker, tensors, segments, base, scales, storage, step, multipliers, rng)
    for name in {m for group in undecided for m in group}:
        if tensors[name].verdict != "defect":
            tensors[name].verdict = "inconclusive"
            words = next(w for g, w in either if name in g)
            tensors[name].evidence.append(words)
            tensors[name].settle = f"{words}: more calls (--max-calls) for a segment that tells them apart"
    failing = unexplained + [f"one of {' or '.join(group)}" for group in undecided]
    decision = decide_check(oracle.name, claimed, tensors, failing_groups=failing)
    return GradCheck(oracle.name, claimed, False, decision.verdict, tensors, [], None, noise, dict(calls.counts),
                     budget, time.perf_counter() - started, calls.program_s, seed, notes + unexplained, undecided,
                     decision=decision)


def _locate_float32_only(calls, checker, tensors, segments, base, scales, storage, step, multipliers, rng) -> None:
    """A float32-only defect located below the tensor where the check's own evidence allows: the short stencil
    (h = u^(1/3)·‖w‖) along the disagreeing segment's direction resolves g·d to ~u^(2/3)·cond (1e-4 – 1e-2), so an
    error above that is halved down to its region (`localise`); one below it, or one without calls, is not."""
    try:
        for tensor in (t for t in tensors.values() if t.verdict == "defect" and not t.located):
            segment = segments[tensor.name]
            if segment.outcome != "disagree":
                tensor.evidence.append("not located below the tensor: its disagreement is a scaling segment's, along "
                                       "its values, which every element shares in proportion to itself")
                continue
            if calls.left < 2:
                tensor.evidence.append("not located below the tensor: no calls left for short stencils (--max-calls)")
                continue
            unit = segment.displacement[tensor.name] / max(compare.norm(segment.displacement[tensor.name]), 1e-300)
            direction = checker.direction(f"{tensor.name} along its disagreeing segment (short stencil)",
                                          {tensor.name: tensor_step(base[tensor.name], step * scales[tensor.name], storage,
                                                                    multipliers, rng, unit=unit)})
            while direction.outcome == "open" and calls.left >= 2:
                checker.advance(direction)
            tensor.directions.append(direction)
            tensor.evidence.append(direction.evidence())
            if direction.outcome != "disagree":
                tensor.evidence.append(f"not located below the tensor: the short stencil along the segment's direction "
                                       f"does not resolve its error ({direction.outcome})")
                continue
            tensor.located = localise(checker, direction, {n: v.shape for n, v in base.items()})
            tensor.evidence += [f"located: {x.region} ({x.note})" for x in tensor.located]
    finally:
        calls.close()


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
    decision = decide_check(oracle.name, oracle.claimed_precision, tensors)
    return GradCheck(oracle.name, oracle.claimed_precision, bool(oracle.has_float64), decision.verdict, tensors, [],
                     None, noise, dict(calls.counts), budget, time.perf_counter() - started, calls.program_s, seed,
                     [words], decision=decision)


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
    if persists(comparison):  # the evidence; decision.decide makes it a defect (decided.decide_check)
        worst = comparison.worst[0]
        tensor.evidence.append(
            f"the {claimed} build's gradient differs from the float64 build's at every one of {comparison.points} nearby "
            f"points: {comparison.flagged} of {comparison.size} elements beyond {PERSISTENCE_LIMIT:g}× their rounding "
            f"spread, worst {tensor.name}{format_index(tuple(worst['index']))} by {worst['error']:.3g} "
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
