"""Conclusions in words, written from a run's own numbers: what was found, on which evidence, what to do.

Every report ends with one (`Conclusion`): a lead sentence answering the notebook's question, then
per candidate its verdict, the two or three measurements that decide it (each with its bound or
null hypothesis) and what to do. Nothing here is fixed text about an outcome: every sentence is
chosen by the verdicts and filled with the measured numbers, so a different run says different
things. `run_summary` writes the index's opening paragraph from the notebooks' conclusions.

This module holds the data model and the words every conclusion shares (verdicts, transforms, actions);
each experiment writes its own conclusion (`experiments.<experiment>.conclude`) with its own thresholds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .tables import HtmlBlock, escape, format_number, verdict_chip, verdict_class, verdict_legend
from .findings import SEVERITY, worst

NOTHING_TO_FIX = "The difference is rounding: nothing to fix."


@dataclass
class Measurement:
    """One deciding number: what it is, its value, and the bound or null it is read against."""

    label: str
    value: str
    against: str = ""

    def text(self) -> str:
        return f"{self.label}: {self.value}" + (f" ({self.against})" if self.against else "")


@dataclass
class Finding:
    """One candidate's conclusion in one experiment."""

    candidate: str
    verdict: str
    finding: str
    measurements: list[Measurement] = field(default_factory=list)
    action: str = ""
    detail: str = ""  # what names the verdict: a transform (flip HW) or a format (tf32)

    @property
    def verdict_text(self) -> str:
        return f"{self.verdict} ({self.detail})" if self.detail else self.verdict


@dataclass
class Conclusion:
    """A notebook's conclusion: the lead sentence, one finding per candidate, notes."""

    experiment: str
    lead: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_frame(self):
        """One row per candidate (saved as `conclusions.csv`; the index's summary reads it)."""
        import pandas as pd

        return pd.DataFrame([{"candidate": f.candidate, "experiment": self.experiment, "verdict": f.verdict,
                              "detail": f.detail, "finding": f.finding,
                              "evidence": "; ".join(m.text() for m in f.measurements), "action": f.action}
                             for f in self.findings],
                            columns=["candidate", "experiment", "verdict", "detail", "finding", "evidence", "action"])

    def html(self) -> str:
        parts = ['<div class="lab-conclusion" id="conclusion"><h2>Conclusion</h2>',
                 f'<p class="lead">{escape(self.lead)}</p>']
        for f in self.findings:
            items = "".join(f"<li>{escape(m.text())}</li>" for m in f.measurements)
            parts.append(f'<div class="lab-finding"><p>{verdict_chip(f.verdict_text, f.verdict)} '
                         f'<span class="candidate">{escape(f.candidate)}</span> — {escape(f.finding)}</p>'
                         + (f"<ul>{items}</ul>" if items else "")
                         + (f'<p class="lab-action"><strong>What to do:</strong> {escape(f.action)}</p>'
                            if f.action else "") + "</div>")
        parts += [f'<p class="lab-note">{escape(note)}</p>' for note in self.notes]
        parts.append(verdict_legend({f.verdict for f in self.findings}))
        return "".join(parts) + "</div>"

    def text(self) -> str:
        lines = ["Conclusion", self.lead, ""]
        for f in self.findings:
            lines.append(f"[{f.verdict_text}] {f.candidate}: {f.finding}")
            lines += [f"  - {m.text()}" for m in f.measurements]
            lines += [f"  What to do: {f.action}"] if f.action else []
        return "\n".join(lines + self.notes)

    def _repr_html_(self) -> str:
        return HtmlBlock(self.html())._repr_html_()

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__


# ---------------------------------------------------------------------------------------------
# words for verdicts, transforms and actions (shared by every experiment and the diagnosis page)


def worst_verdict(verdicts) -> str:
    """The worst verdict across experiments (verdict.worst); a word it does not rank is shown as it is."""
    present = set(verdicts)
    return worst(present) if present & set(SEVERITY) else next(iter(present), "—")


def _axes_in_words(axes: str) -> str:
    return " and ".join(axes)


def describe_transform(parts) -> str:
    """(('flip', 'HW'),) → 'flipped in H and W'; (('layout', 'IOHW'),) → 'read as IOHW' (doctors.transform_parts)."""
    return " and ".join(f"read as {value}" if kind == "layout" else f"flipped in {_axes_in_words(value)}"
                        for kind, value in parts)


