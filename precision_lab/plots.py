"""Figures of the three experiments (matplotlib; each function returns the Figure)."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .formats import unit_roundoff

VERDICT_COLOURS = {"roundoff": "#2b8a3e", "reduced-precision": "#e67700", "layout": "#1971c2", "defect": "#c92a2a",
                   "inconclusive": "#5c5f66"}


def _candidate_colours(names) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(dict.fromkeys(names))}


def _grouped_log_bars(categories: list[str], series: dict[str, np.ndarray], title: str, ylabel: str,
                      colours: dict | None = None, hatches: dict | None = None, floor: float = 1e-17):
    """One group of bars per category, one bar per series, on a log axis: the lab's bar-chart shape."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    x = np.arange(len(categories))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, np.clip(np.asarray(values, float), floor, None), width,
               label=label, color=(colours or {}).get(label), hatch=(hatches or {}).get(label))
    ax.set_yscale("log")
    ax.set_xticks(x, categories, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _finish(fig, ax, legend_columns: int = 2):
    ax.legend(fontsize=7, ncols=legend_columns)
    fig.tight_layout()
    return fig


def masking_figure(step_table: pd.DataFrame):
    """01: relative error of gradients, of updates and of weights after one SGD step, and after Adam."""
    summary = step_table.groupby("candidate", sort=False).max(numeric_only=True)
    metrics = {"gradient": "grad_rel_err", "SGD update lr·g": "sgd_update_rel_err",
               "weights after SGD": "sgd_weight_rel_err", "Adam first update": "adam_update_rel_err"}
    fig, ax = _grouped_log_bars(list(summary.index), {label: summary[column] for label, column in metrics.items()},
                                "What one optimizer step shows of a gradient error", "max relative difference to float64")
    return _finish(fig, ax)


def trajectory_figure(traj: pd.DataFrame, steps_label: str = "SGD step"):
    """01: loss difference and weight distance to the float64 trajectory, envelope shaded."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = _candidate_colours(traj.member)
    envelope = traj[traj.role.isin(["envelope", "both"])].groupby("step").weight_distance.agg(["min", "max"])
    axes[1].fill_between(envelope.index, envelope["min"].clip(lower=1e-18), envelope["max"].clip(lower=1e-18),
                         color="0.85", label="legitimate float32 envelope")
    for name, group in traj.groupby("member", sort=False):
        style = "--" if (group.role == "envelope").all() else "-"
        axes[0].plot(group.step, group.loss_diff.abs().clip(lower=1e-18), style, color=colours[name], label=name)
        axes[1].plot(group.step[group.step > 0], group.weight_distance[group.step > 0], style, color=colours[name])
    for ax, title in zip(axes, ("|loss − loss₆₄|", "‖w − w₆₄‖ / ‖w₆₄‖")):
        ax.set_yscale("log")
        ax.set_xlabel(steps_label)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def recompilation_figure(table: pd.DataFrame):
    """02: err64/err32 per quantity and candidate, against u64/u32 (rounding) and 1 (defect)."""
    quantities = list(dict.fromkeys(table.quantity))
    series = {name: table[table.candidate == name].set_index("quantity").reindex(quantities).ratio.fillna(0)
              for name in dict.fromkeys(table.candidate)}
    fig, ax = _grouped_log_bars(quantities, series, "Does the error vanish when the candidate is recompiled in float64?",
                                "err64 / err32", colours=_candidate_colours(series))
    expected = unit_roundoff("float64") / unit_roundoff("float32")
    ax.axhline(expected, color="k", ls=":", lw=1, label="u64/u32 (rounding)")
    ax.axhline(math.sqrt(expected), color="0.4", ls="--", lw=1, label="√(u64/u32) boundary")
    ax.axhline(1.0, color="#c92a2a", ls="-", lw=1, label="1 (defect)")
    ax.set_ylim(1e-17, 10)
    return _finish(fig, ax)


def sweep_figure(table: pd.DataFrame):
    """03: err/(u·S) against n per weight gradient, with √n and log₂n lines; err/|g| below."""
    weight_names = [p for p in dict.fromkeys(table.parameter) if p.endswith(".weight")]
    fig, axes = plt.subplots(2, len(weight_names), figsize=(4 * len(weight_names), 6.5), sharex=True, squeeze=False)
    colours = _candidate_colours(table.candidate)
    n = np.array(sorted(table.n.unique()), float)
    for col, name in enumerate(weight_names):
        rows = table[table.parameter == name]
        top, bottom = axes[0, col], axes[1, col]
        for candidate, group in rows.groupby("candidate", sort=False):
            top.plot(group.n, group.err_over_uS, "o-", color=colours[candidate], label=candidate, ms=3)
            bottom.plot(group.n, group.err_over_grad, "o-", color=colours[candidate], ms=3)
        top.plot(n, np.sqrt(n), "k--", lw=1, label="√n (recursive, probabilistic)")
        top.plot(n, np.log2(n), "k:", lw=1, label="log₂ n (pairwise)")
        top.set_title(name)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_yscale("log")
        bottom.set_xlabel("n = batch·H·W terms per sum")
    axes[0, 0].set_ylabel("max err / (u₃₂·S)")
    axes[1, 0].set_ylabel("max err / max|g|")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def bound_ratio_figure(table: pd.DataFrame):
    """03: error ÷ bound (worst gradient) across sizes: above 1 means the claimed precision cannot explain it."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    colours = _candidate_colours(table.candidate)
    worst = table.groupby(["candidate", "size"], sort=False).bound_ratio.max().reset_index()
    for candidate, group in worst.groupby("candidate", sort=False):
        ax.plot(group["size"], group.bound_ratio, "o-", color=colours[candidate], label=candidate)
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("image size (pixels per side)")
    ax.set_ylabel("max error ÷ bound")
    ax.set_title("Error against the rounding bound of the claimed precision")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def noise_floor_figure(floor: pd.DataFrame):
    """03: each legitimate member's error and the ensemble's spread, ÷ the model's bound, per quantity."""
    quantities = list(dict.fromkeys(floor.quantity))
    series = {member: floor[floor.member == member].set_index("quantity").reindex(quantities).bound_ratio
              for member in dict.fromkeys(floor.member)}
    fig, ax = _grouped_log_bars(quantities, series, "Empirical noise floor: legitimate float32 computations against the model",
                                "max error ÷ bound", colours=_candidate_colours(series),
                                hatches={"ensemble-spread": "//"}, floor=1e-6)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="the model's bound")
    return _finish(fig, ax)


