"""Reduced precision: beyond the claimed bound, the format whose emulated error level matches the
candidate's; inside it, the precision fingerprint (correlation with each format's emulated error against
the measured null of legitimate float32 orders)."""
from __future__ import annotations

import math

import numpy as np

from .. import errmodel, formats
from ..compare import CERTIFIABLE_FRACTION, bound_fraction, dot, norm, quantity_arrays, zero_to_reference_accuracy
from ..compute import Result, Trace, forward_backward
from ..device import torch_threads
from ..findings import Finding
from ..ops import Kernels
from .budget import recompute_allowed

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


#: the fingerprint names a format when the candidate's error correlates with the format's own emulated
#: error (emulated − plain float32, so only what the format adds) at least this much: r² ≥ 0.9, nine tenths
#: of the error explained. Measured: legitimate float32 orders reach 0.82 (FFT convolution, conv3.weight, whose
#: errors are propagated forward errors along a few directions), TF32 candidates with another accumulation order
#: ≥ 0.96 at 24²–61²; over the probes' problems (benchmarks/sensitivity.py --parts false-alarms, 14 legitimate
#: orders × 3 probes × 100 seeds, docs/results.md) the closest any came to this threshold was 0.096 below ...
FINGERPRINT_MIN = 0.95
#: ... and beyond the largest correlation of a measured legitimate float32 order plus FINGERPRINT_Z standard
#: errors of a correlation of m independent pairs (1/√m): five, a one-in-3-million chance under the null
FINGERPRINT_Z = 5.0
#: correlations need this many elements to mean anything
FINGERPRINT_MIN_ELEMENTS = 16

#: the fingerprint's float32 runs (the null's members and the emulations) take one thread on a CPU: PyTorch's kernels
#: split their sums by the thread count, so with the cores a diagnosis leaves the lab (fewer while a program runs) the
#: null's bits, and its correlations, changed from run to run (a small U-Net at 128², seed 3: 0.128 in one run, 0.155
#: in the next); one thread is the count every machine has. Cost: 1.04 s against 0.57 s on two threads (the seed
#: network at 2·256², the recompute limit; docs/results.md)
FINGERPRINT_THREADS = 1

#: passes an emulated format may act in (docs/design.md, "Explaining a verdict")
PASSES = ("all", "forward", "input_grad", "weight_grad")


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
        with torch_threads(reference.device, FINGERPRINT_THREADS):
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


def _within_format(name: str, fmt: str, got, ref, bound, ratio: float) -> Finding:
    """What a quantity beyond the claimed bound and within a coarser format's element bound is: that format only
    where its bound could have failed it, below half the quantity (compare.CERTIFIABLE_FRACTION) and along the
    gradient's own direction (compare.along); `inconclusive` where the bound is too large to tell (the probes or a
    smaller problem settle it, decision.settle); a defect where the error leaves the format's along its direction."""
    size = norm(ref)
    # the slip along ĝ the format's own error could hide (decision.Diagnosis.hidden_scale)
    resolution = {"along_resolution": bound.along / size} if bound.along is not None and size > 0 else {}
    if bound.along is not None and size > 0:
        along_ratio = abs(dot(got - ref, ref) / size) / bound.along
        if along_ratio > 1.0:
            return Finding("beyond-format", name, name=fmt,
                           evidence=f"within the {fmt} bound element by element (error ÷ bound {ratio:.3g}), but "
                                    f"along the gradient's own direction {along_ratio:.3g}× what {fmt} rounding does "
                                    "there: a scaled or partly lost gradient, not the format",
                           numbers={"format_bound_ratio": ratio, "along_ratio": along_ratio})
    fraction = bound_fraction(ref, bound.bound)
    if fraction > CERTIFIABLE_FRACTION and not zero_to_reference_accuracy(ref, bound.bound):
        return Finding("format-level", name, "inconclusive", fmt,
                       f"beyond the claimed bound and within the {fmt} bound (error ÷ bound {ratio:.3g}), but that "
                       f"bound is {fraction:.3g}× the quantity (above {CERTIFIABLE_FRACTION:g}): too large to tell "
                       f"{fmt} from a defect on this problem; the probes or a smaller problem settle it",
                       {"format_bound_ratio": ratio, **resolution})
    return Finding("format-level", name, "reduced-precision", fmt, f"within the {fmt} bound (error ÷ bound {ratio:.3g})",
                   {"format_bound_ratio": ratio, **resolution})


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
                    if not np.isfinite(fmt_bounds[name].bound).all():
                        # an unbounded element would excuse any error: the format cannot be told from a defect here
                        findings.append(Finding("beyond-format", name, name=fmt, evidence=f"the {fmt} bound is not "
                                                f"finite everywhere (its worst case leaves no relative accuracy), so "
                                                f"it excuses nothing", numbers={"format_bound_ratio": math.inf}))
                    elif ratio <= 1.0:
                        finding = _within_format(name, fmt, got, ref, fmt_bounds[name], ratio)
                        if finding.verdict == "reduced-precision":
                            named[name] = fmt
                        findings.append(finding)
                    else:
                        findings.append(Finding("beyond-format", name, name=fmt,
                                                evidence=f"beyond even the {fmt} bound (error ÷ bound {ratio:.3g})",
                                                numbers={"format_bound_ratio": ratio}))
    if fallbacks(claimed) and recompute_allowed(reference, fingerprint):
        open_quantities = {n: q for n, q in quantities.items() if n not in named}
        findings += _fingerprint(open_quantities, claimed, pairs, reference)
    elif fallbacks(claimed):
        findings.append(Finding("note", evidence=f"precision fingerprint not computed at "
                                f"{reference.problem.size_text}, batch {reference.problem.batch} on "
                                f"{reference.device.type} (the probes carry it)"))
    return findings


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel() - a.mean(), b.ravel() - b.mean()
    norms = norm(a) * norm(b)
    return dot(a, b) / norms if norms > 0 else 0.0


