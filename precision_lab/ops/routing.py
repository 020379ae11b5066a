"""Ops that route values: max_pool2d, avg_pool2d, upsample_nearest, add, concat, flatten, zero_pad2d.

Rounding: max-pool, upsample, concat and flatten copy values exactly; avg-pool sums k² terms and
divides; add rounds once; the backward of upsample sums s² gradients and that of avg-pool up to
⌈k/s⌉² (Higham 2002, §3.1: a sum of n terms, here with the probabilistic γ̃ of roundoff.py).
What they do to upstream errors: copies carry them; max-pool carries the largest error of its
window and may *switch* where two inputs lie within their errors of each other (its gradient then
goes to another element: the whole |g| at each contender, deterministically, as a flipped ReLU).
"""
from __future__ import annotations

import operator

import numpy as np
import torch
import torch.nn.functional as F

from . import (REQUIRED, BackwardReplaced, Field, GradField, Op, OpSpecError, PortSlip, Rule, as_pair, dropping_slips,
               gamma_over_lambda, gather_radius, register, spread)
from .. import switching
from .onnx_reading import (OnnxRead, attr, flattens_each_sample, nearest_scale, pool_window, require, unary,
                           zero_pads)


def _has(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))


def _max_radius(radii):
    return None if any(r is None for r in radii) else max(radii)


def _same_length(lengths, axis: int, joins: str):
    """The common length of two inputs along `axis` (None: not known yet), or the one-line error naming both."""
    first, second = lengths
    if first is not None and second is not None and first != second:
        side = ("height", "width")[axis]
        raise OpSpecError(joins.format(side=side, first=first, second=second) + ": choose an image size the "
                          "network's strides and upsamples bring back to the same size")
    return first


def _image(shape, op: str):
    if len(shape) != 3:
        raise OpSpecError(f"{op} needs an image (C, H, W) but receives {len(shape)}-D features (a flatten came before it)")


def _resized(op, attrs, shape):
    """(C, H', W') of an op that sizes each image axis on its own (its `axis_length`), channels kept."""
    _image(shape, op.name)
    return (shape[0],) + tuple(op.axis_length(attrs, [shape[1 + a]], a) for a in (0, 1))


