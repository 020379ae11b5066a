"""Seconds per layer of a whole diagnosis of torchvision's models: the cost grows with depth, and how fast.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/zoo_scale.py [--models resnet18,regnet_x_400mf,mobilenet_v2]
        [--size 64] [--batch 2] [--seed 0] [--candidate builtin:native] [--record]

Each model is read through the `module` form of a model ({"module": "torchvision.models:NAME", "arguments":
{"num_classes": 10}, "loss": "cross_entropy"}, training mode), then `precision-lab diagnose` runs on it, probes
included, in a process of its own; the wall time covers everything a user waits for (start, conversion, the
candidate's runs, the float64 references, the bounds, the probes). With `--candidate command`, the candidate is
torchvision's module itself through precision_lab.protocol (examples/torchvision/candidate.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from precision_lab.provenance import run_recorded

ROOT = Path(__file__).resolve().parents[1]


def _candidate(folder: Path, model: str, spec: Path, kind: str) -> list[str]:
    if kind != "command":
        return ["--candidate", kind, "--model", str(spec)]
    example = ROOT / "examples" / "torchvision" / "candidate.py"
    yaml = folder / f"{model}.yaml"
    yaml.write_text(f"name: torchvision-{model}\nmodel: {spec}\nprecision: float32\nweight_layout: OIHW\n"
                    f"command: [\"{{python}}\", {example}, \"{{request}}\", \"{{response}}\", --model, {model}]\n"
                    f"command_float64: [\"{{python}}\", {example}, \"{{request}}\", \"{{response}}\", --model, {model}]\n"
                    f"timeout_s: 900\n")
    return ["--candidate", str(yaml)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,regnet_x_400mf,mobilenet_v2")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidate", default="builtin:native", help="builtin:NAME, or 'command' for the module itself")
    args = parser.parse_args()
    print(f"diagnose at {args.size}², batch {args.batch}, seed {args.seed}, candidate {args.candidate}, probes default")
    print(f"{'model':<22}{'layers':>7}{'seconds':>9}{'s/layer':>9}  verdict")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for model in args.models.split(","):
            spec = folder / f"{model}.json"
            spec.write_text(json.dumps({"module": f"torchvision.models:{model}", "arguments": {"num_classes": 10},
                                        "loss": "cross_entropy", "name": model}))
            from precision_lab.model import load_model

            layers = len(load_model(spec).layers)
            out = folder / f"{model}-verdict.json"
            clock = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "precision_lab.cli", "diagnose",
                                   *_candidate(folder, model, spec, args.candidate), "--size", str(args.size),
                                   "--batch", str(args.batch), "--seed", str(args.seed), "--json", str(out)],
                                  capture_output=True, text=True, cwd=ROOT)
            seconds = time.perf_counter() - clock
            verdict = json.loads(out.read_text())["verdict"] if out.is_file() else done.stderr.strip()[-120:]
            print(f"{model:<22}{layers:>7}{seconds:>9.1f}{seconds / layers:>9.3f}  {verdict}", flush=True)


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
