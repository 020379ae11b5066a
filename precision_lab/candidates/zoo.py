"""The defect zoo and the legitimate variants: built-in candidates that test the lab itself.

Legitimate variants compute the same gradients another valid way (summation order of the
weight-gradient reduction, micro-batching, float64 inside a float32 interface, TF32 claimed as
TF32, convolution algorithms of `precision_lab.conv`): each must be judged ``roundoff``.
Defects keep the look of a working implementation (every shape right, loss right) and each
must be judged as its `expected` class, naming the transform or format in `expected_detail`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .. import formats
from ..layout import to_layout
from ..problem import (KERNEL_SIZE, LAYERS, PADDING, PARAM_NAMES, WEIGHT_NAMES, NativeConv, Problem,
                       Result, forward_backward, to_tensors)
from . import Candidate, builtin, register  # noqa: F401 - builtin first: registry() loads only when empty

# ---------------------------------------------------------------------------------------------
# summation orders of the weight-gradient reduction (vectorised over output elements)


def sum_sequential(terms: np.ndarray) -> np.ndarray:
    """Σ along the last axis, left to right, in the terms' dtype (numpy's accumulate is sequential)."""
    return np.add.accumulate(terms, axis=-1)[..., -1]


def sum_pairwise(terms: np.ndarray) -> np.ndarray:
    """Σ along the last axis by a balanced binary tree (zero-padded to a power of two)."""
    n = terms.shape[-1]
    width = 1 << max(0, math.ceil(math.log2(max(n, 1))))
    level = np.concatenate([terms, np.zeros(terms.shape[:-1] + (width - n,), terms.dtype)], axis=-1)
    while level.shape[-1] > 1:
        level = level[..., 0::2] + level[..., 1::2]
    return level[..., 0]


def sum_blocked(terms: np.ndarray, block: int = 256) -> np.ndarray:
    """Σ along the last axis: sequential within blocks of `block`, then sequential over block sums."""
    n = terms.shape[-1]
    padded = -(-n // block) * block
    level = np.concatenate([terms, np.zeros(terms.shape[:-1] + (padded - n,), terms.dtype)], axis=-1)
    block_sums = sum_sequential(level.reshape(terms.shape[:-1] + (padded // block, block)))
    return sum_sequential(block_sums)


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knuth's error-free TwoSum: a + b = s + e exactly (Higham 2002, Alg. 4.4)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def sum_kahan(terms: np.ndarray, steps: int = 64) -> np.ndarray:
    """Compensated summation: Kahan (Higham 2002, Alg. 4.2) along `steps`-long lanes, lanes
    merged pairwise by TwoSum with their compensations (vectorised over the lanes)."""
    n = terms.shape[-1]
    lanes = max(1, -(-n // steps))
    lanes = 1 << math.ceil(math.log2(lanes))
    padded = np.concatenate([terms, np.zeros(terms.shape[:-1] + (lanes * steps - n,), terms.dtype)], axis=-1)
    grid = padded.reshape(terms.shape[:-1] + (lanes, steps))
    total = np.zeros(grid.shape[:-1], terms.dtype)
    compensation = np.zeros_like(total)
    for step in range(steps):
        y = grid[..., step] - compensation
        t = total + y
        compensation = (t - total) - y
        total = t
    compensation = -compensation  # Kahan's c holds the negated lost low part
    while total.shape[-1] > 1:
        s, e = _two_sum(total[..., 0::2], total[..., 1::2])
        compensation = compensation[..., 0::2] + compensation[..., 1::2] + e
        total = s
    return (total + compensation)[..., 0]


SUMMATION_ORDERS = {"sequential": sum_sequential, "pairwise": sum_pairwise, "blocked": sum_blocked,
                    "kahan": sum_kahan}


class OrderedWeightGradConv(NativeConv):
    """Native forward and input gradient; the weight gradient summed over batch·H·W in a chosen order.

    Terms are formed as the hardware would (products rounded to the working dtype), one
    (input channel, kernel offset) at a time to bound memory, on the CPU whatever the device.
    """

    def __init__(self, order: str):
        self.order, self.reduce, self.name = order, SUMMATION_ORDERS[order], f"sum-{order}"

    def weight_grad(self, x, grad_out):
        dtype = np.float32 if x.dtype == torch.float32 else np.float64
        xs = F.pad(x, (PADDING,) * 4).cpu().numpy().astype(dtype, copy=False)
        g = grad_out.cpu().numpy().astype(dtype, copy=False)
        n, c_out, h, w = g.shape
        g_rows = np.ascontiguousarray(g.transpose(1, 0, 2, 3).reshape(c_out, -1))
        out = np.empty((c_out, x.shape[1], KERNEL_SIZE, KERNEL_SIZE), dtype)
        for i in range(x.shape[1]):
            for kh in range(KERNEL_SIZE):
                for kw in range(KERNEL_SIZE):
                    shifted = np.ascontiguousarray(xs[:, i, kh:kh + h, kw:kw + w]).reshape(-1)
                    out[:, i, kh, kw] = self.reduce(g_rows * shifted)
        return torch.from_numpy(out).to(x.device)


def _ordered(order: str):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        return forward_backward(problem, precision, device, conv=OrderedWeightGradConv(order))

    return run


for _order, _text in [("sequential", "left to right over batch·H·W, one float32 accumulator per element"),
                      ("pairwise", "a balanced binary tree over batch·H·W"),
                      ("blocked", "blocks of 256 summed sequentially, then the block sums"),
                      ("kahan", "Kahan-compensated lanes merged by TwoSum")]:
    register(Candidate(name=f"sum-{_order}", description=f"weight gradients summed {_text}", run=_ordered(_order),
                       family="legitimate", expected="roundoff"))


def _layered_native(problem: Problem, precision: str, device: torch.device) -> Result:
    return forward_backward(problem, precision, device)


register(Candidate(name="layered-native", description="the backward written out layer by layer with native kernels "
                   "(not autograd)", run=_layered_native, family="legitimate", expected="roundoff"))


def _micro_batched(problem: Problem, precision: str, device: torch.device) -> Result:
    # gradient accumulation: one image at a time, each loss a mean over its own pixels, averaged
    parts = [forward_backward(Problem(problem.input[b:b + 1], problem.target[b:b + 1], problem.params, problem.seed),
                              precision, device) for b in range(problem.batch)]
    dtype = np.float32 if precision == "float32" else np.float64
    grads = {name: (sum(p.grads[name].astype(dtype) for p in parts) / dtype(len(parts))).astype(dtype) for name in PARAM_NAMES}
    loss = float(np.mean(np.array([p.loss for p in parts], dtype)))
    output = np.concatenate([p.output for p in parts])
    return Result(loss, grads, output, precision, {"conv": "native, micro-batched"})


register(Candidate(name="micro-batched", description="gradient accumulation over single-image micro-batches, averaged",
                   run=_micro_batched, family="legitimate", expected="roundoff"))


def _float64_inside(problem: Problem, precision: str, device: torch.device) -> Result:
    result = forward_backward(problem, "float64", device)
    if precision == "float32":  # the interface hands float32 arrays back
        result.grads = {k: v.astype(np.float32) for k, v in result.grads.items()}
        result.output = result.output.astype(np.float32)
        result.loss, result.dtype = float(np.float32(result.loss)), "float32"
    return result


register(Candidate(name="float64-inside", description="float64 arithmetic behind a float32 interface (results rounded "
                   "to float32)", run=_float64_inside, family="legitimate", expected="roundoff"))


def _tf32(problem: Problem, precision: str, device: torch.device) -> Result:
    if precision == "float64":
        return forward_backward(problem, "float64", device)
    return forward_backward(problem, "float32", device, round_inputs=lambda a: formats.round_to(a, "tf32"))


register(Candidate(name="tf32-claimed", description="TF32 convolution operands, honestly claimed as tf32",
                   run=_tf32, claimed_precision="tf32", family="legitimate", expected="roundoff"))


def _conv_algorithms() -> list[str]:
    try:
        from .. import conv as conv_package
    except ImportError:
        return []
    if not hasattr(conv_package, "get_algorithm"):
        return []
    names = getattr(conv_package, "ALGORITHMS", None) or ("direct", "im2col", "fft", "winograd23", "winograd43")
    return [name for name in names if name != "native"]


def _algorithm(name: str):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        from ..conv import get_algorithm

        return forward_backward(problem, precision, device, conv=get_algorithm(name))

    return run


for _name in _conv_algorithms():
    register(Candidate(name=f"conv-{_name}", description=f"every convolution by the {_name} algorithm of precision_lab.conv",
                       run=_algorithm(_name), family="legitimate", expected="roundoff"))


# ---------------------------------------------------------------------------------------------
# defects inside the computation: a forward + backward with one slip switched on


@dataclass(frozen=True)
class Slips:
    """Mistakes a hand-written backward can make (all off: the seed computation)."""

    relu_mask_missing: bool = False  # input gradient passed through the ReLU unmasked
    mean_missing: bool = False  # ∂loss/∂y = 2r, the 1/N of the mean forgotten
    factor_two_missing: bool = False  # ∂loss/∂y = r/N, the 2 of the square forgotten
    bias_one_sample: bool = False  # bias gradient summed over the first image only
    mask_from_layer_above: bool = False  # layer-1 gradient masked with z2 > 0 instead of z1 > 0
    padding_offset: bool = False  # weight gradient with the input padded (0, 2) instead of (1, 1)
    last_row_skipped: bool = False  # weight-gradient loop over rows stops one short (h < H − 1)


def _slipped_weight_grad(x: torch.Tensor, g: torch.Tensor, slips: Slips) -> torch.Tensor:
    shape = (g.shape[1], x.shape[1], KERNEL_SIZE, KERNEL_SIZE)
    if slips.padding_offset:
        shifted = F.pad(x, (0, 2, 0, 2))  # the halo put on one side: every window one pixel off
        return torch.nn.grad.conv2d_weight(shifted, shape, g, padding=0)
    if slips.last_row_skipped:
        g = g.clone()
        g[:, :, -1, :] = 0
    return torch.nn.grad.conv2d_weight(x, shape, g, padding=PADDING)


def slipped_forward_backward(problem: Problem, dtype: str, device: torch.device, slips: Slips) -> Result:
    """The seed's forward + backward (problem.forward_backward) with `slips` switched on."""
    conv = NativeConv()
    x, t, p = to_tensors(problem, dtype, device)
    with torch.no_grad():
        acts, pres = [x], []
        for k, layer in enumerate(LAYERS):
            z = conv.forward(acts[-1], p[f"{layer}.weight"]) + p[f"{layer}.bias"].view(1, -1, 1, 1)
            pres.append(z)
            if k < len(LAYERS) - 1:
                acts.append(torch.relu(z))
        residual = pres[-1] - t
        loss = torch.mean(residual * residual)
        scale = (1.0 if slips.factor_two_missing else 2.0) / (1 if slips.mean_missing else residual.numel())
        grad = residual * scale
        grads = {}
        for k in reversed(range(len(LAYERS))):
            layer = LAYERS[k]
            grads[f"{layer}.weight"] = _slipped_weight_grad(acts[k], grad, slips)
            grads[f"{layer}.bias"] = (grad[:1] if slips.bias_one_sample else grad).sum(dim=(0, 2, 3))
            if k > 0:
                grad = conv.input_grad(grad, p[f"{layer}.weight"])
                if not slips.relu_mask_missing:
                    mask_source = pres[k] if slips.mask_from_layer_above and k == 1 else pres[k - 1]
                    grad = grad * (mask_source > 0)
    return Result(float(loss), {n: grads[n].cpu().numpy() for n in PARAM_NAMES}, pres[-1].cpu().numpy(), dtype,
                  {"conv": "native", "device": str(device)})


