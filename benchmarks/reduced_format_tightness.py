"""Tightness of a reduced format's bound on the example networks: a right program's error ÷ bound, per format.

    python benchmarks/reduced_format_tightness.py [--size 32] [--seeds 2] [--formats tf32,bfloat16,float16]
        [--networks seed,small-unet.json,...] [--record]

Each network's right programs in each format, claimed in that format, against the bound of that claim
(precision_lab.errmodel: sampled through the backward with the switches' flips, precision_lab.switching):

* `emulated`: float32 arithmetic with every convolution and linear operand rounded to the format (a tensor core
  with float32 results: TF32's only form), precision_lab.candidates.builtin.emulated;
* `autocast` (bfloat16, float16): PyTorch's torch.autocast on the CPU, results stored in the format, float16 with
  GradScaler's loss scale 2¹⁶ (precision_lab.compute.autocast_forward_backward).

Printed per format, network and program, over every quantity and seed: the largest and the smallest error ÷ bound
(a right program must stay at or below 1; above 0.01 the bound is within 100× of what the format does), the
largest ‖bound‖ ÷ ‖quantity‖ (below compare.CERTIFIABLE_FRACTION = 0.5 the quantity is certified) and the largest
error along the gradient's own direction ÷ its bound; `verdict` is judge's on the requested problem, unprobed.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from precision_lab import errmodel
from precision_lab.candidates.builtin import GRAD_SCALER_INIT, emulated
from precision_lab.compare import bound_fraction, dot, norm
from precision_lab.compute import autocast_forward_backward
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.provenance import run_recorded
from precision_lab.reference import reference
from precision_lab.verdict import judge

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = ("seed", "small-unet.json", "dncnn-bn.json", "resnet-projection.json", "deep-denoiser.json",
            "lenet-classifier.json", "conv-transpose-decoder.json", "gn-gelu.json", "mobile-block.json",
            "dropout-denoiser.json", "vit-block.json", "vit-heads.json", "vit-prenorm-block.json")


def programs(fmt: str):
    yield "emulated", lambda problem: emulated(fmt)(problem, "float32", torch.device("cpu")), 1.0
    if fmt != "tf32":
        scale = GRAD_SCALER_INIT if fmt == "float16" else 1.0
        yield "autocast", lambda problem: autocast_forward_backward(problem, fmt, "cpu", scale), scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--formats", default="tf32,bfloat16,float16")
    parser.add_argument("--networks", default=",".join(NETWORKS))
    args = parser.parse_args()
    print(f"size {args.size}² (or the nearest each network takes), batch 2, seeds 0–{args.seeds - 1}")
    print("| format | network (size) | program | error ÷ bound, largest (quantity) | smallest (quantity) | "
          "‖bound‖ ÷ ‖quantity‖, largest (quantity) | along ÷ its bound, largest | verdicts | s |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|")
    for fmt in args.formats.split(","):
        for name in args.networks.split(","):
            network = load_model(name if name == "seed" else MODELS / name)
            size = network.default_size(args.size)
            for label, run, scale in programs(fmt):
                largest, smallest, widest, along, verdicts, seconds = (0.0, ""), (np.inf, ""), (0.0, ""), 0.0, [], 0.0
                for seed in range(args.seeds):
                    problem = make_problem(size, 2, seed, network=network)
                    trace = reference(problem)
                    result = run(problem)  # a float16 program backs its loss scale off where a gradient overflows
                    start = time.perf_counter()
                    bounds = errmodel.error_bounds(trace, fmt, loss_scale=result.meta.get("loss_scale", scale))
                    seconds = max(seconds, time.perf_counter() - start)
                    got = {"loss": result.loss, "output": result.output, **result.grads}
                    for quantity, bound in bounds.items():
                        ref = np.asarray(trace.loss if quantity == "loss" else trace.output if quantity == "output"
                                         else trace.grads[quantity], np.float64)
                        err = np.asarray(got[quantity], np.float64).reshape(ref.shape) - ref
                        ratio = float(np.max(np.abs(err) / bound.bound))
                        largest = max(largest, (ratio, quantity))
                        smallest = min(smallest, (ratio, quantity))
                        widest = max(widest, (bound_fraction(ref, bound.bound), quantity))
                        if bound.along is not None and norm(ref) > 0:
                            along = max(along, abs(dot(err, ref) / norm(ref)) / bound.along)
                    verdicts.append(judge(result, trace, fmt, label, fingerprint=False).verdict)
                print(f"| {fmt} | {network.name} ({size[0]}×{size[1]}) | {label} | {largest[0]:.3g} ({largest[1]}) | "
                      f"{smallest[0]:.3g} ({smallest[1]}) | {widest[0]:.3g} ({widest[1]}) | {along:.3g} | "
                      f"{', '.join(sorted(set(verdicts)))} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
