"""Pools: max_pool2d, avg_pool2d and the global average pool.

Sizes as PyTorch computes them: ⌊(H + 2p − k)/s⌋ + 1 windows (the last rows and columns no window reaches are
dropped: no gradient, no error there), or with ceil_mode ⌈·⌉ + 1, a last partial window, less one that would start
in the right padding. Rounding: max-pool copies values exactly; avg-pool sums each window's in-bounds terms (at most
k²) and divides, its backward up to ⌈k/s⌉² gradients (Higham 2002, §3.1, with the probabilistic γ̃ of roundoff.py);
the adaptive average pool likewise with its own windows (docs/error-model.md, "Pools"). What they do to upstream errors: avg-pool sums them;
max-pool carries the largest error of its window and may *switch* where two inputs lie within their errors of each
other (its gradient then goes to another element: the whole |g| at each contender, deterministically, as a flipped
ReLU; under a reduced claim, a Bernoulli event of its probability: precision_lab.switching).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import (REQUIRED, Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, Rule, as_pair, ceil_div,
               gamma_over_lambda, gather_radius, spread)
from .. import switching
from .onnx_reading import attr, pool_window, require, unary


def _has(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))



def _image(shape, op: str):
    if len(shape) != 3:
        raise OpSpecError(f"{op} needs an image (C, H, W) but receives {len(shape)}-D features (a flatten came before it)")


def _resized(op, attrs, shape):
    """(C, H', W') of an op that sizes each image axis on its own (its `axis_length`), channels kept."""
    _image(shape, op.name)
    return (shape[0],) + tuple(op.axis_length(attrs, [shape[1 + a]], a) for a in (0, 1))


def _listed(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def pool_length(length: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """Windows along one axis as PyTorch counts them (aten pooling_output_shape): floor, or ceil less a last window
    that would start in the right padding."""
    span = length + 2 * padding - kernel
    if not ceil_mode:
        return span // stride + 1
    count = ceil_div(span, stride) + 1
    return count - 1 if (count - 1) * stride >= length + padding else count


def per_window_gamma(counts: torch.Tensor, gamma, dtype) -> torch.Tensor:
    """gamma(n) at each window of `counts` (its terms), formed once per distinct n."""
    out = torch.empty(counts.shape, dtype=dtype)
    for n in torch.unique(counts).tolist():
        out[counts == n] = gamma(int(n))
    return out


class Pool(Op):
    keys = {"kernel": REQUIRED, "stride": None, "padding": 0, "ceil_mode": False}

    def call_inputs(self, tensors, args):
        return tensors[:1]

    #: the functional form's arguments after the input, in order (F.max_pool2d's; F.avg_pool2d's differ)
    call_arguments = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")

    def from_torch_module(self, module):
        if getattr(module, "dilation", 1) not in (1, (1, 1)) or getattr(module, "divisor_override", None) is not None:
            raise OpSpecError(f"{type(module).__name__} with dilation or divisor_override is not supported: "
                              f"use dilation 1 and no divisor_override")
        return {"kernel": _listed(module.kernel_size), "stride": _listed(module.stride),
                "padding": _listed(module.padding), "ceil_mode": bool(module.ceil_mode)}

    def _call_values(self, args, kwargs) -> dict:
        values = dict(zip(self.call_arguments, args[1:]))
        values.update({key: value for key, value in kwargs.items() if key in self.call_arguments})
        if values.get("dilation", 1) not in (1, (1, 1), [1, 1]) or kwargs.get("divisor_override") is not None:
            raise OpSpecError(f"{self.name} with dilation or divisor_override is not supported: "
                              f"use dilation 1 and no divisor_override")
        return values

    def from_torch_call(self, target, args, kwargs):
        values = self._call_values(args, kwargs)
        attrs = {"kernel": _listed(values.get("kernel_size")), "padding": _listed(values.get("padding", 0)),
                 "ceil_mode": bool(values.get("ceil_mode", False))}
        stride = values.get("stride")
        return attrs | ({"stride": _listed(stride)} if stride not in (None, [], ()) else {})

    def from_onnx_node(self, node, graph):
        return unary(node, graph, pool_window(node))

    def check(self, attrs):
        attrs["kernel"] = as_pair(attrs["kernel"], "kernel", 1)
        attrs["stride"] = attrs["kernel"] if attrs["stride"] is None else as_pair(attrs["stride"], "stride", 1)
        attrs["padding"] = as_pair(attrs["padding"], "padding", 0)
        if any(2 * p > k for p, k in zip(attrs["padding"], attrs["kernel"])):
            raise OpSpecError(f"'padding' {list(attrs['padding'])} must be at most half the kernel {list(attrs['kernel'])}")
        if not isinstance(attrs["ceil_mode"], bool):
            raise OpSpecError(f"'ceil_mode' is {attrs['ceil_mode']!r}: expected true or false")
        return attrs

    def out_shape(self, attrs, in_shapes):
        return _resized(self, attrs, in_shapes[0])

    def axis_length(self, attrs, lengths, axis):
        length = lengths[0]
        if length is None:
            return None
        k, s, p = attrs["kernel"][axis], attrs["stride"][axis], attrs["padding"][axis]
        side = ("height", "width")[axis]
        if length + 2 * p < k:
            raise OpSpecError(f"input {side} {length} is smaller than the {k}-pixel pool window: choose a larger "
                              f"image size")
        return pool_length(length, k, s, p, attrs["ceil_mode"])

    def describe(self, attrs):
        k, s = attrs["kernel"], attrs["stride"]
        return f"{self.name} {k[0]}×{k[1]}" + (f"/{s[0]}" if s != k else "") + (" ceil" if attrs["ceil_mode"] else "")

    def _padded(self, attrs, shape) -> tuple[tuple[int, int], tuple[int, int]]:
        """(top, bottom), (left, right) padding that the windows tile: ceil_mode's last partial window reaches past
        the right padding, floor's last rows no window reads stay (unfold drops them)."""
        pads = []
        for axis, length in enumerate(shape[-2:]):
            k, s, p = attrs["kernel"][axis], attrs["stride"][axis], attrs["padding"][axis]
            count = pool_length(length, k, s, p, attrs["ceil_mode"])
            pads.append((p, max(p, (count - 1) * s + k - length - p)))
        return pads[0], pads[1]

    def reach(self, attrs) -> int:
        k, p = attrs["kernel"][0], attrs["padding"][0]
        return max(p, k - 1 - p)

    def _autograd_backward(self, attrs, g, x):
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            (h,) = torch.autograd.grad(self.forward(attrs, [leaf], {}, None), leaf, g)
        return h

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._autograd_backward(attrs, g, xs[0]) if need[0] else None], {}

    def _windows(self, attrs, t, fill: float = 0.0):
        """(N, C, k·k, L): each window's elements (padding filled with `fill`)."""
        n, c = t.shape[:2]
        (top, bottom), (left, right) = self._padded(attrs, t.shape)
        if top or bottom or left or right:
            t = F.pad(t, (left, right, top, bottom), value=fill)
        cols = F.unfold(t, attrs["kernel"], stride=attrs["stride"])
        return cols.view(n, c, attrs["kernel"][0] * attrs["kernel"][1], -1)

    def _fold(self, attrs, windows, shape):
        n, c = windows.shape[:2]
        (top, bottom), (left, right) = self._padded(attrs, shape)
        height, width = shape[-2:]
        folded = F.fold(windows.reshape(n, -1, windows.shape[-1]), (top + height + bottom, left + width + right),
                        attrs["kernel"], stride=attrs["stride"])
        return folded[..., top:top + height, left:left + width]


