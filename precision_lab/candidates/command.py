"""Command candidates: someone else's program, driven through bundles (docs/design.md, "Exchange format").

The candidate YAML::

    name: my-impl
    command: [./impl, "{request}", "{response}"]            # the build as claimed
    command_float64: [./impl64, "{request}", "{response}"]  # optional: the float64 recompilation
    precision: float32          # claimed arithmetic: float32|float64|tf32|bfloat16|float16 (autocast-bfloat16 and
                                # autocast-float16 are bfloat16 and float16: torch.autocast's results are covered)
    loss_scale: 65536           # float16 only, optional: the loss scale the program multiplies its loss by
    weight_layout: OIHW         # any permutation of O, I, H, W
    timeout_s: 600
    request_format: npz         # optional: npz (default) or raw (column-major .bin files)
    env: {OMP_NUM_THREADS: "4"} # optional: extra environment variables (strings)
    model: my-net.json          # optional: a model spec file (or the spec inline); default the seed CNN
    worker: true                # optional: start the program once and send it every request on stdin (worker.py)

Each call: the lab makes a fresh temporary working directory, writes the request bundle to
`<tmp>/request/`, creates the empty `<tmp>/response/`, and runs the command there with no
shell, the timeout, and the environment of `child_environment` (documented in docs/external.md).
Placeholders in arguments: ``{request}``, ``{response}``, ``{candidate_dir}`` (the YAML's folder)
and ``{python}`` (the lab's own Python). The program (first argument) resolves against the
YAML's folder when it holds a "/" and on PATH otherwise; any other argument naming an existing
path relative to the YAML's folder is made absolute (the command runs elsewhere).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

from .. import formats
from ..errors import LabInputError
from ..compute import Result
from ..layout import check_layout
from ..model import ModelSpecError, load_model
from ..problem import Problem
from . import Candidate, CandidateError
from .worker import ProgramError, WorkerLost, WorkerPool, worker_argv

KEYS = ("name", "description", "command", "command_float64", "precision", "weight_layout", "timeout_s",
        "request_format", "env", "model", "start", "loss_scale", "worker")
REQUEST_FORMATS = ("npz", "raw")
#: variables passed through from the lab's environment when set (the rest is not inherited)
PASSTHROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
                   "CUDA_HOME", "CUDA_PATH", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "VIRTUAL_ENV",
                   "CONDA_PREFIX", "SYSTEMROOT", "FC", "FFLAGS", "XDG_CACHE_HOME")
#: programs that take a script as their first argument (python3.12 and the like match too)
INTERPRETERS = ("python", "python3", "sh", "bash", "julia", "Rscript", "node", "perl", "ruby")
#: a candidate YAML is a few lines; anything this large is the wrong file (and is not parsed)
MAX_YAML_BYTES = 1 << 20
#: characters of the command's stderr an error message shows (its end, where errors usually are)
STDERR_TAIL = 1500


class CommandCandidateError(CandidateError, LabInputError):
    """A command candidate's YAML is wrong or its program failed: exit code 2 with this one line."""


