"""The diagnostic experiments, one module each; every one returns tidy pandas DataFrames.

Shared plumbing lives here: resolving candidates for a device, a small cache of float64
references (one per problem, so a notebook that asks twice pays once), and progress bars.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict

import numpy as np
import torch
from tqdm import tqdm

from ..candidates import Candidate, CandidateError, resolve
from ..compute import Trace
from ..device import resolve_device
from ..model import load_model
from ..options import PROGRESS_ENV  # "0" from `precision-lab run`: no bars in the reports
from ..paths import ROOT
from ..problem import Problem, make_problem
from ..reference import reference

_REFERENCE_CACHE: "OrderedDict[tuple, Trace]" = OrderedDict()
_REFERENCE_CACHE_SIZE = 2  # a float64 trace at 1024² holds ~1.5 GB: keep few


def progress(iterable=None, **kwargs):
    """A text progress bar on stderr (no widgets: they would not survive HTML rendering)."""
    kwargs.setdefault("disable", os.environ.get(PROGRESS_ENV) == "0")
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 1.0)
    return tqdm(iterable, **kwargs)


def candidates_for(names: list[str], device: torch.device, network=None) -> tuple[list[Candidate], list[str]]:
    """Resolve candidate specs; those the device cannot run, or that mean nothing for the network, are
    skipped with a note saying why.

    Relative YAML or bundle paths resolve against the repository root when they are not found
    from the working directory (papermill runs notebooks from wherever the CLI was started).
    """
    chosen, skipped = [], []
    for name in names:
        candidate = resolve(name, base_dir=ROOT)
        if not candidate.supports(device):
            skipped.append(f"{candidate.name}: needs {' or '.join(candidate.devices)}, this run is on {device.type}")
        elif network is not None and not candidate.applies_to(network):
            skipped.append(f"{candidate.name}: does not apply to the network {network.name!r}")
        else:
            chosen.append(candidate)
    if not chosen:
        raise CandidateError(f"none of the candidates {names} can run on {device.type}")
    return chosen, skipped


def _problem_key(problem: Problem, device: torch.device) -> tuple:
    digest = tuple(float(np.float64(v.sum())) for v in problem.params.values())
    return (problem.height, problem.width, problem.batch, problem.seed, problem.source, problem.targets,
            repr(problem.network.spec), str(device), digest)


def _cached(cache: "OrderedDict[tuple, Trace]", size: int, problem: Problem, device: torch.device) -> Trace:
    """The float64 reference of `problem` from `cache` (least recently used dropped beyond `size`)."""
    key = _problem_key(problem, device)
    if key not in cache:
        cache[key] = reference(problem, device)
        while len(cache) > size:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


def cached_reference(problem: Problem, device: torch.device) -> Trace:
    """The float64 reference of `problem`, computed once per problem and device."""
    return _cached(_REFERENCE_CACHE, _REFERENCE_CACHE_SIZE, problem, device)


def network_for(model=None):
    """The network a notebook's `model` parameter names: None or 'seed' (the seed CNN), a spec file
    (relative paths against the repository root too), or a spec mapping."""
    return load_model(model, base_dir=ROOT)


def setup(device: str = "auto", size=1024, batch: int = 2, seed: int = 0,
          image: str | None = None, model=None) -> tuple[torch.device, Problem]:
    """What every notebook does first: resolve the device, build the problem (of the `model` network)."""
    return resolve_device(device), make_problem(size, batch, seed, image, network=network_for(model))


def summary_row(candidate: str, experiment: str, decision, headline: str, **extra) -> dict:
    """One row of a notebook's summary table (precision_lab.results.SUMMARY_COLUMNS first), from the candidate's
    decision (precision_lab.decision.Diagnosis): its verdict, what names it, and whether probes were run."""
    if isinstance(decision, str):  # a verdict with no decision behind it: the reference-free check (06)
        return {"candidate": candidate, "experiment": experiment, "verdict": decision, "headline": headline, **extra}
    return {"candidate": candidate, "experiment": experiment, "verdict": decision.verdict, "headline": headline,
            "named": decision.summary().named, "probes": probes_run(decision), "probed": decision.probed, **extra}


def probes_run(decision) -> str:
    """'3 probes' or 'unprobed' ('3 probes, 4 other sizes' in a sweep): what the verdict rests on besides the
    requested problem."""
    from ..decision import SWEEP_SIZE

    sizes = sum(run.kind == SWEEP_SIZE for run, _ in decision.probes)
    probes = len(decision.probes) - sizes
    other = f", {sizes} other size{'s' if sizes != 1 else ''}" if sizes else ""
    if not decision.probed:
        return "unprobed" + other
    return f"{probes} probe{'s' if probes != 1 else ''}{other}"


#: float64 references of probe problems: small, and the same for every candidate of a notebook
_PROBE_REFERENCES: "OrderedDict[tuple, Trace]" = OrderedDict()
_PROBE_REFERENCE_CACHE_SIZE = 8


def probe_reference(problem: Problem, device: torch.device) -> Trace:
    """A probe's float64 reference, shared by every candidate of a notebook."""
    return _cached(_PROBE_REFERENCES, _PROBE_REFERENCE_CACHE_SIZE, problem, device)


