"""Worker mode (`worker: true`): one program answers every request of a diagnosis over stdin/stdout; a lost
worker is started again once; one lost twice, or hung past timeout_s, stops the diagnosis with one line."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import torch

from precision_lab import cli, probes, protocol
from precision_lab.bundle import FORMAT, MANIFEST, NPZ, write_request
from precision_lab.candidates import resolve
from precision_lab.candidates.command import CommandCandidateError
from precision_lab.compute import forward_backward
from precision_lab.diagnosis import diagnose
from precision_lab.problem import make_problem

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "python"
SIZE = 12  # the program and the lab's reference stay tiny: the tests are about the process, not the numbers

# A protocol program: the numpy example's arithmetic behind protocol.run; MODE picks how it misbehaves. Each start
# appends its pid to PID_FILE, each request a line to CALLS_FILE.
PROGRAM = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, os.environ["EXAMPLE_DIR"])
    import candidate
    from precision_lab import protocol
    with open(os.environ["PID_FILE"], "a") as pids:
        pids.write(f"{os.getpid()}\\n")
    print("a banner on stdout before serving", flush=True)
    mode, served = os.environ["MODE"], []

    def compute(request):
        served.append(1)
        with open(os.environ["CALLS_FILE"], "a") as calls:
            calls.write(f"{os.getpid()} {request.precision}\\n")
        marker = Path(os.environ["PID_FILE"] + ".crashed")
        if mode == "crash-once" and len(served) == 2 and not marker.exists():
            marker.write_text("")
            os._exit(1)
        if mode == "crash":
            sys.stderr.write("segmentation fault in conv2_backward\\n")
            sys.stderr.flush()
            os._exit(3)
        if mode == "hang":
            time.sleep(120)
        if mode == "chatty":
            print('{"id": 1, "ok": false, "error": "a print that looks like a frame"}')
            print("epoch 1 loss", 0.5)
            os.write(1, b"written to descriptor 1 by C code\\n")
        loss, output, grads = candidate.forward_backward(request.input, request.target, request.params)
        return loss, grads, output

    protocol.run(compute, layout="OIHW")
''')

# A worker that reads its request and never answers.
HANGS = textwrap.dedent('''
    import os, sys, time
    with open(os.environ["PID_FILE"], "a") as pids:
        pids.write(f"{os.getpid()}\\n")
    for line in sys.stdin:
        time.sleep(120)
''')


ONE_PROBE = probes.select("default")[:1]  # two requests: enough to see a worker serve on, or be restarted


@pytest.fixture(scope="module")
def problem():
    return make_problem(SIZE, 2, seed=5)


@pytest.fixture(autouse=True)
def one_thread():
    # the lab's many tiny ops on a busy shared machine: two threads waiting at each barrier made these diagnoses 2x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _yaml(folder: Path, mode: str, float64: bool = False, timeout_s: float = 60, **overrides) -> Path:
    (folder / "program.py").write_text(PROGRAM)
    command = ["{python}", "program.py", "{request}", "{response}"]
    spec = {"name": f"worker-{mode}", "command": command, "worker": True, "precision": "float32",
            "weight_layout": "OIHW", "timeout_s": timeout_s,
            "env": {"EXAMPLE_DIR": str(EXAMPLE), "PYTHONPATH": str(ROOT), "MODE": mode, "OMP_NUM_THREADS": "1",
                    "PID_FILE": str(folder / "pids.txt"), "CALLS_FILE": str(folder / "calls.txt")}}
    if float64:
        spec["command_float64"] = command
    spec.update(overrides)
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _pids(folder: Path) -> list[int]:
    return [int(line) for line in (folder / "pids.txt").read_text().split()]


def _calls(folder: Path) -> list[str]:
    return (folder / "calls.txt").read_text().splitlines()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_one_worker_answers_every_request_of_a_diagnosis(tmp_path, problem):
    candidate = resolve(str(_yaml(tmp_path, "good")))
    diagnosis = diagnose(candidate, problem, "cpu")
    assert diagnosis.verdict == "roundoff"
    calls = _calls(tmp_path)
    assert len(calls) >= 4  # the problem and the default probes
    assert len(_pids(tmp_path)) == 1 and {line.split()[0] for line in calls} == {str(_pids(tmp_path)[0])}
    assert _gone(_pids(tmp_path)[0])  # shut down with the diagnosis


def test_a_worker_gives_the_plain_commands_numbers(tmp_path, problem):
    candidate = resolve(str(_yaml(tmp_path, "good", float64=True)))
    try:
        float32, float64 = candidate.compute(problem, "float32"), candidate.compute(problem, "float64")
    finally:
        candidate.run.__self__.close()
    reference = forward_backward(problem, "float64")
    for name in problem.network.parameter_names:
        assert float32.grads[name].dtype == np.float32 and float64.grads[name].dtype == np.float64
        np.testing.assert_allclose(float32.grads[name], reference.grads[name], rtol=0, atol=1e-5)
        np.testing.assert_allclose(float64.grads[name], reference.grads[name], rtol=1e-10, atol=1e-14)
    # the same argv serves both builds: one process while the calls come one at a time
    assert len(_pids(tmp_path)) == 1 and [line.split()[1] for line in _calls(tmp_path)] == ["float32", "float64"]


def test_the_two_builds_at_once_take_at_most_one_worker_each(tmp_path, problem):
    diagnosis = diagnose(resolve(str(_yaml(tmp_path, "good", float64=True))), problem, "cpu", probes=[])
    assert diagnosis.verdict == "roundoff"
    assert 1 <= len(_pids(tmp_path)) <= 2 and len(_calls(tmp_path)) == 2
    assert all(_gone(pid) for pid in _pids(tmp_path))


def test_a_worker_lost_once_is_restarted_and_the_diagnosis_completes(tmp_path, problem):
    diagnosis = diagnose(resolve(str(_yaml(tmp_path, "crash-once"))), problem, "cpu", probes=ONE_PROBE)
    assert diagnosis.verdict == "roundoff"
    first, second = _pids(tmp_path)
    assert first != second and (tmp_path / "pids.txt.crashed").exists()
    assert _gone(first) and _gone(second)


def test_a_worker_lost_every_time_stops_the_diagnosis_with_one_line(tmp_path, capsys):
    path = _yaml(tmp_path, "crash")
    assert cli.main(["diagnose", "--candidate", str(path), "--size", str(SIZE), "--batch", "2", "--probes", "none"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("precision-lab: error: candidate worker-crash")
    assert "worker exited with status 3, and again after a restart (exited with status 3)" in error
    assert "segmentation fault in conv2_backward" in error  # the end of its stderr
    assert len(_pids(tmp_path)) == 2 and all(_gone(pid) for pid in _pids(tmp_path))


def test_a_hung_worker_is_killed_at_its_timeout(tmp_path, problem):
    path = _yaml(tmp_path, "hang", timeout_s=2, command=["{python}", "hang.py", "{request}", "{response}"])
    (tmp_path / "hang.py").write_text(HANGS)  # starts in milliseconds: the 2 s are the request's, not an import's
    start = time.perf_counter()
    with pytest.raises(CommandCandidateError, match=r"timed out after 2 s \(key 'timeout_s'\), and again after a "
                                                    r"restart \(timed out after 2 s") as info:
        diagnose(resolve(str(path)), problem, "cpu", probes=[])
    assert "\n" not in str(info.value)
    assert time.perf_counter() - start < 2 * 2 + 20  # two timeouts, not the program's 120 s sleep
    assert len(_pids(tmp_path)) == 2 and all(_gone(pid) for pid in _pids(tmp_path))


def test_prints_to_stdout_inside_compute_do_not_break_the_framing(tmp_path, problem):
    diagnosis = diagnose(resolve(str(_yaml(tmp_path, "chatty"))), problem, "cpu", probes=ONE_PROBE)
    assert diagnosis.verdict == "roundoff" and len(_pids(tmp_path)) == 1 and len(_calls(tmp_path)) == 2


def test_a_failing_request_is_answered_and_the_worker_serves_the_next(tmp_path, problem, capfd, monkeypatch):
    write_request(problem, tmp_path / "req", "float32", "OIHW")
    requests = iter([ValueError("no kernel for this shape"), None])

    def compute(request):
        failure = next(requests)
        if failure is not None:
            raise failure
        from precision_lab.compute import forward_backward as lab_step

        result = lab_step(problem, "float32")
        return np.float32(result.loss), {name: np.asarray(grad) for name, grad in result.grads.items()}

    lines = [json.dumps({"id": 7, "request": str(tmp_path / "req"), "response": str(tmp_path / "r1")}),
             "not json", json.dumps({"id": 8, "request": str(tmp_path / "req"), "response": str(tmp_path / "r2")})]
    saved = os.dup(1)
    try:
        protocol.serve(compute, layout="OIHW", stdin=io.StringIO("\n".join(lines) + "\n"))
    finally:
        os.dup2(saved, 1)  # serve() points descriptor 1 at stderr for the rest of a worker's life
        os.close(saved)
    frames = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert frames[0] == {"id": 7, "ok": False, "error": "ValueError: no kernel for this shape"}
    assert frames[1]["id"] is None and frames[1]["ok"] is False and "a request line is" in frames[1]["error"]
    assert frames[2] == {"id": 8, "ok": True} and (tmp_path / "r2" / "bundle.json").exists()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_worker_value_is_one_line(tmp_path, value):
    path = _yaml(tmp_path, "good", worker=value)
    with pytest.raises(CommandCandidateError, match=r"key 'worker' is .*, expected true") as info:
        resolve(str(path))
    assert "\n" not in str(info.value)


# An opaque program (docs/external.md §5) on protocol.run: loss ½‖x·w‖², its gradient xᵀ(x·w).
OPAQUE = textwrap.dedent('''
    import os
    import numpy as np
    from precision_lab import protocol
    with open(os.environ["PID_FILE"], "a") as pids:
        pids.write(f"{os.getpid()}\\n")

    def compute(request):
        with open(os.environ["CALLS_FILE"], "a") as calls:
            calls.write(f"{os.getpid()} {request.precision}\\n")
        x, w = request.arrays["x"], request.params["w"]
        y = x @ w
        return np.asarray(0.5 * np.sum(y * y), request.dtype), {"w": (x.T @ y).astype(request.dtype)}

    protocol.run(compute)
''')


def test_the_reference_free_checks_calls_go_to_one_worker(tmp_path):
    start = tmp_path / "start"
    start.mkdir()
    rng = np.random.default_rng(3)
    np.savez(start / NPZ, x=rng.standard_normal((6, 4)).astype(np.float32),
             w=rng.standard_normal((4, 3)).astype(np.float32))
    (start / MANIFEST).write_text(json.dumps({"format": FORMAT, "kind": "request", "precision": "float32",
                                              "model": {"opaque": True, "parameters": ["w"]}}))
    (tmp_path / "opaque.py").write_text(OPAQUE)
    path = _yaml(tmp_path, "opaque", float64=True, model="opaque", start="start/",
                 command=["{python}", "opaque.py", "{request}", "{response}"],
                 command_float64=["{python}", "opaque.py", "{request}", "{response}"])
    candidate = resolve(str(path))
    result = candidate.check()
    calls = _calls(tmp_path)
    assert len(calls) >= 4 and {line.split()[1] for line in calls} == {"float32", "float64"}
    assert len(_pids(tmp_path)) == 1 and _gone(_pids(tmp_path)[0])  # one start for every call, closed at the end
    assert result.verdict == "roundoff"


def test_ctrl_c_ends_the_diagnosis_and_its_worker(tmp_path):
    path = _yaml(tmp_path, "hang", command=["{python}", "hang.py", "{request}", "{response}"])
    (tmp_path / "hang.py").write_text(HANGS)
    lab = subprocess.Popen([sys.executable, "-m", "precision_lab.cli", "diagnose", "--candidate", str(path),
                            "--size", str(SIZE), "--batch", "2", "--probes", "none"], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # the lab's start on a busy 2-core machine, then the worker's
    while not (tmp_path / "pids.txt").exists() and time.monotonic() < deadline and lab.poll() is None:
        time.sleep(0.2)
    worker = _pids(tmp_path)[0]
    lab.send_signal(signal.SIGINT)
    _, stderr = lab.communicate(timeout=60)
    assert lab.returncode == 130 and "interrupted" in stderr
    assert _gone(worker)
