"""Native backends' global knobs as context managers that restore every flag they touch."""
from __future__ import annotations

import contextlib

import torch


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
