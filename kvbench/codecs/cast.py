"""cast-fp8-e4m3 / cast-fp8-e5m2: fp16 or bf16 pools sent as fp8 with one fp32 scale per block (lossy).

Per block of 128 values (DeepSeek's and FlashMLA's FP8 block): scale = the power of two at or above
max |x| over the block's finite values / the format's largest finite value (448 e4m3, 57344 e5m2; 1 for
an all-zero block; at least 2^-126); the wire holds the scales as fp32, then round-to-nearest-even fp8
of x / scale.  Power-of-two scales (as MX formats' E8M0) make x / scale exact and leave no slack bits:
the decoder refuses a scale with mantissa or sign bits, or a block of zeros whose scale is not 1, so a
corrupted scale byte is an error or a factor of 2^k on every element of its block, never unnoticed.  The destination writes fp8 x scale,
rounded to its pool's dtype.  Body: scales[blocks] fp32 | values[n] fp8 (ratio ~ 2 x 128/130 = 1.97x).

Tolerance (what verification counts as right), per element, for finite x:
    |decoded - x| <= rel x |x| + abs x scale_of_its_block
    rel = 2^-(m+1) + 2^-(p+1) + 2^-(m+p+2)   m: fp8 mantissa bits (3 e4m3, 2 e5m2),
                                               p: pool mantissa bits (7 bf16, 10 fp16) — two roundings
    abs = half the fp8 format's smallest subnormal (2^-10 e4m3, 2^-17 e5m2), plus the pool
          dtype's half-subnormal (fp16: 2^-25) where the product lands there.
NaN stays NaN; +-Inf stays +-Inf in e5m2 and becomes NaN in e4m3 (no infinity there: counted outside).
"""
from __future__ import annotations

import numpy as np

from . import frame as F
from .base import Codec
from .frame import CodecError

BLOCK = 128
FORMATS = {"fp8-e4m3": ("float8_e4m3fn", 448.0, 3, -9), "fp8-e5m2": ("float8_e5m2", 57344.0, 2, -16)}  # last: smallest subnormal, log2
POOL = {"bf16": ("bfloat16", 7), "fp16": ("float16", 10)}


def _np_dtype(name: str):
    if name == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def tolerance(fmt: str, dtype: str) -> tuple[float, float]:
    """(rel, abs) of the bound above: abs multiplies the element's block scale."""
    _, _, m, sub = FORMATS[fmt]
    p = POOL[dtype][1]
    return 2.0 ** -(m + 1) + 2.0 ** -(p + 1) + 2.0 ** -(m + p + 2), 2.0 ** (sub - 1)


def block_scales(x: np.ndarray, fmax: float) -> np.ndarray:
    """One fp32 scale per block of ``x`` (float32, length a multiple of BLOCK)."""
    a = np.abs(x.reshape(-1, BLOCK))
    a = np.where(np.isfinite(a), a, 0.0)
    amax = a.max(axis=1).astype(np.float64)
    m, e = np.frexp(amax / fmax)  # amax / fmax = m x 2^e, m in [0.5, 1): the power of two at or above is 2^e
    e = np.where(m == 0.5, e - 1, e)
    return np.where(amax > 0, np.ldexp(1.0, np.maximum(e, -126)), 1.0).astype(np.float32)


def outside(x: np.ndarray, got: np.ndarray, fmt: str, dtype: str) -> tuple[int, float, float]:
    """Elements of ``got`` outside the tolerance of ``x`` (both in the pool dtype), max abs and max rel error."""
    xf, gf = x.astype(np.float32), got.astype(np.float32)
    n = len(xf)
    pad = (-n) % BLOCK
    s = np.repeat(block_scales(np.concatenate([xf, np.zeros(pad, np.float32)]), FORMATS[fmt][1]), BLOCK)[:n]
    rel, ab = tolerance(fmt, dtype)
    fin = np.isfinite(xf)
    err = np.abs(gf.astype(np.float64) - xf)
    bound = rel * np.abs(xf) + ab * s + (2.0 ** -25 if dtype == "fp16" else 0.0)
    bad = fin & ~(err <= bound)
    nan_x = np.isnan(xf)
    bad |= nan_x & ~np.isnan(gf)
    inf_x = np.isinf(xf)
    bad |= inf_x & ~(gf == xf)
    e = np.where(fin, err, 0.0)
    r = np.where(fin & (xf != 0), e / np.where(xf != 0, np.abs(xf), 1.0), 0.0)
    return int(bad.sum()), float(e.max(initial=0.0)), float(r.max(initial=0.0))


class CastFP8(Codec):
    """fp16/bf16 -> fp8 (e4m3 or e5m2) with per-block fp32 scales; lossy within ``tolerance``."""

    lossless = False

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.name = f"cast-{fmt}"
        self._q = _np_dtype(FORMATS[fmt][0])

    def max_frame(self, nbytes, dtype):
        n = nbytes // 2
        return F.HEADER_BYTES + 4 * -(-n // BLOCK) + n

    def _check(self, dtype: str):
        if dtype not in POOL:
            raise CodecError(f"{self.name} converts fp16 or bf16 pools, not {dtype}")

    def encode_into(self, data, dtype, out):
        self._check(dtype)
        n = len(data) // 2
        nb = -(-n // BLOCK)
        x = np.zeros(nb * BLOCK, np.float32)
        x[:n] = data.view(_np_dtype(POOL[dtype][0]))
        s = block_scales(x, FORMATS[self.fmt][1])
        body = 4 * nb + n
        with np.errstate(invalid="ignore", over="ignore"):
            q = (x.reshape(nb, BLOCK) / s[:, None]).reshape(-1)[:n].astype(self._q)
        F.pack(out, self.name, dtype, n, body)
        at = F.HEADER_BYTES
        out[at : at + 4 * nb] = s.view(np.uint8)
        out[at + 4 * nb : at + body] = q.view(np.uint8)
        return F.HEADER_BYTES + body

    def decode_bytes(self, frame, dtype, out):
        self._check(dtype)
        n = len(out) // 2
        hdr = F.unpack(frame, self.name, dtype, n)
        nb = -(-n // BLOCK)
        if hdr["raw"] or hdr["body"] != 4 * nb + n:
            raise CodecError(f"{self.name} frame body of {hdr['body']} B, expected {4 * nb + n}")
        at = F.HEADER_BYTES
        s = frame[at : at + 4 * nb].view(np.float32)
        bits = s.view(np.uint32)
        expo = (bits >> 23) & 0xFF
        if (bits & 0x807FFFFF).any() or (expo == 0).any() or (expo == 0xFF).any():
            raise CodecError(f"{self.name} frame corrupt: a block scale is not a power of two")
        q = np.zeros(nb * BLOCK, self._q)
        q[:n] = frame[at + 4 * nb : at + 4 * nb + n].view(self._q)
        zero = ~((q.view(np.uint8) & 0x7F).reshape(nb, BLOCK).any(axis=1))
        if (s[zero] != 1.0).any():
            raise CodecError(f"{self.name} frame corrupt: a block of zeros with a scale other than 1")
        with np.errstate(invalid="ignore", over="ignore"):
            y = (q.astype(np.float32).reshape(nb, BLOCK) * s[:, None]).reshape(-1)[:n]
        out.view(_np_dtype(POOL[dtype][0]))[:] = y.astype(_np_dtype(POOL[dtype][0]))