def _slipped(**slip):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        return slipped_forward_backward(problem, precision, device, Slips(**slip))

    return run


for _name, _slip, _text in [
    ("relu-mask-missing", "relu_mask_missing", "the backward passes gradients through the ReLUs unmasked"),
    ("mean-missing", "mean_missing", "∂loss/∂output = 2(y − t): the 1/N of the mean forgotten"),
    ("factor-two-missing", "factor_two_missing", "∂loss/∂output = (y − t)/N: the 2 of the square forgotten"),
    ("bias-one-sample", "bias_one_sample", "bias gradients summed over the first image of the batch only"),
    ("mask-wrong-layer", "mask_from_layer_above", "conv1's gradient masked with conv2's ReLU instead of its own"),
    ("padding-offset", "padding_offset", "weight gradients with the halo on one side (pad 0, 2): windows one pixel off"),
    ("last-row-skipped", "last_row_skipped", "weight-gradient loop over image rows stops one row short"),
]:
    register(Candidate(name=_name, description=_text, run=_slipped(**{_slip: True}), family="defect", expected="defect"))


# ---------------------------------------------------------------------------------------------
# defects on the way out: a right gradient written or read back wrongly


def _rewritten(rewrite):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        result = forward_backward(problem, precision, device)
        result.grads = rewrite(dict(result.grads))
        return result

    return run