def layout_action(fixes, transforms: dict) -> str:
    """What to do about a layout verdict: the declaration or the flip that makes the buffer match. `fixes`: (quantity
    or None for every one, transform name) (Judgement.layout_fixes); `transforms`: each name's steps."""
    sentences = []
    for name, transform in fixes:
        parts = transforms.get(transform, ())
        steps = []
        for kind, value in parts:
            if kind == "layout":
                # not "declare weight_layout {value}": that also changes the layout the weights arrive in
                steps.append(f"transpose it from {value} to the layout it is declared in before writing")
            else:
                steps.append(f"flip {_axes_in_words(value)} where the gradient is converted (or remove the flip "
                             "the conversion already does)")
        where = f"{name}: " if name else ""
        sentences.append(f"{where}the gradient matches once {describe_transform(parts) or transform}; "
                         + " and ".join(steps or [f"apply {transform}"]) + " before comparing")
    text = "; ".join(sentences)
    return text[:1].upper() + text[1:] + "."


def precision_action(fmt: str) -> str:
    """What to do about a reduced-precision verdict: turn the coarser format off, or claim it."""
    if fmt == "tf32":
        return ("TF32 is on: set torch.backends.cudnn.allow_tf32 = False (and torch.backends.cuda.matmul.allow_tf32 "
                "= False; in your own cuDNN code use cudnnSetConvolutionMathType(convDesc, CUDNN_FMA_MATH)), or compare "
                "against a TF32 bound (precision: tf32 in the candidate's YAML).")
    return (f"Operands are rounded to {fmt}: compute the convolutions in float32 (turn off autocast or mixed "
            f"precision), or compare against a {fmt} bound (precision: {fmt} in the candidate's YAML).")


def _backprop_order(names: list[str]) -> list[str]:
    """Quantities in the order backpropagation produces them: loss and output first, then the
    parameters from the last layer back (judgement order is forward)."""
    forward = [n for n in names if n in ("loss", "output")]
    return forward + list(reversed([n for n in names if n not in ("loss", "output")]))


def defect_action(judgement) -> str:
    """Which quantities are beyond the bound and by how far, and where to start looking."""
    bad = [q for q in judgement.quantities.values() if q.verdict == "defect"]
    if not bad:
        return "Find the bug: the evidence above names the quantities beyond the bound."
    described = ", ".join(f"{q.quantity} (error ÷ bound {format_number(q.bound_ratio)}, {q.exceeding} of "
                          f"{q.size} elements beyond the bound)" for q in bad)
    first = _backprop_order([q.quantity for q in bad])[0]
    hints = [q.evidence for q in bad if q.evidence]
    return (f"Find the bug: no transform of the axes or coarser format explains {described}. Start with {first}, "
            "the first of them in backpropagation order" + (f" ({hints[0]})" if hints else "") + ".")


def action_for(judgement) -> str:
    """What to do, from a judgement (precision_lab.verdict.Judgement)."""
    if judgement.verdict == "roundoff":
        return NOTHING_TO_FIX
    if judgement.verdict == "layout" and judgement.layout_fixes:
        return layout_action(judgement.layout_fixes, judgement.transforms)
    if judgement.verdict == "reduced-precision" and judgement.format:
        return precision_action(judgement.format)
    return defect_action(judgement)


def worst_quantity(judgement, verdict: str | None = None):
    quantities = [q for q in judgement.quantities.values() if verdict is None or q.verdict == verdict]
    return max(quantities or judgement.quantities.values(), key=lambda q: q.bound_ratio)


def judgement_detail(judgement) -> str:
    return judgement.layout_fix if judgement.verdict == "layout" else (
        judgement.format if judgement.verdict == "reduced-precision" else "") or ""


def _transform_words(judgement) -> str:
    """The layout fix in words ('flipped in H and W'), per quantity where they differ."""
    return "; ".join((f"{name}: " if name else "") + (describe_transform(judgement.transforms.get(fix, ())) or fix)
                     for name, fix in judgement.layout_fixes) or (judgement.layout_fix or "")


