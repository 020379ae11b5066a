"""Weight layouts: any permutation of the letters O, I, H, W (docs/design.md, "Exchange format").

4-D (conv2d) weights are canonically OIHW; 2-D (linear) weights OI and keep the relative order of
O and I of the declared layout (HWIO → IO, OIHW → OI).
"""
from __future__ import annotations

import numpy as np

CANONICAL = "OIHW"
CANONICAL_2D = "OI"


def check_layout(layout: str) -> str:
    """Return `layout` if it is a permutation of OIHW, else raise ValueError saying so."""
    if not isinstance(layout, str) or sorted(layout) != sorted(CANONICAL):
        raise ValueError(f"unknown weight layout {layout!r}: expected a permutation of the letters O, I, H, W (e.g. OIHW, HWIO)")
    return layout


def layout_for(ndim: int, layout: str) -> str:
    """The layout a weight of `ndim` dimensions has under the declared 4-letter `layout`."""
    if ndim == 4:
        return layout
    if ndim == 2:
        return "".join(c for c in layout if c in "OI")
    return "O" if ndim == 1 else layout


def canonical_for(ndim: int) -> str:
    return {4: CANONICAL, 2: CANONICAL_2D}.get(ndim, "O")


def to_layout(weight: np.ndarray, layout: str) -> np.ndarray:
    """A canonical weight (OIHW, or OI for 2-D) stored in `layout` (4 letters, or its 2-D letters), C-contiguous."""
    sub = layout_for(weight.ndim, layout) if len(layout) == 4 else layout
    canonical = canonical_for(weight.ndim)
    return np.ascontiguousarray(np.transpose(weight, [canonical.index(c) for c in sub]))


def from_layout(weight: np.ndarray, layout: str) -> np.ndarray:
    """A weight stored in `layout` brought back to the canonical layout, C-contiguous."""
    sub = layout_for(weight.ndim, layout) if len(layout) == 4 else layout
    canonical = canonical_for(weight.ndim)
    return np.ascontiguousarray(np.transpose(weight, [sub.index(c) for c in canonical]))


def shape_in_layout(canonical_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape of a canonical weight (OIHW / OI) when stored in `layout`."""
    sub = layout_for(len(canonical_shape), layout) if len(layout) == 4 else layout
    canonical = canonical_for(len(canonical_shape))
    return tuple(canonical_shape[canonical.index(c)] for c in sub)
