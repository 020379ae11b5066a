"""The experiments' numbers on small problems: each assertion could fail if the physics were wrong."""
import pytest

from precision_lab.experiments import candidates_for, setup
from precision_lab.experiments import float64_recompilation as recompilation
from precision_lab.experiments import optimizer_step, size_sweep


@pytest.fixture(scope="module")
def cpu_case():
    device, problem = setup("cpu", 64, 2, 0)
    chosen, skipped = candidates_for(["native", "native-tf32", "fortran-replay-flip"], device)
    return device, problem, chosen, skipped


def test_gpu_only_candidates_are_skipped_with_a_reason(cpu_case):
    _, _, chosen, skipped = cpu_case
    assert [c.name for c in chosen] == ["native", "fortran-replay-flip"]
    assert skipped and "native-tf32" in skipped[0] and "cpu" in skipped[0]


def test_weights_after_one_step_hide_the_gradient_error(cpu_case):
    device, problem, chosen, _ = cpu_case
    table, judgements = optimizer_step.single_step(problem, chosen, device, lr=0.01, adam_lr=1e-3)
    masking = optimizer_step.lr_masking_summary(table).set_index("candidate")
    for name in masking.index:
        row = masking.loc[name]
        assert row.weights_hide_by > 10  # lr·|g|/|w| ≪ 1 at lr = 0.01
        # updates keep the gradient's error: float32(lr) and the product lr·g add one rounding each (u = 2^-24)
        assert abs(row.sgd_update_rel_err - row.grad_rel_err) <= 2 * 2.0 ** -24 * 1.01
    # most of native's rounding error is rounded away when the weights are stored
    assert masking.loc["native", "error_visible_in_weights"] < 0.2
    # Adam's first step is sign-only: identical wherever the signs agree, even for a flipped gradient
    flip = masking.loc["fortran-replay-flip"]
    assert flip.grad_rel_err > 0.1
    assert flip.adam_identical_fraction == pytest.approx(flip.sign_agreement, abs=0.02)
    assert table.adam_sign_only_fraction.min() > 0.95  # Adam's first step is lr·sign(g) almost everywhere


def test_trajectories_separate_the_slip_from_the_envelope(cpu_case):
    device, problem, chosen, _ = cpu_case
    traj = optimizer_step.trajectories(problem, chosen, [chosen[0]], device, steps=3, lr=0.01)
    verdicts = optimizer_step.envelope_verdicts(traj).set_index("candidate")
    assert verdicts.loc["native", "inside_envelope"]
    assert not verdicts.loc["fortran-replay-flip", "inside_envelope"]
    assert verdicts.loc["fortran-replay-flip", "max_distance_over_envelope"] > 1e3


def test_a_reduced_claim_is_held_to_the_envelope_of_its_own_format(cpu_case):
    # a right bfloat16 program leaves the float32 envelope as surely as a slip; within bfloat16's it stays, and the
    # same program with a spatially flipped weight gradient leaves that too
    from dataclasses import replace

    import numpy as np

    from precision_lab.candidates import get_builtin

    device, problem, chosen, _ = cpu_case
    right = get_builtin("autocast-bfloat16")

    def flipped(problem, precision, device):
        result = right.run(problem, precision, device)
        return replace(result, grads={**result.grads, "conv2.weight": np.ascontiguousarray(
            result.grads["conv2.weight"][..., ::-1, ::-1])})

    slipped = replace(right, name="autocast-bfloat16-flipped", run=flipped)
    traj = optimizer_step.trajectories(problem, [right, slipped], [chosen[0]], device, steps=3, lr=0.01)
    assert set(traj[traj.envelope == "bfloat16"].member) == {"autocast-bfloat16", "bf16-emulated"}
    verdicts = optimizer_step.envelope_verdicts(traj).set_index("candidate")
    assert (verdicts.envelope == "bfloat16").all()
    assert verdicts.loc["autocast-bfloat16", "inside_envelope"]
    assert not verdicts.loc["autocast-bfloat16-flipped", "inside_envelope"]
    # held to float32's instead, the right program would be outside by more than the margin
    float32 = traj[traj.envelope == "float32"].groupby("step").weight_distance.max()
    own = traj[traj.member == "autocast-bfloat16"].set_index("step").weight_distance
    assert (own[1:] / float32[1:]).max() > optimizer_step.ENVELOPE_MARGIN


def test_trajectory_size_defaults_to_the_problem_size_on_a_gpu_only():
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert optimizer_step.trajectory_size_for(None, 1024, gpu) == 1024
    assert optimizer_step.trajectory_size_for(None, 1024, cpu) == optimizer_step.CPU_TRAJECTORY_SIZE == 256
    assert optimizer_step.trajectory_size_for(None, 64, cpu) == 64
    assert optimizer_step.trajectory_size_for(512, 1024, cpu) == 512  # asked for: honoured anywhere


def test_float64_recompilation_ratio_separates_rounding_from_the_slip(cpu_case):
    device, problem, chosen, _ = cpu_case
    table, decisions, notes = recompilation.recompilation_table(problem, chosen, device)
    params = table[table.quantity != "loss"].set_index(["candidate", "quantity"])
    assert params.loc["native"].ratio.max() <= 1e-6
    flip_weights = params.loc["fortran-replay-flip"].filter(like="weight", axis=0)
    assert (flip_weights.ratio > 0.5).all() and (flip_weights.finding == "persists in float64").all()
    summary = recompilation.summarise(table, decisions).set_index("candidate")
    assert summary.loc["native", "verdict"] == "roundoff"
    assert summary.loc["fortran-replay-flip", "verdict"] != "roundoff"


def test_size_sweep_scaling_signatures(cpu_case):
    device, _, chosen, _ = cpu_case
    table, decisions = size_sweep.sweep([32, 64, 128], chosen, device, batch=2, seed=0)
    raw_fits = size_sweep.signature(size_sweep.fit_exponents(table))
    fits = raw_fits.set_index(["candidate", "parameter"])
    native = fits.loc["native"].filter(like="weight", axis=0)
    assert (native.alpha_vs_S < 1.0).all()  # accumulation grows no faster than the worst case n^1
    assert (native.max_bound_ratio <= 1.0).all()
    flip = fits.loc["fortran-replay-flip"].filter(like="weight", axis=0)
    assert (flip.min_err_over_grad >= size_sweep.DEFECT_REL_TO_GRAD).all()
    summary = size_sweep.summarise(table, raw_fits, decisions).set_index("candidate")
    assert summary.loc["native", "verdict"] == "roundoff" and summary.loc["fortran-replay-flip", "verdict"] != "roundoff"