class MaxPool2d(Pool):
    name = "max_pool2d"
    switches = True

    torch_modules = (torch.nn.MaxPool2d,)
    torch_calls = (F.max_pool2d,)
    onnx_ops = ("MaxPool",)

    def torch_forward(self, attrs, xs, module):
        return self.forward(attrs, xs, {}, None)

    def forward(self, attrs, xs, params, kernels):
        return F.max_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"], ceil_mode=attrs["ceil_mode"])

    def forward_error(self, attrs, ins, y, params, ctx):
        z, error = ins[0].value, ins[0].error
        e = torch.zeros_like(z) if error is None else error
        # contenders: elements whose value could be the window's maximum given the errors (exact ties included)
        values = self._windows(attrs, z, fill=-torch.finfo(z.dtype).max)
        errors = self._windows(attrs, e)
        top, where = values.max(dim=2, keepdim=True)
        top_error = errors.gather(2, where)
        contenders = (values + errors) >= (top - top_error)
        switching = contenders.sum(dim=2) > 1  # (N, C, L): a window the candidate may resolve differently
        count = int(torch.count_nonzero(switching))
        out_error = None if error is None else self.forward(attrs, [error], {}, None)
        memo = {"contenders": contenders * switching.unsqueeze(2), "switch_count": count} if count else {}
        radius = ins[0].radius if error is None else spread(ins[0].radius, self.reach(attrs), attrs["stride"][0])
        return Field(y, out_error, radius, ins[0].flips + count, memo)

    def switch_flips(self, attrs, x, variance, g, samples):
        # a window's gradient goes to another element j instead of its largest m when e_j − e_m crosses x_m − x_j:
        # + g at j, − g at m, with σ(e_j − e_m) ≤ σ_j + σ_m
        values = self._windows(attrs, x, fill=-torch.finfo(x.dtype).max)
        sigmas = self._windows(attrs, variance.sqrt())
        top, where = values.max(dim=2, keepdim=True)
        spread = sigmas + sigmas.gather(2, where)
        p = switching.flip_probability(top - values, spread * spread, samples)
        p = switching.kept(p.scatter(2, where, torch.zeros_like(top)))
        window_grad = g.flatten(2).unsqueeze(2)
        mean, deviation = switching.bernoulli(window_grad.expand_as(p), p)
        variance_w = deviation * deviation
        mean = mean.scatter(2, where, -mean.sum(dim=2, keepdim=True))
        variance_w = variance_w.scatter(2, where, variance_w.sum(dim=2, keepdim=True))
        return (self._fold(attrs, mean, x.shape), self._fold(attrs, variance_w, x.shape).sqrt(),
                switching.expected_flips(p))

    def switch_flips_after_activation(self, attrs, z, variance, g, samples, slope: float):
        """switch_flips for a max pool reading a (leaky) ReLU of `z` that nothing else reads, at the activation's input.

        max(f(z)) = f(max z) for a monotone f, so the pair decides twice on z: which element is the window's largest,
        and whether that largest passes. Judged apart, a window whose elements are all closed is a tie at 0 that the
        reference routes to its first element, where the activation's mask stops it: opening any other element (the
        likeliest is the largest z) would pass the whole window's gradient, which neither op's own model sees.
        Jumps are at z's gradient (the activation's frozen mask must not stop them): element j taking over the
        largest m passes g·f′(z_j) at j, where f′ jumps to 1 only if z_j is also opened, and takes g·f′(z_m) from m;
        the largest opening or closing moves (1 − slope)·g at m."""
        values = self._windows(attrs, z, fill=-torch.finfo(z.dtype).max)
        sigmas = self._windows(attrs, variance.sqrt())
        top, where = values.max(dim=2, keepdim=True)
        top_sigma = sigmas.gather(2, where)
        spread = sigmas + top_sigma
        taken = switching.flip_probability(top - values, spread * spread, samples).scatter(2, where,
                                                                                               torch.zeros_like(top))
        # a closed element passes (1 − slope)·g only if it also opens: the rarer of the two events bounds both
        opened = torch.minimum(taken, switching.flip_probability(values.abs(), sigmas * sigmas, samples))
        opened = torch.where(values > 0, torch.zeros_like(opened), opened)
        top_flips = switching.flip_probability(top.abs(), top_sigma * top_sigma, samples)
        probabilities = switching.kept(torch.cat([taken, opened, top_flips], dim=2))
        k = values.shape[2]
        taken, opened, top_flips = probabilities[:, :, :k], probabilities[:, :, k:2 * k], probabilities[:, :, 2 * k:]
        window_grad = g.flatten(2).unsqueeze(2)
        passes = torch.where(values > 0, torch.ones_like(values), torch.full_like(values, slope))
        top_passes = passes.gather(2, where)
        mean_t, deviation_t = switching.bernoulli(window_grad * passes, taken)
        mean_o, deviation_o = switching.bernoulli(window_grad * (1.0 - slope), opened)
        # what m loses when j takes over: g·f′(z_m), once per j
        mean_l, deviation_l = switching.bernoulli(-window_grad * top_passes, taken)
        jump_top = torch.where(top > 0, -window_grad, window_grad) * (1.0 - slope)
        mean_f, deviation_f = switching.bernoulli(jump_top, top_flips)
        mean = (mean_t + mean_o).scatter(2, where, mean_l.sum(dim=2, keepdim=True) + mean_f)
        variance_w = (deviation_t ** 2 + deviation_o ** 2).scatter(
            2, where, (deviation_l ** 2).sum(dim=2, keepdim=True) + deviation_f ** 2)
        return (self._fold(attrs, mean, z.shape), self._fold(attrs, variance_w, z.shape).sqrt(),
                switching.expected_flips(probabilities))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        x = ins[0].value
        error = self._autograd_backward(attrs, grad.error, x)  # routed to the exact maximum
        flips = self._autograd_backward(attrs, grad.flips, x) if _has(grad.flips) else None
        count = out.memo.get("switch_count", 0)
        if count:
            # a switched window sends its whole gradient elsewhere: |g| + errors at every contender
            whole = g.abs() + grad.error + (grad.flips if grad.flips is not None else 0.0)
            spread_windows = out.memo["contenders"] * whole.flatten(2).unsqueeze(2)
            switched = self._fold(attrs, spread_windows.to(whole.dtype), x.shape)
            flips = switched if flips is None else flips + switched
        radius = gather_radius(grad.radius, self.reach(attrs), attrs["stride"][0])
        return [GradField(error, flips, radius, grad.flip_count + count)], {}


