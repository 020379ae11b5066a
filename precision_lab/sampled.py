"""Sampled propagation: the upstream part of every bound from the rounding errors' own statistics.

`errmodel` propagates an upstream error through conv2d and linear as |W|·E, as if every error had
the sign that adds up. Rounding errors do not: each sum's error is a sum of independent, mean-zero
roundings (Higham & Mary 2019, SIAM J. Sci. Comput. 41(5), §2–3), so through a layer their effects
cancel as the signed weights make them. This module measures that cancellation instead of assuming
it away:

* every rounding source of the forward and backward — each sum of conv2d, linear and avg_pool2d, each
  add, each activation's evaluation, the loss's gradient — is given a Gaussian draw of the scale σ its
  Higham & Mary bound has before λ (σ = γ̃ₙ(λ)·S / λ ≥ √n·u·S for a sum of n terms with S = Σ|terms|,
  since γ̃ₙ(λ) = exp(λ√n·u + nu²/(1 − u)) − 1 ≥ λ√n·u; u·|y| for one rounding; the activation's
  evaluation bound of ops/pointwise.py); a 3×3 stride-1 convolution's output at the larger of that and
  Winograd's own scale (conv.winograd_bound), since a legitimate implementation may compute it so; the sums
  of every other convolution and of linear layers, which only summation orders compute, at their partial
  sums' scale (roundoff.partial_sum_scale = u·√(k + 3)·max(S₊, S₋)·(1 + 2γₙ) for k nonzero terms, the
  variance proxy's root of the Azuma–Hoeffding bound roundoff.partial_sum_bound; or γ̃ₙ(λ)·S/λ if smaller);
* the float64 network is run K times with these draws added where they arise (each layer's output and
  each input gradient), so every draw travels through the signed weights, the ReLU masks and the
  max-pool routing it meets, and the same draw reaches every quantity it affects (the dependence that
  really exists, no dependency count needed);
* the quantity's first-order error is a sum of independent sub-Gaussian sources with variance proxy V;
  each run's deviation Δₖ from the reference is N(0, V) under the same coefficients, so with
  V̂ = mean Δₖ², P(|error| > c·√V̂) ≤ E[2·exp(−c²V̂/2V)] = 2·(1 + c²/K)^(−K/2) (the moment generating
  function of a χ²_K variable): 1.1·10⁻⁶ per element at K = 16, c = 9 (SAMPLES, FACTOR).

A reduced format's operand rounding is drawn on the operands themselves (`SampledOp`): an op's float inputs and the
parameters it names (`Op.rounded_params`) get t + r(t)·ξ once per run, read by its forward and backward alike, as
the candidate reads the same rounded value in both; |δ| ≤ r(t) makes that rounding sub-Gaussian with proxy r(t)²
(Hoeffding's lemma), so the argument above holds for it. An attention block's products read its own intermediates
(q, k, v, the weights): those are drawn where the block computes them (`Op.forward_rounded`), one draw per element
and run, so every query that reads a key reads the same rounded key, as in the candidate. errmodel keeps those runs for the loss and the output only
(FORWARD_QUANTITIES): the forward is continuous in every draw, while a ReLU a reduced format flips passes or blocks a
whole gradient element, a jump too rare in K runs to estimate (docs/error-model.md, "Normalisation").

A rounding shared by a group of elements (a normalisation's mean, its variance) is one draw per group
(`ops.SharedDraw`) reaching each element through its signed coefficient, so its effects add coherently as they do.
Each op draws its own scales (`Op.sampled_forward_scale`, `Op.sampled_backward_scales`, and the loss's
`sampled_grad_scale`, in precision_lab.ops); this module only runs them.

The quantity's own last rounding stays deterministic (errmodel's own part) and is added; for every quantity
the sampled upstream part replaces errmodel's |W|·E where it is smaller (both hold with high probability: so
does the smaller, with the two failure probabilities added). ReLU flips and max-pool switches are realised by the
runs as the draws cause them; the draws are at least as large as the roundings they stand for. Not
drawn: the sum where a tensor's gradients from several readers meet (one rounding per element at a skip).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from . import formats, roundoff
from .ops import OPS, Op, SharedDraw

#: runs of the float64 network with sampled roundings (K): each costs one float64 forward and backward
SAMPLES = 16
#: c: the bound is c·√(mean Δₖ²); 2·(1 + c²/K)^(−K/2) = 1.1e-6 at K = 16, c = 9 (module docstring), the
#: order of errmodel's own per-sum failure probability 2n·exp(−λ²/2) at λ = 7, n ≈ 10⁴
FACTOR = 9.0
#: sampled only where batch·H·W is at most this: a 128² problem up to batch 4 (a classifier that takes only
#: 128² gets its batch-3 probe at 128² too); K float64 runs of the seed network at 2·64² take 4 s on 2 busy
#: CPU cores, at 2·256² 31 s; above it errmodel's bound stands alone (the seed scale's figures are errmodel's)
ELEMENT_LIMIT = 4 * 128 * 128
#: the quantities the forward alone computes: continuous in every rounding the runs draw (a flipped ReLU or a switched
#: max-pool moves its output by at most the error that flipped it), so K runs estimate them for any claim
FORWARD_QUANTITIES = ("loss", "output")


def failure_probability(samples: int = SAMPLES, factor: float = FACTOR) -> float:
    """2·(1 + c²/K)^(−K/2): chance one element's error exceeds c·√(mean Δₖ²) (module docstring)."""
    return 2.0 * (1.0 + factor * factor / samples) ** (-samples / 2)


