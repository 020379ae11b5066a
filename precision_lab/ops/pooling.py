"""Pools: max_pool2d, avg_pool2d and the global average pool.

Rounding: max-pool copies values exactly; avg-pool sums k² terms and divides, its backward up to ⌈k/s⌉² gradients
(Higham 2002, §3.1, with the probabilistic γ̃ of roundoff.py). What they do to upstream errors: avg-pool sums them;
max-pool carries the largest error of its window and may *switch* where two inputs lie within their errors of each
other (its gradient then goes to another element: the whole |g| at each contender, deterministically, as a flipped
ReLU; under a reduced claim, a Bernoulli event of its probability: precision_lab.switching).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import REQUIRED, Field, GradField, Op, OpSpecError, as_pair, gamma_over_lambda, gather_radius, spread
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


class Pool(Op):
    keys = {"kernel": REQUIRED, "stride": None, "padding": 0}

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_module(self, module):
        if module.ceil_mode or getattr(module, "dilation", 1) not in (1, (1, 1)) or getattr(
                module, "divisor_override", None) is not None:
            raise OpSpecError(f"{type(module).__name__} with ceil_mode, dilation or divisor_override is not supported")
        return {"kernel": _listed(module.kernel_size), "stride": _listed(module.stride),
                "padding": _listed(module.padding)}

    def from_torch_call(self, target, args, kwargs):
        kernel = kwargs.get("kernel_size", args[1] if len(args) > 1 else None)
        stride = kwargs.get("stride", args[2] if len(args) > 2 else None)
        return {"kernel": _listed(kernel)} | ({"stride": _listed(stride)} if stride is not None else {})

    def from_onnx_node(self, node, graph):
        return unary(node, graph, pool_window(node))

    def check(self, attrs):
        attrs["kernel"] = as_pair(attrs["kernel"], "kernel", 1)
        attrs["stride"] = attrs["kernel"] if attrs["stride"] is None else as_pair(attrs["stride"], "stride", 1)
        attrs["padding"] = as_pair(attrs["padding"], "padding", 0)
        if any(2 * p > k for p, k in zip(attrs["padding"], attrs["kernel"])):
            raise OpSpecError(f"'padding' {list(attrs['padding'])} must be at most half the kernel {list(attrs['kernel'])}")
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
            raise OpSpecError(f"input {side} {length} is smaller than the {k}-pixel pool window")
        if (length + 2 * p - k) % s:
            raise OpSpecError(f"input {side} {length} cannot be divided into {k}-pixel windows every {s} pixels "
                              f"(the last {(length + 2 * p - k) % s} would be dropped): choose a size the pools divide")
        return (length + 2 * p - k) // s + 1

    def describe(self, attrs):
        k, s = attrs["kernel"], attrs["stride"]
        return f"{self.name} {k[0]}×{k[1]}" + (f"/{s[0]}" if s != k else "")

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
        if any(attrs["padding"]):
            t = F.pad(t, _pads(attrs), value=fill)
        cols = F.unfold(t, attrs["kernel"], stride=attrs["stride"])
        return cols.view(n, c, attrs["kernel"][0] * attrs["kernel"][1], -1)

    def _fold(self, attrs, windows, shape):
        n, c = windows.shape[:2]
        return F.fold(windows.reshape(n, -1, windows.shape[-1]), shape[-2:], attrs["kernel"],
                      padding=attrs["padding"], stride=attrs["stride"])


class MaxPool2d(Pool):
    name = "max_pool2d"
    switches = True

    torch_modules = (torch.nn.MaxPool2d,)
    torch_calls = (F.max_pool2d,)
    onnx_ops = ("MaxPool",)

    def torch_forward(self, attrs, xs, module):
        return F.max_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"])

    def forward(self, attrs, xs, params, kernels):
        return F.max_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"])

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
        out_error = None if error is None else F.max_pool2d(error, attrs["kernel"], attrs["stride"], attrs["padding"])
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


def _pads(attrs):
    ph, pw = attrs["padding"]
    return (pw, pw, ph, ph)


class AvgPool2d(Pool):
    name = "avg_pool2d"
    # PyTorch's flag and default: divide by k² (True) or by the window's in-bounds count (False, as TF's SAME)
    keys = {**Pool.keys, "count_include_pad": True}

    torch_modules = (torch.nn.AvgPool2d,)
    torch_calls = (F.avg_pool2d,)
    onnx_ops = ("AveragePool",)

    def from_onnx_node(self, node, graph):
        attrs = pool_window(node)
        if any(attrs["padding"]):  # ONNX's default excludes the padding (0), PyTorch's includes it
            attrs["count_include_pad"] = bool(int(attr(node, "count_include_pad", 0)))
        return unary(node, graph, attrs)

    def from_torch_module(self, module):
        attrs = super().from_torch_module(module)
        return attrs if module.count_include_pad else dict(attrs, count_include_pad=False)

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        window_sum = self.forward(attrs, [xs[0].abs()], {}, None)
        return gamma_over_lambda(self._terms(attrs) + 1, u, lam) * window_sum

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        overlap = -(-attrs["kernel"][0] // attrs["stride"][0]) * -(-attrs["kernel"][1] // attrs["stride"][1])
        (s_in,), _ = self.backward(attrs, g.abs(), xs, y, {}, kernels, need)
        return [gamma_over_lambda(overlap + 1, u, lam) * s_in]

    def torch_forward(self, attrs, xs, module):
        return F.avg_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"],
                            count_include_pad=attrs["count_include_pad"])

    def check(self, attrs):
        if not isinstance(attrs["count_include_pad"], bool):
            raise OpSpecError(f"'count_include_pad' is {attrs['count_include_pad']!r}: expected true or false")
        return super().check(attrs)

    def describe(self, attrs):
        return super().describe(attrs) + ("" if attrs["count_include_pad"] else " (padding not counted)")

    def forward(self, attrs, xs, params, kernels):
        # the error model calls this too (on |a| and on errors): S and the divisor follow the flag
        return F.avg_pool2d(xs[0], attrs["kernel"], attrs["stride"], attrs["padding"],
                            count_include_pad=attrs["count_include_pad"])

    def _terms(self, attrs) -> int:
        return attrs["kernel"][0] * attrs["kernel"][1]

    def forward_error(self, attrs, ins, y, params, ctx):
        a, error = ins[0].value, ins[0].error
        # k² additions and one division: γ̃ of k² + 1 on the window's Σ|a|/k²
        total = ctx.gamma(self._terms(attrs) + 1) * self.forward(attrs, [a.abs()], {}, None)
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
            raise OpSpecError(f"adaptive average pooling to {size!r}: only to 1×1 (a global average) is supported")
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
