"""`device: auto` resolution, a one-line description of where a run happened, and a block's CPU thread count."""
from __future__ import annotations

import contextlib
import platform

import torch


def resolve_device(spec: str = "auto") -> torch.device:
    """'auto' → CUDA when a GPU is present, else CPU; 'cpu', 'cuda', 'cuda:1' as given."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {spec!r}: expected auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but this machine has no CUDA GPU (use device: auto or cpu)")
    return device


def describe_device(device: torch.device) -> dict:
    """Device, its name, and the library versions that decide its kernels."""
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    else:
        info.update(name=platform.processor() or platform.machine(),
                    mkldnn=torch.backends.mkldnn.is_available())
    return info


@contextlib.contextmanager
def torch_threads(device: torch.device, threads: int):
    """PyTorch's CPU ops in `threads` threads for the block, then the count as it was (a GPU's ops are left alone):
    its CPU kernels split their sums by the thread count, so the count decides their last bits."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
