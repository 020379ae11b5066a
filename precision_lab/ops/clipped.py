"""Clipped and hard activations: hardtanh (ReLU6 among them), hardsigmoid, hardswish (MobileNet's).

Each is piecewise: a constant below its lower kink `lo`, a function f_in between the kinks, a constant (hardtanh,
hardsigmoid) or the identity (hardswish) above its upper kink `hi`. Like a ReLU they *switch*: the backward
follows a forward decision (which piece z lies on), and where the pre-activation z lies within its error bound
E_z of a kink the candidate may take the other piece (docs/error-model.md, "Clipped activations"):

* forward: |f(ẑ) − f(z)| ≤ L·E_z with L = sup|f'| over [z − E_z, z + E_z], piece by piece: 0 when the interval lies
  below `lo` (the output is then the constant, exactly), min(sup_in, |f_in'(z)| + M₂E_z) where it meets [lo, hi]
  (M₂ = sup|f_in''|), the slope above `hi` where it reaches above; plus the op's own rounding;
* backward: the output-gradient error E_g passes scaled by L, the slope's own change |g|·M₂E_z adds where the
  interval meets [lo, hi], and where a flip is possible the derivative may jump by J = (the largest jump at a
  kink) + M₂E_z: (|g| + E_g + F_g)·J is a deterministic part, as a ReLU's flips (ops/pointwise.py);
* the own rounding by the standard model, one relative u per operation (Higham, Accuracy and Stability of
  Numerical Algorithms, 2nd ed., §2.2; γₙ = nu/(1 − nu), Lemma 3.1).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, register
from .onnx_reading import attr, require, unary
from .pointwise import STORED_WIDENING, UnmaskedReLU, _near, masked_by
from .. import switching
from ..roundoff import gamma

#: a reformulated hard activation (x·(1/6) + ½ in place of (x + 3)/6, ONNX's form) rounds near a kink: outside
#: [lo, hi] widened by this relative margin its output is the constant exactly (docs/error-model.md derives 4u)
KINK_BAND_UNITS = 4.0


class Clipped(Op):
    """A piecewise activation with kinks lo < hi (module docstring); subclasses give the pieces and the roundings."""

    elementwise = True
    masks = True
    switches = True
    reads_error_backward = True
    above_slope = 0.0  # f' above hi: 0 for a clip, 1 for hardswish
    curvature = 0.0  # M₂ = sup|f_in''| on [lo, hi]

    def kinks(self, attrs) -> tuple[float, float]:
        raise NotImplementedError

    def inside_slope(self, attrs, z: torch.Tensor) -> torch.Tensor:
        """f_in'(z), the derivative between the kinks."""
        raise NotImplementedError

    def largest_inside_slope(self, attrs) -> float:
        """sup|f_in'| on [lo, hi] (f_in' is linear: at a kink)."""
        lo, hi = self.kinks(attrs)
        ends = self.inside_slope(attrs, torch.tensor([lo, hi], dtype=torch.float64)).abs()
        return float(ends.max())

    def largest_jump(self, attrs) -> float:
        """The largest jump of f' at a kink: |f_in'(lo) − 0| or |f_in'(hi) − above_slope|."""
        lo, hi = self.kinks(attrs)
        at = self.inside_slope(attrs, torch.tensor([lo, hi], dtype=torch.float64))
        return max(abs(float(at[0])), abs(float(at[1]) - self.above_slope))

    def derivative(self, attrs, z: torch.Tensor) -> torch.Tensor:
        """f'(z) as PyTorch's backward takes it: 0 at or below lo, f_in' inside, above_slope at or above hi."""
        lo, hi = self.kinks(attrs)
        inside = (z > lo) & (z < hi)
        return torch.where(inside, self.inside_slope(attrs, z), torch.where(z >= hi, self.above_slope, 0.0).to(z.dtype))

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g * self.derivative(attrs, xs[0])], {}

    def own_forward(self, attrs, z_reach, y_reach, band, u) -> torch.Tensor | float:
        """The own rounding of the output given |ẑ| ≤ z_reach, |f(ẑ)| ≤ y_reach; `band`: where ẑ may lie within
        the kinks widened by KINK_BAND_UNITS·u (outside it the output is a constant or ẑ itself)."""
        return 0.0

    def own_backward(self, attrs, g_abs, z_reach, band, u) -> torch.Tensor | float:
        """The own rounding of the input gradient (the same arguments, |g| for the output gradient)."""
        return 0.0

    # the error model ------------------------------------------------------------------------------------------
    def _reach(self, attrs, z, error, u):
        """(E widened for z's float32 storage, L, where the interval meets [lo, hi], `band`, where it may flip)."""
        lo, hi = self.kinks(attrs)
        e = torch.zeros_like(z) if error is None else error * STORED_WIDENING
        meets = (z + e > lo) & (z - e < hi)
        slope = torch.clamp(self.inside_slope(attrs, z).abs() + self.curvature * e, max=self.largest_inside_slope(attrs))
        reach = torch.where(meets, slope, torch.zeros_like(z))
        if self.above_slope:
            reach = torch.where(z + e > hi, torch.clamp(reach, min=abs(self.above_slope)), reach)
        widen = KINK_BAND_UNITS * u
        band = (z + e > lo - widen * abs(lo)) & (z - e < hi + widen * abs(hi))
        flip = ((z - lo).abs() <= e) | ((z - hi).abs() <= e)
        return e, reach, meets, band, flip

    def forward_error(self, attrs, ins, y, params, ctx):
        z, error = ins[0].value, ins[0].error
        e, reach, _, band, flip = self._reach(attrs, z, error, ctx.u)
        propagated = reach * e
        own = self.own_forward(attrs, z.abs() + e, y.abs() + propagated, band, ctx.u)
        flip_count = int(torch.count_nonzero(flip)) if error is not None else 0
        nonnegative = not self.above_slope  # 0 below the kinks: hardtanh's own min_val decides it (its override)
        return Field(y, propagated + own, ins[0].radius, ins[0].flips + flip_count,
                     {"may_flip": flip if flip_count else None, "flip_count": flip_count}, nonnegative=nonnegative)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        z = ins[0].value
        e, reach, meets, band, _ = self._reach(attrs, z, ins[0].error, ctx.u)
        g_abs = g.abs()
        error = grad.error * reach + self.own_backward(attrs, g_abs, z.abs() + e, band, ctx.u)
        if self.curvature:
            error = error + g_abs * (self.curvature * e) * meets  # f_in'(ẑ) − f_in'(z) within M₂E_z
        flips = grad.flips * reach if grad.flips is not None else None
        may_flip, flip_count = out.memo.get("may_flip"), out.memo.get("flip_count", 0)
        if flip_count:
            jump = self.largest_jump(attrs) + self.curvature * e
            whole = (g_abs + grad.error + (grad.flips if grad.flips is not None else 0.0)) * jump * may_flip
            flips = whole if flips is None else flips + whole
        return [GradField(error, flips, grad.radius, grad.flip_count + flip_count)], {}

    def switch_flips(self, attrs, x, variance, g, samples):
        """Each kink a Bernoulli flip of its own probability (switching.flip_probability); both kinks' probabilities
        are left out together (switching.kept); where z lies inside and f_in' varies, the slope's own change
        g·M₂·e (e of variance V̂) adds a spread of |g|·M₂·√V̂."""
        lo, hi = self.kinks(attrs)
        d = self.derivative(attrs, x)
        at = self.inside_slope(attrs, torch.tensor([lo, hi], dtype=x.dtype, device=x.device))
        jumps = [(torch.where(x > lo, torch.zeros_like(x), at[0]) - d) * g,
                 (torch.where(x < hi, torch.full_like(x, self.above_slope), at[1]) - d) * g]
        p = switching.kept(torch.stack([switching.flip_probability((x - k).abs(), variance, samples) for k in (lo, hi)]))
        mean, square = torch.zeros_like(x), torch.zeros_like(x)
        for jump, chance in zip(jumps, p):
            m, s = switching.bernoulli(jump, chance)
            mean, square = mean + m, square + s * s
        if self.curvature:
            square = square + (g * self.curvature) ** 2 * variance * ((x > lo) & (x < hi))
        return mean, square.sqrt(), switching.expected_flips(p)

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        z = xs[0]
        own = self.own_forward(attrs, z.abs(), y.abs(), self._reach(attrs, z, None, u)[3], u)
        if not torch.is_tensor(own):
            return torch.full_like(y, own) if own else None
        return own

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        z = xs[0]
        own = self.own_backward(attrs, g.abs(), z.abs(), self._reach(attrs, z, None, u)[3], u)
        return [own if torch.is_tensor(own) and need[0] else None]


