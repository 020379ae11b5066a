"""The program under check: the interface it answers through, and the budget of calls spent on it."""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from .. import formats
from ..errors import LabInputError
from ..options import PROGRESS_ENV  # "0": the progress bar stays off even on a terminal

#: default number of program calls: ≤ 60 for ≤ 10 tensors, 4 more per tensor beyond
BUDGET_BASE, BUDGET_PER_TENSOR = 20, 4


class GradCheckError(LabInputError):
    """A program's answer the check cannot use (shape, dtype, non-finite values): exit code 2."""


#: a float32-only check's calls beyond its noise line: per tensor one segment of 8 panels (7 dof for the panels' fit,
#: whose Student t is 7.9 instead of 28 on 4 panels; the ratio test on 2, 4, 8 panels, where on 4 the 1-panel
#: trapezoid is not yet like h²) and a moved centre (a bias longer than itself), and this many scaling segments
#: (8 panels and their shared centre)
SEGMENT_CALLS, SCALING_SEGMENTS = 9, 2


def default_budget(n_tensors: int) -> int:
    """Program calls a check may spend: 60 for up to 10 tensors, 4 per tensor beyond."""
    return max(60, BUDGET_BASE + BUDGET_PER_TENSOR * n_tensors)


def float32_only_budget(n_tensors: int, noise_points: int) -> int:
    """Program calls a float32-only check may spend: the base and its noise line, an 8-panel segment (and a moved
    centre) per tensor and two scaling segments, never below `default_budget`: a ceiling, the calls beyond
    `default_budget` double the panels where a segment needs them (measured: a MobileNet block with BatchNorm,
    11 tensors, `inconclusive` at 64 calls, `roundoff` in 83–86 of 130)."""
    return max(default_budget(n_tensors), 1 + noise_points + SEGMENT_CALLS * n_tensors + SCALING_SEGMENTS * SEGMENT_CALLS)


@dataclass
class Evaluation:
    """One answer of the program: the loss and each parameter's gradient (as float64 copies)."""

    loss: float
    grads: dict[str, np.ndarray]
    wall_s: float = 0.0


class Oracle(Protocol):
    """What the check needs of a program: `evaluate("claimed" | "float64", params)`."""

    name: str
    claimed_precision: str
    has_float64: bool

    def evaluate(self, build: str, params: dict[str, np.ndarray]) -> Evaluation: ...


def storage_dtype(build: str, claimed_precision: str) -> np.dtype:
    """The dtype a build exchanges arrays in: float64 for the float64 build, else the claim's storage."""
    return np.dtype("float64" if build == "float64" else formats.STORAGE_DTYPE[claimed_precision])


def exact_cast(value: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """`value` in `dtype`, refusing any rounding (the check builds its points on the build's grid)."""
    cast = np.asarray(value).astype(dtype)
    if not np.array_equal(cast.astype(np.float64), np.asarray(value, np.float64)):
        raise AssertionError(f"internal: point of {name!r} is not representable in {dtype}")
    return cast


def check_evaluation(where: str, evaluation: Evaluation, shapes: dict[str, tuple[int, ...]]) -> Evaluation:
    """Refuse an answer the check cannot use: a missing gradient, a wrong shape, NaN/inf."""
    if not math.isfinite(evaluation.loss):
        raise GradCheckError(f"{where}: the loss is {evaluation.loss} (expected a finite number)")
    for name, shape in shapes.items():
        if name not in evaluation.grads:
            raise GradCheckError(f"{where}: no gradient {name + '.grad'!r} (expected shape {shape})")
        grad = np.asarray(evaluation.grads[name], np.float64)
        if grad.shape != tuple(shape):
            raise GradCheckError(f"{where}: {name + '.grad'!r} has shape {grad.shape}, expected {tuple(shape)} "
                                 f"(the shape of parameter {name!r})")
        if not np.all(np.isfinite(grad)):
            raise GradCheckError(f"{where}: {name + '.grad'!r} holds {int(np.sum(~np.isfinite(grad)))} NaN or "
                                 f"infinite values (expected finite numbers)")
        evaluation.grads[name] = grad
    return evaluation


@dataclass
class FunctionOracle:
    """An in-process program: `function(params, dtype) -> (loss, {name: grad})`, params in `dtype`.

    `float64_function` (default: `function` itself) is the float64 build; `has_float64=False`
    leaves the claimed build alone.
    """

    function: Callable
    name: str = "function"
    claimed_precision: str = "float32"
    has_float64: bool = True
    float64_function: Callable | None = None

    def evaluate(self, build: str, params: dict[str, np.ndarray]) -> Evaluation:
        dtype = storage_dtype(build, self.claimed_precision)
        function = (self.float64_function or self.function) if build == "float64" else self.function
        start = time.perf_counter()
        loss, grads = function({k: exact_cast(v, dtype, k) for k, v in params.items()}, dtype)
        wall = time.perf_counter() - start
        evaluation = Evaluation(float(loss), {k: np.array(v, np.float64) for k, v in grads.items()}, wall)
        return check_evaluation(f"{self.name} ({build} build)", evaluation, {k: v.shape for k, v in params.items()})


class BudgetSpent(Exception):
    """Raised inside the check when the next call would exceed the budget (caught there)."""


class Calls:
    """Counts and times the program calls; caches the answer at the base point."""

    def __init__(self, oracle: Oracle, budget: int, progress: bool):
        self.oracle, self.budget = oracle, budget
        self.counts = {"claimed": 0, "float64": 0}
        self.program_s = 0.0
        self.bar = None
        if progress and os.environ.get(PROGRESS_ENV) != "0":
            from tqdm import tqdm

            self.bar = tqdm(desc=f"gradient check {oracle.name} (≤ {budget} calls)", unit="call", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5, leave=False, disable=None)  # None: off when not a terminal

    @property
    def used(self) -> int:
        return sum(self.counts.values())

    @property
    def left(self) -> int:
        return self.budget - self.used

    def __call__(self, build: str, params: dict[str, np.ndarray]) -> Evaluation:
        if self.left <= 0:
            raise BudgetSpent
        evaluation = self.oracle.evaluate(build, params)
        self.counts[build] += 1
        self.program_s += evaluation.wall_s
        if self.bar is not None:
            self.bar.update(1)
        return evaluation

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
