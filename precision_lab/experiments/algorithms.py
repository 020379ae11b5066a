"""Experiment 05: convolution algorithms (docs/design.md, "Convolution algorithm selection").

Every algorithm of `precision_lab.conv` runs the seed problem's forward + backward in float32
at each size; each result is judged against the float64 reference with the lab's own error
model (precision_lab.verdict.judge, claimed float32). Legitimate algorithms must come out
`roundoff` (the lab must not cry wolf at a legitimate summation order), with an error ÷ bound
that shows how much of the rounding budget each uses, next to its run time. On a GPU the
cuDNN kernels that ran are recorded with TF32 on and off (torch.profiler kernel names).
"""
from __future__ import annotations

import time

import matplotlib.pyplot as plt
import pandas as pd
import torch

from ..candidates import Candidate
from ..compute import forward_backward
from ..conclusions import Conclusion, Finding, Measurement, action_for, unprobed_notes
from ..conv import get_algorithm, record_kernels
from ..conv.backends import native_flags
from ..ops import Kernels
from ..probes import ProbeRun
from ..problem import make_problem
from ..tables import format_number, format_percent
from ..verdict import judge
from . import cached_reference, decide_candidate, progress, summary_row

EXPERIMENT = "05-conv-algorithms"
DEFAULT_ALGORITHMS = ("native", "direct", "im2col", "fft", "winograd-f2x3", "winograd-f4x3")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(problem, algorithm: str, device: torch.device):
    """One float32 forward + backward with `algorithm`: (Result, wall seconds)."""
    conv = get_algorithm(algorithm)
    _synchronize(device)
    start = time.perf_counter()
    result = forward_backward(problem, "float32", device, kernels=Kernels(conv=conv, name=algorithm))
    _synchronize(device)
    return result, time.perf_counter() - start


def algorithm_candidate(algorithm: str) -> Candidate:
    """A convolution algorithm as a candidate (claimed float32): what the probes and the decision run."""
    def run(problem, precision, device):
        return forward_backward(problem, precision, device, kernels=Kernels(conv=get_algorithm(algorithm),
                                                                            name=algorithm))

    return Candidate(name=algorithm, description=f"the network with {algorithm} convolutions", run=run)


def sweep(sizes: list[int], algorithms: list[str], device: torch.device, batch: int = 2, seed: int = 0,
          network=None, probes="default") -> tuple[pd.DataFrame, dict]:
    """Per size × algorithm × parameter gradient: error ÷ bound, max error, the verdict, and run time; and each
    algorithm's decision (precision_lab.decision.decide): the largest size with the probes `diagnose` runs there,
    the other sizes as problems of their own.
    An algorithm runs the network's 3×3 stride-1 convolutions; its other layers run natively."""
    rows, judged, problems = [], {}, {}
    for size in progress(sizes, desc="sizes"):
        problem = make_problem(size, batch, seed, network=network)
        problems[size] = problem
        trace = cached_reference(problem, device)
        for algorithm in algorithms:
            result, seconds = timed_run(problem, algorithm, device)
            judgement = judge(result, trace, "float32", algorithm)
            judged[algorithm, size] = judgement
            for name in problem.network.parameter_names:
                q = judgement.quantities[name]
                rows.append({"algorithm": algorithm, "size": size, "batch": batch, "quantity": name,
                             "n_terms": batch * size * size, "bound_ratio": q.bound_ratio,
                             "max_abs_err": q.max_abs_err, "verdict": q.verdict, "overall": judgement.verdict,
                             "seconds": seconds})
    largest = max(problems)
    decisions = {}
    for algorithm in progress(algorithms, desc="05 probes", unit="algorithm"):
        others = [(ProbeRun.of_size(problems[size]), judged[algorithm, size]) for size in sorted(problems)
                  if size != largest]
        decisions[algorithm] = decide_candidate(algorithm_candidate(algorithm), problems[largest], device,
                                                judged[algorithm, largest], probes, others)
    return pd.DataFrame(rows), decisions


