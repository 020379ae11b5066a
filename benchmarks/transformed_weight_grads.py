"""Winograd's and FFT's own weight-gradient error on the 3×3 layers of the example networks, against the bounds.

    python benchmarks/transformed_weight_grads.py [--seeds 1,3]

Each 3×3 stride-1 padding-1 convolution's weight gradient is computed from the float64 reference's input and
output gradient, rounded to float32, by the lab's Winograd F(4,3) and F(2,3) and FFT algorithms; the error
against the exact weight gradient is the algorithm's own (nothing upstream). Printed per layer, the largest
over the seeds of:

* error ÷ γ̃ₙ(λ)·S, the direct sum's own bound: above 1 where a lag has few or no terms of its own (an edge
  tap the gradient never reaches) but still receives the transform's roundings;
* error ÷ λ·winograd_weight_grad_scale, the Winograd part of the own bound (precision_lab.conv.winograd_bound);
* error ÷ a norm-wise FFT bound, (2ε + γ̃_N(λ) + γ̃_B(λ) + 4u)·Σ_images ‖x‖₂‖g‖₂ per channel pair: each 2-D
  transform's error ε from Higham (2002), Thm 24.2 (log₂n·(u + γ₄(√2 + u)) per axis, a radix-p stage counted
  with γ_(p+2)), reaching a lag through Cauchy–Schwarz and Parseval, the N-frequency and batch sums at
  γ̃(λ) (Higham & Mary 2019); and that bound ÷ γ̃ₙ(λ)·S at the median element (how much it would loosen).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from precision_lab import roundoff
from precision_lab.conv.algorithms import FFTConv, WinogradConv
from precision_lab.conv.winograd_bound import winograd_weight_grad_scale
from precision_lab.model import load_model
from precision_lab.ops import is_seed_conv
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.provenance import run_recorded

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
NETWORKS = (("seed", 128), (MODELS / "small-unet.json", 32), (MODELS / "small-unet.json", 64),
            (MODELS / "deep-denoiser.json", 64))
U, LAM = 2.0 ** -24, roundoff.LAMBDA


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def fft_norm_bound(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(O, C, 3, 3): the norm-wise bound on an FFT weight gradient's own error (module docstring)."""
    batch, _, height, width = x.shape
    grid = (height + 2, width + 2)
    axis = [sum(U + roundoff.gamma(p + 2, U) * (2 ** 0.5 + U) for p in _prime_factors(n)) for n in grid]
    transform = (1 + axis[0]) * (1 + axis[1]) - 1
    factor = (2 * transform + roundoff.probabilistic_gamma(grid[0] * grid[1], U, LAM)
              + roundoff.probabilistic_gamma(batch, U, LAM) + 4 * U)
    pairs = factor * (g.flatten(2).norm(dim=2).T @ x.flatten(2).norm(dim=2))
    return pairs[:, :, None, None].expand(-1, -1, 3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,3")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| network (size) | layer | F(4,3) ÷ γ̃ₙ(λ)·S | FFT ÷ γ̃ₙ(λ)·S | F(4,3), F(2,3) ÷ λ·Winograd scale "
          "| FFT ÷ norm bound | norm bound ÷ γ̃ₙ(λ)·S (median) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec, size in NETWORKS:
        network = load_model(spec)
        worst: dict[str, list[float]] = {}
        for seed in seeds:
            trace = reference(make_problem(size, 2, seed, network=network))
            for index, layer in enumerate(network.layers):
                if layer.op != "conv2d" or not is_seed_conv(layer.attrs):
                    continue
                x, g = trace.value(layer.inputs[0]).double(), trace.grad_at(index).double()
                shape = tuple(trace.params[f"{layer.name}.weight"].shape)
                exact = torch.nn.grad.conv2d_weight(x, shape, g, padding=1)
                direct = roundoff.probabilistic_gamma(x.shape[0] * x.shape[2] * x.shape[3], U, LAM) * \
                    torch.nn.grad.conv2d_weight(x.abs(), shape, g.abs(), padding=1)
                winograd = LAM * winograd_weight_grad_scale(x, g, U)
                norm = fft_norm_bound(x, g)
                errors = {name: (alg.weight_grad(x.float(), g.float()).double() - exact).abs()
                          for name, alg in (("f4", WinogradConv(4)), ("f2", WinogradConv(2)), ("fft", FFTConv()))}
                live, alive = direct > 0, norm > 0
                row = [float((errors["f4"][live] / direct[live]).max()), float((errors["fft"][live] / direct[live]).max()),
                       max(float((errors[k][winograd > 0] / winograd[winograd > 0]).max()) for k in ("f4", "f2")),
                       float((errors["fft"][alive] / norm[alive]).max()), float((norm[live] / direct[live]).median())]
                previous = worst.get(layer.name)
                worst[layer.name] = row if previous is None else [max(a, b) for a, b in zip(previous, row)]
        for name, (f4, fft, wino, fft_norm, loosen) in worst.items():
            print(f"| {network.name} ({size}²) | {name} | {f4:.3g} | {fft:.3g} | {wino:.3f} | {fft_norm:.4f} | {loosen:.1f} |")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
