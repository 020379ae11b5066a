"""Comparison of a candidate's result with the float64 reference, quantity by quantity.

A quantity is the loss, the network output, or one parameter gradient (canonical layout).
`measure` gives every evidence number of one quantity against its error bound (precision_lab.
errmodel): max/mean absolute and relative error, error ÷ bound, ULPs, cosine similarity, sign
agreement, how many elements exceed the bound. The verdict it sets is provisional (`roundoff`
within the bound, else `defect`); the doctors (precision_lab.doctors) may then explain it.

Within the bound certifies rounding only where the bound is well below the quantity itself: a
bound as large as the tensor would accept a zeroed, halved or sign-flipped gradient (cosine 0
next to `roundoff`). A quantity within a bound whose 2-norm exceeds CERTIFIABLE_FRACTION of the
reference's 2-norm is `inconclusive`, with what would settle it. This applies to every claim: a
reduced-format claim's (tf32, bf16, fp16) worst-case operand bound exceeds the seed network's first-layer
gradients themselves, so it is `inconclusive` there, and a sign-flipped gradient is never `roundoff`
(docs/verdicts.md, "Certifiable bounds").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import formats
from .compute import Result, Trace


#: largest ‖bound‖₂ ÷ ‖reference‖₂ at which being within the bound certifies rounding. Within it,
#: ‖error‖₂ ≤ ½‖reference‖₂, so cosine ≥ √(1 − ¼) = 0.87 and every error as large as the tensor itself
#: (a zeroed, lost or sign-flipped gradient: ‖error‖ ≥ ‖reference‖) lies beyond the bound with a
#: factor-2 margin; a tighter fraction (0.1 would exclude a uniformly 10%-short gradient) needs bounds
#: the propagation model does not reach on every network yet (docs/verdicts.md, "Certifiable bounds").
CERTIFIABLE_FRACTION = 0.5

#: a sum of repeated values (a bias gradient behind a global pool, summed term by term) has a legitimate
#: error that is systematic, not random: up to half its own part (roundoff.DRIFT_MARGIN), a few percent of
#: the sum at 2·1024² terms. Where that part makes the bound exceed this fraction of those elements' norm,
#: a uniformly 10%-short gradient would sit inside it: such elements are not certified on the bound
DRIFT_CERTIFIABLE_FRACTION = 0.1


class ComparisonError(ValueError):
    """A result that cannot be compared (a missing gradient, a wrong size): names the quantity."""


@dataclass
class QuantityVerdict:
    """One quantity's verdict and the evidence behind it (errors against the float64 reference)."""

    quantity: str
    verdict: str
    max_abs_err: float
    mean_abs_err: float
    max_rel_err: float
    bound_ratio: float  # max over elements of |error| / bound at the claimed precision
    ulps: float  # max distance in units in the last place of the storage format
    cosine: float
    sign_agreement: float
    layout_fix: str | None = None
    format: str | None = None
    n_terms: int = 0
    size: int = 0
    exceeding: int = 0  # elements beyond the claimed bound
    second_ratio: float = 0.0  # the second-largest error ÷ bound (is the worst element alone?)
    bound_max: float = 0.0
    relu_flips: int = 0
    cause: str | None = None  # the named defect hypothesis, when one fits
    cause_slip: str | None = None  # the cause without its layers ('windows shifted by (0, 1) pixels (a padding offset)')
    cause_layers: tuple[str, ...] = ()  # the layers a layer-local cause slips in ('conv1',)
    evidence: str = ""
    format_bound_ratio: float | None = None  # max error ÷ the bound of the format that names it (reduced-precision)
    along_ratio: float | None = None  # the error's projection on the reference's direction ÷ its bound (reduced formats)
    along_resolution: float | None = None  # that bound ÷ ‖g‖: the smallest scaling of the gradient it could see
    settled_by: str | None = None  # an inconclusive quantity made roundoff elsewhere: "the float64 build" or the problems
    settled_ratios: dict | None = None  # what settled it: err64 ÷ err32, or error ÷ bound on each other problem
    problem: str | None = None  # the probe it was judged on, where a decision took it from one (None: requested)