def _null_members(reference: Trace) -> dict[str, Result]:
    """Legitimate float32 orders for the null: the layered native kernels, and micro-batches of one sample (where no
    layer mixes the samples)."""
    cache = reference.meta.setdefault("null_members", {})
    if not cache:
        problem = reference.problem
        cache["layered-native"] = emulate(reference, "float32")
        if not problem.network.couples_batch:  # where samples meet (batch statistics) a micro-batch is another function
            with torch_threads(reference.device, FINGERPRINT_THREADS):
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


def _autocast_member(reference: Trace, claimed: str) -> Result | None:
    """A stored format's claim as torch.autocast runs it (results stored in the format, float16 with GradScaler's
    first scale): storing results flips ReLUs that operand rounding alone does not, near the same zeros a coarser
    format flips (measured: a right float16 autocast program read as bfloat16 at r = 0.953, a 32² 8-layer denoiser)."""
    from ..candidates.builtin import GRAD_SCALER_INIT, _autocast_runs
    from ..compute import autocast_forward_backward

    if claimed not in formats.STORED_FORMATS or not _autocast_runs(reference.network):
        return None
    scale = GRAD_SCALER_INIT if claimed == "float16" else 1.0
    return autocast_forward_backward(reference.problem, claimed, reference.device, scale)


def _fingerprint(quantities, claimed: str, pairs, reference: Trace) -> list[Finding]:
    """Correlate the candidate's error with emulated coarser formats per quantity and pass, against the null.
    `quantities`: those no format's level has named yet."""
    members = dict(_null_members(reference))
    if claimed in formats.REDUCED_FORMATS:
        # a reduced-format claim: its own emulation is a legitimate order too, and shares what that format does
        # with a coarser one (a ReLU both flip; measured: tf32-claimed read as bf16 at r = 0.961, 33×47, seed 36)
        members[f"{claimed}-emulated"] = emulate(reference, claimed)
        autocast = _autocast_member(reference, claimed)
        if autocast is not None:
            members[f"{claimed}-autocast"] = autocast
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
        bound = errmodel.error_bounds(reference, fmt)[name]  # cached per trace
        ratio = float(np.max(np.abs(got - ref) / bound.bound))
        if ratio <= 1.0:
            finding = _within_format(name, fmt, got, ref, bound, ratio)
            if finding.verdict == "reduced-precision":
                finding = Finding("format-excuse", name, "reduced-precision", fmt,
                                  f"error ÷ bound {q.bound_ratio:.3g}, within the {fmt} bound (error ÷ bound "
                                  f"{ratio:.3g}) of the format the fingerprint names on {witnesses}",
                                  {**finding.numbers, "format_bound_ratio": ratio})
            elif finding.verdict == "inconclusive":
                finding = Finding("format-excuse", name, "inconclusive", fmt, finding.evidence, finding.numbers)
            findings.append(finding)
    return findings

