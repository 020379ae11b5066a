"""Two-input arithmetic: sub (a residual x − f(x)) and mul (a gate, a scale).

Both read their inputs as named by `from` or `inputs` (docs/models.md). sub rounds once, like add:
|fl(â − b̂) − (a − b)| ≤ (1 + u)(E_a + E_b) + u|a − b|, and its backward is exact (g, −g). mul rounds once
too: |fl(â·b̂) − ab| ≤ (1 + u)(|b|E_a + |a|E_b + E_aE_b) + u|ab|, and so does each of its input gradients,
which read the other input's stored value with its forward error: |ĝ·b̂ − g·b| ≤ (1 + u)(|b|E_g + |g|E_b +
E_gE_b) + u|g·b| (Higham 2002, §2.2: one rounding per operation).
"""
from __future__ import annotations

import operator

import torch

from . import Field, GradField, PortSlip, Rule, dropping_slips, register
from .routing import Add, _max_radius


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

    def port_slips(self, attrs, in_shape):
        return [PortSlip("routing", "subtracts the other way round ({skip} minus {first})", SubSwapped,
                         forward=True)] + dropping_slips(self)

    def torch_forward(self, attrs, xs, module):
        return xs[0] - xs[1]

    def forward(self, attrs, xs, params, kernels):
        return xs[0] - xs[1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g if need[0] else None, -g if need[1] else None], {}


class Mul(Add):
    name = "mul"
    verb = "multiplies"
    torch_calls = (operator.mul, torch.mul)
    reads_error_backward = True

    def port_slips(self, attrs, in_shape):
        return dropping_slips(self)

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return u * y.abs()

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return [u * (g * xs[1]).abs() if need[0] else None, u * (g * xs[0]).abs() if need[1] else None]

    def torch_forward(self, attrs, xs, module):
        return xs[0] * xs[1]

    def forward(self, attrs, xs, params, kernels):
        return xs[0] * xs[1]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g * xs[1] if need[0] else None, g * xs[0] if need[1] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        (a, ea), (b, eb) = [(f.value.abs(), f.error) for f in ins]
        carried = 0.0
        if ea is not None:
            carried = carried + b * ea
        if eb is not None:
            carried = carried + a * eb
        if ea is not None and eb is not None:
            carried = carried + ea * eb
        return Field(y, (1 + ctx.u) * carried + ctx.u * y.abs(), _max_radius([f.radius for f in ins]),
                     sum(f.flips for f in ins))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        grads = []
        for keep, other in zip(need, reversed(ins)):
            if not keep:
                grads.append(None)
                continue
            value, stored = other.value.abs(), other.error
            carried = value * grad.error + (0.0 if stored is None else g.abs() * stored + grad.error * stored)
            error = (1 + ctx.u) * carried + ctx.u * (g * other.value).abs()
            flips = None if grad.flips is None else grad.flips * (value + (0.0 if stored is None else stored))
            grads.append(GradField(error, flips, _max_radius([grad.radius, other.radius]), grad.flip_count))
        return grads, {}


for _op in (Sub(), Mul()):
    register(_op)
