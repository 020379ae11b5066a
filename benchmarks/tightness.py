"""Tightness of the rounding bound on the example networks: bound ÷ the actual error of legitimate float32.

    python benchmarks/tightness.py [--seeds 3] [--networks tf-lenet,deep-denoiser]

For each example network at its natural size (batch 2) and each quantity, over the seeds: the headroom
1 / max(|error| ÷ bound) — how far below its bound the closest element is — of PyTorch's native float32,
of the worst of the legitimate float32 orders of the zoo that implementations use (sequential, pairwise,
blocked, Kahan and split-K weight-gradient sums, sequential bias sums, a layer-by-layer backward,
micro-batches, direct/im2col/FFT/Winograd convolutions), and of `sums-signs-apart`, the legitimate order
whose partial sums climb highest (what any bound that holds for every order has to cover); for a
convolution's bias gradient, also the worst of SHUFFLES signs-apart sums with each sign's terms shuffled;
‖bound‖₂ ÷ ‖reference‖₂ (compare.CERTIFIABLE_FRACTION: above it the quantity is `inconclusive`); and the
share of the bound that is the quantity's own last sum (its accumulation bound and operand rounding) rather
than error propagated from other layers, at the element closest to its bound under the worst usual order.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from precision_lab import errmodel
from precision_lab.candidates import registry
from precision_lab.compare import bound_fraction
from precision_lab.compute import forward_backward
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.provenance import run_recorded

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = {"seed": ("seed", 128), "small-unet": (MODELS / "small-unet.json", 64),
            "dilated-resnet": (MODELS / "dilated-resnet.yaml", 64), "lenet-classifier": (MODELS / "lenet-classifier.json", 28),
            "tf-lenet": (MODELS / "tf-lenet.json", 128), "wide-classifier": (MODELS / "wide-classifier.json", 128),
            "deep-denoiser": (MODELS / "deep-denoiser.json", 128)}


#: the legitimate order whose partial sums climb highest: reported on its own, as the order any bound that holds
#: for every order has to cover, beside the orders implementations use
ADVERSARIAL = "sums-signs-apart"


def _value(holder, name):
    held = holder.loss if name == "loss" else holder.output if name == "output" else holder.grads[name]
    return np.asarray(held, np.float64)


#: shuffled orders of each sign's terms tried per bias gradient: one order's error is one draw of a sum of thousands
#: of roundings (a one-element bias can sit 100× under its bound in raster order and 10× in another); GPU atomics
#: add in whatever order the threads arrive, so each of these is a legitimate program
SHUFFLES = 64


def shuffled_signs_apart(trace, network, name: str, bound: np.ndarray, seed: int) -> float:
    """The largest error ÷ bound of a conv bias gradient summed signs apart, each sign's terms in SHUFFLES random
    orders: the exact upstream gradient rounded to float32 (what a float32 program at its best holds), then summed
    in float32 (0 where the bias is not a convolution's: a linear layer's sums 2 terms at batch 2)."""
    layer = network.layers[network.index_of(name.rsplit(".", 1)[0])]
    if layer.op != "conv2d":
        return 0.0
    g = trace.grad_at(layer.index).double().cpu().numpy().astype(np.float32)
    exact = np.asarray(trace.grads[name], np.float64).reshape(-1)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for c in range(g.shape[1]):
        terms = g[:, c].reshape(-1)
        total = np.zeros(SHUFFLES, np.float32)
        for part in (terms[terms > 0], terms[terms < 0]):
            if part.size:
                orders = rng.permuted(np.broadcast_to(part, (SHUFFLES, part.size)), axis=1)
                total += np.add.accumulate(orders, axis=1)[:, -1]
        worst = max(worst, float(np.max(np.abs(total.astype(np.float64) - exact[c]) / bound.reshape(-1)[c])))
    return worst


def measure(spec, size: int, seeds: int) -> dict[str, dict]:
    network = load_model(spec)
    orders = [c for c in registry().values() if c.family == "legitimate" and c.claimed_precision == "float32"
              and c.applies_to(network)]
    worst: dict[str, dict] = {}
    for seed in range(seeds):
        problem = make_problem(size, 2, seed, network=network)
        trace = reference(problem)
        bounds = errmodel.error_bounds(trace, "float32")
        runs = {"native": forward_backward(problem, "float32")}
        runs.update({c.name: c.run(problem, "float32", torch.device("cpu")) for c in orders})
        for name in errmodel.quantities(network):
            ref, q = _value(trace, name), bounds[name]
            entry = worst.setdefault(name, {"native": 0.0, "worst": 0.0, "order": "", "fraction": 0.0, "own": 0.0,
                                            "adversarial": 0.0, "shuffled": 0.0})
            if name.endswith(".bias"):
                entry["shuffled"] = max(entry["shuffled"], shuffled_signs_apart(trace, network, name, q.bound, seed))
            for label, run in runs.items():
                ratio = np.abs(_value(run, name) - ref) / q.bound
                top = float(np.max(ratio))
                if label == "native":
                    entry["native"] = max(entry["native"], top)
                if label == ADVERSARIAL:
                    entry["adversarial"] = max(entry["adversarial"], top)
                elif top > entry["worst"]:
                    at = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.ndim else ()
                    # the output's own last rounding is in its sampled draws (errmodel._tighten): only operand rounding is added
                    own_part = q.input_rounding if name == "output" and q.sampled else q.accumulation + q.input_rounding
                    own = np.asarray(own_part, np.float64).reshape(q.bound.shape)
                    entry.update(worst=top, order=label, own=float(own[at] / q.bound[at]))
            entry["fraction"] = max(entry["fraction"], bound_fraction(ref, q.bound))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--networks", default=",".join(NETWORKS))
    args = parser.parse_args()
    print("| network (size) | quantity | headroom, native | headroom, worst usual order (which) "
          f"| own share of that bound | headroom, {ADVERSARIAL} | headroom, signs apart shuffled (worst of {SHUFFLES}) "
          "| ‖bound‖ ÷ ‖quantity‖ (max) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    headroom = lambda ratio: 1 / ratio if ratio > 0 else float("inf")  # noqa: E731
    for label in args.networks.split(","):
        spec, size = NETWORKS[label]
        for name, e in measure(spec, size, args.seeds).items():
            shuffled = f"{headroom(e['shuffled']):.3g}" if e["shuffled"] else "—"
            print(f"| {label} ({size}²) | {name} | {headroom(e['native']):.3g} | {headroom(e['worst']):.3g} ({e['order']}) "
                  f"| {e['own']:.2f} | {headroom(e['adversarial']):.3g} | {shuffled} | {e['fraction']:.3g} |", flush=True)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
