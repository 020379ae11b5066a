"""Comparison against the float64 reference and verdicts (PROVISIONAL: issue 3 makes it full).

Verdict per quantity: `roundoff` when every element lies within the rounding bound of the
claimed precision, otherwise `defect` (the layout doctor and reduced-precision attribution
come with issue 3).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from . import errmodel
from .problem import PARAM_NAMES, Result, Trace

VERDICTS = ("roundoff", "reduced-precision", "layout", "defect")


@dataclass
class QuantityVerdict:
    quantity: str
    verdict: str
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float
    bound_ratio: float
    cosine: float
    sign_agreement: float
    layout_fix: str | None = None
    format: str | None = None


@dataclass
class Judgement:
    candidate: str
    claimed_precision: str
    verdict: str
    quantities: dict[str, QuantityVerdict] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(q) for q in self.quantities.values()]).assign(candidate=self.candidate)

    def to_json(self) -> dict:
        return {"candidate": self.candidate, "verdict": self.verdict, "claimed_precision": self.claimed_precision,
                "parameters": {name: asdict(q) for name, q in self.quantities.items()}}


def _metrics(name: str, got: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> QuantityVerdict:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    scale = np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    floor = max(float(np.max(bound)) * 1e-3, np.finfo(np.float64).tiny)  # dead elements (S = 0) get a floor
    ratio = float(np.max(err / np.maximum(bound, floor)))
    denom = np.linalg.norm(got) * np.linalg.norm(ref)
    return QuantityVerdict(
        quantity=name, verdict="roundoff" if ratio <= 1.0 else "defect",
        max_abs_err=float(err.max()), mean_abs_err=float(err.mean()), max_rel_err=float((err / scale).max()),
        bound_ratio=ratio, cosine=float(np.dot(got.ravel(), ref.ravel()) / denom) if denom > 0 else 1.0,
        sign_agreement=float(np.mean(np.sign(got) == np.sign(ref))))


def judge(result: Result, reference: Trace, claimed_precision: str = "float32", candidate: str = "") -> Judgement:
    """Compare every gradient of `result` with the reference and give a verdict per quantity."""
    bounds = errmodel.gradient_bounds(reference, claimed_precision)
    quantities = {name: _metrics(name, result.grads[name], reference.grads[name], bounds[name]) for name in PARAM_NAMES}
    overall = "roundoff" if all(q.verdict == "roundoff" for q in quantities.values()) else "defect"
    return Judgement(candidate or result.meta.get("candidate", ""), claimed_precision, overall, quantities)
