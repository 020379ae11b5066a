"""Sums of repeated values: how far the simulated sequential orders are from every other legitimate one.

    python benchmarks/repeated_values.py [--sizes 128,1024] [--trials 3]

For each family of terms (the shapes a broadcast gradient takes), batch 2 at each size, prints the
largest error of a float32 sum over the candidate's orders (raster, reversed, columns first, signs apart, 8 shuffles,
9 – 100 interleaved lanes, blocks of 100, 256 and 1000, pairwise) and over terms moved by 3 ulps or by
random few-ulp amounts (the
candidate's own values), divided by (a) the simulated worst `roundoff.sequential_drift` and (b) the own
part the lab uses for a bias gradient, max(order-free bound, DRIFT_MARGIN × simulated) where `roundoff.repeats`
says the terms repeat, else the order-free bound (roundoff.order_free_bound: the partial-sum bound plus the
absorbed terms). (a) ≤ DRIFT_MARGIN is what the margin
needs; (b) < 1 is no false alarm.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from precision_lab import roundoff
from precision_lab.provenance import run_recorded

U = 2.0 ** -24


def families(rng, shape):
    n = int(np.prod(shape))
    c = rng.uniform(1, 2) * 10.0 ** rng.uniform(-6, -2)
    mask = rng.random(shape) < 0.5
    normal = rng.standard_normal(shape)
    region = np.zeros(shape, bool)
    region[:, : int(0.3 * shape[1])] = True  # the top rows: a flat background
    return {
        "constant": np.full(shape, c),
        "constant x ReLU mask": np.where(mask, c, 0.0),
        "two values (leaky ReLU)": np.where(mask, c, 0.1 * c),
        "per-image constant": np.broadcast_to(c * rng.uniform(0.5, 2, (shape[0], 1, 1)), shape).copy(),
        "near-constant 1e-5": c * (1 + 1e-5 * normal),
        "near-constant 1e-3": c * (1 + 1e-3 * normal),
        "coherent normal mu/sigma 10": c * (10 + normal),
        "coherent normal mu/sigma 100": c * (100 + normal),
        "normal": c * normal,
        "30% flat region, rest normal": np.where(region, c, c * normal),
        "30% near-constant 1e-6, rest normal": np.where(region, c * (1 + 1e-6 * normal), c * normal),
    }


def candidate_sums(x32: np.ndarray) -> list[float]:
    flat = x32.reshape(-1)
    n = flat.size
    sums = [np.add.accumulate(flat)[-1], np.add.accumulate(flat[::-1])[-1],
            np.add.accumulate(np.swapaxes(x32, -1, -2).reshape(-1))[-1]]
    zero = np.float32(0)
    sums.append(np.add.accumulate(np.where(flat > 0, flat, zero))[-1] + np.add.accumulate(np.where(flat < 0, flat, zero))[-1])
    for seed in range(8):
        sums.append(np.add.accumulate(flat[np.random.default_rng(seed).permutation(n)])[-1])
    for lanes in (9, 10, 11, 13, 24, 48, 96, 100):
        padded = np.concatenate([flat, np.zeros(-n % lanes, np.float32)]).reshape(-1, lanes)
        sums.append(np.add.accumulate(np.add.accumulate(padded, axis=0)[-1])[-1])
    for block in (100, 256, 1000):
        blocks = np.concatenate([flat, np.zeros(-n % block, np.float32)]).reshape(-1, block)
        sums.append(np.add.accumulate(np.add.accumulate(blocks, axis=1)[:, -1])[-1])
    level = flat
    while level.size > 1:
        level = np.concatenate([level, np.zeros(level.size % 2, np.float32)])
        level = level[0::2] + level[1::2]
    sums.append(level[0])
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,1024")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for size in (int(s) for s in args.sizes.split(",")):
        shape = (2, size, size)
        n = int(np.prod(shape))
        print(f"\n{n} terms (batch 2, {size}²): worst candidate error ÷ simulated | ÷ own part | own part ÷ γ̃ₙ(λ)·S")
        rows = {}
        for trial in range(args.trials):
            for name, x in families(rng, shape).items():
                x32 = x.astype(np.float32)
                drift = float(roundoff.sequential_drift(torch.from_numpy(x32)[None])[0])
                S = float(np.abs(x32.astype(np.float64)).sum())
                # a bias gradient's own part: only summation orders compute it (roundoff.order_free_bound)
                column = torch.from_numpy(x32.astype(np.float64).reshape(-1, 1))
                own = float(roundoff.order_free_bound(column, (column != 0).sum(0), U)[0])
                if roundoff.repeats(torch.from_numpy(x32), n):  # the lab simulates only what repeats
                    own = max(own, roundoff.DRIFT_MARGIN * drift)
                worst = 0.0
                three_up = np.nextafter(np.nextafter(np.nextafter(x32, np.inf), np.inf), np.inf)
                for values in (x32, np.where(x32 == 0, x32, three_up),
                               (x * (1 + 2 * U * rng.standard_normal(shape))).astype(np.float32)):
                    exact = values.astype(np.float64).sum()
                    worst = max(worst, max(abs(float(s) - exact) for s in candidate_sums(values)))
                a, b, c = worst / drift if drift else float("nan"), worst / own, own / (roundoff.probabilistic_gamma(n, U) * S)
                old = rows.get(name, (0.0, 0.0, 0.0))
                rows[name] = (max(old[0], a), max(old[1], b), max(old[2], c))
        for name, (a, b, c) in rows.items():
            print(f"  {name:32s} {a:8.3f} | {b:8.3f} | {c:8.2f}")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
