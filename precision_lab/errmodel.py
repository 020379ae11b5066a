"""Error-accumulation model: how large rounding error can be, per element, at a claimed precision.

Every quantity the network produces is an inner product (a sum of n products) or a chain of
them. For one sum s = Σ xᵢ·yᵢ computed at unit roundoff u the model uses

* n, the number of accumulated terms: k·k·C_in (+1 for the bias) for a forward output,
  k·k·C_out for an input gradient, batch·H·W for a weight or bias gradient;
* S = Σ|xᵢ·yᵢ|, the absolute-term sum: the same convolution applied to |x| and |y|
  (the condition number is S / |s|; MSE gradients cancel heavily, so errors scale with S);
* the deterministic bound |ŝ − s| ≤ γₙ·S, γₙ = nu/(1 − nu) (Higham 2002, Eq. 3.4 and §3.1);
* the probabilistic bound |ŝ − s| ≤ γ̃ₙ(λ)·S, γ̃ₙ(λ) = exp(λ√n·u + nu²/(1 − u)) − 1, which
  holds with probability ≥ Q(λ, n) = 1 − 2n·exp(−λ²(1 − u)²/2) when rounding errors are
  independent and of mean zero (Higham & Mary 2019, SIAM J. Sci. Comput. 41(5), Thm 2.4, 3.1);
  it is the bound verdicts use: it covers every summation order, sequential included;
* pairwise summation: γ_⌈log₂n⌉·S (Higham 2002, Eq. 4.6); blocked with block b:
  γ_(b + ⌈n/b⌉ − 2)·S (Blanchard, Higham & Mary 2020, SIAM J. Sci. Comput. 42(3), Eq. 2.3);
* reduced formats (tf32, fp16: u = 2⁻¹¹; bf16: u = 2⁻⁸) round the convolution *operands*
  and accumulate in float32; an operand rounding error is at most r(x) = u_f·|x| + η_f/2
  (η_f the subnormal spacing), independent and of mean zero per operand, so their effect on a
  sum is at most λ·√(2·Σ(r(x)²y² + x²r(y)²)) with the probability of Hoeffding's inequality
  (the model of Higham & Mary 2019, §2, applied to the operands), two more convolutions.

Errors propagate: an upstream error E enters the next sum through |W| (forward), |W| and
the ReLU mask (backward) and |a|, |g| (weight and bias gradients). In the short forward and
input-gradient sums they add in absolute value (a deterministic worst case); in the long
gradient sums over batch·H·W they are mean-zero errors that depend only on roundings within a
few pixels, so the smaller of Σ|c|E and λ·√(χ*·Σc²E²) bounds them (Hoeffding's inequality for
sums with a dependency graph of fractional chromatic number χ*, Janson 2004). A ReLU whose
pre-activation lies within its own error bound may flip: the gradient through it is then
wholly uncertain (|h| + E_h, kept apart and added deterministically); where z ≤ −E_z the ReLU
output is exactly zero. Elements with S = 0 (dead
channels) are computed exactly by any order; their bound gets a floor of one unit roundoff of
the tensor's largest S so that a ratio never divides by zero.

Bounds are evaluated in float32 from the float64 reference (memory and speed at 1024²); the
float32 evaluation of a sum of non-negative terms is within γ̃ₙ(λ) ≤ 7e-4 of exact at
n = 2²¹, covered by the EVALUATION_MARGIN below. The reference keeps its 16-channel
intermediates as float32 roundings (|fl(z) − z| ≤ u₃₂|z|), read here without copies; the ReLU
tests widen E_z by 1 + 2u₃₂ for that. Flip fields (F) are sparse at float32 (a few hundred
points at 1024²) and are convolved point by point below SPARSE_LIMIT non-zeros.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import formats
from .problem import CHANNELS, KERNEL_SIZE, LAYERS, PADDING, PARAM_NAMES, Trace

#: λ of Higham & Mary (2019): Q(7, 2²¹) ≥ 0.9999, i.e. the bound fails for fewer than 1 in 10⁴ sums
LAMBDA = 7.0

#: relative headroom for evaluating bounds in float32: γ̃_{2²¹}(7) at u = 2⁻²⁴ is 6.1e-4 < 2⁻⁸
EVALUATION_MARGIN = 1.0 + 2.0 ** -8

#: z is read as its float32 rounding, |fl(z) − z| ≤ u₃₂·|z| (Higham 2002, Thm 2.2); 1 + 2u₃₂ covers that
#: and the rounding of E·(1 + 2u₃₂) itself (1 + u₃₂ is not a float32: it would round to 1)
STORED_WIDENING = 1.0 + 2.0 * formats.UNIT_ROUNDOFF["float32"]

#: ReLU-flip fields with at most this many non-zeros are convolved point by point, not by a full convolution:
#: at float32 a few hundred of 33 M elements at 1024² (tests/test_errmodel.py); 2¹⁴·16·9 int64 indices ≈ 19 MB
SPARSE_LIMIT = 2 ** 14

#: smallest spacing of each format (subnormals): the absolute part of an operand's rounding error
SUBNORMAL_SPACING = {"float64": 2.0 ** -1074, "float32": 2.0 ** -149, "tf32": 2.0 ** -149,
                     "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}

#: formats whose arithmetic accumulates in float32 but whose convolution operands are rounded
ROUNDED_OPERANDS = formats.REDUCED_FORMATS

QUANTITIES = ("loss", "output") + PARAM_NAMES


# ---------------------------------------------------------------------------------------------
# scalar factors


def gamma(n: int, u: float) -> float:
    """Deterministic γₙ = nu/(1 − nu) (Higham 2002, Lemma 3.1); inf when nu ≥ 1."""
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def probabilistic_gamma(n: int, u: float, lam: float = LAMBDA) -> float:
    """γ̃ₙ(λ) = exp(λ√n·u + nu²/(1 − u)) − 1 (Higham & Mary 2019, Thm 2.4)."""
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def failure_probability(n: int, lam: float = LAMBDA, u: float = formats.UNIT_ROUNDOFF["float32"]) -> float:
    """1 − Q(λ, n) = 2n·exp(−λ²(1 − u)²/2): chance the probabilistic bound fails for one sum (Thm 3.1)."""
    return min(1.0, 2 * n * math.exp(-lam * lam * (1 - u) ** 2 / 2))


def pairwise_gamma(n: int, u: float) -> float:
    """γ_⌈log₂ n⌉: pairwise (cascade) summation (Higham 2002, Eq. 4.6)."""
    return gamma(max(1, math.ceil(math.log2(max(n, 2)))), u)


def blocked_gamma(n: int, u: float, block: int = 256) -> float:
    """γ_(b + ⌈n/b⌉ − 2): blocked summation, block b (Blanchard, Higham & Mary 2020, Eq. 2.3)."""
    return gamma(max(1, block + math.ceil(n / block) - 2), u)


def summation_factors(n: int, precision: str = "float32", lam: float = LAMBDA, block: int = 256) -> dict[str, float]:
    """Every bound factor (multiply by S) for an n-term sum at `precision`, with λ's failure probability."""
    u = formats.unit_roundoff(precision)
    return {"n": n, "u": u, "deterministic": gamma(n, u), "probabilistic": probabilistic_gamma(n, u, lam),
            "lambda": lam, "failure_probability": failure_probability(n, lam, u),
            "pairwise": pairwise_gamma(n, u), "blocked": blocked_gamma(n, u, block), "block": block}


