"""An exported ONNX graph as the model: graphs written as TensorFlow/JAX exporters write them (onnx.helper) read
into the layer-form spec with their parameters in the canonical layout, checked against ONNX's own reference
evaluator; PyTorch's exports of real architectures read into the spec from_module gives, walked as autograd, and
PyTorch's float32 run of them judged roundoff; what the lab cannot read is named in one line."""
import io
import json
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from precision_lab import cli  # noqa: E402
from precision_lab.compute import forward_backward  # noqa: E402
from precision_lab.model import ModelSpecError, load_model  # noqa: E402
from precision_lab.modules import SpecModule, from_module  # noqa: E402
from precision_lab.model import read_onnx  # noqa: E402
from precision_lab.ops import OPS  # noqa: E402
from precision_lab.problem import make_problem  # noqa: E402
from precision_lab.reference import reference  # noqa: E402
from precision_lab.verdict import judge  # noqa: E402

from test_architectures import NETWORKS  # noqa: E402
from walk_checks import assert_pytorch_float32_is_roundoff, assert_walks_as_autograd  # noqa: E402

RNG = np.random.default_rng(0)


def _weights(*shape) -> np.ndarray:
    """float32 values held in float64: the lab's float32 parameters and the float64 reference agree exactly."""
    return RNG.uniform(-0.5, 0.5, shape).astype(np.float32).astype(np.float64)


