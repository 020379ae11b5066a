"""ONNX graphs of normalised images and of tokens: GroupNormalization at opsets 18 and 21 read as group_norm where
its affine is per channel, a per-group affine refused in one line; graphs built with onnx.helper checked against ONNX's
own reference evaluator."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from precision_lab.model import ModelSpecError, read_onnx  # noqa: E402

from test_onnx_import import _agrees_with_onnx, _conv, _save, _weights  # noqa: E402
from walk_checks import assert_pytorch_float32_is_roundoff, assert_walks_as_autograd  # noqa: E402


def _group_norm_graph(tmp_path, opset: int, groups: int, affine_size: int, **attrs):
    """conv 2→4, GroupNormalization, Relu, conv 4→1."""
    conv1, w1 = _conv("conv1", "x", "c1", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    norm = helper.make_node("GroupNormalization", ["c1", "gn/scale", "gn/bias"], ["g"], name="gn", num_groups=groups,
                            epsilon=2.0 ** -10, **attrs)  # exact in float32: the attribute is stored so
    relu = helper.make_node("Relu", ["g"], ["r"], name="act")
    conv2, w2 = _conv("conv2", "r", "y", (1, 4, 3, 3), pads=[1, 1, 1, 1])
    weights = {**w1, **w2, "gn/scale": (_weights(affine_size) + 1.0).astype(np.float32).astype(np.float64), "gn/bias": _weights(affine_size)}
    path = _save(tmp_path / f"gn{opset}.onnx", [conv1, norm, relu, conv2], weights, opset=opset)
    return _typed(path), weights


def _typed(path):
    """The file with its tensors' types inferred: the reference evaluator builds GroupNormalization's function for
    its input's type, float32 where the type is not written."""
    onnx.save(onnx.shape_inference.infer_shapes(onnx.load(str(path))), str(path))
    return path


def test_group_normalization_of_opset_21_reads_as_group_norm_with_its_per_channel_affine(tmp_path):
    # stash_type 11: the reference evaluator's statistics in float64 (its default, 1, computes them in float32)
    path, weights = _group_norm_graph(tmp_path, 21, 2, 4, stash_type=11)
    network, params = read_onnx(path)
    norm = network.layers[1]
    assert (norm.op, norm.attrs["groups"], norm.attrs["channels"], norm.attrs["eps"]) == ("group_norm", 2, 4, 2.0 ** -10)
    assert np.array_equal(params[f"{norm.name}.weight"], weights["gn/scale"].astype(np.float32))
    assert np.array_equal(params[f"{norm.name}.bias"], weights["gn/bias"].astype(np.float32))
    _agrees_with_onnx(path, network, params)


def test_group_normalization_of_opset_18_reads_where_each_group_is_one_channel(tmp_path):
    path, _ = _group_norm_graph(tmp_path, 18, 4, 4)  # one channel a group: per group is per channel
    network, params = read_onnx(path)
    assert (network.layers[1].op, network.layers[1].attrs["groups"]) == ("group_norm", 4)
    _agrees_with_onnx(path, network, params)


def test_a_per_group_affine_of_opset_18_is_refused_in_one_line(tmp_path):
    path, _ = _group_norm_graph(tmp_path, 18, 2, 2)
    with pytest.raises(ModelSpecError, match=r"node 'gn' \(GroupNormalization\): opset 18's scale and bias are per "
                                             r"group \(2 for 4 channels\).*export at opset 21"):
        read_onnx(path)


def test_a_group_normalization_whose_affine_is_not_one_per_channel_is_refused(tmp_path):
    path, _ = _group_norm_graph(tmp_path, 21, 2, 2, stash_type=11)
    with pytest.raises(ModelSpecError, match=r"scale and bias of 2 and 2 values for 4 channels"):
        read_onnx(path)


# ---------------------------------------------------------------------------------------------
# tokens and heads: Reshape, Transpose, MatMul of two activations, Softmax, Mul/Div by a number, ReduceMean


def _ints(name, values):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, dtype=np.int64), name))


def _number(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype=np.float64), name))


