"""The error model's bounds hold against exact references, and how tight they are (observed ÷ bound)."""
import math

import mpmath
import numpy as np
import pytest
import torch

from precision_lab import errmodel, formats
from precision_lab.candidates.zoo import sum_blocked, sum_kahan, sum_pairwise, sum_sequential
from precision_lab.problem import Problem, make_problem
from precision_lab.compute import forward_backward
from precision_lab.ops import Kernels
from precision_lab.reference import reference
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names

U32 = formats.UNIT_ROUNDOFF["float32"]


def exact_dot(x: np.ndarray, y: np.ndarray) -> float:
    """Σ xᵢyᵢ exactly rounded: float32 products are exact in float64 (48 ≤ 53 bits), math.fsum is exact."""
    return math.fsum((x.astype(np.float64) * y.astype(np.float64)).tolist())


def test_fsum_reference_agrees_with_mpmath():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(2000).astype(np.float32), rng.standard_normal(2000).astype(np.float32)
    with mpmath.workprec(300):
        exact = mpmath.fsum(mpmath.mpf(float(a)) * mpmath.mpf(float(b)) for a, b in zip(x, y))
    assert exact_dot(x, y) == float(exact)


def test_factors_match_their_formulas():
    n = 2 ** 21
    assert errmodel.gamma(n, U32) == pytest.approx(n * U32 / (1 - n * U32))
    assert errmodel.gamma(2 ** 25, U32) == math.inf  # nu ≥ 1: no deterministic bound
    assert errmodel.probabilistic_gamma(n, U32, 7.0) == pytest.approx(7.0 * math.sqrt(n) * U32, rel=1e-3)
    # λ = 7 makes the per-sum failure probability of Thm 3.1 below 1e-4 at the seed's n = 2·1024²
    assert errmodel.failure_probability(n, 7.0) < 1e-4 < errmodel.failure_probability(n, 6.0)
    assert errmodel.pairwise_gamma(n, U32) == pytest.approx(errmodel.gamma(21, U32))
    assert errmodel.blocked_gamma(n, U32, 256) == pytest.approx(errmodel.gamma(256 + 8192 - 2, U32))
    assert errmodel.dependency_count(0, 10 ** 6) == 1 and errmodel.dependency_count(2, 10 ** 6) == 81
    # never more than the terms that can depend on each other (one image), and all of them after a flatten
    assert errmodel.dependency_count(5, 30) == 30 and errmodel.dependency_count(None, 64) == 64


@pytest.mark.parametrize("data", ["cancelling", "positive"])
def test_summation_bounds_hold_against_exact_sums(data):
    rng = np.random.default_rng(7)
    n, rows = 1 << 15, 16
    x = rng.standard_normal((rows, n)).astype(np.float32)
    y = rng.standard_normal((rows, n)).astype(np.float32)
    if data == "positive":  # no cancellation: the case where rounding errors pile up
        x, y = np.abs(x) + 1, np.abs(y) + 1
    terms = (x * y).astype(np.float32)
    exact = np.array([exact_dot(x[r], y[r]) for r in range(rows)])
    # the products are rounded to float32 too: S bounds them as part of the n-term inner product
    abs_sum = np.array([math.fsum(np.abs(x[r].astype(np.float64) * y[r]).tolist()) for r in range(rows)])
    orders = {"sequential": (sum_sequential, errmodel.probabilistic_gamma(n, U32)),
              "pairwise": (sum_pairwise, errmodel.pairwise_gamma(n, U32) + U32),
              "blocked": (sum_blocked, errmodel.blocked_gamma(n, U32, 256) + U32),
              "kahan": (sum_kahan, errmodel.probabilistic_gamma(n, U32))}
    tightness = {}
    for name, (reduce, factor) in orders.items():
        error = np.abs(reduce(terms).astype(np.float64) - exact)
        assert np.all(error <= errmodel.gamma(n, U32) * abs_sum), name  # deterministic, any order
        assert np.all(error <= factor * abs_sum), name
        tightness[name] = float(np.max(error / (factor * abs_sum)))
    print(f"\n{data}: observed ÷ bound", {k: f"{v:.2e}" for k, v in tightness.items()})
    if data == "positive":
        # without cancellation sequential error grows like √n·u·S/3: the bound is within ~30× of it
        assert tightness["sequential"] > 1 / 60
    # compensated summation is far more accurate than sequential
    assert tightness["kahan"] < tightness["sequential"] / 10


