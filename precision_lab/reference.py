"""The float64 reference: the same problem in float64, inputs cast exactly from float32 (DESIGN.md)."""
from __future__ import annotations

import torch

from .problem import Problem, Trace, forward_backward


def reference(problem: Problem, device: str | torch.device = "cpu") -> Trace:
    """Float64 forward + backward of `problem` with every intermediate kept for the error model."""
    trace = forward_backward(problem, "float64", device, keep_trace=True)
    trace.meta["role"] = "reference"
    trace.meta["params"] = dict(problem.params)  # the error model propagates bounds through |W|
    return trace
