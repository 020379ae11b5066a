"""Any model spec in JAX on precision_lab.protocol: the request's network read layer by layer and written as
the JAX calls a JAX user would make (lax.conv_general_dilated, reduce_window, jax.nn), differentiated by
jax.value_and_grad. NCHW activations and OIHW kernels, as the lab holds them.

`--slip NAME` plants a bug a port can make, to see it named:
  gelu-tanh      every GELU by jax.nn.gelu's default, the tanh approximation, where the spec says erf
  concat-swapped every concat joins [skip, previous] where the spec says [previous, skip]
  no-grad:LAYER  LAYER's parameters held by jax.lax.stop_gradient (off the tape: its gradients all zero)
  bf16-operands  every convolution and dense layer on bfloat16 operands, accumulated in float32 (mixed precision
                 left on while claiming float32: a lower-precision mode, not a bug)
"""
import functools
import sys

import jax
import jax.numpy as jnp

from precision_lab import protocol

jax.config.update("jax_enable_x64", True)  # float64 requests are the float64 build; float32 stays float32
SLIP = sys.argv[sys.argv.index("--slip") + 1] if "--slip" in sys.argv else ""
NCHW = ("NCHW", "OIHW", "NCHW")


def pool(x, attrs, init, op):
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    return jax.lax.reduce_window(x, init, op, (1, 1, kh, kw), (1, 1, sh, sw), ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def operands(x, w):
    """The operands as the multiply sees them: bfloat16 under the bf16-operands slip, else as given."""
    return (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) if SLIP == "bf16-operands" else (x, w)


def layer_output(layer, xs, p):
    op, a, x = layer.op, layer.attrs, xs[0]
    if op == "conv2d":
        (ph, pw) = a["padding"]
        y = jax.lax.conv_general_dilated(*operands(x, p[f"{layer.name}.weight"]), a["stride"], ((ph, ph), (pw, pw)),
                                         rhs_dilation=a["dilation"], feature_group_count=a["groups"],
                                         dimension_numbers=NCHW, preferred_element_type=x.dtype)
        return y + p[f"{layer.name}.bias"][None, :, None, None] if a["bias"] else y
    if op == "linear":
        inputs, weight = operands(x, p[f"{layer.name}.weight"])
        y = jnp.matmul(inputs, weight.T, preferred_element_type=x.dtype)
        return y + p[f"{layer.name}.bias"] if a["bias"] else y
    if op == "relu":
        return jax.nn.relu(x)
    if op == "leaky_relu":
        return jax.nn.leaky_relu(x, a["slope"])
    if op == "tanh":
        return jnp.tanh(x)
    if op == "sigmoid":
        return jax.nn.sigmoid(x)
    if op == "gelu":
        return jax.nn.gelu(x, approximate=a["approximate"] == "tanh" or SLIP == "gelu-tanh")
    if op == "max_pool2d":
        return pool(x, a, -jnp.inf, jax.lax.max)
    if op == "avg_pool2d":
        total = pool(x, a, 0.0, jax.lax.add)
        if a["count_include_pad"]:
            return total / (a["kernel"][0] * a["kernel"][1])
        return total / pool(jnp.ones_like(x), a, 0.0, jax.lax.add)
    if op == "upsample_nearest":
        return jnp.repeat(jnp.repeat(x, a["scale"][0], axis=2), a["scale"][1], axis=3)
    if op == "zero_pad2d":
        top, bottom, left, right = a["padding"]
        return jnp.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    if op == "add":
        return xs[0] + xs[1]
    if op == "concat":
        return jnp.concatenate(xs[::-1] if SLIP == "concat-swapped" else xs, axis=1)
    if op == "flatten":
        return x.reshape(x.shape[0], -1)
    raise SystemExit(f"jax_spec.py: op {op!r} is not written here")


def loss_fn(p, x, t, network):
    if SLIP.startswith("no-grad:"):
        frozen = SLIP.split(":", 1)[1]
        p = {n: jax.lax.stop_gradient(v) if n.startswith(f"{frozen}.") else v for n, v in p.items()}
    values = {-1: x}
    for layer in network.layers:
        values[layer.index] = layer_output(layer, [values[i] for i in layer.inputs], p)
    out = values[len(network.layers) - 1]
    if network.loss == "mse":
        return jnp.mean((out - t) ** 2), out
    log_p = jax.nn.log_softmax(out, axis=1)  # cross-entropy over the class axis, a mean over positions
    picked = jnp.take_along_axis(log_p, jnp.expand_dims(t, 1), axis=1)
    return -jnp.mean(picked), out


def compute(request):
    target = request.target
    step = jax.value_and_grad(functools.partial(loss_fn, network=request.network), has_aux=True)
    (loss, out), grads = step(request.params, request.input, target)
    return loss, {n: jax.device_get(g) for n, g in grads.items()}, out


protocol.run(compute, layout="OIHW", activations="NCHW", argv=sys.argv[1:3])
