"""Provenance of a run: everything needed to repeat it and to know where its numbers came from.

Versions of the libraries that decide the arithmetic (torch, numpy) and the report pipeline,
the device and its kernel libraries (cuDNN version and flags), the git commit and whether the
tree was dirty, the parameters as run, the command line, host and time. `precision-lab rerun`
reads it back from `reports/<run-id>/provenance.json`.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from .paths import ROOT

#: libraries whose versions can change a number or a page of the report
PACKAGES = ("precision-lab", "torch", "numpy", "pandas", "matplotlib", "papermill", "nbconvert",
            "nbformat", "nbclient", "ipykernel", "jupyter_client", "pyyaml", "mrcfile", "jinja2")

FILENAME = "provenance.json"


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when absent)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if versions.get("torch") is not None:
        import torch

        versions["torch"] = torch.__version__  # with its build tag ('2.11.0+cu130'): the wheel's metadata drops it
    return versions


def git_state(root: Path = ROOT) -> dict:
    """Commit, branch and dirty flag of the checkout (None values outside a git repository)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": None if status is None else bool(status)}


def backend_flags() -> dict:
    """The global torch flags that choose kernels and their precision (the parent's defaults)."""
    import torch

    flags = {"cudnn_enabled": torch.backends.cudnn.enabled, "cudnn_benchmark": torch.backends.cudnn.benchmark,
             "cudnn_deterministic": torch.backends.cudnn.deterministic,
             "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
             "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
             "float32_matmul_precision": torch.get_float32_matmul_precision(),
             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
             "mkldnn_enabled": torch.backends.mkldnn.enabled}
    flags["cudnn_version"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return flags


def kernels_that_ran(run_dir: Path) -> dict[str, list]:
    """The kernels each notebook recorded with torch.profiler (`<notebook>/kernels.json`), kept with the run:
    the numbers depend on which cuDNN/oneDNN kernels ran, and that choice changes between versions and GPUs."""
    found = {}
    for table in sorted(Path(run_dir).glob("*/kernels.json")):
        try:
            found[table.parent.name] = json.loads(table.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a notebook that failed mid-write: its outcome already says so
    return found


def device_description(device_spec: str = "auto") -> dict:
    """The device the notebooks resolve `device_spec` to, described by precision_lab.device."""
    from .device import describe_device, resolve_device

    try:
        return describe_device(resolve_device(device_spec))
    except ValueError as exc:
        return {"device": device_spec, "error": str(exc)}


def collect(run_id: str, parameters: dict, *, params_file: str | None = None, notebooks: list[str] = (),
            notebooks_dir: str | None = None, command_line: list[str] | None = None, rerun_of: str | None = None,
            options: dict | None = None) -> dict:
    """Everything about a run except its outcome (report.py adds notebook statuses at the end)."""
    device_spec = parameters.get("device", "auto") if isinstance(parameters.get("device"), str) else "auto"
    return {
        "run_id": run_id,
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command_line": list(sys.argv if command_line is None else command_line),
        "cwd": str(Path.cwd()),
        "parameters": parameters,
        "params_file": params_file,
        "notebooks": list(notebooks),
        "notebooks_dir": notebooks_dir,
        "options": options or {},
        "rerun_of": rerun_of,
        "git": git_state(),
        "device": device_description(device_spec),
        "backend_flags": backend_flags(),
        "versions": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "hostname": socket.gethostname(),
    }


def write(provenance: dict, folder: Path) -> Path:
    path = Path(folder) / FILENAME
    path.write_text(json.dumps(provenance, indent=1, default=str), encoding="utf-8")
    return path


def read(folder: str | Path) -> dict:
    """The provenance of a finished run, from `reports/<run-id>/` (LabInputError when absent)."""
    from .errors import LabInputError

    path = Path(folder) / FILENAME
    if not path.is_file():
        raise LabInputError(f"{folder}: no {FILENAME} here (expected a finished run directory reports/<run-id>)")
    try:
        provenance = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LabInputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(provenance, dict) or not isinstance(provenance.get("parameters"), dict):
        raise LabInputError(f"{path}: key 'parameters' missing or not a mapping (expected a run's provenance)")
    return provenance


# ---------------------------------------------------------------------------------------------
# the results document: what the benchmark scripts measured, written by them


#: the one document of measured figures (docs/results.md); benchmark scripts append to it with --record
RESULTS = ROOT / "docs" / "results.md"


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def record_heading(title: str, argv: list[str] | None = None, root: Path = ROOT) -> str:
    """A results section's heading and the lines that say what gave it: command, commit, date, machine, load."""
    argv = sys.argv if argv is None else argv
    state = git_state(root)
    commit = (state["commit"] or "unknown")[:7] + (" with uncommitted changes" if state["dirty"] else "")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(argv[0], root), *argv[1:]])
    return (f"## {title}\n\n```\n{command}\n```\n\ncommit {commit}, "
            f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} with "
            f"{os.cpu_count()} cores, load {load}; {socket.gethostname()}\n")


def run_recorded(title: str, main, path: Path = RESULTS):
    """Run a benchmark's `main()`; with `--record` among its arguments, append what it printed to `path` under
    `title` with the command, commit, date and machine that gave it, also when it stops on an error."""
    record = "--record" in sys.argv[1:]
    if not record:
        return main()
    sys.argv = [arg for arg in sys.argv if arg != "--record"]
    tee = _Tee(sys.stdout)
    stopped = None
    try:
        with contextlib.redirect_stdout(tee):
            return main()
    except BaseException as exc:  # noqa: BLE001 - recorded, then raised again
        stopped = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        body = tee.copy.getvalue().rstrip("\n")
        section = record_heading(title) + f"\n```text\n{body}\n```\n" + (f"\nstopped: {stopped}\n" if stopped else "")
        with Path(path).open("a", encoding="utf-8") as handle:
            handle.write("\n" + section)
        print(f"recorded in {path}", file=sys.stderr)

