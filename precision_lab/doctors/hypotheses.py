"""The named defect hypotheses: what a port plausibly got wrong, each as the values it would produce."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..compare import dot
from ..compute import Trace, forward_backward
from ..ops import OPS, Kernels


#: aligned tiles tried per tile size at most: 64 float64 weight-gradient convolutions take 0.7 s at a probe's size
#: (61×67, batch 2, conv2; measured on 2 shared cores), only for a failing layer; larger images keep the corner tiles
MAX_TILE_POSITIONS = 64


def hypotheses(reference: Trace, pairs, failing: list[str], recompute: bool):
    """(name, expected arrays by quantity, quantities covered, computed from stored values[, reordered bounds]) per
    hypothesis, family by family in HYPOTHESES's order; recomputing families only where `recompute`."""
    for family in HYPOTHESES:
        if recompute or not family.recomputes:
            yield from family.generate(reference, pairs, failing)


def _constant_factors(reference: Trace, pairs, failing):
    """got = c·ref with one c for every failing quantity (a sum for a mean, a missing 2 or 1/N)."""
    gradient_names = [n for n in failing if n not in ("loss", "output")]
    if not gradient_names:
        return
    num = sum(dot(pairs[n][0], pairs[n][1]) for n in gradient_names)
    den = sum(dot(pairs[n][1], pairs[n][1]) for n in gradient_names)
    if den == 0 or num == 0:
        return  # c = 0 is a gradient never computed: zero_gradients names it
    c = num / den
    problem = reference.problem
    out_count = int(np.prod(reference.output.shape))
    known = {"the number of output elements (a sum where the mean belongs)": out_count,
             "the batch size (a sum over samples where the mean belongs)": problem.batch,
             "the output elements per sample (a sum over each sample's, a mean over the batch)": out_count / problem.batch,
             "2": 2.0, "1/2 (the 2 of a square's derivative forgotten)": 0.5,
             "1/(number of output elements) twice (a mean taken twice)": 1.0 / out_count}
    # a known factor is named without its value, which differs between problems (a probe's size and batch): the
    # diagnosis names a cause only when every problem names the same one
    label = next((f"scaled by {text}" for text, value in known.items() if abs(c / value - 1) < 1e-3),
                 f"scaled by a constant {c:.6g}")
    covers = gradient_names + (["loss"] if "loss" in failing else [])
    yield label, {n: c * pairs[n][1] for n in covers}, covers, False


def _other_parameters(reference: Trace, pairs, failing):
    """A gradient slot holding another parameter's gradient (an index slip)."""
    names = [n for n in pairs if n not in ("loss", "output")]
    for name in failing:
        if name in ("loss", "output"):
            continue
        for other in names:
            if other != name and pairs[other][1].size == pairs[name][1].size:
                yield (f"{name} holds {other}'s gradient", {name: pairs[other][1].reshape(pairs[name][1].shape)},
                       [name], False)


class Slip(str):
    """A layer-local hypothesis's name ('conv1: <slip>') that keeps its parts: the same slip in several layers is
    one cause (`_one_slip_in_every_layer`) without reading the name back."""

    def __new__(cls, layer: str, slip: str):
        named = super().__new__(cls, f"{layer}: {slip}")
        named.layer, named.slip = layer, slip
        return named


