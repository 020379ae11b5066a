"""One cell of a campaign, diagnosed on a worker: the rows it adds to the table.

Each cell is one `diagnose` (precision_lab.diagnosis.diagnose), one Dask task
(precision_lab.campaign.run). The flag `tf32` means:

* `builtin:native` (and its TF32 twins): `on` runs the TF32 build — `native-tf32` on a GPU,
  `tf32-emulated` on a CPU, which has no TF32 hardware; `off` runs `native` (cuDNN/cuBLAS IEEE);
* other built-ins: torch's float32 precision flags (cuDNN and cuBLAS `fp32_precision`) around the
  cell; on a CPU they change nothing (the row's `flags_applied` says so);
* command candidates: `off` sets `NVIDIA_TF32_OVERRIDE=0` in the program's environment (NVIDIA's
  switch that disables TF32 in cuBLAS and cuDNN); `on` leaves the libraries' default;
* static bundles hold a computed answer to their own problem: one cell each, flags, sizes, seeds
  and images do not apply.
"""
from __future__ import annotations

import datetime as dt
import os
import shlex
import time
import traceback
from pathlib import Path

from ..errors import LabInputError
from .spec import version_of
from .store import QUANTITY_NUMBERS, QUANTITY_TEXTS

#: built-ins with a TF32 build: flag value → variant, per device type (the CPU has no TF32 hardware)
TF32_FAMILY = {"native", "native-tf32", "tf32-emulated"}
TF32_VARIANT = {("on", "cuda"): "native-tf32", ("on", "cpu"): "tf32-emulated", ("off", "cuda"): "native",
                ("off", "cpu"): "native"}


def run_cell(params: dict, threads: int | dict | None = None) -> list[dict]:
    """Diagnose one cell; the rows of the table (one per quantity, or one row naming the error).

    Runs in a Dask worker process (or in-process with --workers 0). `threads`: torch's intra-op
    threads for this cell, or {host: threads} for a cluster whose hosts differ.
    """
    import socket

    import numpy
    import torch

    started, clock = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    torch_threads = _threads_here(threads)
    if torch_threads:
        torch.set_num_threads(torch_threads)  # Dask's nanny sets OMP_NUM_THREADS=1; one cell may use its share
    base = dict(params, status="ok", error=None, worker=socket.gethostname(), torch_threads=torch.get_num_threads(),
                started=started.isoformat(timespec="seconds"), precision_lab_version=version_of("precision-lab"),
                torch_version=torch.__version__, numpy_version=numpy.__version__)
    base.pop("target")
    base.pop("kind")
    try:
        rows, timing = _diagnose_cell(params)
    except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, the campaign goes on
        message = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, (LabInputError, ValueError, FileNotFoundError, PermissionError)):
            where = traceback.extract_tb(exc.__traceback__)[-1]
            message = f"{type(exc).__name__}: {message} ({Path(where.filename).name}:{where.lineno})"
        base.update(status="failed", error=message, seconds=time.perf_counter() - clock)
        return [base]
    seconds = time.perf_counter() - clock
    return [dict(base, **timing, **row, seconds=seconds) for row in rows]


