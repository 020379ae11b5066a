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
from typing import TYPE_CHECKING

# light imports only: `--help` and argument errors answer before torch is imported
from . import options, probes as probe_set
from .errors import LabInputError

if TYPE_CHECKING:
    from .candidates import Candidate
    from .candidates.command import CommandProgram
    from .compute import Result, Trace
    from .problem import Problem
    from .verdict import Judgement

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
    parser.add_argument("--verbose", action="store_true",
                        help="print every quantity's evidence on every problem (default: the summary and what fails)")


@dataclass
class Diagnosis:
    """A candidate's verdict on the requested problem and on each probe; overall, the worst."""

    main: Judgement
    probes: list[tuple[probe_set.Probe, Judgement]] = field(default_factory=list)
    repeats: dict = field(default_factory=dict)
    probe_note: str | None = None  # how the probes were chosen when the network fixes the size
    float64_build: dict | None = None  # the candidate's command_float64 against the float64 reference

    @property
    def verdict(self) -> str:
        from .verdict import worst

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
        chosen = self._chosen()
        same = [j for j in [self.main] + [j for _, j in self.probes] if j.verdict == self.verdict]
        # a cause must explain every problem where the doctor tested it, not the first that names one
        causes = {j.cause for j in same if getattr(j, "hypotheses", None)}
        if chosen.cause and len(causes) > 1:
            unknown = "cause unknown: the problems name different causes (" + "; ".join(
                sorted(str(c) for c in causes)) + ")"
            return replace(chosen, cause=None, evidence=list(chosen.evidence) + [unknown])
        return chosen

    def _chosen(self) -> Judgement:
        """The problem's own judgement that `deciding` is drawn from (its identity labels the problem)."""
        same = [j for j in [self.main] + [j for _, j in self.probes] if j.verdict == self.verdict]
        named = [j for j in same if j.layout_fix or j.format or j.cause]
        return (named or same)[0]

    def to_json(self) -> dict:
        from .verdict import json_safe, worst

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
            if self.float64_build:
                parameters[name]["float64_build"] = self.float64_build["quantities"].get(name)
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "layout_fix": deciding.layout_fix, "layout_advice": deciding.layout_advice, "format": deciding.format,
                "cause": deciding.cause, "localisation": deciding.localisation,
                "decided_by": "requested" if self._chosen() is self.main else next(
                    p.name for p, j in self.probes if j is self._chosen()),
                "problem": main["problem"], "parameters": parameters, "forward": main["forward"],
                "evidence": main["evidence"], "main": main, "probes": probes, "probe_note": self.probe_note,
                "float64_build": json_safe(self.float64_build),
                "repeats": json_safe(self.repeats)}

    def summary(self) -> "Summary":
        """What this diagnosis says, once: the text verdict and the HTML page are both written from it."""
        deciding = self.deciding()
        named = deciding.layout_fix or deciding.format or deciding.cause or deciding.localisation
        label = {id(self.main): "the requested problem"}
        label.update({id(j): f"probe {p.name}" for p, j in self.probes})
        failing = [(label[id(self.main)], q) for q in self.main.quantities.values() if q.verdict != "roundoff"]
        if not failing and self.verdict != "roundoff":  # only a probe fails: show where
            failing = [(label[id(self._chosen())], q) for q in deciding.quantities.values() if q.verdict != "roundoff"]
        probes = [(p.name, _problem_text(j.problem), j.verdict, j.layout_fix or j.format or j.cause or j.localisation)
                  for p, j in self.probes]
        repeats = None
        if self.repeats:
            repeats = (f"{self.repeats['runs']} runs, largest run-to-run spread ÷ bound "
                       f"{self.repeats['worst_spread_ratio']:.3g} ({self.repeats['worst_quantity']}), "
                       + ("bitwise reproducible" if self.repeats["bitwise_reproducible"] else "not bitwise reproducible"))
        settled = [q.quantity for q in self.main.quantities.values() if q.settled_by]
        float64_build = None
        if self.float64_build:
            ratios = [(row["ratio"], name) for name, row in self.float64_build["quantities"].items()
                      if row.get("ratio") is not None and row["ratio"] == row["ratio"]]  # NaN: err32 = 0
            largest = max(ratios, default=None)
            persists = self.float64_build["persists"]
            float64_build = (f"{self.float64_build['verdict']} against the float64 reference; largest err64 ÷ err32 "
                             + (f"{largest[0]:.2g} ({largest[1]})" if largest else "n/a")
                             + f" (rounding predicts {self.float64_build['expected_ratio_if_rounding']:.2g}, a defect ≈ 1): "
                             + (f"the error persists in {', '.join(persists)}" if persists else "the error vanishes"))
        return Summary(candidate=self.candidate, claimed_precision=self.claimed_precision, verdict=self.verdict,
                       named=named if self.verdict != "roundoff" else None, decided_by=label[id(self._chosen())],
                       cause=deciding.cause if self.verdict != "roundoff" else None,
                       first_failing=deciding.localisation if self.verdict != "roundoff" else None,
                       fix=deciding.layout_advice if self.verdict != "roundoff" else None,
                       failing=failing, within=[q.quantity for q in self.main.quantities.values()
                                                if q.verdict == "roundoff" and q.quantity not in settled],
                       settled=settled,
                       probes=probes, repeats=repeats, worst_within=_worst_within(self.main, settled),
                       probe_note=self.probe_note, float64_build=float64_build)

    def to_text(self, verbose: bool = False) -> str:
        """The verdict, what names it, the fix, and only what fails; `verbose`: every quantity of every problem."""
        if not verbose:
            return self.summary().to_text()
        lines = [self.main.to_text()]
        if self.probe_note:
            lines.append(f"probes: {self.probe_note}")
        if self.repeats:
            lines.append(f"  repeats: {self.repeats['runs']} runs, largest run-to-run spread ÷ bound "
                         f"{self.repeats['worst_spread_ratio']:.3g} ({self.repeats['worst_quantity']})")
        for probe, judgement in self.probes:
            lines.append(f"probe {probe.name} ({_problem_text(judgement.problem)}): {judgement.headline()}")
            if judgement.verdict != "roundoff":
                lines += [f"  - {line}" for line in judgement.evidence[:6]]
        lines.append(f"overall verdict: {self.summary().headline}")
        return "\n".join(lines)


