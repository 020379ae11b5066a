"""A problem: inputs, targets and initial parameters of one network, in float32, from a seed.

The network is a `precision_lab.model.Network` (the seed CNN by default: Conv 1→16, ReLU, Conv
16→16, ReLU, Conv 16→1; 3×3, padding 1, bias; MSE). Parameters are named as PyTorch's
`state_dict` names them (`conv1.weight` …) in the canonical layout (OIHW, OI).

Documented choices (reproducible from `seed`):

* **inputs** are synthetic micrographs, one per sample and channel: particles (random
  ellipsoidal density blobs projected onto the image), modulated by a CTF-like oscillation in
  Fourier space, then shot noise (Poisson at a low dose), normalised to zero mean and unit
  variance. Images may be non-square (H ≠ W). Channel 0 of sample b is drawn from seed·1000 + b
  (the seed network's inputs), channel c > 0 from seed·1000 + b + 100 000·c;
* **targets** follow the loss and the output's shape: for mse with an output the size of the
  input, the noise-free CTF-modulated projections (a denoising target, the common cryo-EM use;
  output channel c takes input channel c mod C_in); for cross_entropy on (N, K, H, W) logits the
  clean image's intensity quantiles as K classes (a segmentation); otherwise, and for the
  `random` targets of a probe, standard normal values (mse) or uniform classes (cross_entropy)
  from a generator seeded with seed + 7919;
* **weights** follow PyTorch's `nn.Conv2d`/`nn.Linear` default: U(−1/√fan_in, 1/√fan_in) for
  weights and biases (kaiming_uniform with a = √5), drawn in layer order from a
  `torch.Generator` seeded with `seed`;
* **masks** (a training dropout's `<layer>.mask`, float32 0/1 of the layer's output shape, batch
  included) are drawn in layer order by each op (`Op.draw_mask`) from a `torch.Generator` seeded with
  seed + MASK_SEED_OFFSET, so they never share a stream with the weights; they are not parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .sizes import MIN_SIDE, ProblemError, parse_size  # light: the CLI checks sizes before importing torch
from .model import Network, load_model, seed_network
from .ops import LOSSES, OPS

#: what `targets` may say: the task's own targets, or random ones (a probe that decorrelates the gradient)
TARGET_KINDS = ("task", "random")
def size_text(height: int, width: int) -> str:
    return f"{height}×{width}"


@dataclass(frozen=True)
class Problem:
    """Inputs, targets and initial parameters of one network, in float32 (targets int64 for cross_entropy)."""

    input: np.ndarray  # (N, C, H, W) float32
    target: np.ndarray  # the loss's target: float32 like the output (mse), int64 classes (cross_entropy)
    params: dict[str, np.ndarray]  # float32, canonical layout (OIHW, OI)
    seed: int
    source: str = "synthetic"
    network: Network = field(default_factory=seed_network)
    targets: str = "task"
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # '<layer>.mask': float32 0/1, batch included

    @property
    def batch(self) -> int:
        return self.input.shape[0]

    @property
    def height(self) -> int:
        return self.input.shape[2]

    @property
    def width(self) -> int:
        return self.input.shape[3]

    @property
    def size(self) -> int | tuple[int, int]:
        """The image side when square, else (H, W)."""
        return self.height if self.height == self.width else (self.height, self.width)

    @property
    def size_text(self) -> str:
        return size_text(self.height, self.width)

    def with_params(self, params: dict[str, np.ndarray]) -> "Problem":
        """The same data with other parameters (after an optimizer step), kept in float32."""
        return Problem(self.input, self.target, {k: np.asarray(v, np.float32) for k, v in params.items()},
                       self.seed, self.source, self.network, self.targets, self.masks)

    def with_batch(self, start: int, stop: int) -> "Problem":
        """Samples start … stop − 1 only (a micro-batch)."""
        return Problem(self.input[start:stop], self.target[start:stop], self.params, self.seed, self.source,
                       self.network, self.targets, {k: v[start:stop] for k, v in self.masks.items()})

    def describe(self) -> dict:
        return {"size": self.size_text, "batch": self.batch, "seed": self.seed, "source": self.source,
                "network": self.network.name, "targets": self.targets}


# ---------------------------------------------------------------------------------------------
# inputs


def synthetic_micrograph(size, seed: int, n_particles: int | None = None,
                         dose: float = 20.0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy cryo-EM-like micrograph and its noise-free version, both (H, W) float32.

    `size` is N or (H, W). Particles are sums of 2-4 Gaussian lobes (a crude projected density);
    the CTF-like modulation is sin(π·λ·Δf·k² + φ) with a Gaussian envelope; shot noise is Poisson
    at `dose` electrons per pixel on a unit-mean background with particles absorbing up to 30%.
    A square size draws exactly what earlier versions drew (same seed, same image).
    """
    height, width = (size, size) if isinstance(size, int) else size
    side = math.sqrt(height * width)  # the square's side when H = W (exact for integers)
    rng = np.random.default_rng(np.random.PCG64(seed))
    n_particles = n_particles if n_particles is not None else max(4, (height * width) // 2500)
    rows, cols = np.arange(height, dtype=np.float32), np.arange(width, dtype=np.float32)
    density = np.zeros((height, width), np.float32)
    radius = max(2.0, side / 64)
    extent = np.array([height, width], dtype=np.float64)
    for _ in range(n_particles):
        cy, cx = rng.uniform(0, extent, 2) if height != width else rng.uniform(0, height, 2)
        for _ in range(rng.integers(2, 5)):
            oy, ox = rng.normal(0, radius * 0.6, 2)
            sy, sx = rng.uniform(0.4, 1.0, 2) * radius
            lo_y, hi_y = int(max(0, cy + oy - 4 * sy)), int(min(height, cy + oy + 4 * sy + 1))
            lo_x, hi_x = int(max(0, cx + ox - 4 * sx)), int(min(width, cx + ox + 4 * sx + 1))
            if lo_y >= hi_y or lo_x >= hi_x:
                continue
            # a Gaussian lobe is separable: exp(-(dy²/2sy² + dx²/2sx²)) = outer(g_y, g_x)
            g_y = np.exp(-0.5 * ((rows[lo_y:hi_y] - cy - oy) / sy) ** 2)
            g_x = np.exp(-0.5 * ((cols[lo_x:hi_x] - cx - ox) / sx) ** 2)
            density[lo_y:hi_y, lo_x:hi_x] += np.outer(g_y, g_x)
    density /= max(float(density.max()), 1e-12)
    # CTF-like modulation: radial oscillation in frequency with a damping envelope
    k2 = (np.fft.fftfreq(height).astype(np.float32)[:, None] ** 2
          + np.fft.fftfreq(width).astype(np.float32)[None, :] ** 2)
    defocus = rng.uniform(40.0, 80.0) * (side / 256) ** 2 / side * 8
    ctf = -np.sin(np.pi * defocus * k2 * side + 0.1) * np.exp(-k2 * 20.0)
    ctf[0, 0] = 1.0
    clean = np.real(np.fft.ifft2(np.fft.fft2(density) * ctf)).astype(np.float32)
    transmission = np.clip(1.0 - 0.3 * (clean - clean.min()) / max(float(np.ptp(clean)), 1e-12), 0.0, 1.0)
    noisy = rng.poisson(dose * transmission).astype(np.float32)
    return noisy, clean


def _standardise(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    return ((a - a.mean()) / max(a.std(), 1e-12)).astype(np.float32)


def load_micrograph(path: str | Path, size=None) -> np.ndarray:
    """Load a real micrograph from .npy or .mrc (first section), centre-cropped to `size` (N or (H, W))."""
    path = Path(path)
    if not path.exists():
        raise ProblemError(f"{path}: no such image file (give a .npy or .mrc micrograph)")
    try:
        if path.suffix.lower() == ".npy":
            image = np.load(path, allow_pickle=False)
        elif path.suffix.lower() in (".mrc", ".mrcs", ".map"):
            import mrcfile

            with mrcfile.open(path, permissive=True) as mrc:
                if mrc.data is None:
                    raise ProblemError(f"{path}: the MRC file holds no data (header only or truncated)")
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
        height, width = (size, size) if isinstance(size, int) else size
        h, w = image.shape
        if h < height or w < width:
            raise ProblemError(f"{path}: image is {h}×{w}, smaller than the requested size {height}×{width}")
        top, left = (h - height) // 2, (w - width) // 2
        image = image[top:top + height, left:left + width]
    return image.astype(np.float32)


def init_params(network: Network, seed: int) -> dict[str, np.ndarray]:
    """PyTorch's default Conv2d/Linear initialisation, drawn in layer order from a generator seeded with `seed`."""
    generator = torch.Generator(device="cpu").manual_seed(seed)  # host draws: the same numbers whatever the device
    params = {}
    for name, shape in network.param_shapes.items():
        # a bias is drawn by its weight's fan-in: 'fc.bias' by 'fc.weight', 'attn.in_proj_bias' by 'attn.in_proj_weight'
        weight_shape = network.param_shapes[name[:-len("bias")] + "weight" if name.endswith("bias") else name]
        fan_in = math.prod(weight_shape[1:])
        bound = 1.0 / math.sqrt(fan_in)
        values = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu") * (2 * bound) - bound
        params[name] = values.to(torch.float32).numpy()
    return params


def make_problem(size=1024, batch: int = 2, seed: int = 0, image: str | Path | None = None,
                 network: Network | str | dict | None = None, targets: str = "task") -> Problem:
    """A problem of `network` (default: the seed CNN) on `batch` images of `size` (N or (H, W) or "HxW").

    With `image`, every sample is a crop of that file (shifted per sample) and the mse target its
    Gaussian-smoothed version (a denoising target). Every argument is checked first (ProblemError,
    or ModelSpecError naming the layer a size does not fit).
    """
    network = load_model(network)
    height, width = parse_size(size)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ProblemError(f"batch must be a positive integer, got {batch!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ProblemError(f"seed must be a non-negative integer, got {seed!r}")
    if targets not in TARGET_KINDS:
        raise ProblemError(f"targets must be one of {', '.join(TARGET_KINDS)}, got {targets!r}")
    network.check_size(height, width)
    channels = network.input_channels
    inputs = np.empty((batch, channels, height, width), np.float32)
    cleans = np.empty_like(inputs)
    for b in range(batch):
        for c in range(channels):
            if image is None:
                noisy, clean = synthetic_micrograph((height, width) if height != width else height,
                                                    seed * 1000 + b + 100_000 * c)
            else:
                noisy = np.roll(load_micrograph(image, (height, width)), shift=b * 7 + c * 13, axis=1)
                clean = _gaussian_smooth(noisy, sigma=2.0)
            inputs[b, c], cleans[b, c] = _standardise(noisy), _standardise(clean)
    target = _make_target(network, cleans, seed, targets)
    source = "synthetic" if image is None else str(image)
    return Problem(inputs, target, init_params(network, seed), seed, source, network, targets,
                   draw_masks(network, batch, height, width, seed))


#: the masks' generator is seeded with seed + this (a prime): a stream apart from the weights' (seeded with seed)
MASK_SEED_OFFSET = 104_729


def draw_masks(network: Network, batch: int, height: int, width: int, seed: int) -> dict[str, np.ndarray]:
    """Every mask the network's request carries ('<layer>.mask'), drawn in layer order by its op (Op.draw_mask)."""
    shapes = network.mask_shapes(batch, height, width)
    if not shapes:
        return {}
    generator = torch.Generator(device="cpu").manual_seed(seed + MASK_SEED_OFFSET)  # host draws: any device, same masks
    masks = {}
    for layer in network.layers:
        for suffix in OPS[layer.op].request_masks(layer.attrs):
            name = f"{layer.name}.{suffix}"
            masks[name] = OPS[layer.op].draw_mask(layer.attrs, suffix, shapes[name], generator).to(torch.float32).numpy()
    return masks


def _make_target(network: Network, cleans: np.ndarray, seed: int, targets: str) -> np.ndarray:
    batch, channels, height, width = cleans.shape
    out = network.output_shape(height, width)
    rng = np.random.default_rng(np.random.PCG64(seed + 7919))
    same_grid = len(out) == 3 and out[1:] == (height, width)
    if LOSSES[network.loss].target_dtype == "float":
        if targets == "task" and same_grid:
            return np.ascontiguousarray(cleans[:, [c % channels for c in range(out[0])]])
        return rng.standard_normal((batch, *out)).astype(np.float32)
    classes = out[0]
    if targets == "task" and same_grid:
        # the clean image's intensity quantiles as classes: a segmentation of the particles
        edges = np.quantile(cleans[:, 0], np.linspace(0, 1, classes + 1)[1:-1])
        return np.digitize(cleans[:, 0], edges).astype(np.int64)
    return rng.integers(0, classes, size=(batch, *out[1:])).astype(np.int64)


def _gaussian_smooth(image: np.ndarray, sigma: float) -> np.ndarray:
    k = np.fft.fftfreq(image.shape[0])[:, None] ** 2 + np.fft.fftfreq(image.shape[1])[None, :] ** 2
    return np.real(np.fft.ifft2(np.fft.fft2(image) * np.exp(-2 * (np.pi * sigma) ** 2 * k))).astype(np.float32)
