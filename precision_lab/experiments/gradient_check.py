"""06 — reference-free gradient check: why float32 finite differences "pass 92%", and what settles it.

Two parts. The practice of a Rust/wgpu KAN audit and of a Mojo library: central differences
(L(w + ε·eᵢ) − L(w − ε·eᵢ)) / 2ε per element, in float32, against the program's gradient with
rtol 1e-3 / atol 1e-6, reported as a pass rate. On the built-in KAN (examples/opaque/kan.py, run
in-process for the thousands of evaluations this takes) the pass rate is computed at every ε, with
what the measured float32 noise predicts it to be, for a right build and a buggy one. Then the
lab's check (precision_lab.gradcheck) on the command candidates of examples/opaque/, through the
protocol, with its verdicts and cost.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pandas as pd

from .. import formats
from ..candidates import resolve
from ..candidates.opaque import OpaqueCandidate
from ..conclusions import NOTHING_TO_FIX, Conclusion, Finding, Measurement, verdict_groups
from ..gradcheck import FunctionOracle
from ..gradcheck.noise import measure_noise
from ..gradcheck.points import tensor_scales
from ..gradcheck.program import Calls
from ..paths import ROOT
from ..tables import format_number, format_percent
from . import progress, summary_row

EXPERIMENT = "06-gradient-check"
EXAMPLE = ROOT / "examples" / "opaque"
#: the practice being reproduced: ε = 1e-5, rtol 1e-3, atol 1e-6 (numpy.isclose's test)
PRACTICE = {"epsilon": 1e-5, "rtol": 1e-3, "atol": 1e-6}


def load_script(path: str | Path):
    """A Python script (e.g. examples/opaque/kan.py) imported as a module, to call it in-process."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Kan:
    """The example KAN in-process: its start arrays, parameters, and the loss/gradient function."""

    def __init__(self, folder: str | Path = EXAMPLE):
        folder = Path(folder)
        self.module = load_script(folder / "kan.py")
        with np.load(folder / "start" / "arrays.npz") as data:
            self.arrays = {name: data[name] for name in data.files}
        self.parameters = {name: self.arrays[name] for name in self.module.PARAMETERS}

    def function(self, bug: str = "none", bug_in: str = "all"):
        """fn(params, dtype) -> (loss, grads), the planted bug active in every build or in float32 only."""
        def run(params, dtype):
            arrays = {name: value.astype(dtype) for name, value in self.arrays.items()}
            arrays.update({name: np.asarray(value, dtype) for name, value in params.items()})
            active = bug if bug_in == "all" or np.dtype(dtype) == np.float32 else "none"
            return self.module.loss_and_grads(arrays, active)

        return run

    def describe(self) -> pd.DataFrame:
        return pd.DataFrame([{"parameter": name, "shape": str(value.shape), "elements": value.size,
                              "rms": float(np.sqrt(np.mean(value.astype(np.float64) ** 2)))}
                             for name, value in self.parameters.items()])


def float32_noise(function, parameters: dict[str, np.ndarray], seed: int = 0) -> float:
    """σ of the float32 loss, measured like the check does (7 points 64 ulps apart, straight-line fit)."""
    oracle = FunctionOracle(function, name="noise", has_float64=False)
    base = {k: v.astype(np.float64) for k, v in parameters.items()}
    calls = Calls(oracle, 10, progress=False)
    at_base = calls("claimed", base)
    noise = measure_noise(calls, "claimed", "float32", base, at_base, tensor_scales(base), np.random.default_rng(seed))
    return noise.loss_sigma


