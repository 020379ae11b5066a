"""Command-line numbers and sizes, each checked with a message that names its option.

argparse would print a usage block and "invalid int value"; the lab's errors are one line that
names the option and what it takes (`--seed: must be a non-negative integer, got -3`), exit 2.
"""
from __future__ import annotations

from .errors import LabInputError
from .sizes import ProblemError, parse_size

#: the environment variable `precision-lab run` sets to "0": no progress bars in the reports
PROGRESS_ENV = "PRECISION_LAB_PROGRESS"


def integer(text, option: str, minimum: int, words: str) -> int:
    """An integer ≥ minimum from `text`, or LabInputError naming `option`."""
    if text is None:
        return None
    try:
        value = int(str(text).strip(), 10)
    except ValueError:
        raise LabInputError(f"{option}: must be {words}, got {text!r}") from None
    if value < minimum:
        raise LabInputError(f"{option}: must be {words}, got {value}")
    return value


def nonnegative(text, option: str) -> int | None:
    return integer(text, option, 0, "a non-negative integer")


def positive(text, option: str) -> int | None:
    return integer(text, option, 1, "a positive integer")


def size(text, option: str = "--size") -> tuple[int, int] | None:
    """`N` or `HxW` (e.g. 1024 or 61x67), or LabInputError naming `option`."""
    if text is None:
        return None
    try:
        return parse_size(str(text), option)
    except ProblemError as exc:
        raise LabInputError(str(exc)) from None
