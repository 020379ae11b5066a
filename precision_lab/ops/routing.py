"""Ops that route values: upsample_nearest, add, concat, flatten, zero_pad2d (the pools: ops/pooling.py).

Rounding: upsample, concat and flatten copy values exactly; add rounds once; the backward of upsample sums s²
gradients (Higham 2002, §3.1: a sum of n terms, here with the probabilistic γ̃ of roundoff.py). What they do to
upstream errors: copies carry them, add sums them.
"""
from __future__ import annotations

import operator

import numpy as np
import torch
import torch.nn.functional as F

from . import (REQUIRED, BackwardReplaced, Field, GradField, Op, OpSpecError, PortSlip, Rule, as_pair, dropping_slips,
               gamma_over_lambda, register)
from .onnx_reading import OnnxRead, attr, flattens_each_sample, nearest_scale, require, zero_pads
from .pooling import AdaptiveAvgPool2d, AvgPool2d, GlobalAvgPool2d, MaxPool2d, _has, _resized


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



def _integer_scale(scale):
    scales = scale if isinstance(scale, (tuple, list)) else (scale, scale)
    if any(float(s) != int(s) or int(s) < 1 for s in scales):
        raise OpSpecError(f"upsampling scale {scale!r} is not a positive integer")
    return [int(s) for s in scales] if scales[0] != scales[1] else int(scales[0])


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

    def from_torch_call(self, target, args, kwargs):
        if any(not hasattr(a, "op") for a in args[:2]):
            # a tensor and a number or a module's parameter: another op reads it (add_parameter)
            raise OpSpecError(f"{self.verb} a tensor and something other than a computed tensor")
        return {}

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
    joins_many = True

    def expand(self, raw):
        """A concat of k > 2 tensors (DenseNet's `torch.cat(features, 1)`): k − 1 concats, each joining the next tensor
        to the ones before, in order; the last carries the written layer's name."""
        inputs = raw.get("inputs")
        if not isinstance(inputs, list) or len(inputs) <= 2:
            return [raw]
        if "input" in inputs[2:]:  # a later link reads its first input as the chain so far
            raise OpSpecError("concat of the network input after two other tensors: put the input first or second")
        rest = {key: value for key, value in raw.items() if key not in ("inputs", "name")}
        chain = [{**rest, "inputs": inputs[:2]}] + [{**rest, "from": t} for t in inputs[2:]]
        if "name" in raw:
            chain[-1]["name"] = raw["name"]
        return chain

    torch_calls = (torch.cat,)
    onnx_ops = ("Concat",)

    def from_onnx_node(self, node, graph):
        data = graph.data_inputs(node)
        if len(data) == len(node.inputs) == 1:  # a concat of one tensor (DenseNet's first layer): the tensor itself
            return OnnxRead({}, data, node.outputs[0], alias=True)
        require(int(attr(node, "axis", 1)) in (1, -3), f"axis {attr(node, 'axis')}: only channels (axis 1) are joined")
        require(len(data) == len(node.inputs) >= 2, "a constant among its inputs: the spec's concat joins computed "
                "tensors")
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



def _text(shape) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"


# adaptive_avg_pool2d after global_avg_pool2d: it reads the AdaptiveAvgPool2d the global pool refuses (not 1×1)
for _op in (MaxPool2d(), AvgPool2d(), UpsampleNearest(), Add(), Concat(), Flatten(), ZeroPad2d(), GlobalAvgPool2d(),
            AdaptiveAvgPool2d()):
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
