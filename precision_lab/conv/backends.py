"""Native backends (cuDNN on GPU, oneDNN or ATen on CPU): their global knobs, and the kernels that ran."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

import torch.nn.functional as F

from ..ops import SEED_CONV


class NativeConv:
    """PyTorch's own convolution kernels (cuDNN on GPU, oneDNN or ATen on CPU), for any conv2d shape.

    Called with the ConvOps protocol of the hand-written algorithms (3×3, stride 1, padding 1:
    forward(x, w), input_grad(g, w), weight_grad(x, g)) or with a layer's attributes and shapes.
    """

    name = "native"
    any_shape = True

    def forward(self, x, w, attrs=None):
        a = attrs or SEED_CONV
        return F.conv2d(x, w, None, a["stride"], a["padding"], a["dilation"], a["groups"])

    def input_grad(self, grad_out, w, attrs=None, input_shape=None):
        a = attrs or SEED_CONV
        shape = input_shape or (grad_out.shape[0], w.shape[1] * a["groups"], grad_out.shape[2], grad_out.shape[3])
        return torch.nn.grad.conv2d_input(shape, w, grad_out, a["stride"], a["padding"], a["dilation"], a["groups"])

    def weight_grad(self, x, grad_out, attrs=None, weight_shape=None):
        a = attrs or SEED_CONV
        shape = weight_shape or (grad_out.shape[1], x.shape[1] // a["groups"], *a["kernel"])
        return torch.nn.grad.conv2d_weight(x, shape, grad_out, a["stride"], a["padding"], a["dilation"], a["groups"])


def _has_fp32_precision_api() -> bool:
    # PyTorch ≥ 2.9 exposes torch.backends.cudnn.conv.fp32_precision; older versions only allow_tf32
    return hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


@contextlib.contextmanager
def native_flags(fp32_precision: str | None = None, benchmark: bool | None = None,
                 deterministic: bool | None = None, mkldnn: bool | None = None):
    """Set cuDNN/cuBLAS fp32 precision ('ieee' | 'tf32'), cuDNN benchmark/deterministic and
    oneDNN on/off for the block; every flag touched is restored on exit, even on error."""
    saved = []

    def setattr_saved(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        if fp32_precision is not None:
            if fp32_precision not in ("ieee", "tf32"):
                raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got {fp32_precision!r}")
            if _has_fp32_precision_api():
                setattr_saved(torch.backends.cudnn.conv, "fp32_precision", fp32_precision)
                setattr_saved(torch.backends.cuda.matmul, "fp32_precision", fp32_precision)
            else:
                setattr_saved(torch.backends.cudnn, "allow_tf32", fp32_precision == "tf32")
                setattr_saved(torch.backends.cuda.matmul, "allow_tf32", fp32_precision == "tf32")
        if benchmark is not None:
            setattr_saved(torch.backends.cudnn, "benchmark", benchmark)
        if deterministic is not None:
            setattr_saved(torch.backends.cudnn, "deterministic", deterministic)
        if mkldnn is not None:
            setattr_saved(torch.backends.mkldnn, "enabled", mkldnn)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def current_flags() -> dict:
    """The native backends' global flags now (for provenance and for tests that check restoration)."""
    flags = {"cudnn.benchmark": torch.backends.cudnn.benchmark,
             "cudnn.deterministic": torch.backends.cudnn.deterministic,
             "mkldnn.enabled": torch.backends.mkldnn.enabled,
             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    if _has_fp32_precision_api():
        flags["cudnn.conv.fp32_precision"] = torch.backends.cudnn.conv.fp32_precision
        flags["cuda.matmul.fp32_precision"] = torch.backends.cuda.matmul.fp32_precision
    else:
        flags["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
        flags["cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    return flags


@dataclass(frozen=True)
class NativeBackend(NativeConv):
    """PyTorch's convolution kernels with a choice of global knobs, applied around every call.

    Each call runs inside `native_flags(**flags)`, so the configuration holds whatever the
    caller's global state is, and that state is left as it was.
    """

    name: str = "native"
    description: str = "PyTorch native convolution with the flags as they are"
    flags: dict = field(default_factory=dict)

    def forward(self, x, w, attrs=None):
        with native_flags(**self.flags):
            return super().forward(x, w, attrs)

    def input_grad(self, grad_out, w, attrs=None, input_shape=None):
        with native_flags(**self.flags):
            return super().input_grad(grad_out, w, attrs, input_shape)

    def weight_grad(self, x, grad_out, attrs=None, weight_shape=None):
        with native_flags(**self.flags):
            return super().weight_grad(x, grad_out, attrs, weight_shape)


NATIVE_BACKENDS = {backend.name: backend for backend in (
    NativeBackend(),
    NativeBackend("native-ieee", "cuDNN/cuBLAS float32 in IEEE arithmetic (TF32 off)", {"fp32_precision": "ieee"}),
    NativeBackend("native-tf32", "cuDNN/cuBLAS with TF32 allowed for float32 (10-bit mantissa inputs)",
                  {"fp32_precision": "tf32"}),
    NativeBackend("native-benchmark", "cuDNN autotuner picks the fastest kernel per shape (benchmark=True)",
                  {"benchmark": True}),
    NativeBackend("native-deterministic", "cuDNN restricted to deterministic kernels, no autotuning",
                  {"deterministic": True, "benchmark": False}),
    NativeBackend("native-onednn-off", "CPU without oneDNN (ATen's own im2col + GEMM kernels)", {"mkldnn": False}),
)}


def _kernel_events(profiler, device_type: str) -> list[str]:
    names = []
    for event in profiler.events():
        on_device = getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if device_type == "cuda" and on_device:
            names.append(event.name)
        elif device_type == "cpu" and not on_device and "conv" in event.name.lower():
            names.append(event.name)  # on CPU the dispatched ATen/oneDNN operator names say which kernel ran
    return list(dict.fromkeys(names))


def record_kernels(fn, device: str | torch.device | None = None):
    """Run `fn()` under torch.profiler; return (its result, [names of the kernels that ran]).

    On a GPU the names are the CUDA kernels (cuDNN's, e.g. `sm80_xmma_fprop_implicit_gemm_tf32…`);
    on CPU, the convolution operators dispatched (`aten::mkldnn_convolution` is oneDNN).
    Names are deduplicated, in order of first appearance.
    """
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        result = fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return result, _kernel_events(profiler, device_type)
