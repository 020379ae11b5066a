"""tf-same-classifier.json in JAX on precision_lab.protocol: TensorFlow's "SAME" padding (stride 2 pads
(0, 1)), an average pool that divides by the in-bounds count, and a (C, H, W) flatten of NHWC activations."""
import sys

import jax
import jax.numpy as jnp

from precision_lab import protocol

jax.config.update("jax_enable_x64", True)  # float64 requests are the float64 build; float32 stays float32
NHWC = ("NHWC", "HWIO", "NHWC")


def loss_fn(p, x, t):
    conv = lambda v, w, stride: jax.lax.conv_general_dilated(v, w, stride, "SAME", dimension_numbers=NHWC)  # noqa: E731
    a = jax.nn.relu(conv(x, p["c1.weight"], (1, 1)) + p["c1.bias"])
    a = jax.nn.relu(conv(a, p["down.weight"], (2, 2)) + p["down.bias"])
    window = lambda v: jax.lax.reduce_window(v, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")  # noqa: E731
    a = window(a) / window(jnp.ones_like(a))  # count_include_pad: false
    flat = jnp.transpose(a, (0, 3, 1, 2)).reshape(a.shape[0], -1)  # the lab flattens (C, H, W)
    out = flat @ p["fc.weight"] + p["fc.bias"]
    return jnp.mean((out - t) ** 2), out


def compute(request):
    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(request.params, request.input, request.target)
    return loss, {n: jax.device_get(g) for n, g in grads.items()}, out


protocol.run(compute, layout="HWIO", activations="NHWC", argv=sys.argv[1:3])
