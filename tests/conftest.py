"""Shared fixtures: small seed problems and their float64 references (computed once per session)."""
import pytest

from precision_lab.problem import make_problem
from precision_lab.reference import reference


@pytest.fixture(scope="session")
def small_problem():
    return make_problem(size=64, batch=2, seed=0)


@pytest.fixture(scope="session")
def small_reference(small_problem):
    return reference(small_problem)


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """The suite's notebooks run once as `make quick` runs them (`precision-lab run --params params/quick.yaml`):
    (folder, finished process); runs/quick/<notebook>/ holds each one's tables, reports/quick/ its pages and the
    executed notebooks. The notebook tests, the report test and the reproducibility test read this one run."""
    import subprocess
    import sys

    from precision_lab.paths import NOTEBOOKS_DIR, PARAMS_DIR, ROOT

    tmp = tmp_path_factory.mktemp("quick")
    done = subprocess.run([sys.executable, "-m", "precision_lab.cli", "run", "--params", str(PARAMS_DIR / "quick.yaml"),
                           "--run-id", "quick", "--notebooks-dir", str(NOTEBOOKS_DIR), "--reports-dir",
                           str(tmp / "reports"), "--runs-dir", str(tmp / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    return tmp, done


@pytest.fixture
def shared_references(monkeypatch):
    """diagnose's float64 references (and the bounds cached on them) built once per problem for every candidate judged
    on it, as a notebook shares them: a trace is never modified (errmodel.error_bounds), so each candidate's diagnosis
    reads what its own would have built."""
    import torch

    from precision_lab import reference as reference_module
    from precision_lab.experiments import _problem_key

    built, build = {}, reference_module.reference

    def shared(problem, device="cpu"):
        key = _problem_key(problem, torch.device(device))
        if key not in built:
            built[key] = build(problem, device)
        return built[key]

    monkeypatch.setattr(reference_module, "reference", shared)
    return built
