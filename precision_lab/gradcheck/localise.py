"""Localisation: halves of a failing direction, down to the element whose gradient is wrong."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .program import BudgetSpent
from .stencils import Checker, Direction


@dataclass
class Region:
    """A set of parameter elements: per tensor, a box of index ranges."""

    boxes: dict[str, tuple[tuple[int, int], ...]]

    @classmethod
    def whole(cls, names, shapes) -> "Region":
        return cls({name: tuple((0, n) for n in shapes[name]) for name in names})

    def restrict(self, displacement: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        restricted = {}
        for name, box in self.boxes.items():
            if name not in displacement:
                continue
            masked = np.zeros_like(displacement[name])
            index = tuple(slice(a, b) for a, b in box)
            masked[index] = displacement[name][index]
            restricted[name] = masked
        return restricted

    def size(self) -> int:
        return sum(math.prod(b - a for a, b in box) for box in self.boxes.values())

    def describe(self, shapes: dict[str, tuple[int, ...]]) -> str:
        parts = []
        for name, box in self.boxes.items():
            if all(b - a == n for (a, b), n in zip(box, shapes[name])):
                parts.append(name if not box else f"{name} (whole tensor)")
                continue
            axes = [str(a) if b - a == 1 else (":" if b - a == n else f"{a}:{b}") for (a, b), n in zip(box, shapes[name])]
            parts.append(f"{name}[{', '.join(axes)}]")
        return " + ".join(parts)

    def splits(self) -> list[tuple[str, "Region", "Region"]]:
        """Ways to halve the region: by tensors first, then along each axis with more than one index."""
        names = list(self.boxes)
        if len(names) > 1:
            half = len(names) // 2
            return [("tensors", Region({n: self.boxes[n] for n in names[:half]}),
                     Region({n: self.boxes[n] for n in names[half:]}))]
        name, box = names[0], self.boxes[names[0]]
        ways = []
        for axis, (a, b) in enumerate(box):
            if b - a > 1:
                mid = (a + b) // 2
                ways.append((f"axis {axis}", Region({name: box[:axis] + ((a, mid),) + box[axis + 1:]}),
                             Region({name: box[:axis] + ((mid, b),) + box[axis + 1:]})))
        return ways


@dataclass
class Located:
    """Where a failing direction's error lies, with the directional evidence of the last split."""

    region: str
    error: float  # ê of the region (per unit multiplier of the parent direction)
    sigma: float
    note: str = ""
    element_error: float | None = None  # a single element: how far its gradient is off
    tensors: list[str] = field(default_factory=list)  # the tensors the region touches


def localise(checker: Checker, parent: Direction, shapes: dict[str, tuple[int, ...]]) -> list[Located]:
    """Halve the failing direction's support until the error is named (an element, row, column …)."""
    level = parent.deciding
    multiplier = level.multiplier
    region = Region.whole(list(parent.displacement), shapes)
    error, sigma = level.error, level.error_sigma
    found: list[Located] = []
    while True:
        if region.size() == 1:
            (name, box), = region.boxes.items()
            index = tuple(a for a, _ in box)
            step = parent.displacement[name][index]
            claimed = float(checker.at_base.grads[name][index])
            note, wrong_by = "a single element", None
            if step != 0:
                wrong_by = error / step
                note += (f": its gradient {claimed:.8g} is off by {wrong_by:.3g} "
                         f"({abs(wrong_by / claimed) if claimed else math.inf:.2g} relative; the loss says "
                         f"{claimed - wrong_by:.8g})")
            found.append(Located(region.describe(shapes), error, sigma, note, wrong_by, list(region.boxes)))
            return found
        moved = False
        spread_axes = []
        for way, first, second in region.splits():
            try:
                probe = checker.direction(f"{parent.label} restricted to {first.describe(shapes)}",
                                          first.restrict(parent.displacement))
                if not any(np.any(v) for v in probe.displacement.values()):
                    region, moved = second, True  # the first half does not move along this direction
                    break
                measured = checker.evaluate_level(probe, multiplier)
            except BudgetSpent:
                found.append(Located(region.describe(shapes), error, sigma, "the call budget ran out here",
                                     tensors=list(region.boxes)))
                return found
            if measured.status == "kinked":
                continue  # a kink along this half: try the next way of splitting
            e1, s1 = measured.error, measured.error_sigma
            e2, s2 = error - e1, math.hypot(sigma, s1)
            in_first = abs(e1) > measured.bound
            in_second = abs(e2) > checker.critical * s2 + measured.allowance
            if in_first and not in_second:
                region, error, sigma, moved = first, e1, s1, True
            elif in_second and not in_first:
                region, error, sigma, moved = second, e2, s2, True
            elif in_first and in_second:
                spread_axes.append(way)
                continue
            else:
                found.append(Located(region.describe(shapes), error, sigma, f"neither half of {way} carries the error alone",
                                     tensors=list(region.boxes)))
                return found
            break
        if not moved:
            note = f"spread along {', '.join(spread_axes)}" if spread_axes else "cannot be split further"
            found.append(Located(region.describe(shapes), error, sigma, note, tensors=list(region.boxes)))
            return found
