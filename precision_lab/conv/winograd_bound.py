"""How far a Winograd convolution's output may lie from the exact one: the scale of its rounding.

The error model's rounding scale for a convolution's output, γ̃ₙ(λ)·S / λ with S = conv(|a|, |W|),
covers every summation order of the direct sum. Winograd F(m×m, 3×3) is not a summation order: its
transforms (Y = Aᵀ[(G W Gᵀ) ⊙ (Bᵀ D B)]A per tile, Lavin & Gray 2016) round intermediate values whose
absolute sums are hundreds of times S (Barabasz et al. 2020, ACM TOMS 46(4), §4: the error grows with
the tile), so where a convolution has few terms its error leaves that scale (F(4,3): 32× at one input
channel, `benchmarks/winograd_forward.py`) and flips ReLUs that draws of the direct scale never flip:
`conv-winograd-f4x3` was a false `defect` that way on the deep denoiser (docs/error-model.md).

This module gives that scale for the tiles the lab's own algorithms use (F(2,3), F(4,3): the zoo's
`conv-winograd-*`), aligned at the output's origin as they and cuDNN tile the output. Every rounding
of the algorithm — each partial sum of the input transform's two passes, of the weight transform's two
passes, each product and partial sum of the channel sum, each partial sum of the output transform's
two passes, and the bias add — is a relative error |δ| ≤ u of a value no larger than the absolute sum
of its terms; the output error is, to first order, Σ_node c_node·δ_node·b_node with the exact
derivative c_node of the output with respect to that node. Independent mean-zero δ (Higham & Mary
2019, SIAM J. Sci. Comput. 41(5), the model behind γ̃ₙ(λ)) make it sub-Gaussian with variance proxy
u²·Σ_node (c·b)² (Hoeffding's lemma): the scale is u·√(Σ_node (c·b)²), the larger of the two tiles.
`precision_lab.sampled` draws a 3×3 convolution's output at the larger of it and the direct scale.

The weight gradient is the same algorithm turned round (F(3×3, m×m): the output-gradient tile is the filter,
the tiles of the batch are the summed channels), and its roundings reach lags whose own terms are few or none
(an edge tap the gradient never reaches): F(4,3)'s error there was 10⁴× the direct sum's γ̃ₙ(λ)·S on the small
U-Net (`benchmarks/transformed_weight_grads.py`). `winograd_weight_grad_scale` gives its scale; the tile sum is
bounded as any summation order's (roundoff.partial_sum_bound), since the tiles are added, not transformed.
"""
from __future__ import annotations

import torch

from .. import roundoff
from .algorithms import KERNEL, WinogradConv
from .winograd_matrices import winograd_matrices


def winograd_tiles() -> tuple[int, ...]:
    """The output tiles m of F(m×m, 3×3) of the lab's legitimate algorithms (precision_lab.conv.ALGORITHMS)."""
    from . import ALGORITHMS
    return tuple(sorted(a.m for a in ALGORITHMS.values() if isinstance(a, WinogradConv)))


def _squares(tiles: torch.Tensor, weight: torch.Tensor, m: int, r: int = KERNEL) -> torch.Tensor:
    """Σ_node count·(c·b)² of every output (i, j) of F(m, r) for input tiles (T, C, α, α) and filters (O, C, r, r):
    (T, O, m, m), the transforms' actual values where the bound may use them (module docstring)."""
    return _summed_squares(*_channel_squares(tiles, weight, m, r), tiles.shape[1], m, r)


def _matrices(m: int, r: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.as_tensor(x, dtype=torch.float64, device=device) for x in winograd_matrices(m, r))


