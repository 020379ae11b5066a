"""A command candidate for any network of the model spec, written with PyTorch (not with precision-lab).

Usage: python candidate.py REQUEST_DIR RESPONSE_DIR [--slip NAME] [--intermediates]
                           [--autocast bfloat16|float16 [--loss-scale S]]

Reads the request bundle (bundle.json with its `model`, arrays.npz), builds the network the spec
describes (seed form or layer form), runs one forward and backward in the request's precision with
autograd, and writes the response bundle: loss, `<param>.grad` in the request's weight layout,
the output and, with --intermediates, every named layer's output and output gradient. With --autocast the
float32 build runs under torch.autocast in that format (the float64 build never does), the loss multiplied by
--loss-scale before the backward and the gradients divided by it after, as torch.amp.GradScaler does.

`--slip` plants one realistic bug, so each example shows what the lab says about it:

  flip        weight gradients written spatially flipped (a convolution/correlation mix-up)
  ohwi        weight gradients written in OHWI order while the request's layout is declared
  mask        every ReLU's backward passes the gradient unmasked
  upsample    nearest-upsample backward takes each block's first gradient instead of their sum
  skip        an `add` passes no gradient to its second input (a skip or a projection shortcut)
  sum-ce      cross-entropy summed over samples instead of averaged
  tf32        every convolution and linear operand rounded to TF32 (10 mantissa bits), still claimed float32
  unrotated   every transposed convolution correlates with its kernel as stored, not rotated by 180°
  bn-constant every training-mode batch norm's backward treats the batch statistics as constants
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SLIPS = ("flip", "ohwi", "mask", "upsample", "skip", "sum-ce", "tf32", "unrotated", "bn-constant")


def expand(spec):
    """The layer form of a spec (the seed form expanded: conv1, act1, conv2, …)."""
    if "layers" in spec:
        return spec
    channels = spec["channels"]
    layers = []
    for k in range(len(channels) - 1):
        layers.append({"name": f"conv{k + 1}", "op": "conv2d", "in": channels[k], "out": channels[k + 1],
                       "kernel": spec.get("kernel_size", 3), "padding": spec.get("padding", 0),
                       "bias": spec.get("bias", True)})
        if k < len(channels) - 2:
            layers.append({"name": f"act{k + 1}", "op": spec.get("activation", "relu")})
    return {"input_channels": channels[0], "layers": layers, "loss": spec.get("loss", "mse")}


def pair(value, default):
    value = default if value is None else value
    return tuple(value) if isinstance(value, list) else (value, value)


class UnmaskedReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        return g  # the slip: no mask


class FirstOnlyUpsample(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sh, sw):
        ctx.scale = (sh, sw)
        return x.repeat_interleave(sh, 2).repeat_interleave(sw, 3)

    @staticmethod
    def backward(ctx, g):
        sh, sw = ctx.scale
        return g[:, :, ::sh, ::sw], None, None  # the slip: one gradient per block, not their sum


def tf32(t):
    """Round float32 values to TF32 (10 stored mantissa bits, round to nearest even)."""
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return rounded.view(torch.float32)


class RoundedOperands(torch.autograd.Function):
    """Identity whose forward and backward round float32 operands to TF32: every operand of a sum seen at 10 bits
    (TF32 is a mode of the float32 units: a float64 build is untouched, as on a GPU)."""

    @staticmethod
    def forward(ctx, x):
        return tf32(x) if x.dtype == torch.float32 else x

    @staticmethod
    def backward(ctx, g):
        return tf32(g) if g.dtype == torch.float32 else g


def batch_norm(h, a, params, constant_statistics):
    """PyTorch's batch norm; the slip computes the statistics from a detached copy (no gradient through them)."""
    weight, bias = params.get(f"{a['name']}.weight"), params.get(f"{a['name']}.bias")
    eps, training = a.get("eps", 1e-5), a.get("training", True)
    if training and constant_statistics:
        mean = h.detach().mean(dim=(0, 2, 3), keepdim=True)
        var = h.detach().var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        y = (h - mean) / torch.sqrt(var + eps)
        return y if weight is None else y * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
    stats = [None, None] if training else [torch.tensor(a[k], dtype=h.dtype) for k in ("running_mean", "running_var")]
    return F.batch_norm(h, *stats, weight, bias, training=training, momentum=0.0, eps=eps)