def _named(q) -> str | None:
    return q.layout_fix or q.format or q.cause


def _worst_within(judgement, settled=()) -> str | None:
    within = [q for q in judgement.quantities.values() if q.verdict == "roundoff" and q.quantity not in settled]
    if not within:
        return None
    worst = max(within, key=lambda q: q.bound_ratio)
    return f"{worst.bound_ratio:.3g}, {worst.quantity}"


def _problem_text(problem: dict) -> str:
    return (f"{problem.get('size')}, batch {problem.get('batch')}, seed {problem.get('seed')}, "
            f"{problem.get('targets')} targets")


@dataclass
class Summary:
    """A diagnosis in the words both the text verdict and the HTML page use (one source for both)."""

    candidate: str
    claimed_precision: str
    verdict: str
    named: str | None  # the transform, format, cause or first failing op that names the verdict
    decided_by: str  # "the requested problem" or "probe NAME": the judgement that names it
    cause: str | None  # a defect's named cause
    first_failing: str | None  # the first failing op, or the earliest failing quantity in backprop order
    fix: str | None  # the layout fix in words
    failing: list = field(default_factory=list)  # (problem label, QuantityVerdict) beyond the bound
    within: list[str] = field(default_factory=list)  # quantities of the requested problem within the bound
    probes: list = field(default_factory=list)  # (name, problem in words, verdict, what names it)
    repeats: str | None = None
    worst_within: str | None = None  # "0.0123, conv2.weight": how much of the bound the closest quantity uses
    probe_note: str | None = None  # how the probes were chosen when the network fixes the size
    float64_build: str | None = None  # the command_float64 build in words: err64 ÷ err32, vanishes or persists
    settled: list[str] = field(default_factory=list)  # requested-problem quantities its bound cannot certify, settled
    # by the float64 build or the probes (verdict.settle_diagnosis)

    @property
    def headline(self) -> str:
        """'layout (flip HW)', 'defect (act2 backward: mask missing)', 'roundoff'."""
        return self.verdict + (f" ({self.named})" if self.named else "")

    def to_text(self) -> str:
        lines = [f"candidate {self.candidate}  (claimed {self.claimed_precision})",
                 f"verdict: {self.headline}" + (f", named on {self.decided_by}"
                                                if self.named and self.decided_by != "the requested problem" else "")]
        if self.cause and self.cause != self.named:
            lines.append(f"  cause: {self.cause}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.first_failing:
            lines.append(f"  where: {self.first_failing}")
        if self.repeats:
            lines.append(f"  repeats: {self.repeats}")
        if self.float64_build:
            lines.append(f"  float64 build: {self.float64_build}")
        if self.failing:
            lines.append(f"  beyond the bound on {self.failing[0][0]}:")
            lines += [f"    {q.quantity:<13} {q.verdict:<17} max|err| {q.max_abs_err:9.3g}  err/bound {q.bound_ratio:9.3g}"
                      + (f"  ({_named(q)})" if _named(q) and _named(q) != self.named else "")
                      for _, q in self.failing]
        if self.within:
            lines.append(f"  within the bound: {', '.join(self.within)}"
                         + (f" (worst error ÷ bound {self.worst_within})" if self.worst_within else ""))
        if self.settled:
            lines.append(f"  settled elsewhere (too large a bound here to certify rounding): {', '.join(self.settled)} "
                         "— certified on every probe or by the float64 build (--verbose says which)")
        said = {verdict + (f" ({named})" if named else "") for _, _, verdict, named in self.probes}
        if len(said) == 1 and len(self.probes) > 1:  # the usual case: every probe agrees
            lines.append(f"  probes: all {len(self.probes)} {said.pop()} "
                         f"({', '.join(name for name, _, _, _ in self.probes)})")
        elif self.probes:
            lines.append("  probes: " + "; ".join(f"{name} {verdict}" + (f" ({named})" if named else "")
                                                 for name, _, verdict, named in self.probes))
        if self.probe_note:
            lines.append(f"  probes: {self.probe_note}")
        if self.verdict != "roundoff" or self.probes:
            lines.append("  (every quantity's evidence, and each probe's: --verbose)")
        return "\n".join(lines)


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
    """Run `candidate` on `problem` as claimed (and on each probe), build the float64 references, and judge.

    `probes`: a list of precision_lab.probes.Probe (None: the defaults; [] for none).
    """
    from . import resources
    from .device import resolve_device
    from .verdict import judge, settle_diagnosis

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
    recompiled = _float64_build(candidate, problem, where, result, trace, main) if _has_float64_build(candidate) \
        else None
    del trace
    judged = []
    for probe, (_, probe_problem) in zip(chosen, steps[1:]):
        probe_result, probe_trace = _run(candidate, probe_problem, where)
        judged.append((probe, judge(probe_result, probe_trace, candidate.claimed_precision, candidate.name)))
        bar.update()
    bar.close()
    settle_diagnosis(main, [(probe.name, j) for probe, j in judged], recompiled["quantities"] if recompiled else None)
    return Diagnosis(main, judged, spread, probe_set.fixed_size_note(problem.network, problem) if chosen else None,
                     recompiled)


def _has_float64_build(candidate: Candidate) -> bool:
    """A program with `command_float64` whose claimed build is not already float64."""
    return candidate.family == "command" and candidate.has_float64 and candidate.claimed_precision != "float64"


def _float64_build(candidate: Candidate, problem: Problem, where, result32: Result, trace: Trace,
                   main: Judgement) -> dict:
    """The float64 recompilation (experiment 02) on the requested problem: the float64 build judged against the
    float64 reference, and err64 ÷ err32 per quantity (rounding predicts u64/u32, a defect ≈ 1). An error that
    persists in float64 is not rounding, whatever its size: a `roundoff` verdict becomes `defect`."""
    from .experiments.float64_recompilation import EXPECTED_RATIO, VANISH_THRESHOLD, recompilation_rows
    from .verdict import judge

    result64 = candidate.compute(problem, "float64", where)
    judgement64 = judge(result64, trace, "float64", candidate.name, fingerprint=False, hypotheses=False)
    rows = recompilation_rows(result32, result64, trace, problem.network.parameter_names)
    persists = [row["quantity"] for row in rows if row["finding"] == "persists in float64"]
    ratios = ", ".join(f"{row['quantity']} {row['ratio']:.2g}" for row in rows)
    main.evidence.append(f"float64 build (command_float64): {judgement64.verdict} against the float64 reference; "
                         f"err64 ÷ err32 {ratios} (rounding predicts {EXPECTED_RATIO:.2g}, a defect ≈ 1; "
                         f"boundary {VANISH_THRESHOLD:.2g}): "
                         + (f"persists in {', '.join(persists)}" if persists else "vanishes everywhere"))
    if persists and main.verdict == "roundoff":
        from .verdict import overall

        for name in persists:
            if name in main.quantities:
                q = main.quantities[name]
                q.verdict, q.cause = "defect", "the error persists in the float64 build (not rounding error)"
        overall(main)
    return {"verdict": judgement64.verdict, "expected_ratio_if_rounding": EXPECTED_RATIO,
            "threshold": VANISH_THRESHOLD, "persists": persists,
            "quantities": {row.pop("quantity"): row for row in rows}}


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="diagnose", unit="problem", disable=not enabled, file=sys.stderr, leave=False)


