"""A reduced format's loss and output against their sampled bounds, on the example networks.

    python benchmarks/reduced_format_forward.py [--size 24] [--seeds 4] [--formats tf32,bfloat16] [--record]

Each network's float32 build with every convolution and linear operand rounded to the format
(precision_lab.candidates.builtin.emulated, claimed as that format) is judged against the format's bound, whose
loss and output parts are sampled with the operand rounding drawn on the operands (precision_lab.sampled).
Printed per format and network, the largest over the seeds of error ÷ bound (the emulated build must stay below
1) and of ‖bound‖ ÷ ‖reference‖ (below compare.CERTIFIABLE_FRACTION = 0.5 the output is certified), and the
same fraction under |W|·E alone (errmodel without the sampled runs), which is what the bound was before.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from precision_lab import errmodel
from precision_lab.candidates.builtin import emulated
from precision_lab.compare import bound_fraction
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.provenance import run_recorded
from precision_lab.reference import reference

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = ("seed", "dncnn-bn.json", "dncnn.json", "deep-denoiser.json", "small-unet.json", "resnet-projection.json",
            "conv-transpose-decoder.json", "gn-gelu.json", "mobile-block.json", "dropout-denoiser.json",
            "vit-block.json", "vit-heads.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--formats", default="tf32,bfloat16")  # float16 shares tf32's u = 2⁻¹¹
    args = parser.parse_args()
    print(f"size {args.size}², batch 2, seeds 0–{args.seeds - 1}; largest over the seeds")
    print("| format | network | loss error ÷ bound | output error ÷ bound | ‖output bound‖ ÷ ‖output‖ | under |W|·E |")
    print("|---|---|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        run = emulated(fmt)
        for name in NETWORKS:
            network = load_model(name if name == "seed" else MODELS / name)
            size = network.default_size(args.size)
            worst = [0.0, 0.0, 0.0, 0.0]
            for seed in range(args.seeds):
                problem = make_problem(size, 2, seed, network=network)
                trace = reference(problem)
                result = run(problem, "float32", torch.device("cpu"))
                bounds = errmodel.error_bounds(trace, fmt)
                unsampled = errmodel._error_bounds(trace, fmt, errmodel.LAMBDA)
                output = np.asarray(trace.output, np.float64)
                row = [abs(result.loss - trace.loss) / bounds["loss"].max,
                       float(np.max(np.abs(np.asarray(result.output, np.float64) - output) / bounds["output"].bound)),
                       bound_fraction(output, bounds["output"].bound), bound_fraction(output, unsampled["output"].bound)]
                worst = [max(a, b) for a, b in zip(worst, row)]
            print(f"| {fmt} | {network.name} ({size[0]}×{size[1]}) | {worst[0]:.3f} | {worst[1]:.3f} | {worst[2]:.3g} "
                  f"| {worst[3]:.3g} |", flush=True)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
