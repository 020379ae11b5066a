"""Winograd/Toom-Cook transform matrices F(m, r), built exactly from interpolation points.

For the correlation y_i = Σ_j d_{i+j} g_j (i < m, j < r) the bilinear algorithm is
y = Aᵀ[(G g) ⊙ (Bᵀ d)] with α = m + r − 1 evaluation points (one of them ∞): G = E_r and
Aᵀ = E_mᵀ evaluate polynomials of degree r−1 and m−1 at the points, Bᵀ = V⁻ᵀ inverts the
α×α evaluation (Vandermonde) matrix — the transpose of Toom-Cook polynomial multiplication
(Lavin & Gray 2016, "Fast algorithms for convolutional neural networks", §4; Barabasz et al.
2020, ACM TOMS 46(4), "Error analysis and improving the accuracy of Winograd convolution for
deep neural networks", §3). The matrices are computed in exact rational arithmetic; only
their final cast to the working dtype rounds.
"""
from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import numpy as np

#: finite interpolation points in the usual order (Lavin & Gray 2016 use 0, ±1, ±2 for F(4,3)); ∞ is added last
POINTS = (Fraction(0), Fraction(1), Fraction(-1), Fraction(2), Fraction(-2), Fraction(1, 2), Fraction(-1, 2))


def _evaluation(points: tuple[Fraction, ...], degree_plus_one: int) -> list[list[Fraction]]:
    """Rows: a polynomial of `degree_plus_one` coefficients evaluated at each point, ∞ last (leading coefficient)."""
    rows = [[p ** j for j in range(degree_plus_one)] for p in points]
    rows.append([Fraction(0)] * (degree_plus_one - 1) + [Fraction(1)])
    return rows


def _inverse(matrix: list[list[Fraction]]) -> list[list[Fraction]]:
    """Exact Gauss-Jordan inverse of a small rational matrix."""
    n = len(matrix)
    aug = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if aug[r][col] != 0)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        scale = aug[col][col]
        aug[col] = [v / scale for v in aug[col]]
        for r in range(n):
            if r != col and aug[r][col] != 0:
                factor = aug[r][col]
                aug[r] = [a - factor * b for a, b in zip(aug[r], aug[col])]
    return [row[n:] for row in aug]


@lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Aᵀ, G, Bᵀ) of F(m, r) as float64 arrays of shapes (m, α), (α, r), (α, α).

    Each entry is a small rational (denominators ≤ 24 for α ≤ 6), so float64 holds it exactly
    or within one rounding; dtype casts happen where they are used.
    """
    alpha = m + r - 1
    if alpha - 1 > len(POINTS):
        raise ValueError(f"F({m},{r}) needs {alpha - 1} finite points; only {len(POINTS)} are defined")
    points = POINTS[:alpha - 1]
    vandermonde = _evaluation(points, alpha)
    a_t = np.array(_evaluation(points, m), dtype=object).T
    g = np.array(_evaluation(points, r), dtype=object)
    b_t = np.array(_inverse(vandermonde), dtype=object).T
    return a_t.astype(np.float64), g.astype(np.float64), b_t.astype(np.float64)