def elementwise_noise(function, parameters: dict[str, np.ndarray], seed: int = 0, elements: int = 16,
                      points: int = 7, ulps: int = 64) -> float:
    """σ of the float32 loss as the element-wise practice meets it: one element moved at a time.

    Moving one element leaves most of the program's sums as they were, so the two losses of a central
    difference share part of their rounding; the noise along a line through every element (float32_noise)
    overstates it (the KAN: 6.4e-9 against 4.5–5.5e-9, and a predicted pass rate 0.12 short at ε = 1e-4 with
    NumPy 2.4). `elements` random elements, each at `points` values `ulps` of its own spacing apart; the
    residuals of a straight-line fit per element, pooled.
    """
    base32 = {k: v.astype(np.float32) for k, v in parameters.items()}
    everything = [(name, index) for name, value in base32.items() for index in np.ndindex(value.shape)]
    chosen = np.random.default_rng(seed).choice(len(everything), min(elements, len(everything)), replace=False)
    offsets = np.arange(points) - points // 2
    design = np.vstack([offsets, np.ones(points)]).T
    squares = 0.0
    for pick in chosen:
        name, index = everything[pick]
        value = base32[name][index]
        step = ulps * np.spacing(np.float32(value))
        losses = []
        for k in offsets:
            moved = dict(base32)
            moved[name] = base32[name].copy()
            moved[name][index] = np.float32(value + k * step)
            losses.append(float(function(moved, np.float32)[0]))
        fit, *_ = np.linalg.lstsq(design, np.array(losses), rcond=None)
        squares += float(np.sum((np.array(losses) - design @ fit) ** 2))
    return math.sqrt(squares / (len(chosen) * (points - 2)))


def elementwise_practice(function, reference_function, parameters: dict[str, np.ndarray], epsilons,
                         rtol: float = PRACTICE["rtol"], atol: float = PRACTICE["atol"]) -> pd.DataFrame:
    """One row per (ε, element): the float32 central difference against the program's float32 gradient.

    `reference_function` (the right program in float64) gives each element's true derivative, so
    the table says which elements the program gets wrong (`wrong`), whatever the test says.
    """
    base32 = {k: v.astype(np.float32) for k, v in parameters.items()}
    base64 = {k: v.astype(np.float64) for k, v in parameters.items()}
    _, claimed = function(base32, np.float32)
    _, truth = reference_function(base64, np.float64)
    rows = []
    elements = [(name, index) for name, value in base32.items() for index in np.ndindex(value.shape)]
    for epsilon in progress(epsilons, desc="float32 central differences", unit="ε"):
        for name, index in elements:
            plus, minus = dict(base32), dict(base32)
            plus[name], minus[name] = base32[name].copy(), base32[name].copy()
            plus[name][index] = np.float32(base32[name][index] + epsilon)  # the practice: w + ε rounded to float32
            minus[name][index] = np.float32(base32[name][index] - epsilon)
            quotient = (float(function(plus, np.float32)[0]) - float(function(minus, np.float32)[0])) / (2 * epsilon)
            # the same quotient in float64 (exact steps): its difference to the derivative is the truncation
            plus64, minus64 = dict(base64), dict(base64)
            plus64[name], minus64[name] = base64[name].copy(), base64[name].copy()
            plus64[name][index] += epsilon
            minus64[name][index] -= epsilon
            quotient64 = (float(reference_function(plus64, np.float64)[0])
                          - float(reference_function(minus64, np.float64)[0])) / (2 * epsilon)
            g, true = float(claimed[name][index]), float(truth[name][index])
            rows.append({"epsilon": epsilon, "tensor": name, "index": str(index), "gradient": g, "quotient": quotient,
                         "quotient64": quotient64, "true": true, "passed": abs(quotient - g) <= atol + rtol * abs(g),
                         "wrong": abs(g - true) > max(atol, 1e3 * formats.unit_roundoff("float32") * abs(true)),
                         "actual_step": (float(plus[name][index]) - float(minus[name][index])) / 2})
    return pd.DataFrame(rows)


