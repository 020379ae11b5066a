"""Why a tensor's own segment cannot settle a gradient behind ReLUs: the segment identity on the ReLU conv net's conv.weight.

    python benchmarks/relu_segments.py [--seeds 3]

examples/opaque/relu_conv.py (conv 3×3 ×4, ReLU, linear, MSE over 100 8×8 images: 25,600 pre-activations), its
conv.weight moved along a random unit direction (one per seed) by 0.1%, 0.3% and 1% of its norm, on 16, 32 and
64 uniform panels (`experiments.gradient_check.segment_against_length`): the trapezoid's own error against the
float64 program (the kinks' quadrature error), the float32 segment's error, and the resolution the segment states
from its own measurements. Prints min and max over the seeds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from precision_lab.experiments.gradient_check import segment_against_length
from precision_lab.provenance import run_recorded

OPAQUE = Path(__file__).resolve().parents[1] / "examples" / "opaque"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(OPAQUE))
    import relu_conv

    arrays = dict(np.load(OPAQUE / "relu-start" / "arrays.npz"))
    data = {name: arrays.pop(name) for name in ("input", "target")}

    def program(params, dtype):
        return relu_conv.loss_and_grads({**data, **params}, dtype=dtype)

    rows = []
    for seed in range(args.seeds):
        for panels in (16, 32, 64):
            table = segment_against_length(program, arrays, "conv.weight", [0.001, 0.003, 0.01], seed=seed,
                                           panels=panels)
            table["panels"] = panels
            rows.append(table)
    table = pd.concat(rows).groupby(["panels", "fraction"])[
        ["segment_quadrature_error", "segment_error", "segment_resolution"]].agg(["min", "max"])
    print(table.to_string(float_format=lambda v: f"{v:.2g}"))


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