# ---------------------------------------------------------------------------------------------
# the YAML


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise CommandCandidateError(f"{path}: no such candidate file")
    if path.stat().st_size > MAX_YAML_BYTES:
        raise CommandCandidateError(f"{path}: {path.stat().st_size} bytes is not a candidate YAML "
                                    f"(expected a few lines, at most {MAX_YAML_BYTES} bytes)")
    try:
        spec = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CommandCandidateError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(spec, dict):
        raise CommandCandidateError(f"{path}: expected a YAML mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(map(str, spec)) - set(KEYS))
    if unknown:
        raise CommandCandidateError(f"{path}: unknown key {unknown[0]!r}: expected keys among {', '.join(KEYS)}")
    return spec


def _argv(path: Path, spec: dict, key: str) -> list[str] | None:
    value = spec.get(key)
    if value is None and key == "command_float64":
        return None
    if not isinstance(value, list) or not value or not all(isinstance(a, (str, int, float)) for a in value):
        raise CommandCandidateError(f"{path}: key {key!r} must be a non-empty list of arguments, "
                                    f"e.g. [./impl, \"{{request}}\", \"{{response}}\"] (no shell string)")
    argv = [str(a) for a in value]
    if not any("{response}" in a for a in argv):
        raise CommandCandidateError(f"{path}: key {key!r} never mentions \"{{response}}\": the program must be told "
                                    f"where to write its response")
    return argv


def _choice(path: Path, spec: dict, key: str, default: str, choices) -> str:
    value = spec.get(key, default)
    if value not in choices:
        raise CommandCandidateError(f"{path}: key {key!r} is {value!r}, expected one of {', '.join(choices)}")
    return value


def _loss_scale(path: Path, spec: dict, precision: str) -> float:
    """A float16 claim's loss scale (≥ 1; 1, no scaling, covers every scale); no other claim takes one."""
    if "loss_scale" not in spec:
        return 1.0
    value = spec["loss_scale"]
    if precision != "float16":
        raise CommandCandidateError(f"{path}: key 'loss_scale' belongs to a float16 claim (precision is {precision}): "
                                    f"remove it, or claim float16")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < 2 ** 64:
        raise CommandCandidateError(f"{path}: key 'loss_scale' is {value!r}, expected a number ≥ 1 (what the program "
                                    f"multiplies its loss by before the backward, e.g. GradScaler's 65536)")
    return float(value)


def _timeout(path: Path, spec: dict) -> float:
    value = spec.get("timeout_s", 600)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CommandCandidateError(f"{path}: key 'timeout_s' is {value!r}, expected a positive number of seconds")
    return float(value)


def _worker(path: Path, spec: dict) -> bool:
    value = spec.get("worker", False)
    if not isinstance(value, bool):
        raise CommandCandidateError(f"{path}: key 'worker' is {value!r}, expected true (start the program once and "
                                    f"send it each request on stdin, docs/external.md §2) or false")
    return value


def _extra_env(path: Path, spec: dict) -> dict[str, str]:
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in env.items()):
        raise CommandCandidateError(f"{path}: key 'env' must map variable names to strings")
    return {k: str(v) for k, v in env.items()}


def load_command_candidate(path: str | Path) -> Candidate:
    """A Candidate (family "command") from a candidate YAML; every key is checked here."""
    path = Path(path).resolve()
    spec = _read_yaml(path)
    if spec.get("model") == "opaque":  # opaque builds on this module, so the package routes to it
        raise CommandCandidateError(f"{path}: `model: opaque` is the reference-free gradient check: load it with "
                                    f"precision_lab.candidates.resolve (or precision-lab diagnose --candidate)")
    if "start" in spec:
        raise CommandCandidateError(f"{path}: key 'start' belongs to `model: opaque` (the reference-free gradient "
                                    f"check); a candidate with a model spec is sent requests made by the lab")
    name = spec.get("name", path.stem)
    network = _network(path, spec)
    if not isinstance(name, str) or not name.strip():
        raise CommandCandidateError(f"{path}: key 'name' must be a non-empty string")
    precision = formats.claim(_choice(path, spec, "precision", "float32",
                                      formats.PRECISIONS + tuple(formats.AUTOCAST_ALIASES)))
    loss_scale = _loss_scale(path, spec, precision)
    layout = spec.get("weight_layout", "OIHW")
    try:
        check_layout(layout)
    except ValueError as exc:
        raise CommandCandidateError(f"{path}: key 'weight_layout': {exc}") from None
    program = CommandProgram(
        yaml_path=path, name=name, claimed=precision, weight_layout=layout,
        commands={"float32": _argv(path, spec, "command"), "float64": _argv(path, spec, "command_float64")},
        timeout_s=_timeout(path, spec), raw=_choice(path, spec, "request_format", "npz", REQUEST_FORMATS) == "raw",
        env=_extra_env(path, spec), worker=_worker(path, spec))
    description = spec.get("description") or f"external program {' '.join(program.commands['float32'])}"
    return Candidate(name=name, description=str(description), run=program.run, claimed_precision=precision,
                     weight_layout=layout, family="command", has_float64=program.commands["float64"] is not None,
                     loss_scale=loss_scale,
                     meta={"yaml": str(path), "timeout_s": program.timeout_s, "model": network.name},
                     network=network)


