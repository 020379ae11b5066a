"""A sum's own rounding from what its partial sums can be: zero terms add no rounding, balanced signs cap every
partial sum at max(S₊, S₋) (roundoff.partial_sum_bound), and only where no transformed algorithm is legitimate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_lab import errmodel, roundoff
from precision_lab.candidates import registry
from precision_lab.compute import forward_backward
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

U = 2.0 ** -24
LAM = roundoff.LAMBDA


def _float32_sequential(columns: np.ndarray) -> np.ndarray:
    """Each column added top to bottom in float32 (numpy reduces axis 0 one row at a time)."""
    return np.add.reduce(columns.astype(np.float32), axis=0, dtype=np.float32).astype(np.float64)


def _signs_apart(columns: np.ndarray) -> np.ndarray:
    """The order whose partial sums climb highest: positives largest first, then negatives smallest first."""
    kind = np.where(columns > 0, 0, np.where(columns < 0, 1, 2))
    within = np.where(columns > 0, -columns, np.abs(columns))
    return np.take_along_axis(columns, np.lexsort((within, kind), axis=0), axis=0)


def _terms(seed: int, n: int, columns: int, zero_fraction: float, mean: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # float32 operands' products, exact in float64: a masked (ReLU, max-pool) gradient times an activation
    values = rng.normal(mean, 1.0, (n, columns)).astype(np.float32).astype(np.float64)
    values *= rng.uniform(0.0, 2.0, (n, columns)).astype(np.float32)
    values[rng.random((n, columns)) < zero_fraction] = 0.0
    return values


def _bound(columns: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(columns)
    return roundoff.partial_sum_bound(t.abs().sum(0), t.sum(0), (t != 0).sum(0).double(), t.shape[0], U, LAM).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("zero_fraction,mean", [(0.0, 0.0), (0.75, 0.05), (15 / 16, 0.0), (0.5, 1.0)])
def test_no_order_leaves_the_partial_sum_bound(seed, zero_fraction, mean):
    columns = _terms(seed, 2 ** 14, 48, zero_fraction, mean)
    exact = columns.sum(axis=0)
    bound = _bound(columns)
    for ordered in (columns, columns[::-1], _signs_apart(columns)):
        assert np.all(np.abs(_float32_sequential(ordered) - exact) <= bound)


def test_where_nothing_cancels_and_nothing_is_zero_only_the_union_over_terms_is_saved():
    columns = np.abs(_terms(5, 2 ** 12, 16, 0.0, 0.0))
    n = columns.shape[0]
    old = roundoff.probabilistic_gamma(n, U) * columns.sum(axis=0)
    # the same failure probability as γ̃ₙ(λ)·S's 2n·exp(−λ²/2) without its union over the n terms: λₙ = 5.6 for λ = 7
    lam_n = roundoff.same_risk_lambda(n, LAM)
    assert abs(lam_n - np.sqrt(49 - 2 * np.log(n))) < 1e-12 and 5.5 < lam_n < 5.7
    assert np.allclose(_bound(columns), old * lam_n / LAM, rtol=0.01)


def test_zeros_and_balanced_signs_tighten_it_and_the_worst_order_comes_close():
    columns = _terms(7, 2 ** 14, 48, 15 / 16, 0.0)
    n, exact = columns.shape[0], columns.sum(axis=0)
    old = roundoff.probabilistic_gamma(n, U) * np.abs(columns).sum(axis=0)
    bound = _bound(columns)
    # √(n/k) = 4 from the zeros, S ÷ max(S₊, S₋) ≈ 2 from the signs
    assert np.all(bound < old / 6)
    worst = np.abs(_float32_sequential(_signs_apart(columns)) - exact)
    assert np.max(worst / bound) > 0.05  # a bound within 20× of the order it must cover


#: a classifier of 5×5 convolutions (no transformed algorithm of the lab applies) and a 3×3 one (Winograd, FFT do)
MIXED = {"name": "mixed", "input_channels": 1, "loss": "cross_entropy", "layers": [
    {"name": "conv5", "op": "conv2d", "in": 1, "out": 4, "kernel": 5, "padding": 2},
    {"name": "relu1", "op": "relu"},
    {"name": "pool1", "op": "max_pool2d", "kernel": 4},
    {"name": "conv3", "op": "conv2d", "in": 4, "out": 8, "kernel": 3, "padding": 1},
    {"name": "relu2", "op": "relu"},
    {"name": "pool2", "op": "max_pool2d", "kernel": 4},
    {"name": "flat", "op": "flatten"},
    {"name": "fc", "op": "linear", "in": 128, "out": 10}]}


@pytest.fixture(scope="module")
def mixed():
    network = load_model(MIXED)
    problem = make_problem(64, 2, 3, network=network)
    return network, problem, reference(problem)


def test_a_layer_that_may_be_transformed_keeps_the_transforms_scale(mixed, monkeypatch):
    from precision_lab.conv.winograd_bound import winograd_weight_grad_scale
    from precision_lab.ops import layers

    _, _, trace = mixed
    bounds = errmodel.error_bounds(trace, "float32")
    five, three = bounds["conv5.weight"], bounds["conv3.weight"]
    gamma = roundoff.probabilistic_gamma(five.n, U)
    assert np.all(five.accumulation <= gamma * five.abs_sum * (1 + 1e-6))
    # max-pool 4 leaves one gradient in 16 (ReLU: fewer): the 5×5 layer's own part is ≥ 4× below γ̃ₙ·S
    assert np.max(five.accumulation / (gamma * five.abs_sum)) < 0.25
    # a 3×3 stride-1 layer may be computed by Winograd or FFT: its own part is at least λ·Winograd's scale
    index = trace.network.index_of("conv3")
    x, g = trace.value(trace.network.layers[index].inputs[0]), trace.grad_at(index)
    winograd = LAM * winograd_weight_grad_scale(x.double(), g.double(), U).numpy().reshape(three.accumulation.shape)
    assert np.all(three.accumulation >= winograd * (1 - 1e-5)) and np.any(winograd > 0)
    # above the size where that scale is computed, γ̃ₙ(λ)·S stands for every algorithm
    monkeypatch.setattr(layers, "WINOGRAD_SCALE_LIMIT", 0)
    large = errmodel.error_bounds(reference(trace.problem), "float32")["conv3.weight"]
    assert np.allclose(large.accumulation, roundoff.probabilistic_gamma(large.n, U) * large.abs_sum, rtol=1e-5)


def test_a_bias_gradient_is_bounded_as_any_order_of_its_sum(mixed):
    """Σ of the output gradient: only summation orders compute it, so its zeros and balanced signs tighten its own
    part, and the order whose partial sums climb highest stays inside it."""
    network, _, trace = mixed
    bias = errmodel.error_bounds(trace, "float32")["conv5.bias"]
    gamma = roundoff.probabilistic_gamma(bias.n, U)
    # max-pool 4 passes one gradient in 16 (ReLU: fewer): ≥ 4× below γ̃ₙ·S
    assert np.max(bias.accumulation / (gamma * bias.abs_sum)) < 0.25
    g = trace.grad_at(network.index_of("conv5")).double()
    columns = g.movedim(1, -1).reshape(-1, g.shape[1]).numpy()  # one column per channel
    worst = np.abs(_float32_sequential(_signs_apart(columns)) - columns.sum(axis=0))
    assert np.all(worst <= np.asarray(bias.accumulation).reshape(-1))


def test_above_its_size_a_bias_gradient_keeps_the_union_bound(mixed, monkeypatch):
    from precision_lab.ops import layers

    _, problem, _ = mixed
    monkeypatch.setattr(layers, "BIAS_ORDER_FREE_LIMIT", 0)
    bias = errmodel.error_bounds(reference(problem), "float32")["conv5.bias"]
    assert np.allclose(bias.accumulation, roundoff.probabilistic_gamma(bias.n, U) * bias.abs_sum, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_legitimate_orders_stay_rounding_and_a_short_first_layer_does_not(seed):
    network = load_model(MIXED)
    problem = make_problem(64, 2, seed, network=network)
    trace = reference(problem)
    orders = [registry()[name] for name in ("sum-sequential", "sum-pairwise", "bias-sequential")]
    for candidate in [None] + orders:
        result = forward_backward(problem, "float32") if candidate is None else \
            candidate.run(problem, "float32", torch.device("cpu"))
        judgement = judge(result, trace, hypotheses=False)
        assert judgement.verdict == "roundoff", (candidate and candidate.name, judgement.to_text())
    native = forward_backward(problem, "float32")
    short = native.grads["conv5.weight"] * 0.9
    from precision_lab.compute import Result
    slipped = Result(native.loss, {**native.grads, "conv5.weight": short}, native.output, native.dtype,
                     dict(native.meta))
    assert judge(slipped, trace, hypotheses=False).quantities["conv5.weight"].verdict == "defect"


def _absorbed_by_hand(x, g, attrs, weight_shape, threshold):
    """Σ|a·g| below the threshold, one term at a time (padding 1 as in the cases below)."""
    c_out, per_group, k, _ = weight_shape
    stride, dilation, groups = attrs["stride"][0], attrs["dilation"][0], attrs["groups"]
    padded = torch.nn.functional.pad(x.double(), (1, 1, 1, 1))
    out = torch.zeros(weight_shape, dtype=torch.float64)
    for o in range(c_out):
        group = o // (c_out // groups)
        for c in range(per_group):
            for i in range(k):
                for j in range(k):
                    window = padded[:, group * per_group + c, i * dilation::stride, j * dilation::stride]
                    terms = (g[:, o].double() * window[:, :g.shape[2], :g.shape[3]]).abs()
                    out[o, c, i, j] = terms[terms < threshold[o, c, i, j]].sum()
    return out


@pytest.mark.parametrize("groups,kernel,stride,dilation,block", [(1, 3, 1, 1, 2 ** 25), (2, 5, 2, 1, 1), (2, 3, 1, 2, 7)])
def test_absorbed_terms_are_found_in_every_convolution_shape(groups, kernel, stride, dilation, block, monkeypatch):
    from precision_lab.ops import layers

    monkeypatch.setattr(layers, "ABSORPTION_BLOCK", block)  # 1: an output channel at a time, 7: blocks across groups
    gen = torch.Generator().manual_seed(groups + kernel)
    x = torch.randn(2, 8, 13, 11, generator=gen)
    attrs = {"kernel": (kernel, kernel), "stride": (stride, stride), "padding": (1, 1), "dilation": (dilation, dilation),
             "groups": groups}
    weight_shape = (6, 8 // groups, kernel, kernel)
    out = torch.nn.functional.conv2d(x, torch.zeros(weight_shape), stride=stride, padding=1, dilation=dilation,
                                     groups=groups)
    g = torch.randn(out.shape, generator=gen)
    threshold = 0.05 + torch.rand(weight_shape, generator=gen, dtype=torch.float64) * 0.5
    found = layers._absorbed_mass(x, g, attrs, weight_shape, threshold)
    assert torch.allclose(found, _absorbed_by_hand(x, g, attrs, weight_shape, threshold), rtol=1e-12, atol=1e-12)
    assert float(found.min()) > 0  # every element has terms below its threshold: a test that could fail


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_few_large_terms_and_many_absorbed_ones_stay_inside(seed):
    """A confident classifier's gradient: a few O(1) terms early, then 32,768 tiny ones of one sign that a raster
    sum rounds away one by one, always the same way (Higham & Mary's mean-zero premise fails)."""
    rng = np.random.default_rng(seed)
    n, columns = 2 ** 15, 32
    activations = np.abs(rng.standard_normal((n, columns))).astype(np.float32)
    gradient = (10.0 ** rng.uniform(-8, -7.3, (n, columns))).astype(np.float32)
    np.put_along_axis(gradient, rng.integers(0, n // 8, (4, columns)), np.float32(1.0), axis=0)
    terms = activations.astype(np.float64) * gradient.astype(np.float64)
    exact = terms.sum(axis=0)
    error = np.abs(_float32_sequential(activations * gradient) - exact)
    t = torch.from_numpy(terms)
    partial = roundoff.partial_sum_bound(t.abs().sum(0), t.sum(0), (t != 0).sum(0).double(), n, U, LAM)
    own = roundoff.order_free_bound(t, (t != 0).sum(0), U, LAM).numpy()
    assert np.max(error / partial.numpy()) > 1  # the mean-zero bound alone is exceeded
    assert np.max(error / own) < 1


def test_a_term_counts_where_the_candidate_may_hold_it_nonzero():
    from precision_lab.ops.layers import _may_be_nonzero

    value = torch.tensor([0.0, 1.5, 0.0, 0.0, -2.0])
    error = torch.tensor([0.0, 1e-7, 3e-8, 0.0, 0.0])  # a zero within its error bound of a ReLU edge
    flips = torch.tensor([0.0, 0.0, 0.0, 0.4, 0.0])  # a ReLU that may flip and pass its whole value
    assert _may_be_nonzero(value).tolist() == [0, 1, 0, 0, 1]
    assert _may_be_nonzero(value, error, flips).tolist() == [0, 1, 1, 1, 1]
    assert _may_be_nonzero(value, None, flips).tolist() == [0, 1, 0, 1, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loss_summed_in_a_loop_keeps_the_squares_it_absorbs(seed):
    """A mean squared error over 2¹⁷ positions, most residuals small (a denoiser's): a float32 loop loses every square
    below an ulp of its running sum, all one way, past γ̃ₙ(λ)·S; the loss's own part holds it."""
    from types import SimpleNamespace

    from precision_lab.candidates.zoo import sum_sequential
    from precision_lab.ops.losses import _mean_own

    rng = np.random.default_rng(seed)
    n = 2 ** 17
    residual = rng.standard_normal(n).astype(np.float32)
    residual[rng.random(n) < 0.6] *= np.float32(0.03)
    squares = residual * residual
    exact = squares.astype(np.float64).sum()
    error = abs(float(sum_sequential(squares[None])[0]) - exact)
    ctx = SimpleNamespace(u=U, lam=LAM)
    own = n * float(_mean_own(torch.from_numpy(squares.astype(np.float64)).reshape(-1, 1), n + 16, n,
                              torch.tensor([exact / n]), ctx)[0])
    assert error > roundoff.probabilistic_gamma(n + 2, U) * exact  # the union bound alone is exceeded
    assert error < 0.5 * own


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loss_over_few_ulp_squares_takes_their_bias(seed):
    """8,192 squared residuals like the deep denoiser's at 64² (seed 65): most of a near-constant residual (the output
    flat over the background), 8% large. Once the large ones have set the running sum, the bulk's near-equal squares
    sit a few ulps of it with the same fractional part, rounded the same way again and again: a bias past the
    order-free bound's mean-zero walk, which the outliers hide from `roundoff.repeats`. The loss's own part (its
    simulated loops, LOSS_DRIFT_LIMIT) holds the loop in that order and in a shuffled one."""
    from types import SimpleNamespace

    from precision_lab.candidates.zoo import sum_sequential
    from precision_lab.ops.losses import _mean_own, _own_part

    rng = np.random.default_rng(seed)
    n, large = 8192, 655
    # the bulk's square 7.3 ulps of a running sum in [4096, 8192): most of its additions round down, by 0.3 ulp
    residual = np.concatenate([3.0 * rng.standard_normal(large), np.sqrt(7.3 * 2.0 ** -11) + 6e-4 * rng.standard_normal(n - large)])
    squares = (residual * residual).astype(np.float32)
    exact = squares.astype(np.float64).sum()
    loops = [abs(float(sum_sequential(order[None])[0]) - exact) for order in (squares, rng.permutation(squares))]
    ctx = SimpleNamespace(u=U, lam=LAM, precision="float32")
    order_free = _mean_own(torch.from_numpy(squares.astype(np.float64)).reshape(-1, 1), n + 16, n,
                           torch.tensor([exact / n]), ctx)
    own, _ = _own_part(order_free, torch.from_numpy(squares), n, ctx)
    assert not roundoff.repeats(torch.from_numpy(squares), n)
    assert loops[0] > n * float(order_free[0])  # the large squares first: the bias exceeds the order-free bound
    assert max(loops) <= 0.5 * n * float(own[0]) * (1 + 1e-9)