def test_a_two_head_attention_graph_reads_each_node_as_its_op(tmp_path):
    """conv 4×4 patches → Reshape [0, 8, −1] → Transpose (tokens) → Reshape [0, −1, 2, 4] → heads q (Transpose),
    kᵀ (Transpose [0, 2, 3, 1]) → MatMul → Div 2 → Softmax → MatMul by q → Transpose → Reshape [0, 0, 8] (0 copies the
    open token count) → Mul 0.25 → ReduceMean over tokens → MatMul + Add (a dense layer)."""
    conv, weights = _conv("patch", "x", "c", (8, 2, 4, 4), strides=[4, 4])
    nodes = [conv, _ints("s1", [0, 8, -1]), helper.make_node("Reshape", ["c", "s1"], ["p"], name="pixels"),
             helper.make_node("Transpose", ["p"], ["t"], perm=[0, 2, 1], name="tokens"),
             _ints("s2", [0, -1, 2, 4]), helper.make_node("Reshape", ["t", "s2"], ["h"], name="split"),
             helper.make_node("Transpose", ["h"], ["q"], perm=[0, 2, 1, 3], name="q"),
             helper.make_node("Transpose", ["h"], ["kt"], perm=[0, 2, 3, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"), _number("two", 2.0),
             helper.make_node("Div", ["s", "two"], ["sd"], name="scaled"),
             helper.make_node("Softmax", ["sd"], ["w"], axis=-1, name="weights"),
             helper.make_node("MatMul", ["w", "q"], ["a"], name="mix"),
             helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3], name="back"),
             _ints("s3", [0, 0, 8]), helper.make_node("Reshape", ["at", "s3"], ["m"], name="merge"),
             _number("quarter", 0.25), helper.make_node("Mul", ["quarter", "m"], ["mq"], name="quartered"),
             helper.make_node("ReduceMean", ["mq"], ["avg"], axes=[1], keepdims=0, name="avg"),
             helper.make_node("MatMul", ["avg", "head/kernel"], ["hm"], name="head"),
             helper.make_node("Add", ["hm", "head/bias"], ["y"], name="head_bias")]
    weights |= {"head/kernel": _weights(8, 3), "head/bias": _weights(3)}
    path = _save(tmp_path / "heads.onnx", nodes, weights, opset=17)
    network, params = read_onnx(path, loss="cross_entropy")
    assert [(layer.op, {k: v for k, v in layer.attrs.items() if v is not None}) for layer in network.layers][1:] == [
        ("reshape", {"shape": [8, -1]}), ("transpose", {"dims": [1, 2]}), ("reshape", {"shape": [-1, 2, 4]}),
        ("transpose", {"dims": [1, 2]}),
        ("permute", {"dims": [1, 2, 0]}), ("matmul", {"transpose_b": False, "scale": 1.0}), ("scale", {"factor": 0.5}),
        ("softmax", {"dim": -1}), ("matmul", {"transpose_b": False, "scale": 1.0}), ("transpose", {"dims": [1, 2]}),
        ("reshape", {"shape": [-1, 8]}), ("scale", {"factor": 0.25}), ("mean", {"dim": 1}),
        ("linear", {"in": 8, "out": 3, "bias": True})]
    assert network.shapes(16, 16)[4:6] == [(2, 16, 4), (2, 4, 16)]  # q and kᵀ of two heads, 16 tokens of 4
    _agrees_with_onnx(path, network, params)
    _agrees_with_onnx(path, network, params, 8, 24)  # the token count is open: −1 and 0 follow it


def test_a_reshape_that_multiplies_the_batch_size_is_refused_naming_the_node(tmp_path):
    """A head split as bmm writes it: (N·heads, T, d), the batch size read by Shape and Gather and multiplied."""
    conv, weights = _conv("patch", "x", "c", (8, 2, 4, 4), strides=[4, 4])
    nodes = [conv, helper.make_node("Shape", ["c"], ["shape"]), _ints("zero", 0),
             helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0), _ints("heads", 2),
             helper.make_node("Mul", ["n", "heads"], ["nh"], name="batch_heads"), _ints("axes", [0]),
             helper.make_node("Unsqueeze", ["nh", "axes"], ["nh1"]), _ints("rest", [4, -1]),
             helper.make_node("Concat", ["nh1", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["c", "target"], ["y"], name="split")]
    path = _save(tmp_path / "bmm.onnx", nodes, weights, opset=17)
    with pytest.raises(ModelSpecError, match=r"node 'batch_heads' \(Mul\): Mul of the batch size: arithmetic on it "
                                             r"merges the batch axis with another"):
        read_onnx(path)


