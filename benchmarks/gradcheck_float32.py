"""What the reference-free gradient check resolves on float32-only programs, and with a float64 build.

    nice .venv/bin/python benchmarks/gradcheck_float32.py [--seeds 0,1,2] [--kinds kan,relu-conv] [--csv OUT]
        [--max-calls N]

For each kind of program (precision_lab.experiments.gradient_check.FLOAT32_KINDS: the example KAN,
smooth and clamped, a tanh MLP, a batch-normalisation net, the example ReLU conv net with and without
max-pool, ReLU MLPs of 3 and 5 layers, a PyTorch CNN), at each seed: the check on the right program and on
the program with each tensor's gradient 1% too large, once with the float32 build alone and once with the same code in float64 as
the float64 build. Prints one row per kind and build (docs/external.md §5 quotes it).
"""
import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from precision_lab.experiments.gradient_check import FLOAT32_KINDS, float32_resolution, resolution_table  # noqa: E402
from precision_lab.provenance import run_recorded  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--kinds", default=",".join(FLOAT32_KINDS))
    parser.add_argument("--builds", default="float32,float64", help="float32 (alone), float64 (with a float64 build)")
    parser.add_argument("--csv", help="write every check's row here")
    parser.add_argument("--max-calls", type=int, help="the call budget of each check (default: the check's own)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds = args.kinds.split(",")
    rows = pd.concat([float32_resolution(kinds, seeds, with_float64=(build == "float64"), max_calls=args.max_calls)
                      for build in args.builds.split(",")], ignore_index=True)
    if args.csv:
        rows.to_csv(args.csv, index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.2g}".format):
        print(resolution_table(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main))
