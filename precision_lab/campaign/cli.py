"""`precision-lab campaign SPEC.yaml`: a grid of diagnoses on Dask, one Parquet table, a campaign report.

    precision-lab campaign SPEC.yaml [--workers N | --scheduler ADDRESS] [--threads T] [--out DIR]
        [--max-cells N] [--retry-failed] [--no-report | --report]

The spec: precision_lab.campaign.spec; the run: precision_lab.campaign.run. Results land in
`OUT/cells/<cell>.parquet` and `OUT/campaign.parquet` (precision_lab.campaign.store);
`OUT/report.html` is the campaign report (precision_lab.campaign.report), written at the end of
every run; `--report` rewrites it alone.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import LabInputError
from .run import run_campaign
from .spec import load_spec
from .store import consolidate


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC.yaml", help="the campaign spec (docs/campaigns.md)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--workers", default="2", help="worker processes of the local Dask cluster (default 2; "
                                                      "0 runs the cells in this process, one after another)")
    where.add_argument("--scheduler", metavar="ADDRESS", help="an existing Dask scheduler instead: tcp://host:8786 or "
                                                               "the JSON file of `dask scheduler --scheduler-file`")
    parser.add_argument("--threads", default=None, help="torch threads per cell (default: the cores of a worker's "
                                                        "host ÷ the workers on it)")
    parser.add_argument("--out", default=None, help="results folder (default: the spec's `out`, else "
                                                    "<spec folder>/<spec stem>-campaign)")
    parser.add_argument("--max-cells", default=None, help="run at most N unfinished cells, then stop (the rest "
                                                          "on the next run)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed cells again (default: skip them)")
    report = parser.add_mutually_exclusive_group()
    report.add_argument("--no-report", action="store_true", help="do not write OUT/report.html")
    report.add_argument("--report", action="store_true", help="only rewrite OUT/report.html from the finished cells")


def main(args: argparse.Namespace) -> int:
    import importlib.util

    from .. import options

    workers = options.nonnegative(args.workers, "--workers")
    needed = ("pyarrow",) if workers == 0 and not args.scheduler else ("distributed", "pyarrow")  # 0: in-process
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise LabInputError(f"campaign needs {' and '.join(missing)}: `make setup` installs them, or "
                            f"pip install 'dask[distributed]' pyarrow")
    threads = options.positive(args.threads, "--threads")
    max_cells = options.nonnegative(args.max_cells, "--max-cells")
    spec = load_spec(args.spec, args.out)
    if args.report:
        from .report import write_report

        if not (spec.out / "cells").is_dir():
            raise LabInputError(f"{spec.out}: no finished cells yet; run `precision-lab campaign {args.spec}` first")
        table = consolidate(spec.cells(), spec.out / "cells", spec.out / "campaign.parquet")
        print(f"report: {write_report(spec, table, spec.out / 'report.html')}")
        return 0
    outcome = run_campaign(spec, workers, args.scheduler, threads, max_cells, args.retry_failed,
                           report=not args.no_report, progress=sys.stderr.isatty())
    cells = outcome.table.drop_duplicates("key") if len(outcome.table) else outcome.table
    counts = cells.verdict.fillna("failed").value_counts().to_dict() if len(cells) else {}
    print(f"{outcome.ran} cells run ({outcome.failed} failed), {outcome.skipped} skipped as finished, "
          f"{outcome.left} left, in {outcome.seconds:.1f} s; verdicts: "
          + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))
    print(f"table: {outcome.out / 'campaign.parquet'}" + (f"\nreport: {outcome.report}" if outcome.report else ""))
    return 0 if outcome.failed == 0 else 1
