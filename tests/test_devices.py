"""The GPU path: every tensor follows the problem's device.

Parametrised over the devices present (`cpu` always, `cuda` when available), so the same tests
exercise the GPU on a GPU machine and stay green on CI. On any machine, a diagnosis run with
PyTorch's default device set to `meta` proves that the pipeline creates no tensor without naming
its device: such a tensor would land on `meta` and fail the first time it meets the problem's.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from precision_lab import errmodel
from precision_lab.cli import main
from precision_lab.diagnosis import candidate_and_problem, diagnose
from precision_lab.paths import ROOT
from precision_lab.problem import make_problem
from precision_lab.reference import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SIZE = (24, 28)  # non-square: rows and columns cannot be swapped unnoticed


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def implicit_tensors_on_meta():
    """Any tensor created without a device lands on `meta`, where arithmetic with real data fails."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("name, verdict", [
    ("native", "roundoff"), ("fortran-replay-flip", "layout"), ("tf32-emulated", "reduced-precision"),
    ("conv-fft", "roundoff"), ("split-k", "roundoff"), ("relu-mask-missing", "defect"),
    ("first-column-skipped", "defect"),
])
def test_a_diagnosis_makes_no_tensor_off_the_problem_device(name, verdict, device):
    candidate, problem = candidate_and_problem(f"builtin:{name}", None, size=SIZE, batch=2, seed=0)
    torch.set_default_device("meta")
    try:
        diagnosis = diagnose(candidate, problem, device=str(device))
    finally:
        torch.set_default_device(None)
    assert diagnosis.verdict == verdict
    assert len(diagnosis.probes) == 3  # the probes ran under the same rule


def test_a_spec_network_makes_no_tensor_off_the_problem_device(device, implicit_tensors_on_meta):
    candidate, problem = candidate_and_problem("builtin:upsample-backward-first-only", None, size=(32, 48), batch=2,
                                               seed=0, model=str(ROOT / "examples" / "models" / "small-unet.json"))
    diagnosis = diagnose(candidate, problem, device=str(device), probes=[])
    assert diagnosis.verdict == "defect"


def test_reference_and_bounds_follow_the_device(device):
    problem = make_problem(SIZE, 2, 3)
    trace = reference(problem, device)
    assert trace.device.type == device.type
    assert all(t.device.type == device.type for t in trace.params.values())
    on_device = errmodel.error_bounds(trace, "float32")
    on_cpu = errmodel.error_bounds(reference(problem, "cpu"), "float32")
    for name, bound in on_cpu.items():
        got = np.asarray(on_device[name].bound)
        assert isinstance(on_device[name].bound, np.ndarray)  # the arrays leave the device once, at the end
        # float64 on another device sums in another order: bounds agree to float64 rounding
        np.testing.assert_allclose(got, bound.bound, rtol=1e-9, atol=0)
    cpu_grads = reference(problem, "cpu").grads
    for name, grad in trace.grads.items():
        np.testing.assert_allclose(np.asarray(grad), np.asarray(cpu_grads[name]), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name, verdict, detail", [
    ("native", "roundoff", None), ("fortran-replay-flip", "layout", "flip HW"),
    ("native-tf32", "reduced-precision", "tf32"), ("native-benchmark", "roundoff", None),
    ("native-deterministic", "roundoff", None),
])
def test_the_device_candidates_get_their_verdicts(name, verdict, detail, device):
    candidate, problem = candidate_and_problem(f"builtin:{name}", None, size=(64, 72), batch=2, seed=0)
    if not candidate.supports(device):
        pytest.skip(f"{name} runs on {', '.join(candidate.devices)} only")
    diagnosis = diagnose(candidate, problem, device=str(device), probes=[])
    found = diagnosis.to_json()
    if name == "native-tf32" and diagnosis.verdict == "roundoff":
        # inside the float32 bound at this size: the fingerprint must still name the format (docs/design.md, "Explaining a verdict")
        assert found["format"] and "tf32" in found["format"]
        return
    assert diagnosis.verdict == verdict
    if detail:
        assert detail in (found["layout_fix"] or found["format"] or "")


@pytest.mark.parametrize("yaml_name, verdict", [("candidate.yaml", "roundoff")])
def test_a_command_candidate_gets_the_same_verdict_on_every_device(yaml_name, verdict, tmp_path, capsys):
    verdicts = {}
    for where in DEVICES:
        out = tmp_path / f"{where}.json"
        code = main(["diagnose", "--candidate", str(ROOT / "examples" / "python" / yaml_name), "--size", "24x28",
                     "--batch", "2", "--device", where, "--probes", "none", "--json", str(out)])
        verdicts[where] = (code, json.loads(out.read_text())["verdict"])
    capsys.readouterr()
    assert set(verdicts.values()) == {(0, verdict)}


