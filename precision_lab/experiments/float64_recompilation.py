"""Experiment 02: float64 recompilation (docs/design.md, "The experiments").

Run each candidate's float32 build and its float64 build against the float64 reference.
Rounding error scales with the unit roundoff, so recompiling in float64 shrinks it by about
u64/u32 = 2⁻⁵³/2⁻²⁴ ≈ 1.9e-9 (times a modest factor when the two builds sum in different
orders); a defect is arithmetic-independent and does not move.

Classification of the ratio r = err64 / err32 per parameter: the two hypotheses predict
r ≈ u64/u32 (rounding) and r ≈ 1 (defect); the boundary is their geometric midpoint on the
log scale, √(u64/u32) ≈ 4.3e-5, equally far (×23 000) from both predictions.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..candidates import Candidate
from ..conclusions import (Conclusion, Finding, Measurement, action_for_verdict, judgement_detail,
                           judgement_measurements, judgement_phrase, skipped_notes, unprobed_notes, verdict_groups)
from ..formats import unit_roundoff
from ..problem import Problem
from ..tables import format_number
from ..verdict import judge
from . import cached_reference, decide_candidate, progress, summary_row

if TYPE_CHECKING:  # pandas is imported where a table is built: a diagnosis reads build_evidence only
    import pandas as pd

EXPERIMENT = "02-float64-recompilation"

#: what rounding error predicts for err64 / err32
EXPECTED_RATIO = unit_roundoff("float64") / unit_roundoff("float32")
#: geometric midpoint between the rounding (u64/u32) and defect (1) predictions
VANISH_THRESHOLD = math.sqrt(EXPECTED_RATIO)


def _max_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)))


def recompilation_table(problem: Problem, candidates: list[Candidate], device: torch.device, probes="default"
                        ) -> tuple[pd.DataFrame, dict[str, object], list[str]]:
    """Per candidate × parameter: err32, err64 and their ratio; and each candidate's decision
    (precision_lab.decision.decide: the float32 judgement, the probes and the float64 build, one verdict).

    Returns (table, decisions by candidate, notes on candidates without a float64 build).
    """
    import pandas as pd

    ref = cached_reference(problem, device)
    rows, decisions, notes = [], {}, []
    for candidate in progress(candidates, desc="02 float32 + float64 builds", unit="candidate"):
        result32 = candidate.compute(problem, "float32", device)
        judgement = judge(result32, ref, candidate.claimed_precision, candidate.name)
        result64 = candidate.compute(problem, "float64", device) if candidate.has_float64 else None
        if result64 is None:
            notes.append(f"{candidate.name} has no float64 build: without it the error cannot be shown to vanish "
                         "with the arithmetic, so this experiment cannot tell rounding from a defect for it")
        evidence = build_evidence(result32, result64, ref, problem.network.parameter_names,
                                  claimed=candidate.claimed_precision)
        rows += [{"candidate": candidate.name, "quantity": name, **row} for name, row in evidence.quantities.items()]
        decisions[candidate.name] = decide_candidate(candidate, problem, device, judgement, probes,
                                                     float64_build=evidence if result64 is not None else None)
    return pd.DataFrame(rows), decisions, notes


def recompilation_rows(result32, result64, ref, names, accuracy: dict | None = None) -> list[dict]:
    """Per quantity (loss, then the parameters `names`): err32 and err64, the largest |build − float64 reference|
    of each build (err64 NaN without a float64 build), their ratio and what it shows (`_finding`; `accuracy`: the
    reference's own largest error per quantity, compare.reference_accuracy)."""
    quantities = [("loss", np.float64(result32.loss), np.float64(ref.loss),
                   None if result64 is None else np.float64(result64.loss))]
    quantities += [(name, result32.grads[name], ref.grads[name], None if result64 is None else result64.grads[name])
                   for name in names]
    rows = []
    for name, got32, want, got64 in quantities:
        err32 = _max_err(got32, want)
        err64 = math.nan if got64 is None else _max_err(got64, want)
        ratio = err64 / err32 if err32 > 0 else math.nan
        rows.append({"quantity": name, "err32": err32, "err64": err64, "ratio": ratio,
                     "expected_ratio_if_rounding": EXPECTED_RATIO,
                     "finding": _finding(ratio, err32, err64, (accuracy or {}).get(name, 0.0))})
    return rows


def build_evidence(result32, result64, ref, names, verdict64: str | None = None, claimed: str = "float32"):
    """The float64 build as evidence for the decision (precision_lab.decision.Float64Build); `claimed`: the float32
    build's claimed precision, whose bounds (cached on `ref`) give the reference's own accuracy."""
    from .. import errmodel
    from ..compare import reference_accuracy
    from ..decision import Float64Build
    from ..formats import REDUCED_FORMATS, STORAGE_DTYPE

    # the float64 reference rounds as a float32 program does, at u₆₄: a reduced claim's bound holds the format's
    # operand roundings too, which would make the reference's accuracy u_f ÷ u₃₂ too coarse and hide a persisting error
    arithmetic = "float32" if claimed in REDUCED_FORMATS else claimed
    bounds = errmodel.error_bounds(ref, arithmetic)
    accuracy = {name: reference_accuracy(bounds[name].bound, STORAGE_DTYPE[arithmetic]) for name in ("loss", *names)}
    rows = recompilation_rows(result32, result64, ref, names, accuracy)
    return Float64Build({row.pop("quantity"): row for row in rows}, verdict64, EXPECTED_RATIO, VANISH_THRESHOLD)


def _finding(ratio: float, err32: float, err64: float, accuracy: float = 0.0) -> str:
    if math.isnan(err64):
        return "no float64 build"
    if err32 == 0:
        return "exact in float32" if err64 == 0 else "float64 build differs, float32 exact"
    if err32 <= accuracy:  # the reference's own error as much as the build's: nothing to vanish or persist
        from ..decision import REFERENCE_ACCURACY

        return REFERENCE_ACCURACY
    return "vanishes in float64" if ratio <= VANISH_THRESHOLD else "persists in float64"


def summarise(table: pd.DataFrame, decisions: dict) -> pd.DataFrame:
    """One row per candidate: the decision's verdict (an error that persists in float64 is a defect there,
    whatever its size) and the headline for the index."""
    import pandas as pd

    rows = []
    for name, group in table.groupby("candidate", sort=False):
        params = group[group.quantity != "loss"]
        persists = group[group.finding == "persists in float64"]  # the loss too: the decision reads every quantity
        if params.finding.eq("no float64 build").all():
            headline = "no float64 build: ratio unavailable"
        else:
            worst = params.ratio.max()
            headline = (f"err64 ÷ err32 ≤ {format_number(worst)} (rounding predicts {format_number(EXPECTED_RATIO)}); "
                        + (f"persists in {', '.join(persists.quantity)}" if len(persists) else "vanishes everywhere"))
        rows.append(summary_row(name, EXPERIMENT, decisions[name], headline, worst_ratio=float(params.ratio.max())))
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# the conclusion


def conclude(summary, table, judgements: dict, skipped=()) -> Conclusion:
    """02: does each candidate's error vanish when it is recompiled in float64?"""

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
                                action_for_verdict(row.verdict, judgement, override),
                                judgement_detail(judgement) if row.verdict == judgement.verdict else ""))
    clauses = []
    if vanished:
        clauses.append(f"the error vanishes with the arithmetic for {', '.join(vanished)}")
    if persisted:
        clauses.append(f"it stays for {', '.join(persisted)}, which is therefore not rounding")
    if untested:
        clauses.append(f"{', '.join(untested)} cannot be tested this way (no float64 build)")
    lead = ("Recompiled in float64, " + "; ".join(clauses) + f". Verdicts: {verdict_groups(findings)}."
            if clauses else "No candidate ran.")
    return Conclusion(EXPERIMENT, lead[0].upper() + lead[1:], findings, skipped_notes(skipped) + unprobed_notes(judgements))
