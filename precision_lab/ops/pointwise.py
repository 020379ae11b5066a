"""Elementwise activations: relu, leaky_relu, tanh, sigmoid, gelu.

Piecewise-linear ones (relu, leaky_relu) compute exactly except leaky's one multiply; what the
errors can do is *flip* them: where the pre-activation z lies within its own error bound E_z,
the candidate may take the other branch, and the gradient through it is then wholly uncertain
(its |h| passed or blocked), which the backward carries as a deterministic part. Where z ≤ −E_z
a ReLU's output is exactly zero whatever the candidate computed before it.

Smooth ones (tanh, sigmoid, gelu) propagate an input error E by at most max|f'| over [z − E, z + E]
≤ (|f'(z)| + M₂E)·E with M₂ = sup|f''|, and add their own evaluation error: a float32 library
evaluates them within a few ulps (CUDA C Programming Guide, "Mathematical Functions": tanhf, expf,
erff ≤ 2 ulp) and formulas through exp (tanh = (e²ᶻ − 1)/(e²ᶻ + 1), σ = 1/(1 + e⁻ᶻ)) lose a few
units absolutely near their cancellation points: 8u·(|f| + |z·f'| + 1) covers both.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, Rule, register, sparse_enough
from .onnx_reading import OnnxRead, attr, followed_by, multiplies_by_itself, scalar, unary
from .. import formats, switching

#: z is read as its float32 rounding, |fl(z) − z| ≤ u₃₂·|z| (Higham 2002, Thm 2.2); 1 + 2u₃₂ covers that
#: and the rounding of E·(1 + 2u₃₂) itself (1 + u₃₂ is not a float32: it would round to 1)
STORED_WIDENING = 1.0 + 2.0 * formats.UNIT_ROUNDOFF["float32"]

#: elements per slice of a ReLU's forward bound on a CPU: its temporaries (1 MB) stay in cache, allocated once
SLICE_ELEMENTS = 1 << 18

#: evaluation error of a float32 activation, in units of u, on |f| + |z·f'| + 1 (module docstring)
FUNCTION_ERROR_UNITS = 8.0


def masked_by(g: torch.Tensor, source: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ReLU's backward: g where source > 0, else 0 (NaN passes), into `out` where given (it may be g). ATen's own
    threshold_backward: one vectorised pass, bit for bit g.masked_fill(source <= 0, 0), which forms a boolean image
    and fills it element by element, 10–15× slower at 1024² on a CPU."""
    if source.dtype != g.dtype or g.dtype not in (torch.float32, torch.float64):
        # a wider source is compared in its own precision (a cast could round a tiny z to 0); bfloat16's vectorised
        # select sets a NaN's sign bit
        closed = source <= 0
        return g.masked_fill(closed, 0.0) if out is None else out.copy_(g).masked_fill_(closed, 0.0)
    if out is None:
        return torch.ops.aten.threshold_backward(g, source, 0)
    return torch.ops.aten.threshold_backward.grad_input(g, source, 0, grad_input=out)


def _near(value: float | None, target: float) -> bool:
    """A decomposition's constant is `target` as exported: equal once both are rounded to float32."""
    return value is not None and np.float32(value) == np.float32(target)


def _has(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))


def _may_flip(z: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_z widened for z's float32 storage, where |z| ≤ E_z: the sign the candidate saw may differ).

    fl(z + E) has the sign of z + E (gradual underflow: x ⊕ y = 0 only if x = −y), so the test is exact."""
    widened = error * STORED_WIDENING
    return widened, torch.le(z, widened).logical_and_(torch.add(z, widened) >= 0)


#: other frameworks' defaults for a leaky ReLU's negative slope: a port that keeps its framework's default
#: computes another function (PyTorch's and JAX's 0.01, tf.nn.leaky_relu's 0.2, Keras's LeakyReLU 0.3)
LEAKY_SLOPE_DEFAULTS = {0.01: "PyTorch's and JAX's default", 0.2: "tf.nn.leaky_relu's default",
                        0.3: "Keras's LeakyReLU default"}


class UnmaskedReLU(Rule):
    """A ReLU (or leaky ReLU) whose backward forgot the mask: its forward is the op's own."""

    def __init__(self, op):
        self.op = op

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g], {}


class BorrowedMaskReLU(UnmaskedReLU):
    """A ReLU whose backward takes another ReLU's mask."""

    def __init__(self, op, source: torch.Tensor):
        super().__init__(op)
        self.source = source

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [masked_by(g, self.source.to(g.dtype))], {}


