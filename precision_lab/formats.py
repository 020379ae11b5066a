"""Floating-point formats: unit roundoffs and round-to-nearest emulation of coarser formats.

Unit roundoff u = 2^-p for a format with p significand bits (p counts the implicit bit),
i.e. half the distance from 1 to the next number (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., 2002, §2.1). TF32 keeps float32's 8 exponent bits and
10 stored mantissa bits (p = 11, like fp16); bfloat16 keeps 7 (p = 8).
"""
from __future__ import annotations

import numpy as np
import torch

#: significand bits p (implicit bit included) of each format the lab knows
SIGNIFICAND_BITS = {"float64": 53, "float32": 24, "tf32": 11, "float16": 11, "bfloat16": 8}

#: unit roundoff u = 2^-p, round-to-nearest (Higham 2002, Table 2.1)
UNIT_ROUNDOFF = {name: 2.0 ** -p for name, p in SIGNIFICAND_BITS.items()}

#: formats whose arithmetic is float32 but whose conv *inputs* are rounded to fewer bits
REDUCED_FORMATS = ("tf32", "bfloat16", "float16")

#: formats a program may also *store* results in: PyTorch's autocast keeps a convolution's, a linear layer's or a
#: matmul's output in bfloat16 or float16, and every op after it computes in float32 and stores in the format
#: again, gradients too. A claim of either covers that and the tensor-core use with float32 results alike. TF32 is
#: a mode of the float32 units only: nothing is stored in it
STORED_FORMATS = ("bfloat16", "float16")

#: the names users write for PyTorch's torch.autocast with each dtype: the same claims as the formats themselves
AUTOCAST_ALIASES = {"autocast-bfloat16": "bfloat16", "autocast-float16": "float16"}

#: the largest finite float16 (IEEE 754 binary16): a scaled gradient beyond it overflows
FLOAT16_MAX = 65504.0

#: the storage dtype a claimed precision exchanges arrays in (docs/design.md, "Exchange format": float32 for tf32/bf16/fp16)
STORAGE_DTYPE = {"float64": "float64", "float32": "float32", "tf32": "float32",
                 "bfloat16": "float32", "float16": "float32"}

PRECISIONS = tuple(SIGNIFICAND_BITS)


def claim(text: str) -> str:
    """A precision as a user writes it, as the lab names it: autocast-bfloat16 is bfloat16 (AUTOCAST_ALIASES)."""
    name = AUTOCAST_ALIASES.get(text, text)
    unit_roundoff(name)
    return name


def unit_roundoff(precision: str) -> float:
    """u of a named precision; raises ValueError naming the choices for an unknown one."""
    try:
        return UNIT_ROUNDOFF[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS + tuple(AUTOCAST_ALIASES))}"
                         ) from None


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 values to `bits` stored mantissa bits, round-to-nearest-even.

    Emulates what TF32 (bits=10) and bfloat16 (bits=7) tensor cores see of their inputs;
    the exponent range stays float32's (fp16's narrower range is handled by `round_to`).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_mantissa expects float32, got {x.dtype}")
    drop = 23 - bits
    if drop <= 0:
        return x
    as_int = x.contiguous().view(torch.int32)
    # round-half-to-even on the dropped bits: add 0x7FF..F plus the lowest kept bit, then truncate;
    # one temporary, the rest in place (at 1024² each pass is 134 MB: tf32 emulation is mostly this)
    rounded = torch.bitwise_right_shift(as_int, drop).bitwise_and_(1)  # the lowest kept bit
    rounded.add_((1 << (drop - 1)) - 1).add_(as_int).bitwise_and_(~((1 << drop) - 1))
    rounded = rounded.view(torch.float32)
    # ±inf come through unchanged and the largest finite values round up to inf (as in hardware);
    # a NaN's payload could carry into the sign bit, so NaNs are copied back
    nan = torch.isnan(x)
    return torch.where(nan, x, rounded) if bool(nan.any()) else rounded


def round_to(x: torch.Tensor, precision: str) -> torch.Tensor:
    """Round a float32 tensor to what `precision` can represent, returned as float32."""
    if precision in ("float32", "float64"):
        return x
    if precision == "tf32":
        return round_mantissa(x, 10)
    if precision == "bfloat16":
        return x.to(torch.bfloat16).to(torch.float32)
    if precision == "float16":
        return x.to(torch.float16).to(torch.float32)
    raise ValueError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS)}")


def ulp_distance(a: np.ndarray, b: np.ndarray, precision: str = "float32") -> np.ndarray:
    """|a - b| in units in the last place of `precision` at the magnitude of b (the reference)."""
    p = SIGNIFICAND_BITS[precision]
    b = np.asarray(b, dtype=np.float64)
    # spacing of the format at |b|: 2^(floor(log2|b|) - p + 1), with the smallest normal's spacing as floor
    tiny = {"float64": 2.0 ** -1022, "float16": 2.0 ** -14}.get(precision, 2.0 ** -126)
    mag = np.maximum(np.abs(b), tiny)
    spacing = np.exp2(np.floor(np.log2(mag)) - p + 1)
    return np.abs(np.asarray(a, dtype=np.float64) - b) / spacing
