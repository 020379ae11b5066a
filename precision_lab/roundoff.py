"""The rounding-error model's scalar factors and its two ways of adding up errors.

For one sum s = Σ xᵢ·yᵢ of n terms computed at unit roundoff u, with S = Σ|xᵢ·yᵢ|:

* the deterministic bound |ŝ − s| ≤ γₙ·S, γₙ = nu/(1 − nu) (Higham 2002, Eq. 3.4 and §3.1);
* the probabilistic bound |ŝ − s| ≤ γ̃ₙ(λ)·S, γ̃ₙ(λ) = exp(λ√n·u + nu²/(1 − u)) − 1, which
  holds with probability ≥ Q(λ, n) = 1 − 2n·exp(−λ²(1 − u)²/2) when rounding errors are
  independent and of mean zero (Higham & Mary 2019, SIAM J. Sci. Comput. 41(5), Thm 2.4, 3.1);
  it is the bound verdicts use: it covers every summation order, sequential included;
* pairwise summation: γ_⌈log₂n⌉·S (Higham 2002, Eq. 4.6); blocked with block b:
  γ_(b + ⌈n/b⌉ − 2)·S (Blanchard, Higham & Mary 2020, SIAM J. Sci. Comput. 42(3), Eq. 2.3);
* reduced formats (tf32, fp16: u = 2⁻¹¹; bf16: u = 2⁻⁸) round the *operands* of a sum and
  accumulate in float32; an operand rounding error is at most r(x) = u_f·|x| + η_f/2 (η_f the
  subnormal spacing), independent and of mean zero per operand, so their effect on a sum is at
  most λ·√(2·Σ(r(x)²y² + x²r(y)²)) (Hoeffding's inequality on the operands, as Higham & Mary 2019, §2).

Where only summation orders are legitimate, `partial_sum_bound` is tighter and still holds for every order:
each rounding is u × a product or a partial sum, a zero term's product and addition are exact, and a partial
sum of any order lies in [−S₋, S₊] (the negative and positive terms' sums), so the Azuma–Hoeffding inequality
gives λₙ·u·√(k + 3)·max(S₊, S₋)·(1 + 2γₙ) for k nonzero terms (the martingale form of Ipsen & Zhou 2020),
with λₙ chosen to fail as rarely as γ̃ₙ(λ)·S does.

Repeated values break the probabilistic model's premise. Adding the same value c to a long running sum
rounds the same way every time within a binade of the sum (the error is c's residue on the sum's
grid), so the errors add up like n·u·S, not √n·u·S (stagnation; a sum of 2¹⁵ equal float32 terms
sequentially is ~5× the γ̃ₙ(λ)·S bound, of 2²¹ ~50×). It happens where a gradient is broadcast: a
bias gradient behind a global average pool or a mean loss is a sum of n equal terms (masked by a
ReLU: equal or zero), and a Fortran loop, a Rust iterator or GPU atomics add them one by one.
`column_drift` simulates that on the sum's own terms: the largest error of a sequential float32 sum
in several orders (raster, reversed, columns first, shuffled, 2 – 1024 lanes) and with the terms moved
by a few ulps; the own part is the larger of γ̃ₙ(λ)·S and DRIFT_MARGIN times it. `repeats` picks the
sums to simulate (terms that repeat or are near-constant); elsewhere the bound is unchanged.

Errors that enter a long sum from upstream are mean-zero but dependent (each depends on the
roundings within a few pixels): `sum_of_errors` bounds Σ cᵢeᵢ by the smaller of Σ|cᵢ|Eᵢ and
λ·√(χ*·Σcᵢ²Eᵢ²), Hoeffding's inequality for sums with a dependency graph of fractional
chromatic number χ* (Janson 2004, Random Struct. Alg. 24(3), Thm 2.1).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import formats

#: λ of Higham & Mary (2019): Q(7, 2²¹) ≥ 0.9999, i.e. the bound fails for fewer than 1 in 10⁴ sums
LAMBDA = 7.0

#: smallest spacing of each format (subnormals): the absolute part of an operand's rounding error
SUBNORMAL_SPACING = {"float64": 2.0 ** -1074, "float32": 2.0 ** -149, "tf32": 2.0 ** -149,
                     "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}

#: formats whose arithmetic accumulates in float32 but whose sum operands are rounded
ROUNDED_OPERANDS = formats.REDUCED_FORMATS


def gamma(n: int, u: float) -> float:
    """Deterministic γₙ = nu/(1 − nu) (Higham 2002, Lemma 3.1); inf when nu ≥ 1."""
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def probabilistic_gamma(n: int, u: float, lam: float = LAMBDA) -> float:
    """γ̃ₙ(λ) = exp(λ√n·u + nu²/(1 − u)) − 1 (Higham & Mary 2019, Thm 2.4)."""
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


def failure_probability(n: int, lam: float = LAMBDA, u: float = formats.UNIT_ROUNDOFF["float32"]) -> float:
    """1 − Q(λ, n) = 2n·exp(−λ²(1 − u)²/2): chance the probabilistic bound fails for one sum (Thm 3.1)."""
    return min(1.0, 2 * n * math.exp(-lam * lam * (1 - u) ** 2 / 2))


def pairwise_gamma(n: int, u: float) -> float:
    """γ_⌈log₂ n⌉: pairwise (cascade) summation (Higham 2002, Eq. 4.6)."""
    return gamma(max(1, math.ceil(math.log2(max(n, 2)))), u)


def blocked_gamma(n: int, u: float, block: int = 256) -> float:
    """γ_(b + ⌈n/b⌉ − 2): blocked summation, block b (Blanchard, Higham & Mary 2020, Eq. 2.3)."""
    return gamma(max(1, block + math.ceil(n / block) - 2), u)


def summation_factors(n: int, precision: str = "float32", lam: float = LAMBDA, block: int = 256) -> dict[str, float]:
    """Every bound factor (multiply by S) for an n-term sum at `precision`, with λ's failure probability."""
    u = formats.unit_roundoff(precision)
    return {"n": n, "u": u, "deterministic": gamma(n, u), "probabilistic": probabilistic_gamma(n, u, lam),
            "lambda": lam, "failure_probability": failure_probability(n, lam, u),
            "pairwise": pairwise_gamma(n, u), "blocked": blocked_gamma(n, u, block), "block": block}