@pytest.fixture(scope="module")
def problem_and_reference():
    problem = make_problem(48, 2, 3)
    return problem, reference(problem)


def _errors(result, trace):
    out = {"loss": abs(result.loss - trace.loss), "output": np.abs(result.output - trace.output)}
    out.update({name: np.abs(result.grads[name] - trace.grads[name]) for name in PARAM_NAMES})
    return out


def test_network_bounds_hold_for_float32_and_report_tightness(problem_and_reference):
    problem, trace = problem_and_reference
    bounds = errmodel.error_bounds(trace, "float32")
    errors = _errors(forward_backward(problem, "float32"), trace)
    ratios = {name: float(np.max(errors[name] / bounds[name].bound)) for name in errors}
    print("\nfloat32 native, observed ÷ bound:", {k: f"{v:.2e}" for k, v in ratios.items()})
    assert max(ratios.values()) <= 1.0
    assert min(ratios.values()) > 1e-7  # a bound a million times too loose would be useless
    assert set(bounds) == set(errmodel.quantities(trace.network))
    assert errmodel.gradient_bounds(trace, "float32").keys() == set(PARAM_NAMES)


@pytest.mark.parametrize("fmt", ["tf32", "bfloat16", "float16"])
def test_reduced_format_bounds_hold_for_emulated_formats(problem_and_reference, fmt):
    problem, trace = problem_and_reference
    bounds = errmodel.error_bounds(trace, fmt)
    result = forward_backward(problem, "float32", kernels=Kernels(round_operands=lambda a: formats.round_to(a, fmt)))
    errors = _errors(result, trace)
    ratios = {name: float(np.max(errors[name] / bounds[name].bound)) for name in errors}
    assert max(ratios.values()) <= 1.0, ratios
    # the same errors exceed the float32 bound: the format term is what makes them fit
    f32 = errmodel.error_bounds(trace, "float32")
    assert float(np.max(errors["output"] / f32["output"].bound)) > 1.0


def test_float64_bounds_hold_and_shrink_by_about_u64_over_u32(problem_and_reference):
    problem, trace = problem_and_reference
    b64, b32 = errmodel.error_bounds(trace, "float64"), errmodel.error_bounds(trace, "float32")
    shrink = np.median(b64["conv2.weight"].bound / b32["conv2.weight"].bound)
    assert shrink == pytest.approx(2.0 ** -29, rel=0.1)


def test_relu_flips_counted_when_errors_reach_preactivations(problem_and_reference):
    _, trace = problem_and_reference
    f32, bf16 = errmodel.error_bounds(trace, "float32"), errmodel.error_bounds(trace, "bfloat16")
    assert bf16["conv1.weight"].relu_flips > f32["conv1.weight"].relu_flips
    assert bf16["conv3.bias"].relu_flips == 0  # conv3's bias gradient passes no ReLU, forward or backward
    assert bf16["conv3.weight"].relu_flips > 0  # its weight gradient reads act2, whose errors may flip ReLUs


def test_dead_channel_gets_a_floor_not_a_zero_division():
    problem = make_problem(32, 1, 0)
    params = dict(problem.params)
    weight = params["conv1.weight"].copy()
    weight[0] = 0.0  # channel 0 of conv1: constant pre-activation
    bias = params["conv1.bias"].copy()
    bias[0] = -1.0  # … below zero: the channel is dead, its gradients exactly zero
    params["conv1.weight"], params["conv1.bias"] = weight, bias
    dead = Problem(problem.input, problem.target, params, problem.seed)
    trace = reference(dead)
    bounds = errmodel.error_bounds(trace, "float32")
    s = bounds["conv2.weight"].abs_sum
    assert np.all(s[:, 0] == 0) and np.all(bounds["conv2.weight"].bound[:, 0] > 0)
    assert np.all(np.isfinite(bounds["conv2.weight"].bound))
    # the floor is one unit roundoff of the tensor's largest S (evaluation margin aside), far below the live
    # elements' bounds (a live element may reach it too once the propagation is sampled)
    floor = errmodel.formats.unit_roundoff("float32") * float(np.max(s))
    assert np.max(bounds["conv2.weight"].bound[:, 0]) <= floor * errmodel.EVALUATION_MARGIN
    assert np.max(bounds["conv2.weight"].bound[:, 0]) < np.median(bounds["conv2.weight"].bound[:, 1:]) / 10


def test_bounds_follow_the_trace_device_and_refuse_unknown_precisions(problem_and_reference):
    problem, trace = problem_and_reference
    with pytest.raises(ValueError, match="unknown precision"):
        errmodel.error_bounds(trace, "float8")
    assert trace.device == torch.device("cpu") and trace.params["conv1.weight"].dtype == torch.float32


