"""The seed CNN in TensorFlow on precision_lab.protocol: NHWC activations and HWIO kernels, as Keras holds them.

`--slip` plants the slip of the motivating case: TensorFlow's HWIO kernel gradient handed back
as if it were OIHW (.reshape to the PyTorch shape, no transpose).
"""
import sys

import tensorflow as tf

from precision_lab import protocol

SLIP = "--slip" in sys.argv


def compute(request):
    x, t = tf.constant(request.input), tf.constant(request.target)
    params = {n: tf.Variable(tf.transpose(p, (2, 3, 1, 0)) if SLIP and p.ndim == 4 else p)
              for n, p in request.params.items()}
    with tf.GradientTape() as tape:
        a = x
        for k in (1, 2, 3):
            a = tf.nn.conv2d(a, params[f"conv{k}.weight"], 1, [[0, 0], [1, 1], [1, 1], [0, 0]])
            a = a + params[f"conv{k}.bias"]
            a = tf.nn.relu(a) if k < 3 else a
        loss = tf.reduce_mean(tf.square(a - t))
    grads = tape.gradient(loss, params)
    return loss.numpy(), {n: g.numpy().reshape(request.shape_of(n)) for n, g in grads.items()}, a.numpy()


protocol.run(compute, layout="OIHW" if SLIP else "HWIO", activations="NHWC", argv=sys.argv[1:3])
