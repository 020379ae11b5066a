"""Multi-head self-attention over tokens as one op, `attention`, with nn.MultiheadAttention's parameters and names.

y = out_proj(concat_h softmax(q_h·k_hᵀ/√d)·v_h), [q, k, v] = x·in_proj_weightᵀ + in_proj_bias, d = D/heads. Its rules
are its parts' (ops.layers.Linear over tokens, ops.attention.Matmul and Softmax), each head a sample of its own:
(N, T, D) → (N·heads, T, d). The bound composes theirs (Higham 2002 §3.1 for every inner product; Blanchard, Higham &
Mary 2021 for the softmax), the upstream errors carried from part to part; parameter gradients are the two linears'.
"""
from __future__ import annotations

import math

import torch

from . import REQUIRED, BackwardReplaced, BoundContext, Field, GradField, Op, OpSpecError, OtherAttributes, PortSlip, positive_int, register
from .attention import Matmul, Softmax, _unscaled_backward, within_limit
from .layers import Linear
from .tokens import _text
from ..formats import REDUCED_FORMATS

_LINEAR, _MATMUL, _SOFTMAX = Linear(), Matmul(), Softmax()


def _exact(name, t, stored=False, gradient=False, unless_stored=False):
    """No rounding drawn: the block's own forward and backward (Op.forward_rounded's `rounded` left out)."""
    return t


def _stored_output_statistic(a_sm, weights, g_out, stored, computed):
    """What a fused attention backward adds to the scores' gradient by reading its output as stored.

    FlashAttention-2's backward (Dao 2023, Algorithm 2) takes each query's Dᵢ = Σ_c dOᵢ_c·Oᵢ_c from the output O it
    stored, not Σⱼ wᵢⱼ·(dOᵢ·vⱼ): the one rounding of Oᵢ is shared by every key of the row, reaching score (i, j) as
    −wᵢⱼ·δDᵢ. Zero where O is not rounded (`stored` is `computed`) or the weights are not normalised over keys."""
    if stored is computed or a_sm["dim"] != -1:
        return 0.0
    return -weights * (g_out * (stored - computed)).sum(dim=-1, keepdim=True)

_LIN_ATTRS = {"bias": True}


