"""Hand-written convolution algorithms: 3×3 cross-correlation, stride 1, padding 1, any dtype, CPU or GPU.

Each class implements the ConvOps protocol of problem.py (`forward`, `input_grad`,
`weight_grad`) with its own summation order, so each is a legitimate float32 implementation
whose rounding differs from PyTorch's:

* `DirectConv`  — shift-and-GEMM: nine GEMMs, one per kernel tap, on a flattened padded image;
* `Im2colConv`  — im2col + one GEMM with K = 9·C_in (col2im for the input gradient);
* `FFTConv`     — products in the discrete Fourier domain (zero-padded, no wrap-around);
* `WinogradConv(m)` — Winograd F(m×m, 3×3) tiles, F(3×3, m×m) for the weight gradient.

Work is done in row/column chunks so that no intermediate exceeds a few hundred MB at
1024², batch 2 (a diagnosis must stay under 3 GB: bench.DIAGNOSIS_MEMORY_TARGET_GB).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ..device import torch_threads
from .winograd_matrices import winograd_matrices

KERNEL = 3
#: tap offsets (i, j) of a 3×3 kernel in row-major order, as the weight's last two axes index them
TAPS = tuple((i, j) for i in range(KERNEL) for j in range(KERNEL))
#: pixels per block on CPU: keeps a block's operands in cache (best of 2^12–2^18 in noisy timings here)
CPU_CHUNK_COLUMNS = 1 << 14
#: below this many input channels the nine shifted slices are stacked into one GEMM (K = 9·C_in)
FEW_CHANNELS = 4
#: elements of intermediate per block for im2col/FFT/Winograd: bounds memory (2^23 float64 = 64 MB)
BLOCK_ELEMENTS = 1 << 23


def _flipped_transposed(w: torch.Tensor) -> torch.Tensor:
    """The kernel of the input gradient: W'[c, o, i, j] = W[o, c, 2-i, 2-j]."""
    return w.flip(2, 3).transpose(0, 1)


def _chunks(length: int, size: int):
    for start in range(0, length, size):
        yield start, min(length, start + size)


def _work_dtype(dtype: torch.dtype, device: torch.device, fft: bool = False) -> torch.dtype:
    """Half types compute in float32 for FFTs (cuFFT halves need power-of-2 sizes, CPU has none)
    and for Winograd transforms on CPU (no half batched GEMM there)."""
    if dtype in (torch.float16, torch.bfloat16) and (fft or device.type == "cpu"):
        return torch.float32
    return dtype


