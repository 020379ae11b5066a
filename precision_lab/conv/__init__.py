"""Convolution algorithms and native-backend selection (docs/design.md, "Convolution algorithm selection").

`ALGORITHMS` maps a name to a ConvOps object (problem.py's protocol: `.name`, `forward(x, w)`,
`input_grad(grad_out, w)`, `weight_grad(x, grad_out)`; 3×3, stride 1, padding 1, any dtype,
CPU or GPU). `get_algorithm(name)` returns one; `select(name_or_goal)` is a context manager
that also sets the native backend's global flags and restores them; `record_kernels(fn)`
runs `fn` under torch.profiler and returns the kernels that ran.
"""
from __future__ import annotations

from .algorithms import DirectConv, FFTConv, Im2colConv, WinogradConv
from .backends import NATIVE_BACKENDS, NativeBackend, NativeConv, native_flags, record_kernels
from .selection import GOALS, select

#: the hand-written algorithms, each a legitimate implementation with its own summation order
ALGORITHMS = {
    algorithm.name: algorithm
    for algorithm in (DirectConv(), Im2colConv(), FFTConv(), WinogradConv(2), WinogradConv(4))
}


def get_algorithm(name: str):
    """A ConvOps by name: one of ALGORITHMS or a native backend configuration (NATIVE_BACKENDS)."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if name in NATIVE_BACKENDS:
        return NATIVE_BACKENDS[name]
    choices = ", ".join([*ALGORITHMS, *NATIVE_BACKENDS])
    raise ValueError(f"unknown convolution algorithm {name!r}: choose from {choices}")


def algorithm_names() -> list[str]:
    """Every name get_algorithm accepts, hand-written algorithms first."""
    return [*ALGORITHMS, *NATIVE_BACKENDS]


__all__ = ["ALGORITHMS", "GOALS", "NATIVE_BACKENDS", "DirectConv", "FFTConv", "Im2colConv", "NativeBackend",
           "NativeConv", "WinogradConv", "algorithm_names", "get_algorithm", "native_flags", "record_kernels", "select"]
