"""A module's own parameter used as a tensor: scale_by_parameter (ConvNeXt's layer scale, `self.layer_scale * x`) and
add_parameter (a learned positional embedding, `x + self.pos_embedding`).

The parameter keeps its `state_dict` name: the layer is named by the module that owns it and the parameter's suffix is
its attribute ('features.1.0' + 'layer_scale'). Its shape is PyTorch's, broadcast against the batch (N, …): a leading
axis of 1 for the batch, or fewer axes, aligned on the right ((C, 1, 1) against (N, C, H, W)).

Rounding (docs/error-model.md, "Parameters used as tensors"): the parameter is read exactly, so y = x·P and y = x + P
round once: |ŷ − y| ≤ (1 + u)·|P|·E_x + u·|y| (and (1 + u)·E_x + u·|y| for the sum); dx = g·P rounds once, dx = g is
exact. The parameter's gradient sums its terms (g·x, each rounded once, or g) over the n positions it is broadcast to
(the batch, and H·W for a per-channel scale): a sum only summation orders compute, bounded as a bias gradient's
(layers._bias_parts: roundoff.order_free_bound up to BIAS_ORDER_FREE_LIMIT terms, γ̃ₙ(λ)·S above).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from . import REQUIRED, BackwardReplaced, Field, GradField, Op, OpSpecError, PortSlip, register


@dataclass(frozen=True)
class TensorAttribute:
    """A module's parameter read by a traced graph (a `get_attr` node): what modules.from_module passes an op's
    `from_torch_call` in its place. `owner`: the owning module's path ('' for the traced module itself)."""

    owner: str
    attribute: str
    shape: tuple[int, ...]

    def __repr__(self):
        return ".".join(p for p in (self.owner, self.attribute) if p)


def _aligned(shape: tuple, dims: int) -> tuple:
    """The parameter's shape left-padded with 1s to `dims` axes (how PyTorch broadcasts it)."""
    return (1,) * (dims - len(shape)) + tuple(shape)


def _summed_axes(shape: tuple, t: torch.Tensor) -> tuple[list[int], list[int]]:
    """The axes of t (batch first) the parameter is broadcast along, and the ones it spans."""
    aligned = _aligned(shape, t.dim())
    summed = [i for i, s in enumerate(aligned) if s == 1]
    return summed, [i for i in range(t.dim()) if i not in summed]