def per_run(table: pd.DataFrame) -> pd.DataFrame:
    """One row per algorithm × size: worst error ÷ bound over the gradients, time, time ÷ native."""
    grouped = table.groupby(["algorithm", "size"], sort=False)
    runs = grouped.agg(worst_bound_ratio=("bound_ratio", "max"), overall=("overall", "first"),
                       seconds=("seconds", "first")).reset_index()
    if "native" in set(runs["algorithm"]):
        native = runs[runs["algorithm"] == "native"].set_index("size")["seconds"]
        runs["time_vs_native"] = runs["seconds"] / runs["size"].map(native)
    return runs


def summary(table: pd.DataFrame, decisions: dict) -> pd.DataFrame:
    """results.SUMMARY_COLUMNS, one row per algorithm: its decided verdict (every size and the probes)."""
    runs = per_run(table)
    rows = []
    for algorithm, group in runs.groupby("algorithm", sort=False):
        largest = group.loc[group["size"].idxmax()]
        # timings go in their own columns, never in the headline: result tables must repeat bit for bit
        headline = (f"worst error ÷ bound {format_number(group['worst_bound_ratio'].max())} over sizes "
                    f"{group['size'].min()} to {group['size'].max()}")
        timing = {"seconds_at_largest": float(largest["seconds"])}
        if "time_vs_native" in group:
            timing["time_vs_native_at_largest"] = float(largest["time_vs_native"])
        rows.append(summary_row(algorithm, EXPERIMENT, decisions[algorithm], headline, **timing))
    return pd.DataFrame(rows)


def kernels_by_precision(problem, device: torch.device) -> pd.DataFrame:
    """Which kernels one native forward + backward ran, per setting.

    On a GPU: cuDNN/cuBLAS float32 precision 'ieee' (TF32 off) and 'tf32' (on). On CPU: oneDNN
    on and off (the dispatched convolution operators; TF32 does not exist there).
    """
    settings = ({"fp32_precision": "ieee"}, {"fp32_precision": "tf32"}) if device.type == "cuda" \
        else ({"mkldnn": True}, {"mkldnn": False})
    rows = []
    for flags in settings:
        with native_flags(**flags):
            _, kernels = record_kernels(lambda: forward_backward(problem, "float32", device), device)
        label = ", ".join(f"{k}={v}" for k, v in flags.items())
        rows += [{"setting": label, "kernel": kernel} for kernel in kernels]
    return pd.DataFrame(rows, columns=["setting", "kernel"])


def headline_figure(table: pd.DataFrame):
    """Left: worst error ÷ bound against size (≤ 1: rounding); right: time against size."""
    from ..plots import set_caption

    runs = per_run(table)
    fig, (ax_err, ax_time) = plt.subplots(1, 2, figsize=(11, 4.1))
    for algorithm, group in runs.groupby("algorithm", sort=False):
        ax_err.plot(group["size"], group["worst_bound_ratio"], marker="o", label=algorithm)
        ax_time.plot(group["size"], group["seconds"], marker="o", label=algorithm)
    ax_err.axhline(1.0, color="black", linestyle="--", linewidth=1, label="bound: error = bound")
    for ax, ylabel in ((ax_err, "worst gradient error ÷ float32 bound"), (ax_time, "forward + backward time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("image size (pixels per side)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_err.set_title("error ÷ bound (float32 claimed)")
    ax_time.set_title("time per forward + backward (wall clock)")
    fig.suptitle("Convolution algorithms: accuracy against the rounding bound, and cost", fontsize=11)
    fig.tight_layout()
    fig.legend(*ax_err.get_legend_handles_labels(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    above = list(dict.fromkeys(runs[runs["worst_bound_ratio"] > 1.0]["algorithm"]))
    set_caption(fig, "Left: a legitimate float32 algorithm stays below the dashed line at every size"
                     + (f" ({', '.join(above)} crosses it)" if above else ", and every one does")
                     + "; right: what each costs on this machine (one run per point, so small differences are noise).")
    return fig


# ---------------------------------------------------------------------------------------------
# the conclusion


def conclude(summary, table, decisions: dict | None = None) -> Conclusion:
    """05: is each convolution algorithm a legitimate float32 implementation, and how much budget does it use?
    (`decisions`: precision_lab.decision.Diagnosis by algorithm, which says where a verdict the tables cannot
    show was found.)"""

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