class ReLU(Op):
    name = "relu"
    elementwise = True
    slope = 0.0

    masks = True
    switches = True
    #: groups in which a mask missing from every such layer is one hypothesis
    mask_groups = ("every ReLU's", "every ReLU and leaky ReLU")

    torch_modules = (torch.nn.ReLU,)
    torch_calls = (torch.relu, F.relu, "relu")
    onnx_ops = ("Relu",)

    def port_slips(self, attrs, in_shape):
        return [PortSlip("mask", "backward: mask missing", lambda: UnmaskedReLU(self), every=self.mask_groups),
                PortSlip("mask", "backward: masked with {other}'s activation",
                         lambda other_input: BorrowedMaskReLU(self, other_input), borrows=True)]

    def local_slip(self, attrs, g, theirs, expected, bound, u, ratio):
        if ratio(theirs, g, bound + u * g.abs().float()) <= 1.0:
            return "mask missing (the gradient passes unmasked)"
        return None

    def torch_forward(self, attrs, xs, module):
        return torch.relu(xs[0])

    def forward(self, attrs, xs, params, kernels):
        return torch.relu(xs[0])

    def forward_inplace(self, attrs, x):
        """relu in place (the float64 reference: its input has no other use)."""
        return x.relu_()

    def derive_output(self, attrs, x):
        """The output recomputed from a stored input: relu of the float32 rounding is the rounding of relu."""
        return torch.relu(x)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        # relu(z) > 0 exactly where z > 0: the mask comes from whichever is still held
        return [masked_by(g, y if y is not None else xs[0])], {}

    def backward_inplace(self, attrs, g, y):
        """The backward writing into g (the float64 reference owns it): no new image-sized tensor."""
        return masked_by(g, y, out=g)

    def derive_input_grad(self, attrs, g_out, x):
        return masked_by(g_out, x)

    def negative_slope(self, attrs) -> float:
        return 0.0

    def switch_flips(self, attrs, x, variance, g, samples):
        # a flip opens a closed element (x ≤ 0: the gradient passes, (1 − slope)·g more) or closes an open one
        p = switching.kept(switching.flip_probability(x.abs(), variance, samples))
        jump = torch.where(x > 0, -g, g) * (1.0 - self.negative_slope(attrs))
        mean, spread = switching.bernoulli(jump, p)
        return mean, spread, switching.expected_flips(p)

    def forward_error(self, attrs, ins, y, params, ctx):
        z, error = ins[0].value, ins[0].error
        if error is None:
            return Field(y, None, ins[0].radius, ins[0].flips, nonnegative=True)
        widened = error.mul_(STORED_WIDENING) if ins[0].consumable else error * STORED_WIDENING
        widened = widened.contiguous()  # its flat view is written below (an error of any layout)
        may_flip = torch.empty(z.shape, dtype=torch.bool, device=z.device)
        # slice by slice on a CPU: z + E never becomes an image of its own (page faults cost more than the adds)
        z_flat, out_flat, flip_flat = z.reshape(-1), widened.view(-1), may_flip.view(-1)
        step = SLICE_ELEMENTS if z.device.type == "cpu" else max(1, z_flat.numel())
        shifted = torch.empty(min(step, z_flat.numel()), dtype=torch.promote_types(z.dtype, widened.dtype),
                              device=z.device)
        for start in range(0, z_flat.numel(), step):
            z_part, out_part, flip_part = (t[start:start + step] for t in (z_flat, out_flat, flip_flat))
            part = torch.add(z_part, out_part, out=shifted[:z_part.numel()])  # z + E: its sign is exact (gradual underflow)
            torch.le(z_part, out_part, out=flip_part).logical_and_(part >= 0)
            out_part.mul_(part.gt_(0))  # z ≤ −E: the output is exactly 0 whatever was computed
        out = widened
        del shifted
        if ins[0].consumable:
            ins[0].error = None  # consumed: it is this output's error now
        flip_count = int(torch.count_nonzero(may_flip))
        return Field(y, out, ins[0].radius, ins[0].flips + flip_count, {"may_flip": may_flip, "flip_count": flip_count},
                     nonnegative=True)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        z = ins[0].value
        may_flip, flip_count = out.memo.get("may_flip"), out.memo.get("flip_count", 0)
        points = may_flip.nonzero(as_tuple=True) if sparse_enough(flip_count) else None
        if flip_count and points is None:
            closed = z <= 0  # where the exact gradient is blocked and no flip can open it
            closed.logical_and_(~may_flip)
            error = grad.error.masked_fill_(closed, 0.0) if grad.owned else grad.error.masked_fill(closed, 0.0)
            flips = None
            if grad.flips is not None:
                flips = grad.flips.masked_fill_(closed, 0.0) if grad.owned else grad.flips.masked_fill(closed, 0.0)
            del closed
        else:
            # blocked where z ≤ 0, then the few points a flip may open given back their errors: the same fields
            error, flips = (self._blocked(grad.error, z, points, grad.owned),
                            self._blocked(grad.flips, z, points, grad.owned))
        if flip_count:
            # a flipped ReLU passes or blocks the whole gradient: |h| + its errors, deterministically
            if points is not None:
                whole = g[points].abs() + error[points] + (flips[points] if flips is not None else 0.0)
                flips = torch.zeros_like(error) if flips is None else flips
                flips.index_put_(points, whole, accumulate=True)
            else:
                whole = g.abs().add_(error)
                if flips is not None:
                    whole.add_(flips)
                flips = whole.mul_(may_flip) if flips is None else flips.add_(whole.mul_(may_flip))
        return [GradField(error, flips, grad.radius, grad.flip_count + flip_count)], {}

    @staticmethod
    def _blocked(field, z, points, owned: bool):
        """`field` where z > 0, else 0, but kept at `points` (those a flip may open; None: none)."""
        if field is None:
            return None
        kept = field[points] if points is not None else None
        field = masked_by(field, z, out=field if owned else None)
        return field if kept is None else field.index_put_(points, kept)