def test_a_bundle_gets_the_same_verdict_on_the_device_as_on_the_cpu(device, tmp_path, capsys):
    from precision_lab.candidates import get_builtin
    from precision_lab.bundle import write_static

    problem = make_problem(SIZE, 2, 0)
    result = get_builtin("fortran-replay-flip").compute(problem, "float32", torch.device("cpu"))
    write_static(problem, result, tmp_path / "flip", "float32", "HWIO")
    verdicts = []
    for index, where in enumerate(("cpu", str(device))):
        assert main(["diagnose", "--bundle", str(tmp_path / "flip"), "--device", where,
                     "--json", str(tmp_path / f"{index}.json")]) == 1
        verdicts.append(json.loads((tmp_path / f"{index}.json").read_text())["layout_fix"])
    capsys.readouterr()
    assert verdicts[0] == verdicts[1] and "flip" in verdicts[0]


def test_export_computes_its_reference_on_the_device(device, tmp_path, capsys):
    for folder, where in (("cpu", "cpu"), ("device", str(device))):
        assert main(["export", "--size", "20x24", "--batch", "1", "--device", where,
                     "--out", str(tmp_path / folder)]) == 0
    capsys.readouterr()
    cpu = np.load(tmp_path / "cpu" / "reference" / "arrays.npz")
    here = np.load(tmp_path / "device" / "reference" / "arrays.npz")
    assert set(cpu.files) == set(here.files)
    for name in cpu.files:
        np.testing.assert_allclose(here[name], cpu[name], rtol=1e-9, atol=1e-15)


def test_bench_runs_on_the_device_it_is_given(device, capsys):
    assert main(["bench", "--size", "24", "--batch", "1", "--repeats", "1", "--device", str(device),
                 "--only", "reference", "--only", "bounds"]) == 0
    out = capsys.readouterr().out
    assert f"on {device.type}" in out and "float64 reference ÷ float32 native forward+backward" in out


def test_an_absent_gpu_is_one_line_exit_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["diagnose", "--candidate", "builtin:native", "--size", "16", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no CUDA GPU" in err


def test_the_notebooks_experiments_make_no_tensor_off_the_device(device, implicit_tensors_on_meta):
    from precision_lab.experiments import algorithms, candidates_for, float64_recompilation, motivating
    from precision_lab.experiments import optimizer_step, size_sweep

    problem = make_problem((20, 24), 2, 0)
    candidates, _ = candidates_for(["native", "fortran-replay-flip"], device)
    table, judgements = optimizer_step.single_step(problem, candidates, device)
    assert judgements["fortran-replay-flip"].verdict == "layout" and len(table)
    traj = optimizer_step.trajectories(problem, candidates[:1], candidates[:1], device, steps=2)
    assert traj["step"].max() == 2
    table, decisions, _ = float64_recompilation.recompilation_table(problem, candidates, device)
    assert decisions["native"].verdict == "roundoff"
    assert len(size_sweep.sweep([16, 24], candidates[:1], device)[0]) > 0
    assert len(size_sweep.noise_floor_at(16, device, ["sum-pairwise", "sum-sequential", "sum-blocked", "split-k",
                                                      "micro-batched"])) > 0
    table, decisions = algorithms.sweep([16], ["direct", "fft"], device)
    assert set(table["verdict"]) == {"roundoff"} and {d.verdict for d in decisions.values()} == {"roundoff"}
    _, judgements = motivating.replay(make_problem(24, 2, 0), device)
    assert any(j.verdict == "layout" for j in judgements.values())


def test_float32_means_ieee_float32_whatever_the_global_flags():
    """cuDNN's default lets float32 convolutions run in TF32: on an H200 every built-in candidate but `native` ran
    TF32 (the right Fortran replay read `reduced-precision (tf32)`, split-k too), and so did the fingerprint's
    float32 emulation. A candidate and every float32 walk pin IEEE; only a run that asks for TF32 gets it."""
    from precision_lab.candidates import Candidate, get_builtin
    from precision_lab.compute import forward_backward
    from precision_lab.conv.backends import current_flags, native_flags
    from precision_lab.ops import LOSSES

    def precision_now():
        flags = current_flags()
        return flags.get("cudnn.conv.fp32_precision", "tf32" if flags.get("cudnn.allow_tf32") else "ieee")

    seen = {}

    class RecordingLoss:
        def forward_backward(self, output, target):
            seen["walk"] = precision_now()
            return LOSSES["mse"].forward_backward(output, target)

    def run(problem, precision, device):
        seen["candidate"] = precision_now()
        return forward_backward(problem, precision, device)

    problem = make_problem(SIZE, 2, 0)
    with native_flags(fp32_precision="tf32"):  # PyTorch's default for cuDNN convolutions
        Candidate("recording", "records the float32 precision it runs in", run).compute(problem)
        forward_backward(problem, "float32", "cpu", rules={"loss": RecordingLoss()})
        assert precision_now() == "tf32"  # restored for the caller
        native_tf32 = get_builtin("native-tf32").compute(problem) if torch.cuda.is_available() else None
    assert seen == {"candidate": "ieee", "walk": "ieee"}
    if native_tf32 is not None:
        assert native_tf32.meta["fp32_precision"] == "tf32"