def _channel_squares(tiles: torch.Tensor, weight: torch.Tensor, m: int, r: int, count_nonzero: bool = False):
    """The parts of _squares that add over the channels c (so over blocks of them): the transforms' and the products'
    Σ_node (c·b)², Σ_c |U V|, Σ_c U V and, when asked (the partial-sum form needs it), the count of nonzero
    products U V, each (T, O, ·, ·); else 0."""
    a_t, g, b_t = _matrices(m, r, tiles.device)
    alpha = m + r - 1
    a_abs, g_abs, b_abs = a_t.abs(), g.abs(), b_t.abs()
    aa = torch.einsum("ik,jl->ijkl", a_abs, a_abs)  # |∂y_ij/∂M_kl|
    aa2 = aa * aa
    gw = torch.einsum("kp,ocpq->ockq", g, weight)
    u = torch.einsum("ockq,lq->ockl", gw, g)
    u_abs = u.abs()
    t = torch.einsum("kp,ncpq->nckq", b_t, tiles)
    v = torch.einsum("nckq,lq->nckl", t, b_t)
    v_abs = v.abs()
    # input transform, first pass (α roundings of Σ_p Bᵀ_kp d_pq, each ≤ u·Σ|Bᵀ_kp d_pq|): coefficient Σ_l |B_lq||U_kl|AA
    # (|A_ik| factors out of the coefficient: c = |A_ik|·Σ_l |A_jl||B_lq||U_kl|, so its square is summed over k last)
    b1 = torch.einsum("kp,ncpq->nckq", b_abs, tiles.abs())
    c1 = torch.einsum("ockl,jlq->ocjkq", u_abs, torch.einsum("jl,lq->jlq", a_abs, b_abs))
    total = alpha * torch.einsum("ik,nojk->noij", a_abs * a_abs, torch.einsum("nckq,ocjkq->nojk", b1 * b1, c1 * c1))
    # second pass (α roundings of V_kl, ≤ Σ_q |T_kq B_lq|) and the products U_kl·V_kl (one each): coefficient |U_kl|·AA
    b2 = torch.einsum("nckq,lq->nckl", t.abs(), b_abs)
    total += torch.einsum("nckl,ockl,ijkl->noij", alpha * b2 * b2 + v_abs * v_abs, u_abs * u_abs, aa2)
    # weight transform: (G w)_kq (r roundings, ≤ Σ_p |G_kp w_pq|), coefficient Σ_l |G_lq||V_kl|AA; U_kl (r roundings,
    # ≤ Σ_q |(G w)_kq G_lq|), coefficient |V_kl|·AA
    b3 = torch.einsum("kp,ocpq->ockq", g_abs, weight.abs())
    c3 = torch.einsum("nckl,jlq->ncjkq", v_abs, torch.einsum("jl,lq->jlq", a_abs, g_abs))
    total += r * torch.einsum("ik,nojk->noij", a_abs * a_abs, torch.einsum("ockq,ncjkq->nojk", b3 * b3, c3 * c3))
    b4 = torch.einsum("ockq,lq->ockl", gw.abs(), g_abs)
    total += r * torch.einsum("ockl,nckl,ijkl->noij", b4 * b4, v_abs * v_abs, aa2)
    nonzero = torch.einsum("ockl,nckl->nokl", (u != 0).to(u.dtype), (v != 0).to(v.dtype)) if count_nonzero else 0
    return total, torch.einsum("ockl,nckl->nokl", u_abs, v_abs), torch.einsum("ockl,nckl->nokl", u, v), nonzero


def _summed_squares(total: torch.Tensor, uv: torch.Tensor, mm: torch.Tensor, nonzero: torch.Tensor, channels: int,
                    m: int, r: int, partial_sums_u: float | None = None):
    """_channel_squares' total plus the channel sum's and the output transform's Σ_node (c·b)², from Σ_c |U V| (uv),
    M = Σ_c U V (mm) and the count of nonzero products (nonzero); `partial_sums_u`: bound the channel sum's partial
    sums as a summation order's, at that unit roundoff (else by Σ_c |U V|, as the forward scale does)."""
    a_t, _, _ = _matrices(m, r, total.device)
    alpha, a_abs = m + r - 1, a_t.abs()
    aa2 = torch.einsum("ik,jl->ijkl", a_abs, a_abs) ** 2
    total = total.clone()
    # the channel sum M_kl = Σ_c U V: C − 1 partial sums, each ≤ Σ_c |U V|
    if channels > 1:
        additions = (channels - 1) * uv * uv
        if partial_sums_u is not None:
            # or, as any summation order's (roundoff.partial_sum_bound): a zero product adds exactly, and every partial
            # sum is at most max(S₊, S₋) = (Σ|U V| + |Σ U V|)/2, off by γ_C·Σ|U V| once computed
            larger_sign = (uv + mm.abs()) / 2 + roundoff.gamma(channels, partial_sums_u) * uv
            additions = torch.minimum(additions, (nonzero - 1).clamp(min=0) * larger_sign * larger_sign)
        total += torch.einsum("nokl,ijkl->noij", additions, aa2)
    # output transform: P_il = Σ_k Aᵀ_ik M_kl (α roundings, ≤ Σ_k |A_ik M_kl|), coefficient |A_jl|; y_ij = Σ_l P_il A_jl
    # and the bias add (α + 1 roundings, ≤ Σ_l |P_il A_jl|)
    b6 = torch.einsum("ik,nokl->noil", a_abs, mm.abs())
    total += alpha * torch.einsum("noil,jl->noij", b6 * b6, a_abs * a_abs)
    p_row = torch.einsum("ik,nokl->noil", a_t, mm)
    y_abs = torch.einsum("noil,jl->noij", p_row.abs(), a_abs)
    total += (alpha + 1) * y_abs * y_abs
    return total