def _listed(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def _integer_scale(scale):
    scales = scale if isinstance(scale, (tuple, list)) else (scale, scale)
    if any(float(s) != int(s) or int(s) < 1 for s in scales):
        raise OpSpecError(f"upsampling scale {scale!r} is not a positive integer")
    return [int(s) for s in scales] if scales[0] != scales[1] else int(scales[0])

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


class UpsampleNearest(Op):
    name = "upsample_nearest"
    keys = {"scale": REQUIRED}

    torch_modules = (torch.nn.Upsample,)
    torch_calls = (F.interpolate,)
    onnx_ops = ("Resize", "Upsample")

    def from_onnx_node(self, node, graph):
        return OnnxRead({"scale": nearest_scale(node, graph)}, graph.data_inputs(node)[:1], node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_module(self, module):
        if module.mode != "nearest" or module.scale_factor is None:
            raise OpSpecError(f"Upsample(mode={module.mode!r}, scale_factor={module.scale_factor}) — only nearest "
                              f"upsampling by an integer scale_factor is supported")
        return {"scale": _integer_scale(module.scale_factor)}

    def from_torch_call(self, target, args, kwargs):
        if kwargs.get("mode", "nearest") != "nearest" or kwargs.get("scale_factor") is None:
            raise OpSpecError("interpolate other than mode='nearest' with a scale_factor")
        return {"scale": _integer_scale(kwargs["scale_factor"])}

    def port_slips(self, attrs, in_shape):
        return [PortSlip("routing", "backward takes each block's first gradient instead of their sum",
                         lambda: BackwardReplaced(self, _upsample_first)),
                PortSlip("routing", "backward averages each block's gradients instead of summing them",
                         lambda: BackwardReplaced(self, _upsample_mean))]

    def local_slip(self, attrs, g, theirs, expected, bound, u, ratio):
        sh, sw = attrs["scale"]
        if ratio(theirs, expected / (sh * sw), bound) <= 1.0:
            return "averages each block's gradient where it should sum it"
        return None

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        (s_in,), _ = self.backward(attrs, g.abs(), xs, y, {}, kernels, need)
        return [gamma_over_lambda(attrs["scale"][0] * attrs["scale"][1], u, lam) * s_in]

    def torch_forward(self, attrs, xs, module):
        return F.interpolate(xs[0], scale_factor=attrs["scale"], mode="nearest")

    def check(self, attrs):
        attrs["scale"] = as_pair(attrs["scale"], "scale", 1)
        return attrs

    def out_shape(self, attrs, in_shapes):
        return _resized(self, attrs, in_shapes[0])

    def axis_length(self, attrs, lengths, axis):
        return None if lengths[0] is None else lengths[0] * attrs["scale"][axis]

    def describe(self, attrs):
        sh, sw = attrs["scale"]
        return f"upsample ×{sh}" if sh == sw else f"upsample ×{sh}×{sw}"

    def forward(self, attrs, xs, params, kernels):
        sh, sw = attrs["scale"]
        return xs[0].repeat_interleave(sh, dim=2).repeat_interleave(sw, dim=3)

    def _block_sum(self, attrs, g):
        sh, sw = attrs["scale"]
        n, c, h, w = g.shape
        return g.reshape(n, c, h // sh, sh, w // sw, sw).sum(dim=(3, 5))

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._block_sum(attrs, g) if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        error = ins[0].error
        scale = max(attrs["scale"])
        radius = None if ins[0].radius is None else (ins[0].radius + 1) * scale
        return Field(y, None if error is None else self.forward(attrs, [error], {}, None), radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        n = attrs["scale"][0] * attrs["scale"][1]
        error = ctx.gamma(n) * self._block_sum(attrs, g.abs()) + self._block_sum(attrs, grad.error)
        flips = self._block_sum(attrs, grad.flips) if _has(grad.flips) else None
        radius = None if grad.radius is None else -(-grad.radius // min(attrs["scale"])) + 1
        return [GradField(error, flips, radius, grad.flip_count)], {}


class Add(Op):
    name = "add"
    combines = True
    verb = "adds"  # in messages about its inputs' shapes

    torch_calls = (operator.add, torch.add)
    onnx_ops = ("Add",)

    def from_onnx_node(self, node, graph):
        data = graph.data_inputs(node)
        require(len(data) == len(node.inputs) == 2, f"{node.op_type} with a constant: the spec's {self.name} "
                f"combines two computed tensors (a bias belongs to the convolution or dense layer before it)")
        return OnnxRead({}, data, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors

    def port_slips(self, attrs, in_shape):
        return dropping_slips(self)

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return u * y.abs()

    def torch_forward(self, attrs, xs, module):
        return xs[0] + xs[1]

    def out_shape(self, attrs, in_shapes):
        first, second = in_shapes
        if len(first) != len(second) or any(a is not None and b is not None and a != b for a, b in zip(first, second)):
            raise OpSpecError(f"{self.verb} shapes that differ: its first input is {_text(first)}, its second "
                              f"{_text(second)} (no broadcasting)")
        return tuple(a if a is not None else b for a, b in zip(first, second))

    def axis_length(self, attrs, lengths, axis):
        return _same_length(lengths, axis, self.verb + " a {side} of {first} and a {side} of {second}")

    def forward(self, attrs, xs, params, kernels):
        return xs[0] + xs[1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g if need[0] else None, g if need[1] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        errors = [f.error for f in ins if f.error is not None]
        # one rounding: |fl(x̂ + ŷ) − (x + y)| ≤ E_x + E_y + u·(|x + y| + E_x + E_y)
        carried = sum(errors) if errors else 0.0
        total = (1 + ctx.u) * carried + ctx.u * y.abs() if errors else ctx.u * y.abs()
        return Field(y, total, _max_radius([f.radius for f in ins]), sum(f.flips for f in ins))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        # both inputs get the same tensors: neither reader may overwrite them (a ReLU masks its own copy)
        copy = GradField(grad.error, grad.flips, grad.radius, grad.flip_count, grad.owned and not all(need))
        return [copy if need[0] else None, copy if need[1] else None], {}


class Concat(Op):
    name = "concat"
    combines = True

    torch_calls = (torch.cat,)
    onnx_ops = ("Concat",)

    def from_onnx_node(self, node, graph):
        data = graph.data_inputs(node)
        require(int(attr(node, "axis", 1)) in (1, -3), f"axis {attr(node, 'axis')}: only channels (axis 1) are joined")
        require(len(data) == len(node.inputs) == 2, f"{len(node.inputs)} inputs: the spec's concat joins two "
                f"computed tensors")
        return OnnxRead({}, data, node.outputs[0])

    def from_torch_call(self, target, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim != 1:
            raise OpSpecError(f"torch.cat along dim {dim}; only channels (dim=1) are supported")
        return {}

    def call_inputs(self, tensors, args):
        return list(args[0])

    def port_slips(self, attrs, in_shape):
        return [PortSlip("routing", "joins the skip from {skip} first: the spec concatenates [previous, skip] along "
                         "channels", ConcatSwapped, forward=True)] + dropping_slips(self)

    def torch_forward(self, attrs, xs, module):
        return torch.cat([xs[0], xs[1]], dim=1)

    def out_shape(self, attrs, in_shapes):
        first, second = in_shapes
        if len(first) != 3 or len(second) != 3:
            raise OpSpecError("concat joins images (C, H, W) along channels; a flatten came before it")
        for axis in (0, 1):
            self.axis_length(attrs, [first[1 + axis], second[1 + axis]], axis)
        return (first[0] + second[0], first[1] if first[1] is not None else second[1],
                first[2] if first[2] is not None else second[2])

    def axis_length(self, attrs, lengths, axis):
        return _same_length(lengths, axis, "concatenates a {side} of {first} with a {side} of {second}")

    def forward(self, attrs, xs, params, kernels):
        return torch.cat(xs, dim=1)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        split = xs[0].shape[1]
        return [g[:, :split] if need[0] else None, g[:, split:] if need[1] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        if all(f.error is None for f in ins):
            return Field(y, None, _max_radius([f.radius for f in ins]), sum(f.flips for f in ins))
        parts = [f.error if f.error is not None else torch.zeros_like(f.value) for f in ins]
        return Field(y, torch.cat(parts, dim=1), _max_radius([f.radius for f in ins]), sum(f.flips for f in ins))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        split = ins[0].value.shape[1]
        pieces = []
        for keep, sl in zip(need, (slice(None, split), slice(split, None))):
            if not keep:
                pieces.append(None)
                continue
            flips = grad.flips[:, sl] if grad.flips is not None else None
            pieces.append(GradField(grad.error[:, sl], flips, grad.radius, grad.flip_count, grad.owned))
        return pieces, {}


class Reshaping(Op):
    """An op that only reshapes each sample (exact): gradients and error bounds reshaped back, the errors of an element
    reaching anywhere in the sample afterwards (radius None)."""

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g.reshape(xs[0].shape) if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        error = ins[0].error
        return Field(y, None if error is None else error.reshape(y.shape), None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        shape = ins[0].value.shape
        flips = grad.flips.reshape(shape) if grad.flips is not None else None
        return [GradField(grad.error.reshape(shape), flips, None, grad.flip_count, grad.owned)], {}


class Flatten(Reshaping):
    name = "flatten"

    flattens = True

    torch_modules = (torch.nn.Flatten,)
    torch_calls = (torch.flatten, "flatten")
    onnx_ops = ("Flatten", "Reshape", "Transpose", "Squeeze")

    def from_onnx_node(self, node, graph):
        """Flatten, a Reshape to [batch, −1], or TensorFlow's flatten of NHWC: Transpose to (N, H, W, C), then one of
        those; its features are then in (H, W, C) order, which the dense layer reading them permutes back."""
        if node.op_type == "Squeeze":  # a global pool's (C, 1, 1) to (C,): axes an attribute before opset 13
            axes = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else attr(node, "axes")
            x = graph.data_inputs(node)
            require(len(x) == 1 and axes is not None and sorted(int(a) % 4 for a in np.asarray(axes).reshape(-1))
                    == [2, 3] and tuple(graph.shape(x[0])[1:]) == (1, 1), "a Squeeze other than of a 1×1 image's "
                    "height and width")
            return OnnxRead({}, x, node.outputs[0])
        target = graph.constant(node.inputs[1]) if node.op_type == "Reshape" and len(node.inputs) > 1 else None
        if target is not None and target.size != 2:
            return None  # a reshape of tokens or heads: reshape's (ops.tokens)
        if node.op_type == "Transpose" and list(attr(node, "perm", [])) != [0, 2, 3, 1]:
            return None  # a swap or another order: transpose's or permute's (ops.tokens)
        if node.op_type != "Transpose":
            flattens_each_sample(node, graph)
            return OnnxRead({}, graph.data_inputs(node), node.outputs[0])
        flat = graph.only_reader(node.outputs[0])
        x = graph.data_inputs(node)
        require(list(attr(node, "perm", [])) == [0, 2, 3, 1] and flat is not None and flat.op_type != "Transpose"
                and len(x) == 1, "a Transpose other than NCHW → NHWC before a flatten (the lab's activations are "
                "NCHW; tf2onnx: --inputs-as-nchw)")
        require(flat.op_type in self.onnx_ops, f"a Transpose to NHWC read by {flat.op_type}, not by a flatten")
        flattens_each_sample(flat, graph, image=len(graph.shape(x[0])) == 3)
        c, h, w = graph.shape(x[0])
        require(h is not None and w is not None, "a flatten in (H, W, C) order needs the graph's input height and "
                "width fixed (export with a static input shape)")
        order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
        return OnnxRead({}, x, flat.outputs[0], absorbed=[flat], feature_order=order)

    def from_torch_module(self, module):
        if module.start_dim != 1 or module.end_dim != -1:
            raise OpSpecError(f"Flatten(start_dim={module.start_dim}, end_dim={module.end_dim}): only flattening "
                              f"everything but the batch (start_dim=1) is supported")
        return {}

    def from_torch_call(self, target, args, kwargs):
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
        if start != 1 or end != -1:  # a partial flatten is reshape's (ops.tokens), which knows the rank
            raise OpSpecError(f"flatten from dim {start} to {end}; flatten takes start_dim=1 to the end")
        return {}

    def port_slips(self, attrs, in_shape):
        if len(in_shape) != 3 or in_shape[0] < 2 or in_shape[1] * in_shape[2] < 2:
            return []
        c, h, w = in_shape
        return [PortSlip("reorder", "flattens in (H, W, C) order where the spec flattens (C, H, W): permute to "
                         "channels first before flattening, or permute the next layer's weight columns", FlattenHWC,
                         forward=True, feature_order=np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel())]

    def torch_forward(self, attrs, xs, module):
        return torch.flatten(xs[0], 1)

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if any(s is None for s in shape):
            return (None,)
        total = 1
        for s in shape:
            total *= s
        return (total,)

    def axis_length(self, attrs, lengths, axis):
        return None

    def forward(self, attrs, xs, params, kernels):
        return xs[0].reshape(xs[0].shape[0], -1)



class ZeroPad2d(Op):
    """Zeros added on each side, [top, bottom, left, right] (Keras ZeroPadding2D, PyTorch nn.ZeroPad2d); a
    conv2d with per-side or "same" padding is this and an unpadded conv2d (precision_lab.model)."""

    name = "zero_pad2d"
    # `multiple`: the input side must be a multiple of it (TF's "same" with a stride pads so only then)
    keys = {"padding": REQUIRED, "multiple": 1}

    torch_modules = (torch.nn.ZeroPad2d,)
    onnx_ops = ("Pad",)

    def from_onnx_node(self, node, graph):
        return OnnxRead({"padding": zero_pads(node, graph)}, graph.data_inputs(node)[:1], node.outputs[0])

    def from_torch_module(self, module):
        left, right, top, bottom = module.padding
        return {"padding": [top, bottom, left, right]}

    def torch_forward(self, attrs, xs, module):
        top, bottom, left, right = attrs["padding"]
        return F.pad(xs[0], (left, right, top, bottom))

    def check(self, attrs):
        pads = attrs["padding"]
        if not (isinstance(pads, (list, tuple)) and len(pads) == 4
                and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pads)):
            raise OpSpecError(f"'padding' is {pads!r}: expected [top, bottom, left, right], non-negative integers")
        attrs["padding"] = tuple(pads)
        attrs["multiple"] = as_pair(attrs["multiple"], "multiple", 1)
        return attrs

    def out_shape(self, attrs, in_shapes):
        return _resized(self, attrs, in_shapes[0])

    def axis_length(self, attrs, lengths, axis):
        length, multiple = lengths[0], attrs["multiple"][axis]
        if length is None:
            return None
        if length % multiple:
            raise OpSpecError(f"input {('height', 'width')[axis]} {length} is not a multiple of the stride {multiple} "
                              f"(\"same\" padding pads so only then): choose an image size the strides divide")
        return length + attrs["padding"][2 * axis] + attrs["padding"][2 * axis + 1]

    def describe(self, attrs):
        return f"zero_pad2d {list(attrs['padding'])}"

    def _torch_pads(self, attrs):
        top, bottom, left, right = attrs["padding"]
        return (left, right, top, bottom)

    def _crop(self, attrs, t):
        top, bottom, left, right = attrs["padding"]
        return t[:, :, top:t.shape[2] - bottom, left:t.shape[3] - right]

    def forward(self, attrs, xs, params, kernels):
        return F.pad(xs[0], self._torch_pads(attrs))

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._crop(attrs, g).contiguous() if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        # zeros are exact; the copies carry their errors (a shift of the grid: radii unchanged)
        error = ins[0].error
        return Field(y, None if error is None else F.pad(error, self._torch_pads(attrs)), ins[0].radius, ins[0].flips,
                     nonnegative=ins[0].nonnegative)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        flips = self._crop(attrs, grad.flips).contiguous() if grad.flips is not None else None
        return [GradField(self._crop(attrs, grad.error).contiguous(), flips, grad.radius, grad.flip_count,
                          grad.owned)], {}


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
            read.then = [{"op": Flatten.name}]
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


def _text(shape) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"


for _op in (MaxPool2d(), AvgPool2d(), UpsampleNearest(), Add(), Concat(), Flatten(), ZeroPad2d(), GlobalAvgPool2d()):
    register(_op)


# ---------------------------------------------------------------------------------------------
# what a port gets wrong


def _upsample_first(op, attrs, g, xs, y, params, kernels, need):
    sh, sw = attrs["scale"]
    return [g[:, :, ::sh, ::sw].contiguous() if need[0] else None], {}


def _upsample_mean(op, attrs, g, xs, y, params, kernels, need):
    grads, _ = op.backward(attrs, g, xs, y, params, kernels, need)
    return [None if h is None else h / (attrs["scale"][0] * attrs["scale"][1]) for h in grads], {}


class ConcatSwapped(Rule):
    """A concat that puts its second input (the skip) first: [skip, previous] where the spec says [previous, skip]."""

    def forward(self, attrs, xs, params, kernels):
        return torch.cat([xs[1], xs[0]], dim=1)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        split = xs[1].shape[1]
        return [g[:, split:] if need[0] else None, g[:, :split] if need[1] else None], {}


class FlattenHWC(Rule):
    """A flatten in (H, W, C) order (a channels-last framework's habit) where the spec flattens (C, H, W)."""

    def forward(self, attrs, xs, params, kernels):
        x = xs[0]
        return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        n, c, h, w = xs[0].shape
        return [g.reshape(n, h, w, c).permute(0, 3, 1, 2).contiguous() if need[0] else None], {}
