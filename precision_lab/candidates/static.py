"""A static bundle as a candidate: its own problem, and the response it stores (docs/design.md, "Candidates")."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..bundle import Bundle, problem_from_bundle, read_bundle, result_from_bundle
from ..compute import Result
from ..problem import Problem
from . import Candidate, CandidateError


@dataclass
class BundleCandidate(Candidate):
    """A static bundle as a candidate: `problem` is the bundle's own problem, compute returns its response."""

    problem: Problem | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "BundleCandidate":
        """Read and validate a static bundle directory (every array is loaded and checked here)."""
        bundle = read_bundle(path, ("static",))
        problem = problem_from_bundle(bundle)
        response = result_from_bundle(bundle)
        name = bundle.manifest.get("name") if isinstance(bundle.manifest.get("name"), str) else Path(path).name
        return cls(name=name, description=f"static bundle {path}", run=_stored_response(bundle, problem, response),
                   claimed_precision=bundle.precision, weight_layout=bundle.weight_layout, family="bundle",
                   has_float64=False, meta={"bundle": str(path)}, problem=problem)


def _stored_response(bundle: Bundle, problem: Problem, response: Result):
    def run(asked: Problem, precision: str, device: torch.device) -> Result:
        if asked is not problem and not (np.array_equal(asked.input, problem.input)
                                         and all(np.array_equal(asked.params[n], problem.params[n])
                                                 for n in problem.network.parameter_names)
                                         and all(np.array_equal(asked.masks[n], problem.masks[n])
                                                 for n in problem.network.mask_names)):
            raise CandidateError(f"static bundle {bundle.path} holds results for its own problem only "
                                 f"(input {problem.input.shape}); use candidate.problem")
        return Result(response.loss, dict(response.grads), response.output, response.dtype, dict(response.meta),
                      dict(response.intermediates), dict(response.buffers))

    return run
