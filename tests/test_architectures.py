"""Real architectures through the spec: layers that name their inputs (branches, projection shortcuts, x − f(x)),
the ops such networks use (sub, mul, SiLU, ELU, softplus, Mish, dropout, global average pooling, depthwise
convolution), read from PyTorch modules, walked as autograd does, and judged: PyTorch's own float32 run is
roundoff, a port's slip is a defect with its cause."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import ModelSpecError, parse_spec
from precision_lab.modules import from_module
from precision_lab.ops import OPS
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


class DnCNN(nn.Module):
    """Residual learning: the network predicts the noise and returns x − f(x)."""

    def __init__(self):
        super().__init__()
        self.head, self.body, self.tail = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        return x - self.tail(F.elu(self.body(F.relu(self.head(x)))))


class ProjectionResNet(nn.Module):
    """A residual block whose shortcut is a stride-2 1×1 projection of the block's input, then a classifier head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.proj = nn.Conv2d(8, 16, 1, stride=2)
        self.pool, self.drop, self.fc = nn.AdaptiveAvgPool2d(1), nn.Dropout(0.1), nn.Linear(16, 5)

    def forward(self, x):
        a = F.relu(self.stem(x))
        out = F.softplus(self.conv2(F.relu(self.conv1(a)))) + self.proj(a)
        return self.fc(self.drop(torch.flatten(self.pool(out), 1)))


class MobileBlock(nn.Module):
    """Depthwise-separable convolution with SiLU and a per-pixel gate (a mul of two branches)."""

    def __init__(self):
        super().__init__()
        self.expand, self.depthwise = nn.Conv2d(2, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.squeeze, self.excite = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.project = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        h = F.silu(self.depthwise(F.silu(self.expand(x))))
        gate = torch.sigmoid(self.excite(F.mish(self.squeeze(h))))
        return self.project(h * gate)


class SqueezeExcite(nn.Module):
    """A squeeze-and-excitation block: each channel scaled by a gate computed from its global average."""

    def __init__(self):
        super().__init__()
        self.conv, self.squeeze, self.excite = nn.Conv2d(2, 8, 3, padding=1), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.conv(x))
        gate = torch.sigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(h, 1)))))
        return self.head(h * gate)


NETWORKS = {"dncnn": (DnCNN, "mse"), "resnet": (ProjectionResNet, "cross_entropy"), "mobile": (MobileBlock, "mse"),
            "se": (SqueezeExcite, "mse")}


def _network(name: str):
    module_class, loss = NETWORKS[name]
    torch.manual_seed(0)
    return from_module(module_class(), loss=loss, name=name, input_channels=None if name == "dncnn" else 2)


@pytest.mark.parametrize("name, shape", [
    ("dncnn", ["conv2d", "relu", "conv2d", "elu", "conv2d", "sub"]),
    ("resnet", ["conv2d", "relu", "conv2d", "relu", "conv2d", "softplus", "conv2d", "add", "global_avg_pool2d",
                "flatten", "dropout", "linear"]),
    ("mobile", ["conv2d", "silu", "conv2d", "silu", "conv2d", "mish", "conv2d", "sigmoid", "mul", "conv2d"]),
    ("se", ["conv2d", "relu", "global_avg_pool2d", "conv2d", "relu", "conv2d", "sigmoid", "mul", "conv2d"])])
