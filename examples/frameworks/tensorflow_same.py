"""tf-same-classifier.json in TensorFlow on precision_lab.protocol, as Keras would write it: "SAME" padding
(stride 2 pads (0, 1)), a "SAME" average pool (divides by the in-bounds count), NHWC activations and
HWIO kernels; the dense layer reads the lab's (C, H, W) flatten, so the activations are transposed first.
"""
import sys

import tensorflow as tf

from precision_lab import protocol


def compute(request):
    p = {n: tf.Variable(v) for n, v in request.params.items()}
    with tf.GradientTape() as tape:
        a = tf.nn.relu(tf.nn.conv2d(request.input, p["c1.weight"], 1, "SAME") + p["c1.bias"])
        a = tf.nn.relu(tf.nn.conv2d(a, p["down.weight"], 2, "SAME") + p["down.bias"])
        a = tf.nn.avg_pool2d(a, 3, 1, "SAME")
        flat = tf.reshape(tf.transpose(a, (0, 3, 1, 2)), (a.shape[0], -1))  # (C, H, W), as the lab flattens
        out = tf.matmul(flat, p["fc.weight"]) + p["fc.bias"]
        loss = tf.reduce_mean(tf.square(out - request.target))
    grads = tape.gradient(loss, p)
    return loss.numpy(), {n: g.numpy() for n, g in grads.items()}, out.numpy()


protocol.run(compute, layout="HWIO", activations="NHWC", argv=sys.argv[1:3])
