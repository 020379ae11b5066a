"""Localisation: where a failure starts. With intermediates, each op re-run in float64 on the candidate's
own inputs against its local bound, the first that fails named; else the earliest failing quantity in
backprop order."""
from __future__ import annotations

import numpy as np
import torch

from .. import errmodel, formats
from ..compute import Result, Trace, layer_params
from ..findings import Finding
from ..ops import OPS, BoundContext, Field, GradField, Kernels


def localise(quantities, result: Result, reference: Trace, claimed: str) -> list[Finding]:
    """Name where a failure starts: the first op whose local check fails (with intermediates), else the
    earliest failing quantity in backprop order."""
    # an inconclusive quantity has not failed (its bound could not certify it): it starts nothing
    if not any(_failing(q) for q in quantities.values()):
        return []
    if result.intermediates:
        found = _first_failing_op(result, reference, claimed)
        if found:
            return [Finding("localisation", name=found, numbers={"by": "intermediates"})]
    network = reference.network
    order = ["loss", "output"] + [f"{layer.name}.{suffix}" for layer in reversed(network.parametrised_layers)
                                  for suffix in ("weight", "bias") if f"{layer.name}.{suffix}" in network.param_shapes]
    for name in order:
        q = quantities.get(name)
        if q is not None and _failing(q):
            return [Finding("localisation", name=f"first failing quantity in backprop order: {name}",
                            numbers={"by": "backprop order", "quantity": name})]
    return []


def _failing(q) -> bool:
    return q.verdict not in ("roundoff", "inconclusive")


def _first_failing_op(result: Result, reference: Trace, claimed: str) -> str | None:
    """Each op re-run in float64 on the candidate's own intermediates and judged against its local bound."""
    network = reference.network
    inter = result.intermediates
    device = reference.device
    u = formats.unit_roundoff(errmodel.accumulation_precision(claimed))
    ctx = BoundContext(claimed, u, errmodel.LAMBDA, errmodel.bound_kernels(device))

    def value(index):
        if index == -1:
            return reference.input
        layer = network.layers[index]
        key = f"{layer.name}.output" if layer.name else None
        return torch.as_tensor(inter[key], dtype=torch.float64, device=device) if key in inter else None

    def grad(index):
        layer = network.layers[index]
        key = f"{layer.name}.output.grad" if layer.name else None
        return torch.as_tensor(inter[key], dtype=torch.float64, device=device) if key in inter else None

    # the request's masks ride with the parameters, as in every walk (compute.to_tensors)
    params64 = {k: torch.as_tensor(v, dtype=torch.float64, device=device)
                for k, v in {**reference.problem.params, **reference.problem.masks}.items()}
    with torch.no_grad(), errmodel._ieee(device):
        for layer in network.layers:  # forward, in order
            inputs, mine = [value(i) for i in layer.inputs], value(layer.index)
            if mine is None or any(x is None for x in inputs):
                continue
            op = OPS[layer.op]
            expected = op.forward(layer.attrs, inputs, layer_params(params64, layer), Kernels())
            fields = [Field(x.to(torch.float32), None, 0) for x in inputs]
            bound = op.forward_error(layer.attrs, fields, expected.to(torch.float32),
                                     layer_params(reference.params, layer), ctx).error
            ratio = _local_ratio(mine, expected, bound, u)
            if ratio > 1.0:
                return f"{layer.label} forward: beyond its own rounding bound (error ÷ bound {ratio:.3g})"
        for layer in reversed(network.layers):  # backward, in backprop order
            g, inputs = grad(layer.index), [value(i) for i in layer.inputs]
            if g is None or any(x is None for x in inputs):
                continue
            op = OPS[layer.op]
            need = [i >= 0 and len(network.consumers[i]) == 1 and grad(i) is not None for i in layer.inputs]
            expected_in, _ = op.backward(layer.attrs, g, inputs, value(layer.index), layer_params(params64, layer),
                                         Kernels(), need)
            fields = [Field(x.to(torch.float32), None, 0) for x in inputs]
            out_field = op.forward_error(layer.attrs, fields, value(layer.index).to(torch.float32),
                                         layer_params(reference.params, layer), ctx) if op.masks \
                else Field(None, None)
            zero = GradField(torch.zeros_like(g, dtype=torch.float32), None, 0, 0, owned=False)
            local, _ = op.backward_error(layer.attrs, g.to(torch.float32), zero, fields, out_field,
                                         layer_params(reference.params, layer), ctx, need)
            for i, keep, h, field in zip(layer.inputs, need, expected_in, local):
                if not keep or h is None or field is None:
                    continue
                theirs = grad(i)
                bound = field.error + (field.flips if field.flips is not None else 0.0)
                ratio = _local_ratio(theirs, h, bound, u)
                if ratio > 1.0:
                    return f"{layer.label} backward: {_name_local_slip(layer, g, theirs, h, bound, u)}"
    return None


def _local_ratio(got: torch.Tensor, expected: torch.Tensor, bound, u: float) -> float:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    floor = max(u * scale, np.finfo(np.float32).tiny)
    bound = torch.zeros_like(expected) if bound is None else bound
    return float(((got - expected).abs() / bound.double().clamp(min=floor)).max())


def _name_local_slip(layer, g, theirs, expected, bound, u) -> str:
    """A local slip's name when one the op knows fits (Op.local_slip: a mask missing), else the ratio."""
    named = OPS[layer.op].local_slip(layer.attrs, g, theirs, expected, bound, u,
                                     lambda got, wanted, limit: _local_ratio(got, wanted, limit, u))
    if named:
        return named
    if not bool(torch.any(theirs != 0)):
        return "passes no gradient at all"
    return f"beyond its own rounding bound (error ÷ bound {_local_ratio(theirs, expected, bound, u):.3g})"
