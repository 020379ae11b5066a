"""Experiment 03: size sweep 64 → 1024 (docs/design.md, "The experiments").

A weight or bias gradient of the seed network sums n = batch·H·W terms. Each error source has
a signature in how the error scales with n, once measured against S = Σ|terms| (MSE gradients
cancel heavily, so |g| is the wrong yardstick for rounding):

* float32 accumulation: err/(u·S) grows like √n for recursive summation with random-like
  rounding (Higham & Mary 2019) and like log₂n for pairwise or blocked sums (Higham 2002, §4.2);
  worst case n (the deterministic γₙ bound, Higham 2002, Lemma 3.1);
* input rounding of a coarser format (TF32, bf16): each term carries a relative error ~u_in with
  independent signs, so err ~ u_in·√(Σ terms²), which *shrinks* relative to u·S as n grows;
* a defect is a different function, so its error stays O(1) relative to |g| at every size.

The fitted exponent α of err/(u·S) ∝ n^α and of err/|g| ∝ n^β sorts these out.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from .. import errmodel
from ..calibration import noise_floor
from ..candidates import Candidate
from ..conclusions import (Conclusion, Finding, Measurement, NOTHING_TO_FIX, action_for, judgement_detail,
                           judgement_measurements, precision_action, skipped_notes, unprobed_notes, verdict_groups)
from ..decision import Scaling
from ..formats import unit_roundoff
from ..model import ModelSpecError
from ..probes import ProbeRun
from ..problem import make_problem
from ..tables import format_number, format_range
from ..verdict import judge
from . import cached_reference, decide_candidate, network_for, progress, summary_row  # noqa: F401 - network_for: 03

EXPERIMENT = "03-size-sweep"

#: a defect's error relative to |g| stays O(1): flagged above ten times bfloat16's unit roundoff (2⁻⁸) at every
#: size; a bfloat16 or float16 program can reach it on a small problem, so a quantity inside its format's sampled
#: bound is left to that bound (decision._within_reduced)
DEFECT_REL_TO_GRAD = 10 * unit_roundoff("bfloat16")


def sizes_for(sizes: list[int], network) -> tuple[list[int], list[str]]:
    """The sweep's sizes the network takes, and a note for each it cannot (a stride or pool that does not divide)."""
    kept, notes = [], []
    for size in sizes:
        try:
            network.check_size(size, size)
            kept.append(size)
        except ModelSpecError as exc:
            notes.append(f"size {size} skipped: {exc}")
    return kept, notes


def sweep(sizes: list[int], candidates: list[Candidate], device: torch.device, batch: int = 2, seed: int = 0,
          image: str | None = None, network=None, probes="default") -> tuple[pd.DataFrame, dict]:
    """Per size × candidate × gradient: errors against S, |g| and the model's bound; and each candidate's
    decision (precision_lab.decision.decide) on the largest size, with the probes `diagnose` runs there, the
    other sizes as further problems, and the sweep's scaling (an error O(1) of |g| at every size is no rounding)."""
    rows, judged, problems = [], {}, {}
    u32 = unit_roundoff("float32")
    for size in progress(sizes, desc="03 sizes", unit="size"):
        problem = make_problem(size, batch, seed, image, network=network)
        problems[size] = problem
        ref = cached_reference(problem, device)
        abs_sums = errmodel.abs_term_sums(ref)
        n = batch * size * size
        for candidate in progress(candidates, desc=f"03 size {size}", unit="candidate", leave=False):
            result = candidate.compute(problem, "float32", device)
            judgement = judge(result, ref, candidate.claimed_precision, candidate.name)
            judged[candidate.name, size] = judgement
            for name in problem.network.parameter_names:
                err = np.abs(np.asarray(result.grads[name], np.float64) - ref.grads[name])
                s = np.asarray(abs_sums[name], np.float64)
                live = s > 0
                quantity = judgement.quantities[name]
                rows.append({
                    "size": size, "n": n, "candidate": candidate.name, "parameter": name,
                    "max_abs_err": float(err.max()),
                    "err_over_uS": float(np.max(err[live] / (u32 * s[live]))) if live.any() else math.nan,
                    "err_over_grad": float(err.max() / max(np.abs(ref.grads[name]).max(), 1e-300)),
                    "bound_ratio": quantity.bound_ratio, "verdict": quantity.verdict,
                    "overall_verdict": judgement.verdict,
                    "sqrt_n": math.sqrt(n), "log2_n": math.log2(n),
                })
        del ref, abs_sums
    table = pd.DataFrame(rows)
    return table, decide_sweep(table, judged, problems, candidates, device, probes)


