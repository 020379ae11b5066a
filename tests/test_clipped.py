"""MobileNet's clipped and hard activations (ops/clipped.py) and its squeeze-excitation gate (mul of a per-channel
factor): their rules against autograd, their float32 error within the bound, slips caught, torchvision's models."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab import formats
from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.modules import from_module
from precision_lab.ops import OPS, BoundContext, Field, GradField, Kernels
from precision_lab.ops.clipped import BackwardOf
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge

U32 = formats.UNIT_ROUNDOFF["float32"]
CASES = [("hardtanh", {"min_val": 0.0, "max_val": 6.0}, lambda t: F.relu6(t)),
         ("hardtanh", {"min_val": -0.5, "max_val": 2.0}, lambda t: F.hardtanh(t, -0.5, 2.0)),
         ("hardsigmoid", {}, F.hardsigmoid), ("hardswish", {}, F.hardswish)]


def _inputs() -> torch.Tensor:
    """float32 values: spread, dense around the kinks ±3, 0, 6, and far out."""
    generator = torch.Generator().manual_seed(0)
    return torch.cat([4 * torch.randn(20000, generator=generator), torch.linspace(-3.01, 6.01, 20001),
                      100 * torch.randn(500, generator=generator)]).float()


def _exact_slope(name, attrs, z):
    """f' from the formula (PyTorch's float64 hardsigmoid backward multiplies by float32's 1/6: not used)."""
    lo, hi = (attrs["min_val"], attrs["max_val"]) if name == "hardtanh" else (-3.0, 3.0)
    inside = (z > lo) & (z < hi)
    if name == "hardtanh":
        return inside.double()
    if name == "hardsigmoid":
        return inside.double() / 6
    return torch.where(z < -3, 0.0, torch.where(z <= 3, (2 * z + 3) / 6, 1.0)).double()


@pytest.mark.parametrize("name, attrs, function", CASES)
def test_forward_and_backward_are_autograds_in_float64(name, attrs, function):
    op, z = OPS[name], _inputs().double()
    attrs = op.normalise(attrs)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(op.forward(attrs, [z], {}, None), function(z))
    (mine,), _ = op.backward(attrs, g, [z], None, {}, None, [True])
    # the formula's (2z + 3)/6 against the op's z/3 + ½: three float64 roundings apart, γ₃ < 2⁻⁵⁰ (Higham §3.1)
    assert bool(((mine - g * _exact_slope(name, attrs, z)).abs() <= 2.0 ** -50 * g.abs() * (z.abs() / 3 + 1)).all())
    if name != "hardsigmoid":  # PyTorch's float64 hardsigmoid backward multiplies by float32's 1/6 (checked below)
        leaf = z.clone().requires_grad_()
        (expected,), = [torch.autograd.grad(function(leaf), leaf, g)]
        assert torch.equal(mine, expected)


def test_pytorchs_float64_hardsigmoid_gradient_is_off_by_float32s_one_sixth():
    leaf = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    (slope,) = torch.autograd.grad(F.hardsigmoid(leaf).sum(), leaf)
    assert float(slope[0]) == float(np.float32(1 / 6)) != 1 / 6  # 3·10⁻⁸ relative: why the walk keeps 1/6 exact


@pytest.mark.parametrize("name, attrs, function", CASES)
def test_float32_error_is_within_its_own_bound_and_a_few_bounds_more_is_not(name, attrs, function):
    """PyTorch's float32 forward and backward against the float64 values of the same float32 input: within the own
    rounding bound; the largest error is a sizeable part of it (the bound is not vacuous)."""
    op, ctx = OPS[name], BoundContext("float32", U32, 7.0, Kernels())
    attrs = op.normalise(attrs)
    z32 = _inputs()
    z = z32.double()
    y = function(z)
    out = op.forward_error(attrs, [Field(z, None)], y, {}, ctx)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(2)).double()
    leaf = z32.clone().requires_grad_()
    (h32,) = torch.autograd.grad(function(leaf), leaf, g.float())
    (grad,), _ = op.backward_error(attrs, g, GradField(torch.zeros_like(z)), [Field(z, None)], out, {}, ctx, [True])
    for got, exact, bound in ((function(z32).double(), y, out.error), (h32.double(), g * _exact_slope(name, attrs, z),
                                                                        grad.error)):
        bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(exact)
        error = (got - exact).abs()
        assert bool((error <= bound).all())
        if name != "hardtanh":  # hardtanh is exact: a zero bound, and any error at all fails it
            assert float((error / bound.clamp_min(1e-300)).max()) > 0.3
        planted = got + 3 * bound * torch.sign(torch.randn_like(got))  # three bounds: caught wherever it is nonzero
        assert bool(((planted - exact).abs() > bound)[bound > 0].all())


