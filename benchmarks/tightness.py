"""Tightness of the rounding bound on the example networks: bound ÷ the actual error of float32.

    python benchmarks/tightness.py [--seeds 3]

For each example network at its natural size (batch 2) and each quantity, over the seeds: the headroom
1 / max(|error| ÷ bound) of PyTorch's native float32 (how far below its bound the closest element is), and
‖bound‖₂ ÷ ‖reference‖₂ (compare.CERTIFIABLE_FRACTION: above it the quantity is `inconclusive`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from precision_lab import errmodel
from precision_lab.compare import bound_fraction
from precision_lab.compute import forward_backward
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.reference import reference

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = {"seed": ("seed", 128), "small-unet": (MODELS / "small-unet.json", 64),
            "dilated-resnet": (MODELS / "dilated-resnet.yaml", 64), "lenet-classifier": (MODELS / "lenet-classifier.json", 28),
            "tf-lenet": (MODELS / "tf-lenet.json", 128), "wide-classifier": (MODELS / "wide-classifier.json", 128)}


def measure(spec, size: int, seeds: int) -> dict[str, tuple[float, float]]:
    worst: dict[str, list[float]] = {}
    for seed in range(seeds):
        problem = make_problem(size, 2, seed, network=load_model(spec))
        trace = reference(problem)
        bounds = errmodel.error_bounds(trace, "float32")
        result = forward_backward(problem, "float32")
        for name in errmodel.quantities(problem.network):
            got, ref = ((result.loss, trace.loss) if name == "loss" else (result.output, trace.output)
                        if name == "output" else (result.grads[name], trace.grads[name]))
            got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
            ratio = float(np.max(np.abs(got - ref) / bounds[name].bound))
            entry = worst.setdefault(name, [0.0, 0.0])
            entry[0] = max(entry[0], ratio)
            entry[1] = max(entry[1], bound_fraction(ref, bounds[name].bound))
    return {name: (1 / r if r > 0 else float("inf"), f) for name, (r, f) in worst.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print("| network (size) | quantity | headroom: bound ÷ error (min over seeds) | ‖bound‖ ÷ ‖quantity‖ (max) |")
    print("|---|---|---:|---:|")
    for label, (spec, size) in NETWORKS.items():
        for name, (headroom, fraction) in measure(spec, size, args.seeds).items():
            print(f"| {label} ({size}²) | {name} | {headroom:.3g} | {fraction:.3g} |")


if __name__ == "__main__":
    main()
