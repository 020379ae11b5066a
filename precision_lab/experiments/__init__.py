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
from ..paths import ROOT
from ..problem import Problem, make_problem
from ..reference import reference

_REFERENCE_CACHE: "OrderedDict[tuple, Trace]" = OrderedDict()
_REFERENCE_CACHE_SIZE = 2  # a float64 trace at 1024² holds ~1.5 GB: keep few


#: set to "0" by `precision-lab run`: its own per-cell progress shows, and bars would litter the reports
PROGRESS_ENV = "PRECISION_LAB_PROGRESS"


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


def cached_reference(problem: Problem, device: torch.device) -> Trace:
    """The float64 reference of `problem`, computed once per problem and device."""
    key = _problem_key(problem, device)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = reference(problem, device)
        while len(_REFERENCE_CACHE) > _REFERENCE_CACHE_SIZE:
            _REFERENCE_CACHE.popitem(last=False)
    _REFERENCE_CACHE.move_to_end(key)
    return _REFERENCE_CACHE[key]


def network_for(model=None):
    """The network a notebook's `model` parameter names: None or 'seed' (the seed CNN), a spec file
    (relative paths against the repository root too), or a spec mapping."""
    return load_model(model, base_dir=ROOT)


def setup(device: str = "auto", size=1024, batch: int = 2, seed: int = 0,
          image: str | None = None, model=None) -> tuple[torch.device, Problem]:
    """What every notebook does first: resolve the device, build the problem (of the `model` network)."""
    return resolve_device(device), make_problem(size, batch, seed, image, network=network_for(model))


def summary_row(candidate: str, experiment: str, verdict: str, headline: str, **extra) -> dict:
    """One row of a notebook's summary table (precision_lab.results.SUMMARY_COLUMNS first)."""
    return {"candidate": candidate, "experiment": experiment, "verdict": verdict, "headline": headline, **extra}
