"""The idioms of torchvision's models and of hand-written modules convert: stochastic depth, a concat of one or of
many tensors, a mean over height and width, a module's parameter used as a tensor (layer scale, positional
embedding), ConvNeXt's layer norm over channels; each walks as the module's own autograd in float64 and its float32
error stays within its bound, which a planted slip exceeds."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import ModelSpecError
from precision_lab.modules import from_module
from precision_lab.ops import LOSSES, OPS, BoundContext, Field, Kernels
from precision_lab.ops.dropout import DropoutSlip, gamma_k
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge
from walk_checks import assert_pytorch_float32_is_roundoff, assert_walks_as_autograd

U32 = 2.0 ** -24


def assert_walks_as_the_module(module: nn.Module, problem, masks_from=None) -> None:
    """The lab's float64 walk of the converted spec equals the original module's autograd in float64: the loss and
    every parameter gradient to 1e-10 relative (the module reads the problem's parameters by their state_dict names)."""
    module = module.double()
    params = {name: torch.from_numpy(value).double() for name, value in problem.params.items()}
    missing, unexpected = module.load_state_dict(params, strict=False)
    assert not unexpected and all(name.endswith(("running_mean", "running_var", "num_batches_tracked"))
                                  for name in missing), missing
    if masks_from is not None:
        masks_from()
    y = module(torch.from_numpy(problem.input).double())
    loss = LOSSES[problem.network.loss].torch_loss(y, torch.from_numpy(problem.target))
    loss.backward()
    walked = forward_backward(problem, "float64")
    assert abs(walked.loss - loss.item()) <= 1e-10 * abs(loss.item())
    grads = dict(module.named_parameters())
    assert set(walked.grads) == set(grads)
    for name, value in grads.items():
        expected = value.grad.numpy()
        assert np.abs(walked.grads[name] - expected).max() <= 1e-10 * np.abs(expected).max(), name


# ---------------------------------------------------------------------------------------------------------------
# a mean over height and width, a concat of one tensor


class MeanHead(nn.Module):
    """A hand-written classifier ending in a mean over the image (`h.mean(dim=(2, 3))`)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv, self.fc = nn.Conv2d(2, 6, 3, padding=1), nn.Linear(6, 4)

    def forward(self, x):
        h = F.relu(self.conv(x))
        h = torch.cat([h], 1)  # DenseNet's concat of a list of one: the tensor itself
        if self.how == "tuple":
            h = h.mean(dim=(2, 3))
        elif self.how == "list":
            h = torch.mean(h, [-2, -1])
        else:
            h = h.mean(dim=(2, 3), keepdim=True).flatten(1)
        return self.fc(h)


@pytest.mark.parametrize("how", ["tuple", "list", "keepdim"])
def test_a_mean_over_height_and_width_is_a_global_average_pool(how):
    torch.manual_seed(0)
    module = MeanHead(how)
    network = from_module(module, loss="cross_entropy")
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "global_avg_pool2d", "flatten", "linear"]
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_the_module(module, problem)
    if how == "tuple":  # the same layers whichever way it is written: one float32 judgement
        assert_pytorch_float32_is_roundoff(problem)


def test_a_mean_over_other_axes_is_refused_in_one_line():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3)

        def forward(self, x):
            return self.conv(x).mean(dim=(1, 2))

    with pytest.raises(ModelSpecError, match=r"mean over \(1, 2\): only over one axis.*or over an image's height and "
                                             r"width \(dim=\(2, 3\)\)$"):
        from_module(Odd(), input_channels=2)


# ---------------------------------------------------------------------------------------------------------------
# a module's parameter used as a tensor


class Scaled(nn.Module):
    """A residual block with ConvNeXt's layer scale γ (C, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.layer_scale = nn.Parameter(torch.rand(4, 1, 1) + 0.5)

    def forward(self, x):
        return x + self.layer_scale * F.gelu(self.conv(x))


class ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = nn.Conv2d(2, 4, 3, padding=1), Scaled(), nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


class Embedded(nn.Module):
    """A ViT-style encoder: patches as tokens, a learned positional embedding added, a layer norm, a dense layer."""

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens, dim) * 0.1)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.pos_embedding
        return x + self.mlp(self.norm(x))


class TinyViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 8, 4, stride=4)
        self.encoder, self.head = Embedded(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(x).mean(dim=1))


def test_a_layer_scale_keeps_its_state_dict_name_and_walks_as_the_module():
    torch.manual_seed(0)
    module = ScaledNet()
    network = from_module(module)
    assert [layer.op for layer in network.layers] == ["conv2d", "conv2d", "gelu", "scale_by_parameter", "add",
                                                      "conv2d"]
    assert network.param_shapes["block.layer_scale"] == (4, 1, 1)
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_the_module(module, problem)
    assert_walks_as_autograd(problem)
    assert_pytorch_float32_is_roundoff(problem)


def test_a_positional_embedding_keeps_its_state_dict_name_and_walks_as_the_module():
    torch.manual_seed(0)
    module = TinyViT()
    network = from_module(module, loss="cross_entropy")
    ops = [layer.op for layer in network.layers]
    assert ops[:4] == ["conv2d", "flatten_pixels", "transpose", "add_parameter"]
    assert network.param_shapes["encoder.pos_embedding"] == (1, 16, 8)
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_the_module(module, problem)
    assert_pytorch_float32_is_roundoff(problem)


@pytest.mark.parametrize("op, text", [("scale_by_parameter", "backward passes the gradient unscaled"),
                                      ("scale_by_parameter", "averages layer_scale's gradient over the batch"),
                                      ("add_parameter", "averages pos_embedding's gradient over the batch")])
def test_a_parameter_ops_slip_is_a_defect(op, text):
    torch.manual_seed(0)
    network = from_module(ScaledNet()) if op == "scale_by_parameter" else from_module(TinyViT(), loss="cross_entropy")
    index = next(layer.index for layer in network.layers if layer.op == op)
    slip = next(s for s in OPS[op].port_slips(network.layers[index].attrs, ()) if text in s.text)
    problem = make_problem(16, 2, 0, network=network)
    judgement = judge(forward_backward(problem, "float32", rules={index: slip.rule()}), reference(problem))
    assert judgement.verdict == "defect", judgement.to_text()


