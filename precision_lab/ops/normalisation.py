"""Normalisation: batch_norm2d (training and evaluation mode), group_norm and layer_norm (over the last axis).

y = γ·x̂ + β, x̂ = (x − μ)·r, r = 1/√(v + ε), with μ and the biased variance v of each statistics group (a channel
over the batch's N·H·W pixels in training mode; the running statistics, constants of the spec, in evaluation mode;
a group of C/G channels of one sample for group_norm).
Training-mode backward: dx = r·(h − mean(h) − x̂·mean(h·x̂)) with h = γ·g; dγ = Σ g·x̂, dβ = Σ g.

The rounding bound (Higham 2002 §2.2: one rounding per operation, |δ| ≤ u; Higham & Mary 2019: a sum of m terms
within γ̃ₘ(λ)·Σ|terms|), for a candidate whose input carries errors |e| ≤ E:

* μ̂: a sum of m terms and a division: E_μ = γ̃ₘ(λ)·mean|x| + u·|μ| + mean(E).
* v̂: every legitimate float32 order — two-pass mean((x − μ̂)²), Welford's update, the one-pass mean(x²) − μ̂² —
  passes each term through at most four roundings (Welford: a subtraction, a division, a product, an addition),
  each relative to at most mean(x²) = v + μ² (the one-pass form's sum of squares; Chan, Golub & LeVeque 1983, Am.
  Stat. 37(3): its error scales with κ² = mean(x²)/v, the other two's with κ or less), so its own part is
  γ̃₄ₘ(λ)·mean((|x| + E)²) + (2|μ| + 2Ē + own_μ)·own_μ (the one-pass form's μ̂²) + 2u·(mean(x²) + μ²); the input
  errors enter as mean((d + e − ē)²) − mean(d²) ≤ 2·mean(|d|·E) + mean(E²) (d = x − μ, mean(d) = 0: μ̂'s upstream
  error is second order in every form).
* r̂: v̂ + ε rounds once, then √ and ÷ (or rsqrtf, within 2 ulp: CUDA C Programming Guide, "Mathematical
  Functions"): with δ = (E_v + u·(v + ε))/(v + ε) < 1, |r̂/r − 1| ≤ ρ = (1 + δ/(1 − δ))(1 + 4u) − 1 (since
  (1 ± δ)^(−1/2) − 1 ≤ δ/(1 − δ)).
* x̂: E_x̂ = (1 + ρ)(1 + u)·r·((E + E_μ)(1 + u) + u|d|) + (ρ + u)·|x̂|; y adds |γ|·E_x̂·(1 + 2u), the affine's two
  roundings u·(|γx̂| + |β|) + u|y|, and 3u·|γ|·r·(|x| + |μ|) for the folded form x·(γr) + (β − μγr) cuDNN's
  inference kernels use (its products round relative to |x| and |μ|, not to |x − μ|).
* backward (training): a = mean(h), b = mean(h·x̂) are sums of m terms: E_a = γ̃ₘ(λ)·mean|h| + u|a| + mean(E_h),
  E_b = γ̃ₘ(λ)·mean|hx̂| + u|b| + mean(E_h·|x̂| + |h|·E_x̂ + E_h·E_x̂), E_h = |γ|·E_g + u|h|; t = h − a − x̂·b has
  E_t = E_h + E_a + |x̂|E_b + E_x̂(|b| + E_b) + 3u(|h| + |a| + |x̂b|); dx = r̂·t̂ within (1 + ρ)(1 + u)·r·E_t +
  (ρ + u)·r·|t|. In evaluation mode t = h. dγ's own part is γ̃ₙ(λ)·Σ|g·x̂| plus Σ|g|·E_x̂ of the candidate's own x̂;
  its upstream part Σ E_g(|x̂| + E_x̂) + |g|·(E_x̂ − own) is added deterministically (no independence assumed); dβ is a
  bias gradient (layers._bias_parts).

Training mode couples the batch: μ̂'s and r̂'s errors (and a, b's in the backward) are shared by every sample, so the
output's and the input gradient's errors are marked `coupled` (ops.Field): every later sum over samples treats them
as fully dependent (roundoff.dependency_count), where it would otherwise assume different samples share no rounding
(a linear layer's χ* = 1, a convolution's per-image dependency count). Their radius is None (every pixel of the
sample). The sampled propagation draws each statistic's rounding once per group (ops.SharedDraw), with its signed
effect on each element; the forward's μ̂ and r̂ are reused by the backward, so those draws are scaled by √2 in both
(for any linear functional L, (La + Lb)² ≤ 2((La)² + (Lb)²): independent draws at √2 cover the correlated pair).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import (REQUIRED, Field, GradField, Op, OpSpecError, OtherAttributes, Parts, PortSlip, Rule, SharedDraw,
               coupled_terms, gamma_over_lambda, register)
from .. import roundoff
from .onnx_reading import OnnxRead, attr, require

#: r̂'s own rounding in units of u: √ then ÷ (two roundings), or rsqrtf's 2 ulp ≤ 4u (CUDA's documented maximum)
RSQRT_UNITS = 4.0
#: roundings each term of a variance passes through at most (Welford's update: −, ÷, ×, +): γ̃ over this many·m
VARIANCE_ROUNDINGS = 4
#: the folded form x·(γr) + (β − μγr): its three roundings relative to |x| and |μ| (module docstring)
FOLDED_ROUNDINGS = 3.0


def _number(value, key: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise OpSpecError(f"'{key}' is {value!r}: expected a {'positive ' if positive else ''}number")
    return float(value)


def _flag(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise OpSpecError(f"'{key}' is {value!r}: expected true or false")
    return value


class Statistics:
    """One evaluation of a normalisation's statistics bound, per group (view shape) and per element."""

    def __init__(self, **values):
        self.__dict__.update(values)


