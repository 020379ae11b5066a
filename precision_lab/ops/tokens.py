"""Token tensors (T, D) per sample, as a vision transformer makes them from an image: flatten_pixels, transpose, mean.

A patch convolution's image (C, H, W) becomes tokens by PyTorch's `x.flatten(2).transpose(1, 2)`: flatten_pixels
((C, H, W) → (C, H·W)) then transpose ((A, B) → (B, A)); both only move values, so they are exact and carry errors
and gradients unchanged. `mean` averages over one per-sample axis (`x.mean(dim=1)`: over the tokens), a sum of n
terms and one division, bounded as a global average pool's (GlobalAvgPool2d): roundoff.order_free_bound of the
terms (Higham 2002, §4.2: only summation orders compute it) ÷ n, plus u·|y| for the division (Higham 2002, §2.2).
linear (ops.layers) reads tokens too: it acts on the last axis, and its weight gradient sums over batch and tokens.
"""
from __future__ import annotations

import torch

from . import Field, GradField, Op, OpSpecError, gamma_over_lambda, register
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
        if start != 2 or end not in (-1, 3):
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


class Transpose(Op):
    """(A, B) → (B, A): the two per-sample axes swapped (PyTorch `x.transpose(1, 2)`, `x.permute(0, 2, 1)`)."""

    name = "transpose"
    torch_calls = (torch.transpose, "transpose", "permute")

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_call(self, target, args, kwargs):
        if target == "permute":
            order = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else tuple(args[1:])
            if order not in ((0, 2, 1), (0, -1, -2)):
                raise OpSpecError(f"permute{order}: only swapping the two per-sample axes, permute(0, 2, 1)")
            return {}
        dims = {kwargs.get("dim0", args[1] if len(args) > 1 else None), kwargs.get("dim1", args[2] if len(args) > 2 else None)}
        if dims not in ({1, 2}, {-1, -2}, {1, -1}, {2, -2}):
            raise OpSpecError(f"transpose of dims {sorted(dims, key=str)}: only the two per-sample axes of tokens (1, 2)")
        return {}

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 2:
            raise OpSpecError(f"transpose needs a 2-D sample (A, B) but receives {_text(shape)}")
        return (shape[1], shape[0])

    def torch_forward(self, attrs, xs, module):
        return xs[0].transpose(1, 2)

    def forward(self, attrs, xs, params, kernels):
        return xs[0].transpose(1, 2).contiguous()

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g.transpose(1, 2).contiguous() if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        error = ins[0].error
        return Field(y, None if error is None else error.transpose(1, 2).contiguous(), None, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        flips = grad.flips.transpose(1, 2).contiguous() if grad.flips is not None else None
        return [GradField(grad.error.transpose(1, 2).contiguous(), flips, None, grad.flip_count)], {}


class Mean(Op):
    """The mean over one per-sample axis, that axis dropped (`x.mean(dim=1)`: tokens (T, D) → (D,)).

    Each output is a sum of n terms that only summation orders compute, then one division: its own part is
    layers.image_sum_own (roundoff.order_free_bound, as a global average pool's) ÷ n, plus u·|y|; errors average."""

    name = "mean"
    keys = {"dim": 1}
    torch_calls = (torch.mean, "mean")

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_call(self, target, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if not isinstance(dim, int) or kwargs.get("keepdim", args[2] if len(args) > 2 else False):
            raise OpSpecError(f"mean over {dim!r}: only over one axis, keepdim=False (tokens: x.mean(dim=1))")
        return {"dim": dim}

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


for _op in (FlattenPixels(), Transpose(), Mean()):
    register(_op)