def test_a_parameter_of_the_top_module_and_a_class_token_are_refused_in_one_line():
    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.offset = nn.Conv2d(2, 3, 3), nn.Parameter(torch.zeros(3, 1, 1))

        def forward(self, x):
            return self.conv(x) + self.offset

    class Token(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.embed = nn.Conv2d(2, 3, 1), nn.Module()
            self.embed.class_token = nn.Parameter(torch.zeros(1, 1, 3))

        def forward(self, x):
            x = self.conv(x).flatten(2).transpose(1, 2)
            return torch.cat([self.embed.class_token.expand(x.shape[0], -1, -1), x], dim=1)

    with pytest.raises(ModelSpecError, match=r"reads the top module's own parameter offset: .* hold it in a "
                                             r"submodule$"):
        from_module(Top())
    with pytest.raises(ModelSpecError, match=r"expand of the parameter embed.class_token: .* a class token .* not "
                                             r"supported$"):
        from_module(Token())


# ---------------------------------------------------------------------------------------------------------------
# stochastic depth


class Residual(nn.Module):
    """Two residual blocks whose branch is dropped per sample (or per batch) by torchvision's stochastic depth."""

    def __init__(self, mode: str, p: float):
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.stem = nn.Conv2d(2, 6, 3, padding=1)
        self.b1, self.b2 = nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.drop1, self.drop2 = StochasticDepth(p, mode), StochasticDepth(p, mode)
        self.head = nn.Conv2d(6, 1, 3, padding=1)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.drop1(torch.tanh(self.b1(h)))
        h = h + self.drop2(torch.tanh(self.b2(h)))
        return self.head(h)


def _residual(mode="row", p=0.3, batch=2, seed=0):
    pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    torch.manual_seed(0)
    module = Residual(mode, p).train()
    network = from_module(module)
    return module, network, make_problem(16, batch, seed, network=network)


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_stochastic_depth_draws_one_mask_value_per_sample_or_batch(mode):
    module, network, problem = _residual(mode, batch=8)
    assert [layer.op for layer in network.layers].count("stochastic_depth") == 2
    for name, mask in problem.masks.items():
        per_sample = mask.reshape(mask.shape[0], -1)
        assert (per_sample == per_sample[:, :1]).all()  # one draw per sample, the same over its elements
        if mode == "batch":
            assert (per_sample == per_sample[0, 0]).all()
    drawn = np.concatenate([m.reshape(m.shape[0], -1)[:, 0] for m in problem.masks.values()])
    assert 0 < drawn.sum() < drawn.size or mode == "batch"  # p = 0.3 over 16 draws: some kept, some dropped


def test_stochastic_depth_walks_as_torchvisions_own_function_with_its_noise():
    module, network, problem = _residual()
    # torchvision draws its noise (N, 1, 1, 1) from PyTorch's generator: the lab's request carries that noise
    torch.manual_seed(7)
    noises = [torch.empty(problem.batch, 1, 1, 1, dtype=torch.float64).bernoulli_(1.0 - 0.3) for _ in range(2)]
    for (name, mask), noise in zip(sorted(problem.masks.items()), noises):
        problem.masks[name] = np.broadcast_to(noise.numpy(), mask.shape).astype(np.float32).copy()
    assert_walks_as_the_module(module, problem, masks_from=lambda: torch.manual_seed(7))
    assert_walks_as_autograd(problem)


def test_stochastic_depth_is_the_identity_in_evaluation():
    pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    module = Residual("row", 0.3).eval()
    network = from_module(module)
    assert not network.mask_names
    assert_walks_as_the_module(module, make_problem(16, 2, 0, network=network))


@pytest.mark.parametrize("p, exact", [(0.5, True), (0.2, False)])
def test_stochastic_depths_own_rounding_is_gamma3_and_none_for_a_power_of_two(p, exact):
    op = OPS["stochastic_depth"]
    attrs = op.normalise({"p": p, "training": True})
    x = torch.randn(4, 3, 5, 5).double()  # float32 values: the product's rounding alone
    mask = op.draw_mask(attrs, "mask", tuple(x.shape), torch.Generator().manual_seed(0))
    y = op.forward(attrs, [x], {"mask": mask}, None)
    ctx = BoundContext("float32", U32, 5.0, Kernels())
    field = op.forward_error(attrs, [Field(x, None)], y, {"mask": mask}, ctx)
    if exact:
        assert field.error is None
    else:
        assert torch.equal(field.error, gamma_k(3, U32) * y.abs())
        # torchvision's float32 order (noise ÷ (1 − p), then ×) stays within it, and uses a fair part of it
        ours = (x.float() * (mask.float() / (1.0 - p))).double()
        used = ((ours - y).abs() / field.error.clamp_min(1e-300))[y != 0]
        assert 0.1 < float(used.max()) <= 1.0


class PerElement(DropoutSlip):
    """A port that draws stochastic depth's mask per element, as a dropout does, in forward and backward."""

    def _mask(self, params):
        generator = torch.Generator().manual_seed(1)
        return (torch.rand(params["mask"].shape, generator=generator, dtype=torch.float64) < 0.7).to(
            params["mask"].dtype)


def test_pytorchs_float32_stochastic_depth_is_rounding_and_its_slips_are_defects():
    module, network, problem = _residual()
    assert_pytorch_float32_is_roundoff(problem)
    trace = reference(problem)
    index = next(layer.index for layer in network.layers if layer.op == "stochastic_depth")
    for rule in (PerElement(), DropoutSlip(forward_scaled=False, backward_scaled=False)):
        judgement = judge(forward_backward(problem, "float32", rules={index: rule}), trace)
        assert judgement.verdict == "defect", judgement.to_text()
    texts = [s.text for s in OPS["stochastic_depth"].port_slips(network.layers[index].attrs, (6, 16, 16))]
    assert "leaves out the scale 1/(1 − p) in forward and backward" in texts
    assert all(s.every == ("every stochastic depth",) for s in OPS["stochastic_depth"].port_slips(
        network.layers[index].attrs, (6, 16, 16)))


# ---------------------------------------------------------------------------------------------------------------
# torchvision's models


def test_densenet_converts_its_concats_and_walks_as_the_module():
    torchvision = pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    torch.manual_seed(0)
    module = torchvision.models.densenet.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                                                  bn_size=2, num_classes=10).train()
    network = from_module(module, loss="cross_entropy")
    # per block: the first layer's cat of one (no layer), a cat of two (one join), the block's cat of three (two)
    assert [layer.op for layer in network.layers].count("concat") == 2 * (1 + 2)
    assert_walks_as_the_module(module, make_problem(38, 2, 0, network=network))  # 38: the pools divide it