def test_a_real_architecture_converts_and_walks_as_autograd(name, shape):
    network = _network(name)
    assert [layer.op for layer in network.layers] == shape
    problem = make_problem(16, 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter


def test_branches_name_their_inputs():
    dncnn, resnet = _network("dncnn"), _network("resnet")
    sub = dncnn.layers[-1]
    assert sub.inputs == (-1, 4)  # the network input minus the tail's output
    add = resnet.layers[resnet.index_of("add")] if "add" in resnet.named_layers else next(
        layer for layer in resnet.layers if layer.op == "add")
    assert [resnet.layers[i].name for i in add.inputs] == ["softplus", "proj"]
    assert resnet.layers[resnet.index_of("proj")].inputs == (resnet.index_of("relu"),)


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_pytorchs_own_float32_run_of_a_real_architecture_is_rounding(name):
    network = _network(name)
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()


def test_a_residual_subtracted_the_other_way_round_is_named():
    from precision_lab.ops.arithmetic import SubSwapped

    network = _network("dncnn")
    problem = make_problem(24, 2, 0, network=network)
    swapped = forward_backward(problem, "float32", rules={len(network.layers) - 1: SubSwapped()})
    judgement = judge(swapped, reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "subtracts the other way round" in judgement.cause, judgement.to_text()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_depthwise_weight_gradient_summed_over_every_group_is_named(seed):
    network = _network("mobile")
    index = next(i for i, layer in enumerate(network.layers) if layer.op == "conv2d" and layer.attrs["groups"] > 1)
    slip = next(s for s in OPS["conv2d"].port_slips(network.layers[index].attrs, (8, 24, 24)) if "every group" in s.text)
    problem = make_problem(24, 2, seed, network=network)
    judgement = judge(forward_backward(problem, "float32", rules={index: slip.rule()}), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "every group's input channels" in judgement.cause, judgement.to_text()
    assert network.layers[index].name in judgement.cause


def test_a_gate_that_passes_no_gradient_to_its_branch_is_a_defect():
    from precision_lab.ops import BackwardReplaced, dropping

    network = _network("mobile")
    problem = make_problem(24, 2, 0, network=network)
    index = next(layer.index for layer in network.layers if layer.op == "mul")
    slipped = forward_backward(problem, "float32", rules={index: BackwardReplaced(OPS["mul"], dropping(1))})
    judgement = judge(slipped, reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "passes no gradient" in judgement.cause, judgement.to_text()


@pytest.mark.parametrize("op, bound", [("silu", 0.5), ("softplus", 0.25), ("mish", 0.65), ("elu", 1.0)])
def test_each_smooth_ops_curvature_bounds_its_second_derivative(op, bound):
    z = torch.linspace(-40, 40, 800001, dtype=torch.float64, requires_grad=True)
    f = OPS[op].f(OPS[op].normalise({}), z)
    first, = torch.autograd.grad(f.sum(), z, create_graph=True)
    second, = torch.autograd.grad(first.sum(), z)
    assert float(second.abs().max()) <= OPS[op].curvature(OPS[op].normalise({})) == bound
    assert float(second.abs().max()) > 0.9 * bound  # and is not loose by more than the rounding-up


@pytest.mark.parametrize("spec, says", [
    ({"layers": [{"name": "a", "op": "conv2d", "in": 1, "out": 1, "kernel": 3, "padding": 1},
                 {"op": "relu", "inputs": ["nowhere"]}]}, "'inputs' names 'nowhere', which is no earlier layer"),
    ({"layers": [{"name": "a", "op": "conv2d", "in": 1, "out": 1, "kernel": 3, "padding": 1},
                 {"name": "b", "op": "conv2d", "in": 1, "out": 1, "kernel": 3, "padding": 1, "inputs": ["input"]}]},
     "a: its output is read by no layer"),
    ({"layers": [{"name": "input", "op": "conv2d", "in": 1, "out": 1, "kernel": 3}]}, "means the network's input"),
    ({"layers": [{"name": "a", "op": "conv2d", "in": 1, "out": 1, "kernel": 3, "padding": 1},
                 {"op": "sub", "inputs": ["a"]}]}, "expected a list of 2 layer names")])
def test_a_graph_spec_that_cannot_run_says_why(spec, says):
    with pytest.raises(ModelSpecError, match=says):
        parse_spec(spec, "spec")


def test_a_layout_name_is_right_when_it_reads_every_weight_alike():
    from precision_lab.doctors.layout import same_reading

    assert same_reading("layout IOHW", "layout HIOW", [(8, 4, 1, 1)])  # a 1×1 kernel: the same bytes
    assert not same_reading("layout IOHW", "layout HIOW", [(8, 4, 1, 1), (8, 4, 3, 3)])
    assert same_reading("layout WHIO", "layout WIHO", [(8, 1, 3, 3), (4, 8, 1, 1)])  # one input channel, 1×1
    assert not same_reading("flip HW", "layout IOHW", [(8, 4, 3, 3)])


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_every_zoo_verdict_is_right_on_a_real_architecture(name):
    from precision_lab.calibration import judge_zoo

    for seed in (1, 2):
        table = judge_zoo(make_problem(24, 2, seed, network=_network(name)), "cpu")
        assert len(table) >= 24
        wrong = table[~table["correct"]]
        assert wrong.empty, wrong[["candidate", "expected", "verdict", "detail", "worst_ratio"]].to_string()


@pytest.mark.parametrize("spec", ["dncnn.json", "resnet-projection.json", "mobile-block.json",
                                  "dropout-denoiser.json"])
def test_the_architecture_examples_walk_as_autograd_and_their_pytorch_run_is_rounding(spec):
    from precision_lab.model import load_model
    from precision_lab.paths import ROOT

    network = load_model(ROOT / "examples" / "models" / spec)
    problem = make_problem(32, 2, 3, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter
    judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()
