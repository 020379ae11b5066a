"""Channel moves: ShuffleNet's channel shuffle and `x.chunk(2, dim=1)` are read from PyTorch, walked as autograd in
float64, bounded as exact copies, and their slips caught; sizes other than the batch's are read where they are a
shuffle's, and refused in one line where they would fix the image size."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import ModelSpecError
from precision_lab.modules import from_module
from precision_lab.ops import LOSSES, OPS, BackwardReplaced, Field, GradField, OtherAttributes
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge


def shuffle(x, groups):
    """torchvision's channel_shuffle, as its users write it."""
    batchsize, num_channels, height, width = x.size()
    x = x.view(batchsize, groups, num_channels // groups, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, -1, height, width)


class ShuffleUnit(nn.Module):
    """A ShuffleNet v2 stride-1 unit on 8 channels, with a 3-group shuffle (not its own inverse) after it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 12, 3, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(6, 6, 1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1, groups=6))
        self.head = nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x):
        x1, x2 = F.relu(self.stem(x)).chunk(2, dim=1)
        return self.head(shuffle(torch.cat((x1, self.branch(x2)), dim=1), 3))


@pytest.fixture(scope="module")
def unit():
    torch.manual_seed(0)
    network = from_module(ShuffleUnit(), name="shuffle_unit")
    return network, make_problem(16, 2, 0, network=network)


def test_the_shuffle_is_torchvisions_and_its_backward_the_inverse():
    x = torch.randn(2, 12, 3, 4, dtype=torch.float64, requires_grad=True)
    expected = shuffle(x, 3)
    rule = OPS["channel_shuffle"]
    got = rule.forward({"groups": 3}, [x.detach()], {}, None)
    assert torch.equal(got, expected.detach())
    assert torch.equal(got[:, 1], x.detach()[:, 4])  # output channel 1 is group 1's first: input channel 12/3
    g = torch.randn_like(expected)
    back, = torch.autograd.grad(expected, x, g)
    assert torch.equal(rule.backward({"groups": 3}, g, [x.detach()], got, {}, None, [True])[0][0], back)
    assert torch.equal(F.channel_shuffle(x.detach(), 3), got)


@pytest.mark.parametrize("call, attrs, channels", [
    (lambda x: x.chunk(2, dim=1)[1], {"chunk": [1, 2]}, slice(3, 5)),  # ⌈5/2⌉ = 3 channels a piece
    (lambda x: torch.split(x, [1, 4], dim=1)[1], {"channels": [1, 5]}, slice(1, 5)),
    (lambda x: x.split(2, dim=1)[2], {"channels": [4, 6]}, slice(4, 5))])  # the last piece stops at the channels
def test_a_channel_piece_is_torchs_and_its_gradient_lands_in_it(call, attrs, channels):
    x = torch.randn(2, 5, 3, 3, dtype=torch.float64, requires_grad=True)
    expected = call(x)
    rule = OPS["channel_slice"]
    attrs = rule.normalise(attrs)
    assert rule.out_shape(attrs, [(5, 3, 3)]) == tuple(expected.shape[1:])
    assert torch.equal(rule.forward(attrs, [x.detach()], {}, None), expected.detach())
    g = torch.randn_like(expected)
    back, = torch.autograd.grad(expected, x, g)
    got = rule.backward(attrs, g, [x.detach()], expected, {}, None, [True])[0][0]
    assert torch.equal(got, back) and torch.equal(got[:, channels], g)


@pytest.mark.parametrize("op, attrs", [("channel_shuffle", {"groups": 3}), ("channel_slice", {"chunk": [1, 2]})])
def test_a_channel_moves_bound_is_its_inputs_moved_with_the_values(op, attrs):
    rule, x = OPS[op], torch.randn(2, 12, 3, 3, dtype=torch.float64)
    attrs = rule.normalise(attrs)
    error = torch.zeros_like(x)
    error[1, 7, 2, 0] = 1.0  # one element's bound (in both ops' output): it must follow that element, nowhere else
    y = rule.forward(attrs, [x], {}, None)
    out = rule.forward_error(attrs, [Field(x, error, 1, 2, coupled=True)], y, {}, None)
    assert torch.equal(out.error, rule.forward(attrs, [error], {}, None)) and out.error.sum() == 1
    assert (out.radius, out.flips, out.coupled) == (1, 2, True)  # pixels stay in place; no rounding of its own
    g = torch.randn_like(y)
    grad_error = torch.rand_like(y)
    back, = rule.backward_error(attrs, g, GradField(grad_error, None, 1), [Field(x, None)], out, {}, None, [True])[0]
    assert torch.equal(back.error, rule.backward(attrs, grad_error, [x], y, {}, None, [True])[0][0])
    assert back.error.sum() == pytest.approx(float(grad_error.sum()), rel=1e-15) and back.radius == 1


def test_the_unit_is_read_and_walks_as_autograd(unit):
    network, problem = unit
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "channel_slice", "channel_slice", "conv2d",
                                                      "relu", "conv2d", "concat", "channel_shuffle", "conv2d"]
    assert network.layers[8].attrs == {"groups": 3}
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name, expected in autograd.grads.items():
        assert np.abs(walked.grads[name] - expected).max() <= 1e-12 * np.abs(expected).max(), name


def test_float32_is_within_the_bound_and_an_inverted_shuffle_is_named(unit):
    network, problem = unit
    trace = reference(problem)
    assert judge(autograd_forward_backward(problem, "float32"), trace).verdict == "roundoff"
    inverted = OtherAttributes(OPS["channel_shuffle"], {"groups": 4})  # 12 channels: 3 groups of 4 read as 4 of 3
    judgement = judge(forward_backward(problem, "float32", rules={8: inverted}), trace)
    assert judgement.verdict == "defect" and "layer 9 (channel_shuffle) shuffles the other way" in judgement.cause
    wrong_piece = BackwardReplaced(OPS["channel_slice"], lambda op, attrs, g, xs, *rest: (
        [torch.cat([g, torch.zeros_like(g)], dim=1)], {}))  # the second half's gradient placed in the first
    judgement = judge(forward_backward(problem, "float32", rules={3: wrong_piece}), trace)
    assert judgement.verdict == "defect" and "layer 4 (channel_slice) backward places the gradient in channels 0:6" \
        in judgement.cause


def test_the_ops_name_their_slips():
    slips = [slip.text for slip in OPS["channel_shuffle"].port_slips({"groups": 3}, (12, 4, 4))]
    assert len(slips) == 3 and "inverse" in slips[1]
    assert OPS["channel_shuffle"].port_slips({"groups": 2}, (4, 4, 4))[1:] == []  # 2 groups of 2: its own inverse
    assert "channels 0:3" in OPS["channel_slice"].port_slips(OPS["channel_slice"].normalise({"chunk": [1, 2]}),
                                                             (6, 4, 4))[0].text


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3)

    def forward(self, x):
        return F.channel_shuffle(self.conv(x), 3)


def test_nn_channel_shuffle_and_functional_read_as_the_op():
    network = from_module(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ChannelShuffle(2)))
    assert (network.layers[1].op, network.layers[1].attrs) == ("channel_shuffle", {"groups": 2})
    network = from_module(Functional())
    assert (network.layers[1].op, network.layers[1].attrs) == ("channel_shuffle", {"groups": 3})


class HeightRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x):
        x = self.conv(x)
        n, c, h, w = x.shape
        return x.reshape(n, c, h // 2, 2 * w)


class OtherView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)

    def forward(self, x):
        x = self.conv(x)
        b, c, h, w = x.size()
        return x.view(b, 2, c // 2, h, w).sum(2)


class SizeCheck(nn.Module):
    """torchvision's ViT checks its input size before reading patches."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 4, stride=4)

    def forward(self, x):
        n, c, h, w = x.shape
        torch._assert(h == 224, "Wrong image height!")
        return self.conv(x)


class SkipSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        return F.interpolate(self.conv(x), size=x.shape[2:])


@pytest.mark.parametrize("module, words", [
    (HeightRead(), r"derived from the image's height fixes the input size .* write that size as -1"),
    (SizeCheck(), r"_assert reads x.size\(2\) \(the height\) == 224: .* remove the size check"),
    (OtherView(), "a 5-D view is read only as a channel shuffle"),
    (SkipSize(), r"reads the sizes slice\(2, None, None\) of x; read one size at a time")])
def test_other_size_reads_are_refused_in_one_line(module, words):
    with pytest.raises(ModelSpecError, match=words) as caught:
        from_module(module)
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def shufflenet():
    models = pytest.importorskip("torchvision.models", reason="torchvision installs with make setup")
    torch.manual_seed(0)
    return models.shufflenet_v2_x0_5(num_classes=10)


# at 32² conv5's batch norm sees 2 values a channel (1×1 pixels, batch 2): x̂ = ±1 whatever x, so two float64 runs of
# its training-mode backward differ by 1e-7 (measured); evaluation mode reads the running statistics there
@pytest.mark.parametrize("size, training", [(32, False), (64, True)])
def test_torchvisions_shufflenet_walks_as_its_own_autograd(shufflenet, size, training):
    module = shufflenet.train(training)
    network = from_module(module, loss="cross_entropy")
    assert sum(layer.op == "channel_shuffle" for layer in network.layers) == 16
    assert sum(layer.op == "channel_slice" for layer in network.layers) == 26  # two pieces of each stride-1 unit
    problem = make_problem(size, 2, 0, network=network)
    walked = forward_backward(problem, "float64")
    module = copy.deepcopy(module).double()
    module.load_state_dict({k: torch.from_numpy(v).double() for k, v in problem.params.items()}, strict=False)
    loss = LOSSES["cross_entropy"].torch_loss(module(torch.from_numpy(problem.input).double()),
                                              torch.from_numpy(problem.target))
    loss.backward()
    assert abs(walked.loss - loss.item()) <= 1e-12 * abs(loss.item())
    largest = max(float(p.grad.abs().max()) for p in module.parameters())
    for name, parameter in module.named_parameters():
        expected = parameter.grad.numpy()
        if np.abs(expected).max() <= 1e-12 * largest:  # a bias before a training batch norm: zero, but for rounding
            assert np.abs(walked.grads[name]).max() <= 1e-12 * largest, name
            continue
        assert np.abs(walked.grads[name] - expected).max() <= 1e-10 * np.abs(expected).max(), name


class ChannelRead(nn.Module):
    """Reads its channel count for a reshape (`x.view(b, c // 2, -1)`): a number of the spec, any image size."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(2, 3)

    def forward(self, x):
        x = self.conv(x)
        b, c, h, w = x.shape
        return self.fc(x.view(b, c // 2, -1).mean(dim=2))


class Halves(nn.Module):
    """A hand-written split of the channels by indexing (`x[:, :c // 2]`, `x[:, c // 2:]`)."""

    def __init__(self):
        super().__init__()
        self.conv, self.branch = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x = self.conv(x)
        c = x.shape[1]
        return torch.cat((x[:, :c // 2], self.branch(x[:, c // 2:])), dim=1)


def test_a_channel_slice_by_indexing_reads_and_walks_as_autograd():
    torch.manual_seed(0)
    network = from_module(Halves())
    assert [layer.attrs["channels"] for layer in network.layers if layer.op == "channel_slice"] == [[0, 4], [4, None]]
    problem = make_problem(8, 2, 0, network=network)
    walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
    for name, expected in autograd.grads.items():
        assert np.abs(walked.grads[name] - expected).max() <= 1e-12 * np.abs(expected).max(), name


def test_a_read_channel_count_becomes_the_specs_number():
    torch.manual_seed(0)
    network = from_module(ChannelRead())
    assert network.layers[1].attrs["shape"] == [2, -1]
    for size in (6, 8):
        problem = make_problem(size, 2, 0, network=network)
        walked, autograd = forward_backward(problem, "float64"), autograd_forward_backward(problem, "float64")
        for name, expected in autograd.grads.items():
            assert np.abs(walked.grads[name] - expected).max() <= 1e-12 * np.abs(expected).max(), name


class TokenCount(nn.Module):
    """Reads the token count (H·W of an image) where a channel count would be read."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 2, stride=2)

    def forward(self, x):
        t = self.conv(x).flatten(2).transpose(1, 2)
        return t.reshape(t.shape[0], t.shape[1], 2, 2)


def test_a_token_count_is_not_read_as_a_channel_count():
    with pytest.raises(ModelSpecError, match=r"its size 1 follows the image's height and width.*write that size as -1"):
        from_module(TokenCount())


class Shuffled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 12, 3, padding=1), nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x):
        return self.b(shuffle(self.a(x), 3))


def test_pytorchs_onnx_export_of_the_shuffle_reads_as_the_op(tmp_path):
    pytest.importorskip("onnx", reason="onnx installs with make setup")
    import warnings

    from precision_lab.model import load_onnx
    from precision_lab.modules import SpecModule

    torch.manual_seed(0)
    module, path = Shuffled().double(), tmp_path / "shuffled.onnx"
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module.float(), torch.randn(2, 1, 8, 8), path, dynamo=False, opset_version=17)
    network = load_onnx(path)
    assert [(layer.op, layer.attrs) for layer in network.layers][1] == ("channel_shuffle", {"groups": 3})
    lab = SpecModule(network, dtype=torch.float64)
    lab.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(lab(x), module.double()(x), rtol=1e-12, atol=0)
