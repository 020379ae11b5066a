"""`precision-lab diagnose`: judge one candidate against the float64 reference.

    precision-lab diagnose --candidate builtin:NAME | NAME | FILE.yaml
    precision-lab diagnose --bundle DIR            (a static bundle carries its own problem)
        [--size S] [--batch B] [--seed K] [--device D] [--json OUT]

Prints the verdict with its evidence; exit 0 for ``roundoff``, 1 for any other verdict, 2 for
bad input or a failing candidate (one line on stderr, from the CLI).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .candidates import Candidate, resolve
from .candidates.command import CommandProgram
from .device import resolve_device
from .errmodel import attach_parameters
from .errors import LabInputError
from .problem import Problem, Result, Trace, make_problem
from .reference import reference
from .verdict import Judgement, judge

#: the seed scale (DESIGN.md): 1024×1024, batch 2
DEFAULT_SIZE, DEFAULT_BATCH, DEFAULT_SEED = 1024, 2, 0


def configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--candidate", help="builtin:NAME, NAME, or a command candidate FILE.yaml")
    source.add_argument("--bundle", help="a static bundle directory (bundle.json + arrays)")
    parser.add_argument("--size", type=int, default=None, help=f"image size (default {DEFAULT_SIZE}; bundles bring their own)")
    parser.add_argument("--batch", type=int, default=None, help=f"batch size (default {DEFAULT_BATCH})")
    parser.add_argument("--seed", type=int, default=None, help=f"problem seed (default {DEFAULT_SEED})")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    parser.add_argument("--json", metavar="OUT", help="write the verdict as JSON to this file")
    parser.add_argument("--max-calls", type=int, default=None, metavar="N",
                        help="opaque candidates: program calls the gradient check may make (default max(60, 20 + 4·tensors))")


def candidate_and_problem(candidate_spec: str | None, bundle: str | None, size: int | None, batch: int | None,
                          seed: int | None) -> tuple[Candidate, Problem]:
    """Resolve the candidate and the problem it is judged on (a static bundle's own, else the seed's)."""
    if bundle is not None:
        if not Path(bundle).is_dir():
            raise LabInputError(f"{bundle}: --bundle expects a directory holding bundle.json and arrays.npz")
        candidate = resolve(str(bundle))
        if size is not None or batch is not None or seed is not None:
            print(f"note: {bundle} carries its own problem; --size/--batch/--seed are ignored", file=sys.stderr)
        return candidate, candidate.problem
    candidate = resolve(candidate_spec)
    own = getattr(candidate, "problem", None)
    if own is not None:
        return candidate, own
    return candidate, make_problem(size if size is not None else DEFAULT_SIZE,
                                   batch if batch is not None else DEFAULT_BATCH,
                                   seed if seed is not None else DEFAULT_SEED)


def diagnose(candidate: Candidate, problem: Problem, device: str = "auto") -> Judgement:
    """Run `candidate` on `problem` as claimed, build the float64 reference, and judge."""
    where = resolve_device(device)
    if not candidate.supports(where):
        raise LabInputError(f"candidate {candidate.name} runs on {', '.join(candidate.devices)} only, not {where}")
    program = getattr(candidate.run, "__self__", None)  # a command candidate's run is CommandProgram.run
    if isinstance(program, CommandProgram):
        result, trace = _overlapped(candidate, program, problem, where)
    else:  # in-process candidates first: their transients never meet the reference's
        result = candidate.compute(problem, "float32", where)
        trace = reference(problem, where)
    return judge(result, attach_parameters(trace, problem.params), candidate.claimed_precision, candidate.name)


def _overlapped(candidate: Candidate, program: CommandProgram, problem: Problem, where) -> tuple[Result, Trace]:
    """An external program runs in its own process while this one builds the float64 reference.

    Its wait happens in a thread (the GIL is released while waiting); the error bounds, the
    memory peak of a diagnosis, come after it has exited. Anything that stops the reference
    (Ctrl-C, an error) kills the program first, so nothing is left running.
    """
    program.allow_calls()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="candidate") as pool:
        running = pool.submit(candidate.compute, problem, "float32", where)
        try:
            trace = reference(problem, where)
            return running.result(), trace
        except BaseException:
            program.cancel()
            raise


def main(args: argparse.Namespace) -> int:
    if args.candidate is not None:  # `model: opaque`: the reference-free gradient check instead
        from .candidates.opaque import OpaqueCandidate, run_diagnose

        opaque = resolve(args.candidate)
        if isinstance(opaque, OpaqueCandidate):
            return run_diagnose(opaque, args)
    candidate, problem = candidate_and_problem(args.candidate, args.bundle, args.size, args.batch, args.seed)
    judgement = diagnose(candidate, problem, args.device)
    print(f"problem: {problem.size}×{problem.size}, batch {problem.batch}, seed {problem.seed}, {problem.source}")
    print(judgement.to_text())
    if args.json:
        out = Path(args.json)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(judgement.to_json(), indent=1) + "\n")
        except OSError as exc:
            raise LabInputError(f"{out}: cannot write the JSON verdict ({exc.strerror})") from None
    return 0 if judgement.verdict == "roundoff" else 1