def judgement_phrase(judgement) -> str:
    """The judgement in one clause: 'within the float32 rounding bound (…)' / 'beyond it … matches once …'."""
    claimed = judgement.claimed_precision
    worst = worst_quantity(judgement)
    if judgement.verdict == "roundoff":
        return (f"within the {claimed} rounding bound everywhere (worst: {worst.quantity}{_on(worst)}, error ÷ bound "
                f"{format_number(worst.bound_ratio)})")
    off = [q for q in judgement.quantities.values() if q.verdict == judgement.verdict]
    names = ", ".join(q.quantity for q in off)
    if judgement.verdict == "layout":
        return (f"beyond the {claimed} bound in {names} (error ÷ bound up to {format_number(worst.bound_ratio)}), "
                f"and within it once the gradient is {_transform_words(judgement)}")
    if judgement.verdict == "reduced-precision":
        return (f"beyond the {claimed} bound in {names} (error ÷ bound up to {format_number(worst.bound_ratio)}) "
                f"but within the {judgement.format} bound, with {judgement.format}'s error level")
    bad = worst_quantity(judgement, "defect")
    return (f"beyond the {claimed} bound in {names} (error ÷ bound up to {format_number(bad.bound_ratio)}, "
            f"{bad.exceeding} of {bad.size} elements of {bad.quantity}{_on(bad)}), and no transform or coarser format "
            "explains it" + (f" ({judgement.cause})" if judgement.cause else ""))


def _on(q) -> str:
    """' on probe 61x67-batch2-seed0' for a quantity a decision took from a probe (precision_lab.decision)."""
    return f" on probe {q.problem}" if getattr(q, "problem", None) else ""


def judgement_measurements(judgement) -> list[Measurement]:
    """The two or three numbers that decide a judgement, each against its bound."""
    worst = worst_quantity(judgement)
    found = [Measurement(f"max error ÷ bound, {worst.quantity}{_on(worst)}", format_number(worst.bound_ratio),
                         f"rounding at {judgement.claimed_precision}: ≤ 1")]
    if judgement.verdict == "roundoff":
        found.append(Measurement(f"max |error|, {worst.quantity}", format_number(worst.max_abs_err),
                                 f"its largest bound {format_number(worst.bound_max)}"))
    elif judgement.verdict == "layout":
        found.append(Measurement(f"elements of {worst.quantity} beyond the bound", f"{worst.exceeding} of {worst.size}",
                                 "rounding: 0"))
        found.append(Measurement(f"after {judgement.layout_fix}", "every element within the bound",
                                 "the layout doctor's test"))
    elif judgement.verdict == "reduced-precision":
        if judgement.format_levels:
            found.append(Measurement("error level ÷ each format's emulated level", ", ".join(
                f"{row['format']} {format_number(row['level'])}× (pattern r = {row['correlation']:.2f})"
                for row in judgement.format_levels), "a format names it within a factor √32, with its pattern"))
        for q in judgement.quantities.values():
            if q.verdict == "reduced-precision" and q.format_bound_ratio is not None:
                found.append(Measurement(f"max error ÷ {q.format} bound, {q.quantity}{_on(q)}",
                                         format_number(q.format_bound_ratio), f"{q.format} rounding: ≤ 1"))
                break
    else:
        bad = worst_quantity(judgement, "defect")
        found.append(Measurement(f"elements of {bad.quantity} beyond the bound{_on(bad)}",
                                 f"{bad.exceeding} of {bad.size}", "rounding: 0"))
        found.append(Measurement(f"cosine similarity, {bad.quantity}{_on(bad)}", f"{bad.cosine:.6f}", "a layout slip or "
                                 "a bug lowers it; rounding leaves it at 1 to ~7 digits"))
    return found


def from_judgement(judgement, experiment: str = "diagnose", lead: str | None = None) -> Conclusion:
    """A single diagnosis's conclusion (the diagnose HTML page, and any notebook that only judges)."""
    finding = Finding(judgement.candidate, judgement.verdict,
                      f"Against the float64 reference its results are {judgement_phrase(judgement)}.",
                      judgement_measurements(judgement), action_for(judgement), judgement_detail(judgement))
    return Conclusion(experiment, lead or f"{judgement.candidate} is {finding.verdict_text}.", [finding])


