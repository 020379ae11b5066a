"""`precision-lab diagnose`: judge one candidate against the float64 reference, with probes.

    precision-lab diagnose --candidate builtin:NAME | NAME | FILE.yaml
    precision-lab diagnose --bundle DIR            (a static bundle carries its own problem)
        [--size N|HxW] [--batch B] [--seed K] [--image FILE] [--model SPEC] [--device D] [--probes none|default|LIST]
        [--repeats K] [--json OUT] [--html OUT]

Prints the verdict with its evidence; exit 0 for ``roundoff`` (of the problem and every probe),
1 for any other verdict, 2 for bad input or a failing candidate (one line on stderr, from the CLI).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

# light imports only: `--help` and argument errors answer before torch is imported
from . import options, probes as probe_set
from .errors import LabInputError

if TYPE_CHECKING:
    from .candidates import Candidate
    from .decision import Diagnosis, Float64Build, Spread
    from .verdict import Judgement
    from .compute import Result, Trace
    from .problem import Problem

#: the seed scale (docs/design.md, "The motivating case"): 1024×1024, batch 2
DEFAULT_SIZE, DEFAULT_BATCH, DEFAULT_SEED = 1024, 2, 0


def configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--candidate", help="builtin:NAME, NAME, or a command candidate FILE.yaml")
    source.add_argument("--bundle", help="a static bundle directory (bundle.json + arrays)")
    parser.add_argument("--size", default=None, help=f"image size N or HxW (default {DEFAULT_SIZE}, or the nearest "
                                                     f"the network takes; bundles bring their own)")
    parser.add_argument("--batch", default=None, help=f"batch size (default {DEFAULT_BATCH})")
    parser.add_argument("--seed", default=None, help=f"problem seed (default {DEFAULT_SEED})")
    parser.add_argument("--image", default=None, metavar="FILE",
                        help="a real micrograph (.npy or .mrc) instead of synthetic ones: each sample a centre crop")
    parser.add_argument("--model", default=None, help="model spec (JSON/YAML file, an exported .onnx, or 'seed') "
                                                      "for built-in candidates; a candidate YAML names its own")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    parser.add_argument("--probes", default="default",
                        help=f"none, default, or a comma-separated list of {', '.join(probe_set.PROBES)}")
    parser.add_argument("--repeats", default="1", help="run the candidate K times on the problem and report the "
                                                       "run-to-run spread (default 1)")
    parser.add_argument("--json", metavar="OUT", help="write the verdict as JSON to this file")
    parser.add_argument("--max-calls", type=int, default=None, metavar="N",
                        help="opaque candidates: program calls the gradient check may make (default max(60, 20 + 4·tensors))")
    parser.add_argument("--html", metavar="OUT", help="write the verdict as a self-contained HTML page to this file")
    parser.add_argument("--verbose", action="store_true",
                        help="print every quantity's evidence on every problem (default: the summary and what fails)")


def candidate_and_problem(candidate_spec: str | None, bundle: str | None, size=None, batch=None, seed=None,
                          model=None, image=None, device=None) -> tuple[Candidate, Problem]:
    """Resolve the candidate and the problem it is judged on (a static bundle's own, else one made here).

    With `device`, a problem too large for the memory free there is refused before it is allocated."""
    from . import resources
    from .candidates import resolve
    from .device import resolve_device
    from .model import ModelSpecError, load_model
    from .problem import make_problem

    if bundle is not None:
        if not Path(bundle).is_dir():
            raise LabInputError(f"{bundle}: --bundle expects a directory holding bundle.json and arrays.npz")
        candidate = resolve(str(bundle))
        if size is not None or batch is not None or seed is not None or model is not None or image is not None:
            print(f"note: {bundle} carries its own problem; --size/--batch/--seed/--image/--model are ignored", file=sys.stderr)
        return candidate, candidate.problem
    candidate = resolve(candidate_spec)
    own = getattr(candidate, "problem", None)
    if own is not None:
        return candidate, own
    network = candidate.network
    if model is not None:
        try:
            asked = load_model(model)
        except ModelSpecError as exc:
            raise LabInputError(f"--model: {exc}") from None
        if network is not None and asked.spec != network.spec:
            raise LabInputError(f"--model: candidate {candidate.name} names its own model {network.name!r}; "
                                f"drop --model or change the candidate's YAML")
        network = asked
    network = network or load_model(None)
    height, width = size if size is not None else network.default_size(DEFAULT_SIZE)
    if device is not None:
        resources.check_fits(network, batch if batch is not None else DEFAULT_BATCH, height, width,
                             resolve_device(str(device)))
    problem = make_problem((height, width), batch if batch is not None else DEFAULT_BATCH,
                           seed if seed is not None else DEFAULT_SEED, image=image, network=network)
    if not candidate.applies_to(network):
        raise LabInputError(f"candidate {candidate.name} does not apply to the network {network.name!r} "
                            f"({candidate.description})")
    return candidate, problem


def diagnose(candidate: Candidate, problem: Problem, device: str = "auto", probes=None, repeats: int = 1,
             fingerprint: bool | None = None, progress: bool = False) -> Diagnosis:
    """Run `candidate` on `problem` as claimed (and on each probe), build the float64 references, and judge;
    the verdict is precision_lab.decision.decide's, from all of that evidence.

    `probes`: a list of precision_lab.probes.Probe (None: the defaults; [] for none).
    """
    from . import resources
    from .decision import decide
    from .device import resolve_device
    from .verdict import judge

    where = resolve_device(device)
    if not candidate.supports(where):
        raise LabInputError(f"candidate {candidate.name} runs on {', '.join(candidate.devices)} only, not {where}")
    resources.check_fits(problem.network, problem.batch, problem.height, problem.width, where)
    chosen = probe_set.select("default") if probes is None else probes
    if getattr(candidate, "problem", None) is not None:
        chosen = []  # a static bundle holds the answer to its own problem only: nothing to probe
    bar = _bar(1 + len(chosen) + max(0, repeats - 1), progress)
    beside = calls_at_once(candidate, where) > 1
    with _programs(candidate, calls=calls_at_once(candidate, where)) as programs:
        started = _start(candidate, problem, where, programs, beside) if programs is not None else None
        probe_problems = queued = None
        if programs is not None and repeats == 1:
            # the probes' calls queue behind the problem's build(s), each starting as a call ends, and run while the
            # lab builds references and bounds: two at once where the two builds run at once, else one after another
            # (with --repeats the repeated runs come first)
            probe_problems = [probe_set.probe_problem(probe, problem) for probe in chosen]
            queued = [programs.submit(_after, started[0], candidate.compute, probe_problem, "float32", where)
                      for probe_problem in probe_problems]
        result, trace, build64 = _run(candidate, problem, where, programs, started=started)
        bar.update()
        spread = _repeats(candidate, problem, where, trace, result, repeats, bar) if repeats > 1 else None
        with _leaving(programs):
            main = judge(result, trace, candidate.claimed_precision, candidate.name, fingerprint=fingerprint)
        # the probes while a float64 build may still run
        judged = judge_probes(candidate, problem, where, chosen, bar=bar, programs=programs,
                              problems=probe_problems, queued=queued)
        recompiled = None
        if build64 is not None or has_float64_build(candidate, main):
            result64 = None if build64 is None else \
                programs.settled(build64, lambda: candidate.compute(problem, "float64", where))
            with _leaving(programs):
                recompiled = float64_build_evidence(candidate, problem, where, result, trace, result64)
    del trace
    bar.close()
    return decide(main, judged, float64_build=recompiled, spread=spread, probed=bool(chosen) or
                  getattr(candidate, "problem", None) is not None,
                  probe_note=probe_set.fixed_size_note(problem.network, problem) if chosen else None)


def judge_probes(candidate: Candidate, problem: Problem, where, probes, bar=None, reference_of=None,
                 programs=None, problems=None, queued=None) -> list:
    """(ProbeRun, Judgement) of `candidate` on each probe of `problem`; `reference_of(problem, where)` gives a
    probe's float64 reference (a notebook shares them between candidates), else each is built here (beside the
    program's run, with `programs` from _programs; `problems` and `queued`: the probes' problems and their program
    runs already submitted there)."""
    from .verdict import judge

    judged = []
    for k, probe in enumerate(probes):
        probe_problem = problems[k] if problems is not None else probe_set.probe_problem(probe, problem)
        if reference_of is None:
            probe_result, probe_trace, _ = _run(candidate, probe_problem, where, programs,
                                                started=(queued[k], None) if queued is not None else None,
                                                beside=queued is not None and programs.calls > 1)
        else:
            probe_result, probe_trace = candidate.compute(probe_problem, "float32", where), reference_of(probe_problem, where)
        with _leaving(programs):
            judgement = judge(probe_result, probe_trace, candidate.claimed_precision, candidate.name)
        run = probe_set.ProbeRun.of(probe, probe_problem)
        if has_float64_build(candidate, judgement) and any(q.verdict == "inconclusive"
                                                           for q in judgement.quantities.values()):
            # a probe's open quantity is settled, or shown to persist, by the build as the requested problem's is
            # through the program pool where there is one: never more calls at once than its limit (external.md §2)
            result64 = (programs.settled(programs.submit(candidate.compute, probe_problem, "float64", where),
                                         lambda: candidate.compute(probe_problem, "float64", where))
                        if programs is not None else None)
            run = replace(run, float64_build=float64_build_evidence(candidate, probe_problem, where, probe_result,
                                                                    probe_trace, result64, judged=False))
        judged.append((run, judgement))
        if bar is not None:
            bar.update()
    return judged


def calls_at_once(candidate: Candidate, where) -> int:
    """How many of a program's calls a diagnosis runs at once: its two builds together on a CPU, else one at a time
    (a GPU may be in exclusive-process mode; a program without a float64 build may hold a licence or a lock)."""
    return 2 if has_float64_build(candidate) and where.type == "cpu" else 1


def has_float64_build(candidate: Candidate, judgement: Judgement | None = None) -> bool:
    """Whether the decision reads the candidate's float64 build: a program's `command_float64` always; a built-in's
    (a float64 run of its own) where the requested problem has a quantity its bound cannot certify, which the
    build can settle. Never for a build already claimed float64."""
    if not candidate.has_float64 or candidate.claimed_precision == "float64" or candidate.family == "bundle":
        return False
    if candidate.family == "command":
        return True
    return judgement is not None and any(q.verdict == "inconclusive" for q in judgement.quantities.values())


def float64_build_evidence(candidate: Candidate, problem: Problem, where, result32: Result,
                           trace: Trace, result64: Result | None = None, judged: bool = True) -> Float64Build:
    """The float64 recompilation (experiment 02) on the requested problem, as evidence for the decision
    (`result64`: the build's run, when it was started already; `judged`: the build's own verdict against the float64
    reference, which only the evidence's text reads: a probe's build goes without it)."""
    from .experiments.float64_recompilation import build_evidence
    from .verdict import judge

    if result64 is None:
        result64 = candidate.compute(problem, "float64", where)
    verdict64 = (judge(result64, trace, "float64", candidate.name, fingerprint=False, hypotheses=False).verdict
                 if judged else None)
    return build_evidence(result32, result64, trace, problem.network.parameter_names, verdict64,
                          candidate.claimed_precision)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="diagnose", unit="problem", disable=not enabled, file=sys.stderr, leave=False)


def _start(candidate: Candidate, problem: Problem, where, programs: _Programs, float64: bool = False):
    """A program's run on `problem` submitted to `programs`, and (with `float64`) its float64 build's (else None)."""
    running = programs.submit(candidate.compute, problem, "float32", where)
    return running, programs.submit(candidate.compute, problem, "float64", where) if float64 else None


def _run(candidate: Candidate, problem: Problem, where, programs: _Programs | None = None, started=None,
         beside: bool = False):
    """The candidate's run on `problem`, its float64 reference, and the float64 build's run still in flight (a
    Future, for a program whose `started` runs include one; else None). `started`: the runs _start submitted (else
    the claimed run is submitted here); `beside`: the run may have met other calls of the program (a queued probe's),
    so a failure is retried alone (_Programs.settled).

    A program (a command candidate) runs in its own process, its float64 build beside it in another, while this
    one builds the reference and the bounds of both claims (error_bounds caches them on the trace): the programs'
    and the lab's work overlap, so a diagnosis costs about its slowest run, not the sum (docs/results.md, "The float64
    reference and the cost of a diagnosis"). In-process candidates run first: their transients never meet the
    reference's."""
    from . import errmodel
    from .reference import reference

    if programs is None:
        result = candidate.compute(problem, "float32", where)
        return result, reference(problem, where), None
    running, build64 = started if started is not None else _start(candidate, problem, where, programs)
    with programs.threads() as leave:
        leave()
        trace = reference(problem, where)
        leave()
        errmodel.error_bounds(trace, candidate.claimed_precision, loss_scale=candidate.loss_scale)
        if build64 is not None:
            leave()
            errmodel.error_bounds(trace, "float64")
    if beside:
        return programs.settled(running, lambda: candidate.compute(problem, "float32", where)), trace, build64
    return running.result(), trace, build64


@contextlib.contextmanager
def _leaving(programs: _Programs | None):
    """The lab's threads for one stage, leaving a core to each of the program's calls still running: a judgement's
    fingerprint is many small ops, and a thread waiting at each for a core a program holds made a probe's 40 ms
    judgement take 1–2 s (docs/results.md)."""
    if programs is None:
        yield
        return
    with programs.threads() as leave:
        leave()
        yield


def _failed(run) -> bool:
    """Whether a call ended in an error (the claimed build's: nothing queued after it should start then)."""
    return not run.cancelled() and run.exception() is not None


def _after(claimed, call, *args):
    """A queued probe's call, unless the claimed build has failed already: then the program is not called."""
    from .candidates import CandidateError

    if claimed.done() and _failed(claimed):
        raise CandidateError("not run: the claimed build failed")
    return call(*args)


class _Programs:
    """A command candidate's calls in flight: threads wait on them (the GIL is released while waiting)."""

    def __init__(self, pool: ThreadPoolExecutor, calls: int):
        self.pool, self.runs, self.calls = pool, [], calls  # `calls`: how many may run at once

    def submit(self, *call):
        run = self.pool.submit(*call)
        self.runs.append(run)
        return run

    def settled(self, run, again):
        """`run`'s Result; if it failed while other calls were in flight (a licence, a lock file, a device two calls
        cannot share), `again()` once more, alone, after every other call has ended: that failure is the one reported."""
        from concurrent.futures import wait

        from .candidates import CandidateError

        try:
            return run.result()
        except CandidateError:
            others = [other for other in self.runs if other is not run]
            if not others:
                raise
            wait(others)
            return again()

    @contextlib.contextmanager
    def threads(self):
        """Yields `leave()`, which sets the lab's threads to the cores the programs still running leave, at least
        one; called before each stage, the threads come back as the programs end. Threads that wait at every op's
        barrier for a core a program holds burn CPU: 16–17 CPU-seconds of the lab's instead of 21 in a 1024²
        diagnosis of the numpy example with its float64 build, 2 cores (docs/results.md)."""
        import torch

        threads = torch.get_num_threads()

        def leave():
            torch.set_num_threads(max(1, threads - sum(run.running() for run in self.runs)))

        try:
            yield leave
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _programs(candidate: Candidate, calls: int = 2):
    """A command candidate's _Programs (None for in-process candidates), running at most `calls` of its calls at once:
    anything that stops the diagnosis (Ctrl-C, an error, a failed run) kills every call in flight first, so nothing
    is left running."""
    from .candidates.command import CommandProgram

    program = getattr(candidate.run, "__self__", None)  # a command candidate's run is CommandProgram.run
    if not isinstance(program, CommandProgram):
        yield None
        return
    program.allow_calls()
    with ThreadPoolExecutor(max_workers=calls, thread_name_prefix="candidate") as pool:
        try:
            yield _Programs(pool, calls)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # the queued runs never start
            program.cancel()
            raise
        finally:
            program.close()  # a worker (`worker: true`) ends with the diagnosis


def _repeats(candidate, problem, where, trace, first: Result, repeats: int, bar) -> Spread:
    """Run the candidate again and again on the same problem: the run-to-run spread of every quantity
    (atomics, split-K in a racing order) against its bound; beyond the bound is a race that loses updates."""
    import numpy as np

    from . import errmodel
    from .compare import quantity_arrays
    from .decision import Spread

    runs = [quantity_arrays(first, trace)]
    for _ in range(repeats - 1):
        runs.append(quantity_arrays(candidate.compute(problem, "float32", where), trace))
        bar.update()
    bounds = errmodel.error_bounds(trace, candidate.claimed_precision, loss_scale=candidate.loss_scale)
    spread = {}
    for name in runs[0]:
        stack = np.stack([run[name][0] for run in runs])
        width = np.ptp(stack, axis=0)
        spread[name] = {"max_spread": float(width.max()), "spread_ratio": float(np.max(width / bounds[name].bound)),
                        "identical": bool(width.max() == 0)}
    return Spread(repeats, spread)


def write_json_verdict(path: str | Path, verdict: dict) -> None:
    """`--json PATH`: the verdict as JSON (its folder made if need be); one line of error if it cannot be written."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(verdict, indent=1) + "\n")
    except OSError as exc:
        raise LabInputError(f"{out}: cannot write the JSON verdict ({exc.strerror})") from None


def main(args: argparse.Namespace) -> int:
    # every argument is checked before the heavy stages are imported: a typo is answered at once
    size = options.size(args.size, "--size")
    batch = options.positive(args.batch, "--batch")
    seed = options.nonnegative(args.seed, "--seed")
    repeats = options.positive(args.repeats, "--repeats")
    chosen = probe_set.select(args.probes)
    from .candidates import resolve
    from .device import resolve_device

    if args.candidate is not None:  # `model: opaque`: the reference-free gradient check instead
        opaque = resolve(args.candidate)
        # resolve imports the check (and SciPy, 0.7 s) only for a `model: opaque` YAML: no module, no opaque candidate
        checks = sys.modules.get("precision_lab.candidates.opaque")
        if checks is not None and isinstance(opaque, checks.OpaqueCandidate):
            from .candidates.opaque import run_diagnose

            result = run_diagnose(opaque, args)
            if args.json:
                write_json_verdict(args.json, result.to_json())
            return 0 if result.verdict == "roundoff" else 1
    where = resolve_device(args.device)  # a bad --device fails before anything runs
    candidate, problem = candidate_and_problem(args.candidate, args.bundle, size, batch, seed, args.model,
                                               args.image, where)
    diagnosis = diagnose(candidate, problem, args.device, chosen, repeats, progress=sys.stderr.isatty())
    print(f"problem: {problem.size_text}, batch {problem.batch}, seed {problem.seed}, {problem.source}, "
          f"network {problem.network.name}")
    print(diagnosis.to_text(verbose=getattr(args, "verbose", False)))
    if args.json:
        write_json_verdict(args.json, diagnosis.to_json())
    if args.html:
        from .device import describe_device
        from .present import write_diagnosis_page

        write_diagnosis_page(args.html, diagnosis, problem, describe_device(resolve_device(args.device)))
    return 0 if diagnosis.verdict == "roundoff" else 1
