"""Error-accumulation model: how large rounding error can be, per element, at a claimed precision.

Every quantity a network produces is an inner product (a sum of n products) or a chain of
them; the scalar model of one sum (n, S = Σ|terms|, γ̃ₙ(λ), reduced-format operand rounding,
dependent upstream errors) is in `precision_lab.roundoff`, with its sources. This module walks a
float64 reference trace (precision_lab.compute.Trace) through the network:

* forward, layer by layer, each op's `forward_error` (precision_lab.ops) turns the error bound of
  its inputs into that of its output: γ̃·S of its own sums, operand rounding, upstream errors
  through |W|, ReLU flips and max-pool switches, routing;
* the loss gives its own bound and the error of ∂loss/∂output;
* backward, each op's `backward_error` gives its parameters' gradient bounds (`Parts`) and the
  error of its inputs' gradients; where a tensor feeds several layers (skip connections), the
  gradients it receives are summed and that sum's rounding is added.

On problems small enough (precision_lab.sampled.ELEMENT_LIMIT) the upstream part of every bound (of a
reduced-format claim: the loss's and the output's) is also measured by sampled propagation
(precision_lab.sampled: K float64 runs with each rounding drawn at its scale, through the signed weights)
and the smaller of the two is kept (`_tighten`).

Bounds are evaluated in float32 from the reference's float32-rounded intermediates (memory and
speed at 1024²): the float32 evaluation of a sum of non-negative terms is within γ̃ₙ(λ) ≤ 7e-4
of exact at n = 2²¹, covered by the EVALUATION_MARGIN below. Elements with S = 0 (dead channels)
are computed exactly by any order; their bound gets a floor of one unit roundoff of the tensor's
largest S so that a ratio never divides by zero.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import formats, sampled
from .compute import Trace, layer_params
from .ops import LOSSES, OPS, BoundContext, Field, GradField, Kernels, Parts
from .roundoff import (LAMBDA, ROUNDED_OPERANDS, SUBNORMAL_SPACING, accumulation_precision, blocked_gamma,  # noqa: F401
                       dependency_count, failure_probability, gamma, pairwise_gamma, probabilistic_gamma,
                       summation_factors)

#: relative headroom for evaluating bounds in float32: γ̃_{2²¹}(7) at u = 2⁻²⁴ is 6.1e-4 < 2⁻⁸
EVALUATION_MARGIN = 1.0 + 2.0 ** -8


def quantities(network) -> tuple[str, ...]:
    """Every quantity a verdict judges: the loss, the network output, each parameter gradient."""
    return ("loss", "output") + network.parameter_names


@dataclass
class QuantityBound:
    """The bound on |computed − exact| for one quantity, element by element, with its parts."""

    name: str
    n: int
    abs_sum: np.ndarray  # S
    accumulation: np.ndarray  # γ̃ₙ(λ)·S
    input_rounding: np.ndarray  # reduced-format operand rounding
    propagated: np.ndarray  # upstream errors entering this sum
    bound: np.ndarray  # total, floored, with evaluation margin
    relu_flips: int = 0  # ReLU positions (and max-pool windows) upstream whose decision the errors could flip
    sampled: int = 0  # elements whose bound is the sampled propagation's (precision_lab.sampled), not |W|·E
    drifted: np.ndarray | None = None  # elements whose own part is a repeated-value sum's drift (roundoff.column_drift)
    along: float | None = None  # bound on the error's projection on the reference's direction (a reduced format's)
    drawn: np.ndarray | None = None  # share of `accumulation` a reduced format's sampled runs draw (Parts.drawn)

    @property
    def max(self) -> float:
        return float(np.max(self.bound))


def bound_kernels(device: torch.device) -> Kernels:
    """The bounds' own convolutions: the reference's (shift-and-GEMM on CPU, whose weight-gradient
    workspace stays small at 1024²; cuDNN on GPU, in IEEE float32 there — see _ieee)."""
    from .reference import reference_kernels

    return reference_kernels(device)


def _ieee(device: torch.device):
    """No TF32 inside a bound: cuDNN/cuBLAS in IEEE float32 for the bounds' convolutions."""
    if device.type == "cuda":
        from .conv.backends import native_flags

        return native_flags(fp32_precision="ieee")
    return contextlib.nullcontext()


