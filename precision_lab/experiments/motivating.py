"""The motivating case (docs/design.md, "The motivating case"): replay the seed's Fortran/cuDNN design and settle its table.

The seed compared its Fortran/CUDA gradients with PyTorch's and saw weight-gradient
differences of 0.049-0.29 with bias and loss differences near 1e-5. The replay candidates
hold the weights as (H, W, In, Out) like the seed's code and convert cuDNN's (Out, In, H, W)
gradients back: `fortran-replay` correctly, `fortran-replay-flip` with the spatial flip the
seed's conversion added. Computing their differences from PyTorch on the seed problem
reproduces the seed's magnitudes; judging them against the float64 reference names the cause.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..candidates import get_builtin
from ..conclusions import (Conclusion, Finding, Measurement, action_for, judgement_detail, judgement_measurements,
                           judgement_phrase, unprobed_notes, verdict_groups, worst_quantity)
from ..errmodel import error_bounds
from ..errors import LabInputError
from ..paths import DATA_DIR
from ..problem import Problem
from ..tables import format_number, format_range, format_reported
from ..verdict import Judgement, judge
from . import cached_reference, decide_candidate, summary_row

EXPERIMENT = "04-motivating-case"

#: the seed's reported figures (docs/design.md, "The motivating case"), shipped as a table (data/README.md)
SEED_REPORTED = DATA_DIR / "seed-reported.csv"


def _read_seed_reported(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (OSError, pd.errors.ParserError) as exc:
        raise LabInputError(f"{path}: cannot read the seed's reported figures ({exc}); the lab ships it in data/") from None
    missing = {"quantity", "kind", "max_abs_diff", "mean_abs_diff"} - set(frame.columns)
    if missing:
        raise LabInputError(f"{path}: lacks columns {sorted(missing)} (expected quantity, kind, max_abs_diff, "
                            "mean_abs_diff, reported_values)")
    return frame


def seed_reported(path: str | Path = SEED_REPORTED) -> pd.DataFrame:
    """The seed's differences from PyTorch float32: quantity, seed_max_abs, seed_mean_abs."""
    frame = _read_seed_reported(Path(path))
    differences = frame[frame["kind"] == "difference"]
    return pd.DataFrame({"quantity": differences["quantity"].to_numpy(),
                         "seed_max_abs": differences["max_abs_diff"].astype(float).to_numpy(),
                         "seed_mean_abs": differences["mean_abs_diff"].astype(float).to_numpy()})


def seed_estimate(path: str | Path = SEED_REPORTED) -> float:
    """The seed's own rounding estimate, √N·u ≈ 3.6e-4, which it compared with 0.05-0.29."""
    frame = _read_seed_reported(Path(path))
    estimate = frame[frame["kind"] == "rounding estimate"]
    if estimate.empty:
        raise LabInputError(f"{path}: no row of kind 'rounding estimate' (the seed's √N·u)")
    return float(estimate["max_abs_diff"].iloc[0])


#: the PyTorch run the seed compared against, the faithful replay, the replay with the slip
PYTORCH, REPLAY, REPLAY_SLIP = "native", "fortran-replay", "fortran-replay-flip"


def _diff(got, want) -> tuple[float, float]:
    d = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(d.max()), float(d.mean())


def replay(problem: Problem, device: torch.device, seed_table: pd.DataFrame | None = None, probes="default"
           ) -> tuple[pd.DataFrame, dict]:
    """The seed's table beside the replays' differences from PyTorch, and each replay's decision
    (precision_lab.decision: its judgement here and on the probes `diagnose` runs).

    Table columns: quantity, seed_max_abs, seed_mean_abs (`seed_table`, by default data/seed-reported.csv), then for each replay
    `<name>_max_abs`/`<name>_mean_abs` (against PyTorch float32, as the seed measured) and
    `bound_max` (the error model's largest per-element float32 bound for the quantity).
    """
    trace = cached_reference(problem, device)
    pytorch = get_builtin(PYTORCH).compute(problem, "float32", device)
    bounds = error_bounds(trace, "float32")
    table = (seed_reported() if seed_table is None else seed_table).copy()
    # the seed's figures name the seed network's quantities: another network keeps the ones it shares
    table = table[table["quantity"].isin(["loss", *problem.network.parameter_names])].reset_index(drop=True)
    judgements = {}
    for name in (REPLAY_SLIP, REPLAY):
        candidate = get_builtin(name)
        result = candidate.compute(problem, "float32", device)
        judgements[name] = decide_candidate(candidate, problem, device,
                                            judge(result, trace, candidate.claimed_precision, name), probes)
        diffs = [_diff(result.loss, pytorch.loss) if q == "loss" else _diff(result.grads[q], pytorch.grads[q])
                 for q in table["quantity"]]
        table[f"{name}_max_abs"] = [d[0] for d in diffs]
        table[f"{name}_mean_abs"] = [d[1] for d in diffs]
    table["bound_max"] = [bounds[q].max for q in table["quantity"]]  # cached: judge computed them
    table["gradient_scale"] = [abs(float(trace.loss)) if q == "loss" else float(np.max(np.abs(trace.grads[q])))
                               for q in table["quantity"]]
    return table, judgements


