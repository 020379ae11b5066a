"""Checks the tests of ops and networks share: the lab's float64 walk equals PyTorch's autograd, and PyTorch's own
float32 run is judged rounding."""
import numpy as np

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.reference import reference
from precision_lab.verdict import judge


def assert_walks_as_autograd(problem, output: bool = False) -> None:
    """Loss (and, with `output`, the network output) to 1e-12 and every parameter gradient to 1e-11, relative."""
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    if output:
        assert np.abs(walked.output - autograd.output).max() <= 1e-12 * np.abs(autograd.output).max()
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter


def assert_pytorch_float32_is_roundoff(problem) -> None:
    judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()