def _run(candidate: Candidate, problem: Problem, where) -> tuple[Result, Trace]:
    from .candidates.command import CommandProgram
    from .reference import reference

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
    from .reference import reference

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
    import numpy as np

    from . import errmodel
    from .compare import quantity_arrays

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
    # every argument is checked before the heavy stages are imported: a typo is answered at once
    size = options.size(args.size, "--size")
    batch = options.positive(args.batch, "--batch")
    seed = options.nonnegative(args.seed, "--seed")
    repeats = options.positive(args.repeats, "--repeats")
    chosen = probe_set.select(args.probes)
    from .candidates import resolve
    from .device import resolve_device

    if args.candidate is not None:  # `model: opaque`: the reference-free gradient check instead
        from .candidates.opaque import OpaqueCandidate, run_diagnose

        opaque = resolve(args.candidate)
        if isinstance(opaque, OpaqueCandidate):
            return run_diagnose(opaque, args)
    where = resolve_device(args.device)  # a bad --device fails before anything runs
    candidate, problem = candidate_and_problem(args.candidate, args.bundle, size, batch, seed, args.model,
                                               args.image, where)
    diagnosis = diagnose(candidate, problem, args.device, chosen, repeats, progress=sys.stderr.isatty())
    print(f"problem: {problem.size_text}, batch {problem.batch}, seed {problem.seed}, {problem.source}, "
          f"network {problem.network.name}")
    print(diagnosis.to_text(verbose=getattr(args, "verbose", False)))
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

        write_diagnosis_page(args.html, diagnosis, problem, describe_device(resolve_device(args.device)))
    return 0 if diagnosis.verdict == "roundoff" else 1
