"""Two-input arithmetic: sub (a residual x − f(x)) and mul (a gate, a scale).

Both read their inputs as named by `from` or `inputs` (docs/models.md). sub rounds once, like add:
|fl(â − b̂) − (a − b)| ≤ (1 + u)(E_a + E_b) + u|a − b|, and its backward is exact (g, −g). mul rounds once
too: |fl(â·b̂) − ab| ≤ (1 + u)(|b|E_a + |a|E_b + E_aE_b) + u|ab|, and so does each of its input gradients,
which read the other input's stored value with its forward error: |ĝ·b̂ − g·b| ≤ (1 + u)(|b|E_g + |g|E_b +
E_gE_b) + u|g·b| (Higham 2002, §2.2: one rounding per operation).

mul also scales an image by a per-channel factor, (C, H, W) × (C, 1, 1) (a squeeze-and-excitation gate):
the factor's gradient is then a sum over the H·W products g·a, which only summation orders compute — its
own part is roundoff.order_free_bound of those terms (as a bias gradient's, up to
layers.BIAS_ORDER_FREE_LIMIT terms; γ̃ₙ(λ)·S above), and the products' errors add.
"""
from __future__ import annotations

import operator

import torch

from . import Field, GradField, OpSpecError, PortSlip, Rule, dropping_slips, gamma_over_lambda, register
from .routing import Add, _max_radius, _text


class SubSwapped(Rule):
    """A subtraction the other way round: the second input minus the first."""

    def forward(self, attrs, xs, params, kernels):
        return xs[1] - xs[0]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [-g if need[0] else None, g if need[1] else None], {}


class Sub(Add):
    name = "sub"
    verb = "subtracts"
    torch_calls = (operator.sub, torch.sub)
    onnx_ops = ("Sub",)

    def port_slips(self, attrs, in_shape):
        return [PortSlip("routing", "subtracts the other way round ({skip} minus {first})", SubSwapped,
                         forward=True)] + dropping_slips(self)

    def torch_forward(self, attrs, xs, module):
        return xs[0] - xs[1]

    def forward(self, attrs, xs, params, kernels):
        return xs[0] - xs[1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g if need[0] else None, -g if need[1] else None], {}


def _per_channel(shape) -> bool:
    return len(shape) == 3 and shape[1:] == (1, 1)


def _summed_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` summed over the axes `like` is broadcast along (a per-channel factor's H and W)."""
    return t.sum(dim=(2, 3), keepdim=True) if like.shape[2:] == (1, 1) and t.shape[2:] != (1, 1) else t


class Mul(Add):
    name = "mul"
    verb = "multiplies"
    torch_calls = (operator.mul, torch.mul)
    onnx_ops = ("Mul",)
    reads_error_backward = True

    def from_torch_call(self, target, args, kwargs):
        if any(not hasattr(a, "op") for a in args):
            # a tensor times a number is a constant factor: the scale op reads that call
            raise OpSpecError("a tensor times a number: not a product of two tensors")
        return {}

    def out_shape(self, attrs, in_shapes):
        first, second = in_shapes
        if _per_channel(first) != _per_channel(second) and len(first) == len(second) == 3 and first[0] == second[0]:
            return first if _per_channel(second) else second  # an image times a per-channel factor
        if len(first) == 3 and len(second) == 3 and first[0] != second[0]:
            raise OpSpecError(f"multiplies {_text(first)} by {_text(second)}: the channels differ")
        return super().out_shape(attrs, in_shapes)

    def axis_length(self, attrs, lengths, axis):
        first, second = lengths
        if first == 1 or second == 1:
            return second if first == 1 else first
        return super().axis_length(attrs, lengths, axis)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        scales = []
        for keep, mine, other in zip(need, xs, reversed(xs)):
            terms = (g * other).abs()
            n = terms.shape[2] * terms.shape[3] if mine.shape[2:] == (1, 1) and terms.shape[2:] != (1, 1) else 1
            scales.append(None if not keep else gamma_over_lambda(n, u, lam) * _summed_to(terms, mine))
        return scales

    def torch_forward(self, attrs, xs, module):
        return xs[0] * xs[1]

    def forward(self, attrs, xs, params, kernels):
        return xs[0] * xs[1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [_summed_to(g * xs[1], xs[0]) if need[0] else None,
                _summed_to(g * xs[0], xs[1]) if need[1] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        (a, ea), (b, eb) = [(f.value.abs(), f.error) for f in ins]
        carried = 0.0
        if ea is not None:
            carried = carried + b * ea
        if eb is not None:
            carried = carried + a * eb
        if ea is not None and eb is not None:
            carried = carried + ea * eb
        # a per-channel factor's error reaches every pixel of its channel
        broadcast = any(f.value.shape != y.shape and f.error is not None for f in ins)
        radius = None if broadcast else _max_radius([f.radius for f in ins])
        return Field(y, (1 + ctx.u) * carried + ctx.u * y.abs(), radius, sum(f.flips for f in ins))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        from .layers import image_sum_own

        grads = []
        for keep, mine, other in zip(need, ins, reversed(ins)):
            if not keep:
                grads.append(None)
                continue
            value, stored = other.value.abs(), other.error
            carried = value * grad.error + (0.0 if stored is None else g.abs() * stored + grad.error * stored)
            flips = None if grad.flips is None else grad.flips * (value + (0.0 if stored is None else stored))
            products = g * other.value
            if mine.value.shape[2:] != (1, 1) or products.shape[2:] == (1, 1):
                error = (1 + ctx.u) * carried + ctx.u * products.abs()
                spread = other.value.shape != products.shape and other.error is not None  # a factor's error: every pixel
                grads.append(GradField(error, flips, None if spread else _max_radius([grad.radius, other.radius]),
                                       grad.flip_count))
                continue
            # a per-channel factor: Σ over H·W of the products (each rounded once), their errors summed
            own = image_sum_own(products, carried, ctx)
            error = own.reshape(mine.value.shape) + _summed_to((1 + ctx.u) * carried + ctx.u * products.abs(),
                                                               mine.value)
            flips = None if flips is None else _summed_to(flips.expand_as(products), mine.value)
            grads.append(GradField(error, flips, None, grad.flip_count))
        return grads, {}


for _op in (Sub(), Mul()):
    register(_op)
