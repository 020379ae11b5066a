"""The example candidates judged end to end: the Fortran program (right and with the flip slip) and the numpy one.

The Fortran tests need gfortran (`make system-deps` installs it); they skip, saying so, only
when it cannot be found. The first call builds the binaries in a cache folder outside the source
tree (examples/fortran/run.sh says where).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precision_lab.candidates import resolve
from precision_lab.export import export
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FORTRAN = EXAMPLES / "fortran" / "candidate.yaml"
FORTRAN_FLIP = EXAMPLES / "fortran" / "candidate-flip-slip.yaml"
PYTHON = EXAMPLES / "python" / "candidate.yaml"
SIZE = 32  # every example is a full forward/backward; 32² keeps the file under a few seconds once built

needs_gfortran = pytest.mark.skipif(shutil.which("gfortran") is None,
                                    reason="gfortran not found: install it (apt-get install gfortran, or make system-deps)")


@pytest.fixture(scope="module")
def problem():
    return make_problem(SIZE, 2, seed=0)


@pytest.fixture(scope="module")
def ref(problem):
    return reference(problem)


def _judge(spec: Path, problem, ref, precision="float32"):
    candidate = resolve(str(spec))
    result = candidate.compute(problem, precision)
    claimed = candidate.claimed_precision if precision == "float32" else "float64"
    return judge(result, ref, claimed, candidate.name), result


def _fortran_call(tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    return subprocess.run([sys.executable, "-m", "precision_lab.cli", "diagnose", "--candidate", str(FORTRAN),
                           "--size", "16", "--probes", "none"], capture_output=True, text=True,
                          env={**env, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env_extra}, cwd=tmp_path)


def test_fortran_example_without_a_compiler_says_so_in_one_line(tmp_path):
    run = _fortran_call(tmp_path, {"FC": "no-such-fortran-compiler"})
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "no Fortran compiler: 'no-such-fortran-compiler' not found" in run.stderr
    assert "f77" not in run.stderr and not (FORTRAN.parent / "build").exists()


@needs_gfortran
def test_fortran_example_builds_outside_the_source_tree(tmp_path):
    before = sorted(p.name for p in FORTRAN.parent.iterdir())
    run = _fortran_call(tmp_path, {})
    assert run.returncode == 0 and "verdict: roundoff" in run.stdout, run.stderr
    assert sorted(p.name for p in FORTRAN.parent.iterdir()) == before  # nothing left in examples/fortran/
    assert list((tmp_path / "cache" / "precision-lab").glob("fortran-*/cnn32"))  # the binary went to the cache


def test_python_example_is_roundoff(problem, ref):
    judgement, result = _judge(PYTHON, problem, ref)
    assert judgement.verdict == "roundoff", judgement.to_text()
    assert result.meta["wall_s"] > 0
    # not vacuous: the float32 program does differ from float64, just within the bound
    assert 0 < judgement.quantities["conv2.weight"].max_abs_err
    assert judgement.quantities["conv2.weight"].bound_ratio < 1


def test_python_example_float64_build_is_roundoff_at_float64(problem, ref):
    judgement, result = _judge(PYTHON, problem, ref, "float64")
    assert result.grads["conv2.weight"].dtype == np.float64
    assert judgement.verdict == "roundoff", judgement.to_text()


@needs_gfortran
def test_fortran_example_is_roundoff(problem, ref):
    judgement, result = _judge(FORTRAN, problem, ref)
    assert judgement.verdict == "roundoff", judgement.to_text()
    assert result.grads["conv2.weight"].dtype == np.float32
    assert judgement.quantities["conv2.weight"].max_abs_err > 0


@needs_gfortran
def test_fortran_real8_build_is_roundoff_at_float64(problem, ref):
    """The seed's test (2): recompiled in double precision, the error falls by orders of magnitude."""
    judgement64, _ = _judge(FORTRAN, problem, ref, "float64")
    judgement32, _ = _judge(FORTRAN, problem, ref, "float32")
    assert judgement64.verdict == "roundoff", judgement64.to_text()
    err32 = judgement32.quantities["conv2.weight"].max_abs_err
    err64 = judgement64.quantities["conv2.weight"].max_abs_err
    assert err64 < 1e-6 * err32  # u64/u32 ≈ 1e-9: rounding error falls, a defect would not


