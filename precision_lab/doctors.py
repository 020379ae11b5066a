"""The doctors: what explains a quantity beyond its bound (docs/design.md, "Explaining a verdict").

Each reads the verdicts so far (the comparisons of precision_lab.compare with the findings before it
applied, a copy) and the float64 reference, and returns `Finding`s (precision_lab.findings): what it
found about which quantity, with the numbers. None edits a judgement; `verdict.decide_problem` makes
the verdict from the comparisons and every finding, by precedence.

* `layouts` — the layout doctor, by buffer: a gradient read as the candidate wrote it (its
  declared layout's shape, C or F order) is tried in every layout it could hold, with every flip
  of H and W; the fix is named in words a Fortran or CUDA programmer can apply.
* `precision` — a coarser format: beyond the claimed bound, the format whose emulated error level
  matches the forward output's; inside it, the precision fingerprint: the correlation of the
  candidate's error with each format's emulated error, per quantity and pass, against the same
  correlation of legitimate float32 orders (the measured null).
* `zero_gradients` — a parameter gradient identically zero where the reference is not: the layer
  received no gradient (left off the tape, not marked trainable), named before any bound is read;
* `defects` — named hypotheses recomputed in float64 and tested against the bound: a constant
  factor, a flatten in (H, W, C) order where the spec flattens (C, H, W), one sample of the batch
  only, a one-pixel shift, a missing activation mask, a pre-activation used for a post-activation, another layer's mask or gradient, stale weights, a
  missing image row, column or tile. The overall cause is a hypothesis that explains every failing
  quantity, never the one that explains most: otherwise the cause is unknown.
* `localise` — with intermediates in the response, each op re-run in float64 on the candidate's
  own inputs against its local bound, the first that fails named; else the earliest failing
  quantity in backprop order.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from . import errmodel, formats
from .compare import ComparisonError, quantity_arrays
from .compute import GradBuffer, Result, Trace, forward_backward, layer_params
from .findings import Finding
from .layout import canonical_for, from_layout, layout_for, shape_in_layout
from .ops import OPS, BackwardReplaced, BoundContext, Field, GradField, Kernels

#: formats a result may fall back to, finest first (float32 counts for a float64 claim)
FALLBACK_FORMATS = ("float32", "tf32", "float16", "bfloat16")

#: a format names the errors when its emulated output error is within this factor of the
#: candidate's: √32, the geometric midpoint between tf32's u = 2⁻¹¹ and bf16's u = 2⁻⁸
FORMAT_MATCH_FACTOR = math.sqrt(32.0)
#: two formats that both match in level are told apart by pattern only when their correlations differ by
#: more than this: a correlation over n elements has a standard error ≤ 1/√n, under 0.02 for n ≥ 2500 (an output
#: of the smallest probe), so 0.05 is a real difference, not sampling noise
PATTERN_MARGIN = 0.05
#: a format matched by level names the errors only if they also correlate with what its emulation adds, either way,
#: at least this much (|r|). Measured (seeds 1–2, the seed CNN, small U-Net, dilated resnet and LeNet classifier):
#: PyTorch's CPU autocast to bfloat16, which also stores activations in bfloat16, 0.28 – 0.93; the emulations 1.00;
#: a leaky ReLU's slope changed from 0.1 to 0.2, at bfloat16's level by chance, 0.00. Either way: a format whose
#: algorithms round other values than the emulation does (cuDNN's own TF32 has not been measured against the
#: IEEE-pinned emulation yet) may correlate negatively. An unrelated error's correlation over n ≥ 2500 elements has
#: a standard error ≤ 0.02: 0.1 is five of them
FORMAT_PATTERN_MIN = 0.1

#: below this many elements a single exceedance cannot be told from a broad precision loss
MIN_ELEMENTS_FOR_OUTLIER_TEST = 8

#: the precision fingerprint and the recomputing hypotheses run when a problem has at most this many
#: image elements (batch·H·W) on a CPU, about 0.3 s per float32 forward + backward of the seed network
#: on 2 cores (a GPU runs them at any size); above it the diagnosis's probes carry them
RECOMPUTE_LIMIT = 2 * 256 * 256

#: the fingerprint names a format when the candidate's error correlates with the format's own emulated
#: error (emulated − plain float32, so only what the format adds) at least this much: r² ≥ 0.9, nine tenths
#: of the error explained. Measured: legitimate float32 orders reach 0.82 (FFT convolution, conv3.weight, whose
#: errors are propagated forward errors along a few directions), TF32 candidates with another accumulation order
#: ≥ 0.96 at 24²–61²; over the probes' problems (benchmarks/sensitivity.py --parts false-alarms, 14 legitimate
#: orders × 3 probes × 100 seeds, docs/verdicts.md) the closest any came to this threshold was 0.096 below ...
FINGERPRINT_MIN = 0.95
#: ... and beyond the largest correlation of a measured legitimate float32 order plus FINGERPRINT_Z standard
#: errors of a correlation of m independent pairs (1/√m): five, a one-in-3-million chance under the null
FINGERPRINT_Z = 5.0
#: correlations need this many elements to mean anything
FINGERPRINT_MIN_ELEMENTS = 16

#: passes an emulated format may act in (docs/design.md, "Explaining a verdict")
PASSES = ("all", "forward", "input_grad", "weight_grad")


def _recompute_allowed(reference: Trace, requested: bool | None) -> bool:
    if requested is not None:
        return requested
    problem = reference.problem
    return reference.device.type == "cuda" or problem.batch * problem.height * problem.width <= RECOMPUTE_LIMIT


# ---------------------------------------------------------------------------------------------
# the layout doctor, by buffer


def transforms(ndim: int) -> list[tuple[str, tuple[str, ...]]]:
    """Every (layout a buffer may hold, flipped axes) for a weight of `ndim` dimensions."""
    canonical = canonical_for(ndim)
    flips = [(), ("H",), ("W",), ("H", "W")] if ndim == 4 else [()]
    return [("".join(p), f) for p in itertools.permutations(canonical) for f in flips]


def transform_parts(held: str, declared: str, flipped: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(('layout', 'IOHW'), ('flip', 'HW')): what a transform does, step by step (the layout only when it differs)."""
    return ((("layout", held),) if held != declared else ()) + ((("flip", "".join(flipped)),) if flipped else ())


def transform_name(held: str, declared: str, flipped: tuple[str, ...]) -> str:
    """'layout OHWI', 'flip HW', 'layout IOHW + flip HW' (the layout named only when it differs)."""
    return " + ".join(f"{kind} {value}" for kind, value in transform_parts(held, declared, flipped))


def buffer_of(result: Result, name: str, got: np.ndarray) -> GradBuffer:
    """The gradient as written: the bundle's buffer when it came through one, else the canonical array."""
    if name in result.buffers:
        return result.buffers[name]
    return GradBuffer(np.ascontiguousarray(got).ravel(), canonical_for(got.ndim), "C")