def test_a_softmax_over_another_axis_before_opset_13_is_refused(tmp_path):
    conv, weights = _conv("patch", "x", "c", (8, 2, 4, 4), strides=[4, 4])
    nodes = [conv, _ints("s", [0, 8, -1]), helper.make_node("Reshape", ["c", "s"], ["t"]),
             helper.make_node("Softmax", ["t"], ["y"], axis=1, name="probs")]
    path = _save(tmp_path / "softmax11.onnx", nodes, weights, opset=11)
    with pytest.raises(ModelSpecError, match=r"node 'probs' \(Softmax\): axis 1 before opset 13"):
        read_onnx(path)


# ---------------------------------------------------------------------------------------------
# PyTorch's own exports of token blocks


def _exported(module_class, tmp_path):
    import io
    import warnings

    import torch

    torch.manual_seed(0)
    module = module_class().eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, torch.randn(1, 2, 16, 16), buffer, dynamo=False, opset_version=17,
                          do_constant_folding=True, input_names=["x"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    path = tmp_path / f"{module_class.__name__}.onnx"
    path.write_bytes(buffer.getvalue())
    return module, path


def _computes_as_the_module(module, network, params, size=16):
    import torch

    from precision_lab.modules import SpecModule

    x = torch.randn(2, 2, size, size, dtype=torch.float64)
    lab = SpecModule(network, dtype=torch.float64)
    lab.load_state_dict({k: torch.from_numpy(v.copy()).double() for k, v in params.items()})
    with torch.no_grad():
        expected, got = module.double()(x), lab(x)
    return float((got - expected).abs().max() / expected.abs().max())


def test_pytorchs_export_of_a_head_split_reads_and_computes_as_the_module(tmp_path):
    from test_reshape import HeadSplitMatmul

    module, path = _exported(HeadSplitMatmul, tmp_path)
    network, params = read_onnx(path, loss="cross_entropy")
    ops = [layer.op for layer in network.layers]
    assert ops == ["conv2d", "reshape", "transpose", "linear", "reshape", "transpose", "linear", "reshape", "permute",
                   "linear", "reshape", "transpose", "matmul", "scale", "softmax", "matmul", "transpose", "reshape",
                   "linear", "add", "mean", "linear"]
    # its Shape → Gather → Unsqueeze → Concat targets read as the batch's size then per-sample sizes; 1/√4 is exact
    assert _computes_as_the_module(module, network, params) <= 1e-15
    assert _computes_as_the_module(module, network, params, 24) <= 1e-15


@pytest.mark.parametrize("module_name", ["ViTBlock", "HeadSplitMatmul", "HeadSplitSDPA"])
def test_pytorchs_float32_run_of_an_exported_token_block_is_roundoff(module_name, tmp_path):
    import test_attention
    import test_reshape

    from precision_lab.model import load_model
    from precision_lab.problem import make_problem

    module_class = getattr(test_attention, module_name, None) or getattr(test_reshape, module_name)
    _, path = _exported(module_class, tmp_path)
    network = load_model({"onnx": str(path), "loss": "cross_entropy"})
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_autograd(problem)
    assert_pytorch_float32_is_roundoff(problem)


def test_multi_head_attentions_export_is_refused_naming_the_node_that_moves_the_batch(tmp_path):
    from test_attention import PreNormViT

    _, path = _exported(PreNormViT, tmp_path)
    with pytest.raises(ModelSpecError, match=r"node '/attn/Transpose' \(Transpose\): perm \[1, 0, 2\]: moves the batch "
                                             r"axis \(dim 0\) to position 1"):
        read_onnx(path, loss="cross_entropy")
