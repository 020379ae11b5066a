"""PyTorch's pooling and stride semantics: floored strided convolutions and pools (the last rows no window reaches
are dropped), ceil_mode's partial last window, adaptive average pooling to any size; each against PyTorch's
autograd in float64, each float32 run within its bound, and the bound tight enough to catch a planted error."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.errmodel import error_bounds
from precision_lab.modules import from_module
from precision_lab.ops import OPS
from precision_lab.ops.pooling import adaptive_windows, pool_length
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


def _op_against_autograd(op_name: str, attrs: dict, x: torch.Tensor, torch_call):
    """The op's forward and backward in float64 against PyTorch's function and autograd."""
    op = OPS[op_name]
    attrs = op.normalise(dict(attrs))
    y = op.forward(attrs, [x], {}, None)
    leaf = x.clone().requires_grad_(True)
    expected = torch_call(leaf)
    assert y.shape == expected.shape
    assert torch.equal(y, expected.detach())
    assert tuple(y.shape[1:]) == op.out_shape(attrs, [tuple(x.shape[1:])])
    g = torch.randn_like(y)
    (grad,), _ = op.backward(attrs, g, [x], y, {}, None, [True])
    (expected_grad,) = torch.autograd.grad(expected, leaf, g)
    assert torch.allclose(grad, expected_grad, rtol=1e-14, atol=1e-14)
    return grad


@pytest.mark.parametrize("length,kernel,stride,padding", [(33, 3, 2, 0), (33, 3, 2, 1), (10, 3, 2, 1), (7, 2, 2, 1),
                                                          (13, 3, 2, 0), (6, 3, 3, 1)])
def test_the_pool_lengths_are_pytorchs(length, kernel, stride, padding):
    for ceil_mode in (False, True):
        x = torch.zeros(1, 1, length, 4)
        expected = F.max_pool2d(x, (kernel, 1), (stride, 1), (padding, 0), ceil_mode=ceil_mode).shape[2]
        assert pool_length(length, kernel, stride, padding, ceil_mode) == expected


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("padding", [0, 1])
def test_max_and_average_pools_of_any_size_are_pytorchs(ceil_mode, padding):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 13, 10, dtype=torch.float64)  # 13 and 10 leave a partial last window every 2 pixels
    common = {"kernel": 3, "stride": 2, "padding": padding, "ceil_mode": ceil_mode}
    _op_against_autograd("max_pool2d", common, x, lambda t: F.max_pool2d(t, 3, 2, padding, ceil_mode=ceil_mode))
    for included in (True, False):
        _op_against_autograd("avg_pool2d", dict(common, count_include_pad=included), x,
                             lambda t: F.avg_pool2d(t, 3, 2, padding, ceil_mode=ceil_mode, count_include_pad=included))
    # floor mode at 13 with a 2×2 pool: the 13th row is read by no window, so gets no gradient
    grad = _op_against_autograd("max_pool2d", {"kernel": 2}, x, lambda t: F.max_pool2d(t, 2))
    assert torch.all(grad[:, :, 12] == 0) and torch.any(grad[:, :, 11] != 0)


@pytest.mark.parametrize("in_size,out_size", [((13, 10), (7, 7)), ((7, 5), (6, 6)), ((3, 5), (6, 4)), ((8, 8), (4, 4))])
def test_adaptive_average_pooling_to_any_size_is_pytorchs(in_size, out_size):
    torch.manual_seed(1)
    x = torch.randn(2, 3, *in_size, dtype=torch.float64)
    _op_against_autograd("adaptive_avg_pool2d", {"size": list(out_size)}, x,
                         lambda t: F.adaptive_avg_pool2d(t, out_size))
    assert adaptive_windows(5, 3) == [(0, 2), (1, 4), (3, 5)]  # ⌊i·5/3⌋ to ⌈(i + 1)·5/3⌉: overlapping
    assert adaptive_windows(3, 6) == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3)]  # fewer pixels: repeated


def test_adaptive_pooling_to_one_by_one_stays_the_global_pool():
    network = from_module(nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Conv2d(2, 2, 1),
                                        nn.AdaptiveAvgPool2d((3, 2))))
    assert [layer.op for layer in network.layers] == ["conv2d", "global_avg_pool2d", "conv2d", "adaptive_avg_pool2d"]
    assert network.layers[3].attrs["size"] == (3, 2)


class Strided(nn.Module):
    """A small classifier of every floored and partial-window rule: a strided stem, ceil-mode pools, a pool whose
    last rows no window reads, an adaptive pool to a size that does not divide its input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 2, stride=2)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.body = nn.Conv2d(4, 6, 3, padding=1)
        self.pool2 = nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False)
        self.fc = nn.Linear(6 * 4 * 4, 10)

    def forward(self, x):
        h = self.pool1(torch.relu(self.stem(x)))
        h = torch.tanh(self.pool2(self.body(h)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, (4, 4)), 1))


