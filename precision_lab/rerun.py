"""`precision-lab rerun reports/<run-id>`: repeat a run from its provenance, then compare its tables.

The parameters, notebooks and options come from `reports/<run-id>/provenance.json`, not from
the params file (which may have changed since). The new run gets a new id and records
`rerun_of`; its result tables are compared cell by cell, as written, with the earlier run's
(timing columns left out: wall-clock time is never reproducible). On the same
CPU machine and commit they should be identical (tests/test_reproducibility.py checks it);
on a GPU, or after a code change, differences are reported, and `--check` makes them an error.
"""
from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

from . import provenance as prov
from . import report
from .errors import LabInputError

#: files of a run that describe it rather than hold results (they name the run's own folder or time)
NOT_RESULTS = ("provenance.json", "parameters.yaml", "papermill.log", "started")
#: columns that measure wall-clock time (`seconds`, `time_vs_native`, `elapsed_ms` …): they differ
#: between any two runs by nature, so the comparison leaves them out and says so
TIMING_COLUMN = re.compile(r"(^|_)(seconds|secs|time|elapsed|ms|wall)(_|$)", re.IGNORECASE)


def configure(parser) -> None:
    parser.add_argument("run", type=Path, help="an earlier run's report folder, e.g. reports/latest")
    parser.add_argument("--run-id", help="name of the new run (default: UTC time)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every result table is bitwise identical")


def main(args) -> int:
    earlier = prov.read(args.run)
    options = earlier.get("options") or {}
    reports_dir = Path(options.get("reports_dir") or args.run.resolve().parent)
    runs_dir = Path(options.get("runs_dir") or report.RUNS_DIR)
    notebooks = earlier.get("notebooks") or []
    if not notebooks:
        raise LabInputError(f"{args.run}/provenance.json: key 'notebooks' is empty (expected the notebooks run)")
    _warn_if_code_moved(earlier)
    plan = report.plan_run(values=earlier["parameters"], notebooks=",".join(notebooks), run_id=args.run_id,
                           show_code=bool(options.get("show_code")), cell_timeout=options.get("cell_timeout"),
                           notebooks_dir=earlier.get("notebooks_dir") or report.NOTEBOOKS_DIR,
                           reports_dir=reports_dir, runs_dir=runs_dir, rerun_of=earlier["run_id"])
    status = report.execute(plan)
    if status not in (0, 1):  # interrupted: nothing to compare
        return status
    differing, compared = compare_tables(runs_dir / earlier["run_id"], runs_dir / plan.run_id)
    if differing:
        print(f"precision-lab: {len(differing)} of {compared} result files differ from run {earlier['run_id']}: "
              f"{', '.join(differing)}", file=sys.stderr)
        return 1 if args.check else status
    skipped = timing_columns(runs_dir / plan.run_id)
    print(f"precision-lab: all {compared} result files are bitwise identical to run {earlier['run_id']}"
          + (f" (timing columns left out: {', '.join(skipped)})" if skipped else ""), file=sys.stderr)
    return status


def _warn_if_code_moved(earlier: dict) -> None:
    then, now = earlier.get("git") or {}, prov.git_state()
    if then.get("commit") != now.get("commit") or then.get("dirty") or now.get("dirty"):
        print(f"precision-lab: warning: run {earlier.get('run_id')} was made at commit {then.get('commit')}"
              f"{' (dirty)' if then.get('dirty') else ''}; the checkout is at {now.get('commit')}"
              f"{' (dirty)' if now.get('dirty') else ''}: results may differ", file=sys.stderr)


def _is_timing(column: str) -> bool:
    return bool(TIMING_COLUMN.search(column))


def comparable_content(path: Path):
    """A table as compared across runs: every cell as written, except timing columns (wall clock)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        if not rows:
            return rows
        keep = [i for i, column in enumerate(rows[0]) if not _is_timing(column)]
        return [[row[i] for i in keep if i < len(row)] for row in rows]
    data = json.loads(text)
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return [{k: v for k, v in row.items() if not _is_timing(k)} for row in data]
    return data


def timing_columns(run_dir: Path) -> list[str]:
    """The timing columns a comparison of this run's tables leaves out."""
    found = set()
    for path in result_files(run_dir).values():
        if path.suffix == ".csv":
            header = next(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))), [])
            found |= {f"{path.parent.name}/{path.name}:{c}" for c in header if _is_timing(c)}
    return sorted(found)


def result_files(run_dir: Path) -> dict[str, Path]:
    """A run's result tables (CSV, JSON), by path relative to the run folder."""
    return {p.relative_to(run_dir).as_posix(): p for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.suffix in (".csv", ".json") and p.name not in NOT_RESULTS}


def compare_tables(earlier: Path, later: Path) -> tuple[list[str], int]:
    """Result files that differ (or exist in one run only), and how many were compared."""
    a, b = result_files(earlier), result_files(later)
    names = sorted(set(a) | set(b))
    differing = [n for n in names if n not in a or n not in b or comparable_content(a[n]) != comparable_content(b[n])]
    return differing, len(names)
