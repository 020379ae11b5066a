"""Weight layouts: any permutation of the letters O, I, H, W (DESIGN.md, exchange format)."""
from __future__ import annotations

import numpy as np

CANONICAL = "OIHW"


def check_layout(layout: str) -> str:
    """Return `layout` if it is a permutation of OIHW, else raise ValueError saying so."""
    if not isinstance(layout, str) or sorted(layout) != sorted(CANONICAL):
        raise ValueError(f"unknown weight layout {layout!r}: expected a permutation of the letters O, I, H, W (e.g. OIHW, HWIO)")
    return layout


def to_layout(weight_oihw: np.ndarray, layout: str) -> np.ndarray:
    """An OIHW weight (or weight gradient) stored in `layout`, C-contiguous."""
    check_layout(layout)
    return np.ascontiguousarray(np.transpose(weight_oihw, [CANONICAL.index(c) for c in layout]))


def from_layout(weight: np.ndarray, layout: str) -> np.ndarray:
    """A weight stored in `layout` brought back to OIHW, C-contiguous."""
    check_layout(layout)
    return np.ascontiguousarray(np.transpose(weight, [layout.index(c) for c in CANONICAL]))


def shape_in_layout(shape_oihw: tuple[int, ...], layout: str) -> tuple[int, ...]:
    check_layout(layout)
    return tuple(shape_oihw[CANONICAL.index(c)] for c in layout)