class AvgPool2d(Pool):
    name = "avg_pool2d"
    # PyTorch's flag and default: divide by k² (True) or by the window's in-bounds count (False, as TF's SAME)
    keys = {**Pool.keys, "count_include_pad": True}

    torch_modules = (torch.nn.AvgPool2d,)
    torch_calls = (F.avg_pool2d,)
    onnx_ops = ("AveragePool",)
    call_arguments = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")

    def from_onnx_node(self, node, graph):
        attrs = pool_window(node)
        if any(attrs["padding"]):  # ONNX's default excludes the padding (0), PyTorch's includes it
            attrs["count_include_pad"] = bool(int(attr(node, "count_include_pad", 0)))
        return unary(node, graph, attrs)

    def from_torch_module(self, module):
        attrs = super().from_torch_module(module)
        return attrs if module.count_include_pad else dict(attrs, count_include_pad=False)

    def from_torch_call(self, target, args, kwargs):
        attrs = super().from_torch_call(target, args, kwargs)
        included = self._call_values(args, kwargs).get("count_include_pad", True)
        return attrs if included else dict(attrs, count_include_pad=False)

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        window_sum = self.forward(attrs, [xs[0].abs()], {}, None)
        return self._window_gammas(attrs, xs[0], lambda n: gamma_over_lambda(n + 1, u, lam)) * window_sum

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        overlap = -(-attrs["kernel"][0] // attrs["stride"][0]) * -(-attrs["kernel"][1] // attrs["stride"][1])
        (s_in,), _ = self.backward(attrs, g.abs(), xs, y, {}, kernels, need)
        return [gamma_over_lambda(overlap + 1, u, lam) * s_in]

    def torch_forward(self, attrs, xs, module):
        return self.forward(attrs, xs, {}, None)

    def check(self, attrs):
        if not isinstance(attrs["count_include_pad"], bool):
            raise OpSpecError(f"'count_include_pad' is {attrs['count_include_pad']!r}: expected true or false")
        return super().check(attrs)

    def describe(self, attrs):
        return super().describe(attrs) + ("" if attrs["count_include_pad"] else " (padding not counted)")

    def port_slips(self, attrs, in_shape):
        if not (any(attrs["padding"]) or attrs["ceil_mode"]):
            return []  # every window whole: both divisors are k²
        other = not attrs["count_include_pad"]
        text = ("divides each window by k², padding counted" if other else
                "divides each window by its in-bounds count, padding not counted")
        return [PortSlip("default", text, lambda: OtherAttributes(self, {"count_include_pad": other}), forward=True)]

    def forward(self, attrs, xs, params, kernels):
        # the error model calls this too (on |a| and on errors): S and the divisor follow the flag
        return F.avg_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"], ceil_mode=attrs["ceil_mode"],
                            count_include_pad=attrs["count_include_pad"])

    def _window_gammas(self, attrs, x, gamma) -> torch.Tensor:
        """gamma(n) at each output (H', W'), n the window's in-bounds terms (padding adds exact zeros): k² inside,
        fewer at a padded border or ceil_mode's partial last window."""
        ones = torch.ones((1, 1) + tuple(x.shape[-2:]), dtype=torch.float64)
        counts = F.avg_pool2d(ones, attrs["kernel"], attrs["stride"], attrs["padding"], ceil_mode=attrs["ceil_mode"],
                              divisor_override=1)[0, 0].round().long()
        return per_window_gamma(counts, gamma, x.dtype).to(x.device)

    def forward_error(self, attrs, ins, y, params, ctx):
        a, error = ins[0].value, ins[0].error
        # n additions (the window's in-bounds terms) and one division: γ̃ of n + 1 on the window's Σ|a|/divisor
        total = self._window_gammas(attrs, a, lambda n: ctx.gamma(n + 1)) * self.forward(attrs, [a.abs()], {}, None)
        if error is not None:
            total = total + self.forward(attrs, [error], {}, None)
        radius = 0 if error is None else spread(ins[0].radius, self.reach(attrs), attrs["stride"][0])
        return Field(y, total, radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        x = ins[0].value
        overlap = -(-attrs["kernel"][0] // attrs["stride"][0]) * -(-attrs["kernel"][1] // attrs["stride"][1])
        error = ctx.gamma(overlap + 1) * self._autograd_backward(attrs, g.abs(), x)
        error = error + self._autograd_backward(attrs, grad.error, x)
        flips = self._autograd_backward(attrs, grad.flips, x) if _has(grad.flips) else None
        radius = gather_radius(grad.radius, self.reach(attrs), attrs["stride"][0])
        return [GradField(error, flips, radius, grad.flip_count)], {}


class GlobalAvgPool2d(Op):
    """The mean over each channel's whole image, (C, H, W) → (C, 1, 1): AdaptiveAvgPool2d(1), a mean over H and W.

    Each output is a sum of n = H·W terms that only summation orders compute, then one division: its own part is
    roundoff.order_free_bound (the partial-sum bound of any order plus the absorbed terms, as a bias gradient's)
    up to layers.BIAS_ORDER_FREE_LIMIT terms, γ̃ₙ(λ)·S above, ÷ n, plus u·|y|; the input's errors average."""

    name = "global_avg_pool2d"
    torch_modules = (torch.nn.AdaptiveAvgPool2d,)
    torch_calls = (F.adaptive_avg_pool2d,)
    onnx_ops = ("GlobalAveragePool", "ReduceMean")

    def from_onnx_node(self, node, graph):
        """GlobalAveragePool, or ReduceMean over height and width keeping them (a Keras GlobalAveragePooling2D)."""
        if node.op_type != "ReduceMean":
            return unary(node, graph)
        axes = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else attr(node, "axes")
        require(axes is not None and sorted(int(a) % 4 for a in np.asarray(axes).reshape(-1)) == [2, 3],
                "ReduceMean other than over height and width")
        read = unary(node, graph)
        if not int(attr(node, "keepdims", 1)):  # (N, C) as tf2onnx writes GlobalAveragePooling2D: the pool, flattened
            read.then = [{"op": "flatten"}]  # ops.routing.Flatten, by its registered name
        return read

    def from_torch_module(self, module):
        return self._one(module.output_size)

    def from_torch_call(self, target, args, kwargs):
        return self._one(kwargs.get("output_size", args[1] if len(args) > 1 else None))

    @staticmethod
    def _one(size) -> dict:
        if size not in (1, (1, 1), [1, 1]):
            raise OpSpecError(f"adaptive average pooling to {size!r} is not a global average (1×1): give both output "
                              f"sides as integers for adaptive_avg_pool2d")
        return {}

    def out_shape(self, attrs, in_shapes):
        _image(in_shapes[0], self.name)
        return (in_shapes[0][0], 1, 1)

    def axis_length(self, attrs, lengths, axis):
        return 1

    def torch_forward(self, attrs, xs, module):
        return F.adaptive_avg_pool2d(xs[0], 1)

    def forward(self, attrs, xs, params, kernels):
        return xs[0].mean(dim=(2, 3), keepdim=True)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if not need[0]:
            return [None], {}
        h, w = xs[0].shape[2:]
        return [(g / (h * w)).expand_as(xs[0]).contiguous()], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        from .layers import image_sum_own

        a, error = ins[0].value, ins[0].error
        total = image_sum_own(a, error, ctx).reshape(y.shape) / (a.shape[2] * a.shape[3]) + ctx.u * y.abs()
        if error is not None:
            total = total + error.mean(dim=(2, 3), keepdim=True)
        return Field(y, total, None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        x = ins[0].value
        n = x.shape[2] * x.shape[3]
        # one division per output gradient, broadcast to its image
        error = ((ctx.u * g.abs() + grad.error) / n).expand_as(x).contiguous()
        flips = (grad.flips / n).expand_as(x).contiguous() if _has(grad.flips) else None
        return [GradField(error, flips, None, grad.flip_count)], {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        n = xs[0].shape[2] * xs[0].shape[3]
        return gamma_over_lambda(n + 1, u, lam) * xs[0].abs().mean(dim=(2, 3), keepdim=True)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        n = xs[0].shape[2] * xs[0].shape[3]
        return [(u * g.abs() / n).expand_as(xs[0]) if need[0] else None]


def adaptive_windows(length: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of each of `size` windows over `length` pixels, as PyTorch's adaptive pools cut them:
    start = ⌊i·L/o⌋, end = ⌈(i + 1)·L/o⌉ (overlapping, and repeating pixels when L < o)."""
    return [(i * length // size, ceil_div((i + 1) * length, size)) for i in range(size)]


class AdaptiveAvgPool2d(Op):
    """The average over adaptive windows, (C, H, W) → (C, h, w): AdaptiveAvgPool2d((h, w)) other than 1×1 (that is
    global_avg_pool2d, whose order-free bound reads the whole image).

    Output (i, j) is a sum of n = (end_i − start_i)·(end_j − start_j) terms, then one division: γ̃ of n + 1 on the
    window's Σ|a|/n (Higham 2002, §3.1, as avg_pool2d); the input gradient at p sums g/n over the m windows that
    hold p: γ̃ of m + 1 on that sum of |g|/n. Upstream errors average, as the forward."""

    name = "adaptive_avg_pool2d"
    keys = {"size": REQUIRED}
    torch_modules = (torch.nn.AdaptiveAvgPool2d,)
    torch_calls = (F.adaptive_avg_pool2d,)

    _autograd_backward = Pool._autograd_backward

    def from_torch_module(self, module):
        return self._read(module.output_size)

    def from_torch_call(self, target, args, kwargs):
        return self._read(kwargs.get("output_size", args[1] if len(args) > 1 else None))

    @staticmethod
    def _read(size) -> dict:
        pair = size if isinstance(size, (tuple, list)) else (size, size)
        if any(side is None for side in pair):
            raise OpSpecError(f"adaptive average pooling to {size!r}: a side of None (keep the input's) is not "
                              f"supported: give both output sides")
        return {"size": list(pair)}

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def check(self, attrs):
        attrs["size"] = as_pair(attrs["size"], "size", 1)
        return attrs

    def out_shape(self, attrs, in_shapes):
        return _resized(self, attrs, in_shapes[0])

    def axis_length(self, attrs, lengths, axis):
        return None if lengths[0] is None else attrs["size"][axis]

    def describe(self, attrs):
        return f"{self.name} → {attrs['size'][0]}×{attrs['size'][1]}"

    def torch_forward(self, attrs, xs, module):
        return F.adaptive_avg_pool2d(xs[0], attrs["size"])

    def forward(self, attrs, xs, params, kernels):
        return F.adaptive_avg_pool2d(xs[0], attrs["size"])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._autograd_backward(attrs, g, xs[0]) if need[0] else None], {}

    def _gammas(self, attrs, x, gamma, per_input: bool) -> torch.Tensor:
        """gamma(n) at each output (its window's terms), or with `per_input` gamma(m) at each input pixel (the
        windows that hold it)."""
        counts = []
        for axis in (0, 1):
            length = x.shape[2 + axis]
            windows = adaptive_windows(length, attrs["size"][axis])
            if per_input:
                counts.append(torch.tensor([sum(a <= q < b for a, b in windows) for q in range(length)]))
            else:
                counts.append(torch.tensor([b - a for a, b in windows]))
        return per_window_gamma(torch.outer(*counts), gamma, x.dtype).to(x.device)

    def forward_error(self, attrs, ins, y, params, ctx):
        a, error = ins[0].value, ins[0].error
        total = self._gammas(attrs, a, lambda n: ctx.gamma(n + 1), False) * self.forward(attrs, [a.abs()], {}, None)
        if error is not None:
            total = total + self.forward(attrs, [error], {}, None)
        # a window spans up to ⌈H/h⌉ + 1 pixels: the output grid's radius is read as anywhere, as a global pool's
        return Field(y, total, None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        x = ins[0].value
        error = self._gammas(attrs, x, lambda m: ctx.gamma(m + 1), True) * self._autograd_backward(attrs, g.abs(), x)
        error = error + self._autograd_backward(attrs, grad.error, x)
        flips = self._autograd_backward(attrs, grad.flips, x) if _has(grad.flips) else None
        return [GradField(error, flips, None, grad.flip_count)], {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        window_sum = self.forward(attrs, [xs[0].abs()], {}, None)
        return self._gammas(attrs, xs[0], lambda n: gamma_over_lambda(n + 1, u, lam), False) * window_sum

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        if not need[0]:
            return [None]
        s_in = self._autograd_backward(attrs, g.abs(), xs[0])
        return [self._gammas(attrs, xs[0], lambda m: gamma_over_lambda(m + 1, u, lam), True) * s_in]

    def port_slips(self, attrs, in_shape):
        in_size = tuple(in_shape[-2:])
        fixed = FixedWindows(self, in_size).windows(attrs)
        if all(fixed[axis] == adaptive_windows(in_size[axis], attrs["size"][axis]) for axis in (0, 1)):
            return []  # the same windows (h divides H, or 3 → 2): no port differs
        return [PortSlip("routing", "pools with fixed windows (stride ⌊H/h⌋, kernel H − (h − 1)·stride) instead of "
                         "PyTorch's adaptive ones", lambda: FixedWindows(self, in_size), forward=True)]


class FixedWindows(Rule):
    """An adaptive average pool computed as an avg_pool2d of stride ⌊H/h⌋ and kernel H − (h − 1)·stride (what
    exporters and hand ports write, right only when h divides H)."""

    def __init__(self, op, in_size):
        self.op, self.in_size = op, in_size

    def _attrs(self, attrs):
        strides = [length // size for length, size in zip(self.in_size, attrs["size"])]
        kernels = [length - (size - 1) * s for length, size, s in zip(self.in_size, attrs["size"], strides)]
        return {"kernel": kernels, "stride": strides}

    def windows(self, attrs) -> list[list[tuple[int, int]]]:
        """(start, end) of each window along each axis."""
        fixed = self._attrs(attrs)
        return [[(i * s, i * s + k) for i in range(size)]
                for size, s, k in zip(attrs["size"], fixed["stride"], fixed["kernel"])]

    def forward(self, attrs, xs, params, kernels):
        fixed = self._attrs(attrs)
        return F.avg_pool2d(xs[0], fixed["kernel"], fixed["stride"])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [Pool._autograd_backward(self, attrs, g, xs[0]) if need[0] else None], {}
