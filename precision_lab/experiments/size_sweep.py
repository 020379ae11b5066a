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
from ..candidates import Candidate
from ..formats import unit_roundoff
from ..calibration import noise_floor
from ..model import ModelSpecError
from ..problem import make_problem
from ..verdict import judge
from ..decision import Scaling
from ..probes import ProbeRun
from . import cached_reference, decide_candidate, network_for, progress, summary_row  # noqa: F401 - network_for: 03
from ..tables import format_number

EXPERIMENT = "03-size-sweep"

#: a defect's error relative to |g| stays O(1): flagged above ten times the coarsest format's unit
#: roundoff (bfloat16, 2⁻⁸) at every size, which no rounding mode the lab knows reaches
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