class LeakyReLU(ReLU):
    name = "leaky_relu"
    keys = {"slope": 0.01}

    mask_groups = ("every ReLU and leaky ReLU",)

    torch_modules = (torch.nn.LeakyReLU,)
    torch_calls = (F.leaky_relu,)
    onnx_ops = ("LeakyRelu",)

    def from_onnx_node(self, node, graph):
        return unary(node, graph, {"slope": attr(node, "alpha", 0.01)})  # ONNX's default alpha is PyTorch's 0.01

    def from_torch_module(self, module):
        return {"slope": float(module.negative_slope)}

    def from_torch_call(self, target, args, kwargs):
        return {"slope": float(kwargs.get("negative_slope", args[1] if len(args) > 1 else 0.01))}

    def port_slips(self, attrs, in_shape):
        slips = super().port_slips(attrs, in_shape)
        for slope, whose in LEAKY_SLOPE_DEFAULTS.items():
            if not math.isclose(slope, attrs["slope"]):
                slips.append(PortSlip("default", f"computed with a leaky ReLU slope of {slope:g} ({whose}) where the "
                                                 f"spec says {attrs['slope']:g}: pass the slope explicitly",
                                      lambda slope=slope: OtherAttributes(self, {"slope": slope}), forward=True))
        return slips

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return u * abs(attrs["slope"]) * xs[0].abs() * (xs[0] < 0)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return [u * abs(attrs["slope"]) * g.abs() * (xs[0] <= 0)]

    def torch_forward(self, attrs, xs, module):
        return F.leaky_relu(xs[0], attrs["slope"])

    def check(self, attrs):
        slope = attrs["slope"]
        if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not math.isfinite(slope):
            raise OpSpecError(f"'slope' is {slope!r}: expected a number")
        attrs["slope"] = float(slope)
        return attrs

    def describe(self, attrs):
        return f"leaky_relu {attrs['slope']:g}"

    def negative_slope(self, attrs) -> float:
        return attrs["slope"]

    def forward(self, attrs, xs, params, kernels):
        return F.leaky_relu(xs[0], attrs["slope"])

    # none of ReLU's memory shortcuts: its backward scales negatives by the slope, it does not zero them
    forward_inplace = None
    backward_inplace = None
    derive_output = None

    def backward(self, attrs, g, xs, y, params, kernels, need):
        x = xs[0]
        factor = torch.where(x > 0, torch.ones_like(x), torch.full_like(x, attrs["slope"]))
        return [g * factor], {}

    derive_input_grad = None

    def forward_error(self, attrs, ins, y, params, ctx):
        z, error = ins[0].value, ins[0].error
        s = abs(attrs["slope"])
        rounding = ctx.u * s * z.abs() * (z < 0)  # the one multiply of the negative branch
        if error is None:
            return Field(y, rounding, ins[0].radius, ins[0].flips)
        widened, may_flip = _may_flip(z, error)
        positive = z >= widened
        factor = torch.where(positive, torch.ones_like(z), torch.full_like(z, s))
        factor = torch.where(may_flip, torch.full_like(z, max(1.0, s)), factor)
        flip_count = int(torch.count_nonzero(may_flip))
        return Field(y, widened * factor + rounding, ins[0].radius, ins[0].flips + flip_count,
                     {"may_flip": may_flip, "flip_count": flip_count})

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        z, s = ins[0].value, attrs["slope"]
        may_flip = out.memo.get("may_flip")
        factor = torch.where(z > 0, torch.ones_like(z), torch.full_like(z, abs(s)))
        if may_flip is not None:
            factor = torch.where(may_flip, torch.full_like(z, max(1.0, abs(s))), factor)
        error = grad.error * factor + ctx.u * abs(s) * g.abs() * (z <= 0)
        flips = grad.flips * factor if _has(grad.flips) else None
        if may_flip is not None and out.memo["flip_count"]:
            whole = (g.abs() + grad.error + (grad.flips if flips is not None else 0.0)) * abs(1.0 - s)
            flips = whole * may_flip if flips is None else flips + whole * may_flip
        return [GradField(error, flips, grad.radius, grad.flip_count + out.memo.get("flip_count", 0))], {}


