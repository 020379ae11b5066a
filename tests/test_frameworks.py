"""The framework examples (examples/frameworks/): each real framework's candidate on the protocol API.

Each runs when its framework is importable and is skipped with the reason otherwise; `make test`
installs JAX's CPU build (the `test` extra), so that path runs on every commit.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml

from precision_lab import cli

FRAMEWORKS = Path(__file__).resolve().parents[1] / "examples" / "frameworks"
SIZE = "12"


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install {module})")


def _needs_tinygrad():
    # tinygrad's CPU backend compiles with clang; its compiler-free DEV=PYTHON takes minutes a call (measured:
    # 2 min for the seed CNN at 16×16, float32 build only, on 2 shared cores)
    return [_needs("tinygrad"), pytest.mark.skipif(shutil.which("clang") is None,
                                                   reason="tinygrad's DEV=CPU backend needs clang (apt-get install clang)")]


def _candidate(tmp_path: Path, name: str, model: dict | None = None) -> Path:
    """The example's YAML, its program and model made absolute (or the model replaced by `model`)."""
    spec = yaml.safe_load((FRAMEWORKS / name).read_text())
    for key in ("command", "command_float64"):
        spec[key] = [str(FRAMEWORKS / arg) if (FRAMEWORKS / arg).is_file() else arg for arg in spec[key]]
    if "model" in spec:
        spec["model"] = model or str(FRAMEWORKS / spec["model"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


CASES = [
    pytest.param("jax.yaml", 0, "\nverdict: roundoff", marks=_needs("jax")),
    pytest.param("jax-slip.yaml", 1, "\nverdict: layout (layout HWIO)", marks=_needs("jax")),
    pytest.param("jax-same.yaml", 0, "\nverdict: roundoff", marks=_needs("jax")),
    pytest.param("jax-dncnn-bn.yaml", 0, "\nverdict: roundoff", marks=_needs("jax")),
    pytest.param("jax-dncnn-bn-slip.yaml", 1, "\nverdict: defect (every batch norm backward treats the batch statistics "
                 "as constants", marks=_needs("jax")),
    pytest.param("tensorflow.yaml", 0, "\nverdict: roundoff", marks=_needs("tensorflow")),
    pytest.param("tensorflow-slip.yaml", 1, "\nverdict: layout (layout HWIO)", marks=_needs("tensorflow")),
    pytest.param("tensorflow-same.yaml", 0, "\nverdict: roundoff", marks=_needs("tensorflow")),
    pytest.param("tinygrad.yaml", 0, "\nverdict: roundoff", marks=_needs_tinygrad()),
    pytest.param("tinygrad-slip.yaml", 1, "\nverdict: layout (layout OIHW)", marks=_needs_tinygrad()),
    pytest.param("tinygrad-same.yaml", 0, "\nverdict: roundoff", marks=_needs_tinygrad()),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,code,line", CASES)
def test_framework_example_gets_its_verdict(tmp_path, capsys, name, code, line):
    out = tmp_path / "verdict.json"
    size = "8" if "same" in name else SIZE  # the classifier takes 8×8 only
    assert cli.main(["diagnose", "--candidate", str(_candidate(tmp_path, name)), "--size", size, "--batch", "2",
                     "--probes", "none", "--json", str(out)]) == code, capsys.readouterr()
    assert line in capsys.readouterr().out
    assert json.loads(out.read_text())["verdict"] == line.split(": ")[1].split(" ")[0]


@pytest.mark.parametrize("script", sorted(p.name for p in FRAMEWORKS.glob("*.py")))
def test_framework_candidates_fit_in_twenty_lines(script):
    """The point of the protocol API: a framework candidate is its model and nothing else."""
    text = (FRAMEWORKS / script).read_text()
    body = text.split('"""', 2)[2]  # without the module docstring
    code = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 20, f"{script}: {len(code)} lines of code"


@pytest.mark.slow
@_needs("jax")
def test_the_average_pools_divisor_is_part_of_the_spec(tmp_path, capsys):
    """The JAX pool divides by the in-bounds count: described with PyTorch's default (k², padding counted),
    the same right program is a defect; so the flag is what lets it be judged `roundoff` above."""
    spec = json.loads((FRAMEWORKS / "tf-same-classifier.json").read_text())
    pool = next(layer for layer in spec["layers"] if layer["op"] == "avg_pool2d")
    pool["count_include_pad"] = True
    code = cli.main(["diagnose", "--candidate", str(_candidate(tmp_path, "jax-same.yaml", spec)), "--probes", "none"])
    assert code == 1 and "\nverdict: defect" in capsys.readouterr().out
