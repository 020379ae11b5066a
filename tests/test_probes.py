"""The probes' companions: repeats that catch a race, the layout doctor on a raw Fortran-order buffer, and the precision
fingerprint firing on TF32 but not on legitimate float32 orders (FFT, Winograd)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from precision_lab import conclusions
from precision_lab.candidates import registry, resolve
from precision_lab.diagnosis import diagnose
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python" / "candidate.py"

# A program outside the lab, in the command protocol: the numpy example's forward and backward, then
#   racy  — conv2's weight gradient as 8 partial sums over row bands, one element of it missing one band's
#           partial sum, element and band drawn afresh on every run (an atomic add lost in a race);
#   ohwi  — every response array as a raw little-endian Fortran-order .bin; the weight gradients' bytes hold
#           OHWI (cuDNN-order data) while bundle.json declares the HWIO shape (a Fortran array);
#   good  — the same raw Fortran-order response, written right.
PROGRAM = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, os.environ["EXAMPLE_DIR"])
    import candidate as cnn

    mode, request, response = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    meta = json.loads((request / "bundle.json").read_text())
    layout = meta["weight_layout"]
    with np.load(request / "arrays.npz", allow_pickle=False) as arrays:
        x, t = arrays["input"], arrays["target"]
        params = {n: arrays[n] for n in arrays.files if n.startswith("conv")}
    params = {n: np.transpose(v, [layout.index(c) for c in "OIHW"]) if n.endswith("weight") else v
              for n, v in params.items()}
    if mode == "racy":
        exact, calls = cnn.conv_weight_grad, []
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

        def racy_weight_grad(a, g):
            calls.append(1)
            if len(calls) != 2:  # backprop order: conv3, conv2, conv1
                return exact(a, g)
            bands = np.array_split(np.arange(g.shape[2]), 8)
            partials = []
            for band in bands:
                masked = np.zeros_like(g)
                masked[:, :, band] = g[:, :, band]
                partials.append(exact(a, masked))
            total = sum(partials)
            element = tuple(int(rng.integers(s)) for s in total.shape)
            total[element] -= partials[int(rng.integers(len(partials)))][element]
            return total

        cnn.conv_weight_grad = racy_weight_grad
    loss, output, grads = cnn.forward_backward(x, t, params)
    response.mkdir(parents=True, exist_ok=True)
    out = {"loss": np.asarray(loss, x.dtype), "output": output}
    for name, grad in grads.items():
        out[name + ".grad"] = np.transpose(grad, ["OIHW".index(c) for c in layout]) if name.endswith("weight") else grad
    manifest = {"format": "precision-lab/bundle-1", "kind": "response", "precision": meta["precision"],
                "weight_layout": layout}
    if mode == "racy":
        np.savez(response / "arrays.npz", **out)
    else:
        entries = {}
        for name, value in out.items():
            shape = list(value.shape)
            if mode == "ohwi" and name.endswith("weight.grad"):  # the slip: OHWI data in the HWIO-shaped array
                value = np.transpose(grads[name[:-len(".grad")]], (0, 2, 3, 1))
            value.ravel(order="F").astype("<" + value.dtype.str[1:]).tofile(response / (name + ".bin"))
            entries[name] = {"file": name + ".bin", "dtype": value.dtype.name, "shape": shape, "order": "F"}
        manifest["arrays"] = entries
    (response / "bundle.json").write_text(json.dumps(manifest))
''')


def _candidate(folder: Path, mode: str):
    (folder / "program.py").write_text(PROGRAM)
    spec = {"name": f"program-{mode}", "command": ["{python}", "program.py", mode, "{request}", "{response}"],
            "precision": "float32", "weight_layout": "HWIO", "timeout_s": 60,
            "env": {"EXAMPLE_DIR": str(EXAMPLE.parent)}}
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return resolve(str(path))


@pytest.fixture(scope="module")
def problem():
    return make_problem((20, 28), 2, seed=3)  # non-square, as the probes are


# ---------------------------------------------------------------------------------------------
# repeats


def test_repeats_name_a_race_that_loses_updates(tmp_path, problem):
    diagnosis = diagnose(_candidate(tmp_path, "racy"), problem, "cpu", probes=[], repeats=3)
    spread = diagnosis.repeats
    assert spread["runs"] == 3 and not spread["bitwise_reproducible"]
    assert spread["worst_quantity"] == "conv2.weight" and spread["worst_spread_ratio"] > 10
    # only the raced gradient differs from run to run: every other quantity is bitwise reproducible
    assert all(entry["identical"] for name, entry in spread["quantities"].items() if name != "conv2.weight")
    q = diagnosis.quantities["conv2.weight"]
    assert diagnosis.verdict == "defect" and q.verdict == "defect"
    assert q.cause == "run-to-run spread beyond the bound (a race that loses updates)"
    assert "runs differ by" in q.evidence
    text = diagnosis.to_text()
    assert "repeats: 3 runs, largest run-to-run spread ÷ bound" in text and "(conv2.weight)" in text
    assert diagnosis.to_json()["repeats"]["worst_quantity"] == "conv2.weight"


def test_repeats_of_a_deterministic_program_are_roundoff_with_no_spread(tmp_path, problem):
    diagnosis = diagnose(resolve(str(EXAMPLE.with_suffix(".yaml"))), problem, "cpu", probes=[], repeats=3)
    assert diagnosis.verdict == "roundoff"
    assert diagnosis.repeats["bitwise_reproducible"] and diagnosis.repeats["worst_spread_ratio"] == 0.0
    assert all(entry["max_spread"] == 0.0 for entry in diagnosis.repeats["quantities"].values())
    assert "bitwise reproducible" in diagnosis.to_text()


# ---------------------------------------------------------------------------------------------
# the layout doctor, by buffer


def test_raw_fortran_buffer_holding_ohwi_is_named_with_its_fix(tmp_path, problem):
    diagnosis = diagnose(_candidate(tmp_path, "ohwi"), problem, "cpu", probes=[])
    assert diagnosis.verdict == "layout"
    assert diagnosis.main.layout_fix == "layout OHWI"  # named in the program's own (Fortran) index order
    for name in ("conv1.weight", "conv2.weight"):
        assert diagnosis.quantities[name].verdict == "layout", name
    # conv3 has one output channel: OHWI and HWIO hold the same bytes in Fortran order, nothing to fix
    for name in ("conv3.weight", "conv1.bias", "conv2.bias", "conv3.bias", "loss", "output"):
        assert diagnosis.quantities[name].verdict == "roundoff", name
    advice = diagnosis.to_json()["layout_advice"]
    assert "holds OHWI but is declared HWIO (Fortran (column-major) order)" in advice
    assert advice.startswith("conv1.weight.grad, conv2.weight.grad: each holds OHWI")  # both slipped buffers
    assert "transpose each to HWIO before writing" in advice
    # re-declaring weight_layout would also change how the request's weights are written: not an equivalent fix
    assert "declare" not in advice.replace("is declared", "")
    assert "weight_layout" not in conclusions.from_judgement(diagnosis.main).html()


def test_the_fix_names_every_gradient_it_applies_to(problem):
    diagnosis = diagnose(resolve("fortran-replay-flip"), problem, "cpu", probes=[])
    flipped = [name for name, q in diagnosis.quantities.items() if q.layout_fix == "flip HW"]
    assert len(flipped) == 3  # all three weight gradients are reversed, not only the worst one
    advice = diagnosis.to_json()["layout_advice"]
    assert all(f"{name}.grad" in advice.split(":")[0] for name in flipped), advice
    assert "each is reversed along H and W: flip H and W before writing" in advice


def test_raw_fortran_buffer_written_right_is_roundoff(tmp_path, problem):
    diagnosis = diagnose(_candidate(tmp_path, "good"), problem, "cpu", probes=[])
    assert diagnosis.verdict == "roundoff" and diagnosis.main.layout_advice is None


# ---------------------------------------------------------------------------------------------
# the precision fingerprint


@pytest.fixture(scope="module")
def probe_problem():
    problem = make_problem((33, 47), 2, seed=0)  # a probe's size: the fingerprint runs there
    return problem, reference(problem)


@pytest.mark.parametrize("name", ["conv-fft", "conv-winograd-f2x3", "conv-winograd-f4x3"])
def test_fingerprint_stays_silent_on_legitimate_float32_orders(probe_problem, name):
    problem, trace = probe_problem
    candidate = registry()[name]
    judgement = judge(candidate.compute(problem), trace, "float32", name, fingerprint=True)
    assert len(judgement.fingerprint) > 20  # computed, per format, pass and quantity
    assert not any(row["conclusive"] for row in judgement.fingerprint)
    assert max(row["correlation"] for row in judgement.fingerprint) < 0.8  # FINGERPRINT_MIN is 0.95
    assert judgement.verdict == "roundoff" and judgement.format is None
    assert all(q.format is None for q in judgement.quantities.values())


def test_fingerprint_names_tf32_claimed_as_float32(probe_problem):
    problem, trace = probe_problem
    judgement = judge(registry()["tf32-weight-grad-only"].compute(problem), trace, "float32", "tf32", fingerprint=True)
    assert judgement.verdict == "reduced-precision" and judgement.format == "tf32"
    named = [row for row in judgement.fingerprint if row["conclusive"]]
    assert named and {row["format"] for row in named} == {"tf32"}
    assert all(row["correlation"] > row["null"] + 0.5 for row in named)  # far above the legitimate orders


def test_fingerprint_names_tf32_inside_a_float32_bound_that_is_not_sampled():
    """Above sampled.ELEMENT_LIMIT the bound is |W|·E alone and TF32's weight-gradient error hides inside it
    (at a probe's size the sampled bound is tight enough to show it by level): the fingerprint still names it."""
    from precision_lab import sampled

    problem = make_problem((130, 130), 4, seed=0)  # 4·130² image elements > 4·128²
    trace = reference(problem)
    assert not sampled.applies(trace, "float32")
    judgement = judge(registry()["tf32-weight-grad-only"].compute(problem), trace, "float32", "tf32", fingerprint=True)
    assert judgement.verdict == "reduced-precision" and judgement.format == "tf32"
    inside = [q for q in judgement.quantities.values() if q.format == "tf32" and q.bound_ratio <= 1.0]
    assert inside and all("inside the float32 bound" in q.evidence and "legitimate float32 orders reach" in q.evidence
                          for q in inside)


def test_fingerprint_null_of_a_tf32_claim_holds_tf32_itself():
    # measured false alarm (benchmarks/sensitivity.py, probe odd-33x47-batch3, seed 36): honest TF32 read as
    # bfloat16 at r = 0.961 with float32 orders alone in the null, since both formats flip the same ReLU
    import torch

    from precision_lab.device import torch_threads
    from precision_lab.doctors.formats import FINGERPRINT_THREADS

    problem = make_problem((33, 47), 3, seed=36)
    trace = reference(problem)
    with torch_threads(torch.device("cpu"), FINGERPRINT_THREADS):  # the null's own run, to the bit
        claimed = registry()["tf32-claimed"].compute(problem)
    honest = judge(claimed, trace, "tf32", "tf32-claimed", fingerprint=True)
    # within its sampled bound, which certifies it: roundoff, no format named
    assert honest.verdict == "roundoff" and honest.format is None
    bf16 = [row for row in honest.fingerprint if row["format"] == "bfloat16" and row["quantity"] == "conv2.weight"]
    assert max(row["correlation"] for row in bf16) > 0.9  # the shared flip is still there ...
    assert all(row["null"] >= row["correlation"] - 1e-12 for row in bf16)  # ... and the null holds it
    coarser = judge(registry()["bf16-emulated"].compute(problem), trace, "tf32", "bf16", fingerprint=True)
    assert coarser.verdict == "reduced-precision" and coarser.format == "bfloat16"


def test_defect_doctor_names_a_skipped_interior_tile():
    # a weight-gradient kernel that never adds one 16×16 tile of conv2's upstream gradient (rows, columns 16–31)
    from precision_lab.ops import BackwardReplaced
    from precision_lab.compute import forward_backward
    from precision_lab.ops import OPS

    def tile_skipped(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        clipped = g.clone()
        clipped[:, :, 16:32, 16:32] = 0
        param_grads["weight"] = kernels.conv_weight_grad(xs[0], clipped, attrs, tuple(params["weight"].shape))
        return grads, param_grads

    problem = make_problem((61, 67), 2, seed=0)  # the odd-61x67 probe's problem
    result = forward_backward(problem, "float32", rules={2: BackwardReplaced(OPS["conv2d"], tile_skipped)})
    judgement = judge(result, reference(problem), "float32", "tile-skipped")
    assert judgement.verdict == "defect" and judgement.quantities["conv2.weight"].verdict == "defect"
    assert judgement.cause == "conv2: the 16×16 tile at rows 16–31, columns 16–31 of its upstream gradient skipped"
    assert judgement.quantities["conv2.bias"].verdict == "roundoff"  # the bias sum kept the tile