def run(layers, loss_name, x, target, params, slip, keep, masks=None):
    """Forward through the layers, the loss; returns (loss, output, named outputs)."""
    outputs, named = {-1: x}, {}
    names = {layer.get("name"): i for i, layer in enumerate(layers) if layer.get("name")}
    names["input"] = -1
    rnd = RoundedOperands.apply if slip == "tf32" else (lambda t: t)
    for i, layer in enumerate(layers):
        # what a layer reads: the layers `inputs` names ("input": the network's), else the one before it
        reads = [outputs[names[n]] for n in layer.get("inputs", [])] or [outputs[i - 1]]
        a, op, h = layer, layer["op"], reads[0]
        if op == "conv2d":
            w, b = params[f"{a['name']}.weight"], params.get(f"{a['name']}.bias")
            y = F.conv2d(rnd(h), rnd(w), b, pair(a.get("stride"), 1), pair(a.get("padding"), 0),
                         pair(a.get("dilation"), 1), a.get("groups", 1))
        elif op == "conv_transpose2d":
            w, b = params[f"{a['name']}.weight"], params.get(f"{a['name']}.bias")
            w = w.flip(-2, -1) if slip == "unrotated" else w
            y = F.conv_transpose2d(rnd(h), rnd(w), b, pair(a.get("stride"), 1), pair(a.get("padding"), 0),
                                   pair(a.get("output_padding"), 0), a.get("groups", 1), pair(a.get("dilation"), 1))
        elif op == "linear":
            y = F.linear(rnd(h), rnd(params[f"{a['name']}.weight"]), params.get(f"{a['name']}.bias"))
        elif op == "relu":
            y = UnmaskedReLU.apply(h) if slip == "mask" else torch.relu(h)
        elif op == "leaky_relu":
            y = F.leaky_relu(h, a.get("slope", 0.01))
        elif op == "tanh":
            y = torch.tanh(h)
        elif op == "sigmoid":
            y = torch.sigmoid(h)
        elif op == "gelu":
            y = F.gelu(h, approximate=a.get("approximate", "none"))
        elif op in ("max_pool2d", "avg_pool2d"):
            kernel = pair(a["kernel"], None)
            stride = pair(a.get("stride"), None) if a.get("stride") is not None else kernel
            pool = F.max_pool2d if op == "max_pool2d" else F.avg_pool2d
            y = pool(h, kernel, stride, pair(a.get("padding"), 0))
        elif op == "upsample_nearest":
            sh, sw = pair(a["scale"], None)
            y = FirstOnlyUpsample.apply(h, sh, sw) if slip == "upsample" else h.repeat_interleave(sh, 2).repeat_interleave(sw, 3)
        elif op == "add":
            other = outputs[names[a["from"]]] if "from" in a else reads[1]
            y = h + (other.detach() if slip == "skip" else other)
        elif op == "sub":
            first, second = (x if n == "input" else outputs[names[n]] for n in a["inputs"])
            y = first - second
        elif op == "batch_norm2d":
            y = batch_norm(h, a, params, slip == "bn-constant")
        elif op == "concat":
            y = torch.cat([h, outputs[names[a["from"]]]], dim=1)
        elif op == "flatten":
            y = h.flatten(1)
        elif op == "global_avg_pool2d":
            y = h.mean(dim=(2, 3), keepdim=True)
        elif op == "dropout":
            # evaluation: the identity; training: the mask the request carries, scaled as F.dropout scales it
            mask = (masks or {}).get(f"{a.get('name')}.mask")
            y = h if not a.get("training") else h * torch.from_numpy(mask).to(h.dtype) * (1.0 / (1.0 - a.get("p", 0.5)))
        else:
            raise SystemExit(f"candidate.py: op {op!r} is not implemented here")
        if keep and a.get("name"):
            y.retain_grad()
            named[a["name"]] = y
        outputs[i] = y
    out = outputs[len(layers) - 1]
    if loss_name == "mse":
        loss = F.mse_loss(out, target)
    else:
        loss = F.cross_entropy(out, target, reduction="sum" if slip == "sum-ce" else "mean")
    return loss, out, named


