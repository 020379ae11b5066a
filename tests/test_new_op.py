"""Adding an op is one class: a SiLU written here, and nowhere else, is read from a PyTorch module, walked
forward and backward, bounded, and judged (docs/design.md, "Where to add things")."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.modules import from_module
from precision_lab.ops import OPS, BackwardReplaced, register
from precision_lab.ops.pointwise import Smooth
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


class SiLU(Smooth):
    name = "silu"
    #: sup|silu''|: silu''(z) = σ'(z)·(2 + z·(1 − 2σ(z))) peaks at z = 0 with σ' = 1/4, so 1/2 (checked below)
    second_derivative_bound = 0.5
    torch_modules = (nn.SiLU,)
    torch_calls = (F.silu,)

    def torch_forward(self, attrs, xs, module):
        return F.silu(xs[0])

    def f(self, attrs, z):
        return z * torch.sigmoid(z)

    def df(self, attrs, z):
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))


@pytest.fixture
def silu_network():
    register(SiLU())
    try:
        module = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 1, 3, padding=1))
        yield from_module(module)
    finally:
        OPS.pop("silu")


def test_the_new_ops_second_derivative_bound_holds():
    z = torch.linspace(-20, 20, 400001, dtype=torch.float64, requires_grad=True)
    first, = torch.autograd.grad(F.silu(z).sum(), z, create_graph=True)
    second, = torch.autograd.grad(first.sum(), z)
    assert float(second.abs().max()) <= SiLU.second_derivative_bound + 1e-12


def test_a_new_op_is_read_walked_and_bounded_from_its_class_alone(silu_network):
    assert [layer.op for layer in silu_network.layers] == ["conv2d", "silu", "conv2d"]
    problem = make_problem(24, 2, 0, network=silu_network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name in walked.grads:
        scale = np.abs(autograd.grads[name]).max()
        assert np.abs(walked.grads[name] - autograd.grads[name]).max() <= 1e-12 * scale, name
    # PyTorch's own float32 run is rounding; the same network with SiLU's backward missing f' is not
    trace = reference(problem)
    assert judge(autograd_forward_backward(problem, "float32"), trace).verdict == "roundoff"
    without_slope = BackwardReplaced(OPS["silu"], lambda op, attrs, g, *rest: ([g], {}))
    slipped = forward_backward(problem, "float32", rules={"silu": without_slope})
    assert judge(slipped, trace).verdict == "defect"