def predicted_pass(table: pd.DataFrame, noise: float, loss: float, rtol: float = PRACTICE["rtol"],
                   atol: float = PRACTICE["atol"]) -> pd.Series:
    """Pass probability of each row from the measured noise and the stored step, for a right gradient.

    The quotient is (ΔL + e)/2ε: ΔL the exact change over the step actually taken (w ± ε rounded
    to float32; the float64 quotient at the same ε carries the truncation), e the two loss
    roundings, Gaussian with variance 2σ² but landing on the float32 grid of the loss (its ulp q):
    the computed difference is a whole number of q's, exactly 0 when w ± ε round to one number.
    """
    from math import erf

    q = float(np.spacing(np.float32(abs(loss))))
    spread = math.sqrt(2.0) * noise
    cdf = np.vectorize(lambda z: 0.5 * (1 + erf(z / math.sqrt(2))))
    probabilities = []
    for row in table.itertuples():
        tolerance = atol + rtol * abs(row.gradient)
        if row.actual_step == 0:
            probabilities.append(float(abs(row.gradient) <= tolerance))
            continue
        change = row.quotient64 * 2 * row.actual_step
        centre = round(change / q)
        width = int(6 * spread / q) + 2
        k = np.arange(centre - width, centre + width + 1)
        mass = cdf(((k + 0.5) * q - change) / spread) - cdf(((k - 0.5) * q - change) / spread)
        passes = np.abs(k * q / (2 * row.epsilon) - row.gradient) <= tolerance
        probabilities.append(float(np.sum(mass[passes])))
    return pd.Series(probabilities, index=table.index)


def pass_rates(table: pd.DataFrame, noise: float, loss: float, rtol: float = PRACTICE["rtol"],
               atol: float = PRACTICE["atol"]) -> pd.DataFrame:
    """Per ε: the pass rate, what the noise predicts, and what it says about right and wrong elements."""
    table = table.assign(predicted=predicted_pass(table, noise, loss, rtol, atol))
    rows = []
    for epsilon, group in table.groupby("epsilon", sort=False):
        right, wrong = group[~group.wrong], group[group.wrong]
        rows.append({"epsilon": epsilon, "pass_rate": group.passed.mean(),
                     "predicted_pass_rate": group.predicted.mean(),
                     "right_elements_failing": (~right.passed).mean() if len(right) else math.nan,
                     "wrong_elements_passing": wrong.passed.mean() if len(wrong) else math.nan,
                     "wrong_elements": len(wrong), "elements": len(group)})
    return pd.DataFrame(rows)


def v_curve(function, parameters: dict[str, np.ndarray], epsilons, noise32: float, seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """The error of the central difference along one random unit direction against ε, in float32 and
    float64, with the truncation line ε²·|L'''|/6 and the rounding line (loss noise and step rounding)/ε."""
    rng = np.random.default_rng(seed)
    base = {k: v.astype(np.float64) for k, v in parameters.items()}
    direction = {k: rng.standard_normal(v.shape) for k, v in base.items()}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in direction.values()))
    direction = {k: d / norm for k, d in direction.items()}
    _, g64 = function(base, np.float64)
    truth = sum(float(np.sum(g64[k] * direction[k])) for k in base)
    delta = 1e-2  # L''' from the float64 gradients at ±δ: f(δ) − 2f(0) + f(−δ) = δ²·L''' + O(δ⁴)
    slopes = [sum(float(np.sum(function({k: base[k] + s * delta * direction[k] for k in base}, np.float64)[1][k]
                               * direction[k])) for k in base) for s in (1, 0, -1)]
    third = abs(slopes[0] - 2 * slopes[1] + slopes[2]) / delta ** 2
    ulps = math.sqrt(sum(float(np.sum((g64[k] * np.spacing(np.abs(base[k]).astype(np.float32))) ** 2)) for k in base))
    rows = []
    for epsilon in epsilons:
        for precision, dtype in (("float32", np.float32), ("float64", np.float64)):
            plus = {k: (base[k] + epsilon * direction[k]).astype(dtype) for k in base}
            minus = {k: (base[k] - epsilon * direction[k]).astype(dtype) for k in base}
            quotient = (float(function(plus, dtype)[0]) - float(function(minus, dtype)[0])) / (2 * epsilon)
            rows.append({"epsilon": epsilon, "precision": precision, "quotient": quotient,
                         "error": abs(quotient - truth), "relative_error": abs(quotient - truth) / abs(truth)})
    lines = {"truth": truth, "third_derivative": third, "noise32": noise32,
             "truncation": lambda e: third * e ** 2 / 6,
             # loss rounding σ/(√2ε) and the float32 rounding of w ± εd (uniform, ulp²/12 per coordinate, two points)
             "rounding": lambda e: math.sqrt(noise32 ** 2 / 2 + ulps ** 2 / 24) / e}
    return pd.DataFrame(rows), lines


