"""Sensitivity of the verdict to a single-element slip, and the zoo's confusion matrix.

    python benchmarks/sensitivity.py [--sizes 128 1024] [--confusion-size 128] [--device cpu]

For each size: the smallest relative perturbation ε (quarter-decade grid, 1e-5 … 1) of one
weight-gradient element that the verdict catches on a legitimate float32 result (PyTorch
native), for the element of largest |g| and as the median over all elements (from the
per-element threshold (bound − error)/|g|, the same test without the grid); the full
`judge` is re-run at the reported ε to confirm a `defect` verdict. Then every legitimate
variant's worst error ÷ bound at that size (a false alarm would be > 1). Goal (issue 3): 0.1%
or smaller caught with no false alarm. Finally the confusion matrix of the whole zoo.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from precision_lab.candidates import registry
from precision_lab.candidates.zoo import confusion_matrix, judge_zoo
from precision_lab.device import resolve_device
from precision_lab.errmodel import attach_parameters, error_bounds
from precision_lab.problem import WEIGHT_NAMES, Result, make_problem
from precision_lab.reference import reference
from precision_lab.verdict import judge, single_element_sensitivity


def sensitivity_table(size: int, batch: int, seed: int, device) -> pd.DataFrame:
    problem = make_problem(size, batch, seed)
    trace = attach_parameters(reference(problem, device), problem.params)
    native = registry()["native"].compute(problem, "float32", device)
    bounds = error_bounds(trace, "float32")
    rows = []
    for name in WEIGHT_NAMES:
        level, index = single_element_sensitivity(native, trace, name)
        confirmed = None
        if level is not None:
            grads = dict(native.grads)
            slipped = grads[name].astype(np.float64).copy()
            slipped[index] *= 1 + level
            grads[name] = slipped
            confirmed = judge(Result(native.loss, grads, native.output), trace).verdict
        ref = np.asarray(trace.grads[name], np.float64)
        slack = bounds[name].bound - np.abs(np.asarray(native.grads[name], np.float64) - ref)
        threshold = slack / np.maximum(np.abs(ref), np.finfo(float).tiny)
        rows.append({"size": size, "quantity": name, "largest_element_caught": level, "verdict_at_that_slip": confirmed,
                     "median_element_threshold": float(np.median(threshold)),
                     "best_element_threshold": float(np.min(threshold))})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--confusion-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = resolve_device(args.device)
    pd.set_option("display.width", 200)
    for size in args.sizes:
        start = time.time()
        print(f"\n== sensitivity at {size}×{size}, batch {args.batch} ==")
        print(sensitivity_table(size, args.batch, args.seed, device).to_string(index=False))
        print(f"({time.time() - start:.0f} s)")
    start = time.time()
    table = judge_zoo(make_problem(args.confusion_size, args.batch, args.seed), device)
    print(f"\n== zoo at {args.confusion_size}×{args.confusion_size}: worst error ÷ bound per candidate ==")
    print(table[["candidate", "family", "expected", "expected_detail", "verdict", "detail", "correct",
                 "worst_ratio"]].to_string(index=False))
    legit = table[table.family == "legitimate"]
    print(f"\nlegitimate variants: worst error ÷ bound {legit.worst_ratio.max():.3g} "
          f"({'no false alarm' if (legit.verdict == 'roundoff').all() else 'FALSE ALARM'})")
    print(f"\n== confusion matrix (rows expected, columns given), {len(table)} candidates, "
          f"{int(table.correct.sum())} correct including the named transform/format ==")
    print(confusion_matrix(table).to_string())
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