@pytest.fixture(scope="module")
def strided():
    torch.manual_seed(0)
    network = from_module(Strided(), input_channels=1, loss="cross_entropy")
    return make_problem((45, 39), 2, 0, network=network)  # odd and not a multiple of any stride


def test_a_strided_network_at_an_odd_size_walks_as_pytorch(strided):
    assert [layer.op for layer in strided.network.layers] == [
        "conv2d", "relu", "max_pool2d", "conv2d", "avg_pool2d", "tanh", "adaptive_avg_pool2d", "flatten", "linear"]
    walked, autograd = forward_backward(strided, "float64"), autograd_forward_backward(strided, "float64")
    for name in walked.grads:
        scale = np.abs(autograd.grads[name]).max()
        assert np.abs(walked.grads[name] - autograd.grads[name]).max() <= 1e-12 * scale, name


def test_pytorchs_float32_is_within_the_bound_and_a_few_bounds_more_is_not(strided):
    trace = reference(strided)
    ours = autograd_forward_backward(strided, "float32")
    assert judge(ours, trace, fingerprint=False, hypotheses=False).verdict == "roundoff"
    bounds = error_bounds(trace, "float32")
    for name in ("stem.weight", "body.weight"):  # gradients that came back through every pool
        planted = {k: v.copy() for k, v in ours.grads.items()}
        exact, bound = trace.grads[name], bounds[name].bound
        where = np.unravel_index(np.argmax(bound), bound.shape)
        error = planted[name][where] - exact[where]
        planted[name][where] = exact[where] + np.sign(error or 1.0) * 3 * bound[where]
        slipped = dataclasses.replace(ours, grads=planted)
        assert judge(slipped, trace, fingerprint=False, hypotheses=False).verdict != "roundoff", name


def test_a_port_with_fixed_windows_or_the_other_divisor_is_caught(strided):
    trace = reference(strided)
    layers = {layer.op: layer for layer in strided.network.layers}
    # 45×39 → stem 22×19 (its last row and column dropped) → ceil pools 11×9, 6×5 → adaptive 4×4
    for op_name, shape, text in (("adaptive_avg_pool2d", (6, 6, 5), "fixed windows"),
                                 ("avg_pool2d", (6, 11, 9), "by k²")):
        slip = next(s for s in OPS[op_name].port_slips(layers[op_name].attrs, shape) if text in s.text)
        slipped = forward_backward(strided, "float32", rules={layers[op_name].index: slip.rule()})
        assert judge(slipped, trace, fingerprint=False, hypotheses=False).verdict == "defect", op_name


@pytest.fixture(scope="module")
def resnet18():
    torchvision = pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    torch.manual_seed(0)
    module = torchvision.models.resnet18(num_classes=10).train()
    return module, from_module(module, loss="cross_entropy")


