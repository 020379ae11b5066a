"""Normalisation ops: batch_norm2d in training and evaluation mode, read from PyTorch modules, walked as autograd
does, and judged: PyTorch's own float32 run and every legitimate float32 form of the statistics (two-pass, Welford,
the one-pass E[x²] − μ²) are roundoff; a port's slip of the statistics is a defect with its cause named."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.modules import from_module
from precision_lab.ops import OPS, Rule
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


class DnCNNBN(nn.Module):
    """DnCNN: conv–ReLU, conv–BN–ReLU ×2, conv; the network returns x − f(x)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(1, 8, 3, padding=1)
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.tail = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.head(x))
        h = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))))
        return x - self.tail(h)


def _dncnn(mode: str):
    torch.manual_seed(0)
    module = DnCNNBN()
    if mode == "eval":
        for bn in (module.bn1, module.bn2):  # running statistics as a trained network holds them
            bn.running_mean.uniform_(-0.3, 0.3)
            bn.running_var.uniform_(0.5, 2.0)
        module.eval()
    return from_module(module, name=f"dncnn-bn-{mode}")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_forward_and_backward_are_pytorchs_in_float64(mode):
    network = _dncnn(mode)
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "conv2d", "batch_norm2d", "relu", "conv2d",
                                                      "batch_norm2d", "relu", "conv2d", "sub"]
    bn = network.layers[3].attrs
    assert bn["training"] == (mode == "train") and bn["eps"] == 1e-5 and bn["affine"]
    assert (bn["running_mean"] is None) == (mode == "train")
    assert network.param_shapes["bn1.weight"] == (8,) and "bn1.running_mean" not in network.param_shapes
    problem = make_problem(16, 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    assert np.abs(walked.output - autograd.output).max() <= 1e-12 * np.abs(autograd.output).max()
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter


def test_the_batch_statistics_matter_in_training_mode():
    """The backward's two mean terms are not small: dropping them changes conv1's gradient by O(1) of itself."""
    network = _dncnn("train")
    problem = make_problem(16, 2, 0, network=network)
    rules = {3: OPS["batch_norm2d"].port_slips(network.layers[3].attrs, (8, 16, 16))[1].rule()}
    slipped, right = forward_backward(problem, "float64", rules=rules), forward_backward(problem, "float64")
    change = np.abs(slipped.grads["conv1.weight"] - right.grads["conv1.weight"]).max()
    assert change > 0.1 * np.abs(right.grads["conv1.weight"]).max()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_pytorchs_own_float32_run_with_batch_norm_is_rounding(mode):
    network = _dncnn(mode)
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()
