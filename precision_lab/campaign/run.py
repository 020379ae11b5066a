"""Running a campaign: the cells not finished yet, on a local Dask cluster, a scheduler, or in-process.

A LocalCluster of worker processes by default, `--scheduler ADDRESS` for a cluster started
elsewhere (docs/campaigns.md: SLURM with dask-jobqueue, one worker per GPU). Each cell is one task
(precision_lab.campaign.cell.run_cell); each finished cell is written at once
(precision_lab.campaign.store), the table consolidated at the end, interrupted or not, and the
campaign report (precision_lab.campaign.report) written from it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabInputError
from .cell import run_cell
from .spec import Cell, Spec
from .store import consolidate, failed_keys, finished_keys, write_part


@dataclass
class Outcome:
    cells: int
    skipped: int
    ran: int
    failed: int
    left: int
    table: object
    out: Path
    seconds: float
    report: Path | None = None


def run_campaign(spec: Spec, workers: int = 2, scheduler: str | None = None, threads: int | None = None,
                 max_cells: int | None = None, retry_failed: bool = False, report: bool = True,
                 progress: bool = True, say=print) -> Outcome:
    """Run every cell of `spec` not finished yet; returns what ran and the consolidated table."""
    clock = time.perf_counter()
    cells = list({cell.key: cell for cell in spec.cells()}.values())  # `native` and `builtin:native` are one cell
    parts = spec.out / "cells"
    try:
        parts.mkdir(parents=True, exist_ok=True)
        (spec.out / "spec.json").write_text(json.dumps({"spec": str(spec.path.resolve()), "name": spec.name,
                                                         "raw": spec.raw}, indent=1, default=str) + "\n")
    except OSError as exc:
        raise LabInputError(f"{spec.out}: cannot write the campaign folder ({exc.strerror}); choose --out") from None
    for stale in parts.glob(".*.tmp"):  # a part a killed run was writing: its cell runs again
        stale.unlink(missing_ok=True)
    done = finished_keys(parts) & {c.key for c in cells}
    if retry_failed:
        done -= failed_keys(parts, done)
    todo = [c for c in cells if c.key not in done]
    chosen = todo[:max_cells] if max_cells is not None else todo
    say(f"campaign {spec.name}: {len(cells)} cells, {len(done)} already finished, {len(chosen)} to run"
        + (f" now ({len(todo) - len(chosen)} left for later: --max-cells)" if len(chosen) < len(todo) else "")
        + f"; results in {spec.out}")
    failed = 0
    try:
        if chosen:
            failed = _run_cells(chosen, parts, workers, scheduler, threads, len(cells), len(done), progress, say)
    finally:  # interrupted too: the table holds every cell finished so far
        table = consolidate(cells, parts, spec.out / "campaign.parquet")
    outcome = Outcome(len(cells), len(done), len(chosen), failed, len(todo) - len(chosen), table, spec.out,
                      time.perf_counter() - clock)
    if report:
        from .report import write_report

        outcome.report = write_report(spec, table, spec.out / "report.html")
    return outcome


def _run_cells(cells: list[Cell], parts: Path, workers: int, scheduler: str | None, threads: int | None,
               total: int, already: int, progress: bool, say) -> int:
    from tqdm import tqdm

    bar = tqdm(total=total, initial=already, desc="campaign", unit="cell", disable=not progress, file=sys.stderr)
    failed = [0]

    def record(rows: list[dict]) -> None:
        write_part(rows, parts)
        if rows[0]["status"] == "failed":
            failed[0] += 1
            bar.write(f"cell failed: {rows[0]['candidate']} {rows[0]['image_label']} seed {rows[0]['seed']} "
                      f"{rows[0]['height']}x{rows[0]['width']}: {rows[0]['error']}")
        bar.update()
        bar.set_postfix(done=bar.n - failed[0] - already, failed=failed[0], remaining=total - bar.n)

    try:
        if workers == 0 and scheduler is None:  # in-process, one cell after another (the overhead baseline)
            for cell in cells:
                record(run_cell(cell.params(), threads))
        else:
            _on_dask(cells, workers, scheduler, threads, record, say)
    finally:
        bar.close()
    return failed[0]


def _on_dask(cells: list[Cell], workers: int, scheduler: str | None, threads: int | None, record, say) -> None:
    import logging

    from distributed import Client, LocalCluster, as_completed

    cluster = None
    if scheduler is None:
        dashboard = ":0" if _has_bokeh() else None  # any free port: several campaigns may share a host
        # processes, one thread each: every cell owns its worker, and torch's threads are set per cell
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=dashboard,
                               silence_logs=logging.ERROR)
        client = Client(cluster)
        threads = threads or max(1, len(os.sched_getaffinity(0)) // workers)
    else:
        try:  # an address (tcp://host:8786) or the file `dask scheduler --scheduler-file` wrote
            client = (Client(scheduler_file=scheduler, timeout="20s") if scheduler.endswith(".json")
                      else Client(scheduler, timeout="20s"))
        except (OSError, TimeoutError, ValueError) as exc:
            raise LabInputError(f"--scheduler {scheduler}: cannot reach the Dask scheduler ({exc})") from None
        if threads is None:
            hosts: dict[str, int] = {}
            for address in client.scheduler_info().get("workers", {}):
                host = address.split("://")[-1].rsplit(":", 1)[0]
                hosts[host] = hosts.get(host, 0) + 1
            threads = hosts
    try:
        link = client.dashboard_link if (cluster is None or _has_bokeh()) else None
        say(f"Dask: {len(client.scheduler_info().get('workers', {}))} workers at {client.scheduler.address}; "
            + (f"dashboard {link}" if link else "dashboard off (it needs `pip install bokeh`)"))
        futures = {client.submit(run_cell, cell.params(), threads, key=f"cell-{cell.key}", pure=False): cell
                   for cell in cells}
        for future in as_completed(list(futures)):
            try:
                rows = future.result()
            except Exception as exc:  # noqa: BLE001 - a worker that died (memory, a crash) fails its cell only
                rows = [dict(futures[future].params(), status="failed",
                             error=f"{type(exc).__name__}: {exc}".splitlines()[0])]
            record(rows)
            future.release()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None
