"""Token tensors (T, D) per sample, as a vision transformer makes them from an image: flatten_pixels, transpose, mean.

A patch convolution's image (C, H, W) becomes tokens by PyTorch's `x.flatten(2).transpose(1, 2)`: flatten_pixels
((C, H, W) → (C, H·W)) then transpose ((A, B) → (B, A)); both only move values, so they are exact and carry errors
and gradients unchanged. `mean` averages over one per-sample axis (`x.mean(dim=1)`: over the tokens), a sum of n
terms and one division, bounded as a global average pool's (GlobalAvgPool2d): roundoff.order_free_bound of the
terms (Higham 2002, §4.2: only summation orders compute it) ÷ n, plus u·|y| for the division (Higham 2002, §2.2).
linear (ops.layers) reads tokens too: it acts on the last axis, and its weight gradient sums over batch and tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import REQUIRED, BackwardReplaced, Field, GradField, Op, OpSpecError, PortSlip, gamma_over_lambda, register
from .onnx_reading import OnnxRead, OpenSize, attr, require, reshape_target
from .routing import Reshaping, _text


def _has(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))


def per_sample_axis(dim, rank: int, what: str) -> int:
    """PyTorch's `dim` (the batch is dim 0, negative from the end) as a per-sample axis 0 … rank − 1."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise OpSpecError(f"'{what}' is {dim!r}: expected an integer")
    axis = dim + rank + 1 if dim < 0 else dim
    if not 1 <= axis <= rank:
        raise OpSpecError(f"'{what}' {dim} is not a per-sample axis of a {rank}-D sample (dim 0 is the batch)")
    return axis - 1


class FlattenPixels(Reshaping):
    """(C, H, W) → (C, H·W): each channel's pixels in raster order (PyTorch `x.flatten(2)`)."""

    name = "flatten_pixels"
    torch_calls = (torch.flatten, "flatten")

    def from_torch_call(self, target, args, kwargs):
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
        if start != 2 or end != -1:  # other ranges: reshape's flatten, which checks them against the tensor's rank
            raise OpSpecError(f"flatten from dim {start} to {end}: flatten_pixels flattens H and W (start_dim=2)")
        return {}

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 3:
            raise OpSpecError(f"flatten_pixels needs an image (C, H, W) but receives {_text(shape)}")
        c, h, w = shape
        return (c, None if h is None or w is None else h * w)

    def torch_forward(self, attrs, xs, module):
        return xs[0].flatten(2)

    def forward(self, attrs, xs, params, kernels):
        return xs[0].flatten(2)


def _sizes(value, what: str) -> list[int]:
    """A list of integer sizes (a spec attribute, or the arguments of a traced call)."""
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise OpSpecError(f"'{what}' is {value!r}: expected a list of integers")
    return [int(v) for v in value]


def _call_sizes(args: tuple, kwargs: dict, key: str) -> tuple:
    """The sizes of a traced `x.reshape(a, b, …)`, `x.reshape((a, b))`, `torch.reshape(x, (a, b))`, `x.permute(…)`."""
    rest = kwargs[key] if key in kwargs else (args[1] if len(args) == 2 and isinstance(args[1], (list, tuple))
                                                else args[1:])
    return tuple(rest)


def _onnx_perm(node, graph) -> tuple[list[int], list[str]]:
    """(perm, the data input) of an ONNX Transpose that keeps the batch axis first (refused otherwise)."""
    x = graph.data_inputs(node)
    require(len(x) == 1, "it transposes a constant")
    rank = len(graph.shape(x[0])) + 1
    perm = [int(p) % rank for p in attr(node, "perm", range(rank - 1, -1, -1))]
    if perm[0] != 0:
        raise _batch_moved(f"perm {perm}", f"moves the batch axis (dim 0) to position {perm.index(0)}")
    return perm, x


def _batch_moved(call: str, detail: str) -> OpSpecError:
    return OpSpecError(f"{call}: {detail}; the lab's batch axis stays first and unchanged (one sample's values never "
                       f"mix with another's): split or merge only per-sample axes, as (N, T, heads, d)")