class Smooth(Op):
    """A smooth activation f with derivative f' and M₂ = sup|f''| (module docstring)."""

    elementwise = True
    second_derivative_bound = 1.0
    reads_error_backward = True

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        z = xs[0]
        return self.evaluation_error(attrs, z, y, self.df(attrs, z), u)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        z = xs[0]
        slope = self.df(attrs, z)
        # the product's rounding and twice the evaluation error of f' (as backward_error)
        return [g.abs() * (u * slope.abs() + 2 * self.evaluation_error(attrs, z, slope.abs(), slope.abs(), u))]

    def curvature(self, attrs) -> float:
        """M₂ = sup|f''| for these attributes (the class's second_derivative_bound unless they change it)."""
        return self.second_derivative_bound

    def f(self, attrs, z):
        raise NotImplementedError

    def df(self, attrs, z):
        raise NotImplementedError

    def forward(self, attrs, xs, params, kernels):
        return self.f(attrs, xs[0])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g * self.df(attrs, xs[0])], {}

    def evaluation_error(self, attrs, z, value, slope, u):
        return FUNCTION_ERROR_UNITS * u * (value.abs() + (z * slope).abs() + 1.0)

    def forward_error(self, attrs, ins, y, params, ctx):
        z, error = ins[0].value, ins[0].error
        slope = self.df(attrs, z)
        own = self.evaluation_error(attrs, z, y, slope, ctx.u)
        if error is None:
            return Field(y, own, ins[0].radius, ins[0].flips)
        return Field(y, (slope.abs() + self.curvature(attrs) * error) * error + own, ins[0].radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        z, error = ins[0].value, ins[0].error
        slope = self.df(attrs, z).abs()
        # the candidate's f'(ẑ) (from ẑ or from its f(ẑ)): within M₂E_z plus twice the evaluation error
        slope_error = 2 * self.evaluation_error(attrs, z, slope, slope, ctx.u)
        if error is not None:
            slope_error = slope_error + self.curvature(attrs) * error * STORED_WIDENING
        total = grad.error * (slope + slope_error) + g.abs() * slope_error
        flips = grad.flips * (slope + slope_error) if _has(grad.flips) else None
        return [GradField(total, flips, grad.radius, grad.flip_count)], {}


class Tanh(Smooth):
    name = "tanh"
    second_derivative_bound = 4 / (3 * math.sqrt(3))  # sup|tanh''| = 4/(3√3) at tanh z = 1/√3

    torch_modules = (torch.nn.Tanh,)
    torch_calls = (torch.tanh, F.tanh, "tanh")
    onnx_ops = ("Tanh",)

    def torch_forward(self, attrs, xs, module):
        return torch.tanh(xs[0])

    def f(self, attrs, z):
        return torch.tanh(z)

    def df(self, attrs, z):
        t = torch.tanh(z)
        return 1 - t * t


class Sigmoid(Smooth):
    name = "sigmoid"
    second_derivative_bound = 1 / (6 * math.sqrt(3))  # sup|σ''| = 1/(6√3) at σ = 1/2 ± 1/(2√3)

    torch_modules = (torch.nn.Sigmoid,)
    torch_calls = (torch.sigmoid, F.sigmoid, "sigmoid")
    onnx_ops = ("Sigmoid",)

    def torch_forward(self, attrs, xs, module):
        return torch.sigmoid(xs[0])

    def f(self, attrs, z):
        return torch.sigmoid(z)

    def df(self, attrs, z):
        s = torch.sigmoid(z)
        return s * (1 - s)


class GELU(Smooth):
    name = "gelu"
    keys = {"approximate": "none"}
    #: sup|GELU''| = 2φ(0) = √(2/π) ≈ 0.798 (erf form: f'' = φ(z)(2 − z²)); the tanh form stays below 0.82
    second_derivative_bound = 0.82

    torch_modules = (torch.nn.GELU,)
    torch_calls = (F.gelu,)
    onnx_ops = ("Gelu", "Div")

    def from_onnx_node(self, node, graph):
        """ONNX Gelu (opset 20), or its erf decomposition as exporters write it before: x·(1 + erf(x/√2))·0.5 as
        Div(x, √2), Erf, Add 1, Mul by x, Mul by 0.5 (the constants compared at float32, as exported)."""
        if node.op_type == "Gelu":
            return unary(node, graph, {"approximate": attr(node, "approximate", "none")})
        x = graph.data_inputs(node)
        if len(x) != 1 or node.inputs[0] != x[0] or not _near(scalar(graph, node), math.sqrt(2)):
            return None
        erf = followed_by(node, graph, "Erf")
        plus = erf and followed_by(erf, graph, "Add")
        times = plus and followed_by(plus, graph, "Mul")
        half = times and followed_by(times, graph, "Mul")
        if not (half and _near(scalar(graph, plus), 1.0) and multiplies_by_itself(times, graph, x[0], plus.outputs[0])
                and _near(scalar(graph, half), 0.5)):
            return None
        return OnnxRead({}, x, half.outputs[0], absorbed=[erf, plus, times, half])

    def from_torch_module(self, module):
        return {"approximate": module.approximate}

    def from_torch_call(self, target, args, kwargs):
        return {"approximate": kwargs.get("approximate", "none")}

    def port_slips(self, attrs, in_shape):
        if attrs["approximate"] == "none":
            text, other = ("computed with GELU's tanh approximation where the spec says erf (jax.nn.gelu's default, "
                           "tinygrad's gelu): use the exact form (approximate=False), or say \"approximate\": \"tanh\" "
                           "in the spec"), "tanh"
        else:
            text, other = ("computed with GELU's exact (erf) form where the spec says the tanh approximation: use "
                           "approximate=True, or drop \"approximate\" from the spec"), "none"
        return [PortSlip("default", text, lambda: OtherAttributes(self, {"approximate": other}), forward=True)]

    def torch_forward(self, attrs, xs, module):
        return F.gelu(xs[0], approximate=attrs["approximate"])

    def check(self, attrs):
        if attrs["approximate"] not in ("none", "tanh"):
            raise OpSpecError(f"'approximate' is {attrs['approximate']!r}: expected \"none\" (erf) or \"tanh\"")
        return attrs

    def describe(self, attrs):
        return "gelu" + (" (tanh)" if attrs["approximate"] == "tanh" else "")

    def f(self, attrs, z):
        return F.gelu(z, approximate=attrs["approximate"])

    def df(self, attrs, z):
        with torch.enable_grad():
            leaf = z.detach().requires_grad_(True)
            (slope,) = torch.autograd.grad(F.gelu(leaf, approximate=attrs["approximate"]).sum(), leaf)
        return slope


class SiLU(Smooth):
    name = "silu"
    #: sup|silu''| = 1/2 at z = 0: silu'' = σ'(z)·(2 + z(1 − 2σ(z))), σ'(0) = 1/4 (tests/test_architectures.py checks)
    second_derivative_bound = 0.5

    torch_modules = (torch.nn.SiLU,)
    torch_calls = (F.silu,)
    onnx_ops = ("Sigmoid",)

    def from_onnx_node(self, node, graph):
        """x·σ(x) as exporters write SiLU: Sigmoid then Mul by its own input (a Sigmoid read by anything else is
        sigmoid's)."""
        x = graph.data_inputs(node)
        times = graph.only_reader(node.outputs[0])
        if len(x) != 1 or not multiplies_by_itself(times, graph, x[0], node.outputs[0]):
            return None
        return OnnxRead({}, x, times.outputs[0], absorbed=[times])

    def torch_forward(self, attrs, xs, module):
        return F.silu(xs[0])

    def f(self, attrs, z):
        return F.silu(z)

    def df(self, attrs, z):
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))


