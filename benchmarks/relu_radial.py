"""Directions along which a ReLU network has few or no kinks: the quadrature error of the segment identity by direction.

    python benchmarks/relu_radial.py [--seeds 3]

examples/opaque/relu_conv.py (with and without its 2×2 max-pool), run in float64 so that only the quadrature
error is left: the trapezoid of g·d on 8 uniform panels over [−h, h] against the loss difference, relative, for
segments of h = 1%, 3% and 10% of the parameters moved, along

* a unit direction at 45° between conv.weight's gradient and a random direction orthogonal to it (what the
  float32-only check uses today, scaled to ‖conv.weight‖);
* conv.weight's own direction (its radial scaling): a unit whose pre-activation z = W·x + b crosses zero moves
  there at the rate W·x = −b, so only the bias, not the whole patch, sets how many kinks are crossed;
* conv.bias's own direction: every unit of a channel moves by the same amount, as along any bias direction;
* conv.weight and conv.bias scaled together: z → (1 + t)·z keeps every pre-activation's sign and every
  max-pool winner, so the loss has no kink along it (the ReLU is positively homogeneous).

Prints one line per program, seed and direction.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from precision_lab.provenance import run_recorded

OPAQUE = Path(__file__).resolve().parents[1] / "examples" / "opaque"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(OPAQUE))
    import relu_conv

    def slope_and_loss(arrays, direction, t, pool):
        moved = {k: v + t * direction[k] if k in direction else v for k, v in arrays.items()}
        loss, grads = relu_conv.loss_and_grads(moved, pool=pool, dtype=np.float64)
        return loss, sum(float(np.sum(grads[k] * direction[k])) for k in direction)

    def quadrature_error(arrays, direction, h, pool, panels=8):
        nodes = np.linspace(-h, h, panels + 1)
        losses, slopes = zip(*(slope_and_loss(arrays, direction, t, pool) for t in nodes))
        trapezoid = (nodes[1] - nodes[0]) * (sum(slopes) - (slopes[0] + slopes[-1]) / 2)
        difference = losses[-1] - losses[0]
        return abs(difference - trapezoid) / abs(difference)

    for pool in (False, True):
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory() as folder:
                relu_conv.make_start(folder, seed=seed, pool=pool)
                arrays = {k: v.astype(np.float64) for k, v in np.load(Path(folder) / "arrays.npz").items()}
            weight, bias = arrays["conv.weight"], arrays["conv.bias"]
            gradient = relu_conv.loss_and_grads(arrays, pool=pool, dtype=np.float64)[1]["conv.weight"]
            rng = np.random.default_rng(100 + seed)
            other = rng.standard_normal(weight.shape)
            other -= gradient * np.sum(other * gradient) / np.sum(gradient * gradient)
            at_45 = gradient / np.linalg.norm(gradient) + other / np.linalg.norm(other)
            directions = {"45° on conv.weight": {"conv.weight": at_45 / np.linalg.norm(at_45) * np.linalg.norm(weight)},
                          "conv.weight radial": {"conv.weight": weight},
                          "conv.bias radial": {"conv.bias": bias},
                          "conv.weight and conv.bias radial": {"conv.weight": weight, "conv.bias": bias}}
            for name, direction in directions.items():
                errors = "  ".join(f"h={h:g}: {quadrature_error(arrays, direction, h, pool):.1e}" for h in (0.01, 0.03, 0.1))
                print(f"{'max-pool' if pool else 'conv'} seed {seed}  {name:34s} {errors}")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
