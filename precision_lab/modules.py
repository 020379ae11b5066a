"""Networks as PyTorch modules, both ways (docs/design.md, "Networks").

* `SpecModule(network)`: the spec as an `nn.Module` (nn.Conv2d / nn.Linear under the layer names,
  functional ops between them), so `state_dict` names are the spec's parameter names; the
  `native` candidate runs it through autograd, as PyTorch users do.
* `from_module(module)`: an `nn.Sequential`, or a module `torch.fx` can trace, built from the
  supported ops, as a model spec; an unsupported op is named with the supported set.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import NETWORK_INPUT, ModelSpecError, Network, parse_spec
from .ops import BATCH_SIZE, LOSSES, OPS, OpSpecError
from .ops import arity as op_arity
from .ops.losses import MSE


class SpecModule(nn.Module):
    """A Network as a PyTorch module: parameters under '<layer name>.weight' / '.bias'."""

    def __init__(self, network: Network, device=None, dtype=None):
        super().__init__()
        place = {"device": device, "dtype": dtype}  # built where it runs: no host copy to move
        self.network = network
        self.steps = []
        self.held = set()  # layers whose op has a module (parameters, or a training dropout's mask buffer)
        for layer in network.layers:
            module = OPS[layer.op].torch_module(layer.attrs, **place)
            if module is not None:
                self._add(layer.name, module)
                self.held.add(layer.name)

    def carry(self, masks: dict) -> None:
        """Hand each mask the request carries ('<layer>.mask') to its layer's module, as a buffer (not a parameter)."""
        for name, value in masks.items():
            layer, suffix = name.rsplit(".", 1)
            self._module(layer).register_buffer(suffix, value)

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
            xs = [outputs[i] for i in layer.inputs]
            module = self._module(layer.name) if layer.name in self.held else None
            device = xs[0].device.type
            if op.autocast_float32 and torch.is_autocast_enabled(device):
                # CUDA's autocast runs it in float32 (PyTorch's CPU layer norm in bfloat16 sums its weight and bias
                # gradients in bfloat16: 4096 ones sum to 512)
                with torch.autocast(device, enabled=False):
                    outputs[layer.index] = op.torch_forward(layer.attrs, [t.float() for t in xs], module)
            else:
                outputs[layer.index] = op.torch_forward(layer.attrs, xs, module)
        return outputs[len(self.network.layers) - 1]

    def loss(self, y, target):
        return LOSSES[self.network.loss].torch_loss(y, target)


# ---------------------------------------------------------------------------------------------
# module → spec


def from_module(module: nn.Module, input_channels: int | None = None, loss: str = MSE.name, name: str | None = None) -> Network:
    """A Network from an nn.Sequential or a torch.fx-traceable module built from supported ops.

    Parameter names stay PyTorch's (`state_dict` keys). `input_channels` defaults to the first
    convolution's in_channels (plain or transposed); `loss` is "mse" or "cross_entropy" (a module does not say).
    """
    layers = _sequential_layers(module) if isinstance(module, nn.Sequential) else _traced_layers(module)
    if not layers:
        raise ModelSpecError(f"{type(module).__name__}: no layers found")
    if input_channels is None:
        first = next((layer for layer in layers if OPS[layer["op"]].parametrised), None)
        # a convolution, plain or transposed (its kernel slides over an image): its `in` is the image's channels
        if first is None or "kernel" not in OPS[first["op"]].keys:
            raise ModelSpecError(f"{type(module).__name__}: give input_channels (the first layer is not a convolution)")
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
    """The spec layer of one leaf module (named as in state_dict): the op that reads its class (Op.torch_modules)."""
    refused = None
    for op in OPS.values():
        if isinstance(module, op.torch_modules):
            try:
                return {"name": name, "op": op.name, **op.from_torch_module(module)}
            except OpSpecError as exc:
                # another op may read the same class with these settings (AdaptiveAvgPool2d: 1×1 or other sizes)
                refused = refused or exc
    if refused is not None:
        raise ModelSpecError(f"{name}: {refused}")
    readable = ", ".join(cls.__name__ for op in OPS.values() for cls in op.torch_modules)
    raise ModelSpecError(f"{name}: unsupported module {type(module).__name__}: supported ops are {', '.join(OPS)} "
                         f"({readable}, +, torch.cat)")