def _store_as(layout: str):
    # the program writes the OIHW gradient in `layout` but declares OIHW: the buffer is misread
    def rewrite(grads):
        return {n: (to_layout(g, layout).reshape(g.shape) if n in WEIGHT_NAMES else g) for n, g in grads.items()}

    return rewrite


def _flip_h(grads):
    return {n: (np.ascontiguousarray(g[:, :, ::-1, :]) if n in WEIGHT_NAMES else g) for n, g in grads.items()}


def _wrong_layer(grads):
    # conv1's slot filled with conv3's gradient (same 144 values, reshaped): an index slip
    grads["conv1.weight"] = grads["conv3.weight"].reshape(grads["conv1.weight"].shape).copy()
    return grads


#: the element a lost atomic update hits; its sum is split over SPLIT_K blocks (split-K, as GEMM
#: weight-gradient kernels parallelise batch·H·W) and one block's partial sum is lost
LOST_UPDATE_ELEMENT = (3, 5, 1, 1)
SPLIT_K = 32


def _lost_update(problem: Problem, precision: str, device: torch.device) -> Result:
    trace = forward_backward(problem, precision, device, keep_trace=True)
    o, i, kh, kw = LOST_UPDATE_ELEMENT
    a, g = trace.activations[1], trace.output_grads[1]
    h, w = a.shape[2:]
    # the middle block of SPLIT_K (in batch·H·W order) of one element's sum never lands
    terms = F.pad(a, (PADDING,) * 4)[:, i, kh:kh + h, kw:kw + w].reshape(-1) * g[:, o].reshape(-1)
    block = terms.numel() // SPLIT_K
    lost = float(terms[SPLIT_K // 2 * block:(SPLIT_K // 2 + 1) * block].sum())
    grad = trace.grads["conv2.weight"].copy()
    grad[LOST_UPDATE_ELEMENT] -= lost
    trace.grads["conv2.weight"] = grad
    return Result(trace.loss, trace.grads, trace.output, trace.dtype, trace.meta)


for _name, _rewrite, _expected, _detail, _text in [
    ("weight-grad-transposed-hw", _store_as("OIWH"), "layout", "layout OIWH", "weight gradients written with H and W swapped"),
    ("weight-grad-swapped-in-out", _store_as("IOHW"), "layout", "layout IOHW", "weight gradients written (In, Out, H, W)"),
    ("weight-grad-fortran-order", _store_as("WHIO"), "layout", "layout WHIO",
     "weight gradients written in column-major order (Fortran) but read row-major"),
    ("weight-grad-flip-h", _flip_h, "layout", "flip H", "weight gradients flipped vertically (bottom-up image rows)"),
    ("wrong-layer-gradient", _wrong_layer, "defect", None, "conv1's weight gradient slot filled with conv3's"),
]:
    register(Candidate(name=_name, description=_text, run=_rewritten(_rewrite), family="defect",
                       expected=_expected, expected_detail=_detail))

register(Candidate(name="lost-atomic-update", description="one conv2 weight-gradient element misses one of its 32 "
                   "split-K partial sums (a lost atomic add)", run=_lost_update, family="defect", expected="defect"))


def _bf16(problem: Problem, precision: str, device: torch.device) -> Result:
    if precision == "float64":
        return forward_backward(problem, "float64", device)
    return forward_backward(problem, "float32", device, round_inputs=lambda a: formats.round_to(a, "bfloat16"))


register(Candidate(name="bf16-emulated", description="bfloat16 convolution operands (float32 accumulation), claimed as "
                   "float32", run=_bf16, family="defect", expected="reduced-precision", expected_detail="bfloat16"))

__all__ = ["SUMMATION_ORDERS", "OrderedWeightGradConv", "Slips", "slipped_forward_backward", "sum_blocked",
           "sum_kahan", "sum_pairwise", "sum_sequential", "judge_zoo", "confusion_matrix"]


# ---------------------------------------------------------------------------------------------
# the lab judging its own zoo


def judge_zoo(problem: Problem, device: str | torch.device = "cpu", names: list[str] | None = None):
    """Judge every built-in candidate with an expected verdict: one row each (a tidy DataFrame).

    Columns: candidate, family, expected, expected_detail, verdict, detail, correct, worst_ratio.
    `correct` needs the verdict and, when one is expected, the transform or format it names.
    """
    import pandas as pd

    from ..reference import reference
    from ..verdict import judge
    from . import registry

    from ..errmodel import attach_parameters

    trace = attach_parameters(reference(problem, device), problem.params)
    rows = []
    for candidate in registry().values():
        if candidate.expected is None or not candidate.supports(device) or (names and candidate.name not in names):
            continue
        judgement = judge(candidate.compute(problem, "float32", device), trace, candidate.claimed_precision,
                          candidate.name)
        detail = judgement.layout_fix or judgement.format
        correct = judgement.verdict == candidate.expected and candidate.expected_detail in (None, detail)
        rows.append({"candidate": candidate.name, "family": candidate.family, "expected": candidate.expected,
                     "expected_detail": candidate.expected_detail, "verdict": judgement.verdict, "detail": detail,
                     "correct": correct, "worst_ratio": max(q.bound_ratio for q in judgement.quantities.values())})
    return pd.DataFrame(rows)


def confusion_matrix(table):
    """Expected verdict (rows) × verdict given (columns) counts from `judge_zoo`'s table."""
    import pandas as pd

    from ..verdict import VERDICTS

    return pd.crosstab(table["expected"], table["verdict"]).reindex(index=list(VERDICTS), columns=list(VERDICTS),
                                                                    fill_value=0)
