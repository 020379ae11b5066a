"""A Kolmogorov–Arnold network (B-spline activations) as an opaque candidate for precision-lab.

Usage:
    python kan.py REQUEST_DIR RESPONSE_DIR [--bug NAME] [--bug-in all|float32] [--clamped]
    python kan.py --make-start DIR [--seed K]        # write the start bundle the candidate YAMLs name

Numpy only: copy it and replace `loss_and_grads` with your network. Two KAN layers in the
efficient-KAN form (Liu et al. 2024, "KAN: Kolmogorov-Arnold Networks", arXiv:2404.19756):

    y[n, j] = sum_i base_weight[j, i] * silu(x[n, i]) + sum_i sum_m spline_weight[j, i, m] * B_m(x[n, i])

with cubic B-splines B_m on the knots in the request's `grid` (uniform, G intervals on [-1, 1],
extended by 3 knots on each side: G + 3 basis functions). Loss: mean squared error against
`target`. Forward and backward are written by hand and run in the request's precision
(float32, or float64 when the lab sends a float64 request: the same code is both builds).

Planted bugs (for the lab to find), applied in every build or, with --bug-in float32, only in
the float32 one (a float32 fast path):
    derivative   B'_m without the knot spacing: k*(B_{m,k-1} - B_{m+1,k-1}) instead of dividing each
                 term by its knot span; the input gradient of layer 2, hence layer 1's gradients, is off
    clamp        the backward evaluates the basis at x clipped to [-1, 1] while the forward does not:
                 spline_weight gradients miss the part of the inputs outside the grid
    chunked-sum  spline_weight gradients summed over the batch in chunks of 64, the last partial chunk
                 dropped
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

FORMAT = "precision-lab/bundle-1"
PARAMETERS = ("layer1.base_weight", "layer1.spline_weight", "layer2.base_weight", "layer2.spline_weight")
DEGREE = 3
BUGS = ("none", "derivative", "clamp", "chunked-sum")
CHUNK = 64


def silu(x):
    return x / (1 + np.exp(-x))


def silu_derivative(x):
    s = 1 / (1 + np.exp(-x))
    return s * (1 + x * (1 - s))


def bspline(x, grid, bug="none"):
    """B_m(x) and dB_m/dx for the cubic B-splines on `grid` (Cox-de Boor), shape x.shape + (G + 3,)."""
    x = x[..., None]
    basis = ((x >= grid[:-1]) & (x < grid[1:])).astype(x.dtype)  # degree 0
    for p in range(1, DEGREE + 1):
        if p == DEGREE:
            lower = basis  # degree DEGREE-1: the derivative needs it
        left = (x - grid[:-(p + 1)]) / (grid[p:-1] - grid[:-(p + 1)]) * basis[..., :-1]
        right = (grid[p + 1:] - x) / (grid[p + 1:] - grid[1:-p]) * basis[..., 1:]
        basis = left + right
    if bug == "derivative":  # the knot span forgotten: k*(B_{m,k-1} - B_{m+1,k-1})
        derivative = DEGREE * (lower[..., :-1] - lower[..., 1:])
    else:
        derivative = DEGREE * (lower[..., :-1] / (grid[DEGREE:-1] - grid[:-(DEGREE + 1)])
                               - lower[..., 1:] / (grid[DEGREE + 1:] - grid[1:-DEGREE]))
    return basis, derivative


def batch_sum(terms, bug="none"):
    """Sum over the batch (axis 0); the chunked-sum bug drops the last partial chunk."""
    if bug != "chunked-sum":
        return terms.sum(axis=0)
    full = (terms.shape[0] // CHUNK) * CHUNK
    total = np.zeros(terms.shape[1:], terms.dtype)
    for start in range(0, full, CHUNK):
        total += terms[start:start + CHUNK].sum(axis=0)
    return total


def layer_forward(x, base_weight, spline_weight, grid, clamped=False):
    if clamped:  # the spline sees its input clipped to the grid (a KAN library's guard): a kink at each end
        inside = np.clip(x, grid[DEGREE], grid[-DEGREE - 1])
        basis, derivative = bspline(inside, grid)
        derivative = derivative * (inside == x)[..., None]
    else:
        basis, derivative = bspline(x, grid)
    y = silu(x) @ base_weight.T + np.einsum("nim,jim->nj", basis, spline_weight)
    return y, (x, basis, derivative)


def layer_backward(dy, cache, base_weight, spline_weight, grid, bug="none"):
    """Gradients of the weights and of the layer's input, from dL/dy."""
    x, basis, derivative = cache
    grad_base = dy.T @ silu(x)
    if bug == "clamp":
        basis, _ = bspline(np.clip(x, grid[DEGREE], grid[-DEGREE - 1]), grid)
    if bug == "derivative":
        _, derivative = bspline(x, grid, bug)
    grad_spline = batch_sum(dy[:, :, None, None] * basis[:, None, :, :], bug)
    dx = dy @ base_weight * silu_derivative(x) + np.einsum("nj,jim,nim->ni", dy, spline_weight, derivative)
    return grad_base, grad_spline, dx


