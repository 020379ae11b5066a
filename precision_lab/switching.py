"""Switches a rounding can flip: how likely each flip is, and what it does to a gradient on average and in spread.

A ReLU passes its gradient where its input is positive; a max pool routes it to the window's largest input.
Their backward follows a *decision* of the forward. Under a reduced format (TF32, bfloat16, float16) the input
of such a decision errs by a fraction of a percent, so a few in a thousand decisions go the other way, and each
such flip passes or blocks a whole gradient element: a jump, not a small perturbation. The sampled propagation
(precision_lab.sampled) therefore takes every decision from the float64 reference in its backward runs and adds
each flip as a Bernoulli event of its own probability: its mean and its standard deviation, drawn through the
same backward as every rounding. No flip is left to chance sampling (K runs would realise the rare ones too
seldom to estimate), and none is counted as certain.

The probability. The decision's input z errs by e, a sum of many roundings: sub-Gaussian with variance proxy V,
and the forward runs measure V̂ = mean Δₖ² over K runs. A flip needs e to cross −z, so given V̂,
P(flip) ≤ exp(−z²/(2V)); with V̂ = V·χ²_K/K (each Δₖ ~ N(0, V)), averaging over the estimate gives
p = (1 + z²/(K·V̂))^(−K/2) (the χ²_K moment generating function, as the sampled bound's own failure probability,
precision_lab.sampled), heavier-tailed than a Gaussian for the margin the estimate leaves.

Decisions whose flips are least likely are left out while their probabilities add up to at most EXCLUDED (a
union bound: with probability ≥ 1 − EXCLUDED none of them flips), so the runs carry only the flips that may
happen.

The scale. The runs treat every source as sub-Gaussian and bound a quantity by c·√(its variance proxy), so a
flip's draw has the scale of its centred Bernoulli's least variance proxy, J²·(1 − 2p)/(2·ln((1 − p)/p))
(`subgaussian_proxy`), not its variance J²·p(1 − p): a rare flip that happens moves its quantity by the whole
jump J, and with the variance a flip of p < 1/37 lies beyond c·√p·J at c = 6 (a right bfloat16 program's weight
gradient was 1.14× its bound so). The proxy is √(1/(2·ln(1/p)))·J: 0.19·J at p = 10⁻⁶, so c·√proxy covers a jump.

Decisions that read each other. A max pool of a ReLU's output (nothing else reading it) decides twice on the same
values: max(f(z)) = f(max z) for a monotone f. Judged one at a time, a window whose elements are all closed is a
tie at 0 that the reference routes to its first element, where the ReLU's frozen mask stops every jump the pool
adds: an element that opens passes the whole window's gradient and no model sees it. Such a pair is judged on z
together (ops.pooling.MaxPool2d.switch_flips_after_activation; sampled.activation_pools).
"""
from __future__ import annotations

import torch

#: the total probability of the flips left out of the runs (union bound), per switching layer: the failure
#: probability of the float32 bound's λ = 7 per sum at 2²¹ terms (precision_lab.roundoff.LAMBDA)
EXCLUDED = 1e-4


def flip_probability(margin: torch.Tensor, variance: torch.Tensor, samples: int) -> torch.Tensor:
    """p = (1 + margin²/(K·V̂))^(−K/2), at most ½, for each decision whose input is `margin` from the other branch
    and errs with the measured variance V̂ over K = `samples` runs (module docstring); 0 where nothing errs."""
    ratio = margin * margin / (samples * variance.clamp_min(torch.finfo(variance.dtype).tiny))
    p = torch.exp(-0.5 * samples * torch.log1p(ratio))
    return torch.where(variance > 0, p, torch.zeros_like(p)).clamp_(max=0.5)


def kept(probability: torch.Tensor) -> torch.Tensor:
    """The probabilities with the least likely decisions set to 0, as long as those add up to at most EXCLUDED."""
    flat, _ = torch.sort(probability.reshape(-1))
    cumulative = torch.cumsum(flat, 0)
    limit = torch.tensor(EXCLUDED, dtype=cumulative.dtype, device=cumulative.device)
    below = int(torch.searchsorted(cumulative, limit))
    if below >= flat.numel():
        return torch.zeros_like(probability)
    return probability * (probability >= flat[below])


def bernoulli(jump: torch.Tensor, probability: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, sub-Gaussian scale) of a change that is `jump` with `probability`, 0 otherwise (module docstring)."""
    return jump * probability, jump.abs() * torch.sqrt(subgaussian_proxy(probability))


def subgaussian_proxy(probability: torch.Tensor) -> torch.Tensor:
    """The least variance proxy of a centred Bernoulli(p): (1 − 2p) / (2·ln((1 − p)/p)), ¼ at p = ½, 0 at p = 0
    (Kearns & Saul 1998; optimal: Berend & Kontorovich 2013, Electron. Commun. Probab. 18(3))."""
    p = probability.clamp(min=torch.finfo(probability.dtype).tiny, max=0.5)
    proxy = (1.0 - 2.0 * p) / (2.0 * torch.log((1.0 - p) / p))
    proxy = torch.where(p >= 0.5 - 1e-12, torch.full_like(p, 0.25), proxy)
    return torch.where(probability > 0, proxy, torch.zeros_like(proxy))


def expected_flips(probability: torch.Tensor) -> float:
    """Σ p: how many of these decisions a candidate flips on average."""
    return float(probability.sum())


__all__ = ["EXCLUDED", "bernoulli", "expected_flips", "flip_probability", "kept", "subgaussian_proxy"]
