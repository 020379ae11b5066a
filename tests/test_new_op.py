"""Adding an op is one class: a softsign written here, and nowhere else, is read from a PyTorch module, walked
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


class Softsign(Smooth):
    name = "softsign"
    #: sup|softsign''|: softsign''(z) = −2·sign(z)/(1 + |z|)³, largest (2) beside z = 0 (checked below)
    second_derivative_bound = 2.0
    torch_modules = (nn.Softsign,)
    torch_calls = (F.softsign,)

    def torch_forward(self, attrs, xs, module):
        return F.softsign(xs[0])

    def f(self, attrs, z):
        return z / (1 + z.abs())

    def df(self, attrs, z):
        return 1 / (1 + z.abs()) ** 2


@pytest.fixture
def softsign_network():
    register(Softsign())
    try:
        module = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.Softsign(), nn.Conv2d(6, 1, 3, padding=1))
        yield from_module(module)
    finally:
        OPS.pop("softsign")


def test_the_new_ops_second_derivative_bound_holds():
    z = torch.linspace(-20, 20, 400000, dtype=torch.float64, requires_grad=True)
    first, = torch.autograd.grad(F.softsign(z).sum(), z, create_graph=True)
    second, = torch.autograd.grad(first.sum(), z)
    assert 1.99 < float(second.abs().max()) <= Softsign.second_derivative_bound


def test_a_new_op_is_read_walked_and_bounded_from_its_class_alone(softsign_network):
    assert [layer.op for layer in softsign_network.layers] == ["conv2d", "softsign", "conv2d"]
    problem = make_problem(24, 2, 0, network=softsign_network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name in walked.grads:
        scale = np.abs(autograd.grads[name]).max()
        assert np.abs(walked.grads[name] - autograd.grads[name]).max() <= 1e-12 * scale, name
    # PyTorch's own float32 run is rounding; the same network with the backward missing f' is not
    trace = reference(problem)
    assert judge(autograd_forward_backward(problem, "float32"), trace).verdict == "roundoff"
    without_slope = BackwardReplaced(OPS["softsign"], lambda op, attrs, g, *rest: ([g], {}))
    slipped = forward_backward(problem, "float32", rules={"softsign": without_slope})
    assert judge(slipped, trace).verdict == "defect"
