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
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import errmodel, options, probes as probe_set, resources
from .candidates import Candidate, resolve
from .candidates.command import CommandProgram
from .compare import quantity_arrays
from .compute import Result, Trace
from .device import resolve_device
from .errors import LabInputError
from .model import ModelSpecError, load_model
from .problem import Problem, make_problem
from .reference import reference
from .verdict import Judgement, json_safe, judge, worst

#: the seed scale (DESIGN.md): 1024×1024, batch 2
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
    parser.add_argument("--model", default=None, help="model spec (JSON/YAML file or 'seed') for built-in candidates; "
                                                      "a candidate YAML names its own")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    parser.add_argument("--probes", default="default",
                        help=f"none, default, or a comma-separated list of {', '.join(probe_set.PROBES)}")
    parser.add_argument("--repeats", default="1", help="run the candidate K times on the problem and report the "
                                                       "run-to-run spread (default 1)")
    parser.add_argument("--json", metavar="OUT", help="write the verdict as JSON to this file")
    parser.add_argument("--max-calls", type=int, default=None, metavar="N",
                        help="opaque candidates: program calls the gradient check may make (default max(60, 20 + 4·tensors))")
    parser.add_argument("--html", metavar="OUT", help="write the verdict as a self-contained HTML page to this file")


@dataclass
class Diagnosis:
    """A candidate's verdict on the requested problem and on each probe; overall, the worst."""

    main: Judgement
    probes: list[tuple[probe_set.Probe, Judgement]] = field(default_factory=list)
    repeats: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return worst([self.main.verdict] + [j.verdict for _, j in self.probes])

    @property
    def candidate(self) -> str:
        return self.main.candidate

    @property
    def claimed_precision(self) -> str:
        return self.main.claimed_precision

    @property
    def quantities(self):
        return self.main.quantities

    def deciding(self) -> Judgement:
        """The judgement whose verdict is the overall one: the first (requested problem, then the probes) that
        names a cause, else the first with that verdict. A cause needs a recomputation that the requested
        problem may be too large for (doctors.RECOMPUTE_LIMIT on a CPU); a probe is small enough to name it."""
        same = [j for j in [self.main] + [j for _, j in self.probes] if j.verdict == self.verdict]
        named = [j for j in same if j.layout_fix or j.format or j.cause]
        chosen = (named or same)[0]
        # a cause must explain every problem where the doctor tested it, not the first that names one
        causes = {j.cause for j in same if getattr(j, "hypotheses", None)}
        if chosen.cause and len(causes) > 1:
            unknown = "cause unknown: the problems name different causes (" + "; ".join(
                sorted(str(c) for c in causes)) + ")"
            return replace(chosen, cause=None, evidence=list(chosen.evidence) + [unknown])
        return chosen

    def to_json(self) -> dict:
        deciding = self.deciding()
        main = self.main.to_json()
        probes = []
        for probe, judgement in self.probes:
            entry = judgement.to_json()
            entry.update(name=probe.name, why=probe.why)
            probes.append(entry)
        parameters = {}
        for name, entry in main["parameters"].items():
            chosen, where = entry, "requested"
            for probe, judgement in self.probes:
                other = judgement.to_json()["parameters"].get(name)
                if other and worst([chosen["verdict"], other["verdict"]]) != chosen["verdict"]:
                    chosen, where = other, probe.name
            parameters[name] = dict(chosen, problem=where)
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "layout_fix": deciding.layout_fix, "layout_advice": deciding.layout_advice, "format": deciding.format,
                "cause": deciding.cause, "localisation": deciding.localisation,
                "decided_by": "requested" if deciding is self.main else next(
                    p.name for p, j in self.probes if j is deciding),
                "problem": main["problem"], "parameters": parameters, "forward": main["forward"],
                "evidence": main["evidence"], "main": main, "probes": probes, "repeats": json_safe(self.repeats)}

    def to_text(self) -> str:
        lines = [self.main.to_text()]
        if self.repeats:
            lines.append(f"  repeats: {self.repeats['runs']} runs, largest run-to-run spread ÷ bound "
                         f"{self.repeats['worst_spread_ratio']:.3g} ({self.repeats['worst_quantity']})")
        for probe, judgement in self.probes:
            p = judgement.problem
            lines.append(f"probe {probe.name} ({p.get('size')}, batch {p.get('batch')}, seed {p.get('seed')}, "
                         f"{p.get('targets')} targets): {judgement.headline()}")
            if judgement.verdict != "roundoff":
                lines += [f"  - {line}" for line in judgement.evidence[:6]]
        deciding = self.deciding()
        detail = deciding.layout_fix or deciding.format or deciding.cause or deciding.localisation
        lines.append(f"overall verdict: {self.verdict}" + (f" ({detail})" if self.verdict != "roundoff" and detail else ""))
        return "\n".join(lines)