class ELU(Smooth):
    name = "elu"
    keys = {"alpha": 1.0}

    torch_modules = (torch.nn.ELU,)
    torch_calls = (F.elu,)
    onnx_ops = ("Elu",)

    def from_onnx_node(self, node, graph):
        return unary(node, graph, {"alpha": attr(node, "alpha", 1.0)})

    def check(self, attrs):
        alpha = attrs["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise OpSpecError(f"'alpha' is {alpha!r}: expected a non-negative number")
        attrs["alpha"] = float(alpha)
        return attrs

    def curvature(self, attrs):
        return attrs["alpha"]  # f'' = α·eᶻ for z < 0, 0 above: sup α (at z → 0⁻)

    def from_torch_module(self, module):
        return {"alpha": float(module.alpha)}

    def from_torch_call(self, target, args, kwargs):
        return {"alpha": float(kwargs.get("alpha", args[1] if len(args) > 1 else 1.0))}

    def describe(self, attrs):
        return f"elu α={attrs['alpha']:g}" if attrs["alpha"] != 1.0 else "elu"

    def torch_forward(self, attrs, xs, module):
        return F.elu(xs[0], attrs["alpha"])

    def f(self, attrs, z):
        return F.elu(z, attrs["alpha"])

    def df(self, attrs, z):
        return torch.where(z > 0, torch.ones_like(z), attrs["alpha"] * torch.exp(torch.clamp(z, max=0.0)))


class Softplus(Smooth):
    name = "softplus"
    #: sup|softplus''| = sup σ(1 − σ) = 1/4 at z = 0
    second_derivative_bound = 0.25

    torch_modules = (torch.nn.Softplus,)
    torch_calls = (F.softplus,)
    # ONNX Softplus is log(1 + eˣ) without PyTorch's threshold 20, above which both equal x in float32
    onnx_ops = ("Softplus",)

    def from_torch_module(self, module):
        if module.beta != 1 or module.threshold != 20:
            raise OpSpecError(f"Softplus(beta={module.beta}, threshold={module.threshold}): only the defaults "
                              f"(beta=1, threshold=20) are supported")
        return {}

    def torch_forward(self, attrs, xs, module):
        return F.softplus(xs[0])

    def f(self, attrs, z):
        return F.softplus(z)  # z itself above 20, as PyTorch: 2·10⁻⁹ from log(1 + eᶻ), far below float32's u

    def df(self, attrs, z):
        return torch.sigmoid(z)


class Mish(Smooth):
    name = "mish"
    #: sup|mish''| = 0.6442 at z ≈ −0.088 (a 10⁻⁴ grid over [−40, 40]; tests/test_architectures.py checks), rounded up
    second_derivative_bound = 0.65

    torch_modules = (torch.nn.Mish,)
    torch_calls = (F.mish,)
    onnx_ops = ("Mish", "Softplus")

    def from_onnx_node(self, node, graph):
        """ONNX Mish (opset 18), or x·tanh(softplus(x)) as exporters write it before: Softplus, Tanh, Mul by x."""
        if node.op_type == "Mish":
            return unary(node, graph)
        x = graph.data_inputs(node)
        tanh = followed_by(node, graph, "Tanh")
        times = tanh and graph.only_reader(tanh.outputs[0])
        if len(x) != 1 or not (tanh and multiplies_by_itself(times, graph, x[0], tanh.outputs[0])):
            return None
        return OnnxRead({}, x, times.outputs[0], absorbed=[tanh, times])

    def torch_forward(self, attrs, xs, module):
        return F.mish(xs[0])

    def f(self, attrs, z):
        return F.mish(z)

    def df(self, attrs, z):
        t = torch.tanh(F.softplus(z))
        return t + z * (1 - t * t) * torch.sigmoid(z)


for _op in (ReLU(), LeakyReLU(), Tanh(), Sigmoid(), GELU(), SiLU(), ELU(), Softplus(), Mish()):
    register(_op)
