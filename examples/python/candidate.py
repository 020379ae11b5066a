"""A candidate for precision-lab in plain numpy: copy it and replace `forward_backward` with your code.

Usage: python candidate.py REQUEST_DIR RESPONSE_DIR
   or, as a worker (candidate-worker.yaml): PRECISION_LAB_WORKER=1 python candidate.py, one request per stdin line

Reads the request bundle (bundle.json + arrays.npz, weights in the layout bundle.json names),
runs one forward and backward of the 3-layer CNN (conv 3x3 pad 1 + bias, ReLU, conv, ReLU,
conv; MSE loss, mean) in float32 (float64 when the request says so), and writes the response
bundle: loss, conv{k}.weight.grad in the request's weight layout, conv{k}.bias.grad, output.
Each 3x3 convolution is nine shifted matrix products ("shift and GEMM", numpy's BLAS), summed
over the kernel offsets.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np

LAYERS = ("conv1", "conv2", "conv3")


def shifted(padded, p, q, h, width):
    """The (N, C, H*W) window of a zero-padded batch at kernel offset (p, q), contiguous for BLAS."""
    n, c = padded.shape[:2]
    return np.ascontiguousarray(padded[:, :, p:p + h, q:q + width]).reshape(n, c, h * width)


def pad(a):
    return np.pad(a, ((0, 0), (0, 0), (1, 1), (1, 1)))


def conv_forward(a, w, b):
    """Cross-correlation with padding 1: out[n,o,y,x] = b[o] + sum_{i,p,q} w[o,i,p,q] a[n,i,y+p-1,x+q-1]."""
    n, _, h, width = a.shape
    padded = pad(a)
    out = np.zeros((n, w.shape[0], h * width), a.dtype)
    for p in range(3):
        for q in range(3):
            out += np.matmul(w[:, :, p, q], shifted(padded, p, q, h, width))
    return out.reshape(n, w.shape[0], h, width) + b[None, :, None, None]


def conv_weight_grad(a, g):
    """dL/dw[o,i,p,q] = sum_{n,y,x} g[n,o,y,x] a[n,i,y+p-1,x+q-1]: one (O, N*H*W) x (N*H*W, I) product per offset."""
    n, c_in, h, width = a.shape
    padded = pad(a).transpose(1, 0, 2, 3)  # (C, N, H+2, W+2): channels first, so a window is one matrix
    g_matrix = np.ascontiguousarray(g.transpose(1, 0, 2, 3)).reshape(g.shape[1], n * h * width)
    grad = np.zeros((g.shape[1], c_in, 3, 3), a.dtype)
    for p in range(3):
        for q in range(3):
            window = np.ascontiguousarray(padded[:, :, p:p + h, q:q + width]).reshape(c_in, n * h * width)
            grad[:, :, p, q] = g_matrix @ window.T
    return grad


def conv_input_grad(g, w):
    """dL/da[n,i,y,x] = sum_{o,p,q} w[o,i,p,q] g[n,o,y-p+1,x-q+1] (zero outside the image)."""
    n, c_out, h, width = g.shape
    g_rows = g.reshape(n, c_out, h * width)
    padded = np.zeros((n, w.shape[1], h + 2, width + 2), g.dtype)
    for p in range(3):
        for q in range(3):
            contribution = np.matmul(w[:, :, p, q].T, g_rows).reshape(n, w.shape[1], h, width)
            padded[:, :, p:p + h, q:q + width] += contribution
    return padded[:, :, 1:h + 1, 1:width + 1]


def forward_backward(x, t, params):
    """Loss, output and parameter gradients (weights OIHW) of the seed CNN, in x's dtype."""
    acts, pres = [x], []
    for k, layer in enumerate(LAYERS):
        z = conv_forward(acts[-1], params[f"{layer}.weight"], params[f"{layer}.bias"])
        pres.append(z)
        if k < 2:
            acts.append(np.maximum(z, 0))
    residual = pres[-1] - t
    loss = np.mean(residual * residual, dtype=x.dtype)
    g = residual * x.dtype.type(2.0 / residual.size)
    grads = {}
    for k in reversed(range(3)):
        layer = LAYERS[k]
        grads[f"{layer}.weight"] = conv_weight_grad(acts[k], g)
        grads[f"{layer}.bias"] = g.sum(axis=(0, 2, 3))
        if k > 0:
            g = conv_input_grad(g, params[f"{layer}.weight"]) * (pres[k - 1] > 0)
    return loss, pres[-1], grads


def main(request_dir, response_dir):
    request_dir, response_dir = Path(request_dir), Path(response_dir)
    meta = json.loads((request_dir / "bundle.json").read_text())
    layout = meta["weight_layout"]
    to_oihw = [layout.index(c) for c in "OIHW"]
    with np.load(request_dir / "arrays.npz", allow_pickle=False) as arrays:
        x, t = arrays["input"], arrays["target"]
        params = {name: arrays[name] for name in arrays.files if name.startswith("conv")}
    params = {name: np.transpose(v, to_oihw) if name.endswith("weight") else v for name, v in params.items()}
    loss, output, grads = forward_backward(x, t, params)
    from_oihw = ["OIHW".index(c) for c in layout]
    response = {"loss": np.asarray(loss, x.dtype), "output": output}
    for name, grad in grads.items():
        response[f"{name}.grad"] = np.ascontiguousarray(np.transpose(grad, from_oihw) if name.endswith("weight") else grad)
    response_dir.mkdir(parents=True, exist_ok=True)
    np.savez(response_dir / "arrays.npz", **response)
    (response_dir / "bundle.json").write_text(json.dumps(
        {"format": "precision-lab/bundle-1", "kind": "response", "precision": meta["precision"], "weight_layout": layout}))


def serve():
    """Worker mode (`worker: true`, PRECISION_LAB_WORKER=1): one request per stdin line, one answer line each, until EOF."""
    for line in sys.stdin:
        frame = json.loads(line)
        try:
            main(frame["request"], frame["response"])
            answer = {"id": frame["id"], "ok": True}
        except Exception as exc:  # the request fails; the worker serves the next one
            answer = {"id": frame["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    if os.environ.get("PRECISION_LAB_WORKER") == "1":
        serve()
    elif len(sys.argv) != 3:
        sys.exit("usage: python candidate.py REQUEST_DIR RESPONSE_DIR")
    else:
        main(sys.argv[1], sys.argv[2])
