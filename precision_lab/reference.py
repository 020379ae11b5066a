"""The float64 reference: the same problem in float64, inputs cast exactly from float32 (DESIGN.md).

Stock PyTorch float64 convolution on CPU goes through ATen's slow im2col path (no oneDNN
for float64) and costs ~6-20× the float32 run. The reference runs the same layer-by-layer
forward + backward (problem.forward_backward) with the shift-and-GEMM algorithm of
`precision_lab.conv.DirectConv`: nine small float64 GEMMs per chunk of pixels (MKL's dgemm),
chunks spread over threads;
it agrees with stock float64 to ~1e-15 relative (tests/test_reference.py checks 1e-13).
On a GPU, cuDNN's float64 kernels are used as they are.
"""
from __future__ import annotations

import torch

from .conv.algorithms import DirectConv
from .problem import NativeConv, Problem, Trace, forward_backward

#: relative agreement with stock float64 that the reference guarantees (issue 5; tested)
STOCK_AGREEMENT = 1e-13


def reference_conv(device: str | torch.device = "cpu"):
    """The convolution the reference uses on `device`: shift-and-GEMM on CPU, cuDNN on GPU."""
    return DirectConv() if torch.device(device).type == "cpu" else NativeConv()


def reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """Float64 forward + backward of `problem` with every intermediate kept for the error model."""
    conv = reference_conv(device)
    trace = forward_backward(problem, "float64", device, conv=conv, keep_trace=True)
    trace.meta.update(role="reference", conv=conv.name)
    trace.meta["params"] = dict(problem.params)  # the error model propagates bounds through |W|
    return trace


def stock_reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """The same with PyTorch's own float64 convolution: the yardstick `reference` is tested against."""
    trace = forward_backward(problem, "float64", device, conv=NativeConv(), keep_trace=True)
    trace.meta.update(role="reference", conv="native", params=dict(problem.params))
    return trace


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|: the normwise agreement of two float64 results."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())


def agreement(trace: Trace, stock: Trace) -> dict[str, float]:
    """Relative difference of every gradient, the output and every intermediate of two traces."""
    diffs = {name: relative_difference(torch.from_numpy(trace.grads[name]), torch.from_numpy(stock.grads[name]))
             for name in trace.grads}
    diffs["output"] = relative_difference(torch.from_numpy(trace.output), torch.from_numpy(stock.output))
    for kind in ("activations", "preactivations", "output_grads"):
        for k, (mine, theirs) in enumerate(zip(getattr(trace, kind), getattr(stock, kind))):
            diffs[f"{kind}[{k}]"] = relative_difference(mine.cpu(), theirs.cpu())
    return diffs
