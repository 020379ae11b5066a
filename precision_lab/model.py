"""Networks as model specs (docs/design.md, "Networks").

A model spec describes a network in one of two forms, both valid in `bundle.json`:

* the seed form ``{"channels": [1, 16, 16, 1], "kernel_size": 3, "padding": 1,
  "activation": "relu", "loss": "mse"}``: conv layers ``conv1 … convK`` with the activation
  (named ``act1 …``) between them and none after the last;
* the layer form ``{"input_channels": 1, "layers": [{"name": …, "op": …, …}, …], "loss": …}``:
  layers run in order, each on the previous layer's output; ``add`` and ``concat`` combine it
  with the output of the earlier layer named in ``from``.

`load_model` reads either (a dict, a JSON/YAML file, or a built-in name), or an exported `.onnx` file
(precision_lab.onnx_import; `{"onnx": FILE, "loss": …}` names its loss), into a `Network`, the
one value every consumer reads (problem, reference, error model, verdicts, doctors, bundles,
experiments). Every check happens here, before anything runs: an unknown op names the op and
the supported set; channels that do not chain, a `from` that names no earlier layer, a
duplicate name, a size the network cannot take — each one line naming the layer
(`ModelSpecError`, exit code 2 from the CLI). Per-op rules live in `precision_lab.ops`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import ModelSpecError  # noqa: F401 - ModelSpecError is read from here too
from .ops import OPS, LOSSES, OpSpecError
from .ops import arity as op_arity
from .ops.layers import Conv2d
from .ops.losses import MSE
from .ops.pointwise import ReLU

#: the seed network (docs/design.md, "The motivating case"): the default everywhere
SEED_SPEC = {"channels": [1, 16, 16, 1], "kernel_size": 3, "padding": 1, "activation": ReLU.name, "loss": MSE.name}

SEED_FORM_KEYS = ("channels", "kernel_size", "padding", "activation", "loss", "bias", "name")
LAYER_FORM_KEYS = ("input_channels", "layers", "loss", "name")
#: activations a seed-form spec may name: the elementwise ops
SEED_FORM_ACTIVATIONS = tuple(name for name, op in OPS.items() if op.elementwise)
#: a model spec file is a few kilobytes; anything this large is the wrong file (and is not parsed)
MAX_SPEC_BYTES = 1 << 20
#: image sides searched when a network fixes its input size (a linear layer after a flatten)
LARGEST_SIDE = 4096
#: sides tried (this to 4×) to see whether a flatten's image follows the input's size
MIN_FREE_SIDE = 16


@dataclass(frozen=True)
class Layer:
    """One layer of a network: its op, its attributes (defaults filled in), where it reads from."""

    index: int
    op: str
    attrs: dict = field(hash=False, compare=False)
    name: str | None = None
    source: int | None = None  # a two-input op: index of its second input (`from`, or inputs[1])
    reads: tuple[int, ...] | None = None  # the indices named by `inputs` (None: the previous layer, and `from`)

    @property
    def label(self) -> str:
        """How messages name the layer: its name, else its position and op."""
        return self.name if self.name else f"layer {self.index + 1} ({self.op})"

    @property
    def inputs(self) -> tuple[int, ...]:
        """Indices of the layers whose outputs it reads (−1: the network input)."""
        if self.reads is not None:
            return self.reads
        return (self.index - 1,) if self.source is None else (self.index - 1, self.source)


@dataclass(frozen=True)
class Network:
    """A validated network: layers in order, loss, parameter names and canonical shapes.

    Weights are held in the canonical layout OIHW (conv2d) and OI (linear), as PyTorch's
    `state_dict` names and shapes them: `<layer name>.weight`, `<layer name>.bias`.
    """

    input_channels: int
    layers: tuple[Layer, ...]
    loss: str
    spec: dict = field(hash=False, compare=False)  # the spec as given (bundles write it back)
    name: str = "network"

    # -----------------------------------------------------------------------------------------
    # parameters

    @cached_property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter, in layer order (weight before bias), with its canonical shape."""
        shapes = {}
        for layer in self.layers:
            for suffix, shape in OPS[layer.op].param_shapes(layer.attrs).items():
                shapes[f"{layer.name}.{suffix}"] = tuple(shape)
        return shapes

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(self.param_shapes)

    @property
    def weight_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.param_shapes if n.endswith(".weight"))

    @property
    def bias_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.param_shapes if n.endswith(".bias"))

    def layer_of(self, parameter: str) -> Layer:
        """The layer owning `parameter` (e.g. 'conv2.weight' → conv2)."""
        # the longest layer name the parameter starts with ('attn.out_proj.weight' → attn)
        owners = [layer for layer in self.layers if layer.name and parameter.startswith(layer.name + ".")]
        if not owners:
            raise KeyError(f"no layer owns {parameter!r} in {self.name}")
        return max(owners, key=lambda layer: len(layer.name))

    def index_of(self, name: str) -> int:
        for layer in self.layers:
            if layer.name == name:
                return layer.index
        raise KeyError(f"no layer named {name!r} in {self.name}")

    @property
    def parametrised_layers(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if OPS[layer.op].parametrised)

    @property
    def named_layers(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers if layer.name)

    @cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        """For each layer output (−1: the network input), the layers that read it, in order."""
        readers: dict[int, list[int]] = {i: [] for i in range(-1, len(self.layers))}
        for layer in self.layers:
            for i in layer.inputs:
                readers[i].append(layer.index)
        return {i: tuple(r) for i, r in readers.items()}

    # -----------------------------------------------------------------------------------------
    # shapes

    def shapes(self, height: int, width: int) -> list[tuple[int, ...]]:
        """Per-sample output shape of every layer ((C, H, W) or (F,)) for an input of height × width.

        Raises ModelSpecError naming the first layer the size does not fit.
        """
        shapes: dict[int, tuple[int, ...]] = {-1: (self.input_channels, height, width)}
        for layer in self.layers:
            try:
                shapes[layer.index] = tuple(OPS[layer.op].out_shape(layer.attrs, [shapes[i] for i in layer.inputs]))
            except OpSpecError as exc:
                raise ModelSpecError(f"{self.name}: {layer.label}: {exc}") from None
        return [shapes[i] for i in range(len(self.layers))]

    def output_shape(self, height: int, width: int) -> tuple[int, ...]:
        return self.shapes(height, width)[-1]

    @property
    def mask_names(self) -> tuple[str, ...]:
        """The masks a request carries beyond the parameters ('<layer>.mask' of a training dropout), in layer order."""
        return tuple(f"{layer.name}.{suffix}" for layer in self.layers for suffix in OPS[layer.op].request_masks(layer.attrs))

    def mask_shapes(self, batch: int, height: int, width: int) -> dict[str, tuple[int, ...]]:
        """Each mask's shape: its layer's output, batch included (a mask is drawn per sample)."""
        if not self.mask_names:
            return {}
        shapes = self.shapes(height, width)
        return {f"{layer.name}.{suffix}": (batch, *shapes[layer.index]) for layer in self.layers
                for suffix in OPS[layer.op].request_masks(layer.attrs)}

    def fits(self, height: int, width: int) -> bool:
        try:
            self.check_size(height, width)
        except ModelSpecError:
            return False
        return True

    def check_size(self, height: int, width: int) -> None:
        """Raise ModelSpecError (naming the layer) unless an input of height × width runs, loss included."""
        out = self.output_shape(height, width)
        try:
            LOSSES[self.loss].check_output(out, "")
        except OpSpecError as exc:
            raise ModelSpecError(f"{self.name}: loss {self.loss}: {exc}") from None

    @cached_property
    def couples_batch(self) -> bool:
        """True when a layer's output for one sample reads the others (a training-mode batch norm's statistics)."""
        return any(OPS[layer.op].couples_batch(layer.attrs) for layer in self.layers)

    @cached_property
    def has_fixed_size(self) -> bool:
        """True when a flatten feeds a linear layer an image whose size follows the input's: the image size is then
        fixed by the linear layer's `in` (a global pool before the flatten leaves every size free)."""
        if not any(OPS[layer.op].flattens for layer in self.layers):
            return False
        for axis in (0, 1):
            reached = {self._flatten_length(axis, n) for n in range(MIN_FREE_SIDE, 4 * MIN_FREE_SIDE)} - {None}
            if len(reached) != 1:
                return True
        return False

    def sizes_near(self, height: int, width: int, limit: int = 8) -> list[tuple[int, int]]:
        """Up to `limit` sizes (H, W) this network takes, nearest to height × width first."""
        if self.has_fixed_size:
            pairs = self._fixed_sizes()
        else:
            pairs = [(h, w) for h in self._axis_lengths(0, height) for w in self._axis_lengths(1, width)]
        pairs = sorted(pairs, key=lambda hw: (abs(math.log(hw[0] / height)) + abs(math.log(hw[1] / width)), hw))
        return [hw for hw in pairs if self.fits(*hw)][:limit]

    def _axis_lengths(self, axis: int, near: int, span: int = 64) -> list[int]:
        """Lengths along one axis that every spatial layer divides, within `span` of `near`, nearest first."""
        ok = [n for n in range(max(1, near - span), near + span + 1) if self._flatten_length(axis, n) is not None]
        return sorted(ok, key=lambda n: (abs(n - near), n))[:32]

    def _flatten_length(self, axis: int, length: int) -> int | None:
        """The length along `axis` where the image is flattened (or at the output), None if a layer cannot take it."""
        lengths: dict[int, int | None] = {-1: length}
        for layer in self.layers:
            if OPS[layer.op].flattens:
                return lengths[layer.inputs[0]]
            try:
                lengths[layer.index] = OPS[layer.op].axis_length(layer.attrs, [lengths[i] for i in layer.inputs], axis)
            except OpSpecError:
                return None
        return lengths[len(self.layers) - 1]

    def _fixed_sizes(self) -> list[tuple[int, int]]:
        """Every (H, W) up to LARGEST_SIDE whose flattened size matches the linear layer after the flatten."""
        flatten = next(layer for layer in self.layers if OPS[layer.op].flattens)
        symbolic = self._symbolic_shapes()
        channels = symbolic[flatten.inputs[0]][0]
        consumer = next((layer for layer in self.layers[flatten.index + 1:] if OPS[layer.op].parametrised), None)
        if consumer is None:
            return []
        features = consumer.attrs["in"]
        by_height: dict[int, list[int]] = {}
        by_width: dict[int, list[int]] = {}
        for side in range(1, LARGEST_SIDE + 1):
            for axis, table in ((0, by_height), (1, by_width)):
                reduced = self._flatten_length(axis, side)
                if reduced is not None:
                    table.setdefault(reduced, []).append(side)
        pairs = []
        for h, heights in by_height.items():
            if features % (channels * h) == 0:
                pairs += [(height, width) for height in heights[:4] for width in by_width.get(features // (channels * h), [])[:4]]
        return pairs

    def _symbolic_shapes(self) -> dict[int, tuple]:
        shapes: dict[int, tuple] = {-1: (self.input_channels, None, None)}
        for layer in self.layers:
            shapes[layer.index] = tuple(OPS[layer.op].out_shape(layer.attrs, [shapes[i] for i in layer.inputs]))
        return shapes

    def default_size(self, preferred: int = 1024) -> tuple[int, int]:
        """The size diagnoses run at when none is asked: `preferred`² if it fits, else the nearest that does."""
        if self.fits(preferred, preferred):
            return preferred, preferred
        near = self.sizes_near(preferred, preferred, limit=64)
        smaller = preferred // 2
        while not near and smaller >= MIN_FREE_SIDE:  # a cap on size (attention's tokens²): the largest that fits
            near = self.sizes_near(smaller, smaller, limit=64)
            smaller //= 2
        square = [hw for hw in near if hw[0] == hw[1]]
        if not near:
            raise ModelSpecError(f"{self.name}: no image size up to {LARGEST_SIDE}×{LARGEST_SIDE} fits this network "
                                 f"(check the `in` of its linear layers against the flattened size)")
        return (square or near)[0]

    def describe_size_fix(self, height: int, width: int) -> str:
        """' (e.g. 64×64 fits)' for an error message about a size that does not fit."""
        near = self.sizes_near(height, width, limit=1)
        return f" (e.g. {near[0][0]}×{near[0][1]} fits)" if near else ""

    # -----------------------------------------------------------------------------------------
    # text

    @property
    def is_seed_form(self) -> bool:
        return "channels" in self.spec

    def summary(self) -> str:
        """One line: the layers and the loss (e.g. 'conv2d 1→16, relu, conv2d 16→16, …; loss mse')."""
        parts = [OPS[layer.op].describe(layer.attrs) for layer in self.layers]
        return f"{', '.join(parts)}; loss {self.loss}"

    def to_json(self) -> dict:
        return json.loads(json.dumps(self.spec))


# ---------------------------------------------------------------------------------------------
# reading specs


def seed_network() -> Network:
    """The seed CNN (the default network)."""
    return parse_spec(SEED_SPEC, "seed")


def parse_spec(spec: Any, where: str = "model") -> Network:
    """A Network from a spec dict of either form; every error is one line naming `where` and the layer."""
    if not isinstance(spec, dict):
        raise ModelSpecError(f"{where}: a model spec is a mapping (seed form with 'channels', or 'layers'), "
                             f"got {type(spec).__name__}")
    if "channels" in spec:
        return _network(_expand_seed_form(spec, where), where, spec)
    if "layers" in spec:
        return _network(spec, where, spec)
    if ONNX_KEY in spec:
        return _onnx_form(spec, None, where)
    if spec.get("opaque") is True:
        raise ModelSpecError(f"{where}: an opaque model has no spec the lab can compute; use a candidate YAML "
                             f"with `model: opaque` and `start: DIR` (reference-free gradient check)")
    raise ModelSpecError(f"{where}: a model spec needs 'channels' (seed form) or 'layers' (layer form); "
                         f"got keys {sorted(map(str, spec))}")


def _expand_seed_form(spec: dict, where: str) -> dict:
    unknown = sorted(set(map(str, spec)) - set(SEED_FORM_KEYS))
    if unknown:
        raise ModelSpecError(f"{where}: unknown key {unknown[0]!r} in a seed-form spec: expected keys among "
                             f"{', '.join(SEED_FORM_KEYS)}")
    channels = spec.get("channels")
    if not isinstance(channels, list) or len(channels) < 2 or not all(_is_int(c) and c >= 1 for c in channels):
        raise ModelSpecError(f"{where}: key 'channels' is {channels!r}: expected a list of at least two positive "
                             f"integers (input, hidden…, output)")
    activation = spec.get("activation", ReLU.name)
    if activation not in SEED_FORM_ACTIVATIONS:
        raise ModelSpecError(f"{where}: key 'activation' is {activation!r}: expected one of "
                             f"{', '.join(SEED_FORM_ACTIVATIONS)}")
    layers = []
    n_conv = len(channels) - 1
    for k in range(n_conv):
        layers.append({"name": f"conv{k + 1}", "op": Conv2d.name, "in": channels[k], "out": channels[k + 1],
                       "kernel": spec.get("kernel_size", 3), "padding": spec.get("padding", 0),
                       "bias": spec.get("bias", True)})
        if k < n_conv - 1:
            layers.append({"name": f"act{k + 1}", "op": activation})
    return {"input_channels": channels[0], "layers": layers, "loss": spec.get("loss", MSE.name)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _network(spec: dict, where: str, original: dict) -> Network:
    unknown = sorted(set(map(str, spec)) - set(LAYER_FORM_KEYS))
    if unknown:
        raise ModelSpecError(f"{where}: unknown key {unknown[0]!r}: expected keys among {', '.join(LAYER_FORM_KEYS)}")
    channels = spec.get("input_channels", 1)
    if not _is_int(channels) or channels < 1:
        raise ModelSpecError(f"{where}: key 'input_channels' is {channels!r}: expected a positive integer")
    loss = spec.get("loss", MSE.name)
    if loss not in LOSSES:
        raise ModelSpecError(f"{where}: unknown loss {loss!r}: supported losses are {', '.join(LOSSES)}")
    raw_layers = spec.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise ModelSpecError(f"{where}: key 'layers' must be a non-empty list of layers")
    layers, names = [], {}
    for index, raw in enumerate(_expand(raw_layers, where)):
        layer = _layer(raw, index, names, where)
        if layer.name:
            names[layer.name] = index
        layers.append(layer)
    name = spec.get("name") or original.get("name") or where
    network = Network(channels, tuple(layers), loss, dict(original), str(name))
    _check_chain(network, where)
    return network


def _expand(raw_layers: list, where: str) -> list:
    """The spec layers the written ones stand for (Op.expand: a convolution's per-side padding is a zero_pad2d)."""
    expanded = []
    for index, raw in enumerate(raw_layers):
        op = OPS.get(raw.get("op")) if isinstance(raw, dict) else None
        if op is None:
            expanded.append(raw)
            continue
        try:
            expanded += op.expand(raw)
        except OpSpecError as exc:
            raise ModelSpecError(f"{where}: {raw.get('name') or f'layer {index + 1} ({op.name})'}: {exc}") from None
    return expanded


def _layer(raw, index: int, names: dict[str, int], where: str) -> Layer:
    label = f"{where}: layer {index + 1}"
    if not isinstance(raw, dict):
        raise ModelSpecError(f"{label}: expected a mapping with 'op', got {type(raw).__name__}")
    op = raw.get("op")
    if op not in OPS:
        raise ModelSpecError(f"{label}: unknown op {op!r}: supported ops are {', '.join(OPS)}")
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not name or any(c.isspace() for c in name)
                             or name.startswith(".") or name.endswith(".")):
        raise ModelSpecError(f"{label} ({op}): name {name!r} must be a non-empty string without spaces")
    label = f"{where}: {name}" if name else label + f" ({op})"
    if name in names:
        raise ModelSpecError(f"{label}: duplicate layer name (layer {names[name] + 1} has it too)")
    if name == NETWORK_INPUT:
        raise ModelSpecError(f"{label}: the name {NETWORK_INPUT!r} means the network's input in 'inputs': "
                             f"choose another")
    if OPS[op].parametrised and not name:
        raise ModelSpecError(f"{label}: a {op} layer has parameters and needs a unique 'name' "
                             f"(its parameters are '<name>.weight' and '<name>.bias')")
    attrs = {k: v for k, v in raw.items() if k not in ("op", "name", "from", "inputs")}
    source, reads = None, None
    arity = op_arity(OPS[op])
    if "inputs" in raw:
        reads = _named_inputs(raw, arity, names, label)
        source = reads[1] if arity == 2 else None
    elif OPS[op].combines:
        target = raw.get("from")
        if target not in names:
            earlier = ", ".join(names) or "none"
            raise ModelSpecError(f"{label}: 'from' is {target!r}, which names no earlier layer (named earlier: {earlier})")
        source = names[target]
    elif "from" in raw:
        raise ModelSpecError(f"{label}: key 'from' belongs to ops of two inputs only "
                             f"({', '.join(n for n, o in OPS.items() if o.combines)}); 'inputs' names any layer's")
    try:
        attrs = OPS[op].normalise(attrs)
    except OpSpecError as exc:
        raise ModelSpecError(f"{label}: {exc}") from None
    masks = OPS[op].request_masks(attrs)
    if masks and not name:
        raise ModelSpecError(f"{label}: this {op} layer reads a mask the request carries and needs a unique 'name' "
                             f"(its mask is '<name>.{masks[0]}')")
    return Layer(index, op, attrs, name, source, reads)


#: the name `inputs` gives the network's own input (no layer may take it)
from .ops import NETWORK_INPUT  # noqa: E402 - read from here too


def _named_inputs(raw: dict, arity: int, names: dict[str, int], label: str) -> tuple[int, ...]:
    """The layer indices (−1: the network input) that a layer's `inputs` names, `arity` of them, all earlier."""
    given = raw["inputs"]
    if "from" in raw:
        raise ModelSpecError(f"{label}: give 'inputs' or 'from', not both")
    if not isinstance(given, list) or len(given) != arity or not all(isinstance(n, str) for n in given):
        raise ModelSpecError(f"{label}: 'inputs' is {given!r}: expected a list of {arity} layer name"
                             f"{'s' if arity > 1 else ''} (or \"{NETWORK_INPUT}\" for the network's input)")
    unknown = [n for n in given if n != NETWORK_INPUT and n not in names]
    if unknown:
        earlier = ", ".join(names) or "none"
        raise ModelSpecError(f"{label}: 'inputs' names {unknown[0]!r}, which is no earlier layer (named earlier: "
                             f"{earlier}, and \"{NETWORK_INPUT}\")")
    return tuple(-1 if n == NETWORK_INPUT else names[n] for n in given)


def _check_chain(network: Network, where: str) -> None:
    """Channels chain and combines match, checked on symbolic sizes (any image size that divides)."""
    shapes: dict[int, tuple] = {-1: (network.input_channels, None, None)}
    for layer in network.layers:
        try:
            shapes[layer.index] = tuple(OPS[layer.op].out_shape(layer.attrs, [shapes[i] for i in layer.inputs]))
        except OpSpecError as exc:
            raise ModelSpecError(f"{where}: {layer.label}: {exc}") from None
    unread = [layer for layer in network.layers[:-1] if not network.consumers[layer.index]]
    if unread:
        raise ModelSpecError(f"{where}: {unread[0].label}: its output is read by no layer and is not the network's "
                             f"output (the last layer): name it in a later layer's 'inputs', or remove it")
    try:
        LOSSES[network.loss].check_output(shapes[len(network.layers) - 1], "")
    except OpSpecError as exc:
        raise ModelSpecError(f"{where}: loss {network.loss}: {exc}") from None


#: built-in networks by name (the examples under examples/models/ are files, loaded by path)
BUILTIN_MODELS = {"seed": SEED_SPEC}


def symbolic_shapes(spec: dict) -> list[tuple]:
    """Per-layer per-sample shapes of a layer-form spec, the height and width left free (None): the channel counts a
    traced module reads (precision_lab.tracing)."""
    network = parse_spec(spec, spec.get("name", "model"))
    shapes = network._symbolic_shapes()
    return [shapes[i] for i in range(len(network.layers))]


def load_model(source: Any = None, base_dir: str | Path | None = None) -> Network:
    """A Network from a spec dict, a JSON/YAML file path, a built-in name ('seed'), or a Network.

    None gives the seed network. Relative paths resolve against `base_dir` when not found as given.
    """
    if source is None:
        return seed_network()
    if isinstance(source, Network):
        return source
    if isinstance(source, dict):
        if MODULE_KEY in source:
            return _module_form(source, "model")
        return _onnx_form(source, base_dir, "model") if ONNX_KEY in source else parse_spec(source)
    if isinstance(source, (str, Path)):
        text = str(source)
        if text in BUILTIN_MODELS:
            return parse_spec(BUILTIN_MODELS[text], text)
        path = _resolved(text, base_dir)
        if path.suffix.lower() == ONNX_SUFFIX:
            return load_onnx(path)
        return _load_file(path, text)
    raise ModelSpecError(f"model must be a spec mapping, a JSON/YAML file or one of {', '.join(BUILTIN_MODELS)}; "
                         f"got {type(source).__name__}")


#: an exported network: a `.onnx` file, or a spec {"onnx": FILE, "loss": …, "name": …} (the graph has no loss)
ONNX_SUFFIX = ".onnx"
ONNX_KEY = "onnx"
ONNX_FORM_KEYS = (ONNX_KEY, "loss", "name")


def _resolved(text: str, base_dir: str | Path | None) -> Path:
    """A path as given, else relative to `base_dir` (a spec's or candidate YAML's folder)."""
    path = Path(text)
    if not path.is_absolute() and not path.exists() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def _onnx_form(spec: dict, base_dir: str | Path | None, where: str) -> Network:
    """The network of {"onnx": FILE, "loss": …, "name": …}: FILE relative to `base_dir`, loss mse unless named."""
    unknown = sorted(set(map(str, spec)) - set(ONNX_FORM_KEYS))
    if unknown:
        raise ModelSpecError(f"{where}: unknown key {unknown[0]!r} beside 'onnx': expected keys among "
                             f"{', '.join(ONNX_FORM_KEYS)}")
    file = spec[ONNX_KEY]
    if not isinstance(file, str) or not file.lower().endswith(ONNX_SUFFIX):
        raise ModelSpecError(f"{where}: key 'onnx' is {file!r}: expected the path of an {ONNX_SUFFIX} file")
    loss = spec.get("loss", MSE.name)
    if loss not in LOSSES:
        raise ModelSpecError(f"{where}: unknown loss {loss!r}: supported losses are {', '.join(LOSSES)}")
    return load_onnx(_resolved(file, base_dir), loss, spec.get("name"))


#: a PyTorch module built by a callable, read as from_module reads it: {"module": "torchvision.models:resnet18",
#: "arguments": {"num_classes": 10}, "loss": "cross_entropy"}; the candidate program builds the same module
MODULE_KEY = "module"
MODULE_FORM_KEYS = (MODULE_KEY, "arguments", "loss", "name", "input_channels", "training")


def _module_form(spec: dict, where: str) -> Network:
    """The network of {"module": "package.path:callable", "arguments": {…}, "loss": …, "training": true}: the callable
    called with the arguments, in training mode unless `training` is false, traced (precision_lab.tracing)."""
    import importlib

    from .tracing import module_spec

    unknown = sorted(set(map(str, spec)) - set(MODULE_FORM_KEYS))
    if unknown:
        raise ModelSpecError(f"{where}: unknown key {unknown[0]!r} beside 'module': expected keys among "
                             f"{', '.join(MODULE_FORM_KEYS)}")
    reference, arguments = spec[MODULE_KEY], spec.get("arguments", {})
    if not isinstance(reference, str) or reference.count(":") != 1:
        raise ModelSpecError(f"{where}: key 'module' is {reference!r}: expected 'package.module:callable' "
                             f"(e.g. 'torchvision.models:resnet18')")
    if not isinstance(arguments, dict):
        raise ModelSpecError(f"{where}: key 'arguments' is {arguments!r}: expected a mapping of keyword arguments")
    package, attribute = reference.split(":")
    try:
        build = getattr(importlib.import_module(package), attribute)
    except ImportError as exc:
        raise ModelSpecError(f"{where}: cannot import {package} ({exc}): install it beside precision-lab") from None
    except AttributeError:
        raise ModelSpecError(f"{where}: {package} has no {attribute!r}") from None
    try:
        module = build(**arguments)
    except Exception as exc:  # noqa: BLE001 - the user's constructor: one line
        raise ModelSpecError(f"{where}: {reference}(**{arguments}) failed: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    module.train(bool(spec.get("training", True)))
    loss = spec.get("loss", MSE.name)
    if loss not in LOSSES:
        raise ModelSpecError(f"{where}: unknown loss {loss!r}: supported losses are {', '.join(LOSSES)}")
    layer_spec = module_spec(module, symbolic_shapes, spec.get("input_channels"), loss, spec.get("name") or attribute)
    return parse_spec(layer_spec, f"{where} ({reference})")


def load_onnx(path: str | Path, loss: str = MSE.name, name: str | None = None) -> Network:
    """The Network an ONNX file describes (its parameters' values: read_onnx)."""
    return read_onnx(path, loss, name)[0]


def read_onnx(path: str | Path, loss: str = MSE.name, name: str | None = None) -> tuple[Network, dict]:
    """(Network, parameters by spec name as float32 arrays in the canonical layout) of an ONNX file
    (precision_lab.onnx_import reads the graph into a layer-form spec)."""
    from .onnx_import import onnx_spec

    spec, params, where = onnx_spec(path, loss, name)
    network = parse_spec(spec, where)
    for parameter, shape in network.param_shapes.items():
        if params[parameter].shape != shape:  # the op's layout reading and its param_shapes disagree
            raise ModelSpecError(f"{where}: {parameter} reads as {list(params[parameter].shape)}, the spec wants "
                                 f"{list(shape)}")
    return network, params


def _load_file(path: Path, given: str) -> Network:
    if not path.is_file():
        raise ModelSpecError(f"{given}: no such model spec file (give a .json or .yaml spec, or one of "
                             f"{', '.join(BUILTIN_MODELS)})")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise ModelSpecError(f"{path}: {path.stat().st_size} bytes is not a model spec (at most {MAX_SPEC_BYTES})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ModelSpecError(f"{path}: not a UTF-8 text file (expected a JSON or YAML model spec)") from None
    try:
        if path.suffix.lower() == ".json":
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except (json.JSONDecodeError, Exception) as exc:  # noqa: BLE001 - yaml errors too: one line
        raise ModelSpecError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'} "
                             f"({' '.join(str(exc).split())})") from None
    if isinstance(spec, dict) and ONNX_KEY in spec:
        return _onnx_form({"name": path.stem, **spec}, path.parent, str(path))
    if isinstance(spec, dict) and MODULE_KEY in spec:
        return _module_form({"name": path.stem, **spec}, str(path))
    network = parse_spec(spec, str(path))
    if "name" not in spec:
        object.__setattr__(network, "name", path.stem)
    return network

