"""Same parameters on the same CPU machine → bitwise-identical result tables; `rerun` repeats a run."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from precision_lab.paths import NOTEBOOKS_DIR, PARAMS_DIR, ROOT
from precision_lab.rerun import compare_tables, result_files

FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"
#: candidates with different arithmetic, so the tables hold many distinct float32/float64 digits
CANDIDATES = "[native, tf32-emulated, fortran-replay-flip]"


def lab(tmp: Path, *args, notebooks_dir=FIXTURES, timeout=600):
    command = [sys.executable, "-m", "precision_lab.cli", *map(str, args)]
    if args[0] == "run":
        command += ["--notebooks-dir", str(notebooks_dir), "--reports-dir", str(tmp / "reports"),
                    "--runs-dir", str(tmp / "runs")]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    for run_id in ("a", "b"):
        done = lab(tmp, "run", "--notebooks", "01", "--run-id", run_id, "-p", "size", "24", "-p", "batch", "2",
                   "-p", "candidates", CANDIDATES)
        assert done.returncode == 0, done.stderr
    return tmp


def test_same_parameters_give_bitwise_identical_tables(two_runs):
    runs = two_runs / "runs"
    files = result_files(runs / "a")
    assert {"01-fixture-gradients/summary.csv", "01-fixture-gradients/errors.csv",
            "01-fixture-gradients/errors.json"} <= set(files)
    errors = json.loads(files["01-fixture-gradients/errors.json"].read_text())
    assert len(errors) == 3 * 6 and all(row["max_abs_err"] > 0 for row in errors)  # real numbers, not blanks
    assert compare_tables(runs / "a", runs / "b") == ([], len(files))


def test_comparison_notices_a_one_digit_change(two_runs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(two_runs / "runs" / "a", copy)
    table = copy / "01-fixture-gradients" / "errors.csv"
    text = table.read_text()
    last_digit = next(i for i in range(len(text) - 1, 0, -1) if text[i].isdigit())
    table.write_text(text[:last_digit] + str((int(text[last_digit]) + 1) % 10) + text[last_digit + 1:])
    differing, _ = compare_tables(two_runs / "runs" / "a", copy)
    assert differing == ["01-fixture-gradients/errors.csv"]


def test_rerun_repeats_a_run_from_its_provenance(two_runs):
    done = lab(two_runs, "rerun", two_runs / "reports" / "a", "--run-id", "again", "--check")
    assert done.returncode == 0, done.stderr
    assert "bitwise identical to run a" in done.stderr
    provenance = json.loads((two_runs / "reports" / "again" / "provenance.json").read_text())
    earlier = json.loads((two_runs / "reports" / "a" / "provenance.json").read_text())
    assert provenance["rerun_of"] == "a"
    assert provenance["parameters"] == earlier["parameters"]
    assert provenance["notebooks"] == earlier["notebooks"] == ["01-fixture-gradients"]


@pytest.mark.slow
def test_real_notebooks_are_reproducible(quick_run, tmp_path):
    """The suite's notebooks with the quick parameters, a second time beside the suite's shared run (conftest.quick_run):
    every table they write is bitwise identical."""
    if not sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        pytest.skip("notebooks/ holds no notebooks yet")
    first, done = quick_run
    assert done.returncode == 0, done.stderr[-3000:]
    again = lab(tmp_path, "run", "--params", PARAMS_DIR / "quick.yaml", "--run-id", "again",
                notebooks_dir=NOTEBOOKS_DIR, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    differing, compared = compare_tables(first / "runs" / "quick", tmp_path / "runs" / "again")
    assert compared >= 6 and differing == []


def test_timing_columns_are_left_out_but_nothing_else(tmp_path):
    for run, seconds in (("a", "0.25"), ("b", "0.31")):
        folder = tmp_path / run / "05-x"
        folder.mkdir(parents=True)
        (folder / "runs.csv").write_text(f"algorithm,bound_ratio,seconds,time_vs_native\ndirect,0.125,{seconds},{seconds}\n")
        (folder / "runs.json").write_text(json.dumps([{"algorithm": "direct", "bound_ratio": 0.125,
                                                        "seconds": float(seconds)}]))
    assert compare_tables(tmp_path / "a", tmp_path / "b") == ([], 2)
    (tmp_path / "b" / "05-x" / "runs.csv").write_text("algorithm,bound_ratio,seconds,time_vs_native\ndirect,0.126,0.31,0.31\n")
    assert compare_tables(tmp_path / "a", tmp_path / "b") == (["05-x/runs.csv"], 2)
