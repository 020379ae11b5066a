"""A PyTorch module read as a model spec (docs/models.md, "From PyTorch"): an `nn.Sequential` child by child, any other
module by torch.fx tracing, each leaf module and call read by the op that names it (`Op.torch_modules`,
`Op.torch_calls`); an unsupported op or idiom is refused in one line naming it.

`module_spec` gives the layer-form spec as a dict; `precision_lab.modules.from_module` and the `module` form of a
model file (precision_lab.model) parse it. This module reads no Network: where a traced call reads a channel count,
the caller's `symbolic_shapes` gives it from the spec read so far.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx
from torch import nn

from .errors import ModelSpecError
from .ops import BATCH_SIZE, NETWORK_INPUT, OPS, OpSpecError
from .ops import arity as op_arity
from .ops.losses import MSE
from .ops.parameters import TensorAttribute

#: a layer-form spec (dict) → per-layer per-sample shapes with None for the free height and width
SymbolicShapes = Callable[[dict], list]


def module_spec(module: nn.Module, symbolic_shapes: SymbolicShapes, input_channels: int | None = None,
                loss: str = MSE.name, name: str | None = None) -> dict:
    """The layer-form spec of `module` (parameter names stay PyTorch's `state_dict` keys). `input_channels` defaults to
    the first convolution's in_channels (plain or transposed); `loss` is "mse" or "cross_entropy" (a module does not
    say)."""
    layers = (_sequential_layers(module) if isinstance(module, nn.Sequential)
              else _traced_layers(module, symbolic_shapes))
    if not layers:
        raise ModelSpecError(f"{type(module).__name__}: no layers found")
    if input_channels is None:
        first = next((layer for layer in layers if OPS[layer["op"]].parametrised), None)
        # a convolution, plain or transposed (its kernel slides over an image): its `in` is the image's channels
        if first is None or "kernel" not in OPS[first["op"]].keys:
            raise ModelSpecError(f"{type(module).__name__}: give input_channels (the first layer is not a convolution)")
        input_channels = first["in"]
    return {"input_channels": input_channels, "layers": layers, "loss": loss, "name": name or type(module).__name__}


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


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, keeping as one call a module an op reads by its exact class beyond torch.nn's (torchvision's
    StochasticDepth): its layer is named by its module path, as the masks a candidate applies are."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return super().is_leaf_module(m, qualname) or any(type(m) in op.torch_modules for op in OPS.values())


def _traced_layers(module: nn.Module, symbolic_shapes: SymbolicShapes) -> list[dict]:
    """Layers of an fx-traced module, in graph order: a layer that reads the previous one says nothing, a two-input
    op whose first input is the previous names its second in 'from', any other names what it reads in 'inputs'
    (the network's input as "input")."""
    import torch.fx

    try:
        graph = _Tracer().trace(module)
    except Exception as exc:  # noqa: BLE001 - tracing failures are the user's module: one line
        raise ModelSpecError(f"{type(module).__name__}: torch.fx cannot trace it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}); build it from supported ops or as nn.Sequential")
    submodules = dict(module.named_modules())
    layers, by_node, previous, network_input = [], {}, None, None
    sizes: dict[str, object] = {}  # traced size queries: a shape (_ShapeOf), the batch size (BATCH_SIZE), a _Size
    moves: dict[str, tuple] = {}  # calls read with their readers: a shuffle's 5-D view, a chunk's pieces
    called = set()  # modules already read as a layer
    attributes: dict[str, TensorAttribute] = {}  # parameters read as tensors (get_attr), passed to the op reading them
    same: dict[str, str] = {}  # nodes that are another node's tensor itself (a concat of one tensor)

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
            if same.get(node.args[0].name, node.args[0].name) != previous:
                raise ModelSpecError(f"{type(module).__name__}: its output is {node.args[0].name}, not the last layer")
            break
        if node.op == "get_attr":
            attributes[node.name] = _tensor_attribute(module, node)
            continue
        source = _single_concat(node)
        if source is not None:
            same[node.name] = same.get(source, source)
            continue
        if _reads_size(node, sizes):
            continue
        read = _reads_channels(node, sizes, moves, lambda source: _channel_count(source, layers, by_node, network_input,
                                                                                     symbolic_shapes))
        if read is _ABSORBED:
            continue
        if _reads_first_of_pair(node, by_node, previous):
            by_node[node.name] = by_node[previous]  # module(x)[0] of a module returning (output, extra): its output
            previous = node.name
            continue
        layer, inputs = read or _node_layer(node, submodules, sizes, attributes)
        op = OPS[layer["op"]]
        if "name" not in layer and op.request_masks(op.normalise({k: v for k, v in layer.items() if k != "op"})):
            layer["name"] = node.name  # a call reading a mask the request carries (F.dropout in training): '<node>.mask'
        if node.op == "call_module" and node.target in called:
            if OPS[layer["op"]].parametrised:
                raise ModelSpecError(f"{node.target}: called more than once (its parameters shared); the spec gives "
                                     f"each layer its own parameters: use one module per call")
            layer["name"] = node.name  # a parameter-free module called twice (one max-pool per level): fx's own name
        called.add(node.target)
        tensors = [same.get(a.name, a.name) for a in inputs]
        arity = op_arity(OPS[layer["op"]])
        if len(tensors) != arity and not (OPS[layer["op"]].joins_many and len(tensors) > arity):
            raise ModelSpecError(f"{node.name}: {layer['op']} of {len(tensors)} tensors; the spec's {layer['op']} "
                                 f"reads {arity}")
        if len(tensors) > arity:
            layer["inputs"] = [named(t) for t in tensors]
        elif arity == 2 and tensors[0] == previous and tensors[1] != network_input:
            layer["from"] = named(tensors[1])
        elif tensors != [previous]:
            layer["inputs"] = [named(t) for t in tensors]
        by_node[node.name] = layer
        layers.append(layer)
        previous = node.name
    return layers


def _node_layer(node, submodules, sizes: dict, attributes: dict | None = None) -> tuple[dict, list]:
    """The spec layer of one traced call, and the tensors it reads: the op whose torch_calls holds its target."""
    args, kwargs = _with_batch_size(node.args, sizes), _with_batch_size(dict(node.kwargs), sizes)
    args, kwargs = _with_attributes(args, attributes or {}), _with_attributes(kwargs, attributes or {})
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
        if _reads_call(op, target, node.op):
            try:
                return {"op": op.name, **op.from_torch_call(target, args, kwargs)}, \
                    op.call_inputs(tensors, args)
            except OpSpecError as exc:
                # another op may read the same call with these arguments (flatten(1): flatten, flatten(2): flatten_pixels)
                refused = refused or exc
    if refused is not None:
        raise ModelSpecError(f"{node.name}: {refused}")
    label = getattr(target, "__name__", str(target))
    read = [a for a in args if isinstance(a, TensorAttribute)]
    if read:
        raise ModelSpecError(f"{node.name}: {label} of the parameter {read[0]!r}: a parameter is read only as a scale "
                             f"(x * p) or an added tensor (x + p); a class token (a cat of an expanded parameter) is "
                             f"not supported")
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
    if isinstance(args, slice):  # x[:, :c // 2]: a slice's ends may be read sizes
        return slice(*(_with_batch_size(end, sizes) for end in (args.start, args.stop, args.step)))
    return sizes[args.name] if _is_node(args) and args.name in sizes else args


class _ShapeOf:
    """`x.shape` or `x.size()` of a traced tensor `source`: its items are sizes."""

    def __init__(self, source: str):
        self.source = source


class _Size:
    """A per-sample size a traced module reads (`x.size(1)`, `x.shape[2]`) or computes from one (`c // groups`):
    `source` the tensor read, `dims` the axes it derives from, `axis` and `divisor` where it is size(axis) // divisor."""

    def __init__(self, source: str, dims: frozenset, text: str, axis: int | None = None, divisor: int = 1):
        self.source, self.dims, self.text, self.axis, self.divisor = source, dims, text, axis, divisor

    def __repr__(self):
        return self.text

    def of(self, source: str, axis: int, divisor: int = 1) -> bool:
        return (self.source, self.axis, self.divisor) == (source, axis, divisor)


_IMAGE_AXES = {1: "channels", 2: "height", 3: "width"}


def _size_text(value) -> str:
    return repr(value) if isinstance(value, _Size) else str(value)


def _size_arithmetic(node, sizes: dict) -> _Size:
    """`c // groups`, `h // p`, `h == 224` on per-sample sizes: a _Size naming what it derives from."""
    operands = [sizes[a.name] if _is_node(a) else a for a in node.args]
    reads = [v for v in operands if isinstance(v, _Size)]
    if not reads or any(isinstance(v, _ShapeOf) for v in operands):
        raise ModelSpecError(f"{node.name}: {node.target.__name__} of a whole shape (x.shape, x.size()); read one size "
                             f"at a time (x.shape[1])")
    symbol = {"floordiv": "//", "mul": "*", "add": "+", "sub": "-", "truediv": "/", "eq": "==", "ne": "!="}.get(
        node.target.__name__, node.target.__name__)
    text = f" {symbol} ".join(_size_text(v) for v in operands)
    first = operands[0]
    if (node.target.__name__ == "floordiv" and isinstance(first, _Size) and first.axis is not None
            and isinstance(operands[1], int) and first.divisor == 1):
        return _Size(first.source, first.dims, text, first.axis, operands[1])
    return _Size(reads[0].source, frozenset().union(*(v.dims for v in reads)), text)


def _reads_size(node, sizes: dict) -> bool:
    """Whether a traced node reads a tensor's size (`x.shape`, `x.size()`, `x.shape[1]`, `x.size(2)`) or computes
    from sizes (`c // groups`), recorded in `sizes`: the batch size is ops.BATCH_SIZE (a reshape's first size), any
    other a _Size, which _reads_channels reads (a channel shuffle's, a channel count's number) or refuses."""
    import operator

    args = node.args
    if node.op == "call_function" and node.target is getattr and len(args) == 2 and args[1] == "shape":
        sizes[node.name] = _ShapeOf(args[0].name)
        return True
    if node.op == "call_method" and node.target == "size" and len(args) == 1 and not node.kwargs:
        sizes[node.name] = _ShapeOf(args[0].name)
        return True
    dim, source = None, None
    if node.op == "call_method" and node.target == "size":
        dim, source = node.kwargs.get("dim", args[1] if len(args) > 1 else None), args[0].name
    elif (node.op == "call_function" and node.target is operator.getitem and _is_node(args[0])
          and isinstance(sizes.get(args[0].name), _ShapeOf)):
        dim, source = args[1], sizes[args[0].name].source
    elif any(_is_node(a) and a.name in sizes for a in args):
        if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
            if any(_is_node(a) and sizes.get(a.name) is BATCH_SIZE for a in args):
                raise ModelSpecError(f"{node.name}: {getattr(node.target, '__name__', node.target)} of a tensor's "
                                     f"size: arithmetic on the batch size merges it with another axis, and the lab's "
                                     f"batch axis stays first and unchanged; write per-sample sizes as numbers")
            sizes[node.name] = _size_arithmetic(node, sizes)
            return True
        return False
    else:
        return False
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ModelSpecError(f"{node.name}: reads the sizes {dim!r} of {source}; read one size at a time (x.shape[1]) "
                             f"or write per-sample sizes as numbers")
    if dim == 0:
        sizes[node.name] = BATCH_SIZE
    else:
        axis = f"the {_IMAGE_AXES[dim]}" if dim in _IMAGE_AXES else f"dim {dim}"
        sizes[node.name] = _Size(source, frozenset([dim]), f"{source}.size({dim}) ({axis})", dim)
    return True


#: what _reads_channels returns for a node it reads as part of a layer to come (a shuffle's view, a chunk)
_ABSORBED = object()


def _reads_channels(node, sizes: dict, moves: dict, channel_count):
    """A traced node that reads per-sample sizes or moves channels: ShuffleNet's channel shuffle, `view(b, g, c // g,
    h, w)` → `transpose(1, 2)` (→ `contiguous()`) → `view(b, -1, h, w)`, read as F.channel_shuffle's layer; a piece
    `[i]` of `x.chunk(2, dim=1)` (an op with `pieces`). Returns (layer, inputs), _ABSORBED, or None (not such a node).
    A channel count another call reads (`x.view(b, c, -1)`, `c // g`) becomes its number (`channel_count(tensor)`);
    one derived from the height or width is refused in one line (the spec's sizes are numbers, its H, W free)."""
    import operator

    args = _with_batch_size(node.args, sizes)
    kwargs = _with_batch_size(dict(node.kwargs), sizes)
    first = node.args[0] if node.args and _is_node(node.args[0]) else None
    moved = moves.get(first.name) if first is not None else None
    method = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    call = getattr(torch.Tensor, node.target, None) if node.op == "call_method" else node.target
    if moved is not None and moved[0] == "pieces":
        if node.target is not operator.getitem or not isinstance(node.args[1], int):
            raise ModelSpecError(f"{node.name}: reads the pieces of {first.name} other than by [i] (x1, x2 = "
                                 f"x.chunk(2, dim=1)); read each piece by its index")
        _, op, target, call_args, call_kwargs = moved
        try:
            layer = {"op": op.name, **op.from_torch_piece(target, call_args, call_kwargs, node.args[1])}
        except OpSpecError as exc:
            raise ModelSpecError(f"{first.name}: {exc}") from None
        return layer, [call_args[0]]
    if moved is not None:  # a channel shuffle's 5-D view: ("view", source, groups) or ("swapped", source, groups)
        stage, source, groups = moved
        if stage == "view" and call in (torch.Tensor.transpose, torch.transpose) and sorted(args[1:3]) == [1, 2]:
            moves[node.name] = ("swapped", source, groups)
            return _ABSORBED
        if stage == "swapped" and call is torch.Tensor.contiguous:
            moves[node.name] = moved
            return _ABSORBED
        if stage == "swapped" and _merges_groups(call, args, kwargs, source.name):
            op = _op_reading(torch.nn.functional.channel_shuffle)
            return {"op": op.name, **op.from_torch_call(torch.nn.functional.channel_shuffle, (None, groups), {})}, \
                [source]
        raise ModelSpecError(f"{node.name}: {method} of {first.name}, a 5-D view of an image: a 5-D view is read only "
                             f"as a channel shuffle, view(b, g, c // g, h, w) → transpose(1, 2) → view(b, -1, h, w); "
                             f"use nn.ChannelShuffle or write it so")
    if node.op in ("call_method", "call_function") and first is not None:
        op = _op_reading(node.target, node.op)
        if op is not None and _is_call(node.target, node.op, op.pieces):
            moves[node.name] = ("pieces", op, node.target, args, kwargs)
            return _ABSORBED
    if call in _VIEWS and first is not None:
        sizes_given = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        c, h, w = sizes_given[2:5] if len(sizes_given) == 5 else (None, None, None)
        if (sizes_given and sizes_given[0] is BATCH_SIZE and isinstance(sizes_given[1], int)
                and isinstance(c, _Size) and c.of(first.name, 1, sizes_given[1])
                and isinstance(h, _Size) and h.of(first.name, 2) and isinstance(w, _Size) and w.of(first.name, 3)):
            moves[node.name] = ("view", first, sizes_given[1])
            return _ABSORBED
    read = [v for v in _flat(list(args) + list(kwargs.values())) if isinstance(v, _Size)]
    if read and all(v.axis == 1 for v in read):  # channel counts: the spec's numbers, whatever the image size
        for used in _flat(list(node.args) + list(node.kwargs.values())):
            if _is_node(used) and isinstance(sizes.get(used.name), _Size):
                size = sizes[used.name]
                sizes[used.name] = channel_count(size.source) // size.divisor
        return None
    if read:
        label = method or node.target
        fixing = next((v for v in read if max(v.dims) >= 2), None)
        if fixing is not None:
            spatial = sorted(d for d in fixing.dims if d >= 2)
            raise ModelSpecError(f"{node.name}: {label} reads {fixing!r}: a number derived from the image's "
                                 f"{' and '.join(_IMAGE_AXES.get(d, f'dim {d}') for d in spatial)} "
                                 f"fixes the input size the network takes, and a spec takes any height and width; "
                                 + ("write that size as -1" if call in _VIEWS else "remove the size check, or build "
                                    "the network from ops that take any size"))
        raise ModelSpecError(f"{node.name}: {label} reads {read[0]!r}; write the per-sample size as a number")
    return None


def _channel_count(source: str, layers: list, by_node: dict, network_input: str,
                   symbolic_shapes: SymbolicShapes) -> int:
    """The channels of traced tensor `source`: the input's (the first convolution's `in`), or the spec's own shape of
    the layer computing it, from the layers read so far."""
    first = next((layer for layer in layers if OPS[layer["op"]].parametrised), None)
    if first is None or "kernel" not in OPS[first["op"]].keys:
        raise ModelSpecError(f"{source}: its channel count is read before a convolution says the input's; write it "
                             f"as a number")
    if source == network_input:
        return first["in"]
    import copy

    upto = next(i for i, layer in enumerate(layers) if layer is by_node[source])
    count = symbolic_shapes({"input_channels": first["in"], "layers": copy.deepcopy(layers[:upto + 1]),
                             "name": source})[-1][0]
    if count is None:  # tokens of an image: their count follows the height and width
        raise ModelSpecError(f"{source}: its size 1 follows the image's height and width, and a spec takes any; "
                             f"write that size as -1")
    return count


def _flat(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        elif isinstance(value, slice):
            yield from (value.start, value.stop, value.step)
        else:
            yield value


#: the calls that view a tensor in another shape (x.view, x.reshape, torch.reshape)
_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)


def _merges_groups(call, args, kwargs, source: str) -> bool:
    """Whether a call on a shuffle's swapped view merges the groups back: view(b, c or -1, h, w), flatten(1, 2)."""
    if call in _VIEWS:
        given = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return (len(given) == 4 and given[0] in (BATCH_SIZE, -1)
                and (given[1] == -1 or isinstance(given[1], _Size) and given[1].of(source, 1))
                and all(v == -1 or isinstance(v, _Size) and v.of(source, axis) for axis, v in ((2, given[2]),
                                                                                                (3, given[3]))))
    if call in (torch.Tensor.flatten, torch.flatten):
        return list(args[1:3]) == [1, 2] or (kwargs.get("start_dim"), kwargs.get("end_dim")) == (1, 2)
    return False


def _is_call(target, kind: str, calls: tuple) -> bool:
    """Whether a traced call of `target` is one of `calls` (functions, or tensor methods' names where `kind` is
    call_method)."""
    return any(target == call if isinstance(call, str) else target is call for call in calls) and (
        isinstance(target, str) == (kind == "call_method"))


def _reads_call(op, target, kind: str) -> bool:
    """Whether `op` reads a traced call of `target`."""
    return _is_call(target, kind, op.torch_calls)


def _op_reading(target, kind: str = "call_function"):
    """The first registered op whose torch_calls hold a traced call's target (None if none)."""
    return next((op for op in OPS.values() if _reads_call(op, target, kind)), None)


# ---------------------------------------------------------------------------------------------
# parameters read as tensors, a concat of one tensor


def _tensor_attribute(module: nn.Module, node) -> TensorAttribute:
    """A get_attr node as the parameter it reads (owner module's path, attribute, shape); a buffer or constant refused."""
    owner, _, attribute = node.target.rpartition(".")
    if not owner:
        raise ModelSpecError(f"{node.name}: reads the top module's own parameter {attribute}: the spec names a "
                             f"parameter '<layer>.<attribute>'; hold it in a submodule")
    if "relative_position" in attribute:
        raise ModelSpecError(f"{node.name}: reads {node.target}: a relative position bias (Swin's attention) is not "
                             f"supported")
    try:
        value = module.get_parameter(node.target)
    except AttributeError:
        raise ModelSpecError(f"{node.name}: reads {node.target}, a tensor attribute that is no parameter (a buffer or a "
                             f"constant); only parameters are read as tensors: make it an nn.Parameter") from None
    return TensorAttribute(owner, attribute, tuple(value.shape))


def _with_attributes(args, attributes: dict):
    """A traced call's arguments with each get_attr node as its TensorAttribute (in tuples, lists and dicts too)."""
    if isinstance(args, dict):
        return {key: _with_attributes(value, attributes) for key, value in args.items()}
    if isinstance(args, (tuple, list)):
        return type(args)(_with_attributes(a, attributes) for a in args)
    return attributes[args.name] if _is_node(args) and args.name in attributes else args


def _single_concat(node) -> str | None:
    """The node a torch.cat of one tensor reads (DenseNet's `torch.cat(inputs, 1)` of a list of one): no layer, the
    tensor itself; None for any other node."""
    if node.op != "call_function" or node.target is not torch.cat or not node.args:
        return None
    tensors = node.args[0]
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1 and _is_node(tensors[0]):
        return tensors[0].name
    return None