def _save(path, nodes, initializers: dict, channels: int = 2, opset: int = 17, input_shape=None):
    """A one-input one-output float64 graph (float64 so ONNX's reference evaluator and the lab agree to 1e-12)."""
    input_shape = input_shape or ["N", channels, "H", "W"]
    graph = helper.make_graph(
        nodes, path.stem, [helper.make_tensor_value_info("x", TensorProto.DOUBLE, input_shape)],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.DOUBLE, None)],
        [numpy_helper.from_array(value, name) for name, value in initializers.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def _agrees_with_onnx(path, network, params, height=16, width=16, nhwc=False, nhwc_out=False):
    """The spec with the imported parameters computes what ONNX's reference evaluator computes from the file
    (`nhwc`: the file reads the same images (N, H, W, C); `nhwc_out`: it gives its output so too)."""
    x = RNG.standard_normal((2, network.input_channels, height, width))
    expected = ReferenceEvaluator(str(path)).run(None, {"x": x.transpose(0, 2, 3, 1) if nhwc else x})[0]
    expected = expected.transpose(0, 3, 1, 2) if nhwc_out else expected
    module = SpecModule(network, dtype=torch.float64)
    module.load_state_dict({name: torch.from_numpy(value).double() for name, value in params.items()})
    got = module(torch.from_numpy(x)).detach().numpy()
    assert got.shape == expected.shape
    # float64 sums of a few hundred terms: |error| ≲ n·u₆₄·Σ|terms| ≈ 1e-13 of the output's scale
    assert np.abs(got - expected).max() <= 1e-12 * np.abs(expected).max()


def _conv(name, x, out, w_shape, **attrs):
    return helper.make_node("Conv", [x, f"{name}/kernel", f"{name}/bias"], [out], name=name, **attrs), {
        f"{name}/kernel": _weights(*w_shape), f"{name}/bias": _weights(w_shape[0])}


def test_a_tensorflow_style_cnn_reads_with_same_padding_and_a_bias_added_after(tmp_path):
    c1, w1 = _conv("model/conv1", "x", "c1", (8, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2])
    nodes = [c1, helper.make_node("LeakyRelu", ["c1"], ["a1"], alpha=0.25, name="model/leaky"),
             helper.make_node("MaxPool", ["a1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="model/pool"),
             # a bias-free Conv, then an Add of one value per channel: the bias as some exporters keep it
             helper.make_node("Conv", ["p1", "k2"], ["c2"], pads=[1, 1, 1, 1], name="model/conv2"),
             helper.make_node("Add", ["c2", "b2"], ["y"], name="model/conv2/BiasAdd")]
    path = _save(tmp_path / "tf-cnn.onnx", nodes, {**w1, "k2": _weights(4, 8, 3, 3), "b2": _weights(1, 4, 1, 1)})
    network, params = read_onnx(path)
    assert [(layer.name, layer.op) for layer in network.layers] == [
        (None, "zero_pad2d"), ("model_conv1", "conv2d"), ("model_leaky", "leaky_relu"), ("model_pool", "max_pool2d"),
        ("model_conv2", "conv2d")]
    # SAME_UPPER at stride 2 is TensorFlow's "same": (0, 1) per axis, not PyTorch's (1, 1)
    assert network.layers[0].attrs["padding"] == (0, 1, 0, 1)
    assert network.layers[2].attrs["slope"] == 0.25 and network.layers[4].attrs["bias"] is True
    assert sorted(params) == ["model_conv1.bias", "model_conv1.weight", "model_conv2.bias", "model_conv2.weight"]
    np.testing.assert_array_equal(params["model_conv1.weight"], w1["model/conv1/kernel"])  # OIHW, as ONNX's
    assert network.loss == "mse" and network.name == "tf-cnn"
    _agrees_with_onnx(path, network, params)


def test_a_classifier_reads_gemm_with_and_without_transb_and_matmul_plus_bias(tmp_path):
    conv, weights = _conv("stem", "x", "c", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("AveragePool", ["r"], ["p"], kernel_shape=[4, 4], strides=[4, 4]),
             helper.make_node("Flatten", ["p"], ["f"], axis=1),
             # PyTorch's Linear: B is (out, in), transB = 1
             helper.make_node("Gemm", ["f", "fc1.weight", "fc1.bias"], ["h"], transB=1, name="fc1"),
             helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Gemm", ["t", "dense/kernel", "dense/bias"], ["g"], name="dense"),  # TF: (in, out)
             helper.make_node("Sigmoid", ["g"], ["s"]),
             helper.make_node("MatMul", ["s", "head/kernel"], ["m"], name="head/MatMul"),  # JAX: (in, out), then + bias
             helper.make_node("Add", ["m", "head/bias"], ["y"], name="head/Add")]
    inits = {**weights, "fc1.weight": _weights(12, 64), "fc1.bias": _weights(12), "dense/kernel": _weights(12, 6),
             "dense/bias": _weights(6), "head/kernel": _weights(6, 3), "head/bias": _weights(3)}
    path = _save(tmp_path / "classifier.onnx", nodes, inits)
    network, params = read_onnx(path, loss="cross_entropy")
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "avg_pool2d", "flatten", "linear", "tanh",
                                                      "linear", "sigmoid", "linear"]
    assert network.param_shapes == {"stem.weight": (4, 2, 3, 3), "stem.bias": (4,), "fc1.weight": (12, 64),
                                    "fc1.bias": (12,), "dense.weight": (6, 12), "dense.bias": (6,),
                                    "head_MatMul.weight": (3, 6), "head_MatMul.bias": (3,)}
    np.testing.assert_array_equal(params["dense.weight"], inits["dense/kernel"].T)  # (in, out) stored as OI
    np.testing.assert_array_equal(params["fc1.weight"], inits["fc1.weight"])
    assert network.loss == "cross_entropy" and network.fits(16, 16) and not network.fits(32, 32)
    _agrees_with_onnx(path, network, params)


@pytest.mark.parametrize("transform, rounding", [("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                                                 ("pytorch_half_pixel", "round_prefer_ceil")])
def test_a_unet_reads_its_skip_concat_in_onnx_order_and_nearest_resize(tmp_path, transform, rounding):
    enc, w_enc = _conv("enc", "x", "e", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    down, w_down = _conv("down", "a", "d", (8, 4, 3, 3), pads=[1, 1, 1, 1], strides=[2, 2])
    head, w_head = _conv("head", "cat", "y", (1, 12, 3, 3), pads=[1, 1, 1, 1])
    nodes = [enc, helper.make_node("Elu", ["e"], ["a"], alpha=0.5), down, helper.make_node("Relu", ["d"], ["r"]),
             helper.make_node("Resize", ["r", "", "scales"], ["up"], mode="nearest",
                              coordinate_transformation_mode=transform, nearest_mode=rounding),
             helper.make_node("Concat", ["a", "up"], ["cat"], axis=1),  # the skip first
             head]
    path = _save(tmp_path / "unet.onnx", nodes, {**w_enc, **w_down, **w_head,
                                                 "scales": np.array([1, 1, 2, 2], np.float32)})
    network, params = read_onnx(path)
    concat = network.layers[5]
    assert concat.op == "concat" and [network.layers[i].op for i in concat.inputs] == ["elu", "upsample_nearest"]
    assert network.layers[4].attrs["scale"] == (2, 2) and network.layers[1].attrs["alpha"] == 0.5
    _agrees_with_onnx(path, network, params)


def test_a_resize_that_does_not_copy_pixels_into_blocks_is_refused(tmp_path):
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest", name="up",
                              coordinate_transformation_mode="asymmetric", nearest_mode="round_prefer_ceil")]
    path = _save(tmp_path / "up.onnx", nodes, {"scales": np.array([1, 1, 2, 2], np.float32)})
    with pytest.raises(ModelSpecError, match="node 'up' \\(Resize\\): coordinate_transformation_mode 'asymmetric' "
                                             "with nearest_mode 'round_prefer_ceil' does not copy"):
        read_onnx(path)


def test_a_residual_subtracted_from_the_input_reads_padded_and_gated(tmp_path):
    head, w_head = _conv("head", "x", "h", (4, 1, 3, 3), pads=[0, 0, 0, 0])
    tail, w_tail = _conv("tail", "g", "t", (1, 4, 3, 3), pads=[1, 1, 1, 1])
    nodes = [helper.make_node("Pad", ["x", "pads"], ["xp"], mode="constant", name="pad"), head,
             helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["g"]),  # SiLU, decomposed
             tail, helper.make_node("Identity", ["t"], ["ti"]),
             helper.make_node("Sub", ["x", "ti"], ["y"], name="clean")]
    nodes[1].input[0] = "xp"
    path = _save(tmp_path / "dncnn.onnx", nodes, {**w_head, **w_tail,
                                                  "pads": np.array([0, 0, 1, 2, 0, 0, 1, 0], np.int64)}, channels=1)
    network, params = read_onnx(path)
    assert [layer.op for layer in network.layers] == ["zero_pad2d", "conv2d", "silu", "conv2d", "sub"]
    # ONNX's [begins…, ends…] read as [top, bottom, left, right]
    assert network.layers[0].attrs["padding"] == (1, 1, 2, 0)
    assert network.layers[-1].inputs == (-1, 3)  # the network input minus the tail (Identity is no layer)
    _agrees_with_onnx(path, network, params, 16, 14)


def test_an_unsupported_node_is_named_in_one_line_with_the_supported_set(tmp_path):
    conv, weights = _conv("conv", "x", "c", (3, 2, 1, 1))
    path = _save(tmp_path / "model.onnx", [conv, helper.make_node("Hardmax", ["c"], ["y"], axis=1, name="probs")],
                 weights)
    with pytest.raises(ModelSpecError) as caught:
        load_model(str(path))
    message = str(caught.value)
    supported = sorted({kind for op in OPS.values() for kind in op.onnx_ops})
    assert {"Conv", "Gemm", "MatMul", "Resize", "Concat"} <= set(supported)
    assert message == f"{path}: node 'probs' is Hardmax, which the lab has no op for; supported: {', '.join(supported)}"


@pytest.mark.parametrize("shape", [(1, 3, 4, 4), (3,)])  # per pixel; (3,) broadcasts along the width, not channels
def test_an_add_of_a_constant_that_is_no_bias_is_refused(tmp_path, shape):
    conv = helper.make_node("Conv", ["x", "kernel"], ["c"], name="conv")  # bias-free: the Add could have been it
    path = _save(tmp_path / "shift.onnx", [conv, helper.make_node("Add", ["c", "shift"], ["y"], name="shift")],
                 {"kernel": _weights(3, 2, 1, 1), "shift": _weights(*shape)})
    with pytest.raises(ModelSpecError, match="node 'shift' \\(Add\\): Add with a constant: the spec's add combines"):
        read_onnx(path)


def test_the_cli_names_an_unreadable_file_and_its_fix_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf \xff\xfe")
    code = cli.main(["diagnose", "--candidate", "builtin:native", "--size", "16", "--model", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{bad}: not a readable ONNX model" in err and "export it again" in err


def test_an_onnx_file_is_named_with_its_loss_in_a_spec_file_or_a_candidates_model_key(tmp_path):
    conv, weights = _conv("conv", "x", "c", (3, 2, 3, 3), pads=[1, 1, 1, 1])
    (tmp_path / "nets").mkdir()
    _save(tmp_path / "nets" / "seg.onnx", [conv, helper.make_node("Relu", ["c"], ["y"])], weights)
    (tmp_path / "nets" / "seg.yaml").write_text("onnx: seg.onnx\nloss: cross_entropy\n")
    from_file = load_model(str(tmp_path / "nets" / "seg.yaml"))
    inline = load_model({"onnx": "nets/seg.onnx", "loss": "cross_entropy"}, base_dir=tmp_path)
    bare = load_model(str(tmp_path / "nets" / "seg.onnx"))
    assert from_file.loss == inline.loss == "cross_entropy" and bare.loss == "mse"
    assert from_file.name == "seg" and from_file.param_shapes == bare.param_shapes == {"conv.weight": (3, 2, 3, 3),
                                                                                      "conv.bias": (3,)}
    # the network's spec is the layer form: a bundle written from it needs no .onnx file
    assert json.loads(json.dumps(from_file.spec))["layers"][0]["op"] == "conv2d"
    from precision_lab.candidates import resolve

    (tmp_path / "impl.py").write_text("")
    (tmp_path / "mine.yaml").write_text("name: mine\ncommand: ['{python}', impl.py, '{request}', '{response}']\n"
                                        "precision: float32\nweight_layout: OIHW\n"
                                        "model: {onnx: nets/seg.onnx, loss: cross_entropy}\n")
    candidate = resolve(str(tmp_path / "mine.yaml"))
    assert candidate.network.loss == "cross_entropy" and candidate.network.param_shapes == bare.param_shapes
    with pytest.raises(ModelSpecError, match="unknown key 'weights' beside 'onnx'"):
        load_model({"onnx": "nets/seg.onnx", "weights": "w.npz"}, base_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# PyTorch's own exports of the real architectures


def _exported(name: str, tmp_path, opset: int):
    module_class, loss = NETWORKS[name]
    torch.manual_seed(0)
    module = module_class().eval()
    channels = 1 if name == "dncnn" else 2
    path = tmp_path / f"{name}-{opset}.onnx"
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice: it needs no onnxscript
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, torch.randn(1, channels, 16, 16), buffer, dynamo=False, opset_version=opset,
                          input_names=["x"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    path.write_bytes(buffer.getvalue())
    return module, path, loss, channels


def _structure(network):
    """Each layer's op and the ops it reads, with dropout (the identity an inference export leaves out) skipped."""
    def source(index):
        while index >= 0 and network.layers[index].op == "dropout":
            index = network.layers[index].inputs[0]
        return "input" if index < 0 else network.layers[index].op

    return [(layer.op, tuple(source(i) for i in layer.inputs)) for layer in network.layers if layer.op != "dropout"]


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_pytorchs_export_reads_as_from_module_and_computes_as_the_module(name, opset, tmp_path):
    module, path, loss, channels = _exported(name, tmp_path, opset)
    imported, params = read_onnx(path, loss=loss)
    converted = from_module(module, loss=loss, input_channels=channels)
    assert _structure(imported) == _structure(converted)
    assert imported.param_shapes == converted.param_shapes  # the same state_dict names and shapes
    assert imported.input_channels == channels and imported.loss == loss
    x = torch.randn(2, channels, 16, 16, dtype=torch.float64)
    lab = SpecModule(imported, dtype=torch.float64)
    lab.load_state_dict({k: torch.from_numpy(v).double() for k, v in params.items()})
    expected = module.double()(x)
    assert (lab(x) - expected).abs().max() <= 1e-12 * expected.abs().max()


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_an_imported_network_walks_as_autograd_and_pytorchs_float32_run_is_roundoff(name, tmp_path):
    _, path, loss, _ = _exported(name, tmp_path, 17)
    network = load_model({"onnx": str(path), "loss": loss})
    problem = make_problem(16, 2, 0, network=network)
    assert_walks_as_autograd(problem)
    assert_pytorch_float32_is_roundoff(problem)


def test_a_slip_in_a_port_of_an_imported_network_is_a_defect_with_its_cause(tmp_path):
    from precision_lab.ops.arithmetic import SubSwapped

    _, path, loss, _ = _exported("dncnn", tmp_path, 17)
    network = load_model({"onnx": str(path), "loss": loss})
    problem = make_problem(24, 2, 0, network=network)
    swapped = forward_backward(problem, "float32", rules={len(network.layers) - 1: SubSwapped()})
    judgement = judge(swapped, reference(problem))
    assert judgement.verdict == "defect"
    assert judgement.cause is not None and "subtracts the other way round" in judgement.cause, judgement.to_text()


def test_a_same_padded_branch_pads_what_it_reads_not_the_layer_before_it(tmp_path):
    stem, w_stem = _conv("stem", "x", "s", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    main, w_main = _conv("main", "r", "m", (4, 4, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2])
    proj, w_proj = _conv("proj", "r", "p", (4, 4, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2])  # reads r, not m
    nodes = [stem, helper.make_node("Relu", ["s"], ["r"]), main, proj, helper.make_node("Add", ["m", "p"], ["y"])]
    path = _save(tmp_path / "branch.onnx", nodes, {**w_stem, **w_main, **w_proj})
    network, params = read_onnx(path)
    ops = [(layer.op, tuple(network.layers[i].op for i in layer.inputs)) for layer in network.layers]
    assert ops[2:] == [("zero_pad2d", ("relu",)), ("conv2d", ("zero_pad2d",)), ("zero_pad2d", ("relu",)),
                       ("conv2d", ("zero_pad2d",)), ("add", ("conv2d", "conv2d"))]
    _agrees_with_onnx(path, network, params)


@pytest.mark.parametrize("opset", [13, 18])
def test_a_keras_style_head_reads_reduce_mean_reshape_and_an_old_upsample(tmp_path, opset):
    conv, weights = _conv("conv", "u", "c", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    axes = {"axes": [2, 3]} if opset < 18 else {}  # an attribute before opset 18, an input since
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["u"], mode="nearest", coordinate_transformation_mode=
                              "asymmetric", nearest_mode="floor"), conv, helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("ReduceMean", ["r"] + (["axes"] if opset >= 18 else []), ["m"], keepdims=1, **axes),
             helper.make_node("Reshape", ["m", "shape"], ["f"]),
             helper.make_node("Dropout", ["f", "ratio"], ["d"]),
             helper.make_node("MatMul", ["d", "dense/kernel"], ["g"]), helper.make_node("Add", ["dense/bias", "g"], ["y"])]
    inits = {**weights, "scales": np.array([1, 1, 3, 3], np.float32), "shape": np.array([-1, 4], np.int64),
             "ratio": np.array(0.25, np.float64), "dense/kernel": _weights(4, 5), "dense/bias": _weights(5),
             **({"axes": np.array([2, 3], np.int64)} if opset >= 18 else {})}
    path = _save(tmp_path / "head.onnx", nodes, inits, opset=opset)
    network, params = read_onnx(path, loss="cross_entropy")
    assert [layer.op for layer in network.layers] == ["upsample_nearest", "conv2d", "relu", "global_avg_pool2d",
                                                      "flatten", "dropout", "linear"]
    assert network.layers[0].attrs["scale"] == (3, 3) and network.layers[5].attrs["p"] == 0.25
    assert network.param_shapes["MatMul_6.weight"] == (5, 4) and network.fits(20, 28)  # any size: a global average
    _agrees_with_onnx(path, network, params, 8, 12)


def test_a_tensorflow_lenet_with_nhwc_input_and_an_hwc_flatten_reads_with_its_dense_rows_permuted(tmp_path):
    """tf2onnx without --inputs-as-nchw: the input transposed to NCHW, then back to NHWC before Keras's Flatten, whose
    (H, W, C) features the dense kernel's rows follow."""
    conv, weights = _conv("conv", "xc", "c", (3, 2, 3, 3), pads=[0, 0, 0, 0])
    nodes = [helper.make_node("Transpose", ["x"], ["xc"], perm=[0, 3, 1, 2]), conv, helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Transpose", ["p"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["t", "shape"], ["f"]), helper.make_node("Relu", ["f"], ["fr"]),
             helper.make_node("MatMul", ["fr", "dense/kernel"], ["g"]), helper.make_node("Add", ["g", "dense/bias"], ["y"])]
    kernel = _weights(3 * 5 * 4, 6)
    path = _save(tmp_path / "tf-lenet.onnx", nodes, {**weights, "shape": np.array([-1, 60], np.int64),
                                                      "dense/kernel": kernel, "dense/bias": _weights(6)},
                 input_shape=["N", 12, 10, 2])
    network, params = read_onnx(path, loss="cross_entropy")
    assert [layer.op for layer in network.layers] == ["conv2d", "relu", "max_pool2d", "flatten", "relu", "linear"]
    assert network.input_channels == 2 and network.fits(12, 10) and not network.fits(16, 16)
    # the dense row of (h, w, c) is the spec's column c·H·W + h·W + w (H, W = 5, 4 after the pool)
    h, w, c = 1, 3, 2
    np.testing.assert_array_equal(params["MatMul_7.weight"][:, c * 20 + h * 4 + w], kernel[h * 4 * 3 + w * 3 + c])
    _agrees_with_onnx(path, network, params, 12, 10, nhwc=True)


def test_hwc_features_read_by_anything_but_a_dense_layer_are_refused(tmp_path):
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Flatten", ["t"], ["f"], axis=1), helper.make_node("Add", ["f", "f"], ["y"], name="twice")]
    path = _save(tmp_path / "hwc.onnx", nodes, {}, input_shape=["N", 2, 4, 4])
    with pytest.raises(ModelSpecError, match="node 'twice' \\(Add\\): reads features flattened in \\(H, W, C\\) order"):
        read_onnx(path)


def test_a_div_by_a_number_is_a_scale_and_by_anything_else_is_refused(tmp_path):
    nodes = [helper.make_node("Div", ["x", "two"], ["y"], name="halve")]
    path = _save(tmp_path / "div.onnx", nodes, {"two": np.array(2.0)})
    assert [(layer.op, layer.attrs["factor"]) for layer in read_onnx(path)[0].layers] == [("scale", 0.5)]
    path = _save(tmp_path / "div.onnx", nodes, {"two": np.array([[[2.0]], [[3.0]]])})
    with pytest.raises(ModelSpecError, match="node 'halve' \\(Div\\): Div other than of a computed tensor by one "
                                             "constant number"):
        read_onnx(path)


def test_gelu_and_mish_read_whole_or_decomposed_as_exporters_write_them(tmp_path):
    conv, weights = _conv("conv", "x", "c", (3, 2, 3, 3), pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("Div", ["c", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["c", "p"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["gelu"]),  # x·(1 + erf(x/√2))·0.5: GELU before opset 20
             helper.make_node("Softplus", ["gelu"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
             helper.make_node("Mul", ["t", "gelu"], ["mish"]),  # x·tanh(softplus(x)): Mish before opset 18
             helper.make_node("Gelu", ["mish"], ["g"], approximate="tanh"),
             helper.make_node("Mish", ["g"], ["y"])]
    path = _save(tmp_path / "smooth.onnx", nodes, {**weights, "sqrt2": np.array(np.sqrt(2.0)), "one": np.array(1.0),
                                                   "half": np.array(0.5)}, opset=20)
    network, params = read_onnx(path)
    assert [(layer.op, layer.attrs.get("approximate")) for layer in network.layers] == [
        ("conv2d", None), ("gelu", "none"), ("mish", None), ("gelu", "tanh"), ("mish", None)]
    # against the formulas themselves: ONNX's reference evaluator computes erf to about 3e-8 only
    x = torch.from_numpy(RNG.standard_normal((2, 2, 16, 16)))
    module = SpecModule(network, dtype=torch.float64)
    module.load_state_dict({name: torch.from_numpy(value).double() for name, value in params.items()})
    c = torch.nn.functional.conv2d(x, module.conv.weight, module.conv.bias, padding=1)
    gelu = c * (1 + torch.erf(c / np.sqrt(2.0))) * 0.5
    mish = gelu * torch.tanh(torch.log1p(torch.exp(gelu)))
    g = torch.nn.functional.gelu(mish, approximate="tanh")
    expected = g * torch.tanh(torch.log1p(torch.exp(g)))
    assert (module(x) - expected).abs().max() <= 1e-12 * expected.abs().max()


def test_a_sigmoid_read_by_more_than_its_product_stays_a_sigmoid(tmp_path):
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
             helper.make_node("Add", ["m", "s"], ["y"])]
    network, _ = read_onnx(_save(tmp_path / "gate.onnx", nodes, {}))
    assert [layer.op for layer in network.layers] == ["sigmoid", "mul", "add"]


@pytest.mark.parametrize("ending", ["reduce_mean", "squeeze"])
def test_a_global_average_to_features_reads_as_a_pool_and_a_flatten(tmp_path, ending):
    """tf2onnx's GlobalAveragePooling2D: ReduceMean without keepdims, or a pool then Squeeze of H and W."""
    conv, weights = _conv("conv", "x", "c", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    pooled = ([helper.make_node("ReduceMean", ["c"], ["f"], axes=[2, 3], keepdims=0, name="gap")]
              if ending == "reduce_mean" else
              [helper.make_node("GlobalAveragePool", ["c"], ["p"], name="gap"),
               helper.make_node("Squeeze", ["p", "axes"], ["f"], name="squeeze")])
    nodes = [conv, *pooled, helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], transB=1)]
    path = _save(tmp_path / "gap.onnx", nodes, {**weights, "axes": np.array([2, 3], np.int64),
                                                "fc.weight": _weights(3, 4), "fc.bias": _weights(3)}, opset=13)
    network, params = read_onnx(path, loss="cross_entropy")
    assert [(layer.name, layer.op) for layer in network.layers] == [
        ("conv", "conv2d"), ("gap", "global_avg_pool2d"), ("gap_flatten" if ending == "reduce_mean" else "squeeze",
                                                          "flatten"), ("fc", "linear")]
    _agrees_with_onnx(path, network, params, 12, 20)


@pytest.mark.parametrize("final, opset", [("Softmax", 13), ("LogSoftmax", 17), ("Softmax", 11)])
def test_a_classifiers_final_softmax_belongs_to_cross_entropy(tmp_path, final, opset):
    conv, weights = _conv("conv", "x", "c", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("GlobalAveragePool", ["c"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["z"], transB=1),
             helper.make_node(final, ["z"], ["y"], name="probs")]
    path = _save(tmp_path / "probs.onnx", nodes, {**weights, "fc.weight": _weights(3, 4), "fc.bias": _weights(3)},
                 opset=opset)
    network, _ = read_onnx(path, loss="cross_entropy")
    assert [layer.op for layer in network.layers][-1] == "linear"  # the logits: the loss applies the softmax
    if final == "Softmax":  # under mse the network's own last layer, over the classes
        assert read_onnx(path, loss="mse")[0].layers[-1].op == "softmax"
        return
    with pytest.raises(ModelSpecError, match=f"node 'probs' is {final}, which the lab has no op for"):
        read_onnx(path, loss="mse")


def test_a_softmax_over_every_axis_at_once_is_not_the_classifiers(tmp_path):
    conv, weights = _conv("conv", "x", "c", (4, 2, 3, 3), pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("Softmax", ["c"], ["y"], name="probs")]  # opset 11: over C·H·W together
    path = _save(tmp_path / "seg.onnx", nodes, weights, opset=11)
    with pytest.raises(ModelSpecError, match="node 'probs' \\(Softmax\\): Softmax over axis None is not over the "
                                             "classes"):
        read_onnx(path, loss="cross_entropy")
    _save(tmp_path / "seg.onnx", [conv, helper.make_node("Softmax", ["c"], ["y"], axis=1)], weights, opset=13)
    assert read_onnx(tmp_path / "seg.onnx", loss="cross_entropy")[0].layers[-1].op == "conv2d"


def test_a_keras_decoder_taking_and_giving_nhwc_reads_its_last_transpose_as_the_layout_of_the_output(tmp_path):
    """tf2onnx without --inputs-as-nchw/--outputs-as-nchw: NHWC in, NHWC out, weights under the exporter's names."""
    up1, up2 = "model/conv2d_transpose/conv2d_transpose/ReadVariableOp:0", "const_fold_opt__42"
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2], name="model/transpose"),
             helper.make_node("ConvTranspose", ["t", up1, "model/conv2d_transpose/BiasAdd/ReadVariableOp:0"], ["u1"],
                              strides=[2, 2], pads=[1, 1, 1, 1], kernel_shape=[4, 4], name="model/conv2d_transpose"),
             helper.make_node("Relu", ["u1"], ["r"], name="model/re_lu/Relu"),
             helper.make_node("ConvTranspose", ["r", up2, "const_fold_opt__43"], ["u2"], strides=[3, 3],
                              dilations=[2, 2], pads=[2, 2, 2, 2], output_padding=[1, 1], name="model/up2"),
             helper.make_node("Transpose", ["u2"], ["y"], perm=[0, 2, 3, 1], name="model/transpose_1")]
    weights = {up1: _weights(3, 8, 4, 4), "model/conv2d_transpose/BiasAdd/ReadVariableOp:0": _weights(8),
               up2: _weights(8, 2, 3, 3), "const_fold_opt__43": _weights(2)}
    path = _save(tmp_path / "decoder.onnx", nodes, weights, input_shape=["N", "H", "W", 3])
    network, params = read_onnx(path)
    assert [layer.op for layer in network.layers] == ["conv_transpose2d", "relu", "conv_transpose2d"]
    assert network.input_channels == 3 and network.shapes(6, 5)[-1] == (2, 35, 29)  # 6×5 → 12×10 → (12 − 1)·3 − 4 + 2·2 + 1 + 1
    _agrees_with_onnx(path, network, params, 6, 5, nhwc=True, nhwc_out=True)


@pytest.mark.parametrize("pads, output_padding, read_as", [
    ([1, 1, 0, 0], [0, 0], ((1, 1), (1, 1))),  # [top, left, bottom, right]: one more row and column at the start
    ([2, 2, 1, 0], [0, 1], ((2, 2), (1, 3))),  # the end's crop lessened by output_padding
    ([1, 2, 1, 2], [2, 1], ((1, 2), (2, 1)))])  # symmetric: PyTorch's own export
def test_a_transposed_convolution_cropping_more_at_the_start_reads_as_output_padding(tmp_path, pads, output_padding,
                                                                                      read_as):
    node = helper.make_node("ConvTranspose", ["x", "up/kernel", "up/bias"], ["y"], strides=[4, 4], pads=pads,
                            output_padding=output_padding, name="up")
    path = _save(tmp_path / "up.onnx", [node], {"up/kernel": _weights(2, 3, 5, 5), "up/bias": _weights(3)})
    network, params = read_onnx(path)
    attrs = network.layers[0].attrs
    assert (attrs["padding"], attrs["output_padding"]) == read_as
    _agrees_with_onnx(path, network, params, 5, 6)


def test_a_transposed_convolution_cropping_more_at_the_end_is_refused_in_one_line(tmp_path):
    node = helper.make_node("ConvTranspose", ["x", "up/kernel"], ["y"], strides=[2, 2], pads=[0, 1, 1, 1], name="up")
    path = _save(tmp_path / "up.onnx", [node], {"up/kernel": _weights(2, 3, 3, 3)})
    with pytest.raises(ModelSpecError, match="crop more at the end of an axis than at its start"):
        read_onnx(path)
