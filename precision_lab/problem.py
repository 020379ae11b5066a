"""The seed problem (DESIGN.md): a 3-layer CNN on cryo-EM micrographs, one forward and backward.

Network: Conv 1→16, ReLU, Conv 16→16, ReLU, Conv 16→1; 3×3 kernels, stride 1, padding 1,
bias; MSE loss (mean over every output element). Parameters are named as PyTorch's
``state_dict`` names them (``conv1.weight`` …) and stored in PyTorch's OIHW layout.

Documented choices (reproducible from ``seed``):

* **inputs** are synthetic micrographs: particles (random ellipsoidal density blobs
  projected onto the image), modulated by a CTF-like oscillation in Fourier space, then
  shot noise (Poisson at a low dose) — normalised to zero mean and unit variance;
* **targets** are the noise-free, CTF-modulated projections of the same particles, on the
  same normalisation: the network learns to denoise, the common cryo-EM use;
* **weights** follow PyTorch's ``nn.Conv2d`` default: U(−1/√fan_in, 1/√fan_in) for weights
  and biases (kaiming_uniform with a = √5), drawn from a ``torch.Generator`` seeded with ``seed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

CHANNELS = (1, 16, 16, 1)
KERNEL_SIZE = 3
PADDING = 1
LAYERS = ("conv1", "conv2", "conv3")
PARAM_NAMES = tuple(f"{layer}.{kind}" for layer in LAYERS for kind in ("weight", "bias"))
WEIGHT_NAMES = tuple(f"{layer}.weight" for layer in LAYERS)
BIAS_NAMES = tuple(f"{layer}.bias" for layer in LAYERS)


def param_shape(name: str) -> tuple[int, ...]:
    """Shape of a parameter in the canonical OIHW layout."""
    k = LAYERS.index(name.split(".")[0])
    c_in, c_out = CHANNELS[k], CHANNELS[k + 1]
    return (c_out, c_in, KERNEL_SIZE, KERNEL_SIZE) if name.endswith("weight") else (c_out,)


class ProblemError(ValueError):
    """Bad problem input (image file, size, batch): the message names the file and the fix."""


@dataclass(frozen=True)
class Problem:
    """Inputs, targets and initial parameters of one instance of the seed problem, in float32."""

    input: np.ndarray  # (N, 1, H, W) float32
    target: np.ndarray  # (N, 1, H, W) float32
    params: dict[str, np.ndarray]  # float32, OIHW
    seed: int
    source: str = "synthetic"

    @property
    def batch(self) -> int:
        return self.input.shape[0]

    @property
    def size(self) -> int:
        return self.input.shape[-1]

    def with_params(self, params: dict[str, np.ndarray]) -> "Problem":
        """The same data with other parameters (after an optimizer step), kept in float32."""
        return Problem(self.input, self.target, {k: np.asarray(v, np.float32) for k, v in params.items()},
                       self.seed, self.source)

    def describe(self) -> dict:
        return {"size": self.size, "batch": self.batch, "seed": self.seed, "source": self.source}


# ---------------------------------------------------------------------------------------------
# inputs


def synthetic_micrograph(size: int, seed: int, n_particles: int | None = None,
                         dose: float = 20.0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy cryo-EM-like micrograph and its noise-free version, both (size, size) float32.

    Particles are sums of 2-4 Gaussian lobes (a crude projected density); the CTF-like
    modulation is sin(π·λ·Δf·k² + φ) with a Gaussian envelope; shot noise is Poisson at
    `dose` electrons per pixel on a unit-mean background with particles absorbing up to 30%.
    """
    rng = np.random.default_rng(np.random.PCG64(seed))
    n_particles = n_particles if n_particles is not None else max(4, (size * size) // 2500)
    pixels = np.arange(size, dtype=np.float32)
    density = np.zeros((size, size), np.float32)
    radius = max(2.0, size / 64)
    for _ in range(n_particles):
        cy, cx = rng.uniform(0, size, 2)
        for _ in range(rng.integers(2, 5)):
            oy, ox = rng.normal(0, radius * 0.6, 2)
            sy, sx = rng.uniform(0.4, 1.0, 2) * radius
            lo_y, hi_y = int(max(0, cy + oy - 4 * sy)), int(min(size, cy + oy + 4 * sy + 1))
            lo_x, hi_x = int(max(0, cx + ox - 4 * sx)), int(min(size, cx + ox + 4 * sx + 1))
            if lo_y >= hi_y or lo_x >= hi_x:
                continue
            # a Gaussian lobe is separable: exp(-(dy²/2sy² + dx²/2sx²)) = outer(g_y, g_x)
            g_y = np.exp(-0.5 * ((pixels[lo_y:hi_y] - cy - oy) / sy) ** 2)
            g_x = np.exp(-0.5 * ((pixels[lo_x:hi_x] - cx - ox) / sx) ** 2)
            density[lo_y:hi_y, lo_x:hi_x] += np.outer(g_y, g_x)
    density /= max(float(density.max()), 1e-12)
    # CTF-like modulation: radial oscillation in frequency with a damping envelope
    k = np.fft.fftfreq(size).astype(np.float32)
    k2 = k[:, None] ** 2 + k[None, :] ** 2
    defocus = rng.uniform(40.0, 80.0) * (size / 256) ** 2 / size * 8
    ctf = -np.sin(np.pi * defocus * k2 * size + 0.1) * np.exp(-k2 * 20.0)
    ctf[0, 0] = 1.0
    clean = np.real(np.fft.ifft2(np.fft.fft2(density) * ctf)).astype(np.float32)
    transmission = np.clip(1.0 - 0.3 * (clean - clean.min()) / max(float(np.ptp(clean)), 1e-12), 0.0, 1.0)
    noisy = rng.poisson(dose * transmission).astype(np.float32)
    return noisy, clean


def _standardise(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    return ((a - a.mean()) / max(a.std(), 1e-12)).astype(np.float32)


def load_micrograph(path: str | Path, size: int | None = None) -> np.ndarray:
    """Load a real micrograph from .npy or .mrc (first section), centre-cropped to `size`."""
    path = Path(path)
    if not path.exists():
        raise ProblemError(f"{path}: no such image file (give a .npy or .mrc micrograph)")
    try:
        if path.suffix.lower() == ".npy":
            image = np.load(path, allow_pickle=False)
        elif path.suffix.lower() in (".mrc", ".mrcs", ".map"):
            import mrcfile

            with mrcfile.open(path, permissive=True) as mrc:
                image = np.asarray(mrc.data)
        else:
            raise ProblemError(f"{path}: unknown image type {path.suffix!r}: expected .npy or .mrc")
    except ProblemError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure becomes one clear line
        raise ProblemError(f"{path}: cannot read image ({type(exc).__name__}: {exc})") from None
    if image.ndim == 3:
        image = image[0]
    if image.ndim != 2 or not np.issubdtype(image.dtype, np.number):
        raise ProblemError(f"{path}: expected a 2-D numeric image, got shape {image.shape} dtype {image.dtype}")
    if not np.all(np.isfinite(image)):
        raise ProblemError(f"{path}: image holds NaN or infinite values")
    if size is not None:
        h, w = image.shape
        if h < size or w < size:
            raise ProblemError(f"{path}: image is {h}×{w}, smaller than the requested size {size}")
        top, left = (h - size) // 2, (w - size) // 2
        image = image[top:top + size, left:left + size]
    return image.astype(np.float32)


def init_params(seed: int) -> dict[str, np.ndarray]:
    """PyTorch's default Conv2d initialisation, drawn from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for k, layer in enumerate(LAYERS):
        bound = 1.0 / math.sqrt(CHANNELS[k] * KERNEL_SIZE * KERNEL_SIZE)
        for kind in ("weight", "bias"):
            shape = param_shape(f"{layer}.{kind}")
            values = torch.rand(shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound
            params[f"{layer}.{kind}"] = values.to(torch.float32).numpy()
    return params


def make_problem(size: int = 1024, batch: int = 2, seed: int = 0, image: str | Path | None = None) -> Problem:
    """The seed problem at `size`×`size`, `batch` images, reproducible from `seed`.

    With `image`, every batch element is a crop of that file (shifted per element when it is
    large enough) and the target is its Gaussian-smoothed version (a denoising target).
    """
    if not isinstance(size, int) or size < 8:
        raise ProblemError(f"size must be an integer ≥ 8, got {size!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ProblemError(f"batch must be a positive integer, got {batch!r}")
    inputs, targets = [], []
    for b in range(batch):
        if image is None:
            noisy, clean = synthetic_micrograph(size, seed * 1000 + b)
        else:
            noisy = load_micrograph(image, size)
            noisy = np.roll(noisy, shift=b * 7, axis=1)
            clean = _gaussian_smooth(noisy, sigma=2.0)
        inputs.append(_standardise(noisy))
        targets.append(_standardise(clean))
    source = "synthetic" if image is None else str(image)
    return Problem(np.stack(inputs)[:, None], np.stack(targets)[:, None], init_params(seed), seed, source)


def _gaussian_smooth(image: np.ndarray, sigma: float) -> np.ndarray:
    k = np.fft.fftfreq(image.shape[0])[:, None] ** 2 + np.fft.fftfreq(image.shape[1])[None, :] ** 2
    return np.real(np.fft.ifft2(np.fft.fft2(image) * np.exp(-2 * (np.pi * sigma) ** 2 * k))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# one forward and backward


class ConvOps(Protocol):
    """The three convolution primitives a forward + backward needs (cross-correlation, stride 1).

    `padding` is always PADDING here; algorithms in `precision_lab.conv` implement this protocol.
    """

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def input_grad(self, grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor: ...


class NativeConv:
    """PyTorch's own convolution kernels (cuDNN on GPU, oneDNN or ATen on CPU)."""

    name = "native"

    def forward(self, x, w):
        return F.conv2d(x, w, padding=PADDING)

    def input_grad(self, grad_out, w):
        return torch.nn.grad.conv2d_input(
            (grad_out.shape[0], w.shape[1], grad_out.shape[2], grad_out.shape[3]), w, grad_out, padding=PADDING)

    def weight_grad(self, x, grad_out):
        return torch.nn.grad.conv2d_weight(
            x, (grad_out.shape[1], x.shape[1], KERNEL_SIZE, KERNEL_SIZE), grad_out, padding=PADDING)


@dataclass
class Result:
    """What one forward + backward produced, in the canonical OIHW layout.

    Arrays keep the dtype the computation stored them in (float32 for a float32 candidate).
    """

    loss: float
    grads: dict[str, np.ndarray]
    output: np.ndarray | None = None
    dtype: str = "float32"
    meta: dict = field(default_factory=dict)


@dataclass
class Trace(Result):
    """A Result plus the intermediates the error model needs (reference runs).

    The float64 reference keeps the 16-channel intermediates as their float32 roundings (they only
    feed bound magnitudes; `meta["intermediates"]` says so) and the network input, output and
    output gradient in float64.

    `activations[k]` is the input of layer k+1 (a0 = network input, a1, a2 post-ReLU);
    `preactivations[k]` is z_{k+1} (conv output + bias); `output_grads[k]` is ∂loss/∂z_{k+1}.
    """

    activations: list[torch.Tensor] = field(default_factory=list)
    preactivations: list[torch.Tensor] = field(default_factory=list)
    output_grads: list[torch.Tensor] = field(default_factory=list)


TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def to_tensors(problem: Problem, dtype: str = "float32", device: str | torch.device = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Input, target and parameters as tensors, cast exactly from the float32 values."""
    torch_dtype = TORCH_DTYPES[dtype]
    x = torch.from_numpy(problem.input).to(device=device, dtype=torch_dtype)
    t = torch.from_numpy(problem.target).to(device=device, dtype=torch_dtype)
    params = {k: torch.from_numpy(v).to(device=device, dtype=torch_dtype) for k, v in problem.params.items()}
    return x, t, params


def forward_backward(problem: Problem, dtype: str = "float32", device: str | torch.device = "cpu",
                     conv: ConvOps | None = None, round_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     keep_trace: bool = False) -> Result | Trace:
    """One forward and backward of the seed network, written out layer by layer.

    `conv` supplies the convolution primitives (default: PyTorch native); `round_inputs`, when
    given, is applied to both operands of every convolution (TF32/bf16/fp16 emulation).
    With `keep_trace` the intermediates are kept (a Trace) for the error model.
    """
    conv = conv or NativeConv()
    rnd = round_inputs or (lambda a: a)
    x, t, p = to_tensors(problem, dtype, device)
    with torch.no_grad():
        acts, pres = [x], []
        for k, layer in enumerate(LAYERS):
            z = conv.forward(rnd(acts[-1]), rnd(p[f"{layer}.weight"])) + p[f"{layer}.bias"].view(1, -1, 1, 1)
            pres.append(z)
            if k < len(LAYERS) - 1:
                acts.append(torch.relu(z))
        y = pres[-1]
        residual = y - t
        loss = torch.mean(residual * residual)
        grad = residual * (2.0 / residual.numel())  # d mean((y-t)^2) / dy
        grads, out_grads = {}, [None] * len(LAYERS)
        for k in reversed(range(len(LAYERS))):
            layer = LAYERS[k]
            out_grads[k] = grad
            grads[f"{layer}.weight"] = conv.weight_grad(rnd(acts[k]), rnd(grad))
            grads[f"{layer}.bias"] = grad.sum(dim=(0, 2, 3))
            if k > 0:
                grad = conv.input_grad(rnd(grad), rnd(p[f"{layer}.weight"])) * (pres[k - 1] > 0)
    result_grads = {name: grads[name].cpu().numpy() for name in PARAM_NAMES}
    common = dict(loss=float(loss), grads=result_grads, output=y.cpu().numpy(), dtype=dtype,
                  meta={"conv": getattr(conv, "name", type(conv).__name__), "device": str(device)})
    if keep_trace:
        return Trace(**common, activations=acts, preactivations=pres, output_grads=out_grads)
    return Result(**common)


class SeedNet(torch.nn.Module):
    """The seed network as PyTorch users write it (what the `native` candidate runs)."""

    def __init__(self):
        super().__init__()
        for k, layer in enumerate(LAYERS):
            self.add_module(layer, torch.nn.Conv2d(CHANNELS[k], CHANNELS[k + 1], KERNEL_SIZE, padding=PADDING))

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.conv3(x)


def autograd_forward_backward(problem: Problem, dtype: str = "float32",
                              device: str | torch.device = "cpu") -> Result:
    """One step of `SeedNet` through autograd: PyTorch exactly as a user runs it."""
    net = SeedNet().to(device=device, dtype=TORCH_DTYPES[dtype])
    x, t, params = to_tensors(problem, dtype, device)
    with torch.no_grad():
        for name, value in net.named_parameters():
            value.copy_(params[name])
    y = net(x)
    loss = F.mse_loss(y, t)
    loss.backward()
    grads = {name: value.grad.detach().cpu().numpy() for name, value in net.named_parameters()}
    return Result(float(loss.detach()), grads, y.detach().cpu().numpy(), dtype, {"conv": "native-autograd", "device": str(device)})