def test_bounds_leave_the_trace_untouched():
    # the reference keeps float32 intermediates, which the bounds read without copying: no in-place op may reach them
    problem = make_problem(24, 2, 3)
    trace = reference(problem)
    stored = [t for t in trace.values + trace.grads_at + [trace.input] if t is not None]
    before = [t.clone() for t in stored]
    assert len(stored) >= 5  # conv outputs, ReLU-output gradients, the output, its gradient, the input
    for precision in ("float32", "bfloat16", "float64"):
        errmodel.error_bounds(trace, precision)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(before, stored))


def test_float32_stored_intermediates_give_the_bounds_of_a_float64_trace():
    # same model from a trace that holds every intermediate in float64: equal to a few float32 ulps, never below
    from precision_lab.conv import DirectConv

    problem = make_problem(40, 2, 5)
    stored32 = errmodel.error_bounds(reference(problem), "float32")
    plain = forward_backward(problem, "float64", kernels=Kernels(conv=DirectConv()), keep_trace=True)
    full64 = errmodel.error_bounds(plain, "float32")
    for name in errmodel.quantities(problem.network):
        ratio = stored32[name].bound / full64[name].bound
        assert np.all(ratio >= 1 - 2 ** -22) and np.all(ratio <= 1 + 2 ** -20), (name, ratio.min(), ratio.max())
        assert stored32[name].relu_flips >= full64[name].relu_flips


