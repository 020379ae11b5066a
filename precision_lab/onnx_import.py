"""An ONNX file as a model spec (docs/models.md, "From ONNX").

`onnx_spec(path, loss)` walks an exported graph (torch.onnx, tf2onnx, jax2onnx) in its node order and asks the
op registry which op reads each node (`Op.onnx_ops`, `Op.from_onnx_node`): a layer of the layer form, the tensors
it reads turned into its `inputs`, its initializers into its parameters in the lab's canonical layout (OIHW,
OI). It returns that spec and those parameters; `precision_lab.model.read_onnx` makes the `Network` of them. An ONNX graph has no loss:
the caller names it (`loss:` beside `onnx:` in a spec file or a candidate YAML's `model:`; mse otherwise), and the
loss may take the graph's last node (`takes_onnx_output`: a classifier's softmax under cross_entropy).

Layer names: a parametrised layer whose weight initializer is named `<layer>.weight` (a PyTorch export) takes
`<layer>`, so the parameters keep their `state_dict` names; any other layer takes its node's name with each run
of characters other than letters, digits, `_` and `.` turned into `_` (`/conv1/Conv` → `conv1_Conv`), or its
type and position when unnamed.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .errors import ModelSpecError
from .ops import NETWORK_INPUT
from .ops import LOSSES, OPS, OpSpecError
from .ops.losses import MSE
from .ops.onnx_reading import OnnxGraph, OnnxNode, OnnxRead, size_value

#: how a user gets the package when it is missing (pyproject's `onnx` extra)
INSTALL_HINT = "pip install 'precision-lab[onnx]' (or pip install onnx)"


def supported_node_types() -> list[str]:
    """Every ONNX node type some op reads, sorted."""
    return sorted({t for op in OPS.values() for t in op.onnx_ops})


def onnx_spec(path: str | Path, loss: str = MSE.name, name: str | None = None) -> tuple[dict, dict, str]:
    """(layer-form spec, parameters by spec name as float32 arrays in the canonical layout, where) of an ONNX file:
    precision_lab.model.read_onnx turns it into a Network."""
    path = Path(path)
    model = _load(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    return _Importer(model.graph, str(path), opset).network(loss, name or path.stem)


def _load(path: Path):
    try:
        import onnx
    except ImportError:
        raise ModelSpecError(f"{path}: reading an ONNX model needs the onnx package: {INSTALL_HINT}") from None
    if not path.is_file():
        raise ModelSpecError(f"{path}: no such ONNX file (give the path of the exported .onnx, or a JSON/YAML spec)")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf's decode errors and external-data errors alike: one line
        raise ModelSpecError(f"{path}: not a readable ONNX model ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}): export it again (torch.onnx.export, tf2onnx, "
                             f"jax2onnx) or describe the network as a JSON/YAML spec") from None


def _python(value):
    """An ONNX attribute value as the ops read it: text as str, float32 numbers at their shortest decimal (0.01,
    not 0.009999999776482582: the value the exporter was given), tensors as arrays."""
    from onnx import numpy_helper

    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float):
        return float(str(np.float32(value)))
    if isinstance(value, (list, tuple)):
        return [_python(v) for v in value]
    if hasattr(value, "data_type") and hasattr(value, "dims"):
        return numpy_helper.to_array(value)
    return value


def _node(proto, index: int) -> OnnxNode:
    from onnx import helper

    attrs = {a.name: _python(helper.get_attribute_value(a)) for a in proto.attribute}
    return OnnxNode(proto.name or f"{proto.op_type}_{index}", proto.op_type, list(proto.input), list(proto.output),
                    attrs)


#: a module path as PyTorch's state_dict writes it ('head', 'features.0'): kept as the layer's name
_STATE_DICT_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")

#: the value attributes of an ONNX Constant node (one of them is set)
_CONSTANT_VALUES = ("value", "value_float", "value_floats", "value_int", "value_ints")


class _Importer:
    def __init__(self, graph, where: str, opset: int):
        from onnx import numpy_helper

        self.where, self.opset = where, opset
        self.constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.nodes = []
        for index, proto in enumerate(graph.node):
            node = _node(proto, index)
            if node.op_type == "Constant":  # data, not a layer: its value stands for the tensor
                value = next((node.attrs[k] for k in _CONSTANT_VALUES if k in node.attrs), None)
                if value is None:
                    self.fail(node, "a Constant without a numeric value")
                self.constants[node.outputs[0]] = np.asarray(value)
            else:
                self.nodes.append(node)
        consumers: dict[str, list[OnnxNode]] = {}
        for node in self.nodes:
            for tensor in dict.fromkeys(node.inputs):
                consumers.setdefault(tensor, []).append(node)
        self.input, self.input_shape, self.nhwc = self._input(graph, consumers)
        self.input_channels = self.input_shape[0]
        outputs = [o.name for o in graph.output]
        if len(outputs) != 1:
            raise ModelSpecError(f"{where}: {len(outputs)} graph outputs ({', '.join(outputs)}); the lab's networks "
                                 f"have one: export the network without its other outputs")
        self.output = outputs[0]
        self.shapes = {self.input: self.input_shape}
        self.orders: dict[str, np.ndarray] = {}  # tensors of features in another order than the spec's flatten
        self.graph = OnnxGraph(self.constants, self.shapes, consumers, self.orders, opset)
        self.producer = {self.input: NETWORK_INPUT}  # tensor → the layer name that computes it
        if self.nhwc is not None:  # the exporter's NHWC → NCHW transpose of the input: the lab's input is NCHW
            self.producer[self.nhwc.outputs[0]], self.shapes[self.nhwc.outputs[0]] = NETWORK_INPUT, self.input_shape
        self.layers, self.params, self.names = [], {}, set()

    def fail(self, node: OnnxNode, text: str):
        raise ModelSpecError(f"{self.where}: node '{node.name}' ({node.op_type}): {text}")

    def _input(self, graph, consumers) -> tuple[str, tuple, OnnxNode | None]:
        """(name, per-sample shape (C, H, W) with H, W None unless fixed, the NHWC → NCHW Transpose that is its only
        reader when the graph takes NHWC, as tf2onnx writes a Keras model)."""
        inputs = [i for i in graph.input if i.name not in self.constants]
        if len(inputs) != 1:
            raise ModelSpecError(f"{self.where}: {len(inputs)} graph inputs ({', '.join(i.name for i in inputs)}); "
                                 f"the lab's networks read one image batch (N, C, H, W)")
        name, dims = inputs[0].name, [d.dim_value or None for d in inputs[0].type.tensor_type.shape.dim]
        readers = consumers.get(name, [])
        nhwc = readers[0] if len(readers) == 1 and readers[0].op_type == "Transpose" and list(
            readers[0].attrs.get("perm", [])) == [0, 3, 1, 2] else None
        if len(dims) == 4 and nhwc is not None:
            dims = [dims[0], dims[3], dims[1], dims[2]]
        if len(dims) != 4 or dims[1] is None:
            raise ModelSpecError(f"{self.where}: input '{name}' is not (N, C, H, W) with a fixed channel count C "
                                 f"(its dims: {[d or '?' for d in dims]}); export with NCHW input (tf2onnx: "
                                 f"--inputs-as-nchw)")
        return name, tuple(dims[1:]), nhwc

    def network(self, loss: str, name: str) -> tuple[dict, dict, str]:
        absorbed: set[int] = {id(self.nhwc)}
        for node in self.nodes:
            if id(node) in absorbed:
                continue
            if loss in LOSSES and node.outputs[0] == self.output and self._loss_takes(LOSSES[loss], node):
                self.producer[self.output] = self._producer(node, self.graph.data_inputs(node)[0])
                continue
            if self._nhwc_output(node):
                self.producer[self.output] = self._producer(node, node.inputs[0])
                continue
            value = self._size_value(node)
            if value is not None:  # sizes and constants (a Reshape's target): a value of the graph, not a layer
                self.constants[node.outputs[0]] = value
                continue
            read = self._read(node)
            absorbed.update(id(n) for n in read.absorbed)
            self._carry_feature_order(node, read)
            if read.alias:
                self.producer[read.output] = self._producer(node, read.reads[0])
                self.shapes[read.output] = self.shapes[read.reads[0]]
            else:
                self._add_layer(node, read)
        last = self.layers[-1]["name"] if self.layers else None
        if self.producer.get(self.output) != last or last is None:
            raise ModelSpecError(f"{self.where}: the graph's output '{self.output}' is not computed by its last "
                                 f"node; the lab's network returns its last layer's output")
        spec = {"name": name, "input_channels": self.input_channels, "layers": self.layers, "loss": loss}
        return spec, self.params, self.where

    def _size_value(self, node: OnnxNode):
        try:
            return size_value(node, self.graph)
        except OpSpecError as exc:
            self.fail(node, str(exc))

    def _nhwc_output(self, node: OnnxNode) -> bool:
        """Whether `node` is the NCHW → NHWC Transpose of an image that a graph taking NHWC gives as its output (tf2onnx's
        Keras layout, in and out): read as the identity, since the loss and the target follow the output's layout."""
        return (self.nhwc is not None and node.outputs[0] == self.output and node.op_type == "Transpose"
                and list(node.attrs.get("perm", [])) == [0, 2, 3, 1] and len(self.shapes.get(node.inputs[0], ())) == 3)

    def _loss_takes(self, loss, node: OnnxNode) -> bool:
        """Whether the graph's last node belongs to the loss (a classifier's final softmax under cross_entropy)."""
        data = self.graph.data_inputs(node)
        if len(data) != 1 or data[0] not in self.shapes:
            return False
        try:
            return loss.takes_onnx_output(node, self.shapes[data[0]], self.opset)
        except OpSpecError as exc:
            self.fail(node, str(exc))

    def _read(self, node: OnnxNode) -> OnnxRead:
        """The read of the op that absorbs the most nodes from here (SiLU's Sigmoid then Mul before sigmoid)."""
        candidates = [op for op in OPS.values() if node.op_type in op.onnx_ops]
        if not candidates:
            raise ModelSpecError(f"{self.where}: node '{node.name}' is {node.op_type}, which the lab has no op for; "
                                 f"supported: {', '.join(supported_node_types())}")
        reads, refusals = [], []
        for op in candidates:
            try:
                read = op.from_onnx_node(node, self.graph)
            except OpSpecError as exc:
                refusals.append(str(exc))
                continue
            if read is not None:
                reads.append((len(read.absorbed), -len(reads), op, read))
        if not reads:
            self.fail(node, refusals[0] if refusals else f"the lab reads {node.op_type} only as part of "
                      f"{' or '.join(op.name for op in candidates)} (docs/models.md, \"From ONNX\")")
        _, _, op, read = max(reads, key=lambda r: r[:2])
        read.attrs = {"op": op.name, **read.attrs}
        return read

    def _carry_feature_order(self, node: OnnxNode, read: OnnxRead) -> None:
        """Features in another order pass through elementwise ops and an alias; any other reader must have asked for
        the order (a dense layer permuting its columns)."""
        permuted = [t for t in read.reads if t in self.orders]
        op = OPS[read.attrs["op"]] if not read.alias else None
        if permuted and (read.alias or op.elementwise):
            self.orders[read.output] = self.orders[permuted[0]]
        elif permuted and not set(permuted) <= self.graph.orders_read:
            self.fail(node, "reads features flattened in (H, W, C) order, which only a dense layer can take")
        if read.feature_order is not None:
            self.orders[read.output] = read.feature_order

    def _producer(self, node: OnnxNode, tensor: str) -> str:
        if tensor not in self.producer:
            self.fail(node, f"reads '{tensor}', which no earlier node computes")
        return self.producer[tensor]

    def _add_layer(self, node: OnnxNode, read: OnnxRead) -> None:
        op = OPS[read.attrs["op"]]
        reads = [self._producer(node, t) for t in read.reads]
        layer_name = self._name(node, read)
        layer = {"name": layer_name, **read.attrs}  # name, op, then the op's attributes
        previous = self.layers[-1]["name"] if self.layers else NETWORK_INPUT
        arity = 2 if op.combines else 1
        if len(reads) != arity and not (op.joins_many and len(reads) > arity):
            self.fail(node, f"reads {len(reads)} computed tensors; the spec's {op.name} reads {arity}")
        # as from_module writes it: the previous layer implied, a second input by `from`, anything else `inputs`
        if arity == 2 and reads[0] == previous and reads[1] != NETWORK_INPUT:
            layer["from"] = reads[1]
        elif reads != [previous]:
            layer["inputs"] = reads
        shapes = [self.shapes[t] for t in read.reads]
        if len(shapes) > arity:  # a concat of k > 2 tensors: the chain of two-input concats it expands to
            link = {k: v for k, v in layer.items() if k not in ("inputs", "from")}
            shape = shapes[0]
            for more in shapes[1:]:
                shape = self._shape(node, link, [shape, more])
        else:
            shape = self._shape(node, layer, shapes)
        self.layers.append(layer)
        for suffix, value in read.params.items():
            self.params[f"{layer_name}.{suffix}"] = np.ascontiguousarray(value, dtype=np.float32)
        for extra in read.then:  # the node's further layers, each reading the one before
            self.layers.append({"name": self._unique(f"{layer_name}_{extra['op']}"), **extra})
            shape = self._shape(node, self.layers[-1], [shape])
        self.shapes[read.output] = shape
        self.producer[read.output] = self.layers[-1]["name"]

    def _shape(self, node: OnnxNode, layer: dict, shapes: list) -> tuple:
        """The per-sample output shape (any image size), through the layers the written one stands for."""
        try:
            for index, raw in enumerate(OPS[layer["op"]].expand(layer)):
                op = OPS[raw["op"]]
                attrs = op.normalise({k: v for k, v in raw.items() if k not in ("op", "name", "from", "inputs")})
                shapes = [tuple(op.out_shape(attrs, shapes if index == 0 else shapes[:1]))]
        except OpSpecError as exc:
            self.fail(node, str(exc))
        return shapes[0]

    def _name(self, node: OnnxNode, read: OnnxRead) -> str:
        prefix = read.param_sources.get("weight", "").removesuffix(".weight")
        if (read.param_sources.get("weight", "").endswith(".weight") and _STATE_DICT_NAME.fullmatch(prefix)
                and prefix not in self.names and prefix != NETWORK_INPUT):
            name = prefix
        else:
            name = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9_.]+", "_", node.name)).strip("._")
            name = name or node.op_type.lower()
            name = self._unique(name + "_layer" if name == NETWORK_INPUT else name)
        self.names.add(name)
        return name

    def _unique(self, name: str) -> str:
        """`name`, or `name_2`, `name_3` … when a layer has it."""
        base, count = name, 1
        while name in self.names:
            count += 1
            name = f"{base}_{count}"
        self.names.add(name)
        return name
