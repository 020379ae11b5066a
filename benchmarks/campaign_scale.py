"""Campaign throughput on this machine: cells per minute in-process, on 1 and on 2 Dask workers, and the
scheduler's overhead per cell.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/campaign_scale.py [--cells 24] [--size 128] [--batch 2]
        [--probes none] [--candidate builtin:native]

Every mode runs the same fresh cells (one candidate, seeds 0 … cells−1) into its own folder:

* `in-process`: `--workers 0`, the cells one after another in this process (torch on every core);
* `1 worker`, `2 workers`: a LocalCluster of worker processes (one thread each; torch threads per
  cell = cores ÷ workers, as `precision-lab campaign` sets them), started before the clock and
  reached through its address, as `--scheduler` does; its start-up time is printed apart.

Time outside the cells, per cell = (wall × workers − Σ cell seconds measured inside the task) ÷ cells:
what Dask adds (submission, pickling the rows back, idle workers at the end) plus writing the part
file, which the in-process mode pays too; the difference of the two is the scheduler's overhead per
cell. It is measured within one run, so it does not depend on how busy the machine was between runs
(the cells' own time does). A no-op task round trip on the same cluster is printed as the floor.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

from precision_lab import campaign
from precision_lab.provenance import run_recorded


def _spec(folder: Path, args) -> Path:
    path = folder / "scale.yaml"
    path.write_text(f"candidates: [{args.candidate}]\nseeds: {list(range(args.cells))}\nsizes: [{args.size}]\n"
                    f"batch: {args.batch}\nprobes: {args.probes}\ndevice: cpu\n")
    return path


def _noop(x):
    return x


def _run(spec_file: Path, out: Path, workers: int) -> dict:
    spec = campaign.load_spec(spec_file, out)
    cores = len(os.sched_getaffinity(0))
    if workers == 0:
        clock = time.perf_counter()
        outcome = campaign.run_campaign(spec, workers=0, threads=cores, report=False, progress=False, say=lambda *_: None)
        return {"start": 0.0, "wall": time.perf_counter() - clock, "outcome": outcome, "noop_ms": None}
    from distributed import Client, LocalCluster

    clock = time.perf_counter()
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                           silence_logs=logging.ERROR)
    start = time.perf_counter() - clock
    try:
        with Client(cluster) as client:
            client.gather(client.map(_noop, range(workers * 4), pure=False))  # workers warm
            clock = time.perf_counter()
            client.gather(client.map(_noop, range(200), pure=False))
            noop_ms = (time.perf_counter() - clock) / 200 * 1e3
        clock = time.perf_counter()
        outcome = campaign.run_campaign(spec, scheduler=cluster.scheduler_address, threads=max(1, cores // workers),
                                        report=False, progress=False, say=lambda *_: None)
        wall = time.perf_counter() - clock
    finally:
        cluster.close()
    return {"start": start, "wall": wall, "outcome": outcome, "noop_ms": noop_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=24)
    parser.add_argument("--size", default="128")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--probes", default="none")
    parser.add_argument("--candidate", default="builtin:native")
    args = parser.parse_args()
    print(f"{args.cells} cells of {args.candidate}, size {args.size}, batch {args.batch}, probes {args.probes}, "
          f"on {len(os.sched_getaffinity(0))} cores")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec_file = _spec(folder, args)
        for label, workers in (("in-process", 0), ("1 worker", 1), ("2 workers", 2)):
            r = _run(spec_file, folder / f"out-{workers}", workers)
            cells = r["outcome"].table.drop_duplicates("key")
            assert r["outcome"].ran == args.cells and r["outcome"].failed == 0, "every cell must run and succeed"
            r["outside_ms"] = (r["wall"] * max(workers, 1) - cells.seconds.sum()) / args.cells * 1e3
            results[label] = r
            print(f"{label:>10}: {args.cells / r['wall'] * 60:6.1f} cells/min  (wall {r['wall']:.1f} s, "
                  f"median cell {cells.seconds.median():.2f} s with {int(cells.torch_threads.iloc[0])} torch threads, "
                  f"outside the cells {r['outside_ms']:.0f} ms per cell"
                  + (f", cluster start {r['start']:.1f} s, no-op task {r['noop_ms']:.1f} ms" if workers else "") + ")")
    overhead = results["1 worker"]["outside_ms"] - results["in-process"]["outside_ms"]
    speedup = results["in-process"]["wall"] / results["2 workers"]["wall"]
    print(f"scheduler overhead per cell (1 worker − in-process, outside the cells): {overhead:.0f} ms; "
          f"throughput 2 workers ÷ 1 worker: {results['1 worker']['wall'] / results['2 workers']['wall']:.2f}×, "
          f"2 workers ÷ in-process: {speedup:.2f}×")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
