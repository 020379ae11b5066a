"""`precision-lab diagnose`: built-ins, static bundles (npz and raw Fortran order), JSON, exit codes."""
import json

import pytest

from precision_lab import cli
from precision_lab.bundle import write_static
from precision_lab.candidates import registry
from precision_lab.problem import make_problem

SIZE = "32"


def run(capsys, *argv):
    code = cli.main(["diagnose", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layout_slip_exits_1_and_names_the_transform(tmp_path, capsys):
    out_json = tmp_path / "verdict.json"
    code, out, _ = run(capsys, "--candidate", "builtin:fortran-replay-flip", "--size", SIZE, "--device", "cpu",
                       "--json", str(out_json))
    assert code == 1 and "verdict: layout (flip HW)" in out
    verdict = json.loads(out_json.read_text())
    assert verdict["candidate"] == "fortran-replay-flip" and verdict["verdict"] == "layout"
    assert verdict["claimed_precision"] == "float32"
    weight = verdict["parameters"]["conv2.weight"]
    assert weight["verdict"] == "layout" and weight["layout_fix"] == "flip HW" and weight["bound_ratio"] > 1
    assert verdict["parameters"]["conv2.bias"]["verdict"] == "roundoff"


def test_legitimate_variant_exits_0(capsys):
    code, out, _ = run(capsys, "--candidate", "sum-pairwise", "--size", SIZE, "--batch", "1", "--seed", "3")
    assert code == 0 and "verdict: roundoff" in out and "32×32, batch 1, seed 3" in out


@pytest.mark.parametrize("raw", [False, True])
def test_static_bundle_from_the_motivating_replay_says_layout(tmp_path, capsys, raw):
    problem = make_problem(32, 2, 5)
    replay = registry()["fortran-replay-flip"]
    bundle = write_static(problem, replay.compute(problem), tmp_path / "replay", "float32", "HWIO", raw=raw)
    code, out, err = run(capsys, "--bundle", str(bundle), "--size", "64")
    assert code == 1 and "verdict: layout (flip HW)" in out and "32×32" in out
    assert "carries its own problem" in err


def test_static_bundle_of_a_correct_program_exits_0(tmp_path, capsys):
    problem = make_problem(32, 1, 2)
    bundle = write_static(problem, registry()["fortran-replay"].compute(problem), tmp_path / "ok", "float32", "HWIO")
    code, out, _ = run(capsys, "--bundle", str(bundle))
    assert code == 0, out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = run(capsys, "--bundle", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "missing" in err and "Traceback" not in err
    code, _, err = run(capsys, "--candidate", "no-such-candidate", "--size", SIZE)
    assert code == 2 and "unknown built-in candidate 'no-such-candidate'" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bundle.json").write_text("{not json")
    code, _, err = run(capsys, "--bundle", str(broken))
    assert code == 2 and "bundle.json" in err and err.count("\n") == 1
    code, _, err = run(capsys, "--candidate", "native", "--size", "3")
    assert code == 2 and "size" in err


def test_unwritable_json_is_bad_input(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(capsys, "--candidate", "native", "--size", SIZE, "--json", str(blocker / "v.json"))
    assert code == 2 and "cannot write the JSON verdict" in err


def test_motivating_case_replay_names_the_flip_and_reproduces_the_pattern():
    import numpy as np

    from precision_lab.experiments import motivating, setup

    device, problem = setup("cpu", 48, 2, 0)
    table, judgements = motivating.replay(problem, device)
    slip, faithful = judgements[motivating.REPLAY_SLIP].judgement(), judgements[motivating.REPLAY].judgement()
    assert slip.verdict == "layout" and slip.layout_fix == "flip HW" and faithful.verdict == "roundoff"
    assert len(judgements[motivating.REPLAY].probes) == 3  # judged with diagnose's probes
    rows = table.set_index("quantity")
    weights = rows.loc[["conv1.weight", "conv2.weight", "conv3.weight"]]
    biases = rows.loc[["conv1.bias", "conv2.bias", "conv3.bias"]]
    # the seed's pattern: weight gradients off by ~1e-2 while biases agree to rounding
    assert (weights[f"{motivating.REPLAY_SLIP}_max_abs"] > 1e-3).all()
    assert (biases[f"{motivating.REPLAY_SLIP}_max_abs"] < 1e-6).all()
    assert (weights[f"{motivating.REPLAY}_max_abs"] < 1e-6).all()
    summary = motivating.summarise(table, judgements)
    assert list(summary.columns[:4]) == ["candidate", "experiment", "verdict", "headline"]
    assert np.isfinite(motivating.magnitude_agreement(table).iloc[1:]).all()


def test_the_overall_cause_comes_from_the_first_problem_that_names_one():
    """At 1024² on a CPU the defect doctor's recomputations are skipped (doctors.RECOMPUTE_LIMIT): the requested
    problem says only where the failure starts, and the probe that names the cause must be the one quoted."""
    from types import SimpleNamespace

    from precision_lab.decision import Diagnosis

    def judged(verdict, cause=None, localisation=None):
        return SimpleNamespace(verdict=verdict, layout_fix=None, format=None, cause=cause, localisation=localisation)

    main = judged("defect", localisation="first failing quantity in backprop order: mid.weight")
    probe = judged("defect", cause="up backward takes each block's first gradient instead of their sum")
    diagnosis = Diagnosis(main, [(SimpleNamespace(name="odd-61x67"), judged("roundoff")),
                                 (SimpleNamespace(name="odd-33x47-batch3"), probe)])
    assert diagnosis.deciding() is probe
    named = Diagnosis(judged("defect", cause="scaled by 2"), [(SimpleNamespace(name="p"), probe)])
    assert named.deciding() is named.main  # the requested problem first when it names one
    unnamed = Diagnosis(main, [(SimpleNamespace(name="p"), judged("defect"))])
    assert unnamed.deciding() is main