def winograd_scale(inputs: torch.Tensor, weight: torch.Tensor, u: float) -> torch.Tensor:
    """u·√(max over winograd_tiles() of Σ_node (c·b)²) at every output of a 3×3, stride-1, padding-1 convolution of
    `inputs` (N, C, H, W) by `weight` (O, C, 3, 3): (N, O, H, W), in the inputs' dtype (module docstring)."""
    batch, channels, height, width = inputs.shape
    w = weight.detach().to(torch.float64)
    out = None
    for m in winograd_tiles():
        alpha = m + KERNEL - 1
        tiles_h, tiles_w = -(-height // m), -(-width // m)
        # padding 1 on top and left, whole tiles (+1) on bottom and right: tiles aligned at the output's origin
        padded = torch.nn.functional.pad(inputs.detach().to(torch.float64),
                                         (1, tiles_w * m - width + 1, 1, tiles_h * m - height + 1))
        tiles = padded.unfold(2, alpha, m).unfold(3, alpha, m)  # (N, C, th, tw, α, α)
        tiles = tiles.permute(0, 2, 3, 1, 4, 5).reshape(-1, channels, alpha, alpha)
        rows = max(1, (1 << 22) // (channels * alpha * alpha * max(1, w.shape[0])))  # tiles per block
        squares = torch.cat([_squares(tiles[s:s + rows], w, m) for s in range(0, len(tiles), rows)])
        squares = squares.view(batch, tiles_h, tiles_w, -1, m, m).permute(0, 3, 1, 4, 2, 5)
        squares = squares.reshape(batch, -1, tiles_h * m, tiles_w * m)[..., :height, :width]
        out = squares if out is None else torch.maximum(out, squares)
    return (out.sqrt() * u).to(inputs.dtype)


def winograd_weight_grad_scale(inputs: torch.Tensor, grad_out: torch.Tensor, u: float) -> torch.Tensor:
    """u·√(max over winograd_tiles() of Σ_node (c·b)²) at every weight-gradient element of a 3×3, stride-1,
    padding-1 convolution of `inputs` (N, C, H, W) with output gradient `grad_out` (N, O, H, W): (O, C, 3, 3).

    The algorithm is F(3×3, m×m) on the forward's tiles (precision_lab.conv.algorithms.WinogradConv.weight_grad):
    for each tile, the m×m output-gradient tile is the filter and the (m + 2)² input tile the data, the products
    are summed over every tile of the batch in the transformed domain and the sum's inverse transform gives the
    3×3 lags. That is _squares with the tiles (batch × tiles) as the summed channels, the input channels as the
    'tiles' and the output channels as the filters. Zeros do not spare it: a lag whose own terms are zero (an
    edge tap the gradient never reaches) still receives the roundings of the other lags' transformed products."""
    batch, channels, height, width = inputs.shape
    x, g = inputs.detach().to(torch.float64), grad_out.detach().to(torch.float64)
    out = None
    for m in winograd_tiles():
        alpha = m + KERNEL - 1
        tiles_h, tiles_w = -(-height // m), -(-width // m)
        padded = torch.nn.functional.pad(x, (1, tiles_w * m - width + 1, 1, tiles_h * m - height + 1))
        data = padded.unfold(2, alpha, m).unfold(3, alpha, m)  # (N, C, th, tw, α, α)
        data = data.permute(1, 0, 2, 3, 4, 5).reshape(channels, -1, alpha, alpha)
        grad = torch.nn.functional.pad(g, (0, tiles_w * m - width, 0, tiles_h * m - height))
        grad = grad.reshape(batch, -1, tiles_h, m, tiles_w, m).permute(1, 0, 2, 4, 3, 5)
        grad = grad.reshape(grad.shape[0], -1, m, m)  # (O, N·th·tw, m, m)
        summed = data.shape[1]
        block = max(1, (1 << 22) // (max(channels, grad.shape[0]) * alpha * alpha * KERNEL * KERNEL))
        parts = None
        for s in range(0, summed, block):
            chunk = _channel_squares(data[:, s:s + block], grad[:, s:s + block], KERNEL, m, count_nonzero=True)
            parts = chunk if parts is None else tuple(a + b for a, b in zip(parts, chunk))
        squares = _summed_squares(*parts, summed, KERNEL, m, partial_sums_u=u).permute(1, 0, 2, 3)
        out = squares if out is None else torch.maximum(out, squares)
    return (out.sqrt() * u).to(inputs.dtype)