def check_candidates(specs: list[str], seed: int = 0):
    """Run the lab's check on each opaque candidate YAML: (table of tensors, summary rows, results)."""
    frames, summary, results = [], [], {}
    for spec in specs:
        candidate = resolve(spec, base_dir=ROOT)
        if not isinstance(candidate, OpaqueCandidate):
            raise ValueError(f"{spec}: not an opaque candidate (its YAML needs model: opaque and start: DIR)")
        result = candidate.check(seed=seed, progress=True)
        results[candidate.name] = result
        frames.append(result.to_frame())
        summary.append(summary_row(candidate.name, EXPERIMENT, result.verdict,
                                   f"{result.headline()} ({result.total_calls} program calls)",
                                   program_calls=result.total_calls, float64_calls=result.calls["float64"],
                                   wall_s=round(result.wall_s, 1)))
    return pd.concat(frames, ignore_index=True), pd.DataFrame(summary), results


# ---------------------------------------------------------------------------------------------
# float32-only programs of several kinds: what the segment check resolves


def _example(script: str):
    return load_script(EXAMPLE / script)


def _kan_kind(clamped: bool):
    kan = Kan()

    def run(params, dtype):
        arrays = {name: value.astype(dtype) for name, value in kan.arrays.items()}
        arrays.update({name: np.asarray(value, dtype) for name, value in params.items()})
        return kan.module.loss_and_grads(arrays, "none", clamped)
    return dict(kan.parameters), run


def _relu_kind(pool: bool):
    module = _example("relu_conv.py")
    with np.load(EXAMPLE / ("relu-pool-start" if pool else "relu-start") / "arrays.npz") as data:
        arrays = {name: data[name] for name in data.files}

    def run(params, dtype):
        return module.loss_and_grads({**arrays, **params}, pool, "none", dtype)
    return {name: arrays[name] for name in module.PARAMETERS}, run


