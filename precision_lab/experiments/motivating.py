"""The motivating case (DESIGN.md): replay the seed's Fortran/cuDNN design and settle its table.

The seed compared its Fortran/CUDA gradients with PyTorch's and saw weight-gradient
differences of 0.05-0.29 with bias and loss differences near 1e-5. The replay candidates
hold the weights as (H, W, In, Out) like the seed's code and convert cuDNN's (Out, In, H, W)
gradients back: `fortran-replay` correctly, `fortran-replay-flip` with the spatial flip the
seed's conversion added. Computing their differences from PyTorch on the seed problem
reproduces the seed's magnitudes; judging them against the float64 reference names the cause.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..candidates import get_builtin
from ..errmodel import error_bounds
from ..problem import Problem
from ..verdict import Judgement, judge
from . import cached_reference, summary_row

EXPERIMENT = "04-motivating-case"

#: the seed's table (DESIGN.md, "The motivating case"): its candidate against PyTorch float32
SEED_TABLE = pd.DataFrame([
    {"quantity": "loss", "seed_max_abs": 1e-6, "seed_mean_abs": np.nan},
    {"quantity": "conv1.bias", "seed_max_abs": 2.2e-5, "seed_mean_abs": 6.6e-6},
    {"quantity": "conv2.bias", "seed_max_abs": 8.2e-5, "seed_mean_abs": 1.9e-5},
    {"quantity": "conv3.bias", "seed_max_abs": 8.6e-6, "seed_mean_abs": 8.6e-6},
    {"quantity": "conv1.weight", "seed_max_abs": 0.049, "seed_mean_abs": 0.012},
    {"quantity": "conv2.weight", "seed_max_abs": 0.290, "seed_mean_abs": 0.018},
    {"quantity": "conv3.weight", "seed_max_abs": 0.168, "seed_mean_abs": 0.067},
])

#: the seed's own rounding estimate, √N·u ≈ 3.6e-4, which it compared with 0.05-0.29
SEED_ESTIMATE = 3.6e-4

#: the PyTorch run the seed compared against, the faithful replay, the replay with the slip
PYTORCH, REPLAY, REPLAY_SLIP = "native", "fortran-replay", "fortran-replay-flip"


def _diff(got, want) -> tuple[float, float]:
    d = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(d.max()), float(d.mean())


def replay(problem: Problem, device: torch.device) -> tuple[pd.DataFrame, dict[str, Judgement]]:
    """The seed's table beside the replays' differences from PyTorch, and each replay's judgement.

    Table columns: quantity, seed_max_abs, seed_mean_abs, then for each replay
    `<name>_max_abs`/`<name>_mean_abs` (against PyTorch float32, as the seed measured) and
    `bound_max` (the error model's largest per-element float32 bound for the quantity).
    """
    trace = cached_reference(problem, device)
    pytorch = get_builtin(PYTORCH).compute(problem, "float32", device)
    bounds = error_bounds(trace, "float32")
    table = SEED_TABLE.copy()
    judgements = {}
    for name in (REPLAY_SLIP, REPLAY):
        candidate = get_builtin(name)
        result = candidate.compute(problem, "float32", device)
        judgements[name] = judge(result, trace, candidate.claimed_precision, name)
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


def summarise(table: pd.DataFrame, judgements: dict[str, Judgement]) -> pd.DataFrame:
    """One summary row per replay: verdict, and the headline that the index shows."""
    rows = []
    for name, judgement in judgements.items():
        weights = table[table.quantity.str.endswith(".weight")]
        headline = (f"{judgement.headline()}; weight-gradient differences from PyTorch "
                    f"{weights[f'{name}_max_abs'].min():.2g}-{weights[f'{name}_max_abs'].max():.2g} "
                    f"(seed: {weights.seed_max_abs.min():.2g}-{weights.seed_max_abs.max():.2g})")
        rows.append(summary_row(name, EXPERIMENT, judgement.verdict, headline))
    return pd.DataFrame(rows)


def headline_figure(table: pd.DataFrame, judgement: Judgement):
    """Max |difference| per quantity: the seed, the replays and the float32 rounding bound (log scale)."""
    import matplotlib.pyplot as plt

    series = [("seed's table", "seed_max_abs"), (f"{REPLAY_SLIP} − PyTorch", f"{REPLAY_SLIP}_max_abs"),
              (f"{REPLAY} − PyTorch", f"{REPLAY}_max_abs"), ("float32 rounding bound (max)", "bound_max")]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(table))
    width = 0.2
    for k, (label, column) in enumerate(series):
        ax.bar(x + (k - 1.5) * width, table[column].clip(lower=1e-12), width, label=label)
    ax.axhline(SEED_ESTIMATE, color="grey", ls="--", lw=1, label="seed's estimate √N·u")
    ax.set_yscale("log")
    ax.set_xticks(x, table["quantity"], rotation=20)
    ax.set_ylabel("max |difference|")
    ax.set_title(f"Motivating case: verdict {judgement.verdict}"
                 + (f" — fix: {judgement.layout_fix}" if judgement.layout_fix else ""))
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


__all__ = ["EXPERIMENT", "SEED_TABLE", "SEED_ESTIMATE", "replay", "magnitude_agreement", "evidence", "summarise",
           "headline_figure"]