def _network(path: Path, spec: dict):
    """The network the YAML's `model` names: a spec file (relative to the YAML's folder), the spec inline,
    or a built-in name; the seed CNN when absent."""
    model = spec.get("model")
    if model is None:
        return load_model(None)
    try:
        return load_model(model, base_dir=path.parent)
    except ModelSpecError as exc:
        raise CommandCandidateError(f"{path}: key 'model': {exc}") from None


# ---------------------------------------------------------------------------------------------
# running it


def child_environment(extra: dict[str, str], workdir: Path, request: Path, response: Path,
                      precision: str) -> dict[str, str]:
    """The documented environment of a command: PASSTHROUGH_ENV, the lab's variables, the YAML's `env`."""
    env = {key: os.environ[key] for key in PASSTHROUGH_ENV if key in os.environ}
    env.setdefault("PATH", os.defpath)
    env.update(TMPDIR=str(workdir), PRECISION_LAB_REQUEST=str(request), PRECISION_LAB_RESPONSE=str(response),
               PRECISION_LAB_PRECISION=precision)
    env.update(extra)
    return env


class CommandProgram:
    """The command(s) of one candidate YAML and how to call them on a problem."""

    def __init__(self, yaml_path: Path, name: str, claimed: str, weight_layout: str,
                 commands: dict[str, list[str] | None], timeout_s: float, raw: bool, env: dict[str, str],
                 worker: bool = False):
        self.yaml_path, self.name, self.claimed, self.weight_layout = yaml_path, name, claimed, weight_layout
        self.commands, self.timeout_s, self.raw, self.env = commands, timeout_s, raw, env
        self.workers = WorkerPool() if worker else None  # `worker: true`: programs that stay up between calls
        self.folder = yaml_path.parent
        self._running: set[subprocess.Popen] = set()  # calls in flight, for cancel() from another thread
        self._lock = threading.Lock()  # orders cancel() against the start of a call
        self._cancelled = False

    def allow_calls(self) -> None:
        """Undo cancel(): calls may start again (each diagnosis begins with this)."""
        with self._lock:
            self._cancelled = False

    def cancel(self) -> None:
        """Kill every call in flight (its process group) and refuse new ones until allow_calls():
        the lab stopped while the program ran, or was about to start it."""
        with self._lock:
            self._cancelled = True
            for process in list(self._running):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)

    def close(self) -> None:
        """Shut the workers down (stdin closed, killed after a grace period); the next call starts new ones."""
        if self.workers is not None:
            self.workers.close()

    def run(self, problem: Problem, precision: str, device: torch.device) -> Result:
        from ..bundle import BundleError, read_response, result_from_bundle, write_request

        # "float32" means the build as claimed (which may be tf32, bf16, …); "float64" the recompiled one
        exchange_precision = self.claimed if precision == "float32" else "float64"
        key = "float32" if precision == "float32" else "float64"
        with tempfile.TemporaryDirectory(prefix="precision-lab-call-") as tmp:
            workdir = Path(tmp)
            request, response = workdir / "request", workdir / "response"
            write_request(problem, request, exchange_precision, self.weight_layout, raw=self.raw)
            response.mkdir()
            wall_s, program = self.exchange(key, workdir, request, response, exchange_precision)
            try:
                bundle = read_response(response, exchange_precision, self.weight_layout, problem.input.shape,
                                       problem.network)
            except BundleError as exc:
                raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): bad response: "
                                            f"{str(exc).replace(str(workdir) + os.sep, '')}") from None
            result = result_from_bundle(bundle)
        result.meta.update(wall_s=wall_s, command=program, exchange_precision=exchange_precision,
                           weight_layout=self.weight_layout)
        result.meta.pop("bundle", None)  # the temporary response folder is gone
        return result

    def exchange(self, key: str, workdir: Path, request: Path, response: Path, precision: str) -> tuple[float, str]:
        """One call of build `key` (float32, float64) on the request bundle written at `request`, its response to
        `response`: a run of the command, or a request to a worker; (wall seconds, the program)."""
        name = "command_float64" if key == "float64" else "command"
        template = self.commands[key] if self.workers is None else worker_argv(self.commands[key])
        argv = self.argv(template, request, response, name)
        env = child_environment(self.env, workdir, request, response, precision)
        if self.workers is None:
            return self.call(argv, workdir, env), argv[0]
        return self.ask_worker(argv, env, request, response, precision), argv[0]

    def ask_worker(self, argv: list[str], env: dict[str, str], request: Path, response: Path, precision: str) -> float:
        """One request to a free worker of `argv` (started if none is): a worker lost during it (exited, hung past
        timeout_s) is started again and asked once more; a second loss is this call's error."""
        where = f"candidate {self.name} ({self.yaml_path})"
        start = time.perf_counter()
        worker = self.workers.take(argv, env, self._spawn_worker, self._forget)
        try:
            try:
                worker.ask(request, response, precision, self.timeout_s)
                return time.perf_counter() - start
            except WorkerLost as exc:
                first = str(exc)
            shutil.rmtree(response, ignore_errors=True)  # nothing of the lost attempt is read as the answer
            response.mkdir()
            try:
                worker.ask(request, response, precision, self.timeout_s)
                return time.perf_counter() - start
            except WorkerLost as exc:
                raise CommandCandidateError(
                    f"{where}: worker {first}, and again after a restart ({exc}); with `worker: true` the program "
                    f"must answer each request on stdin until EOF (docs/external.md §2){_tail(worker.stderr_path)}"
                    f"{_env_hint(worker.stderr_path, self.env)}") from None
        except ProgramError as exc:
            raise CommandCandidateError(f"{where}: worker answered an error: {exc}") from None
        finally:
            self.workers.give_back(worker)

    def _spawn_worker(self, argv: list[str], workdir: Path, env: dict[str, str], stderr) -> subprocess.Popen:
        return self._spawn(argv, workdir, env, subprocess.PIPE, stderr, stdin=subprocess.PIPE)

    def _forget(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(process)

    def argv(self, template: list[str], request: Path, response: Path, key: str) -> list[str]:
        """The argument list with placeholders filled and relative paths made absolute."""
        self._check_script(template, key)
        values = {"{request}": str(request), "{response}": str(response), "{candidate_dir}": str(self.folder),
                  "{python}": sys.executable}
        argv = []
        for index, arg in enumerate(template):
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(self._resolve(arg, first=index == 0, key=key))
        return argv

    def _check_script(self, template: list[str], key: str) -> None:
        """An interpreter's script must exist beside the YAML: else the interpreter would report it missing
        in the temporary folder the command runs in, a path the user never wrote."""
        first = Path(template[0]).name
        if template[0] != "{python}" and first not in INTERPRETERS and not re.fullmatch(r"python[\d.]*", first):
            return
        for arg in template[1:]:
            if arg in ("-m", "-c", "-e") or "{" in arg:  # a module, inline code or a placeholder: no script file
                return
            if arg.startswith("-"):
                continue
            script = Path(arg) if Path(arg).is_absolute() else self.folder / arg
            if not script.exists():
                raise CommandCandidateError(f"{self.yaml_path}: key {key!r}: script {arg!r} not found "
                                            f"(looked for {script}; relative paths resolve against the YAML's folder)")
            return

    def _resolve(self, arg: str, first: bool, key: str) -> str:
        candidate_path = self.folder / arg
        if first:
            if os.sep in arg or "/" in arg:
                program = candidate_path if not Path(arg).is_absolute() else Path(arg)
                if not program.is_file():
                    raise CommandCandidateError(f"{self.yaml_path}: key {key!r}: program {arg!r} not found "
                                                f"(looked for {program})")
                return str(program)
            found = shutil.which(arg, path=os.environ.get("PATH", os.defpath))
            if found is None:
                raise CommandCandidateError(f"{self.yaml_path}: key {key!r}: command {arg!r} not found on PATH")
            return found
        if arg and not arg.startswith("-") and not Path(arg).is_absolute() and candidate_path.exists():
            return str(candidate_path)
        return arg

    def call(self, argv: list[str], workdir: Path, env: dict[str, str]) -> float:
        """Run the command (no shell, own process group); returns its wall time in seconds."""
        stdout_path, stderr_path = workdir / "stdout.txt", workdir / "stderr.txt"
        start = time.perf_counter()
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = self._spawn(argv, workdir, env, stdout, stderr)
            try:
                returncode = process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): command timed out after "
                                            f"{self.timeout_s:g} s (key 'timeout_s'){_tail(stderr_path)}") from None
            except BaseException:
                _kill_group(process)  # Ctrl-C in the lab must not leave the program running
                raise
            finally:
                _kill_group(process)  # children the program left behind in its group
                with self._lock:
                    self._running.discard(process)
        if returncode != 0:
            status = f"killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
            raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): command {status}"
                                        f"{_tail(stderr_path)}{_env_hint(stderr_path, self.env)}")
        return time.perf_counter() - start

    def _spawn(self, argv: list[str], workdir: Path, env: dict[str, str], stdout, stderr,
               stdin=subprocess.DEVNULL) -> subprocess.Popen:
        """Start the program (no shell, own process group) unless calls were cancelled; cancel() kills it."""
        try:
            with self._lock:  # a cancel() before this point stops the call; one after it kills the process
                if self._cancelled:
                    raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): cancelled")
                process = subprocess.Popen(argv, cwd=workdir, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                           start_new_session=True)
                self._running.add(process)
        except FileNotFoundError:
            raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): command {argv[0]!r} not found") from None
        except PermissionError:
            raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): {argv[0]!r} is not "
                                        f"executable (chmod +x it)") from None
        except OSError as exc:
            raise CommandCandidateError(f"candidate {self.name} ({self.yaml_path}): cannot start {argv[0]!r} "
                                        f"({exc.strerror or exc})") from None
        return process


