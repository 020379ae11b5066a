"""Winograd's forward error against the direct sum's per-element bound, by a convolution's input channels.

    python benchmarks/winograd_forward.py [--seeds 3] [--size 64]

The error model's flip test (ops/pointwise.py) asks whether a ReLU's input z lies within its forward bound
γ̃ₙ(λ)·S, S = conv(|a|, |W|), n = 9·C: a bound for every summation order of the direct 3×3 sum. Winograd
F(m×m, 3×3) rounds its transforms' intermediate values instead (Barabasz et al. 2020, ACM TOMS 46(4)), so its
error is not bounded by it where n is small. For C input channels (a standard normal image for C = 1, ReLU
outputs of one for C > 1, 16 output channels, weights N(0, 1/9), batch 2) this prints the largest
|Winograd − exact| ÷ γ̃ₙ(λ)·S over the output and the seeds, for the lab's F(2,3) and F(4,3). Above 1, a ReLU
the bound says cannot flip may flip under that algorithm; the bound of the weight gradient behind it then holds
only through its own slack (docs/verdicts.md, "False alarms on the example networks").
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from precision_lab import errmodel, formats
from precision_lab.conv.algorithms import WinogradConv
from precision_lab.roundoff import probabilistic_gamma
from precision_lab.provenance import run_recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    u = formats.UNIT_ROUNDOFF["float32"]
    print("| input channels C | n = 9C | F(2,3): max error ÷ γ̃ₙ(λ)·S | F(4,3): max error ÷ γ̃ₙ(λ)·S |")
    print("|---:|---:|---:|---:|")
    for channels in (1, 2, 3, 4, 8, 16, 32, 64):
        worst = {2: 0.0, 4: 0.0}
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(2, channels, args.size, args.size, generator=g)
            x = x.relu() if channels > 1 else x
            w = torch.randn(16, channels, 3, 3, generator=g) / 3
            exact = F.conv2d(x.double(), w.double(), padding=1)
            bound = probabilistic_gamma(9 * channels, u, errmodel.LAMBDA) * F.conv2d(x.abs().double(), w.abs().double(),
                                                                                     padding=1)
            for m in worst:
                error = (WinogradConv(m).forward(x, w).double() - exact).abs()
                worst[m] = max(worst[m], float((error / bound).max()))
        print(f"| {channels} | {9 * channels} | {worst[2]:.3g} | {worst[4]:.3g} |", flush=True)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
