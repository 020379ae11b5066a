"""Networks as PyTorch modules, both ways (docs/design.md, "Networks").

* `SpecModule(network)`: the spec as an `nn.Module` (nn.Conv2d / nn.Linear under the layer names,
  functional ops between them), so `state_dict` names are the spec's parameter names; the
  `native` candidate runs it through autograd, as PyTorch users do.
* `from_module(module)`: an `nn.Sequential`, or a module `torch.fx` can trace, built from the
  supported ops, as a model spec; an unsupported op is named with the supported set.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .model import ModelSpecError, Network, parse_spec
from .ops import LOSSES, OPS


class SpecModule(nn.Module):
    """A Network as a PyTorch module: parameters under '<layer name>.weight' / '.bias'."""

    def __init__(self, network: Network, device=None, dtype=None):
        super().__init__()
        place = {"device": device, "dtype": dtype}  # built where it runs: no host copy to move
        self.network = network
        self.steps = []
        for layer in network.layers:
            module = OPS[layer.op].torch_module(layer.attrs, **place)
            if module is not None:
                self._add(layer.name, module)

    def _add(self, name: str, module: nn.Module) -> None:
        # a dotted name ('enc.conv1') becomes nested modules, so state_dict keys read 'enc.conv1.weight'
        parent = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)

    def _module(self, name: str) -> nn.Module:
        module = self
        for part in name.split("."):
            module = getattr(module, part)
        return module

    def forward(self, x):
        outputs = {-1: x}
        for layer in self.network.layers:
            op = OPS[layer.op]
            xs = [outputs[layer.index - 1]] + ([outputs[layer.source]] if op.combines else [])
            outputs[layer.index] = op.torch_forward(layer.attrs, xs, self._module(layer.name) if op.parametrised else None)
        return outputs[len(self.network.layers) - 1]

    def loss(self, y, target):
        return LOSSES[self.network.loss].torch_loss(y, target)


# ---------------------------------------------------------------------------------------------
# module → spec


_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}
_ACTIVATION_FUNCTIONS = {torch.relu: "relu", F.relu: "relu", torch.tanh: "tanh", F.tanh: "tanh",
                         torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid"}


def from_module(module: nn.Module, input_channels: int | None = None, loss: str = "mse", name: str | None = None) -> Network:
    """A Network from an nn.Sequential or a torch.fx-traceable module built from supported ops.

    Parameter names stay PyTorch's (`state_dict` keys). `input_channels` defaults to the first
    conv2d's in_channels; `loss` is "mse" or "cross_entropy" (a module does not say).
    """
    layers = _sequential_layers(module) if isinstance(module, nn.Sequential) else _traced_layers(module)
    if not layers:
        raise ModelSpecError(f"{type(module).__name__}: no layers found")
    if input_channels is None:
        first = next((layer for layer in layers if layer["op"] in ("conv2d", "linear")), None)
        if first is None or first["op"] != "conv2d":
            raise ModelSpecError(f"{type(module).__name__}: give input_channels (the first layer is not a conv2d)")
        input_channels = first["in"]
    spec = {"input_channels": input_channels, "layers": layers, "loss": loss}
    return parse_spec(spec, name or type(module).__name__)


def _sequential_layers(sequential: nn.Sequential, prefix: str = "") -> list[dict]:
    layers = []
    for child_name, child in sequential.named_children():
        full = f"{prefix}{child_name}"
        if isinstance(child, nn.Sequential):
            layers += _sequential_layers(child, full + ".")
        else:
            layers.append(_module_layer(child, full))
    return layers


def _module_layer(module: nn.Module, name: str) -> dict:
    """The spec layer of one leaf module (named as in state_dict)."""
    if isinstance(module, nn.Conv2d):
        if module.padding_mode != "zeros":
            raise ModelSpecError(f"{name}: Conv2d with padding_mode {module.padding_mode!r}: only zero padding "
                                 f"is supported")
        return {"name": name, "op": "conv2d", "in": module.in_channels, "out": module.out_channels,
                "kernel": list(module.kernel_size), "stride": list(module.stride),
                "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
                "dilation": list(module.dilation), "groups": module.groups, "bias": module.bias is not None}
    if isinstance(module, nn.Linear):
        return {"name": name, "op": "linear", "in": module.in_features, "out": module.out_features,
                "bias": module.bias is not None}
    if isinstance(module, nn.LeakyReLU):
        return {"name": name, "op": "leaky_relu", "slope": float(module.negative_slope)}
    if isinstance(module, nn.GELU):
        return {"name": name, "op": "gelu", "approximate": module.approximate}
    for cls, op in _ACTIVATION_MODULES.items():
        if isinstance(module, cls):
            return {"name": name, "op": op}
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        op = "max_pool2d" if isinstance(module, nn.MaxPool2d) else "avg_pool2d"
        if module.ceil_mode or getattr(module, "dilation", 1) not in (1, (1, 1)) or getattr(
                module, "divisor_override", None) is not None:
            raise ModelSpecError(f"{name}: {type(module).__name__} with ceil_mode, dilation or divisor_override "
                                 f"is not supported")
        layer = {"name": name, "op": op, "kernel": _pair(module.kernel_size), "stride": _pair(module.stride),
                 "padding": _pair(module.padding)}
        if op == "avg_pool2d" and not module.count_include_pad:
            layer["count_include_pad"] = False
        return layer
    if isinstance(module, nn.ZeroPad2d):
        left, right, top, bottom = module.padding
        return {"name": name, "op": "zero_pad2d", "padding": [top, bottom, left, right]}
    if isinstance(module, nn.Upsample):
        if module.mode != "nearest" or module.scale_factor is None:
            raise ModelSpecError(f"{name}: Upsample(mode={module.mode!r}, scale_factor={module.scale_factor}) — "
                                 f"only nearest upsampling by an integer scale_factor is supported")
        return {"name": name, "op": "upsample_nearest", "scale": _integer_scale(module.scale_factor, name)}
    if isinstance(module, nn.Flatten):
        if module.start_dim != 1 or module.end_dim != -1:
            raise ModelSpecError(f"{name}: Flatten(start_dim={module.start_dim}, end_dim={module.end_dim}): only "
                                 f"flattening everything but the batch (start_dim=1) is supported")
        return {"name": name, "op": "flatten"}
    raise ModelSpecError(f"{name}: unsupported module {type(module).__name__}: supported ops are {', '.join(OPS)} "
                         f"(Conv2d, Linear, ReLU, LeakyReLU, Tanh, Sigmoid, GELU, MaxPool2d, AvgPool2d, "
                         f"Upsample(nearest), Flatten, +, torch.cat)")


def _pair(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def _integer_scale(scale, name: str):
    scales = scale if isinstance(scale, (tuple, list)) else (scale, scale)
    if any(float(s) != int(s) or int(s) < 1 for s in scales):
        raise ModelSpecError(f"{name}: upsampling scale {scale!r} is not a positive integer")
    return [int(s) for s in scales] if scales[0] != scales[1] else int(scales[0])


def _traced_layers(module: nn.Module) -> list[dict]:
    """Layers of an fx-traced module, in graph order; every layer reads the previous one, and add/cat
    the output of an earlier named layer too (the spec's form)."""
    import torch.fx

    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception as exc:  # noqa: BLE001 - tracing failures are the user's module: one line
        raise ModelSpecError(f"{type(module).__name__}: torch.fx cannot trace it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}); build it from supported ops or as nn.Sequential")
    submodules = dict(module.named_modules())
    layers, index_of, previous = [], {}, None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                raise ModelSpecError(f"{type(module).__name__}: more than one input ({node.name})")
            index_of[node.name], previous = -1, node.name
            continue
        if node.op == "output":
            if node.args[0].name != previous:
                raise ModelSpecError(f"{type(module).__name__}: its output is {node.args[0].name}, not the last layer")
            break
        if node.op == "get_attr":
            raise ModelSpecError(f"{node.name}: reads a tensor attribute directly ({node.target}); only layers "
                                 f"of supported ops are supported")
        layer, inputs = _node_layer(node, submodules)
        tensors = [a.name for a in inputs]
        if not tensors or tensors[0] != previous:
            first = tensors[0] if tensors else "nothing"
            raise ModelSpecError(f"{node.name}: reads {first!r}, not the previous layer {previous!r}: the spec runs "
                                 f"layers in order (only add and concat read a second input, named by 'from')")
        if layer["op"] in ("add", "concat"):
            if len(tensors) != 2:
                raise ModelSpecError(f"{node.name}: {layer['op']} of {len(tensors)} tensors; the spec combines two")
            other = tensors[1]
            earlier = next((lay for lay in layers if lay.get("_node") == other), None)
            if earlier is None:
                raise ModelSpecError(f"{node.name}: combines the network input directly; add a layer before it")
            earlier.setdefault("name", other)
            layer["from"] = earlier["name"]
        layer["_node"] = node.name
        layers.append(layer)
        previous = node.name
    for layer in layers:
        layer.pop("_node", None)
    return layers


def _node_layer(node, submodules) -> tuple[dict, list]:
    tensors = [a for a in node.args if hasattr(a, "name") and hasattr(a, "op")]
    if node.op == "call_module":
        return _module_layer(submodules[node.target], node.target), tensors
    target = node.target
    if target in _ACTIVATION_FUNCTIONS:
        return {"op": _ACTIVATION_FUNCTIONS[target]}, tensors
    if target is F.leaky_relu:
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        return {"op": "leaky_relu", "slope": float(slope)}, tensors
    if target is F.gelu:
        return {"op": "gelu", "approximate": node.kwargs.get("approximate", "none")}, tensors
    if target in (operator.add, torch.add):
        return {"op": "add"}, tensors
    if target is torch.cat:
        parts = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if dim != 1:
            raise ModelSpecError(f"{node.name}: torch.cat along dim {dim}; only channels (dim=1) are supported")
        return {"op": "concat"}, list(parts)
    if target is torch.flatten or (node.op == "call_method" and target == "flatten"):
        start = node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0)
        if start != 1:
            raise ModelSpecError(f"{node.name}: flatten from dim {start}; only start_dim=1 is supported")
        return {"op": "flatten"}, tensors[:1]
    if node.op == "call_method" and target in ("relu", "tanh", "sigmoid"):
        return {"op": target}, tensors
    if target in (F.max_pool2d, F.avg_pool2d):
        kernel = node.kwargs.get("kernel_size", node.args[1] if len(node.args) > 1 else None)
        stride = node.kwargs.get("stride", node.args[2] if len(node.args) > 2 else None)
        layer = {"op": "max_pool2d" if target is F.max_pool2d else "avg_pool2d", "kernel": _pair(kernel)}
        if stride is not None:
            layer["stride"] = _pair(stride)
        return layer, tensors[:1]
    if target is F.interpolate:
        if node.kwargs.get("mode", "nearest") != "nearest" or node.kwargs.get("scale_factor") is None:
            raise ModelSpecError(f"{node.name}: interpolate other than mode='nearest' with a scale_factor")
        return {"op": "upsample_nearest", "scale": _integer_scale(node.kwargs["scale_factor"], node.name)}, tensors[:1]
    label = getattr(target, "__name__", str(target))
    raise ModelSpecError(f"{node.name}: unsupported op {label}: supported ops are {', '.join(OPS)}")
