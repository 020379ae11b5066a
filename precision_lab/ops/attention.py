"""Attention's parts over tokens: softmax over one axis and matmul of two per-sample matrices (q·kᵀ, attn·v).

softmax (the stable form y = exp(x − m)/Σ exp(x − m), m = max x: Blanchard, Higham & Mary 2021, "Accurately computing
the log-sum-exp and softmax functions", IMA J. Numer. Anal. 41(4), §3–4). The max is exact (a selection); the shift
x − m is one subtraction, relative error ≤ u (Higham 2002, §2.2), i.e. an absolute error u·|x − m| in exp's argument,
which exp turns into a relative error ≈ u·|x − m|; exp itself is within EXP_ERROR_UNITS·u; the sum of n exponentials
is within γ̃ₙ(λ) relatively (all terms positive: Higham & Mary 2019), plus the terms' own errors weighted by yⱼ; the
division adds u. All relative: |ŷᵢ − yᵢ| ≤ yᵢ·expm1(rᵢ + Σⱼ yⱼrⱼ + γ̃ₙ(λ) + u) with rᵢ = (|xᵢ − m| + EXP_ERROR_UNITS)·u
(expm1 keeps the bound valid beyond first order: every factor is a ratio (1 + δ)). An input error E moves
ln yᵢ = xᵢ − logsumexp(x) by at most Eᵢ + e^{2·max E}·Σⱼ yⱼEⱼ (logsumexp's gradient is y, which a shift of at most
max E changes by a factor within e^{±2 max E}). A softmax without the shift (exp(x)/Σ exp(x)) has rᵢ = EXP_ERROR_UNITS·u
only, inside the same bound.

Its backward, dx = y ⊙ (g − s) with s = Σⱼ gⱼyⱼ, is an inner product of n terms (γ̃ₙ(λ)·Σ|g y|, Higham 2002 §3.1),
one subtraction and one product (u each, Higham 2002 §2.2), with the stored output's and the gradient's errors carried.

matmul: C = A·B of per-sample matrices (batch of (M, K)·(K, N) → (M, N)), or A·Bᵀ (`transpose_b`, q·kᵀ), times a
constant `scale` (1/√d); each output is an inner product of K terms: γ̃_K(λ)·|A||B| plus the upstream errors
|A|E_B + E_A|B| + E_AE_B (Higham 2002, §3.1, Higham & Mary 2019), and the scale one more rounding u·|s|·|A||B| unless
it is a power of two (exact), whether the product or an operand is scaled. Its input gradients are products too: G·Bᵀ sums N terms, Aᵀ·G sums M.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from . import REQUIRED, BackwardReplaced, Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, gamma_over_lambda, register
from .onnx_reading import OnnxRead, attr, require
from .tokens import _has, _text, per_sample_axis

#: entries of one sample's product (a head's attention weights, tokens²) up to which a size is taken: 2²⁴, 4096 tokens
#: (a 256² image in 4×4 patches), 128 MB a float64 copy; the float64 reference keeps several per head and sample
PRODUCT_LIMIT = 2 ** 24


def within_limit(rows, cols, what: str) -> None:
    """OpSpecError where one sample's (rows, cols) product exceeds PRODUCT_LIMIT entries (the sizes that fit are smaller)."""
    if rows is not None and cols is not None and rows * cols > PRODUCT_LIMIT:
        raise OpSpecError(f"{what} of {rows}×{cols} entries a sample, above {PRODUCT_LIMIT} (memory): choose a smaller "
                          f"image or larger patches")


#: evaluation error of float32 exp, in units of u: CUDA's expf is within 2 ulp (CUDA C Programming Guide, "Mathematical
#: Functions"), an ulp is at most 2u relative: 4u; glibc's and SLEEF's expf are within 1 ulp
EXP_ERROR_UNITS = 4.0


