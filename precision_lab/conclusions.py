"""Conclusions in words, written from a run's own numbers: what was found, on which evidence, what to do.

Every report ends with one (`Conclusion`): a lead sentence answering the notebook's question, then
per candidate its verdict, the two or three measurements that decide it (each with its bound or
null hypothesis) and what to do. Nothing here is fixed text about an outcome: every sentence is
chosen by the verdicts and filled with the measured numbers, so a different run says different
things. `run_summary` writes the index's opening paragraph from the notebooks' conclusions.

The thresholds quoted are the experiments' own (imported, never restated): the rounding bound
(error ÷ bound ≤ 1, precision_lab.verdict), the float64 vanishing boundary √(u64/u32)
(experiments.float64_recompilation), the envelope margin (experiments.optimizer_step), the
defect level relative to |g| (experiments.size_sweep).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .tables import (HtmlBlock, escape, format_factor, format_number, format_percent, format_range, format_reported,
                     verdict_chip, verdict_class, verdict_legend)
from .verdict import SEVERITY, worst

NOTHING_TO_FIX = "The difference is rounding: nothing to fix."
#: fitted exponents α of error ÷ (u·S) ∝ nᵅ (experiments.size_sweep): operand rounding in a coarser format predicts
#: −0.5, float32 accumulation 0 (pairwise) to 0.5 (recursive), the worst case 1 (γₙ, Higham 2002, Lemma 3.1);
#: each boundary is the midpoint between neighbouring predictions
SHRINKING_BELOW, GROWING_ABOVE = -0.25, 0.75


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


def _worst(judgement, verdict: str | None = None):
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
    worst = _worst(judgement)
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
    bad = _worst(judgement, "defect")
    return (f"beyond the {claimed} bound in {names} (error ÷ bound up to {format_number(bad.bound_ratio)}, "
            f"{bad.exceeding} of {bad.size} elements of {bad.quantity}{_on(bad)}), and no transform or coarser format "
            "explains it" + (f" ({judgement.cause})" if judgement.cause else ""))


def _on(q) -> str:
    """' on probe 61x67-batch2-seed0' for a quantity a decision took from a probe (precision_lab.decision)."""
    return f" on probe {q.problem}" if getattr(q, "problem", None) else ""


def judgement_measurements(judgement) -> list[Measurement]:
    """The two or three numbers that decide a judgement, each against its bound."""
    worst = _worst(judgement)
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
        bad = _worst(judgement, "defect")
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


def _verdict_groups(findings: list[Finding]) -> str:
    """'native, fortran-replay: roundoff; fortran-replay-flip: layout (flip HW)'."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in findings:
        groups.setdefault((f.verdict, f.verdict_text), []).append(f.candidate)
    order = sorted(groups, key=lambda key: SEVERITY.index(key[0]) if key[0] in SEVERITY else len(SEVERITY), reverse=True)
    return "; ".join(f"{', '.join(groups[key])}: {key[1]}" for key in order)


def _action_for_verdict(verdict: str, judgement, override_reason: str) -> str:
    """The action when an experiment's verdict is the judgement's own, or the reason it overrides it."""
    if verdict == judgement.verdict:
        return action_for(judgement)
    return override_reason


# ---------------------------------------------------------------------------------------------
# 01 optimizer step