def quantity_arrays(result: Result, reference: Trace) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(candidate, reference) float64 arrays for each quantity the result has, in canonical shapes."""
    who = result.meta.get("candidate", "the candidate")
    pairs = {"loss": (np.asarray(result.loss, np.float64), np.asarray(reference.loss, np.float64))}
    if result.output is not None:
        pairs["output"] = (same_size(result.output, reference.output, "output", who),
                           np.asarray(reference.output, np.float64))
    for name in reference.network.parameter_names:
        if name not in result.grads:
            raise ComparisonError(f"result of {who} has no gradient {name!r}")
        pairs[name] = (same_size(result.grads[name], reference.grads[name], name, who),
                       np.asarray(reference.grads[name], np.float64))
    return pairs


def same_size(got, ref, name: str, who: str = "the candidate") -> np.ndarray:
    got, ref = np.asarray(got, np.float64), np.asarray(ref)
    if got.size != ref.size:
        raise ComparisonError(f"{who}: {name} has {got.size} values (shape {got.shape}), expected {ref.size} "
                              f"(shape {ref.shape})")
    return got.reshape(ref.shape)  # a buffer of the right size: the layout doctor reads its order


def measure(name: str, got: np.ndarray, ref: np.ndarray, bound: np.ndarray, storage: str = "float32"
            ) -> QuantityVerdict:
    """Every evidence number of one quantity; the verdict is provisional (roundoff iff within bound)."""
    err = np.abs(got - ref)
    # an element the error model cannot bound (a reduced format's worst case through normalisations) is no evidence
    unbounded = ~np.isfinite(bound)
    ratio = np.where(unbounded, 0.0, err / np.where(unbounded, 1.0, bound))
    finite = bool(np.all(np.isfinite(got)))
    nonzero = ref != 0
    norms = norm(got) * norm(ref)
    q = QuantityVerdict(
        quantity=name, verdict="roundoff" if finite and float(ratio.max()) <= 1.0 else "defect",
        max_abs_err=float(err.max()), mean_abs_err=float(err.mean()),
        max_rel_err=float((err / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)).max()),
        bound_ratio=float(ratio.max()) if finite else math.inf,
        ulps=max_ulps(got, ref, storage) if finite else math.inf,
        cosine=dot(got, ref) / norms if norms > 0 and finite else float(np.array_equal(got, ref)),
        sign_agreement=float(np.mean(np.sign(got[nonzero]) == np.sign(ref[nonzero]))) if nonzero.any() else 1.0,
        size=int(ref.size), exceeding=int(np.sum(~(ratio <= 1.0))), bound_max=float(bound.max()),
        second_ratio=_second_largest(ratio) if ratio.size > 1 and finite else 0.0)
    if not finite:
        q.evidence = "non-finite values (NaN or inf)"
    elif q.verdict == "roundoff" and unbounded.any():
        q.verdict = "inconclusive"
        q.evidence = (f"the error model gives no finite bound at {int(unbounded.sum())} of {q.size} elements (its worst "
                      f"case leaves no relative accuracy there): neither rounding nor a defect is shown")
    elif q.verdict == "roundoff":
        certify(q, ref, bound, storage)
    return q


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b over every element, summed in this thread: the same bits on any machine. A BLAS dot splits a long sum
    across its threads (its last bits then follow the core count) and leaves them spinning for ~0.1 CPU-s after
    each call, a core taken from the program a diagnosis runs beside it (docs/results.md)."""
    return float(np.einsum("i,i->", np.ravel(a), np.ravel(b)))


def norm(a: np.ndarray) -> float:
    """‖a‖₂ over every element, summed as `dot` sums."""
    return math.sqrt(dot(a, a))


def _second_largest(values: np.ndarray) -> float:
    """The second largest value (two passes without a copy: np.partition copies and sorts a 16M-weight layer)."""
    flat = values.ravel()
    top = int(flat.argmax())
    return float(max(flat[:top].max(initial=-np.inf), flat[top + 1:].max(initial=-np.inf)))


def bound_fraction(ref: np.ndarray, bound: np.ndarray) -> float:
    """‖bound‖₂ ÷ ‖reference‖₂ (0 for a reference exactly zero: nothing to lose, any error is its own)."""
    size = norm(ref)
    with np.errstate(over="ignore"):  # a bound beyond 1e154 squares to inf: its norm is inf, a fraction that certifies nothing
        return norm(bound) / size if size > 0 else 0.0


def zero_to_reference_accuracy(ref: np.ndarray, bound: np.ndarray, storage: str = "float32") -> bool:
    """Whether the float64 reference is zero within its own rounding: ‖ref‖₂ ≤ (u₆₄ ÷ u)·‖bound‖₂.

    The bound is first order in the claimed unit roundoff u (γₙ ≈ nu, Higham 2002 §3.1, and every propagated
    part), so the reference's own float64 error is bounded by the same expression at u₆₄. A gradient exactly zero
    by structure (a convolution's bias in front of a training-mode batch norm, which removes every per-channel
    shift) comes out of float64 as noise of that size: there is no gradient to lose, as for ref = 0."""
    accuracy = formats.unit_roundoff("float64") / formats.unit_roundoff(storage)
    with np.errstate(over="ignore"):
        return norm(ref) <= accuracy * norm(bound)