def magnitude_agreement(table: pd.DataFrame, name: str = REPLAY_SLIP) -> pd.Series:
    """log10(replay ÷ seed) of the max differences, per quantity: 0 is the same magnitude."""
    ratio = table[f"{name}_max_abs"] / table["seed_max_abs"]
    return np.log10(ratio.where(ratio > 0)).rename("log10_replay_over_seed")  # an exact match (0) has no magnitude


def evidence(judgement: Judgement) -> pd.DataFrame:
    """The evidence columns of a judgement, one row per quantity."""
    columns = ["quantity", "verdict", "max_abs_err", "mean_abs_err", "bound_ratio", "ulps", "cosine",
               "sign_agreement", "layout_fix"]
    return judgement.to_frame()[columns]


def summarise(table: pd.DataFrame, decisions: dict) -> pd.DataFrame:
    """One summary row per replay: its decided verdict, and the headline that the index shows."""
    rows = []
    weights = table[table.quantity.str.endswith(".weight")]
    seed = f"{format_reported(weights.seed_max_abs.min())}–{format_reported(weights.seed_max_abs.max())}"  # as written
    for name, decision in decisions.items():
        judgement = decision.judgement()
        differences = weights[f"{name}_max_abs"]
        compared = ("weight gradients identical to PyTorch's, bit for bit" if differences.max() == 0 else
                    f"weight-gradient differences from PyTorch {format_range(differences.min(), differences.max())}")
        worst = max(judgement.quantities.values(), key=lambda q: q.bound_ratio)
        detail = judgement.layout_fix or judgement.format
        headline = (f"{judgement.verdict}{f' ({detail})' if detail else ''}: worst {worst.quantity} error ÷ bound "
                    f"{format_number(worst.bound_ratio)}; {compared} (seed: {seed})")
        rows.append(summary_row(name, EXPERIMENT, decision, headline))
    return pd.DataFrame(rows)


def headline_figure(table: pd.DataFrame, judgement: Judgement, estimate: float | None = None):
    """Max |difference| per quantity: the seed, the replays and the float32 rounding bound (log scale)."""
    import matplotlib.pyplot as plt

    from ..plots import set_caption

    estimate = seed_estimate() if estimate is None else estimate
    series = [("seed's report (its code − PyTorch)", "seed_max_abs"), (f"{REPLAY_SLIP} − PyTorch", f"{REPLAY_SLIP}_max_abs"),
              (f"{REPLAY} − PyTorch", f"{REPLAY}_max_abs"), ("float32 rounding bound (largest element)", "bound_max")]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    x = np.arange(len(table))
    width = 0.2
    for k, (label, column) in enumerate(series):
        ax.bar(x + (k - 1.5) * width, table[column].clip(lower=1e-12), width, label=label)
    ax.axhline(estimate, color="grey", ls="--", lw=1, label=f"seed's estimate √N·u = {estimate:.1e}")
    ax.set_yscale("log")
    ax.set_xticks(x, table["quantity"], rotation=20)
    ax.set_xlabel("quantity")
    ax.set_ylabel("max |difference| (absolute)")
    ax.set_title(f"Motivating case: {REPLAY_SLIP} is {judgement.verdict}"
                 + (f" (fix: {judgement.layout_fix})" if judgement.layout_fix else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    beyond = list(table.quantity[table[f"{REPLAY_SLIP}_max_abs"] > 2 * table.bound_max])
    faithful_beyond = list(table.quantity[table[f"{REPLAY}_max_abs"] > 2 * table.bound_max])
    set_caption(fig, f"Compare orange ({REPLAY_SLIP}) with red (the float32 rounding bound; two float32 results may "
                     "differ by twice it): "
                     + (f"{', '.join(beyond)} {'is' if len(beyond) == 1 else 'are'} beyond it, like the seed's blue bars"
                        if beyond else "no quantity is beyond it")
                     + f", while green ({REPLAY}) "
                     + (f"is beyond it in {', '.join(faithful_beyond)}." if faithful_beyond else "stays below it."))
    return fig


__all__ = ["EXPERIMENT", "SEED_REPORTED", "seed_reported", "seed_estimate", "replay", "magnitude_agreement", "evidence", "summarise",
           "headline_figure"]


# ---------------------------------------------------------------------------------------------
# the conclusion


def _as_reported(low, high) -> str:
    """The seed's figures as it wrote them (0.049–0.29), not padded to three digits it never gave."""
    return f"{format_reported(low)}–{format_reported(high)}" if low != high else format_reported(low)


def conclude(summary, table, judgements: dict) -> Conclusion:
    """04: the seed's question — were its 0.05–0.29 weight-gradient differences rounding?"""

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
                f"error ÷ bound up to {format_number(worst_quantity(slip).bound_ratio)}, where the float32 rounding bound is at "
                f"most {bound}), while the same design without the flip is within rounding "
                f"(error ÷ bound ≤ {format_number(worst_quantity(faithful).bound_ratio)}).")
    else:
        lead = (f"The replays do not settle the seed's question on this run: {verdict_groups(findings)} "
                f"(the float32 rounding bound of the weight gradients is at most {bound}).")
    return Conclusion(EXPERIMENT, lead, findings, unprobed_notes(judgements))
