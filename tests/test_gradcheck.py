"""The reference-free gradient check (precision_lab.gradcheck) and the opaque command protocol.

Most checks run in-process (FunctionOracle over small numpy/PyTorch networks, float32 and float64
builds of the same code); the protocol tests run tiny Python programs; the end-to-end runs of the
KAN example through `precision-lab diagnose` are marked slow.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from precision_lab import cli
from precision_lab.candidates import CandidateError, resolve
from precision_lab.candidates.command import CommandCandidateError
from precision_lab.candidates.opaque import OpaqueCandidate, read_start_bundle
from precision_lab.errors import LabInputError
from precision_lab.gradcheck import FunctionOracle, GradCheckError, check_gradients
from precision_lab.gradcheck.groups import homogeneous_groups, scaling_step
from precision_lab.gradcheck.localise import Region
from precision_lab.gradcheck.noise import t_critical, t_two_sided_p
from precision_lab.gradcheck.points import on_grid
from precision_lab.gradcheck.program import default_budget
from precision_lab.gradcheck.segments import SEGMENT_MAX, Segment, half_aligned, segment_step

ROOT = Path(__file__).resolve().parents[1]
F = torch.nn.functional


# ---------------------------------------------------------------------------------------------
# small networks: fn(params, dtype) -> (loss, grads), the same code in float32 and float64


def _torch_program(model):
    def program(params, dtype):
        torch_dtype = torch.float64 if np.dtype(dtype) == np.float64 else torch.float32
        tensors = {k: torch.tensor(v, dtype=torch_dtype, requires_grad=True) for k, v in params.items()}
        loss = model(tensors, torch_dtype)
        grads = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)
        return loss.item(), {k: (g if g is not None else torch.zeros_like(tensors[k])).detach().numpy()
                             for k, g in zip(tensors, grads)}
    return program


def relu_max_mlp(seed=0, n=64, d=8, hidden=32):
    """ReLU, an elementwise max and a clamp: kinks everywhere. MSE."""
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((n, d)), rng.standard_normal((n, 1))
    params = {"fc1.weight": rng.standard_normal((hidden, d)) / np.sqrt(d), "fc1.bias": 0.1 * rng.standard_normal(hidden),
              "fc2.weight": rng.standard_normal((hidden, hidden)) / np.sqrt(hidden), "fc2.bias": np.zeros(hidden),
              "fc3.weight": rng.standard_normal((1, hidden)) / np.sqrt(hidden)}

    def model(p, dt):
        h = torch.relu(torch.tensor(x, dtype=dt) @ p["fc1.weight"].T + p["fc1.bias"])
        h = torch.clamp(torch.relu(h @ p["fc2.weight"].T + p["fc2.bias"]), max=2.0)
        h = torch.maximum(h, h.roll(1, dims=1))
        return torch.mean((h @ p["fc3.weight"].T - torch.tensor(t, dtype=dt)) ** 2)
    return {k: v.astype(np.float32) for k, v in params.items()}, _torch_program(model)


def rbf_rational(seed=1, n=96, centers=12):
    """Radial-basis features and a rational activation (the reference-free check's first user), linear read-out."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, 2))
    t = np.sin(3 * x[:, :1]) * np.cos(2 * x[:, 1:2])
    params = {"rbf.centers": rng.uniform(-1, 1, (centers, 2)), "rbf.log_width": np.full(centers, np.log(0.5)),
              "act.p": np.array([0.0, 1.0, 0.2, 0.05]), "act.q": np.array([0.3, 0.1]),
              "head.weight": rng.standard_normal((1, centers)) / 4}

    def model(p, dt):
        diff = torch.tensor(x, dtype=dt)[:, None, :] - p["rbf.centers"][None]
        phi = torch.exp(-(diff ** 2).sum(-1) / torch.exp(2 * p["rbf.log_width"]))
        num = p["act.p"][0] + p["act.p"][1] * phi + p["act.p"][2] * phi ** 2 + p["act.p"][3] * phi ** 3
        act = num / (1 + torch.abs(p["act.q"][0] * phi + p["act.q"][1] * phi ** 2))
        return torch.mean((act @ p["head.weight"].T - torch.tensor(t, dtype=dt)) ** 2)
    return {k: v.astype(np.float32) for k, v in params.items()}, _torch_program(model)


def small_cnn(seed=3, size=12):
    """Conv, ReLU, max-pool, attention-free classifier with cross-entropy."""
    rng = np.random.default_rng(seed)
    x, labels = rng.standard_normal((2, 1, size, size)), torch.tensor(rng.integers(0, 5, 2))
    params = {"conv.weight": rng.standard_normal((6, 1, 3, 3)) / 3, "conv.bias": np.zeros(6),
              "fc.weight": rng.standard_normal((5, 6 * (size // 2) ** 2)) / 16}

    def model(p, dt):
        h = F.max_pool2d(F.relu(F.conv2d(torch.tensor(x, dtype=dt), p["conv.weight"], p["conv.bias"], padding=1)), 2)
        return F.cross_entropy(h.flatten(1) @ p["fc.weight"].T, labels)
    return {k: v.astype(np.float32) for k, v in params.items()}, _torch_program(model)


def attention_block(seed=2, batch=2, length=6, width=8):
    """Softmax attention, a residual, layer norm and GELU."""
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((batch, length, width)), rng.standard_normal((batch, length, width))
    params = {"attn.in_proj": rng.standard_normal((3 * width, width)) / np.sqrt(width),
              "attn.out_proj": rng.standard_normal((width, width)) / np.sqrt(width),
              "norm.weight": np.ones(width), "norm.bias": np.zeros(width)}

    def model(p, dt):
        inputs = torch.tensor(x, dtype=dt)
        q, k, v = (inputs @ p["attn.in_proj"].T).split(width, dim=-1)
        mixed = torch.softmax(q @ k.transpose(1, 2) / width ** 0.5, -1) @ v @ p["attn.out_proj"].T
        y = F.gelu(F.layer_norm(mixed + inputs, (width,), p["norm.weight"], p["norm.bias"]))
        return torch.mean((y - torch.tensor(t, dtype=dt)) ** 2)
    return {k: v.astype(np.float32) for k, v in params.items()}, _torch_program(model)


def tanh_chain(tensors=10, width=6, seed=4):
    """A numpy network of `tensors` parameter tensors (weights and biases of tanh layers), backward by hand."""
    from precision_lab.experiments.gradient_check import _tanh_kind

    return _tanh_kind(seed=seed, width=width, layers=tensors // 2)


def wrong(program, tensor, how, only_float32=False):
    """The program with a planted gradient bug in `tensor` (every build, or the float32 one only)."""
    def buggy(params, dtype):
        loss, grads = program(params, dtype)
        if not only_float32 or np.dtype(dtype) == np.float32:
            g = np.array(grads[tensor], copy=True)
            if how == "element":  # one element off by 1%
                g.flat[3] *= 1.01
            elif how == "half":  # a missing factor 2 in one tensor
                g *= 0.5
            elif how == "factor":
                g *= 1.01
            grads = {**grads, tensor: g}
        return loss, grads
    return buggy


NETWORKS = {"relu-max-mlp": relu_max_mlp, "rbf-rational": rbf_rational, "cnn-maxpool": small_cnn,
            "attention": attention_block, "tanh-chain": tanh_chain}


def float32_budget(params) -> int:
    """A float32-only check's default budget: 13 calls of noise, 9 per tensor, 18 for two scaling segments; ≥ 60."""
    return max(60, 13 + 9 * len(params) + 18)


# ---------------------------------------------------------------------------------------------
# statistics and grids


def test_student_t_tail_matches_mpmath():
    mpmath = pytest.importorskip("mpmath")
    for dof in (3, 5, 6, 12):
        for k in (0.5, 2.0, 9.7, 40.0):
            x = dof / (dof + k * k)
            exact = float(mpmath.betainc(dof / 2, 0.5, 0, x, regularized=True))
            assert t_two_sided_p(k, dof) == pytest.approx(exact, rel=1e-9)
    critical = t_critical(1e-4, 5)
    assert t_two_sided_p(critical, 5) == pytest.approx(1e-4, rel=1e-6)
    assert critical == pytest.approx(11.1777, abs=1e-3)  # qt(1 - 5e-5, df = 5) in R


def test_student_t_quantiles_match_the_tables():
    # two-sided quantiles as printed in t tables: t_{0.975, 10}, t_{0.995, 5}, t_{0.95, 1} = tan(0.45π)
    for alpha, dof, table in ((0.05, 10, 2.228138852), (0.01, 5, 4.032142984), (0.10, 1, 6.313751515)):
        assert t_critical(alpha, dof) == pytest.approx(table, rel=1e-9)
        assert t_two_sided_p(table, dof) == pytest.approx(alpha, rel=1e-8)


def test_stencil_points_are_exact_in_the_build_format():
    rng = np.random.default_rng(0)
    base = np.concatenate([rng.standard_normal(1000), [0.9999999, 1.0, 2.0 - 2 ** -23, 0.0, 1e-30, -3.0]]).astype(np.float32)
    base = base.astype(np.float64)
    step = 1e-4 * rng.standard_normal(base.size)
    for storage, multipliers in ((np.float32, (1, -1, 0.25, -0.25, 1 / 16, -1 / 16)), (np.float64, (-3, -1, 2, 3))):
        quantised = on_grid(base, step, np.dtype(storage), multipliers)
        for m in multipliers:
            point = base + m * quantised
            assert np.array_equal(point.astype(storage).astype(np.float64), point)
            assert np.array_equal(point - base, m * quantised)
        assert np.count_nonzero(quantised) > 0.99 * base.size  # almost every element moves
    assert np.max(np.abs(quantised - step) / np.abs(step)) < 1e-6  # float64: the direction barely changes


def test_regions_halve_and_name_themselves():
    shapes = {"w": (4, 6)}
    region = Region.whole(["w"], shapes)
    way, first, second = region.splits()[0]
    assert way == "axis 0" and first.describe(shapes) == "w[0:2, :]" and second.describe(shapes) == "w[2:4, :]"
    assert Region({"w": ((1, 2), (0, 6))}).describe(shapes) == "w[1, :]"
    assert Region({"w": ((1, 2), (5, 6))}).size() == 1


# ---------------------------------------------------------------------------------------------
# verdicts: right gradients, bugs in both builds, bugs in the float32 build only


@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_right_gradients_are_roundoff_within_the_call_budget(network):
    params, program = NETWORKS[network]()
    result = check_gradients(FunctionOracle(program, name=network), params, seed=0)
    assert result.verdict == "roundoff", result.to_text()
    assert {t.verdict for t in result.tensors.values()} == {"roundoff"}
    for tensor in result.tensors.values():
        assert tensor.bound_ratio < 1
        assert max(d.resolution for d in tensor.directions if d.deciding) < 1e-6  # float64 settles to ~1e-8
    assert result.total_calls <= 60 and result.calls["claimed"] == 7
    assert result.to_json()["parameters"][next(iter(params))]["layout_fix"] is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kinked_networks_are_never_called_defect(seed):
    """ReLU/max/clamp and max-pool networks, right gradients, other random directions and weights."""
    for build in (relu_max_mlp, small_cnn):
        params, program = build(seed=seed + 10)
        result = check_gradients(FunctionOracle(program, name=build.__name__), params, seed=seed)
        assert result.verdict == "roundoff", result.to_text()


def test_one_element_off_by_one_percent_in_both_builds_is_located():
    params, program = rbf_rational()
    result = check_gradients(FunctionOracle(wrong(program, "rbf.centers", "element"), name="element"), params)
    assert result.verdict == "defect"
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == ["rbf.centers"]
    tensor = result.tensors["rbf.centers"]
    assert any("disagrees by" in line for line in tensor.evidence)
    # flat index 3 of a (12, 2) tensor is [1, 1]: halving directions names it, and its size
    assert tensor.located[0].region == "rbf.centers[1, 1]"
    g = program({k: v.astype(np.float64) for k, v in params.items()}, np.float64)[1]["rbf.centers"][1, 1]
    assert tensor.located[0].element_error == pytest.approx(0.01 * g, rel=1e-3)


def test_a_missing_factor_in_one_tensor_is_named():
    params, program = small_cnn()
    result = check_gradients(FunctionOracle(wrong(program, "conv.bias", "half"), name="half"), params)
    assert result.verdict == "defect"
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == ["conv.bias"]
    assert "spread" in result.tensors["conv.bias"].located[0].note  # a whole-tensor error is not one element


def test_a_bug_in_the_float32_build_only_is_found_against_the_float64_build():
    params, program = attention_block()
    result = check_gradients(FunctionOracle(wrong(program, "norm.bias", "factor", only_float32=True), name="f32"), params)
    assert result.verdict == "defect"
    tensor = result.tensors["norm.bias"]
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == ["norm.bias"]
    assert tensor.directions[0].outcome == "agree"  # the float64 build is right ...
    assert tensor.comparison.bound_ratio > 1  # ... the float32 build differs from it at every point
    assert tensor.comparison.flagged >= 1 and "float32 build's gradient differs" in " ".join(tensor.evidence)
    # the defect is the one decision's (decision.not_rounding's float64-build rule), not a rule of the check's own
    assert result.causes == {"norm.bias": "the error persists in the float64 build (not rounding error)"}
    assert result.to_json()["causes"] == result.causes


def test_a_float32_only_single_element_bug_is_named_element_by_element():
    params, program = relu_max_mlp()
    result = check_gradients(FunctionOracle(wrong(program, "fc2.weight", "element", only_float32=True), name="e"), params)
    tensor = result.tensors["fc2.weight"]
    assert result.verdict == "defect" and tensor.verdict == "defect"
    assert tensor.comparison.flagged == 1 and tensor.comparison.worst[0]["index"] == [0, 3]
    assert tensor.comparison.worst[0]["relative"] == pytest.approx(0.01, rel=0.01)


def test_a_float32_build_computing_with_tf32_inputs_is_not_roundoff():
    params, program = tanh_chain(tensors=4)

    def tf32(p, dtype):  # operands rounded to 10 mantissa bits in the float32 build, as a TF32 unit would
        if np.dtype(dtype) != np.float32:
            return program(p, dtype)
        rounded = {k: (v.view(np.int32) & ~0x1FFF).view(np.float32) for k, v in p.items()}
        return program(rounded, dtype)
    result = check_gradients(FunctionOracle(tf32, name="tf32"), params)
    assert result.verdict == "defect"


def test_without_a_float64_build_kinked_right_gradients_are_never_defect():
    """ReLU, max, clamp, max-pool: float32-only segments cross many kinks; a right gradient is not a defect."""
    for build in (relu_max_mlp, small_cnn):
        params, program = build()
        for seed in (0, 1):
            result = check_gradients(FunctionOracle(program, name="f32", has_float64=False), params, seed=seed)
            assert result.verdict != "defect", result.to_text()
            assert result.calls["float64"] == 0 and result.total_calls <= result.budget == float32_budget(params)


@pytest.mark.parametrize("seed", [0, 1])
def test_without_a_float64_build_a_smooth_right_gradient_is_roundoff_from_its_segments(seed):
    """tanh MLP, float32 only: every tensor is roundoff to ≤ 1e-4 relative (short central differences reach
    ~u^(2/3) ≈ 1e-5·cond at best, measured 5.8e-4 at 1e-3‖w‖)."""
    params, program = tanh_chain(tensors=4)
    result = check_gradients(FunctionOracle(program, name="f32", has_float64=False), params, seed=seed)
    assert all(t.verdict != "defect" for t in result.tensors.values()), result.to_text()
    resolutions = [t.segment.resolution for t in result.tensors.values()]
    # every tensor, biases included: each segment's length comes from the measured σ_L and g·d (was 0.5‖w‖, which
    # left the biases at 1e-4 – 4e-4)
    assert result.verdict == "roundoff" and max(resolutions) <= 1e-4, result.to_text()
    assert result.total_calls <= result.budget == float32_budget(params)
    # each tensor's line states the resolution it reached
    lines = [line for line in result.to_text().splitlines() if line.startswith("  l")]
    assert len(lines) == 4 and all(re.search(r"roundoff .* to \d\.\de-05 relative$", line) for line in lines), lines


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tensor", ["l0.weight", "l0.bias", "l1.weight", "l1.bias"])
def test_without_a_float64_build_a_one_percent_slip_is_a_defect_naming_its_tensor(tensor, seed):
    params, program = tanh_chain(tensors=4)
    result = check_gradients(FunctionOracle(wrong(program, tensor, "factor"), name="f32", has_float64=False), params,
                             seed=seed)
    assert result.verdict == "defect", result.to_text()
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == [tensor]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_without_a_float64_build_a_relu_conv_net_is_settled_along_its_scaling_direction(seed):
    """The example ReLU conv net, right gradient, float32 only: along the 45° direction its conv layer crosses ~10⁴
    kinks (resolution ~1e-2); scaling conv.weight, conv.bias and fc.bias together keeps every ReLU's sign, and the
    segment there settles both conv tensors to ≤ 1e-4. Seed 0's noise line crosses a kink, which inflates the noise
    line's σ_g ~10³×: the scaling segment's own σ_f must not depend on it."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS

    params, function = FLOAT32_KINDS["relu-conv"][1]()
    result = check_gradients(FunctionOracle(function, name="relu", has_float64=False), params, seed=seed)
    assert result.verdict == "roundoff" and result.total_calls <= result.budget == float32_budget(params), result.to_text()
    for name in ("conv.weight", "conv.bias"):
        tensor = result.tensors[name]
        assert tensor.segment.resolution > 1e-3  # its own segment, across the kinks, does not settle it
        share = min((x for x in tensor.shares if x.outcome == "agree"), key=lambda x: x.resolution)
        assert share.resolution <= 1e-4 and share.segment.rule not in ("panels", "jump-free panels")
        assert set(share.segment.displacement) == {"conv.weight", "conv.bias", "fc.bias"}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["relu-conv", "relu-maxpool"])
def test_a_one_percent_slip_behind_a_relu_is_a_defect_without_a_float64_build(kind, seed):
    """conv.weight's gradient 1% off behind the ReLU: the scaling segment disagrees and names conv.weight alone (conv.bias
    would need a 25% error to explain it, which its own segment excludes); conv.bias 1% off: a defect naming conv.bias
    (with the max-pool its own segment sees it; without, conv.weight cannot be cleared: "one of conv.bias or
    conv.weight", neither named alone)."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS[kind][1]()
    for tensor in ("conv.weight", "conv.bias"):
        result = check_gradients(FunctionOracle(slipped(function, tensor), name="relu", has_float64=False), params,
                                 seed=seed)
        named = [t.name for t in result.tensors.values() if t.verdict == "defect"]
        assert result.verdict == "defect" and result.tensors[tensor].verdict != "roundoff", result.to_text()
        if (kind, tensor) == ("relu-conv", "conv.bias"):  # one of two, and the check says so, naming neither alone
            assert named in ([tensor], []) and (named or result.defect_in_one_of == [["conv.bias", "conv.weight"]])
        else:
            assert named == [tensor], result.to_text()
        assert all(t.verdict == "roundoff" for n, t in result.tensors.items() if n.startswith("fc."))


@pytest.mark.parametrize("seed", [0, 1])
def test_without_a_float64_build_a_deeper_relu_network_names_a_hidden_layer_slip(seed):
    """A three-layer ReLU MLP with cross-entropy: a 1% slip in the first or second layer's weight gradient is a defect
    naming it (each layer's group scales the logits by 1 + t); the right program is never a defect."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS["relu-mlp"][1]()
    right = check_gradients(FunctionOracle(function, name="mlp", has_float64=False), params, seed=seed)
    assert right.verdict != "defect", right.to_text()
    assert all(right.tensors[n].verdict == "roundoff" for n in ("l0.weight", "l1.weight", "l2.weight")), right.to_text()
    for tensor in ("l0.weight", "l1.weight"):
        result = check_gradients(FunctionOracle(slipped(function, tensor), name="mlp", has_float64=False), params,
                                 seed=seed)
        assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == [tensor], result.to_text()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_slip_in_the_read_out_bias_of_a_deeper_relu_network_is_named_without_a_float64_build(seed):
    """A 1% slip in the last layer's bias: its own segment disagrees, and telling the suspects apart scales the read-out
    layer's group, which no open tensor's group holds; it goes through the centre every scaling segment shares, on the
    float32 grid (the check stopped with 'internal: point of 'l2.weight' is not representable in float32' before)."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS["relu-mlp"][1]()
    result = check_gradients(FunctionOracle(slipped(function, "l2.bias"), name="mlp", has_float64=False), params,
                             seed=seed)
    assert result.verdict == "defect", result.to_text()
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == ["l2.bias"], result.to_text()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind, tensor", [("relu-mlp", "l1.bias"), ("relu-mlp", "l0.bias"), ("relu-conv", "conv.bias")])
def test_a_bias_gradient_left_at_zero_is_named_alone_without_a_float64_build(kind, tensor, seed):
    """A forgotten bias gradient (all zeros): its part of every scaling segment is 0, so it alone explains their
    disagreement at any size; the right tensors beside it are not named (they were, while a zero part dropped the
    member from the suspects), and its own kinked segment disagrees (the panels' scatter is the loss's own change
    there, not rounding)."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS[kind][1]()
    result = check_gradients(FunctionOracle(slipped(function, tensor, 0.0), name="zero", has_float64=False), params,
                             seed=seed)
    assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == [tensor], result.to_text()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scaling_segment_does_not_settle_the_gradient_of_zero_weights(seed):
    """Pruned weights (value 0) are not moved by a scaling segment, so it cannot see their gradient: a forward that
    masks them with a backward that forgets the mask is never roundoff; the right masked program still is."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS

    params, function = FLOAT32_KINDS["relu-maxpool"][1]()
    params = {k: np.array(v, np.float32) for k, v in params.items()}
    keep = np.random.default_rng(5).random(params["conv.weight"].shape) >= 0.15
    params["conv.weight"] = params["conv.weight"] * keep

    def forgets_the_mask(p, dtype):
        return function({**p, "conv.weight": np.asarray(p["conv.weight"]) * keep}, dtype)

    def right(p, dtype):
        loss, grads = forgets_the_mask(p, dtype)
        return loss, {**grads, "conv.weight": grads["conv.weight"] * keep}
    bug = check_gradients(FunctionOracle(forgets_the_mask, name="mask", has_float64=False), params, seed=seed)
    assert bug.tensors["conv.weight"].verdict != "roundoff" and bug.verdict != "roundoff", bug.to_text()
    assert any("whose value is 0" in line for line in bug.tensors["conv.weight"].evidence)
    fine = check_gradients(FunctionOracle(right, name="mask", has_float64=False), params, seed=seed)
    assert fine.verdict == "roundoff", fine.to_text()


def test_scaling_steps_are_exact_and_drop_no_element():
    """Every node of a scaling segment is exact in float32 for every element (on_grid would drop the ones whose
    segment crosses a power of two: 0.245 and 0.4958 here), the step is the scaling to a few ulps, and every reach
    shares one centre."""
    rng = np.random.default_rng(0)
    value = np.concatenate([rng.standard_normal(200), [0.2450888, 0.49575993, 0.5, -0.25, 1e-30, 0.0]]).astype(np.float32)
    value = value.astype(np.float64)
    centres = []
    for reach in (0.75, 0.1, 0.003):
        centre, step = scaling_step(value, reach, np.float32)
        centres.append(centre)
        for m in np.linspace(-1, 1, 33):
            point = centre + m * step
            assert np.array_equal(point.astype(np.float32).astype(np.float64), point)
        assert np.all((step != 0) == (value != 0))
        # the scaling to half a grid spacing (32 ulps at |w|·1.77, ≤ 2⁻²³·1.78|w| each): < 2⁻¹⁸ of |w|
        assert np.all(np.abs(step - reach * centre) <= 2.0 ** -18 * np.abs(value))
        assert np.all(np.abs(centre - value) <= 16 * np.spacing(np.abs(value).astype(np.float32) * 2).astype(np.float64))
    assert all(np.array_equal(centres[0], c) for c in centres)


def test_homogeneous_groups_follow_the_layers_in_the_programs_order():
    shapes = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc.weight": (1, 256), "fc.bias": (1,)}
    assert homogeneous_groups(shapes, "conv.weight") == [("conv.weight", "conv.bias", "fc.bias"),
                                                         ("conv.weight", "conv.bias")]
    assert homogeneous_groups(shapes, "conv.bias") == homogeneous_groups(shapes, "conv.weight")
    assert homogeneous_groups(shapes, "fc.weight") == [("fc.weight", "fc.bias")]
    # HWIO (TensorFlow): the bias matches the last axis; a scalar is no layer's; a bias with no weight beside or before
    # it neither
    hwio = {"k": (3, 3, 1, 8), "b": (8,), "t": (), "head": (8, 2)}
    assert homogeneous_groups(hwio, "b") == [("k", "b")] and homogeneous_groups(hwio, "t") == []
    assert homogeneous_groups({"b": (3,), "x": (5,), "w": (3, 3)}, "b") == []
    # a sorted pytree (Flax: bias before kernel), square layers: each kernel takes the bias of its own name
    flax = {"Dense_0/bias": (8,), "Dense_0/kernel": (8, 8), "Dense_1/bias": (8,), "Dense_1/kernel": (8, 8)}
    assert homogeneous_groups(flax, "Dense_0/kernel")[0] == ("Dense_0/kernel", "Dense_0/bias", "Dense_1/bias")
    assert homogeneous_groups(flax, "Dense_1/bias") == [("Dense_1/kernel", "Dense_1/bias")]
    # a normalisation's scale between layers joins the upstream group
    normed = {"w1": (4, 1, 3, 3), "b1": (4,), "scale": (4,), "w2": (2, 16), "b2": (2,)}
    assert homogeneous_groups(normed, "w1")[0] == ("w1", "b1", "scale", "b2")
    assert homogeneous_groups(normed, "scale") == [("w1", "b1", "scale", "b2")]


@pytest.mark.parametrize("bias_size", [0.0, 1e-6])
def test_without_a_float64_build_biases_near_zero_get_their_length_from_the_loss(bias_size):
    """Biases at 0 or ~1e-6 beside weights ~0.4: 8‖b‖ would cap their segments far below what the loss needs
    (resolution 0.14 – 0.26); the length comes from σ_L and g·d, capped by the model's typical tensor. A 1% slip
    in such a bias is still a defect."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS["tanh-mlp"][1]()
    rng = np.random.default_rng(1)
    params = {k: (bias_size * rng.standard_normal(v.shape)).astype(np.float32) if "bias" in k else v
              for k, v in params.items()}
    result = check_gradients(FunctionOracle(function, name="f32", has_float64=False), params)
    assert result.verdict == "roundoff", result.to_text()
    assert all(t.segment.resolution <= 1e-4 for t in result.tensors.values())
    slip = check_gradients(FunctionOracle(slipped(function, "l0.bias"), name="f32", has_float64=False), params)
    assert [t.name for t in slip.tensors.values() if t.verdict == "defect"] == ["l0.bias"], slip.to_text()


@pytest.mark.parametrize("tensors", [12, 20])
def test_without_a_float64_build_moved_segment_centres_never_spend_the_last_calls(tensors):
    """A segment through a moved centre costs one call more; with 12 or 20 tensors at 4 panels each those calls
    overran the budget and every tensor came back inconclusive ("0 calls left"). Now a centre moves only when a
    call is to spare, so every tensor gets its segment."""
    params, program = tanh_chain(tensors=tensors)
    result = check_gradients(FunctionOracle(program, name="f32", has_float64=False), params, seed=1)
    assert all(t.segment is not None for t in result.tensors.values()), result.notes
    assert result.verdict != "defect" and result.total_calls <= result.budget
    assert sum(t.verdict == "roundoff" for t in result.tensors.values()) >= tensors // 2, result.to_text()


def test_without_a_float64_build_the_noise_has_eleven_degrees_of_freedom():
    """Every float32-only bound is k_crit·σ_L: 12 noise points (t's 1e-4 quantile 5.9) instead of 6 (11.2)."""
    params, program = tanh_chain(tensors=4)
    result = check_gradients(FunctionOracle(program, name="f32", has_float64=False), params)
    assert result.noise["claimed"].dof == 11
    with_float64 = check_gradients(FunctionOracle(program, name="f32"), params)
    assert with_float64.noise["float64"].dof == 5


def test_a_segment_longer_than_the_elements_keeps_its_length_and_every_node_is_exact():
    """A bias of ~0.1 moved by 0.3: starting from w, the nodes beyond 2|w| lose w's last bits, so on_grid dropped
    those elements and the segment shrank (6× on a tanh MLP's bias); the centre moves onto the step's grid instead."""
    rng = np.random.default_rng(0)
    bias = (0.1 * rng.standard_normal(6)).astype(np.float32).astype(np.float64)
    unit = rng.standard_normal(6)
    unit /= np.linalg.norm(unit)
    multipliers = list(np.linspace(-1.0, 1.0, 17))
    assert np.linalg.norm(on_grid(bias, 0.3 * unit, np.dtype("float32"), multipliers)) < 0.9 * 0.3  # the old shrink
    centre, step = segment_step(bias, 0.3, np.dtype("float32"), multipliers, unit)
    assert np.linalg.norm(step) >= 0.9 * 0.3 and np.all(step != 0)
    assert np.max(np.abs(centre - bias)) < 1e-6  # a few ulps of the reach (0.3 + 0.1), not a move
    for m in multipliers:
        point = centre + m * step
        assert np.array_equal(point.astype(np.float32).astype(np.float64), point)


@pytest.mark.parametrize("seed", [0, 7])
def test_the_segment_direction_sees_a_scale_error_at_every_seed(seed):
    """45° between the claimed gradient and a random direction: g·d = ‖g‖/√2 whatever the seed (a random d nearly
    orthogonal to g let a 1% slip in a tanh MLP's bias pass as roundoff), and one element: g's own direction."""
    g = np.random.default_rng(seed).standard_normal((3, 4))
    d = half_aligned(g, np.random.default_rng(seed + 1))
    assert abs(np.linalg.norm(d) - 1) < 1e-12 and abs(np.sum(g * d) - np.linalg.norm(g) / np.sqrt(2)) < 1e-12
    assert half_aligned(np.array([-2.0]), np.random.default_rng(seed))[0] == -1.0


def test_without_a_float64_build_one_percent_slips_in_a_tanh_mlp_are_named_at_every_seed():
    """20 seeds × 4 tensors: each 1% slip is a defect naming its tensor (seed 18 once called a bias slip roundoff)."""
    from precision_lab.experiments.gradient_check import FLOAT32_KINDS, slipped

    params, function = FLOAT32_KINDS["tanh-mlp"][1]()
    for seed in range(20):
        for tensor in params:
            result = check_gradients(FunctionOracle(slipped(function, tensor), name="f32", has_float64=False), params,
                                     seed=seed)
            assert [t.name for t in result.tensors.values() if t.verdict == "defect"] == [tensor], (seed, tensor)


@pytest.mark.parametrize("jump_at", [-0.8, 0.37, 0.9])
def test_a_segment_with_one_jump_is_settled_by_the_panels_beside_it(jump_at):
    """f = g·Δ jumps once along the segment (an input crosses a clamp): the trapezoid sums do not converge like h²
    and the fit over all panels resolved only ~3e-3; the run of panels with no jump in their gradients settles it
    (the loss is the exact integral, its σ 1e-7); a 1% slip is never settled there."""
    nodes = np.linspace(-1.0, 1.0, 9)
    losses = 5 + nodes + 0.15 * nodes ** 2 + 0.05 * np.maximum(nodes - jump_at, 0)
    slopes = 1 + 0.3 * nodes + 0.05 * (nodes > jump_at)

    def judged(factor):
        segment = Segment("w", {"w": np.ones(3)}, nodes, losses, factor * slopes, 1e-7, 1e-9, 11)
        segment.evaluate(lambda dof: t_critical(1e-4, dof))
        return segment
    right = judged(1.0)
    assert right.rule == "jump-free panels" and right.outcome == "agree" and right.resolution <= 1e-4, right.statistic
    slip = judged(1.01)
    assert slip.outcome == "disagree" or slip.resolution > 1e-2 / 3, slip.statistic


def test_without_a_float64_build_a_parameter_the_loss_ignores_is_not_a_defect():
    """An unused parameter (gradient 0, loss unchanged) and one whose segment integral cancels to ~0 (an odd f)."""
    params, program = tanh_chain(tensors=4)
    params = {**params, "unused": np.ones(3, np.float32), "centred": np.zeros(2, np.float32)}

    def extended(p, dtype):
        loss, grads = program({k: v for k, v in p.items() if k.startswith("l")}, dtype)
        total = np.asarray(p["centred"], dtype).sum()
        return loss + total ** 2, {**grads, "unused": np.zeros(3, dtype), "centred": 2 * total * np.ones(2, dtype)}
    result = check_gradients(FunctionOracle(extended, name="f32", has_float64=False), params)
    assert result.verdict != "defect", result.to_text()
    assert result.tensors["unused"].verdict == "roundoff" and result.tensors["centred"].verdict == "roundoff"


def test_a_tensor_whose_norm_dwarfs_the_others_does_not_set_their_steps():
    """A bias at −7e4 beside weights ~0.1: each tensor's step comes from itself (was a ZeroDivisionError)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    t = (-7e4 + rng.standard_normal((64, 3))).astype(np.float32)
    params = {"w": (0.1 * rng.standard_normal((3, 5))).astype(np.float32), "b": np.full(3, -7e4 + 0.5, np.float32)}

    def program(p, dtype):
        r = x.astype(dtype) @ p["w"].T + p["b"] - t.astype(dtype)
        return np.mean(r * r), {"w": 2 * r.T @ x.astype(dtype) / r.size, "b": 2 * r.sum(0) / r.size}
    result = check_gradients(FunctionOracle(program, name="big", has_float64=False), params)
    segment = result.tensors["w"].segment
    # w's own scale bounds its segment (the loss's noise, large here, asks for the longest), not b's ~6e4
    assert 0.25 * np.linalg.norm(params["w"]) < segment.norm() <= 1.01 * SEGMENT_MAX * np.linalg.norm(params["w"])
    assert result.verdict != "defect", result.to_text()


def test_without_a_float64_build_a_gross_bug_is_still_a_defect():
    params, program = rbf_rational()
    result = check_gradients(FunctionOracle(wrong(program, "head.weight", "half"), name="f32", has_float64=False), params)
    assert result.verdict == "defect"
    assert result.tensors["head.weight"].verdict == "defect"


def test_a_float64_claim_is_settled_by_its_own_build():
    params, program = tanh_chain(tensors=4)
    right = check_gradients(FunctionOracle(program, name="c64", claimed_precision="float64", has_float64=False), params)
    assert right.verdict == "roundoff" and right.calls["claimed"] == right.total_calls
    bug = check_gradients(FunctionOracle(wrong(program, "l1.weight", "factor"), name="c64", claimed_precision="float64",
                                         has_float64=False), params)
    assert bug.verdict == "defect" and bug.tensors["l1.weight"].verdict == "defect"


def _least_squares_at_its_minimum():
    """A linear model at its least-squares fit: the gradient is tiny beside the loss (slope tests cannot see a
    float64 build that computes in float32 there)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    t = (x.astype(np.float64) @ rng.standard_normal((64, 1)) + rng.standard_normal((256, 1))).astype(np.float32)
    fit = np.linalg.lstsq(np.hstack([x, np.ones((256, 1), np.float32)]).astype(np.float64), t.astype(np.float64),
                          rcond=None)[0]
    params = {"w": fit[:64].T.astype(np.float32), "b": fit[64].astype(np.float32)}

    def program(p, dtype):
        r = x.astype(dtype) @ p["w"].T + p["b"] - t.astype(dtype)
        return np.mean(r * r), {"w": 2 * r.T @ x.astype(dtype) / r.size, "b": 2 * r.sum(0) / r.size}
    return params, program


@pytest.mark.parametrize("network", [lambda: tanh_chain(tensors=4), _least_squares_at_its_minimum])
def test_a_float64_build_that_computes_in_float32_is_named_and_not_trusted(network):
    params, program = network()

    def fake(p, dtype):
        loss, grads = program({k: v.astype(np.float32) for k, v in p.items()}, np.float32)
        return np.float64(loss), {k: v.astype(np.float64) for k, v in grads.items()}
    result = check_gradients(FunctionOracle(program, name="fake", float64_function=fake), params)
    assert "does not change at float64 resolution" in result.notes[0] and "computes in float32" in result.notes[0]
    assert result.calls["float64"] == 7  # its noise points only: then the float32 build alone decides
    assert result.verdict != "defect" and all(t.segment is not None for t in result.tensors.values())


def test_the_printed_uncertainty_is_the_one_that_decides():
    """Every "agrees" line prints the bound it was judged against (k·σ plus the kink allowance), which holds the
    difference; a bare "± σ" beside "agrees" read as a 12σ agreement."""
    import re

    params, program = relu_max_mlp()
    result = check_gradients(FunctionOracle(program, name="kinks"), params, seed=1)
    lines = [e for t in result.tensors.values() for e in t.evidence if "agrees" in e]
    lines += [d.evidence() for d in result.whole if d.outcome == "agree"]
    assert lines
    for line in lines:
        found = re.search(r"difference (\S+), bound (\S+) =", line)
        assert found, line
        assert abs(float(found.group(1))) <= float(found.group(2)) * (1 + 1e-2), line


def test_a_kink_inside_the_first_step_is_stepped_around():
    """L = w² + relu(w − k) with the kink 0.4 h above the base: the halves of step h disagree, h/4 is clean."""
    base = {"w": np.array([1.0], np.float32)}
    kink = 1.0 + 0.4 * (np.finfo(np.float64).eps / 2) ** (1 / 3)  # h = u64^(1/3)·‖w‖ with ‖w‖ = 1

    def program(p, dtype):
        w = p["w"].astype(np.float64)
        loss = float(w[0] ** 2 + max(w[0] - kink, 0.0))
        return np.asarray(loss, dtype), {"w": np.array([2 * w[0] + (1.0 if w[0] > kink else 0.0)], dtype)}
    result = check_gradients(FunctionOracle(program, name="kink"), base)
    direction = result.tensors["w"].directions[0]
    assert [level.status for level in direction.levels] == ["kinked", "agree"]
    assert "kink" in direction.reason and direction.outcome == "agree"
    assert result.verdict == "roundoff"


def test_ten_tensors_cost_at_most_sixty_calls_even_with_a_defect():
    params, program = tanh_chain(tensors=10)
    assert default_budget(10) == 60
    for candidate in (program, wrong(program, "l2.weight", "element")):
        result = check_gradients(FunctionOracle(candidate, name="ten"), params)
        assert result.total_calls <= 60
        assert result.calls["claimed"] + result.calls["float64"] == result.total_calls
        assert "program calls" in result.cost() and "wall time" in result.cost()
    assert result.verdict == "defect" and result.tensors["l2.weight"].verdict == "defect"


def test_an_answer_with_nan_or_a_wrong_shape_is_refused():
    params, program = tanh_chain(tensors=2)

    def nan(p, dtype):
        loss, grads = program(p, dtype)
        grads["l0.bias"] = grads["l0.bias"] * np.nan
        return loss, grads

    def shape(p, dtype):
        loss, grads = program(p, dtype)
        grads["l0.weight"] = grads["l0.weight"].ravel()
        return loss, grads
    with pytest.raises(GradCheckError, match=r"'l0.bias.grad' holds 6 NaN"):
        check_gradients(FunctionOracle(nan, name="nan"), params)
    with pytest.raises(GradCheckError, match=r"'l0.weight.grad' has shape \(36,\), expected \(6, 6\)"):
        check_gradients(FunctionOracle(shape, name="shape"), params)


# ---------------------------------------------------------------------------------------------
# the protocol: start bundles, requests, responses, the candidate YAML

PROGRAM = textwrap.dedent('''
    """A tiny opaque program: L = mean((x @ W + b - t)^2), reading npz or raw binaries (C or F order)."""
    import json, sys, time
    from pathlib import Path
    import numpy as np
    request, response, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    manifest = json.loads((request / "bundle.json").read_text())
    def read(name):
        if "arrays" in manifest:
            spec = manifest["arrays"][name]
            data = np.fromfile(request / spec["file"], dtype=spec["dtype"])
            return data.reshape(spec["shape"], order=spec.get("order", "C"))
        with np.load(request / "arrays.npz") as data:
            return data[name]
    x, t, w, b = read("x"), read("t"), read("lin.w"), read("lin.b")
    Path("seen.json").write_text(json.dumps({"manifest": manifest, "w": w.tolist(), "dtype": str(w.dtype)}))
    if mode == "fail":
        sys.stderr.write("segmentation fault in backward\\n"); sys.exit(3)
    if mode == "hang":
        time.sleep(30)
    r = x @ w + b - t
    loss = np.mean(r * r)
    gw, gb = 2 * x.T @ r / r.size, 2 * r.sum(0) / r.size
    out = {"loss": np.asarray(loss, w.dtype), "lin.w.grad": gw.astype(w.dtype), "lin.b.grad": gb.astype(w.dtype)}
    if mode == "missing":
        del out["lin.b.grad"]
    if mode == "shape":
        out["lin.w.grad"] = out["lin.w.grad"].T
    if mode == "nan":
        out["lin.w.grad"][0, 0] = np.nan
    if mode == "dtype":
        out["lin.w.grad"] = out["lin.w.grad"].astype(np.float16)
    response.mkdir(exist_ok=True)
    np.savez(response / "arrays.npz", **out)
    (response / "bundle.json").write_text(json.dumps({"format": "precision-lab/bundle-1", "kind": "response",
                                                      "precision": manifest["precision"]}))
''')


def _start(folder: Path, raw_order: str | None = None, **model_overrides) -> Path:
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((16, 3)), "t": rng.standard_normal((16, 2)),
              "lin.w": rng.standard_normal((3, 2)), "lin.b": np.zeros(2)}
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    start = folder / "start"
    start.mkdir(parents=True, exist_ok=True)
    model = {"opaque": True, "parameters": ["lin.w", "lin.b"], **model_overrides}
    manifest = {"format": "precision-lab/bundle-1", "kind": "request", "precision": "float32", "model": model}
    if raw_order:
        manifest["arrays"] = {}
        for name, value in arrays.items():
            value.ravel(order=raw_order).tofile(start / f"{name}.raw")
            manifest["arrays"][name] = {"file": f"{name}.raw", "dtype": "float32", "shape": list(value.shape),
                                        "order": raw_order}
    else:
        np.savez(start / "arrays.npz", **arrays)
    (start / "bundle.json").write_text(json.dumps(manifest))
    return start


def _yaml(folder: Path, mode: str = "good", **overrides) -> Path:
    (folder / "program.py").write_text(PROGRAM)
    spec = {"name": f"tiny-{mode}", "model": "opaque", "start": "start/",
            "command": ["{python}", "program.py", "{request}", "{response}", mode],
            "command_float64": ["{python}", "program.py", "{request}", "{response}", mode],
            "precision": "float32", "timeout_s": 20}
    spec.update(overrides)
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if v is not None}))
    return path


@pytest.mark.parametrize("raw_order", [None, "C", "F"])
def test_requests_keep_the_start_bundle_format_and_carry_the_perturbed_parameters(tmp_path, raw_order):
    _start(tmp_path, raw_order)
    candidate = resolve(str(_yaml(tmp_path)))
    assert isinstance(candidate, OpaqueCandidate) and candidate.start.parameters == ["lin.w", "lin.b"]
    point = {"lin.w": candidate.start.arrays["lin.w"].astype(np.float64) + 0.5, "lin.b": np.ones(2)}
    request = tmp_path / "request"
    candidate.program.write_request(request, "float64", np.dtype(np.float64), point)
    manifest = json.loads((request / "bundle.json").read_text())
    assert manifest["precision"] == "float64" and manifest["model"]["parameters"] == ["lin.w", "lin.b"]
    if raw_order:
        assert manifest["arrays"]["lin.w"]["order"] == raw_order and manifest["arrays"]["lin.w"]["file"] == "lin.w.raw"
        back = np.fromfile(request / "lin.w.raw", np.float64).reshape((3, 2), order=raw_order)
    else:
        back = np.load(request / "arrays.npz")["lin.w"]
    assert back.dtype == np.float64 and np.array_equal(back, point["lin.w"])
    answer = candidate.program.evaluate("claimed", {k: v.astype(np.float64) for k, v in candidate.start.arrays.items()
                                                   if k in ("lin.w", "lin.b")})
    x, t, w = (candidate.start.arrays[k].astype(np.float64) for k in ("x", "t", "lin.w"))
    assert answer.loss == pytest.approx(np.mean((x @ w - t) ** 2), rel=1e-6)
    assert answer.grads["lin.w"].shape == (3, 2)


def test_diagnose_takes_a_seed_for_an_opaque_candidate(tmp_path, capsys):
    """`--seed 3` reaches the check as the integer 3 (it reached numpy's SeedSequence as the text '3')."""
    _start(tmp_path)
    out = tmp_path / "verdict.json"
    code = cli.main(["diagnose", "--candidate", str(_yaml(tmp_path)), "--seed", "3", "--json", str(out)])
    assert code in (0, 1) and json.loads(out.read_text())["seed"] == 3
    assert cli.main(["diagnose", "--candidate", str(_yaml(tmp_path)), "--seed", "three"]) == 2
    assert "--seed" in capsys.readouterr().err


def test_an_opaque_candidate_is_checked_through_the_protocol(tmp_path):
    _start(tmp_path)
    candidate = resolve(str(_yaml(tmp_path)))
    result = candidate.check(max_calls=40)
    assert result.verdict == "roundoff", result.to_text()
    assert result.calls["claimed"] == 7 and result.total_calls <= 40
    with pytest.raises(CandidateError, match="opaque"):
        candidate.compute(None, "float32", "cpu")  # the model-based experiments cannot run it


@pytest.mark.parametrize("mode, message", [
    ("missing", r"float64 build: bad response: .*the response has no 'lin.b.grad' \(expected shape \(2,\) float64\)"),
    ("shape", r"'lin.w.grad' has shape \(2, 3\), expected \(3, 2\) \(the shape of parameter 'lin.w'\)"),
    ("nan", r"'lin.w.grad' holds 1 NaN or infinite values"),
    ("dtype", r"'lin.w.grad' has dtype float16, expected float64"),
    ("fail", r"command exited with status 3; end of its stderr: segmentation fault in backward"),
    ("hang", r"command timed out after 2 s"),
])
def test_bad_answers_are_one_line_and_exit_2(tmp_path, capsys, mode, message):
    _start(tmp_path)
    path = _yaml(tmp_path, mode, timeout_s=2 if mode == "hang" else 20)
    assert cli.main(["diagnose", "--candidate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("precision-lab: error: candidate tiny-") and __import__("re").search(message, err), err


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(model={"channels": [1, 16, 16, 1]}), r"an opaque start bundle needs \{\"opaque\": true"),
    (lambda m: m["model"].update(parameters=[]), r"'model.parameters' must be a non-empty list"),
    (lambda m: m["model"].update(parameters=["lin.w", "lin.v"]), r"parameter 'lin.v' .* is not among the arrays"),
    (lambda m: m["model"].update(parameter=["x"]), r"'model.parameter' is not part of an opaque model"),
    (lambda m: m["model"].update(parameters=["lin.w", "lin.w"]), r"lists 'lin.w' twice"),
    (lambda m: m.update(kind="static"), r"key 'kind' is 'static', expected 'request'"),
    (lambda m: m.update(precision="float8"), r"key 'precision' is 'float8'"),
])
def test_bad_start_bundles_are_refused_in_one_line(tmp_path, change, message):
    start = _start(tmp_path)
    manifest = json.loads((start / "bundle.json").read_text())
    change(manifest)
    (start / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(LabInputError, match=message):
        resolve(str(_yaml(tmp_path)))


def test_start_bundle_arrays_are_checked(tmp_path):
    start = _start(tmp_path)
    with np.load(start / "arrays.npz") as data:
        arrays = dict(data)
    np.savez(start / "arrays.npz", **{**arrays, "lin.b": np.array([1, 2])})
    with pytest.raises(LabInputError, match=r"parameter 'lin.b' has dtype int64; parameters must be float32 or float64"):
        read_start_bundle(start, "float32")
    np.savez(start / "arrays.npz", **{**arrays, "x": arrays["x"] * np.inf})
    with pytest.raises(LabInputError, match=r"'x' holds 48 NaN or infinite values"):
        read_start_bundle(start, "float32")
    np.savez(start / "arrays.npz", **{**arrays, "t": arrays["t"].astype(np.float64) / 3})
    assert read_start_bundle(start, "float32").rounded == ["t"]  # both builds get the float32 values


@pytest.mark.parametrize("overrides, message", [
    ({"start": None}, r"key 'start' must name the start bundle folder"),
    ({"start": "nowhere/"}, r"no such start bundle directory"),
    ({"weight_layot": "OIHW"}, r"unknown key 'weight_layot'"),
    ({"command": ["./missing-program", "{request}", "{response}"]}, r"program './missing-program' not found"),
    ({"model": "resnet"}, r"key 'start' belongs to `model: opaque`"),
])
def test_bad_opaque_yaml_is_refused_in_one_line(tmp_path, overrides, message):
    _start(tmp_path)
    with pytest.raises((CommandCandidateError, LabInputError), match=message):
        resolve(str(_yaml(tmp_path, **overrides)))


# ---------------------------------------------------------------------------------------------
# the KAN example end to end (precision-lab diagnose; each run is ~30 program starts)


@pytest.mark.slow
@pytest.mark.parametrize("name, verdict, tensors", [
    ("relu", "roundoff", []),  # float32 only: the conv layer behind the ReLU settled along its scaling direction
    ("relu-bug", "defect", ["fc.weight"]),
    ("relu-conv-bug", "defect", ["conv.weight"]),  # behind the ReLU: named by the scaling segment
    ("kan", "roundoff", []),
    ("kan-no-float64", "roundoff", []),  # float32 only: every tensor's segment resolves g·d to ≤ 1e-4
    ("kan-bug", "defect", ["layer2.spline_weight"]),
    ("kan-bug-float32", "defect", ["layer1.spline_weight", "layer2.spline_weight"]),
])
def test_kan_candidates_through_diagnose(tmp_path, capsys, name, verdict, tensors):
    out = tmp_path / "verdict.json"
    code = cli.main(["diagnose", "--candidate", str(ROOT / "examples" / "opaque" / f"{name}.yaml"), "--json", str(out)])
    assert code == (0 if verdict == "roundoff" else 1)
    report = json.loads(out.read_text())
    assert report["verdict"] == verdict and report["claimed_precision"] == "float32" and report["candidate"] == name
    assert sorted(k for k, v in report["parameters"].items() if v["verdict"] == "defect") == tensors
    for entry in report["parameters"].values():
        assert {"verdict", "max_abs_err", "bound_ratio", "layout_fix"} <= set(entry) and entry["layout_fix"] is None
    assert report["cost"]["calls"] <= report["cost"]["budget"]
    printed = capsys.readouterr().out
    assert f"verdict: {verdict}" in printed and "program calls" in printed
    if name == "relu":  # its read-out is quadratic along any segment; its conv layer along the scaling segment
        for tensor in ("fc.weight", "conv.weight", "conv.bias"):
            assert report["parameters"][tensor]["resolution"] <= 1e-4
        assert report["parameters"]["conv.weight"]["scaling_segments"][0]["group"]["rule"] == "trapezoid"
    if name == "kan-bug":  # the three wrong elements: layer2.spline_weight[0, 4, 0..2]
        assert report["parameters"]["layer2.spline_weight"]["located"][0]["region"].startswith("layer2.spline_weight[0, 4,")