def _as_tensor(value, like: torch.Tensor) -> torch.Tensor:
    if torch.is_tensor(value):
        return value
    return torch.full_like(like, float(value))


def _floored(bound: torch.Tensor, abs_sum: torch.Tensor, u: float) -> torch.Tensor:
    # dead elements (S = 0) are exact in any order; floor at one u of the tensor's largest S
    floor = max(u * float(abs_sum.max()), np.finfo(np.float32).tiny)
    # |W|·E through a deep network can overflow float32 (inf, and 0·inf = NaN): a bound that large is
    # infinite, not undefined — it certifies nothing (compare.certify), and never makes a right result a defect
    return torch.clamp(torch.nan_to_num(bound * EVALUATION_MARGIN, nan=math.inf), min=floor)


def _quantity(name: str, parts: Parts, u: float, shape=None) -> QuantityBound:
    abs_sum = parts.abs_sum
    acc = _as_tensor(parts.accumulation, abs_sum)
    rnd = _as_tensor(parts.input_rounding, abs_sum)
    prop = _as_tensor(parts.propagated, abs_sum)
    bound = _floored(acc + rnd + prop, abs_sum, u)

    def as_np(t):
        t = t.double().cpu().numpy()
        return t.reshape(shape) if shape is not None else t

    drifted = None
    if parts.drifted is not None and bool(parts.drifted.any()):
        drifted = torch.broadcast_to(parts.drifted.to(abs_sum.device), abs_sum.shape).cpu().numpy()
        drifted = drifted.reshape(shape) if shape is not None else drifted
    drawn = None if parts.drawn is None else as_np(_as_tensor(parts.drawn, abs_sum))
    return QuantityBound(name, parts.n, as_np(abs_sum), as_np(acc), as_np(rnd), as_np(prop), as_np(bound), parts.flips,
                         drifted=drifted, drawn=drawn)


def error_bounds(trace: Trace, precision: str = "float32", lam: float = LAMBDA,
                 loss_scale: float = 1.0) -> dict[str, QuantityBound]:
    """Per-element rounding bound for loss, output and every parameter gradient of `trace` at `precision`.

    `trace` is the float64 reference (it holds the exact-enough intermediates); `precision`
    is the candidate's claimed arithmetic; `loss_scale`, a float16 program's loss scale (1: none, which covers
    every scale). The trace is never modified (its meta caches the result).
    """
    formats.unit_roundoff(precision)  # raises for an unknown precision
    loss_scale = float(loss_scale) if precision == "float16" else 1.0
    cache = trace.meta.setdefault("error_bounds", {})  # one evaluation per trace and precision
    key = (precision, lam) if loss_scale == 1.0 else (precision, lam, loss_scale)
    if key not in cache:
        with torch.no_grad(), _ieee(trace.device):
            bounds = _error_bounds(trace, precision, lam)
            u = formats.unit_roundoff(accumulation_precision(precision))
            if sampled.applies(trace, precision) and precision in formats.REDUCED_FORMATS:
                # every rounding the format makes, drawn through the network, with its switches' flips as Bernoulli
                # events of their own probability (precision_lab.switching; docs/error-model.md, "Reduced formats")
                reduced = sampled.reduced_upstream_bounds(trace, precision, lam, loss_scale)
                _tighten_reduced(bounds, reduced, trace, precision, u, loss_scale)
            elif sampled.applies(trace, precision):
                _tighten(bounds, sampled.upstream_bounds(trace, precision, lam), u)
            cache[key] = bounds
    return cache[key]