#: what a program that needs a variable of the user's shell says when it fails at start-up
START_UP_FAILURES = ("ModuleNotFoundError", "ImportError", "No module named", "error while loading shared libraries",
                     "command not found", "No such file or directory", "KeyError: '", "no usable devices",
                     "environment variable")


def _env_hint(stderr_path: Path, env: dict[str, str]) -> str:
    """A hint when a failure looks like a missing environment: the lab passes only documented variables."""
    try:
        text = stderr_path.read_text(errors="replace")[-4000:]
    except OSError:
        return ""
    if not any(marker in text for marker in START_UP_FAILURES):
        return ""
    given = f" (it sets {', '.join(sorted(env))})" if env else ""
    return (f"; if it needs variables of your shell (PYTHONPATH, a backend such as DEV=CPU, a licence), add them "
            f"to the YAML's `env`{given}: the lab passes only PATH, HOME and the variables docs/external.md §2 lists")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _tail(stderr_path: Path) -> str:
    """The end of the command's stderr, on one line (an error message is one line)."""
    with open(stderr_path, "rb") as stderr:
        stderr.seek(max(0, stderr_path.stat().st_size - STDERR_TAIL))  # a chatty program's log may be huge
        data = stderr.read().decode("utf-8", "replace")
    text = " | ".join(line.strip() for line in data.splitlines() if line.strip())
    return f"; end of its stderr: {text}" if text else "; it wrote nothing to stderr"