def candidate_and_problem(candidate_spec: str | None, bundle: str | None, size=None, batch=None, seed=None,
                          model=None, image=None, device=None) -> tuple[Candidate, Problem]:
    """Resolve the candidate and the problem it is judged on (a static bundle's own, else one made here).

    With `device`, a problem too large for the memory free there is refused before it is allocated."""
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
    """Run `candidate` on `problem` as claimed (and on each probe), build the float64 references, and judge.

    `probes`: a list of precision_lab.probes.Probe (None: the defaults; [] for none).
    """
    where = resolve_device(device)
    if not candidate.supports(where):
        raise LabInputError(f"candidate {candidate.name} runs on {', '.join(candidate.devices)} only, not {where}")
    resources.check_fits(problem.network, problem.batch, problem.height, problem.width, where)
    chosen = probe_set.select("default") if probes is None else probes
    if getattr(candidate, "problem", None) is not None:
        chosen = []  # a static bundle holds the answer to its own problem only: nothing to probe
    steps = [("requested", problem)] + [(probe.name, probe_set.probe_problem(probe, problem)) for probe in chosen]
    bar = _bar(len(steps) + max(0, repeats - 1), progress)
    result, trace = _run(candidate, problem, where)
    bar.update()
    spread = _repeats(candidate, problem, where, trace, result, repeats, bar) if repeats > 1 else {}
    main = judge(result, trace, candidate.claimed_precision, candidate.name, fingerprint=fingerprint)
    if spread:
        _apply_spread(main, spread)
    del trace
    judged = []
    for probe, (_, probe_problem) in zip(chosen, steps[1:]):
        probe_result, probe_trace = _run(candidate, probe_problem, where)
        judged.append((probe, judge(probe_result, probe_trace, candidate.claimed_precision, candidate.name)))
        bar.update()
    bar.close()
    return Diagnosis(main, judged, spread)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="diagnose", unit="problem", disable=not enabled, file=sys.stderr, leave=False)


def _run(candidate: Candidate, problem: Problem, where) -> tuple[Result, Trace]:
    program = getattr(candidate.run, "__self__", None)  # a command candidate's run is CommandProgram.run
    if isinstance(program, CommandProgram):
        return _overlapped(candidate, program, problem, where)
    # in-process candidates first: their transients never meet the reference's
    result = candidate.compute(problem, "float32", where)
    return result, reference(problem, where)


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


def _repeats(candidate, problem, where, trace, first: Result, repeats: int, bar) -> dict:
    """Run the candidate again and again on the same problem: the run-to-run spread of every quantity
    (atomics, split-K in a racing order) against its bound; beyond the bound is a race that loses updates."""
    runs = [quantity_arrays(first, trace)]
    for _ in range(repeats - 1):
        runs.append(quantity_arrays(candidate.compute(problem, "float32", where), trace))
        bar.update()
    bounds = errmodel.error_bounds(trace, candidate.claimed_precision)
    spread = {}
    for name in runs[0]:
        stack = np.stack([run[name][0] for run in runs])
        width = np.ptp(stack, axis=0)
        spread[name] = {"max_spread": float(width.max()), "spread_ratio": float(np.max(width / bounds[name].bound)),
                        "identical": bool(width.max() == 0)}
    worst_name = max(spread, key=lambda n: spread[n]["spread_ratio"])
    return {"runs": repeats, "quantities": spread, "worst_quantity": worst_name,
            "worst_spread_ratio": spread[worst_name]["spread_ratio"],
            "bitwise_reproducible": all(s["identical"] for s in spread.values())}


def _apply_spread(judgement: Judgement, spread: dict) -> None:
    for name, entry in spread["quantities"].items():
        if entry["spread_ratio"] > 1.0 and name in judgement.quantities:
            q = judgement.quantities[name]
            q.verdict, q.cause = "defect", "run-to-run spread beyond the bound (a race that loses updates)"
            q.evidence = f"runs differ by {entry['max_spread']:.3g}, {entry['spread_ratio']:.3g}× the bound"
    judgement.evidence.append(f"{spread['runs']} runs: largest spread ÷ bound {spread['worst_spread_ratio']:.3g} "
                              f"({spread['worst_quantity']}); "
                              + ("bitwise reproducible" if spread["bitwise_reproducible"] else "not bitwise reproducible"))
    from .verdict import overall

    judgement.evidence = [e for e in judgement.evidence if not e.startswith(tuple(judgement.quantities))]
    overall(judgement)


def main(args: argparse.Namespace) -> int:
    if args.candidate is not None:  # `model: opaque`: the reference-free gradient check instead
        from .candidates.opaque import OpaqueCandidate, run_diagnose

        opaque = resolve(args.candidate)
        if isinstance(opaque, OpaqueCandidate):
            return run_diagnose(opaque, args)
    size = options.size(args.size, "--size")
    batch = options.positive(args.batch, "--batch")
    seed = options.nonnegative(args.seed, "--seed")
    repeats = options.positive(args.repeats, "--repeats")
    chosen = probe_set.select(args.probes)
    where = resolve_device(args.device)  # a bad --device fails before anything runs
    candidate, problem = candidate_and_problem(args.candidate, args.bundle, size, batch, seed, args.model,
                                               args.image, where)
    diagnosis = diagnose(candidate, problem, args.device, chosen, repeats, progress=sys.stderr.isatty())
    print(f"problem: {problem.size_text}, batch {problem.batch}, seed {problem.seed}, {problem.source}, "
          f"network {problem.network.name}")
    print(diagnosis.to_text())
    if args.json:
        out = Path(args.json)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(diagnosis.to_json(), indent=1) + "\n")
        except OSError as exc:
            raise LabInputError(f"{out}: cannot write the JSON verdict ({exc.strerror})") from None
    if args.html:
        from .device import describe_device
        from .present import write_diagnosis_page

        write_diagnosis_page(args.html, diagnosis.main, problem, describe_device(resolve_device(args.device)))
    return 0 if diagnosis.verdict == "roundoff" else 1
