"""The DnCNN with batch norms (../models/dncnn-bn.json) in JAX on precision_lab.protocol: NHWC activations and
HWIO kernels as Flax holds them, training-mode batch statistics as flax.linen.BatchNorm computes them (biased
variance, ε = 1e-5 inside the square root).

`--slip` plants a natural slip of a hand-written batch norm: the batch mean and variance behind
`lax.stop_gradient` (as if they were running statistics), so the backward misses dx's two mean terms.
"""
import sys

import jax

from precision_lab import protocol

jax.config.update("jax_enable_x64", True)  # float64 requests are the float64 build; float32 stays float32
HOLD = jax.lax.stop_gradient if "--slip" in sys.argv else (lambda t: t)


def conv(p, a, name):
    return jax.lax.conv_general_dilated(a, p[f"{name}.weight"], (1, 1), "SAME", dimension_numbers=(
        "NHWC", "HWIO", "NHWC")) + p.get(f"{name}.bias", 0.0)


def loss_fn(p, x, t):
    a = jax.nn.relu(conv(p, x, "head"))
    for k in (1, 2):  # conv, batch norm over (N, H, W), ReLU
        z = conv(p, a, f"body{k}")
        z = (z - HOLD(z.mean((0, 1, 2)))) * jax.lax.rsqrt(HOLD(z.var((0, 1, 2))) + 1e-5)
        a = jax.nn.relu(z * p[f"bn{k}.weight"] + p[f"bn{k}.bias"])
    out = x - conv(p, a, "noise")
    return ((out - t) ** 2).mean(), out


def compute(request):
    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(request.params, request.input, request.target)
    return loss, {n: jax.device_get(g) for n, g in grads.items()}, out


protocol.run(compute, layout="HWIO", activations="NHWC", argv=sys.argv[1:3])