class Transpose(Op):
    """Two per-sample axes swapped (PyTorch `x.transpose(1, 2)`; `x.permute(…)` is permute's): tokens (A, B) → (B, A); `dims`
    counted as PyTorch does (the batch is dim 0), so `k.transpose(-2, -1)` of heads (H, T, d) is (H, d, T)."""

    name = "transpose"
    keys = {"dims": [1, 2]}
    torch_calls = (torch.transpose, "transpose")
    onnx_ops = ("Transpose",)

    def from_onnx_node(self, node, graph):
        """A Transpose that swaps two axes other than the batch's (`perm` [0, 2, 1]; other orders are permute's)."""
        perm, x = _onnx_perm(node, graph)
        moved = [axis for axis, source in enumerate(perm) if axis != source]
        require(len(moved) == 2, f"perm {perm} is not a swap of two axes")
        return OnnxRead({} if moved == [1, 2] else {"dims": moved}, x, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def check(self, attrs):
        dims = _sizes(attrs["dims"], "dims")
        if len(dims) != 2 or 0 in dims:
            raise OpSpecError(f"'dims' is {attrs['dims']!r}: expected two per-sample axes (dim 0 is the batch)")
        attrs["dims"] = dims
        return attrs

    def from_torch_call(self, target, args, kwargs):
        dims = [kwargs.get("dim0", args[1] if len(args) > 1 else None), kwargs.get("dim1", args[2] if len(args) > 2 else None)]
        if not all(isinstance(d, int) for d in dims):
            raise OpSpecError(f"transpose of dims {dims}: expected two integers")
        if 0 in dims:
            raise _batch_moved(f"transpose{tuple(dims)}", "swaps the batch axis (dim 0) with another")
        return {} if sorted(dims) == [1, 2] else {"dims": sorted(dims)}

    def _axes(self, attrs, rank: int) -> tuple[int, int]:
        """The two swapped axes as per-sample axes 0 … rank − 1."""
        return tuple(per_sample_axis(d, rank, "dims") for d in attrs["dims"])

    def out_shape(self, attrs, in_shapes):
        shape = list(in_shapes[0])
        if len(shape) < 2:
            raise OpSpecError(f"transpose needs a sample of two axes or more but receives {_text(shape)}")
        a, b = self._axes(attrs, len(shape))
        shape[a], shape[b] = shape[b], shape[a]
        return tuple(shape)

    def describe(self, attrs):
        return "transpose" if attrs["dims"] == [1, 2] else f"transpose of dims {attrs['dims'][0]}, {attrs['dims'][1]}"

    def _swap(self, attrs, t: torch.Tensor) -> torch.Tensor:
        a, b = self._axes(attrs, t.dim() - 1)
        return t.transpose(a + 1, b + 1).contiguous()

    def torch_forward(self, attrs, xs, module):
        return xs[0].transpose(*attrs["dims"])

    def forward(self, attrs, xs, params, kernels):
        return self._swap(attrs, xs[0])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._swap(attrs, g) if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        error = ins[0].error
        return Field(y, None if error is None else self._swap(attrs, error), None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        flips = self._swap(attrs, grad.flips) if grad.flips is not None else None
        return [GradField(self._swap(attrs, grad.error), flips, None, grad.flip_count, grad.owned)], {}


class Reshape(Reshaping):
    """Each sample reshaped, the batch axis first and unchanged (`x.reshape(N, T, heads, d)`, `x.view(…)`,
    `x.flatten(start, end)`): `shape` the per-sample shape, one −1 resolved from the input's size (PyTorch's rule), or
    `flatten` [start, end] in PyTorch's dims (the batch is dim 0). Only moves values: exact (Reshaping)."""

    name = "reshape"
    keys = {"shape": None, "flatten": None}
    torch_calls = (torch.reshape, "reshape", "view", torch.flatten, "flatten")
    onnx_ops = ("Reshape",)

    def from_onnx_node(self, node, graph):
        """A Reshape whose target is constant or computed from sizes (Shape, Gather, Concat): the batch's size first
        (its Shape, 0 or −1), each 0 copying the input's size; a copied size the graph leaves open is read as −1, the
        target's own −1 then resolved from the input's other sizes."""
        from . import BATCH_SIZE

        x = graph.data_inputs(node)
        require(len(x) == 1, "it reshapes a constant")
        target, source = reshape_target(node, graph), graph.shape(x[0])
        text = "[" + ", ".join("N" if t is BATCH_SIZE else "?" if isinstance(t, OpenSize) else str(t)
                               for t in target) + "]"
        if not target or (target[0] is not BATCH_SIZE and target[0] != -1):
            raise _batch_moved(f"shape {text}", "the first size is not the batch's")
        rest = target[1:]
        require(BATCH_SIZE not in rest, f"shape {text}: the batch size is not first")
        copied = [axis for axis, t in enumerate(rest) if isinstance(t, OpenSize)]
        require(all(rest[axis] == OpenSize(x[0], axis) for axis in copied), f"shape {text}: a size of another tensor or "
                f"axis that the graph leaves open (export with a fixed image size)")
        if copied and -1 in rest:  # the −1 from the sizes not copied: (T, h, d) to [N, T, −1] is [−1, h·d]
            others = [size for axis, size in enumerate(source) if axis not in copied]
            known = math.prod(t for t in rest if isinstance(t, int) and t != -1)
            require(None not in others and math.prod(others) % known == 0, f"shape {text}: more than one size is "
                    f"left open (export with a fixed image size)")
            rest = [math.prod(others) // known if t == -1 else t for t in rest]
        rest = [-1 if isinstance(t, OpenSize) else t for t in rest]
        require(rest.count(-1) <= 1 and not (target[0] == -1 and -1 in rest), f"shape {text}: more than one size is "
                f"left open (export with a fixed image size)")
        return OnnxRead({"shape": rest}, x, node.outputs[0])

    def check(self, attrs):
        if (attrs["shape"] is None) == (attrs["flatten"] is None):
            raise OpSpecError("reshape takes 'shape' (the per-sample shape) or 'flatten' ([start, end]), one of them")
        if attrs["shape"] is not None:
            shape = _sizes(attrs["shape"], "shape")
            if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
                raise OpSpecError(f"'shape' is {attrs['shape']!r}: expected positive sizes and at most one -1")
            attrs["shape"] = shape
        else:
            ends = _sizes(attrs["flatten"], "flatten")
            if len(ends) != 2 or 0 in ends:
                raise OpSpecError(f"'flatten' is {attrs['flatten']!r}: expected [start, end], per-sample axes (dim 0 "
                                  f"is the batch)")
            attrs["flatten"] = ends
        return attrs

    def from_torch_call(self, target, args, kwargs):
        from . import BATCH_SIZE

        if target is torch.flatten or target == "flatten":
            start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
            end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
            if start == 0:
                raise _batch_moved(f"flatten({start}, {end})", "merges the batch axis (dim 0) with the next")
            return {"flatten": [start, end]}
        call = "view" if target == "view" else "reshape"
        sizes = _call_sizes(args, kwargs, "shape")
        text = ", ".join("x.shape[0]" if s is BATCH_SIZE else str(s) for s in sizes)
        if not sizes or (sizes[0] is not BATCH_SIZE and sizes[0] != -1):
            raise _batch_moved(f"{call}({text})", "the first size is not the batch's (write x.shape[0] or x.size(0))")
        if any(s is BATCH_SIZE for s in sizes[1:]):
            raise _batch_moved(f"{call}({text})", "moves the batch size off the first axis")
        rest = list(sizes[1:])
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in rest):
            raise OpSpecError(f"{call}({text}): per-sample sizes must be numbers or -1 (a size read from a tensor other "
                              f"than the batch's x.shape[0] is not read)")
        if sizes[0] == -1 and -1 in rest:
            raise OpSpecError(f"{call}({text}): two sizes are -1; write the batch's as x.shape[0]")
        return {"shape": rest}

    def _flattened(self, attrs, shape: tuple) -> tuple:
        start, end = (per_sample_axis(d, len(shape), "flatten") for d in attrs["flatten"])
        if end < start:
            raise OpSpecError(f"flatten from dim {attrs['flatten'][0]} to {attrs['flatten'][1]}: the end is before the start")
        merged = shape[start:end + 1]
        size = None if None in merged else math.prod(merged)
        return (*shape[:start], size, *shape[end + 1:])

    def out_shape(self, attrs, in_shapes):
        shape = tuple(in_shapes[0])
        if attrs["flatten"] is not None:
            return self._flattened(attrs, shape)
        target, known = list(attrs["shape"]), None not in shape
        fixed = math.prod(s for s in target if s != -1)
        if known and (math.prod(shape) % fixed if -1 in target else math.prod(shape) != fixed):
            raise OpSpecError(f"reshape of a sample {_text(shape)} ({math.prod(shape)} values) to "
                              f"{_text(['-1' if s == -1 else s for s in target])}: the sizes do not match")
        if -1 in target:
            target[target.index(-1)] = math.prod(shape) // fixed if known else None
        return tuple(target)

    def axis_length(self, attrs, lengths, axis):
        return None  # the image's rows and columns are no longer axes of their own

    def describe(self, attrs):
        if attrs["flatten"] is not None:
            return f"flatten dims {attrs['flatten'][0]} to {attrs['flatten'][1]}"
        return "reshape to " + _text(["-1" if s == -1 else s for s in attrs["shape"]])

    def _reshaped(self, attrs, x: torch.Tensor) -> torch.Tensor:
        if attrs["flatten"] is not None:
            return x.flatten(*attrs["flatten"])
        return x.reshape(x.shape[0], *attrs["shape"])

    def torch_forward(self, attrs, xs, module):
        return self._reshaped(attrs, xs[0])

    def forward(self, attrs, xs, params, kernels):
        return self._reshaped(attrs, xs[0])


class Permute(Op):
    """The per-sample axes reordered, the batch axis first and unchanged (`x.permute(0, 2, 1, 3)`: (T, heads, d) →
    (heads, T, d)); `dims` the per-sample order (0 the first per-sample axis). Only moves values: exact; its backward
    is the inverse permutation, errors routed as the values are."""

    name = "permute"
    keys = {"dims": REQUIRED}
    torch_calls = (torch.permute, "permute")
    onnx_ops = ("Transpose",)

    def from_onnx_node(self, node, graph):
        perm, x = _onnx_perm(node, graph)
        return OnnxRead({"dims": [axis - 1 for axis in perm[1:]]}, x, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def check(self, attrs):
        dims = _sizes(attrs["dims"], "dims")
        if sorted(dims) != list(range(len(dims))):
            raise OpSpecError(f"'dims' is {attrs['dims']!r}: expected an order of the per-sample axes 0 … {len(dims) - 1}")
        attrs["dims"] = dims
        return attrs

    def from_torch_call(self, target, args, kwargs):
        order = _call_sizes(args, kwargs, "dims")
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in order):
            raise OpSpecError(f"permute{order}: expected integers")
        order = tuple(d % len(order) for d in order)
        if order[0] != 0:
            raise _batch_moved(f"permute{order}", f"moves the batch axis (dim 0) to position {order.index(0)}")
        return {"dims": [d - 1 for d in order[1:]]}

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != len(attrs["dims"]):
            raise OpSpecError(f"permute of {len(attrs['dims'])} per-sample axes receives a sample {_text(shape)}")
        return tuple(shape[d] for d in attrs["dims"])

    def axis_length(self, attrs, lengths, axis):
        return None

    def describe(self, attrs):
        return f"permute {tuple(attrs['dims'])}"

    @staticmethod
    def _order(dims) -> list[int]:
        return [0, *(d + 1 for d in dims)]

    @staticmethod
    def _inverse(dims) -> list[int]:
        inverse = [0] * len(dims)
        for position, axis in enumerate(dims):
            inverse[axis] = position
        return inverse

    def torch_forward(self, attrs, xs, module):
        return xs[0].permute(*self._order(attrs["dims"]))

    def forward(self, attrs, xs, params, kernels):
        return xs[0].permute(*self._order(attrs["dims"])).contiguous()

    def _back(self, attrs, g: torch.Tensor) -> torch.Tensor:
        return g.permute(*self._order(self._inverse(attrs["dims"]))).contiguous()

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._back(attrs, g) if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        error = ins[0].error
        moved = None if error is None else error.permute(*self._order(attrs["dims"])).contiguous()
        return Field(y, moved, None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        flips = self._back(attrs, grad.flips) if grad.flips is not None else None
        return [GradField(self._back(attrs, grad.error), flips, None, grad.flip_count, grad.owned)], {}

    def port_slips(self, attrs, in_shape):
        if self._inverse(attrs["dims"]) == attrs["dims"]:
            return []  # a swap is its own inverse: the slip computes the same
        return [PortSlip("routing", f"backward applies the permutation {tuple(attrs['dims'])} again instead of its "
                         f"inverse {tuple(self._inverse(attrs['dims']))}", lambda: BackwardReplaced(self, _permuted_again))]


def _permuted_again(op, attrs, g, xs, y, params, kernels, need):
    """A backward that permutes the gradient's buffer as the forward did, read back in the input's shape."""
    again = g.permute(*op._order(attrs["dims"])).contiguous()
    return [again.reshape(xs[0].shape) if need[0] else None], {}


def _over_image(dim) -> bool:
    """Whether a mean's dims are an image's height and width ((2, 3) or (-2, -1) of (N, C, H, W)), in either order."""
    return isinstance(dim, (list, tuple)) and sorted(d % 4 if isinstance(d, int) else d for d in dim) == [2, 3]


class Mean(Op):
    """The mean over one per-sample axis, that axis dropped (`x.mean(dim=1)`: tokens (T, D) → (D,)).

    Each output is a sum of n terms that only summation orders compute, then one division: its own part is
    layers.image_sum_own (roundoff.order_free_bound, as a global average pool's) ÷ n, plus u·|y|; errors average."""

    name = "mean"
    keys = {"dim": 1}
    torch_calls = (torch.mean, "mean")
    onnx_ops = ("ReduceMean",)

    def from_onnx_node(self, node, graph):
        """ReduceMean over one per-sample axis without keepdims (`axes` an input from opset 18, an attribute before);
        ONNX counts axes as PyTorch does, the batch dim 0. Over height and width it is global_avg_pool2d's."""
        axes = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else attr(node, "axes")
        x = graph.data_inputs(node)
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        require(len(x) == 1 and axes is not None and len(axes) == 1 and not int(attr(node, "keepdims", 1)),
                "ReduceMean other than over one axis without keepdims (tokens: axes [1], keepdims 0)")
        return OnnxRead({"dim": axes[0]}, x, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_call(self, target, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if _over_image(dim):
            # x.mean((2, 3), keepdim=True) is AdaptiveAvgPool2d(1)'s global average itself
            return {"op": "global_avg_pool2d"} if keepdim else {"dim": [2, 3]}
        if not isinstance(dim, int) or keepdim:
            raise OpSpecError(f"mean over {dim!r}: only over one axis, keepdim=False (tokens: x.mean(dim=1)), or over "
                              f"an image's height and width (dim=(2, 3))")
        return {"dim": dim}

    def expand(self, raw):
        """A mean over an image's height and width (dim [2, 3]): the global average pool, then a flatten to (C,)."""
        if not _over_image(raw.get("dim")):
            return [raw]
        pool = {"op": "global_avg_pool2d", **({"inputs": raw["inputs"]} if "inputs" in raw else {})}
        return [pool, {"op": "flatten", **({"name": raw["name"]} if "name" in raw else {})}]

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        axis = per_sample_axis(attrs["dim"], len(shape), "dim")
        return tuple(s for i, s in enumerate(shape) if i != axis)

    def describe(self, attrs):
        return f"mean over dim {attrs['dim']}"

    @staticmethod
    def _dim(attrs, x: torch.Tensor) -> int:
        return 1 + per_sample_axis(attrs["dim"], x.dim() - 1, "dim")

    def torch_forward(self, attrs, xs, module):
        return xs[0].mean(dim=attrs["dim"])

    def forward(self, attrs, xs, params, kernels):
        return xs[0].mean(dim=self._dim(attrs, xs[0]))

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if not need[0]:
            return [None], {}
        dim = self._dim(attrs, xs[0])
        return [(g / xs[0].shape[dim]).unsqueeze(dim).expand_as(xs[0]).contiguous()], {}

    @staticmethod
    def _as_images(t: torch.Tensor, dim: int) -> torch.Tensor:
        """(N, …) with the summed axis last, as (N, M, n, 1): image_sum_own's (N, C, H, W) with one sum per channel."""
        moved = t.movedim(dim, -1)
        return moved.reshape(t.shape[0], -1, t.shape[dim], 1)

    def forward_error(self, attrs, ins, y, params, ctx):
        from .layers import image_sum_own

        a, error = ins[0].value, ins[0].error
        dim = self._dim(attrs, a)
        n = a.shape[dim]
        errors = None if error is None else self._as_images(torch.broadcast_to(error, a.shape), dim)
        total = image_sum_own(self._as_images(a, dim), errors, ctx).reshape(y.shape) / n + ctx.u * y.abs()
        if error is not None:
            total = total + error.mean(dim=dim)
        return Field(y, total, None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        x = ins[0].value
        dim = self._dim(attrs, x)
        n = x.shape[dim]
        # one division per output gradient, broadcast along the averaged axis
        error = ((ctx.u * g.abs() + grad.error) / n).unsqueeze(dim).expand_as(x).contiguous()
        flips = (grad.flips / n).unsqueeze(dim).expand_as(x).contiguous() if _has(grad.flips) else None
        return [GradField(error, flips, None, grad.flip_count)], {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        dim = self._dim(attrs, xs[0])
        return gamma_over_lambda(xs[0].shape[dim] + 1, u, lam) * xs[0].abs().mean(dim=dim)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        dim = self._dim(attrs, xs[0])
        return [(u * g.abs() / xs[0].shape[dim]).unsqueeze(dim).expand_as(xs[0]) if need[0] else None]


for _op in (FlattenPixels(), Transpose(), Mean(), Reshape(), Permute()):
    register(_op)
