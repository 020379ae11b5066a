"""Points on the build's grid: steps every program call can represent exactly, and g·Δ along them."""
from __future__ import annotations

import math

import numpy as np

from .. import compare
from .program import GradCheckError


def on_grid(base: np.ndarray, step: np.ndarray, storage: np.dtype, multipliers) -> np.ndarray:
    """`step` rounded so that base + m·step is exact in `storage` for every multiplier m.

    Elements where that fails (a step across a binade boundary, a step below one ulp) do not move.
    """
    storage = np.dtype(storage)
    fractions = [abs(m) for m in multipliers if 0 < abs(m) < 1]
    granularity = 2.0 ** math.ceil(math.log2(1.0 / min(fractions))) if fractions else 1.0
    reach = np.abs(base) + max(abs(m) for m in multipliers) * np.abs(step)
    spacing = np.spacing(reach.astype(storage)).astype(np.float64) * granularity
    quantised = np.round(step / spacing) * spacing
    for m in multipliers:
        point = base + m * quantised
        exact = (point.astype(storage).astype(np.float64) == point) & ((point - base) == m * quantised)
        quantised = np.where(exact, quantised, 0.0)
    return quantised


def displaced(base: dict[str, np.ndarray], displacement: dict[str, np.ndarray],
              multiplier: float) -> dict[str, np.ndarray]:
    """base + multiplier·displacement; the tensors the displacement leaves out stay where they are."""
    return {name: value + multiplier * displacement[name] if name in displacement else value
            for name, value in base.items()}


def dot(grads: dict[str, np.ndarray], displacement: dict[str, np.ndarray]) -> float:
    """g·Δ over the tensors the displacement moves."""
    return float(sum(compare.dot(grads[name], step) for name, step in displacement.items()))


def tensor_scales(base: dict[str, np.ndarray]) -> dict[str, float]:
    """‖w‖ per tensor, each from itself: a tensor whose norm dwarfs the others' (a bias at −7e4 beside
    weights ~0.1) must not set their steps. An all-zero tensor (a bias at initialisation) takes the
    median RMS element of the non-zero tensors × √n (1 per element when every tensor is zero)."""
    rms = sorted(float(np.sqrt(np.mean(v * v))) for v in base.values() if np.any(v))
    typical = rms[len(rms) // 2] if rms else 1.0
    scales = {}
    for name, value in base.items():
        norm = compare.norm(value)
        scales[name] = norm if norm > 0 else typical * math.sqrt(value.size)
    return scales


def tensor_step(value: np.ndarray, size: float, storage: np.dtype, multipliers, rng: np.random.Generator,
                unit: np.ndarray | None = None) -> np.ndarray:
    """A random direction (`unit` when given) of norm ≈ `size` over one tensor, exact on the build's grid at every
    multiplier; never all zero: a size below the elements' ulps is raised until some of them move."""
    for _ in range(64):
        step = on_grid(value, size * (random_unit(rng, value.shape) if unit is None else unit), storage, multipliers)
        if np.any(step):
            return step
        size *= 4.0
    raise GradCheckError(f"no step of a tensor of shape {value.shape} is exact in {storage} (non-finite values?)")


def random_unit(rng: np.random.Generator, shape) -> np.ndarray:
    """A random direction of norm 1 (all zero for an empty shape)."""
    z = rng.standard_normal(shape)
    norm = compare.norm(z)
    return z / norm if norm > 0 else z