def accumulation_precision(precision: str) -> str:
    """The format sums are accumulated in: float32 for the reduced formats (tensor cores), else itself."""
    formats.unit_roundoff(precision)  # raises for an unknown precision
    return "float32" if precision in ROUNDED_OPERANDS else precision


def partial_sum_scale(abs_sum: torch.Tensor, exact_sum: torch.Tensor, live_terms: torch.Tensor, n: int,
                      u: float) -> torch.Tensor:
    """u·√(k + 3)·M·(1 + 2γₙ): the variance proxy's root of the roundings of any summation order (partial_sum_bound)."""
    larger_sign = (abs_sum + exact_sum.abs()).mul_(0.5)
    return larger_sign.mul_((live_terms + 3).sqrt_()).mul_(u * (1.0 + 2.0 * gamma(n, u)))


def same_risk_lambda(n: int, lam: float) -> float:
    """λₙ with 2·exp(−λₙ²/2) = 2n·exp(−λ²/2): the partial-sum bound failing as often as γ̃ₙ(λ)·S does."""
    return math.sqrt(max(lam * lam - 2.0 * math.log(max(1, n)), 0.0)) if n > 1 else lam


def partial_sum_bound(abs_sum: torch.Tensor, exact_sum: torch.Tensor, live_terms: torch.Tensor, n: int,
                      u: float, lam: float) -> torch.Tensor:
    """The own rounding of sums of n terms from what any order's partial sums can be: λₙ·u·√(k + 3)·M·(1 + 2γₙ).

    A summation order (sequential, pairwise, blocked, lanes, split-K, FMA or not) rounds once per product and
    once per addition; a zero term's product and its addition are exact (x·0 = 0, s + 0 = s), so of the
    k = `live_terms` nonzero terms come at most 2k − 1 roundings. Each is δ·v with |δ| ≤ u and v a product
    |xᵢyᵢ| or a partial sum of a subset of the terms, and a subset's sum lies in [−S₋, S₊] (S₊ the positive
    terms' sum, S₋ the negative ones' magnitude); the computed partial sums differ from it by at most γₙ·S.
    With M = max(S₊, S₋) = (S + |s|)/2 (S = Σ|terms|, s the exact sum) and Σ products² ≤ S² ≤ 4M², the
    roundings' squared bounds add to at most (k + 3)·M²·(1 + 2γₙ)², and the Azuma–Hoeffding inequality
    for mean-zero roundings taken in sequence gives |ŝ − s| ≤ λₙ·u·√(k + 3)·M·(1 + 2γₙ), failing with
    probability ≤ 2·exp(−λₙ²/2) (Higham & Mary 2019's model; the martingale form of Ipsen & Zhou 2020, SIAM J.
    Matrix Anal. Appl. 41(4)). λₙ = same_risk_lambda(n, λ) makes that the failure probability of γ̃ₙ(λ)·S,
    2n·exp(−λ²/2) (Higham & Mary's Thm 3.1 takes a union over the n terms; this inequality needs none).
    It is below γ̃ₙ(λ)·S where terms are zero (ReLU masks, max-pool routing: √(n/k)), where their signs
    balance (S ÷ M up to 2) and by λ ÷ λₙ (1.3 at n = 2¹⁵). Terms too small for a partial sum of size M to
    hold (below absorption_threshold) round the same way again and again; callers add their absorbed_mass.
    It holds for summation orders only: an algorithm
    that transforms the terms first (Winograd, FFT) rounds transformed values that zeros do not spare, so
    callers add their scales where one is legitimate. Returns the smaller of the two bounds.
    """
    scale = partial_sum_scale(abs_sum, exact_sum, live_terms, n, u)
    return torch.minimum(scale.mul_(same_risk_lambda(n, lam)), probabilistic_gamma(max(1, n), u, lam) * abs_sum)