def to_layout(w, layout):
    """A canonical weight (OIHW, or OI for linear) in `layout` (for 2-D weights: its order of O and I)."""
    canonical = "OIHW" if w.ndim == 4 else "OI"
    letters = layout if w.ndim == 4 else "".join(c for c in layout if c in "OI")
    return np.ascontiguousarray(np.transpose(w, [canonical.index(c) for c in letters]))


def from_layout(w, layout):
    canonical = "OIHW" if w.ndim == 4 else "OI"
    letters = layout if w.ndim == 4 else "".join(c for c in layout if c in "OI")
    return np.ascontiguousarray(np.transpose(w, [letters.index(c) for c in canonical]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("request", type=Path)
    parser.add_argument("response", type=Path)
    parser.add_argument("--slip", choices=SLIPS)
    parser.add_argument("--intermediates", action="store_true")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"))
    parser.add_argument("--loss-scale", type=float, default=1.0)
    args = parser.parse_args()
    manifest = json.loads((args.request / "bundle.json").read_text())
    spec = expand(manifest["model"])
    dtype = {"float64": torch.float64}.get(manifest["precision"], torch.float32)
    layout = manifest["weight_layout"]
    with np.load(args.request / "arrays.npz", allow_pickle=False) as arrays:
        data = {k: arrays[k] for k in arrays.files}
    x = torch.from_numpy(data.pop("input")).to(dtype)
    target = torch.from_numpy(data.pop("target"))
    target = target if spec.get("loss") == "cross_entropy" else target.to(dtype)
    masks = {name: data.pop(name) for name in [n for n in data if n.endswith(".mask")]}  # no parameters: no gradient
    params = {name: torch.from_numpy(from_layout(value, layout) if value.ndim in (2, 4) else value).to(dtype)
              .requires_grad_(True) for name, value in data.items()}
    mixed = args.autocast is not None and dtype == torch.float32
    with torch.autocast("cpu", dtype=getattr(torch, args.autocast or "bfloat16"), enabled=mixed):
        loss, out, named = run(spec["layers"], spec.get("loss", "mse"), x, target, params, args.slip,
                               args.intermediates, masks)
    scale = args.loss_scale if mixed else 1.0
    (loss.to(dtype) * scale).backward()
    store = np.float64 if dtype == torch.float64 else np.float32
    response = {"loss": np.asarray(loss.item(), store), "output": out.detach().to(dtype).numpy().astype(store)}
    for name, value in params.items():
        # a parameter the backward never reached keeps its zeroed buffer, as a port writes it
        grad = (value.grad / scale if value.grad is not None else torch.zeros_like(value)).detach().numpy().astype(store)
        if grad.ndim == 4 and args.slip == "flip":
            grad = grad[:, :, ::-1, ::-1]
        if grad.ndim == 4 and args.slip == "ohwi":  # the buffer holds OHWI, whatever the request declared
            written = to_layout(grad, "OHWI").reshape(to_layout(grad, layout).shape)
        else:
            written = to_layout(grad, layout) if grad.ndim in (2, 4) else grad
        response[f"{name}.grad"] = written
    for name, value in named.items():
        response[f"{name}.output"] = value.detach().to(dtype).numpy().astype(store)
        response[f"{name}.output.grad"] = (value.grad.to(dtype) / scale).numpy().astype(store)
    args.response.mkdir(parents=True, exist_ok=True)
    np.savez(args.response / "arrays.npz", **response)
    (args.response / "bundle.json").write_text(json.dumps({
        "format": "precision-lab/bundle-1", "kind": "response", "precision": manifest["precision"],
        "weight_layout": layout}))


if __name__ == "__main__":
    main()