def loss_and_grads(arrays, bug="none", clamped=False):
    """The loss and the gradient of every parameter, in the arrays' precision (`clamped`: spline inputs clipped
    to the grid in the forward, and the backward consistent with it)."""
    grid = arrays["grid"]
    x, target = arrays["input"], arrays["target"]
    w = {name: arrays[name] for name in PARAMETERS}
    hidden, cache1 = layer_forward(x, w["layer1.base_weight"], w["layer1.spline_weight"], grid, clamped)
    output, cache2 = layer_forward(hidden, w["layer2.base_weight"], w["layer2.spline_weight"], grid, clamped)
    residual = output - target
    loss = np.mean(residual * residual)
    d_output = (2 / residual.size) * residual
    g2_base, g2_spline, d_hidden = layer_backward(d_output, cache2, w["layer2.base_weight"], w["layer2.spline_weight"],
                                                  grid, bug)
    g1_base, g1_spline, _ = layer_backward(d_hidden, cache1, w["layer1.base_weight"], w["layer1.spline_weight"],
                                           grid, bug)
    grads = {"layer1.base_weight": g1_base, "layer1.spline_weight": g1_spline,
             "layer2.base_weight": g2_base, "layer2.spline_weight": g2_spline}
    return loss, grads


def make_start(directory, seed=0, samples=200, widths=(2, 5, 1), intervals=5):
    """The start bundle: inputs on [-1, 1]², a smooth target, the grid, and initial weights (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (samples, widths[0]))
    target = np.sin(np.pi * x[:, :1]) * np.cos(np.pi * x[:, 1:2]) / 2
    spacing = 2 / intervals
    grid = -1 + spacing * np.arange(-DEGREE, intervals + DEGREE + 1)
    arrays = {"input": x, "target": target, "grid": grid}
    for layer, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:]), 1):
        arrays[f"layer{layer}.base_weight"] = rng.uniform(-1, 1, (n_out, n_in)) / np.sqrt(n_in)
        arrays[f"layer{layer}.spline_weight"] = 0.3 * rng.standard_normal((n_out, n_in, intervals + DEGREE))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "arrays.npz", **{name: value.astype(np.float32) for name, value in arrays.items()})
    manifest = {"format": FORMAT, "kind": "request", "precision": "float32",
                "model": {"opaque": True, "parameters": list(PARAMETERS),
                          "description": f"KAN {widths}, cubic B-splines on {intervals} intervals, MSE"}}
    (directory / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(request, response, bug="none", bug_in="all", clamped=False):
    request, response = Path(request), Path(response)
    manifest = json.loads((request / "bundle.json").read_text())
    dtype = np.float64 if manifest["precision"] == "float64" else np.float32
    with np.load(request / "arrays.npz") as data:
        arrays = {name: data[name].astype(dtype) for name in data.files}
    active = bug if bug_in == "all" or (bug_in == "float32" and dtype == np.float32) else "none"
    loss, grads = loss_and_grads(arrays, active, clamped)
    response.mkdir(parents=True, exist_ok=True)
    out = {"loss": np.asarray(loss, dtype)}
    out.update({f"{name}.grad": np.asarray(grad, dtype) for name, grad in grads.items()})
    np.savez(response / "arrays.npz", **out)
    (response / "bundle.json").write_text(json.dumps({"format": FORMAT, "kind": "response",
                                                      "precision": manifest["precision"]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("request", nargs="?")
    parser.add_argument("response", nargs="?")
    parser.add_argument("--bug", choices=BUGS, default="none")
    parser.add_argument("--bug-in", choices=("all", "float32"), default="all")
    parser.add_argument("--clamped", action="store_true", help="clip the spline inputs to the grid (forward and backward)")
    parser.add_argument("--make-start", metavar="DIR")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.make_start:
        make_start(args.make_start, args.seed)
    elif args.request and args.response:
        main(args.request, args.response, args.bug, args.bug_in, args.clamped)
    else:
        parser.error("give REQUEST_DIR RESPONSE_DIR, or --make-start DIR")
        sys.exit(2)
