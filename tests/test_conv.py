"""The convolution registry: each algorithm exact in float64, within its own rounding bound in float32,
selection restoring every global flag, kernels recorded."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from precision_lab.conv import (ALGORITHMS, DirectConv, NATIVE_BACKENDS, WinogradConv, get_algorithm,
                                record_kernels, select)
from precision_lab.conv.backends import current_flags, native_flags
from precision_lab.conv.winograd_matrices import winograd_matrices
from precision_lab.conv import NativeConv

U32 = 2.0 ** -24  # float32 unit roundoff
U_BF16 = 2.0 ** -8  # bfloat16 unit roundoff (docs/design.md, "Error-accumulation model")
#: float64 algorithms must agree with PyTorch's float64 convolution to this (the reference's 1e-13 agreement target; u64 ≈ 1.1e-16)
FLOAT64_AGREEMENT = 1e-13
#: (N, C_in, C_out, H, W): odd sizes and few channels (padding and tiling edges), and the seed's 16→16
SHAPES = [(2, 3, 5, 13, 11), (2, 16, 16, 24, 20), (1, 1, 16, 9, 17), (2, 16, 1, 10, 10)]


def _operands(shape, dtype=torch.float64, seed=0):
    n, c_in, c_out, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c_in, h, w, generator=gen, dtype=torch.float64)
    weight = torch.randn(c_out, c_in, 3, 3, generator=gen, dtype=torch.float64) / 3
    grad = torch.randn(n, c_out, h, w, generator=gen, dtype=torch.float64)
    return x.to(dtype), weight.to(dtype), grad.to(dtype)


def _three_ops(conv, x, w, g):
    return conv.forward(x, w), conv.input_grad(g, w), conv.weight_grad(x, g)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", [*ALGORITHMS, "direct-chunked"])
def test_float64_algorithms_agree_with_pytorch(name, shape):
    conv = DirectConv(chunk_columns=37) if name == "direct-chunked" else get_algorithm(name)
    x, w, g = _operands(shape)
    expected = _three_ops(NativeConv(), x, w, g)
    for op, got, want in zip(("forward", "input_grad", "weight_grad"), _three_ops(conv, x, w, g), expected):
        assert got.shape == want.shape and got.dtype == torch.float64, f"{name}.{op}: {got.shape} {got.dtype}"
        assert _rel(got, want) <= FLOAT64_AGREEMENT, f"{name}.{op} differs from float64 by {_rel(got, want):.2e}"


def _gamma(n, u):
    """γ_n = n·u / (1 − n·u) (Higham 2002, Lemma 3.1): any summation order of n terms."""
    return n * u / (1 - n * u)


def _abs_term_sums(x, w, g):
    """S = the same three operations on |operands|: Σ|terms| of every computed element."""
    return _three_ops(NativeConv(), x.abs(), w.abs(), g.abs())


@pytest.mark.parametrize("name", ["direct", "im2col"])
def test_float32_gemm_algorithms_within_componentwise_bound(name):
    # Higham 2002, eq. (3.5): |ŝ − s| ≤ γ_n Σ|x_i y_i| for a dot product of n terms in any order
    shape = (2, 16, 16, 24, 20)
    x, w, g = _operands(shape)
    exact = _three_ops(NativeConv(), x, w, g)
    got = _three_ops(get_algorithm(name), x.float(), w.float(), g.float())
    n_img, c_in, c_out, h, wd = shape
    terms = {"forward": 9 * c_in, "input_grad": 9 * c_out, "weight_grad": n_img * h * wd}
    for (op, n), computed, value, s in zip(terms.items(), got, exact, _abs_term_sums(x, w, g)):
        err = (computed.double() - value).abs()
        # the operands themselves were rounded to float32: that adds 2u per product (γ_{n+2})
        bound = _gamma(n + 2, U32) * s
        assert torch.all(err <= bound), f"{name}.{op}: error/bound {float((err / bound).max()):.3f} > 1"
        assert float(err.max()) > 0, f"{name}.{op} in float32 equals float64 exactly: not computed in float32"


#: FFT error per transform level: η ≈ μ + γ4(√2 + μ) ≈ 6u with accurate twiddles (Higham 2002, Thm 24.2)
FFT_LEVEL_ERROR = 6


def test_float32_fft_within_normwise_bound():
    # Higham 2002 Thm 24.2: one FFT of length n has ‖ŷ−y‖₂ ≤ log2(n)·η‖y‖₂; a convolution takes three
    # transforms plus the C-term channel sum, and ‖x ⋆ w‖₂ ≤ ‖x‖₂·‖w‖₁ (Young) bounds each term
    shape = (2, 16, 16, 24, 20)
    n_img, c_in, c_out, h, wd = shape
    x, w, g = _operands(shape)
    exact = _three_ops(NativeConv(), x, w, g)
    got = _three_ops(get_algorithm("fft"), x.float(), w.float(), g.float())
    levels = math.log2((h + 2) * (wd + 2))
    x_norm, g_norm = x.flatten(2).norm(dim=2), g.flatten(2).norm(dim=2)  # (N, C)
    w_l1 = w.abs().sum(dim=(2, 3))  # (O, I)
    scales = {
        "forward": (x_norm.sum(0) * w_l1).sum(1), "input_grad": (g_norm.sum(0)[:, None] * w_l1).sum(0),
        "weight_grad": (g_norm.T @ x_norm),  # Cauchy–Schwarz: |Σ g·x_shift| ≤ ‖g‖₂‖x‖₂ per (o, c)
    }
    sums = {"forward": c_in, "input_grad": c_out, "weight_grad": n_img}
    for (op, scale), computed, value in zip(scales.items(), got, exact):
        factor = (3 * levels * FFT_LEVEL_ERROR + sums[op] + 2) * U32
        if op == "weight_grad":
            err = (computed.double() - value).abs().amax(dim=(2, 3))
        else:
            err = (computed.double() - value).transpose(0, 1).flatten(1).norm(dim=1)
        assert torch.all(err <= factor * scale), f"fft.{op}: error/bound {float((err / (factor * scale)).max()):.3f}"
        assert float(err.max()) > 0


def _winograd_amplification(m, r):
    """(‖Aᵀ‖∞‖G‖∞‖Bᵀ‖∞)²: how much the 2-D transforms can amplify rounding (Barabasz et al. 2020, §4)."""
    a_t, g, b_t = winograd_matrices(m, r)
    return (np.abs(a_t).sum(1).max() * np.abs(g).sum(1).max() * np.abs(b_t).sum(1).max()) ** 2


@pytest.mark.parametrize("m", [2, 4])
def test_float32_winograd_within_its_bound(m):
    # Barabasz et al. 2020, Thm 2 form: error ≤ (ops)·u·‖Aᵀ‖‖G‖‖Bᵀ‖ products × the operand sizes;
    # ops counts the α-term sums of the three 2-D transforms (2 passes each) plus the channel sum
    shape = (2, 16, 16, 24, 20)
    n_img, c_in, c_out, h, wd = shape
    x, w, g = _operands(shape)
    exact = _three_ops(NativeConv(), x, w, g)
    got = _three_ops(WinogradConv(m), x.float(), w.float(), g.float())
    alpha = m + 2
    tiles = n_img * math.ceil(h / m) * math.ceil(wd / m)
    x_max, g_max = x.abs().amax(dim=(0, 2, 3)), g.abs().amax(dim=(0, 2, 3))  # per channel
    w_max = w.abs().amax(dim=(2, 3))  # (O, I)
    cases = {
        "forward": ((6 * alpha + c_in) * _winograd_amplification(m, 3), (w_max * x_max).sum(1)[None, :, None, None]),
        "input_grad": ((6 * alpha + c_out) * _winograd_amplification(m, 3), (w_max * g_max[:, None]).sum(0)[None, :, None, None]),
        "weight_grad": ((6 * alpha + tiles) * _winograd_amplification(3, m),
                        (tiles * m * m * g_max[:, None] * x_max[None, :])[:, :, None, None]),
    }
    for (op, (ops, scale)), computed, value in zip(cases.items(), got, exact):
        err = (computed.double() - value).abs()
        bound = ops * U32 * scale
        assert torch.all(err <= bound), f"winograd F({m},3).{op}: error/bound {float((err / bound).max()):.3f}"


def test_winograd_error_grows_with_tile_size():
    # Barabasz et al. 2020: F(4,3) loses more accuracy than F(2,3) (larger transform entries)
    x, w, g = _operands((2, 16, 16, 32, 32), seed=3)
    exact = _three_ops(NativeConv(), x, w, g)
    errors = {}
    for m in (2, 4):
        got = _three_ops(WinogradConv(m), x.float(), w.float(), g.float())
        errors[m] = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, exact)]
    direct = [float((a.double() - b).norm() / b.norm())
              for a, b in zip(_three_ops(DirectConv(), x.float(), w.float(), g.float()), exact)]
    assert errors[4][0] > errors[2][0] > 0.5 * direct[0], (errors, direct)
    assert errors[4][1] > errors[2][1], errors


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_bfloat16_runs_in_any_dtype(name):
    shape = (2, 3, 5, 13, 11)
    x, w, g = _operands(shape)
    exact = _three_ops(NativeConv(), x, w, g)
    low = [t.to(torch.bfloat16) for t in (x, w, g)]
    got = _three_ops(get_algorithm(name), *low)
    for op, computed, value, s in zip(("forward", "input_grad", "weight_grad"), got, exact, _abs_term_sums(x, w, g)):
        assert computed.dtype == torch.bfloat16 and computed.shape == value.shape, f"{name}.{op}"
        # γ_n is vacuous at bfloat16 (n·u > 1): Higham & Mary 2019 Thm 3.1, λ√(n+3)·u·S with λ = 6
        # (operands and result rounded: +3 terms), fails with probability ≤ 2n·exp(−λ²/2) ≈ 1e-5
        n = {"forward": 9 * 3, "input_grad": 9 * 5, "weight_grad": 2 * 13 * 11}[op]
        bound = 6 * math.sqrt(n + 3) * U_BF16 * s
        err = (computed.double() - value).abs()
        assert torch.all(err <= bound), f"{name}.{op} in bfloat16: error/bound {float((err / bound).max()):.2f}"


def test_get_algorithm_names_the_choices():
    assert {"direct", "im2col", "fft", "winograd-f2x3", "winograd-f4x3"} <= set(ALGORITHMS)
    assert get_algorithm("native-tf32").flags == {"fp32_precision": "tf32"}
    with pytest.raises(ValueError, match="unknown convolution algorithm 'winograd'.*direct.*native"):
        get_algorithm("winograd")


def _nondefault_flags():
    return dict(fp32_precision="tf32", benchmark=False, deterministic=False, mkldnn=False)


@pytest.mark.parametrize("goal", ["accurate", "fast", "deterministic"])
def test_select_goal_sets_and_restores_every_flag(goal):
    with native_flags(**_nondefault_flags()):
        before = current_flags()
        with select(goal) as conv:
            inside = current_flags()
            assert conv.name in NATIVE_BACKENDS
        assert current_flags() == before
        assert inside != before, f"goal {goal} changed no flag"
        with pytest.raises(RuntimeError, match="boom"):
            with select(goal):
                raise RuntimeError("boom")
        assert current_flags() == before


def test_select_goal_flags_mean_what_they_say():
    with select("deterministic"):
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
    with select("fast"):
        assert torch.backends.cudnn.benchmark
    with select("direct") as conv:
        assert conv is ALGORITHMS["direct"]


def test_native_backend_applies_its_flags_per_call_and_restores_them():
    x, w, _ = _operands((2, 16, 16, 64, 64), dtype=torch.float32)  # large enough for oneDNN
    before = current_flags()
    _, with_onednn = record_kernels(lambda: get_algorithm("native").forward(x, w), device="cpu")
    _, without = record_kernels(lambda: get_algorithm("native-onednn-off").forward(x, w), device="cpu")
    assert current_flags() == before
    assert "aten::mkldnn_convolution" in with_onednn, with_onednn
    assert not any("mkldnn" in name for name in without) and any("slow_conv2d" in n for n in without), without


def test_record_kernels_returns_the_result():
    x, w, _ = _operands((1, 2, 3, 8, 8))
    result, kernels = record_kernels(lambda: NativeConv().forward(x, w), device="cpu")
    assert result.shape == (1, 3, 8, 8) and result.dtype == torch.float64
    # the call's own output, not a stand-in: it agrees with the lab's direct float64 convolution
    assert _rel(result, DirectConv().forward(x, w)) <= FLOAT64_AGREEMENT
    assert kernels and all(isinstance(k, str) for k in kernels)
    assert len(kernels) == len(set(kernels)), kernels  # each name once, in order of first appearance
    assert "aten::conv2d" in kernels and all("conv" in k.lower() for k in kernels), kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithms_on_gpu_match_cpu(name):
    x, w, g = _operands((2, 16, 16, 24, 20))
    cpu = _three_ops(get_algorithm(name), x, w, g)
    gpu = _three_ops(get_algorithm(name), x.cuda(), w.cuda(), g.cuda())
    for a, b in zip(gpu, cpu):
        assert a.device.type == "cuda" and _rel(a.cpu(), b) <= FLOAT64_AGREEMENT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_record_kernels_names_cudnn_kernels_on_gpu():
    x, w, _ = _operands((2, 16, 16, 64, 64), dtype=torch.float32)
    _, kernels = record_kernels(lambda: NativeConv().forward(x.cuda(), w.cuda()), device="cuda")
    assert kernels and not any(k.startswith("aten::") for k in kernels), kernels


def test_algorithms_experiment_judges_every_algorithm_roundoff():
    # the lab must not cry wolf at a legitimate summation order (docs/design.md, "Error-accumulation model")
    from precision_lab.experiments import algorithms as experiment
    from precision_lab.results import SUMMARY_COLUMNS

    table, decisions = experiment.sweep([24], list(experiment.DEFAULT_ALGORITHMS), torch.device("cpu"), batch=1, seed=0)
    summary = experiment.summary(table, decisions)
    assert all(len(d.probes) == 3 for d in decisions.values())  # each algorithm judged on diagnose's probes too
    assert list(summary.columns[:4]) == list(SUMMARY_COLUMNS)
    assert set(summary["candidate"]) == set(experiment.DEFAULT_ALGORITHMS)
    assert (summary["verdict"] == "roundoff").all(), summary
    assert (table["bound_ratio"] > 0).all()  # every algorithm really ran in float32
