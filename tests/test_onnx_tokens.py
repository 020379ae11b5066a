"""ONNX graphs of normalised images and of tokens: GroupNormalization at opsets 18 and 21 read as group_norm where
its affine is per channel, a per-group affine refused in one line; graphs built with onnx.helper checked against ONNX's
own reference evaluator."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from precision_lab.model import ModelSpecError, read_onnx  # noqa: E402

from test_onnx_import import _agrees_with_onnx, _conv, _save, _weights  # noqa: E402


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