def _window_slips(reference: Trace, pairs, failing):
    """Per layer with windows (a convolution, plain or transposed) and a failing gradient: shifted windows (its input's,
    or for a transposed convolution its upstream gradient's), a missing edge row/column/tile of the upstream gradient,
    the pre-activation for the post-activation — recomputed in float64 from the stored operands."""
    network = reference.network
    for layer in network.parametrised_layers:
        names = [f"{layer.name}.weight", f"{layer.name}.bias"]
        op = OPS[layer.op]
        if not any(n in failing for n in names) or op.window_shifts is None:
            continue
        a = reference.value(layer.inputs[0]).double()
        g = reference.grad_at(layer.index).double()
        attrs = layer.attrs
        shape = network.param_shapes[f"{layer.name}.weight"]
        kernels = Kernels()

        def wgrad(x, grad, op=op, attrs=attrs, shape=shape, kernels=kernels):
            return op.weight_grad_from(attrs, x, grad, shape, kernels).cpu().numpy()

        def expected(grad, x=a):
            out = {names[0]: wgrad(x, grad)}
            if names[1] in network.param_shapes:
                out[names[1]] = grad.sum(dim=(0, 2, 3)).cpu().numpy()
            return out

        for dy, dx in [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]:
            moved = a if op.window_shifts == "input" else g
            shifted = torch.roll(moved, shifts=(dy, dx), dims=(2, 3))
            if dy:
                shifted[:, :, (0 if dy > 0 else -1), :] = 0
            if dx:
                shifted[:, :, :, (0 if dx > 0 else -1)] = 0
            if op.window_shifts == "input":
                yield Slip(layer.name, f"windows shifted by ({dy}, {dx}) pixels (a padding offset)"), \
                    {names[0]: wgrad(shifted, g)}, [names[0]], True
            else:
                yield Slip(layer.name, f"its weight gradient reads the upstream gradient shifted by ({dy}, {dx}) "
                                       "pixels (a crop offset in the backward only)"), \
                    {names[0]: wgrad(a, shifted)}, [names[0]], True
        height, width = g.shape[2:]
        edges = {"first image row": (slice(None), slice(None), slice(0, 1), slice(None)),
                 "last image row": (slice(None), slice(None), slice(height - 1, height), slice(None)),
                 "first image column": (slice(None), slice(None), slice(None), slice(0, 1)),
                 "last image column": (slice(None), slice(None), slice(None), slice(width - 1, width))}
        for tile in (8, 16, 32):
            if tile < min(height, width) // 2:
                edges[f"top-left {tile}×{tile} tile"] = (slice(None), slice(None), slice(0, tile), slice(0, tile))
                edges[f"bottom-right {tile}×{tile} tile"] = (slice(None), slice(None), slice(height - tile, height),
                                                            slice(width - tile, width))
                # a kernel's tiles sit on a grid of their own size: every aligned one, where there are few
                rows, cols = range(0, height - tile + 1, tile), range(0, width - tile + 1, tile)
                if len(rows) * len(cols) <= MAX_TILE_POSITIONS:
                    for r0, c0 in itertools.product(rows, cols):
                        if (r0, c0) != (0, 0):
                            label = f"{tile}×{tile} tile at rows {r0}–{r0 + tile - 1}, columns {c0}–{c0 + tile - 1}"
                            edges[label] = (slice(None), slice(None), slice(r0, r0 + tile), slice(c0, c0 + tile))
        for text, region in edges.items():
            masked = g.clone()
            masked[region] = 0
            yield Slip(layer.name, f"the {text} of its upstream gradient skipped"), expected(masked), names, True
        source = network.layers[layer.inputs[0]] if layer.inputs[0] >= 0 else None
        if source is not None and OPS[source.op].elementwise:
            pre = reference.value(source.inputs[0]).double()
            if pre.shape == a.shape:
                yield (Slip(layer.name, f"the pre-activation of {source.label} used for its output"),
                       {names[0]: wgrad(pre, g)}, [names[0]], True)


def _one_sample(reference: Trace, pairs, failing):
    """Every gradient summed over one sample of the batch only (the mean's 1/N kept)."""
    problem = reference.problem
    if problem.batch < 2:
        return
    network = reference.network
    if any(OPS[layer.op].couples_batch(layer.attrs) for layer in network.layers):
        # samples meet (batch statistics): one sample's part of the batch's backward, not a batch of one's gradient
        for b in range(problem.batch):
            expected = _sample_part(reference, b)
            yield f"sample {b} of the batch only", expected, list(expected), False
        return
    total = problem.batch
    for b in range(problem.batch):
        part = forward_backward(problem.with_batch(b, b + 1), "float64", reference.device)
        scale = 1.0 / total  # each sample's loss is a mean over its own positions, the batch's the mean of those
        expected = {name: value * scale for name, value in part.grads.items()}
        yield f"sample {b} of the batch only", expected, list(expected), False


def _sample_part(reference: Trace, b: int) -> dict[str, np.ndarray]:
    """Each parameter's gradient from sample b's positions only: its layer's backward with the batch's upstream
    gradient kept on sample b and zero elsewhere (float64 from the stored operands)."""
    from ..compute import layer_params

    network, out = reference.network, {}
    params = {name: value.double() for name, value in reference.params.items()}
    for layer in network.parametrised_layers:
        g = reference.grad_at(layer.index).double()
        kept = torch.zeros_like(g)
        kept[b] = g[b]
        xs = [reference.value(i).double() for i in layer.inputs]
        _, grads = OPS[layer.op].backward(layer.attrs, kept, xs, reference.value(layer.index).double(),
                                          layer_params(params, layer), Kernels(), [False] * len(xs))
        out.update({f"{layer.name}.{suffix}": value.cpu().numpy() for suffix, value in grads.items()})
    return out


def _stale_weights(reference: Trace, pairs, failing):
    """Gradients at weights one small step away (stale weights): g(w − η·g) ≈ g + (η/s)·(g(w − s·g) − g(w)),
    the step η fitted by least squares over the failing gradients (one float64 recomputation at s = 10⁻²)."""
    names = [n for n in failing if n not in ("loss", "output")]
    if not names:
        return
    problem = reference.problem
    step = 1e-2
    moved = problem.with_params({n: (problem.params[n] - step * reference.grads[n]).astype(np.float32)
                                 for n in problem.params})
    other = forward_backward(moved, "float64", reference.device)
    direction = {n: other.grads[n] - pairs[n][1] for n in names}
    den = sum(float(np.sum(d * d)) for d in direction.values())
    if den == 0:
        return
    alpha = sum(float(np.sum((pairs[n][0] - pairs[n][1]) * direction[n])) for n in names) / den
    if alpha <= 0:
        return
    yield (f"stale weights (gradients at weights a step η ≈ {alpha * step:.3g}·g away)",
           {n: pairs[n][1] + alpha * direction[n] for n in names}, names, False)


