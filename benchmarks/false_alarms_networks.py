"""False alarms on the example networks: every legitimate order of the zoo judged on many seeds.

    python benchmarks/false_alarms_networks.py SPEC SIZE [--seeds 100] [--first 0] [--batch 2] [--probes]
        [--no-fingerprint] [--candidates NAME,NAME]

Each seed's problem gets its float64 reference and bounds (sampled where precision_lab.sampled applies);
every legitimate zoo candidate that applies to the network is judged as `diagnose` judges one problem
(hypotheses off: they only name a defect's cause; `--no-fingerprint`: the bound and its certification
only, the part the propagation model decides; `--candidates`: only these legitimate ones). `--probes`: each seed's default probes too, and
the requested problem's quantities its bound cannot certify settled by them as diagnose settles them. Prints the count of verdicts
other than `roundoff` (`inconclusive` allowed for the honest TF32 claim: Candidate.accepts) per candidate, the largest error ÷ bound and the largest ‖bound‖ ÷ ‖quantity‖.
"""
from __future__ import annotations

import argparse
import time

import torch

from precision_lab import probes as probe_set
from precision_lab.candidates import registry
from precision_lab.model import load_model
from precision_lab.problem import make_problem
from precision_lab.reference import reference
from precision_lab.decision import decide
from precision_lab.verdict import judge
from precision_lab.compare import bound_fraction
from precision_lab.provenance import run_recorded
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("size")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--probes", action="store_true")
    parser.add_argument("--no-fingerprint", action="store_true")
    parser.add_argument("--candidates", default="", help="comma-separated legitimate candidates (default: all)")
    args = parser.parse_args()
    network = load_model(args.spec)
    candidates = [c for c in registry().values() if c.family == "legitimate" and c.applies_to(network)]
    if args.candidates:
        wanted = args.candidates.split(",")
        unknown = sorted(set(wanted) - {c.name for c in candidates})
        if unknown:
            parser.error(f"not a legitimate candidate that applies to {args.spec}: {', '.join(unknown)}")
        candidates = [c for c in candidates if c.name in wanted]
    alarms, by_name = {c.name: 0 for c in candidates}, {c.name: c for c in candidates}
    worst_ratio, worst_fraction, start = 0.0, 0.0, time.time()
    for seed in range(args.first, args.first + args.seeds):
        main = make_problem(args.size, args.batch, seed, network=network)
        problems = [main] + ([probe_set.probe_problem(p, main) for p in probe_set.DEFAULT_PROBES] if args.probes else [])
        judged = {c.name: [] for c in candidates}
        for problem in problems:
            trace = reference(problem)
            for candidate in candidates:
                result = candidate.run(problem, "float32", torch.device("cpu"))
                judgement = judge(result, trace, candidate.claimed_precision, candidate.name, hypotheses=False,
                                  fingerprint=False if args.no_fingerprint else None)
                judged[candidate.name].append(judgement)
                worst_ratio = max(worst_ratio, max(q.bound_ratio for q in judgement.quantities.values()))
            bounds = trace.meta["error_bounds"][("float32", 7.0)]
            for name, q in bounds.items():
                ref = np.asarray(trace.loss if name == "loss" else trace.output if name == "output" else trace.grads[name])
                worst_fraction = max(worst_fraction, bound_fraction(np.asarray(ref, np.float64), q.bound))
        for name, judgements in judged.items():
            # what the requested problem's bound cannot certify, every probe may (as diagnose settles it)
            decided = decide(judgements[0], [(probe_set.ProbeRun.of(p, problem), j) for p, problem, j
                                             in zip(probe_set.DEFAULT_PROBES, problems[1:], judgements[1:])])
            for problem, (_, judgement) in zip(problems, decided.problems()):
                if not by_name[name].accepts(judgement.verdict):  # an honest TF32 claim may be inconclusive
                    alarms[name] += 1
                    print(f"seed {seed} {problem.size_text} {name}: {judgement.headline()}", flush=True)
        print(f"seed {seed} done: non-roundoff so far {sum(alarms.values())}, largest error ÷ bound {worst_ratio:.3g}",
              flush=True)
    runs = len(candidates) * args.seeds * (1 + (len(probe_set.DEFAULT_PROBES) if args.probes else 0))
    print(f"{args.spec} {args.size} seeds {args.first}–{args.first + args.seeds - 1}: {len(candidates)} legitimate "
          f"orders, non-roundoff {sum(alarms.values())} of {runs} judged "
          f"({', '.join(f'{k} {v}' for k, v in alarms.items() if v) or 'none'}); largest error ÷ bound {worst_ratio:.3g}; "
          f"largest float32 ‖bound‖ ÷ ‖quantity‖ {worst_fraction:.3g}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    run_recorded(__doc__.strip().splitlines()[0].rstrip('.'), main)
