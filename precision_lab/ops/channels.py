"""Ops that only move or select an image's channels: channel_shuffle (ShuffleNet's) and channel_slice (`x.chunk(2, dim=1)`).

Both copy values without arithmetic, so they are exact (docs/error-model.md, "Channel moves"): the forward's error
bound is the input's, moved as the values are; the backward's is the output gradient's, moved back (the shuffle's
inverse permutation; a slice's gradient placed in its channels, zeros elsewhere, which adds no rounding). A pixel
stays at its place in the grid, so the radius of the errors is unchanged.
"""
from __future__ import annotations

import operator

import numpy as np
import torch
import torch.nn.functional as F

from . import BackwardReplaced, Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, positive_int, register
from .onnx_reading import OnnxRead, OpenSize, attr, require, reshape_target
from .routing import _text


def _image(shape, what: str) -> tuple:
    if len(shape) != 3:
        raise OpSpecError(f"{what} reads an image (C, H, W) but receives {_text(shape)}")
    return tuple(shape)


def _moved(t, move):
    return None if t is None else move(t)


class ChannelMove(Op):
    """An op whose output channels are input channels moved (`_move`) and whose input gradient is the output gradient
    moved back (`_back`): exact, errors and flips routed with the values, pixels in place."""

    def call_inputs(self, tensors, args):
        return tensors[:1]

    def forward(self, attrs, xs, params, kernels):
        return self._move(attrs, xs[0])

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return [self._back(attrs, g, xs[0].shape) if need[0] else None], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        x = ins[0]
        return Field(y, _moved(x.error, lambda t: self._move(attrs, t)), x.radius, x.flips,
                     nonnegative=x.nonnegative, coupled=x.coupled)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        shape = ins[0].value.shape
        back = lambda t: self._back(attrs, t, shape)  # noqa: E731 - the same move for error and flips
        return [GradField(back(grad.error), _moved(grad.flips, back), grad.radius, grad.flip_count,
                          coupled=grad.coupled)], {}