def absorption_threshold(abs_sum: torch.Tensor, exact_sum: torch.Tensor, n: int, u: float) -> torch.Tensor:
    """2u·M·(1 + 2γₙ): a term below it may be absorbed, whole or in part, by a partial sum as large as M allows."""
    return (abs_sum + exact_sum.abs()).mul_(u * (1.0 + 2.0 * gamma(n, u)))


def absorbed_mass(terms: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Σ|t| over the terms (rows) below their column's absorption_threshold: added deterministically to the
    partial-sum bound. A term smaller than an ulp of the running sum is rounded away (or up to an ulp) always in
    the same direction, so those roundings are not mean-zero (Higham & Mary's premise); each still errs by at
    most |t|, since the running sum itself is a float closer to s + t than |t|."""
    magnitude = terms.abs()
    return torch.where(magnitude < threshold, magnitude, torch.zeros((), dtype=magnitude.dtype)).sum(dim=0)


def order_free_bound(terms: torch.Tensor, live_terms: torch.Tensor, u: float, lam: float = LAMBDA,
                     dims: tuple[int, ...] = (0,)) -> torch.Tensor:
    """The own part of each sum over `dims` of `terms` when only summation orders compute it: partial_sum_bound
    plus the absorbed_mass of its terms, summed in float64 without a float64 copy of the terms (a bias gradient
    at 1024² is 2M terms a channel). `live_terms`: per sum, the terms the candidate may hold nonzero (at least
    the nonzero ones)."""
    n = math.prod(terms.shape[d] for d in dims)
    magnitude = terms.abs()
    abs_sum = magnitude.sum(dim=dims, keepdim=True, dtype=torch.float64)
    exact_sum = terms.sum(dim=dims, keepdim=True, dtype=torch.float64)
    threshold = absorption_threshold(abs_sum, exact_sum, n, u)
    # in the terms' format, rounded up: a term at the threshold's float64 value is never left out
    limit = threshold.to(magnitude.dtype)
    limit = torch.where(limit.double() < threshold, torch.nextafter(limit, torch.full_like(limit, math.inf)), limit)
    absorbed = magnitude.masked_fill_(magnitude >= limit, 0.0).sum(dim=dims, keepdim=True, dtype=torch.float64)
    own = partial_sum_bound(abs_sum, exact_sum, live_terms.double().reshape(abs_sum.shape), n, u, lam).add_(absorbed)
    return own.reshape(live_terms.shape)


def dependency_count(radius: int | None, terms_per_group: int, coupled_terms: int | None = None) -> int:
    """χ* bound for the terms of a sum over an image grid whose error at p depends on roundings within
    `radius` pixels of p: elements farther apart than 2·radius share no rounding event, so the dependency
    graph has degree Δ ≤ (4·radius + 1)² − 1 and fractional chromatic number χ* ≤ Δ + 1 (Janson 2004).
    `radius` None means every term of a group (one image, one sample) may depend on every other.
    `coupled_terms`: the whole sum's term count where the errors are shared across the groups (a training-mode
    batch norm's statistics reach every sample): every term may then depend on every other, χ* = n, and
    sum_of_errors' Hoeffding side, λ·√(n·Σc²E²) ≥ λ·Σ|c|E (Cauchy–Schwarz), gives way to the deterministic sum."""
    if coupled_terms is not None:
        return max(1, coupled_terms)
    if radius is None:
        return max(1, terms_per_group)
    return min((4 * radius + 1) ** 2, max(1, terms_per_group))


def sum_of_errors(deterministic: torch.Tensor, squares: torch.Tensor, chi: int, lam: float) -> torch.Tensor:
    """Bound on Σ c_p·e_p with |e_p| ≤ E_p mean-zero errors: min(Σ|c|E, λ·√(χ*·Σ c²E²)).

    The second is Hoeffding's inequality for sums with a dependency graph (Janson 2004, Thm 2.1),
    failing with probability ≤ 2·exp(−λ²/2).
    """
    return torch.minimum(deterministic, lam * torch.sqrt(chi * squares))


#: the simulated orders' largest error × this is the own part of a sum of repeated values: the other
#: legitimate orders and the candidate's own terms moved by 3 ulps stay within 1.14× the simulated worst on
#: every family `benchmarks/repeated_values.py` simulates (constant, masked constant, two values,
#: near-constant, flat background; 2¹⁵ – 2²¹ terms): 2 leaves that margin and more
DRIFT_MARGIN = 2.0

#: fixed seed of the shuffled order (GPU atomics add in whatever order the threads arrive)
DRIFT_SHUFFLE_SEED = 12345

#: lane counts simulated: k accumulators over interleaved terms, then added (SIMD lanes × unrolling, tiles,
#: split sums). Each k puts the partial sums on other binades, where a repeated value's residue differs:
#: the powers of two shift by whole binades, 3, 5, 6, 7 and 12 by fractions of one (3 lanes alone
#: exceeded 2× the powers-of-two worst for ~1% of constants)
DRIFT_LANES = (2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64, 128, 256, 512, 1024)

#: the terms are also simulated moved by these many ulps, all in the same direction: the candidate's
#: values are a few ulps off the reference's, and a binade whose rounding then changes sign can undo a
#: cancellation the reference's values enjoyed (+2 ulps took a raster sum from 0.4 to 2.5× the unmoved worst)
DRIFT_ULP_SHIFTS = (-2, -1, 1, 2)

#: columns simulated at once (each pass copies n × this many terms)
DRIFT_BLOCK = 16

#: a factor's entries "repeat" when at least this fraction of a sample of DRIFT_SAMPLE of them (zeros
#: left out: they add exactly) share their value with another: one value carrying a fraction f of n terms
#: drifts by ~0.24·f·n·u·S, past half of γ̃ₙ(λ)·S once f > 15/√n (1% at 2²¹ terms)
REPEAT_FRACTION = 0.005
DRIFT_SAMPLE = 4096


def column_drift(columns, grid: tuple | None = None, precision: str = "float32"):
    """Largest |sequential sum − exact sum| of each column of `columns` (n, E), over the orders a loop or
    atomics use: raster, reversed, the last two axes of `grid` (n = Π grid, raster order) swapped
    (column-major loops), one shuffled order, the positive and the negative terms in two accumulators
    (where repeated values of each sign stagnate apart), and DRIFT_LANES interleaved accumulators; and, in raster
    order and in lanes, over the terms moved by DRIFT_ULP_SHIFTS ulps.

    The terms are rounded to the accumulation format and added in it; the exact sum is that of the same
    terms in float64 (exact for float32 terms: 24 + log₂n bits). numpy reduces a 2-D array along axis 0
    row after row (sequentially, for every column at once); a single column is given a zero partner,
    which adds nothing. For a float64 claim it returns the deterministic γₙ·S: the terms the trace keeps
    are float32, and summed in float64 they never stagnate, where the candidate's 53-bit ones can.
    Returns float64 (E,).
    """
    n, width = columns.shape
    if accumulation_precision(precision) != "float32":
        return gamma(n, formats.unit_roundoff(precision)) * np.abs(np.asarray(columns, np.float64)).sum(axis=0)
    drift = np.zeros(width)
    if n < 2:
        return drift
    index_type = np.int32 if n < 2 ** 31 else np.int64
    shuffle = np.random.default_rng(DRIFT_SHUFFLE_SEED).permutation(n).astype(index_type)

    def lane_orders(block):
        sums = [np.add.reduce(block, axis=0)]
        for lanes in DRIFT_LANES:
            if lanes * 2 > n:
                break
            whole = n - n % lanes
            lane_sums = np.add.reduce(block[:whole].reshape(-1, lanes, block.shape[1]), axis=0)
            sums.append(np.add.reduce(np.concatenate([lane_sums, block[whole:]]), axis=0))
        return sums

    def worst(block, sums):
        exact = block.astype(np.float64).sum(axis=0)
        return np.max([np.abs(total.astype(np.float64) - exact) for total in sums], axis=0)

    for first in range(0, width, DRIFT_BLOCK):
        block = np.asarray(columns[:, first:first + DRIFT_BLOCK], np.float32)
        if block.shape[1] == 1:
            block = np.concatenate([block, np.zeros_like(block)], axis=1)
        zero = np.float32(0)
        signs_apart = (np.add.reduce(np.where(block > 0, block, zero), axis=0)
                       + np.add.reduce(np.where(block < 0, block, zero), axis=0))
        sums = lane_orders(block) + [np.add.reduce(block[::-1], axis=0), np.add.reduce(block[shuffle], axis=0),
                                     signs_apart]
        if grid is not None and len(grid) >= 2:
            sums.append(np.add.reduce(np.swapaxes(block.reshape(*grid, -1), -2, -3).reshape(n, -1), axis=0))
        found = worst(block, sums)
        for shift in DRIFT_ULP_SHIFTS:
            moved = block
            for _ in range(abs(shift)):
                moved = np.nextafter(moved, np.float32(np.inf if shift > 0 else -np.inf))
            moved = np.where(block == 0, block, moved)  # zeros stay zeros: they add exactly
            found = np.maximum(found, worst(moved, lane_orders(moved)))
        drift[first:first + DRIFT_BLOCK] = found[:min(DRIFT_BLOCK, width - first)]
    return drift


def with_drift(own: torch.Tensor, drift) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(own, DRIFT_MARGIN × drift), where the drift won): a sum's own part with its simulated drift."""
    # made on own's device outright (a constructor without a device would follow a default device set elsewhere)
    scaled = DRIFT_MARGIN * torch.as_tensor(np.asarray(drift, np.float64), dtype=own.dtype, device=own.device)
    return torch.maximum(own, scaled), scaled > own


def as_terms(values: torch.Tensor, precision: str = "float32"):
    """A tensor's values as the accumulation format holds them, in a numpy array on the CPU."""
    torch_dtype = torch.float32 if accumulation_precision(precision) == "float32" else torch.float64
    return values.detach().to("cpu", torch_dtype).contiguous().numpy()


def sequential_drift(terms: torch.Tensor, precision: str = "float32") -> torch.Tensor:
    """`column_drift` of each row of `terms` (rows, ...): the remaining axes are summed (for a bias
    gradient: batch, H, W, in that raster order). float64 (rows,) on the CPU."""
    columns = as_terms(terms.reshape(terms.shape[0], -1).T, precision)
    return torch.from_numpy(column_drift(columns, tuple(terms.shape[1:]), precision))


def repeats(values: torch.Tensor, n: int, precision: str = "float32") -> bool:
    """Whether a factor's nonzero entries repeat (REPEAT_FRACTION of a sample share a value) or are
    near-constant (their spread below 2u·n·|mean|, the spacing of an n-term running sum of them): in a
    sum of n products, only where both factors do can the products stagnate."""
    flat = values.detach().reshape(-1)
    if flat.numel() > DRIFT_SAMPLE:
        index = torch.from_numpy(np.random.default_rng(DRIFT_SHUFFLE_SEED).choice(flat.numel(), DRIFT_SAMPLE,
                                                                                 replace=False)).to(flat.device)
        flat = flat[index]
    sample = flat.to("cpu", torch.float32).numpy()
    sample = sample[sample != 0]
    if sample.size < 2:
        return False
    _, inverse, counts = np.unique(sample, return_inverse=True, return_counts=True)
    if np.mean(counts[inverse] > 1) >= REPEAT_FRACTION:
        return True
    mean = float(np.mean(sample.astype(np.float64)))
    u = formats.unit_roundoff(accumulation_precision(precision))
    return mean != 0 and float(np.std(sample.astype(np.float64))) <= 2 * u * n * abs(mean)


def operand_rounding(x: torch.Tensor, precision: str, scale: float = 1.0) -> torch.Tensor:
    """r(x) = u_f·|x| + η_f/(2·scale): the largest error of rounding x to `precision` (zero if not rounded); `scale`:
    what x was multiplied by before the rounding and divided by after (a float16 program's loss scale, on gradients)."""
    if precision not in ROUNDED_OPERANDS:
        return torch.zeros_like(x)
    return formats.unit_roundoff(precision) * x.abs() + SUBNORMAL_SPACING[precision] / (2 * scale)


def rounding_term(op, x: torch.Tensor, y: torch.Tensor, precision: str, lam: float) -> torch.Tensor | float:
    """λ·√(2·Σ(r(x)²y² + x²r(y)²)): rounded operands' effect on the sum op(x, y) (Hoeffding); 0 when not rounded."""
    if precision not in ROUNDED_OPERANDS:
        return 0.0
    rx, ry = operand_rounding(x, precision), operand_rounding(y, precision)
    return lam * torch.sqrt(2 * (op(rx * rx, y * y) + op(x * x, ry * ry)))
