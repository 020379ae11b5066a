"""Spec features frameworks need: per-side and TensorFlow "same" padding (zero_pad2d), and avg_pool2d's
count_include_pad, through spec validation, reference, bounds, verdicts, export and from_module."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precision_lab import cli
from precision_lab.candidates import resolve
from precision_lab.diagnosis import diagnose
from precision_lab.model import ModelSpecError, load_model
from precision_lab.modules import from_module
from precision_lab.problem import make_problem
from precision_lab.reference import reference


def _conv(**extra):
    return {"input_channels": 1, "layers": [dict({"name": "c", "op": "conv2d", "in": 1, "out": 2, "kernel": 3}, **extra)]}


@pytest.mark.parametrize("extra,layers", [
    ({"padding": "same"}, "conv2d 1→2 3×3"),                                   # stride 1: (1, 1), the conv's own
    ({"padding": "same", "stride": 2}, "zero_pad2d [0, 1, 0, 1], conv2d 1→2 3×3 stride 2"),  # TF: (0, 1)
    ({"padding": "same", "kernel": 4}, "zero_pad2d [1, 2, 1, 2], conv2d 1→2 4×4"),
    ({"padding": [2, 0, 1, 1]}, "zero_pad2d [2, 0, 1, 1], conv2d 1→2 3×3"),
    ({"padding": [1, 1, 2, 2]}, "conv2d 1→2 3×3"),
    ({"padding": "valid"}, "conv2d 1→2 3×3"),
])
def test_per_side_and_same_padding_become_zero_pad2d(extra, layers):
    network = load_model(_conv(**extra))
    assert network.summary() == f"{layers}; loss mse"


def test_same_padding_matches_tensorflows_output_sizes():
    # TF "SAME": out = ceil(in / stride); the lab takes inputs its strides divide
    network = load_model(_conv(padding="same", stride=2))
    assert network.output_shape(16, 10) == (2, 8, 5)
    with pytest.raises(ModelSpecError, match="not a multiple of the stride 2"):
        network.check_size(15, 10)


@pytest.mark.parametrize("bad,message", [("full", "expected an integer, \\[height, width\\], \\[top, bottom"),
                                         ([1, -1, 0, 0], "non-negative integers")])
def test_bad_padding_is_one_line_naming_the_layer(bad, message):
    with pytest.raises(ModelSpecError, match=f"model: c: 'padding' is .*{message}"):
        load_model(_conv(padding=bad))


def test_reference_pads_per_side_and_divides_by_the_in_bounds_count():
    spec = {"input_channels": 1, "layers": [
        {"name": "c", "op": "conv2d", "in": 1, "out": 2, "kernel": 3, "padding": [0, 2, 1, 0]},
        {"name": "p", "op": "avg_pool2d", "kernel": 3, "stride": 1, "padding": 1, "count_include_pad": False}]}
    problem = make_problem((8, 6), 2, 4, network=load_model(spec))
    trace = reference(problem, "cpu")
    x = torch.from_numpy(problem.input).double()
    w, b = (torch.from_numpy(problem.params[f"c.{k}"]).double() for k in ("weight", "bias"))
    conv = F.conv2d(F.pad(x, (1, 0, 0, 2)), w, b)
    ones = torch.ones_like(conv)
    expected = F.avg_pool2d(conv, 3, 1, 1, divisor_override=1) / F.avg_pool2d(ones, 3, 1, 1, divisor_override=1)
    np.testing.assert_allclose(trace.output, expected.numpy(), rtol=1e-12, atol=1e-14)
    # PyTorch's default would divide the corners by 9, not 4: a different network
    assert not np.allclose(trace.output, F.avg_pool2d(conv, 3, 1, 1).numpy())


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_float32_pytorch_on_padded_networks_is_roundoff(count_include_pad):
    spec = {"input_channels": 1, "layers": [
        {"name": "c1", "op": "conv2d", "in": 1, "out": 4, "kernel": 3, "stride": 2, "padding": "same"},
        {"name": "r", "op": "relu"},
        {"name": "p", "op": "avg_pool2d", "kernel": 3, "stride": 1, "padding": 1, "count_include_pad": count_include_pad},
        {"name": "c2", "op": "conv2d", "in": 4, "out": 1, "kernel": 2, "padding": [0, 1, 1, 0]}]}
    problem = make_problem((12, 10), 2, 1, network=load_model(spec))
    diagnosis = diagnose(resolve("native"), problem, "cpu", probes=None)
    assert diagnosis.verdict == "roundoff", diagnosis.to_text()


def test_from_module_reads_zero_pad_and_the_pools_flag():
    module = torch.nn.Sequential(torch.nn.ZeroPad2d((1, 0, 2, 0)), torch.nn.Conv2d(1, 2, 3),
                                 torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False))
    network = from_module(module, input_channels=1)
    assert network.summary() == ("zero_pad2d [2, 0, 1, 0], conv2d 1→2 3×3, avg_pool2d 3×3/1 (padding not counted); "
                                 "loss mse")
    problem = make_problem((9, 8), 1, 0, network=network)
    with torch.no_grad():
        for name, value in problem.params.items():  # a converted layer keeps its state_dict name ("1.weight")
            module.get_parameter(name).copy_(torch.from_numpy(value))
        expected = module(torch.from_numpy(problem.input)).double().numpy()
    np.testing.assert_allclose(reference(problem, "cpu").output, expected, rtol=1e-5, atol=1e-6)


def test_export_writes_bounds_for_a_padded_network(tmp_path):
    spec = tmp_path / "net.json"
    spec.write_text('{"input_channels": 1, "layers": [{"name": "c", "op": "conv2d", "in": 1, "out": 2, "kernel": 3, '
                    '"stride": 2, "padding": "same"}, {"name": "p", "op": "avg_pool2d", "kernel": 3, "stride": 1, '
                    '"padding": 1, "count_include_pad": false}]}')
    assert cli.main(["export", "--size", "8", "--model", str(spec), "--out", str(tmp_path / "x")]) == 0
    with np.load(tmp_path / "x" / "reference" / "arrays.npz") as data:
        bound = data["c.weight.grad.bound"]
    assert bound.shape == (2, 1, 3, 3) and np.all(bound > 0)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # PyTorch's own note on its copy
def test_from_module_reads_pytorchs_same_padding_of_an_even_kernel():
    # PyTorch's "same" (stride 1) puts the odd pixel after, as TensorFlow does: k = 4 pads (1, 2)
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 4, padding="same"))
    network = from_module(module, input_channels=1)
    assert network.summary() == "zero_pad2d [1, 2, 1, 2], conv2d 1→2 4×4; loss mse"
    problem = make_problem((7, 6), 1, 0, network=network)
    with torch.no_grad():
        for name, value in problem.params.items():
            module.get_parameter(name).copy_(torch.from_numpy(value))
        expected = module(torch.from_numpy(problem.input)).double().numpy()
    np.testing.assert_allclose(reference(problem, "cpu").output, expected, rtol=1e-5, atol=1e-6)