def n_terms(trace: Trace) -> int:
    """Terms in each weight/bias gradient sum: batch·H·W."""
    x = trace.activations[0]
    return int(x.shape[0] * x.shape[2] * x.shape[3])


def terms_per_quantity(trace: Trace) -> dict[str, int]:
    """n for every quantity: loss, output (forward sum of the last layer) and each gradient."""
    per_image = n_terms(trace)
    counts = {"loss": per_image, "output": KERNEL_SIZE * KERNEL_SIZE * CHANNELS[-2] + 1}
    counts.update({name: per_image for name in PARAM_NAMES})
    return counts


def accumulation_precision(precision: str) -> str:
    """The format sums are accumulated in: float32 for the reduced formats (tensor cores), else itself."""
    return "float32" if precision in ROUNDED_OPERANDS else formats.PRECISIONS[formats.PRECISIONS.index(precision)]


# ---------------------------------------------------------------------------------------------
# per-element bounds


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
    relu_flips: int = 0  # ReLU positions upstream whose sign the errors could flip

    @property
    def max(self) -> float:
        return float(np.max(self.bound))


def _bound_convolutions(device: torch.device):
    """Shift-and-GEMM in chunks on CPU (oneDNN's weight-gradient workspace is ~1 GB at 1024²);
    cuDNN on GPU, in IEEE float32 there (see _ieee): no TF32 inside a bound."""
    from .reference import reference_conv

    return reference_conv(device)