def test_an_error_at_a_kink_flips_the_gradient_within_the_bound():
    """z = 6 ± E: the candidate may pass or block the gradient there, so |g| enters the flips part (a ReLU's flips)."""
    op, ctx = OPS["hardtanh"], BoundContext("float32", U32, 7.0, Kernels())
    attrs = op.normalise({"min_val": 0.0, "max_val": 6.0})
    z = torch.tensor([6.0 - 1e-6, 6.0 + 1e-6, 3.0, 7.0, -1.0], dtype=torch.float64)
    error = torch.full_like(z, 1e-5)
    out = op.forward_error(attrs, [Field(z, error.clone())], F.relu6(z), {}, ctx)
    assert out.memo["flip_count"] == 2 and out.flips == 2
    assert float(out.error[3:].abs().max()) == 0.0  # 7 ≥ 6 + E and −1 ≤ 0 − E are clamped: exact
    g = torch.tensor([2.0, -3.0, 1.0, 5.0, 7.0], dtype=torch.float64)
    (grad,), _ = op.backward_error(attrs, g, GradField(torch.zeros_like(z)), [Field(z, error)], out, {}, ctx, [True])
    assert torch.equal(grad.flips[:2], g[:2].abs()) and float(grad.flips[2:].abs().max()) == 0.0


class MobileBlock(nn.Module):
    """A MobileNetV3-like block: ReLU6, a depthwise convolution, hardswish, a squeeze-excitation gate of hardsigmoid."""

    def __init__(self):
        super().__init__()
        self.stem, self.act = nn.Conv2d(2, 8, 3, padding=1), nn.ReLU6()
        self.dw, self.swish = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardswish()
        self.squeeze, self.excite = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.head = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        h = self.swish(self.dw(self.act(4 * self.stem(x))))  # 4×: some pre-activations above 6
        gate = F.hardsigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(h, 1)))))
        return self.head(gate * h)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    network = from_module(MobileBlock(), loss="mse", input_channels=2)
    problem = make_problem(24, 2, 0, network=network)
    return network, problem, reference(problem)


def test_the_block_converts_and_walks_as_autograd(block):
    network, problem, _ = block
    assert [layer.op for layer in network.layers] == ["conv2d", "scale", "hardtanh", "conv2d", "hardswish",
                                                      "global_avg_pool2d", "conv2d", "relu", "conv2d", "hardsigmoid",
                                                      "mul", "conv2d"]
    walked = forward_backward(problem, "float64")
    autograd = autograd_forward_backward(problem, "float64")
    for name, expected in autograd.grads.items():
        # PyTorch's float64 hardsigmoid backward takes float32's 1/6 (3·10⁻⁸ relative): the gate's path carries it
        assert np.abs(walked.grads[name] - expected).max() <= 1e-7 * np.abs(expected).max(), name


def test_pytorchs_float32_run_of_the_block_is_rounding_and_a_relu6_slip_is_named(block):
    network, problem, trace = block
    assert float(np.sum(trace.value(1).numpy() > 6)) > 0  # the slip below has elements to show on
    assert judge(autograd_forward_backward(problem, "float32"), trace).verdict == "roundoff"
    index = next(layer.index for layer in network.layers if layer.op == "hardtanh")
    relu_backward = BackwardOf(OPS["hardtanh"], lambda attrs, x: (x > 0).to(x.dtype))
    judgement = judge(forward_backward(problem, "float32", rules={index: relu_backward}), trace)
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "gradient passed above 6" in judgement.cause, judgement.to_text()
    index = next(layer.index for layer in network.layers if layer.op == "hardswish")
    unswitched = BackwardOf(OPS["hardswish"], lambda attrs, x: x / 3 + 0.5)  # (2x + 3)/6 below −3 and above 3 too
    judgement = judge(forward_backward(problem, "float32", rules={index: unswitched}), trace, hypotheses=False)
    assert judgement.verdict == "defect"