class Softmax(Op):
    """y = softmax(x) over one per-sample axis (`dim`, PyTorch's: the batch is dim 0; −1 the last)."""

    name = "softmax"
    autocast_float32 = True
    keys = {"dim": -1}
    reads_error_backward = False
    torch_modules = (torch.nn.Softmax,)
    torch_calls = (F.softmax, torch.softmax, "softmax")
    onnx_ops = ("Softmax",)

    def from_onnx_node(self, node, graph):
        """Softmax over `axis` (ONNX counts it as PyTorch does); before opset 13 the axis took every later one with it,
        the same only for the last axis (its default there was 1)."""
        x = graph.data_inputs(node)
        require(len(x) == 1, "a softmax of a constant")
        rank = len(graph.shape(x[0])) + 1
        axis = int(attr(node, "axis", -1 if graph.opset is None or graph.opset >= 13 else 1))
        require(graph.opset is None or graph.opset >= 13 or axis % rank == rank - 1, f"axis {axis} before opset 13 "
                f"normalises every later axis with it: only the last axis reads as softmax")
        return OnnxRead({"dim": axis - rank if axis >= 0 else axis}, x, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_module(self, module):
        if module.dim is None:
            raise OpSpecError("Softmax without dim: say which axis (dim=-1)")
        return {"dim": module.dim}

    def from_torch_call(self, target, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim is None:
            raise OpSpecError("softmax without dim: say which axis (dim=-1)")
        return {"dim": dim}

    def out_shape(self, attrs, in_shapes):
        per_sample_axis(attrs["dim"], len(in_shapes[0]), "dim")
        return in_shapes[0]

    def describe(self, attrs):
        return f"softmax over dim {attrs['dim']}"

    def port_slips(self, attrs, in_shape):
        axis = per_sample_axis(attrs["dim"], len(in_shape), "dim")
        return [PortSlip("attention", f"normalises over dim {other + 1} where the spec says dim {attrs['dim']} (a softmax "
                         f"over the wrong axis: keys and queries swapped)", lambda other=other: OtherAttributes(
                             self, {"dim": other + 1}), forward=True)
                for other in range(len(in_shape)) if other != axis and in_shape[other] not in (None, 1)]

    @staticmethod
    def _dim(attrs, x: torch.Tensor) -> int:
        return 1 + per_sample_axis(attrs["dim"], x.dim() - 1, "dim")

    def torch_forward(self, attrs, xs, module):
        return torch.softmax(xs[0], dim=attrs["dim"])

    def forward(self, attrs, xs, params, kernels):
        return torch.softmax(xs[0], dim=self._dim(attrs, xs[0]))

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if not need[0]:
            return [None], {}
        dim = self._dim(attrs, xs[0])
        y = torch.softmax(xs[0], dim=dim) if y is None else y
        return [y * (g - (g * y).sum(dim=dim, keepdim=True))], {}

    # error model ------------------------------------------------------------------------------
    def _own_log_error(self, x: torch.Tensor, y: torch.Tensor, dim: int, ctx_u: float, gamma: float) -> torch.Tensor:
        """rᵢ + Σⱼ yⱼrⱼ + γ̃ₙ(λ) + u: the computed softmax's own relative error (module docstring)."""
        r = ((x - x.amax(dim=dim, keepdim=True)).abs() + EXP_ERROR_UNITS) * ctx_u
        return r + (y * r).sum(dim=dim, keepdim=True) + gamma + ctx_u

    def forward_error(self, attrs, ins, y, params, ctx):
        x, error = ins[0].value.double(), ins[0].error
        y64 = y.double()
        dim = self._dim(attrs, x)
        log_error = self._own_log_error(x, y64, dim, ctx.u, ctx.gamma(x.shape[dim]))
        if error is not None:
            e = error.double()
            widest = e.amax(dim=dim, keepdim=True)
            log_error = log_error + e + torch.exp(2 * widest) * (y64 * e).sum(dim=dim, keepdim=True)
        total = (y64 * torch.expm1(log_error)).to(y.dtype)
        # the backward reads the output's own error; the walk may free the field's (no reader of it reads errors)
        return Field(y, total, None, ins[0].flips, {"output_error": total.clone()})

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        y = out.value.abs()  # a softmax is positive: |y| = y
        dim = self._dim(attrs, y)
        e_y = out.memo["output_error"]
        e_g = grad.error + (grad.flips if _has(grad.flips) else 0.0)
        gy = (g * out.value).abs()
        s = (g * out.value).sum(dim=dim, keepdim=True)
        # s = Σ gⱼyⱼ: an inner product of n terms, its inputs' errors carried (Higham 2002, §3.1)
        e_s = ctx.gamma(y.shape[dim]) * gy.sum(dim=dim, keepdim=True) + (
            y * e_g + g.abs() * e_y + e_g * e_y).sum(dim=dim, keepdim=True)
        diff = (g - s).abs()
        e_diff = (1 + ctx.u) * (e_g + e_s) + ctx.u * diff
        # dx = y·(g − s): one product, both factors in error
        error = (1 + ctx.u) * ((y + e_y) * e_diff + diff * e_y) + ctx.u * y * diff
        return [GradField(error, None, None, grad.flip_count)], {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        x = xs[0]
        dim = self._dim(attrs, x)
        n = x.shape[dim]
        return y.abs() * self._own_log_error(x, y, dim, u, gamma_over_lambda(n, u, lam))

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        if not need[0]:
            return [None]
        dim = self._dim(attrs, xs[0])
        y = torch.softmax(xs[0], dim=dim) if y is None else y
        inner = gamma_over_lambda(xs[0].shape[dim], u, lam) * (g * y).abs().sum(dim=dim, keepdim=True)
        return [y.abs() * inner + u * grads[0].abs()]


class Matmul(Op):
    """scale · A·B (or A·Bᵀ with `transpose_b`) of two per-sample matrices: (M, K)·(K, N) → (M, N), or of stacks of them
    (heads: (H, M, K)·(H, K, N) → (H, M, N), `q @ k.transpose(-2, -1)` after a head split)."""

    name = "matmul"
    combines = True
    rounded_params = ()  # both operands are its inputs
    keys = {"transpose_b": False, "scale": 1.0}
    reads_error_backward = True
    torch_calls = (torch.matmul, operator.matmul, torch.bmm)
    onnx_ops = ("MatMul",)

    def from_onnx_node(self, node, graph):
        """MatMul of two computed tensors (q·kᵀ, attention·v); by a constant it is linear's."""
        data = graph.data_inputs(node)
        require(len(data) == len(node.inputs) == 2, "MatMul by a constant: a dense layer's (linear), with its bias")
        return OnnxRead({}, data, node.outputs[0])

    def call_inputs(self, tensors, args):
        return tensors

    def check(self, attrs):
        if not isinstance(attrs["transpose_b"], bool):
            raise OpSpecError(f"'transpose_b' is {attrs['transpose_b']!r}: expected true or false")
        scale = attrs["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale == 0:
            raise OpSpecError(f"'scale' is {scale!r}: expected a finite non-zero number")
        attrs["scale"] = float(scale)
        return attrs

    def out_shape(self, attrs, in_shapes):
        a, b = in_shapes
        if len(a) < 2 or len(a) != len(b) or any(x is not None and y is not None and x != y for x, y in zip(a[:-2], b[:-2])):
            raise OpSpecError(f"matmul needs two per-sample matrices, or stacks of as many (heads), but receives "
                              f"{_text(a)} and {_text(b)}")
        inner_b, cols = (b[-1], b[-2]) if attrs["transpose_b"] else b[-2:]
        if a[-1] is not None and inner_b is not None and a[-1] != inner_b:
            raise OpSpecError(f"multiplies {_text(a)} by {_text(b)}{'ᵀ' if attrs['transpose_b'] else ''}: inner "
                              f"sizes {a[-1]} and {inner_b} differ")
        within_limit(None if None in a[:-1] else math.prod(a[:-1]), cols, "a product")  # every head's
        return (*a[:-2], a[-2], cols)

    def describe(self, attrs):
        text = "matmul A·Bᵀ" if attrs["transpose_b"] else "matmul A·B"
        return text if attrs["scale"] == 1.0 else f"{text} × {attrs['scale']:.6g}"

    def port_slips(self, attrs, in_shape):
        return scale_slips(self, attrs, "scale")

    def _exact_scale(self, attrs) -> bool:
        """A power-of-two scale multiplies exactly (Higham 2002, §2.1: only the exponent changes)."""
        return math.frexp(abs(attrs["scale"]))[0] == 0.5

    @staticmethod
    def _b(attrs, b: torch.Tensor) -> torch.Tensor:
        return b.transpose(-1, -2) if attrs["transpose_b"] else b

    def torch_forward(self, attrs, xs, module):
        y = xs[0] @ self._b(attrs, xs[1])
        return y if attrs["scale"] == 1.0 else y * attrs["scale"]

    def forward(self, attrs, xs, params, kernels):
        a, b = kernels.rnd(xs[0], "forward"), kernels.rnd(self._b(attrs, xs[1]), "forward")
        y = torch.matmul(a, b)
        return y if attrs["scale"] == 1.0 else y * attrs["scale"]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        g = g if attrs["scale"] == 1.0 else g * attrs["scale"]
        a, b = xs[0], self._b(attrs, xs[1])
        ga = torch.matmul(kernels.rnd(g, "input_grad"), kernels.rnd(b, "input_grad").transpose(-1, -2)) if need[0] else None
        gb = None
        if need[1]:
            gb = torch.matmul(kernels.rnd(a, "input_grad").transpose(-1, -2), kernels.rnd(g, "input_grad"))
            gb = gb.transpose(-1, -2).contiguous() if attrs["transpose_b"] else gb
        return [ga, gb], {}

    # error model ------------------------------------------------------------------------------
    def _scaled(self, attrs, magnitude: torch.Tensor, error: torch.Tensor, ctx) -> torch.Tensor:
        """|s|·(error) plus the scale's own rounding unless s is a power of two: u·|s|·(|A||B|) covers it whether the
        product is scaled or an operand first (nn.MultiheadAttention scales q before q·kᵀ)."""
        s = abs(attrs["scale"])
        return error * s if self._exact_scale(attrs) else (1 + ctx.u) * s * error + ctx.u * s * magnitude

    def forward_error(self, attrs, ins, y, params, ctx):
        (a, ea), (b, eb) = [(f.value, f.error) for f in ins]
        b = self._b(attrs, b)
        eb = None if eb is None else self._b(attrs, eb)
        a_abs, b_abs = a.abs(), b.abs()
        magnitude = a_abs @ b_abs
        # γ̃_K(λ)·|A||B| + |A|E_B + E_A|B| + E_AE_B (Higham 2002, §3.1)
        error = ctx.gamma(a.shape[-1]) * magnitude
        rounding = ctx.rounding_term(torch.matmul, a_abs, b_abs)
        if torch.is_tensor(rounding):
            error = error + rounding
        if ea is not None:
            error = error + ea @ b_abs
        if eb is not None:
            error = error + a_abs @ eb
        if ea is not None and eb is not None:
            error = error + ea @ eb
        return Field(y, self._scaled(attrs, magnitude, error, ctx), None, sum(f.flips for f in ins))

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        s = abs(attrs["scale"])
        # the gradient the products read: s·g, rounded once unless s is a power of two
        g_scaled = g * attrs["scale"]
        e_g = grad.error + (grad.flips if _has(grad.flips) else 0.0)
        e_g = e_g * s if self._exact_scale(attrs) else (1 + ctx.u) * s * e_g + ctx.u * g_scaled.abs()
        g_abs = g_scaled.abs()
        (a, ea), (b, eb) = [(f.value, f.error) for f in ins]
        b = self._b(attrs, b)
        eb = None if eb is None else self._b(attrs, eb)
        grads = [None, None]
        if need[0]:  # G·Bᵀ: N terms
            bt, ebt = b.abs().transpose(-1, -2), None if eb is None else eb.transpose(-1, -2)
            error = (ctx.gamma(g.shape[-1]) * g_abs + e_g) @ bt
            if ebt is not None:
                error = error + (g_abs + e_g) @ ebt
            rounding = ctx.rounding_term(torch.matmul, g_abs, bt)
            grads[0] = GradField(error + rounding if torch.is_tensor(rounding) else error, None, None, grad.flip_count)
        if need[1]:  # Aᵀ·G: M terms
            at, eat = a.abs().transpose(-1, -2), None if ea is None else ea.transpose(-1, -2)
            error = at @ (ctx.gamma(g.shape[-2]) * g_abs + e_g)
            if eat is not None:
                error = error + eat @ (g_abs + e_g)
            rounding = ctx.rounding_term(torch.matmul, at, g_abs)
            error = error + rounding if torch.is_tensor(rounding) else error
            error = error.transpose(-1, -2).contiguous() if attrs["transpose_b"] else error
            grads[1] = GradField(error, None, None, grad.flip_count)
        return grads, {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        a, b = xs[0].abs(), self._b(attrs, xs[1]).abs()
        magnitude = abs(attrs["scale"]) * (a @ b)
        scale = gamma_over_lambda(a.shape[-1], u, lam) * magnitude
        return scale if self._exact_scale(attrs) else scale + u * magnitude

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        g_abs = (g * attrs["scale"]).abs()
        a, b = xs[0].abs(), self._b(attrs, xs[1]).abs()
        extra = lambda t: 0.0 if self._exact_scale(attrs) else u * t  # noqa: E731 - the scale's rounding of g, carried
        scales = [None, None]
        if need[0]:
            scales[0] = (gamma_over_lambda(g.shape[-1], u, lam) * g_abs + extra(g_abs)) @ b.transpose(-1, -2)
        if need[1]:
            gb = a.transpose(-1, -2) @ (gamma_over_lambda(g.shape[-2], u, lam) * g_abs + extra(g_abs))
            scales[1] = gb.transpose(-1, -2).contiguous() if attrs["transpose_b"] else gb
        return scales


def _unscaled_backward(key: str):
    """A backward computed with the factor `key` left out (1), its forward kept (for BackwardReplaced)."""
    def backward(op, attrs, g, xs, y, params, kernels, need):
        return op.backward({**attrs, key: 1.0}, g, xs, y, params, kernels, need)

    return backward


def scale_slips(op, attrs, key: str) -> list[PortSlip]:
    """An attention score's factor (1/√d) left out of the backward only, or out of forward and backward."""
    factor = attrs[key]
    if factor == 1.0:
        return []
    return [PortSlip("attention", f"leaves the factor {factor:.6g} (1/√d) out of its backward",
                     lambda: BackwardReplaced(op, _unscaled_backward(key)), every=("every attention score",)),
            PortSlip("attention", f"leaves the factor {factor:.6g} (1/√d) out of forward and backward",
                     lambda: OtherAttributes(op, {key: 1.0}), forward=True, every=("every attention score",))]


class Scale(Op):
    """y = factor·x, a constant factor (an attention score's 1/√d: `scores * d ** -0.5`, `scores / math.sqrt(d)`).

    One rounding, u·|y|, none for a power of two (Higham 2002, §2.1–2.2); its backward is the same product with g."""

    name = "scale"
    keys = {"factor": REQUIRED}
    elementwise = True
    torch_calls = (operator.mul, torch.mul, operator.truediv, torch.div)
    onnx_ops = ("Mul", "Div")

    def from_onnx_node(self, node, graph):
        """Mul or Div of a computed tensor by one constant number (an attention score's 1/√d)."""
        data = graph.data_inputs(node)
        constants = [graph.constant(t) for t in node.inputs if t not in data]
        require(len(data) == 1 and len(constants) == 1 and constants[0].size == 1, f"{node.op_type} other than of "
                f"a computed tensor by one constant number")
        require(node.op_type == "Mul" or node.inputs[0] == data[0], "a number divided by a tensor")
        number = float(constants[0].reshape(-1)[0])
        return OnnxRead({"factor": 1.0 / number if node.op_type == "Div" else number}, data, node.outputs[0])

    def check(self, attrs):
        factor = attrs["factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor == 0:
            raise OpSpecError(f"'factor' is {factor!r}: expected a finite non-zero number")
        attrs["factor"] = float(factor)
        return attrs

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def from_torch_call(self, target, args, kwargs):
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(args) != 2 or len(numbers) != 1:
            raise OpSpecError(f"{getattr(target, '__name__', target)} of two tensors: not a constant factor")
        divides = target in (operator.truediv, torch.div)
        if divides and numbers[0] is args[0]:
            raise OpSpecError("a number divided by a tensor: not a constant factor")
        return {"factor": 1.0 / numbers[0] if divides else float(numbers[0])}

    def describe(self, attrs):
        return f"scale × {attrs['factor']:.6g}"

    def port_slips(self, attrs, in_shape):
        return scale_slips(self, attrs, "factor")

    def _exact(self, attrs) -> bool:
        return math.frexp(abs(attrs["factor"]))[0] == 0.5

    def torch_forward(self, attrs, xs, module):
        return xs[0] * attrs["factor"]

    def forward(self, attrs, xs, params, kernels):
        return xs[0] * attrs["factor"]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [g * attrs["factor"] if need[0] else None], {}

    def _rounded(self, attrs, value, error, u: float):
        """|f|·E plus one rounding u·|f·value| (none for a power of two)."""
        f = abs(attrs["factor"])
        carried = 0.0 if error is None else error * f
        if self._exact(attrs):
            return None if error is None else carried
        return (1 + u) * carried + u * f * value.abs()

    def forward_error(self, attrs, ins, y, params, ctx):
        return Field(y, self._rounded(attrs, ins[0].value, ins[0].error, ctx.u), ins[0].radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        flips = None if grad.flips is None else grad.flips * abs(attrs["factor"])
        return [GradField(self._rounded(attrs, g, grad.error, ctx.u), flips, grad.radius, grad.flip_count)], {}

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return None if self._exact(attrs) else u * y.abs()

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return [None if self._exact(attrs) or not need[0] else u * grads[0].abs()]


for _op in (Softmax(), Matmul(), Scale()):
    register(_op)