def _ieee(device: torch.device):
    if device.type == "cuda":
        from .conv.backends import native_flags

        return native_flags(fp32_precision="ieee")
    return contextlib.nullcontext()


def _rounding_error(x: torch.Tensor, precision: str) -> torch.Tensor:
    """r(x) = u_f·|x| + η_f/2: the largest error of rounding x to `precision` (zero if not rounded)."""
    if precision not in ROUNDED_OPERANDS:
        return torch.zeros_like(x)
    return formats.unit_roundoff(precision) * x.abs() + SUBNORMAL_SPACING[precision] / 2


def _rounding_term(op, x, y, precision: str, lam: float) -> torch.Tensor | float:
    """λ·√(2·Σ(r(x)²y² + x²r(y)²)): rounded operands' effect on the sum op(x, y) (Hoeffding)."""
    if precision not in ROUNDED_OPERANDS:
        return 0.0
    rx, ry = _rounding_error(x, precision), _rounding_error(y, precision)
    return lam * torch.sqrt(2 * (op(rx * rx, y * y) + op(x * x, ry * ry)))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, READ ONLY: a float32 trace tensor comes back as itself, not a copy."""
    return t.detach().to(torch.float32)


def _magnitude(t: torch.Tensor) -> torch.Tensor:
    """|t| in float32 as a tensor of its own (free to modify in place)."""
    t32 = _f32(t)
    return t32.abs() if t32.data_ptr() == t.data_ptr() else t32.abs_()


def _floored(bound: torch.Tensor, abs_sum: torch.Tensor, u: float) -> torch.Tensor:
    # dead elements (S = 0) are exact in any order; floor at one u of the tensor's largest S
    floor = max(u * float(abs_sum.max()), np.finfo(np.float32).tiny)
    return torch.clamp(bound * EVALUATION_MARGIN, min=floor)


def _quantity(name, n, abs_sum, acc, rnd, prop, u, flips=0) -> QuantityBound:
    rnd = rnd if torch.is_tensor(rnd) else torch.zeros_like(abs_sum)
    prop = prop if torch.is_tensor(prop) else torch.zeros_like(abs_sum)
    bound = _floored(acc + rnd + prop, abs_sum, u)
    as_np = lambda t: t.double().cpu().numpy()  # noqa: E731 - local shorthand
    return QuantityBound(name, n, as_np(abs_sum), as_np(acc), as_np(rnd), as_np(prop), as_np(bound), flips)


def error_bounds(trace: Trace, precision: str = "float32", lam: float = LAMBDA) -> dict[str, QuantityBound]:
    """Per-element rounding bound for loss, output and every gradient of `trace` at `precision`.

    `trace` is the float64 reference (it holds the exact-enough intermediates); `precision`
    is the candidate's claimed arithmetic. The trace is never modified. Peak extra memory: about
    eight float32 16-channel tensors (≈1.1 GB at 1024², batch 2; a diagnosis peaks at ≈2.6 GB).
    """
    formats.unit_roundoff(precision)  # raises for an unknown precision
    cache = trace.meta.setdefault("error_bounds", {})  # one evaluation per trace and precision
    if (precision, lam) not in cache:
        device = trace.activations[0].device
        with torch.no_grad(), _ieee(device):
            cache[(precision, lam)] = _error_bounds(trace, precision, lam)
    return cache[(precision, lam)]


def dependency_count(radius: int) -> int:
    """χ* bound for a field whose element at p depends on roundings within `radius` of p.

    Elements farther apart than 2·radius share no rounding event, so the dependency graph has
    degree Δ ≤ (4·radius + 1)² − 1 and fractional chromatic number χ* ≤ Δ + 1 (Janson 2004).
    """
    return (4 * radius + 1) ** 2


def _zeros_like_reusing(like: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as `like`, in `spare`'s storage when it is a finished temporary of that shape
    (a fresh 128 MB tensor costs ~40 ms of page faults at 1024²: the kernel zeroes every page)."""
    return spare.zero_() if spare.shape == like.shape and spare.dtype == like.dtype else torch.zeros_like(like)


