"""The defect zoo and the legitimate variants: built-in candidates that test the lab itself.

Every candidate runs on the problem's own network (precision_lab.compute), with one thing
changed: a legitimate variant computes the same gradients another valid way (summation order of
the weight-gradient reductions, split-K partial sums in a shuffled order, micro-batching, float64
inside a float32 interface, TF32 claimed as TF32, the convolution algorithms of
`precision_lab.conv`) and must be judged ``roundoff``; a defect keeps the look of a working
implementation (every shape right, loss right) and must be judged as its `expected` class,
naming the transform or format in `expected_detail`. `applies` says which networks a candidate
means something for (a missing ReLU mask needs a ReLU).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .. import formats
from ..compute import Result, forward_backward
from ..layout import to_layout
from ..ops import LOSSES, OPS, BackwardReplaced, Kernels, is_seed_conv
from ..ops.layers import Conv2d
from ..ops.losses import MSE, CrossEntropy
from ..ops.pointwise import ReLU, masked_by
from ..ops.routing import Add, UpsampleNearest
from ..problem import Problem
from . import Candidate, builtin, register  # noqa: F401 - builtin first: registry() loads only when empty
from .builtin import emulated

# ---------------------------------------------------------------------------------------------
# summation orders of the weight-gradient reductions (vectorised over output elements)


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
    if n <= block:  # one block: the same sum, without padding a batch of 2 out to 256 terms
        return sum_sequential(terms)
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


def sum_signs_apart(terms: np.ndarray) -> np.ndarray:
    """Σ along the last axis in two accumulators, the positive terms in one and the negative in the other, each left
    to right, added at the end: the order whose partial sums climb highest (to S₊ and S₋, not ~√n as cancelling
    terms in raster order do), which a bound that holds for every summation order has to cover."""
    zero = terms.dtype.type(0)
    return sum_sequential(np.where(terms > 0, terms, zero)) + sum_sequential(np.where(terms < 0, terms, zero))


SUMMATION_ORDERS = {"sequential": sum_sequential, "pairwise": sum_pairwise, "blocked": sum_blocked,
                    "kahan": sum_kahan, "signs-apart": sum_signs_apart}


class OrderedWeightGrad:
    """Weight gradients summed over batch·H_out·W_out (conv2d) or batch (linear) in a chosen order.

    Terms are formed as the hardware would (products rounded to the working dtype), one input
    channel at a time (its kh·kw taps together) to bound memory, on the CPU whatever the device.
    """

    def __init__(self, order: str):
        self.order, self.reduce, self.name = order, SUMMATION_ORDERS[order], f"sum-{order}"

    def conv(self, x, g, attrs, weight_shape):
        dtype = np.float32 if x.dtype == torch.float32 else np.float64
        c_out, per_group, kh, kw = weight_shape
        outs_per_group = c_out // attrs["groups"]
        g_np = g.cpu().numpy().astype(dtype, copy=False)
        out = np.empty(weight_shape, dtype)
        for c in range(x.shape[1]):
            group = c // per_group
            cols = F.unfold(x[:, c:c + 1], attrs["kernel"], dilation=attrs["dilation"], padding=attrs["padding"],
                            stride=attrs["stride"]).cpu().numpy().astype(dtype, copy=False)  # (N, kh·kw, L)
            outs = slice(group * outs_per_group, (group + 1) * outs_per_group)
            g_rows = np.ascontiguousarray(g_np[:, outs].reshape(g_np.shape[0], outs_per_group, -1)
                                          .transpose(1, 0, 2).reshape(outs_per_group, -1))
            taps = np.ascontiguousarray(cols.transpose(1, 0, 2).reshape(kh * kw, -1))
            for tap in range(kh * kw):
                out[outs, c - group * per_group, tap // kw, tap % kw] = self.reduce(g_rows * taps[tap])
        return torch.from_numpy(out).to(x.device)

    def linear(self, x, g):
        dtype = np.float32 if x.dtype == torch.float32 else np.float64
        x_np, g_np = x.cpu().numpy().astype(dtype, copy=False), g.cpu().numpy().astype(dtype, copy=False)
        terms = g_np.T[:, None, :] * x_np.T[None, :, :]  # (O, I, N)
        return torch.from_numpy(self.reduce(terms)).to(x.device)


class SplitKWeightGrad:
    """Weight gradients as `parts` partial sums over bands of output rows (conv2d) or batch chunks
    (linear), added in a shuffled order: how GEMM kernels split a long reduction (split-K) and
    combine the partial results in whatever order their blocks finish."""

    def __init__(self, parts: int = 32, seed: int = 1):
        self.parts, self.seed, self.name = parts, seed, f"split-k{parts}"

    def _shuffled_sum(self, partials):
        order = np.random.default_rng(self.seed).permutation(len(partials))
        total = partials[order[0]].clone()
        for i in order[1:]:
            total += partials[i]
        return total

    def conv(self, x, g, attrs, weight_shape):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (attrs[k] for k in ("kernel", "stride", "padding", "dilation"))
        padded = F.pad(x, (pw, pw, ph, ph))
        height = g.shape[2]
        bands = np.array_split(np.arange(height), min(self.parts, height))
        partials = []
        for band in bands:
            if len(band) == 0:
                continue
            r0, r1 = int(band[0]), int(band[-1]) + 1
            rows = padded[:, :, r0 * sh:(r1 - 1) * sh + dh * (kh - 1) + 1]
            partials.append(torch.nn.grad.conv2d_weight(rows, weight_shape, g[:, :, r0:r1].contiguous(), (sh, sw),
                                                        (0, 0), (dh, dw), attrs["groups"]))
        return self._shuffled_sum(partials)

    def linear(self, x, g):
        chunks = np.array_split(np.arange(x.shape[0]), min(self.parts, x.shape[0]))
        return self._shuffled_sum([g[c[0]:c[-1] + 1].T @ x[c[0]:c[-1] + 1] for c in chunks if len(c)])


def _with_kernels(kernels: Kernels):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        return forward_backward(problem, precision, device, kernels=kernels)

    return run


for _order, _text in [("sequential", "left to right, one accumulator per element"),
                      ("pairwise", "by a balanced binary tree"),
                      ("blocked", "in blocks of 256 summed sequentially, then the block sums"),
                      ("kahan", "in Kahan-compensated lanes merged by TwoSum")]:
    register(Candidate(name=f"sum-{_order}", description=f"weight gradients summed over batch·H·W {_text}",
                       run=_with_kernels(Kernels(weight_grad=OrderedWeightGrad(_order), name=f"sum-{_order}")),
                       family="legitimate", expected="roundoff"))

register(Candidate(name="split-k", description="weight gradients as 32 partial sums over row bands, added in a "
                   "shuffled order (split-K)", run=_with_kernels(Kernels(weight_grad=SplitKWeightGrad(), name="split-k")),
                   family="legitimate", expected="roundoff"))

register(Candidate(name="layered-native", description="the backward written out layer by layer with native kernels "
                   "(not autograd)", run=_with_kernels(Kernels()), family="legitimate", expected="roundoff"))


def _bias_summed(reduce):
    """A backward whose bias gradients are `reduce` of each channel's terms (batch, then H, W: raster order)."""

    def backward(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        if "bias" in param_grads:
            # one row of terms per channel: (N, C, H, W) by channel, features (N, F) and tokens (N, T, F) by the last axis
            rows = g.movedim(1, 0).reshape(g.shape[1], -1) if g.dim() == 4 else g.reshape(-1, g.shape[-1]).T
            param_grads["bias"] = torch.from_numpy(reduce(rows.detach().cpu().numpy()).copy()).to(g.device)
        return grads, param_grads

    return backward


#: the ops with a bias gradient (a per-channel sum over batch and pixels)
_BIASED = tuple(name for name, op in OPS.items() if "bias" in op.keys)

# a loop (or atomics) with one accumulator per channel: the order that stagnates on repeated values
_bias_sequential = _bias_summed(sum_sequential)


register(Candidate(name="bias-sequential", description="bias gradients summed over batch·H·W left to right, one "
                   "accumulator per channel (a loop, or atomics)",
                   run=lambda problem, precision, device: forward_backward(
                       problem, precision, device,
                       rules={op: BackwardReplaced(OPS[op], _bias_sequential) for op in _BIASED}),
                   family="legitimate", expected="roundoff", applies=lambda n: bool(n.bias_names)))


class _SignsApartLoss:
    """The loss's mean over positions as sum_signs_apart of the per-position terms (all ≥ 0: one running sum, left
    to right, the sum whose partial sums grow the most), ÷ their count; its gradient as the loss computes it."""

    def __init__(self, loss):
        self.loss = loss

    def forward_backward(self, y: torch.Tensor, t: torch.Tensor, in_place: bool = False):
        _, grad = self.loss.forward_backward(y, t, in_place=False)
        if isinstance(self.loss, MSE):
            residual = y - t
            terms = residual * residual
        else:  # cross-entropy: log-sum-exp minus the target's logit at each position
            _, _, _, lse, z_t = self.loss._parts(y, t)
            terms = lse - z_t
        total = sum_signs_apart(terms.detach().reshape(1, -1).cpu().numpy())[0]
        count = self.loss.positions(y)
        return torch.tensor(total, dtype=y.dtype, device=y.device) / count, grad


class _SignsApartKernels(Kernels):
    """Linear layers' forward and input-gradient sums (over the fan-in, the fan-out) in sum_signs_apart's order,
    the products rounded to the working dtype; convolutions' forward and input gradients stay native."""

    @staticmethod
    def _sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(…, J) from a (…, K) and b (J, K): Σ_k a_bk·b_jk, the terms in sum_signs_apart's order (tokens: row by row)."""
        a_np, b_np = a.detach().reshape(-1, a.shape[-1]).cpu().numpy(), b.detach().cpu().numpy()
        sums = torch.from_numpy(sum_signs_apart(a_np[:, None, :] * b_np[None, :, :]).copy()).to(a.device)
        return sums.reshape(*a.shape[:-1], b.shape[0])

    def linear_forward(self, x, w):
        return self._sums(x, w)

    def linear_input_grad(self, g, w):
        return self._sums(g, w.T)


def _sums_signs_apart(problem: Problem, precision: str, device: torch.device) -> Result:
    rules = {op: BackwardReplaced(OPS[op], _bias_summed(sum_signs_apart)) for op in _BIASED}
    rules["loss"] = _SignsApartLoss(LOSSES[problem.network.loss])
    kernels = _SignsApartKernels(weight_grad=OrderedWeightGrad("signs-apart"), name="sums-signs-apart")
    return forward_backward(problem, precision, device, rules=rules, kernels=kernels)


register(Candidate(name="sums-signs-apart", description="weight and bias gradients summed over batch·H·W, linear layers' "
                   "outputs and input gradients, and the loss over positions, with the positive and the negative terms in "
                   "two accumulators: the order whose partial sums climb highest", run=_sums_signs_apart,
                   family="legitimate", expected="roundoff"))


def _micro_batched(problem: Problem, precision: str, device: torch.device) -> Result:
    # gradient accumulation: one image at a time, each loss a mean over its own positions, averaged
    parts = [forward_backward(problem.with_batch(b, b + 1), precision, device) for b in range(problem.batch)]
    dtype = np.float32 if precision == "float32" else np.float64
    grads = {name: (sum(p.grads[name].astype(dtype) for p in parts) / dtype(len(parts))).astype(dtype)
             for name in problem.network.parameter_names}
    loss = float(np.mean(np.array([p.loss for p in parts], dtype)))
    output = np.concatenate([p.output for p in parts])
    return Result(loss, grads, output, precision, {"conv": "native, micro-batched"})


# a network whose samples meet (training-mode batch statistics) computes another function on each micro-batch
register(Candidate(name="micro-batched", description="gradient accumulation over single-image micro-batches, averaged",
                   run=_micro_batched, family="legitimate", expected="roundoff",
                   applies=lambda network: not network.couples_batch))


def _float64_inside(problem: Problem, precision: str, device: torch.device) -> Result:
    result = forward_backward(problem, "float64", device)
    if precision == "float32":  # the interface hands float32 arrays back
        result.grads = {k: v.astype(np.float32) for k, v in result.grads.items()}
        result.output = result.output.astype(np.float32)
        result.loss, result.dtype = float(np.float32(result.loss)), "float32"
    return result


register(Candidate(name="float64-inside", description="float64 arithmetic behind a float32 interface (results rounded "
                   "to float32)", run=_float64_inside, family="legitimate", expected="roundoff"))

# where its worst-case bound exceeds half a quantity (the seed network's first layer, docs/verdicts.md) it is
# inconclusive, which Candidate.accepts counts as right: never a defect
register(Candidate(name="tf32-claimed", description="TF32 operands, honestly claimed as tf32", run=emulated("tf32"),
                   claimed_precision="tf32", family="legitimate", expected="roundoff"))


def _has_seed_conv(network) -> bool:
    return any(OPS[layer.op].windowed and is_seed_conv(layer.attrs) for layer in network.layers)


def _algorithm(name: str):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        from ..conv import get_algorithm

        return forward_backward(problem, precision, device, kernels=Kernels(conv=get_algorithm(name), name=name))

    return run


def _conv_algorithms() -> list[str]:
    from ..conv import ALGORITHMS

    return list(ALGORITHMS)


for _name in _conv_algorithms():
    register(Candidate(name=f"conv-{_name}", description=f"every 3×3 convolution by the {_name} algorithm of "
                       f"precision_lab.conv", run=_algorithm(_name), family="legitimate", expected="roundoff",
                       applies=_has_seed_conv))


# ---------------------------------------------------------------------------------------------
# defects inside the computation: one op's rule replaced


def _slipped(rules_for):
    """A candidate run with the rules `rules_for(network)` returns (op name or layer index → rule)."""
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        return forward_backward(problem, precision, device, rules=rules_for(problem.network))

    return run


def _relu_layers(network):
    return [layer for layer in network.layers if layer.op == ReLU.name]


def _unmasked(op, attrs, g, xs, y, params, kernels, need):
    return [g], {}


def _bias_one_sample(op, attrs, g, xs, y, params, kernels, need):
    grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
    if "bias" in param_grads:
        # every axis but the channels (dim 1 of an image) or the features (the last of features and tokens)
        param_grads["bias"] = g[:1].sum(dim=(0, 2, 3)) if g.dim() == 4 else g[:1].reshape(-1, g.shape[-1]).sum(dim=0)
    return grads, param_grads


def _shifted_windows(op, attrs, g, xs, y, params, kernels, need):
    # the halo put on one side: every window one pixel off (x[i + 1] where x[i] belongs)
    grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
    shifted = torch.zeros_like(xs[0])
    shifted[:, :, :-1, :-1] = xs[0][:, :, 1:, 1:]
    param_grads["weight"] = kernels.conv_weight_grad(shifted, g, attrs, tuple(params["weight"].shape))
    return grads, param_grads


def _edge_skipped(row: bool, first: bool):
    def backward(op, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
        clipped = g.clone()
        index = 0 if first else -1
        if row:
            clipped[:, :, index, :] = 0
        else:
            clipped[:, :, :, index] = 0
        param_grads["weight"] = kernels.conv_weight_grad(xs[0], clipped, attrs, tuple(params["weight"].shape))
        return grads, param_grads

    return backward


def _first_conv(network):
    return next((layer for layer in network.layers if OPS[layer.op].windowed), None)


def _convs(network):
    return [layer for layer in network.layers if OPS[layer.op].windowed]


def _loss_rule(scale_of):
    """The loss with its gradient scaled by scale_of(y): a forgotten 1/N or 2."""
    class Scaled:
        def __init__(self, base):
            self.base = base

        def forward_backward(self, y, t, in_place=False):
            loss, grad = self.base.forward_backward(y, t)
            return loss, grad * scale_of(self.base, y)

    return Scaled


def _loss_slip(scale_of):
    def rules_for(network):
        return {"loss": _loss_rule(scale_of)(LOSSES[network.loss])}

    return rules_for


class _SummedCrossEntropy:
    """cross_entropy summed over positions instead of averaged: loss and gradient both × count."""

    def __init__(self, base):
        self.base = base

    def forward_backward(self, y, t, in_place=False):
        loss, grad = self.base.forward_backward(y, t)
        count = self.base.positions(y)
        return loss * count, grad * count


class _MaskFromOther:
    """A ReLU whose backward uses another ReLU's mask (recorded from that ReLU's input in this forward)."""

    forward_inplace = None
    derive_output = None
    derive_input_grad = None
    backward_inplace = None

    def __init__(self, store: dict, key: str, record: bool):
        self.store, self.key, self.record = store, key, record

    def forward(self, attrs, xs, params, kernels):
        if self.record:
            self.store[self.key] = xs[0]
        return torch.relu(xs[0])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        source = self.store[self.key] if not self.record else xs[0]
        return [masked_by(g, source)], {}


def _mask_wrong_layer(network):
    relus = _relu_layers(network)
    first = relus[0]
    other = next(layer for layer in relus[1:] if _same_shape(network, first, layer))
    store = {}
    return {first.index: _MaskFromOther(store, "z", record=False), other.index: _MaskFromOther(store, "z", record=True)}


def _same_shape(network, a, b) -> bool:
    try:
        shapes = network.shapes(32, 32)
    except Exception:  # noqa: BLE001 - a network that cannot take 32×32: compare symbolically
        shapes = None
    if shapes is None:
        return False
    return shapes[a.inputs[0]] == shapes[b.inputs[0]]


def _two_relus_alike(network) -> bool:
    relus = _relu_layers(network)
    return len(relus) >= 2 and any(_same_shape(network, relus[0], other) for other in relus[1:])


def _upsample_first_only(op, attrs, g, xs, y, params, kernels, need):
    # each block's gradient taken from its top-left element only (a strided read instead of a sum)
    sh, sw = attrs["scale"]
    return [g[:, :, ::sh, ::sw].contiguous() if need[0] else None], {}


def _skip_no_gradient(op, attrs, g, xs, y, params, kernels, need):
    # the add's backward forgets the branch named by `from`
    return [g if need[0] else None, torch.zeros_like(g) if need[1] else None], {}


def _has_op(name):
    return lambda network: any(layer.op == name for layer in network.layers)


for _name, _rules, _applies, _expected, _text in [
    ("relu-mask-missing", lambda n: {ReLU.name: BackwardReplaced(OPS[ReLU.name], _unmasked)}, lambda n: bool(_relu_layers(n)),
     "defect", "the backward passes gradients through the ReLUs unmasked"),
    ("mean-missing", _loss_slip(lambda base, y: base.positions(y) if isinstance(base, CrossEntropy) else y.numel()),
     None, "defect", "∂loss/∂output without the 1/N of the mean"),
    ("factor-two-missing", _loss_slip(lambda base, y: 0.5), lambda n: n.loss == MSE.name, "defect",
     "∂loss/∂output = (y − t)/N: the 2 of the square forgotten"),
    ("bias-one-sample", lambda n: {op: BackwardReplaced(OPS[op], _bias_one_sample) for op in _BIASED},
     lambda n: bool(n.bias_names), "defect", "bias gradients summed over the first image of the batch only"),
    ("mask-wrong-layer", _mask_wrong_layer, _two_relus_alike, "defect",
     "the first ReLU's backward uses another ReLU's mask"),
    ("padding-offset", lambda n: {Conv2d.name: BackwardReplaced(OPS[Conv2d.name], _shifted_windows)}, lambda n: bool(_convs(n)),
     "defect", "weight gradients with the halo on one side: windows one pixel off"),
    ("last-row-skipped", lambda n: {Conv2d.name: BackwardReplaced(OPS[Conv2d.name], _edge_skipped(row=True, first=False))},
     lambda n: bool(_convs(n)), "defect", "weight-gradient loop over image rows stops one row short"),
    ("first-column-skipped", lambda n: {_first_conv(n).index: BackwardReplaced(OPS[Conv2d.name], _edge_skipped(row=False, first=True))},
     lambda n: bool(_convs(n)), "defect", "the first convolution's weight gradient ignores the first image column"),
    ("upsample-backward-first-only", lambda n: {UpsampleNearest.name: BackwardReplaced(OPS[UpsampleNearest.name], _upsample_first_only)},
     _has_op(UpsampleNearest.name), "defect", "upsample backward takes each block's first gradient instead of their sum"),
    ("skip-no-gradient", lambda n: {Add.name: BackwardReplaced(OPS[Add.name], _skip_no_gradient)}, _has_op(Add.name), "defect",
     "the skip connection (add's `from`) gets no gradient"),
    ("cross-entropy-summed", lambda n: {"loss": _SummedCrossEntropy(LOSSES[CrossEntropy.name])},
     lambda n: n.loss == CrossEntropy.name, "defect", "cross-entropy summed over samples instead of averaged"),
]:
    register(Candidate(name=_name, description=_text, run=_slipped(_rules), family="defect", expected=_expected,
                       applies=_applies))


# ---------------------------------------------------------------------------------------------
# defects on the way out: a right gradient written or read back wrongly


def _rewritten(rewrite):
    def run(problem: Problem, precision: str, device: torch.device) -> Result:
        result = forward_backward(problem, precision, device)
        result.grads = rewrite(problem.network, dict(result.grads))
        return result

    return run


def _store_as(layout: str):
    # the program writes the OIHW gradient in `layout` but declares OIHW: the buffer is misread
    def rewrite(network, grads):
        return {n: (to_layout(g, layout).reshape(g.shape) if g.ndim == 4 else g) for n, g in grads.items()}

    return rewrite


def _flip_h(network, grads):
    return {n: (np.ascontiguousarray(g[:, :, ::-1, :]) if g.ndim == 4 else g) for n, g in grads.items()}


def _flip_hw(network, grads):
    return {n: (np.ascontiguousarray(g[:, :, ::-1, ::-1]) if g.ndim == 4 else g) for n, g in grads.items()}


def _same_size_weights(network):
    weights = network.weight_names
    return next(((a, b) for a in weights for b in weights if a != b
                 and math.prod(network.param_shapes[a]) == math.prod(network.param_shapes[b])), None)


def _wrong_layer(network, grads):
    # one weight slot filled with another's gradient of the same size (reshaped): an index slip
    first, other = _same_size_weights(network)
    grads[first] = grads[other].reshape(grads[first].shape).copy()
    return grads


def _kernel_with(network, test) -> bool:
    return any(len(s) == 4 and test(s) for s in network.param_shapes.values())


for _name, _rewrite, _applies, _expected, _detail, _text in [
    ("weight-grad-transposed-hw", _store_as("OIWH"), lambda n: _kernel_with(n, lambda s: s[2] > 1 or s[3] > 1),
     "layout", "layout OIWH", "weight gradients written with H and W swapped"),
    ("weight-grad-swapped-in-out", _store_as("IOHW"), lambda n: _kernel_with(n, lambda s: s[0] > 1 and s[1] > 1),
     "layout", "layout IOHW", "weight gradients written (In, Out, H, W)"),
    ("weight-grad-fortran-order", _store_as("WHIO"), lambda n: _kernel_with(n, lambda s: s[2] * s[3] > 1),
     "layout", "layout WHIO", "weight gradients written in column-major order (Fortran) but read row-major"),
    ("weight-grad-flip-h", _flip_h, lambda n: _kernel_with(n, lambda s: s[2] > 1), "layout", "flip H",
     "weight gradients flipped vertically (bottom-up image rows)"),
    ("weight-grad-flip-hw", _flip_hw, lambda n: _kernel_with(n, lambda s: s[2] > 1 and s[3] > 1), "layout", "flip HW",
     "weight gradients flipped in H and W (a convolution where a correlation belongs)"),
    ("wrong-layer-gradient", _wrong_layer, lambda n: _same_size_weights(n) is not None, "defect", None,
     "a weight gradient slot filled with another layer's"),
]:
    register(Candidate(name=_name, description=_text, run=_rewritten(_rewrite), family="defect",
                       expected=_expected, expected_detail=_detail, applies=_applies))


#: a lost atomic update: one element's sum is split over SPLIT_K blocks (split-K, as GEMM weight-gradient
#: kernels parallelise batch·H·W) and one block's partial sum is lost
LOST_UPDATE_ELEMENT = (3, 5, 1, 1)
SPLIT_K = 32


def _lost_update_layer(network):
    convs = [layer for layer in _convs(network) if layer.attrs["groups"] == 1]
    return max(convs, key=lambda layer: layer.attrs["in"] * layer.attrs["out"]) if convs else None


def _lost_update(problem: Problem, precision: str, device: torch.device) -> Result:
    network = problem.network
    layer = _lost_update_layer(network)
    trace = forward_backward(problem, precision, device, keep_trace=True)
    shape = network.param_shapes[f"{layer.name}.weight"]
    element = tuple(min(i, s - 1) for i, s in zip(LOST_UPDATE_ELEMENT, shape))
    o, i, kh, kw = element
    a, g = trace.value(layer.inputs[0]), trace.grad_at(layer.index)
    attrs = layer.attrs
    cols = F.unfold(a[:, i:i + 1], attrs["kernel"], dilation=attrs["dilation"], padding=attrs["padding"],
                    stride=attrs["stride"])[:, kh * attrs["kernel"][1] + kw]  # (N, L)
    terms = (cols * g[:, o].reshape(g.shape[0], -1)).reshape(-1)
    block = max(1, terms.numel() // SPLIT_K)
    partials = terms[:block * (terms.numel() // block)].reshape(-1, block).sum(dim=1)
    # the block whose loss shows: behind a max-pool or a ReLU most blocks can sum to zero, and losing nothing is no bug
    lost = float(partials[int(torch.argmax(partials.abs()))])
    name = f"{layer.name}.weight"
    grad = trace.grads[name].copy()
    grad[element] -= lost
    grads = dict(trace.grads, **{name: grad})
    return Result(trace.loss, grads, trace.output, trace.dtype, trace.meta)


register(Candidate(name="lost-atomic-update", description="one weight-gradient element misses one of its 32 "
                   "split-K partial sums (a lost atomic add)", run=_lost_update, family="defect", expected="defect",
                   applies=lambda n: _lost_update_layer(n) is not None))

register(Candidate(name="bf16-emulated", description="bfloat16 operands (float32 accumulation), claimed as float32",
                   run=emulated("bfloat16"), family="defect", expected="reduced-precision", expected_detail="bfloat16"))

register(Candidate(name="tf32-weight-grad-only", description="TF32 operands in the weight-gradient sums only "
                   "(cuDNN's TF32 in backward-filter kernels), claimed as float32",
                   run=emulated("tf32", passes=("weight_grad",)), family="defect", expected="reduced-precision",
                   expected_detail="tf32"))

__all__ = ["SUMMATION_ORDERS", "OrderedWeightGrad", "SplitKWeightGrad", "sum_blocked", "sum_kahan", "sum_pairwise",
           "sum_sequential"]