def verdict_table_style(frame: pd.DataFrame):
    """A pandas Styler colouring the verdict column; cell text is HTML-escaped (names come from users)."""
    def colour(value):
        return f"color: {VERDICT_COLOURS.get(value, 'inherit')}; font-weight: bold"

    return frame.style.map(colour, subset=["verdict"]).format(precision=3, escape="html").hide(axis="index")


def difference_quotient_figure(v_table: pd.DataFrame, lines: dict, practice_epsilon: float = 1e-5):
    """06: |central difference − derivative| against ε (the V), with the truncation and rounding lines."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    eps = np.array(sorted(v_table.epsilon.unique()))
    fine = np.logspace(np.log10(eps.min()), np.log10(eps.max()), 100)
    for precision, colour in (("float32", "#c92a2a"), ("float64", "#1971c2")):
        rows = v_table[v_table.precision == precision].sort_values("epsilon")
        ax.loglog(rows.epsilon, np.clip(rows.error, 1e-18, None), "o-", color=colour, label=f"{precision} central difference")
    ax.loglog(fine, [lines["truncation"](e) for e in fine], "--", color="0.3", label="truncation ε²·|L‴|/6")
    ax.loglog(fine, [lines["rounding"](e) for e in fine], ":", color="#c92a2a",
              label="float32 rounding (loss noise, rounded step)/ε")
    ax.axhline(1e-3 * abs(lines["truth"]), color="#e67700", lw=1, label="rtol 1e-3 × |derivative|")
    ax.axvline(practice_epsilon, color="0.6", lw=1)
    ax.text(practice_epsilon, ax.get_ylim()[1], " ε = 1e-5", va="top", fontsize=8, color="0.4")
    ax.set_xlabel("step ε along a random unit direction")
    ax.set_ylabel("|difference quotient − derivative|")
    ax.set_title("Central differences: truncation falls as ε², rounding grows as 1/ε")
    return _finish(fig, ax, legend_columns=1)


def pass_rate_figure(rates: pd.DataFrame):
    """06: the practice's pass rate against ε for each candidate, with what the noise predicts."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for (candidate, rows), colour in zip(rates.groupby("candidate", sort=False), ("#2b8a3e", "#c92a2a", "#1971c2")):
        rows = rows.sort_values("epsilon")
        ax.semilogx(rows.epsilon, 100 * rows.pass_rate, "o-", color=colour, label=f"{candidate}: observed")
        ax.semilogx(rows.epsilon, 100 * rows.predicted_pass_rate, "--", color=colour,
                    label=f"{candidate}: predicted from the measured noise (right gradient)")
    ax.set_ylim(0, 102)
    ax.set_xlabel("ε")
    ax.set_ylabel("elements passing rtol 1e-3, atol 1e-6 (%)")
    ax.set_title("float32 finite-difference 'pass rate' of the KAN's gradient")
    return _finish(fig, ax, legend_columns=1)


__all__ = ["masking_figure", "trajectory_figure", "recompilation_figure", "sweep_figure", "bound_ratio_figure",
           "verdict_table_style", "difference_quotient_figure", "pass_rate_figure"]