def verdict_groups(findings: list[Finding]) -> str:
    """'native, fortran-replay: roundoff; fortran-replay-flip: layout (flip HW)'."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in findings:
        groups.setdefault((f.verdict, f.verdict_text), []).append(f.candidate)
    order = sorted(groups, key=lambda key: SEVERITY.index(key[0]) if key[0] in SEVERITY else len(SEVERITY), reverse=True)
    return "; ".join(f"{', '.join(groups[key])}: {key[1]}" for key in order)


def action_for_verdict(verdict: str, judgement, override_reason: str) -> str:
    """The action when an experiment's verdict is the judgement's own, or the reason it overrides it."""
    if verdict == judgement.verdict:
        return action_for(judgement)
    return override_reason


def unprobed_notes(decided) -> list[str]:
    """A note naming the candidates judged without the probes (precision_lab.decision: `probed` False)."""
    names = [name for name, d in (decided or {}).items() if getattr(d, "probed", True) is False]
    if not names:
        return []
    return [f"Unprobed: {', '.join(names)} judged on the requested problem alone (probes = \"none\"); boundary and "
            "indexing slips that hide under its bound are not ruled out — run with the default probes for a verdict."]


def skipped_notes(skipped) -> list[str]:
    return [f"Not run here: {note}." for note in skipped]


# ---------------------------------------------------------------------------------------------
# the index: the whole run in words


def run_summary(conclusions, summaries) -> dict:
    """The index's opening: a lead sentence and one line per verdict group, from every notebook's
    conclusions (or, for notebooks that wrote none, their summary tables)."""
    import pandas as pd

    frames = []
    if conclusions is not None and len(conclusions):
        frames.append(conclusions)
    if summaries is not None and len(summaries):
        covered = set() if conclusions is None or not len(conclusions) else set(conclusions.experiment)
        rest = summaries[~summaries.experiment.isin(covered)]
        if len(rest):
            frames.append(rest.assign(detail="", action=""))
    if not frames:
        return {"lead": "No notebook wrote a verdict.", "lines": []}
    rows = pd.concat(frames, ignore_index=True)
    rows = rows.assign(detail=rows["detail"].fillna("") if "detail" in rows else "",
                       action=rows["action"].fillna("") if "action" in rows else "")
    experiments = list(dict.fromkeys(rows.experiment))
    lines, clean = [], []
    for candidate, group in rows.groupby("candidate", sort=False):
        verdict = worst_verdict(group.verdict)
        if verdict == "roundoff":
            clean.append(candidate)
            continue
        where = _experiments_in_words(group)
        chosen = group[group.verdict == verdict].iloc[0]
        detail = f" ({chosen.detail})" if chosen.detail else ""
        lines.append({"verdict": verdict, "verdict_class": verdict_class(verdict), "candidates": candidate, "text": f"{verdict}{detail} — {where}",
                      "action": chosen.action or "See the reports for the quantities beyond the bound."})
    if clean:
        lines.insert(0, {"verdict": "roundoff", "verdict_class": verdict_class("roundoff"), "candidates": ", ".join(clean),
                         "text": "roundoff in every experiment that judged them", "action": NOTHING_TO_FIX})
    judged = rows.candidate.nunique()
    flagged = judged - len(clean)
    lead = (f"{judged} implementations judged in {len(experiments)} experiments: "
            f"{len(clean)} within rounding in every experiment"
            + (f", {flagged} not ({', '.join(line['candidates'] for line in lines if line['verdict'] != 'roundoff')})"
               if flagged else "") + ".")
    return {"lead": lead, "lines": lines}


def _experiments_in_words(group) -> str:
    """'layout in 01, 02, 04; defect in 03' (experiment numbers), or 'in 01, 02' when they agree."""
    by_verdict: dict[str, list[str]] = {}
    for row in group.itertuples():
        text = f"{row.verdict} ({row.detail})" if isinstance(row.detail, str) and row.detail else row.verdict
        by_verdict.setdefault(text, []).append(str(row.experiment).split("-")[0])
    if len(by_verdict) == 1:
        return "in " + ", ".join(next(iter(by_verdict.values())))
    return "; ".join(f"{verdict} in {', '.join(where)}" for verdict, where in by_verdict.items())


__all__ = ["Conclusion", "Finding", "Measurement", "NOTHING_TO_FIX", "action_for", "action_for_verdict",
           "describe_transform", "from_judgement", "judgement_detail", "judgement_measurements", "judgement_phrase",
           "layout_action", "precision_action", "run_summary", "skipped_notes", "unprobed_notes", "verdict_groups",
           "worst_quantity", "worst_verdict"]
