"""Normalisation ops: batch_norm2d in training and evaluation mode and group_norm, read from PyTorch modules, walked as autograd
does, and judged: PyTorch's own float32 run and every legitimate float32 form of the statistics (two-pass, Welford,
the one-pass E[x²] − μ²) are roundoff; a port's slip of the statistics is a defect with its cause named."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.modules import from_module
from precision_lab.ops import OPS, Rule
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


class DnCNNBN(nn.Module):
    """DnCNN: conv–ReLU, conv–BN–ReLU ×2, conv; the network returns x − f(x)."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.head = nn.Conv2d(1, 8, 3, padding=1)
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, eps=eps)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, eps=eps)
        self.tail = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.head(x))
        h = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))))
        return x - self.tail(h)


def _dncnn(mode: str, eps: float = 1e-5):
    torch.manual_seed(0)
    module = DnCNNBN(eps)
    if mode == "eval":
        # running statistics as training leaves them: one batch's (momentum 1), scaled off it by up to 30%
        for bn in (module.bn1, module.bn2):
            bn.momentum = 1.0
        with torch.no_grad():
            module(torch.from_numpy(make_problem(16, 2, 7, network=from_module(DnCNNBN(eps))).input))
        for bn in (module.bn1, module.bn2):
            bn.running_mean.mul_(torch.empty(8).uniform_(0.7, 1.3))
            bn.running_var.mul_(torch.empty(8).uniform_(0.7, 1.3))
        module.eval()
    return from_module(module, name=f"dncnn-bn-{mode}")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_forward_and_backward_are_pytorchs_in_float64(mode):
    network = _dncnn(mode)
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "conv2d", "batch_norm2d", "relu", "conv2d",
                                                      "batch_norm2d", "relu", "conv2d", "sub"]
    bn = network.layers[3].attrs
    assert bn["training"] == (mode == "train") and bn["eps"] == 1e-5 and bn["affine"]
    assert (bn["running_mean"] is None) == (mode == "train")
    assert network.param_shapes["bn1.weight"] == (8,) and "bn1.running_mean" not in network.param_shapes
    problem = make_problem(16, 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    assert np.abs(walked.output - autograd.output).max() <= 1e-12 * np.abs(autograd.output).max()
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter


def test_the_batch_statistics_matter_in_training_mode():
    """The backward's two mean terms are not small: dropping them changes conv1's gradient by O(1) of itself."""
    network = _dncnn("train")
    problem = make_problem(16, 2, 0, network=network)
    rules = {3: OPS["batch_norm2d"].port_slips(network.layers[3].attrs, (8, 16, 16))[1].rule()}
    slipped, right = forward_backward(problem, "float64", rules=rules), forward_backward(problem, "float64")
    change = np.abs(slipped.grads["conv1.weight"] - right.grads["conv1.weight"]).max()
    assert change > 0.1 * np.abs(right.grads["conv1.weight"]).max()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_pytorchs_own_float32_run_with_batch_norm_is_rounding(mode):
    network = _dncnn(mode)
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()


class StatisticsForm(Rule):
    """A float32 normalisation whose statistics are computed in another legitimate form (backward unchanged)."""

    def __init__(self, form: str, op: str = "batch_norm2d"):
        self.op, self.form = OPS[op], form

    def _statistics(self, x, attrs=None):
        attrs = attrs or {"training": True}
        if self.form == "two-pass":
            return self.op.statistics(attrs, x)
        viewed = self.op.view(attrs, x)
        dims = self.op.stat_dims
        kept = [d for d in range(viewed.dim()) if d not in dims]
        group_shape = tuple(1 if d in dims else n for d, n in enumerate(viewed.shape))
        columns = viewed.permute(*kept, *dims).reshape(-1, self.op.group_size(attrs, x))  # (groups, m)
        if self.form == "one-pass":  # E[x²] − μ², cuDNN's and others' single sweep
            mu = columns.mean(dim=1)
            var = (columns * columns).mean(dim=1) - mu * mu
        else:  # Welford's update, term by term
            mu, m2 = torch.zeros_like(columns[:, 0]), torch.zeros_like(columns[:, 0])
            for k in range(columns.shape[1]):
                delta = columns[:, k] - mu
                mu = mu + delta / (k + 1)
                m2 = m2 + delta * (columns[:, k] - mu)
            var = m2 / columns.shape[1]
        return mu.reshape(group_shape), var.reshape(group_shape)

    def forward(self, attrs, xs, params, kernels):
        mu, var = self._statistics(xs[0], attrs)
        xhat = ((self.op.view(attrs, xs[0]) - mu) * torch.rsqrt(var + attrs["eps"])).reshape(xs[0].shape)
        return self.op.scaled(attrs, xhat, params)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.op.backward(attrs, g, xs, y, params, kernels, need)


def _shifted(problem, shift: float):
    """The same problem with the head's bias raised: the batch norms' inputs get a mean far above their spread."""
    params = dict(problem.params)
    params["head.bias"] = params["head.bias"] + np.float32(shift)
    return problem.with_params(params)


@pytest.mark.parametrize("form", ["two-pass", "one-pass", "welford"])
@pytest.mark.parametrize("shift", [0.0, 20.0])
def test_every_legitimate_float32_form_of_the_statistics_is_rounding(form, shift):
    network = _dncnn("train")
    problem = _shifted(make_problem(24, 2, 0, network=network), shift)
    bns = [layer.index for layer in network.layers if layer.op == "batch_norm2d"]
    candidate = forward_backward(problem, "float32", rules={i: StatisticsForm(form) for i in bns})
    judgement = judge(candidate, reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()


def test_the_one_pass_form_errs_beyond_the_variances_scale_where_the_mean_is_large():
    """What the bound must cover: with |μ| ≫ σ the one-pass variance's error scales with E[x²], not with v."""
    network = _dncnn("train")
    problem = _shifted(make_problem(24, 2, 0, network=network), 20.0)
    bn = network.layers.index(next(layer for layer in network.layers if layer.op == "batch_norm2d"))
    trace = forward_backward(problem, "float64", keep_trace=True)
    x = torch.as_tensor(np.asarray(trace.value(bn - 1)), dtype=torch.float64)
    exact = StatisticsForm("two-pass")._statistics(x)[1]
    errors = {form: float(((StatisticsForm(form)._statistics(x.float())[1].double() - exact) / exact).abs().max())
              for form in ("two-pass", "one-pass")}
    assert errors["one-pass"] > 30 * errors["two-pass"], errors


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_a_batch_norm_slip_is_a_defect_with_its_cause(which):
    """The unbiased variance moves x̂ by 1/(2m) relatively: on 2·12² pixels (m = 288) 1.7e-3, beyond TF32's unit
    roundoff; on 2·24² (m = 1152) it is TF32's level, and a coarser format is named instead (never rounding)."""
    network = _dncnn("train")
    problem = make_problem(12, 2, 0, network=network)
    slip = OPS["batch_norm2d"].port_slips(network.layers[3].attrs, (8, 12, 12))[which]
    candidate = forward_backward(problem, "float32", rules={3: slip.rule()})
    judgement = judge(candidate, reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and slip.text in judgement.cause, judgement.to_text()
    if "unbiased" in slip.text:
        larger = make_problem(24, 2, 0, network=network)
        judged = judge(forward_backward(larger, "float32", rules={3: slip.rule()}), reference(larger))
        assert judged.verdict in ("defect", "reduced-precision"), judged.to_text()


def test_an_evaluation_mode_batch_norm_with_epsilon_outside_the_root_is_named():
    """ε outside the root moves r by √(v + ε)/(√v + ε) − 1: with Keras's default ε = 10⁻³ and these running variances
    (0.03 – 0.06) about 0.7%, on a 12² problem (at 24² the format doctor finds that level bfloat16's, at PyTorch's
    ε = 10⁻⁵ it is TF32's: neither is called rounding)."""
    network = _dncnn("eval", eps=1e-3)
    problem = make_problem(12, 2, 0, network=network)
    (slip,) = OPS["batch_norm2d"].port_slips(network.layers[3].attrs, (8, 12, 12))
    candidate = forward_backward(problem, "float32", rules={3: slip.rule(), 6: slip.rule()})
    judgement = judge(candidate, reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "ε outside the square root" in judgement.cause, judgement.to_text()


# ---------------------------------------------------------------------------------------------
# the example network, and the examples' PyTorch candidate with and without its planted slip


def test_the_dncnn_bn_example_walks_as_autograd_and_its_pytorch_run_is_rounding():
    from precision_lab.model import load_model
    from precision_lab.paths import ROOT

    network = load_model(ROOT / "examples" / "models" / "dncnn-bn.json")
    assert [layer.op for layer in network.layers].count("batch_norm2d") == 2
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
        for parameter, expected in autograd.grads.items():
            assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()


@pytest.mark.slow
@pytest.mark.parametrize("yaml_name, verdict_, cause", [
    ("dncnn-bn.yaml", "roundoff", None),
    ("dncnn-bn-statistics-slip.yaml", "defect", "backward treats the batch statistics as constants")])
def test_the_dncnn_bn_candidates_are_judged_with_their_cause(capsys, tmp_path, yaml_name, verdict_, cause):
    import json

    from precision_lab import cli
    from precision_lab.paths import ROOT

    out_json = tmp_path / "verdict.json"
    code = cli.main(["diagnose", "--candidate", str(ROOT / "examples" / "models" / yaml_name), "--size", "16x16",
                     "--batch", "2", "--probes", "none", "--json", str(out_json)])
    capsys.readouterr()
    verdict = json.loads(out_json.read_text())
    assert code == (0 if cause is None else 1) and verdict["verdict"] == verdict_, verdict["evidence"]
    if cause is not None:
        assert cause in (verdict["cause"] or ""), verdict["cause"]


# ---------------------------------------------------------------------------------------------
# group_norm


class GroupNormGELU(nn.Module):
    """conv–GroupNorm–GELU twice, then a conv: a GroupNorm network as diffusion U-Nets build their blocks."""

    def __init__(self):
        super().__init__()
        self.stem, self.gn1 = nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.body, self.gn2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.head = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        return self.head(F.gelu(self.gn2(self.body(F.gelu(self.gn1(self.stem(x)))))))


def _gn_network():
    torch.manual_seed(0)
    return from_module(GroupNormGELU(), name="gn-gelu")


def test_group_norm_converts_and_walks_as_autograd():
    network = _gn_network()
    assert [layer.op for layer in network.layers] == ["conv2d", "group_norm", "gelu", "conv2d", "group_norm", "gelu",
                                                      "conv2d"]
    assert network.layers[4].attrs == {"groups": 4, "channels": 8, "eps": 1e-5, "affine": True}
    problem = make_problem(16, 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    assert abs(walked.loss - autograd.loss) <= 1e-12 * abs(autograd.loss)
    for parameter, expected in autograd.grads.items():
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-11 * np.abs(expected).max(), parameter


@pytest.mark.parametrize("spec", [None, "gn-gelu.json"])
def test_pytorchs_own_float32_run_with_group_norm_is_rounding(spec):
    from precision_lab.model import load_model
    from precision_lab.paths import ROOT

    network = _gn_network() if spec is None else load_model(ROOT / "examples" / "models" / spec)
    for seed in (0, 1):
        problem = make_problem(24, 2, seed, network=network)
        judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
        assert judgement.verdict == "roundoff", judgement.to_text()


@pytest.mark.parametrize("form", ["one-pass", "welford"])
def test_group_norms_legitimate_float32_statistics_are_rounding(form):
    network = _gn_network()
    problem = make_problem(24, 2, 0, network=network)
    rules = {i: StatisticsForm(form, "group_norm") for i, layer in enumerate(network.layers) if layer.op == "group_norm"}
    judgement = judge(forward_backward(problem, "float32", rules=rules), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()


@pytest.mark.parametrize("which, says", [(0, "over one group (a layer norm"), (1, "each channel on its own")])
def test_a_group_norm_with_the_wrong_group_count_is_named(which, says):
    network = _gn_network()
    problem = make_problem(24, 2, 0, network=network)
    slip = OPS["group_norm"].port_slips(network.layers[1].attrs, (8, 24, 24))[which]
    judgement = judge(forward_backward(problem, "float32", rules={1: slip.rule()}), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and says in judgement.cause and "gn1" in judgement.cause, judgement.to_text()


@pytest.mark.parametrize("name", ["train", "eval", "gn"])
def test_every_zoo_verdict_is_right_on_a_normalised_network(name):
    """Legitimate summation orders and algorithms around the normalisations are roundoff, the zoo's defects, layouts
    and formats named; micro-batching is left out where training-mode batch statistics make each micro-batch
    another function."""
    from precision_lab.calibration import judge_zoo

    network = _gn_network() if name == "gn" else _dncnn(name)
    table = judge_zoo(make_problem(24, 2, 1, network=network), "cpu")
    assert ("micro-batched" in set(table["candidate"])) == (name != "train")
    assert len(table) >= 24
    # TF32's |W|·E bound through two training-mode batch norms was infinite; sampled through the backward, it certifies
    assert list(table[table["candidate"] == "tf32-claimed"]["verdict"]) == ["roundoff"]
    wrong = table[~table["correct"]]
    assert wrong.empty, wrong[["candidate", "expected", "verdict", "detail", "worst_ratio"]].to_string()


# ---------------------------------------------------------------------------------------------
# the batch's coupling in the error model


def test_a_training_batch_norm_couples_the_errors_of_every_later_quantity():
    """Training-mode statistics share their errors among the samples: every field after the batch norm, and every
    gradient field of the backward, is marked coupled; evaluation mode with float32 statistics and group norm are not."""
    from precision_lab import errmodel
    from precision_lab.ops import Field

    seen = []
    original = errmodel._combine

    def spy(contributions, g, ctx):
        seen.extend(c.coupled for c in contributions)
        return original(contributions, g, ctx)

    for network, coupled in ((_dncnn("train"), True), (_dncnn("eval"), False), (_gn_network(), False)):
        seen.clear()
        problem = make_problem(16, 2, 0, network=network)
        errmodel._combine = spy
        try:
            errmodel.error_bounds(reference(problem), "float32")
        finally:
            errmodel._combine = original
        assert seen and all(c == coupled for c in seen), (network.name, seen)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    field = OPS["batch_norm2d"].forward_error(OPS["batch_norm2d"].normalise({"channels": 4}),
                                              [Field(x, torch.full_like(x, 1e-6), 1)], x, {}, _context())
    assert field.coupled and field.radius is None


def _context():
    from precision_lab.errmodel import bound_kernels
    from precision_lab.ops import BoundContext

    return BoundContext("float32", 2.0 ** -24, 7.0, bound_kernels(torch.device("cpu")))


def test_coupled_errors_are_summed_as_fully_dependent():
    """Hoeffding's side with χ* = n is never below the deterministic sum (Cauchy–Schwarz): coupled errors get it."""
    from precision_lab import roundoff

    assert roundoff.dependency_count(None, 64, coupled_terms=128) == 128
    assert roundoff.dependency_count(None, 64) == 64 and roundoff.dependency_count(1, 64) == 25
    c, e = torch.rand(128, dtype=torch.float64), torch.rand(128, dtype=torch.float64)
    deterministic, squares = (c * e).sum(), (c * c * e * e).sum()
    assert float(roundoff.sum_of_errors(deterministic, squares, 128, 7.0)) == float(deterministic)
    assert float(roundoff.sum_of_errors(deterministic, squares, 25, 7.0)) < float(deterministic) * 7.0 * 25 ** 0.5 / 128 ** 0.5 * 1.5


def test_a_tf32_claim_through_two_batch_norms_is_certified_and_a_scaled_gradient_is_not():
    """Under TF32's worst case two batch norms leave |W|·E infinite (docs/error-model.md, "Normalisation"); the
    reduced format's sampled bound through the backward ("Reduced formats") is finite and certifies a right program
    claimed TF32, and a gradient 5% large is a defect under a TF32 claim as under a float32 one."""
    from precision_lab import errmodel
    from precision_lab.model import load_model

    problem = make_problem(24, 2, 0, network=load_model("examples/models/dncnn-bn.json"))
    trace = reference(problem)
    bound = errmodel.error_bounds(trace, "tf32")["body1.weight"]
    assert np.isfinite(bound.bound).all() and bound.sampled == bound.bound.size  # every element sampled
    run = autograd_forward_backward(problem, "float32")
    claimed = judge(run, trace, "tf32")
    assert claimed.verdict == "roundoff", claimed.to_text()
    run.grads["body1.weight"] = run.grads["body1.weight"] * 1.05
    assert judge(run, trace, "tf32").quantities["body1.weight"].verdict == "defect"
    assert judge(run, trace, "float32").verdict == "defect"


class DeepDnCNN(nn.Module):
    """The DnCNN layout at depth: conv–ReLU, then conv–BN–ReLU blocks, a conv, and x − f(x)."""

    def __init__(self, depth: int, channels: int):
        super().__init__()
        layers = [nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Conv2d(channels, 1, 3, padding=1))

    def forward(self, x):
        return x - self.body(x)


def test_a_deep_batch_norm_stack_keeps_its_parameters_own_bounds_finite():
    """Through six training-mode batch norms the worst-case upstream error leaves no relative accuracy, but a batch
    norm's own rounding does not depend on it: every γ's own part stays finite, the sampled propagation bounds the
    rest, PyTorch's float32 run is roundoff and a first layer's gradient 1% short is a defect."""
    from precision_lab import errmodel

    torch.manual_seed(0)
    problem = make_problem(16, 2, 0, network=from_module(DeepDnCNN(8, 8), name="dncnn-8"))
    trace = reference(problem)
    bounds = errmodel.error_bounds(trace, "float32")
    for name in problem.network.parameter_names:
        assert np.isfinite(bounds[name].accumulation).all(), name
        assert np.isfinite(bounds[name].bound).all(), name
    run = autograd_forward_backward(problem, "float32")
    judgement = judge(run, trace)
    assert judgement.verdict == "roundoff", judgement.to_text()
    run.grads["body.0.weight"] = run.grads["body.0.weight"] * 0.99
    assert judge(run, trace).quantities["body.0.weight"].verdict == "defect"


class NormedHead(nn.Module):
    """A classifier head with a layer norm over its hidden features (a transformer's MLP head)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc1 = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 32)
        self.norm, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 5)

    def forward(self, x):
        h = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1), 1)
        return self.fc2(F.gelu(self.norm(self.fc1(h))))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_layer_norm_over_features_walks_as_autograd_and_its_pytorch_run_is_roundoff(seed):
    torch.manual_seed(seed)
    network = from_module(NormedHead(), loss="cross_entropy")
    assert [layer.op for layer in network.layers][4:6] == ["linear", "layer_norm"]
    problem = make_problem(16, 2, seed, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name, expected in autograd.grads.items():
        assert np.abs(walked.grads[name] - expected).max() <= 1e-12 * np.abs(expected).max(), name
    judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()


def test_a_layer_norm_whose_backward_holds_its_statistics_is_named():
    network = from_module(NormedHead(), loss="cross_entropy")
    index = next(i for i, layer in enumerate(network.layers) if layer.op == "layer_norm")
    problem = make_problem(16, 2, 0, network=network)
    slip = OPS["layer_norm"].port_slips(network.layers[index].attrs, (32,))[0]
    judgement = judge(forward_backward(problem, "float32", rules={index: slip.rule()}), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "statistics as constants" in judgement.cause, judgement.to_text()


@pytest.mark.parametrize("module, says", [
    (nn.LayerNorm([4, 8, 8]), "last axis only"), (nn.LayerNorm(8, bias=False), "no bias")])
def test_a_layer_norm_the_spec_cannot_hold_is_refused_with_the_alternative(module, says):
    from precision_lab.ops import OpSpecError

    with pytest.raises(OpSpecError, match=says):
        OPS["layer_norm"].from_torch_module(module)


class NormedNet(nn.Module):
    """A batch norm after a bias-free conv and a layer norm in the classifier head, to export to ONNX."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.fc = nn.Conv2d(8, 4, 3, padding=1), nn.Linear(4, 16)
        self.norm, self.out = nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.flatten(F.adaptive_avg_pool2d(self.c2(F.relu(self.bn(self.c1(x)))), 1), 1)
        return self.out(F.gelu(self.norm(self.fc(h))))


@pytest.mark.parametrize("training", [True, False])
def test_an_onnx_export_reads_batch_and_layer_norms_as_from_module_and_computes_as_the_module(training, tmp_path):
    pytest.importorskip("onnx")
    import io
    import warnings

    from precision_lab.modules import SpecModule
    from precision_lab.model import read_onnx

    torch.manual_seed(0)
    module = NormedNet()
    module(torch.randn(4, 1, 16, 16))  # running statistics other than PyTorch's fresh 0 and 1
    module.train(training)
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's notices; unfolded, so the batch norm stays a node
        warnings.simplefilter("ignore")
        torch.onnx.export(module, torch.randn(2, 1, 16, 16), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], do_constant_folding=False, dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}},
                          training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL)
    path = tmp_path / "normed.onnx"
    path.write_bytes(buffer.getvalue())
    imported, params = read_onnx(path, loss="cross_entropy")
    converted = from_module(module, loss="cross_entropy", input_channels=1)
    assert [(layer.op, layer.attrs) for layer in imported.layers] == [(layer.op, layer.attrs) for layer in converted.layers]
    assert imported.param_shapes == converted.param_shapes
    lab = SpecModule(imported, dtype=torch.float64)
    lab.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()})
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = module.double()(x)
        assert (lab(x) - expected).abs().max() <= 1e-12 * expected.abs().max()


@pytest.mark.parametrize("name", ["body1.weight", "bn1.bias"])
def test_a_gradient_summed_over_one_sample_is_named_where_batch_statistics_couple_the_samples(name):
    """Batch statistics make a batch of one another function: the slip is one sample's part of the batch's backward
    (its upstream gradient kept on one sample), built here from the reference's stored operands."""
    from precision_lab.model import load_model

    network = load_model("examples/models/dncnn-bn.json")
    problem = make_problem(24, 2, 0, network=network)
    trace = reference(problem)
    layer = network.layers[network.index_of(name.split(".")[0])]
    g = trace.grad_at(layer.index).double()[:1]
    if name.endswith("bias"):
        part = g.sum(dim=(0, 2, 3))
    else:
        x = trace.value(layer.inputs[0]).double()[:1]
        part = torch.nn.grad.conv2d_weight(x, network.param_shapes[name], g, padding=1)
    run = autograd_forward_backward(problem, "float32")
    run.grads[name] = part.numpy().astype(np.float32)
    judgement = judge(run, trace)
    assert judgement.verdict == "defect" and judgement.cause == "sample 0 of the batch only", judgement.to_text()
