"""Slips that hide under the seed-scale bound, through the notebooks: each one's verdict in 01–03 at 1024².

    python benchmarks/hidden_slips.py [--size 1024] [--sizes 256,1024] [--probes default|none|both] [--out docs/results.md]

A gradient that skips one image column, one row, one atomic update, or reads its windows one pixel off changes
a 1024² weight gradient by less than its float32 bound: judged on the requested problem alone, it is rounding.
The notebooks judge every candidate with the probes `diagnose` runs (precision_lab.decision), so each of these
must come out `defect` (or `layout`) in notebooks 01, 02 and 03, and `native` `roundoff`. This script runs the
three notebooks through papermill at the seed scale (batch 2) with those candidates, prints candidate × notebook
verdicts and each notebook's wall time, and appends them, with the command, commit, date and machine, to `--out`.
`--probes both` also runs them unprobed: the time difference is the probes' own cost, and the verdicts show
what the probes catch.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import papermill

from precision_lab.paths import NOTEBOOKS_DIR, ROOT

SLIPS = ["first-column-skipped", "last-row-skipped", "lost-atomic-update", "padding-offset"]
NOTEBOOKS = ["01-optimizer-step", "02-float64-recompilation", "03-size-sweep"]


def run(probes: str, size: int, sizes: list[int], work: Path) -> tuple[pd.DataFrame, dict]:
    """Every notebook once with these probes: (verdict table, seconds per notebook)."""
    rows, seconds = [], {}
    run_dir = work / probes
    for name in NOTEBOOKS:
        parameters = {"device": "cpu", "candidates": ["native", *SLIPS], "probes": probes, "run_dir": str(run_dir)}
        parameters.update({"sizes": sizes} if name.startswith("03") else {"size": size})
        start = time.perf_counter()
        papermill.execute_notebook(str(NOTEBOOKS_DIR / f"{name}.ipynb"), str(work / f"{name}-{probes}.ipynb"),
                                   parameters=parameters, kernel_name="precision-lab", progress_bar=False)
        seconds[name] = time.perf_counter() - start
        summary = pd.read_csv(run_dir / name / "summary.csv")
        rows += [{"candidate": row.candidate, "notebook": name[:2], "verdict": row.verdict,
                  "named": row.named if isinstance(row.named, str) else ""} for row in summary.itertuples()]
        print(f"{name} (probes {probes}): {seconds[name]:.0f} s", file=sys.stderr, flush=True)
    return pd.DataFrame(rows), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--sizes", default="256,1024", help="notebook 03's sweep (comma-separated)")
    parser.add_argument("--probes", choices=["default", "none", "both"], default="default")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = ["default", "none"] if args.probes == "both" else [args.probes]
    lines = []
    with tempfile.TemporaryDirectory() as work:
        for probes in modes:
            table, seconds = run(probes, args.size, sizes, Path(work))
            verdicts = table.pivot(index="candidate", columns="notebook", values="verdict")
            caught = all((verdicts.loc[slip] != "roundoff").all() for slip in SLIPS)
            print(f"probes {probes}:\n{verdicts.to_string()}\n"
                  f"every slip flagged in every notebook: {caught}; native roundoff everywhere: "
                  f"{(verdicts.loc['native'] == 'roundoff').all()}")
            lines += [f"Probes `{probes}` — wall time per notebook: "
                      + ", ".join(f"{name[:2]} {s:.0f} s" for name, s in seconds.items())
                      + f" (total {sum(seconds.values()):.0f} s)", "",
                      "| candidate | " + " | ".join(verdicts.columns) + " |",
                      "|---|" + "---|" * len(verdicts.columns)]
            named = table.set_index(["candidate", "notebook"]).named
            lines += [f"| {candidate} | " + " | ".join(
                f"{verdicts.loc[candidate, nb]}" + (f" ({named[candidate, nb]})" if named[candidate, nb] else "")
                for nb in verdicts.columns) + " |" for candidate in verdicts.index]
            lines.append("")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    header = [f"## Slips hidden under the 1024² bound, through notebooks 01–03",
              "", f"- command: `python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`".replace(" `", " `", 1),
              f"- commit {commit or 'unknown'}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{platform.machine()} ({os.cpu_count()} cores), "
              f"size {args.size}, 03 sizes {sizes}, batch 2, seed 0; load average at the end "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}", ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as handle:
        if out.stat().st_size == 0:
            handle.write("# Results\n\nFigures written by the benchmark scripts themselves, newest last; each says "
                         "the command, commit, date and machine that gave it.\n\n")
        handle.write("\n".join(header + lines) + "\n")
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