class Attention(Op):
    """Self-attention of tokens (T, D), `heads` heads (nn.MultiheadAttention(D, heads, batch_first=True)(x, x, x))."""

    name = "attention"
    keys = {"dim": REQUIRED, "heads": 1, "scale": None}
    parametrised = True
    rounds_inside = True
    rounded_params = ("in_proj_weight", "out_proj.weight")  # the projections' weights; x is the first's input
    reads_error_backward = True
    torch_modules = (torch.nn.MultiheadAttention,)
    returns_pair = True  # nn.MultiheadAttention returns (output, weights): a traced [0] reads the output

    def check(self, attrs):
        attrs["dim"], attrs["heads"] = positive_int(attrs["dim"], "dim"), positive_int(attrs["heads"], "heads")
        if attrs["dim"] % attrs["heads"]:
            raise OpSpecError(f"'heads' {attrs['heads']} must divide 'dim' {attrs['dim']}")
        if attrs["scale"] is None:
            attrs["scale"] = (attrs["dim"] // attrs["heads"]) ** -0.5  # 1/√d, as nn.MultiheadAttention
        elif isinstance(attrs["scale"], bool) or not isinstance(attrs["scale"], (int, float)) or attrs["scale"] == 0:
            raise OpSpecError(f"'scale' is {attrs['scale']!r}: expected a non-zero number (default 1/√(dim/heads))")
        attrs["scale"] = float(attrs["scale"])
        return attrs

    def from_torch_module(self, module):
        if not module.batch_first or not module._qkv_same_embed_dim or module.in_proj_bias is None \
                or module.bias_k is not None or module.add_zero_attn or module.dropout:
            raise OpSpecError("nn.MultiheadAttention: only batch_first=True, bias=True, no bias_kv, no zero attention, "
                              "no dropout, q, k and v of the same size")
        return {"dim": module.embed_dim, "heads": module.num_heads}

    def call_inputs(self, tensors, args):
        if len({t.name for t in tensors}) != 1:
            raise OpSpecError("attention of different query, key and value tensors: only self-attention (x, x, x)")
        return tensors[:1]

    def out_shape(self, attrs, in_shapes):
        shape = in_shapes[0]
        if len(shape) != 2 or (shape[1] is not None and shape[1] != attrs["dim"]):
            raise OpSpecError(f"attention needs tokens (T, {attrs['dim']}) but receives {_text(shape)}")
        within_limit(shape[0], shape[0], "attention weights")
        return shape

    def param_shapes(self, attrs):
        dim = attrs["dim"]
        return {"in_proj_weight": (3 * dim, dim), "in_proj_bias": (3 * dim,), "out_proj.weight": (dim, dim),
                "out_proj.bias": (dim,)}

    def describe(self, attrs):
        return f"attention {attrs['dim']}, {attrs['heads']} heads"

    def torch_module(self, attrs, device=None, dtype=None):
        return torch.nn.MultiheadAttention(attrs["dim"], attrs["heads"], batch_first=True, device=device, dtype=dtype)

    def torch_forward(self, attrs, xs, module):
        return module(xs[0], xs[0], xs[0], need_weights=False)[0]

    def port_slips(self, attrs, in_shape):
        return [PortSlip("attention", f"leaves the factor {attrs['scale']:.6g} (1/√d) out of its backward",
                         lambda: BackwardReplaced(self, _unscaled_backward("scale")), every=("every attention score",)),
                PortSlip("attention", f"leaves the factor {attrs['scale']:.6g} (1/√d) out of forward and backward",
                         lambda: OtherAttributes(self, {"scale": 1.0}), forward=True, every=("every attention score",)),
                PortSlip("attention", "normalises each head's attention over the queries where it should over the keys",
                         lambda: OtherAttributes(self, {"softmax_dim": -2}), forward=True)]

    # the parts ----------------------------------------------------------------------------------
    @staticmethod
    def _split(t: torch.Tensor, heads: int) -> torch.Tensor:
        """(N, T, D) → (N·heads, T, D/heads)."""
        n, tokens, dim = t.shape
        return t.reshape(n, tokens, heads, dim // heads).transpose(1, 2).reshape(n * heads, tokens, dim // heads)

    @staticmethod
    def _merge(t: torch.Tensor, heads: int) -> torch.Tensor:
        """(N·heads, T, d) → (N, T, heads·d)."""
        nh, tokens, d = t.shape
        return t.reshape(nh // heads, heads, tokens, d).transpose(1, 2).reshape(nh // heads, tokens, heads * d)

    @staticmethod
    def _proj(params, which: str) -> dict:
        if which == "in":
            return {"weight": params["in_proj_weight"], "bias": params["in_proj_bias"]}
        return {"weight": params["out_proj.weight"], "bias": params["out_proj.bias"]}

    def _attrs(self, attrs):
        dim = attrs["dim"]
        return ({"in": dim, "out": 3 * dim, **_LIN_ATTRS}, {"transpose_b": True, "scale": attrs["scale"]},
                {"dim": attrs.get("softmax_dim", -1)}, {"transpose_b": False, "scale": 1.0}, {"in": dim, "out": dim, **_LIN_ATTRS})

    def _parts_forward(self, attrs, x, params, kernels, rounded=None):
        """Every intermediate: qkv, q, k, v (heads split), scores, weights, mixed (heads split), merged, y; each
        operand of a product through `rounded` (Op.forward_rounded), where given."""
        r = rounded or _exact
        a_in, a_s, a_sm, a_mix, a_out = self._attrs(attrs)
        h = attrs["heads"]
        qkv = _LINEAR.forward(a_in, [x], self._proj(params, "in"), kernels)
        q, k, v = (r(name, self._split(t, h)) for name, t in zip("qkv", qkv.chunk(3, dim=-1)))
        scores = r("scores", _MATMUL.forward(a_s, [q, k], {}, kernels), stored=True)
        weights = r("weights", _SOFTMAX.forward(a_sm, [scores], {}, kernels))
        computed = _MATMUL.forward(a_mix, [weights, v], {}, kernels)
        mixed = r("mixed", computed, stored=True)  # autocast stores the heads' output (a fused kernel's O) in the format
        merged = r("merged", self._merge(mixed, h), unless_stored=True)  # TF32 rounds it as out_proj's operand
        y = _LINEAR.forward(a_out, [merged], self._proj(params, "out"), kernels)
        return dict(qkv=qkv, q=q, k=k, v=v, scores=scores, weights=weights, mixed=mixed, merged=merged, y=y,
                    computed=computed)

    def forward(self, attrs, xs, params, kernels):
        return self._parts_forward(attrs, xs[0], params, kernels)["y"]

    def _parts_backward(self, attrs, g, x, parts, params, kernels, need_input: bool, rounded=None):
        """Every intermediate gradient and the parameter gradients, from the output gradient g; each intermediate
        gradient a product reads through `rounded` (Op.backward_rounded), where given."""
        r = rounded or _exact
        a_in, a_s, a_sm, a_mix, a_out = self._attrs(attrs)
        h = attrs["heads"]
        (g_merged,), out_grads = _LINEAR.backward(a_out, g, [parts["merged"]], parts["y"], self._proj(params, "out"),
                                                  kernels, [True])
        g_mixed = r("g_mixed", self._split(g_merged, h), gradient=True)
        (g_weights, g_v), _ = _MATMUL.backward(a_mix, g_mixed, [parts["weights"], parts["v"]], parts["mixed"], {},
                                               kernels, [True, True])
        g_weights = r("g_weights", g_weights, stored=True, gradient=True)
        (g_scores,), _ = _SOFTMAX.backward(a_sm, g_weights, [parts["scores"]], parts["weights"], {}, kernels, [True])
        g_scores = g_scores + _stored_output_statistic(a_sm, parts["weights"], g_mixed, parts["mixed"],
                                                       parts["computed"])
        g_scores = r("g_scores", g_scores, gradient=True)
        (g_q, g_k), _ = _MATMUL.backward(a_s, g_scores, [parts["q"], parts["k"]], parts["scores"], {}, kernels,
                                         [True, True])
        g_qkv = r("g_qkv", torch.cat([self._merge(t, h) for t in (g_q, g_k, g_v)], dim=-1), gradient=True)
        (g_x,), in_grads = _LINEAR.backward(a_in, g_qkv, [x], parts["qkv"], self._proj(params, "in"), kernels,
                                            [need_input])
        grads = dict(g_merged=g_merged, g_mixed=g_mixed, g_weights=g_weights, g_v=g_v, g_scores=g_scores, g_q=g_q,
                     g_k=g_k, g_qkv=g_qkv, g_x=g_x)
        param_grads = {"in_proj_weight": in_grads["weight"], "in_proj_bias": in_grads["bias"],
                       "out_proj.weight": out_grads["weight"], "out_proj.bias": out_grads["bias"]}
        return grads, param_grads

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.backward_rounded(attrs, g, xs, y, params, kernels, need, None)

    # a reduced format's sampled runs: q, k, v, the weights and the merged heads are operands of products (scores
    # too where results are stored in the format); in the backward the gradients the products read
    def forward_rounded(self, attrs, xs, params, kernels, rounded):
        return self._parts_forward(attrs, xs[0], params, kernels, rounded)["y"]

    def backward_rounded(self, attrs, g, xs, y, params, kernels, need, rounded):
        parts = self._parts_forward(attrs, xs[0], params, kernels, rounded)
        grads, param_grads = self._parts_backward(attrs, g, xs[0], parts, params, kernels, need[0], rounded)
        return [grads["g_x"]], param_grads

    # error model: the parts' rules, each head a sample ------------------------------------------------
    def forward_error(self, attrs, ins, y, params, ctx, parts: bool = False):
        out = self._forward_chain(attrs, ins[0], y, params, ctx, parts)
        if ins[0].error is not None:
            # its own roundings alone (an exact input): kept as the own part of its parameters' bounds (backward_error)
            own = self._forward_chain(attrs, Field(ins[0].value, None, None), y, params, ctx, False)
            out.memo["own"] = own.memo
        return out

    def _forward_chain(self, attrs, x: Field, y, params, ctx, parts: bool) -> Field:
        a_in, a_s, a_sm, a_mix, a_out = self._attrs(attrs)
        h = attrs["heads"]
        p = self._parts_forward(attrs, x.value.double(), {k: v.double() for k, v in params.items()}, ctx.kernels)
        f32 = {k: v.to(x.value.dtype) for k, v in p.items()}
        qkv = _LINEAR.forward_error(a_in, [x], f32["qkv"], self._proj(params, "in"), ctx)
        q, k, v = (Field(f32[name], self._split(e, h), None, x.flips)
                   for name, e in zip("qkv", qkv.error.chunk(3, dim=-1)))
        scores = _MATMUL.forward_error(a_s, [q, k], f32["scores"], {}, ctx)
        weights = _SOFTMAX.forward_error(a_sm, [scores], f32["weights"], {}, ctx)
        mixed = _MATMUL.forward_error(a_mix, [weights, v], f32["mixed"], {}, ctx)
        merged = Field(f32["merged"], self._merge(mixed.error, h), None, x.flips)
        out = _LINEAR.forward_error(a_out, [merged], y, self._proj(params, "out"), ctx, parts=parts)
        memo = dict(out.memo, fields=dict(qkv=qkv, q=q, k=k, v=v, scores=scores, weights=weights, mixed=mixed,
                                          merged=merged), values=p, input=x)
        return Field(y, out.error, None, x.flips, memo)

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        (e_x,), parts = self._backward_chain(attrs, g, grad, out.memo, params, ctx, need)
        # the sampled propagation draws at this op's output and input gradient only: the roundings inside it reach its
        # parameters' gradients through its intermediates, so their part stays deterministic (the own part)
        own_memo = out.memo.get("own", out.memo)
        quiet = GradField(torch.zeros_like(grad.error), None, None, grad.flip_count)
        _, inside = self._backward_chain(attrs, g, quiet, own_memo, params, ctx, [False])
        for name, part in parts.items():
            part.accumulation = part.accumulation + inside[name].propagated
        if ctx.precision in REDUCED_FORMATS:
            # the sampled runs draw the format's roundings inside (forward_rounded): what they leave is the float32
            # accumulation's share, the same chain at the accumulation's precision
            ctx32 = self._context(ctx.kernels, ctx.u, ctx.lam)
            exact_input = Field(out.memo["input"].value, None, None)
            f32 = self._forward_chain(attrs, exact_input, out.value, params, ctx32, False)
            _, inside32 = self._backward_chain(attrs, g, quiet, f32.memo, params, ctx32, [False])
            for name, part in parts.items():
                part.drawn = inside[name].propagated - inside32[name].propagated
        return [e_x], parts

    def _backward_chain(self, attrs, g, grad, memo, params, ctx, need):
        a_in, a_s, a_sm, a_mix, a_out = self._attrs(attrs)
        h = attrs["heads"]
        fields, values, x = memo["fields"], memo["values"], memo["input"]
        exact, _ = self._parts_backward(attrs, g.double(), x.value.double(), values,
                                        {k: v.double() for k, v in params.items()}, ctx.kernels, need[0])
        gs = {k: (None if v is None else v.to(g.dtype)) for k, v in exact.items()}
        (e_merged,), out_parts = _LINEAR.backward_error(a_out, g, grad, [fields["merged"]], None,
                                                        self._proj(params, "out"), ctx, [True])
        # flipped decisions upstream (a ReLU after the block) pass or block whole gradients: carried as errors here
        flips = e_merged.flips if e_merged.flips is not None else 0.0
        e_mixed = GradField(self._split(e_merged.error + flips, h), None, None, grad.flip_count)
        (e_weights, e_v), _ = _MATMUL.backward_error(a_mix, gs["g_mixed"], e_mixed, [fields["weights"], fields["v"]],
                                                     fields["mixed"], {}, ctx, [True, True])
        (e_scores,), _ = _SOFTMAX.backward_error(a_sm, gs["g_weights"], e_weights, [fields["scores"]], fields["weights"],
                                                 {}, ctx, [True])
        (e_q, e_k), _ = _MATMUL.backward_error(a_s, gs["g_scores"], e_scores, [fields["q"], fields["k"]],
                                               fields["scores"], {}, ctx, [True, True])
        e_qkv = GradField(torch.cat([self._merge(e.error, h) for e in (e_q, e_k, e_v)], dim=-1), None, None,
                          grad.flip_count)
        (e_x,), in_parts = _LINEAR.backward_error(a_in, gs["g_qkv"], e_qkv, [x], fields["qkv"],
                                                  self._proj(params, "in"), ctx, [need[0]])
        parts = {"in_proj_weight": in_parts["weight"], "in_proj_bias": in_parts["bias"],
                 "out_proj.weight": out_parts["weight"], "out_proj.bias": out_parts["bias"]}
        return [e_x], parts

    # sampled propagation: the scale of its own roundings is its bound with exact inputs (larger than the draws of
    # its parts would be: each part's bound is before its own λ-scaling, and carried worst-case through the others)
    @staticmethod
    def _context(kernels, u: float, lam: float) -> BoundContext:
        return BoundContext("float32", u, lam, kernels)  # operands are not rounded: sampled runs float32/float64 claims

    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        ctx = self._context(kernels, u, lam)
        return self._forward_chain(attrs, Field(xs[0], None, None), y, params, ctx, False).error.to(y.dtype)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        if not need[0]:
            return [None]
        ctx = self._context(kernels, u, lam)
        out = self._forward_chain(attrs, Field(xs[0], None, None), y, params, ctx, False)
        quiet = GradField(torch.zeros_like(g), None, None, 0)
        (e_x,), _ = self._backward_chain(attrs, g, quiet, out.memo, params, ctx, need)
        return [e_x.error.to(g.dtype)]


class DotProductAttention(Op):
    """softmax(q·kᵀ·scale)·v of three token inputs (T, d), (S, d), (S, e) → (T, e): F.scaled_dot_product_attention of
    one head (`inputs`: q, k, v). Its rules are matmul's and softmax's, composed (ops.attention)."""

    name = "dot_product_attention"
    arity = 3
    rounds_inside = True
    rounded_params = ()  # q, k and v are its inputs
    keys = {"scale": None}
    reads_error_backward = True
    torch_calls = (torch.nn.functional.scaled_dot_product_attention,)

    def check(self, attrs):
        if attrs["scale"] is not None and (isinstance(attrs["scale"], bool) or not isinstance(attrs["scale"], (int, float))
                                           or attrs["scale"] == 0):
            raise OpSpecError(f"'scale' is {attrs['scale']!r}: expected a non-zero number (default 1/√d)")
        return attrs

    def call_inputs(self, tensors, args):
        return tensors[:3]

    def from_torch_call(self, target, args, kwargs):
        if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p", 0.0) or kwargs.get("is_causal", False) \
                or len(args) > 3:
            raise OpSpecError("scaled_dot_product_attention with a mask, dropout or causal: only plain attention")
        return {} if kwargs.get("scale") is None else {"scale": kwargs["scale"]}

    def out_shape(self, attrs, in_shapes):
        q, k, v = in_shapes
        if (len(q) < 2 or len({len(s) for s in in_shapes}) != 1 or q[-1] != k[-1] or k[-2] != v[-2]
                or not q[:-2] == k[:-2] == v[:-2]):
            raise OpSpecError(f"dot_product_attention needs q (T, d), k (S, d), v (S, e), or stacks of as many (heads), "
                              f"but receives {_text(q)}, {_text(k)}, {_text(v)}")
        within_limit(None if None in q[:-1] else math.prod(q[:-1]), k[-2], "attention weights")  # every head's
        return (*q[:-2], q[-2], v[-1])

    def describe(self, attrs):
        return "dot_product_attention"

    @staticmethod
    def _attrs(attrs, d: int):
        scale = attrs["scale"] if attrs["scale"] is not None else d ** -0.5
        return {"transpose_b": True, "scale": float(scale)}, {"dim": attrs.get("softmax_dim", -1)}, \
            {"transpose_b": False, "scale": 1.0}

    def port_slips(self, attrs, in_shape):
        factor = attrs["scale"] if attrs["scale"] is not None else in_shape[-1] ** -0.5
        return [PortSlip("attention", f"leaves the factor {factor:.6g} (1/√d) out of its backward",
                         lambda: BackwardReplaced(self, _unscaled_backward("scale")), every=("every attention score",)),
                PortSlip("attention", f"leaves the factor {factor:.6g} (1/√d) out of forward and backward",
                         lambda: OtherAttributes(self, {"scale": 1.0}), forward=True, every=("every attention score",)),
                PortSlip("attention", "normalises the attention over the queries where it should over the keys",
                         lambda: OtherAttributes(self, {"softmax_dim": -2}), forward=True)]

    def torch_forward(self, attrs, xs, module):
        return torch.nn.functional.scaled_dot_product_attention(*xs, scale=attrs["scale"])

    def _parts(self, attrs, xs, kernels, rounded=None):
        r = rounded or _exact
        a_s, a_sm, a_mix = self._attrs(attrs, xs[0].shape[-1])
        scores = r("scores", _MATMUL.forward(a_s, xs[:2], {}, kernels), stored=True)
        weights = r("weights", _SOFTMAX.forward(a_sm, [scores], {}, kernels))
        return scores, weights, _MATMUL.forward(a_mix, [weights, xs[2]], {}, kernels)

    def forward(self, attrs, xs, params, kernels):
        return self._parts(attrs, xs, kernels)[2]

    def backward(self, attrs, g, xs, y, params, kernels, need):
        return self.backward_rounded(attrs, g, xs, y, params, kernels, need, None)

    # a reduced format's sampled runs: q, k, v are its inputs (rounded there), the weights an operand of a product
    # (the scores too where results are stored in the format); in the backward the gradients the products read
    def forward_rounded(self, attrs, xs, params, kernels, rounded):
        return self._parts(attrs, xs, kernels, rounded)[2]

    def backward_rounded(self, attrs, g, xs, y, params, kernels, need, rounded):
        r = rounded or _exact
        a_s, a_sm, a_mix = self._attrs(attrs, xs[0].shape[-1])
        stored = y
        scores, weights, y = self._parts(attrs, xs, kernels, rounded)
        (g_weights, g_v), _ = _MATMUL.backward(a_mix, g, [weights, xs[2]], y, {}, kernels, [True, need[2]])
        g_weights = r("g_weights", g_weights, stored=True, gradient=True)
        (g_scores,), _ = _SOFTMAX.backward(a_sm, g_weights, [scores], weights, {}, kernels, [True])
        if rounded is not None:  # the sampled runs: the output as this run stored it (SampledOp's draws on it)
            g_scores = g_scores + _stored_output_statistic(a_sm, weights, g, stored, y)
        g_scores = r("g_scores", g_scores, gradient=True)
        (g_q, g_k), _ = _MATMUL.backward(a_s, g_scores, xs[:2], scores, {}, kernels, need[:2])
        return [g_q, g_k, g_v], {}

    def forward_error(self, attrs, ins, y, params, ctx):
        a_s, a_sm, a_mix = self._attrs(attrs, ins[0].value.shape[-1])
        scores64, weights64, _ = self._parts(attrs, [f.value.double() for f in ins], ctx.kernels)
        scores = _MATMUL.forward_error(a_s, ins[:2], scores64.to(y.dtype), {}, ctx)
        weights = _SOFTMAX.forward_error(a_sm, [scores], weights64.to(y.dtype), {}, ctx)
        out = _MATMUL.forward_error(a_mix, [weights, ins[2]], y, {}, ctx)
        return Field(y, out.error, None, out.flips, {"scores": scores, "weights": weights})

    def backward_error(self, attrs, g, grad, ins, out, params, ctx, need):
        a_s, a_sm, a_mix = self._attrs(attrs, ins[0].value.shape[-1])
        scores, weights = out.memo["scores"], out.memo["weights"]
        xs = [f.value.double() for f in ins]
        _, w64, y64 = self._parts(attrs, xs, ctx.kernels)
        (g_weights, _), _ = _MATMUL.backward(a_mix, g.double(), [w64, xs[2]], y64, {}, ctx.kernels, [True, False])
        (g_scores,), _ = _SOFTMAX.backward(a_sm, g_weights, [scores.value.double()], w64, {}, ctx.kernels, [True])
        flips = grad.flips if grad.flips is not None else 0.0
        merged = GradField(grad.error + flips, None, None, grad.flip_count)
        (e_weights, e_v), _ = _MATMUL.backward_error(a_mix, g, merged, [weights, ins[2]], out, {}, ctx, [True, need[2]])
        (e_scores,), _ = _SOFTMAX.backward_error(a_sm, g_weights.to(g.dtype), e_weights, [scores], weights, {}, ctx,
                                                 [True])
        (e_q, e_k), _ = _MATMUL.backward_error(a_s, g_scores.to(g.dtype), e_scores, ins[:2], scores, {}, ctx, need[:2])
        return [e_q, e_k, e_v], {}

    # sampled propagation: its bound with exact inputs (and an exact output gradient), as Attention's
    def sampled_forward_scale(self, attrs, xs, y, params, kernels, u, lam):
        return self.forward_error(attrs, [Field(x, None, None) for x in xs], y, params,
                                  Attention._context(kernels, u, lam)).error.to(y.dtype)

    def sampled_backward_scales(self, attrs, g, xs, y, params, kernels, need, grads, u, lam):
        ctx = Attention._context(kernels, u, lam)
        ins = [Field(x, None, None) for x in xs]
        out = self.forward_error(attrs, ins, y, params, ctx)
        fields, _ = self.backward_error(attrs, g, GradField(torch.zeros_like(g), None, None, 0), ins, out, params, ctx,
                                        need)
        return [None if f is None else f.error.to(g.dtype) for f in fields]


register(Attention())
register(DotProductAttention())
