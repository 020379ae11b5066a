"""Where a notebook's results go: tidy tables (CSV + JSON) and figures under the run directory.

A notebook run by `precision-lab run` receives `run_dir` (a papermill parameter); run by hand
in Jupyter it has `run_dir = None` and nothing is written. Each notebook saves a `summary`
table with SUMMARY_COLUMNS, one row per candidate: the index page reads those.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

#: one row per (candidate, experiment): what the index shows
SUMMARY_COLUMNS = ("candidate", "experiment", "verdict", "headline")
#: each notebook's conclusion in words (precision_lab.conclusions.Conclusion.to_frame): the index's summary
CONCLUSIONS = "conclusions"
CAPTION_SUFFIX = ".caption.txt"


def notebook_dir(run_dir: str | Path | None, notebook: str) -> Path | None:
    if run_dir is None:
        return None
    path = Path(run_dir) / notebook
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_tables(run_dir: str | Path | None, notebook: str, tables: dict[str, pd.DataFrame]) -> list[Path]:
    """Write each table as `<run_dir>/<notebook>/<name>.csv` and `.json` (records); returns the paths."""
    folder = notebook_dir(run_dir, notebook)
    if folder is None:
        return []
    if "summary" in tables:
        missing = [c for c in SUMMARY_COLUMNS if c not in tables["summary"].columns]
        if missing:
            raise ValueError(f"summary table of {notebook} lacks columns {missing}")
    written = []
    for name, frame in tables.items():
        csv, js = folder / f"{name}.csv", folder / f"{name}.json"
        frame.to_csv(csv, index=False, float_format="%.17g")
        js.write_text(json.dumps(json.loads(frame.to_json(orient="records", double_precision=15)), indent=1))
        written += [csv, js]
    return written


def save_figure(run_dir: str | Path | None, notebook: str, name: str, figure) -> Path | None:
    """Save a matplotlib figure as `<run_dir>/<notebook>/<name>.png` (the index shows headline ones),
    and its caption (precision_lab.plots.set_caption) as `<name>.caption.txt` beside it."""
    from .plots import DPI, caption_of

    folder = notebook_dir(run_dir, notebook)
    if folder is None:
        return None
    path = folder / f"{name}.png"
    figure.savefig(path, dpi=DPI, bbox_inches="tight")
    caption = caption_of(figure)
    if caption:
        (folder / f"{name}{CAPTION_SUFFIX}").write_text(caption + "\n", encoding="utf-8")
    return path


def figure_caption(png: Path) -> str:
    """The caption saved beside a figure ('' when none was)."""
    path = png.with_name(png.stem + CAPTION_SUFFIX)
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


def load_summaries(run_dir: str | Path) -> pd.DataFrame:
    """Every notebook's summary table of a run, stacked (empty frame if none)."""
    frames = [pd.read_csv(p) for p in sorted(Path(run_dir).glob("*/summary.csv"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(SUMMARY_COLUMNS))


def load_conclusions(run_dir: str | Path) -> pd.DataFrame:
    """Every notebook's conclusions table of a run, stacked (empty frame if none)."""
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in sorted(Path(run_dir).glob(f"*/{CONCLUSIONS}.csv"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