def decide_sweep(table: pd.DataFrame, judged: dict, problems: dict, candidates: list[Candidate], device,
                 probes="default") -> dict:
    """Each candidate's decision: the largest size is the requested problem; the other sizes join the probes as
    problems of their own; the fitted scaling is evidence (precision_lab.decision.Scaling)."""
    largest = max(problems)
    fits = fit_exponents(table)
    decisions = {}
    for candidate in progress(candidates, desc="03 probes", unit="candidate"):
        mine = fits[fits.candidate == candidate.name]
        scaling = Scaling(tuple(sorted(problems)), dict(zip(mine.parameter, mine.min_err_over_grad)), DEFECT_REL_TO_GRAD)
        others = [(ProbeRun.of_size(problems[size]), judged[candidate.name, size]) for size in sorted(problems)
                  if size != largest]
        decisions[candidate.name] = decide_candidate(candidate, problems[largest], device,
                                                     judged[candidate.name, largest], probes, others, scaling=scaling)
    return decisions


def fit_exponents(table: pd.DataFrame) -> pd.DataFrame:
    """Least-squares slopes of log err/(u·S) and log err/|g| against log n, per candidate × gradient."""
    rows = []
    for (candidate, parameter), group in table.groupby(["candidate", "parameter"], sort=False):
        logn = np.log(group.n.to_numpy(float))
        fits = {}
        for column, label in (("err_over_uS", "alpha_vs_S"), ("err_over_grad", "beta_vs_grad")):
            y = group[column].to_numpy(float)
            ok = np.isfinite(y) & (y > 0)
            fits[label] = float(np.polyfit(logn[ok], np.log(y[ok]), 1)[0]) if ok.sum() >= 2 else math.nan
        rows.append({"candidate": candidate, "parameter": parameter, **fits,
                     "min_err_over_grad": float(group.err_over_grad.min()),
                     "max_bound_ratio": float(group.bound_ratio.max())})
    return pd.DataFrame(rows)


def signature(fits: pd.DataFrame) -> pd.DataFrame:
    """Which error source each candidate's scaling looks like (per gradient, then worst)."""
    def classify(row) -> str:
        if row.min_err_over_grad >= DEFECT_REL_TO_GRAD:
            return "O(1) relative to |g| at every size: defect-like"
        if row.max_bound_ratio <= 1.0:
            return "within the accumulation bound at every size"
        return "exceeds the float32 bound (input rounding or defect)"

    return fits.assign(signature=fits.apply(classify, axis=1))


def summarise(table: pd.DataFrame, fits: pd.DataFrame, decisions: dict) -> pd.DataFrame:
    """One row per candidate: its decision's verdict, and the scaling found."""
    rows = []
    largest = table[table["size"] == table["size"].max()]
    for name, group in largest.groupby("candidate", sort=False):
        weights = fits[(fits.candidate == name) & fits.parameter.str.endswith("weight")]
        headline = (f"error ÷ (u·S) ∝ n^{weights.alpha_vs_S.median():.2f}, error ÷ |g| ∝ n^{weights.beta_vs_grad.median():.2f}"
                    f" (weights, median); max error ÷ bound {format_number(group.bound_ratio.max())} at "
                    f"{group['size'].iloc[0]} × {group['size'].iloc[0]}")
        rows.append(summary_row(name, EXPERIMENT, decisions[name], headline,
                                alpha_vs_S=float(weights.alpha_vs_S.median()),
                                beta_vs_grad=float(weights.beta_vs_grad.median())))
    return pd.DataFrame(rows)


def noise_floor_at(size: int, device: torch.device, members: list[str], batch: int = 2, seed: int = 0,
                   image: str | None = None, network=None) -> pd.DataFrame:
    """The empirical noise floor at one size: legitimate float32 members and their spread, ÷ the model's bound.

    Reuses the reference the sweep computed at that size (precision_lab.calibration.noise_floor).
    """
    problem = make_problem(size, batch, seed, image, network=network)
    return noise_floor(problem, device, reference=cached_reference(problem, device), members=tuple(members))

#: fitted exponents α of error ÷ (u·S) ∝ nᵅ (experiments.size_sweep): operand rounding in a coarser format predicts
#: −0.5, float32 accumulation 0 (pairwise) to 0.5 (recursive), the worst case 1 (γₙ, Higham 2002, Lemma 3.1);
#: each boundary is the midpoint between neighbouring predictions
SHRINKING_BELOW, GROWING_ABOVE = -0.25, 0.75


# ---------------------------------------------------------------------------------------------
# the conclusion


def conclude(summary, table, fits, skipped=(), decisions: dict | None = None) -> Conclusion:
    """03: how each candidate's error scales with the number of terms, and its decided verdict (`decisions`:
    precision_lab.decision.Diagnosis by candidate, which names what the tables cannot: a probe's finding)."""

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
        if decided is not None:  # a quantity inside a coarser format's sampled bound is that bound's to judge
            defect_like = defect_like[[decided.quantities[p].verdict in ("defect", "layout")
                                       if p in decided.quantities else True for p in defect_like.parameter]]
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
            f"per weight-gradient sum): {verdict_groups(findings)}.")
    return Conclusion(EXPERIMENT, lead, findings, skipped_notes(skipped) + unprobed_notes(decisions))


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
