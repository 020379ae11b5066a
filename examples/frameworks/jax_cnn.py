"""The seed CNN in JAX on precision_lab.protocol: NHWC activations and HWIO kernels, as Flax holds them.

`--slip` plants a natural slip: the weights are taken in PyTorch's OIHW, transposed to HWIO for
lax.conv, and the HWIO gradient is handed back with .reshape instead of a transpose.
"""
import sys

import jax
import jax.numpy as jnp

from precision_lab import protocol

jax.config.update("jax_enable_x64", True)  # float64 requests are the float64 build; float32 stays float32
SLIP = "--slip" in sys.argv


def loss_fn(params, x, t):
    a = x
    for k in (1, 2, 3):
        a = jax.lax.conv_general_dilated(a, params[f"conv{k}.weight"], (1, 1), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + params[f"conv{k}.bias"]
        a = jax.nn.relu(a) if k < 3 else a
    return jnp.mean((a - t) ** 2), a


def compute(request):
    hwio = {n: jnp.transpose(p, (2, 3, 1, 0)) if SLIP and p.ndim == 4 else jnp.asarray(p)
            for n, p in request.params.items()}
    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(hwio, request.input, request.target)
    return loss, {n: jax.device_get(g).reshape(request.shape_of(n)) for n, g in grads.items()}, out


protocol.run(compute, layout="OIHW" if SLIP else "HWIO", activations="NHWC", argv=sys.argv[1:3])
