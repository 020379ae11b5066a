"""How tight can a bound that covers every summation order be? A weight-gradient sum, its orders, measured.

    python benchmarks/order_free_limit.py [--seeds 2] [--networks tf-lenet:128,...] [--elements 256]

The own part of a convolution's weight-gradient bound is γ̃ₙ(λ)·S (Higham & Mary 2019), S = Σ|terms|: it
holds for every order in which the n = batch·H_out·W_out terms a·g can be added. One order any such bound
has to cover adds the positive terms first and the negative ones after ("signs apart"): its partial sums
climb to S₊ before they come down, the largest any order can have. Orders that implementations use
(raster, reversed, a layer of tiles or lanes) follow the image, not the signs: where the terms' signs
mix, their partial sums wander like √k instead of climbing like k, and their error is far smaller.

For each conv2d weight gradient of the example networks (batch 2, each at its natural size), on a sample
of its elements, this forms the terms a·g exactly (float32 operands, float64 products), adds them in
float32 sequentially in those orders (numpy reduces axis 0 row by row: one sequential sum per column),
and prints each order's largest |error| ÷ bound over the elements and seeds, against two order-free bounds:
γ̃ₙ(λ)·S and roundoff.partial_sum_bound (zero terms add no rounding; every partial sum is at most
max(S₊, S₋)). How close the signs-apart order comes to a bound says how much of its looseness against
raster is the order, which no order-free bound can remove, and how much is the bound.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from precision_lab import roundoff
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.provenance import run_recorded

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = ("seed:128", f"{MODELS / 'small-unet.json'}:64", f"{MODELS / 'dilated-resnet.yaml'}:64",
            f"{MODELS / 'lenet-classifier.json'}:28", f"{MODELS / 'tf-lenet.json'}:128",
            f"{MODELS / 'wide-classifier.json'}:128")


def weight_grad_terms(attrs, x: torch.Tensor, g: torch.Tensor, elements: int, rng) -> np.ndarray:
    """The terms a·g of a sample of weight-gradient elements: (n, E) float64, rows in raster (batch, y, x) order."""
    groups = attrs["groups"]
    columns = F.unfold(x, attrs["kernel"], dilation=attrs["dilation"], padding=attrs["padding"],
                       stride=attrs["stride"])  # (B, C_in·kh·kw, L)
    c_out, per_group = g.shape[1], columns.shape[1] // groups
    pairs = [(o, j) for o in range(c_out) for j in range(per_group)]
    chosen = rng.choice(len(pairs), size=min(elements, len(pairs)), replace=False)
    outs = torch.tensor([pairs[i][0] for i in chosen])
    ins = torch.tensor([pairs[i][1] + (pairs[i][0] // (c_out // groups)) * per_group for i in chosen])
    terms = g.flatten(2)[:, outs, :] * columns[:, ins, :]  # (B, E, L)
    return terms.permute(0, 2, 1).reshape(-1, len(chosen)).numpy()


def sequential_float32(terms: np.ndarray) -> np.ndarray:
    """Each column added top to bottom in float32, the products rounded to float32 first."""
    return np.add.reduce(terms.astype(np.float32), axis=0, dtype=np.float32).astype(np.float64)


def signs_apart(terms: np.ndarray) -> np.ndarray:
    """Each column reordered so its partial sums stay as large as they can: the positive terms, largest first,
    then the negative ones, smallest magnitude first (zeros last)."""
    kind = np.where(terms > 0, 0, np.where(terms < 0, 1, 2))
    within = np.where(terms > 0, -terms, np.abs(terms))
    order = np.lexsort((within, kind), axis=0)
    return np.take_along_axis(terms, order, axis=0)


def headrooms(terms: np.ndarray) -> dict[str, float]:
    """max over the elements of |error| ÷ bound, per order and bound; the median share of nonzero terms."""
    exact = terms.sum(axis=0)  # float64 sum of exact products: error ~1e-16·S, far below float32's
    total = np.abs(terms).sum(axis=0)
    n, u = terms.shape[0], 2.0 ** -24
    bounds = {"S": roundoff.probabilistic_gamma(n, u) * total,
              "partial": roundoff.partial_sum_bound(torch.from_numpy(total), torch.from_numpy(exact),
                                                    torch.from_numpy((terms != 0).sum(axis=0).astype(np.float64)),
                                                    n, u, roundoff.LAMBDA).numpy()}
    live = total > 0
    result = {"nonzero": float(np.median((terms != 0).mean(axis=0)))}
    for order, ordered in {"raster": terms, "reversed": terms[::-1], "apart": signs_apart(terms)}.items():
        error = np.abs(sequential_float32(ordered) - exact)
        for label, bound in bounds.items():
            result[f"{order} {label}"] = float(np.max(error[live] / bound[live]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--networks", default=",".join(NETWORKS), help="SPEC:SIZE, comma-separated")
    parser.add_argument("--elements", type=int, default=256, help="weight-gradient elements sampled per layer")
    args = parser.parse_args()
    print("| network (size) | weight gradient | n | nonzero terms | raster ÷ γ̃ₙ(λ)·S | signs apart ÷ γ̃ₙ(λ)·S "
          "| raster ÷ partial-sum bound | signs apart ÷ partial-sum bound |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for item in args.networks.split(","):
        spec, size = item.rsplit(":", 1)
        network = load_model(spec)
        worst: dict[str, dict[str, float]] = {}
        counts: dict[str, int] = {}
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            trace = reference(make_problem(int(size), 2, seed, network=network))
            for index, layer in enumerate(network.layers):
                if layer.op != "conv2d":
                    continue
                # float32 operands, as a float32 implementation holds them; their products are exact in float64
                x = trace.value(layer.inputs[0]).float().double()
                g = trace.grad_at(index).float().double()
                terms = weight_grad_terms(layer.attrs, x, g, args.elements, rng)
                counts[layer.name] = terms.shape[0]
                for order, ratio in headrooms(terms).items():
                    entry = worst.setdefault(layer.name, {})
                    entry[order] = max(entry.get(order, 0.0), ratio)
        for name, ratios in worst.items():
            raster = max(ratios["raster S"], ratios["reversed S"])
            raster_partial = max(ratios["raster partial"], ratios["reversed partial"])
            print(f"| {network.name} ({size}²) | {name} | {counts[name]} | {ratios['nonzero']:.3f} | 1/{1 / raster:.0f} "
                  f"| 1/{1 / ratios['apart S']:.0f} | 1/{1 / raster_partial:.0f} | 1/{1 / ratios['apart partial']:.1f} |")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
