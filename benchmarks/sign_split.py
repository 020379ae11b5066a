"""How much the sign split tightens each weight-gradient sum's own bound: S ÷ max(S₊, S₋).

    python benchmarks/sign_split.py [--seeds 2] [--networks tf-lenet:128,seed:128,...]

The bound of a sum of n terms in any order is γ̃ₙ(λ)·S, S = Σ|terms| (Higham & Mary 2019): every partial sum
is at most S. Any partial sum of any order is also at most max(S₊, S₋), the larger of the positive terms' sum
and the negative terms' magnitude, so that is an order-free bound too (roundoff.partial_sum_bound uses it),
smaller by S ÷ max(S₊, S₋) ∈ [1, 2]:
near 2 where the terms' signs balance, 1 where they do not. This prints that factor (median and smallest over
the elements with S > 0) for each conv2d and linear weight gradient of the example networks. The first layers'
weight gradients are where the own last sum dominates the bound (docs/verdicts.md, "Tightness").
"""
from __future__ import annotations

import argparse

import torch

from precision_lab.model import load_model
from precision_lab.ops import Kernels
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.provenance import run_recorded

NETWORKS = ("seed:128", "examples/models/small-unet.json:64", "examples/models/dilated-resnet.yaml:64",
            "examples/models/lenet-classifier.json:28", "examples/models/tf-lenet.json:128",
            "examples/models/wide-classifier.json:128")


def split_sums(layer, x: torch.Tensor, g: torch.Tensor, weight_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, S₊) of the weight gradient's terms g·x per element: S₊ = Σ(g₊x₊ + g₋x₋) (the positive terms)."""
    kernels = Kernels()  # PyTorch's native kernels, as the error model reads them

    def weight_grad(a, b):
        if layer.op == "linear":
            return kernels.linear_weight_grad(a.reshape(a.shape[0], -1), b)
        return kernels.conv_weight_grad(a, b, layer.attrs, weight_shape)
    pos, neg = (lambda t: t.clamp(min=0)), (lambda t: t.clamp(max=0))
    return weight_grad(x.abs(), g.abs()), weight_grad(pos(x), pos(g)) + weight_grad(neg(x), neg(g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--networks", default=",".join(NETWORKS), help="SPEC:SIZE, comma-separated")
    args = parser.parse_args()
    print("| network (size) | weight gradient | S ÷ max(S₊, S₋): median | smallest |")
    print("|---|---|---:|---:|")
    for item in args.networks.split(","):
        spec, size = item.rsplit(":", 1)
        network = load_model(spec)
        gains: dict[str, list[torch.Tensor]] = {}
        for seed in range(args.seeds):
            trace = reference(make_problem(int(size), 2, seed, network=network))
            for index, layer in enumerate(network.layers):
                if layer.op not in ("conv2d", "linear"):
                    continue
                x = trace.value(layer.inputs[0]).double()
                g = trace.grad_at(index).double()
                total, positive = split_sums(layer, x, g, trace.params[f"{layer.name}.weight"].shape)
                live = total > 0
                larger = torch.maximum(positive, total - positive)
                gains.setdefault(layer.name, []).append((total[live] / larger[live]).flatten())
        for name, parts in gains.items():
            gain = torch.cat(parts)
            print(f"| {network.name} ({size}²) | {name} | {gain.median().item():.2f} | {gain.min().item():.2f} |")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
