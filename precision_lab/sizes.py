"""Image sizes as users write them (`N`, `HxW`), checked without importing torch or numpy.

The command line checks `--size` before anything heavy is imported, so a typo is answered at once;
precision_lab.problem re-exports these names.
"""
from __future__ import annotations

import re

from .errors import LabInputError

#: the smallest side an image may have (a 3×3 kernel, pooling, a probe): below it nothing is learnt
MIN_SIDE = 4


class ProblemError(LabInputError):
    """Bad problem input (image file, size, batch): the message names the file and the fix."""


def parse_size(value, what: str = "size") -> tuple[int, int]:
    """An image size from `N`, `HxW` (also 'H×W'), an int or an (H, W) pair; ProblemError otherwise."""
    if isinstance(value, bool):
        raise ProblemError(f"{what}: expected N or HxW (e.g. 1024 or 61x67), got {value!r}")
    if isinstance(value, int):
        pair = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        pair = (int(value[0]), int(value[1]))
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+\s*([x×X]\s*\d+\s*)?", value):
        numbers = [int(n) for n in re.findall(r"\d+", value)]
        pair = (numbers[0], numbers[-1]) if len(numbers) == 2 else (numbers[0], numbers[0])
    else:
        raise ProblemError(f"{what}: expected N or HxW (e.g. 1024 or 61x67), got {value!r}")
    if min(pair) < MIN_SIDE:
        raise ProblemError(f"{what}: {pair[0]}×{pair[1]} is too small (each side at least {MIN_SIDE})")
    return pair