def read_buffer(buffer: GradBuffer, canonical_shape, held: str, flipped: tuple[str, ...]) -> np.ndarray:
    """The buffer read as holding `held` (in the candidate's own index order), back to canonical, unflipped."""
    c_layout = held if buffer.order == "C" else held[::-1]  # Fortran order is C order of the reversed axes
    array = buffer.flat.reshape(shape_in_layout(canonical_shape, c_layout))
    canonical = from_layout(array, c_layout)
    axes = tuple(canonical_for(len(canonical_shape)).index(a) for a in flipped)
    return np.flip(canonical, axis=axes) if axes else canonical


def layout_fits(buffer: GradBuffer, ref: np.ndarray, bound: np.ndarray) -> list[tuple[str, tuple[str, ...]]]:
    """Transforms that bring the buffer within `bound` of `ref`, simplest first (the declared reading excluded)."""
    declared = layout_for(ref.ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
    candidates = [(held, flipped) for held, flipped in transforms(ref.ndim) if (held, flipped) != (declared, ())]
    candidates.sort(key=lambda c: (sum(a != b for a, b in zip(c[0], declared)) + len(c[1]), c))
    fits = []
    for held, flipped in candidates:
        fixed = read_buffer(buffer, ref.shape, held, flipped)
        if float(np.max(np.abs(fixed - ref) / bound)) <= 1.0:
            fits.append((held, flipped))
    return fits


def layout_advice(name: str, buffer: GradBuffer, held: str, flipped: tuple[str, ...], ndim: int,
                  also: tuple[str, ...] = ()) -> str:
    """The fix in words: what the buffer holds, and how to convert it before writing.

    Only the conversion is offered: re-declaring weight_layout would also change the layout the
    request's weights arrive in, so it is not the same program with the bug fixed. `also` names the
    other gradients the same fix applies to.
    """
    declared = layout_for(ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
    order = "Fortran (column-major) order" if buffer.order == "F" else "C (row-major) order"
    names = [name, *also]
    it = "it" if len(names) == 1 else "each"
    steps = []
    if held != declared:
        permutation = tuple(held.index(c) for c in declared)
        steps.append(f"{it} holds {held} but is declared {declared} ({order}): transpose {it} to {declared} before "
                     f"writing (numpy: g.transpose{permutation})")
    if flipped:
        axes = " and ".join(flipped)
        steps.append(f"{it} is reversed along {axes}: flip {axes} before writing (a convolution where cuDNN and "
                     f"PyTorch compute a cross-correlation, or a flip in the conversion)")
    return ", ".join(f"{n}.grad" for n in names) + ": " + "; ".join(steps)


def layouts(quantities, result: Result, reference: Trace, pairs, bounds) -> list[Finding]:
    """Name the layout of every weight gradient beyond its bound that some transform fixes, and the fix in words."""
    found, findings = {}, []  # name → (buffer, fits, ndim)
    for name, q in quantities.items():
        if q.verdict != "defect" or not math.isfinite(q.bound_ratio) or not name.endswith(".weight"):
            continue
        got, ref = pairs[name]
        if ref.ndim not in (2, 4):
            continue
        buffer = buffer_of(result, name, got)
        fits = layout_fits(buffer, ref, bounds[name].bound)
        if not fits:
            continue
        declared = layout_for(ref.ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
        names = [transform_name(held, declared, flipped) for held, flipped in fits]
        parts = {n: transform_parts(held, declared, flipped) for n, (held, flipped) in zip(names, fits)}
        findings.append(Finding("layout", name, "layout", names[0], f"matches within the bound after: {', '.join(names[:4])}",
                                {"options": names, "parts": parts}))
        found[name] = (buffer, fits, ref.ndim)
    if found:
        # one fix for every slipped buffer: the first transform all of them admit (verdict.overall names the
        # same), told for the buffer it fits most plainly (one input channel makes OHWI and OHIW the same bytes)
        first = next(iter(found.values()))[1]
        common = [fit for fit in first if all(fit in fits for _, fits, _ in found.values())] or first[:1]
        name = min((n for n in found if common[0] in found[n][1]), key=lambda n: len(found[n][1]))
        buffer, _, ndim = found[name]
        applies = [n for n in found if common[0] in found[n][1]]  # every buffer the fix applies to, in network order
        findings.append(Finding("layout-advice", name=layout_advice(applies[0], buffer, common[0][0], common[0][1],
                                                                      ndim, tuple(applies[1:]))))
    return findings


# ---------------------------------------------------------------------------------------------
# reduced precision: the format's bound plus its error level, and the fingerprint


def emulate(reference: Trace, precision: str, passes: str = "all") -> Result:
    """The reference's problem computed in float32 with sum operands rounded to `precision` in `passes`."""
    cache = reference.meta.setdefault("emulations", {})
    key = (precision, passes)
    if key not in cache:
        if precision == "float32":
            kernels = Kernels()
        else:
            chosen = Kernels.PASSES if passes == "all" else (passes,)
            kernels = Kernels(round_operands=lambda a: formats.round_to(a, precision), rounded_passes=chosen,
                              name=f"{precision}-emulated")
        cache[key] = forward_backward(reference.problem, "float32", reference.device, kernels=kernels)
    return cache[key]


def _rms_error(got, ref) -> float:
    return float(np.sqrt(np.mean((np.asarray(got, np.float64) - ref) ** 2)))


def fallbacks(claimed: str) -> list[str]:
    u = formats.unit_roundoff(claimed)
    return [f for f in FALLBACK_FORMATS if formats.unit_roundoff(f) > u]


def name_format(pairs, reference: Trace, claimed: str, witnesses: list[str]) -> tuple[str | None, str, list[dict]]:
    """The coarser format whose emulated error level matches the result's, with the evidence line.

    The witness is the forward output when the result has one (a format acts there too),
    else the gradients beyond the claimed bound (median of their error-level ratios). Formats
    that match in level (TF32 and float16 share a 10-bit significand) are told apart by the
    pattern: the correlation of the result's error with what each format adds to float32's.
    """
    witness = ["output"] if "output" in pairs else witnesses
    plain = quantity_arrays(emulate(reference, "float32"), reference)
    matching, levels, unlike, rows = [], [], [], []
    for fmt in fallbacks(claimed):
        emulated = quantity_arrays(emulate(reference, fmt), reference)
        ratios = [_rms_error(*pairs[w]) / max(_rms_error(*emulated[w]), np.finfo(float).tiny) for w in witness]
        level = float(np.median(ratios))
        # the pattern reads the gradients too: float16's narrow range shows there first (tiny gradients)
        shown = list(dict.fromkeys(witness + [w for w in witnesses if w in pairs]))
        error = np.concatenate([(pairs[w][0] - pairs[w][1]).ravel() for w in shown])
        added = np.concatenate([(emulated[w][0] - plain[w][0]).ravel() for w in shown])
        r = _correlation(error, added)
        levels.append(f"{fmt} {level:.3g}× (pattern r = {r:.2f})")
        distance = abs(math.log(level)) if level > 0 else math.inf
        at_level, alike = distance <= math.log(FORMAT_MATCH_FACTOR), abs(r) >= FORMAT_PATTERN_MIN
        rows.append({"format": fmt, "level": level, "correlation": r, "level_matches": at_level,
                     "pattern_matches": alike})
        if at_level:
            # a format rounds where its emulation does: its level without its pattern is a coincidence
            (matching if alike else unlike).append((fmt, distance, r))
    text = f"error level of {'/'.join(witness)} ÷ emulated format: " + ", ".join(levels)
    if not matching:
        if unlike:
            return None, text + (f" ({' and '.join(m[0] for m in unlike)} at the level, not the pattern: "
                                 f"|r| < {FORMAT_PATTERN_MIN:g}; no format explains these errors)"), rows
        return None, text + " (no format within a factor √32)", rows
    top = max(matching, key=lambda m: m[2])
    alike = sorted((m for m in matching if top[2] - m[2] < PATTERN_MARGIN), key=lambda m: FALLBACK_FORMATS.index(m[0]))
    if len(alike) > 1:
        # the same rounding of the same operands: the first in FALLBACK_FORMATS (tf32, the silent GPU default) names it
        return alike[0][0], text + (f" ({' and '.join(m[0] for m in alike)} round these operands alike: none of the "
                                    f"values leaves their common range, so the pattern cannot tell them apart)"), rows
    return top[0], text, rows


def _is_isolated(q) -> bool:
    """One element beyond the bound, standing a format step (FORMAT_MATCH_FACTOR) above the next:
    a coarser format raises every element's error together, so it cannot make such an outlier."""
    if q.exceeding != 1 or q.size < MIN_ELEMENTS_FOR_OUTLIER_TEST:
        return False
    return q.bound_ratio > FORMAT_MATCH_FACTOR * q.second_ratio


def precision(quantities, claimed: str, result: Result, reference: Trace, pairs, bounds,
              fingerprint: bool | None = None) -> list[Finding]:
    """Name a coarser format for excesses a format explains (its level + its bound), then look for a fingerprint
    inside the bound.

    A single element far above all others (`_is_isolated`) is no witness of a format — a precision mode acts on
    every element — but once the output shows a format, it is excused when that format's bound holds it (a
    ReLU the format flipped moves one channel's sum alone)."""
    findings = []
    beyond = [n for n, q in quantities.items() if q.verdict == "defect" and math.isfinite(q.bound_ratio)]
    isolated = [n for n in beyond if _is_isolated(quantities[n])]
    for name in isolated:
        q = quantities[name]
        findings.append(Finding("isolated", name, evidence=f"a single element of {q.size} is beyond the bound "
                                f"(error ÷ bound {q.bound_ratio:.3g}), a format step above all others: a precision "
                                "mode acts on every element", numbers={"ratio": q.bound_ratio,
                                                                       "second_ratio": q.second_ratio}))
    broad = [n for n in beyond if n not in isolated]
    named = {}
    if broad and fallbacks(claimed):
        if "output" in quantities and quantities["output"].verdict == "roundoff":
            findings.append(Finding("note", evidence="the forward output is within the claimed bound: no coarser "
                                                     "format acts here"))
        else:
            fmt, level_text, levels = name_format(pairs, reference, claimed, broad)
            findings.append(Finding("format-levels", name=fmt, evidence=level_text, numbers={"levels": levels}))
            if fmt is not None:
                fmt_bounds = errmodel.error_bounds(reference, fmt)
                output_shows = "output" in quantities and "output" in broad
                for name in broad + (isolated if output_shows else []):
                    got, ref = pairs[name]
                    ratio = float(np.max(np.abs(got - ref) / fmt_bounds[name].bound))
                    if ratio <= 1.0:
                        named[name] = fmt
                        findings.append(Finding("format-level", name, "reduced-precision", fmt,
                                                f"within the {fmt} bound (error ÷ bound {ratio:.3g})",
                                                {"format_bound_ratio": ratio}))
                    else:
                        findings.append(Finding("beyond-format", name, name=fmt,
                                                evidence=f"beyond even the {fmt} bound (error ÷ bound {ratio:.3g})",
                                                numbers={"format_bound_ratio": ratio}))
    if fallbacks(claimed) and _recompute_allowed(reference, fingerprint):
        open_quantities = {n: q for n, q in quantities.items() if n not in named}
        findings += _fingerprint(open_quantities, claimed, pairs, reference)
    elif fallbacks(claimed):
        findings.append(Finding("note", evidence=f"precision fingerprint not computed at "
                                f"{reference.problem.size_text}, batch {reference.problem.batch} on "
                                f"{reference.device.type} (the probes carry it)"))
    return findings


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel() - a.mean(), b.ravel() - b.mean()
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norm) if norm > 0 else 0.0


def _null_members(reference: Trace) -> dict[str, Result]:
    """Legitimate float32 orders for the null: the layered native kernels, and micro-batches of one sample."""
    cache = reference.meta.setdefault("null_members", {})
    if not cache:
        problem = reference.problem
        cache["layered-native"] = emulate(reference, "float32")
        parts = [forward_backward(problem.with_batch(b, b + 1), "float32", reference.device)
                 for b in range(problem.batch)]
        cache["micro-batched"] = _combine_micro_batches(parts, problem)
    return cache


def _combine_micro_batches(parts: list[Result], problem) -> Result:
    """Per-sample results as one batch's: each loss is a mean over its own positions, averaged over samples."""
    weights = np.full(len(parts), 1.0 / len(parts), np.float32)
    grads = {name: sum(np.float32(w) * p.grads[name] for w, p in zip(weights, parts)).astype(np.float32)
             for name in parts[0].grads}
    loss = float(np.sum(np.array([p.loss for p in parts], np.float32) * weights))
    return Result(loss, grads, np.concatenate([p.output for p in parts]), "float32", {"conv": "micro-batched"})


def _fingerprint(quantities, claimed: str, pairs, reference: Trace) -> list[Finding]:
    """Correlate the candidate's error with emulated coarser formats per quantity and pass, against the null.
    `quantities`: those no format's level has named yet."""
    members = dict(_null_members(reference))
    if claimed in formats.REDUCED_FORMATS:
        # a reduced-format claim: its own emulation is a legitimate order too, and shares what that format does
        # with a coarser one (a ReLU both flip; measured: tf32-claimed read as bf16 at r = 0.961, 33×47, seed 36)
        members[f"{claimed}-emulated"] = emulate(reference, claimed)
    nulls = {name: quantity_arrays(member, reference) for name, member in members.items()}
    plain = quantity_arrays(emulate(reference, "float32"), reference)
    named, table = {}, []
    for fmt in [f for f in fallbacks(claimed) if f in ("tf32", "bfloat16")]:
        for passes in PASSES:
            emulated = quantity_arrays(emulate(reference, fmt, passes), reference)
            for name, (got, ref) in pairs.items():
                if ref.size < FINGERPRINT_MIN_ELEMENTS or name == "loss":
                    continue
                direction = emulated[name][0] - plain[name][0]  # what the format adds, not float32's own error
                if not np.any(direction):
                    continue
                r = _correlation(got - ref, direction)
                null = max(abs(_correlation(members[name][0] - ref, direction)) for members in nulls.values())
                threshold = max(FINGERPRINT_MIN, null + FINGERPRINT_Z / math.sqrt(ref.size))
                # a format reproduces its own error level as well as its pattern: a pattern at another level is not it
                level = _rms_error(got, ref) / max(_rms_error(emulated[name][0], ref), np.finfo(float).tiny)
                at_level = level > 0 and abs(math.log(level)) <= math.log(FORMAT_MATCH_FACTOR)
                row = {"format": fmt, "pass": passes, "quantity": name, "correlation": r, "null": null,
                       "threshold": threshold, "level": level, "conclusive": r >= threshold and at_level}
                table.append(row)
                if row["conclusive"] and (name not in named or r > named[name]["correlation"]):
                    named[name] = row
    findings = [Finding("fingerprint-table", numbers={"rows": table})]
    for name, row in named.items():
        q = quantities.get(name)
        if q is not None and q.verdict in ("roundoff", "defect") and not q.layout_fix:
            inside = q.verdict == "roundoff"
            where = f"inside the {claimed} bound (error ÷ bound {q.bound_ratio:.3g})" if inside \
                else f"error ÷ bound {q.bound_ratio:.3g}"
            findings.append(Finding("fingerprint", name, "reduced-precision", row["format"],
                                    f"{where}, but the error correlates r = {row['correlation']:.3f} with emulated "
                                    f"{row['format']} ({row['pass'].replace('_', '-')} pass) at {row['level']:.3g}× its "
                                    f"error level; legitimate float32 orders reach {row['null']:.3f}", dict(row)))
    named = {name: row for name, row in named.items()
             if any(f.quantity == name and f.doctor == "fingerprint" for f in findings)}
    return findings + _excuse_by_named_format(quantities, pairs, reference, named)


def _excuse_by_named_format(quantities, pairs, reference: Trace, named: dict) -> list[Finding]:
    """Once the fingerprint names one format on some quantities, a quantity beyond the claimed bound that is too
    small to carry a fingerprint of its own (a 1×1 head's 24 weights) is `reduced-precision` when that format's
    bound holds it: a precision mode acts on every element of its pass, as `precision` excuses what the output's
    format holds. Two formats named leave it a defect (which one would excuse it is not known), and so does a
    format named in a pass that includes the forward while the output is within the claimed bound (a coarser
    forward would show there)."""
    shown = {row["format"] for row in named.values()}
    output = quantities.get("output")
    forward_clean = output is not None and output.verdict == "roundoff"
    if len(shown) != 1 or (forward_clean and any(row["pass"] in ("all", "forward") for row in named.values())):
        return []
    fmt, witnesses = shown.pop(), ", ".join(named)
    findings = []
    for name, q in quantities.items():
        if q.verdict != "defect" or q.layout_fix or not math.isfinite(q.bound_ratio) or name not in pairs or name in named:
            continue
        got, ref = pairs[name]
        ratio = float(np.max(np.abs(got - ref) / errmodel.error_bounds(reference, fmt)[name].bound))  # cached per trace
        if ratio <= 1.0:
            findings.append(Finding("format-excuse", name, "reduced-precision", fmt,
                                    f"error ÷ bound {q.bound_ratio:.3g}, within the {fmt} bound (error ÷ bound "
                                    f"{ratio:.3g}) of the format the fingerprint names on {witnesses}",
                                    {"format_bound_ratio": ratio}))
    return findings


# ---------------------------------------------------------------------------------------------
# the defect doctor: named hypotheses recomputed in float64


#: a local hypothesis is computed from the reference's float32-stored intermediates: it may differ
#: from its exact float64 value by 2u₃₂ of S per operand, added to the bound it is tested against
STORED_SLACK = 2 * formats.UNIT_ROUNDOFF["float32"]


#: aligned tiles tried per tile size at most: 64 float64 weight-gradient convolutions take 0.7 s at a probe's size
#: (61×67, batch 2, conv2; measured on 2 shared cores), only for a failing layer; larger images keep the corner tiles
MAX_TILE_POSITIONS = 64


#: share of each element's discrepancy a fitting hypothesis may leave unexplained: the reference's bound does not
#: cover the hypothesised computation's own rounding (a missing ReLU mask sends gradients down paths the correct
#: network's sums never take), so a residual of 1% of what the hypothesis explains is allowed beside the bound
UNEXPLAINED_SHARE = 0.01


def _fit_ratio(got, expected, bound, abs_sum=None, reference=None) -> float:
    slack = 0.0 if abs_sum is None else STORED_SLACK * np.asarray(abs_sum)
    if reference is not None:
        slack = slack + UNEXPLAINED_SHARE * np.abs(got - reference)
    return float(np.max(np.abs(got - expected) / (bound + slack)))


def defects(quantities, result: Result, reference: Trace, pairs, bounds) -> list[Finding]:
    """Test named hypotheses against every quantity still a defect; name the one that fits."""
    failing = [n for n, q in quantities.items() if q.verdict == "defect" and math.isfinite(q.bound_ratio)]
    if not failing:
        return []
    tested, findings, fitted = [], [], {}
    for order, (hypothesis, expected, covers, local, *own) in enumerate(
            _hypotheses(reference, pairs, failing, _recompute_allowed(reference, None))):
        reorders = own[0] if own else {}  # a hypothesis that reorders elements reads their bounds reordered
        fits = {}
        for name in covers:
            if name not in failing or name not in expected:
                continue
            got = pairs[name][0]
            bound = bounds[name].bound[reorders[name]] if name in reorders else bounds[name].bound
            ratio = _fit_ratio(got, expected[name], bound, bounds[name].abs_sum if local else None, pairs[name][1])
            fits[name] = ratio
        if not fits:
            continue
        explained = sorted(n for n, r in fits.items() if r <= 1.0)
        tested.append({"hypothesis": str(hypothesis), "explains": explained,
                       "best_ratio": min(fits.values()), "quantities": len(fits)})
        for name in explained:
            layers = (hypothesis.layer,) if isinstance(hypothesis, Slip) else ()
            findings.append(Finding("hypothesis", name, name=str(hypothesis),
                                    evidence=f"fits '{hypothesis}' (error ÷ bound {fits[name]:.3g} against it)",
                                    numbers={"ratio": fits[name], "order": order, "layers": layers,
                                             "slip": getattr(hypothesis, "slip", str(hypothesis))}))
            fitted.setdefault(name, findings[-1])
    findings.append(Finding("hypotheses", numbers={"tested": tested}))
    # the cause of the whole problem: what every defect quantity's first fitting hypothesis says, read from the
    # findings above and the zero-gradient doctor's (a quantity's own cause), never from words
    defective = [n for n, q in quantities.items() if q.verdict == "defect"]
    own = {n: quantities[n].cause for n in defective if quantities[n].cause}
    causes = [own.get(n) or (fitted[n].name if n in fitted else None) for n in defective]
    unexplained = [n for n in failing if n not in fitted and n not in own]
    if tested:
        best = max(tested, key=lambda t: (len(t["explains"]), -t["best_ratio"]))
        shared = _one_slip_in_every_layer([(fitted[n].numbers["layers"], fitted[n].numbers["slip"]) if n in fitted
                                           else (None, own.get(n)) for n in defective])
        if len(set(causes)) == 1 and None not in causes:
            findings.append(Finding("cause", name=causes[0]))  # one cause (first fitted, or zero gradients) for all
        elif shared:
            findings.append(Finding("cause", name=shared))
        elif best["explains"] and set(defective) <= set(best["explains"]):
            findings.append(Finding("cause", name=best["hypothesis"],
                                    evidence=f"defect doctor: '{best['hypothesis']}' fits {', '.join(best['explains'])}"))
        elif best["explains"]:
            # one tensor of several is no cause: name it as a partial fit only
            findings.append(Finding("note", evidence=f"defect doctor: cause unknown; '{best['hypothesis']}' fits "
                                                     f"only {', '.join(best['explains'])} of {', '.join(defective)}"))
    if unexplained:
        findings.append(Finding("note", evidence=f"defect doctor: no named hypothesis fits {', '.join(unexplained)} "
                                                 f"({len(tested)} tested)"))
    return findings


def _one_slip_in_every_layer(fits) -> str | None:
    """'conv1, conv2: <slip>' when the failing quantities' fits (layers, slip), in network order, are the same
    layer-local slip in several layers: one cause, the same mistake made wherever that code runs."""
    if any(not layers or slip is None for layers, slip in fits) or len({slip for _, slip in fits}) != 1:
        return None
    named = list(dict.fromkeys(layer for layers, _ in fits for layer in layers))
    return f"{', '.join(named)}: {fits[0][1]}" if len(named) > 1 else None


def zero_gradients(quantities, pairs) -> list[Finding]:
    """A parameter gradient that is exactly zero in every element where the reference has non-zero ones.

    Rounding makes an exact zero only by an exact cancellation; every element of a tensor at once is a
    gradient never computed (a layer off the tape, frozen, or its buffer never written), whatever the bound."""
    layers = {}
    for name in quantities:
        if name in ("loss", "output") or name not in pairs:
            continue
        got, ref = pairs[name]
        if ref.size >= 2 and np.count_nonzero(ref) >= 2 and not np.any(got):
            layers.setdefault(name.rsplit(".", 1)[0], []).append(name)
    findings = []
    for layer, names in layers.items():
        cause = (f"{layer} received no gradient ({', '.join(names)} all zero): is it on the tape / marked "
                 f"trainable?")
        findings += [Finding("zero-gradient", name, "defect", cause, "every element exactly zero, the reference's "
                             "are not", {"nonzero_in_reference": int(np.count_nonzero(pairs[name][1]))})
                     for name in names]
    return findings


def _hypotheses(reference: Trace, pairs, failing: list[str], recompute: bool):
    """(name, expected arrays by quantity, quantities covered, computed from stored values) per hypothesis."""
    yield from _constant_factors(pairs, failing, reference)
    yield from _other_parameters(pairs, failing)
    if recompute:
        yield from _flatten_order(reference)
        yield from _local_weight_hypotheses(reference, failing)
        yield from _one_sample(reference, failing)
        yield from _mask_hypotheses(reference)
        yield from _routing_hypotheses(reference)
        yield from _activation_variants(reference)
        yield from _true_convolutions(reference)
        yield from _stale_weights(reference, pairs, failing)


def _constant_factors(pairs, failing, reference: Trace):
    """got = c·ref with one c for every failing quantity (a sum for a mean, a missing 2 or 1/N)."""
    gradient_names = [n for n in failing if n not in ("loss", "output")]
    if not gradient_names:
        return
    num = sum(float(np.dot(pairs[n][0].ravel(), pairs[n][1].ravel())) for n in gradient_names)
    den = sum(float(np.dot(pairs[n][1].ravel(), pairs[n][1].ravel())) for n in gradient_names)
    if den == 0 or num == 0:
        return  # c = 0 is a gradient never computed: zero_gradients names it
    c = num / den
    problem = reference.problem
    out_count = int(np.prod(reference.output.shape))
    known = {"the number of output elements (a sum where the mean belongs)": out_count,
             "the batch size (a sum over samples where the mean belongs)": problem.batch,
             "the output elements per sample (a sum over each sample's, a mean over the batch)": out_count / problem.batch,
             "2": 2.0, "1/2 (the 2 of a square's derivative forgotten)": 0.5,
             "1/(number of output elements) twice (a mean taken twice)": 1.0 / out_count}
    # a known factor is named without its value, which differs between problems (a probe's size and batch): the
    # diagnosis names a cause only when every problem names the same one
    label = next((f"scaled by {text}" for text, value in known.items() if abs(c / value - 1) < 1e-3),
                 f"scaled by a constant {c:.6g}")
    covers = gradient_names + (["loss"] if "loss" in failing else [])
    yield label, {n: c * pairs[n][1] for n in covers}, covers, False


def _other_parameters(pairs, failing):
    """A gradient slot holding another parameter's gradient (an index slip)."""
    names = [n for n in pairs if n not in ("loss", "output")]
    for name in failing:
        if name in ("loss", "output"):
            continue
        for other in names:
            if other != name and pairs[other][1].size == pairs[name][1].size:
                yield (f"{name} holds {other}'s gradient", {name: pairs[other][1].reshape(pairs[name][1].shape)},
                       [name], False)


class Slip(str):
    """A layer-local hypothesis's name ('conv1: <slip>') that keeps its parts: the same slip in several layers is
    one cause (`_one_slip_in_every_layer`) without reading the name back."""

    def __new__(cls, layer: str, slip: str):
        named = super().__new__(cls, f"{layer}: {slip}")
        named.layer, named.slip = layer, slip
        return named


def _local_weight_hypotheses(reference: Trace, failing):
    """Per conv2d layer with a failing gradient: shifted windows, a missing edge row/column/tile of the upstream
    gradient, the pre-activation for the post-activation — recomputed in float64 from the stored operands."""
    network = reference.network
    for layer in network.parametrised_layers:
        names = [f"{layer.name}.weight", f"{layer.name}.bias"]
        if not any(n in failing for n in names) or layer.op != "conv2d":
            continue
        a = reference.value(layer.inputs[0]).double()
        g = reference.grad_at(layer.index).double()
        attrs = layer.attrs
        shape = network.param_shapes[f"{layer.name}.weight"]
        kernels = Kernels()

        def wgrad(x, grad):
            return kernels.conv_weight_grad(x, grad, attrs, shape).cpu().numpy()

        def expected(grad, x=a):
            out = {names[0]: wgrad(x, grad)}
            if names[1] in network.param_shapes:
                out[names[1]] = grad.sum(dim=(0, 2, 3)).cpu().numpy()
            return out

        for dy, dx in [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]:
            shifted = torch.roll(a, shifts=(dy, dx), dims=(2, 3))
            if dy:
                shifted[:, :, (0 if dy > 0 else -1), :] = 0
            if dx:
                shifted[:, :, :, (0 if dx > 0 else -1)] = 0
            yield Slip(layer.name, f"windows shifted by ({dy}, {dx}) pixels (a padding offset)"), \
                {names[0]: wgrad(shifted, g)}, [names[0]], True
        height, width = g.shape[2:]
        edges = {"first image row": (slice(None), slice(None), slice(0, 1), slice(None)),
                 "last image row": (slice(None), slice(None), slice(height - 1, height), slice(None)),
                 "first image column": (slice(None), slice(None), slice(None), slice(0, 1)),
                 "last image column": (slice(None), slice(None), slice(None), slice(width - 1, width))}
        for tile in (8, 16, 32):
            if tile < min(height, width) // 2:
                edges[f"top-left {tile}×{tile} tile"] = (slice(None), slice(None), slice(0, tile), slice(0, tile))
                edges[f"bottom-right {tile}×{tile} tile"] = (slice(None), slice(None), slice(height - tile, height),
                                                            slice(width - tile, width))
                # a kernel's tiles sit on a grid of their own size: every aligned one, where there are few
                rows, cols = range(0, height - tile + 1, tile), range(0, width - tile + 1, tile)
                if len(rows) * len(cols) <= MAX_TILE_POSITIONS:
                    for r0, c0 in itertools.product(rows, cols):
                        if (r0, c0) != (0, 0):
                            label = f"{tile}×{tile} tile at rows {r0}–{r0 + tile - 1}, columns {c0}–{c0 + tile - 1}"
                            edges[label] = (slice(None), slice(None), slice(r0, r0 + tile), slice(c0, c0 + tile))
        for text, region in edges.items():
            masked = g.clone()
            masked[region] = 0
            yield Slip(layer.name, f"the {text} of its upstream gradient skipped"), expected(masked), names, True
        source = network.layers[layer.inputs[0]] if layer.inputs[0] >= 0 else None
        if source is not None and OPS[source.op].elementwise:
            pre = reference.value(source.inputs[0]).double()
            if pre.shape == a.shape:
                yield (Slip(layer.name, f"the pre-activation of {source.label} used for its output"),
                       {names[0]: wgrad(pre, g)}, [names[0]], True)


def _one_sample(reference: Trace, failing):
    """Every gradient summed over one sample of the batch only (the mean's 1/N kept)."""
    problem = reference.problem
    if problem.batch < 2:
        return
    total = problem.batch
    for b in range(problem.batch):
        part = forward_backward(problem.with_batch(b, b + 1), "float64", reference.device)
        scale = 1.0 / total  # each sample's loss is a mean over its own positions, the batch's the mean of those
        expected = {name: value * scale for name, value in part.grads.items()}
        yield f"sample {b} of the batch only", expected, list(expected), False


def _mask_hypotheses(reference: Trace):
    """A ReLU's backward without its mask, or with another ReLU's mask (full float64 recomputations)."""
    network = reference.network
    relus = [layer for layer in network.layers if layer.op in ("relu", "leaky_relu")]
    groups = {"every ReLU's backward: mask missing": [layer for layer in relus if layer.op == "relu"],
              "every ReLU and leaky ReLU backward: mask missing": relus}
    seen = []
    for text, group in groups.items():
        if len(group) > 1 and group not in seen:
            seen.append(group)
            rules = {layer.index: _UnmaskedReLU(OPS[layer.op]) for layer in group}
            result = forward_backward(reference.problem, "float64", reference.device, rules=rules)
            yield text, result.grads, list(result.grads), False
    for layer in relus:
        rules = {layer.index: _UnmaskedReLU(OPS[layer.op])}
        result = forward_backward(reference.problem, "float64", reference.device, rules=rules)
        yield f"{layer.label} backward: mask missing", result.grads, list(result.grads), False
        for other in relus:
            if other is layer:
                continue
            other_z = reference.value(other.inputs[0])
            mine = reference.value(layer.inputs[0])
            if other_z.shape != mine.shape:
                continue
            rules = {layer.index: _BorrowedMaskReLU(OPS[layer.op], other_z.double())}
            result = forward_backward(reference.problem, "float64", reference.device, rules=rules)
            yield (f"{layer.label} backward: masked with {other.label}'s activation", result.grads,
                   list(result.grads), False)


def _routing_hypotheses(reference: Trace):
    """Backward slips of the routing ops, recomputed in float64: an upsample whose backward takes one gradient
    per block or averages the block; an add or a concat that passes no gradient to one of its inputs; a concat
    that joins its inputs in the other order."""
    network = reference.network
    for layer in network.layers:
        if layer.op == "upsample_nearest":
            for text, backward in (("takes each block's first gradient instead of their sum", _upsample_first),
                                   ("averages each block's gradients instead of summing them", _upsample_mean)):
                result = forward_backward(reference.problem, "float64", reference.device,
                                          rules={layer.index: BackwardReplaced(OPS[layer.op], backward)})
                yield f"{layer.label} backward {text}", result.grads, list(result.grads), False
        if layer.op == "concat":
            result = forward_backward(reference.problem, "float64", reference.device, rules={layer.index: ConcatSwapped()})
            expected = dict(result.grads, output=result.output, loss=np.asarray(result.loss, np.float64))
            yield (f"{layer.label} joins the skip from {network.layers[layer.source].label} first: the spec "
                   "concatenates [previous, skip] along channels", expected, list(expected), False)
        if layer.op in ("add", "concat"):
            source = network.layers[layer.source].label
            for which, text in ((1, f"passes no gradient to the skip from {source}"),
                                (0, "passes no gradient to the main branch")):
                result = forward_backward(reference.problem, "float64", reference.device,
                                          rules={layer.index: BackwardReplaced(OPS[layer.op], _dropping(which))})
                yield f"{layer.label} backward {text}", result.grads, list(result.grads), False


class _Rule:
    """An op's rules replaced for one recomputation: computed plainly (no in-place forward or backward, nothing
    derived from a neighbour)."""

    forward_inplace = None
    derive_output = None
    derive_input_grad = None
    backward_inplace = None


#: other frameworks' defaults for a leaky ReLU's negative slope: a port that keeps its framework's default
#: computes another function (PyTorch's and JAX's 0.01, tf.nn.leaky_relu's 0.2, Keras's LeakyReLU 0.3)
LEAKY_SLOPE_DEFAULTS = {0.01: "PyTorch's and JAX's default", 0.2: "tf.nn.leaky_relu's default",
                        0.3: "Keras's LeakyReLU default"}


def _activation_variants(reference: Trace):
    """Each activation recomputed in float64 as a framework's other default computes it: GELU by the other formula
    (erf, or the tanh approximation: jax.nn.gelu's default, tinygrad's), a leaky ReLU with another default slope."""
    network = reference.network
    for layer in network.layers:
        changes = []
        if layer.op == "gelu":
            if layer.attrs["approximate"] == "none":
                changes.append(({"approximate": "tanh"}, "GELU's tanh approximation where the spec says erf "
                                 "(jax.nn.gelu's default, tinygrad's gelu): use the exact form (approximate=False), "
                                 "or say \"approximate\": \"tanh\" in the spec"))
            else:
                changes.append(({"approximate": "none"}, "GELU's exact (erf) form where the spec says the tanh "
                                 "approximation: use approximate=True, or drop \"approximate\" from the spec"))
        elif layer.op == "leaky_relu":
            for slope, whose in LEAKY_SLOPE_DEFAULTS.items():
                if not math.isclose(slope, layer.attrs["slope"]):
                    changes.append(({"slope": slope}, f"a leaky ReLU slope of {slope:g} ({whose}) where the spec says "
                                                      f"{layer.attrs['slope']:g}: pass the slope explicitly"))
        for change, text in changes:
            result = forward_backward(reference.problem, "float64", reference.device,
                                      rules={layer.index: _OtherAttributes(OPS[layer.op], change)})
            expected = dict(result.grads, output=result.output, loss=np.asarray(result.loss, np.float64))
            yield f"{layer.label} computed with {text}", expected, list(expected), False


class _OtherAttributes(_Rule):
    """An op computed, forward and backward, with some of its attributes changed."""

    def __init__(self, op, changes: dict):
        self.op, self.changes = op, changes

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward({**attrs, **self.changes}, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.op.backward({**attrs, **self.changes}, g, xs, y, params, kernels, need)


def _true_convolutions(reference: Trace):
    """Every convolution with a kernel larger than 1×1, and each on its own, recomputed in float64 as a true
    convolution (the kernel flipped in H and W: cuDNN's CUDNN_CONVOLUTION mode, scipy.signal.convolve2d) where the
    spec means cross-correlation (CUDNN_CROSS_CORRELATION, as PyTorch, TensorFlow and JAX compute it). The weight
    gradient is then the flipped problem's, flipped back: the forward differs, not only a buffer's layout."""
    network = reference.network
    layers = [layer for layer in network.layers if layer.op == "conv2d" and tuple(layer.attrs["kernel"]) != (1, 1)]
    groups = ([("every convolution", layers)] if len(layers) > 1 else []) + [(layer.label, [layer]) for layer in layers]
    for text, group in groups:
        rules = {layer.index: _TrueConvolution(OPS[layer.op]) for layer in group}
        result = forward_backward(reference.problem, "float64", reference.device, rules=rules)
        expected = dict(result.grads, output=result.output, loss=np.asarray(result.loss, np.float64))
        yield (f"{text} computed as a true convolution, the kernel flipped (cuDNN's CUDNN_CONVOLUTION mode) where the "
               "spec means cross-correlation (CUDNN_CROSS_CORRELATION, as PyTorch and TensorFlow)", expected,
               list(expected), False)


class _TrueConvolution(_Rule):
    """A conv2d computed with its kernel flipped in H and W, its weight gradient flipped back to the kernel's."""

    def __init__(self, op):
        self.op = op

    @staticmethod
    def _flipped(params):
        return dict(params, weight=params["weight"].flip(-2, -1))

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, self._flipped(params), kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = self.op.backward(attrs, g, xs, y, self._flipped(params), kernels, need)
        return grads, dict(param_grads, weight=param_grads["weight"].flip(-2, -1))


class ConcatSwapped(_Rule):
    """A concat that puts its second input (the skip) first: [skip, previous] where the spec says [previous, skip]."""

    def forward(self, attrs, xs, params, kernels):
        return torch.cat([xs[1], xs[0]], dim=1)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        split = xs[1].shape[1]
        return [g[:, split:] if need[0] else None, g[:, :split] if need[1] else None], {}


class FlattenHWC(_Rule):
    """A flatten in (H, W, C) order (a channels-last framework's habit) where the spec flattens (C, H, W)."""

    def forward(self, attrs, xs, params, kernels):
        x = xs[0]
        return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        n, c, h, w = xs[0].shape
        return [g.reshape(n, h, w, c).permute(0, 3, 1, 2).contiguous() if need[0] else None], {}


def _flatten_order(reference: Trace):
    """Each flatten of a multi-channel image recomputed in float64 in (H, W, C) order: every quantity after it."""
    network, problem = reference.network, reference.problem
    shapes = network.shapes(problem.height, problem.width)
    for layer in network.layers:
        if layer.op != "flatten" or layer.index + 1 >= len(network.layers):
            continue
        shape = shapes[layer.inputs[0]] if layer.inputs[0] >= 0 else (network.input_channels, problem.height,
                                                                        problem.width)
        if len(shape) != 3 or shape[0] < 2 or shape[1] * shape[2] < 2:
            continue
        result = forward_backward(reference.problem, "float64", reference.device, rules={layer.index: FlattenHWC()})
        expected = dict(result.grads, output=result.output, loss=np.asarray(result.loss, np.float64))
        # the next linear layer's weight columns then multiply features in (H, W, C) order: so do their bounds
        c, h, w = shape
        order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()
        reader = network.layers[layer.index + 1]
        own = {}
        if reader.op == "linear" and f"{reader.name}.weight" in reference.grads:
            name = f"{reader.name}.weight"
            own[name] = (slice(None), order)
        yield (f"{layer.label} flattens in (H, W, C) order where the spec flattens (C, H, W): permute to channels "
               f"first before flattening, or permute the next layer's weight columns", expected, list(expected), False,
               own)


def _upsample_first(op, attrs, g, xs, y, params, kernels, need):
    sh, sw = attrs["scale"]
    return [g[:, :, ::sh, ::sw].contiguous() if need[0] else None], {}


def _upsample_mean(op, attrs, g, xs, y, params, kernels, need):
    grads, _ = op.backward(attrs, g, xs, y, params, kernels, need)
    return [None if h is None else h / (attrs["scale"][0] * attrs["scale"][1]) for h in grads], {}


def _dropping(which: int):
    def backward(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        grads = list(grads)
        if grads[which] is not None:
            grads[which] = torch.zeros_like(grads[which])
        return grads, param_grads

    return backward


def _stale_weights(reference: Trace, pairs, failing):
    """Gradients at weights one small step away (stale weights): g(w − η·g) ≈ g + (η/s)·(g(w − s·g) − g(w)),
    the step η fitted by least squares over the failing gradients (one float64 recomputation at s = 10⁻²)."""
    names = [n for n in failing if n not in ("loss", "output")]
    if not names:
        return
    problem = reference.problem
    step = 1e-2
    moved = problem.with_params({n: (problem.params[n] - step * reference.grads[n]).astype(np.float32)
                                 for n in problem.params})
    other = forward_backward(moved, "float64", reference.device)
    direction = {n: other.grads[n] - pairs[n][1] for n in names}
    den = sum(float(np.sum(d * d)) for d in direction.values())
    if den == 0:
        return
    alpha = sum(float(np.sum((pairs[n][0] - pairs[n][1]) * direction[n])) for n in names) / den
    if alpha <= 0:
        return
    yield (f"stale weights (gradients at weights a step η ≈ {alpha * step:.3g}·g away)",
           {n: pairs[n][1] + alpha * direction[n] for n in names}, names, False)


class _UnmaskedReLU(_Rule):
    """A ReLU (or leaky ReLU) whose backward forgot the mask: its forward is the op's own."""

    def __init__(self, op):
        self.op = op

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g], {}


class _BorrowedMaskReLU(_UnmaskedReLU):
    """A ReLU whose backward takes another ReLU's mask."""

    def __init__(self, op, source: torch.Tensor):
        super().__init__(op)
        self.source = source

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g.masked_fill(self.source.to(g.dtype) <= 0, 0.0)], {}


# ---------------------------------------------------------------------------------------------
# localisation


def localise(quantities, result: Result, reference: Trace, claimed: str) -> list[Finding]:
    """Name where a failure starts: the first op whose local check fails (with intermediates), else the
    earliest failing quantity in backprop order."""
    if not any(q.verdict != "roundoff" for q in quantities.values()):
        return []
    if result.intermediates:
        found = _first_failing_op(result, reference, claimed)
        if found:
            return [Finding("localisation", name=found, numbers={"by": "intermediates"})]
    network = reference.network
    order = ["loss", "output"] + [f"{layer.name}.{suffix}" for layer in reversed(network.parametrised_layers)
                                  for suffix in ("weight", "bias") if f"{layer.name}.{suffix}" in network.param_shapes]
    for name in order:
        q = quantities.get(name)
        if q is not None and q.verdict != "roundoff":
            return [Finding("localisation", name=f"first failing quantity in backprop order: {name}",
                            numbers={"by": "backprop order", "quantity": name})]
    return []


def _first_failing_op(result: Result, reference: Trace, claimed: str) -> str | None:
    """Each op re-run in float64 on the candidate's own intermediates and judged against its local bound."""
    network = reference.network
    inter = result.intermediates
    device = reference.device
    u = formats.unit_roundoff(errmodel.accumulation_precision(claimed))
    ctx = BoundContext(claimed, u, errmodel.LAMBDA, errmodel.bound_kernels(device))

    def value(index):
        if index == -1:
            return reference.input
        layer = network.layers[index]
        key = f"{layer.name}.output" if layer.name else None
        return torch.as_tensor(inter[key], dtype=torch.float64, device=device) if key in inter else None

    def grad(index):
        layer = network.layers[index]
        key = f"{layer.name}.output.grad" if layer.name else None
        return torch.as_tensor(inter[key], dtype=torch.float64, device=device) if key in inter else None

    params64 = {k: torch.as_tensor(v, dtype=torch.float64, device=device) for k, v in reference.problem.params.items()}
    with torch.no_grad(), errmodel._ieee(device):
        for layer in network.layers:  # forward, in order
            inputs, mine = [value(i) for i in layer.inputs], value(layer.index)
            if mine is None or any(x is None for x in inputs):
                continue
            op = OPS[layer.op]
            expected = op.forward(layer.attrs, inputs, layer_params(params64, layer), Kernels())
            fields = [Field(x.to(torch.float32), None, 0) for x in inputs]
            bound = op.forward_error(layer.attrs, fields, expected.to(torch.float32),
                                     layer_params(reference.params, layer), ctx).error
            ratio = _local_ratio(mine, expected, bound, u)
            if ratio > 1.0:
                return f"{layer.label} forward: beyond its own rounding bound (error ÷ bound {ratio:.3g})"
        for layer in reversed(network.layers):  # backward, in backprop order
            g, inputs = grad(layer.index), [value(i) for i in layer.inputs]
            if g is None or any(x is None for x in inputs):
                continue
            op = OPS[layer.op]
            need = [i >= 0 and len(network.consumers[i]) == 1 and grad(i) is not None for i in layer.inputs]
            expected_in, _ = op.backward(layer.attrs, g, inputs, value(layer.index), layer_params(params64, layer),
                                         Kernels(), need)
            fields = [Field(x.to(torch.float32), None, 0) for x in inputs]
            out_field = op.forward_error(layer.attrs, fields, value(layer.index).to(torch.float32),
                                         layer_params(reference.params, layer), ctx) if op.name in ("relu", "leaky_relu") \
                else Field(None, None)
            zero = GradField(torch.zeros_like(g, dtype=torch.float32), None, 0, 0, owned=False)
            local, _ = op.backward_error(layer.attrs, g.to(torch.float32), zero, fields, out_field,
                                         layer_params(reference.params, layer), ctx, need)
            for i, keep, h, field in zip(layer.inputs, need, expected_in, local):
                if not keep or h is None or field is None:
                    continue
                theirs = grad(i)
                bound = field.error + (field.flips if field.flips is not None else 0.0)
                ratio = _local_ratio(theirs, h, bound, u)
                if ratio > 1.0:
                    return f"{layer.label} backward: {_name_local_slip(layer, g, theirs, h, bound, u)}"
    return None


def _local_ratio(got: torch.Tensor, expected: torch.Tensor, bound, u: float) -> float:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    floor = max(u * scale, np.finfo(np.float32).tiny)
    bound = torch.zeros_like(expected) if bound is None else bound
    return float(((got - expected).abs() / bound.double().clamp(min=floor)).max())


def _name_local_slip(layer, g, theirs, expected, bound, u) -> str:
    """A local slip's name when a simple one fits (a mask missing), else the ratio."""
    if layer.op in ("relu", "leaky_relu") and _local_ratio(theirs, g, bound + u * g.abs().float(), u) <= 1.0:
        return "mask missing (the gradient passes unmasked)"
    if layer.op == "upsample_nearest":
        sh, sw = layer.attrs["scale"]
        if _local_ratio(theirs, expected / (sh * sw), bound, u) <= 1.0:
            return "averages each block's gradient where it should sum it"
    if not bool(torch.any(theirs != 0)):
        return "passes no gradient at all"
    return f"beyond its own rounding bound (error ÷ bound {_local_ratio(theirs, expected, bound, u):.3g})"


__all__ = ["FALLBACK_FORMATS", "FORMAT_MATCH_FACTOR", "defects", "emulate", "layouts", "localise", "name_format",
           "precision", "transforms", "ComparisonError"]
