"""Winograd's rounding scale (precision_lab.conv.winograd_bound) against the lab's own Winograd algorithms, and the
false alarm it removes from the sampled bound."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precision_lab.conv.algorithms import WinogradConv
from precision_lab.conv.winograd_bound import winograd_scale, winograd_tiles
from precision_lab.roundoff import LAMBDA, probabilistic_gamma

U32 = 2.0 ** -24


@pytest.mark.parametrize("channels, relu_input", [(1, False), (16, True)])
def test_winograd_errors_stay_within_lambda_times_their_scale(channels, relu_input):
    g = torch.Generator().manual_seed(channels)
    x = torch.randn(2, channels, 29, 34, generator=g)
    x = x.relu() if relu_input else x
    w = torch.randn(8, channels, 3, 3, generator=g) / 3
    exact = F.conv2d(x.double(), w.double(), padding=1)
    scale = winograd_scale(x.double(), w.double(), U32)
    worst = max(float(((WinogradConv(m).forward(x, w).double() - exact).abs() / (LAMBDA * scale)).max())
                for m in winograd_tiles())
    assert worst < 0.5 and winograd_tiles() == (2, 4)
    # the reason it exists: at one input channel F(4,3) leaves the direct sum's bound, and its scale says so
    if channels == 1:
        direct = probabilistic_gamma(9, U32, LAMBDA) * F.conv2d(x.abs().double(), w.abs().double(), padding=1)
        assert float(((WinogradConv(4).forward(x, w).double() - exact).abs() / direct).max()) > 1.0
        assert float((LAMBDA * scale / direct).median()) > 1.0


def test_winograd_f4x3_on_the_deep_denoisers_first_layer_is_roundoff():
    """deep denoiser, probe odd-33x47-batch3 of seed 57 (64²): F(4,3) flips a ReLU after conv1 (one input channel)
    that draws of the direct sum's scale never flip; conv1.weight was at 2.14× its sampled bound (a false defect)."""
    from precision_lab import probes
    from precision_lab.candidates import registry
    from precision_lab.model import load_model
    from precision_lab.problem import make_problem
    from precision_lab.reference import reference
    from precision_lab.verdict import judge
    from pathlib import Path

    network = load_model(Path(__file__).resolve().parents[1] / "examples" / "models" / "deep-denoiser.json")
    probe = next(p for p in probes.DEFAULT_PROBES if p.name == "odd-33x47-batch3")
    problem = probes.probe_problem(probe, make_problem(64, 2, 57, network=network))
    trace = reference(problem)
    result = registry()["conv-winograd-f4x3"].run(problem, "float32", torch.device("cpu"))
    judgement = judge(result, trace, "float32", "conv-winograd-f4x3", hypotheses=False, fingerprint=False)
    assert judgement.verdict == "roundoff", judgement.headline()
    assert np.isfinite(judgement.quantities["conv1.weight"].bound_ratio)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_winograd_weight_gradients_stay_within_lambda_times_their_scale_even_where_a_lag_has_no_terms(seed):
    from precision_lab.conv.winograd_bound import winograd_weight_grad_scale

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 16, 16, generator=g).relu()
    grad = torch.randn(2, 5, 16, 16, generator=g)
    grad[:, :2, 1:, :] = 0.0  # channels whose gradient lives on the top row only: their lower taps see only padding
    exact = torch.nn.grad.conv2d_weight(x.double(), (5, 6, 3, 3), grad.double(), padding=1)
    scale = winograd_weight_grad_scale(x.double(), grad.double(), U32)
    worst = max(float(((WinogradConv(m).weight_grad(x, grad).double() - exact).abs() / (LAMBDA * scale)).max())
                for m in winograd_tiles())
    assert worst < 0.5
    # the reason it exists: the top-row taps (no terms there: S = 0) still carry F(4,3)'s roundings
    direct = probabilistic_gamma(2 * 16 * 16, U32, LAMBDA) * torch.nn.grad.conv2d_weight(
        x.abs().double(), (5, 6, 3, 3), grad.abs().double(), padding=1)
    leak = (WinogradConv(4).weight_grad(x, grad).double() - exact).abs()[:, :, 0, :]
    assert torch.all(direct[:2, :, 0, :] == 0) and float(leak[:2].max()) > 0