def _relu_tests(z: torch.Tensor, error: torch.Tensor, spare: torch.Tensor | None = None) -> torch.Tensor:
    """Where |z| ≤ E_z (the ReLU may flip), returned; where z ≤ −E_z, E_z is set to 0 (the ReLU output
    is exactly 0 there). E_z is widened by STORED_WIDENING first (z is held in float32) and carried so.
    fl(z + E) has the sign of z + E (gradual underflow: x ⊕ y = 0 only if x = −y), so z > −E ⇔ z ⊕ E > 0."""
    error.mul_(STORED_WIDENING)
    above = torch.add(z, error) if spare is None else torch.add(z, error, out=spare)  # z + E (in spare's room)
    may_flip = torch.le(z, error).logical_and_(above >= 0)
    error.mul_(above.gt_(0))  # 1.0 where z > −E, else 0.0: a multiply, not a masked fill (twice as fast)
    return may_flip


def _channel_sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Σ t² over batch, height and width per channel, as one dot product per image and channel
    (no squared copy of t: 128 MB at 1024²)."""
    flat = t.reshape(t.shape[0], t.shape[1], 1, -1)
    return torch.matmul(flat, flat.transpose(-1, -2)).sum(dim=0).view(-1)


def _sum_of_errors(deterministic: torch.Tensor, squares: torch.Tensor, radius: int, lam: float) -> torch.Tensor:
    """Bound on Σ c_p·e_p with |e_p| ≤ E_p mean-zero errors: min(Σ|c|E, λ·√(χ*·Σ c²E²)).

    The second is Hoeffding's inequality for sums with a dependency graph (Janson 2004, Random
    Struct. Alg. 24(3), Thm 2.1), failing with probability ≤ 2·exp(−λ²/2).
    """
    return torch.minimum(deterministic, lam * torch.sqrt(dependency_count(radius) * squares))


def _error_bounds(trace: Trace, precision: str, lam: float) -> dict[str, QuantityBound]:
    ops = _bound_convolutions(trace.activations[0].device)
    u = formats.unit_roundoff(accumulation_precision(precision))
    n_grad = n_terms(trace)
    weights = _weights_from_trace(trace)
    out: dict[str, QuantityBound] = {}

    # forward: E_z = γ̃·S_z + rounding + conv(E_a, |W|); ReLU is 1-Lipschitz so E_a(next) = E_z
    # where z may be positive, 0 where z ≤ −E_z.
    # act_radius[k]: how far (in pixels) the roundings behind a_k's error reach
    act_errors, act_radius, flip_masks = [None], [-1], []  # the input is exact (float32 cast)
    for k, layer in enumerate(LAYERS):
        w, b = weights[layer]
        n_fwd = KERNEL_SIZE * KERNEL_SIZE * CHANNELS[k] + 1
        if k == len(LAYERS) - 1:  # the output: keep every part (one channel, small)
            out["output"], output_error = _output_bound(ops, trace, act_errors[k], w, b, n_fwd, precision, u, lam)
            output_radius = act_radius[k] + 1
            break
        error, spare = _forward_error(ops, trace.activations[k], act_errors[k], w, b, n_fwd, precision, u, lam,
                               nonnegative=k > 0)
        z = _f32(trace.preactivations[k])  # read only: it may be the trace's own float32 tensor
        flip_masks.append(_relu_tests(z, error, spare))
        del z, spare
        act_errors.append(error)
        act_radius.append(act_radius[k] + 1)

    # loss = mean(r²): n positive terms (S = loss) plus the output error through 2|r|/N
    residual = _f32(trace.output_grads[-1] * (trace.output_grads[-1].numel() / 2.0))  # r = y − t from 2r/N
    n_out = residual.numel()
    loss_sum = torch.tensor([float(trace.loss)], dtype=torch.float64)
    first_order = _sum_of_errors((residual.abs() * output_error).sum().double(),
                                 (residual * residual * output_error * output_error).sum().double(), output_radius, lam)
    loss_prop = (2.0 / n_out) * first_order + (output_error.double() ** 2).sum() / n_out
    out["loss"] = _quantity("loss", n_out, loss_sum, probabilistic_gamma(n_out + 2, u, lam) * loss_sum,
                            0.0, loss_prop.reshape(1), u)

    # backward: g_last = 2r/N; E_g = (2/N)(E_y + γ₂|r|); then through |W| and the ReLU masks.
    # grad_error is mean-zero-modelled; grad_flips collects ReLU flips (deterministic, |h| at a flip)
    grad_error = (2.0 / n_out) * (output_error + gamma(2, u) * residual.abs())
    grad_flips, grad_radius = torch.zeros_like(grad_error), output_radius
    del residual, output_error
    for k in reversed(range(len(LAYERS))):
        layer = LAYERS[k]
        abs_g, (w, _) = _magnitude(trace.output_grads[k]), weights[layer]  # |g|: signs never matter below
        flips = int(sum(torch.count_nonzero(m) for m in flip_masks[k:]))  # masks this gradient went through
        radius = max(act_radius[k] + 1, grad_radius)
        bias_sum = abs_g.sum(dim=(0, 2, 3))
        bias_prop = (_sum_of_errors(grad_error.sum(dim=(0, 2, 3)), _channel_sum_of_squares(grad_error), grad_radius, lam)
                     + grad_flips.sum(dim=(0, 2, 3)))
        out[f"{layer}.bias"] = _quantity(f"{layer}.bias", n_grad, bias_sum, probabilistic_gamma(n_grad, u, lam) * bias_sum,
                                         0.0, bias_prop, u, flips)
        layer_error, layer_flips = grad_error, grad_flips
        if k > 0:  # the next gradient down, before this layer's tensors are reused in place
            grad_error, grad_flips = _input_grad_error(ops, abs_g, w, layer_error, layer_flips, flip_masks[k - 1],
                                                       trace.preactivations[k - 1], precision, u, lam)
            grad_radius += 1
        abs_a = _f32(trace.activations[k]) if k > 0 else _magnitude(trace.activations[k])  # a ≥ 0 after a ReLU
        out[f"{layer}.weight"] = _weight_grad_bound(ops, layer, abs_a, abs_g,
                                                    act_errors[k], layer_error, layer_flips, radius, n_grad,
                                                    precision, u, lam, flips)
        act_errors[k] = None  # free as we go: peak memory at 1024² is the point
        del abs_a, abs_g, layer_error, layer_flips
    return {name: out[name] for name in QUANTITIES}


def attach_parameters(trace: Trace, params: dict[str, np.ndarray]) -> Trace:
    """Record the float32 parameters a trace was computed with (the bounds propagate through |W|)."""
    trace.meta.setdefault("params", dict(params))
    return trace


def _forward_error(ops, activation, act_error, w, b, n_fwd, precision, u, lam, nonnegative):
    """E_z = γ̃·(conv(|a|, |W|) + |b|) + rounding + conv(E_a, |W|), as conv(γ̃·|a| + E_a, |W|) + γ̃·|b| + rounding:
    the convolution is linear in its input, so one 16→16 convolution instead of two (time at 1024²).
    `nonnegative`: a is a ReLU output, |a| = a (no copy of the trace's tensor). Returns (E_z, a finished
    temporary of E_z's shape or None)."""
    a, gamma_fwd = _f32(activation), probabilistic_gamma(n_fwd, u, lam)
    rnd = _rounding_term(ops.forward, a, w, precision, lam)
    reach = torch.mul(a, gamma_fwd) if nonnegative else _magnitude(activation).mul_(gamma_fwd)
    del a
    if act_error is not None:
        reach.add_(act_error)
    error = ops.forward(reach, w.abs())
    spare = reach if reach.shape == error.shape else None  # a finished temporary, for the ReLU tests
    del reach
    error.add_(b.abs().mul_(gamma_fwd).view(1, -1, 1, 1))
    if torch.is_tensor(rnd):
        error.add_(rnd)
    return error, spare


def _output_bound(ops, trace, act_error, w, b, n_fwd, precision, u, lam):
    a = _f32(trace.activations[-1])  # a ReLU output: |a| = a (read only)
    abs_sum = ops.forward(a, w.abs()) + b.abs().view(1, -1, 1, 1)
    acc = probabilistic_gamma(n_fwd, u, lam) * abs_sum
    rnd = _rounding_term(ops.forward, a, w, precision, lam)
    del a
    prop = ops.forward(act_error, w.abs())
    return _quantity("output", n_fwd, abs_sum, acc, rnd, prop, u), acc + rnd + prop


def _weights_from_trace(trace: Trace) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    params = trace.meta.get("params")
    if params is None:
        raise ValueError("the reference trace carries no parameters: build it with precision_lab.reference.reference()")
    device = trace.activations[0].device
    return {layer: (torch.as_tensor(params[f"{layer}.weight"], dtype=torch.float32, device=device),
                    torch.as_tensor(params[f"{layer}.bias"], dtype=torch.float32, device=device))
            for layer in LAYERS}


def _weight_grad_bound(ops, layer, abs_a, abs_g, act_error, grad_error, grad_flips, radius, n, precision, u, lam,
                       flips) -> QuantityBound:
    """`abs_a` is |a| (read only: it may be the trace's own tensor); `abs_g`, `act_error` and
    `grad_error` are CONSUMED (squared in place: the caller is done with them, and each copy is
    128 MB at 1024²). Signs never matter here: S, rounding and propagation depend on magnitudes only."""
    abs_sum, deterministic = _weight_grads_of(ops, abs_a, abs_g, grad_error)
    acc = probabilistic_gamma(n, u, lam) * abs_sum
    rnd = _rounding_term(ops.weight_grad, abs_a, abs_g, precision, lam)
    # first order Σ(|a|E_g + E_a|g|) as a sum of mean-zero dependent errors; (x+y)² ≤ 2x² + 2y²
    # flips enter deterministically
    flip_count = int(torch.count_nonzero(grad_flips))
    flip_part = (0.0 if flip_count == 0 else _sparse_weight_grad(abs_a, grad_flips) if flip_count <= SPARSE_LIMIT
                 else ops.weight_grad(abs_a, grad_flips))
    second_order = 0.0
    if act_error is not None:
        deterministic += ops.weight_grad(act_error, abs_g)
        # second order Σ E_a·(E_g + F) ≤ max(E_a)·Σ(E_g + F): cheap and tiny
        largest = act_error.amax(dim=(0, 2, 3)).view(1, -1, 1, 1)  # per input channel
        second_order = largest * (grad_error.sum(dim=(0, 2, 3)) + grad_flips.sum(dim=(0, 2, 3))).view(-1, 1, 1, 1)
    if act_error is not None:
        squares = ops.weight_grad(act_error.square_(), abs_g.square_())  # E_a and |g| are consumed here
        squares += ops.weight_grad(torch.mul(abs_a, abs_a, out=act_error), grad_error.square_())  # |a|² into E_a's room
        squares *= 2
    else:
        squares = ops.weight_grad(abs_a.square(), grad_error.square_())  # E_g is consumed here
    prop = _sum_of_errors(deterministic, squares, radius, lam) + flip_part + second_order
    del deterministic, squares, abs_a, abs_g
    return _quantity(f"{layer}.weight", n, abs_sum, acc, rnd, prop, u, flips)


def _weight_grads_of(ops, a: torch.Tensor, g: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight_grad(a, g) and weight_grad(a, e). A one-channel g (conv3) costs a pass over the
    16-channel a all the same: then both in one pass, g and e side by side (a 16 MB copy at 1024²)."""
    if g.shape[1] > 1:
        return ops.weight_grad(a, g), ops.weight_grad(a, e)
    both = ops.weight_grad(a, torch.cat([g, e], dim=1))
    return both[:1], both[1:]


def _input_grad_error(ops, abs_g, w, grad_error, grad_flips, flip_mask, preactivation, precision, u, lam):
    """(E, F) of ∂loss/∂z one layer down: the input-gradient sum's bound E (mean-zero model) and
    the ReLU-flip part F (deterministic: a flipped ReLU passes or blocks the whole |h|).
    Built in place: each full-size temporary is ~134 MB at 1024²."""
    gamma_bwd = probabilistic_gamma(KERNEL_SIZE * KERNEL_SIZE * w.shape[0], u, lam)
    abs_w = w.abs()
    flip_points = flip_mask.nonzero(as_tuple=True) if int(torch.count_nonzero(flip_mask)) <= SPARSE_LIMIT else None
    # 1.0 where some candidate may pass the gradient (z > 0, or a possible flip), else 0.0: a multiply, not a masked fill
    opened = _f32(preactivation).clamp(min=0).sign_()
    if flip_points is not None:
        opened[flip_points] = 1.0
    else:
        opened.masked_fill_(flip_mask, 1.0)
    if flip_points is not None:  # S_h = Σ|g||W| only where a ReLU may flip: γ̃·S_h + conv(E_g) is one convolution
        reach = torch.mul(abs_g, gamma_bwd).add_(grad_error)
        error = ops.input_grad(reach, abs_w)
        flips = _zeros_like_reusing(error, reach)
        del reach
        flips[flip_points] = _input_grad_at(abs_g, abs_w, flip_points)  # |h| ≤ Σ|g||W|
    else:
        error = ops.input_grad(abs_g, abs_w)  # S of the input-gradient sum, also a bound on |h|
        flips = error.masked_fill(~flip_mask, 0.0)
        error.mul_(gamma_bwd).add_(ops.input_grad(grad_error, abs_w))
    flip_count = int(torch.count_nonzero(grad_flips))
    if 0 < flip_count <= SPARSE_LIMIT:
        _add_sparse_input_grad(flips, grad_flips, abs_w, gate=opened)
    elif flip_count:
        flips.add_(ops.input_grad(grad_flips, abs_w).mul_(opened))
    rounding = _rounding_term(ops.input_grad, abs_g, w, precision, lam)  # magnitudes only
    if torch.is_tensor(rounding):
        error.add_(rounding)
    del rounding
    return error.mul_(opened), flips


# ---------------------------------------------------------------------------------------------
# point-by-point convolutions of sparse fields (3×3, padding 1, the conventions of problem.ConvOps)


def _taps(ys: torch.Tensor, xs: torch.Tensor, sign: int, height: int, width: int):
    """Rows ys + sign·(i − 1) and columns xs + sign·(j − 1) of the 3×3 taps around m points, clamped
    into the image, and an (m, 3, 3) mask of the taps that lie inside it (outside is zero padding)."""
    offsets = sign * (torch.arange(KERNEL_SIZE, device=ys.device) - PADDING)
    rows, cols = ys[:, None] + offsets, xs[:, None] + offsets
    inside = ((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[:, None, :]
    return rows.clamp(0, height - 1), cols.clamp(0, width - 1), inside


def _patches(t: torch.Tensor, images, rows, cols, inside) -> torch.Tensor:
    """(m, C, 3, 3): t[image, c, rows[i], cols[j]] around each point, 0 outside the image."""
    channels = torch.arange(t.shape[1], device=t.device)[None, :, None, None]
    patch = t[images[:, None, None, None], channels, rows[:, None, :, None], cols[:, None, None, :]]
    return patch.mul_(inside[:, None])


def _input_grad_at(g: torch.Tensor, w: torch.Tensor, points) -> torch.Tensor:
    """input_grad(g, w) at the given (n, c, y, x) points only: Σ_o Σ_ij g[n, o, y−i+1, x−j+1]·w[o, c, i, j]."""
    images, channels, ys, xs = points
    rows, cols, inside = _taps(ys, xs, -1, g.shape[2], g.shape[3])
    return (_patches(g, images, rows, cols, inside) * w[:, channels].transpose(0, 1)).sum(dim=(1, 2, 3))


def _add_sparse_input_grad(out: torch.Tensor, f: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None = None) -> None:
    """out += input_grad(f, w)·gate for a sparse f: each f[n, o, y, x] adds f·w[o, c, i, j] at (n, c, y+i−1, x+j−1)."""
    images, outs, ys, xs = f.nonzero(as_tuple=True)
    rows, cols, inside = _taps(ys, xs, 1, f.shape[2], f.shape[3])
    shape = (len(images), w.shape[1], KERNEL_SIZE, KERNEL_SIZE)
    channels = torch.arange(w.shape[1], device=f.device)[None, :, None, None]
    index = [images[:, None, None, None], channels, rows[:, None, :, None], cols[:, None, None, :]]
    keep = inside[:, None].expand(shape)
    values = w[outs] * f[images, outs, ys, xs][:, None, None, None]
    targets = tuple(i.expand(shape)[keep] for i in index)
    values = values[keep] if gate is None else values[keep] * gate[targets]
    out.index_put_(targets, values, accumulate=True)


def _sparse_weight_grad(a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """weight_grad(a, f) for a sparse f: [o, c, i, j] = Σ a[n, c, y+i−1, x+j−1]·f[n, o, y, x] over f's non-zeros."""
    images, outs, ys, xs = f.nonzero(as_tuple=True)
    rows, cols, inside = _taps(ys, xs, 1, f.shape[2], f.shape[3])
    terms = _patches(a, images, rows, cols, inside).mul_(f[images, outs, ys, xs][:, None, None, None])
    return a.new_zeros(f.shape[1], a.shape[1], KERNEL_SIZE, KERNEL_SIZE).index_add_(0, outs, terms)


def gradient_bounds(trace: Trace, precision: str = "float32") -> dict[str, np.ndarray]:
    """Per-element bound on |ĝ − g| for every parameter gradient at `precision` (PARAM_NAMES keys)."""
    bounds = error_bounds(trace, precision)
    return {name: bounds[name].bound for name in PARAM_NAMES}


def abs_term_sums(trace: Trace) -> dict[str, np.ndarray]:
    """S for each gradient: the sums recomputed on |operands| (float32 evaluation)."""
    bounds = error_bounds(trace, "float32")
    return {name: bounds[name].abs_sum for name in PARAM_NAMES}