def _tanh_kind(seed: int = 4, width: int = 6, layers: int = 2, samples: int = 32):
    """A tanh MLP in numpy, backward by hand, MSE."""
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((samples, width)), rng.standard_normal((samples, width))
    params = {}
    for i in range(layers):
        params[f"l{i}.weight"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        params[f"l{i}.bias"] = (0.1 * rng.standard_normal(width)).astype(np.float32)

    def run(p, dtype):
        h, cache = x.astype(dtype), []
        for i in range(layers):
            z = h @ np.asarray(p[f"l{i}.weight"], dtype).T + np.asarray(p[f"l{i}.bias"], dtype)
            cache.append((h, z))
            h = np.tanh(z)
        r = h - t.astype(dtype)
        grads, g = {}, 2 * r / r.size
        for i in reversed(range(layers)):
            h_in, z = cache[i]
            g = g * (1 - np.tanh(z) ** 2)
            grads[f"l{i}.weight"], grads[f"l{i}.bias"] = g.T @ h_in, g.sum(0)
            g = g @ np.asarray(p[f"l{i}.weight"], dtype)
        return np.mean(r * r), grads
    return params, run


def _normalisation_kind(seed: int = 5, samples: int = 32, width: int = 8, hidden: int = 16):
    """Linear → batch normalisation (batch statistics, learned scale and shift) → tanh → linear, MSE, in numpy."""
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((samples, width)), rng.standard_normal((samples, 1))
    params = {"fc1.weight": rng.standard_normal((hidden, width)) / np.sqrt(width),
              "norm.weight": 1 + 0.1 * rng.standard_normal(hidden), "norm.bias": 0.1 * rng.standard_normal(hidden),
              "fc2.weight": rng.standard_normal((1, hidden)) / np.sqrt(hidden)}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    eps = 1e-5

    def run(p, dtype):
        p = {k: np.asarray(v, dtype) for k, v in p.items()}
        xs = x.astype(dtype)
        z = xs @ p["fc1.weight"].T
        mean, var = z.mean(0), z.var(0)
        inv = 1 / np.sqrt(var + eps)
        zhat = (z - mean) * inv
        a = np.tanh(zhat * p["norm.weight"] + p["norm.bias"])
        r = a @ p["fc2.weight"].T - t.astype(dtype)
        d_out = 2 * r / r.size
        d_a = d_out @ p["fc2.weight"]
        d_y = d_a * (1 - a ** 2)
        d_zhat = d_y * p["norm.weight"]
        n = z.shape[0]  # the batch-normalisation backward (Ioffe & Szegedy 2015, §3)
        d_z = inv / n * (n * d_zhat - d_zhat.sum(0) - zhat * (d_zhat * zhat).sum(0))
        grads = {"fc1.weight": d_z.T @ xs, "norm.weight": (d_y * zhat).sum(0), "norm.bias": d_y.sum(0),
                 "fc2.weight": d_out.T @ a}
        return np.mean(r * r), grads
    return params, run


def _relu_mlp_kind(seed: int = 6, samples: int = 64, inputs: int = 20, widths=(64, 32), classes: int = 10):
    """A ReLU MLP in numpy, three layers, cross-entropy, backward by hand: kinks in two layers, one behind the other."""
    rng = np.random.default_rng(seed)
    x, labels = rng.standard_normal((samples, inputs)), rng.integers(0, classes, samples)
    sizes = (inputs, *widths, classes)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"l{i}.weight"] = (rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / fan_in)).astype(np.float32)
        params[f"l{i}.bias"] = (0.1 * rng.standard_normal(fan_out)).astype(np.float32)
    layers = len(sizes) - 1

    def run(p, dtype):
        p = {k: np.asarray(v, dtype) for k, v in p.items()}
        h, cache = x.astype(dtype), []
        for i in range(layers):
            z = h @ p[f"l{i}.weight"].T + p[f"l{i}.bias"]
            cache.append(h)
            h = np.maximum(z, 0) if i < layers - 1 else z
        shifted = h - h.max(1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        loss = -log_p[np.arange(samples), labels].mean()
        g = np.exp(log_p)
        g[np.arange(samples), labels] -= 1
        g /= samples
        grads = {}
        for i in reversed(range(layers)):
            grads[f"l{i}.weight"], grads[f"l{i}.bias"] = g.T @ cache[i], g.sum(0)
            if i:
                g = (g @ p[f"l{i}.weight"]) * (cache[i] > 0)
        return loss, grads
    return params, run


def _torch_cnn_kind(seed: int = 7, samples: int = 8, size: int = 16, channels=(8, 16), classes: int = 10):
    """Two convolutions with ReLU and max-pool, a linear read-out and cross-entropy, in PyTorch float32 (autograd)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    x, labels = rng.standard_normal((samples, 1, size, size)), rng.integers(0, classes, samples)
    c1, c2 = channels
    params = {"conv1.weight": rng.standard_normal((c1, 1, 3, 3)) / 3, "conv1.bias": 0.1 * rng.standard_normal(c1),
              "conv2.weight": rng.standard_normal((c2, c1, 3, 3)) / np.sqrt(9 * c1),
              "conv2.bias": 0.1 * rng.standard_normal(c2),
              "fc.weight": rng.standard_normal((classes, c2 * (size // 4) ** 2)) / np.sqrt(c2 * (size // 4) ** 2),
              "fc.bias": np.zeros(classes)}
    params = {k: v.astype(np.float32) for k, v in params.items()}

    def run(p, dtype):
        dt = torch.float64 if np.dtype(dtype) == np.float64 else torch.float32
        t = {k: torch.tensor(np.asarray(v), dtype=dt, requires_grad=True) for k, v in p.items()}
        h = F.max_pool2d(F.relu(F.conv2d(torch.tensor(x, dtype=dt), t["conv1.weight"], t["conv1.bias"], padding=1)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, t["conv2.weight"], t["conv2.bias"], padding=1)), 2)
        loss = F.cross_entropy(h.flatten(1) @ t["fc.weight"].T + t["fc.bias"], torch.tensor(labels))
        grads = torch.autograd.grad(loss, list(t.values()))
        return loss.item(), {k: g.numpy() for k, g in zip(t, grads)}
    return params, run


#: kind → (what it is, builder); each builder gives (parameters in float32, fn(params, dtype) -> (loss, grads))
FLOAT32_KINDS = {
    "kan": ("the example KAN (cubic B-splines, smooth)", lambda: _kan_kind(False)),
    "kan-clamped": ("the KAN with spline inputs clipped to the grid", lambda: _kan_kind(True)),
    "tanh-mlp": ("a tanh MLP, 2 layers", _tanh_kind),
    "normalisation": ("linear, batch normalisation, tanh, linear", _normalisation_kind),
    "relu-conv": ("the example ReLU conv net", lambda: _relu_kind(False)),
    "relu-maxpool": ("the ReLU conv net with a 2x2 max-pool", lambda: _relu_kind(True)),
    "relu-mlp": ("a ReLU MLP, 3 layers (64, 32 wide), cross-entropy", _relu_mlp_kind),
    "relu-mlp5": ("a ReLU MLP, 5 layers (64, 64, 64, 32 wide), cross-entropy", lambda: _relu_mlp_kind(widths=(64, 64, 64, 32))),
    "torch-cnn": ("PyTorch: 2 convolutions with ReLU and max-pool, linear, cross-entropy", _torch_cnn_kind),
}


def slipped(function, tensor: str, factor: float = 1.01):
    """`function` with `tensor`'s gradient `factor`× too large (a 1% slip), in every build."""
    def run(params, dtype):
        loss, grads = function(params, dtype)
        return loss, {**grads, tensor: np.asarray(grads[tensor]) * factor}
    return run


def float32_resolution(kinds=None, seeds=(0, 1), with_float64: bool = False, slips: bool = True,
                       max_calls: int | None = None) -> pd.DataFrame:
    """One row per (kind, seed, case): the check's verdict on the right program and on each 1% slip, the
    resolution it states per tensor, and its program calls. `with_float64`: the same code in float64 as the
    float64 build; else the float32 build alone."""
    from ..gradcheck import FunctionOracle, check_gradients

    rows = []
    for kind in kinds or list(FLOAT32_KINDS):
        params, function = FLOAT32_KINDS[kind][1]()
        cases = [("right", None)] + ([(f"1% slip in {name}", name) for name in params] if slips else [])
        for seed in seeds:
            for case, tensor in cases:
                program = function if tensor is None else slipped(function, tensor)
                oracle = FunctionOracle(program, name=kind, has_float64=with_float64)
                result = check_gradients(oracle, params, seed=seed, max_calls=max_calls)
                resolutions = [t.summary()["resolution"] for t in result.tensors.values()]
                resolutions = [r for r in resolutions if r is not None and math.isfinite(r)]
                flagged = sorted(t.name for t in result.tensors.values() if t.verdict == "defect")
                rows.append({"kind": kind, "build": "float32 + float64" if with_float64 else "float32 only",
                             "seed": seed, "case": case, "slipped": tensor, "verdict": result.verdict,
                             "defects": ", ".join(flagged + [f"one of {' or '.join(g)}" for g in result.defect_in_one_of]),
                             "named": (flagged == [tensor]) if tensor else (not flagged),
                             "in_a_set": bool(tensor) and not flagged and any(tensor in g for g in result.defect_in_one_of),
                             "tensors_roundoff": sum(t.verdict == "roundoff" for t in result.tensors.values()),
                             "tensors": len(result.tensors),
                             "worst_resolution": max(resolutions, default=math.nan),
                             "best_resolution": min(resolutions, default=math.nan),
                             "calls": result.total_calls})
    return pd.DataFrame(rows)


def resolution_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per kind and build: right programs → verdicts, the resolution stated, slips → defects naming them."""
    out = []
    for (kind, build), group in rows.groupby(["kind", "build"], sort=False):
        right, slips = group[group.slipped.isna()], group[group.slipped.notna()]
        out.append({"kind": kind, "build": build, "right: roundoff": f"{(right.verdict == 'roundoff').sum()}/{len(right)}",
                    "right: defect": f"{(right.verdict == 'defect').sum()}/{len(right)}",
                    "right: tensors roundoff": f"{int(right.tensors_roundoff.sum())}/{int(right.tensors.sum())}",
                    "resolution (median of worst tensor)": float(right.worst_resolution.median()),
                    "resolution (best tensor)": float(right.best_resolution.min()),
                    "1% slips named": f"{int(slips.named.sum())}/{len(slips)}" if len(slips) else "",
                    "1% slips: defect in one of a set holding it": f"{int(slips.in_a_set.sum())}/{len(slips)}" if len(slips) else "",
                    "slips called roundoff": f"{(slips.verdict == 'roundoff').sum()}/{len(slips)}" if len(slips) else "",
                    "max calls": int(group.calls.max())})
    return pd.DataFrame(out)


def segment_against_length(function, parameters: dict[str, np.ndarray], tensor: str, fractions,
                           seed: int = 0, panels: int = 8) -> pd.DataFrame:
    """Float32 only, along one random direction of `tensor` with length h = fraction·‖tensor‖: what a central
    difference (L(w + h·d) − L(w − h·d))/2h and the segment identity L(w + h·d) − L(w − h·d) = ∫ g·d (the
    program's gradients at `panels` + 1 uniform nodes, the check's Segment) each get wrong, against the
    float64 derivative, and the resolution the segment states from its own measurements (no float64)."""
    from ..gradcheck.noise import ALPHA, t_critical
    from ..gradcheck.points import displaced, dot, tensor_step
    from ..gradcheck.segments import Segment

    base = {k: v.astype(np.float64) for k, v in parameters.items()}
    scales = tensor_scales(base)
    rng = np.random.default_rng(seed)
    oracle = FunctionOracle(function, name="segment", has_float64=False)
    calls = Calls(oracle, 10 ** 6, progress=False)
    at_base = calls("claimed", base)
    noise = measure_noise(calls, "claimed", "float32", base, at_base, scales, rng)
    unit = rng.standard_normal(base[tensor].shape)
    unit /= np.linalg.norm(unit)
    _, g64 = function(base, np.float64)
    rows = []
    for fraction in fractions:
        nodes = np.linspace(-1.0, 1.0, panels + 1)
        step = tensor_step(base[tensor], fraction * scales[tensor], np.dtype("float32"), list(nodes),
                           np.random.default_rng(seed))
        displacement = {tensor: step}
        answers = [at_base if t == 0 else calls("claimed", displaced(base, displacement, float(t))) for t in nodes]
        losses = np.array([a.loss for a in answers])
        slopes = np.array([dot(a.grads, displacement) for a in answers])
        truth = float(np.sum(np.asarray(g64[tensor]) * step))  # g(w)·Δ from the float64 program
        central = (losses[-1] - losses[0]) / 2
        segment = Segment(tensor, displacement, nodes, losses, slopes, noise.loss_sigma,
                          noise.direction_sigma(displacement), noise.dof, fraction=fraction)
        segment.evaluate(lambda dof: t_critical(ALPHA, dof))
        # the segment's own error: its residual with the float64 program's (the quadrature error) removed
        answers64 = [function(displaced(base, displacement, float(t)), np.float64) for t in nodes]
        segment64 = Segment(tensor, displacement, nodes, np.array([float(a[0]) for a in answers64]),
                            np.array([dot(a[1], displacement) for a in answers64]), 0.0, 0.0, noise.dof)
        segment64.evaluate(lambda dof: t_critical(ALPHA, dof))
        rows.append({"fraction": fraction, "step": float(np.linalg.norm(step)),
                     "central_difference_error": abs(central - truth) / abs(truth),
                     "segment_error": abs(segment.residual) / segment.scale,
                     "segment_quadrature_error": abs(segment64.residual) / segment64.scale,
                     "segment_resolution": segment.resolution, "rule": segment.rule})
    return pd.DataFrame(rows)


def length_figure(table: pd.DataFrame, practice_rtol: float = PRACTICE["rtol"]):
    """Relative error against length: the central difference's V and the segment's error and stated resolution."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4))
    axes.loglog(table.fraction, table.central_difference_error, "o-", label="central difference (float32)")
    axes.loglog(table.fraction, table.segment_error, "s-", label="segment identity (float32): error")
    axes.loglog(table.fraction, table.segment_resolution, "s--", label="segment: stated resolution")
    axes.axhline(1e-4, color="grey", lw=0.8, ls=":", label="settled (1e-4)")
    axes.axhline(practice_rtol, color="grey", lw=0.8, ls="-.", label=f"the practice's rtol ({practice_rtol:g})")
    axes.set_xlabel("step or segment half-length / ‖w‖")
    axes.set_ylabel("relative error of g·d")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------------------------------------
# the conclusion


def conclude(summary, tensors, results: dict, rates, rtol: float, practice_epsilon: float = 1e-5) -> Conclusion:
    """06: the lab's verdict per opaque candidate (from its own measurements), and what the float32 practice showed.

    `results` are the gradient checks (precision_lab.gradcheck.GradCheck) by candidate; `rates` the
    practice's pass rates per ε (experiments.gradient_check.pass_rates)."""
    findings = []
    for row in summary.itertuples():
        result = results[row.candidate]
        rows = tensors[tensors.candidate == row.candidate]
        failing = rows[rows.verdict == row.verdict] if row.verdict != "roundoff" else rows
        measurements = [Measurement("program calls", f"{result.total_calls} (float64 build: "
                                                     f"{result.calls.get('float64', 0)})", f"budget {result.budget}")]
        for t in failing.head(3).itertuples():
            if t.directional_error is not None and math.isfinite(t.directional_error):
                measurements.append(Measurement(f"{t.tensor}: directional error (relative)",
                                                format_number(t.directional_error),
                                                f"resolved to {format_number(t.resolution)}"))
            if t.located:
                measurements.append(Measurement(f"{t.tensor}: where", t.located))
        if row.verdict == "roundoff":
            finding, action = "the gradient is the derivative of the loss, within what the check resolves.", NOTHING_TO_FIX
        elif row.verdict == "defect":
            names = ", ".join(failing.tensor)
            finding = f"the gradient of {names} is not the derivative of the loss."
            action = (f"Fix the backward of {names}" + (f" (start at {failing.located.iloc[0]})"
                                                        if failing.located.iloc[0] else "") + ".")
        else:
            finding = ("the check does not resolve the gradient closely enough to settle it (the loss's rounding noise, or "
                       "kinks along its segments).")
            action = next((t.settle for t in result.tensors.values() if t.settle),
                          "Give a float64 build (command_float64): it settles the gradient to ~1e-8.")
        findings.append(Finding(row.candidate, row.verdict, finding, measurements, action))
    at = rates[rates.epsilon == practice_epsilon].set_index("candidate")
    practice = "; ".join(f"{name}: {format_percent(at.pass_rate[name])} pass at ε = {practice_epsilon:g}"
                         for name in at.index)
    lead = (f"Directional differences checked against the float64 build settle each gradient "
            f"({verdict_groups(findings)}); float32 central differences at rtol {rtol:g} cannot: {practice}, "
            f"a pass rate set by ε and the loss's rounding noise, not by whether the gradient is right.")
    return Conclusion("06-gradient-check", lead, findings)