def _threads_here(threads) -> int | None:
    if isinstance(threads, dict):
        try:
            from distributed import get_worker

            host = get_worker().address.split("://")[-1].rsplit(":", 1)[0]
        except (ImportError, ValueError):
            return None
        workers_here = threads.get(host, 1)
        return max(1, len(os.sched_getaffinity(0)) // workers_here)
    return threads


def _diagnose_cell(params: dict) -> tuple[list[dict], dict]:
    from contextlib import nullcontext

    from .. import probes as probe_set
    from ..candidates import resolve
    from ..conv.backends import native_flags
    from ..device import describe_device, resolve_device
    from ..diagnosis import candidate_and_problem, diagnose

    where = resolve_device(params["device"])
    flags = dict(f.split("=", 1) for f in params["flags"].split(",") if f)
    target, note, context = params["target"], "", nullcontext()
    tf32 = flags.get("tf32")
    if params["kind"] == "builtin" and tf32:
        name = target.removeprefix("builtin:")
        if name in TF32_FAMILY:
            target = "builtin:" + TF32_VARIANT[(tf32, where.type)]
            note = f"tf32={tf32}: ran as {target}"
        elif where.type == "cuda":
            context = native_flags(fp32_precision="tf32" if tf32 == "on" else "ieee")
            note = f"tf32={tf32}: torch cuDNN/cuBLAS fp32_precision={'tf32' if tf32 == 'on' else 'ieee'}"
        else:
            note = f"tf32={tf32}: no effect on a CPU (no TF32 hardware)"
    clock = time.perf_counter()
    if params["kind"] == "bundle":
        candidate, problem = candidate_and_problem(None, target)
    else:
        candidate, problem = candidate_and_problem(
            target, None, (params["height"], params["width"]), params["batch"], params["seed"], params["model"],
            None if params["image"] == "synthetic" else params["image"], where)
    if params["kind"] == "command" and tf32:
        program = candidate.run.__self__
        if tf32 == "off":
            program.env = dict(program.env, NVIDIA_TF32_OVERRIDE="0")
        note = f"tf32={tf32}: " + ("NVIDIA_TF32_OVERRIDE=0 for the program" if tf32 == "off" else "libraries' default")
    problem_seconds = time.perf_counter() - clock
    with context:
        diagnosis = diagnose(candidate, problem, str(where), probe_set.select(params["probes"]))
    diagnose_seconds = time.perf_counter() - clock - problem_seconds
    info = describe_device(where)
    report = diagnosis.to_json()
    deciding = diagnosis.deciding()
    detail = deciding.layout_fix or deciding.format or deciding.cause or deciding.localisation
    quantities = {name: dict(entry, problem="requested") for name, entry in report["forward"].items()}
    quantities.update(report["parameters"])
    worst_name = max(quantities, key=lambda n: quantities[n]["bound_ratio"] or 0.0)
    expected = params["expected"]
    if params["kind"] == "builtin" and target != params["target"]:  # a flag chose another build: its own expectation
        expected = candidate.expected or "roundoff"
    cell = {"ran_as": candidate.name, "flags_applied": note or None, "expected": expected, "verdict": diagnosis.verdict,
            "claimed_precision": diagnosis.claimed_precision, "decided_by": report["decided_by"], "detail": detail,
            "worst_quantity": worst_name, "worst_bound_ratio": quantities[worst_name]["bound_ratio"],
            "device": str(where), "device_name": info.get("name"),
            "height": problem.height, "width": problem.width, "batch": problem.batch,
            "seed": problem.seed if problem.seed >= 0 else None,  # a static bundle does not know its seed (−1)
            "command": reproduce_command(params, target)}
    rows = []
    for name, q in quantities.items():
        rows.append(dict(cell, quantity=name, problem=q.get("problem"), quantity_verdict=q["verdict"],
                         **{k: q.get(k) for k in QUANTITY_NUMBERS}, elements=q.get("size"),
                         **{k: q.get(k) for k in QUANTITY_TEXTS}))
    return rows, {"problem_seconds": problem_seconds, "diagnose_seconds": diagnose_seconds}


def reproduce_command(params: dict, target: str | None = None) -> str:
    """The `precision-lab diagnose` command that repeats one cell (paths relative to where you run it)."""
    target = target or params["target"]
    if params["kind"] == "bundle":
        return shlex.join(["precision-lab", "diagnose", "--bundle", _shown_path(target)])
    words = ["precision-lab", "diagnose", "--candidate",
             _shown_path(target) if params["kind"] != "builtin" else target,
             "--size", f"{params['height']}x{params['width']}", "--batch", str(params["batch"]),
             "--seed", str(params["seed"])]
    if params["image"] != "synthetic":
        words += ["--image", _shown_path(params["image"])]
    if params.get("model"):
        words += ["--model", _shown_path(params["model"])]
    words += ["--device", params["device"], "--probes", params["probes"]]
    command = shlex.join(words)
    if params["kind"] == "command" and "tf32=off" in params["flags"]:
        command += "  # with NVIDIA_TF32_OVERRIDE: '0' added to the YAML's env"
    return command


def _shown_path(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
