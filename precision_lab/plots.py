"""Figures of the experiments (matplotlib; each function returns the Figure with its caption attached).

Every figure has a title, axes labelled with their units, a legend, the bound drawn wherever a
quantity is compared with one, and a one-sentence caption saying what to look at (written from the
plotted numbers). A notebook saves it with results.save_figure (the caption goes beside the PNG for
the index) and shows it with ``plots.show(figure)``: the image with its caption under it.
"""
from __future__ import annotations

import base64
import io
import math
import weakref

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter
import pandas as pd

from .formats import unit_roundoff
from .tables import HtmlBlock, escape, format_number, format_percent, format_range

VERDICT_COLOURS = {"roundoff": "#2b8a3e", "reduced-precision": "#e67700", "layout": "#1971c2", "defect": "#c92a2a",
                   "inconclusive": "#5c5f66"}
#: resolution of figures in reports and saved PNGs
DPI = 110
_CAPTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_caption(figure, caption: str):
    """Attach the one-sentence caption that says what to look at; returns the figure."""
    _CAPTIONS[figure] = caption
    return figure


def caption_of(figure) -> str:
    return _CAPTIONS.get(figure, "")


def _title_of(figure) -> str:
    suptitle = getattr(figure, "_suptitle", None)
    if suptitle is not None and suptitle.get_text():
        return suptitle.get_text()
    return next((ax.get_title() for ax in figure.axes if ax.get_title()), "figure")


class CaptionedFigure(HtmlBlock):
    """A figure as a report shows it: the PNG inline, its caption under it (figure/figcaption)."""

    def __init__(self, figure, caption: str | None = None):
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
        self.png, self.caption, title = buffer.getvalue(), caption or caption_of(figure), _title_of(figure)
        plt.close(figure)  # shown once, here: the inline backend must not show it again
        uri = "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")
        super().__init__(f'<figure class="lab-figure"><img src="{uri}" alt="{escape(title)}">'
                         f"<figcaption>{escape(self.caption)}</figcaption></figure>", f"[figure: {title}] {self.caption}")


def show(figure, caption: str | None = None) -> CaptionedFigure:
    """What a notebook displays for a figure: ``plots.show(figure)`` as the cell's last line."""
    return CaptionedFigure(figure, caption)


def _candidate_colours(names) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(dict.fromkeys(names))}