def _tighten_reduced(bounds: dict[str, QuantityBound], reduced, trace: Trace, precision: str, u: float,
                     loss_scale: float) -> None:
    """A reduced format's quantities take the sampled bound (sampled.reduced_upstream_bounds) where smaller.

    The runs draw every operand's rounding and every result's, the output's last one included, so the own part
    left is a sum's float32 accumulation (the loss's and each parameter gradient's: γ̃ₙ(λ)·S or the partial-sum
    bound) and, in a stored format, the parameter gradient's own storage: one rounding, u_f·|ĝ| + η_f/(2·scale),
    with |ĝ| ≤ |g| + its upstream bound. Along the gradient's direction ĝ the own parts add as independent mean-zero
    roundings (Hoeffding: λ·√Σ(own·ĝ)²) and the sampled part is the runs' own projection."""
    stored = precision in formats.STORED_FORMATS
    for name, up in reduced.upstream.items():
        q = bounds[name]
        up = np.asarray(up).reshape(q.bound.shape)
        if name == "output":
            own = np.zeros_like(q.accumulation)
        else:
            own = np.asarray(q.accumulation, np.float64)
            if q.drawn is not None:  # an attention block's inside roundings: the runs draw them
                own = own - np.asarray(q.drawn, np.float64).reshape(own.shape)
            if stored and name != "loss":
                reference = np.abs(np.asarray(trace.grads[name], np.float64)).reshape(q.bound.shape)
                own = own + (formats.unit_roundoff(precision) * (reference + up)
                             + SUBNORMAL_SPACING[precision] / (2 * loss_scale))
        floor = max(u * float(np.max(q.abs_sum)), np.finfo(np.float32).tiny)
        candidate = np.maximum((own + up) * EVALUATION_MARGIN, floor)
        tighter = candidate < q.bound
        q.bound = np.where(tighter, candidate, q.bound)
        q.propagated = np.where(tighter, up, q.propagated)
        q.input_rounding = np.where(tighter, 0.0, q.input_rounding)
        q.accumulation = np.where(tighter, own, q.accumulation)
        q.sampled = int(np.count_nonzero(tighter))
        if name in reduced.along:
            g = np.asarray(trace.grads[name], np.float64).reshape(q.bound.shape)
            size = float(np.linalg.norm(g))
            direction = np.abs(g) / size if size > 0 else np.zeros_like(g)
            own_along = LAMBDA * float(np.sqrt(np.sum((own * direction) ** 2)))
            q.along = (own_along + reduced.along[name]) * EVALUATION_MARGIN


def _tighten(bounds: dict[str, QuantityBound], upstream: dict[str, np.ndarray], u: float) -> None:
    """Each quantity of `upstream` gets its propagated part replaced by the sampled one (precision_lab.sampled) where
    smaller.

    The output's sampled deviations include its own last rounding (every layer's output is drawn), so its
    accumulation is not added again; a gradient's and the loss's own rounding stay errmodel's γ̃ₙ·S."""
    for name, up in upstream.items():
        q = bounds[name]
        up = up.reshape(q.bound.shape)
        own = q.input_rounding if name == "output" else q.accumulation + q.input_rounding
        floor = max(u * float(np.max(q.abs_sum)), np.finfo(np.float32).tiny)
        candidate = np.maximum((own + up) * EVALUATION_MARGIN, floor)
        tighter = candidate < q.bound
        q.bound = np.where(tighter, candidate, q.bound)
        q.propagated = np.where(tighter, up, q.propagated)
        q.sampled = int(np.count_nonzero(tighter))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, READ ONLY: a float32 trace tensor comes back as itself, not a copy."""
    return t.detach().to(torch.float32) if t.is_floating_point() else t


def _storage(magnitude: np.ndarray, precision: str) -> np.ndarray:
    """One rounding to a stored format of values up to `magnitude`: u_f·|x| + η_f/2."""
    return formats.unit_roundoff(precision) * magnitude + SUBNORMAL_SPACING[precision] / 2


def _storage_bias(bias: torch.Tensor, shape, precision: str) -> np.ndarray:
    """A bias's rounding to the format, per channel, broadcast over an output of `shape` (batch, channels, …)."""
    per_channel = _storage(np.abs(bias.double().cpu().numpy()), precision)
    return per_channel.reshape((1, -1) + (1,) * (len(shape) - 2)) if len(shape) >= 2 else per_channel


