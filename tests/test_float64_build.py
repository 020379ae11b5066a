"""`diagnose` runs a command candidate's `command_float64`: the float64 build against the float64 reference and
err64 ÷ err32 per quantity, so an error inside the float32 bound that does not shrink in float64 is a defect."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from precision_lab import cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python"
# the numpy example, with conv3's bias gradient scaled by 1 + 1e-6 in both builds when asked: a bug of
# ~17 float32 ulps, inside the float32 bound of that 288-term sum, but a million times float64's rounding
PROGRAM = textwrap.dedent('''
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[4])
    import candidate
    candidate.main(sys.argv[1], sys.argv[2])
    if sys.argv[3] == "scaled":
        path = sys.argv[2] + "/arrays.npz"
        with np.load(path) as data:
            arrays = dict(data)
        grad = arrays["conv3.bias.grad"]
        arrays["conv3.bias.grad"] = (grad * (1 + 1e-6)).astype(grad.dtype)
        np.savez(path, **arrays)
''')


def _candidate(tmp_path: Path, mode: str) -> Path:
    (tmp_path / "program.py").write_text(PROGRAM)
    argv = f'["{{python}}", program.py, "{{request}}", "{{response}}", {mode}, "{EXAMPLE}"]'
    (tmp_path / "c.yaml").write_text(f"name: numpy-{mode}\ncommand: {argv}\ncommand_float64: {argv}\n"
                                     f"precision: float32\nweight_layout: HWIO\n")
    return tmp_path / "c.yaml"


@pytest.mark.parametrize("mode,code", [("right", 0), ("scaled", 1)])
def test_float64_build_ratio_separates_rounding_from_a_small_bug(tmp_path, capsys, mode, code):
    out = tmp_path / "v.json"
    assert cli.main(["diagnose", "--candidate", str(_candidate(tmp_path, mode)), "--size", "12",
                     "--probes", "none", "--json", str(out)]) == code
    text = capsys.readouterr().out
    verdict = json.loads(out.read_text())
    build = verdict["float64_build"]
    ratio = build["quantities"]["conv3.bias"]["ratio"]
    assert "err64 ÷ err32" in text and verdict["parameters"]["conv3.bias"]["float64_build"]["ratio"] == ratio
    if mode == "right":
        assert ratio < 1e-6 and build["persists"] == [] and verdict["verdict"] == "roundoff"
    else:
        # the float32 bound alone passes it; the float64 build shows it is not rounding
        assert verdict["main"]["parameters"]["conv3.bias"]["bound_ratio"] < 1
        assert ratio > 0.1 and build["persists"] == ["conv3.bias"] and verdict["verdict"] == "defect"
        assert "persists in the float64 build" in verdict["parameters"]["conv3.bias"]["cause"]


def test_every_notebook_reads_a_programs_float64_build_as_diagnose_does(tmp_path):
    """A program with `command_float64` whose bug hides inside the float32 bound: `diagnose` says defect from its
    float64 build; so must the experiments that run no float64 build of their own (01 through decide_all, 03)."""
    import torch

    from precision_lab.candidates import resolve
    from precision_lab.diagnosis import diagnose
    from precision_lab.experiments import decide_all, optimizer_step, size_sweep
    from precision_lab.problem import make_problem

    candidate = resolve(str(_candidate(tmp_path, "scaled")))
    problem = make_problem(12, 2, 0)
    cpu = torch.device("cpu")
    expected = diagnose(candidate, problem, "cpu", probes=[])
    assert expected.verdict == "defect" and expected.float64_build is not None
    _, judgements = optimizer_step.single_step(problem, [candidate], cpu)
    assert judgements[candidate.name].verdict == "roundoff"  # the float32 bound alone passes it
    decided = decide_all(problem, [candidate], cpu, judgements, probes="none")[candidate.name]
    assert decided.verdict == "defect" and decided.float64_build.persists == ["conv3.bias"]
    _, swept = size_sweep.sweep([12], [candidate], cpu, probes="none")
    assert swept[candidate.name].verdict == "defect"


def test_the_float64_build_run_beside_the_claimed_one_gives_the_numbers_it_gives_alone(tmp_path):
    """diagnose starts the float64 build beside the claimed one and bounds both claims while they run: the evidence is
    the one the builds give one after the other, to the last bit."""
    import torch

    from precision_lab.candidates import resolve
    from precision_lab.diagnosis import diagnose, float64_build_evidence
    from precision_lab.problem import make_problem
    from precision_lab.reference import reference

    candidate = resolve(str(_candidate(tmp_path, "scaled")))
    problem = make_problem(12, 2, 0)
    beside = diagnose(candidate, problem, "cpu", probes=[]).float64_build
    cpu = torch.device("cpu")
    alone = float64_build_evidence(candidate, problem, cpu, candidate.compute(problem, "float32", cpu),
                                   reference(problem, cpu))
    assert beside.quantities == alone.quantities
    assert beside.verdict == alone.verdict == "defect"  # the bug is in both builds: beyond float64 rounding too
    assert beside.persists == ["conv3.bias"]
