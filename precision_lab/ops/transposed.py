"""conv_transpose2d: a convolution's adjoint, computed and bounded by conv2d's rules with the roles swapped.

A transposed convolution with weight W (in, out/groups, kh, kw) is the input gradient of the convolution
`adjoint(attrs)` (in = its out, out = its in, the same kernel, stride, padding, dilation, groups) whose weight
is the same W in OIHW. So its forward is that convolution's input gradient, its input gradient that
convolution's forward, its weight gradient that convolution's weight gradient with its input and output gradient
swapped (the output gradient g as the convolution's input, the input x as its output gradient), all through
`Kernels` under the transposed convolution's own pass names (operand rounding where its forward is rounded).

Rounding model (Higham 2002 §3.1, inner products; Higham & Mary 2019 γ̃ₙ(λ)): an output element sums only the
products whose taps land on it, ⌈k/s⌉² per input channel in the interior with stride s (fewer at the edges), so
its n is counted element by element by transposed-convolving ones; an input gradient sums (out/groups)·kh·kw
products, a weight gradient batch·H_in·W_in, a bias gradient batch·H_out·W_out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import REQUIRED, Field, GradField, Op, OpSpecError, Parts, PortSlip, Rule, as_pair, gather_radius, has_values
from . import abs_params, gamma_over_lambda, is_seed_conv, positive_int, register, spread
from .. import roundoff
from ..conv.winograd_bound import winograd_scale
from .layers import Conv2d, TrueConvolution, _bias_checked, _bias_parts, _conv_weight_drift, _order_only_backward_scales
from .layers import _order_only_forward_scale, _with_bias
from .onnx_reading import OnnxRead, attr, pads_tblr, require

#: conv2d's rules, read with the roles swapped (never registered: conv2d's own instance is the registry's)
_CONV = Conv2d()


def adjoint(attrs: dict) -> dict:
    """The convolution whose input gradient this transposed convolution is (its weight is ours, read as OIHW)."""
    return {"in": attrs["out"], "out": attrs["in"], "kernel": attrs["kernel"], "stride": attrs["stride"],
            "padding": attrs["padding"], "dilation": attrs["dilation"], "groups": attrs["groups"], "bias": False}


def _full_length(attrs: dict, length: int, axis: int) -> int:
    """(H − 1)·s + d·(k − 1) + 1: the uncropped transposed convolution's length along `axis`."""
    return (length - 1) * attrs["stride"][axis] + attrs["dilation"][axis] * (attrs["kernel"][axis] - 1) + 1


