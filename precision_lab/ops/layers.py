"""The ops with parameters: conv2d and linear. Each output element is one inner product.

Rounding model (precision_lab.roundoff): a forward output of conv2d sums n = (C_in/groups)·kh·kw
products (+1 for the bias), an input gradient (C_out/groups)·kh·kw, a weight or bias gradient
batch·H_out·W_out (conv2d) or batch (linear). S = Σ|terms| is the same operation applied to
|operands|; the bound of a sum is γ̃ₙ(λ)·S plus reduced-format operand rounding plus the upstream
errors entering it. Convolutions are linear in each operand, so γ̃·S + conv(E, |W|) is computed
as one convolution conv(γ̃|a| + E, |W|).

A convolution's weight-gradient sum is long (batch·H·W terms), so its own part is sharpened where the
algorithms that may compute it allow: the partial-sum bound of roundoff.partial_sum_bound (zero terms add no
rounding, a partial sum is at most max(S₊, S₋)) where only summation orders are legitimate, and, on a 3×3
stride-1 layer (Winograd, FFT), the larger of that and λ × Winograd's own scale on problems small enough to
compute it (WINOGRAD_SCALE_LIMIT; above it γ̃ₙ(λ)·S).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import REQUIRED, BoundContext, Field, GradField, Op, OpSpecError, Parts, as_pair, gather_radius, positive_int
from . import BackwardReplaced, PortSlip, Rule, abs_params, coupled_terms, gamma_over_lambda, has_values, is_seed_conv, nonzero, register, sparse_points, spread
from .onnx_reading import OnnxRead, attr, bias_of, pads_tblr, require
from .. import roundoff
from ..conv.winograd_bound import winograd_scale, winograd_weight_grad_scale

#: batch·H·W up to which a 3×3 stride-1 layer's weight gradient gets Winograd's own scale and, with it, the direct
#: orders' partial-sum bound (as the sampled draws, precision_lab.sampled.ELEMENT_LIMIT); above it the scale's
#: cost grows with the tiles, and γ̃ₙ(λ)·S stands for every algorithm with the |W|·E upstream part's room
#: (docs/verdicts.md, "The bound")
WINOGRAD_SCALE_LIMIT = 4 * 128 * 128
#: weight-gradient terms (elements × batch·H·W) up to which they are formed to find the absorbed ones (the
#: partial-sum bound needs them: roundoff.absorbed_mass); above it the own part stays γ̃ₙ(λ)·S. 2²⁸: the seed
#: CNN's widest layer at 128², in about a second
ABSORPTION_TERMS_LIMIT = 2 ** 28
#: float64 products formed at once (256 MB)
ABSORPTION_BLOCK = 2 ** 25
#: batch·H·W up to which a bias gradient's own part is roundoff.order_free_bound (the probes, the sampled sizes);
#: above it γ̃ₙ(λ)·S, as for the weight gradient there: its float64 passes took 0.45 s a 16-channel layer at
#: 2·1024², a third more on the seed CNN's bounds
BIAS_ORDER_FREE_LIMIT = 4 * 128 * 128


def _abs(t: torch.Tensor) -> torch.Tensor:
    return t.abs()



def _conv_pads(raw: dict, padding) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a conv2d's padding: a 4-list as given, "valid" none, "same" TensorFlow's
    rule: total d·(k − 1) + 1 − s per axis (the input a multiple of the stride), the odd pixel at the bottom/right."""
    if isinstance(padding, list):
        if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in padding):
            raise OpSpecError(f"'padding' is {padding!r}: expected [top, bottom, left, right], non-negative integers")
        return tuple(padding)
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding != "same":
        raise OpSpecError(f"'padding' is {padding!r}: expected an integer, [height, width], [top, bottom, left, right], "
                          f"\"same\" or \"valid\"")
    kernel, stride, dilation = (as_pair(raw.get(key, default), key, 1)
                                for key, default in (("kernel", None), ("stride", 1), ("dilation", 1)))
    pads = []
    for axis in (0, 1):
        total = max(dilation[axis] * (kernel[axis] - 1) + 1 - stride[axis], 0)
        pads += [total // 2, total - total // 2]
    return tuple(pads)

class Conv2d(Op):
    name = "conv2d"
    keys = {"in": REQUIRED, "out": REQUIRED, "kernel": REQUIRED, "stride": 1, "padding": 0, "dilation": 1,
            "bias": True, "groups": 1}
    parametrised = True
    rounded_params = ("weight",)

    windowed = True
    window_shifts = "input"  # a padding offset moves the input's windows
    reads_error_backward = True

    torch_modules = (torch.nn.Conv2d,)

    def expand(self, raw):
        """Per-side padding ([top, bottom, left, right]) or "same"/"valid" (TensorFlow's rules) is a zero_pad2d and the
        conv unpadded; symmetric padding stays the conv's own [height, width]."""
        padding = raw.get("padding")
        if not (isinstance(padding, str) or (isinstance(padding, list) and len(padding) == 4)):
            return [raw]
        pads = _conv_pads(raw, padding)
        if pads[0] == pads[1] and pads[2] == pads[3]:
            return [dict(raw, padding=[pads[0], pads[2]])]
        multiple = raw.get("stride", 1) if padding == "same" else 1
        # the pad reads what the conv was written to read; the conv then reads the pad
        pad = {"op": "zero_pad2d", "padding": list(pads), "multiple": multiple,
               **({"inputs": raw["inputs"]} if "inputs" in raw else {})}
        return [pad, {key: value for key, value in raw.items() if key != "inputs"} | {"padding": 0}]

    onnx_ops = ("Conv",)

    def from_onnx_node(self, node, graph):
        """ONNX Conv (weight OIHW, as the lab's canonical layout); a bias as Conv's third input or a following Add."""
        weight = graph.constant(node.inputs[1])
        require(weight is not None and weight.ndim == 4, "its weight is not a constant 4-D tensor (a 2-D convolution "
                "with weights as an initializer)")
        out, per_group, kh, kw = weight.shape
        require(list(attr(node, "kernel_shape", [kh, kw])) == [kh, kw], "kernel_shape differs from its weight's")
        auto_pad = attr(node, "auto_pad", "NOTSET")
        # SAME_UPPER puts the odd pixel after, TensorFlow's "same" (docs/models.md, "Per-side and same padding")
        padding = {"NOTSET": None, "VALID": "valid", "SAME_UPPER": "same"}.get(auto_pad, auto_pad)
        require(padding != "SAME_LOWER", "auto_pad SAME_LOWER (the odd pixel before): export with explicit pads")
        pads = pads_tblr(attr(node, "pads", [0, 0, 0, 0]))
        if pads[0] == pads[1] and pads[2] == pads[3]:
            pads = [pads[0], pads[2]]  # symmetric: the conv's own padding, as PyTorch writes it
        group = int(attr(node, "group", 1))
        attrs = {"in": per_group * group, "out": out, "kernel": [kh, kw],
                 "stride": list(attr(node, "strides", [1, 1])),
                 "padding": pads if padding is None else padding,
                 "dilation": list(attr(node, "dilations", [1, 1])), "groups": group}
        return _with_bias(OnnxRead(attrs, graph.data_inputs(node), node.outputs[0], params={"weight": weight},
                                   param_sources={"weight": node.inputs[1]}), node, graph, out, image=True)

    def from_torch_module(self, module):
        if module.padding_mode != "zeros":
            raise OpSpecError(f"Conv2d with padding_mode {module.padding_mode!r}: only zero padding is supported")
        return {"in": module.in_channels, "out": module.out_channels, "kernel": list(module.kernel_size),
                "stride": list(module.stride),
                "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
                "dilation": list(module.dilation), "groups": module.groups, "bias": module.bias is not None}

    def port_slips(self, attrs, in_shape):
        slips = []
        if attrs["groups"] > 1:
            slips.append(PortSlip("routing", "weight gradient sums the windows of every group's input channels, not its "
                                  "own group's (a dense weight-gradient kernel folded onto the grouped weight)",
                                  lambda: BackwardReplaced(self, _weight_grad_over_every_group)))
        if tuple(attrs["kernel"]) == (1, 1):
            return slips
        return slips + [PortSlip("kernel orientation", "computed as a true convolution, the kernel flipped (cuDNN's "
                         "CUDNN_CONVOLUTION mode) where the spec means cross-correlation (CUDNN_CROSS_CORRELATION, as "
                         "PyTorch and TensorFlow)", lambda: TrueConvolution(self), forward=True,
                         every=("every convolution",))]

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        abs_sum = self.forward(attrs, [xs[0].abs()], abs_params(params), kernels)
        n = self.terms_forward(attrs)
        if is_seed_conv(attrs):
            direct = gamma_over_lambda(n, u, lam) * abs_sum
            # a legitimate Winograd algorithm rounds more where the layer has few input channels: its scale
            return torch.maximum(direct, winograd_scale(xs[0], params["weight"], u).to(direct.dtype))
        return _order_only_forward_scale(self, attrs, xs, y, params, kernels, abs_sum, n, u, lam)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        kh, kw = attrs["kernel"]
        # Winograd and FFT are legitimate for the seed convolution: S's scale
        return _order_only_backward_scales(self, attrs, g, xs, params, kernels, need, grads,
                                           attrs["out"] // attrs["groups"] * kh * kw, u, lam,
                                           whole_sum=is_seed_conv(attrs))

    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.Conv2d(attrs["in"], attrs["out"], attrs["kernel"], attrs["stride"], attrs["padding"],
                               attrs["dilation"], attrs["groups"], attrs["bias"], device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return module(xs[0])

    def check(self, attrs):
        attrs["in"], attrs["out"] = positive_int(attrs["in"], "in"), positive_int(attrs["out"], "out")
        attrs["kernel"] = as_pair(attrs["kernel"], "kernel", 1)
        attrs["stride"] = as_pair(attrs["stride"], "stride", 1)
        attrs["padding"] = as_pair(attrs["padding"], "padding", 0)
        attrs["dilation"] = as_pair(attrs["dilation"], "dilation", 1)
        attrs["groups"] = positive_int(attrs["groups"], "groups")
        if attrs["in"] % attrs["groups"] or attrs["out"] % attrs["groups"]:
            raise OpSpecError(f"'groups' {attrs['groups']} must divide 'in' {attrs['in']} and 'out' {attrs['out']}")
        return _bias_checked(attrs)

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 3:
            raise OpSpecError(f"conv2d needs an image (C, H, W) but receives {len(shape)}-D features "
                              f"(a flatten came before it)")
        if shape[0] != attrs["in"]:
            raise OpSpecError(f"receives {shape[0]} channels but declares 'in': {attrs['in']} (channels do not chain)")
        return (attrs["out"],) + tuple(self.axis_length(attrs, [shape[1 + axis]], axis) for axis in (0, 1))

    def axis_length(self, attrs, lengths, axis):
        length = lengths[0]
        if length is None:
            return None
        k, s, p, d = (attrs[key][axis] for key in ("kernel", "stride", "padding", "dilation"))
        side = ("height", "width")[axis]
        span = length + 2 * p - d * (k - 1)
        if span < 1:
            raise OpSpecError(f"input {side} {length} is smaller than its {d * (k - 1) + 1}-pixel kernel window "
                              f"(padding {p})")
        # PyTorch's floor: the last rows no window reaches are dropped (no gradient there, and no error)
        return (span - 1) // s + 1

    def param_shapes(self, attrs):
        kh, kw = attrs["kernel"]
        shapes = {"weight": (attrs["out"], attrs["in"] // attrs["groups"], kh, kw)}
        if attrs["bias"]:
            shapes["bias"] = (attrs["out"],)
        return shapes

    def describe(self, attrs):
        kh, kw = attrs["kernel"]
        extra = "".join(f" {key} {attrs[key][0] if attrs[key][0] == attrs[key][1] else list(attrs[key])}"
                        for key, default in (("stride", 1), ("dilation", 1)) if attrs[key] != (default, default))
        return f"conv2d {attrs['in']}→{attrs['out']} {kh}×{kw}{extra}"

    @staticmethod
    def reach(attrs, axis: int = 0) -> int:
        """Farthest input pixel (from stride·q) an output pixel reads."""
        k, p, d = attrs["kernel"][axis], attrs["padding"][axis], attrs["dilation"][axis]
        return max(p, d * (k - 1) - p)

    # compute -----------------------------------------------------------------------------------
    def forward(self, attrs, xs, params, kernels):
        z = kernels.conv_forward(xs[0], params["weight"], attrs)
        if "bias" in params:
            z += params["bias"].view(1, -1, 1, 1)
        return z

    def weight_grad_from(self, attrs, x, g, weight_shape, kernels):
        return kernels.conv_weight_grad(x, g, attrs, weight_shape)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        w = params["weight"]
        grads = {"weight": kernels.conv_weight_grad(xs[0], g, attrs, tuple(w.shape))}
        if "bias" in params:
            grads["bias"] = g.sum(dim=(0, 2, 3))
        h = kernels.conv_input_grad(g, w, attrs, tuple(xs[0].shape)) if need[0] else None
        return [h], grads

    # error model ------------------------------------------------------------------------------
    def terms_forward(self, attrs) -> int:
        kh, kw = attrs["kernel"]
        return attrs["in"] // attrs["groups"] * kh * kw + (1 if attrs["bias"] else 0)

    def forward_error(self, attrs, ins, y, params, ctx, parts: bool = False):
        a, error = ins[0].value, ins[0].error
        w_abs = params["weight"].abs()
        n = self.terms_forward(attrs)
        gamma = ctx.gamma(n)
        conv = lambda x, w: ctx.kernels.conv_forward(x, w, attrs)  # noqa: E731
        a_abs = a if ins[0].nonnegative else a.abs()
        rounding = ctx.rounding_term(conv, a_abs, params["weight"])
        bias_abs = params["bias"].abs().view(1, -1, 1, 1) if "bias" in params else 0.0
        radius = 0 if error is None else spread(ins[0].radius, self.reach(attrs), attrs["stride"][0])
        if parts:  # the network output: every part kept (one quantity of the report)
            abs_sum = conv(a_abs, w_abs) + bias_abs
            propagated = conv(error, w_abs) if error is not None else 0.0
            accumulation = gamma * abs_sum
            total = accumulation + rounding + propagated
            return Field(y, total, radius, ins[0].flips, {"parts": Parts(n, abs_sum, accumulation, rounding, propagated,
                                                                         ins[0].flips)})
        # γ̃·S + conv(E, |W|) = conv(γ̃|a| + E, |W|): the convolution is linear in its input (one pass, not two)
        if error is not None and ins[0].consumable:
            reach = error.add_(a_abs, alpha=gamma)
        else:
            reach = torch.mul(a_abs, gamma)
            if error is not None:
                reach.add_(error)
        total = conv(reach, w_abs)
        del reach
        if "bias" in params:
            total.add_(bias_abs * gamma)
        if torch.is_tensor(rounding):
            total.add_(rounding)
        return Field(y, total, radius, ins[0].flips)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        # the parameters' parts first, the input's error last, reusing their operands' memory (peak at 1024²)
        w = params["weight"]
        w_abs = w.abs()
        g_abs = g.abs()
        flip_points = sparse_points(grad.flips)
        bias_parts = None
        n_terms = g.shape[0] * g.shape[2] * g.shape[3]
        g_repeats = [roundoff.repeats(g[:, c], n_terms, ctx.precision) for c in range(g.shape[1])]
        if "bias" in params:
            bias_parts = _bias_parts(g, g_abs, grad, (0, 2, 3), self._chi(attrs, grad, g), ctx, g_repeats)
        drift = _conv_weight_drift(g, g_repeats, ins[0].value, attrs, tuple(w.shape), ctx)
        parts = {"weight": self._weight_grad_parts(attrs, g, g_abs, grad, flip_points, ins[0], tuple(w.shape), ctx)}
        if drift is not None:
            parts["weight"].accumulation, parts["weight"].drifted = roundoff.with_drift(parts["weight"].accumulation, drift)
        if bias_parts is not None:
            parts["bias"] = bias_parts
        input_field = None
        if need[0]:
            kh, kw = attrs["kernel"]
            n_input = attrs["out"] // attrs["groups"] * kh * kw
            shape = tuple(ins[0].value.shape)
            conv_t = lambda e, wa: ctx.kernels.conv_input_grad(e, wa, attrs, shape)  # noqa: E731
            rounding = ctx.rounding_term(conv_t, g_abs, w)
            # γ̃·|g| + E, formed in |g|'s memory and, where this op owns E, in E's (a + b = b + a, bit for bit)
            reach = g_abs.mul_(ctx.gamma(n_input))
            del g_abs
            if grad.owned:
                reach, grad.error = grad.error.add_(reach), None  # nobody reads E after: freed with reach
            else:
                reach.add_(grad.error)
            error = conv_t(reach, w_abs)
            del reach
            if torch.is_tensor(rounding):
                error.add_(rounding)
            flips = None
            if flip_points is not None:
                flips = _sparse_input_grad(grad.flips, flip_points, w_abs, attrs, shape)
            elif has_values(grad.flips):
                flips = conv_t(grad.flips, w_abs)
            if grad.owned:
                grad.flips = None
            input_field = GradField(error, flips, gather_radius(grad.radius, self.reach(attrs), attrs["stride"][0]),
                                    grad.flip_count)
        return [input_field], parts

    @staticmethod
    def _chi(attrs, grad: GradField, g) -> int:
        return roundoff.dependency_count(grad.radius, g.shape[2] * g.shape[3], coupled_terms(g.numel() // g.shape[1], grad))

    def _weight_grad_parts(self, attrs, g, g_abs, grad: GradField, flip_points, inp: Field, weight_shape,
                           ctx: BoundContext) -> Parts:
        """Σ over batch·H_out·W_out of a·g: S, accumulation, rounding, and the upstream errors of a and g.

        The sums of squared terms are squared block by block (Kernels.conv_weight_grad_of_squares); the input's
        error is freed when the walk says nobody reads it after (each is a full-size tensor at 1024²)."""
        wgrad = lambda x, e: ctx.kernels.conv_weight_grad(x, e, attrs, weight_shape)  # noqa: E731
        a_abs = inp.value if inp.nonnegative else inp.value.abs()
        n = g_abs.shape[0] * g_abs.shape[2] * g_abs.shape[3]
        live = signed = None
        transformed = is_seed_conv(attrs)  # a 3×3 stride-1 layer may be computed by Winograd or FFT
        affordable = n * int(np.prod(weight_shape)) <= ABSORPTION_TERMS_LIMIT  # every term is formed once, below
        if affordable and (not transformed or n <= WINOGRAD_SCALE_LIMIT):
            # the direct orders' partial sums (where a transformed algorithm's scale comes with them, below), and the
            # terms the candidate may hold nonzero
            live = wgrad(_may_be_nonzero(inp.value, inp.error), _may_be_nonzero(g, grad.error, grad.flips))
            signed = wgrad(inp.value, g)
        if g_abs.shape[1] <= 4 and attrs["groups"] == 1:
            # few output channels (a last layer): one pass over the many-channel input for S and Σ|a|E_g
            doubled = (2 * weight_shape[0], *weight_shape[1:])
            both = ctx.kernels.conv_weight_grad(a_abs, torch.cat([g_abs, grad.error], dim=1), attrs, doubled)
            abs_sum, deterministic = both[:g_abs.shape[1]], both[g_abs.shape[1]:]
        else:
            abs_sum, deterministic = ctx.shared_sum(lambda: wgrad(a_abs, g_abs)), wgrad(a_abs, grad.error)
        rounding = ctx.rounding_term(wgrad, a_abs, g_abs)
        second_order = 0.0
        if inp.error is not None:
            deterministic = deterministic + wgrad(inp.error, g_abs)
            # Σ E_a·(E_g + F) ≤ max(E_a)·Σ(E_g + F): second order, cheap and tiny
            upstream = grad.error.sum(dim=(0, 2, 3)) + (grad.flips.sum(dim=(0, 2, 3)) if grad.flips is not None else 0.0)
            second_order = float(inp.error.max()) * upstream.view(-1, 1, 1, 1)
        squares_of = lambda x, e: ctx.kernels.conv_weight_grad_of_squares(x, e, attrs, weight_shape)  # noqa: E731
        squares = squares_of(a_abs, grad.error)
        if inp.error is not None:
            squares = 2 * (squares + squares_of(inp.error, g_abs))
            if inp.consumable:
                inp.error = None  # nobody reads it after: freed now (memory at 1024²)
        radius = _max_radius(spread(inp.radius, self.reach(attrs), attrs["stride"][0]), grad.radius)
        chi = roundoff.dependency_count(radius, g_abs.shape[2] * g_abs.shape[3], coupled_terms(n, inp, grad))
        propagated = ctx.sum_of_errors(deterministic, squares, chi) + second_order
        # flipped ReLUs pass or block a whole gradient: added deterministically
        if flip_points is not None:
            propagated = propagated + _sparse_weight_grad(a_abs, grad.flips, flip_points, attrs, weight_shape)
        elif has_values(grad.flips):
            propagated = propagated + wgrad(a_abs, grad.flips)
        if live is None:
            own = ctx.gamma(n) * abs_sum
        else:
            threshold = roundoff.absorption_threshold(abs_sum.double(), signed.double(), n, ctx.u)
            absorbed = _absorbed_mass(inp.value, g, attrs, weight_shape, threshold).to(abs_sum.dtype)
            own = roundoff.partial_sum_bound(abs_sum, signed, live, n, ctx.u, ctx.lam).add_(absorbed)
        if transformed and n <= WINOGRAD_SCALE_LIMIT:
            # a Winograd algorithm's roundings reach lags whose own terms are few or zero (the edge taps)
            own = torch.maximum(own, ctx.lam * winograd_weight_grad_scale(inp.value, g, ctx.u).to(own.dtype))
        return Parts(n, abs_sum, own, rounding, propagated, grad.flip_count + inp.flips)


# ---------------------------------------------------------------------------------------------
# point-by-point convolutions of sparse flip fields (any kernel, stride, padding, dilation, groups)


def _absorbed_mass(x: torch.Tensor, g: torch.Tensor, attrs, weight_shape, threshold: torch.Tensor) -> torch.Tensor:
    """roundoff.absorbed_mass of every weight-gradient element's terms a·g, formed in float64 a block of output
    channels at a time: (O, C/groups, kh, kw)."""
    cols = F.unfold(x.double(), attrs["kernel"], dilation=attrs["dilation"], padding=attrs["padding"],
                    stride=attrs["stride"])  # (B, C·kh·kw, L)
    c_out, per_group = weight_shape[0], int(np.prod(weight_shape[1:]))
    outs_per_group = c_out // attrs["groups"]
    grad = g.double().flatten(2)  # (B, O, L)
    limit = threshold.reshape(c_out, per_group, 1)
    out = torch.zeros(c_out, per_group, dtype=torch.float64, device=x.device)
    block = max(1, min(outs_per_group, ABSORPTION_BLOCK // max(1, cols.shape[0] * per_group * cols.shape[2])))
    start = 0
    while start < c_out:
        group = start // outs_per_group
        stop = min(start + block, (group + 1) * outs_per_group)  # one group per block
        terms = (grad[:, start:stop, None, :] * cols[:, None, group * per_group:(group + 1) * per_group, :]).abs_()
        out[start:stop] = terms.masked_fill_(terms >= limit[None, start:stop], 0.0).sum(dim=(0, 3))  # in place: 1.5× faster
        start = stop
    return out.view(weight_shape)


def _may_be_nonzero(value: torch.Tensor, *errors) -> torch.Tensor:
    """1 where the candidate's tensor may be nonzero: the exact value is, or an error bound (or flip) allows it."""
    mask = value != 0
    for error in errors:
        if error is not None:
            mask |= error != 0
    return mask.to(value.dtype)


def _columns_moved(weight: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The (out, in) weight whose column order[j] is `weight`'s column j."""
    require(weight.shape[1] == order.size, f"its matrix has {weight.shape[1]} rows, the flatten before it gives "
            f"{order.size} features")
    moved = np.empty_like(weight)
    moved[:, order] = weight
    return moved


def _with_bias(read: OnnxRead, node, graph, channels: int, image: bool) -> OnnxRead:
    """`read` with its bias: the node's third input, else a following Add of one constant per output channel
    (absorbed), else none."""
    bias_name = node.inputs[2] if node.op_type in ("Conv", "ConvTranspose") and len(node.inputs) > 2 else ""
    bias = graph.constant(bias_name)
    if bias is None:
        after = graph.only_reader(node.outputs[0])
        bias = bias_of(after, graph, channels, image)
        if bias is not None:
            read.absorbed, read.output = [after], after.outputs[0]
            bias_name = next(t for t in after.inputs if graph.constant(t) is not None)
    read.attrs["bias"] = bias is not None
    if bias is not None:
        read.params["bias"], read.param_sources["bias"] = bias.reshape(-1), bias_name
    return read


def _bias_checked(attrs):
    if not isinstance(attrs["bias"], bool):
        raise OpSpecError(f"'bias' is {attrs['bias']!r}: expected true or false")
    return attrs


def _taps(ys, xs, attrs, height: int, width: int):
    """Input rows y·s − p + d·i and columns x·s − p + d·j read by output points (ys, xs), clamped into the
    image, and an (m, kh, kw) mask of the taps that lie inside it (outside is zero padding)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (attrs[k] for k in ("kernel", "stride", "padding", "dilation"))
    rows = ys[:, None] * sh - ph + dh * torch.arange(kh, device=ys.device)
    cols = xs[:, None] * sw - pw + dw * torch.arange(kw, device=xs.device)
    inside = ((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[:, None, :]
    return rows.clamp(0, height - 1), cols.clamp(0, width - 1), inside


def _sparse_weight_grad(a, f, points, attrs, weight_shape):
    """weight_grad(a, f) from f's few non-zeros: [o, c, i, j] = Σ a[n, g(o)·C_g + c, y·s − p + d·i, …]·f[n, o, y, x]."""
    images, outs, ys, xs = points
    rows, cols, inside = _taps(ys, xs, attrs, a.shape[2], a.shape[3])
    per_group = weight_shape[1]
    first = (outs // (weight_shape[0] // attrs["groups"])) * per_group
    channels = first[:, None] + torch.arange(per_group, device=a.device)[None, :]
    patch = a[images[:, None, None, None], channels[:, :, None, None], rows[:, None, :, None], cols[:, None, None, :]]
    terms = patch.mul_(inside[:, None]).mul_(f[images, outs, ys, xs][:, None, None, None])
    return a.new_zeros(weight_shape).index_add_(0, outs, terms)


def _sparse_input_grad(f, points, w_abs, attrs, input_shape):
    """input_grad(f, |W|) from f's few non-zeros: each f[n, o, y, x] adds f·|W|[o, c, i, j] at the input pixel it read."""
    images, outs, ys, xs = points
    out = f.new_zeros(input_shape)
    rows, cols, inside = _taps(ys, xs, attrs, input_shape[2], input_shape[3])
    per_group = w_abs.shape[1]
    first = (outs // (w_abs.shape[0] // attrs["groups"])) * per_group
    channels = first[:, None] + torch.arange(per_group, device=f.device)[None, :]
    shape = (len(images), per_group, rows.shape[1], cols.shape[1])
    index = [images[:, None, None, None], channels[:, :, None, None], rows[:, None, :, None], cols[:, None, None, :]]
    keep = inside[:, None].expand(shape)
    values = (w_abs[outs] * f[images, outs, ys, xs][:, None, None, None])[keep]
    out.index_put_(tuple(i.expand(shape)[keep] for i in index), values, accumulate=True)
    return out


def _sum_of_squares(t: torch.Tensor, dims) -> torch.Tensor:
    """Σ t² over `dims` per channel without a squared copy of t (128 MB at 1024²): for an image
    tensor, one dot product per image and channel."""
    if dims == (0, 2, 3):
        flat = t.reshape(t.shape[0], t.shape[1], 1, -1)
        return torch.matmul(flat, flat.transpose(-1, -2)).sum(dim=0).view(-1)
    return (t * t).sum(dim=dims)


def _has(t) -> bool:
    return t is not None and bool(torch.count_nonzero(t))


def _max_radius(a, b):
    return None if a is None or b is None else max(a, b)


def _conv_weight_drift(g, g_repeats, a, attrs, weight_shape, ctx: BoundContext):
    """The simulated sequential sums' error (`roundoff.column_drift`) of the weight-gradient elements whose
    two factors both repeat (`roundoff.repeats`: a broadcast gradient times a quantised image, say); None
    where no pair does. Other products take continuous values, whose rounding errors average out."""
    c_out, per_group, kh, kw = weight_shape
    n = g.shape[0] * g.shape[2] * g.shape[3]
    outs_per_group = c_out // attrs["groups"]
    if not any(g_repeats):
        return None
    a_repeats = [roundoff.repeats(a[:, ci], n, ctx.precision) for ci in range(a.shape[1])]
    pairs = [(co, ci) for co in range(c_out) if g_repeats[co]
             for ci in range(per_group) if a_repeats[co // outs_per_group * per_group + ci]]
    if not pairs:
        return None
    drift = torch.zeros(weight_shape, dtype=torch.float64, device="cpu")
    grid = (g.shape[0], g.shape[2], g.shape[3])
    for co, ci in pairs:
        channel = co // outs_per_group * per_group + ci
        cols = F.unfold(a[:, channel:channel + 1].to(torch.float32), (kh, kw), dilation=attrs["dilation"],
                        padding=attrs["padding"], stride=attrs["stride"])  # (N, kh·kw, L)
        products = g[:, co].to(torch.float32).reshape(g.shape[0], 1, -1) * cols  # float32 products, as computed
        columns = products.permute(0, 2, 1).reshape(n, kh * kw).cpu().numpy()  # raster order (batch, row, column)
        drift[co, ci] = torch.from_numpy(np.asarray(roundoff.column_drift(columns, grid, ctx.precision))).view(kh, kw)
    return drift


def image_sum_own(values: torch.Tensor, errors, ctx: BoundContext) -> torch.Tensor:
    """Own rounding of each channel's sum over its image (N, C, H, W) → (N, C), a sum only summation orders compute:
    roundoff.order_free_bound up to BIAS_ORDER_FREE_LIMIT terms (`errors`: where the candidate's terms may be
    nonzero besides the exact ones), γ̃ₙ(λ)·S above (a global pool, a per-channel factor's gradient)."""
    n = values.shape[2] * values.shape[3]
    terms = values.reshape(*values.shape[:2], n)
    if n > BIAS_ORDER_FREE_LIMIT:
        return ctx.gamma(n) * terms.abs().sum(dim=2)
    live = _may_be_nonzero(terms, None if errors is None else torch.broadcast_to(errors, values.shape).reshape(
        terms.shape)).sum(dim=2)
    return roundoff.order_free_bound(terms, live, ctx.u, ctx.lam, (2,)).to(values.dtype)


def _bias_parts(g, g_abs, grad: GradField, dims, chi: int, ctx: BoundContext, g_repeats=None) -> Parts:
    """Σ of the output gradient over batch (and pixels): S = Σ|g|, its errors as dependent mean-zero terms.

    The own part is the partial-sum bound of any summation order plus the absorbed terms (roundoff.order_free_bound:
    only orders compute this sum) up to BIAS_ORDER_FREE_LIMIT terms, γ̃ₙ(λ)·S above; or DRIFT_MARGIN × the
    simulated sequential sums' error where that is larger, for the channels whose terms repeat (`roundoff.repeats`):
    a gradient broadcast by a global pool or a mean loss is n equal terms, which stagnate (`roundoff.column_drift`)."""
    n = 1
    for d in dims:
        n *= g_abs.shape[d]
    abs_sum = g_abs.sum(dim=dims)
    if n <= BIAS_ORDER_FREE_LIMIT:
        # the terms the candidate may hold nonzero
        live = _may_be_nonzero(g, grad.error, grad.flips).sum(dim=dims)
        own = roundoff.order_free_bound(g, live, ctx.u, ctx.lam, dims).to(abs_sum.dtype)
    else:
        own = ctx.gamma(n) * abs_sum
    drifted = None
    if n > 1:
        # one column per channel that repeats, its terms in raster order (batch, row, column)
        if g_repeats is None:
            g_repeats = [roundoff.repeats(g[:, c], n, ctx.precision) for c in range(g.shape[1])]
        channels = [c for c in range(g.shape[1]) if g_repeats[c]]
        if channels:
            picked = g[:, channels]
            columns = picked.movedim(1, -1).reshape(n, -1)  # (batch, rows, columns[, tokens]) order, a channel each
            grid = (g.shape[0], g.shape[2], g.shape[3]) if g.dim() == 4 else None
            drift = roundoff.column_drift(roundoff.as_terms(columns, ctx.precision), grid, ctx.precision)
            drifted = torch.zeros(own.shape, dtype=torch.bool, device=own.device)
            own[channels], drifted[channels] = roundoff.with_drift(own[channels], drift)
    propagated = ctx.sum_of_errors(grad.error.sum(dim=dims), _sum_of_squares(grad.error, dims), chi)
    if _has(grad.flips):
        propagated = propagated + grad.flips.sum(dim=dims)
    return Parts(n, abs_sum, own, 0.0, propagated, grad.flip_count, drifted)


def _order_only_forward_scale(op, attrs, xs, y, params, kernels, abs_sum, n, u, lam):
    """A sum only summation orders compute: its partial sums' scale (roundoff.partial_sum_scale), or γ̃ₙ(λ)·S/λ if smaller."""
    live = op.forward(attrs, [nonzero(xs[0])], {k: nonzero(v) for k, v in params.items()}, kernels)
    return torch.minimum(roundoff.partial_sum_scale(abs_sum, y, live, n, u), gamma_over_lambda(n, u, lam) * abs_sum)


def _order_only_backward_scales(op, attrs, g, xs, params, kernels, need, grads, n, u, lam, whole_sum=False):
    """The input gradient's draw scale, as _order_only_forward_scale (γ̃ₙ(λ)·S/λ alone where `whole_sum`)."""
    if not need[0]:
        return [None]
    (s_in,), _ = op.backward(attrs, g.abs(), [xs[0].abs()], None, abs_params(params), kernels, need)
    if whole_sum:
        return [gamma_over_lambda(n, u, lam) * s_in]
    (live,), _ = op.backward(attrs, nonzero(g), [nonzero(xs[0])], None, {k: nonzero(v) for k, v in params.items()},
                             kernels, need)
    return [torch.minimum(roundoff.partial_sum_scale(s_in, grads[0], live, n, u), gamma_over_lambda(n, u, lam) * s_in)]


def _weight_grad_over_every_group(op, attrs, g, xs, y, params, kernels, need):
    """A grouped convolution's weight gradient taken densely (every input channel against every output channel's
    gradient) and summed over the groups onto the (out, in/groups, kh, kw) weight: its own group's part plus the rest."""
    grads, param_grads = op.backward(attrs, g, xs, y, params, kernels, need)
    weight = params["weight"]
    dense = dict(attrs, groups=1)
    full = kernels.conv_weight_grad(xs[0], g, dense, (weight.shape[0], attrs["in"], *weight.shape[2:]))
    groups, per_group = attrs["groups"], attrs["in"] // attrs["groups"]
    return grads, dict(param_grads, weight=full.reshape(weight.shape[0], groups, per_group, *weight.shape[2:]).sum(dim=1))


class TrueConvolution(Rule):
    """A conv2d computed with its kernel flipped in H and W (cuDNN's CUDNN_CONVOLUTION mode, scipy.signal.convolve2d)
    where the spec means cross-correlation; its weight gradient is the flipped problem's, flipped back."""

    def __init__(self, op):
        self.op = op

    @staticmethod
    def _flipped(params):
        return dict(params, weight=params["weight"].flip(-2, -1))

    def forward(self, attrs, xs, params, kernels):
        return self.op.forward(attrs, xs, self._flipped(params), kernels)

    def backward(self, attrs, g, xs, y, params, kernels, need):
        grads, param_grads = self.op.backward(attrs, g, xs, y, self._flipped(params), kernels, need)
        return grads, dict(param_grads, weight=param_grads["weight"].flip(-2, -1))

class Linear(Op):
    name = "linear"
    keys = {"in": REQUIRED, "out": REQUIRED, "bias": True}
    parametrised = True
    rounded_params = ("weight",)

    reads_error_backward = True

    torch_modules = (torch.nn.Linear,)

    def from_torch_module(self, module):
        return {"in": module.in_features, "out": module.out_features, "bias": module.bias is not None}

    onnx_ops = ("Gemm", "MatMul")

    def from_onnx_node(self, node, graph):
        """ONNX Gemm (B is (out, in) with transB = 1, PyTorch's; (in, out) with transB = 0) or MatMul by a constant
        (in, out) matrix (TensorFlow's and JAX's dense kernel) then an Add of the bias; the weight is stored OI."""
        matrix = graph.constant(node.inputs[1])
        require(matrix is not None and matrix.ndim == 2, "its second operand is not a constant matrix (a dense layer "
                "with weights as an initializer)")
        transposed = node.op_type == "Gemm" and int(attr(node, "transB", 0)) == 1
        require(not int(attr(node, "transA", 0)) and float(attr(node, "alpha", 1.0)) == 1.0
                and float(attr(node, "beta", 1.0)) == 1.0, "transA, alpha or beta other than Gemm's defaults")
        weight = matrix if transposed else matrix.T
        order = graph.feature_order(node.inputs[0])
        if order is not None:  # features flattened (H, W, C): each weight column goes where the spec's flatten puts it
            weight = _columns_moved(weight, order)
        read = OnnxRead({"in": weight.shape[1], "out": weight.shape[0]}, graph.data_inputs(node), node.outputs[0],
                        params={"weight": np.ascontiguousarray(weight)}, param_sources={"weight": node.inputs[1]})
        bias_name = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else ""
        bias = graph.constant(bias_name)
        if bias is None:
            return _with_bias(read, node, graph, weight.shape[0], image=False)
        require(bias.size == weight.shape[0], f"its bias C has shape {list(bias.shape)}, not one value per output")
        read.attrs["bias"] = True
        read.params["bias"], read.param_sources["bias"] = bias.reshape(-1), bias_name
        return read

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        abs_sum = self.forward(attrs, [xs[0].abs()], abs_params(params), kernels)
        n = attrs["in"] + (1 if attrs["bias"] else 0)
        return _order_only_forward_scale(self, attrs, xs, y, params, kernels, abs_sum, n, u, lam)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        return _order_only_backward_scales(self, attrs, g, xs, params, kernels, need, grads, attrs["out"], u, lam)

    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.Linear(attrs["in"], attrs["out"], attrs["bias"], device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return module(xs[0])

    def check(self, attrs):
        attrs["in"], attrs["out"] = positive_int(attrs["in"], "in"), positive_int(attrs["out"], "out")
        return _bias_checked(attrs)

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) not in (1, 2) and not (len(shape) == 3 and shape[-1] == attrs["in"]):  # (H, W, C): pixels
            raise OpSpecError(f"linear needs features (F,) or tokens (T, F) but receives an image {_shape_text(shape)}: "
                              f"put a flatten before it")
        if shape[-1] is not None and shape[-1] != attrs["in"]:
            raise OpSpecError(f"receives {shape[-1]} features but declares 'in': {attrs['in']} (sizes do not chain)")
        return (*shape[:-1], attrs["out"])

    def axis_length(self, attrs, lengths, axis):
        # tokens keep the image's grid in their count; features come after a flatten, where sizes stop being traced
        return lengths[0]

    def param_shapes(self, attrs):
        shapes = {"weight": (attrs["out"], attrs["in"])}
        if attrs["bias"]:
            shapes["bias"] = (attrs["out"],)
        return shapes

    def describe(self, attrs):
        return f"linear {attrs['in']}→{attrs['out']}"

    def forward(self, attrs, xs, params, kernels):
        y = kernels.linear_forward(xs[0], params["weight"])
        if "bias" in params:
            y += params["bias"]
        return y

    def backward(self, attrs, g, xs, y, params, kernels, need):
        # tokens (N, T, F): the weight and bias gradients sum over the batch and the tokens
        grads = {"weight": kernels.linear_weight_grad(xs[0].reshape(-1, xs[0].shape[-1]), g.reshape(-1, g.shape[-1]))}
        if "bias" in params:
            grads["bias"] = g.reshape(-1, g.shape[-1]).sum(dim=0)
        h = kernels.linear_input_grad(g, params["weight"]) if need[0] else None
        return [h], grads

    def forward_error(self, attrs, ins, y, params, ctx, parts: bool = False):
        a, error = ins[0].value, ins[0].error
        w_abs = params["weight"].abs()
        n = attrs["in"] + (1 if attrs["bias"] else 0)
        gamma = ctx.gamma(n)
        a_abs = a.abs()
        bias_abs = params["bias"].abs() if "bias" in params else 0.0
        abs_sum = a_abs @ w_abs.T + bias_abs
        rounding = ctx.rounding_term(lambda x, w: x @ w.T, a_abs, params["weight"])
        propagated = error @ w_abs.T if error is not None else 0.0
        accumulation = gamma * abs_sum
        total = accumulation + rounding + propagated
        memo = {"parts": Parts(n, abs_sum, accumulation, rounding, propagated, ins[0].flips)} if parts else {}
        return Field(y, total, None, ins[0].flips, memo)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need, chi: int = 1):
        if g.dim() > 2:
            return self._token_backward_error(attrs, g, grad, ins, out, params, ctx, need)
        w = params["weight"]
        w_abs, g_abs = w.abs(), g.abs()
        input_field = None
        if need[0]:
            error = (g_abs * ctx.gamma(attrs["out"]) + grad.error) @ w_abs
            rounding = ctx.rounding_term(lambda e, wa: e @ wa, g_abs, w)
            if torch.is_tensor(rounding):
                error = error + rounding
            flips = grad.flips @ w_abs if _has(grad.flips) else None
            input_field = GradField(error, flips, None, grad.flip_count)
        a_abs, a_error = ins[0].value.abs(), ins[0].error
        n = g.shape[0]
        abs_sum = g_abs.T @ a_abs
        deterministic = grad.error.T @ a_abs
        squares = (grad.error * grad.error).T @ (a_abs * a_abs)
        second_order = 0.0
        if a_error is not None:
            deterministic = deterministic + g_abs.T @ a_error
            squares = 2 * (squares + (g_abs * g_abs).T @ (a_error * a_error))
            upstream = grad.error.sum(dim=0) + (grad.flips.sum(dim=0) if _has(grad.flips) else 0.0)
            second_order = float(a_error.max()) * upstream.view(-1, 1)
        # each term of a weight-gradient element is one sample (or token): tokens of a sample may share roundings,
        # and errors coupled across the batch (a training-mode batch norm) share them with every term
        coupled = coupled_terms(n, ins[0], grad)
        chi = chi if coupled is None else coupled
        propagated = ctx.sum_of_errors(deterministic, squares, chi) + second_order
        if _has(grad.flips):
            propagated = propagated + grad.flips.T @ a_abs
        rounding = ctx.rounding_term(lambda x, e: e.T @ x, a_abs, g_abs)
        parts = {"weight": Parts(n, abs_sum, ctx.gamma(n) * abs_sum, rounding, propagated,
                                 grad.flip_count + ins[0].flips)}
        if "bias" in params:
            parts["bias"] = _bias_parts(g, g_abs, grad, (0,), chi, ctx)
        return [input_field], parts

    def _token_backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        """Tokens (N, T, F) as N·T rows: each row's input gradient is a row's, the weight and bias gradients sum over
        all rows; χ* = T (Janson 2004): a sample's tokens may share every rounding upstream (attention mixes them)."""
        tokens = g.numel() // (g.shape[0] * g.shape[-1])  # T, or H·W pixels of (N, H, W, C)
        rows = lambda t: None if t is None else t.reshape(-1, t.shape[-1])  # noqa: E731
        flat_in = [Field(rows(f.value), rows(f.error), None, f.flips) for f in ins]
        flat_grad = GradField(rows(grad.error), rows(grad.flips), None, grad.flip_count, grad.owned)
        (field,), parts = self.backward_error(attrs, rows(g), flat_grad, flat_in, out, params, ctx, need, chi=tokens)
        if field is not None:
            shape = ins[0].value.shape
            field = GradField(field.error.reshape(shape), None if field.flips is None else field.flips.reshape(shape),
                              None, field.flip_count)
        return [field], parts


def _shape_text(shape) -> str:
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"


register(Conv2d())
register(Linear())