def _module_gradients(module, problem, loss=None):
    """The module's float64 autograd (loss and parameter gradients) at the problem's parameters and input."""
    module = module.double()
    state = module.state_dict()
    with torch.no_grad():
        for key, value in problem.params.items():
            state[key].copy_(torch.from_numpy(value))
    output = module(torch.from_numpy(problem.input).double())
    loss = loss(output, torch.from_numpy(problem.target).double()) if loss else F.cross_entropy(
        output, torch.from_numpy(problem.target).long())
    names = [name for name, _ in module.named_parameters()]
    return float(loss.detach()), dict(zip(names, (g.numpy() for g in torch.autograd.grad(loss, list(module.parameters())))))


class ExactHardsigmoid(nn.Module):
    """relu6(x + 3)/6: nn.Hardsigmoid's function with the exact 1/6 in its float64 gradient."""

    def forward(self, x):
        return F.relu6(x + 3) / 6


def _torchvision_model(name: str):
    models = pytest.importorskip("torchvision", reason="torchvision installs with make setup").models
    torch.manual_seed(0)
    model = getattr(models, name)(num_classes=10).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()  # its draw is PyTorch's own: the walk's dropout would draw another
    return model


@pytest.mark.parametrize("name, stages", [("mobilenet_v2", 4), ("mobilenet_v3_small", 5)])
def test_torchvisions_mobilenets_convert_and_walk_as_their_own_autograd(name, stages):
    model = _torchvision_model(name)
    # float64 depthwise convolutions are slow on a CPU: the first inverted residuals only (v3's fifth: hardswish, SE)
    model.features = model.features[:stages]
    channels = model.features(torch.zeros(1, 3, 32, 32)).shape[1]
    first = next(i for i, m in enumerate(model.classifier) if isinstance(m, nn.Linear))
    model.classifier[first] = nn.Linear(channels, model.classifier[first].out_features)
    network = from_module(model, loss="cross_entropy")
    ops = {layer.op for layer in network.layers}
    assert {"hardtanh"} <= ops if name == "mobilenet_v2" else {"hardswish", "hardsigmoid", "mul"} <= ops
    problem = make_problem(32, 2, 0, network=network)
    walked = forward_backward(problem, "float64")
    for module in list(model.modules()):
        for child_name, child in module.named_children():
            if isinstance(child, nn.Hardsigmoid):
                setattr(module, child_name, ExactHardsigmoid())
    loss, grads = _module_gradients(model, problem)
    assert abs(walked.loss - loss) <= 1e-12 * abs(loss)
    largest = max(np.abs(g).max() for g in grads.values())
    for parameter, expected in grads.items():
        # a batch-normalised layer's bias upstream of another batch norm has an exactly-zero gradient: its float64
        # rounding noise is allowed at 10⁻¹⁴ (about 50 units of 2⁻⁵³) of the network's largest gradient
        bound = 1e-10 * np.abs(expected).max() + 1e-14 * largest
        assert np.abs(walked.grads[parameter] - expected).max() <= bound, parameter


@pytest.mark.parametrize("name, ops", [("mobilenet_v2", {"hardtanh"}),
                                       ("mobilenet_v3_small", {"hardswish", "hardsigmoid", "mul", "relu"})])
def test_the_whole_torchvision_mobilenets_convert(name, ops):
    network = from_module(_torchvision_model(name), loss="cross_entropy")
    assert ops <= {layer.op for layer in network.layers}
    relu6 = [layer for layer in network.layers if layer.op == "hardtanh"]
    assert all((layer.attrs["min_val"], layer.attrs["max_val"]) == (0.0, 6.0) for layer in relu6)


def test_pytorchs_onnx_export_of_the_block_reads_as_from_module(tmp_path):
    """nn.ReLU6 exports as Clip(0, 6), Hardswish as HardSwish, hardsigmoid as HardSigmoid (alpha 1/6), the gate as a
    broadcasting Mul: read back, the same layers, computing the module's output."""
    pytest.importorskip("onnx")
    import io
    import warnings

    from precision_lab.model import read_onnx
    from precision_lab.modules import SpecModule

    torch.manual_seed(0)
    module = MobileBlock().eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice: it needs no onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, torch.randn(1, 2, 16, 16), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    path = tmp_path / "block.onnx"
    path.write_bytes(buffer.getvalue())
    imported, params = read_onnx(path, loss="mse")
    converted = from_module(module, loss="mse", input_channels=2)
    assert [(layer.op, layer.attrs) for layer in imported.layers] == [(layer.op, layer.attrs) for layer in
                                                                    converted.layers]
    x = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    lab = SpecModule(imported, dtype=torch.float64)
    lab.load_state_dict({k: torch.from_numpy(np.array(v)).double() for k, v in params.items()})
    expected = module.double()(x)
    # float64 sums of a few hundred terms, as tests/test_onnx_import.py: ≈ 1e-13 of the output's scale
    assert (lab(x) - expected).abs().max() <= 1e-12 * expected.abs().max()