def _as_columns(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """t as (n, K): the n terms summed into each of the parameter's K elements, one column per element."""
    summed, kept = _summed_axes(shape, t)
    n = math.prod(t.shape[i] for i in summed)
    return t.permute(*summed, *kept).reshape(n, -1)


def sum_to_parameter(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """t summed over the axes the parameter is broadcast along, in the parameter's shape."""
    return t.sum_to_size(_aligned(shape, t.dim())).reshape(shape)


def _gradient_parts(terms, errors, flips, shape, ctx, flip_count):
    """The parameter gradient's bound: the terms' sum over the positions the parameter is broadcast to, as a bias
    gradient's sum (layers._bias_parts), element by element in the parameter's shape."""
    from .layers import _bias_parts

    columns = _as_columns(terms, shape)
    grad = GradField(_as_columns(errors, shape), None if flips is None else _as_columns(flips, shape),
                     None, flip_count)
    # every term's error may depend on every other's (Janson's χ* ≤ n): no independence is claimed
    parts = _bias_parts(columns, columns.abs(), grad, (0,), columns.shape[0], ctx)
    for key in ("abs_sum", "accumulation", "propagated", "drifted"):
        value = getattr(parts, key)
        if torch.is_tensor(value):
            setattr(parts, key, value.reshape(shape))
    return parts


class ParameterOp(Op):
    """The shared reading, shape rules and parameter of scale_by_parameter and add_parameter."""

    keys = {"parameter": REQUIRED, "shape": REQUIRED}
    parametrised = True
    reads_error_backward = True
    verb = ""

    def check(self, attrs):
        if not isinstance(attrs["parameter"], str) or not attrs["parameter"].isidentifier():
            raise OpSpecError(f"'parameter' is {attrs['parameter']!r}: expected the attribute's name (an identifier)")
        shape = attrs["shape"]
        if not isinstance(shape, (list, tuple)) or not shape or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
            raise OpSpecError(f"'shape' is {shape!r}: expected the parameter's shape, a list of positive integers")
        attrs["shape"] = [int(s) for s in shape]
        return attrs

    def param_shapes(self, attrs):
        return {attrs["parameter"]: tuple(attrs["shape"])}

    def out_shape(self, attrs, in_shapes):
        sample, shape = tuple(in_shapes[0]), tuple(attrs["shape"])
        aligned = _aligned(shape, len(sample) + 1)
        if len(shape) > len(sample) + 1 or aligned[0] != 1 or any(
                p != 1 and s is not None and p != s for p, s in zip(aligned[1:], sample)):
            raise OpSpecError(f"{self.verb} a parameter of shape {list(shape)} to a sample of shape {list(sample)}: "
                              f"it must broadcast over the batch (leading axis 1) and match the sample's other axes")
        return sample

    def describe(self, attrs):
        return f"{self.name} {attrs['parameter']} {tuple(attrs['shape'])}"

    def from_torch_call(self, target, args, kwargs):
        found = [a for a in args if isinstance(a, TensorAttribute)]
        tensors = [a for a in args if hasattr(a, "op") and hasattr(a, "name")]
        if len(args) != 2 or len(found) != 1 or len(tensors) != 1 or kwargs:
            raise OpSpecError(f"{getattr(target, '__name__', target)} not of a tensor and one parameter")
        attribute = found[0]
        return {"name": attribute.owner, "parameter": attribute.attribute, "shape": list(attribute.shape)}

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def torch_module(self, attrs, device=None, dtype=None):
        holder = torch.nn.Module()
        holder.register_parameter(attrs["parameter"], torch.nn.Parameter(
            torch.empty(attrs["shape"], device=device, dtype=dtype)))
        return holder

    def torch_forward(self, attrs, xs, module):
        return self.forward(attrs, xs, {attrs["parameter"]: getattr(module, attrs["parameter"])}, None)


def _mean_over_batch(op, attrs, g, xs, y, params, kernels, need):
    """A backward whose parameter gradient is averaged over the batch instead of summed."""
    grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
    return grads, {k: v / g.shape[0] for k, v in param_grads.items()}


class ScaleByParameter(ParameterOp):
    """y = x·P, a parameter scaling its input (ConvNeXt's layer scale γ of shape (C, 1, 1)): module docstring."""

    name = "scale_by_parameter"
    verb = "scales by"
    torch_calls = (operator.mul, torch.mul)

    def forward(self, attrs, xs, params, kernels):
        return xs[0] * params[attrs["parameter"]]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        p = params[attrs["parameter"]]
        return [g * p if need[0] else None], {attrs["parameter"]: sum_to_parameter(g * xs[0], tuple(p.shape))}

    def forward_error(self, attrs, ins, y, params, ctx):
        p = params[attrs["parameter"]].abs()
        own = ctx.u * y.abs()
        error = own if ins[0].error is None else (1 + ctx.u) * p * ins[0].error + own
        return Field(y, error, ins[0].radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        p = params[attrs["parameter"]]
        x, stored = ins[0].value, ins[0].error
        # each term g·x reads the stored input and the output gradient, both with their errors, and rounds once
        carried = x.abs() * grad.error + (0.0 if stored is None else g.abs() * stored + grad.error * stored)
        terms = g * x
        errors = (1 + ctx.u) * carried + ctx.u * terms.abs()
        flips = None if grad.flips is None else grad.flips * (x.abs() + (0.0 if stored is None else stored))
        parts = {attrs["parameter"]: _gradient_parts(terms, errors, flips, tuple(p.shape), ctx, grad.flip_count)}
        if not need[0]:
            return [None], parts
        error = (1 + ctx.u) * p.abs() * grad.error + ctx.u * (g * p).abs()
        input_flips = None if grad.flips is None else grad.flips * p.abs()
        return [GradField(error, input_flips, grad.radius, grad.flip_count)], parts

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return u * y.abs()

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return [u * (g * params[attrs["parameter"]]).abs() if need[0] else None]

    def port_slips(self, attrs, in_shape):
        every = ("every parameter scale",)
        return [PortSlip("parameter", f"backward passes the gradient unscaled (leaves out {attrs['parameter']})",
                         lambda: BackwardReplaced(self, _unscaled), every=every),
                PortSlip("parameter", f"averages {attrs['parameter']}'s gradient over the batch instead of summing",
                         lambda: BackwardReplaced(self, _mean_over_batch), every=every)]


def _unscaled(op, attrs, g, xs, y, params, kernels, need):
    """A backward that passes g to the input as if the parameter were 1."""
    _, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
    return [g if need[0] else None], param_grads


class AddParameter(ParameterOp):
    """y = x + P, a parameter added to its input (a learned positional embedding (1, T, D)): module docstring."""

    name = "add_parameter"
    verb = "adds"
    torch_calls = (operator.add, torch.add)

    def forward(self, attrs, xs, params, kernels):
        return xs[0] + params[attrs["parameter"]]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        shape = tuple(params[attrs["parameter"]].shape)
        return [g if need[0] else None], {attrs["parameter"]: sum_to_parameter(g, shape)}

    def forward_error(self, attrs, ins, y, params, ctx):
        own = ctx.u * y.abs()
        error = own if ins[0].error is None else (1 + ctx.u) * ins[0].error + own
        return Field(y, error, ins[0].radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        shape = tuple(params[attrs["parameter"]].shape)
        parts = {attrs["parameter"]: _gradient_parts(g, grad.error, grad.flips, shape, ctx, grad.flip_count)}
        if not need[0]:
            return [None], parts
        # dx = g exactly: the same tensors, which this op does not own
        return [GradField(grad.error, grad.flips, grad.radius, grad.flip_count, False)], parts

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return u * y.abs()

    def port_slips(self, attrs, in_shape):
        return [PortSlip("parameter", f"averages {attrs['parameter']}'s gradient over the batch instead of summing",
                         lambda: BackwardReplaced(self, _mean_over_batch), every=("every added parameter",))]


for _op in (ScaleByParameter(), AddParameter()):
    register(_op)