def _traced_layers(module: nn.Module) -> list[dict]:
    """Layers of an fx-traced module, in graph order: a layer that reads the previous one says nothing, a two-input
    op whose first input is the previous names its second in 'from', any other names what it reads in 'inputs'
    (the network's input as "input")."""
    import torch.fx

    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception as exc:  # noqa: BLE001 - tracing failures are the user's module: one line
        raise ModelSpecError(f"{type(module).__name__}: torch.fx cannot trace it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}); build it from supported ops or as nn.Sequential")
    submodules = dict(module.named_modules())
    layers, by_node, previous, network_input = [], {}, None, None
    sizes: dict[str, object] = {}  # traced size queries: a shape (None) or the batch size (BATCH_SIZE)
    called = set()  # modules already read as a layer

    def named(node_name: str) -> str:
        if node_name == network_input:
            return NETWORK_INPUT
        layer = by_node[node_name]
        layer.setdefault("name", node_name)
        return layer["name"]

    for node in graph.nodes:
        if node.op == "placeholder":
            if network_input is not None:
                raise ModelSpecError(f"{type(module).__name__}: more than one input ({node.name})")
            network_input = previous = node.name
            continue
        if node.op == "output":
            if node.args[0].name != previous:
                raise ModelSpecError(f"{type(module).__name__}: its output is {node.args[0].name}, not the last layer")
            break
        if node.op == "get_attr":
            raise ModelSpecError(f"{node.name}: reads a tensor attribute directly ({node.target}); only layers "
                                 f"of supported ops are supported")
        if _reads_size(node, sizes):
            continue
        if _reads_first_of_pair(node, by_node, previous):
            by_node[node.name] = by_node[previous]  # module(x)[0] of a module returning (output, extra): its output
            previous = node.name
            continue
        layer, inputs = _node_layer(node, submodules, sizes)
        op = OPS[layer["op"]]
        if "name" not in layer and op.request_masks(op.normalise({k: v for k, v in layer.items() if k != "op"})):
            layer["name"] = node.name  # a call reading a mask the request carries (F.dropout in training): '<node>.mask'
        if node.op == "call_module" and node.target in called:
            if OPS[layer["op"]].parametrised:
                raise ModelSpecError(f"{node.target}: called more than once (its parameters shared); the spec gives "
                                     f"each layer its own parameters: use one module per call")
            layer["name"] = node.name  # a parameter-free module called twice (one max-pool per level): fx's own name
        called.add(node.target)
        tensors = [a.name for a in inputs]
        arity = op_arity(OPS[layer["op"]])
        if len(tensors) != arity and not (getattr(OPS[layer["op"]], "joins_several", False) and len(tensors) > arity):
            raise ModelSpecError(f"{node.name}: {layer['op']} of {len(tensors)} tensors; the spec's {layer['op']} "
                                 f"reads {arity}")
        if len(tensors) == 2 and arity == 2 and tensors[0] == previous and tensors[1] != network_input:
            layer["from"] = named(tensors[1])
        elif tensors != [previous]:
            layer["inputs"] = [named(t) for t in tensors]
        by_node[node.name] = layer
        layers.append(layer)
        previous = node.name
    return layers


def _node_layer(node, submodules, sizes: dict) -> tuple[dict, list]:
    """The spec layer of one traced call, and the tensors it reads: the op whose torch_calls holds its target."""
    args, kwargs = _with_batch_size(node.args, sizes), _with_batch_size(dict(node.kwargs), sizes)
    tensors = [a for a in args if hasattr(a, "name") and hasattr(a, "op")]
    if node.op == "call_module":
        layer = _module_layer(submodules[node.target], node.target)
        try:
            return layer, OPS[layer["op"]].call_inputs(tensors, args)
        except OpSpecError as exc:
            raise ModelSpecError(f"{node.name}: {exc}") from None
    target = node.target
    refused = None
    for op in OPS.values():
        if any(target == call if isinstance(call, str) else target is call for call in op.torch_calls) and (
                isinstance(target, str) == (node.op == "call_method")):
            try:
                return {"op": op.name, **op.from_torch_call(target, args, kwargs)}, \
                    op.call_inputs(tensors, args)
            except OpSpecError as exc:
                # another op may read the same call with these arguments (flatten(1): flatten, flatten(2): flatten_pixels)
                refused = refused or exc
    if refused is not None:
        raise ModelSpecError(f"{node.name}: {refused}")
    label = getattr(target, "__name__", str(target))
    raise ModelSpecError(f"{node.name}: unsupported op {label}: supported ops are {', '.join(OPS)}")


def _reads_first_of_pair(node, by_node: dict, previous) -> bool:
    """Whether a traced node is `[0]` of the previous layer, an op whose module returns (output, extra)."""
    import operator

    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    source, index = node.args
    layer = by_node.get(getattr(source, "name", None))
    return (index == 0 and source.name == previous and layer is not None
            and OPS[layer["op"]].returns_pair)


def _is_node(value) -> bool:
    return hasattr(value, "name") and hasattr(value, "op")


def _with_batch_size(args, sizes: dict):
    """A traced call's arguments with each read of the batch size as ops.BATCH_SIZE (in tuples and lists too)."""
    if isinstance(args, dict):
        return {key: _with_batch_size(value, sizes) for key, value in args.items()}
    if isinstance(args, (tuple, list)):
        return type(args)(_with_batch_size(a, sizes) for a in args)
    return sizes[args.name] if _is_node(args) and args.name in sizes else args


def _reads_size(node, sizes: dict) -> bool:
    """Whether a traced node reads a tensor's size (`x.shape`, `x.size()`, `x.shape[0]`, `x.size(0)`), recorded in
    `sizes`; only the batch size is read (a reshape's first size), any other size or arithmetic on one is refused."""
    import operator

    args = node.args
    if node.op == "call_function" and node.target is getattr and len(args) == 2 and args[1] == "shape":
        sizes[node.name] = None
        return True
    if node.op == "call_method" and node.target == "size" and len(args) == 1 and not node.kwargs:
        sizes[node.name] = None
        return True
    dim = None
    if node.op == "call_method" and node.target == "size":
        dim = node.kwargs.get("dim", args[1] if len(args) > 1 else None)
    elif (node.op == "call_function" and node.target is operator.getitem and _is_node(args[0])
          and sizes.get(args[0].name, 0) is None):
        dim = args[1]
    elif any(_is_node(a) and a.name in sizes for a in args):
        if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
            raise ModelSpecError(f"{node.name}: {getattr(node.target, '__name__', node.target)} of a tensor's size: "
                                 f"arithmetic on the batch size merges it with another axis, and the lab's batch axis "
                                 f"stays first and unchanged; write per-sample sizes as numbers")
        return False
    else:
        return False
    if dim != 0:
        raise ModelSpecError(f"{node.name}: reads the size of dim {dim}; only the batch size x.shape[0] is read: write "
                             f"per-sample sizes as numbers or -1")
    sizes[node.name] = BATCH_SIZE
    return True