def applies(trace, precision: str) -> bool:
    """Sampled where the problem is small; for a reduced format only where every rounded operand is an op's input or
    parameter (an attention block rounds intermediates of its own: errmodel's operand model stands there)."""
    problem = trace.problem
    if problem is None:
        return False
    if precision in formats.REDUCED_FORMATS and any(_unrounded_inside(OPS[layer.op]) for layer in problem.network.layers):
        return False
    return problem.batch * problem.height * problem.width <= ELEMENT_LIMIT


def _unrounded_inside(op) -> bool:
    """An op whose products read intermediates of its own that its sampled runs cannot round (no forward_rounded)."""
    return op.rounds_inside and type(op).forward_rounded is Op.forward_rounded


def drawn(scale, like: torch.Tensor, draw) -> torch.Tensor:
    """The deviation a scale stands for: one draw per element (a tensor), or a list of such scales and SharedDraws
    (one draw per group, reaching its elements through a signed coefficient: a statistic's rounding), summed."""
    if not isinstance(scale, list):
        return scale * draw(like)
    total = torch.zeros_like(like)
    for part in scale:
        if isinstance(part, SharedDraw):
            total += (part.coefficient * (part.scale * draw(part.scale))).reshape(like.shape)
        else:
            total += part * draw(like)
    return total


