"""Losses: mse (mean over every output element) and cross_entropy (mean over samples and pixels).

Each loss gives its value and ∂loss/∂output (the start of every backward) and its part of the
error model: the loss's own bound and the error of ∂loss/∂output from the output's error E_y.

* both: the mean's own rounding is that of a sum only summation orders compute (`roundoff.order_free_bound`:
  the partial-sum bound, at most γ̃ₙ(λ)·S, plus the terms a running sum as large as the loss absorbs:
  a loop over 2·128² squared residuals of a normal size loses those below an ulp of the sum, 0.82 of
  γ̃ₙ(λ)·S on the deep denoiser, all one way), divided by the count (one more rounding), or more where
  the terms repeat (a constant residual, uniform logits: `roundoff.column_drift`).
* mse: loss = Σr²/N with r = y − t: N positive terms (S = loss); the output error enters to first
  order through 2|r|/N and to second through E_y²/N. ∂loss/∂y = 2r/N, computed with two roundings
  (the subtraction and the scaling: γ₂, Higham 2002 Lemma 3.1) on top of 2E_y/N.
* cross_entropy: per position lᵢ = logsumexp(zᵢ) − zᵢₜ, loss = mean lᵢ (PyTorch's reduction
  "mean" over N, or N·H·W for (N, K, H, W) logits). logsumexp is 1-Lipschitz in the ∞-norm with
  weights softmax(z): |Δlse| ≤ Σₖ pₖEₖ + ½maxₖEₖ²; its float32 evaluation (exp and log within
  2 ulp, a K-term sum, the shift by max z) is within (K + 8)u + 2u·(|lse| + |zₜ| + Σₖpₖ|zₖ − m|).
  ∂l/∂z = (p − onehot)/count with p = softmax(z): relative error of p at most
  (K + 8 + |zₖ| + |lse| + |zₖ − m|)·u from its evaluation (whichever of exp(z − m)/Σ or exp(z − lse))
  and expm1(Eₖ + Σⱼ pⱼEⱼ) from the logits' errors.
"""
from __future__ import annotations

import torch

from . import Field, GradField, OpSpecError, Parts, coupled_terms, register_loss
from .. import roundoff