class BackwardOf(UnmaskedReLU):
    """An op whose backward is another derivative `slope(x)` (a port's slip), its forward the op's own."""

    def __init__(self, op, slope):
        super().__init__(op)
        self.slope = slope

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g * self.slope(attrs, xs[0])], {}


def _number(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpSpecError(f"'{key}' is {value!r}: expected a finite number")
    return float(value)


class Hardtanh(Clipped):
    """clamp(z, min_val, max_val); ReLU6 is min_val = 0, max_val = 6. Exact in any format, but for a bound that is
    not a float32: the candidate clamps to its rounding, u·|bound| away."""

    name = "hardtanh"
    keys = {"min_val": -1.0, "max_val": 1.0}

    torch_modules = (torch.nn.Hardtanh,)  # nn.ReLU6 is a Hardtanh(0, 6)
    torch_calls = (F.hardtanh, F.relu6)
    onnx_ops = ("Clip",)

    def check(self, attrs):
        lo, hi = _number(attrs["min_val"], "min_val"), _number(attrs["max_val"], "max_val")
        if not lo < hi:
            raise OpSpecError(f"'min_val' {lo:g} is not below 'max_val' {hi:g}: swap them")
        return {"min_val": lo, "max_val": hi}

    def kinks(self, attrs):
        return attrs["min_val"], attrs["max_val"]

    def describe(self, attrs):
        if (attrs["min_val"], attrs["max_val"]) == (0.0, 6.0):
            return "relu6"
        return f"hardtanh [{attrs['min_val']:g}, {attrs['max_val']:g}]"

    def from_torch_module(self, module):
        return {"min_val": float(module.min_val), "max_val": float(module.max_val)}

    def from_torch_call(self, target, args, kwargs):
        if target is F.relu6:
            return {"min_val": 0.0, "max_val": 6.0}
        lo = kwargs.get("min_val", args[1] if len(args) > 1 else -1.0)
        hi = kwargs.get("max_val", args[2] if len(args) > 2 else 1.0)
        return {"min_val": float(lo), "max_val": float(hi)}

    def from_onnx_node(self, node, graph):
        """Clip with constant bounds: inputs 1 and 2 from opset 11, attributes min and max before."""
        values = [graph.constant(t) if t else None for t in node.inputs[1:3]]
        lo = attr(node, "min") if len(node.inputs) < 2 else (None if values[0] is None else float(values[0]))
        hi = attr(node, "max") if len(node.inputs) < 3 else (None if values[1] is None else float(values[1]))
        require(lo is not None and hi is not None,
                "Clip without a constant min and max: the lab's hardtanh clips to both (export with both bounds)")
        return unary(node, graph, self.check({"min_val": float(lo), "max_val": float(hi)}))

    def torch_forward(self, attrs, xs, module):
        return F.hardtanh(xs[0], attrs["min_val"], attrs["max_val"])

    def forward(self, attrs, xs, params, kernels):
        return F.hardtanh(xs[0], attrs["min_val"], attrs["max_val"])

    def inside_slope(self, attrs, z):
        return torch.ones_like(z)

    def forward_error(self, attrs, ins, y, params, ctx):
        out = super().forward_error(attrs, ins, y, params, ctx)
        out.nonnegative = attrs["min_val"] >= 0
        return out

    def own_forward(self, attrs, z_reach, y_reach, band, u):
        # a bound that is no float32 is clamped to its rounding: u·|bound| at most
        return sum(u * abs(bound) for bound in self.kinks(attrs) if float(np.float32(bound)) != bound)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        lo, hi = self.kinks(attrs)
        # open where lo < x < hi: min(x − lo, hi − x) > 0, its sign exact (Sterbenz: the differences' signs are)
        return [masked_by(g, torch.minimum(xs[0] - lo, hi - xs[0]))], {}

    def port_slips(self, attrs, in_shape):
        lo, hi = self.kinks(attrs)
        return [PortSlip("mask", f"backward: gradient passed above {hi:g} (a ReLU's backward)",
                         lambda: BackwardOf(self, lambda a, x: (x > lo).to(x.dtype))),
                PortSlip("mask", "backward: mask missing", lambda: UnmaskedReLU(self)),
                PortSlip("default", f"forward: the clip at {hi:g} is missing (a ReLU where the spec clips)",
                         lambda: OtherAttributes(self, {"max_val": math.inf}), forward=True)]


class Hardsigmoid(Clipped):
    """relu6(z + 3)/6. PyTorch computes min(max(z + 3, 0), 6)/6, ONNX's HardSigmoid z·(1/6) + ½ clamped to [0, 1]:
    both within γ₃·(|z|/6 + |y|) between the (widened) kinks (docs/error-model.md), exact outside."""

    name = "hardsigmoid"

    torch_modules = (torch.nn.Hardsigmoid,)
    torch_calls = (F.hardsigmoid,)
    onnx_ops = ("HardSigmoid",)

    def kinks(self, attrs):
        return -3.0, 3.0

    def from_onnx_node(self, node, graph):
        require(_near(attr(node, "alpha", 0.2), 1 / 6) and _near(attr(node, "beta", 0.5), 0.5),
                f"HardSigmoid with alpha {attr(node, 'alpha', 0.2):g}, beta {attr(node, 'beta', 0.5):g}: the lab's "
                f"hardsigmoid is PyTorch's (alpha 1/6, beta 0.5)")
        return unary(node, graph)

    def torch_forward(self, attrs, xs, module):
        return F.hardsigmoid(xs[0])

    def forward(self, attrs, xs, params, kernels):
        return F.hardsigmoid(xs[0])

    def inside_slope(self, attrs, z):
        return torch.full_like(z, 1 / 6)

    def own_forward(self, attrs, z_reach, y_reach, band, u):
        return gamma(3, u) * (z_reach / 6 + y_reach) * band

    def own_backward(self, attrs, g_abs, z_reach, band, u):
        return gamma(2, u) * g_abs / 6 * band  # g·fl(1/6): the constant's rounding and the product's

    def port_slips(self, attrs, in_shape):
        return [PortSlip("mask", "backward: mask missing (1/6 passed outside (−3, 3))",
                         lambda: BackwardOf(self, lambda a, x: torch.full_like(x, 1 / 6))),
                PortSlip("mask", "backward: the factor 1/6 missing",
                         lambda: BackwardOf(self, lambda a, x: ((x > -3) & (x < 3)).to(x.dtype)))]


class Hardswish(Clipped):
    """z·relu6(z + 3)/6: f' = (2z + 3)/6 between −3 and 3 (it jumps from 0 to −½ at −3 and from 3/2 to 1 at 3),
    M₂ = 1/3. PyTorch computes z·min(max(z + 3, 0), 6)/6 (three roundings), ONNX's HardSwish z·clip(z/6 + ½): within
    γ₃·(|y| + |z|(|z| + 3)/6) between the widened kinks, γ₂|z| above; its backward g·(z/3 + ½) within
    γ₃·|g|·(|z|/3 + ½) (docs/error-model.md)."""

    name = "hardswish"
    above_slope = 1.0
    curvature = 1 / 3

    torch_modules = (torch.nn.Hardswish,)
    torch_calls = (F.hardswish,)
    onnx_ops = ("HardSwish",)

    def kinks(self, attrs):
        return -3.0, 3.0

    def from_onnx_node(self, node, graph):
        return unary(node, graph)

    def torch_forward(self, attrs, xs, module):
        return F.hardswish(xs[0])

    def forward(self, attrs, xs, params, kernels):
        return F.hardswish(xs[0])

    def inside_slope(self, attrs, z):
        return z / 3 + 0.5

    def derivative(self, attrs, z):
        # PyTorch's hardswish_backward: 0 below −3, z/3 + ½ up to 3 included, 1 above
        return torch.where(z < -3, torch.zeros_like(z), torch.where(z <= 3, z / 3 + 0.5, torch.ones_like(z)))

    def own_forward(self, attrs, z_reach, y_reach, band, u):
        return gamma(3, u) * (y_reach + z_reach * (z_reach + 3) / 6 * band) + gamma(2, u) * z_reach * ~band

    def own_backward(self, attrs, g_abs, z_reach, band, u):
        return gamma(3, u) * g_abs * (z_reach / 3 + 0.5) * band

    def port_slips(self, attrs, in_shape):
        return [PortSlip("mask", "backward: (2x + 3)/6 everywhere (the switches at ±3 missing)",
                         lambda: BackwardOf(self, lambda a, x: x / 3 + 0.5)),
                PortSlip("mask", "backward: hardsigmoid's value passed (the product rule's x·h'(x) missing)",
                         lambda: BackwardOf(self, lambda a, x: F.hardsigmoid(x)))]


for _op in (Hardtanh(), Hardsigmoid(), Hardswish()):
    register(_op)
