"""Error-accumulation model (PROVISIONAL: issue 3 replaces this with the full model).

Per gradient element: n accumulated terms and S = Σ|terms| (the same convolution applied to
absolute values), and the probabilistic bound λ·√n·u·S of Higham & Mary (2019, Thm 3.1).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import formats
from .problem import KERNEL_SIZE, LAYERS, NativeConv, Trace

#: λ of Higham & Mary (2019): the bound fails with probability ≤ 2·exp(-λ²(1-u)²/2) per sum
LAMBDA = 6.0


def abs_term_sums(trace: Trace) -> dict[str, np.ndarray]:
    """S for each gradient and for the output: the sums recomputed on |operands|."""
    conv = NativeConv()
    sums = {}
    for k, layer in enumerate(LAYERS):
        a, g = trace.activations[k].abs(), trace.output_grads[k].abs()
        sums[f"{layer}.weight"] = conv.weight_grad(a, g).cpu().numpy()
        sums[f"{layer}.bias"] = g.sum(dim=(0, 2, 3)).cpu().numpy()
    return sums


def n_terms(trace: Trace) -> int:
    """Terms in each weight/bias gradient sum: batch·H·W."""
    x = trace.activations[0]
    return int(x.shape[0] * x.shape[2] * x.shape[3])


def probabilistic_bound(n: int, u: float, lam: float = LAMBDA) -> float:
    """γ̃ₙ(λ) = exp(λ√n·u + n·u²/(1-u)) - 1 (Higham & Mary 2019, Theorem 3.1)."""
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def gradient_bounds(trace: Trace, precision: str = "float32") -> dict[str, np.ndarray]:
    """Per-element bound on |ĝ - g| for every parameter gradient at `precision`."""
    u = formats.unit_roundoff(precision)
    factor = probabilistic_bound(n_terms(trace), u)
    return {name: factor * s for name, s in abs_term_sums(trace).items()}
