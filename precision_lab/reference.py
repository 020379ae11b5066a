"""The float64 reference: the same problem in float64, inputs cast exactly from float32 (DESIGN.md).

Stock PyTorch float64 convolution on CPU goes through ATen's slow im2col path (no oneDNN
for float64) and costs ~6-20× the float32 run. The reference runs the same layer-by-layer
forward + backward (problem.forward_backward) with the shift-and-GEMM algorithm of
`precision_lab.conv.DirectConv`: nine small float64 GEMMs per chunk of pixels (MKL's dgemm),
chunks spread over threads;
it agrees with stock float64 to ~1e-15 relative (tests/test_reference.py checks 1e-13). The trace keeps
the 16-channel intermediates as float32 roundings (memory at 1024²; the error model is float32).
On a GPU, cuDNN's float64 kernels are used as they are.
"""
from __future__ import annotations

import torch

from .conv.algorithms import DirectConv
from .problem import LAYERS, PARAM_NAMES, NativeConv, Problem, Trace, forward_backward, to_tensors

#: relative agreement with stock float64 that the reference guarantees (issue 5; tested)
STOCK_AGREEMENT = 1e-13

#: what the trace keeps (tested): float64 for the input, output and its gradient; the float32
#: rounding of the 16-channel intermediates, exact to 2⁻²⁴ relative (the bounds evaluate in float32)
INTERMEDIATE_STORAGE = "float64 input/output/output gradient, float32 16-channel intermediates"


def reference_conv(device: str | torch.device = "cpu"):
    """The convolution the reference uses on `device`: shift-and-GEMM on CPU, cuDNN on GPU."""
    return DirectConv() if torch.device(device).type == "cpu" else NativeConv()


def reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """Float64 forward + backward of `problem`, keeping what the error model needs.

    Loss, output and gradients are float64. Of the intermediates, the network input, the
    output and its gradient stay float64 (small; the verdict rebuilds the problem from them);
    the 16-channel activations, preactivations and output gradients are kept as their float32
    roundings (see `_forward_backward_in_place`).
    """
    conv = reference_conv(device)
    trace = _forward_backward_in_place(problem, device, conv)
    trace.meta.update(role="reference", conv=conv.name, intermediates=INTERMEDIATE_STORAGE)
    trace.meta["params"] = dict(problem.params)  # the error model propagates bounds through |W|
    return trace


def _forward_backward_in_place(problem: Problem, device, conv) -> Trace:
    """problem.forward_backward in float64 with bias, ReLU and ReLU mask applied in place.

    Same operations in the same order (so the same loss, output and gradients, bit for bit)
    without image-sized temporaries. The 16-channel intermediates only feed the error model,
    which evaluates in float32 anyway, so the trace keeps their float32 roundings (768 MB at
    1024², batch 2, instead of 1.5 GB) and each float64 one is freed once the backward is past it.
    The ReLU mask is taken from the activation: relu(z) > 0 exactly where z > 0.
    """
    x, target, p = to_tensors(problem, "float64", device)
    last = len(LAYERS) - 1
    with torch.no_grad():
        hidden, acts, pres = [x], [x], []  # hidden: float64 activations the backward needs
        for k, layer in enumerate(LAYERS):
            z = conv.forward(hidden[-1], p[f"{layer}.weight"])
            z += p[f"{layer}.bias"].view(1, -1, 1, 1)
            if k == last:
                pres.append(z)
                break
            pres.append(z.to(torch.float32))
            acts.append(torch.relu(pres[-1]))  # rounding commutes with relu: the float32 of relu(z)
            hidden.append(z.relu_())
            del z
        residual = pres[-1] - target
        loss = torch.mean(residual * residual)
        grad = residual.mul_(2.0 / residual.numel())  # d mean((y-t)^2) / dy
        grads, out_grads = {}, [None] * len(LAYERS)
        for k in reversed(range(len(LAYERS))):
            layer = LAYERS[k]
            out_grads[k] = grad if k == last else grad.to(torch.float32)
            grads[f"{layer}.weight"] = conv.weight_grad(hidden[k], grad)
            grads[f"{layer}.bias"] = grad.sum(dim=(0, 2, 3))
            if k > 0:
                grad = conv.input_grad(grad, p[f"{layer}.weight"])
                grad.mul_(hidden[k].sign_())  # the ReLU mask (a > 0 ⇔ z > 0) as 0/1 in place: a is not needed again
                hidden[k] = None  # free the float64 activation as soon as the backward is past it
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
    for kind in ("activations", "preactivations", "output_grads"):
        for k, (mine, theirs) in enumerate(zip(getattr(trace, kind), getattr(stock, kind))):
            allowed = STOCK_AGREEMENT + (2.0 ** -24 if mine.dtype == torch.float32 else 0.0)
            out[f"{kind}[{k}]"] = (relative_difference(mine.cpu().double(), theirs.cpu()), allowed)
    return out
