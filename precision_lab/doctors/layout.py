"""The layout doctor, by buffer: a gradient read as the candidate wrote it, tried in every layout it could
hold with every flip of H and W; the fix named in words a Fortran or CUDA programmer can apply."""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..compute import GradBuffer, Result, Trace
from ..findings import Finding
from ..layout import canonical_for, from_layout, layout_for, shape_in_layout, to_layout
from ..ops import OPS


def transforms(ndim: int) -> list[tuple[str, tuple[str, ...]]]:
    """Every (layout a buffer may hold, flipped axes) for a weight of `ndim` dimensions."""
    canonical = canonical_for(ndim)
    flips = [(), ("H",), ("W",), ("H", "W")] if ndim == 4 else [()]
    return [("".join(p), f) for p in itertools.permutations(canonical) for f in flips]


def transform_parts(held: str, declared: str, flipped: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(('layout', 'IOHW'), ('flip', 'HW')): what a transform does, step by step (the layout only when it differs)."""
    return ((("layout", held),) if held != declared else ()) + ((("flip", "".join(flipped)),) if flipped else ())


def transform_name(held: str, declared: str, flipped: tuple[str, ...]) -> str:
    """'layout OHWI', 'flip HW', 'layout IOHW + flip HW' (the layout named only when it differs)."""
    return " + ".join(f"{kind} {value}" for kind, value in transform_parts(held, declared, flipped))


def buffer_of(result: Result, name: str, got: np.ndarray) -> GradBuffer:
    """The gradient as written: the bundle's buffer when it came through one, else the canonical array."""
    if name in result.buffers:
        return result.buffers[name]
    return GradBuffer(np.ascontiguousarray(got).ravel(), canonical_for(got.ndim), "C")


def read_buffer(buffer: GradBuffer, canonical_shape, held: str, flipped: tuple[str, ...]) -> np.ndarray:
    """The buffer read as holding `held` (in the candidate's own index order), back to canonical, unflipped."""
    c_layout = held if buffer.order == "C" else held[::-1]  # Fortran order is C order of the reversed axes
    array = buffer.flat.reshape(shape_in_layout(canonical_shape, c_layout))
    canonical = from_layout(array, c_layout)
    axes = tuple(canonical_for(len(canonical_shape)).index(a) for a in flipped)
    return np.flip(canonical, axis=axes) if axes else canonical


def layout_fits(buffer: GradBuffer, ref: np.ndarray, bound: np.ndarray,
                along: float | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """Transforms that bring the buffer within `bound` of `ref`, simplest first (the declared reading excluded), and
    within `along` of it along ref's own direction where that bound is given (errmodel.QuantityBound.along)."""
    declared = layout_for(ref.ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
    candidates = [(held, flipped) for held, flipped in transforms(ref.ndim) if (held, flipped) != (declared, ())]
    # simplest first: fewest axes out of place and flips, then the shortest moves (a 1×1 kernel's OIHW read as IOHW
    # and as HIOW are the same bytes: the swap of O and I is the plainer name)
    candidates.sort(key=lambda c: (sum(a != b for a, b in zip(c[0], declared)) + len(c[1]),
                                   sum(abs(c[0].index(axis) - declared.index(axis)) for axis in declared), c))
    fits = []
    for held, flipped in candidates:
        fixed = read_buffer(buffer, ref.shape, held, flipped)
        if float(np.max(np.abs(fixed - ref) / bound)) <= 1.0 and (along is None or _along_within(fixed, ref, along)):
            fits.append((held, flipped))
    return fits


def _along_within(fixed: np.ndarray, ref: np.ndarray, along: float) -> bool:
    size = float(np.linalg.norm(ref))
    return size == 0 or abs(float(np.sum((fixed - ref) * ref)) / size) <= along


def layout_advice(name: str, buffer: GradBuffer, held: str, flipped: tuple[str, ...], ndim: int,
                  also: tuple[str, ...] = ()) -> str:
    """The fix in words: what the buffer holds, and how to convert it before writing.

    Only the conversion is offered: re-declaring weight_layout would also change the layout the
    request's weights arrive in, so it is not the same program with the bug fixed. `also` names the
    other gradients the same fix applies to.
    """
    declared = layout_for(ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
    order = "Fortran (column-major) order" if buffer.order == "F" else "C (row-major) order"
    names = [name, *also]
    it = "it" if len(names) == 1 else "each"
    steps = []
    if held != declared:
        permutation = tuple(held.index(c) for c in declared)
        steps.append(f"{it} holds {held} but is declared {declared} ({order}): transpose {it} to {declared} before "
                     f"writing (numpy: g.transpose{permutation})")
    if flipped:
        axes = " and ".join(flipped)
        steps.append(f"{it} is reversed along {axes}: flip {axes} before writing (a convolution where cuDNN and "
                     f"PyTorch compute a cross-correlation, or a flip in the conversion)")
    return ", ".join(f"{n}.grad" for n in names) + ": " + "; ".join(steps)


def layouts(quantities, result: Result, reference: Trace, pairs, bounds) -> list[Finding]:
    """Name the layout of every weight gradient beyond its bound that some transform fixes, and the fix in words."""
    found, findings = {}, []  # name → (buffer, fits, ndim)
    for name, q in quantities.items():
        if q.verdict != "defect" or not math.isfinite(q.bound_ratio) or not name.endswith(".weight"):
            continue
        got, ref = pairs[name]
        if ref.ndim not in (2, 4):
            continue
        buffer = buffer_of(result, name, got)
        fits = layout_fits(buffer, ref, bounds[name].bound, bounds[name].along)
        if not fits:
            continue
        declared = layout_for(ref.ndim, buffer.declared) if len(buffer.declared) == 4 else buffer.declared
        names = [transform_name(held, declared, flipped) for held, flipped in fits]
        parts = {n: transform_parts(held, declared, flipped) for n, (held, flipped) in zip(names, fits)}
        findings.append(Finding("layout", name, "layout", names[0], f"matches within the bound after: {', '.join(names[:4])}",
                                {"options": names, "parts": parts}))
        found[name] = (buffer, fits, ref.ndim)
    if found:
        # one fix for every slipped buffer: the first transform all of them admit (verdict.overall names the
        # same), told for the buffer it fits most plainly (one input channel makes OHWI and OHIW the same bytes)
        first = next(iter(found.values()))[1]
        common = [fit for fit in first if all(fit in fits for _, fits, _ in found.values())] or first[:1]
        name = min((n for n in found if common[0] in found[n][1]), key=lambda n: len(found[n][1]))
        buffer, _, ndim = found[name]
        applies = [n for n in found if common[0] in found[n][1]]  # every buffer the fix applies to, in network order
        advice = layout_advice(applies[0], buffer, common[0][0], common[0][1], ndim, tuple(applies[1:]))
        # an op whose weight's letters mean other channels says which (a transposed convolution's O is its input)
        notes = dict.fromkeys(OPS[layer.op].weight_letters for layer in reference.network.parametrised_layers
                              if f"{layer.name}.weight" in applies and OPS[layer.op].weight_letters)
        findings.append(Finding("layout-advice", name=advice + "".join(f" ({note})" for note in notes)))
    return findings


def same_reading(expected: str, named: str, shapes) -> bool:
    """Whether two transform names ('layout WHIO', 'flip HW', …) read every weight of these canonical shapes alike:
    a 1×1 kernel's OIHW written as IOHW is, byte for byte, written as HIOW too, and either name is right."""
    if expected == named:
        return True
    readings = []
    for text in (expected, named):
        held, flipped = None, ()
        for part in text.split(" + "):
            kind, _, value = part.partition(" ")
            if kind == "layout":
                held = value
            elif kind == "flip":
                flipped = tuple(value)
            else:
                return False
        readings.append((held, flipped))
    for shape in shapes:
        declared = canonical_for(len(shape))
        truth = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        read = []
        for held, flipped in readings:
            held = held or declared
            if len(held) != len(shape):
                return False
            axes = tuple(declared.index(a) for a in flipped)
            written = to_layout(np.flip(truth, axis=axes) if axes else truth, held).ravel()
            read.append(read_buffer(GradBuffer(written, declared, "C"), shape, declared, ()))
        if not np.array_equal(read[0], read[1]):
            return False
    return True
