"""What a diagnosis can afford to recompute in float64 (the fingerprint and the recomputing hypotheses)."""
from __future__ import annotations

from ..compute import Trace


#: the precision fingerprint and the recomputing hypotheses run when a problem has at most this many
#: image elements (batch·H·W) on a CPU, about 0.3 s per float32 forward + backward of the seed network
#: on 2 cores (a GPU runs them at any size); above it the diagnosis's probes carry them
RECOMPUTE_LIMIT = 2 * 256 * 256


def recompute_allowed(reference: Trace, requested: bool | None) -> bool:
    if requested is not None:
        return requested
    problem = reference.problem
    return reference.device.type == "cuda" or problem.batch * problem.height * problem.width <= RECOMPUTE_LIMIT