def test_convnext_converts_and_walks_as_the_module():
    torchvision = pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    module = ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], stochastic_depth_prob=0.0,
                      layer_scale=0.5, num_classes=10).train()
    network = from_module(module, loss="cross_entropy")
    ops = [layer.op for layer in network.layers]
    assert {"scale_by_parameter", "layer_norm", "permute", "stochastic_depth"} <= set(ops)
    assert network.param_shapes["features.1.0.layer_scale"] == (8, 1, 1)
    assert network.param_shapes["features.0.1.weight"] == (8,)  # LayerNorm2d's weight, its own name
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_the_module(module, problem)
    assert_pytorch_float32_is_roundoff(problem)


def test_efficientnet_in_evaluation_converts_and_walks_as_the_module():
    pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    torch.manual_seed(0)
    # two stages of MBConv (squeeze-and-excitation gates, stochastic depth 0.2 on the residual): evaluation's identity
    module = EfficientNet([MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 16, 2)], dropout=0.2,
                          stochastic_depth_prob=0.2, num_classes=10).eval()
    network = from_module(module, loss="cross_entropy")
    assert [layer.op for layer in network.layers].count("stochastic_depth") == 2
    assert_walks_as_the_module(module, make_problem(32, 2, 0, network=network))


@pytest.mark.parametrize("family", ["efficientnet_b0", "mnasnet0_5", "densenet121", "convnext_tiny"])
def test_a_torchvision_family_converts(family):
    torchvision = pytest.importorskip("torchvision", reason="torchvision installs with make setup")
    module = getattr(torchvision.models, family)(num_classes=10).train()
    network = from_module(module, loss="cross_entropy")
    assert network.layers[-1].op == "linear" and network.layers[-1].attrs["out"] == 10


@pytest.mark.parametrize("how", ["tuple", "keepdim"])
def test_pytorchs_onnx_export_of_a_mean_over_height_and_width_reads_as_the_pool(how, tmp_path):
    pytest.importorskip("onnx", reason="onnx installs with make setup")
    import io
    import warnings

    from precision_lab.model import read_onnx
    from precision_lab.modules import SpecModule

    torch.manual_seed(0)
    module = MeanHead(how).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, torch.randn(1, 2, 16, 16), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N"}})
    path = tmp_path / "mean.onnx"
    path.write_bytes(buffer.getvalue())
    network, params = read_onnx(path)
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "global_avg_pool2d", "flatten", "linear"]
    lab = SpecModule(network, dtype=torch.float64)
    lab.load_state_dict({k: torch.from_numpy(v.copy()).double() for k, v in params.items()})
    x = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        expected, got = module.double()(x), lab(x)
    assert float((got - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


@pytest.mark.parametrize("module_class, name, loss", [(ScaledNet, "block.layer_scale", "mse"),
                                                      (TinyViT, "encoder.pos_embedding", "cross_entropy")])
def test_a_parameter_gradients_bound_holds_and_three_bounds_more_are_caught(module_class, name, loss):
    import copy

    from precision_lab import errmodel

    torch.manual_seed(0)
    problem = make_problem(16, 2, 0, network=from_module(module_class(), loss=loss))
    trace = reference(problem)
    bound = errmodel.error_bounds(trace, "float32")[name].bound
    ours = autograd_forward_backward(problem, "float32")
    # measured 0.004 (layer scale) and 0.03 (positional embedding) of the bound at seed 0
    assert float((np.abs(ours.grads[name] - trace.grads[name]) / bound).max()) <= 1.0
    planted = copy.deepcopy(ours)
    at = np.unravel_index(np.argmax(bound), bound.shape)
    planted.grads[name] = planted.grads[name].copy()
    planted.grads[name][at] += 3 * bound[at]  # one element three bounds off: no bound that cannot fail
    assert judge(planted, trace).verdict == "defect"