class ChannelShuffle(ChannelMove):
    """ShuffleNet's channel shuffle (Zhang et al. 2018): the C channels as `groups` groups of C/groups, read group-
    interleaved: output channel j·groups + i is input channel i·(C/groups) + j. Read from nn.ChannelShuffle,
    F.channel_shuffle and the traced idiom `x.view(b, g, c // g, h, w)`, `transpose(1, 2)`, `view(b, -1, h, w)`."""

    name = "channel_shuffle"
    keys = {"groups": 2}
    torch_modules = (torch.nn.ChannelShuffle,)
    torch_calls = (F.channel_shuffle,)

    onnx_ops = ("Reshape",)

    def check(self, attrs):
        attrs["groups"] = positive_int(attrs["groups"], "groups")
        return attrs

    def from_onnx_node(self, node, graph):
        """PyTorch's export of the idiom: Reshape to (N, g, C/g, H, W), Transpose perm [0, 2, 1, 3, 4], Reshape to
        (N, C, H, W); None for any other Reshape (reshape's and flatten's)."""
        x = graph.data_inputs(node)
        if len(x) != 1 or len(graph.shape(x[0])) != 3:
            return None
        split = reshape_target(node, graph)
        swap = graph.only_reader(node.outputs[0])
        if len(split) != 5 or swap is None or swap.op_type != "Transpose" or list(attr(swap, "perm", [])) != [0, 2, 1, 3, 4]:
            return None
        merge = graph.only_reader(swap.outputs[0])
        c, h, w = graph.shape(x[0])
        groups = split[1]
        require(merge is not None and merge.op_type == "Reshape",
                "a Reshape to 5-D and a Transpose of its groups not reshaped back to an image")
        merged = graph.constant(merge.inputs[1])  # the 5-D tensor has no per-sample shape yet: its target as given
        merged = [] if merged is None else [int(t) for t in np.asarray(merged).reshape(-1)]
        require(isinstance(groups, int) and groups > 0 and c % groups == 0 and split[2] in (c // groups, -1)
                and len(merged) == 4 and merged[1] in (c, -1)
                and all(_same_side(t, side, x[0], axis) for t, side, axis in ((split[3], h, 1), (split[4], w, 2),
                                                                               (merged[2], h, 1), (merged[3], w, 2))),
                f"Reshape to {split} and back to {merged or 'a computed shape'} of a ({c}, {h}, {w}) image: not a "
                f"channel shuffle of a fixed image size (export with a fixed image size)")
        return OnnxRead({"groups": groups}, x, merge.outputs[0], absorbed=[swap, merge])

    def from_torch_module(self, module):
        return {"groups": module.groups}

    def from_torch_call(self, target, args, kwargs):
        return {"groups": kwargs.get("groups", args[1] if len(args) > 1 else None)}

    def out_shape(self, attrs, in_shapes):
        c, h, w = _image(in_shapes[0], "channel_shuffle")
        if c % attrs["groups"]:
            raise OpSpecError(f"channel_shuffle of {c} channels into {attrs['groups']} groups: the groups do not "
                              f"divide the channels")
        return (c, h, w)

    def describe(self, attrs):
        return f"channel shuffle of {attrs['groups']} groups"

    @staticmethod
    def _shuffled(t: torch.Tensor, groups: int) -> torch.Tensor:
        n, c, h, w = t.shape
        return t.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)

    def torch_forward(self, attrs, xs, module):
        x = xs[0]
        n, c, h, w = x.shape
        return torch.transpose(x.view(n, attrs["groups"], c // attrs["groups"], h, w), 1, 2).contiguous().view(n, c, h, w)

    def _move(self, attrs, t):
        return self._shuffled(t, attrs["groups"])

    def _back(self, attrs, g, shape):
        return self._shuffled(g, shape[1] // attrs["groups"])  # the inverse: C/groups groups of `groups`

    def port_slips(self, attrs, in_shape):
        groups, per_group = attrs["groups"], in_shape[0] // attrs["groups"]
        if 1 in (groups, per_group):
            return []  # the shuffle is the identity: every slip computes the same
        slips = [PortSlip("routing", "leaves the channels in place (the shuffle forgotten)",
                          lambda: OtherAttributes(self, {"groups": 1}), forward=True)]
        if groups != per_group:  # else the shuffle is its own inverse
            slips += [PortSlip("routing", f"shuffles the other way ({per_group} groups of {groups}: the inverse "
                               f"shuffle)", lambda: OtherAttributes(self, {"groups": per_group}), forward=True),
                      PortSlip("routing", "backward shuffles the gradient again instead of back",
                               lambda: BackwardReplaced(self, _shuffled_again))]
        return slips


def _same_side(size, side, tensor: str, axis: int) -> bool:
    """Whether a Reshape's size keeps an image's height or width: the graph's number, or a copy of the open size."""
    return size == side if side is not None else size == OpenSize(tensor, axis)


def _shuffled_again(op, attrs, g, xs, y, params, kernels, need):
    """A backward that applies the forward's shuffle to the gradient, not its inverse."""
    return [op._shuffled(g, attrs["groups"]) if need[0] else None], {}


class ChannelSlice(ChannelMove):
    """Some of an image's channels, `channels` [start, stop) (`torch.split`'s pieces, `x[:, a:b]`; a stop past the
    channels, or null, stops at them, as a Python slice), or piece `chunk` [index, count] of torch.chunk (pieces of ⌈C/count⌉ channels). Read
    from `x.chunk(2, dim=1)` and `torch.split(x, sizes, dim=1)`, each piece through `[i]` (ShuffleNet's `x1, x2`)."""

    name = "channel_slice"
    keys = {"channels": None, "chunk": None}
    pieces = (torch.chunk, "chunk", torch.split, "split")
    torch_calls = (*pieces, operator.getitem)

    def check(self, attrs):
        given = [key for key in self.keys if attrs[key] is not None]
        if len(given) != 1:
            raise OpSpecError("channel_slice takes 'channels' ([start, stop]) or 'chunk' ([index, count]), one of them")
        pair = attrs[given[0]]
        open_end = given[0] == "channels" and isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[1] is None
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair[:1 if open_end else 2])):
            raise OpSpecError(f"'{given[0]}' is {pair!r}: expected two integers ≥ 0"
                              + (" (the stop may be null: to the last channel)" if given[0] == "channels" else ""))
        first, second = pair
        if not open_end and first >= second:
            raise OpSpecError(f"'{given[0]}' is {pair!r}: expected {'start < stop' if given[0] == 'channels' else 'index < count'}")
        attrs[given[0]] = [first, second]
        return attrs

    def from_torch_piece(self, target, args, kwargs, index: int) -> dict:
        call = getattr(target, "__name__", target)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if dim != 1:
            raise OpSpecError(f"{call} along dim {dim}: only an image's channels (dim=1) are split")
        given = [kwargs[key] for key in ("chunks", "split_size_or_sections", "split_size") if key in kwargs]
        size = given[0] if given else args[1]
        if call == "chunk":
            return {"chunk": [index, size]}
        if isinstance(size, int):
            return {"channels": [index * size, (index + 1) * size]}
        sizes = list(size)
        return {"channels": [sum(sizes[:index]), sum(sizes[:index + 1])]}

    def from_torch_call(self, target, args, kwargs):
        """`x[:, a:b]`: channels a … b − 1 of an image (every other index refused)."""
        index = args[1] if len(args) > 1 else None
        whole, channels = (index + (slice(None),) * 2)[:2] if isinstance(index, tuple) and len(index) <= 4 else (None, None)
        rest = index[2:] if isinstance(index, tuple) else ()
        if (whole != slice(None) or not isinstance(channels, slice) or channels.step not in (None, 1)
                or any(r not in (slice(None), Ellipsis) for r in rest)):
            raise OpSpecError(f"indexing by {index!r}: only x[:, a:b] (some of an image's channels) is read")
        start, stop = channels.start or 0, channels.stop
        if not all(isinstance(v, int) and v >= 0 for v in (start, stop if stop is not None else 0)):
            raise OpSpecError(f"x[:, {start}:{stop}]: channel ends must be numbers ≥ 0 (negative ends count from the end)")
        return {"channels": [start, stop]}

    def _range(self, attrs, c: int) -> tuple[int, int]:
        if attrs["chunk"] is not None:
            index, count = attrs["chunk"]
            size = -(-c // count)
            start, stop = index * size, min(c, (index + 1) * size)
        else:
            start, stop = attrs["channels"][0], min(c, attrs["channels"][1] or c)
        if start >= stop:
            raise OpSpecError(f"channel_slice {self.describe(attrs)} of {c} channels: the piece is empty")
        return start, stop

    def out_shape(self, attrs, in_shapes):
        c, h, w = _image(in_shapes[0], "channel_slice")
        start, stop = self._range(attrs, c)
        return (stop - start, h, w)

    def describe(self, attrs):
        if attrs["chunk"] is not None:
            return f"channel chunk {attrs['chunk'][0]} of {attrs['chunk'][1]}"
        return f"channels {attrs['channels'][0]}:{'' if attrs['channels'][1] is None else attrs['channels'][1]}"

    def torch_forward(self, attrs, xs, module):
        start, stop = self._range(attrs, xs[0].shape[1])
        return xs[0][:, start:stop]

    def _move(self, attrs, t):
        start, stop = self._range(attrs, t.shape[1])
        return t[:, start:stop].contiguous()

    def _back(self, attrs, g, shape):
        start, stop = self._range(attrs, shape[1])
        placed = g.new_zeros(shape)
        placed[:, start:stop] = g
        return placed

    def port_slips(self, attrs, in_shape):
        start, stop = self._range(attrs, in_shape[0])
        length, c = stop - start, in_shape[0]
        other = start + length if start + 2 * length <= c else start - length
        if other < 0 or length == c:
            return []
        return [PortSlip("routing", f"takes channels {other}:{other + length} (the wrong piece)",
                         lambda: OtherAttributes(self, {"channels": [other, other + length], "chunk": None}),
                         forward=True),
                PortSlip("routing", f"backward places the gradient in channels {other}:{other + length} (the wrong "
                         f"piece)", lambda: BackwardReplaced(self, _placed_at(other)))]


def _placed_at(start: int):
    """A backward that places the gradient in the channels from `start`, not the slice's own."""
    def backward(op, attrs, g, xs, y, params, kernels, need):
        placed = g.new_zeros(xs[0].shape)
        placed[:, start:start + g.shape[1]] = g
        return [placed if need[0] else None], {}

    return backward


for _op in (ChannelShuffle(), ChannelSlice()):
    register(_op)