def optimizer_step(summary, masking, envelope, judgements: dict, lr: float, adam_lr: float, steps: int | None = None,
                   skipped=()) -> Conclusion:
    """01: the gradient verdicts, what one SGD/Adam step shows of each error, and the k-step trajectories."""
    from .experiments.optimizer_step import ENVELOPE_MARGIN, EXPERIMENT

    masking = masking.set_index("candidate")
    inside = {} if envelope is None else envelope.set_index("candidate").to_dict("index")
    findings = []
    for row in summary.itertuples():
        judgement, m = judgements[row.candidate], masking.loc[row.candidate]
        text = (f"Its gradients are {judgement_phrase(judgement)}. One SGD step (lr = {lr:g}) carries the gradient "
                f"error unchanged into the update lr·g ({format_number(m.sgd_update_rel_err)} relative, against "
                f"{format_number(m.grad_rel_err)} in the gradient) but shows it {format_factor(m.weights_hide_by)} "
                f"smaller in the weights, where it changes {format_percent(m.error_visible_in_weights)} of the stored "
                "float32 values.")
        measurements = judgement_measurements(judgement)[:2] + [
            Measurement("weights after one SGD step hide the gradient error by", format_factor(m.weights_hide_by),
                        "the update lr·g hides nothing: compare updates")]
        if row.candidate in inside:
            e = inside[row.candidate]
            where = "stay inside" if e["inside_envelope"] else "leave"
            text += (f" Over {steps if steps is not None else 'k'} SGD steps its weights {where} the envelope of "
                     f"legitimate float32 implementations (worst step at {format_factor(e['max_distance_over_envelope'])}"
                     f" the envelope's edge).")
            measurements.append(Measurement("weight distance to float64 ÷ envelope edge, worst step",
                                            format_factor(e["max_distance_over_envelope"]),
                                            f"inside: ≤ {ENVELOPE_MARGIN:g}×"))
        findings.append(Finding(row.candidate, row.verdict, text, measurements, action_for(judgement),
                                judgement_detail(judgement)))
    hide = masking.weights_hide_by
    lead = (f"Comparing weights after one SGD step (lr = {lr:g}) hides a gradient error by "
            f"{format_range(hide.min(), hide.max())}×, and Adam's first step (lr = {adam_lr:g}) is lr·sign(g) in at "
            f"least {format_percent(masking.adam_sign_only_fraction.min())} of elements, so neither comparison tells "
            f"rounding from a bug; judged on the gradients (and the updates, which keep their error): "
            f"{_verdict_groups(findings)}.")
    return Conclusion(EXPERIMENT, lead, findings, _skipped_notes(skipped) + unprobed_notes(judgements))


def unprobed_notes(decided) -> list[str]:
    """A note naming the candidates judged without the probes (precision_lab.decision: `probed` False)."""
    names = [name for name, d in (decided or {}).items() if getattr(d, "probed", True) is False]
    if not names:
        return []
    return [f"Unprobed: {', '.join(names)} judged on the requested problem alone (probes = \"none\"); boundary and "
            "indexing slips that hide under its bound are not ruled out — run with the default probes for a verdict."]


def _skipped_notes(skipped) -> list[str]:
    return [f"Not run here: {note}." for note in skipped]


# ---------------------------------------------------------------------------------------------
# 02 float64 recompilation


def float64_recompilation(summary, table, judgements: dict, skipped=()) -> Conclusion:
    """02: does each candidate's error vanish when it is recompiled in float64?"""
    from .experiments.float64_recompilation import EXPECTED_RATIO, EXPERIMENT, VANISH_THRESHOLD

    findings, vanished, persisted, untested = [], [], [], []
    against = (f"vanishes: ≤ {format_number(VANISH_THRESHOLD)}; rounding predicts {format_number(EXPECTED_RATIO)}, "
               "a defect ≈ 1")
    for row in summary.itertuples():
        judgement = judgements[row.candidate]
        group = table[(table.candidate == row.candidate) & (table.quantity != "loss")]
        persists = group[group.finding == "persists in float64"]
        worst_ratio = group.ratio.max()
        measurements = []
        if group.finding.eq("no float64 build").all():
            untested.append(row.candidate)
            text = ("It has no float64 build, so this experiment cannot show whether its error vanishes with the "
                    f"arithmetic; the verdict rests on the float32 bound: its results are {judgement_phrase(judgement)}.")
        elif len(persists):
            persisted.append(row.candidate)
            text = (f"Recompiled in float64, the error of {', '.join(persists.quantity)} stays (err64 ÷ err32 up to "
                    f"{format_number(worst_ratio)}, where rounding error would fall to {format_number(EXPECTED_RATIO)}): "
                    f"it does not come from the arithmetic. In float32 its results are {judgement_phrase(judgement)}.")
        else:
            vanished.append(row.candidate)
            text = (f"Recompiled in float64, its error falls by a factor of at least "
                    f"{format_number(1 / worst_ratio) if worst_ratio > 0 else '∞'} (worst err64 ÷ err32 "
                    f"{format_number(worst_ratio)}): the difference comes from the arithmetic. In float32 its results are "
                    f"{judgement_phrase(judgement)}.")
        if not math.isnan(worst_ratio):
            worst_q = group.loc[group.ratio.idxmax(), "quantity"]
            measurements.append(Measurement(f"err64 ÷ err32, worst parameter ({worst_q})", format_number(worst_ratio),
                                            against))
        measurements += judgement_measurements(judgement)[:2]
        override = (f"The error of {', '.join(persists.quantity)} does not vanish in float64, so it is not rounding "
                    "whatever its size: find the bug in those gradients (precision-lab diagnose names the quantities "
                    "and elements beyond the bound).")
        findings.append(Finding(row.candidate, row.verdict, text, measurements,
                                _action_for_verdict(row.verdict, judgement, override),
                                judgement_detail(judgement) if row.verdict == judgement.verdict else ""))
    clauses = []
    if vanished:
        clauses.append(f"the error vanishes with the arithmetic for {', '.join(vanished)}")
    if persisted:
        clauses.append(f"it stays for {', '.join(persisted)}, which is therefore not rounding")
    if untested:
        clauses.append(f"{', '.join(untested)} cannot be tested this way (no float64 build)")
    lead = ("Recompiled in float64, " + "; ".join(clauses) + f". Verdicts: {_verdict_groups(findings)}."
            if clauses else "No candidate ran.")
    return Conclusion(EXPERIMENT, lead[0].upper() + lead[1:], findings, _skipped_notes(skipped) + unprobed_notes(judgements))


