"""A ReLU convolutional network in numpy, float32 only, as an opaque candidate for precision-lab.

Usage:
    python relu_conv.py REQUEST_DIR RESPONSE_DIR [--pool] [--bug none|head-count|conv-count]
    python relu_conv.py --make-start DIR [--seed K]      # write the start bundle the candidate YAMLs name

conv 3×3 (4 channels, zero padding 1) → ReLU → [2×2 max-pool with --pool] → linear → one output per
sample; loss: mean squared error over the batch of 100. Forward and backward by hand, always in
float32 (the program has no float64 build: it casts a float64 request's arrays to float32 and
answers in the request's precision, which is what a float32-only library does).

Planted bugs: an off-by-one in the batch count, the gradient averaged over 99 samples where the loss
has 100, leaving one tensor's gradient 1.01× too large (1% wrong), everything else right:
    head-count   in fc.weight (the read-out: the loss is quadratic along it, no kinks)
    conv-count   in conv.weight (behind the ReLU: tens of thousands of kinks along any long segment)
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

FORMAT = "precision-lab/bundle-1"
PARAMETERS = ("conv.weight", "conv.bias", "fc.weight", "fc.bias")
SAMPLES, SIZE, CHANNELS = 100, 8, 4


def patches(x):
    """im2col: (N, 1, H, W) → (N, H, W, 9), zero padding 1."""
    padded = np.pad(x[:, 0], ((0, 0), (1, 1), (1, 1)))
    return np.stack([padded[:, i:i + x.shape[2], j:j + x.shape[3]] for i in range(3) for j in range(3)], axis=-1)


def loss_and_grads(arrays, pool=False, bug="none", dtype=np.float32):
    """The loss and the gradient of every parameter, in float32 (`dtype`: the same code in another precision,
    for studies; the program itself always runs float32)."""
    f32 = {name: np.asarray(value, dtype) for name, value in arrays.items()}
    x, target = f32["input"], f32["target"]
    w, b, fw, fb = f32["conv.weight"], f32["conv.bias"], f32["fc.weight"], f32["fc.bias"]
    cols = patches(x)  # (N, H, W, 9)
    pre = cols @ w.reshape(CHANNELS, 9).T + b  # (N, H, W, C)
    act = np.maximum(pre, 0)
    if pool:
        n, h, wd, c = act.shape
        blocks = act.reshape(n, h // 2, 2, wd // 2, 2, c)
        pooled = blocks.max(axis=(2, 4))
        features = pooled.reshape(n, -1)
    else:
        features = act.reshape(act.shape[0], -1)
    out = features @ fw.T + fb  # (N, 1)
    residual = out - target
    loss = np.mean(residual * residual)
    d_out = (2 / residual.size) * residual
    g_fw, g_fb = d_out.T @ features, d_out.sum(0)
    d_features = d_out @ fw
    if pool:
        d_pooled = d_features.reshape(pooled.shape)
        winners = blocks == pooled[:, :, None, :, None, :]
        first = winners & (np.cumsum(np.cumsum(winners, axis=2), axis=4) == 1)  # one winner per block
        d_act = (first * d_pooled[:, :, None, :, None, :]).reshape(act.shape)
    else:
        d_act = d_features.reshape(act.shape)
    d_pre = d_act * (pre > 0)
    g_w = np.einsum("nhwc,nhwk->ck", d_pre, cols).reshape(w.shape)
    if bug == "conv-count":  # the average's count off by one: 1/99 where the loss has 1/100
        g_w = g_w * (SAMPLES / (SAMPLES - 1))
    if bug == "head-count":
        g_fw = g_fw * (SAMPLES / (SAMPLES - 1))
    g_b = d_pre.sum(axis=(0, 1, 2))
    return loss, {"conv.weight": g_w, "conv.bias": g_b, "fc.weight": g_fw, "fc.bias": g_fb}


def make_start(directory, seed=0, pool=False):
    """The start bundle: 100 random 8×8 images, targets, initial weights (float32)."""
    rng = np.random.default_rng(seed)
    features = CHANNELS * (SIZE // 2) ** 2 if pool else CHANNELS * SIZE ** 2
    arrays = {"input": rng.standard_normal((SAMPLES, 1, SIZE, SIZE)), "target": rng.standard_normal((SAMPLES, 1)),
              "conv.weight": rng.standard_normal((CHANNELS, 1, 3, 3)) / 3, "conv.bias": 0.1 * rng.standard_normal(CHANNELS),
              "fc.weight": rng.standard_normal((1, features)) / np.sqrt(features), "fc.bias": np.zeros(1)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "arrays.npz", **{name: value.astype(np.float32) for name, value in arrays.items()})
    manifest = {"format": FORMAT, "kind": "request", "precision": "float32",
                "model": {"opaque": True, "parameters": list(PARAMETERS),
                          "description": f"conv 3x3x{CHANNELS}, ReLU{', max-pool 2x2' if pool else ''}, linear, MSE"}}
    (directory / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(request, response, pool=False, bug="none"):
    request, response = Path(request), Path(response)
    manifest = json.loads((request / "bundle.json").read_text())
    with np.load(request / "arrays.npz") as data:
        arrays = {name: data[name] for name in data.files}
    loss, grads = loss_and_grads(arrays, pool, bug)
    dtype = np.float64 if manifest["precision"] == "float64" else np.float32  # answered in the request's precision
    response.mkdir(parents=True, exist_ok=True)
    out = {"loss": np.asarray(loss, dtype), **{f"{name}.grad": np.asarray(g, dtype) for name, g in grads.items()}}
    np.savez(response / "arrays.npz", **out)
    (response / "bundle.json").write_text(json.dumps({"format": FORMAT, "kind": "response",
                                                      "precision": manifest["precision"]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("request", nargs="?")
    parser.add_argument("response", nargs="?")
    parser.add_argument("--pool", action="store_true", help="2x2 max-pool after the ReLU")
    parser.add_argument("--bug", choices=("none", "head-count", "conv-count"), default="none")
    parser.add_argument("--make-start", metavar="DIR")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.make_start:
        make_start(args.make_start, args.seed, args.pool)
    elif args.request and args.response:
        main(args.request, args.response, args.pool, args.bug)
    else:
        parser.error("give REQUEST_DIR RESPONSE_DIR, or --make-start DIR")
        sys.exit(2)
