"""Dropout: the identity of evaluation, or a training step's inverted dropout with a mask the request carries.

The lab compares one deterministic step, so a training dropout's random mask is drawn by the lab (from the
problem's seed, `problem.draw_masks`) and carried by the request as `<layer>.mask` (float 0/1, keep = 1, the
layer's output shape, batch included); every computation reads that mask and draws none of its own.
y = x·mask·s and ∂x = g·mask·s with s = 1/(1 − p), as PyTorch computes them (`input * mask * scale`).

Rounding: x·mask is exact (mask is 0 or 1). The scale s in float32 is one rounding of 1/(1 − p) shared by every
element, the product one more per element: |ŷ − y| ≤ γ₂·|y|, γ₂ = 2u/(1 − 2u) (Higham 2002, §2.2 and Lemma 3.1);
none at all where s is a power of two (p = 0.5, 0.75), and a zeroed element is exact.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import Field, GradField, Op, OpSpecError, PortSlip, Rule, SharedDraw, register
from .onnx_reading import OnnxRead, attr, require

#: the suffix of the mask a training dropout's request carries: '<layer>.mask'
MASK = "mask"


def keep_scale(attrs) -> float:
    """s = 1/(1 − p), in float64 (PyTorch's native dropout computes it so, then multiplies in the tensor's dtype)."""
    return 1.0 / (1.0 - attrs["p"])


def exact_scale(attrs) -> bool:
    """Whether multiplying by s rounds nothing: s a power of two (frexp's mantissa exactly 1/2)."""
    return math.frexp(keep_scale(attrs))[0] == 0.5


def gamma2(u: float) -> float:
    """γ₂ = 2u/(1 − 2u): two roundings, s's own and the product's (Higham 2002, Lemma 3.1)."""
    return 2.0 * u / (1.0 - 2.0 * u)


def gamma_k(k: int, u: float) -> float:
    """γₖ = ku/(1 − ku): k roundings in a product (Higham 2002, Lemma 3.1)."""
    return k * u / (1.0 - k * u)


class DropoutSlip(Rule):
    """A training dropout computed otherwise: the scale left out of a pass, the mask left out of the backward, or
    the mask inverted (the kept elements dropped), in forward and backward as the slip says."""

    def __init__(self, forward_scaled=True, backward_scaled=True, backward_masked=True, inverted=False):
        self.forward_scaled, self.backward_scaled = forward_scaled, backward_scaled
        self.backward_masked, self.inverted = backward_masked, inverted

    def _mask(self, params):
        return 1.0 - params[MASK] if self.inverted else params[MASK]

    def forward(self, attrs, xs, params, kernels):
        y = xs[0] * self._mask(params)
        return y * keep_scale(attrs) if self.forward_scaled else y

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if not need[0]:
            return [None], {}
        h = g * self._mask(params) if self.backward_masked else g
        return [h * keep_scale(attrs) if self.backward_scaled else h], {}


class Dropout(Op):
    """Dropout: at evaluation (`training` false) the identity; in training, y = x·mask/(1 − p) with the request's
    mask `<layer>.mask` (module docstring)."""

    name = "dropout"
    keys = {"p": 0.5, "training": False}
    elementwise = True
    #: roundings in ŷ = x·mask·s: s's own and the product's (module docstring)
    roundings = 2
    every = "every dropout"

    torch_modules = (torch.nn.Dropout,)
    torch_calls = (F.dropout,)
    onnx_ops = ("Dropout", "Identity")

    def from_onnx_node(self, node, graph):
        """ONNX Dropout (its ratio an attribute before opset 12, an input since) at inference; Identity is no layer."""
        if node.op_type == "Identity":
            return OnnxRead({}, graph.data_inputs(node), node.outputs[0], alias=True)
        training = graph.constant(node.inputs[2]) if len(node.inputs) > 2 else None
        require(training is None or not bool(training.reshape(())), "training_mode true: a mask drawn inside the "
                "graph, which no request can carry; export the network in evaluation")
        ratio = graph.constant(node.inputs[1]) if len(node.inputs) > 1 else None
        p = float(ratio.reshape(())) if ratio is not None else attr(node, "ratio", 0.5)
        return OnnxRead({"p": float(str(np.float32(p)))}, graph.data_inputs(node)[:1], node.outputs[0])

    def check(self, attrs):
        p = attrs["p"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise OpSpecError(f"'p' is {p!r}: expected a probability in [0, 1)")
        if not isinstance(attrs["training"], bool):
            raise OpSpecError(f"'training' is {attrs['training']!r}: expected true or false")
        attrs["p"] = float(p)
        return attrs

    def describe(self, attrs):
        return f"dropout p={attrs['p']:g} (training, the request's mask)" if attrs["training"] else "dropout"

    # the mask the request carries ---------------------------------------------------------------
    def request_masks(self, attrs):
        return (MASK,) if attrs["training"] else ()

    def draw_mask(self, attrs, suffix, shape, generator):
        """Bernoulli(1 − p) per element: kept where a uniform draw in [0, 1) is below 1 − p."""
        return (torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu") < 1.0 - attrs["p"]).double()

    # PyTorch --------------------------------------------------------------------------------------
    def from_torch_module(self, module):
        # a module traced in training mode drops; p = 0 drops nothing, the identity either way
        return {"p": float(module.p), "training": True} if module.training and module.p > 0 else {"p": float(module.p)}

    def from_torch_call(self, target, args, kwargs):
        p = float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
        training = kwargs.get("training", args[2] if len(args) > 2 else True)  # F.dropout's own default: training
        if not isinstance(training, bool):
            raise OpSpecError("F.dropout's 'training' is a traced value: give it as a Python bool (self.training)")
        return {"p": p, "training": True} if training and p > 0 else {"p": p}

    def torch_module(self, attrs, device=None, dtype=None):
        """A training dropout's module holds the request's mask as a buffer (SpecModule.carry): no draw of its own."""
        return torch.nn.Dropout(attrs["p"]) if attrs["training"] else None

    def torch_forward(self, attrs, xs, module):
        if not attrs["training"]:
            return xs[0]
        return xs[0] * module.mask * keep_scale(attrs)  # as F.dropout computes it: input * mask * scale

    # compute ----------------------------------------------------------------------------------------
    def forward(self, attrs, xs, params, kernels):
        return xs[0] * params[MASK] * keep_scale(attrs) if attrs["training"] else xs[0]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        if not need[0]:
            return [None], {}
        return [g * params[MASK] * keep_scale(attrs) if attrs["training"] else g], {}

    # error model ----------------------------------------------------------------------------------
    def _rounded(self, attrs, mask, result, error, u: float):
        """E·mask·s carried (widened by 1 + γ₂) plus γ₂·|result| of its own (result = value·mask·s); nothing of its
        own where s is a power of two."""
        s = keep_scale(attrs)
        carried = None if error is None else error * mask * s
        if exact_scale(attrs):
            return carried
        gamma = gamma_k(self.roundings, u)
        own = gamma * result.abs()
        return own if carried is None else (1 + gamma) * carried + own

    def forward_error(self, attrs, ins, y, params, ctx):
        if not attrs["training"]:
            return Field(y, ins[0].error, ins[0].radius, ins[0].flips)
        return Field(y, self._rounded(attrs, params[MASK], y, ins[0].error, ctx.u), ins[0].radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        if not need[0]:
            return [None], {}
        if not attrs["training"]:
            return [GradField(grad.error, grad.flips, grad.radius, grad.flip_count, grad.owned)], {}
        mask, s = params[MASK], keep_scale(attrs)
        flips = None if grad.flips is None else grad.flips * mask * s
        return [GradField(self._rounded(attrs, mask, g * mask * s, grad.error, ctx.u), flips, grad.radius,
                          grad.flip_count)], {}

    def _sampled(self, attrs, t, u: float):
        """u·|t| per element (the product's rounding) and one shared draw of scale u reaching every element as t
        (s's own rounding, the same for all): None where s is a power of two."""
        if not attrs["training"] or exact_scale(attrs):
            return None
        shared = (self.roundings - 1) * u  # s's own roundings, the same for every element
        return [u * t.abs(), SharedDraw(t, torch.full((1,), shared, dtype=t.dtype, device=t.device))]

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return self._sampled(attrs, y, u)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return [self._sampled(attrs, grads[0], u) if need[0] else None]

    # what a port gets wrong -------------------------------------------------------------------------
    def local_slip(self, attrs, g, theirs, expected, bound, u, ratio):
        """The localised backward's slip: g·s (the mask missing) or g·mask (the scale left out), each within the
        bound plus its own γₖ rounding (k = `roundings`)."""
        if not attrs["training"] or attrs["p"] == 0:
            return None
        unmasked, unscaled = g * keep_scale(attrs), expected / keep_scale(attrs)
        gamma = gamma_k(self.roundings, u)
        if ratio(theirs, unmasked, bound + gamma * unmasked.abs()) <= 1.0:
            return "mask missing (scaled by 1/(1 − p) only)"
        if ratio(theirs, unscaled, bound + gamma * unscaled.abs()) <= 1.0:
            return "leaves out the scale 1/(1 − p)"
        return None

    def port_slips(self, attrs, in_shape):
        if not attrs["training"] or attrs["p"] == 0:
            return []
        every = (self.every,)
        return [PortSlip("dropout", "backward: mask missing (scaled by 1/(1 − p) only)",
                         lambda: DropoutSlip(backward_masked=False), every=every),
                PortSlip("dropout", "backward leaves out the scale 1/(1 − p)",
                         lambda: DropoutSlip(backward_scaled=False), every=every),
                PortSlip("dropout", "leaves out the scale 1/(1 − p) in forward and backward",
                         lambda: DropoutSlip(forward_scaled=False, backward_scaled=False), forward=True, every=every),
                PortSlip("dropout", "mask inverted (drops the kept elements)",
                         lambda: DropoutSlip(inverted=True), forward=True, every=every)]


register(Dropout())
