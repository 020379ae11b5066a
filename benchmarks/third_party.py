"""Real frameworks on every example network: verdicts a user of JAX or TensorFlow would get.

    python benchmarks/third_party.py [--frameworks jax,tensorflow] [--seeds 5] [--slip-seeds 3]
        [--python tensorflow=PATH] [--networks tf-lenet,small-unet]

benchmarks/frameworks/ holds one JAX and one TensorFlow program that compute any model spec as their users
write it (JAX: lax.conv_general_dilated, reduce_window, jax.nn, NCHW/OIHW; TensorFlow: tf.nn with NHWC/HWIO
and (in, out) dense kernels, tf.GradientTape). Each is diagnosed (`precision-lab diagnose`, default probes)
on every example network at a size it takes, right (`--seeds` seeds: every verdict should be `roundoff`)
and with bugs a port makes planted (`--slip-seeds` seeds: each should be `defect` with its cause named):
a layer off the tape, a flatten in (H, W, C) order, GELU's tanh approximation for the exact one, a concat
in the other order, a leaky ReLU with TensorFlow's default slope; and bfloat16 operands left on while
claiming float32, which should be `reduced-precision (bfloat16)`. `--python FRAMEWORK=PATH`: the interpreter
that framework's program runs in (default: this one; TensorFlow is not a dependency of the lab). Prints one line per
diagnosis and the counts; exit status 1 if any verdict is not the expected one.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from precision_lab.provenance import run_recorded

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "frameworks"
MODELS = ROOT / "examples" / "models"
#: each example network at a size it takes (the classifiers' flatten fixes theirs), small enough for 5 diagnoses a
#: minute on 2 cores
NETWORKS = {"tf-lenet": ("tf-lenet.json", 128), "wide-classifier": ("wide-classifier.json", 128),
            "lenet-classifier": ("lenet-classifier.json", 28), "small-unet": ("small-unet.json", 32),
            "dilated-resnet": ("dilated-resnet.yaml", 32), "deep-denoiser": ("deep-denoiser.json", 32)}
FRAMEWORKS = {
    "jax": {"program": "jax_spec.py", "module": "jax", "weight_layout": "OIHW",
            "env": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}},
    "tensorflow": {"program": "tensorflow_spec.py", "module": "tensorflow", "weight_layout": "HWIO",
                   "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "TF_NUM_INTRAOP_THREADS": "1",
                           "TF_NUM_INTEROP_THREADS": "1"}},
}
#: (framework, --slip argument, network, what the verdict must name: a cause, or "reduced-precision (FORMAT)")
SLIPS = [
    ("tensorflow", "no-grad:conv1", "tf-lenet", "conv1 received no gradient"),
    ("tensorflow", "no-grad:conv1", "wide-classifier", "conv1 received no gradient"),
    ("tensorflow", "no-grad:enc1", "small-unet", "enc1 received no gradient"),
    ("tensorflow", "flatten-hwc", "tf-lenet", "flattens in (H, W, C) order"),
    ("tensorflow", "flatten-hwc", "lenet-classifier", "flattens in (H, W, C) order"),
    ("tensorflow", "leaky-default", "small-unet", "slope of 0.2 (tf.nn.leaky_relu's default)"),
    ("jax", "gelu-tanh", "dilated-resnet", "GELU's tanh approximation"),
    ("jax", "concat-swapped", "small-unet", "joins the skip from"),
    ("jax", "no-grad:stem", "dilated-resnet", "stem received no gradient"),
    ("jax", "bf16-operands", "small-unet", "reduced-precision (bfloat16)"),
    ("jax", "bf16-operands", "lenet-classifier", "reduced-precision (bfloat16)"),
    ("jax", "bf16-operands", "dilated-resnet", "reduced-precision (bfloat16)"),
]


def candidate_yaml(directory: Path, framework: str, network: str, python: str, slip: str = "") -> Path:
    settings, (model, _) = FRAMEWORKS[framework], NETWORKS[network]
    command = [python, str(PROGRAMS / settings["program"]), "{request}", "{response}"] + (["--slip", slip] if slip else [])
    spec = {"name": f"{framework}-{network}" + (f"-{slip.replace(':', '-')}" if slip else ""),
            "model": str(MODELS / model), "command": command, "precision": "float32",
            "weight_layout": settings["weight_layout"], "timeout_s": 300,
            "env": {**settings["env"], "PYTHONPATH": str(ROOT)}}
    path = directory / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def diagnose(path: Path, network: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "verdict.json"
        subprocess.run([sys.executable, "-m", "precision_lab.cli", "diagnose", "--candidate", str(path), "--size",
                        str(NETWORKS[network][1]), "--seed", str(seed), "--json", str(out)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if not out.exists():
            return {"verdict": "error", "cause": None}
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="jax,tensorflow")
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--slip-seeds", type=int, default=3)
    parser.add_argument("--python", action="append", default=[], metavar="FRAMEWORK=PATH",
                        help="the interpreter one framework's program runs in (default: this one)")
    args = parser.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]
    networks = [n for n in args.networks.split(",") if n]
    pythons = dict(item.split("=", 1) for item in args.python if "=" in item)
    unknown = sorted(set(pythons) - set(FRAMEWORKS)) + [item for item in args.python if "=" not in item]
    if unknown:
        parser.error(f"--python {', '.join(unknown)}: expected FRAMEWORK=PATH with FRAMEWORK one of {', '.join(FRAMEWORKS)}")
    missing = [f for f in frameworks if f not in pythons and importlib.util.find_spec(FRAMEWORKS[f]["module"]) is None]
    if missing:
        parser.error(f"{', '.join(missing)} not importable here: install it, or give --python {missing[0]}=PATH, "
                     "an interpreter that has it")
    start, wrong, total = time.time(), 0, 0
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        runs = [(f, "", n, None, args.seeds) for f in frameworks for n in networks]
        runs += [(f, slip, n, cause, args.slip_seeds) for f, slip, n, cause in SLIPS if f in frameworks and n in networks]
        for framework, slip, network, cause, seeds in runs:
            path = candidate_yaml(directory, framework, network, pythons.get(framework, sys.executable), slip)
            for seed in range(seeds):
                verdict = diagnose(path, network, seed)
                named = verdict.get("cause") or verdict.get("layout_fix") or verdict.get("format") or ""
                if cause is None:
                    right = verdict["verdict"] == "roundoff"
                elif cause.startswith("reduced-precision"):
                    right = f"{verdict['verdict']} ({named})" == cause
                else:
                    right = verdict["verdict"] == "defect" and cause in named
                total += 1
                wrong += not right
                print(f"{framework:10s} {slip or 'right':15s} {network:16s} seed {seed}: {verdict['verdict']}"
                      f"{f' ({named})' if named else ''}{'' if right else '   <-- not as expected'}", flush=True)
    print(f"{total - wrong} of {total} diagnoses as expected; {time.time() - start:.0f} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main))