# ---------------------------------------------------------------------------------------------
# 03 size sweep


def size_sweep(summary, table, fits, skipped=(), decisions: dict | None = None) -> Conclusion:
    """03: how each candidate's error scales with the number of terms, and its decided verdict (`decisions`:
    precision_lab.decision.Diagnosis by candidate, which names what the tables cannot: a probe's finding)."""
    from .experiments.size_sweep import DEFECT_REL_TO_GRAD, EXPERIMENT

    largest = int(table["size"].max())
    sizes = sorted(int(s) for s in table["size"].unique())
    findings = []
    for row in summary.itertuples():
        rows = table[table.candidate == row.candidate]
        at_largest = rows[rows["size"] == largest]
        worst_largest = at_largest.loc[at_largest.bound_ratio.idxmax()]
        worst_any = rows.loc[rows.bound_ratio.idxmax()]
        cand_fits = fits[fits.candidate == row.candidate]
        weights = cand_fits[cand_fits.parameter.str.endswith("weight")]
        alpha = float(weights.alpha_vs_S.median())
        defect_like = cand_fits[cand_fits.min_err_over_grad >= DEFECT_REL_TO_GRAD]
        decided = decisions[row.candidate].judgement() if decisions else None
        detail = judgement_detail(decided) if decided is not None else ""
        if len(defect_like):
            level = format_range(defect_like.min_err_over_grad.min(), defect_like.min_err_over_grad.max())
            text = (f"{', '.join(defect_like.parameter)} stay at {level} of max |g| or more at every size from "
                    f"{sizes[0]} to {largest} pixels: rounding error stays far below |g| (under "
                    f"{format_number(DEFECT_REL_TO_GRAD)} for every format the lab knows), a different function does not.")
        elif worst_any.bound_ratio <= 1.0:
            text = (f"Its gradients are within the float32 bound at every size from {sizes[0]} to {largest} pixels; "
                    f"the error grows like n^{alpha:.2f} relative to u·S (recursive summation's probabilistic growth is "
                    "n^0.5, pairwise summation's about log n).")
        else:
            trend = ("shrinks relative to u·S as n grows, the signature of operands rounded to a coarser format"
                     if alpha < SHRINKING_BELOW else "grows relative to u·S faster than float32 accumulation explains"
                     if alpha > GROWING_ABOVE else "scales like float32 accumulation relative to u·S (n^0 to n^0.5)")
            text = (f"Its gradients exceed the float32 bound (worst: {worst_any.parameter} at {int(worst_any['size'])} "
                    f"pixels, error ÷ bound {format_number(worst_any.bound_ratio)}; at {largest} pixels "
                    f"{format_number(worst_largest.bound_ratio)}), and the error {trend} (n^{alpha:.2f}).")
        if row.verdict != "roundoff" and worst_largest.bound_ratio <= 1.0 and not len(defect_like):
            where = (f" on {decisions[row.candidate].summary().decided_by}" if decisions else "")
            text += (f" At {largest} pixels its gradients are within the bound, but the decision, which also judges "
                     f"the loss, the forward output, the other sizes and the probes, finds it {row.verdict}{where}"
                     + (f": {decided.cause or detail}" if decided is not None and (decided.cause or detail) else "")
                     + ".")
        measurements = [
            Measurement(f"max error ÷ bound at {largest} × {largest}, {worst_largest.parameter}",
                        format_number(worst_largest.bound_ratio), "rounding: ≤ 1")]
        if int(worst_any["size"]) != largest and worst_any.bound_ratio > 1.0:
            measurements.append(Measurement(f"max error ÷ bound over sizes, {worst_any.parameter} at "
                                            f"{int(worst_any['size'])} pixels", format_number(worst_any.bound_ratio),
                                            "rounding: ≤ 1"))
        measurements += [
            Measurement("fitted exponent α of error ÷ (u·S) ∝ nᵅ (weights, median)", f"{alpha:.2f}",
                        "float32 accumulation: 0 (pairwise) to 0.5 (recursive); input rounding: < 0"),
            Measurement("smallest max |error| ÷ max |g| over sizes (worst gradient)",
                        format_number(cand_fits.min_err_over_grad.max()),
                        f"a defect stays ≥ {format_number(DEFECT_REL_TO_GRAD)} at every size")]
        if decided is not None and worst_largest.bound_ratio <= 1.0 and row.verdict != "roundoff":
            measurements += judgement_measurements(decided)[:2]
        action = (action_for(decided) if decided is not None and (row.verdict != "defect" or not len(defect_like))
                  else _action_from_verdict(row.verdict, detail, defect_like, at_largest))
        findings.append(Finding(row.candidate, row.verdict, text, measurements, action, detail))
    lead = (f"Across sizes {', '.join(map(str, sizes))} (n = batch·H·W up to {format_number(int(table.n.max()))} terms "
            f"per weight-gradient sum): {_verdict_groups(findings)}.")
    return Conclusion(EXPERIMENT, lead, findings, _skipped_notes(skipped) + unprobed_notes(decisions))


