"""Command candidates: the YAML, the call (no shell, temporary folder, timeout, environment) and every failure."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from precision_lab import cli
from precision_lab.candidates import Candidate, CandidateError, resolve
from precision_lab.candidates.command import CommandCandidateError, load_command_candidate
from precision_lab.errors import LabInputError
from precision_lab.problem import make_problem
from precision_lab.compute import forward_backward
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names

SIZE = 12  # the fake program computes nothing heavy; the lab's side stays small too
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python" / "candidate.py"

# A stand-in program: MODE picks a behaviour; "good" answers with the numpy example's results.
FAKE = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    mode, request, response = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    Path("cwd.txt").write_text(os.getcwd())
    if "PID_FILE" in os.environ:
        Path(os.environ["PID_FILE"]).write_text(str(os.getpid()))
    Path(sys.argv[4] if len(sys.argv) > 4 else "env.json").write_text(json.dumps(dict(os.environ)))
    if mode == "fail":
        sys.stderr.write("reading input...\\nsegmentation fault in conv2_backward at line 42\\n")
        sys.exit(3)
    if mode == "sleep":
        time.sleep(30)
    if mode == "silent":
        sys.exit(0)
    sys.path.insert(0, os.environ["EXAMPLE_DIR"])
    import candidate
    candidate.main(request, response)
    meta = json.loads((response / "bundle.json").read_text())
    with np.load(response / "arrays.npz") as data:
        arrays = dict(data)
    if mode == "malformed":
        (response / "bundle.json").write_text("{oops")
    if mode == "missing":
        del arrays["conv2.weight.grad"]
    if mode == "shape":
        arrays["conv1.weight.grad"] = arrays["conv1.weight.grad"].reshape(-1)
    if mode == "nan":
        arrays["conv3.bias.grad"][0] = np.nan
    if mode == "pickle":
        arrays["loss"] = np.array([{"loss": 1}], dtype=object)
    if mode == "precision":
        meta["precision"] = "float64"
    np.savez(response / "arrays.npz", **arrays)
    if mode != "malformed":
        (response / "bundle.json").write_text(json.dumps(meta))
''')


@pytest.fixture(scope="module")
def problem():
    return make_problem(SIZE, 2, seed=5)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    (tmp_path / "fake.py").write_text(FAKE)
    monkeypatch.setenv("PRECISION_LAB_TEST_SECRET", "must-not-leak")
    return tmp_path


def _yaml(folder: Path, mode: str = "good", **overrides) -> Path:
    spec = {"name": f"fake-{mode}", "command": ["{python}", "fake.py", mode, "{request}", "{response}"],
            "precision": "float32", "weight_layout": "HWIO", "timeout_s": 60,
            "env": {"EXAMPLE_DIR": str(EXAMPLE.parent)}}
    spec.update(overrides)
    spec = {k: v for k, v in spec.items() if v is not None}
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _fails(path, problem, pattern, precision="float32"):
    candidate = load_command_candidate(path)
    with pytest.raises(CommandCandidateError, match=pattern) as info:
        candidate.compute(problem, precision)
    assert "\n" not in str(info.value) and isinstance(info.value, LabInputError)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# a working program


def test_good_program_returns_its_gradients_in_oihw(folder, problem):
    candidate = resolve(str(_yaml(folder)))
    assert (candidate.family, candidate.weight_layout, candidate.has_float64) == ("command", "HWIO", False)
    result = candidate.compute(problem)
    reference = forward_backward(problem, "float64")
    assert result.meta["wall_s"] > 0
    for name in PARAM_NAMES:  # sent as HWIO, read back through HWIO: must agree with OIHW float64
        assert result.grads[name].dtype == np.float32
        np.testing.assert_allclose(result.grads[name], reference.grads[name], rtol=0, atol=1e-5)
    assert result.loss == pytest.approx(reference.loss, rel=1e-5)


def test_float64_runs_command_float64_with_a_float64_request(folder, problem):
    path = _yaml(folder, command_float64=["{python}", "fake.py", "good", "{request}", "{response}", "env64.json"])
    candidate = load_command_candidate(path)
    assert candidate.has_float64
    result = candidate.compute(problem, "float64")
    assert result.grads["conv2.weight"].dtype == np.float64
    assert result.meta["exchange_precision"] == "float64"
    reference = forward_backward(problem, "float64")
    np.testing.assert_allclose(result.grads["conv2.weight"], reference.grads["conv2.weight"], rtol=1e-9, atol=1e-15)


def test_no_command_float64_means_no_float64_build(folder, problem):
    candidate = load_command_candidate(_yaml(folder))
    with pytest.raises(CandidateError, match="no float64 build"):
        candidate.compute(problem, "float64")


def test_runs_in_a_temporary_folder_with_the_documented_environment(folder, problem):
    load_command_candidate(_yaml(folder, command=["{python}", str(folder / "fake.py"), "good", "{request}",
                                                  "{response}", str(folder / "env.json")])).compute(problem)
    env = json.loads((folder / "env.json").read_text())
    assert "PRECISION_LAB_TEST_SECRET" not in env  # the lab's own environment is not inherited
    assert env["PRECISION_LAB_PRECISION"] == "float32" and env["EXAMPLE_DIR"] == str(EXAMPLE.parent)
    assert Path(env["PRECISION_LAB_REQUEST"]).name == "request"
    assert env["TMPDIR"] == str(Path(env["PRECISION_LAB_REQUEST"]).parent)
    assert not (folder / "cwd.txt").exists()  # the command ran elsewhere: in the temporary folder
    assert not Path(env["TMPDIR"]).exists()  # which is gone afterwards


def test_tf32_claim_sends_float32_arrays(folder, problem):
    result = load_command_candidate(_yaml(folder, precision="tf32")).compute(problem)
    assert result.meta["exchange_precision"] == "tf32" and result.grads["conv1.weight"].dtype == np.float32


# ---------------------------------------------------------------------------------------------
# the program fails


def test_command_not_found_on_path(folder, problem):
    path = _yaml(folder, command=["no-such-program-xyz", "{request}", "{response}"])
    _fails(path, problem, r"key 'command': command 'no-such-program-xyz' not found on PATH")


def test_relative_program_not_found(folder, problem):
    path = _yaml(folder, command=["./build/impl", "{request}", "{response}"])
    _fails(path, problem, r"program './build/impl' not found \(looked for .*build/impl\)")


def test_program_not_executable(folder, problem):
    (folder / "impl").write_text("#!/bin/sh\nexit 0\n")
    os.chmod(folder / "impl", 0o644)
    _fails(_yaml(folder, command=["./impl", "{request}", "{response}"]), problem, r"'.*impl' is not executable")


def test_non_zero_exit_shows_the_end_of_stderr(folder, problem):
    message = _fails(_yaml(folder, "fail"), problem, "command exited with status 3")
    assert "segmentation fault in conv2_backward at line 42" in message


def test_timeout(folder, problem):
    message = _fails(_yaml(folder, "sleep", timeout_s=1.5), problem, r"timed out after 1.5 s \(key 'timeout_s'\)")
    assert "fake-sleep" in message


def test_no_response(folder, problem):
    _fails(_yaml(folder, "silent"), problem, r"bad response: response/bundle.json: missing")


def test_malformed_response(folder, problem):
    _fails(_yaml(folder, "malformed"), problem, r"bad response: .*bundle.json: not valid JSON")


def test_missing_array_in_response(folder, problem):
    _fails(_yaml(folder, "missing"), problem,
           r"arrays.npz has no 'conv2.weight.grad' \(expected shape \(3, 3, 16, 16\) in layout HWIO\)")


def test_wrong_shape_in_response(folder, problem):
    _fails(_yaml(folder, "shape"), problem, r"'conv1.weight.grad' has shape \(144,\), expected shape \(3, 3, 1, 16\)")


def test_non_finite_response(folder, problem):
    _fails(_yaml(folder, "nan"), problem, r"'conv3.bias.grad' holds 1 NaN or infinite values")


def test_pickled_response(folder, problem):
    _fails(_yaml(folder, "pickle"), problem, r"'loss' holds Python objects \(a pickle\)")


def test_response_in_another_precision(folder, problem):
    _fails(_yaml(folder, "precision"), problem, r"bundle.json: key 'precision' is 'float64', expected 'float32' as in the request")


# ---------------------------------------------------------------------------------------------
# the YAML is wrong


@pytest.mark.parametrize("overrides,pattern", [
    ({"weight_layout": "HWIOO"}, r"key 'weight_layout': unknown weight layout 'HWIOO'"),
    ({"precision": "float8"}, r"key 'precision' is 'float8', expected one of float64, float32, tf32"),
    ({"command": "./impl {request} {response}"}, r"key 'command' must be a non-empty list of arguments"),
    ({"command": ["./impl", "{request}"]}, r"key 'command' never mentions \"\{response\}\""),
    ({"command_float64": []}, r"key 'command_float64' must be a non-empty list"),
    ({"timeout_s": -1}, r"key 'timeout_s' is -1, expected a positive number of seconds"),
    ({"env": ["A=1"]}, r"key 'env' must map variable names to strings"),
    ({"comand": ["x"]}, r"unknown key 'comand': expected keys among name, description, command"),
    ({"name": ""}, r"key 'name' must be a non-empty string"),
])
def test_bad_yaml_keys(folder, overrides, pattern):
    with pytest.raises(CommandCandidateError, match=pattern):
        load_command_candidate(_yaml(folder, **overrides))


def test_unreadable_yaml(folder):
    (folder / "broken.yaml").write_text("command: [unclosed\n")
    with pytest.raises(CommandCandidateError, match=r"broken.yaml: not valid YAML"):
        load_command_candidate(folder / "broken.yaml")
    (folder / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(CommandCandidateError, match=r"list.yaml: expected a YAML mapping"):
        load_command_candidate(folder / "list.yaml")
    with pytest.raises(CommandCandidateError, match=r"nope.yaml: no such candidate file"):
        load_command_candidate(folder / "nope.yaml")
    (folder / "huge.yaml").write_text("# padding\n" * 200_000)
    with pytest.raises(CommandCandidateError, match=r"huge.yaml: 2000000 bytes is not a candidate YAML"):
        load_command_candidate(folder / "huge.yaml")


def test_diagnosis_stopped_during_the_reference_kills_the_running_program(folder, problem, monkeypatch):
    import time

    import psutil

    from precision_lab import diagnosis as diagnosis_module, reference as reference_module

    pid_file = folder / "pid.txt"
    candidate = resolve(str(_yaml(folder, "sleep", env={"EXAMPLE_DIR": str(EXAMPLE.parent), "PID_FILE": str(pid_file)})))

    def interrupted_reference(*_args):  # Ctrl-C arrives while the program runs beside the reference
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline, "the program never started"
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_module, "reference", interrupted_reference)  # diagnose imports it when it runs
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        diagnosis_module.diagnose(candidate, problem, "cpu")
    assert time.monotonic() - start < 20  # the program sleeps 30 s: it was killed, not waited for
    assert not psutil.pid_exists(int(pid_file.read_text()))


def test_a_cancel_before_the_program_starts_stops_the_call(folder, problem):
    pid_file = folder / "pid.txt"
    candidate = load_command_candidate(_yaml(folder, env={"EXAMPLE_DIR": str(EXAMPLE.parent), "PID_FILE": str(pid_file)}))
    program = candidate.run.__self__
    program.cancel()  # Ctrl-C arrived while the request was still being written
    with pytest.raises(CommandCandidateError, match=r"fake-good .*: cancelled"):
        candidate.compute(problem)
    assert not pid_file.exists()  # the program never ran
    program.allow_calls()
    assert candidate.compute(problem).meta["wall_s"] > 0 and pid_file.exists()


def test_cli_exits_2_with_one_line_for_a_failing_candidate(folder, capsys):
    code = cli.main(["diagnose", "--candidate", str(_yaml(folder, "fail")), "--size", str(SIZE)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "exited with status 3" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["{python}", "fake_v2.py", "good", "{request}", "{response}"],
                                     ["python3", "-u", "fake_v2.py", "{request}", "{response}"]])
def test_a_missing_script_is_named_beside_its_yaml(folder, problem, command):
    message = _fails(_yaml(folder, command=command), problem, r"script 'fake_v2.py' not found")
    assert f"looked for {folder / 'fake_v2.py'}" in message and "precision-lab-call" not in message


def test_an_interpreter_without_a_script_file_is_left_alone(folder, problem):
    # `python -c CODE`: no script to look for; the program runs (and fails for its own reason)
    _fails(_yaml(folder, command=["{python}", "-c", "import sys; sys.exit(3)", "{response}"]), problem,
           r"exit")


# A program whose two builds share a device: the claimed build holds `busy` while it runs; the float64 build waits
# until the claimed one has started and fails while it holds the device ("device busy"), as an exclusive GPU would.
SHARED = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    lock, started = Path(os.environ["LOCK_DIR"]) / "busy", Path(os.environ["LOCK_DIR"]) / "started32"
    (Path(os.environ["LOCK_DIR"]) / f"pid-{os.environ['PRECISION_LAB_PRECISION']}").write_text(str(os.getpid()))
    if os.environ.get("SLEEP"):
        time.sleep(30)
    if os.environ["PRECISION_LAB_PRECISION"] == "float32":
        lock.touch()
        started.touch()
        time.sleep(1.0)
    else:
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if lock.exists():
            sys.exit("device busy")
    sys.path.insert(0, os.environ["EXAMPLE_DIR"])
    import candidate
    candidate.main(sys.argv[1], sys.argv[2])
    lock.unlink(missing_ok=True)
''')


def _shared_yaml(folder: Path, **env) -> Path:
    (folder / "shared.py").write_text(SHARED)
    argv = ["{python}", "shared.py", "{request}", "{response}"]
    return _yaml(folder, "shared", command=argv, command_float64=argv,
                 env={"EXAMPLE_DIR": str(EXAMPLE.parent), "LOCK_DIR": str(folder), **env})


def test_a_float64_build_that_cannot_run_beside_the_claimed_one_runs_again_alone(folder, problem):
    from precision_lab.diagnosis import diagnose

    diagnosis = diagnose(resolve(str(_shared_yaml(folder))), problem, "cpu", probes=[])
    # the first float64 call failed while the claimed build held the device: the lab ran it again after
    assert diagnosis.verdict == "roundoff" and diagnosis.float64_build is not None
    assert diagnosis.float64_build.persists == [] and not (folder / "busy").exists()


def test_diagnosis_stopped_during_the_reference_kills_both_builds(folder, problem, monkeypatch):
    import time

    import psutil

    from precision_lab import diagnosis as diagnosis_module, reference as reference_module

    candidate = resolve(str(_shared_yaml(folder, SLEEP="1")))
    pids = [folder / "pid-float32", folder / "pid-float64"]

    def interrupted_reference(*_args):  # Ctrl-C once both builds run beside the reference
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in pids):
            assert time.monotonic() < deadline, "the two builds never ran at once"
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_module, "reference", interrupted_reference)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        diagnosis_module.diagnose(candidate, problem, "cpu", probes=[])
    assert time.monotonic() - start < 20  # each build sleeps 30 s: both were killed, not waited for
    assert not any(psutil.pid_exists(int(p.read_text())) for p in pids)


# A program that leaves a mark as it starts, then answers as the numpy example does; its float32 calls (with
# EXCLUSIVE set) cannot run two at once: each holds a lock while it computes and exits at once if another holds it.
MARKING = textwrap.dedent('''
    import fcntl, os, sys, time
    from pathlib import Path
    folder = Path(os.environ["MARK_DIR"])
    (folder / f"started-{os.environ['PRECISION_LAB_PRECISION']}-{os.getpid()}").touch()
    if os.environ["PRECISION_LAB_PRECISION"] == "float32" and os.environ.get("FAIL"):
        sys.exit("the claimed build fails")
    lock = open(folder / "lock", "w")
    if os.environ["PRECISION_LAB_PRECISION"] == "float32" and os.environ.get("EXCLUSIVE"):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            (folder / f"refused-{os.getpid()}").touch()
            sys.exit("licence busy")
        time.sleep(0.5)
    sys.path.insert(0, os.environ["EXAMPLE_DIR"])
    import candidate
    candidate.main(sys.argv[1], sys.argv[2])
''')


def _marking(folder: Path, float64: bool = True, **env) -> Candidate:
    (folder / "marking.py").write_text(MARKING)
    argv = ["{python}", "marking.py", "{request}", "{response}"]
    return resolve(str(_yaml(folder, "marking", command=argv, command_float64=argv if float64 else None,
                             env={"EXAMPLE_DIR": str(EXAMPLE.parent), "MARK_DIR": str(folder), **env})))


def _marks(folder: Path, kind: str = "started-") -> int:
    return len(list(folder.glob(f"{kind}*")))


def test_the_probes_programs_run_while_the_lab_builds_the_problems_reference(folder, problem, monkeypatch):
    import time

    from precision_lab import diagnosis as diagnosis_module, reference as reference_module

    candidate, real, seen = _marking(folder), reference_module.reference, []

    def watching_reference(asked, where):
        if asked is problem:  # the problem's own reference: a probe's program starts before it is done
            deadline = time.monotonic() + 60
            while _marks(folder, "started-float32") < 2:
                assert time.monotonic() < deadline, "no probe's program ran beside the problem's reference"
                time.sleep(0.02)
            seen.append(_marks(folder))
        return real(asked, where)

    monkeypatch.setattr(reference_module, "reference", watching_reference)
    diagnosis = diagnosis_module.diagnose(candidate, problem, "cpu")
    assert diagnosis.verdict == "roundoff" and len(diagnosis.probes) == 3 and seen and seen[0] >= 3
    # the problem's two builds and three probes, each run once
    assert (_marks(folder, "started-float32"), _marks(folder, "started-float64")) == (4, 1)


def test_a_program_without_a_float64_build_runs_its_probes_while_the_lab_works(folder, problem, monkeypatch):
    import time

    from precision_lab import diagnosis as diagnosis_module, errmodel

    candidate, real, seen = _marking(folder, float64=False, EXCLUSIVE="1"), errmodel.error_bounds, []

    def watching_bounds(trace, precision, *args, **kwargs):
        if trace.problem is problem and not seen:  # the problem's own bounds: the first probe's call starts meanwhile
            deadline = time.monotonic() + 60
            while _marks(folder, "started-float32") < 2:
                assert time.monotonic() < deadline, "no probe's program ran beside the problem's bounds"
                time.sleep(0.02)
            seen.append(_marks(folder, "started-float32"))
        return real(trace, precision, *args, **kwargs)

    monkeypatch.setattr(errmodel, "error_bounds", watching_bounds)
    diagnosis = diagnosis_module.diagnose(candidate, problem, "cpu")
    assert diagnosis.verdict == "roundoff" and len(diagnosis.probes) == 3 and seen and seen[0] >= 2
    # one call at a time (none refused by the lock), each once
    assert _marks(folder, "refused-") == 0 and (_marks(folder, "started-float32"), _marks(folder, "started-float64")) \
        == (4, 0)


def test_a_probes_judgement_leaves_a_core_to_the_call_running_beside_it(folder, problem, monkeypatch):
    import torch

    from precision_lab import diagnosis as diagnosis_module, verdict

    programs, real_judge, seen = [], verdict.judge, []
    real_init = diagnosis_module._Programs.__init__

    def keeping(self, *args):
        real_init(self, *args)
        programs.append(self)

    def judging(*args, **kwargs):
        # the calls running now: the next probe's, queued behind the one just judged
        seen.append((torch.get_num_threads(), sum(run.running() for run in programs[0].runs)))
        return real_judge(*args, **kwargs)

    monkeypatch.setattr(diagnosis_module._Programs, "__init__", keeping)
    monkeypatch.setattr(verdict, "judge", judging)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        diagnosis = diagnosis_module.diagnose(_marking(folder, float64=False, EXCLUSIVE="1"), problem, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert diagnosis.verdict == "roundoff" and len(seen) == 4  # the problem and three probes
    beside = [(lab, running) for lab, running in seen if running]
    assert beside, "no judgement ran while a probe's call did"
    assert all(lab == 1 for lab, _ in beside)  # one of the two cores, the other the program's


def test_a_probe_refused_beside_another_call_runs_again_alone(folder, problem):
    from precision_lab.diagnosis import diagnose

    diagnosis = diagnose(_marking(folder, EXCLUSIVE="1"), problem, "cpu")
    assert _marks(folder, "refused-") >= 1  # a probe met the claimed build (or another probe) holding the licence
    assert diagnosis.verdict == "roundoff" and len(diagnosis.probes) == 3
    assert _marks(folder, "started-float32") == 4 + _marks(folder, "refused-")  # each refused call, once more


def test_a_program_without_a_float64_build_is_called_once_at_a_time(folder, problem):
    from precision_lab.diagnosis import diagnose

    diagnosis = diagnose(_marking(folder, float64=False, EXCLUSIVE="1"), problem, "cpu")
    assert diagnosis.verdict == "roundoff" and len(diagnosis.probes) == 3
    assert _marks(folder, "refused-") == 0 and _marks(folder, "started-float32") == 4


def test_a_failed_claimed_build_starts_no_queued_probe(folder, problem):
    from precision_lab.diagnosis import diagnose

    with pytest.raises(CandidateError, match="the claimed build fails"):
        diagnose(_marking(folder, FAIL="1"), problem, "cpu")
    # the claimed build and the float64 build; a probe may have taken the slot the float64 build left before the
    # failure was read, none after
    assert _marks(folder, "started-float32") <= 2


def test_a_failed_claimed_build_of_a_one_call_program_starts_no_probe(folder, problem):
    from precision_lab.diagnosis import diagnose

    with pytest.raises(CandidateError, match="the claimed build fails"):
        diagnose(_marking(folder, float64=False, FAIL="1"), problem, "cpu")
    assert _marks(folder, "started-float32") == 1  # the probes' calls queued behind it never ran


def test_a_diagnosis_stopped_early_never_starts_the_queued_probes(folder, problem, monkeypatch):
    from precision_lab import diagnosis as diagnosis_module, reference as reference_module

    candidate = _marking(folder)

    def interrupted_reference(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(reference_module, "reference", interrupted_reference)
    with pytest.raises(KeyboardInterrupt):
        diagnosis_module.diagnose(candidate, problem, "cpu")
    assert _marks(folder) <= 2  # the two builds that had a slot when the Ctrl-C came; no probe


def test_repeats_run_before_the_probes_and_every_call_once(folder, problem):
    from precision_lab.diagnosis import diagnose

    diagnosis = diagnose(_marking(folder), problem, "cpu", repeats=2)
    assert diagnosis.verdict == "roundoff" and diagnosis.spread.runs == 2 and len(diagnosis.probes) == 3
    # the claimed build twice and three probes; the float64 build once
    assert (_marks(folder, "started-float32"), _marks(folder, "started-float64")) == (5, 1)