class SampledOp:
    """An op whose outputs and input gradients get a Gaussian draw of their rounding's scale.

    In a reduced format's runs (`layer` and `reference` given, `reduced_upstream_bounds`) it also draws the storage
    of its results in the format (formats.STORED_FORMATS: a rounding op's output and input gradients), the rounding
    where its output's gradients from several readers meet, and, once `frozen`, takes a switching op's decisions
    from the reference and adds its flips' mean and spread (`flips`, precision_lab.switching); while `record`, it
    sums its output's squared deviation from the reference."""

    forward_inplace = None
    derive_output = None
    derive_input_grad = None
    backward_inplace = None

    def __init__(self, op, draw, u: float, lam: float, precision: str = "float32", layer=None, reference=None,
                 grad_scale: float = 1.0):
        self.op, self.draw, self.u, self.lam = op, draw, u, lam
        # the scales of the first run, kept: the runs differ from each other by rounding only (second order)
        self.scale, self.scales = False, None
        # a reduced format rounds this op's operands: drawn on them, once per run (_rounded_operands)
        self.operands = precision if precision in formats.REDUCED_FORMATS and op.rounded_params is not None else None
        self.run_operands = None
        self.layer, self.reference, self.grad_scale = layer, reference, grad_scale
        self.stored = precision if layer is not None and precision in formats.STORED_FORMATS else None
        self.joins = layer is not None and len(reference.network.consumers.get(layer.index, ())) > 1
        self.frozen, self.record, self.squares, self.flips = False, False, None, None
        # the draws on an attention block's intermediates (Op.forward_rounded), this run's: its backward reads them
        self.inside = {}

    def _rounded(self, t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """t plus a draw of its rounding to the claimed format: σ = r(t) = u_f·|t| + η_f/2 per element
        (roundoff.operand_rounding), at least the rounding error's range, so a sub-Gaussian proxy of it."""
        if not t.is_floating_point():
            return t
        return t + roundoff.operand_rounding(t, self.operands, scale) * self.draw(t)

    def _stored(self, t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """t plus a draw of its storage in the claimed format (a stored format only)."""
        return t + roundoff.operand_rounding(t, self.stored, scale) * self.draw(t)

    def _rounded_operands(self, xs, params):
        """This run's rounded inputs and parameters: one draw per operand element, read by the forward and by the
        backward of the same run, as the candidate reads the same rounded value in both (its effect on this op's own
        parameter gradients is then counted twice, here and in errmodel's own part: conservative)."""
        # autocast casts a bias to the format with the weight (a tensor core adds it in float32: covered too)
        biases = {name for name in params if name == "bias" or name.endswith("_bias") or name.endswith(".bias")}
        names = set(self.op.rounded_params) | (biases if self.stored is not None else set())
        rounded = {k: self._rounded(v) if k in names else v for k, v in params.items()}
        self.run_operands = ([self._rounded(x) for x in xs], rounded)
        return self.run_operands

    def _inside(self, name: str, t: torch.Tensor, stored: bool = False, gradient: bool = False,
                unless_stored: bool = False) -> torch.Tensor:
        """An intermediate of a block that rounds inside (Op.forward_rounded), with this run's draw of its rounding:
        an operand of a product always, a result only where results are stored in the format (`unless_stored`: an
        operand already stored in the format, rounded again exactly); one draw per name and run, so every query that
        reads a rounded key reads the same rounding, and the backward what the forward read."""
        if (stored and self.stored is None) or (unless_stored and self.stored is not None):
            return t
        if name not in self.inside:
            self.inside[name] = self._rounded(t, self.grad_scale if gradient else 1.0)
        return self.inside[name]

    def forward(self, attrs, xs, params, kernels):
        rounded_xs, rounded_params = self._rounded_operands(xs, params) if self.operands is not None else (xs, params)
        if self.operands is not None and self.op.rounds_inside:
            self.inside = {}
            y = self.op.forward_rounded(attrs, rounded_xs, rounded_params, kernels, self._inside)
        else:
            y = self.op.forward(attrs, rounded_xs, rounded_params, kernels)
        if self.scale is False:
            self.scale = self.forward_scale(attrs, xs, y, params, kernels)
        y = y if self.scale is None else y + drawn(self.scale, y, self.draw)
        if self.stored is not None and self.scale is not None:  # a result that rounds is stored in the format
            y = self._stored(y)
        if self.record:
            deviation = y - self.reference.value(self.layer.index).to(y.dtype)
            deviation.mul_(deviation)
            self.squares = deviation if self.squares is None else self.squares.add_(deviation)
        return y

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if self.joins:  # the gradients of several readers, summed: one rounding (stored: in the format)
            g = self._stored(g, self.grad_scale) if self.stored is not None else g + self.u * g.abs() * self.draw(g)
        if self.frozen and self.op.switches:  # the reference's decisions: their flips come as `flips`
            xs = [self.reference.value(i).to(g.dtype) for i in self.layer.inputs]
            y = self.reference.value(self.layer.index).to(g.dtype)
        # this run's rounded operands, as its forward read them (_rounded_operands)
        (rounded_xs, rounded_params), rounded_g = (self.run_operands, self._rounded(g, self.grad_scale)) \
            if self.operands is not None else ((xs, params), g)
        if self.operands is not None and self.op.rounds_inside:
            grads, param_grads = self.op.backward_rounded(attrs, rounded_g, rounded_xs, y, rounded_params, kernels, need,
                                                          self._inside)
        else:
            grads, param_grads = self.op.backward(attrs, rounded_g, rounded_xs, y, rounded_params, kernels, need)
        if self.scales is None:
            self.scales = self.backward_scales(attrs, g, xs, y, params, kernels, need, grads)
        scales = self.scales
        grads = [h if h is None or s is None else h + drawn(s, h, self.draw) for h, s in zip(grads, scales)]
        if self.stored is not None:
            grads = [h if h is None or s is None else self._stored(h, self.grad_scale) for h, s in zip(grads, scales)]
        if self.flips is not None and grads[0] is not None:
            mean, spread = self.flips
            grads[0] = grads[0] + mean + spread * self.draw(spread)
        return grads, param_grads  # a parameter gradient's own rounding is errmodel's (deterministic)

    def forward_scale(self, attrs, xs, y, params, kernels):
        return self.op.sampled_forward_scale(attrs, xs, y, params, kernels, self.u, self.lam)

    def backward_scales(self, attrs, g, xs, y, params, kernels, need, grads):
        return self.op.sampled_backward_scales(attrs, g, xs, y, params, kernels, need, grads, self.u, self.lam)


class SampledLoss:
    """The loss with a draw on ∂loss/∂output of its evaluation's scale (ops/losses.py's bound without E_y); with a
    stored format, ∂loss/∂output is also stored in it (scaled by the loss scale first)."""

    def __init__(self, loss, draw, u: float, stored: str | None = None, grad_scale: float = 1.0):
        self.loss, self.draw, self.u, self.scale = loss, draw, u, None
        self.stored, self.grad_scale = stored, grad_scale

    def forward_backward(self, y, t, in_place: bool = False):
        loss, grad = self.loss.forward_backward(y, t)
        if self.scale is None:
            self.scale = self._scale(y, t)
        grad = grad + self.scale * self.draw(grad)
        if self.stored is not None:
            grad = grad + roundoff.operand_rounding(grad, self.stored, self.grad_scale) * self.draw(grad)
        return loss, grad

    def _scale(self, y, t):
        return self.loss.sampled_grad_scale(y, t, self.u)


def deviations(trace, precision: str, lam: float, samples: int = SAMPLES, forward_only: bool = False):
    """K runs' deviations from the reference: {quantity: array (K, *shape)} for loss, output and gradients (the loss
    and the output alone with `forward_only`: each run then skips its backward and draws none of its roundings)."""
    from .compute import forward_backward
    from .ops import LOSSES

    network, problem = trace.network, trace.problem
    u = formats.unit_roundoff(roundoff.accumulation_precision(precision))
    # drawn on the CPU and moved: a CUDA generator's stream differs, and the bounds must not depend on the device
    generator = torch.Generator(device="cpu").manual_seed(1_000_003 * (problem.seed + 1))

    def draw(like: torch.Tensor) -> torch.Tensor:
        # drawn in float32 (5× faster than float64 on a CPU): a N(0, 1) draw's 2⁻²⁴ relative rounding is nothing
        # beside the margin c = FACTOR
        return torch.randn(like.shape, generator=generator, device="cpu", dtype=torch.float32).to(like.device, like.dtype)

    rules = {layer.index: SampledOp(OPS[layer.op], draw, u, lam, precision) for layer in network.layers}
    if not forward_only:  # the loss's own draw is on its gradient: a forward-only run takes the loss plainly
        rules["loss"] = SampledLoss(LOSSES[network.loss], draw, u)
    names = FORWARD_QUANTITIES + (() if forward_only else network.parameter_names)
    out = {name: [] for name in names}
    reference_values = {"loss": np.asarray(trace.loss, np.float64), "output": np.asarray(trace.output, np.float64)}
    reference_values.update({n: np.asarray(trace.grads[n], np.float64) for n in network.parameter_names})
    for _ in range(samples):
        run = forward_backward(problem, "float64", trace.device, rules=rules, backward=not forward_only)
        values = {"loss": run.loss, "output": run.output, **run.grads}
        for name in names:
            out[name].append(np.asarray(values[name], np.float64) - reference_values[name])
    return {name: np.stack(values) for name, values in out.items()}


def upstream_bounds(trace, precision: str, lam: float, forward_only: bool = False) -> dict[str, np.ndarray]:
    """FACTOR·√(mean Δₖ²) per element of every quantity (the loss and the output alone with `forward_only`): the
    sampled bound on its propagated error."""
    return {name: FACTOR * np.sqrt(np.mean(d * d, axis=0))
            for name, d in deviations(trace, precision, lam, forward_only=forward_only).items()}


#: runs of a reduced format's bound (`reduced_upstream_bounds`): K forward runs measure what the switches read (and
#: the loss and the output), K more with the switches frozen the gradients; at K = 64 the factor that keeps the
#: failure probability of SAMPLES, FACTOR is c = 6.0 (factor_for), against 9 at K = 16
REDUCED_SAMPLES = 64


def activation_pools(network) -> dict[int, int]:
    """{activation layer: max pool layer} for each (leaky) ReLU read by a max pool alone: their decisions are judged
    together (MaxPool2d.switch_flips_after_activation)."""
    pairs = {}
    for layer in network.layers:
        if OPS[layer.op].switches and hasattr(OPS[layer.op], "switch_flips_after_activation") and layer.inputs[0] >= 0:
            source = network.layers[layer.inputs[0]]
            if (OPS[source.op].switches and hasattr(OPS[source.op], "negative_slope")
                    and len(network.consumers.get(source.index, ())) == 1 and source.inputs[0] >= 0):
                pairs[source.index] = layer.index
    return pairs


def factor_for(samples: int, probability: float | None = None) -> float:
    """c with 2·(1 + c²/K)^(−K/2) = `probability` (default: that of SAMPLES, FACTOR): the same risk at K runs."""
    p = failure_probability() if probability is None else probability
    return math.sqrt(samples * ((p / 2) ** (-2.0 / samples) - 1.0))


@dataclass
class ReducedBounds:
    """A reduced format's sampled bounds: per element of every quantity, and along each parameter gradient's own
    direction (the error's projection on ĝ = g/‖g‖: a scaled or partly lost gradient shows there)."""

    upstream: dict  # quantity → c·√(mean Δₖ²), per element
    along: dict  # parameter gradient → c·√(mean ⟨Δₖ, ĝ⟩²)
    flips: dict = field(default_factory=dict)  # switching layer → flips a candidate makes on average
    samples: int = REDUCED_SAMPLES


def reduced_upstream_bounds(trace, precision: str, lam: float, loss_scale: float = 1.0,
                            samples: int = REDUCED_SAMPLES) -> ReducedBounds:
    """The sampled bounds of a reduced-format claim, switches included (precision_lab.switching).

    K forward runs draw every rounding the format makes (operands, sums, results stored in the format) and measure
    the loss's and the output's deviations and, at every switching op's input, the variance of its deviation. Each
    switch's flips then get their Bernoulli mean and spread at its input gradient, and K more runs, each switch
    taking its decision from the reference, draw every rounding of the forward and the backward, flips included.
    `loss_scale`: what a float16 program multiplies its loss by before the backward (the absolute part of its
    gradients' rounding is divided by it)."""
    from .compute import forward_backward
    from .ops import LOSSES

    network, problem = trace.network, trace.problem
    u = formats.unit_roundoff(roundoff.accumulation_precision(precision))
    generator = torch.Generator(device="cpu").manual_seed(1_000_003 * (problem.seed + 1) + 7)

    def draw(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=generator, device="cpu", dtype=torch.float32).to(like.device, like.dtype)

    rules = {layer.index: SampledOp(OPS[layer.op], draw, u, lam, precision, layer, trace, loss_scale)
             for layer in network.layers}
    switching_layers = [layer for layer in network.layers if OPS[layer.op].switches and layer.inputs[0] >= 0]
    for layer in switching_layers:
        rules[layer.inputs[0]].record = True
    references = {"loss": np.asarray(trace.loss, np.float64), "output": np.asarray(trace.output, np.float64)}
    squares = {name: 0.0 for name in FORWARD_QUANTITIES}
    for _ in range(samples):
        run = forward_backward(problem, "float64", trace.device, rules=rules, backward=False)
        for name, value in (("loss", run.loss), ("output", run.output)):
            squares[name] = squares[name] + (np.asarray(value, np.float64) - references[name]) ** 2
    flips = {}
    pairs = activation_pools(network)
    for layer in switching_layers:
        if layer.index in pairs.values():  # judged with the activation it reads
            continue
        source = rules[layer.inputs[0]]
        x = trace.value(layer.inputs[0]).to(torch.float64)
        if layer.index in pairs:
            pool = network.layers[pairs[layer.index]]
            mean, spread, expected = OPS[pool.op].switch_flips_after_activation(
                pool.attrs, x, source.squares / samples, trace.grad_at(pool.index).to(torch.float64), samples,
                OPS[layer.op].negative_slope(layer.attrs))
            name = f"{layer.name or f'layer {layer.index}'} + {pool.name or f'layer {pool.index}'}"
        else:
            mean, spread, expected = OPS[layer.op].switch_flips(layer.attrs, x, source.squares / samples,
                                                               trace.grad_at(layer.index).to(torch.float64), samples)
            name = layer.name or f"layer {layer.index}"
        rules[layer.index].flips = (mean, spread)
        flips[name] = expected
    for rule in rules.values():
        rule.record, rule.squares, rule.frozen = False, None, True
    rules["loss"] = SampledLoss(LOSSES[network.loss], draw, u, precision if precision in formats.STORED_FORMATS
                                else None, loss_scale)
    directions = {}
    for name in network.parameter_names:
        g = np.asarray(trace.grads[name], np.float64)
        size = float(np.linalg.norm(g))
        directions[name] = g / size if size > 0 else g
        references[name], squares[name] = g, 0.0
    along = {name: 0.0 for name in network.parameter_names}
    for _ in range(samples):
        run = forward_backward(problem, "float64", trace.device, rules=rules)
        for name in network.parameter_names:
            deviation = np.asarray(run.grads[name], np.float64) - references[name]
            squares[name] = squares[name] + deviation * deviation
            along[name] += float(np.sum(deviation * directions[name])) ** 2
    c = factor_for(samples)
    upstream = {name: c * np.sqrt(np.asarray(total) / samples) for name, total in squares.items()}
    return ReducedBounds(upstream, {name: c * math.sqrt(total / samples) for name, total in along.items()}, flips,
                         samples)


__all__ = ["ELEMENT_LIMIT", "FACTOR", "FORWARD_QUANTITIES", "REDUCED_SAMPLES", "ReducedBounds", "SAMPLES", "applies",
           "factor_for", "reduced_upstream_bounds", "deviations", "failure_probability", "upstream_bounds"]