def _action_from_verdict(verdict: str, detail: str, defect_like, at_largest) -> str:
    """An action when only the verdict and its detail are known (tables, not a Judgement)."""
    if verdict == "roundoff":
        return NOTHING_TO_FIX
    if verdict == "layout" and detail:
        return f"Fix the layout: the gradient matches after {detail} (precision-lab diagnose says how, buffer by buffer)."
    if verdict == "reduced-precision" and detail:
        return precision_action(detail)
    bad = at_largest[at_largest.bound_ratio > 1.0]
    names = list(defect_like.parameter) if len(defect_like) else list(bad.parameter)
    if not names:
        return (f"The verdict ({verdict}) comes from quantities this sweep does not tabulate (the loss or the forward "
                "output): precision-lab diagnose at the largest size names them and their elements.")
    return (f"Find the bug: {', '.join(names)} are beyond the rounding bound"
            + (f" (error ÷ bound up to {format_number(bad.bound_ratio.max())} at the largest size)" if len(bad) else "")
            + " and no transform or coarser format explains them; precision-lab diagnose names the elements.")


# ---------------------------------------------------------------------------------------------
# 04 motivating case


def _as_reported(low, high) -> str:
    """The seed's figures as it wrote them (0.049–0.29), not padded to three digits it never gave."""
    return f"{format_reported(low)}–{format_reported(high)}" if low != high else format_reported(low)


