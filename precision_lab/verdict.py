"""Comparison against the float64 reference, verdicts with their evidence, and the layout doctor.

Per quantity (loss, output, each parameter gradient) and overall, one verdict (DESIGN.md):

* ``roundoff`` — every element within the error model's bound for the claimed precision;
* ``layout`` — a weight gradient that matches once its buffer is read in another layout
  (any permutation of O, I, H, W) and/or flipped in H and/or W: the transform is named;
* ``reduced-precision`` — beyond the claimed bound, but a coarser format explains it: the
  errors fit that format's bound, and the *forward output* shows that format's error level
  (a coarser format acts everywhere; an emulation of each format on the same problem gives the
  level), and more than one element is off (a single outlying element is a local bug);
* ``defect`` — nothing above explains it.

Overall: ``defect`` if any quantity is a defect, else ``layout`` if any, else
``reduced-precision`` if any, else ``roundoff``.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import errmodel, formats
from .layout import CANONICAL, from_layout, shape_in_layout
from .problem import PARAM_NAMES, WEIGHT_NAMES, Problem, Result, Trace, forward_backward

if TYPE_CHECKING:  # pandas is imported where a table is built: a diagnosis never needs it
    import pandas as pd

VERDICTS = ("roundoff", "reduced-precision", "layout", "defect")

#: formats a result may fall back to, finest first (float32 counts for a float64 claim)
FALLBACK_FORMATS = ("float32", "tf32", "float16", "bfloat16")

#: a format names the errors when its emulated output error is within this factor of the
#: candidate's: √32, the geometric midpoint between tf32's u = 2⁻¹¹ and bf16's u = 2⁻⁸
FORMAT_MATCH_FACTOR = math.sqrt(32.0)

#: below this many elements a single exceedance cannot be told from a broad precision loss
MIN_ELEMENTS_FOR_OUTLIER_TEST = 8


def _is_isolated(q: "QuantityVerdict") -> bool:
    """One element beyond the bound, standing a format step (FORMAT_MATCH_FACTOR) above the next:
    a coarser format raises every element's error together, so it cannot make such an outlier."""
    if q.exceeding != 1 or q.size < MIN_ELEMENTS_FOR_OUTLIER_TEST:
        return False
    return q.bound_ratio > FORMAT_MATCH_FACTOR * q.second_ratio


@dataclass
class QuantityVerdict:
    """One quantity's verdict and the evidence behind it (errors against the float64 reference)."""

    quantity: str
    verdict: str
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float
    bound_ratio: float  # max over elements of |error| / bound at the claimed precision
    ulps: float  # max distance in units in the last place of the storage format
    cosine: float
    sign_agreement: float
    layout_fix: str | None = None
    format: str | None = None
    n_terms: int = 0
    size: int = 0
    exceeding: int = 0  # elements beyond the claimed bound
    second_ratio: float = 0.0  # the second-largest error ÷ bound (is the worst element alone?)
    bound_max: float = 0.0
    relu_flips: int = 0
    evidence: str = ""


@dataclass
class Judgement:
    """The verdict on one candidate: overall, per quantity, and how it was reached."""

    candidate: str
    claimed_precision: str
    verdict: str
    quantities: dict[str, QuantityVerdict] = field(default_factory=dict)
    layout_fix: str | None = None
    format: str | None = None
    evidence: list[str] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    layout_options: dict[str, list[str]] = field(default_factory=dict)  # every fitting transform per quantity

    def headline(self) -> str:
        """One line: verdict, what names it, and the worst error ÷ bound."""
        detail = self.layout_fix or self.format
        worst = max(self.quantities.values(), key=lambda q: q.bound_ratio)
        return (f"{self.verdict}{f' ({detail})' if detail else ''}: worst {worst.quantity} "
                f"error ÷ bound = {worst.bound_ratio:.3g}")

    def to_frame(self) -> pd.DataFrame:
        """Tidy table: one row per quantity, with candidate and claimed precision."""
        import pandas as pd  # here, not at the top: a diagnosis needs no pandas (0.3 s of its start-up)

        frame = pd.DataFrame([asdict(q) for q in self.quantities.values()])
        return frame.assign(candidate=self.candidate, claimed_precision=self.claimed_precision,
                            overall=self.verdict)

    def to_json(self) -> dict:
        """DESIGN.md's diagnose JSON: candidate, verdict, claimed_precision, parameters, plus evidence."""
        per = {name: _json_safe(asdict(q)) for name, q in self.quantities.items()}
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "layout_fix": self.layout_fix, "format": self.format,
                "parameters": {name: per[name] for name in PARAM_NAMES if name in per},
                "forward": {name: per[name] for name in ("loss", "output") if name in per},
                "evidence": list(self.evidence), "model": _json_safe(self.model)}

    def to_text(self) -> str:
        """A readable report: the verdict, then one line of evidence per quantity."""
        lines = [f"candidate {self.candidate}  (claimed {self.claimed_precision})",
                 f"verdict: {self.headline()}"]
        lines += [f"  {q.quantity:<13} {q.verdict:<17} max|err| {q.max_abs_err:9.3g}  err/bound {q.bound_ratio:9.3g}"
                  f"  ulps {q.ulps:9.3g}  cos {q.cosine:.6f}  signs {q.sign_agreement:.3f}"
                  + (f"  fix: {q.layout_fix}" if q.layout_fix else "") + (f"  format: {q.format}" if q.format else "")
                  for q in self.quantities.values()]
        lines += [f"  - {line}" for line in self.evidence]
        return "\n".join(lines)