class Normalisation(Op):
    """The statistics, the backward and the bound shared by the normalisations (module docstring): a subclass says
    how its tensor is grouped (`view`, `stat_dims`), how its affine parameters broadcast and which axes their
    gradients sum over, and where its statistics come from."""

    parametrised = True
    reads_error_backward = True
    #: axes of the viewed tensor the statistics are taken over
    stat_dims: tuple = ()

    def check(self, attrs):
        if attrs["channels"] is not None:
            attrs["channels"] = _positive(attrs["channels"], "channels")
        attrs["affine"] = _flag(attrs["affine"], "affine")
        attrs["eps"] = _number(attrs["eps"], "eps", positive=True)
        if attrs["affine"] and attrs["channels"] is None:
            raise OpSpecError(f"an affine {self.name} needs 'channels' (its weight and bias have one per channel)")
        return attrs

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 3:
            raise OpSpecError(f"{self.name} needs an image (C, H, W) but receives {len(shape)}-D features")
        if attrs["channels"] is not None and shape[0] != attrs["channels"]:
            raise OpSpecError(f"receives {shape[0]} channels but declares 'channels': {attrs['channels']}")
        return shape

    def param_shapes(self, attrs):
        return {"weight": (attrs["channels"],), "bias": (attrs["channels"],)} if attrs["affine"] else {}

    def call_inputs(self, tensors, args):
        return tensors[:1]

    # grouping -----------------------------------------------------------------------------------
    def view(self, attrs, t: torch.Tensor) -> torch.Tensor:
        return t

    def group_size(self, attrs, t: torch.Tensor) -> int:
        shape = self.view(attrs, t).shape
        return math.prod(shape[d] for d in self.stat_dims)

    def mean(self, attrs, t: torch.Tensor) -> torch.Tensor:
        """Each group's mean, keepdim in the view's shape."""
        return self.view(attrs, t).mean(dim=self.stat_dims, keepdim=True)

    def each(self, attrs, stat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A per-group quantity at every element of `like` (its shape)."""
        return stat.expand(self.view(attrs, like).shape).reshape(like.shape)

    def affine(self, attrs, p: torch.Tensor) -> torch.Tensor:
        return p.view(1, -1, 1, 1)

    def channel_first(self, t: torch.Tensor) -> torch.Tensor:
        """`t` with the affine parameters' axis at 1 (an image's channels already are): their gradients sum the rest."""
        return t

    def param_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over every axis but the affine parameters' (a weight or bias gradient's sum)."""
        t = self.channel_first(t)
        return t.sum(dim=_all_but_channels(t))

    def uses_batch_statistics(self, attrs) -> bool:
        return True

    def running(self, attrs, like: torch.Tensor):
        raise NotImplementedError

    # compute ------------------------------------------------------------------------------------
    def statistics(self, attrs, x, unbiased=False, running=False):
        """(μ, v) in the view's shape: the batch's (biased variance; `unbiased`: ÷ (m − 1), a slip) or the running ones."""
        if running or not self.uses_batch_statistics(attrs):
            return self.running(attrs, x)
        xv = self.view(attrs, x)
        mu = xv.mean(dim=self.stat_dims, keepdim=True)
        var = (xv - mu).square().mean(dim=self.stat_dims, keepdim=True)
        if unbiased:
            m = self.group_size(attrs, x)
            var = var * (m / max(m - 1, 1))
        return mu, var

    def inverse_std(self, attrs, var, eps_outside=False):
        return 1.0 / (var.sqrt() + attrs["eps"]) if eps_outside else torch.rsqrt(var + attrs["eps"])

    def normalised(self, attrs, x, unbiased=False, eps_outside=False, running=False):
        """(x̂, r) with r in the view's shape."""
        mu, var = self.statistics(attrs, x, unbiased, running)
        r = self.inverse_std(attrs, var, eps_outside)
        return ((self.view(attrs, x) - mu) * r).reshape(x.shape), r

    def scaled(self, attrs, xhat, params):
        if "weight" not in params:
            return xhat
        return xhat * self.affine(attrs, params["weight"]) + self.affine(attrs, params["bias"])

    def compute(self, attrs, x, params, **how):
        return self.scaled(attrs, self.normalised(attrs, x, **how)[0], params)

    def forward(self, attrs, xs, params, kernels):
        return self.compute(attrs, xs[0], params)

    def backward(self, attrs, g, xs, y, params, kernels, need, constant_statistics=False):
        x = xs[0]
        xhat, r = self.normalised(attrs, x)
        grads = {}
        if "weight" in params:
            grads = {"weight": self.param_sum(g * xhat), "bias": self.param_sum(g)}
        if not need[0]:
            return [None], grads
        h = g * self.affine(attrs, params["weight"]) if "weight" in params else g
        if self.uses_batch_statistics(attrs) and not constant_statistics:
            t = self.view(attrs, h - self.each(attrs, self.mean(attrs, h), h)
                          - xhat * self.each(attrs, self.mean(attrs, h * xhat), h))
        else:
            t = self.view(attrs, h)
        return [(t * r).reshape(x.shape)], grads

    # error model --------------------------------------------------------------------------------
    def bound_statistics(self, attrs, x, error, ctx) -> Statistics:
        """μ, r and their errors per group (module docstring), in float64: total (`rho`, `e_mu`) and own (`*_own`)."""
        u = ctx.u
        mean = lambda t: self.mean(attrs, t)  # noqa: E731
        if self.uses_batch_statistics(attrs):
            m = self.group_size(attrs, x)
            mu, var = self.statistics(attrs, x)
            mean_error = mean(error)
            own_mu = ctx.gamma(m) * mean(x.abs()) + u * mu.abs()
            squares, perturbed = mean(x.square()), mean((x.abs() + error).square())
            own_var = (ctx.gamma(VARIANCE_ROUNDINGS * m) * squares + (2 * mu.abs() + own_mu) * own_mu
                       + 2 * u * (squares + mu.square()))
            d = x - self.each(attrs, mu, x)
            # what the upstream error adds to the variance's roundings and to the mean's is upstream's, so the own part
            # (its parameters' own bound) stays finite where E is not
            upstream_var = (2 * mean(d.abs() * error) + mean(error.square()) + 2 * mean_error * own_mu
                            + (ctx.gamma(VARIANCE_ROUNDINGS * m) + 2 * u) * (perturbed - squares))
            e_mu, e_var = own_mu + mean_error, own_var + upstream_var
        else:
            m = 1
            mu, var = self.running(attrs, x)
            # the spec's statistics reach a float32 candidate rounded once, unless float32 already holds them
            own_mu = u * mu.abs() * (mu.float().double() != mu)
            own_var = u * var * (var.float().double() != var)
            e_mu, e_var = own_mu, own_var
        a = var + attrs["eps"]

        def relative(e):
            delta = (e + u * a) / a
            rho = torch.where(delta < 1, delta / (1 - delta).clamp(min=1e-300), torch.full_like(delta, math.inf))
            return (1 + rho) * (1 + RSQRT_UNITS * u) - 1

        return Statistics(m=m, mu=mu, var=var, a=a, r=torch.rsqrt(a), e_mu=e_mu, own_mu=own_mu, own_var=own_var,
                          rho=relative(e_var), rho_own=relative(own_var))

    def xhat_error(self, attrs, st, x, error, e_mu, rho, u):
        """E_x̂ per element and x̂, d (module docstring)."""
        d = x - self.each(attrs, st.mu, x)
        r = self.each(attrs, st.r, x)
        xhat = d * r
        rho = self.each(attrs, rho, x)
        ed = (error + self.each(attrs, e_mu, x)) * (1 + u) + u * d.abs()
        return (1 + rho) * (1 + u) * r * ed + (rho + u) * xhat.abs(), xhat, d, r

    def _gamma_beta(self, attrs, params, like):
        if "weight" not in params:
            return torch.ones((), dtype=like.dtype, device=like.device), torch.zeros((), dtype=like.dtype, device=like.device)
        return self.affine(attrs, params["weight"].double()), self.affine(attrs, params["bias"].double())

    def forward_error(self, attrs, ins, y, params, ctx, parts: bool = False):
        u = ctx.u
        x = ins[0].value.double()
        error = torch.zeros_like(x) if ins[0].error is None else ins[0].error.double()
        st = self.bound_statistics(attrs, x, error, ctx)
        e_xhat, xhat, d, r = self.xhat_error(attrs, st, x, error, st.e_mu, st.rho, u)
        own_xhat = self.xhat_error(attrs, st, x, torch.zeros_like(x), st.own_mu, st.rho_own, u)[0]
        gam, beta = self._gamma_beta(attrs, params, x)
        mu = self.each(attrs, st.mu, x)
        total = ((1 + 2 * u) * gam.abs() * e_xhat + FOLDED_ROUNDINGS * u * gam.abs() * r * (x.abs() + mu.abs())
                 + u * ((gam * xhat).abs() + beta.abs()) + u * y.double().abs())
        # running statistics a float32 candidate rounds are one error shared by every sample too
        coupled = self.couples_batch(attrs) or (not self.uses_batch_statistics(attrs) and bool(
            (st.own_mu > 0).any() or (st.own_var > 0).any()))
        radius = None if self.uses_batch_statistics(attrs) else ins[0].radius
        memo = {"statistics": st, "xhat": xhat, "e_xhat": e_xhat, "own_xhat": own_xhat}
        total = total.to(y.dtype)
        if parts:  # the network's output
            memo["parts"] = Parts(1, y.abs(), total, 0.0, 0.0, ins[0].flips)
        return Field(y, total, radius, ins[0].flips, memo, coupled=coupled)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        u = ctx.u
        st, xhat, e_xhat, own_xhat = (out.memo[k] for k in ("statistics", "xhat", "e_xhat", "own_xhat"))
        gd, eg = g.double(), grad.error.double()
        gam, _ = self._gamma_beta(attrs, params, gd)
        parts = {}
        if "weight" in params:
            first = self.channel_first(g)
            n = first.numel() // first.shape[1]
            abs_sum = self.param_sum((gd * xhat).abs())
            own = ctx.gamma(n) * abs_sum + self.param_sum(gd.abs() * own_xhat)
            propagated = self.param_sum(eg * (xhat.abs() + e_xhat) + gd.abs() * (e_xhat - own_xhat))
            if grad.flips is not None:
                propagated = propagated + self.param_sum(grad.flips.double() * (xhat.abs() + e_xhat))
            flips = grad.flip_count + ins[0].flips
            from .layers import _bias_parts

            # the terms of one sample: its pixels (an image), its tokens (a layer norm's rows), or one (features)
            chi = roundoff.dependency_count(grad.radius, first[0].numel() // first.shape[1], coupled_terms(n, grad))
            moved = GradField(self.channel_first(grad.error), None if grad.flips is None else self.channel_first(
                grad.flips), grad.radius, grad.flip_count, coupled=grad.coupled)
            parts = {"weight": Parts(n, abs_sum, own, 0.0, propagated, flips),
                     "bias": _bias_parts(first, first.abs(), moved, _all_but_channels(first), chi, ctx)}
        if not need[0]:
            return [None], parts
        h = gd * gam
        e_h = gam.abs() * eg + u * h.abs()
        f_h = None if grad.flips is None else gam.abs() * grad.flips.double()
        mean = lambda t: self.each(attrs, self.mean(attrs, t), h)  # noqa: E731
        if self.uses_batch_statistics(attrs):
            m = st.m
            a, b = mean(h), mean(h * xhat)
            e_a = ctx.gamma(m) * mean(h.abs()) + u * a.abs() + mean(e_h)
            e_b = (ctx.gamma(m) * mean((h * xhat).abs()) + u * b.abs()
                   + mean(e_h * xhat.abs() + h.abs() * e_xhat + e_h * e_xhat))
            t = h - a - xhat * b
            e_t = (e_h + e_a + xhat.abs() * e_b + e_xhat * (b.abs() + e_b)
                   + 3 * u * (h.abs() + a.abs() + (xhat * b).abs()))
            if f_h is not None:
                reach = xhat.abs() + e_xhat
                f_h = f_h + mean(f_h) + reach * mean(f_h * reach)
        else:
            t, e_t = h, e_h
        r = self.each(attrs, st.r, h)
        rho = self.each(attrs, st.rho, h)
        error = (1 + rho) * (1 + u) * r * e_t + (rho + u) * r * t.abs()
        flips = None if f_h is None else (1 + rho) * r * f_h
        radius = None if self.uses_batch_statistics(attrs) else grad.radius
        return [GradField(error.to(g.dtype), None if flips is None else flips.to(g.dtype), radius, grad.flip_count,
                          coupled=self.couples_batch(attrs) or out.coupled)], parts

    # sampled propagation ------------------------------------------------------------------------
    def _sampled_statistics(self, attrs, x, u, lam):
        """σ of μ̂'s and of r̂'s relative rounding per group (the bound's own parts at γ̃/λ), each × √2 (module docstring)."""
        if not self.uses_batch_statistics(attrs):
            mu, var = self.running(attrs, x)
            sigma_mu = u * mu.abs() * (mu.float().double() != mu)
            sigma_r = u * var * (var.float().double() != var) / (2 * (var + attrs["eps"])) + RSQRT_UNITS * u
            return mu, var, sigma_mu, sigma_r
        m = self.group_size(attrs, x)
        mu, var = self.statistics(attrs, x)
        sigma_mu = gamma_over_lambda(m, u, lam) * self.mean(attrs, x.abs()) + u * mu.abs()
        squares = self.mean(attrs, x.square())
        sigma_var = (gamma_over_lambda(VARIANCE_ROUNDINGS * m, u, lam) * squares + 2 * mu.abs() * sigma_mu
                     + 2 * u * (squares + mu.square()))
        sigma_r = sigma_var / (2 * (var + attrs["eps"])) + RSQRT_UNITS * u
        return mu, var, math.sqrt(2) * sigma_mu, math.sqrt(2) * sigma_r

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        x = xs[0]
        mu, var, sigma_mu, sigma_r = self._sampled_statistics(attrs, x, u, lam)
        r = self.each(attrs, torch.rsqrt(var + attrs["eps"]), x)
        xhat = (x - self.each(attrs, mu, x)) * r
        gam, beta = self._gamma_beta(attrs, params, x)
        gam = gam.to(x.dtype)
        own = (gam.abs() * u * (2 * xhat.abs()) + FOLDED_ROUNDINGS * u * gam.abs() * r * (x.abs() + self.each(
            attrs, mu, x).abs()) + u * ((gam * xhat).abs() + beta.abs().to(x.dtype) + y.abs()))
        shape = self.view(attrs, x).shape
        return [own, SharedDraw(self.view(attrs, -(gam * r).expand(x.shape)), sigma_mu.expand(
                    _group_shape(shape, self.stat_dims))),
                SharedDraw(self.view(attrs, gam * xhat), sigma_r.expand(_group_shape(shape, self.stat_dims)))]

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        if not need[0]:
            return [None]
        x = xs[0]
        mu, var, sigma_mu, sigma_r = self._sampled_statistics(attrs, x, u, lam)
        r = self.each(attrs, torch.rsqrt(var + attrs["eps"]), x)
        xhat = (x - self.each(attrs, mu, x)) * r
        gam, _ = self._gamma_beta(attrs, params, x)
        h = g * gam.to(g.dtype)
        shape = self.view(attrs, x).shape
        group = _group_shape(shape, self.stat_dims)
        if not self.uses_batch_statistics(attrs):
            return [[u * r * 2 * h.abs(), SharedDraw(self.view(attrs, r * h), sigma_r.expand(group))]]
        m = self.group_size(attrs, x)
        a_g, b_g = self.mean(attrs, h), self.mean(attrs, h * xhat)
        a, b = self.each(attrs, a_g, h), self.each(attrs, b_g, h)
        t = h - a - xhat * b
        sigma_a = gamma_over_lambda(m, u, lam) * self.mean(attrs, h.abs()) + u * a_g.abs()
        sigma_b = gamma_over_lambda(m, u, lam) * self.mean(attrs, (h * xhat).abs()) + u * b_g.abs()
        own = r * (u * h.abs() + 3 * u * (h.abs() + a.abs() + (xhat * b).abs()) + u * t.abs())
        return [[own, SharedDraw(self.view(attrs, -r.expand(x.shape)), sigma_a),
                 SharedDraw(self.view(attrs, -r * xhat), sigma_b),
                 SharedDraw(self.view(attrs, r * r * (b + xhat * a)), sigma_mu.expand(group)),
                 SharedDraw(self.view(attrs, r * (t - 2 * xhat * b)), sigma_r.expand(group))]]


def _all_but_channels(t: torch.Tensor) -> tuple:
    return tuple(d for d in range(t.dim()) if d != 1)


def _group_shape(shape, dims) -> tuple:
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


# ---------------------------------------------------------------------------------------------
# what a port gets wrong


class StatisticsSlip(Rule):
    """A normalisation computed with other statistics (the unbiased variance, ε outside the root, the running
    statistics in training mode): the slipped forward, and its own backward (autograd of it)."""

    def __init__(self, op, **how):
        self.op, self.how = op, how

    def compute(self, attrs, x, params):
        return self.op.compute(attrs, x, params, **self.how)

    def forward(self, attrs, xs, params, kernels):
        return self.compute(attrs, xs[0], params)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        with torch.enable_grad():
            x = xs[0].detach().requires_grad_(True)
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            out = self.compute(attrs, x, leaves)
            names = list(leaves)
            grads = torch.autograd.grad(out, [x] + [leaves[k] for k in names], g, allow_unused=True)
        return [grads[0] if need[0] else None], {k: v for k, v in zip(names, grads[1:])}


class ConstantStatistics(Rule):
    """A backward that treats the batch statistics as constants: dx = γ·r·g, the two mean terms missing."""

    def __init__(self, op):
        self.op = op

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, params, kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.op.backward(attrs, g, xs, y, params, kernels, need, constant_statistics=True)


# ---------------------------------------------------------------------------------------------
# the ops


class BatchNorm2d(Normalisation):
    """Batch normalisation of an image's channels (PyTorch's nn.BatchNorm2d): in training mode each channel's
    statistics over the batch's N·H·W pixels, in evaluation mode the running statistics the spec carries as constants
    (`running_mean`, `running_var`: C numbers each; PyTorch's fresh 0 and 1 when left out)."""

    name = "batch_norm2d"
    keys = {"channels": REQUIRED, "training": True, "eps": 1e-5, "affine": True, "running_mean": None,
            "running_var": None}
    stat_dims = (0, 2, 3)

    torch_modules = (torch.nn.BatchNorm2d,)
    torch_calls = (F.batch_norm,)
    onnx_ops = ("BatchNormalization",)

    def from_onnx_node(self, node, graph):
        """ONNX BatchNormalization (X, scale, B, mean, var): an inference export (training_mode 0, the exporters'
        default) reads as evaluation mode with its running statistics; training_mode 1 as training mode."""
        scale, bias, mean, var = (graph.constant(t) for t in node.inputs[1:5])
        require(all(t is not None and t.ndim == 1 for t in (scale, bias, mean, var)), "its scale, bias, mean and "
                "variance are not constant vectors (initializers)")
        require(len(graph.shape(node.inputs[0])) == 3, "normalises no image (N, C, H, W)")
        training = bool(int(attr(node, "training_mode", 0)))
        attrs = {"channels": int(scale.size), "training": training, "eps": float(attr(node, "epsilon", 1e-5))}
        if not training:
            attrs |= {"running_mean": [float(v) for v in mean], "running_var": [float(v) for v in var]}
        return OnnxRead(attrs, graph.data_inputs(node)[:1], node.outputs[0], params={"weight": scale, "bias": bias},
                        param_sources={"weight": node.inputs[1], "bias": node.inputs[2]})

    def check(self, attrs):
        attrs = super().check(attrs)
        attrs["training"] = _flag(attrs["training"], "training")
        for key, positive in (("running_mean", False), ("running_var", False)):
            value = attrs[key]
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or (attrs["channels"] is not None and len(value) != attrs["channels"]):
                raise OpSpecError(f"'{key}' must be a list of 'channels' ({attrs['channels']}) numbers")
            attrs[key] = [_number(v, key, positive) for v in value]
            if key == "running_var" and min(attrs[key]) < 0:
                raise OpSpecError("'running_var' holds a negative variance")
        return attrs

    def describe(self, attrs):
        return f"batch_norm2d ({'training' if attrs['training'] else 'evaluation'})"

    def uses_batch_statistics(self, attrs):
        return attrs["training"]

    def couples_batch(self, attrs):
        return attrs["training"]

    def autocast_cpu_runs(self, attrs):
        # evaluation mode: a bfloat16 input with float32 running statistics is "mixed dtype (CPU)" to PyTorch
        return attrs["training"]

    def running(self, attrs, like):
        channels = like.shape[1]
        place = {"dtype": like.dtype, "device": like.device}
        mu = torch.zeros(channels, **place) if attrs["running_mean"] is None else torch.tensor(attrs["running_mean"], **place)
        var = torch.ones(channels, **place) if attrs["running_var"] is None else torch.tensor(attrs["running_var"], **place)
        return mu.view(1, -1, 1, 1), var.view(1, -1, 1, 1)

    # PyTorch ------------------------------------------------------------------------------------
    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.BatchNorm2d(attrs["channels"] or 1, eps=attrs["eps"], affine=attrs["affine"],
                                    track_running_stats=False, device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        x = xs[0]
        mean, var = (None, None) if attrs["training"] else (t.view(-1) for t in self.running(attrs, x))
        return F.batch_norm(x, mean, var, module.weight, module.bias, training=attrs["training"], momentum=0.0,
                            eps=attrs["eps"])

    def from_torch_module(self, module):
        training = module.training or not module.track_running_stats or module.running_mean is None
        attrs = {"channels": module.num_features, "training": training, "eps": float(module.eps), "affine": module.affine}
        if not training:
            attrs |= {"running_mean": module.running_mean.tolist(), "running_var": module.running_var.tolist()}
        return attrs

    def from_torch_call(self, target, args, kwargs):
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        given = dict(zip(names, args)) | kwargs
        if any(given.get(key) is not None for key in ("running_mean", "running_var", "weight", "bias")):
            raise OpSpecError("F.batch_norm with running statistics or affine tensors: the spec cannot read them from "
                              "a traced call; use nn.BatchNorm2d")
        if not given.get("training", False):
            raise OpSpecError("F.batch_norm without running statistics needs training=True")
        return {"channels": None, "affine": False, "training": True, "eps": float(given.get("eps", 1e-5))}

    def port_slips(self, attrs, in_shape):
        every = ("every batch norm",)
        slips = [PortSlip("statistics", "adds ε outside the square root (1/(σ + ε))",
                          lambda: StatisticsSlip(self, eps_outside=True), forward=True, every=every)]
        if attrs["training"]:
            slips += [PortSlip("statistics", "backward treats the batch statistics as constants (dx = γ/σ·g, the two "
                               "mean terms missing)", lambda: ConstantStatistics(self), every=every),
                      PortSlip("statistics", "normalises with the unbiased variance (÷ (m − 1), not m)",
                               lambda: StatisticsSlip(self, unbiased=True), forward=True, every=every),
                      PortSlip("statistics", "uses the running statistics in training mode",
                               lambda: StatisticsSlip(self, running=True), forward=True, every=every)]
        return slips


class GroupNorm(Normalisation):
    """Group normalisation (PyTorch's nn.GroupNorm): each sample's channels in `groups` groups, the statistics of a
    group over its C/G·H·W values, a per-channel affine. The statistics stay within a sample: its errors reach the
    whole sample (radius None), never another sample."""

    name = "group_norm"
    autocast_float32 = True
    keys = {"groups": REQUIRED, "channels": REQUIRED, "eps": 1e-5, "affine": True}
    stat_dims = (2, 3, 4)

    torch_modules = (torch.nn.GroupNorm,)
    torch_calls = (F.group_norm,)
    onnx_ops = ("GroupNormalization",)

    def from_onnx_node(self, node, graph):
        """ONNX GroupNormalization (X, scale, bias; num_groups, epsilon): opset 21 on, scale and bias per channel, as
        nn.GroupNorm's; opsets 18–20 per group, the same only with one channel a group (a per-group affine is another
        parameter: its gradient sums its group's channels)."""
        x = graph.data_inputs(node)
        shape = graph.shape(x[0]) if len(x) == 1 else ()
        require(len(shape) == 3 and shape[0] is not None, "normalises a tensor other than an image (N, C, H, W)")
        channels, groups = shape[0], int(attr(node, "num_groups", 0))
        require(groups >= 1 and channels % groups == 0, f"num_groups {groups} does not divide the {channels} channels")
        named = [*node.inputs, "", ""]
        scale, bias = graph.constant(named[1]), graph.constant(named[2])
        require(scale is not None and bias is not None, "its scale and bias are not constants (initializers)")
        scale, bias = scale.reshape(-1), bias.reshape(-1)
        per_group = graph.opset is not None and graph.opset < 21
        if per_group and groups != channels:
            raise OpSpecError(f"opset {graph.opset}'s scale and bias are per group ({groups} for {channels} channels); "
                              f"the spec's group_norm has one per channel (nn.GroupNorm): export at opset 21 or later")
        require(scale.size == channels and bias.size == channels, f"scale and bias of {scale.size} and {bias.size} "
                f"values for {channels} channels: expected one per channel")
        # stash_type (opset 21): the precision of the statistics, the claimed precision's to the lab
        return OnnxRead({"groups": groups, "channels": channels, "eps": float(attr(node, "epsilon", 1e-5))}, x,
                        node.outputs[0], params={"weight": scale, "bias": bias},
                        param_sources={"weight": named[1], "bias": named[2]})

    def check(self, attrs):
        attrs = super().check(attrs)
        attrs["groups"] = _positive(attrs["groups"], "groups")
        if attrs["channels"] is not None and attrs["channels"] % attrs["groups"]:
            raise OpSpecError(f"'groups' {attrs['groups']} must divide 'channels' {attrs['channels']}")
        return attrs

    def out_shape(self, attrs, in_shapes):
        shape = super().out_shape(attrs, in_shapes)
        if shape[0] % attrs["groups"]:
            raise OpSpecError(f"'groups' {attrs['groups']} must divide the {shape[0]} channels it receives")
        return shape

    def describe(self, attrs):
        return f"group_norm {attrs['groups']} groups"

    def view(self, attrs, t):
        n, c = t.shape[:2]
        return t.reshape(n, attrs["groups"], c // attrs["groups"], *t.shape[2:])

    def torch_module(self, attrs, device=None, dtype=None):
        channels = attrs["channels"] or attrs["groups"]
        return torch.nn.GroupNorm(attrs["groups"], channels, eps=attrs["eps"], affine=attrs["affine"], device=device,
                                  dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return F.group_norm(xs[0], attrs["groups"], module.weight, module.bias, attrs["eps"])

    def from_torch_module(self, module):
        return {"groups": module.num_groups, "channels": module.num_channels, "eps": float(module.eps),
                "affine": module.affine}

    def from_torch_call(self, target, args, kwargs):
        names = ("input", "num_groups", "weight", "bias", "eps")
        given = dict(zip(names, args)) | kwargs
        if given.get("weight") is not None or given.get("bias") is not None:
            raise OpSpecError("F.group_norm with affine tensors: the spec cannot read them from a traced call; use "
                              "nn.GroupNorm")
        return {"groups": int(given["num_groups"]), "channels": None, "affine": False,
                "eps": float(given.get("eps", 1e-5))}

    def port_slips(self, attrs, in_shape):
        channels = in_shape[0]
        slips = []
        for groups, text in ((1, "normalises over one group (a layer norm over C·H·W)"),
                             (channels, "normalises each channel on its own (an instance norm)")):
            if groups != attrs["groups"]:
                slips.append(PortSlip("statistics", text, lambda groups=groups: OtherAttributes(self, {"groups": groups}),
                                      forward=True, every=("every group norm",)))
        return slips


class LayerNorm(Normalisation):
    """Layer normalisation over the last axis (PyTorch's nn.LayerNorm(features)): a feature vector's F values, or each
    token's D of a (T, D) sequence, their statistics within that row alone, a per-feature affine. An image's channels
    are normalised by group_norm with one group (over C·H·W) instead."""

    name = "layer_norm"
    autocast_float32 = True
    keys = {"features": REQUIRED, "eps": 1e-5, "affine": True}
    stat_dims = (2,)

    torch_modules = (torch.nn.LayerNorm,)
    torch_calls = (F.layer_norm,)
    onnx_ops = ("LayerNormalization",)

    def from_onnx_node(self, node, graph):
        """ONNX LayerNormalization (opset 17: X, Scale, B) over the last axis only."""
        shape = graph.shape(node.inputs[0])
        require(int(attr(node, "axis", -1)) in (-1, len(shape)), "normalises more than the last axis (axis "
                f"{attr(node, 'axis', -1)}): the spec's layer_norm takes the last axis only")
        scale = graph.constant(node.inputs[1])
        bias = graph.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        require(scale is not None and bias is not None and scale.ndim == 1, "its Scale and B are not constant "
                "vectors (initializers)")
        return OnnxRead({"features": int(scale.size), "eps": float(attr(node, "epsilon", 1e-5))},
                        graph.data_inputs(node)[:1], node.outputs[0], params={"weight": scale, "bias": bias},
                        param_sources={"weight": node.inputs[1], "bias": node.inputs[2]})

    def check(self, attrs):
        attrs["features"] = _positive(attrs["features"], "features")
        attrs["affine"] = _flag(attrs["affine"], "affine")
        attrs["eps"] = _number(attrs["eps"], "eps", positive=True)
        return attrs

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) == 3 and shape[-1] != attrs["features"]:  # (H, W, C) after a permute is a pixel's channels
            raise OpSpecError("layer_norm normalises a feature vector's, a token's or a pixel's (H, W, C) last axis, "
                              "not an image: for a layer norm over C·H·W use group_norm with groups 1")
        if shape[-1] != attrs["features"]:
            raise OpSpecError(f"receives {shape[-1]} features on its last axis but declares 'features': "
                              f"{attrs['features']}")
        return shape

    def param_shapes(self, attrs):
        return {"weight": (attrs["features"],), "bias": (attrs["features"],)} if attrs["affine"] else {}

    def describe(self, attrs):
        return f"layer_norm over {attrs['features']}"

    def view(self, attrs, t):
        return t.reshape(t.shape[0], -1, t.shape[-1])  # (N, rows, features): each row's statistics on its own

    def affine(self, attrs, p):
        return p  # broadcasts along the last axis

    def channel_first(self, t):
        return t.movedim(-1, 1) if t.dim() > 2 else t

    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.LayerNorm(attrs["features"], eps=attrs["eps"], elementwise_affine=attrs["affine"],
                                  device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return F.layer_norm(xs[0], (attrs["features"],), module.weight, module.bias, attrs["eps"])

    def from_torch_module(self, module):
        if len(module.normalized_shape) != 1:
            raise OpSpecError(f"LayerNorm over {list(module.normalized_shape)}: the spec's layer_norm normalises the "
                              f"last axis only (over an image's C·H·W use nn.GroupNorm(1, C))")
        if module.elementwise_affine and module.bias is None:
            raise OpSpecError("LayerNorm with a weight but no bias: the spec's affine layer norm has both")
        return {"features": int(module.normalized_shape[0]), "eps": float(module.eps),
                "affine": bool(module.elementwise_affine)}

    def from_torch_call(self, target, args, kwargs):
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        given = dict(zip(names, args)) | kwargs
        shape = list(given["normalized_shape"])
        if len(shape) != 1:
            raise OpSpecError(f"F.layer_norm over {shape}: the spec's layer_norm normalises the last axis only")
        read = {"features": int(shape[0]), "affine": False, "eps": float(given.get("eps", 1e-5))}
        weight, bias = given.get("weight"), given.get("bias")
        if weight is None and bias is None:
            return read
        # a module's own weight and bias (torchvision's LayerNorm2d): the layer is named by that module
        owner = getattr(weight, "owner", None)
        if not owner or (getattr(weight, "attribute", None), getattr(bias, "attribute", None)) != ("weight", "bias") \
                or bias.owner != owner:
            raise OpSpecError("F.layer_norm with affine tensors other than one module's own weight and bias; use "
                              "nn.LayerNorm")
        return {**read, "affine": True, "name": owner}

    def port_slips(self, attrs, in_shape):
        every = ("every layer norm",)
        slips = [PortSlip("statistics", "backward treats the statistics as constants (dx = γ/σ·g, the two mean terms "
                          "missing)", lambda: ConstantStatistics(self), every=every)]
        if len(in_shape) < 2:
            return slips  # a feature vector has one axis: no other axes to take the statistics over
        return slips + [PortSlip("statistics", "takes the statistics over the tokens (the other axis), not each "
                                 "token's features", lambda: LayerNormOver(self, (1,)), forward=True, every=every),
                        PortSlip("statistics", "takes the statistics over the whole sequence (tokens and features "
                                 "together)", lambda: LayerNormOver(self, (1, 2)), forward=True, every=every)]


class LayerNormOver(StatisticsSlip):
    """A layer norm whose statistics are taken over other axes of the (N, T, D) sequence."""

    def __init__(self, op, dims):
        self.op, self.dims = op, dims

    def compute(self, attrs, x, params):
        mu = x.mean(dim=self.dims, keepdim=True)
        var = (x - mu).square().mean(dim=self.dims, keepdim=True)
        return self.op.scaled(attrs, (x - mu) * torch.rsqrt(var + attrs["eps"]), params)


def _positive(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OpSpecError(f"'{key}' is {value!r}: expected a positive integer")
    return value


register(BatchNorm2d())
register(GroupNorm())
register(LayerNorm())
