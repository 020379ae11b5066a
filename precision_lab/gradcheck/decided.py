"""The reference-free check's evidence, decided by the lab's one decision (precision_lab.decision.decide).

The check has no float64 reference, so its evidence maps onto the decision's as follows:

* each tensor's finite-difference or segment finding (and a build spread coarser than claimed) is that quantity's
  comparison on the requested problem: `roundoff`, `defect` or `inconclusive`;
* the loss has no comparison of its own (it is what the differences are taken of): `roundoff` unless the builds
  say otherwise;
* the claimed build against the float64 build at nearby points (gradcheck.builds) is a `Float64Build`: an error
  present at every point beyond PERSISTENCE_LIMIT× its rounding spread "persists in float64", and the decision's
  rule for that evidence, not a rule of the check's own, makes the quantity `defect`;
* scaling segments of a float32-only check that fail with no member to blame are `defect` quantities of their own.
"""
from __future__ import annotations

import math

from ..compare import QuantityVerdict
from ..decision import Diagnosis, Float64Build, decide
from ..verdict import Judgement
from .builds import PERSISTENCE_LIMIT, BuildComparison
from .results import TensorVerdict

#: what the build comparison's rows say (decision.Float64Build.persists reads the first)
PERSISTS, WITHIN_SPREAD = "persists in float64", "within its rounding spread"


def persists(comparison: BuildComparison | None) -> bool:
    """Whether the claimed build's error is present at every nearby point beyond its rounding spread."""
    return comparison is not None and comparison.bound_ratio > 1


def _quantity(name: str, verdict: str, max_abs_err: float = math.nan, bound_ratio: float = math.nan,
              size: int = 1, evidence: str = "") -> QuantityVerdict:
    # no reference: the error statistics the reference path has (mean, relative, ulps, cosine) are unknown
    return QuantityVerdict(name, verdict, max_abs_err, math.nan, math.nan, bound_ratio, math.nan, math.nan, math.nan,
                           size=size, evidence=evidence)


def _row(comparison: BuildComparison, claimed: str) -> dict:
    finding = PERSISTS if persists(comparison) else WITHIN_SPREAD
    return {"err32": comparison.max_abs_err, "err64": math.nan, "ratio": math.nan, "finding": finding,
            "evidence": (f"the {claimed} build differs from the float64 build by {comparison.persistent:.3g} at every "
                         f"one of {comparison.points} nearby points, {comparison.bound_ratio:.3g}× the bound "
                         f"{PERSISTENCE_LIMIT:g}× its rounding spread")}


def decide_check(candidate: str, claimed: str, tensors: dict[str, TensorVerdict],
                 loss: BuildComparison | None = None, failing_groups: list[str] = ()) -> Diagnosis:
    """The decision on a check's evidence; each tensor's verdict is then the decided one (set here)."""
    quantities = {name: _quantity(name, t.verdict, t.max_abs_err, t.bound_ratio, int(math.prod(t.shape)))
                  for name, t in tensors.items()}
    quantities["loss"] = _quantity("loss", "roundoff", loss.max_abs_err if loss is not None else math.nan)
    for words in failing_groups:
        quantities[words] = _quantity(words, "defect", evidence=words)
    rows = {name: _row(t.comparison, claimed) for name, t in tensors.items() if t.comparison is not None}
    if loss is not None:
        rows["loss"] = _row(loss, claimed)
    build = (Float64Build(rows, verdict=None, expected_ratio=math.nan, threshold=PERSISTENCE_LIMIT)
             if rows else None)
    judgement = Judgement(candidate, claimed, "roundoff", quantities, problem={"source": "reference-free check"})
    diagnosis = decide(judgement, probed=False, float64_build=build)
    for name, tensor in tensors.items():
        tensor.verdict = diagnosis.main.quantities[name].verdict
    return diagnosis
