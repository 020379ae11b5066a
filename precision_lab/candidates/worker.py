"""Worker mode of a command candidate (`worker: true`, docs/external.md §2): the program starts once and answers
every request of a diagnosis over stdin/stdout, as Bazel's persistent workers do.

The lab starts the command with its `{request}`/`{response}` arguments left out and `PRECISION_LAB_WORKER=1` in its
environment, then writes one JSON line per request to its stdin::

    {"id": 3, "request": "/tmp/…/request", "response": "/tmp/…/response", "precision": "float32"}

and reads one JSON line per answer from its stdout, after the response bundle is written::

    {"id": 3, "ok": true}                 or    {"id": 3, "ok": false, "error": "one line"}

Lines on stdout that are no frame (a JSON object with this request's `id` and `ok`) are kept with the worker's
stderr and change nothing. Each request has the YAML's `timeout_s`; a worker that exits or hangs is killed, started
again once and asked the same request; a second loss ends the call with one line. A worker answers one request at a
time: calls at once take one worker each. Closing the pool closes each worker's stdin (the program ends at EOF) and
kills its process group after GRACE_S.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

#: the variable that tells a program it is a worker (protocol.WORKER_ENV: the same name, read by protocol.run)
WORKER_ENV = "PRECISION_LAB_WORKER"
#: seconds a worker has to exit after its stdin closes before its process group is killed: a numpy or torch program
#: ends in well under a second; a JIT cache flush (JAX, tinygrad) may take a few
GRACE_S = 5.0
#: the per-call variables of the plain command form: a worker serves many requests, each named in its frame
PER_CALL_ENV = ("PRECISION_LAB_REQUEST", "PRECISION_LAB_RESPONSE", "PRECISION_LAB_PRECISION")


class WorkerLost(Exception):
    """The worker exited or hung during a request (it is killed): the request may be asked again of a new one."""


def worker_argv(template: list[str]) -> list[str]:
    """The command as a worker starts: every argument naming the request or the response left out (they come
    per request on stdin)."""
    return [arg for arg in template if "{request}" not in arg and "{response}" not in arg]


class Worker:
    """One running program serving requests one at a time; started on its first request."""

    def __init__(self, argv: list[str], env: dict[str, str], spawn: Callable, forget: Callable):
        self.argv, self.env = argv, {k: v for k, v in env.items() if k not in PER_CALL_ENV}
        self.env[WORKER_ENV] = "1"
        self.spawn, self.forget = spawn, forget  # CommandProgram's start (cancel-aware) and its bookkeeping
        self.workdir = Path(tempfile.mkdtemp(prefix="precision-lab-worker-"))
        self.env["TMPDIR"] = str(self.workdir)
        self.stderr_path = self.workdir / "stderr.txt"
        self.process: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.next_id = 0
        self.starts = 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.lines = queue.Queue()  # a new process: nothing of the old one's output is read as an answer
        # appending: the lab's notes on stray stdout lines and the program's stderr share the file without overwriting
        with open(self.stderr_path, "ab") as stderr:
            self.process = self.spawn(self.argv, self.workdir, self.env, stderr)
        self.starts += 1
        threading.Thread(target=_read_lines, args=(self.process.stdout, self.lines), daemon=True,
                         name="worker-stdout").start()

    def ask(self, request: Path, response: Path, precision: str, timeout_s: float) -> None:
        """Send one request and wait for its answer; raises WorkerLost (exited, or killed at the timeout) or
        ProgramError (it answered ok:false)."""
        deadline = time.monotonic() + timeout_s
        if not self.alive():
            if self.process is not None:
                self.kill()  # exited between requests: its children go too
            self.start()
        self.next_id += 1
        frame = {"id": self.next_id, "request": str(request), "response": str(response), "precision": precision}
        try:
            self.process.stdin.write((json.dumps(frame) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerLost(self._ended()) from None
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise WorkerLost(f"timed out after {timeout_s:g} s (key 'timeout_s')") from None
            if line is None:
                raise WorkerLost(self._ended())
            answer = _frame(line)
            if answer is None or answer.get("id") != self.next_id:
                self._note(line)
                continue
            if answer["ok"] is True:
                return
            raise ProgramError(" ".join(str(answer.get("error") or "no error message").split()))

    def _ended(self) -> str:
        returncode = self.process.wait()
        self.kill()
        return f"killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"

    def _note(self, line: bytes) -> None:
        with open(self.stderr_path, "ab") as stderr:
            stderr.write(b"[stdout] " + line.rstrip(b"\n") + b"\n")

    def kill(self) -> None:
        """Kill the worker's process group (the program and anything it started) and reap it."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self.forget(self.process)

    def close(self) -> None:
        """End the worker: stdin closed (a protocol program ends at EOF), killed after GRACE_S; its folder removed."""
        if self.alive():
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=GRACE_S)
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class ProgramError(Exception):
    """The worker answered ok:false: the program's own one-line error (it keeps serving)."""


def _read_lines(stdout, lines: queue.Queue) -> None:
    with contextlib.suppress(OSError, ValueError):
        for line in stdout:
            lines.put(line)
    lines.put(None)


def _frame(line: bytes) -> dict | None:
    """An answer frame ({"id": N, "ok": bool, …}), or None for any other line."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(value, dict) and "id" in value and isinstance(value.get("ok"), bool):
        return value
    return None


class WorkerPool:
    """The workers of one candidate: idle ones by argv, a new one where every worker of that argv is busy."""

    def __init__(self):
        self.idle: dict[tuple[str, ...], list[Worker]] = {}
        self.all: list[Worker] = []
        self.lock = threading.Lock()
        _POOLS.add(self)

    def take(self, argv: list[str], env: dict[str, str], spawn: Callable, forget: Callable) -> Worker:
        with self.lock:
            free = self.idle.get(tuple(argv))
            if free:
                return free.pop()
            worker = Worker(argv, env, spawn, forget)
            self.all.append(worker)
            return worker

    def give_back(self, worker: Worker) -> None:
        with self.lock:
            if worker in self.all:
                self.idle.setdefault(tuple(worker.argv), []).append(worker)

    def close(self) -> None:
        with self.lock:
            workers, self.all, self.idle = self.all, [], {}
        for worker in workers:
            worker.close()


_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # a notebook or a script that never closed its candidate's workers: none outlives the lab
    for pool in list(_POOLS):
        pool.close()