def _stored(error: torch.Tensor | None, value: torch.Tensor, precision: str) -> torch.Tensor:
    """An error bound after the value is kept in a stored format: plus u_f·(|value| + error) + η_f/2."""
    magnitude = value.abs().to(torch.float32) if error is None else value.abs().to(torch.float32) + error
    rounding = magnitude.mul_(formats.unit_roundoff(precision)).add_(SUBNORMAL_SPACING[precision] / 2)
    return rounding if error is None else error + rounding


def _error_bounds(trace: Trace, precision: str, lam: float) -> dict[str, QuantityBound]:
    network = trace.network
    # autocast keeps results in bfloat16 or float16: every layer that computes (not a selection), every gradient, the
    # output and the parameter gradients round once more (formats.STORED_FORMATS)
    stored = precision in formats.STORED_FORMATS
    u = formats.unit_roundoff(accumulation_precision(precision))
    # S of a weight gradient is the same in every claim's bound: the trace's meta keeps it for the next claim's
    ctx = BoundContext(precision, u, lam, bound_kernels(trace.device), shared=trace.meta.setdefault("shared_sums", {}))
    layers, last = network.layers, len(network.layers) - 1
    params = trace.params
    out: dict[str, QuantityBound] = {}

    # forward: each layer's output error from its inputs' (the network input is exact: float32 values)
    fields: dict[int, Field] = {-1: Field(_f32(trace.input), None, 0)}
    remaining_readers = {i: len(r) for i, r in network.consumers.items()}
    for layer in layers:
        op = OPS[layer.op]
        inputs = [fields[i] for i in layer.inputs]
        for i, field in zip(layer.inputs, inputs):
            # the last reader may overwrite an error no backward rule reads (memory and time at 1024²)
            field.consumable = i >= 0 and remaining_readers[i] == 1 and not _error_read_backward(network, i)
        y = trace.value(layer.index)
        y = y if layer.index == last else _f32(y)
        ctx.at_layer(layer.index)
        if layer.index == last and op.parametrised:
            field = op.forward_error(layer.attrs, inputs, y, layer_params(params, layer), ctx, parts=True)
        else:
            field = op.forward_error(layer.attrs, inputs, y, layer_params(params, layer), ctx)
        # errors shared across the batch (a batch norm's statistics) stay shared in everything computed from them
        field.coupled = field.coupled or any(f.coupled for f in inputs)
        if stored and layer.index != last:  # a result kept in the format: one more rounding (a selection's is exact,
            field.error = _stored(field.error, y, precision)  # counted anyway: this bound is the large problems')
        fields[layer.index] = field
        for i in layer.inputs:
            remaining_readers[i] -= 1
            if remaining_readers[i] == 0 and i >= 0 and not _error_read_backward(network, i):
                fields[i].error = None  # no reader's backward rule reads it: free it now (memory at 1024²)
    output_field = fields[last]
    if "parts" in output_field.memo:
        out["output"] = _quantity("output", output_field.memo.pop("parts"), u)
    else:
        error = output_field.error if output_field.error is not None else torch.zeros_like(_f32(output_field.value))
        out["output"] = _quantity("output", Parts(1, _f32(output_field.value).abs(), error, 0.0, 0.0,
                                                  output_field.flips), u)
    if stored:  # the network's output kept in the format, and a bias it rounds (autocast casts it with the weight)
        extra = _storage(np.abs(np.asarray(trace.output, np.float64)) + out["output"].bound, precision)
        if network.layers[last].name and f"{network.layers[last].name}.bias" in params:
            extra = extra + _storage_bias(params[f"{network.layers[last].name}.bias"], out["output"].bound.shape,
                                          precision)
        with np.errstate(over="ignore"):  # a |W|·E bound near float32's top becomes infinite: it certifies nothing
            out["output"].bound = out["output"].bound + extra

    # the loss: its bound, and the error of ∂loss/∂output that starts the backward
    loss_parts, grad_field = LOSSES[network.loss].bound(output_field, trace.target, trace.loss, ctx)
    out["loss"] = _quantity("loss", loss_parts, u)

    pending: dict[int, list[GradField]] = {last: [grad_field]}
    # no backward rule reads its own output's error: once every reader's backward has run, it is freed (memory at 1024²)
    readers_left = {i: len(set(r)) for i, r in network.consumers.items()}
    for layer in reversed(layers):
        for i in set(layer.inputs):
            readers_left[i] -= 1
        contributions = pending.pop(layer.index, [])
        if not contributions:
            continue
        g = _f32(trace.grad_at(layer.index))
        grad = _combine(contributions, g, ctx)
        if stored:  # the gradient kept in the format (scaled by the loss scale first: 1 covers every scale)
            grad.error = _stored(grad.error, g, precision)
        need = [i >= 0 for i in layer.inputs]
        inputs = [fields[i] for i in layer.inputs]
        ctx.at_layer(~layer.index)  # the backward rule's sums apart from the forward's
        input_grads, parts = OPS[layer.op].backward_error(layer.attrs, g, grad, inputs, fields[layer.index],
                                                          layer_params(params, layer), ctx, need)
        for suffix, part in parts.items():
            name = f"{layer.name}.{suffix}"
            out[name] = _quantity(name, part, u, network.param_shapes[name])
            if stored:  # the parameter gradient kept in the format before it is cast back
                with np.errstate(over="ignore"):
                    out[name].bound = out[name].bound + _storage(np.abs(np.asarray(trace.grads[name], np.float64))
                                                                 + out[name].bound, precision)
        for i, field in zip(layer.inputs, input_grads):
            if field is not None:
                field.coupled = field.coupled or grad.coupled or any(f.coupled for f in inputs)
                if layer.index == last:  # the loss's float64 error, passed on unchanged (a sub, an add): float32 below
                    field = GradField(_f32(field.error), None if field.flips is None else _f32(field.flips),
                                      field.radius, field.flip_count, field.owned, field.coupled)
                pending.setdefault(i, []).append(field)
        fields.pop(layer.index)  # every reader of this output is behind us: free its value and error
        for i in set(layer.inputs):
            if i >= 0 and readers_left[i] == 0:
                fields[i].error = None
        del g, grad, contributions
    return {name: out[name] for name in quantities(network)}


