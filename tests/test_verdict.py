"""Verdicts: thresholds at the bound, the layout doctor, format attribution, evidence, JSON, noise floor."""
import json

import numpy as np
import pytest

from precision_lab import errmodel, verdict
from precision_lab.candidates import registry
from precision_lab.layout import CANONICAL, to_layout
from precision_lab.problem import make_problem
from precision_lab.compute import Result, forward_backward
from precision_lab.reference import reference
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names


@pytest.fixture(scope="module")
def case():
    problem = make_problem(48, 2, 1)
    trace = reference(problem)
    return problem, trace, forward_backward(problem, "float32")


def _copy(result: Result, **grads) -> Result:
    return Result(result.loss, {**result.grads, **grads}, result.output, result.dtype, dict(result.meta))


def test_transforms_cover_every_permutation_and_flip():
    from precision_lab import doctors
    from precision_lab.compute import GradBuffer

    transforms = doctors.transforms(4)
    assert len(transforms) == 24 * 4 and len(doctors.transforms(2)) == 2  # linear weights: OI or IO, no flips
    rng = np.random.default_rng(0)
    true = rng.standard_normal((16, 8, 3, 3))
    for layout, flipped in transforms:
        axes = tuple(CANONICAL.index(a) for a in flipped)
        written = to_layout(np.flip(true, axis=axes) if axes else true, layout)
        for order in ("C", "F"):  # the buffer as a C or a Fortran program wrote it
            held = layout if order == "C" else layout[::-1]
            buffer = GradBuffer(written.ravel(order="C"), "OIHW", order)
            assert np.array_equal(doctors.read_buffer(buffer, true.shape, held, flipped), true), (layout, flipped)
    fits = doctors.layout_fits(GradBuffer(to_layout(true, "IOHW").ravel(), "OIHW", "C"), true,
                               np.full(true.shape, 1e-12))
    assert fits[0] == ("IOHW", ())  # the simplest fitting transform comes first


def test_exact_result_is_roundoff_with_sane_evidence(case):
    _, trace, result = case
    judgement = verdict.judge(result, trace, "float32", "native")
    assert judgement.verdict == "roundoff"
    for q in judgement.quantities.values():
        assert 0 < q.bound_ratio <= 1 and q.cosine > 0.999999 and q.sign_agreement > 0.99
    assert set(judgement.quantities) == {"loss", "output", *PARAM_NAMES}


def test_an_element_just_beyond_its_bound_is_a_single_element_defect(case):
    _, trace, result = case
    bound = errmodel.error_bounds(trace)["conv2.weight"].bound
    grad = np.asarray(trace.grads["conv2.weight"], np.float64).copy()
    inside, outside = grad.copy(), grad.copy()
    inside[1, 2, 0, 0] += 0.9 * bound[1, 2, 0, 0]
    outside[1, 2, 0, 0] += 1.1 * bound[1, 2, 0, 0]
    assert verdict.judge(_copy(result, **{"conv2.weight": inside}), trace).verdict == "roundoff"
    slipped = verdict.judge(_copy(result, **{"conv2.weight": outside}), trace)
    assert slipped.verdict == "defect"
    q = slipped.quantities["conv2.weight"]
    assert q.exceeding == 1 and q.bound_ratio == pytest.approx(1.1, rel=1e-3)
    assert "single element" in q.evidence


def test_layout_doctor_names_the_transform(case):
    _, trace, result = case
    grads = {name: to_layout(np.flip(result.grads[name], axis=(2, 3)).copy(), "IOHW").reshape(result.grads[name].shape)
             for name in ("conv2.weight",)}
    judgement = verdict.judge(_copy(result, **grads), trace)
    assert judgement.verdict == "layout" and judgement.layout_fix == "layout IOHW + flip HW"
    assert judgement.quantities["conv2.weight"].cosine < 0.99


def test_layout_slip_plus_bug_is_not_excused(case):
    _, trace, result = case
    grad = np.flip(result.grads["conv2.weight"], axis=(2, 3)).copy()
    grad[0, 0, 0, 0] *= 1.5  # the flip fixes all but this element
    judgement = verdict.judge(_copy(result, **{"conv2.weight": grad}), trace)
    assert judgement.verdict == "defect" and judgement.layout_fix is None


def test_reduced_precision_needs_the_forward_output_to_show_it(case):
    problem, trace, result = case
    tf32 = registry()["tf32-emulated"].compute(problem)
    judged = verdict.judge(tf32, trace, "float32")
    assert judged.verdict == "reduced-precision" and judged.format == "tf32"
    # tf32 gradients behind an exact float32 output: a coarser format would act there too
    mixed = _copy(result, **{name: tf32.grads[name] for name in PARAM_NAMES})
    assert verdict.judge(mixed, trace, "float32").verdict == "defect"
    # claimed as tf32 the sampled tf32 bound certifies it: within the bound, and the bound below half of each quantity
    claimed = verdict.judge(tf32, trace, "tf32")
    assert claimed.verdict == "roundoff"
    assert all(q.bound_ratio <= 1 for q in claimed.quantities.values())