class DirectConv:
    """Shift-and-GEMM: out += W[:, :, i, j] @ shift_{i,j}(x) for the nine taps.

    The image is cut into blocks of rows; each block, padded, is flattened with its row stride
    W+2, so the shift by (i, j) is a contiguous slice at offset i·(W+2)+j and each tap is one
    GEMM without copies (the two padding columns per row receive values that are dropped).
    Blocks are padded one at a time, so no image-sized temporary is made (the reference's
    peak memory at 1024² is the point). On CPU the blocks run on a pool of threads with
    single-threaded BLAS: thin 16-row GEMMs parallelise badly inside BLAS, and a busy core
    then stalls every call; each block's result is the same whichever thread computes it.
    """

    name = "direct"
    description = "shift-and-GEMM: nine GEMMs (one per tap) on row blocks flattened with their padding"
    squares_in_blocks = True  # weight_grad(x, g, squares=True): Σ x²·g², each block squared as it is padded

    def __init__(self, chunk_columns: int | None = None):
        self.chunk_columns = chunk_columns

    def _jobs(self, x: torch.Tensor) -> list[tuple[int, int, int]]:
        n_img, _, height, width = x.shape
        columns = self.chunk_columns or (CPU_CHUNK_COLUMNS if x.device.type == "cpu" else height * (width + 2))
        rows = max(1, columns // (width + 2))
        return [(n, r0, r1) for n in range(n_img) for r0, r1 in _chunks(height, rows)]

    @staticmethod
    def _padded_block(x: torch.Tensor, n: int, r0: int, r1: int) -> torch.Tensor:
        """Rows r0-1 … r1 of image n, zero-padded (plus one spare zero row), flattened: (C, (r1-r0+3)·(W+2))."""
        height = x.shape[2]
        top, bottom = max(r0 - 1, 0), min(r1 + 1, height)
        block = F.pad(x[n, :, top:bottom], (1, 1, 1 if r0 == 0 else 0, (1 if r1 == height else 0) + 1))
        return block.reshape(x.shape[1], -1)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n_img, c_in, height, width = x.shape
        c_out, row = w.shape[0], width + 2
        taps = w.permute(2, 3, 0, 1).reshape(len(TAPS), c_out, c_in).contiguous()
        stacked = w.permute(0, 2, 3, 1).reshape(c_out, len(TAPS) * c_in) if c_in < FEW_CHANNELS else None
        offsets = [i * row + j for i, j in TAPS]
        out = x.new_empty(n_img, c_out, height, width)

        def block(job):
            n, r0, r1 = job
            padded, length = self._padded_block(x, n, r0, r1), (r1 - r0) * row
            shifts = [padded[:, offset:offset + length] for offset in offsets]
            if stacked is not None:  # one GEMM with K = 9·C_in: nine GEMMs with K = 1 waste the BLAS
                result = stacked @ torch.cat(shifts)
            else:
                result = torch.mm(taps[0], shifts[0])
                for tap, shift in zip(taps[1:], shifts[1:]):
                    result.addmm_(tap, shift)
            out[n, :, r0:r1] = result.view(c_out, r1 - r0, row)[..., :width]

        _run_chunks(block, self._jobs(x), x.device)
        return out

    def input_grad(self, grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.forward(grad_out, _flipped_transposed(w))

    def weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor, squares: bool = False) -> torch.Tensor:
        """Σ x·g per weight; with `squares`, Σ x²·g², each block squared as it is padded (the same products as
        squaring whole images first, without two image-sized squares: an error bound's Hoeffding sums)."""
        n_img, c_in, height, width = x.shape
        c_out, row = grad_out.shape[1], width + 2
        offsets = [i * row + j for i, j in TAPS]

        def block(job):
            n, r0, r1 = job
            padded, length = self._padded_block(x, n, r0, r1), (r1 - r0) * row
            # grad_out on the same flattened grid, zero in the two padding columns of each row
            grad = F.pad(grad_out[n, :, r0:r1], (0, 2)).reshape(c_out, length)
            if squares:  # both are this block's own copies
                padded.square_()
                grad.square_()
            partial = x.new_empty(len(TAPS), c_out, c_in)
            for tap, offset in enumerate(offsets):
                torch.mm(grad, padded[:, offset:offset + length].T, out=partial[tap])
            return partial

        partials = _run_chunks(block, self._jobs(x), x.device)
        acc = partials[0]
        for partial in partials[1:]:  # summed in block order: the result does not depend on scheduling
            acc += partial
        return acc.view(KERNEL, KERNEL, c_out, c_in).permute(2, 3, 0, 1).contiguous()


def _run_chunks(work, jobs, device: torch.device) -> list:
    """work(job) for every job, in order of results; on CPU across torch's thread count with 1-thread BLAS."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1 or len(jobs) <= 1:
        return [work(job) for job in jobs]
    with torch_threads(device, 1):
        return list(_pool(threads).map(work, jobs))


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count, kept: starting the threads anew on every call cost more than a small layer's work."""
    if threads not in _POOLS:
        # OpenMP's thread count is per thread: each worker sets its own to 1
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, initializer=torch.set_num_threads, initargs=(1,))
    return _POOLS[threads]


