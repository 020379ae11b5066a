"""Any model spec in TensorFlow on precision_lab.protocol: the request's network read layer by layer and written
as a Keras user would (NHWC activations, HWIO kernels, (in, out) dense kernels), differentiated by
tf.GradientTape. A flatten transposes to (C, H, W) first, as the lab flattens.

`--slip NAME` plants a bug a port can make, to see it named:
  no-grad:LAYER  LAYER's parameters read outside the tape (tf.stop_gradient): its gradients come back zero
  flatten-hwc    every flatten in NHWC order, (H, W, C), where the spec flattens (C, H, W)
  leaky-default  every leaky ReLU with tf.nn.leaky_relu's default slope, 0.2, not the spec's
"""
import sys

import tensorflow as tf

from precision_lab import protocol

SLIP = sys.argv[sys.argv.index("--slip") + 1] if "--slip" in sys.argv else ""


def padded(x, top, bottom, left, right, value=0.0):
    return tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]], constant_values=value)


def conv(x, w, a):
    (ph, pw), groups = a["padding"], a["groups"]
    x = padded(x, ph, ph, pw, pw)
    per_group = w.shape[3] // groups
    outs = [tf.nn.convolution(part, w[..., g * per_group:(g + 1) * per_group], strides=a["stride"], padding="VALID",
                              dilations=a["dilation"])
            for g, part in enumerate(tf.split(x, groups, axis=3))]  # grouped convolution as its groups
    return outs[0] if groups == 1 else tf.concat(outs, axis=3)


def pool(x, a, kind):
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    if kind == "max":
        return tf.nn.max_pool2d(padded(x, ph, ph, pw, pw, float("-inf")), (kh, kw), (sh, sw), "VALID")
    total = tf.nn.avg_pool2d(padded(x, ph, ph, pw, pw), (kh, kw), (sh, sw), "VALID") * (kh * kw)
    if a["count_include_pad"]:
        return total / (kh * kw)
    count = tf.nn.avg_pool2d(padded(tf.ones_like(x), ph, ph, pw, pw), (kh, kw), (sh, sw), "VALID") * (kh * kw)
    return total / count


def layer_output(layer, xs, p):
    op, a, x = layer.op, layer.attrs, xs[0]
    if op == "conv2d":
        y = conv(x, p[f"{layer.name}.weight"], a)
        return y + p[f"{layer.name}.bias"] if a["bias"] else y
    if op == "linear":
        y = tf.matmul(x, p[f"{layer.name}.weight"])
        return y + p[f"{layer.name}.bias"] if a["bias"] else y
    if op == "relu":
        return tf.nn.relu(x)
    if op == "leaky_relu":
        return tf.nn.leaky_relu(x) if SLIP == "leaky-default" else tf.nn.leaky_relu(x, alpha=a["slope"])
    if op == "tanh":
        return tf.tanh(x)
    if op == "sigmoid":
        return tf.sigmoid(x)
    if op == "gelu":
        return tf.nn.gelu(x, approximate=a["approximate"] == "tanh")
    if op in ("max_pool2d", "avg_pool2d"):
        return pool(x, a, op[:3])
    if op == "upsample_nearest":
        return tf.repeat(tf.repeat(x, a["scale"][0], axis=1), a["scale"][1], axis=2)
    if op == "zero_pad2d":
        return padded(x, *a["padding"])
    if op == "add":
        return xs[0] + xs[1]
    if op == "concat":
        return tf.concat(xs, axis=3)
    if op == "flatten":
        channels_first = x if SLIP == "flatten-hwc" else tf.transpose(x, (0, 3, 1, 2))
        return tf.reshape(channels_first, (x.shape[0], -1))
    raise SystemExit(f"tensorflow_spec.py: op {op!r} is not written here")


def compute(request):
    network = request.network
    params = {n: tf.Variable(v) for n, v in request.params.items()}
    frozen = SLIP.split(":", 1)[1] if SLIP.startswith("no-grad:") else None
    with tf.GradientTape() as tape:
        read = {n: tf.stop_gradient(v) if frozen and n.startswith(f"{frozen}.") else v for n, v in params.items()}
        values = {-1: tf.constant(request.input)}
        for layer in network.layers:
            values[layer.index] = layer_output(layer, [values[i] for i in layer.inputs], read)
        out = values[len(network.layers) - 1]
        if network.loss == "mse":
            loss = tf.reduce_mean(tf.square(out - request.target))
        else:  # cross-entropy over the class axis (last, NHWC), a mean over positions
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(request.target, out))
    grads = tape.gradient(loss, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss.numpy(), {n: g.numpy() for n, g in grads.items()}, out.numpy()


protocol.run(compute, layout="HWIO", activations="NHWC", argv=sys.argv[1:3])
