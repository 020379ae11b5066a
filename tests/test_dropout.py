"""A training-mode dropout with the mask the request carries: drawn by the lab from the seed, applied by the
float64 reference, the built-in PyTorch candidates, command candidates and protocol users alike; its rounding
bound, its reading from PyTorch modules, and the slips a port makes, each planted and named."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from precision_lab import protocol
from precision_lab.bundle import problem_from_bundle, read_bundle, write_request
from precision_lab.candidates import get_builtin, resolve
from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import ModelSpecError, parse_spec
from precision_lab.modules import from_module
from precision_lab.ops import OPS, BoundContext, Field, Kernels, SharedDraw
from precision_lab.ops.dropout import gamma2
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

ROOT = Path(__file__).resolve().parents[1]
U32 = 2.0 ** -24


def _spec(p=0.1, training=True):
    return {"input_channels": 1, "loss": "mse", "name": "drop-net", "layers": [
        {"name": "conv1", "op": "conv2d", "in": 1, "out": 8, "kernel": 3, "padding": 1},
        {"name": "act1", "op": "relu"},
        {"name": "drop", "op": "dropout", "p": p, "training": training},
        {"name": "conv2", "op": "conv2d", "in": 8, "out": 1, "kernel": 3, "padding": 1}]}


NETWORK = parse_spec(_spec())
DROP = 2  # the dropout's layer index


# ---------------------------------------------------------------------------------------------
# the spec and the mask


def test_evaluation_dropout_is_the_identity_and_carries_no_mask():
    network = parse_spec(_spec(training=False))
    assert network.layers[DROP].attrs == {"p": 0.1, "training": False}
    assert network.mask_names == () and make_problem(16, 2, 0, network=network).masks == {}


def test_a_training_dropout_needs_a_name_and_a_boolean():
    spec = _spec()
    del spec["layers"][DROP]["name"]
    with pytest.raises(ModelSpecError, match="needs a unique 'name'.*'<name>.mask'"):
        parse_spec(spec)
    spec = _spec()
    spec["layers"][DROP]["training"] = "yes"
    with pytest.raises(ModelSpecError, match="'training' is 'yes'"):
        parse_spec(spec)


def test_the_mask_is_drawn_from_the_seed_bernoulli_one_minus_p():
    problem = make_problem(16, 2, 0, network=NETWORK)
    mask = problem.masks["drop.mask"]
    assert NETWORK.mask_names == ("drop.mask",) and mask.shape == (2, 8, 16, 16) and mask.dtype == np.float32
    assert set(np.unique(mask)) == {0.0, 1.0}
    # kept fraction of 4096 Bernoulli(0.9) draws: within 5 standard deviations √(0.9·0.1/4096) = 0.0047
    assert abs(mask.mean() - 0.9) < 5 * math.sqrt(0.09 / mask.size)
    assert np.array_equal(make_problem(16, 2, 0, network=NETWORK).masks["drop.mask"], mask)
    assert not np.array_equal(make_problem(16, 2, 1, network=NETWORK).masks["drop.mask"], mask)
    # the two samples draw different masks; a micro-batch keeps its own sample's
    assert not np.array_equal(mask[0], mask[1])
    assert np.array_equal(problem.with_batch(1, 2).masks["drop.mask"], mask[1:2])


def test_the_walk_applies_the_mask_and_agrees_with_autograd():
    problem = make_problem(16, 2, 0, network=NETWORK)
    walked = forward_backward(problem, "float64", intermediates=True)
    before, after = walked.intermediates["act1.output"], walked.intermediates["drop.output"]
    mask = problem.masks["drop.mask"]
    assert np.array_equal(after, before * mask * (1 / 0.9))
    grad_after, grad_before = walked.intermediates["drop.output.grad"], walked.intermediates["act1.output.grad"]
    assert np.array_equal(grad_before, grad_after * mask * (1 / 0.9))
    autograd = autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    for name, expected in autograd.grads.items():
        assert np.abs(walked.grads[name] - expected).max() <= 1e-11 * np.abs(expected).max(), name


def test_pytorchs_own_dropout_is_input_times_mask_times_scale_bitwise():
    # what SpecModule computes with the request's mask is what F.dropout computes with its own draw
    torch.manual_seed(3)
    x = torch.randn(4096)
    for p in (0.1, 0.3, 0.5):
        y = F.dropout(x, p, training=True)
        assert torch.equal(y, x * (y != 0).to(x.dtype) * (1 / (1 - p)))


# ---------------------------------------------------------------------------------------------
# the mask travels with the request


@pytest.mark.parametrize("raw", [False, True])
def test_a_request_carries_the_mask_and_reads_back_the_same_problem(tmp_path, raw):
    problem = make_problem(16, 2, 0, network=NETWORK)
    write_request(problem, tmp_path / "req", "float64", "HWIO", raw=raw)
    found = read_bundle(tmp_path / "req", ("request",))
    assert found.arrays["drop.mask"].dtype == np.float64 and "drop.mask.grad" not in found.arrays
    again = problem_from_bundle(found)
    assert np.array_equal(again.masks["drop.mask"], problem.masks["drop.mask"])
    assert forward_backward(again, "float64").loss == forward_backward(problem, "float64").loss
    request = protocol.read_request(tmp_path / "req", activations="NHWC")
    assert np.array_equal(request.masks["drop.mask"], problem.masks["drop.mask"].transpose(0, 2, 3, 1))
    assert set(request.params) == set(NETWORK.parameter_names)  # a mask is no parameter


def test_a_request_whose_mask_is_not_zero_or_one_is_refused(tmp_path):
    problem = make_problem(16, 2, 0, network=NETWORK)
    masks = {"drop.mask": problem.masks["drop.mask"] * np.float32(0.5)}
    broken = type(problem)(problem.input, problem.target, problem.params, 0, network=NETWORK, masks=masks)
    write_request(broken, tmp_path / "req")
    with pytest.raises(Exception, match="'drop.mask' holds values other than 0 and 1"):
        problem_from_bundle(read_bundle(tmp_path / "req", ("request",)))


def test_the_builtin_candidates_apply_the_requests_mask():
    problem = make_problem(24, 2, 0, network=NETWORK)
    ref = reference(problem)
    for name in ("native", "layered-native", "micro-batched", "conv-fft"):
        judgement = judge(get_builtin(name).compute(problem), ref)
        assert judgement.verdict == "roundoff", (name, judgement.to_text())
    # a mask of PyTorch's own drawing is another step: far beyond rounding
    other = type(problem)(problem.input, problem.target, problem.params, 0, network=NETWORK,
                          masks=make_problem(24, 2, 1, network=NETWORK).masks)
    assert judge(autograd_forward_backward(other, "float32"), ref).verdict == "defect"


PROGRAM = '''
import numpy as np, torch, torch.nn.functional as F
from precision_lab import protocol

def compute(request):
    as_tensor = lambda a: torch.tensor(a, dtype=torch.float64 if request.dtype == np.float64 else torch.float32)
    w = {k: as_tensor(v).requires_grad_() for k, v in request.params.items()}
    h = F.relu(F.conv2d(as_tensor(request.input), w["conv1.weight"], w["conv1.bias"], padding=1))
    h = h * as_tensor(request.masks["drop.mask"]) * (1 / (1 - request.layer("drop")["p"]))
    y = F.conv2d(h, w["conv2.weight"], w["conv2.bias"], padding=1)
    loss = F.mse_loss(y, as_tensor(request.target))
    loss.backward()
    return loss.item(), {k: v.grad.numpy() for k, v in w.items()}, y.detach().numpy()

protocol.run(compute)
'''


def test_a_command_candidate_reads_the_mask_from_the_request(tmp_path):
    (tmp_path / "drop.py").write_text(PROGRAM)
    (tmp_path / "drop.json").write_text(json.dumps(_spec()))
    spec = {"name": "torch-dropout", "command": ["{python}", "drop.py", "{request}", "{response}"], "model": "drop.json",
            "precision": "float32", "weight_layout": "OIHW", "timeout_s": 120,
            "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}}
    (tmp_path / "drop.yaml").write_text(yaml.safe_dump(spec))
    problem = make_problem(16, 2, 0, network=NETWORK)
    judgement = judge(resolve(str(tmp_path / "drop.yaml")).compute(problem), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()


# ---------------------------------------------------------------------------------------------
# the bound


def _ctx():
    return BoundContext("float32", U32, 7.0, Kernels())


def test_the_scaling_rounds_twice_unless_it_is_a_power_of_two():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, 16, dtype=torch.float64).float().double()  # float32 values
    mask = (torch.rand(x.shape, dtype=torch.float64) < 0.7).double()
    op = OPS["dropout"]
    for p, exact in ((0.5, True), (0.75, True), (0.1, False), (0.3, False)):
        attrs = op.normalise({"p": p, "training": True})
        y = op.forward(attrs, [x], {"mask": mask}, Kernels())
        field = op.forward_error(attrs, [Field(x, None)], y, {"mask": mask}, _ctx())
        got = op.forward(attrs, [x.float()], {"mask": mask.float()}, Kernels()).double()
        if exact:
            assert field.error is None and torch.equal(got, y)
            assert op.sampled_forward_scale(attrs, [x], y, {"mask": mask}, Kernels(), U32, 7.0) is None
            continue
        assert torch.equal(field.error, gamma2(U32) * y.abs())
        assert bool(torch.all((got - y).abs() <= field.error))
        assert bool(torch.all(field.error[mask == 0] == 0))  # a dropped element is exact
        # PyTorch's x·mask·fl(s) rounds s too: one rounding u·|y| would not cover every element at p = 0.1
        if p == 0.1:
            assert float(((got - y).abs() / y.abs().clamp_min(1e-300)).max()) > U32
        own, shared = op.sampled_forward_scale(attrs, [x], y, {"mask": mask}, Kernels(), U32, 7.0)
        assert torch.equal(own, U32 * y.abs()) and isinstance(shared, SharedDraw) and torch.equal(shared.coefficient, y)


def test_the_backward_bound_carries_the_mask_and_the_scale():
    from precision_lab.ops import GradField

    op = OPS["dropout"]
    attrs = op.normalise({"p": 0.1, "training": True})
    g = torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(1, 1, 8, 8)
    mask = (torch.arange(64, dtype=torch.float64).reshape(1, 1, 8, 8) % 3 != 0).double()
    carried = torch.full_like(g, 1e-6)
    (grad,), params = op.backward_error(attrs, g, GradField(carried), [Field(g, None)], Field(g, None),
                                        {"mask": mask}, _ctx(), [True])
    s = 1 / 0.9
    assert params == {}
    assert torch.allclose(grad.error, (1 + gamma2(U32)) * carried * mask * s + gamma2(U32) * (g * mask * s).abs(),
                          rtol=1e-15, atol=0)
    assert bool(torch.all(grad.error[mask == 0] == 0))


# ---------------------------------------------------------------------------------------------
# read from PyTorch


class Traced(nn.Module):
    def __init__(self, **dropout):
        super().__init__()
        self.conv, self.dropout = nn.Conv2d(1, 4, 3, padding=1), dropout

    def forward(self, x):
        return F.dropout(self.conv(x), **self.dropout)


def test_a_module_in_training_mode_reads_as_a_training_dropout():
    sequential = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Dropout(0.2))
    assert from_module(sequential).layers[1].attrs == {"p": 0.2, "training": True}
    assert from_module(sequential.eval()).layers[1].attrs == {"p": 0.2, "training": False}
    assert from_module(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Dropout(0.0))).layers[1].attrs["training"] is False
    assert from_module(Traced(p=0.3, training=True)).layers[1].attrs == {"p": 0.3, "training": True}
    assert from_module(Traced(p=0.3)).layers[1].attrs["training"] is True  # F.dropout's own default
    assert from_module(Traced(p=0.3, training=False)).layers[1].attrs["training"] is False


# ---------------------------------------------------------------------------------------------
# judged: PyTorch's own run is rounding, a port's slip is named


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_pytorchs_own_float32_run_with_the_requests_mask_is_rounding(p):
    network = parse_spec(_spec(p=p))
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()


SLIPS = ["backward: mask missing", "backward leaves out the scale", "leaves out the scale 1/(1 − p) in forward and",
         "mask inverted"]


@pytest.mark.parametrize("text", SLIPS)
def test_a_dropout_slip_is_a_defect_with_its_cause_named(text):
    slip = next(s for s in OPS["dropout"].port_slips(NETWORK.layers[DROP].attrs, (8, 24, 24)) if text in s.text)
    problem = make_problem(24, 2, 0, network=NETWORK)
    judgement = judge(forward_backward(problem, "float32", rules={DROP: slip.rule()}), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause == f"drop {slip.text}", judgement.to_text()


def test_an_evaluation_dropout_or_p_zero_has_no_slips():
    op = OPS["dropout"]
    assert op.port_slips(op.normalise({"p": 0.1}), (8, 4, 4)) == []
    assert op.port_slips(op.normalise({"p": 0.0, "training": True}), (8, 4, 4)) == []
    assert len(op.port_slips(op.normalise({"p": 0.1, "training": True}), (8, 4, 4))) == 4
    assert sys.modules["precision_lab.ops.dropout"].exact_scale({"p": 0.5})


def test_every_zoo_verdict_is_right_on_the_dropout_example():
    from precision_lab.calibration import judge_zoo
    from precision_lab.model import load_model

    # two training dropouts, p = 0.1 (the scale rounds) and p = 0.5 (exact)
    network = load_model(ROOT / "examples" / "models" / "dropout-denoiser.json")
    table = judge_zoo(make_problem(24, 2, 1, network=network), "cpu")
    assert len(table) >= 24
    wrong = table[~table["correct"]]
    assert wrong.empty, wrong[["candidate", "expected", "verdict", "detail", "worst_ratio"]].to_string()


def test_the_same_slip_in_every_dropout_is_one_cause():
    from precision_lab.model import load_model

    network = load_model(ROOT / "examples" / "models" / "dropout-denoiser.json")
    drops = [layer for layer in network.layers if layer.op == "dropout"]
    problem = make_problem(24, 2, 0, network=network)
    rules = {layer.index: next(s for s in OPS["dropout"].port_slips(layer.attrs, (16, 24, 24))
                               if "mask inverted" in s.text).rule() for layer in drops}
    judgement = judge(forward_backward(problem, "float32", rules=rules), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause == "every dropout mask inverted (drops the kept elements)", judgement.to_text()


@pytest.mark.parametrize("index, text, says", [
    (2, "backward: mask missing", "drop1 backward: mask missing (scaled by 1/(1 − p) only)"),
    (5, "backward leaves out the scale", "drop2 backward: leaves out the scale 1/(1 − p)"),
    (5, "mask inverted", "drop2 forward: beyond its own rounding bound")])
def test_intermediates_localise_a_dropout_slip_to_its_layer(index, text, says):
    from precision_lab.model import load_model

    # drop1 at p = 0.1 (its scale rounds), drop2 at p = 0.5 (exact)
    network = load_model(ROOT / "examples" / "models" / "dropout-denoiser.json")
    slip = next(s for s in OPS["dropout"].port_slips(network.layers[index].attrs, (16, 16, 16)) if text in s.text)
    problem = make_problem(16, 2, 0, network=network)
    judgement = judge(forward_backward(problem, "float32", rules={index: slip.rule()}, intermediates=True),
                      reference(problem))
    assert judgement.verdict == "defect" and judgement.localisation.startswith(says), judgement.to_text()
    # the right walk's intermediates localise nothing
    assert judge(forward_backward(problem, "float32", intermediates=True), reference(problem)).localisation is None
