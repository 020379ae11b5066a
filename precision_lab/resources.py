"""Guards before work: the memory a diagnosis will need, estimated from the problem, against what is free.

A diagnosis holds, at its peak, the float64 reference's live activations and gradients, their
float32 copies in the trace, the error model's temporaries (a few float32 tensors of the largest
layer), and the candidate's own float32 run. Measured on the seed CNN at 1024², batch 2 (136 M
activation elements over its five layers): 2.6 GB peak, i.e. about 19 bytes per activation
element; BYTES_PER_ELEMENT below keeps a margin over that, and LARGEST_LAYER_BYTES covers the
bound's temporaries of the largest layer.
"""
from __future__ import annotations

import math

import torch

from .errors import LabInputError

#: bytes per activation element (every layer output, whole batch) a diagnosis holds at its peak (module doc)
BYTES_PER_ELEMENT = 24
#: extra bytes per element of the largest layer: the bound's float32 temporaries (4 tensors)
LARGEST_LAYER_BYTES = 16
#: fixed cost: the Python process with torch and numpy imported
BASE_BYTES = 400 * 2 ** 20
#: share of the free memory a run may plan on (the rest for the OS, other processes, fragmentation)
USABLE_SHARE = 0.9


class ResourceError(LabInputError):
    """A problem too large for the memory that is free: names the need, the free amount and a size that fits."""


def activation_elements(network, batch: int, height: int, width: int) -> tuple[int, int]:
    """(Σ elements of every layer output over the batch, elements of the largest layer output)."""
    shapes = network.shapes(height, width)
    sizes = [batch * math.prod(shape) for shape in shapes] + [batch * network.input_channels * height * width]
    return sum(sizes), max(sizes)


def diagnosis_bytes(network, batch: int, height: int, width: int) -> int:
    """The memory one diagnosis of this problem needs at its peak (estimate, module doc)."""
    total, largest = activation_elements(network, batch, height, width)
    params = sum(math.prod(s) for s in network.param_shapes.values())
    return BASE_BYTES + BYTES_PER_ELEMENT * total + LARGEST_LAYER_BYTES * largest + 64 * params


def free_bytes(device: torch.device) -> int | None:
    """Memory free now on `device` (RAM via psutil; GPU via torch.cuda.mem_get_info), None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: no guard rather than no run
        return None


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.3g} GiB"


def check_fits(network, batch: int, height: int, width: int, device: torch.device, what: str = "this diagnosis") -> int:
    """Raise ResourceError (one line: need, free, a size that fits) unless the problem fits; returns the need."""
    need = diagnosis_bytes(network, batch, height, width)
    free = free_bytes(device)
    if free is None or need <= USABLE_SHARE * free:
        return need
    side = _largest_fitting_side(network, batch, height, width, USABLE_SHARE * free)
    hint = f"; {side[0]}×{side[1]} fits" if side else "; no smaller size of this network fits either"
    raise ResourceError(f"{what} at {height}×{width}, batch {batch} needs about {_gib(need)} of memory on "
                        f"{device.type} but {_gib(free)} is free{hint} (or use a smaller --batch)")


def _largest_fitting_side(network, batch: int, height: int, width: int, budget: float):
    """The largest size of the same aspect that fits the budget and the network (None if none)."""
    scale = 1.0
    for _ in range(64):
        scale *= 0.85
        h, w = max(4, int(height * scale)), max(4, int(width * scale))
        for hw in network.sizes_near(h, w, limit=4):
            if diagnosis_bytes(network, batch, *hw) <= budget:
                return hw
        if h == 4 and w == 4:
            break
    return None
