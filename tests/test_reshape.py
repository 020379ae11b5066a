"""Reshape and permute of each sample (the batch axis first and unchanged): a ViT block's head split written with
`x.reshape(n, -1, heads, d)`, `permute`, `transpose` and `flatten`, read by from_module, walked as autograd, PyTorch's
own float32 run judged roundoff, a permute whose backward repeats the permutation a defect with its cause named, and
each head split that mixes the batch axis refused in one line naming the call."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import ModelSpecError, load_model
from precision_lab.modules import from_module
from precision_lab.ops import OPS, BackwardReplaced, Kernels
from precision_lab.ops.tokens import _permuted_again
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge
from walk_checks import assert_walks_as_autograd


class HeadSplitSDPA(nn.Module):
    """Two heads split by reshape and permute (q, v), view and transpose (k), F.scaled_dot_product_attention of
    (N, heads, T, d), merged back by transpose(1, 2).flatten(2); a residual, the mean over tokens, a linear head."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.patch = nn.Conv2d(2, d, 4, stride=4)
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        n = x.shape[0]
        t = self.patch(x).flatten(2).transpose(1, 2)
        q = self.q(t).reshape(n, -1, self.heads, self.hd).permute(0, 2, 1, 3)
        k = self.k(t).view(x.size(0), -1, self.heads, self.hd).transpose(1, 2)
        v = torch.reshape(self.v(t), (n, -1, self.heads, self.hd)).permute(0, 2, 1, 3)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        t = t + self.o(a)
        return self.head(t.mean(dim=1))


