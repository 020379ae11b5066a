"""What the doctors found, as records (docs/design.md, "Explaining a verdict").

A doctor reads the comparisons and the float64 reference and returns `Finding`s; it never edits a
judgement. `apply` makes one problem's verdict per quantity from the comparisons and every finding,
each quantity taking the finding of highest `PRECEDENCE` (a gradient never computed before a layout,
a layout before a coarser format, a format before a named defect), so the order in which findings
arrive cannot change the outcome. Findings about the whole problem (`quantity` None) carry what the
judgement reports beside its quantities: the layout fix in words, the formats' error levels, the
fingerprint's table, the hypotheses tested, the overall cause, where the failure starts.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

VERDICTS = ("roundoff", "reduced-precision", "layout", "defect", "inconclusive")
#: worst first: the overall verdict of several quantities (or problems) is the first present
SEVERITY = ("defect", "layout", "reduced-precision", "inconclusive", "roundoff")


def worst(verdicts) -> str:
    present = set(verdicts)
    return next((v for v in SEVERITY if v in present), "roundoff")


#: which finding decides a quantity's verdict when several would: the first in this order
PRECEDENCE = ("zero-gradient", "layout", "format-level", "fingerprint", "format-excuse")
#: findings that add to a quantity's evidence without changing its verdict, in the order their words are shown
EVIDENCE_ONLY = ("isolated", "beyond-format", "hypothesis")


@dataclass(frozen=True)
class Finding:
    """One doctor's finding: about one quantity (its verdict, what names it, the numbers), or about the problem."""

    doctor: str  # zero-gradient, layout, format-level, fingerprint, format-excuse, isolated, beyond-format,
    # hypothesis; problem-wide: layout-advice, note, format-levels, fingerprint-table, hypotheses, cause, localisation
    quantity: str | None = None  # None: about the whole problem
    verdict: str | None = None  # the verdict it gives the quantity; None: evidence only
    name: str | None = None  # the transform, the format or the cause it names
    evidence: str = ""  # words for people, made once from `numbers`
    numbers: dict = field(default_factory=dict)


def _rank(finding: Finding) -> int:
    order = PRECEDENCE + EVIDENCE_ONLY
    return order.index(finding.doctor) if finding.doctor in order else len(order)


def apply(comparisons: dict, findings: list[Finding]) -> dict:
    """Each quantity's verdict from its comparison (provisional) and the findings about it, on copies: the finding
    first in PRECEDENCE decides the verdict and names it; a named hypothesis names a defect's cause; the rest add
    words. The order of `findings` does not matter."""
    out = {name: copy.copy(q) for name, q in comparisons.items()}
    for name, q in out.items():
        mine = sorted((f for f in findings if f.quantity == name), key=_rank)
        deciding = next((f for f in mine if f.doctor in PRECEDENCE), None)
        if deciding is not None:
            q.verdict = deciding.verdict
            if deciding.doctor == "zero-gradient":
                q.cause, q.cause_slip = deciding.name, deciding.name
                q.evidence = _joined(q.evidence, deciding.evidence)
            else:
                if deciding.doctor == "layout":
                    q.layout_fix = deciding.name
                else:
                    q.format, q.format_bound_ratio = deciding.name, deciding.numbers.get("format_bound_ratio")
                    q.along_resolution = deciding.numbers.get("along_resolution", q.along_resolution)
                q.evidence = deciding.evidence
        else:
            for f in mine:
                if f.doctor in ("isolated", "beyond-format"):
                    q.evidence = f.evidence  # the last word on a quantity no format explains
        fitted = min((f for f in mine if f.doctor == "hypothesis"), key=lambda f: f.numbers.get("order", 0), default=None)
        if fitted is not None and q.verdict == "defect" and q.cause is None:
            q.cause, q.cause_slip = fitted.name, fitted.numbers.get("slip", fitted.name)
            q.cause_layers = tuple(fitted.numbers.get("layers", ()))
            q.evidence = _joined(q.evidence, fitted.evidence)
    return out


def _joined(first: str, second: str) -> str:
    return f"{first}; {second}" if first and second else first or second


def about_problem(findings: list[Finding], doctor: str) -> list[Finding]:
    """The problem-wide findings of one kind, in the order they were made."""
    return [f for f in findings if f.quantity is None and f.doctor == doctor]