def motivating_case(summary, table, judgements: dict) -> Conclusion:
    """04: the seed's question — were its 0.05–0.29 weight-gradient differences rounding?"""
    from .experiments.motivating import EXPERIMENT, REPLAY, REPLAY_SLIP

    weights = table[table.quantity.str.endswith("weight")]
    others = table[~table.quantity.str.endswith("weight")]
    seed_range = _as_reported(weights.seed_max_abs.min(), weights.seed_max_abs.max())
    findings = []
    for row in summary.itertuples():
        judgement = judgements[row.candidate]
        column = f"{row.candidate}_max_abs"
        weight_range = format_range(weights[column].min(), weights[column].max())
        other_range = format_range(others[column].min(), others[column].max())
        ratio = (weights[column] / weights.seed_max_abs).where(weights[column] > 0)
        if weights[column].max() == 0:
            text = "Its weight gradients are identical to PyTorch's, bit for bit"
        else:
            factor = float(ratio.median()) if ratio.notna().any() else math.nan
            relation = ("the seed's magnitude" if 1 / 3 <= factor <= 3 else
                        f"the seed's were {format_number(1 / factor)} times larger" if factor < 1 else
                        f"{format_number(factor)} times the seed's")
            text = (f"Its weight gradients differ from PyTorch's by {weight_range} (the seed reported {seed_range}: "
                    f"{relation}), its loss and bias gradients by {other_range}")
        text += f"; against the float64 reference its results are {judgement_phrase(judgement)}."
        measurements = [Measurement("weight-gradient differences from PyTorch, max |difference|", weight_range,
                                    f"seed's report: {seed_range}")]
        measurements += judgement_measurements(judgement)[:2]
        findings.append(Finding(row.candidate, row.verdict, text, measurements, action_for(judgement),
                                judgement_detail(judgement)))
    slip, faithful = judgements.get(REPLAY_SLIP), judgements.get(REPLAY)
    bound = format_number(weights.bound_max.max())
    if slip is not None and faithful is not None and slip.verdict != "roundoff" and faithful.verdict == "roundoff":
        cause = (f"a spatial flip in the gradient conversion ({slip.layout_fix})" if slip.verdict == "layout"
                 else f"the conversion ({slip.verdict})")
        lead = (f"The seed's weight-gradient differences ({seed_range}) were not floating-point accumulation but "
                f"{cause}: replaying its design with that conversion gives differences of the same kind "
                f"({format_range(weights[f'{REPLAY_SLIP}_max_abs'].min(), weights[f'{REPLAY_SLIP}_max_abs'].max())}, "
                f"error ÷ bound up to {format_number(_worst(slip).bound_ratio)}, where the float32 rounding bound is at "
                f"most {bound}), while the same design without the flip is within rounding "
                f"(error ÷ bound ≤ {format_number(_worst(faithful).bound_ratio)}).")
    else:
        lead = (f"The replays do not settle the seed's question on this run: {_verdict_groups(findings)} "
                f"(the float32 rounding bound of the weight gradients is at most {bound}).")
    return Conclusion(EXPERIMENT, lead, findings, unprobed_notes(judgements))


# ---------------------------------------------------------------------------------------------
# 05 convolution algorithms


def conv_algorithms(summary, table, decisions: dict | None = None) -> Conclusion:
    """05: is each convolution algorithm a legitimate float32 implementation, and how much budget does it use?
    (`decisions`: precision_lab.decision.Diagnosis by algorithm, which says where a verdict the tables cannot
    show was found.)"""
    from .experiments.algorithms import EXPERIMENT

    sizes = sorted(int(s) for s in table["size"].unique())
    findings, budget = [], {}
    for row in summary.itertuples():
        rows = table[table.algorithm == row.candidate]
        worst = rows.loc[rows.bound_ratio.idxmax()]
        budget[row.candidate] = float(worst.bound_ratio)
        if row.verdict == "roundoff":
            text = (f"Within the float32 rounding bound at every size from {sizes[0]} to {sizes[-1]} pixels; it uses at "
                    f"most {format_percent(worst.bound_ratio)} of the bound ({worst.quantity} at {int(worst['size'])} "
                    "pixels).")
            action = "A legitimate float32 algorithm: nothing to fix."
        elif (rows.bound_ratio > 1.0).any():
            beyond = rows[rows.bound_ratio > 1.0]
            text = (f"Beyond the float32 bound in {len(beyond)} of {len(rows)} gradients across sizes (worst "
                    f"{worst.quantity} at {int(worst['size'])} pixels, error ÷ bound {format_number(worst.bound_ratio)}).")
            action = (f"Not a float32-accurate algorithm at these sizes: use it only with a coarser claim, or find the "
                      f"error in its {worst.quantity} computation.")
        else:
            flagged = sorted({int(s) for s in rows[rows.overall != "roundoff"]["size"]})
            where = (decisions[row.candidate].summary().decided_by if decisions else
                     f"{', '.join(map(str, flagged))} pixels")
            text = (f"Its gradients are within the float32 bound at every size (worst {worst.quantity} at "
                    f"{int(worst['size'])} pixels, error ÷ bound {format_number(worst.bound_ratio)}), but the decision, "
                    f"which also judges the loss, the forward output and the probes, finds it {row.verdict} on {where}.")
            action = (action_for(decisions[row.candidate].judgement()) if decisions else
                      "Not float32-accurate in its loss or forward output: precision-lab diagnose names the quantities "
                      "and elements beyond the bound.")
        measurements = [Measurement(f"worst error ÷ bound over sizes ({worst.quantity}, {int(worst['size'])} pixels)",
                                    format_number(worst.bound_ratio), "rounding: ≤ 1"),
                        Measurement("gradients beyond the bound", f"{int((rows.bound_ratio > 1).sum())} of {len(rows)}",
                                    "rounding: 0")]
        findings.append(Finding(row.candidate, row.verdict, text, measurements, action))
    legit = [f.candidate for f in findings if f.verdict == "roundoff"]
    most = max(budget, key=budget.get) if budget else None
    least = min(budget, key=budget.get) if budget else None
    lead = (f"{len(legit)} of {len(findings)} algorithms are legitimate float32 implementations at every size "
            f"from {sizes[0]} to {sizes[-1]} pixels" + (f" (not: {', '.join(f.candidate for f in findings if f.verdict != 'roundoff')})"
                                                       if len(legit) < len(findings) else "")
            + (f"; {most} uses the most of the rounding bound ({format_percent(budget[most])}), {least} the least "
               f"({format_percent(budget[least])})" if most else "") + ".")
    if "winograd-f2x3" in budget and "winograd-f4x3" in budget:
        f2, f4 = budget["winograd-f2x3"], budget["winograd-f4x3"]
        lead += (f" Winograd F(4,3) uses {'more' if f4 > f2 else 'no more'} of it than F(2,3) ({format_percent(f4)} "
                 f"against {format_percent(f2)}), {'as' if f4 > f2 else 'unlike what'} the larger tile's error growth "
                 "(Barabasz et al. 2020) predicts.")
    return Conclusion(EXPERIMENT, lead, findings, unprobed_notes(decisions))


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


