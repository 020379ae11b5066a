"""The float64 reference: the same problem in float64, inputs cast exactly from float32 (docs/design.md, "One way through a diagnosis").

Stock PyTorch float64 convolution on CPU goes through ATen's slow im2col path (no oneDNN for
float64) and costs ~6-20× the float32 run. On a CPU the reference runs the 3×3 stride-1
padding-1 convolutions (the seed's) with the shift-and-GEMM algorithm of
`precision_lab.conv.DirectConv` — nine small float64 GEMMs per chunk of pixels (MKL's dgemm),
chunks spread over threads — and every other layer with PyTorch's own float64 kernels; it agrees
with stock float64 to ~1e-15 relative (tests/test_reference.py checks 1e-13). On a GPU, cuDNN's
float64 kernels are used as they are. The walk is `precision_lab.compute.forward_backward` with a
trace: intermediates kept as float32 roundings (memory at 1024²; the error model is float32),
the network's output and its gradient in float64.
"""
from __future__ import annotations

import torch

from .compute import Trace, forward_backward
from .conv.algorithms import DirectConv
from .ops import Kernels
from .problem import Problem

#: relative agreement with stock float64 that the reference guarantees (tests/test_reference.py checks it)
STOCK_AGREEMENT = 1e-13

#: what the trace keeps (tested): float64 for the input, output and its gradient; the float32
#: rounding of the intermediates, exact to 2⁻²⁴ relative (the bounds evaluate in float32)
INTERMEDIATE_STORAGE = "float64 input/output/output gradient, float32 intermediates"


def reference_kernels(device: str | torch.device = "cpu") -> Kernels:
    """The kernels the reference (and the bounds) use on `device`: shift-and-GEMM for 3×3 convolutions
    on CPU, PyTorch native (cuDNN) elsewhere."""
    if torch.device(device).type == "cpu":
        return Kernels(conv=DirectConv(), name="direct")
    return Kernels(name="native")


def reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """Float64 forward + backward of `problem`, keeping what the error model needs."""
    kernels = reference_kernels(device)
    trace = forward_backward(problem, "float64", device, kernels=kernels, keep_trace=True)
    trace.meta.update(role="reference", conv=kernels.name, intermediates=INTERMEDIATE_STORAGE)
    return trace


def stock_reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """The same with PyTorch's own float64 convolution: the yardstick `reference` is tested against."""
    trace = forward_backward(problem, "float64", device, kernels=Kernels(name="native"), keep_trace=True)
    trace.meta.update(role="reference", conv="native")
    return trace


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|: the normwise agreement of two float64 results."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())


def agreement(trace: Trace, stock: Trace) -> dict[str, float]:
    """Relative difference of every gradient and the output of two float64 traces."""
    diffs = {name: relative_difference(torch.from_numpy(trace.grads[name]), torch.from_numpy(stock.grads[name]))
             for name in trace.grads}
    diffs["output"] = relative_difference(torch.from_numpy(trace.output), torch.from_numpy(stock.output))
    return diffs


def intermediate_agreement(trace: Trace, stock: Trace) -> dict[str, tuple[float, float]]:
    """(relative difference, what its storage allows) for every intermediate of `trace` against `stock`.

    A float64 intermediate must agree to STOCK_AGREEMENT; a float32 one to its rounding,
    2⁻²⁴ relative per element (IEEE 754 round to nearest), plus STOCK_AGREEMENT.
    """
    out = {}
    for index, layer in enumerate(trace.network.layers):
        for kind, mine, theirs in (("output", trace.value(index), stock.value(index)),
                                   ("output.grad", trace.grad_at(index), stock.grad_at(index))):
            allowed = STOCK_AGREEMENT + (2.0 ** -24 if mine.dtype == torch.float32 else 0.0)
            out[f"{layer.label}.{kind}"] = (relative_difference(mine.cpu().double(), theirs.cpu().double()), allowed)
    return out
