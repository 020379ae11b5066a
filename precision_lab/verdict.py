"""Verdicts: comparisons explained by the doctors, per quantity and overall (docs/design.md, "Verdicts").

One diagnosis runs one way: the problem → the float64 reference trace (precision_lab.reference)
→ the bounds (precision_lab.errmodel) → the comparisons (precision_lab.compare) → the doctors
(precision_lab.doctors) → the judgement here, each stage reading only what came before it.

Per quantity (loss, output, each parameter gradient) and overall, one verdict:

* ``roundoff`` — every element within the error model's bound for the claimed precision, and no
  coarser format's fingerprint in the errors;
* ``reduced-precision`` — a coarser format explains it (the format is named): beyond the claimed
  bound but within that format's, with the forward output showing the format's error level; or
  inside the bound with the format's fingerprint (the errors correlate with an emulation of that
  format far beyond what legitimate float32 orders do);
* ``layout`` — a weight gradient that matches once its buffer is read in another layout
  (any permutation of O, I, H, W) and/or flipped in H and/or W: the transform is named;
* ``inconclusive`` — within the bound, but a bound so large against the quantity itself that it
  cannot tell rounding from a lost gradient (compare.CERTIFIABLE_FRACTION): not certified;
* ``defect`` — nothing above explains it (a named hypothesis when one fits every failing quantity).

Overall: ``defect`` if any quantity is a defect, else ``layout`` if any, else
``reduced-precision`` if any, else ``inconclusive`` if any, else ``roundoff``. The overall cause is
named only when one cause explains every defect quantity; otherwise it is unknown.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import doctors, errmodel, findings, formats
from .compare import CERTIFIABLE_FRACTION, QuantityVerdict, compare, quantity_arrays  # noqa: F401 - re-exported
from .compute import Result, Trace
from .findings import SEVERITY, VERDICTS, worst  # noqa: F401 - re-exported: the verdicts and their order
from .jsonable import json_safe

if TYPE_CHECKING:  # pandas is imported where a table is built: a diagnosis never needs it
    import pandas as pd



@dataclass
class Judgement:
    """The verdict on one candidate for one problem: overall, per quantity, and how it was reached."""

    candidate: str
    claimed_precision: str
    verdict: str
    quantities: dict[str, QuantityVerdict] = field(default_factory=dict)
    layout_fix: str | None = None
    format: str | None = None
    notes: list[str] = field(default_factory=list)  # the doctors' findings about the whole problem, in words
    model: dict = field(default_factory=dict)
    layout_options: dict[str, list[str]] = field(default_factory=dict)  # every fitting transform per quantity
    layout_advice: str | None = None  # the fix in words a Fortran or CUDA programmer can apply
    cause: str | None = None  # a defect's named hypothesis, or the first failing op
    localisation: str | None = None
    fingerprint: list[dict] = field(default_factory=list)  # correlation with emulated formats, and the null
    hypotheses: list[dict] = field(default_factory=list)  # the defect doctor's tests
    problem: dict = field(default_factory=dict)  # size, batch, seed, source, network
    format_levels: list[dict] = field(default_factory=list)  # each coarser format's error level and pattern
    transforms: dict = field(default_factory=dict)  # each transform named → its steps (('layout', 'IOHW'), ('flip', 'HW'))
    layout_fixes: list = field(default_factory=list)  # (quantity or None for all, transform): the fix, per quantity
    probed: bool | None = None  # a decided judgement (decision.Diagnosis.judgement): whether probes were run
    cause_by: str | None = None  # who named the cause: "doctor", "localisation" or "evidence" (decision.not_rounding)

    @property
    def evidence(self) -> list[str]:
        """How the verdict was reached, in words: each quantity that is not plainly `roundoff`, then the notes."""
        lines = [f"{q.quantity}{f' (on probe {q.problem})' if q.problem else ''}: {q.verdict}, {q.exceeding} of "
                 f"{q.size} elements beyond the bound (max error ÷ bound {q.bound_ratio:.3g})"
                 f"{'; ' + q.evidence if q.evidence else ''}" for q in self.quantities.values() if q.verdict != "roundoff"]
        settled = [q.quantity for q in self.quantities.values() if q.settled_by]
        if settled:
            lines.append(f"settled elsewhere (their bounds here cannot certify): {', '.join(settled)}")
        return list(self.notes) + lines  # the doctors' findings, then what each quantity shows

    def headline(self) -> str:
        """One line: verdict, what names it, and the worst error ÷ bound."""
        detail = self.layout_fix or self.format or self.cause
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
        """The diagnose JSON (docs/verdicts.md): candidate, verdict, claimed_precision, parameters, plus evidence."""
        per = {name: json_safe(asdict(q)) for name, q in self.quantities.items()}
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "layout_fix": self.layout_fix, "layout_advice": self.layout_advice, "format": self.format,
                "cause": self.cause, "localisation": self.localisation, "problem": json_safe(self.problem),
                "parameters": {name: per[name] for name in per if name not in ("loss", "output")},
                "forward": {name: per[name] for name in ("loss", "output") if name in per},
                "evidence": list(self.evidence), "fingerprint": json_safe(self.fingerprint),
                "hypotheses": json_safe(self.hypotheses), "model": json_safe(self.model)}

    def to_text(self) -> str:
        """A readable report: the verdict, then one line of evidence per quantity."""
        lines = [f"candidate {self.candidate}  (claimed {self.claimed_precision})",
                 f"verdict: {self.headline()}"]
        lines += [f"  {q.quantity:<13} {q.verdict:<17} max|err| {q.max_abs_err:9.3g}  err/bound {q.bound_ratio:9.3g}"
                  f"  ulps {q.ulps:9.3g}  cos {q.cosine:.6f}  signs {q.sign_agreement:.3f}"
                  + (f"  fix: {q.layout_fix}" if q.layout_fix else "") + (f"  format: {q.format}" if q.format else "")
                  + (f"  cause: {q.cause}" if q.cause else "")
                  for q in self.quantities.values()]
        if self.layout_advice:
            lines.append(f"  fix: {self.layout_advice}")
        if self.localisation:
            lines.append(f"  where: {self.localisation}")
        lines += [f"  - {line}" for line in self.evidence]
        return "\n".join(lines)


def judge(result: Result, reference: Trace, claimed_precision: str = "float32", candidate: str = "",
          fingerprint: bool | None = None, hypotheses: bool = True) -> Judgement:
    """Compare `result` with the float64 `reference` and give a verdict per quantity and overall.

    `fingerprint`: correlate the errors with emulated coarser formats (None: when cheap enough,
    doctors.RECOMPUTE_LIMIT); `hypotheses`: run the defect doctor when a defect is found.
    """
    formats.unit_roundoff(claimed_precision)  # unknown precision → ValueError naming the choices
    storage = formats.STORAGE_DTYPE[claimed_precision]
    bounds = errmodel.error_bounds(reference, claimed_precision, loss_scale=result.meta.get("loss_scale", 1.0))
    quantities = compare(result, reference, bounds, storage)
    judgement = Judgement(candidate or result.meta.get("candidate", ""), claimed_precision, "roundoff", quantities,
                          model=_model_summary(reference, claimed_precision),
                          problem=reference.problem.describe() if reference.problem is not None else {})
    pairs = quantity_arrays(result, reference)
    # each doctor reads the verdicts the findings before it give (a view, never edited) and returns its own findings
    found = doctors.zero_gradients(quantities, pairs, bounds, storage)
    found += doctors.layouts(findings.apply(quantities, found), result, reference, pairs, bounds)
    found += doctors.precision(findings.apply(quantities, found), claimed_precision, result, reference, pairs, bounds,
                               fingerprint)
    if hypotheses:
        found += doctors.defects(findings.apply(quantities, found), result, reference, pairs, bounds)
    found += doctors.localise(findings.apply(quantities, found), result, reference, claimed_precision)
    return decide_problem(judgement, quantities, found)


def decide_problem(judgement: Judgement, comparisons: dict, found: list) -> Judgement:
    """One problem's judgement from its comparisons and every doctor's findings (precision_lab.findings.apply:
    the order of the findings cannot change it)."""
    judgement.quantities = findings.apply(comparisons, found)
    for f in found:
        if f.doctor == "layout":
            judgement.layout_options[f.quantity] = list(f.numbers["options"])
            judgement.transforms.update(f.numbers["parts"])
    judgement.layout_advice = next((f.name for f in findings.about_problem(found, "layout-advice")), None)
    levels = findings.about_problem(found, "format-levels")
    judgement.format_levels = [row for f in levels for row in f.numbers["levels"]]
    judgement.fingerprint = [row for f in findings.about_problem(found, "fingerprint-table") for row in f.numbers["rows"]]
    judgement.hypotheses = [row for f in findings.about_problem(found, "hypotheses") for row in f.numbers["tested"]]
    judgement.notes = [f.evidence for f in found if f.quantity is None and f.evidence
                       and f.doctor in ("note", "format-levels", "cause")]
    localisation = next((f for f in findings.about_problem(found, "localisation")), None)
    judgement.localisation = localisation.name if localisation is not None else None
    cause = next((f.name for f in findings.about_problem(found, "cause")), None)
    judgement.cause_by = "doctor" if cause is not None else None
    if cause is None and localisation is not None and localisation.numbers.get("by") == "intermediates" \
            and any(q.verdict == "defect" for q in judgement.quantities.values()):
        cause, judgement.cause_by = localisation.name, "localisation"  # the first op that fails its own check
    judgement.cause = cause
    overall(judgement)
    return judgement


def _model_summary(reference: Trace, claimed: str) -> dict:
    n = max(errmodel.terms_per_quantity(reference).values())
    factors = errmodel.summation_factors(n, errmodel.accumulation_precision(claimed))
    return {"bound": "Higham & Mary (2019) probabilistic, propagated through the layers", **factors}


def overall(judgement: Judgement) -> None:
    """The overall verdict, transform, format and cause from the quantities' (worst first)."""
    judgement.verdict = worst(q.verdict for q in judgement.quantities.values())
    layout_qs = [q for q in judgement.quantities.values() if q.verdict == "layout"]
    if layout_qs:
        options = judgement.layout_options
        common = [fix for fix in options[layout_qs[0].quantity] if all(fix in options[q.quantity] for q in layout_qs)]
        judgement.layout_fixes = [(None, common[0])] if common else [(q.quantity, q.layout_fix) for q in layout_qs]
        judgement.layout_fix = common[0] if common else "; ".join(f"{q.quantity}: {q.layout_fix}" for q in layout_qs)
    formats_named = sorted({q.format for q in judgement.quantities.values() if q.format},
                           key=doctors.FALLBACK_FORMATS.index)
    if formats_named and judgement.verdict == "reduced-precision":
        judgement.format = formats_named[-1]
    if judgement.verdict == "defect" and judgement.cause is None:
        # a cause is named only when it explains every defect quantity, not one tensor of several
        causes = {q.cause for q in judgement.quantities.values() if q.verdict == "defect"}
        judgement.cause = causes.pop() if len(causes) == 1 else None
        judgement.cause_by = "doctor" if judgement.cause is not None else None


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
