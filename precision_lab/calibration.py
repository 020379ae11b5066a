"""The lab judging itself: the zoo's confusion matrix and the empirical noise floor.

These read the candidates (precision_lab.candidates) and the verdicts (precision_lab.verdict),
which never read them back: the flow stays one way.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from . import errmodel
from .candidates import registry
from .compare import quantity_arrays
from .problem import Problem
from .doctors.layout import same_reading
from .reference import reference as make_reference
from .decision import decide
from .verdict import VERDICTS, judge


def judge_zoo(problem: Problem, device: str | torch.device = "cpu", names: list[str] | None = None,
              **judge_options) -> pd.DataFrame:
    """Judge every built-in candidate with an expected verdict that applies to the problem's network:
    one row each.

    Columns: candidate, family, expected, expected_detail, verdict, detail, correct, worst_ratio, cause, and
    fingerprint_max, the largest correlation with an emulated coarser format, and fingerprint_margin, the least
    threshold − correlation (≤ 0 names a format; NaN where no fingerprint was computed).
    `correct` needs the verdict and, when one is expected, the transform or format it names.
    """
    trace = make_reference(problem, device)
    # a layout is named right when it reads every weight gradient as the expected one does (degenerate kernels)
    weight_shapes = [problem.network.param_shapes[n] for n in problem.network.weight_names]
    rows = []
    for candidate in registry().values():
        if (candidate.expected is None or not candidate.supports(device) or not candidate.applies_to(problem.network)
                or (names and candidate.name not in names)):
            continue
        # one problem, no probes: the decision of that problem alone (a probe's false alarms are counted one by one)
        judgement = decide(judge(candidate.compute(problem, "float32", device), trace, candidate.claimed_precision,
                                 candidate.name, **judge_options), probed=False).judgement()
        detail = judgement.layout_fix or judgement.format
        correct = candidate.accepts(judgement.verdict) and (candidate.expected_detail is None or (
            detail is not None and same_reading(candidate.expected_detail, detail, weight_shapes)))
        rows.append({"candidate": candidate.name, "family": candidate.family, "expected": candidate.expected,
                     "expected_detail": candidate.expected_detail, "verdict": judgement.verdict, "detail": detail,
                     "correct": correct, "worst_ratio": max(q.bound_ratio for q in judgement.quantities.values()),
                     "cause": judgement.cause,
                     "fingerprint_max": max((row["correlation"] for row in judgement.fingerprint), default=float("nan")),
                     "fingerprint_margin": min((row["threshold"] - row["correlation"] for row in judgement.fingerprint),
                                               default=float("nan"))})
    return pd.DataFrame(rows)


def confusion_matrix(table: pd.DataFrame) -> pd.DataFrame:
    """Expected verdict (rows) × verdict given (columns) counts from `judge_zoo`'s table."""
    return pd.crosstab(table["expected"], table["verdict"]).reindex(index=list(VERDICTS), columns=list(VERDICTS),
                                                                    fill_value=0)


def noise_floor(problem: Problem, device="cpu", reference=None, members: tuple[str, ...] | None = None) -> pd.DataFrame:
    """An ensemble of legitimate float32 computations and their spread, beside the model's bound.

    One row per (quantity, member) with the member's max |error| and error ÷ bound against the
    float64 reference, plus a row per quantity for ``member="ensemble-spread"``: the largest
    element-wise spread (max − min over members) and its ratio to the bound.
    """
    reference = reference if reference is not None else make_reference(problem, device)
    bounds = errmodel.error_bounds(reference, "float32")
    legit = floor_members(problem.network, device, members)
    names = errmodel.quantities(problem.network)
    rows, stacks = [], {name: [] for name in names}
    for candidate in legit:
        pairs = quantity_arrays(candidate.compute(problem, "float32", device), reference)
        for name, (got, ref) in pairs.items():
            stacks[name].append(got)
            rows.append(_floor_row(name, candidate.name, np.abs(got - ref), bounds[name]))
    for name, stack in stacks.items():
        if stack:
            spread = np.ptp(np.stack(stack), axis=0)
            rows.append(_floor_row(name, "ensemble-spread", spread, bounds[name]))
    return pd.DataFrame(rows)


#: the ensemble's size: requested members that do not apply to a network are replaced by others up to it
FLOOR_MEMBERS = 5


def floor_members(network, device="cpu", members: tuple[str, ...] | None = None) -> list:
    """The legitimate float32 candidates of the noise floor: the requested ones that apply to `network` (all when
    None), topped up to FLOOR_MEMBERS with other legitimate ones that apply (a batch norm in training rules out
    micro-batching; a network without a 3×3 convolution, the hand-written convolution algorithms).

    A spread needs two members: fewer is a ValueError naming the ones found."""
    usable = [c for c in registry().values() if c.family == "legitimate" and c.claimed_precision == "float32"
              and c.supports(device) and c.applies_to(network)]
    chosen = [c for c in usable if members is None or c.name in members]
    chosen += [c for c in usable if c not in chosen][:max(0, FLOOR_MEMBERS - len(chosen))]
    if len(chosen) < 2:
        raise ValueError(f"noise floor needs at least 2 legitimate float32 members for {network.name}, found "
                         f"{[c.name for c in chosen]}")
    return chosen


def _floor_row(name: str, member: str, deviation: np.ndarray, bound: errmodel.QuantityBound) -> dict:
    return {"quantity": name, "member": member, "max_abs_err": float(np.max(deviation)),
            "bound_ratio": float(np.max(deviation / bound.bound)), "bound_max": bound.max, "n_terms": bound.n}