class MSE:
    name = "mse"
    target_dtype = "float"

    def sampled_grad_scale(self, y, t, u: float):
        """Scale of the draw on ∂loss/∂y for sampled propagation: its two roundings (bound's own part, without E_y)."""
        residual = y - t
        return (2.0 / residual.numel()) * roundoff.gamma(2, u) * residual.abs()

    def torch_loss(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(y, t)

    def check_output(self, shape, where: str) -> None:
        return None

    def takes_onnx_output(self, node, shape: tuple, opset: int) -> bool:
        """Whether an exported graph's last node is part of this loss, not of the network (mse: never)."""
        return False

    def target_shape(self, out_shape: tuple) -> tuple:
        return tuple(out_shape)

    def positions(self, y: torch.Tensor) -> int:
        return y.numel()

    def forward_backward(self, y: torch.Tensor, t: torch.Tensor, in_place: bool = False):
        """(loss, ∂loss/∂y) in y's dtype; with `in_place` the residual's storage becomes the gradient."""
        residual = y - t
        loss = torch.mean(residual * residual)
        scale = 2.0 / residual.numel()  # d mean((y-t)^2) / dy
        return loss, (residual.mul_(scale) if in_place else residual * scale)

    def bound(self, out: Field, target: torch.Tensor, loss: float, ctx) -> tuple[Parts, GradField]:
        y = out.value
        residual = (y.double() - target.double()).to(torch.float32)
        n_out = residual.numel()
        loss_sum = torch.tensor([float(loss)], dtype=torch.float64, device=y.device)
        squares = (y.double() - target.double()).square_().reshape(-1, 1)
        # each term carries its subtraction's rounding too (2u·r²): 16 more in √(k + 3)'s count (Σ(2t)² ≤ 16M²)
        own = _mean_own(squares, n_out + 16, n_out, loss_sum, ctx)
        accumulation, drifted = _own_part(own, residual * residual, n_out, ctx)
        error = out.error if out.error is not None else torch.zeros_like(residual)
        chi = roundoff.dependency_count(out.radius, _pixels(y), coupled_terms(n_out, out)) * (1 if out.coupled else _channels(y))
        first_order = ctx.sum_of_errors((residual.abs() * error).sum().double(),
                                        (residual * residual * error * error).sum().double(), chi)
        propagated = ((2.0 / n_out) * first_order + (error.double() ** 2).sum() / n_out).reshape(1)
        grad_error = (2.0 / n_out) * (error + roundoff.gamma(2, ctx.u) * residual.abs())
        return (Parts(n_out, loss_sum, accumulation, 0.0, propagated, out.flips, drifted),
                GradField(grad_error, None, out.radius, 0, coupled=out.coupled))


def _mean_own(terms: torch.Tensor, live: int, count: int, mean: torch.Tensor, ctx) -> torch.Tensor:
    """A mean's own rounding: order_free_bound of the sum of `terms` (a column, float64) ÷ `count`, plus the
    division's rounding u·|mean|."""
    summed = roundoff.order_free_bound(terms, torch.tensor([float(live)], dtype=torch.float64, device=terms.device),
                                       ctx.u, ctx.lam)
    return summed / count + ctx.u * mean.abs()


#: a loss of at most this many terms (a batch of 4 at 128²) always takes the larger of its order-free own part and
#: DRIFT_MARGIN × its simulated sums' error (30 ms at 65,536 terms; 1.4 s at 2·1024²). A near-constant residual
#: (an output flat over the background) beside a few large ones: the large squares set the running sum, and the
#: bulk's near-equal squares, a few ulps of it with bunched fractional parts, round the same way again and again,
#: too spread (0.44% repeat) for `roundoff.repeats` to see. A loop over the deep denoiser's 8,192 squares (64²,
#: seed 65) erred 1.4× the order-free bound, 50 shuffled orders −0.26 ± 0.02 of the sum: a bias, not the
#: mean-zero walk the bound's Azuma–Hoeffding step assumes. Above it the absorbed terms carry such a bias: 2·1024²
#: chi-square squares absorb 3% of their sum, the simulated loops err 0.13%
LOSS_DRIFT_LIMIT = 4 * 128 * 128


def _own_part(accumulation: torch.Tensor, terms: torch.Tensor, count: int, ctx):
    """(the mean's own rounding, where drift won): the order-free bound, or DRIFT_MARGIN × the simulated sequential
    sums' error ÷ count where the terms repeat (`roundoff.repeats`: equal residuals or losses stagnate) or are few
    enough to simulate (LOSS_DRIFT_LIMIT)."""
    if count > LOSS_DRIFT_LIMIT and not roundoff.repeats(terms, count, ctx.precision):
        return accumulation, None
    drift = roundoff.column_drift(roundoff.as_terms(terms.reshape(-1, 1), ctx.precision), None, ctx.precision)
    return roundoff.with_drift(accumulation, drift / count)


def _pixels(y: torch.Tensor) -> int:
    return y.shape[2] * y.shape[3] if y.dim() == 4 else 1


def _channels(y: torch.Tensor) -> int:
    return y.shape[1] if y.dim() >= 2 else 1


class CrossEntropy:
    name = "cross_entropy"
    target_dtype = "int64"

    def sampled_grad_scale(self, y, t, u: float):
        """Scale of the draw on ∂loss/∂y for sampled propagation: p's evaluation error (bound's own part, without E_y)."""
        m, e, s, lse, z_t = self._parts(y, t)
        p = e / s
        onehot = torch.zeros_like(p).scatter_(1, t.unsqueeze(1), 1.0)
        k, count = y.shape[1], self.positions(y)
        relative = (k + 8 + y.abs() + lse.abs() + (y - m).abs()) * u
        return (p * relative + 2 * u * (p - onehot).abs()) / count

    def torch_loss(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(y, t)

    def takes_onnx_output(self, node, shape: tuple, opset: int) -> bool:
        """A final Softmax or LogSoftmax over the classes (a Keras classifier's last activation): the loss applies
        it to the logits, −log softmax(z)ₜ being the cross-entropy of the probabilities, so the network ends before it."""
        if node.op_type not in ("Softmax", "LogSoftmax"):
            return False
        # before opset 13 the axis flattens every later one with it: over the classes only for (N, K)
        axis = node.attrs.get("axis", -1 if opset >= 13 else 1) % (len(shape) + 1)
        if axis != 1 or (opset < 13 and len(shape) != 1):
            raise OpSpecError(f"{node.op_type} over axis {node.attrs.get('axis')} is not over the classes (axis 1)")
        return True

    def check_output(self, shape, where: str) -> None:
        if len(shape) not in (1, 3):
            raise OpSpecError(f"cross_entropy needs logits (N, K) or (N, K, H, W), got per-sample shape {tuple(shape)}")
        if shape[0] is not None and shape[0] < 2:
            raise OpSpecError(f"cross_entropy needs at least 2 classes, the output has {shape[0]}")

    def target_shape(self, out_shape: tuple) -> tuple:
        return tuple(out_shape[1:])

    def positions(self, y: torch.Tensor) -> int:
        return y.numel() // y.shape[1]

    @staticmethod
    def _parts(z: torch.Tensor, t: torch.Tensor):
        """(max, exp(z − max), Σ, lse, z at the target) along the class axis."""
        m = z.amax(dim=1, keepdim=True)
        e = torch.exp(z - m)
        s = e.sum(dim=1, keepdim=True)
        lse = m + torch.log(s)
        z_t = z.gather(1, t.unsqueeze(1))
        return m, e, s, lse, z_t

    def forward_backward(self, z: torch.Tensor, t: torch.Tensor, in_place: bool = False):
        m, e, s, lse, z_t = self._parts(z, t)
        count = self.positions(z)
        loss = (lse - z_t).sum() / count
        grad = e / s
        grad.scatter_add_(1, t.unsqueeze(1), -torch.ones_like(z_t))
        return loss, grad / count

    def bound(self, out: Field, target: torch.Tensor, loss: float, ctx) -> tuple[Parts, GradField]:
        z = out.value.double()
        u, k, count = ctx.u, z.shape[1], self.positions(z)
        m, e, s, lse, z_t = self._parts(z, target)
        p = e / s
        error = (out.error.double() if out.error is not None else torch.zeros_like(z))
        shift = (p * (z - m).abs()).sum(dim=1, keepdim=True)
        evaluation = (k + 8) * u + 2 * u * (lse.abs() + z_t.abs() + shift)
        weighted = (p * error).sum(dim=1, keepdim=True)
        error_t = error.gather(1, target.unsqueeze(1))
        propagated_each = weighted + error_t + 0.5 * error.amax(dim=1, keepdim=True) ** 2
        chi = roundoff.dependency_count(out.radius, _pixels(z), coupled_terms(z.shape[0] * _pixels(z), out))
        propagated = ctx.sum_of_errors(propagated_each.sum(), (propagated_each ** 2).sum(), chi) / count
        loss_sum = torch.tensor([float(loss)], dtype=torch.float64, device=z.device)
        # the positions' terms lᵢ ≥ 0 (their evaluation is `evaluation`, below)
        own, drifted = _own_part(_mean_own((lse - z_t).reshape(-1, 1), count, count, loss_sum, ctx), lse - z_t,
                                 count, ctx)
        parts = Parts(count, loss_sum, own, (evaluation.sum() / count).reshape(1),
                      propagated.reshape(1), out.flips, drifted)
        onehot = torch.zeros_like(p).scatter_(1, target.unsqueeze(1), 1.0)
        relative = (k + 8 + z.abs() + lse.abs() + (z - m).abs()) * u + torch.expm1(error + weighted)
        # a probability is off by at most 1 whatever the logits' errors (an overflowing expm1 would give inf·0)
        p_error = torch.minimum(p * relative.clamp(max=1e300), torch.ones_like(p))
        grad_error = (p_error + 2 * u * (p - onehot).abs()) / count
        return parts, GradField(grad_error.to(torch.float32), None, out.radius, 0, coupled=out.coupled)


register_loss(MSE())
register_loss(CrossEntropy())