class HeadSplitMatmul(nn.Module):
    """Two heads with explicit products: kᵀ of each head by one permute (N, heads, d, T), q·kᵀ/√d, softmax, ·v, the
    heads merged by permute and reshape to (N, T, heads·d)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.d, self.heads, self.hd = d, heads, d // heads
        self.scale = self.hd ** -0.5
        self.patch = nn.Conv2d(2, d, 4, stride=4)
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        n = x.size(0)
        t = self.patch(x).flatten(2).transpose(1, 2)
        q = self.q(t).reshape(n, -1, self.heads, self.hd).permute(0, 2, 1, 3)
        kt = self.k(t).reshape(n, -1, self.heads, self.hd).permute(0, 2, 3, 1)
        v = self.v(t).reshape(n, -1, self.heads, self.hd).permute(0, 2, 1, 3)
        w = torch.softmax(q @ kt * self.scale, dim=-1)
        a = (w @ v).permute(0, 2, 1, 3).reshape(n, -1, self.d)
        t = t + self.o(a)
        return self.head(t.mean(dim=1))


def _converted(module_class):
    torch.manual_seed(0)
    return from_module(module_class(), loss="cross_entropy", input_channels=2, name=module_class.__name__)


def _walks_as_autograd(network, size=16):
    problem = make_problem(size, 2, 0, network=network)
    assert_walks_as_autograd(problem)


def _op_walks_as_autograd(op_name, attrs, x):
    op = OPS[op_name]
    attrs = op.normalise(attrs)
    xs = [x.clone().requires_grad_(True)]
    y = op.torch_forward(attrs, xs, None)
    g = torch.randn_like(y)
    (expected,) = torch.autograd.grad(y, xs, g)
    ours = op.forward(attrs, [x], {}, Kernels())
    assert torch.equal(ours, y.detach())  # only moves values: bit for bit
    (grad,), _ = op.backward(attrs, g, [x], ours, {}, Kernels(), [True])
    assert torch.equal(grad, expected)
    assert tuple(ours.shape[1:]) == op.out_shape(attrs, [tuple(x.shape[1:])])
    return ours


def test_reshape_permute_and_transpose_move_values_exactly_as_pytorch():
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    assert _op_walks_as_autograd("reshape", {"shape": [-1, 2, 4]}, x).shape == (2, 6, 2, 4)
    assert _op_walks_as_autograd("reshape", {"flatten": [1, 2]}, x).shape == (2, 48)
    heads = torch.randn(2, 6, 2, 4, dtype=torch.float64)
    assert _op_walks_as_autograd("permute", {"dims": [1, 0, 2]}, heads).shape == (2, 2, 6, 4)
    assert _op_walks_as_autograd("permute", {"dims": [1, 2, 0]}, heads).shape == (2, 2, 4, 6)
    assert _op_walks_as_autograd("transpose", {"dims": [-2, -1]}, heads).shape == (2, 6, 4, 2)
    assert _op_walks_as_autograd("transpose", {}, heads).shape == (2, 2, 6, 4)


def test_a_reshape_resolves_minus_one_from_the_sample_and_refuses_sizes_that_do_not_match():
    reshape = OPS["reshape"]
    assert reshape.out_shape(reshape.normalise({"shape": [-1, 2, 4]}), [(6, 8)]) == (6, 2, 4)
    assert reshape.out_shape(reshape.normalise({"shape": [-1, 2, 4]}), [(None, 8)]) == (None, 2, 4)
    with pytest.raises(ValueError, match=r"reshape of a sample \(6, 8\) \(48 values\) to \(-1, 5\)"):
        reshape.out_shape(reshape.normalise({"shape": [-1, 5]}), [(6, 8)])
    with pytest.raises(ValueError, match="at most one -1"):
        reshape.normalise({"shape": [-1, -1]})
    with pytest.raises(ValueError, match="expected an order of the per-sample axes"):
        OPS["permute"].normalise({"dims": [0, 0, 1]})


def test_a_head_split_reads_as_reshape_and_permute_and_walks_as_autograd():
    network = _converted(HeadSplitSDPA)
    ops = [layer.op for layer in network.layers]
    assert ops[3:13] == ["linear", "reshape", "permute", "linear", "reshape", "transpose", "linear", "reshape",
                         "permute", "dot_product_attention"]
    shapes = network.shapes(16, 16)  # 4×4 patches of 16²: 16 tokens of 8, two heads of 4
    assert shapes[4:6] == [(16, 2, 4), (2, 16, 4)] and shapes[12] == (2, 16, 4) and shapes[14] == (16, 8)
    assert network.layers[4].attrs["shape"] == [-1, 2, 4]  # the batch's x.shape[0] dropped, the tokens' -1 kept
    assert network.fits(32, 32) and network.fits(24, 40)  # -1: any number of tokens
    _walks_as_autograd(network)
    matmul = _converted(HeadSplitMatmul)
    assert [layer.attrs["dims"] for layer in matmul.layers if layer.op == "permute"] == [[1, 0, 2], [1, 2, 0],
                                                                                        [1, 0, 2], [1, 0, 2]]
    _walks_as_autograd(matmul)


@pytest.mark.parametrize("module_class", [HeadSplitSDPA, HeadSplitMatmul])
@pytest.mark.parametrize("seed", [0, 1])
def test_pytorchs_own_float32_run_of_a_head_split_is_rounding(module_class, seed):
    problem = make_problem(16, 2, seed, network=_converted(module_class))
    judgement = judge(autograd_forward_backward(problem, "float32"), reference(problem))
    assert judgement.verdict == "roundoff", judgement.to_text()


def test_a_permute_whose_backward_repeats_the_permutation_is_a_defect_with_its_cause_named():
    network = _converted(HeadSplitMatmul)
    problem = make_problem(16, 2, 0, network=network)
    kt = next(layer for layer in network.layers if layer.op == "permute" and layer.attrs["dims"] == [1, 2, 0])
    rule = BackwardReplaced(OPS["permute"], _permuted_again)
    judgement = judge(forward_backward(problem, "float32", rules={kt.index: rule}), reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "applies the permutation (1, 2, 0) again instead of its inverse (2, 0, 1)" \
        in judgement.cause, judgement.to_text()


def _head_split(body):
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch, self.qkv = nn.Conv2d(2, 8, 4, stride=4), nn.Linear(8, 24)

        def forward(self, x):
            return body(x, self.qkv(self.patch(x).flatten(2).transpose(1, 2)))

    return Split()


@pytest.mark.parametrize("body, says", [
    (lambda x, t: t.reshape(x.shape[0], -1, 3, 2, 4).permute(2, 0, 3, 1, 4),
     r"permute\(2, 0, 3, 1, 4\): moves the batch axis \(dim 0\) to position 1; the lab's batch axis stays first"),
    (lambda x, t: t.reshape(x.shape[0] * 2, -1, 12), r"mul of a tensor's size: arithmetic on the batch size"),
    (lambda x, t: t.reshape(2, -1, 24), r"reshape\(2, -1, 24\): the first size is not the batch's"),
    (lambda x, t: t.reshape(x.shape[0], x.shape[2], 3, 8), r"reads x.size\(2\) \(the height\): a number derived"),
    (lambda x, t: t.transpose(0, 1), r"swaps the batch axis \(dim 0\) with another"),
    (lambda x, t: t.flatten(0, 1), r"flatten from dim 0 to 1")])
def test_a_reshape_that_mixes_the_batch_axis_is_refused_naming_the_call(body, says):
    with pytest.raises(ModelSpecError, match=says):
        from_module(_head_split(body), input_channels=2)


def test_a_spec_reshape_and_permute_are_written_per_sample():
    network = load_model({"input_channels": 1, "layers": [
        {"name": "c", "op": "conv2d", "in": 1, "out": 4, "kernel": 3, "padding": 1},
        {"op": "reshape", "shape": [2, 2, -1]}, {"op": "permute", "dims": [2, 0, 1]}, {"op": "reshape", "flatten": [1, 2]}],
        "loss": "mse"})
    assert network.shapes(6, 8)[1:] == [(2, 2, 48), (48, 2, 2), (96, 2)]  # flatten [1, 2]: PyTorch's dims
    _walks_as_autograd(network, 8)


def test_a_traced_reshape_reads_its_first_size_as_the_batchs():
    from precision_lab.ops import BATCH_SIZE, OpSpecError

    reshape = OPS["reshape"]
    assert reshape.from_torch_call("reshape", (None, BATCH_SIZE, -1, 2, 4), {}) == {"shape": [-1, 2, 4]}
    assert reshape.from_torch_call("view", (None, (BATCH_SIZE, 16, 8)), {}) == {"shape": [16, 8]}
    assert reshape.from_torch_call("reshape", (None, -1, 16, 8), {}) == {"shape": [16, 8]}  # -1 is then the batch
    assert reshape.from_torch_call(torch.flatten, (None, 2, 3), {}) == {"flatten": [2, 3]}
    with pytest.raises(OpSpecError, match=r"reshape\(-1, -1, 8\): two sizes are -1"):
        reshape.from_torch_call("reshape", (None, -1, -1, 8), {})
    with pytest.raises(OpSpecError, match=r"reshape\(16, x.shape\[0\], 8\): the first size is not the batch's"):
        reshape.from_torch_call("reshape", (None, 16, BATCH_SIZE, 8), {})


def test_the_two_head_example_walks_as_autograd_and_its_pytorch_run_is_rounding():
    from precision_lab.paths import ROOT

    network = load_model(ROOT / "examples" / "models" / "vit-heads.json")
    shapes = network.shapes(16, 16)
    assert shapes[8] == (2, 4, 16) and shapes[9] == (2, 16, 16)  # each head's kᵀ, each head's 16 × 16 scores
    assert network.output_shape(16, 16) == (3,)
    _walks_as_autograd(network)
    problem = make_problem(16, 2, 3, network=network)
    reference_trace = reference(problem)
    assert judge(autograd_forward_backward(problem, "float32"), reference_trace).verdict == "roundoff"
    k_t = network.index_of("k_t")
    slipped = forward_backward(problem, "float32", rules={k_t: BackwardReplaced(OPS["permute"], _permuted_again)})
    judgement = judge(slipped, reference_trace)
    assert judgement.verdict == "defect" and judgement.cause is not None and "k_t" in judgement.cause, \
        judgement.to_text()