@pytest.mark.parametrize("size", [32, 33, 64, 97])
def test_resnet18_runs_as_torchvision_at_any_size(resnet18, size):
    """Its stem halves 33 to 17, its max pool 17 to 9 (both floored): refused before at every size."""
    module, network = resnet18
    problem = make_problem((size, size), 2, 0, network=network)
    walked = forward_backward(problem, "float64")
    module = module.double()
    state = module.state_dict()
    with torch.no_grad():
        for name, value in problem.params.items():
            state[name].copy_(torch.from_numpy(value))
    module.zero_grad()
    logits = module(torch.from_numpy(problem.input).double())
    F.cross_entropy(logits, torch.from_numpy(problem.target)).backward()
    assert np.abs(walked.output - logits.detach().numpy()).max() <= 1e-10 * logits.abs().max().item()
    for name, parameter in module.named_parameters():
        expected = parameter.grad.numpy()
        assert np.abs(walked.grads[name] - expected).max() <= 1e-10 * np.abs(expected).max(), name


def test_an_onnx_export_with_ceil_mode_reads_as_the_module(tmp_path):
    pytest.importorskip("onnx", reason="onnx installs with make setup")
    import io
    import warnings

    from precision_lab.model import read_onnx
    from precision_lab.modules import SpecModule

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 3, 3), nn.MaxPool2d(3, 2, ceil_mode=True),
                           nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False), nn.Conv2d(3, 2, 1))
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's notices
        warnings.simplefilter("ignore")
        torch.onnx.export(module, torch.randn(2, 1, 16, 16), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    path = tmp_path / "ceil.onnx"
    path.write_bytes(buffer.getvalue())
    imported, params = read_onnx(path, loss="mse")
    converted = from_module(module, input_channels=1)
    assert [(layer.op, layer.attrs) for layer in imported.layers] == [(layer.op, layer.attrs) for layer in converted.layers]
    lab = SpecModule(imported, dtype=torch.float64)
    lab.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()})
    x = torch.randn(2, 1, 18, 17, dtype=torch.float64)  # partial last windows along both axes
    with torch.no_grad():
        assert torch.allclose(lab(x), module.double()(x), rtol=1e-12, atol=1e-12)


def test_probes_run_at_their_own_odd_sizes_and_diagnose_calls_a_right_float32_rounding(strided):
    """The probes' odd sizes were refused by every strided network; they now run where PyTorch runs them."""
    from precision_lab import diagnose, probes
    from precision_lab.candidates import resolve

    assert [probes.probe_problem(p, strided).size_text for p in probes.DEFAULT_PROBES] == ["61×67", "33×47", "45×39"]
    assert diagnose(resolve("builtin:native"), strided, probes=[]).verdict == "roundoff"


class Inception(nn.Module):
    """Four branches joined by one torch.cat, as an Inception block (googlenet) writes it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 1), nn.Conv2d(2, 2, 3, padding=1)
        self.c, self.pool = nn.Conv2d(2, 1, 5, padding=2), nn.MaxPool2d(3, 1, padding=1, ceil_mode=True)
        self.head = nn.Conv2d(8, 1, 3, stride=2)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), torch.relu(self.b(x)), self.c(x), self.pool(x)], 1))


def test_a_cat_of_four_branches_is_a_chain_of_concats_that_walks_as_autograd():
    torch.manual_seed(0)
    network = from_module(Inception(), input_channels=2)
    assert [layer.op for layer in network.layers].count("concat") == 3
    problem = make_problem((15, 13), 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name in walked.grads:
        scale = np.abs(autograd.grads[name]).max()
        assert np.abs(walked.grads[name] - autograd.grads[name]).max() <= 1e-12 * scale, name


@pytest.mark.parametrize("family", ["squeezenet1_0", "googlenet", "vgg11_bn", "alexnet"])
def test_torchvision_families_with_ceil_and_adaptive_pools_convert(family):
    torchvision = pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    extra = {"aux_logits": False, "init_weights": True} if family == "googlenet" else {}
    network = from_module(getattr(torchvision.models, family)(num_classes=10, **extra), loss="cross_entropy")
    ops = {layer.op for layer in network.layers}
    assert ("adaptive_avg_pool2d" in ops) == (family in ("vgg11_bn", "alexnet"))
    assert any(layer.attrs.get("ceil_mode") for layer in network.layers) == (family in ("squeezenet1_0", "googlenet"))
