"""Stochastic depth (torchvision.ops.StochasticDepth, Huang et al. 2016): a residual branch dropped per sample ("row")
or for the whole batch ("batch") in training, the identity at evaluation.

As a training dropout (ops.dropout), the lab draws the mask from the problem's seed and the request carries it as
`<layer>.mask`, in the layer's output shape: one Bernoulli(1 − p) draw per sample (or one for the batch), the same
over that sample's elements. y = x·mask·s and ∂x = g·mask·s with s = 1/(1 − p).

Rounding (docs/error-model.md, "Stochastic depth"): torchvision scales the mask first, noise ÷ (1 − p) in the tensor's
dtype: 1 − p rounded to the format, the quotient rounded, then the product x·noise: three roundings,
|ŷ − y| ≤ γ₃·|y| (Higham 2002, Lemma 3.1), the first two shared by every element; none where s is a power of two
(1 − p = 2⁻ᵏ is exact and so is its reciprocal), and a dropped sample is exact.
"""
from __future__ import annotations

import sys

import torch

from . import OpSpecError, register
from .dropout import Dropout

MODES = ("row", "batch")


def _torchvision():
    """torchvision's stochastic-depth module, where a module to read has imported it (the lab never imports it)."""
    return sys.modules.get("torchvision.ops.stochastic_depth")


class StochasticDepth(Dropout):
    """Stochastic depth (module docstring): dropout's mask, scale, bounds and slips, one draw per sample or batch."""

    name = "stochastic_depth"
    keys = {"p": 0.5, "mode": "row", "training": False}
    roundings = 3
    every = "every stochastic depth"

    onnx_ops = ()  # exported in evaluation it is no node at all

    @property
    def torch_modules(self):
        return () if _torchvision() is None else (_torchvision().StochasticDepth,)

    @property
    def torch_calls(self):
        return () if _torchvision() is None else (_torchvision().stochastic_depth,)

    def check(self, attrs):
        if attrs["mode"] not in MODES:
            raise OpSpecError(f"'mode' is {attrs['mode']!r}: expected 'row' (one draw per sample) or 'batch'")
        return super().check(attrs)

    def describe(self, attrs):
        return (f"stochastic depth p={attrs['p']:g} per {attrs['mode']} (training, the request's mask)"
                if attrs["training"] else "stochastic depth")

    def draw_mask(self, attrs, suffix, shape, generator):
        """Kept where a uniform draw in [0, 1) is below 1 − p: one draw per sample ("row") or one for the batch,
        the same over its elements."""
        drawn = (shape[0] if attrs["mode"] == "row" else 1,) + (1,) * (len(shape) - 1)
        keep = torch.rand(drawn, generator=generator, dtype=torch.float64, device="cpu") < 1.0 - attrs["p"]
        return keep.double().expand(shape).contiguous()

    def from_torch_module(self, module):
        return self._attrs(module.p, module.mode, module.training)

    def from_torch_call(self, target, args, kwargs):
        given = dict(zip(("input", "p", "mode", "training"), args)) | kwargs
        training = given.get("training", True)  # torchvision's own default: training
        if not isinstance(training, bool):
            raise OpSpecError("stochastic_depth's 'training' is a traced value: give it as a Python bool "
                              "(self.training)")
        return self._attrs(given["p"], given["mode"], training)

    @staticmethod
    def _attrs(p, mode, training) -> dict:
        if not 0 <= float(p) < 1:
            raise OpSpecError(f"stochastic depth with p = {p}: every branch dropped; the spec takes p in [0, 1)")
        return {"p": float(p), "mode": mode, "training": bool(training) and float(p) > 0}

    def torch_forward(self, attrs, xs, module):
        if not attrs["training"]:
            return xs[0]
        return xs[0] * (module.mask / (1.0 - attrs["p"]))  # as torchvision computes it: noise.div_(1 − p), then ×


register(StochasticDepth())
