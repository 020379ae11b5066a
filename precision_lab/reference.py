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
from .problem import LAYERS, PARAM_NAMES, NativeConv, Problem, Trace, forward_backward, to_tensors

#: relative agreement with stock float64 that the reference guarantees (issue 5; tested)
STOCK_AGREEMENT = 1e-13


def reference_conv(device: str | torch.device = "cpu"):
    """The convolution the reference uses on `device`: shift-and-GEMM on CPU, cuDNN on GPU."""
    return DirectConv() if torch.device(device).type == "cpu" else NativeConv()


def reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """Float64 forward + backward of `problem` with every intermediate kept for the error model."""
    conv = reference_conv(device)
    trace = _forward_backward_in_place(problem, device, conv)
    trace.meta.update(role="reference", conv=conv.name)
    trace.meta["params"] = dict(problem.params)  # the error model propagates bounds through |W|
    return trace


def _forward_backward_in_place(problem: Problem, device, conv) -> Trace:
    """problem.forward_backward in float64 with bias, ReLU mask and scaling applied in place.

    Same operations in the same order (so the same values) without the image-sized temporaries:
    the trace itself holds ~1.6 GB at 1024², batch 2, and the diagnosis must peak under 3 GB.
    """
    x, target, p = to_tensors(problem, "float64", device)
    with torch.no_grad():
        acts, pres = [x], []
        for k, layer in enumerate(LAYERS):
            z = conv.forward(acts[-1], p[f"{layer}.weight"])
            z += p[f"{layer}.bias"].view(1, -1, 1, 1)
            pres.append(z)
            if k < len(LAYERS) - 1:
                acts.append(torch.relu(z))
        residual = pres[-1] - target
        loss = torch.mean(residual * residual)
        grad = residual.mul_(2.0 / residual.numel())  # d mean((y-t)^2) / dy
        grads, out_grads = {}, [None] * len(LAYERS)
        for k in reversed(range(len(LAYERS))):
            layer = LAYERS[k]
            out_grads[k] = grad
            grads[f"{layer}.weight"] = conv.weight_grad(acts[k], grad)
            grads[f"{layer}.bias"] = grad.sum(dim=(0, 2, 3))
            if k > 0:
                grad = conv.input_grad(grad, p[f"{layer}.weight"])
                grad.mul_(pres[k - 1] > 0)
    output = pres[-1].cpu().numpy()
    return Trace(loss=float(loss), grads={name: grads[name].cpu().numpy() for name in PARAM_NAMES}, output=output,
                 dtype="float64", meta={"conv": conv.name, "device": str(device)},
                 activations=acts, preactivations=pres, output_grads=out_grads)


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