def _json_safe(value):
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None  # JSON has no inf/NaN
    if isinstance(value, np.integer):
        return int(value)
    return value


# ---------------------------------------------------------------------------------------------
# measuring one quantity


def _quantity_arrays(result: Result, reference: Trace) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(candidate, reference) float64 arrays for each quantity the result has, reshaped to OIHW."""
    pairs = {"loss": (np.asarray(result.loss, np.float64), np.asarray(reference.loss, np.float64))}
    if result.output is not None:
        pairs["output"] = (_same_size(result.output, reference.output, "output"), np.asarray(reference.output, np.float64))
    for name in PARAM_NAMES:
        if name not in result.grads:
            raise ValueError(f"result of {result.meta.get('candidate', 'the candidate')} has no gradient {name!r}")
        pairs[name] = (_same_size(result.grads[name], reference.grads[name], name), np.asarray(reference.grads[name], np.float64))
    return pairs


def _same_size(got, ref, name: str) -> np.ndarray:
    got, ref = np.asarray(got, np.float64), np.asarray(ref)
    if got.size != ref.size:
        raise ValueError(f"{name}: candidate gave {got.size} values (shape {got.shape}), expected {ref.size} (shape {ref.shape})")
    return got.reshape(ref.shape)  # a buffer of the right size: the layout doctor reads its order


def measure(name: str, got: np.ndarray, ref: np.ndarray, bound: np.ndarray, storage: str = "float32") -> QuantityVerdict:
    """Every evidence number of one quantity; the verdict is provisional (roundoff iff within bound)."""
    err = np.abs(got - ref)
    ratio = err / bound
    finite = bool(np.all(np.isfinite(got)))
    nonzero = ref != 0
    norms = float(np.linalg.norm(got)) * float(np.linalg.norm(ref))
    q = QuantityVerdict(
        quantity=name, verdict="roundoff" if finite and float(ratio.max()) <= 1.0 else "defect",
        max_abs_err=float(err.max()), mean_abs_err=float(err.mean()),
        max_rel_err=float((err / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)).max()),
        bound_ratio=float(ratio.max()) if finite else math.inf,
        ulps=_max_ulps(got, ref, storage) if finite else math.inf,
        cosine=float(np.dot(got.ravel(), ref.ravel()) / norms) if norms > 0 and finite else float(np.array_equal(got, ref)),
        sign_agreement=float(np.mean(np.sign(got[nonzero]) == np.sign(ref[nonzero]))) if nonzero.any() else 1.0,
        size=int(ref.size), exceeding=int(np.sum(~(ratio <= 1.0))), bound_max=float(bound.max()),
        second_ratio=float(np.sort(ratio.ravel())[-2]) if ratio.size > 1 and finite else 0.0)
    if not finite:
        q.evidence = "non-finite values (NaN or inf)"
    return q


def _max_ulps(got: np.ndarray, ref: np.ndarray, storage: str) -> float:
    """Max ULPs of `storage` at each element's magnitude, floored at the tensor's RMS magnitude.

    The floor keeps near-zero elements (cancelled sums) from counting ulps of a tiny number.
    """
    rms = float(np.sqrt(np.mean(ref * ref)))
    magnitude = np.where(np.abs(ref) < rms, np.copysign(rms, ref), ref)
    return float(np.max(formats.ulp_distance(got - ref + magnitude, magnitude, storage)))


# ---------------------------------------------------------------------------------------------
# the layout doctor


def layout_transforms() -> list[tuple[str, tuple[str, ...]]]:
    """Every (layout the buffer really holds, flipped axes) but the identity, simplest first."""
    flips = [(), ("H",), ("W",), ("H", "W")]
    candidates = [("".join(p), f) for p in itertools.permutations(CANONICAL) for f in flips]
    candidates = [c for c in candidates if c != (CANONICAL, ())]
    return sorted(candidates, key=lambda c: (sum(a != b for a, b in zip(c[0], CANONICAL)) + len(c[1]), c))


def transform_name(layout: str, flipped: tuple[str, ...]) -> str:
    parts = ([f"layout {layout}"] if layout != CANONICAL else []) + ([f"flip {''.join(flipped)}"] if flipped else [])
    return " + ".join(parts)


def apply_transform(got: np.ndarray, layout: str, flipped: tuple[str, ...]) -> np.ndarray:
    """Read an OIHW-shaped buffer as if it held `layout`, back to OIHW, then undo `flipped` flips."""
    fixed = from_layout(got.reshape(shape_in_layout(got.shape, layout)), layout)
    axes = tuple(CANONICAL.index(a) for a in flipped)
    return np.flip(fixed, axis=axes) if axes else fixed


def layout_fixes(got: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> list[str]:
    """Names of the transforms that bring `got` within `bound` of `ref`, simplest first."""
    fixes = []
    for layout, flipped in layout_transforms():
        fixed = apply_transform(got, layout, flipped)
        if fixed.shape == ref.shape and float(np.max(np.abs(fixed - ref) / bound)) <= 1.0:
            fixes.append(transform_name(layout, flipped))
    return fixes


# ---------------------------------------------------------------------------------------------
# reduced precision: the format's bound plus its error level, measured by emulation


def problem_from_trace(reference: Trace) -> Problem:
    """The float32 problem a reference trace was computed from (target recovered as y − r)."""
    params = reference.meta.get("params")
    if params is None:
        raise ValueError("the reference trace carries no parameters: build it with precision_lab.reference.reference()")
    x = reference.activations[0].detach().cpu().numpy().astype(np.float32)
    g = reference.output_grads[-1].detach().cpu().double()
    residual = (g * (g.numel() / 2.0)).numpy()
    target = (np.asarray(reference.output, np.float64) - residual).astype(np.float32)  # exact: t was float32
    return Problem(x, target, {k: np.asarray(v, np.float32) for k, v in params.items()}, seed=-1, source="reference")


def emulate(reference: Trace, precision: str) -> Result:
    """The same problem computed in float32 with convolution operands rounded to `precision`."""
    problem = problem_from_trace(reference)
    device = reference.activations[0].device
    if precision == "float32":
        return forward_backward(problem, "float32", device)
    return forward_backward(problem, "float32", device, round_inputs=lambda a: formats.round_to(a, precision))


def _rms_error(got, ref) -> float:
    return float(np.sqrt(np.mean((np.asarray(got, np.float64) - ref) ** 2)))


def _fallbacks(claimed: str) -> list[str]:
    u = formats.unit_roundoff(claimed)
    return [f for f in FALLBACK_FORMATS if formats.unit_roundoff(f) > u]


def name_format(result: Result, reference: Trace, claimed: str, witnesses: list[str]) -> tuple[str | None, str]:
    """The coarser format whose emulated error level matches the result's, with the evidence line.

    The witness is the forward output when the result has one (a format acts there too),
    else the gradients beyond the claimed bound (median of their error-level ratios).
    """
    pairs = _quantity_arrays(result, reference)
    witness = ["output"] if "output" in pairs else witnesses
    best, best_distance, levels = None, math.inf, []
    for fmt in _fallbacks(claimed):
        emulated = emulate(reference, fmt)
        emulated_pairs = _quantity_arrays(emulated, reference)
        ratios = [_rms_error(*pairs[w]) / max(_rms_error(*emulated_pairs[w]), np.finfo(float).tiny) for w in witness]
        level = float(np.median(ratios))
        levels.append(f"{fmt} {level:.3g}×")
        distance = abs(math.log(level)) if level > 0 else math.inf
        if distance < best_distance:
            best, best_distance = fmt, distance
    text = f"error level of {'/'.join(witness)} ÷ emulated format: " + ", ".join(levels)
    if best is None or best_distance > math.log(FORMAT_MATCH_FACTOR):
        return None, text + " (no format within a factor √32)"
    return best, text


# ---------------------------------------------------------------------------------------------
# the judgement


def judge(result: Result, reference: Trace, claimed_precision: str = "float32", candidate: str = "") -> Judgement:
    """Compare `result` with the float64 `reference` and give a verdict per quantity and overall."""
    formats.unit_roundoff(claimed_precision)  # unknown precision → ValueError naming the choices
    storage = formats.STORAGE_DTYPE[claimed_precision]
    bounds = errmodel.error_bounds(reference, claimed_precision)
    pairs = _quantity_arrays(result, reference)
    quantities = {}
    for name, (got, ref) in pairs.items():
        quantities[name] = measure(name, got, ref, bounds[name].bound, storage)
        quantities[name].n_terms, quantities[name].relu_flips = bounds[name].n, bounds[name].relu_flips
    judgement = Judgement(candidate or result.meta.get("candidate", ""), claimed_precision, "roundoff", quantities,
                          model=_model_summary(reference, claimed_precision))
    beyond = [name for name, q in quantities.items() if q.verdict != "roundoff" and math.isfinite(q.bound_ratio)]
    _doctor_layouts(judgement, pairs, bounds, [n for n in beyond if n in WEIGHT_NAMES])
    _attribute_precision(judgement, result, reference, [n for n in beyond if quantities[n].verdict == "defect"])
    _overall(judgement)
    return judgement


def _model_summary(reference: Trace, claimed: str) -> dict:
    n = errmodel.n_terms(reference)
    factors = errmodel.summation_factors(n, errmodel.accumulation_precision(claimed))
    return {"bound": "Higham & Mary (2019) probabilistic, propagated through the layers", **factors}


def _doctor_layouts(judgement: Judgement, pairs, bounds, names: list[str]) -> None:
    for name in names:
        got, ref = pairs[name]
        fixes = layout_fixes(got, ref, bounds[name].bound)
        if fixes:
            q = judgement.quantities[name]
            q.verdict, q.layout_fix = "layout", fixes[0]
            judgement.layout_options[name] = fixes
            q.evidence = f"matches within the bound after: {', '.join(fixes[:4])}"


def _attribute_precision(judgement: Judgement, result: Result, reference: Trace, names: list[str]) -> None:
    quantities = judgement.quantities
    isolated = [n for n in names if _is_isolated(quantities[n])]
    for name in isolated:
        quantities[name].evidence = (f"a single element of {quantities[name].size} is beyond the bound "
                                     f"(error ÷ bound {quantities[name].bound_ratio:.3g}), a format step above all "
                                     "others: a precision mode acts on every element")
    broad = [n for n in names if n not in isolated]
    if not broad or not _fallbacks(judgement.claimed_precision):
        return
    if "output" in quantities and quantities["output"].verdict == "roundoff":
        judgement.evidence.append("the forward output is within the claimed bound: no coarser format acts here")
        return
    fmt, level_text = name_format(result, reference, judgement.claimed_precision, broad)
    judgement.evidence.append(level_text)
    if fmt is None:
        return
    fmt_bounds = errmodel.error_bounds(reference, fmt)
    pairs = _quantity_arrays(result, reference)
    for name in broad:
        got, ref = pairs[name]
        ratio = float(np.max(np.abs(got - ref) / fmt_bounds[name].bound))
        q = quantities[name]
        if ratio <= 1.0:
            q.verdict, q.format = "reduced-precision", fmt
            q.evidence = f"within the {fmt} bound (error ÷ bound {ratio:.3g})"
        else:
            q.evidence = f"beyond even the {fmt} bound (error ÷ bound {ratio:.3g})"


def _overall(judgement: Judgement) -> None:
    verdicts = {q.verdict for q in judgement.quantities.values()}
    for verdict in ("defect", "layout", "reduced-precision"):
        if verdict in verdicts:
            judgement.verdict = verdict
            break
    layout_qs = [q for q in judgement.quantities.values() if q.verdict == "layout"]
    if layout_qs:
        options = judgement.layout_options
        common = [fix for fix in options[layout_qs[0].quantity] if all(fix in options[q.quantity] for q in layout_qs)]
        judgement.layout_fix = common[0] if common else "; ".join(f"{q.quantity}: {q.layout_fix}" for q in layout_qs)
    formats_named = sorted({q.format for q in judgement.quantities.values() if q.format},
                           key=FALLBACK_FORMATS.index)
    if formats_named:
        judgement.format = formats_named[-1]
    for q in judgement.quantities.values():
        if q.verdict != "roundoff":
            judgement.evidence.append(f"{q.quantity}: {q.verdict}, {q.exceeding} of {q.size} elements beyond the "
                                      f"bound (max error ÷ bound {q.bound_ratio:.3g}){'; ' + q.evidence if q.evidence else ''}")


# ---------------------------------------------------------------------------------------------
# the empirical noise floor


def noise_floor(problem: Problem, device: str | torch.device = "cpu", reference: Trace | None = None,
                members: tuple[str, ...] | None = None) -> pd.DataFrame:
    """An ensemble of legitimate float32 computations and their spread, beside the model's bound.

    One row per (quantity, member) with the member's max |error| and error ÷ bound against the
    float64 reference, plus a row per quantity for ``member="ensemble-spread"``: the largest
    element-wise spread (max − min over members) and its ratio to the bound.
    """
    import pandas as pd

    from .candidates import registry
    from .reference import reference as make_reference

    reference = errmodel.attach_parameters(reference if reference is not None else make_reference(problem, device),
                                           problem.params)
    bounds = errmodel.error_bounds(reference, "float32")
    legit = [c for c in registry().values() if c.family == "legitimate" and c.claimed_precision == "float32"
             and c.supports(device) and (members is None or c.name in members)]
    if len(legit) < 5:
        raise ValueError(f"noise floor needs at least 5 legitimate float32 members, found {[c.name for c in legit]}")
    rows, stacks = [], {name: [] for name in errmodel.QUANTITIES}
    for candidate in legit:
        pairs = _quantity_arrays(candidate.compute(problem, "float32", device), reference)
        for name, (got, ref) in pairs.items():
            stacks[name].append(got)
            rows.append(_floor_row(name, candidate.name, np.abs(got - ref), bounds[name]))
    for name, stack in stacks.items():
        if stack:
            spread = np.ptp(np.stack(stack), axis=0)
            rows.append(_floor_row(name, "ensemble-spread", spread, bounds[name]))
    return pd.DataFrame(rows)


def _floor_row(name: str, member: str, deviation: np.ndarray, bound: errmodel.QuantityBound) -> dict:
    return {"quantity": name, "member": member, "max_abs_err": float(np.max(deviation)),
            "bound_ratio": float(np.max(deviation / bound.bound)), "bound_max": bound.max, "n_terms": bound.n}


def dumps(judgement: Judgement) -> str:
    """The diagnose JSON as text (no NaN/inf: JSON has neither)."""
    return json.dumps(judgement.to_json(), indent=1)


# ---------------------------------------------------------------------------------------------
# sensitivity: the smallest single-element slip the verdict catches

#: relative perturbation levels tried, 10^-5 … 1 in steps of 10^(1/4) (a quarter decade)
SENSITIVITY_LEVELS = tuple(10.0 ** (e / 4) for e in range(-20, 1))


def single_element_sensitivity(result: Result, reference: Trace, name: str, claimed_precision: str = "float32",
                               index: tuple[int, ...] | None = None,
                               levels: tuple[float, ...] = SENSITIVITY_LEVELS) -> tuple[float | None, tuple[int, ...]]:
    """Smallest ε in `levels` for which g[index]·(1 + ε) in gradient `name` of a legitimate
    `result` is no longer judged ``roundoff`` (None if none is caught); `index` defaults to the
    element of largest |g|. The rest of the result is left as computed (its own rounding included)."""
    bounds = errmodel.error_bounds(reference, claimed_precision)[name].bound
    ref = np.asarray(reference.grads[name], np.float64)
    got = np.asarray(result.grads[name], np.float64)
    index = tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(ref)), ref.shape)) if index is None else index
    for level in sorted(levels):
        slipped = got.copy()
        slipped[index] *= 1 + level
        if float(np.max(np.abs(slipped - ref) / bounds)) > 1.0:
            return level, index
    return None, index
