"""The campaign report: one self-contained HTML page from a campaign's table (`OUT/report.html`).

Same pieces and offline rules as the other reports (precision_lab.tables, plots, conclusions; the
stylesheet inline, figures inlined as PNG data, no script, nothing fetched): the conclusion in
words, verdict rates per candidate, the false-alarm rate of legitimate candidates, error ÷ bound
distributions per quantity, verdicts against image size and against image, the worst cells with
the `precision-lab diagnose` command that reproduces each, and the failed cells with their error.
"""
from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import numpy as np
import pandas as pd

from .. import plots, tables
from ..conclusions import Conclusion, Finding, Measurement
from ..errors import LabInputError
from ..findings import VERDICTS, worst

#: normal quantile of a two-sided 95% interval
Z95 = 1.959964
#: rows of the worst-cells table: every cell that disagrees with its expectation (up to the cap), then each
#: candidate's worst few, so that one loud defect does not hide a legitimate candidate's closest call
WORST_SHOWN, WORST_PER_CANDIDATE = 12, 2


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a rate k/n (Wilson 1927; stays inside [0, 1] and is sane at k = 0)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def cells_of(table: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (the cell-level columns repeat on each quantity's row)."""
    return table.drop_duplicates("key").reset_index(drop=True)


def _count(k: int, n: int) -> str:
    return f"{k} of {n} ({tables.format_percent(k / n)})" if n else "—"


def summary(table: pd.DataFrame) -> dict:
    """The numbers the report's words are computed from."""
    cells = cells_of(table)
    ok = cells[cells.status == "ok"]
    per = {}
    for candidate, group in cells.groupby("candidate", sort=False):
        good = group[group.status == "ok"]
        # a flag may run another build (native with tf32 on): each cell carries its own expectation
        expected = ", ".join(dict.fromkeys(good.expected.dropna())) or None
        counts = good.verdict.value_counts().to_dict()
        agree = int((good.verdict == good.expected).sum()) if expected else None
        per[candidate] = {"cells": len(group), "failed": int((group.status == "failed").sum()), "ok": len(good),
                          "counts": {v: int(counts.get(v, 0)) for v in VERDICTS}, "expected": expected,
                          "agree": agree, "most": max(counts, key=counts.get) if counts else None,
                          "max_ratio": float(good.worst_bound_ratio.max()) if len(good) else None,
                          "median_ratio": float(good.worst_bound_ratio.median()) if len(good) else None}
    legit = ok[ok.expected == "roundoff"]
    alarms = int((legit.verdict != "roundoff").sum())
    low, high = wilson_interval(alarms, len(legit))
    return {"cells": len(cells), "ok": len(ok), "failed": int((cells.status == "failed").sum()), "per": per,
            "legit_cells": len(legit), "false_alarms": alarms, "false_alarm_interval": (low, high),
            "legit_max_ratio": float(legit.worst_bound_ratio.max()) if len(legit) else None,
            "disagreeing": int((ok.expected.notna() & (ok.verdict != ok.expected)).sum())}


def conclusion(table: pd.DataFrame) -> Conclusion:
    s = summary(table)
    if s["legit_cells"]:
        low, high = s["false_alarm_interval"]
        alarm = (f"legitimate candidates were called something other than roundoff in {_count(s['false_alarms'], s['legit_cells'])} "
                 f"cells (95% interval {tables.format_percent(low)}–{tables.format_percent(high)}), with error ÷ bound "
                 f"at most {tables.format_number(s['legit_max_ratio'])}")
    else:
        alarm = "no candidate is declared legitimate (give `expect: roundoff` to measure a false-alarm rate)"
    lead = (f"{s['ok']} of {s['cells']} cells were diagnosed" + (f" ({s['failed']} failed)" if s["failed"] else "")
            + f"; {alarm}; " + ("every candidate with an expected verdict got it in every cell."
                                if s["disagreeing"] == 0 else
                                f"{s['disagreeing']} cells disagree with their candidate's expected verdict "
                                f"(the worst cells below reproduce them)."))
    findings = []
    for candidate, p in s["per"].items():
        if not p["ok"]:
            findings.append(Finding(candidate, "failed", f"all {p['cells']} cells failed (see the failed cells)"))
            continue
        spread = ", ".join(f"{v} in {_count(n, p['ok'])}" for v, n in p["counts"].items() if n)
        measurements = [Measurement("largest worst-quantity error ÷ bound", tables.format_number(p["max_ratio"]),
                                    "≤ 1 is rounding"),
                        Measurement("median worst-quantity error ÷ bound", tables.format_number(p["median_ratio"]))]
        if p["expected"]:
            measurements.append(Measurement(f"cells with the expected verdict ({p['expected']})",
                                            _count(p["agree"], p["ok"])))
        if p["failed"]:
            measurements.append(Measurement("failed cells", str(p["failed"])))
        verdict = p["most"] if len(set(v for v, n in p["counts"].items() if n)) == 1 else worst(
            [v for v, n in p["counts"].items() if n])
        action = ("" if p["expected"] is None or p["agree"] == p["ok"] else
                  f"reproduce a cell that disagrees with {p['expected']} (worst cells below) and read its evidence")
        findings.append(Finding(candidate, verdict, spread, measurements, action))
    notes = ["A cell's verdict is its diagnosis's overall one (the worst over the requested problem and the probes); "
             "a legitimate candidate is one whose expected verdict is roundoff (built-ins know theirs, "
             "a spec declares others with `expect:`)."]
    return Conclusion("campaign", lead, findings, notes)


# ---------------------------------------------------------------------------------------------
# tables


def rates_table(table: pd.DataFrame) -> pd.DataFrame:
    s = summary(table)
    rows = []
    for candidate, p in s["per"].items():
        row = {"candidate": candidate, "expected": p["expected"] or "—", "cells": p["cells"], "failed": p["failed"]}
        row.update({v: _count(p["counts"][v], p["ok"]) for v in VERDICTS})
        row["with the expected verdict"] = _count(p["agree"], p["ok"]) if p["expected"] else "—"
        rows.append(row)
    return pd.DataFrame(rows)


def verdicts_against(table: pd.DataFrame, by: str) -> pd.DataFrame:
    """Verdict counts per candidate and `by` (image_size or image_label), as words."""
    cells = cells_of(table)
    cells = cells.assign(image_size=_sizes(cells),
                         outcome=cells.verdict.where(cells.status == "ok", "failed"))
    rows = []
    for (candidate, value), group in cells.groupby(["candidate", by], sort=False):
        counts = group.outcome.value_counts()
        rows.append({"candidate": candidate, by: value, "cells": len(group),
                     "verdicts": ", ".join(f"{v} {counts[v]}" for v in (*VERDICTS, "failed") if v in counts),
                     "worst_bound_ratio": group.worst_bound_ratio.max()})
    return pd.DataFrame(rows)


def worst_cells(table: pd.DataFrame, shown: int = WORST_SHOWN, per_candidate: int = WORST_PER_CANDIDATE) -> pd.DataFrame:
    """Cells that disagree with their expected verdict first, then each candidate's worst by error ÷ bound."""
    cells = cells_of(table)
    cells = cells[cells.status == "ok"].copy()
    cells["disagrees"] = cells.expected.notna() & (cells.verdict != cells.expected)
    cells = cells.sort_values(["disagrees", "worst_bound_ratio"], ascending=[False, False])
    rank = cells.groupby("candidate", sort=False).cumcount()
    cells = cells[cells.disagrees | (rank < per_candidate)].head(shown)
    cells["image_size"] = _sizes(cells)
    return cells[["candidate", "image_label", "seed", "image_size", "batch", "flags", "verdict", "expected",
                  "worst_quantity", "worst_bound_ratio", "command"]]


LABELS = {"image_label": "image", "expected": "expected verdict", "cells": "cells", "failed": "failed cells",
          "worst_bound_ratio": "worst error ÷ bound (≤ 1: rounding)", "worst_quantity": "worst quantity",
          "command": "reproduce with", "flags": "precision flags", "image_size": "image size (H×W pixels)",
          "verdicts": "verdicts (cells)", "error": "error", "seed": "seed"}


# ---------------------------------------------------------------------------------------------
# figures


def ratio_figure(table: pd.DataFrame):
    """Error ÷ bound of every quantity in every cell, per candidate, with the bound at 1."""
    import matplotlib.pyplot as plt

    rows = table[(table.status == "ok") & table.quantity.notna()]
    quantities = list(dict.fromkeys(rows.quantity))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    colours = plots._candidate_colours(rows.candidate)
    offsets = np.linspace(-0.3, 0.3, max(len(colours), 1)) if len(colours) > 1 else [0.0]
    rng = np.random.default_rng(0)  # jitter only spreads overlapping points sideways
    for (candidate, colour), offset in zip(colours.items(), offsets):
        mine = rows[rows.candidate == candidate]
        x = np.array([quantities.index(q) for q in mine.quantity], float) + offset + rng.uniform(-0.04, 0.04, len(mine))
        ax.scatter(x, np.clip(mine.bound_ratio.astype(float), 1e-6, None), s=12, color=colour, alpha=0.7,
                   label=candidate)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="bound: error = bound")
    ax.set_yscale("log")
    ax.set_xticks(range(len(quantities)), quantities, rotation=20, ha="right")
    ax.set_xlabel("quantity (loss, output, gradient of each parameter)")
    ax.set_ylabel("max error ÷ bound (dimensionless)")
    ax.set_title("Error ÷ rounding bound per quantity, every cell")
    plots._finish(fig, ax)
    legit = rows[rows.expected == "roundoff"]
    above = legit[legit.bound_ratio > 1]
    text = (f"Each point is one quantity of one cell; points above the dashed line are errors the claimed precision "
            f"cannot explain. Legitimate candidates: {len(above)} of {len(legit)} points above it, the highest at "
            f"{tables.format_number(legit.bound_ratio.max())}." if len(legit) else
            "Each point is one quantity of one cell; points above the dashed line are errors the claimed precision "
            "cannot explain.")
    return plots.set_caption(fig, text)


def size_figure(table: pd.DataFrame):
    """Worst error ÷ bound of each cell against the number of pixels, per candidate."""
    import matplotlib.pyplot as plt

    cells = cells_of(table)
    cells = cells[cells.status == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plots._candidate_colours(cells.candidate)
    for candidate, group in cells.groupby("candidate", sort=False):
        pixels = (group.height * group.width).astype(float)
        ax.scatter(pixels, np.clip(group.worst_bound_ratio.astype(float), 1e-6, None), s=16,
                   color=colours[candidate], alpha=0.75, label=candidate)
        median = group.assign(pixels=pixels).groupby("pixels").worst_bound_ratio.median()
        ax.plot(median.index, np.clip(median.values, 1e-6, None), "-", color=colours[candidate], lw=1)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="bound: error = bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("image size H·W (pixels)")
    ax.set_ylabel("worst error ÷ bound (dimensionless)")
    ax.set_title("Worst error ÷ bound against image size (lines: median per size)")
    plots._finish(fig, ax)
    by_size = cells.groupby(cells.height * cells.width).apply(lambda g: (g.verdict != g.expected).sum()
                                                              if g.expected.notna().any() else 0)
    return plots.set_caption(fig, "A verdict that holds at every size keeps its points on one side of the dashed line; "
                                  + (f"disagreements with the expected verdict per size (pixels): "
                                     + ", ".join(f"{int(k)}: {int(v)}" for k, v in by_size.items()) + "."
                                     if len(by_size) else "no finished cell."))


# ---------------------------------------------------------------------------------------------
# the page


def _sizes(frame: pd.DataFrame) -> pd.Series:
    return frame.height.astype("Int64").astype(str) + "×" + frame.width.astype("Int64").astype(str)


def _context_rows(spec, cells: pd.DataFrame) -> list[tuple[str, str]]:
    ok = cells[cells.status == "ok"]
    grid = len({cell.key for cell in spec.cells()})
    versions = ", ".join(f"{name} {cells[col].dropna().iloc[0]}" for name, col in
                         (("precision-lab", "precision_lab_version"), ("torch", "torch_version"),
                          ("numpy", "numpy_version")) if col in cells and cells[col].notna().any())
    devices = sorted({f"{d} ({n})" for d, n in zip(ok.device, ok.device_name.fillna("?"))})
    time_text = (f"{tables.format_number(ok.seconds.sum())} s in all, median {tables.format_number(ok.seconds.median())} s"
                 if len(ok) else "—")
    return [("campaign", spec.name), ("spec", str(spec.path)),
            ("cells", f"{len(cells)} of {grid} finished ({int((cells.status == 'failed').sum())} failed)"),
            ("devices", ", ".join(devices) or "—"), ("probes", spec.probes), ("packages", versions or "—"),
            ("cell time", time_text), ("written", dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))]


def _false_alarms(table: pd.DataFrame) -> str:
    s = summary(table)
    if not s["legit_cells"]:
        return "<p>No legitimate candidate in this campaign (give one `expect: roundoff`).</p>"
    low, high = s["false_alarm_interval"]
    return (f"<p>{tables.escape(_count(s['false_alarms'], s['legit_cells']))} cells of legitimate candidates got a "
            f"verdict other than roundoff; 95% Wilson interval {tables.format_percent(low)}–"
            f"{tables.format_percent(high)}.</p>")


def report_html(spec, table: pd.DataFrame) -> str:
    cells = cells_of(table)
    concl = conclusion(table) if len(cells) else Conclusion("campaign", "No cell has finished yet.")
    parts = [concl.html(), "<h2>Run context</h2>", tables.definition_table(_context_rows(spec, cells), "run-context")]
    if (cells.status == "ok").any():
        parts += ["<h2>Verdict rates per candidate</h2>",
                  tables.table_html(rates_table(table), labels=LABELS, table_id="rates"),
                  "<h2>False alarms of legitimate candidates</h2>", _false_alarms(table),
                  "<h2>Error ÷ bound per quantity</h2>", plots.CaptionedFigure(ratio_figure(table)).body,
                  "<h2>Verdicts against image size</h2>", plots.CaptionedFigure(size_figure(table)).body,
                  tables.table_html(verdicts_against(table, "image_size"), labels=LABELS, table_id="by-size"),
                  "<h2>Verdicts against image</h2>",
                  tables.table_html(verdicts_against(table, "image_label"), labels=LABELS, table_id="by-image"),
                  "<h2>Worst cells</h2>",
                  f'<p class="lab-note">Cells that disagree with their expected verdict first, then each '
                  f"candidate's {WORST_PER_CANDIDATE} worst by error ÷ bound; each command repeats the cell with "
                  f"<code>precision-lab diagnose</code>.</p>",
                  tables.table_html(worst_cells(table), labels=LABELS, table_id="worst-cells")]
    failed = cells[cells.status == "failed"]
    if len(failed):
        shown = failed.assign(image_size=_sizes(failed))
        parts += ["<h2>Failed cells</h2>",
                  tables.table_html(shown[["candidate", "image_label", "seed", "image_size", "flags", "error"]],
                                    labels=LABELS, table_id="failed-cells")]
    parts.append('<p class="lab-note">The table behind this page: <code>campaign.parquet</code> beside it, one row per '
                 'cell and quantity (docs/campaigns.md lists its columns).</p>')
    heading = f"precision-lab campaign: {spec.name}"
    return tables.page(heading, "".join(parts), max_width="80em")


def write_report(spec, table: pd.DataFrame, path: Path) -> Path:
    """Write the page atomically (a temporary file renamed into place)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(report_html(spec, table), encoding="utf-8")
        temporary.replace(path)
    except OSError as exc:
        raise LabInputError(f"{path}: cannot write the campaign report ({exc.strerror})") from None
    return path
