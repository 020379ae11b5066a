"""Pick a convolution by name or by goal, as a context manager that restores every global flag."""
from __future__ import annotations

import contextlib

import torch

from .backends import NATIVE_BACKENDS, native_flags

#: goal → (native backend name, extra global flags); why each choice serves the goal is in its comment
GOALS = {
    # IEEE float32 everywhere: TF32 rounds conv inputs to 10 mantissa bits (u = 2^-11)
    "accurate": ("native-ieee", {"fp32_precision": "ieee"}),
    # the autotuner's fastest kernel, TF32 allowed (cuDNN's default choice on Ampere+)
    "fast": ("native-benchmark", {"benchmark": True, "fp32_precision": "tf32"}),
    # deterministic kernels only and no autotuning: repeated runs give identical bits
    "deterministic": ("native-deterministic", {"deterministic": True, "benchmark": False}),
}


@contextlib.contextmanager
def select(name_or_goal: str):
    """Yield the ConvOps for an algorithm name or a goal (`accurate`, `fast`, `deterministic`).

    For a goal the native flags are set globally for the block (so autograd code such as
    `autograd_forward_backward` uses them too); `deterministic` also turns on
    `torch.use_deterministic_algorithms`. Every flag touched is restored on exit, even on error.
    """
    from . import get_algorithm

    if name_or_goal not in GOALS:
        yield get_algorithm(name_or_goal)
        return
    backend_name, flags = GOALS[name_or_goal]
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        with native_flags(**flags):
            if name_or_goal == "deterministic":
                torch.use_deterministic_algorithms(True, warn_only=True)
            yield NATIVE_BACKENDS[backend_name]
    finally:
        torch.use_deterministic_algorithms(deterministic_before, warn_only=warn_only_before)