def _error_read_backward(network, index: int) -> bool:
    """Whether a reader's backward rule reads the input's forward error (parametrised and smooth ops do)."""
    return any(OPS[network.layers[r].op].reads_error_backward for r in network.consumers[index])


def _combine(contributions: list[GradField], g: torch.Tensor, ctx: BoundContext) -> GradField:
    """The gradient a tensor receives from several readers, summed (skip connections).

    m contributions summed in any order: each partial sum is at most |g| plus the contributions'
    errors (one contribution may be unknown in size: the partial sums are then sums of the others
    or g minus them), so the sum's own rounding is at most (m − 1)·u·(|g| + ΣE + ΣF), Higham 2002 §3.1.
    """
    if len(contributions) == 1:
        return contributions[0]
    m = len(contributions)
    error = contributions[0].error.clone()
    for c in contributions[1:]:
        error += c.error
    flip_parts = [c.flips for c in contributions if c.flips is not None]
    flips = None
    if flip_parts:
        flips = flip_parts[0].clone()
        for f in flip_parts[1:]:
            flips += f
    magnitude = g.abs() + error + (flips if flips is not None else 0.0)
    error = error + (m - 1) * ctx.u * magnitude
    radii = [c.radius for c in contributions]
    radius = None if any(r is None for r in radii) else max(radii)
    return GradField(error, flips, radius, max(c.flip_count for c in contributions),
                     coupled=any(c.coupled for c in contributions))


def gradient_bounds(trace: Trace, precision: str = "float32") -> dict[str, np.ndarray]:
    """Per-element bound on |ĝ − g| for every parameter gradient at `precision`."""
    bounds = error_bounds(trace, precision)
    return {name: bounds[name].bound for name in trace.network.parameter_names}


def abs_term_sums(trace: Trace) -> dict[str, np.ndarray]:
    """S for each parameter gradient: the sums recomputed on |operands| (float32 evaluation)."""
    bounds = error_bounds(trace, "float32")
    return {name: bounds[name].abs_sum for name in trace.network.parameter_names}


def terms_per_quantity(trace: Trace) -> dict[str, int]:
    """n for every quantity (terms accumulated per element)."""
    return {name: bound.n for name, bound in error_bounds(trace, "float32").items()}