def _port_slips(family: str):
    """The hypotheses of one family that the ops name for themselves (Op.port_slips), recomputed in float64: each
    layer's own, and the same slip in every layer of a group as one hypothesis too."""

    def generate(reference: Trace, pairs, failing):
        network, problem = reference.network, reference.problem
        shapes = network.shapes(problem.height, problem.width)

        def label_of(index: int) -> str:
            return network.layers[index].label if index >= 0 else "the network's input"

        def in_shape(layer):
            return shapes[layer.inputs[0]] if layer.inputs[0] >= 0 else (network.input_channels, problem.height,
                                                                        problem.width)

        slips = [(layer, slip) for layer in network.layers for slip in OPS[layer.op].port_slips(layer.attrs, in_shape(layer))
                 if slip.family == family]

        def recomputed(rules, slip):
            result = forward_backward(problem, "float64", reference.device, rules=rules)
            return dict(result.grads, output=result.output, loss=np.asarray(result.loss, np.float64)) if slip.forward \
                else result.grads

        # one group per name and slip: an op with several slips (a batch norm's statistics) groups each on its own
        groups = list(dict.fromkeys((name, slip.text) for _, slip in slips for name in slip.every))
        seen = []
        for every, text in groups:
            members = [(layer, slip) for layer, slip in slips if every in slip.every and slip.text == text]
            if len(members) > 1 and ([m[0] for m in members], text) not in seen:
                seen.append(([m[0] for m in members], text))
                expected = recomputed({layer.index: slip.rule() for layer, slip in members}, members[0][1])
                yield f"{every} {members[0][1].text}", expected, list(expected), False
        for layer, slip in slips:
            if slip.borrows:
                continue
            skip = None if layer.source is None else label_of(layer.source)
            if slip.feature_order is not None:
                if layer.index + 1 >= len(network.layers):
                    continue
                expected = recomputed({layer.index: slip.rule()}, slip)
                # the next layer's weight columns then multiply features in the new order: so do their bounds
                reader = network.layers[layer.index + 1]
                name = f"{reader.name}.weight"
                own = {name: (slice(None), slip.feature_order)} if (
                    OPS[reader.op].parametrised and name in reference.grads and reference.grads[name].ndim == 2) else {}
                yield f"{layer.label} {slip.text}", expected, list(expected), False, own
                continue
            expected = recomputed({layer.index: slip.rule()}, slip)
            yield f"{layer.label} {slip.text.format(skip=skip, first=label_of(layer.inputs[0]))}", expected, \
                list(expected), False
            for borrowed in (s for owner, s in slips if owner is layer and s.borrows):
                for other, other_slip in slips:
                    if other is layer or other_slip.text != borrowed.text:
                        continue
                    other_z, mine = reference.value(other.inputs[0]), reference.value(layer.inputs[0])
                    if other_z.shape != mine.shape:
                        continue
                    expected = recomputed({layer.index: borrowed.rule(other_z.double())}, borrowed)
                    yield f"{layer.label} {borrowed.text.format(other=other.label)}", expected, list(expected), False

    return generate


@dataclass(frozen=True)
class Family:
    """A family of named hypotheses: what it covers, and whether it recomputes the network in float64 (skipped
    where a CPU cannot afford it: doctors.budget)."""

    name: str
    recomputes: bool
    generate: Callable


#: the defect hypotheses in the order they are tested: a quantity is named by the first that fits it, so the
#: cheap whole-gradient ones come first, then the ops' own slips (Op.port_slips), then stale weights; a training
#: dropout's slips come before all (only networks with one have any): a scale 1/(1 − p) left out of its backward
#: is also a constant factor on every gradient behind it, and the dropout is the more specific name
HYPOTHESES = (
    Family("a training dropout's mask or its scale 1/(1 − p)", True, _port_slips("dropout")),
    Family("a constant factor (a sum for a mean, a missing 2 or 1/N)", False, _constant_factors),
    Family("another parameter's gradient in a slot", False, _other_parameters),
    Family("features reordered (a flatten in another order)", True, _port_slips("reorder")),
    Family("a weight gradient's windows shifted or clipped", True, _window_slips),
    Family("one sample of the batch only", True, _one_sample),
    Family("a backward mask missing or borrowed", True, _port_slips("mask")),
    Family("a routing op's backward (upsample, add, concat)", True, _port_slips("routing")),
    Family("another framework's default (GELU's formula, a leaky slope)", True, _port_slips("default")),
    Family("an attention's scale or softmax axis", True, _port_slips("attention")),
    Family("a kernel's orientation (a true convolution)", True, _port_slips("kernel orientation")),
    Family("a parameter used as a tensor (left out of the input gradient, its gradient averaged over the batch)", True,
           _port_slips("parameter")),
    Family("a transposed convolution's crop (its padding taken at the wrong side)", True, _port_slips("crop")),
    Family("a normalisation's statistics (constants in the backward, the unbiased variance, ε outside the root, "
           "running statistics)", True, _port_slips("statistics")),
    Family("stale weights", True, _stale_weights),
)
