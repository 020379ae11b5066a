"""A single diagnosis as a self-contained HTML page, in the reports' style (`diagnose --html OUT`).

The page is what a reviewer who never runs the lab reads: the verdict with what names it, the
cause, the fix, the first failing quantity, what fails and the probes' verdicts — written from the
same `Summary` as the text verdict (precision_lab.diagnosis), so the two never disagree — then the
conclusion in words (precision_lab.conclusions) of the judgement that decided it, the run context,
the evidence per quantity as a table for people (precision_lab.tables), the evidence lines and the
error model used. Everything is escaped text;
the stylesheet is inline; there is no script and nothing is fetched.
"""
from __future__ import annotations

import datetime as dt

from . import conclusions, tables

#: evidence columns of a judgement, in reading order (precision_lab.verdict.QuantityVerdict)
EVIDENCE_COLUMNS = ("quantity", "verdict", "max_abs_err", "mean_abs_err", "bound_ratio", "exceeding", "ulps",
                    "cosine", "sign_agreement", "layout_fix", "format")


def _model_rows(model: dict) -> list[tuple[str, str]]:
    rows = []
    for key, value in model.items():
        text = tables.format_number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        rows.append((str(key).replace("_", " "), text))
    return rows


def diagnosis_page(diagnosis, problem=None, device_info: dict | None = None, title: str | None = None) -> str:
    """The whole HTML document for one diagnosis (precision_lab.decision.Diagnosis: a judgement alone is
    `Diagnosis(judgement)`; diagnose imports this module, so this one does not import it back)."""
    summary = diagnosis.summary()
    judgement = diagnosis.deciding()
    conclusion = conclusions.from_judgement(judgement, lead=f"{summary.candidate} is {summary.headline}.")
    frame = judgement.to_frame()
    columns = [c for c in EVIDENCE_COLUMNS if c in frame.columns]
    context = tables.context_rows(device_info, problem) if device_info is not None else []
    context += [("claimed precision", judgement.claimed_precision),
                ("written", dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))]
    evidence = "".join(f"<li>{tables.escape(line)}</li>" for line in judgement.evidence + diagnosis.notes())
    heading = title or f"precision-lab diagnosis: {summary.candidate}"
    evidence_heading = ("Evidence per quantity" if judgement is diagnosis.main
                        else f"Evidence per quantity, {summary.decided_by}")
    return tables.page(heading, f"""<p>{tables.verdict_chip(summary.headline, summary.verdict)} {tables.escape(_headline(judgement))}</p>
{_summary_html(summary)}
{conclusion.html()}
<h2>Run context</h2>
{tables.definition_table(context, "run-context")}
<h2>{tables.escape(evidence_heading)}</h2>
{tables.table_html(frame, columns, table_id="evidence")}
{f'<h3>How the verdict was reached</h3><ul class="lab-evidence">{evidence}</ul>' if evidence else ''}
<h2>Error model</h2>
{tables.definition_table(_model_rows(judgement.model), "error-model")}
<p class="lab-note">The bound per element is the probabilistic bound of Higham &amp; Mary (2019), λ·√n·u·S with
S = Σ|terms|, propagated through the layers; error ÷ bound ≤ 1 is rounding (docs/verdicts.md).</p>
""")


def _summary_html(summary) -> str:
    """The text verdict's lines as a definition table: verdict, cause, fix, where, what fails, probes."""
    rows = [("verdict", summary.headline)]
    if summary.named and summary.decided_by != "the requested problem":
        rows.append(("named on", summary.decided_by))
    rows += [(label, value) for label, value in (("cause", summary.cause), ("fix", summary.fix),
                                                 ("first failing", summary.first_failing),
                                                 ("repeats", summary.repeats),
                                                 ("float64 build", summary.float64_build),
                                                 ("probes chosen", summary.probe_note)) if value]
    if summary.failing:
        rows.append((f"beyond the bound on {summary.failing[0][0]}", "; ".join(
            f"{q.quantity}: {q.verdict}, max error ÷ bound {tables.format_number(q.bound_ratio)}"
            for _, q in summary.failing)))
    if summary.within:
        rows.append(("within the bound", ", ".join(summary.within)))
    if summary.settled:
        rows.append(("settled elsewhere (too large a bound here to certify rounding)", ", ".join(summary.settled)
                     + ": certified on every probe or by the float64 build"))
    for name, problem_text, verdict, named in summary.probes:
        rows.append((f"probe {name} ({problem_text})", verdict + (f" ({named})" if named else "")))
    return tables.definition_table(rows, "summary")


def _headline(judgement) -> str:
    worst = max(judgement.quantities.values(), key=lambda q: q.bound_ratio)
    return f"worst: {worst.quantity}, max error ÷ bound {tables.format_number(worst.bound_ratio)}"


def write_diagnosis_page(path, diagnosis, problem=None, device_info: dict | None = None) -> None:
    """Write the page; a path that cannot be written is one clear line (LabInputError)."""
    from pathlib import Path

    from .errors import LabInputError

    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(diagnosis_page(diagnosis, problem, device_info), encoding="utf-8")
    except OSError as exc:
        raise LabInputError(f"{out}: cannot write the HTML diagnosis ({exc.strerror})") from None


__all__ = ["diagnosis_page", "write_diagnosis_page"]
