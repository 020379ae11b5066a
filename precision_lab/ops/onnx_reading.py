"""How an op reads an ONNX node (precision_lab.onnx_import walks the graph; each op says what it reads).

An op lists the ONNX node types it reads in `onnx_ops` and turns one node — or a short chain starting at it,
such as MatMul then Add of a bias, or Sigmoid then Mul that is SiLU — into an `OnnxRead`: its spec attributes,
its parameters in the lab's canonical layout (OIHW, OI), the tensors it reads and the tensor it produces.
Nothing here imports onnx: the importer hands over plain values (attributes as Python values, constants as
numpy arrays).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import OpSpecError


@dataclass
class OnnxNode:
    """One ONNX node: its name, type, input and output tensor names, and attributes as Python values."""

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict


@dataclass
class OnnxRead:
    """What an op made of a node (and of the nodes after it that it absorbed).

    `reads`: the tensors the layer reads, in the spec's input order; `output`: the tensor it produces;
    `absorbed`: the nodes after the first that it stands for too; `params`: parameter suffix → array in the
    canonical layout, `param_sources`: suffix → the initializer it came from (its name can name the layer);
    `alias`: no layer at all, the output is the input (Identity); `feature_order`: a flatten of another order
    (TensorFlow's (H, W, C)): ONNX feature j is the spec's feature feature_order[j], for the reader to permute;
    `then`: layers after the op's own that the node stands for too (ReduceMean without keepdims: a pool, a flatten).
    """

    attrs: dict
    reads: list[str]
    output: str
    absorbed: list[OnnxNode] = field(default_factory=list)
    params: dict = field(default_factory=dict)
    param_sources: dict = field(default_factory=dict)
    alias: bool = False
    feature_order: np.ndarray | None = None  # features in another order than the spec's (C, H, W) flatten: where each goes
    then: list = field(default_factory=list)  # spec layers ({"op": …, attributes}) the node also stands for, in order


class OnnxGraph:
    """What an op may ask about the graph around a node: constants, per-sample shapes, who reads a tensor."""

    def __init__(self, constants: dict, shapes: dict, consumers: dict, orders: dict, opset: int | None = None):
        self._constants, self._shapes, self._consumers, self._orders = constants, shapes, consumers, orders
        self.orders_read: set[str] = set()
        self.opset = opset  # the graph's default-domain opset: a node type's meaning may change with it

    def feature_order(self, tensor: str) -> np.ndarray | None:
        """Where each feature of `tensor` sits in the spec's (C, H, W) flatten (None: the same order); asking
        says the asking op puts them there (a dense layer permutes its weight's columns)."""
        self.orders_read.add(tensor)
        return self._orders.get(tensor)

    def constant(self, tensor: str) -> np.ndarray | None:
        """An initializer's or Constant node's value (None: a tensor computed from the input, or absent)."""
        return self._constants.get(tensor) if tensor else None

    def shape(self, tensor: str) -> tuple:
        """The per-sample shape (C, H, W) or (F,) of a computed tensor; H and W None unless the graph fixes them."""
        return self._shapes[tensor]

    def has_shape(self, tensor: str) -> bool:
        return tensor in self._shapes

    def only_reader(self, tensor: str) -> OnnxNode | None:
        """The one node reading `tensor` (None: several, or none: then nothing after may be absorbed)."""
        readers = self._consumers.get(tensor, [])
        return readers[0] if len(readers) == 1 else None

    def data_inputs(self, node: OnnxNode) -> list[str]:
        """The inputs of `node` that are computed tensors (not constants, not omitted)."""
        return [t for t in node.inputs if t and t not in self._constants]


def attr(node: OnnxNode, key: str, default=None):
    return node.attrs.get(key, default)


def require(condition: bool, text: str) -> None:
    """OpSpecError(text) unless `condition`: a setting the op cannot take, said in ONNX's words."""
    if not condition:
        raise OpSpecError(text)


def pads_tblr(pads) -> list[int]:
    """ONNX 2-D `pads` (x1_begin, x2_begin, x1_end, x2_end) as the spec's [top, bottom, left, right]."""
    top, left, bottom, right = (int(p) for p in pads)
    return [top, bottom, left, right]


def bias_of(node: OnnxNode, graph: OnnxGraph, channels: int, image: bool) -> np.ndarray | None:
    """A bias added by `node` when it is an Add of a constant with one value per output channel (the other input
    being `node`'s data input), as exporters that keep the bias out of Conv/MatMul write it; else None."""
    if node is None or node.op_type != "Add" or len(graph.data_inputs(node)) != 1:
        return None
    constant = next((graph.constant(t) for t in node.inputs if graph.constant(t) is not None), None)
    # on an image (N, C, H, W) a (C,) constant broadcasts along W: a bias there is (C, 1, 1)
    wanted = {(channels, 1, 1), (1, channels, 1, 1)} if image else {(channels,), (1, channels)}
    if constant is None or not (tuple(constant.shape) in wanted or constant.size == channels == 1):
        return None
    return constant.reshape(channels)


def unary(node: OnnxNode, graph: OnnxGraph, attrs: dict | None = None) -> OnnxRead:
    """The read of a one-input node without parameters."""
    data = graph.data_inputs(node)
    require(len(data) == 1, f"reads {len(data)} computed tensors, expected one")
    return OnnxRead(attrs or {}, data, node.outputs[0])


def followed_by(node: OnnxNode, graph: OnnxGraph, op_type: str) -> OnnxNode | None:
    """The one reader of `node`'s output when it is of `op_type` (the next link of a decomposed op)."""
    reader = graph.only_reader(node.outputs[0])
    return reader if reader is not None and reader.op_type == op_type else None


def scalar(graph: OnnxGraph, node: OnnxNode) -> float | None:
    """The value of `node`'s one scalar constant input (None: none, or not a scalar)."""
    values = [graph.constant(t) for t in node.inputs if graph.constant(t) is not None]
    if len(values) != 1 or values[0].size != 1:
        return None
    return float(values[0].reshape(()))


def multiplies_by_itself(node: OnnxNode | None, graph: OnnxGraph, x: str, gate: str) -> bool:
    """`node` is Mul(x, gate) or Mul(gate, x): the closing product of SiLU (x·σ(x)) and Mish (x·tanh(softplus x))."""
    return node is not None and node.op_type == "Mul" and sorted(node.inputs) == sorted([x, gate])


# ---------------------------------------------------------------------------------------------
# the routing ops' ONNX settings


def pool_window(node: OnnxNode) -> dict:
    """kernel, stride, padding and ceil_mode of an ONNX MaxPool/AveragePool (strides default to 1, ONNX's, not the
    kernel; ceil_mode 1 read as PyTorch's, which exports it, a last window starting in the right padding dropped)."""
    require(attr(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID"),
            f"auto_pad {attr(node, 'auto_pad')}: export with explicit pads")
    require(list(attr(node, "dilations", [1, 1])) == [1, 1], "dilations other than 1")
    require(len([t for t in node.outputs if t]) == 1, "its indices output is read (the spec's pools return values)")
    top, bottom, left, right = pads_tblr(attr(node, "pads", [0, 0, 0, 0]))
    require(top == bottom and left == right, f"pads {[top, bottom, left, right]} (top, bottom, left, right) differ "
            f"before and after: the spec's pools pad each side alike")
    return {"kernel": list(attr(node, "kernel_shape")), "stride": list(attr(node, "strides", [1, 1])),
            "padding": [top, left], "ceil_mode": bool(int(attr(node, "ceil_mode", 0)))}


#: where a nearest Resize output i reads, per ONNX coordinate_transformation_mode, for an integer scale s (the
#: output exactly s times the input: then half_pixel_symmetric is half_pixel, pytorch_half_pixel too)
_SOURCE = {"half_pixel": lambda i, s: (i + 0.5) / s - 0.5, "pytorch_half_pixel": lambda i, s: (i + 0.5) / s - 0.5,
           "half_pixel_symmetric": lambda i, s: (i + 0.5) / s - 0.5, "asymmetric": lambda i, s: i / s,
           "tf_half_pixel_for_nn": lambda i, s: (i + 0.5) / s}
_ROUND = {"round_prefer_floor": lambda x: math.ceil(x - 0.5), "round_prefer_ceil": lambda x: math.floor(x + 0.5),
          "floor": math.floor, "ceil": math.ceil}


def nearest_scale(node: OnnxNode, graph: OnnxGraph):
    """The integer scale of a nearest Resize/Upsample that copies each pixel into an s×s block (output i reads
    input ⌊i/s⌋, checked for the node's coordinate transformation and rounding), as the spec's upsample_nearest."""
    mode = attr(node, "mode", "nearest")
    require(mode == "nearest", f"mode {mode!r}: only nearest upsampling is supported")
    if node.op_type == "Upsample" or len(node.inputs) == 2:  # Upsample and Resize-10: asymmetric, floor
        transform, rounding = "asymmetric", "floor"
        scales = attr(node, "scales") if node.op_type == "Upsample" and len(node.inputs) < 2 else None
        scales = graph.constant(node.inputs[1]) if scales is None else np.asarray(scales)
    else:
        transform = attr(node, "coordinate_transformation_mode", "half_pixel")
        rounding = attr(node, "nearest_mode", "round_prefer_floor")
        scales = graph.constant(node.inputs[2]) if len(node.inputs) > 2 else None
    require(scales is not None and scales.size > 0, "its output size is given (sizes), not scales: export with an "
            "integer scale_factor")
    scales = [float(s) for s in np.asarray(scales).reshape(-1)]
    axes = [a % 4 for a in attr(node, "axes", [0, 1, 2, 3])]
    per_axis = dict(zip(axes, scales))
    pair = [per_axis.get(2, 1.0), per_axis.get(3, 1.0)]
    require(per_axis.get(0, 1.0) == per_axis.get(1, 1.0) == 1.0 and all(s == int(s) and s >= 1 for s in pair),
            f"scales {scales}: only integer scales of height and width are supported")
    require(transform in _SOURCE and rounding in _ROUND, f"coordinate_transformation_mode {transform!r} with "
            f"nearest_mode {rounding!r}: not a copy of each pixel into a block")
    for s in {int(s) for s in pair}:
        length = 4  # the pattern repeats every s outputs; the ends clamp into [0, length − 1]
        reads = [min(max(_ROUND[rounding](_SOURCE[transform](i, s)), 0), length - 1) for i in range(length * s)]
        require(reads == [i // s for i in range(length * s)], f"coordinate_transformation_mode {transform!r} with "
                f"nearest_mode {rounding!r} does not copy each pixel into a {s}×{s} block")
    return int(pair[0]) if pair[0] == pair[1] else [int(s) for s in pair]


def zero_pads(node: OnnxNode, graph: OnnxGraph) -> list[int]:
    """[top, bottom, left, right] of an ONNX Pad of zeros on height and width (pads an input since opset 11)."""
    require(attr(node, "mode", "constant") == "constant", f"mode {attr(node, 'mode')!r}: only zero padding")
    pads = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else attr(node, "pads")
    value = graph.constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else attr(node, "value", 0.0)
    require(len(node.inputs) < 4 or not node.inputs[3], "an axes input: export padding all four axes")
    require(pads is not None and float(np.asarray(value).reshape(())) == 0.0, "a pad value other than 0, or pads "
            "computed at run time")
    n0, c0, h0, w0, n1, c1, h1, w1 = (int(p) for p in np.asarray(pads).reshape(-1))
    require(n0 == c0 == n1 == c1 == 0 and min(h0, h1, w0, w1) >= 0, f"pads {list(np.asarray(pads).reshape(-1))}: "
            f"only non-negative padding of height and width")
    return [h0, h1, w0, w1]


def flattens_each_sample(node: OnnxNode, graph: OnnxGraph, image: bool | None = None) -> None:
    """ONNX Flatten at axis 1, or a Reshape of an image to [batch, −1] (as tf2onnx writes a Keras Flatten);
    `image`: whether it reads an image (default: its input's shape says)."""
    data = graph.data_inputs(node)
    image = len(data) == 1 and len(graph.shape(data[0])) == 3 if image is None else image
    require(len(data) == 1 and image, "it reshapes features, not an image (C, H, W)")
    if node.op_type == "Flatten":
        require(int(attr(node, "axis", 1)) == 1, f"axis {attr(node, 'axis')}: only flattening each sample (axis 1)")
        return
    target = graph.constant(node.inputs[1])
    require(target is not None, "its shape is computed at run time (Shape, Gather, Concat): export with "
            "torch.flatten(x, 1) or a constant shape")
    from . import BATCH_SIZE

    target = [0 if t is BATCH_SIZE else -1 if isinstance(t, OpenSize) else int(t)
              for t in np.asarray(target, dtype=object).reshape(-1)]
    require(len(target) == 2 and (target[1] == -1 or target[0] in (0, -1)), f"shape {target}: only flattening each "
            f"sample to [batch, -1] is supported")


#: node types computed from shapes and constants alone (a Reshape's target, 1/√d): values of the graph, not layers
SIZE_NODES = ("Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Sqrt", "Div", "Mul", "Reciprocal",
              "Identity")


@dataclass(frozen=True)
class OpenSize:
    """A size the graph leaves open (an image's height or width): per-sample axis `axis` of tensor `tensor`."""

    tensor: str
    axis: int


def _axes(node: OnnxNode, graph: OnnxGraph) -> list[int] | None:
    """Unsqueeze's or Squeeze's axes: an input from opset 13, an attribute before."""
    axes = graph.constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else attr(node, "axes")
    return None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]


def _numbers(values: list, node: OnnxNode) -> list[np.ndarray]:
    """The values as numeric arrays, OpSpecError where one holds the batch size or a size the graph leaves open."""
    from . import BATCH_SIZE

    for value in values:
        flat = np.asarray(value, dtype=object).reshape(-1)
        if any(v is BATCH_SIZE for v in flat):
            raise OpSpecError(f"{node.op_type} of the batch size: arithmetic on it merges the batch axis with another, "
                              f"and the lab's batch axis stays first and unchanged")
        if any(isinstance(v, OpenSize) for v in flat):
            raise OpSpecError(f"{node.op_type} of a size the graph leaves open (the image's height or width): export "
                              f"with that size fixed")
    return [np.asarray(v).astype(np.float64 if np.asarray(v).dtype == object else np.asarray(v).dtype) for v in values]


def size_value(node: OnnxNode, graph: OnnxGraph):
    """The value of a node that computes on sizes and constants only (Shape of a tensor, then Gather, Slice, Concat,
    Unsqueeze; a constant's Cast, Sqrt, Div, Mul): an array, object-typed where it holds ops.BATCH_SIZE (the batch's
    size, dim 0 of every tensor) or None (a size the graph leaves open); None when the node reads a computed tensor's
    values (a layer)."""
    from . import BATCH_SIZE

    if node.op_type not in SIZE_NODES:
        return None
    if node.op_type == "Shape":
        source = node.inputs[0]
        known = graph.constant(source)
        if known is None and not graph.has_shape(source):
            return None  # a tensor no layer computes: the reader says so
        dims = list(known.shape) if known is not None else [BATCH_SIZE, *(
            OpenSize(source, axis) if size is None else size for axis, size in enumerate(graph.shape(source)))]
        start, end = int(attr(node, "start", 0)), attr(node, "end")
        return np.array(dims[start:None if end is None else int(end)], dtype=object)
    present = [t for t in node.inputs if t]
    values = [graph.constant(t) for t in present]
    if any(v is None for v in values):
        return None
    x = values[0]
    if node.op_type == "Identity":
        return x
    if node.op_type == "Gather":
        return np.take(np.asarray(x, dtype=object), np.asarray(values[1]).astype(np.int64), axis=int(attr(node, "axis", 0)))
    if node.op_type == "Slice":
        x = np.asarray(x, dtype=object)
        if len(values) > 1:  # opset 10 on: starts, ends, axes, steps as inputs
            starts, ends = values[1], values[2]
            axes = values[3] if len(values) > 3 else range(len(starts))
            steps = values[4] if len(values) > 4 else [1] * len(starts)
        else:
            starts, ends = attr(node, "starts"), attr(node, "ends")
            axes, steps = attr(node, "axes", range(len(starts))), [1] * len(starts)
        index = [slice(None)] * x.ndim
        for axis, start, end, step in zip(axes, starts, ends, steps):
            index[int(axis)] = slice(int(start), int(end), int(step))  # INT64_MAX as the end: to the last
        return x[tuple(index)]
    if node.op_type == "Concat":
        return np.concatenate([np.asarray(v, dtype=object).reshape(-1) if np.ndim(v) <= 1 else np.asarray(v, dtype=object)
                               for v in values], axis=int(attr(node, "axis", 0)))
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = _axes(node, graph)
        x = np.asarray(x, dtype=object)
        if node.op_type == "Unsqueeze":
            for axis in sorted(a % (x.ndim + len(axes)) for a in axes):
                x = np.expand_dims(x, axis)
            return x
        return np.squeeze(x, axis=None if axes is None else tuple(a % x.ndim for a in axes))
    numbers = _numbers(values, node)
    if node.op_type == "Cast":
        from onnx import helper

        return numbers[0].astype(helper.tensor_dtype_to_np_dtype(int(attr(node, "to"))))
    operations = {"Sqrt": lambda a: np.sqrt(a), "Reciprocal": lambda a: 1 / a, "Div": lambda a, b: a / b,
                  "Mul": lambda a, b: a * b}
    result = operations[node.op_type](*numbers)
    return np.asarray(result, dtype=np.result_type(*numbers))


def reshape_target(node: OnnxNode, graph: OnnxGraph) -> list:
    """A Reshape's target: ops.BATCH_SIZE (its Shape, or 0 copying dim 0), integers, and OpenSize where it copies a
    size the graph leaves open (0 with allowzero 0 copies the input's size at that position)."""
    from . import BATCH_SIZE

    target = graph.constant(node.inputs[1])
    require(target is not None, "its shape is computed from a tensor's values, not from sizes")
    x = graph.data_inputs(node)[0]
    source = [BATCH_SIZE, *(OpenSize(x, axis) if size is None else size for axis, size in enumerate(graph.shape(x)))]
    copies = not int(attr(node, "allowzero", 0))
    resolved = []
    for position, t in enumerate(np.asarray(target, dtype=object).reshape(-1)):
        if copies and not isinstance(t, (type(BATCH_SIZE), OpenSize)) and int(t) == 0 and position < len(source):
            t = source[position]
        resolved.append(t if isinstance(t, (type(BATCH_SIZE), OpenSize)) else int(t))
    return resolved