class ConvTranspose2d(Op):
    name = "conv_transpose2d"
    keys = {"in": REQUIRED, "out": REQUIRED, "kernel": REQUIRED, "stride": 1, "padding": 0, "output_padding": 0,
            "dilation": 1, "groups": 1, "bias": True}
    parametrised = True
    rounded_params = ("weight",)
    reads_error_backward = True
    weight_letters = ("for a conv_transpose2d weight, O is its input channels and I its output channels, as in the "
                      "convolution it transposes: PyTorch's (in, out/groups, kH, kW) is OIHW")
    # not `windowed` (the zoo plants a convolution's window slips there); a crop offset moves the gradient's windows
    window_shifts = "gradient"

    torch_modules = (torch.nn.ConvTranspose2d,)
    torch_calls = (F.conv_transpose2d,)
    onnx_ops = ("ConvTranspose",)

    def check(self, attrs):
        attrs["in"], attrs["out"] = positive_int(attrs["in"], "in"), positive_int(attrs["out"], "out")
        for key, minimum in (("kernel", 1), ("stride", 1), ("padding", 0), ("output_padding", 0), ("dilation", 1)):
            attrs[key] = as_pair(attrs[key], key, minimum)
        attrs["groups"] = positive_int(attrs["groups"], "groups")
        if attrs["in"] % attrs["groups"] or attrs["out"] % attrs["groups"]:
            raise OpSpecError(f"'groups' {attrs['groups']} must divide 'in' {attrs['in']} and 'out' {attrs['out']}")
        # PyTorch allows output_padding < max(stride, dilation); ≥ stride the adjoint convolution would not map the
        # output back onto the input grid, and the weight gradient's role swap needs it to
        if any(op >= s for op, s in zip(attrs["output_padding"], attrs["stride"])):
            raise OpSpecError(f"'output_padding' {list(attrs['output_padding'])} must be smaller than the stride "
                              f"{list(attrs['stride'])}")
        return _bias_checked(attrs)

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 3:
            raise OpSpecError(f"conv_transpose2d needs an image (C, H, W) but receives {len(shape)}-D features")
        if shape[0] != attrs["in"]:
            raise OpSpecError(f"receives {shape[0]} channels but declares 'in': {attrs['in']} (channels do not chain)")
        return (attrs["out"],) + tuple(self.axis_length(attrs, [shape[1 + axis]], axis) for axis in (0, 1))

    def axis_length(self, attrs, lengths, axis):
        """(H − 1)·s − 2p + d·(k − 1) + output_padding + 1."""
        length = lengths[0]
        if length is None:
            return None
        out = _full_length(attrs, length, axis) - 2 * attrs["padding"][axis] + attrs["output_padding"][axis]
        if out < 1:
            raise OpSpecError(f"input {('height', 'width')[axis]} {length} gives no output: padding "
                              f"{attrs['padding'][axis]} crops all of it")
        return out

    def param_shapes(self, attrs):
        kh, kw = attrs["kernel"]
        shapes = {"weight": (attrs["in"], attrs["out"] // attrs["groups"], kh, kw)}  # as PyTorch stores it
        if attrs["bias"]:
            shapes["bias"] = (attrs["out"],)
        return shapes

    def describe(self, attrs):
        kh, kw = attrs["kernel"]
        extra = "".join(f" {key} {attrs[key][0] if attrs[key][0] == attrs[key][1] else list(attrs[key])}"
                        for key, default in (("stride", 1), ("dilation", 1)) if attrs[key] != (default, default))
        return f"conv_transpose2d {attrs['in']}→{attrs['out']} {kh}×{kw}{extra}"

    # as PyTorch runs and reads it -------------------------------------------------------------
    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.ConvTranspose2d(attrs["in"], attrs["out"], attrs["kernel"], attrs["stride"], attrs["padding"],
                                        attrs["output_padding"], attrs["groups"], attrs["bias"], attrs["dilation"],
                                        device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return module(xs[0])

    def from_torch_module(self, module):
        if module.padding_mode != "zeros":
            raise OpSpecError(f"ConvTranspose2d with padding_mode {module.padding_mode!r}: only zero padding is "
                              f"supported")
        attrs = {"in": module.in_channels, "out": module.out_channels, "kernel": list(module.kernel_size),
                 "stride": list(module.stride), "padding": list(module.padding),
                 "output_padding": list(module.output_padding), "dilation": list(module.dilation),
                 "groups": module.groups, "bias": module.bias is not None}
        self.normalise(dict(attrs))  # its refusals (output_padding ≥ stride) said here, with the module's name
        return attrs

    def from_onnx_node(self, node, graph):
        """ONNX ConvTranspose: its weight (in, out/group, kH, kW) is PyTorch's; explicit pads only (an exporter's
        output_shape or auto_pad leave the crop to be inferred: export with explicit pads), the start's at least the
        end's on each axis."""
        weight = graph.constant(node.inputs[1])
        require(weight is not None and weight.ndim == 4, "its weight is not a constant 4-D tensor (a 2-D transposed "
                "convolution with weights as an initializer)")
        channels_in, per_group, kh, kw = weight.shape
        require(list(attr(node, "kernel_shape", [kh, kw])) == [kh, kw], "kernel_shape differs from its weight's")
        require(attr(node, "auto_pad", "NOTSET") == "NOTSET" and attr(node, "output_shape", None) is None,
                "auto_pad or output_shape instead of explicit pads: export with pads and output_padding")
        top, bottom, left, right = pads_tblr(attr(node, "pads", [0, 0, 0, 0]))
        extra_h, extra_w = (int(v) for v in attr(node, "output_padding", [0, 0]))
        # ONNX crops pads_begin at an axis's start and pads_end − output_padding at its end, PyTorch padding at both
        # ends and then adds output_padding: the same with padding = pads_begin when the start's crop is the larger
        extra = [top - bottom + extra_h, left - right + extra_w]
        require(min(extra) >= 0, f"pads [top {top}, bottom {bottom}, left {left}, right {right}] crop more at the "
                "end of an axis than at its start (padding crops both ends alike, output_padding adds at the end)")
        group = int(attr(node, "group", 1))
        attrs = {"in": channels_in, "out": per_group * group, "kernel": [kh, kw],
                 "stride": list(attr(node, "strides", [1, 1])), "padding": [top, left], "output_padding": extra,
                 "dilation": list(attr(node, "dilations", [1, 1])), "groups": group}
        self.normalise({**attrs, "bias": False})  # its refusals (output_padding ≥ stride) in its own words
        return _with_bias(OnnxRead(attrs, graph.data_inputs(node), node.outputs[0], params={"weight": weight},
                                   param_sources={"weight": node.inputs[1]}), node, graph, attrs["out"], image=True)

    def from_torch_call(self, target, args, kwargs):
        # the functional form's weight is a tensor of the caller's, not a named parameter the spec can hold
        raise OpSpecError("F.conv_transpose2d with a weight tensor of its own: use nn.ConvTranspose2d, whose "
                          "parameters have state_dict names")

    # compute ----------------------------------------------------------------------------------
    def forward(self, attrs, xs, params, kernels):
        x = xs[0]
        shape = (x.shape[0], attrs["out"]) + tuple(self.axis_length(attrs, [x.shape[2 + a]], a) for a in (0, 1))
        y = kernels.conv_input_grad(x, params["weight"], adjoint(attrs), shape, "forward")
        if "bias" in params:
            y += params["bias"].view(1, -1, 1, 1)
        return y

    def weight_grad_from(self, attrs, x, g, weight_shape, kernels):
        return kernels.conv_weight_grad(g, x, adjoint(attrs), weight_shape)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        w = params["weight"]
        grads = {"weight": kernels.conv_weight_grad(g, xs[0], adjoint(attrs), tuple(w.shape))}
        if "bias" in params:
            grads["bias"] = g.sum(dim=(0, 2, 3))
        h = kernels.conv_forward(g, w, adjoint(attrs), "input_grad") if need[0] else None
        return [h], grads

    # error model ------------------------------------------------------------------------------
    def term_counts(self, attrs, x_shape, dtype, device) -> torch.Tensor:
        """Products summed into each output pixel, (1, 1, H_out, W_out): the taps that land on it (ones
        transposed-convolved with ones), times the input channels of a group, plus the bias."""
        ones = torch.ones((1, 1) + tuple(x_shape[2:]), dtype=dtype, device=device)
        taps = F.conv_transpose2d(ones, torch.ones((1, 1) + tuple(attrs["kernel"]), dtype=dtype, device=device), None,
                                  attrs["stride"], attrs["padding"], attrs["output_padding"], 1, attrs["dilation"])
        return taps * (attrs["in"] // attrs["groups"]) + (1 if attrs["bias"] else 0)

    def gammas(self, counts: torch.Tensor, gamma) -> torch.Tensor:
        """γ̃ₙ(λ) of each output pixel's own n (Higham & Mary 2019): `gamma` at each distinct count."""
        out = torch.zeros_like(counts)
        for n in torch.unique(counts).tolist():
            out[counts == n] = gamma(int(round(n)))
        return out

    def forward_error(self, attrs, ins, y, params, ctx, parts: bool = False):
        a, error = ins[0].value, ins[0].error
        w = params["weight"]
        w_abs = w.abs()
        counts = self.term_counts(attrs, a.shape, a.dtype, a.device)
        shape = tuple(y.shape)
        conv_t = lambda x, wa: ctx.kernels.conv_input_grad(x, wa, adjoint(attrs), shape)  # noqa: E731
        a_abs = a if ins[0].nonnegative else a.abs()
        abs_sum = conv_t(a_abs, w_abs)
        if "bias" in params:
            abs_sum.add_(params["bias"].abs().view(1, -1, 1, 1))
        accumulation = abs_sum * self.gammas(counts, ctx.gamma)
        rounding = ctx.rounding_term(conv_t, a_abs, w)
        propagated = conv_t(error, w_abs) if error is not None else 0.0
        radius = 0 if error is None else gather_radius(ins[0].radius, _CONV.reach(attrs), attrs["stride"][0])
        total = accumulation + rounding + propagated
        memo = {"parts": Parts(int(counts.max()), abs_sum, accumulation, rounding, propagated, ins[0].flips)} \
            if parts else {}
        return Field(y, total, radius, ins[0].flips, memo)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        w = params["weight"]
        w_abs, g_abs = w.abs(), g.abs()
        x = ins[0]
        conv = adjoint(attrs)
        input_field = None
        if need[0]:
            kh, kw = attrs["kernel"]
            n_input = attrs["out"] // attrs["groups"] * kh * kw
            forward = lambda e, wa: ctx.kernels.conv_forward(e, wa, conv)  # noqa: E731
            error = forward(torch.mul(g_abs, ctx.gamma(n_input)).add_(grad.error), w_abs)
            rounding = ctx.rounding_term(forward, g_abs, w)
            if torch.is_tensor(rounding):
                error.add_(rounding)
            flips = forward(grad.flips, w_abs) if has_values(grad.flips) else None
            input_field = GradField(error, flips, spread(grad.radius, _CONV.reach(attrs), attrs["stride"][0]),
                                    grad.flip_count)
        parts = {}
        x_abs = x.value if x.nonnegative else x.value.abs()
        if "bias" in params:
            chi = roundoff.dependency_count(grad.radius, g.shape[2] * g.shape[3])
            parts["bias"] = _bias_parts(g, g_abs, grad, (0, 2, 3), chi, ctx)
        # the weight gradient is conv2d's with the roles swapped: g as its input, x as its output gradient; their
        # errors are read, never overwritten (owned/consumable False); g's flips are added whole below
        as_input = Field(g, grad.error, grad.radius, grad.flip_count)
        x_error = x.error if x.error is not None else torch.zeros_like(x.value)
        as_gradient = GradField(x_error, None, x.radius, x.flips, owned=False)
        weight = _CONV._weight_grad_parts(conv, x.value, x_abs.clone(), as_gradient, None, as_input, tuple(w.shape),
                                          ctx)
        if has_values(grad.flips):
            # flipped ReLUs downstream pass or block a whole gradient: Σ F·(|x| + E_x), added deterministically
            weight.propagated = weight.propagated + ctx.kernels.conv_weight_grad(grad.flips, x_abs + x_error, conv,
                                                                                 tuple(w.shape))
        n_terms = x.value.shape[0] * x.value.shape[2] * x.value.shape[3]
        x_repeats = [roundoff.repeats(x.value[:, c], n_terms, ctx.precision) for c in range(x.value.shape[1])]
        drift = _conv_weight_drift(x.value, x_repeats, g, conv, tuple(w.shape), ctx)
        if drift is not None:
            weight.accumulation, weight.drifted = roundoff.with_drift(weight.accumulation, drift)
        parts["weight"] = weight
        return [input_field], parts

    # sampled propagation ----------------------------------------------------------------------
    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        abs_sum = self.forward(attrs, [xs[0].abs()], abs_params(params), kernels)
        counts = self.term_counts(attrs, xs[0].shape, abs_sum.dtype, abs_sum.device)
        whole = self.gammas(counts, lambda n: gamma_over_lambda(n, u, lam)) * abs_sum
        if is_seed_conv(adjoint(attrs)):
            return whole  # a Winograd or FFT input gradient is legitimate here: S's scale, as conv2d's input gradient
        scale = _order_only_forward_scale(self, attrs, xs, y, params, kernels, abs_sum, int(counts.max()), u, lam)
        return torch.minimum(scale, whole)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        kh, kw = attrs["kernel"]
        n = attrs["out"] // attrs["groups"] * kh * kw
        if not need[0] or not is_seed_conv(adjoint(attrs)):
            return _order_only_backward_scales(self, attrs, g, xs, params, kernels, need, grads, n, u, lam)
        # the input gradient is a 3×3 stride-1 convolution's forward: Winograd's own scale where it is larger
        (s_in,), _ = self.backward(attrs, g.abs(), [xs[0].abs()], None, abs_params(params), kernels, need)
        direct = gamma_over_lambda(n, u, lam) * s_in
        return [torch.maximum(direct, winograd_scale(g, params["weight"], u).to(direct.dtype))]

    # what a port gets wrong -------------------------------------------------------------------
    def port_slips(self, attrs, in_shape):
        slips = []
        if tuple(attrs["kernel"]) != (1, 1):
            slips.append(PortSlip("kernel orientation", "computed as a correlation over the zero-inserted input "
                                  "without rotating the kernel by 180°", lambda: TrueConvolution(self), forward=True,
                                  every=("every transposed convolution",)))
        texts: dict[int, list[str]] = {}
        pads, extra = attrs["padding"], attrs["output_padding"]
        if pads[0] == pads[1] and extra[0] == extra[1]:  # the slips of a port that crops both axes alike
            p, op = pads[0], extra[0]
            for shift, text in ((p, "crops all 2·padding rows and columns at the top and left"),
                                (-p, "crops all 2·padding rows and columns at the bottom and right"),
                                (1, "crops one row and column too many at the top and left"),
                                (-1, "crops one row and column too few at the top and left"),
                                (-op, "puts output_padding at the top and left instead of the bottom and right")):
                if shift:
                    texts.setdefault(shift, []).append(text)
        for shift, said in texts.items():
            text = said[0] + (f" (equally: {'; '.join(said[1:])})" if len(said) > 1 else "")
            slips.append(PortSlip("crop", text,
                                  lambda shift=shift: Cropped(self, shift), forward=True))
        return slips


class Cropped(Rule):
    """A transposed convolution whose output is the uncropped one read from `padding + shift` on (zeros beyond its
    ends) instead of from `padding`; backward as its autograd: the output gradient placed back on the uncropped grid."""

    def __init__(self, op: ConvTranspose2d, shift: int):
        self.op, self.shift = op, shift

    def _pads(self, attrs, x_shape) -> tuple[int, int, int, int]:
        """F.pad's (left, right, top, bottom) taking the uncropped grid to the output grid."""
        pads = []
        for axis in (1, 0):
            start = attrs["padding"][axis] + self.shift
            stop = start + self.op.axis_length(attrs, [x_shape[2 + axis]], axis)
            pads += [-start, stop - _full_length(attrs, x_shape[2 + axis], axis)]
        return tuple(pads)

    @staticmethod
    def _uncropped(attrs) -> dict:
        return dict(adjoint(attrs), padding=(0, 0))

    def forward(self, attrs, xs, params, kernels):
        x = xs[0]
        full = tuple(_full_length(attrs, x.shape[2 + a], a) for a in (0, 1))
        y = kernels.conv_input_grad(x, params["weight"], self._uncropped(attrs), (x.shape[0], attrs["out"]) + full,
                                    "forward")
        y = F.pad(y, self._pads(attrs, x.shape))
        if "bias" in params:
            y = y + params["bias"].view(1, -1, 1, 1)
        return y

    def backward(self, attrs, g, xs, y, params, kernels, need):
        x, w = xs[0], params["weight"]
        left, right, top, bottom = self._pads(attrs, x.shape)
        back = F.pad(g, (-left, -right, -top, -bottom))  # the crop's adjoint: g on the uncropped grid
        conv = self._uncropped(attrs)
        grads = {"weight": kernels.conv_weight_grad(back, x, conv, tuple(w.shape))}
        if "bias" in params:
            grads["bias"] = g.sum(dim=(0, 2, 3))
        h = kernels.conv_forward(back, w, conv, "input_grad") if need[0] else None
        return [h], grads


register(ConvTranspose2d())