@needs_gfortran
def test_fortran_flip_slip_is_diagnosed_layout(problem, ref):
    judgement, _ = _judge(FORTRAN_FLIP, problem, ref)
    assert judgement.verdict == "layout", judgement.to_text()
    for name in ("conv1.weight", "conv2.weight", "conv3.weight"):
        assert judgement.quantities[name].verdict == "layout"
        assert judgement.quantities[name].layout_fix == "flip HW"
    for name in ("conv1.bias", "conv2.bias", "conv3.bias", "loss", "output"):
        assert judgement.quantities[name].verdict == "roundoff"  # the slip touches the conversion only


@needs_gfortran
def test_flip_slip_is_one_line_of_the_source():
    source = (EXAMPLES / "fortran" / "cnn.F90").read_text().splitlines()
    start = source.index("#ifdef FLIP_SLIP")
    assert source[start + 2] == "#else" and source[start + 4] == "#endif"  # one line each way


def _external_check(reference_dir: Path, response: dict[str, np.ndarray]) -> dict[str, float]:
    """What an external test suite does with an export: worst |g − g_ref| ÷ bound per array."""
    with np.load(reference_dir / "arrays.npz") as data:
        stored = dict(data)
    return {name: float(np.max(np.abs(response[name] - stored[name]) / stored[f"{name}.bound"]))
            for name in response if f"{name}.bound" in stored}


def test_export_lets_an_external_suite_pass_the_numpy_example(tmp_path):
    out = export(make_problem(16, 2, seed=1), tmp_path / "export", "float32", "HWIO")
    response = tmp_path / "response"
    subprocess.run([sys.executable, str(EXAMPLES / "python" / "candidate.py"), str(out / "request"), str(response)],
                   check=True)
    with np.load(response / "arrays.npz") as data:
        ratios = _external_check(out / "reference", dict(data))
    assert set(ratios) >= {"loss", "output", "conv1.weight.grad", "conv3.bias.grad"}
    assert max(ratios.values()) <= 1.0, ratios
    assert ratios["conv2.weight.grad"] > 0


def test_export_bounds_catch_a_flip(tmp_path):
    """The same check fails for a flipped weight gradient: the bounds are not vacuous."""
    out = export(make_problem(16, 2, seed=1), tmp_path / "export", "float32", "OIHW")
    with np.load(out / "reference" / "arrays.npz") as data:
        stored = dict(data)
    flipped = {"conv2.weight.grad": stored["conv2.weight.grad"][:, :, ::-1, ::-1].astype(np.float32)}
    assert _external_check(out / "reference", flipped)["conv2.weight.grad"] > 100


def test_export_float64_bounds_hold_for_the_float64_build(tmp_path):
    out = export(make_problem(16, 2, seed=2), tmp_path / "export", "float64", "OIHW")
    response = tmp_path / "response"
    subprocess.run([sys.executable, str(EXAMPLES / "python" / "candidate.py"), str(out / "request"), str(response)],
                   check=True)
    with np.load(response / "arrays.npz") as data:
        arrays = dict(data)
    assert arrays["conv2.weight.grad"].dtype == np.float64
    ratios = _external_check(out / "reference", arrays)
    assert max(ratios.values()) <= 1.0, ratios


def test_export_cli_writes_raw_bundles_and_refuses_to_overwrite(tmp_path, capsys):
    from precision_lab import cli

    out = tmp_path / "export"
    assert cli.main(["export", "--size", "16", "--layout", "HWIO", "--raw", "--out", str(out)]) == 0
    reference_manifest = (out / "reference" / "bundle.json").read_text()
    assert '"conv2.weight.grad.bound": {"file": "conv2.weight.grad.bound.bin", "dtype": "float64", ' \
           '"shape": [3, 3, 16, 16], "order": "F"}' in reference_manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left behind
    capsys.readouterr()
    assert cli.main(["export", "--size", "16", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists and is not an empty folder" in err
    assert cli.main(["export", "--size", "16", "--layout", "OIHX", "--out", str(tmp_path / "x")]) == 2
    assert "--layout: unknown weight layout 'OIHX'" in capsys.readouterr().err


@needs_gfortran
def test_diagnose_cli_exit_codes_on_the_fortran_examples(capsys):
    from precision_lab import cli

    assert cli.main(["diagnose", "--candidate", str(FORTRAN), "--size", str(SIZE)]) == 0
    assert "verdict: roundoff" in capsys.readouterr().out
    assert cli.main(["diagnose", "--candidate", str(FORTRAN_FLIP), "--size", str(SIZE)]) == 1
    assert "verdict: layout (flip HW)" in capsys.readouterr().out