def test_a_reduced_format_claim_never_certifies_a_sign_flipped_gradient(case):
    # every gradient negated (gradient ascent) sits inside a bfloat16 bound several times the gradients themselves:
    # within the bound is not rounding unless the bound is below half the quantity (compare.CERTIFIABLE_FRACTION)
    problem, trace, _ = case
    bf16 = registry()["bf16-emulated"].compute(problem)
    flipped = _copy(bf16, **{name: -bf16.grads[name] for name in PARAM_NAMES})
    judged = verdict.judge(flipped, trace, "bfloat16")
    assert judged.verdict != "roundoff"
    assert all(judged.quantities[name].verdict != "roundoff" for name in PARAM_NAMES)


def test_result_without_output_is_judged_on_gradients(case):
    problem, trace, _ = case
    flipped = registry()["fortran-replay-flip"].compute(problem)
    flipped.output = None
    judgement = verdict.judge(flipped, trace)
    assert judgement.verdict == "layout" and judgement.layout_fix == "flip HW" and "output" not in judgement.quantities


def test_non_finite_values_are_a_defect_and_json_stays_valid(case):
    _, trace, result = case
    grad = result.grads["conv1.bias"].copy()
    grad[3] = np.nan
    judgement = verdict.judge(_copy(result, **{"conv1.bias": grad}), trace, candidate="nan")
    assert judgement.verdict == "defect"
    text = verdict.dumps(judgement)
    parsed = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-JSON token {token}"))
    assert parsed["parameters"]["conv1.bias"]["bound_ratio"] is None
    assert set(parsed) >= {"candidate", "verdict", "claimed_precision", "parameters"}
    assert set(parsed["parameters"]["conv1.weight"]) >= {"verdict", "max_abs_err", "bound_ratio", "layout_fix"}


def test_wrong_size_is_a_clear_error(case):
    _, trace, result = case
    with pytest.raises(ValueError, match="conv1.weight has 10 values"):
        verdict.judge(_copy(result, **{"conv1.weight": np.zeros(10, np.float32)}), trace)


def test_frame_is_tidy(case):
    _, trace, result = case
    frame = verdict.judge(result, trace, candidate="native").to_frame()
    assert len(frame) == 8 and {"quantity", "verdict", "bound_ratio", "ulps", "candidate"} <= set(frame.columns)


def test_noise_floor_ensemble_sits_under_the_bound():
    problem = make_problem(32, 2, 0)
    from precision_lab.calibration import noise_floor

    floor = noise_floor(problem)
    members = set(floor["member"]) - {"ensemble-spread"}
    assert len(members) >= 5
    assert floor["bound_ratio"].max() <= 1.0
    spread = floor[floor.member == "ensemble-spread"].set_index("quantity")
    assert spread.loc["conv2.weight", "max_abs_err"] > 0  # the members really differ



def test_a_noise_floor_member_that_does_not_apply_is_replaced():
    """A training-mode batch norm makes each micro-batch another function: the notebook's default members lose
    micro-batching and another legitimate order takes its place, all under the bound."""
    from precision_lab.calibration import FLOOR_MEMBERS, noise_floor
    from precision_lab.model import load_model

    problem = make_problem(16, 2, 0, network=load_model("examples/models/dncnn-bn.json"))
    requested = ("layered-native", "micro-batched", "conv-direct", "conv-im2col", "conv-winograd-f4x3")
    floor = noise_floor(problem, members=requested)
    members = set(floor["member"]) - {"ensemble-spread"}
    assert len(members) == FLOOR_MEMBERS and "micro-batched" not in members
    assert set(requested) - {"micro-batched"} <= members
    assert floor["bound_ratio"].max() <= 1.0

def test_second_ratio_is_the_second_largest_element_ties_included():
    from precision_lab.compare import measure

    ref = np.ones(6)
    bound = np.full(6, 1e-3)
    got = ref + np.array([0.0, 5e-4, 2e-3, 2e-3, 1e-4, 0.0])
    q = measure("w", got, ref, bound)
    assert q.bound_ratio == pytest.approx(2.0) and q.second_ratio == pytest.approx(2.0) and q.exceeding == 2
    got[3] = 1.0
    assert measure("w", got, ref, bound).second_ratio == pytest.approx(0.5)