def _grouped_log_bars(categories: list[str], series: dict[str, np.ndarray], title: str, ylabel: str, xlabel: str,
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
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _finish(fig, ax, legend_columns: int = 1):
    ax.legend(fontsize=7, ncols=legend_columns, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    return fig


def masking_figure(step_table: pd.DataFrame):
    """01: relative error of gradients, of updates and of weights after one SGD step, and after Adam."""
    summary = step_table.groupby("candidate", sort=False).max(numeric_only=True)
    metrics = {"gradient g": "grad_rel_err", "SGD update lr·g": "sgd_update_rel_err",
               "weights after SGD": "sgd_weight_rel_err", "Adam first update": "adam_update_rel_err"}
    fig, ax = _grouped_log_bars(list(summary.index), {label: summary[column] for label, column in metrics.items()},
                                "What one optimizer step shows of a gradient error",
                                "max relative difference to float64\n(‖·‖∞ ÷ ‖reference‖∞, worst tensor)", "candidate")
    u32 = unit_roundoff("float32")
    ax.axhline(u32, color="k", ls=":", lw=1, label=f"float32 unit roundoff u = {u32:.1e}")
    hide = summary.grad_rel_err / summary.sgd_weight_rel_err.clip(lower=1e-300)
    set_caption(fig, "In each group compare the orange bar (the SGD update lr·g) with the green one (the weights "
                     "after the step): the update carries the gradient's error (blue) unchanged, while the weights show "
                     f"it {format_range(hide.min(), hide.max())}× smaller, down towards float32's unit roundoff (dotted).")
    return _finish(fig, ax)


def trajectory_figure(traj: pd.DataFrame, margin: float, steps_label: str = "SGD step"):
    """01: loss difference and weight distance to the float64 trajectory, envelope shaded, its limit (the envelope
    times `margin`, experiments.optimizer_step.ENVELOPE_MARGIN) dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9))
    colours = _candidate_colours(traj.member)
    spans, claims = traj.envelope, traj.claim  # experiments.optimizer_step.trajectories' columns
    members = traj[traj.role.isin(["envelope", "both"])]
    limits = {}
    # one band per format: a candidate is held to the envelope of the format it claims
    for fmt, shade in zip(dict.fromkeys(spans[members.index]), ("0.85", "#f3d9b1", "#cfe3f3", "#d8efd0")):
        envelope = members[spans[members.index] == fmt].groupby("step").weight_distance.agg(["min", "max"])
        moved = envelope.index > 0
        axes[1].fill_between(envelope.index[moved], envelope["min"][moved].clip(lower=1e-18),
                             envelope["max"][moved].clip(lower=1e-18), color=shade, alpha=0.9,
                             label=f"legitimate {fmt} envelope")
        axes[1].plot(envelope.index[moved], envelope["max"][moved] * margin, color="0.35", ls="--", lw=1,
                     label=f"{fmt} envelope edge × {margin:g} (limit)")
        limits[fmt] = (envelope["max"] * margin)[moved]  # the test of experiments.optimizer_step.envelope_verdicts
    for name, group in traj.groupby("member", sort=False):
        style = "--" if (group.role == "envelope").all() else "-"
        label = f"{name} (envelope)" if (group.role == "envelope").all() else name
        axes[0].plot(group.step, group.loss_diff.abs().clip(lower=1e-18), style, color=colours[name], label=label)
        axes[1].plot(group.step[group.step > 0], group.weight_distance[group.step > 0], style, color=colours[name])
    axes[0].set_title("loss difference to the float64 trajectory")
    axes[0].set_ylabel("|loss − loss₆₄| (absolute, loss units)")
    axes[1].set_title("weight distance to the float64 trajectory")
    axes[1].set_ylabel("‖w − w₆₄‖₂ ÷ ‖w₆₄‖₂ (relative)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel(steps_label)
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    labels = [label for ax in axes for label in ax.get_legend_handles_labels()[1]]
    fig.suptitle("k SGD steps: does each candidate stay with legitimate implementations of its format?", fontsize=11)
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside, never over, the lines
    outside = []
    for name, group in traj[traj.role.isin(["candidate", "both"])].groupby("member", sort=False):
        limit = limits.get(claims[group.index[0]])
        if limit is not None and (group.set_index("step").weight_distance.reindex(limit.index) > limit).any():
            outside.append(name)
    shaded = "the grey envelope" if set(limits) <= {"float32"} else "the envelope of the format it claims"
    set_caption(fig, f"Look at the right panel: a legitimate implementation stays in {shaded}, below its dashed "
                     "limit; " + (f"{', '.join(outside)} cross it." if outside else "every candidate stays below it."))
    return fig


def recompilation_figure(table: pd.DataFrame):
    """02: err64/err32 per quantity and candidate, against u64/u32 (rounding) and 1 (defect)."""
    quantities = list(dict.fromkeys(table.quantity))
    series = {name: table[table.candidate == name].set_index("quantity").reindex(quantities).ratio.fillna(0)
              for name in dict.fromkeys(table.candidate)}
    fig, ax = _grouped_log_bars(quantities, series, "Does the error vanish when the candidate is recompiled in float64?",
                                "err64 ÷ err32 (ratio of max |error|)", "quantity", colours=_candidate_colours(series))
    expected = unit_roundoff("float64") / unit_roundoff("float32")
    ax.axhline(expected, color="k", ls=":", lw=1, label=f"u₆₄/u₃₂ = {expected:.1e} (rounding predicts)")
    ax.axhline(math.sqrt(expected), color="0.4", ls="--", lw=1, label=f"√(u₆₄/u₃₂) = {math.sqrt(expected):.1e} (boundary)")
    ax.axhline(1.0, color="#c92a2a", ls="-", lw=1, label="1 (a defect predicts)")
    ax.set_ylim(1e-17, 10)
    params = table[table.quantity != "loss"]
    persisting = list(dict.fromkeys(params[params.ratio > math.sqrt(expected)].candidate))
    set_caption(fig, "Bars below the dashed boundary are errors that vanish with the arithmetic (rounding); bars near "
                     "the red line at 1 persist in float64" + (f": {', '.join(persisting)}." if persisting else
                                                              ", and no candidate has one."))
    return _finish(fig, ax)


def sweep_figure(table: pd.DataFrame, defect_level: float):
    """03: err/(u·S) against n per weight gradient, with √n and log₂n lines; err/|g| below with the defect level
    (experiments.size_sweep.DEFECT_REL_TO_GRAD)."""

    weight_names = [p for p in dict.fromkeys(table.parameter) if p.endswith(".weight")]
    fig, axes = plt.subplots(2, len(weight_names), figsize=(4 * len(weight_names), 6.8), sharex=True,
                             squeeze=False)
    colours = _candidate_colours(table.candidate)
    n = np.array(sorted(table.n.unique()), float)
    for col, name in enumerate(weight_names):
        rows = table[table.parameter == name]
        top, bottom = axes[0, col], axes[1, col]
        for candidate, group in rows.groupby("candidate", sort=False):
            top.plot(group.n, group.err_over_uS, "o-", color=colours[candidate], label=candidate, ms=3)
            bottom.plot(group.n, group.err_over_grad, "o-", color=colours[candidate], ms=3)
        top.plot(n, np.sqrt(n), "k--", lw=1, label="√n (recursive summation, probabilistic)")
        top.plot(n, np.log2(n), "k:", lw=1, label="log₂ n (pairwise summation)")
        bottom.axhline(defect_level, color="#c92a2a", ls="--", lw=1,
                       label=f"defect level {defect_level:.2g} (10·u of bfloat16)")
        top.set_title(name)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_yscale("log")
        bottom.set_xlabel("n = batch·H·W (terms per sum)")
    axes[0, 0].set_ylabel("max |error| ÷ (u₃₂·S)\n(S = Σ|terms|)")
    axes[1, 0].set_ylabel("max |error| ÷ max |g|\n(relative to the gradient)")
    for ax in axes.ravel():
        ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: minor ones overlap
    handles, labels = axes[0, 0].get_legend_handles_labels()
    bottom_handles, bottom_labels = axes[1, 0].get_legend_handles_labels()
    fig.suptitle("Weight-gradient error against the number of accumulated terms", fontsize=11)
    fig.tight_layout()
    fig.legend(handles + bottom_handles, labels + bottom_labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    set_caption(fig, "Top: float32 accumulation follows the √n or log₂ n lines while operands rounded to a coarser "
                     "format fall relative to them; bottom: a defect stays above the red dashed line at every size, "
                     "rounding falls below it.")
    return fig


def bound_ratio_figure(table: pd.DataFrame):
    """03: error ÷ bound (worst gradient) across sizes: above 1 means the claimed precision cannot explain it."""
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    colours = _candidate_colours(table.candidate)
    worst = table.groupby(["candidate", "size"], sort=False).bound_ratio.max().reset_index()
    for candidate, group in worst.groupby("candidate", sort=False):
        ax.plot(group["size"], group.bound_ratio, "o-", color=colours[candidate], label=candidate)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="bound: error = bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("image size (pixels per side)")
    ax.set_ylabel("max error ÷ bound (worst gradient)")
    ax.set_title("Error against the rounding bound of the claimed precision")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    largest = worst[worst["size"] == worst["size"].max()]
    above = list(largest[largest.bound_ratio > 1].candidate)
    set_caption(fig, "Points above the dashed line are errors the claimed precision cannot explain"
                     + (f": at the largest size, {', '.join(above)}." if above else "; no candidate is above it."))
    return fig


def noise_floor_figure(floor: pd.DataFrame):
    """03: each legitimate member's error and the ensemble's spread, ÷ the model's bound, per quantity."""
    quantities = list(dict.fromkeys(floor.quantity))
    series = {member: floor[floor.member == member].set_index("quantity").reindex(quantities).bound_ratio
              for member in dict.fromkeys(floor.member)}
    fig, ax = _grouped_log_bars(quantities, series, "Empirical noise floor: legitimate float32 computations against the model",
                                "max error ÷ bound", "quantity", colours=_candidate_colours(series),
                                hatches={"ensemble-spread": "//"}, floor=1e-6)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="the model's bound")
    members = floor[floor.member != "ensemble-spread"]
    set_caption(fig, "Every legitimate member must stay below the dashed line (the model's bound); the gap is the "
                     f"model's slack: the largest member error uses {format_percent(members.bound_ratio.max())} of it.")
    return _finish(fig, ax)


def verdict_table_style(frame: pd.DataFrame):
    """A verdict table for people (precision_lab.tables.show); kept for notebooks written before it."""
    from .tables import show as show_table

    return show_table(frame)


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
    f32 = v_table[v_table.precision == "float32"].sort_values("error")
    best = f32.iloc[0]
    set_caption(fig, f"The float32 quotient is closest to the derivative at ε = {best.epsilon:g} "
                     f"({format_number(best.relative_error)} relative), where truncation and rounding cross; "
                     f"smaller steps only add rounding, which is why a tolerance at ε = {practice_epsilon:g} measures ε.")
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
    best = rates.loc[rates.groupby("candidate").pass_rate.idxmax()]
    set_caption(fig, "The pass rate rises and falls with ε for right and wrong gradients alike (best: "
                     + "; ".join(f"{r.candidate} {format_percent(r.pass_rate)} at ε = {r.epsilon:g}"
                                 for r in best.itertuples())
                     + "), and the measured loss noise predicts it: it says how noisy the loss is, not whether "
                       "the gradient is right.")
    return _finish(fig, ax, legend_columns=1)


__all__ = ["CaptionedFigure", "bound_ratio_figure", "caption_of", "difference_quotient_figure", "masking_figure",
           "noise_floor_figure", "pass_rate_figure", "recompilation_figure", "set_caption", "show", "sweep_figure",
           "trajectory_figure", "verdict_table_style"]
