"""How far an FFT convolution's weight gradient may lie from the exact one.

The direct weight-gradient sum of a lag is bounded by γ̃ₙ(λ)·S, S = Σ|a·g| over that lag's own terms. An FFT
algorithm (precision_lab.conv.algorithms.FFTConv.weight_grad; cuDNN's FFT and FFT-tiling algorithms) does not
add those terms: it transforms the whole input and output gradient, multiplies the spectra and transforms
back, so every lag receives roundings of every frequency. Where a lag's own terms are few or zero (an edge tap
the gradient never reaches, a sparse gradient) its error is not a multiple of its S (measured: up to 640× γ̃ₙ·S
on the small U-Net's mid layer, `benchmarks/tightness.py`), but of the norms:

* each 2-D transform (rows, then columns) of length n per axis is a sequence of radix-p stages; the computed
  spectrum satisfies ‖X̂ − X‖₂ ≤ ε·‖X‖₂ with ε = Σ_stages (μ + γ_(p+2)·(√2 + μ)), μ = u the twiddle factors'
  error (Higham 2002, Thm 24.2: log₂n·η, η = μ + γ₄(√2 + μ), for radix 2; a radix-p stage's butterflies are
  p-term sums, γ_(p+2));
* a lag is (1/N)·Σ_f X(f)·conj(G(f))·ω(f) over the N frequencies: by Cauchy–Schwarz and Parseval
  (‖X‖₂ = √N‖x‖₂) the transforms' errors reach it as at most 2ε·‖x‖₂‖g‖₂, the frequency sum's roundings as
  γ̃_N(λ)·‖x‖₂‖g‖₂ (Higham & Mary 2019, every order), and the products, the twiddles of the lag and the scaling
  by 1/N as a few u more;
* the batch adds these per image: Σ_images ‖x‖₂‖g‖₂, with γ̃_B(λ) for its own sum.
"""
from __future__ import annotations

import torch

from .. import roundoff


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def transform_error(length: int, u: float) -> float:
    """ε of one 1-D FFT of `length`: Σ over its radix-p stages of μ + γ_(p+2)·(√2 + μ), μ = u (module docstring)."""
    return sum(u + roundoff.gamma(p + 2, u) * (2 ** 0.5 + u) for p in _prime_factors(max(2, length)))


def fft_weight_grad_bound(inputs: torch.Tensor, grad_out: torch.Tensor, u: float, lam: float) -> torch.Tensor:
    """The bound on an FFT algorithm's own rounding of the weight gradient of a 3×3, stride-1, padding-1
    convolution of `inputs` (B, C, H, W) with output gradient `grad_out` (B, O, H, W): (O, C, 3, 3), the same
    for the nine lags of a channel pair (module docstring)."""
    batch, _, height, width = inputs.shape
    grid = (height + 2, width + 2)  # the padded input: the cyclic correlation must not wrap
    n = grid[0] * grid[1]
    one_transform = (1 + transform_error(grid[0], u)) * (1 + transform_error(grid[1], u)) - 1
    factor = (2 * one_transform + roundoff.probabilistic_gamma(n, u, lam)
              + roundoff.probabilistic_gamma(batch, u, lam) + 4 * u)
    x_norms = inputs.detach().to(torch.float64).flatten(2).norm(dim=2)  # (B, C)
    g_norms = grad_out.detach().to(torch.float64).flatten(2).norm(dim=2)  # (B, O)
    pairs = factor * (g_norms.T @ x_norms)  # (O, C): Σ_images ‖g_o‖₂‖x_c‖₂
    return pairs[:, :, None, None].expand(-1, -1, 3, 3).to(inputs.dtype)