__all__ = ["Conclusion", "Finding", "Measurement", "NOTHING_TO_FIX", "action_for", "conv_algorithms",
           "describe_transform", "float64_recompilation", "from_judgement", "judgement_measurements",
           "judgement_phrase", "layout_action", "motivating_case", "optimizer_step", "precision_action",
           "run_summary", "size_sweep", "worst_verdict"]


# ---------------------------------------------------------------------------------------------
# 06: the reference-free gradient check


def gradient_check(summary, tensors, results: dict, rates, rtol: float, practice_epsilon: float = 1e-5) -> Conclusion:
    """06: the lab's verdict per opaque candidate (from its own measurements), and what the float32 practice showed.

    `results` are the gradient checks (precision_lab.gradcheck.GradCheck) by candidate; `rates` the
    practice's pass rates per ε (experiments.gradient_check.pass_rates)."""
    findings = []
    for row in summary.itertuples():
        result = results[row.candidate]
        rows = tensors[tensors.candidate == row.candidate]
        failing = rows[rows.verdict == row.verdict] if row.verdict != "roundoff" else rows
        measurements = [Measurement("program calls", f"{result.total_calls} (float64 build: "
                                                     f"{result.calls.get('float64', 0)})", f"budget {result.budget}")]
        for t in failing.head(3).itertuples():
            if t.directional_error is not None and math.isfinite(t.directional_error):
                measurements.append(Measurement(f"{t.tensor}: directional error (relative)",
                                                format_number(t.directional_error),
                                                f"resolved to {format_number(t.resolution)}"))
            if t.located:
                measurements.append(Measurement(f"{t.tensor}: where", t.located))
        if row.verdict == "roundoff":
            finding, action = "the gradient is the derivative of the loss, within what the check resolves.", NOTHING_TO_FIX
        elif row.verdict == "defect":
            names = ", ".join(failing.tensor)
            finding = f"the gradient of {names} is not the derivative of the loss."
            action = (f"Fix the backward of {names}" + (f" (start at {failing.located.iloc[0]})"
                                                        if failing.located.iloc[0] else "") + ".")
        else:
            finding = ("the check does not resolve the gradient closely enough to settle it (the loss's rounding noise, or "
                       "kinks along its segments).")
            action = next((t.settle for t in result.tensors.values() if t.settle),
                          "Give a float64 build (command_float64): it settles the gradient to ~1e-8.")
        findings.append(Finding(row.candidate, row.verdict, finding, measurements, action))
    at = rates[rates.epsilon == practice_epsilon].set_index("candidate")
    practice = "; ".join(f"{name}: {format_percent(at.pass_rate[name])} pass at ε = {practice_epsilon:g}"
                         for name in at.index)
    lead = (f"Directional differences checked against the float64 build settle each gradient "
            f"({_verdict_groups(findings)}); float32 central differences at rtol {rtol:g} cannot: {practice}, "
            f"a pass rate set by ε and the loss's rounding noise, not by whether the gradient is right.")
    return Conclusion("06-gradient-check", lead, findings)