@pytest.mark.parametrize("attrs", [
    {"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1},
    {"kernel": (3, 2), "stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2},
], ids=["seed-conv", "strided-dilated-grouped"])
def test_point_by_point_convolutions_match_the_full_ones(attrs):
    from precision_lab.ops.layers import _sparse_input_grad, _sparse_weight_grad

    generator = torch.Generator().manual_seed(7)
    kernels = Kernels()
    w_shape = (6, 4 // attrs["groups"], *attrs["kernel"])
    w = torch.rand(w_shape, generator=generator, dtype=torch.float64)
    a = torch.rand(2, 4, 10, 11, generator=generator, dtype=torch.float64)
    out_shape = kernels.conv_forward(a, w, attrs).shape
    sparse = torch.rand(out_shape, generator=generator, dtype=torch.float64)
    sparse *= torch.rand(sparse.shape, generator=generator, dtype=torch.float64) < 0.1
    sparse[0, 0, 0, 0] = sparse[1, -1, -1, -1] = 1.5  # corners: taps reach outside the image
    points = sparse.nonzero(as_tuple=True)
    full = kernels.conv_weight_grad(a, sparse, attrs, w_shape)
    assert torch.allclose(_sparse_weight_grad(a, sparse, points, attrs, w_shape), full, rtol=1e-12, atol=0)
    full_input = kernels.conv_input_grad(sparse, w, attrs, tuple(a.shape))
    assert torch.allclose(_sparse_input_grad(sparse, points, w, attrs, tuple(a.shape)), full_input, rtol=1e-12,
                          atol=1e-15)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_sparse_flip_path_gives_the_dense_bounds(problem_and_reference, precision, monkeypatch):
    problem, _ = problem_and_reference
    sparse = errmodel.error_bounds(reference(problem), precision)
    assert sparse["conv1.weight"].relu_flips > 0  # the sparse path was taken and had flips to handle
    import precision_lab.ops as ops

    monkeypatch.setattr(ops, "SPARSE_LIMIT", -1)  # every field through the full convolutions
    dense = errmodel.error_bounds(reference(problem), precision)
    for name in errmodel.quantities(problem.network):  # the same sums in another order: float32 evaluation differences only
        np.testing.assert_allclose(sparse[name].bound, dense[name].bound, rtol=2e-6, err_msg=name)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_a_gradient_two_readers_share_is_never_overwritten_by_either(monkeypatch, precision):
    """An add hands the same error tensors to both its inputs. A reader that overwrote them (a weight gradient squaring
    them in place, a ReLU masking them) shrank the other branch's bound: the projection ResNet's conv1.weight bound was
    7.7× too small at 40×36, conv2.bias's 1.2e4× under tf32. The bounds are those of a private copy for each branch."""
    from precision_lab.model import load_model
    from precision_lab.ops import OPS, GradField
    from precision_lab.paths import ROOT

    problem = make_problem((40, 36), 2, 0, network=load_model(ROOT / "examples" / "models" / "resnet-projection.json"))
    shared = errmodel._error_bounds(reference(problem), precision, errmodel.LAMBDA)
    add = type(OPS["add"])
    original = add.backward_error

    def private(self, attrs, g, grad, ins, out, params, ctx, need):
        fields, parts = original(self, attrs, g, grad, ins, out, params, ctx, need)
        return [None if f is None else GradField(f.error.clone(), None if f.flips is None else f.flips.clone(),
                                                 f.radius, f.flip_count, True, f.coupled) for f in fields], parts

    monkeypatch.setattr(add, "backward_error", private)
    copied = errmodel._error_bounds(reference(problem), precision, errmodel.LAMBDA)
    assert shared.keys() == copied.keys()
    for name in shared:  # the copies sit elsewhere in memory, where BLAS may order a sum otherwise: the evaluation margin
        np.testing.assert_allclose(shared[name].bound, copied[name].bound, rtol=errmodel.EVALUATION_MARGIN - 1,
                                   atol=0, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_relu_masking_is_masked_fill_bit_for_bit(dtype):
    from precision_lab.ops.pointwise import masked_by

    generator = torch.Generator().manual_seed(3)
    g = torch.randn(2, 3, 17, 19, generator=generator, dtype=dtype)
    source = torch.randn(2, 3, 17, 19, generator=generator, dtype=dtype)
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal, either sign
    specials = [math.nan, -0.0, 0.0, math.inf, -math.inf, tiny, -tiny]
    source.view(-1)[:len(specials)] = torch.tensor(specials, dtype=dtype)
    g.view(-1)[len(specials):len(specials) + 3] = torch.tensor([math.nan, -math.inf, -0.0], dtype=dtype)
    expected = g.masked_fill(source <= 0, 0.0)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)
    assert torch.equal(masked_by(g, source).view(bits), expected.view(bits))
    in_place = g.clone()
    assert masked_by(in_place, source, out=in_place) is in_place
    assert torch.equal(in_place.view(bits), expected.view(bits))


def test_a_relu_bound_computed_slice_by_slice_is_the_whole_images(problem_and_reference, monkeypatch):
    import precision_lab.ops.pointwise as pointwise

    problem, _ = problem_and_reference
    monkeypatch.setattr(pointwise, "SLICE_ELEMENTS", 1 << 40)  # one slice: the whole image
    whole = errmodel.error_bounds(reference(problem), "float32")
    monkeypatch.setattr(pointwise, "SLICE_ELEMENTS", 1000)  # many slices, the last one short
    sliced = errmodel.error_bounds(reference(problem), "float32")
    assert sliced["conv1.weight"].relu_flips == whole["conv1.weight"].relu_flips > 0
    for name in errmodel.quantities(problem.network):
        assert np.array_equal(sliced[name].bound, whole[name].bound), name


def test_relu_masking_reads_a_wider_source_in_its_own_precision():
    from precision_lab.ops.pointwise import masked_by

    source = torch.tensor([1e-60, -1e-60, 0.0, 2.0], dtype=torch.float64)  # 1e-60 rounds to 0 in float32
    g = torch.ones(4)
    assert masked_by(g, source).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert masked_by(g, source, out=g).tolist() == [1.0, 0.0, 0.0, 1.0] and g.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_a_second_claims_bound_reads_the_weight_sums_the_first_formed():
    # S = Σ|a|·|g| of a weight gradient is the trace's alone: the float64 claim's bound after the float32 one's reads it
    problem = make_problem(size=48, batch=2, seed=6)
    fresh, shared = reference(problem), reference(problem)
    first = errmodel.error_bounds(shared, "float32")
    sums = shared.meta["shared_sums"]
    assert len(sums) >= 2  # the seed network's two 16-channel layers
    alone = errmodel.error_bounds(fresh, "float64")
    after = errmodel.error_bounds(shared, "float64")
    for name in alone:  # the same numbers, bit for bit
        assert np.array_equal(after[name].bound, alone[name].bound), name
        assert np.array_equal(after[name].abs_sum, alone[name].abs_sum), name
    assert np.array_equal(first["conv2.weight"].abs_sum, after["conv2.weight"].abs_sum)
    # read, not formed anew: a kept sum doubled shows in the next claim's S
    for kept in sums.values():
        kept.mul_(2)
    doubled = errmodel.error_bounds(shared, "tf32")
    assert np.array_equal(doubled["conv2.weight"].abs_sum, 2 * alone["conv2.weight"].abs_sum)