def reference_accuracy(bound: np.ndarray, storage: str = "float32") -> float:
    """The largest error the float64 reference itself may carry where the claimed bound is `bound`: its largest
    element at u₆₄ instead of u (first order in u, zero_to_reference_accuracy). A candidate's error no larger is the
    reference's as much as the candidate's: no build, float32 or float64, can show it vanishing or persisting.
    Elements the error model cannot bound say nothing of it: the largest finite element's (0 where none is)."""
    bound = np.asarray(bound, np.float64)
    finite = bound[np.isfinite(bound)]
    largest = float(np.max(finite)) if finite.size else 0.0
    return largest * formats.unit_roundoff("float64") / formats.unit_roundoff(storage)


#: how `certify`'s evidence begins: a quantity within its bound, the bound too large against it to certify
TOO_LARGE_A_BOUND = "within a bound "


def certify(q: QuantityVerdict, ref: np.ndarray, bound: np.ndarray, storage: str = "float32") -> None:
    """A quantity within its bound stays `roundoff` only if the bound is below CERTIFIABLE_FRACTION of it, or the
    quantity is zero to the reference's own accuracy (zero_to_reference_accuracy)."""
    fraction = bound_fraction(ref, bound)
    if fraction > CERTIFIABLE_FRACTION and not zero_to_reference_accuracy(ref, bound, storage):
        q.verdict = "inconclusive"
        q.evidence = (f"{TOO_LARGE_A_BOUND}{fraction:.3g}× the quantity's own size (‖bound‖ ÷ ‖reference‖ > "
                      f"{CERTIFIABLE_FRACTION:g}): such a bound cannot tell rounding from a lost gradient; settle it "
                      "with the candidate's float64 build (command_float64), the default probes (a diagnosis settles it "
                      "where every probe certifies it) or a smaller problem")


def certify_repeated(q: QuantityVerdict, ref: np.ndarray, bound: np.ndarray, drifted: np.ndarray) -> None:
    """Elements whose bound is a repeated-value sum's drift certify rounding only below
    DRIFT_CERTIFIABLE_FRACTION of their own norm."""
    mask = np.asarray(drifted, bool).reshape(-1)
    values, bounds = np.asarray(ref, np.float64).reshape(-1)[mask], np.asarray(bound).reshape(-1)[mask]
    fraction = bound_fraction(values, bounds)
    if fraction > DRIFT_CERTIFIABLE_FRACTION:
        q.verdict = "inconclusive"
        q.evidence = (f"on {int(mask.sum())} element(s) that sum repeated values, within a bound {fraction:.3g}× their "
                      f"own size (equal terms added one by one stagnate: float32's own error there is systematic, up to "
                      f"half that bound; above {DRIFT_CERTIFIABLE_FRACTION:g} a 10%-short gradient would pass): settle it "
                      "with the candidate's float64 build (command_float64), the default probes or a smaller problem")


def max_ulps(got: np.ndarray, ref: np.ndarray, storage: str) -> float:
    """Max ULPs of `storage` at each element's magnitude, floored at the tensor's RMS magnitude.

    The floor keeps near-zero elements (cancelled sums) from counting ulps of a tiny number.
    """
    rms = float(np.sqrt(np.mean(ref * ref)))
    magnitude = np.where(np.abs(ref) < rms, np.copysign(rms, ref), ref)
    return float(np.max(formats.ulp_distance(got - ref + magnitude, magnitude, storage)))


def compare(result: Result, reference: Trace, bounds: dict, storage: str) -> dict[str, QuantityVerdict]:
    """Every quantity of `result` measured against the reference and its bound (certified as `certify` says)."""
    out = {}
    for name, (got, ref) in quantity_arrays(result, reference).items():
        q = measure(name, got, ref, bounds[name].bound, storage)
        q.n_terms, q.relu_flips = bounds[name].n, bounds[name].relu_flips
        if q.verdict == "roundoff" and bounds[name].drifted is not None:
            certify_repeated(q, ref, bounds[name].bound, bounds[name].drifted)
        if bounds[name].along is not None:
            along(q, got, ref, bounds[name].along)
        out[name] = q
    return out


def along(q: QuantityVerdict, got: np.ndarray, ref: np.ndarray, bound: float) -> None:
    """The error's projection on the reference's own direction ĝ = g/‖g‖ against its bound (errmodel's `along`):
    rounding moves a gradient every which way, so its projection there is a small part of it, while a scaled, partly
    lost or one-sample gradient moves along g itself. Beyond its bound the quantity is a `defect`, even where every
    element is within its own."""
    size = norm(ref)
    if size == 0 or not math.isfinite(q.bound_ratio):
        return
    projection = dot(got - ref, ref) / size
    q.along_ratio = abs(projection) / bound if bound > 0 else math.inf
    q.along_resolution = bound / size
    if q.along_ratio > 1.0 and q.verdict in ("roundoff", "inconclusive"):
        q.verdict = "defect"
        q.evidence = (f"the error along the gradient's own direction is {projection / size:+.3g} of its size, "
                      f"{q.along_ratio:.3g}× what rounding can do there ({bound / size:.3g}): a scaled or partly lost "
                      "gradient, not rounding")