def decide_candidate(candidate: Candidate, problem: Problem, device: torch.device, judgement, probes="default",
                     others=(), **evidence):
    """The candidate's verdict as `diagnose` reaches it (precision_lab.decision.decide): its `judgement` of the
    requested `problem`, its judgements on the probes `diagnose` would run (`probes`: "default", "none", or a
    comma-separated list of names), the experiment's own `evidence` (float64_build, scaling), and `others`:
    (ProbeRun, Judgement) of further problems the experiment judged (a sweep's other sizes)."""
    from .. import probes as probe_set
    from ..decision import decide
    from ..diagnosis import float64_build_evidence, has_float64_build, judge_probes

    if "float64_build" not in evidence and has_float64_build(candidate, judgement):  # as diagnose reads it
        result32 = candidate.compute(problem, "float32", device)
        evidence["float64_build"] = float64_build_evidence(candidate, problem, device, result32,
                                                           cached_reference(problem, device))
    chosen = probe_set.select(probes) if isinstance(probes, str) or probes is None else list(probes)
    if getattr(candidate, "problem", None) is not None:
        chosen = []  # a static bundle answers its own problem only
    judged = judge_probes(candidate, problem, device, chosen, reference_of=probe_reference)
    return decide(judgement, list(others) + judged, probed=bool(chosen) or getattr(candidate, "problem", None) is not None,
                  probe_note=probe_set.fixed_size_note(problem.network, problem) if chosen else None, **evidence)


def decide_all(problem: Problem, candidates: list[Candidate], device: torch.device, judgements: dict,
               probes="default", desc: str = "probes") -> dict:
    """decide_candidate for every candidate judged on `problem` (`judgements`: name → Judgement)."""
    return {candidate.name: decide_candidate(candidate, problem, device, judgements[candidate.name], probes)
            for candidate in progress(candidates, desc=desc, unit="candidate")}


def probe_table(decisions: dict):
    """One row per candidate × probe: what ran (size, batch, seed, targets), its verdict, its worst quantity."""
    import pandas as pd

    rows = [row for decision in decisions.values() for row in decision.probe_rows()]
    return pd.DataFrame(rows, columns=["candidate", "probe", "image", "batch", "seed", "targets", "verdict", "named",
                                       "worst_quantity", "worst_bound_ratio"])


def verdict_table(decisions: dict):
    """One row per candidate × quantity of the decided verdict (the worst over the requested problem and probes)."""
    import pandas as pd

    return pd.concat([decision.judgement().to_frame() for decision in decisions.values()], ignore_index=True)


def decided_judgements(decisions: dict) -> dict:
    """Each candidate's decision as one judgement (precision_lab.decision.Diagnosis.judgement): what the
    conclusions read, so a notebook's words say the same verdict as its summary."""
    return {name: decision.judgement() for name, decision in decisions.items()}


def show_probes(decisions: dict):
    """The probes table a notebook shows, or the note that its verdicts are unprobed."""
    from .. import tables
    from ..conclusions import unprobed_notes

    unprobed = unprobed_notes(decisions)
    if unprobed:
        return tables.notes(unprobed, "Note:")
    return tables.show(probe_table(decisions), caption="The probes diagnose runs beside the requested problem, and a "
                       "sweep's other sizes (each label says what ran); a candidate's verdict is the worst over all of "
                       "them (precision_lab.decision)")