class Im2colConv:
    """im2col + GEMM: unfold 3×3 patches into a (9·C_in, pixels) matrix, one GEMM per row block."""

    name = "im2col"
    description = "im2col + GEMM (K = 9·C_in); col2im (fold) for the input gradient"

    def _rows(self, channels: int, width: int) -> int:
        return max(1, BLOCK_ELEMENTS // (KERNEL * KERNEL * channels * width))

    def forward(self, x, w):
        n_img, c_in, height, width = x.shape
        padded = F.pad(x, (1, 1, 1, 1))
        weights = w.reshape(w.shape[0], -1)
        out = x.new_empty(n_img, w.shape[0], height, width)
        for n in range(n_img):
            for r0, r1 in _chunks(height, self._rows(c_in, width)):
                cols = F.unfold(padded[n:n + 1, :, r0:r1 + 2], KERNEL)[0]
                out[n, :, r0:r1] = (weights @ cols).view(-1, r1 - r0, width)
        return out

    def input_grad(self, grad_out, w):
        n_img, c_out, height, width = grad_out.shape
        c_in = w.shape[1]
        weights_t = w.reshape(c_out, -1).T
        grad_padded = grad_out.new_zeros(n_img, c_in, height + 2, width + 2)
        for n in range(n_img):
            for r0, r1 in _chunks(height, self._rows(c_in, width)):
                cols = weights_t @ grad_out[n, :, r0:r1].reshape(c_out, -1)
                grad_padded[n, :, r0:r1 + 2] += F.fold(cols[None], (r1 - r0 + 2, width + 2), KERNEL)[0]
        return grad_padded[:, :, 1:-1, 1:-1].contiguous()

    def weight_grad(self, x, grad_out):
        n_img, c_in, height, width = x.shape
        c_out = grad_out.shape[1]
        padded = F.pad(x, (1, 1, 1, 1))
        acc = x.new_zeros(c_out, c_in * KERNEL * KERNEL)
        for n in range(n_img):
            for r0, r1 in _chunks(height, self._rows(c_in, width)):
                cols = F.unfold(padded[n:n + 1, :, r0:r1 + 2], KERNEL)[0]
                acc.addmm_(grad_out[n, :, r0:r1].reshape(c_out, -1), cols.T)
        return acc.view(c_out, c_in, KERNEL, KERNEL)


class FFTConv:
    """Convolution theorem on the (H+2)×(W+2) padded grid: large enough that nothing wraps around.

    The 3×3 kernel's transform along H is a three-term DFT evaluated per block of frequency
    rows, so the (C_out, C_in, H+2, W/2+2) kernel spectrum is never held whole.
    """

    name = "fft"
    description = "FFT convolution on the zero-padded grid (complex products summed over channels)"

    @staticmethod
    def _phases(length: int, rows: slice, device, dtype, sign: float) -> torch.Tensor:
        """e^{sign·2πi·k·t/length} for t = 0, 1, 2 (rows) and k in `rows` (columns)."""
        k = torch.arange(rows.start, rows.stop, device=device, dtype=torch.float64)
        t = torch.arange(KERNEL, device=device, dtype=torch.float64)
        angle = sign * 2 * math.pi * torch.outer(t, k) / length
        return torch.polar(torch.ones_like(angle), angle).to(dtype)

    def _kernel_spectrum(self, w, grid, rows: slice, complex_dtype):
        """DFT of the zero-padded kernel for frequency rows `rows`: (C_out, C_in, rows, W'/2+1)."""
        along_w = torch.fft.rfft(w, n=grid[1], dim=-1).to(complex_dtype)  # (O, I, 3, Kx)
        phase = self._phases(grid[0], rows, w.device, complex_dtype, -1.0)  # (3, rows)
        return torch.einsum("oitx,tk->oikx", along_w, phase)

    def _row_block(self, channels: int, grid) -> int:
        return max(1, BLOCK_ELEMENTS // (channels * channels * (grid[1] // 2 + 1)))

    def forward(self, x, w):
        dtype = _work_dtype(x.dtype, x.device, fft=True)
        height, width = x.shape[-2:]
        grid = (height + 2, width + 2)
        spectrum = torch.fft.rfft2(F.pad(x.to(dtype), (1, 1, 1, 1)), s=grid)
        out_spectrum = torch.empty(x.shape[0], w.shape[0], *spectrum.shape[-2:], dtype=spectrum.dtype, device=x.device)
        for r0, r1 in _chunks(grid[0], self._row_block(max(w.shape[:2]), grid)):
            kernel = self._kernel_spectrum(w.to(dtype), grid, slice(r0, r1), spectrum.dtype)
            out_spectrum[:, :, r0:r1] = torch.einsum("nikx,oikx->nokx", spectrum[:, :, r0:r1], kernel.conj())
        return torch.fft.irfft2(out_spectrum, s=grid)[..., :height, :width].to(x.dtype).contiguous()

    def input_grad(self, grad_out, w):
        dtype = _work_dtype(grad_out.dtype, grad_out.device, fft=True)
        height, width = grad_out.shape[-2:]
        grid = (height + 2, width + 2)
        # the adjoint of a correlation is a convolution: no conjugate, result on the padded grid
        spectrum = torch.fft.rfft2(grad_out.to(dtype), s=grid)
        in_spectrum = torch.empty(grad_out.shape[0], w.shape[1], *spectrum.shape[-2:], dtype=spectrum.dtype,
                                  device=grad_out.device)
        for r0, r1 in _chunks(grid[0], self._row_block(max(w.shape[:2]), grid)):
            kernel = self._kernel_spectrum(w.to(dtype), grid, slice(r0, r1), spectrum.dtype)
            in_spectrum[:, :, r0:r1] = torch.einsum("nokx,oikx->nikx", spectrum[:, :, r0:r1], kernel)
        padded = torch.fft.irfft2(in_spectrum, s=grid)
        return padded[..., 1:height + 1, 1:width + 1].to(grad_out.dtype).contiguous()

    def weight_grad(self, x, grad_out):
        dtype = _work_dtype(x.dtype, x.device, fft=True)
        height, width = x.shape[-2:]
        grid = (height + 2, width + 2)
        x_spectrum = torch.fft.rfft2(F.pad(x.to(dtype), (1, 1, 1, 1)), s=grid)
        g_spectrum = torch.fft.rfft2(grad_out.to(dtype), s=grid)
        complex_dtype = x_spectrum.dtype
        n_freq_w = x_spectrum.shape[-1]
        # lags 0..2 along W from the half spectrum: interior frequencies stand for a conjugate pair
        weight = torch.full((n_freq_w,), 2.0, dtype=torch.float64, device=x.device)
        weight[0] = 1.0
        if grid[1] % 2 == 0:
            weight[-1] = 1.0
        phase_w = self._phases(grid[1], slice(0, n_freq_w), x.device, complex_dtype, 1.0)  # (3, Kx)
        phase_w = phase_w * weight.to(complex_dtype)
        acc = torch.zeros(grad_out.shape[1], x.shape[1], KERNEL, KERNEL, dtype=complex_dtype, device=x.device)
        for r0, r1 in _chunks(grid[0], self._row_block(max(x.shape[1], grad_out.shape[1]), grid)):
            cross = torch.einsum("nikx,nokx->oikx", x_spectrum[:, :, r0:r1], g_spectrum[:, :, r0:r1].conj())
            phase_h = self._phases(grid[0], slice(r0, r1), x.device, complex_dtype, 1.0)  # (3, rows)
            acc += torch.einsum("oikx,sk,tx->oist", cross, phase_h, phase_w)
        return (acc.real / (grid[0] * grid[1])).to(x.dtype)


class WinogradConv:
    """Winograd F(m×m, 3×3): Y = Aᵀ[(G W Gᵀ) ⊙ (Bᵀ D B)]A per tile, channel sums as batched GEMMs.

    The weight gradient uses F(3×3, m×m) on the same tiles (the output-gradient tile is the
    'filter'), summed over tiles in the transformed domain. Rounding error grows with the tile
    size m (Barabasz et al. 2020), which is why F(2,3) and F(4,3) are both offered.
    """

    description = "Winograd F(m×m,3×3) forward/input grad, F(3×3,m×m) weight grad (Lavin & Gray 2016)"

    def __init__(self, m: int):
        self.m = m
        self.alpha = m + KERNEL - 1
        self.name = f"winograd-f{m}x3"

    def _matrices(self, m, r, dtype, device):
        return tuple(torch.as_tensor(a, dtype=dtype, device=device) for a in winograd_matrices(m, r))

    def _tiles_per_block(self, channels: int, tiles_w: int) -> int:
        return max(1, BLOCK_ELEMENTS // (channels * tiles_w * self.alpha * self.alpha))

    def _padded(self, x):
        """x padded by 1 on top/left and up to whole tiles (+1) on bottom/right."""
        height, width = x.shape[-2:]
        tiles_h, tiles_w = -(-height // self.m), -(-width // self.m)
        padded = F.pad(x, (1, tiles_w * self.m - width + 1, 1, tiles_h * self.m - height + 1))
        return padded, tiles_h, tiles_w

    def _input_tiles(self, padded_image, t0, t1, b_t):
        """Bᵀ D B of the overlapping (α×α) input tiles of tile rows t0..t1: (α, α, C, tiles)."""
        m, a = self.m, self.alpha
        tiles = padded_image[:, t0 * m:t1 * m + KERNEL - 1].unfold(1, a, m).unfold(2, a, m)  # (C, th, tw, a, a)
        # einsum lowers each transform to one GEMM over all tiles (matmul would batch tiny 4×4 products)
        return torch.einsum("ik,jl,cyxkl->ijcyx", b_t, b_t, tiles).reshape(a, a, tiles.shape[0], -1)

    def forward(self, x, w):
        dtype = _work_dtype(x.dtype, x.device)
        a_t, g, b_t = self._matrices(self.m, KERNEL, dtype, x.device)
        m, a = self.m, self.alpha
        height, width = x.shape[-2:]
        c_out = w.shape[0]
        kernel = (g @ w.to(dtype) @ g.T).permute(2, 3, 0, 1).reshape(a * a, c_out, -1)  # (α², O, I)
        padded, tiles_h, tiles_w = self._padded(x.to(dtype))
        out = torch.empty(x.shape[0], c_out, tiles_h * m, tiles_w * m, dtype=dtype, device=x.device)
        for n in range(x.shape[0]):
            for t0, t1 in _chunks(tiles_h, self._tiles_per_block(max(w.shape[:2]), tiles_w)):
                data = self._input_tiles(padded[n], t0, t1, b_t).reshape(a * a, w.shape[1], -1)
                products = torch.bmm(kernel, data).view(a, a, c_out, t1 - t0, tiles_w)
                tiles = torch.einsum("pi,qj,ijoyx->oypxq", a_t, a_t, products)  # (O, th, m, tw, m)
                out[n, :, t0 * m:t1 * m] = tiles.reshape(c_out, (t1 - t0) * m, tiles_w * m)
        return out[..., :height, :width].to(x.dtype).contiguous()

    def input_grad(self, grad_out, w):
        return self.forward(grad_out, _flipped_transposed(w))

    def weight_grad(self, x, grad_out):
        dtype = _work_dtype(x.dtype, x.device)
        a_t, g, b_t = self._matrices(KERNEL, self.m, dtype, x.device)  # F(3, m): 3 lags, m-long "filter"
        m, a = self.m, self.alpha
        c_in, c_out = x.shape[1], grad_out.shape[1]
        padded, tiles_h, tiles_w = self._padded(x.to(dtype))
        height, width = grad_out.shape[-2:]
        grad = F.pad(grad_out.to(dtype), (0, tiles_w * m - width, 0, tiles_h * m - height))
        acc = torch.zeros(a * a, c_out, c_in, dtype=dtype, device=x.device)
        for n in range(x.shape[0]):
            for t0, t1 in _chunks(tiles_h, self._tiles_per_block(max(c_in, c_out), tiles_w)):
                data = self._input_tiles(padded[n], t0, t1, b_t).reshape(a * a, c_in, -1)
                g_tiles = grad[n, :, t0 * m:t1 * m].reshape(c_out, t1 - t0, m, tiles_w, m)
                g_transformed = torch.einsum("ip,jq,oypxq->ijoyx", g, g, g_tiles).reshape(a * a, c_out, -1)
                acc += torch.bmm(g_transformed, data.transpose(1, 2))
        lags = torch.einsum("si,tj,ijoc->ocst", a_t, a_t, acc.view(a, a, c_out, c_in))  # (O, I, 3, 3)
        return lags.to(x.dtype).contiguous()