def test_a_hardtanh_whose_bounds_are_out_of_order_is_refused_in_one_line():
    from precision_lab.model import ModelSpecError, parse_spec

    with pytest.raises(ModelSpecError, match="'min_val' 6 is not below 'max_val' 0: swap them"):
        parse_spec({"input_channels": 1, "loss": "mse", "layers": [
            {"name": "conv", "op": "conv2d", "in": 1, "out": 2, "kernel": 3, "padding": 1},
            {"op": "hardtanh", "min_val": 6, "max_val": 0}]})


def test_efficientnets_squeeze_excitation_gate_walks_as_its_autograd():
    """torchvision.ops.SqueezeExcitation (EfficientNet's, SiLU inside): scale (N, C, 1, 1) · input (N, C, H, W) is a
    mul whose factor's gradient sums over H·W."""
    ops = pytest.importorskip("torchvision", reason="torchvision installs with make setup").ops

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = ops.Conv2dNormActivation(2, 16, activation_layer=nn.SiLU)
            self.se, self.head = ops.SqueezeExcitation(16, 4, activation=nn.SiLU), nn.Conv2d(16, 1, 1)

        def forward(self, x):
            return self.head(self.se(self.stem(x)))

    torch.manual_seed(0)
    module = Block()
    network = from_module(module, loss="mse", input_channels=2)
    assert [layer.op for layer in network.layers][3:9] == ["global_avg_pool2d", "conv2d", "silu", "conv2d", "sigmoid",
                                                           "mul"]
    problem = make_problem(16, 2, 0, network=network)
    walked = forward_backward(problem, "float64")
    loss, grads = _module_gradients(module, problem, F.mse_loss)
    assert abs(walked.loss - loss) <= 1e-12 * abs(loss)
    largest = max(np.abs(g).max() for g in grads.values())
    for parameter, expected in grads.items():  # the zero-gradient floor as for the MobileNets above
        assert np.abs(walked.grads[parameter] - expected).max() <= 1e-10 * np.abs(expected).max() + 1e-14 * largest


def test_a_reduced_formats_flips_at_both_kinks_are_bernoulli_jumps():
    """switch_flips: each element near a kink flips with switching.flip_probability, moving its gradient by the
    derivative across the kink minus its own; far from both kinks nothing flips."""
    from precision_lab import switching

    x = torch.tensor([1e-3, 6 - 2e-3, 3.0, -3 + 1e-3, 3 - 1e-3], dtype=torch.float64)
    g = torch.tensor([2.0, -3.0, 5.0, 7.0, 11.0], dtype=torch.float64)
    variance, samples = torch.full_like(x, 1e-6), 64
    p = switching.flip_probability(torch.tensor([1e-3, 2e-3]), torch.tensor(1e-6), samples).double()
    relu6 = OPS["hardtanh"]
    mean, spread, expected = relu6.switch_flips(relu6.normalise({"min_val": 0.0, "max_val": 6.0}), x[:3], variance[:3],
                                                g[:3], samples)
    assert torch.allclose(mean, torch.stack([-g[0] * p[0], -g[1] * p[1], torch.tensor(0.0).double()]), rtol=1e-6)
    assert float(spread[2]) == 0.0 and expected == pytest.approx(float(p.sum()), rel=1e-6)
    swish = OPS["hardswish"]
    mean, _, _ = swish.switch_flips({}, x[3:], variance[3:], g[3:], samples)
    slopes = x[3:] / 3 + 0.5  # −½ just above −3 (across: 0), 3/2 just below 3 (across: 1)
    assert torch.allclose(mean, torch.stack([(0 - slopes[0]) * g[3], (1 - slopes[1]) * g[4]]) * p[0], rtol=1e-6)
