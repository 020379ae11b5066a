"""The defect doctor: named hypotheses (doctors.hypotheses) recomputed in float64 and tested against the
bound; and gradients never computed (all zero). The cause is a hypothesis that explains every failing
quantity, never the one that explains most."""
from __future__ import annotations

import math

import numpy as np

from .. import formats
from ..compute import Result, Trace
from ..findings import Finding
from .budget import recompute_allowed
from .hypotheses import Slip, hypotheses


#: a local hypothesis is computed from the reference's float32-stored intermediates: it may differ
#: from its exact float64 value by 2u₃₂ of S per operand, added to the bound it is tested against
STORED_SLACK = 2 * formats.UNIT_ROUNDOFF["float32"]


#: share of each element's discrepancy a fitting hypothesis may leave unexplained: the reference's bound does not
#: cover the hypothesised computation's own rounding (a missing ReLU mask sends gradients down paths the correct
#: network's sums never take), so a residual of 1% of what the hypothesis explains is allowed beside the bound
UNEXPLAINED_SHARE = 0.01


def _fit_ratio(got, expected, bound, abs_sum=None, reference=None) -> float:
    slack = 0.0 if abs_sum is None else STORED_SLACK * np.asarray(abs_sum)
    if reference is not None:
        slack = slack + UNEXPLAINED_SHARE * np.abs(got - reference)
    return float(np.max(np.abs(got - expected) / (bound + slack)))


def defects(quantities, result: Result, reference: Trace, pairs, bounds) -> list[Finding]:
    """Test named hypotheses against every quantity still a defect; name the one that fits."""
    failing = [n for n, q in quantities.items() if q.verdict == "defect" and math.isfinite(q.bound_ratio)]
    if not failing:
        return []
    tested, findings, fitted = [], [], {}
    for order, (hypothesis, expected, covers, local, *own) in enumerate(
            hypotheses(reference, pairs, failing, recompute_allowed(reference, None))):
        reorders = own[0] if own else {}  # a hypothesis that reorders elements reads their bounds reordered
        fits = {}
        for name in covers:
            if name not in failing or name not in expected:
                continue
            got = pairs[name][0]
            bound = bounds[name].bound[reorders[name]] if name in reorders else bounds[name].bound
            ratio = _fit_ratio(got, expected[name], bound, bounds[name].abs_sum if local else None, pairs[name][1])
            fits[name] = ratio
        if not fits:
            continue
        explained = sorted(n for n, r in fits.items() if r <= 1.0)
        tested.append({"hypothesis": str(hypothesis), "explains": explained,
                       "best_ratio": min(fits.values()), "quantities": len(fits)})
        for name in explained:
            layers = (hypothesis.layer,) if isinstance(hypothesis, Slip) else ()
            findings.append(Finding("hypothesis", name, name=str(hypothesis),
                                    evidence=f"fits '{hypothesis}' (error ÷ bound {fits[name]:.3g} against it)",
                                    numbers={"ratio": fits[name], "order": order, "layers": layers,
                                             "slip": getattr(hypothesis, "slip", str(hypothesis))}))
            fitted.setdefault(name, findings[-1])
    findings.append(Finding("hypotheses", numbers={"tested": tested}))
    # the cause of the whole problem: what every defect quantity's first fitting hypothesis says, read from the
    # findings above and the zero-gradient doctor's (a quantity's own cause), never from words
    defective = [n for n, q in quantities.items() if q.verdict == "defect"]
    own = {n: quantities[n].cause for n in defective if quantities[n].cause}
    causes = [own.get(n) or (fitted[n].name if n in fitted else None) for n in defective]
    unexplained = [n for n in failing if n not in fitted and n not in own]
    if tested:
        best = max(tested, key=lambda t: (len(t["explains"]), -t["best_ratio"]))
        shared = _one_slip_in_every_layer([(fitted[n].numbers["layers"], fitted[n].numbers["slip"]) if n in fitted
                                           else (None, own.get(n)) for n in defective])
        if len(set(causes)) == 1 and None not in causes:
            findings.append(Finding("cause", name=causes[0]))  # one cause (first fitted, or zero gradients) for all
        elif shared:
            findings.append(Finding("cause", name=shared))
        elif best["explains"] and set(defective) <= set(best["explains"]):
            findings.append(Finding("cause", name=best["hypothesis"],
                                    evidence=f"defect doctor: '{best['hypothesis']}' fits {', '.join(best['explains'])}"))
        elif best["explains"]:
            # one tensor of several is no cause: name it as a partial fit only
            findings.append(Finding("note", evidence=f"defect doctor: cause unknown; '{best['hypothesis']}' fits "
                                                     f"only {', '.join(best['explains'])} of {', '.join(defective)}"))
    if unexplained:
        findings.append(Finding("note", evidence=f"defect doctor: no named hypothesis fits {', '.join(unexplained)} "
                                                 f"({len(tested)} tested)"))
    return findings


def _one_slip_in_every_layer(fits) -> str | None:
    """'conv1, conv2: <slip>' when the failing quantities' fits (layers, slip), in network order, are the same
    layer-local slip in several layers: one cause, the same mistake made wherever that code runs."""
    if any(not layers or slip is None for layers, slip in fits) or len({slip for _, slip in fits}) != 1:
        return None
    named = list(dict.fromkeys(layer for layers, _ in fits for layer in layers))
    return f"{', '.join(named)}: {fits[0][1]}" if len(named) > 1 else None


def zero_gradients(quantities, pairs, bounds, storage: str = "float32") -> list[Finding]:
    """A parameter gradient that is exactly zero in every element where the reference has non-zero ones.

    Rounding makes an exact zero only by an exact cancellation; every element of a tensor at once is a
    gradient never computed (a layer off the tape, frozen, or its buffer never written), whatever the bound.
    Not where the reference is zero to its own accuracy (compare.zero_to_reference_accuracy): a gradient zero by
    structure (a convolution's bias in front of a training-mode batch norm, an attention's key bias) is exactly
    zero in a program that knows it, and noise in the float64 reference."""
    from ..compare import zero_to_reference_accuracy

    layers = {}
    for name in quantities:
        if name in ("loss", "output") or name not in pairs:
            continue
        got, ref = pairs[name]
        if ref.size >= 2 and np.count_nonzero(ref) >= 2 and not np.any(got) \
                and not zero_to_reference_accuracy(ref, bounds[name].bound, storage):
            layers.setdefault(name.rsplit(".", 1)[0], []).append(name)
    findings = []
    for layer, names in layers.items():
        cause = (f"{layer} received no gradient ({', '.join(names)} all zero): is it on the tape / marked "
                 f"trainable?")
        findings += [Finding("zero-gradient", name, "defect", cause, "every element exactly zero, the reference's "
                             "are not", {"nonzero_in_reference": int(np.count_nonzero(pairs[name][1]))})
                     for name in names]
    return findings


