"""Pool contents other than the check pattern: realistic KV values, or a user's KV dump.

Verification stays exact: like the check pattern, every element is a pure
function of (source rank, element index, epoch), so a destination recomputes
what each byte must hold; the check pass's epoch changes the values (a new
draw, not an XOR that would break their statistics) and its poison is their
bitwise complement.

``realistic``: every element's exponent is drawn from the exponent
distribution of a model of KV values (below), its sign and mantissa bits are
uniform (they are in real caches: SplitZip and ZipNN find them
incompressible).  The model follows what KIVI (Liu et al., ICML 2024,
arXiv 2402.02750, Fig. 2) and KVQuant (Hooper et al., 2024, arXiv 2401.18079,
Fig. 2) measured on Llama-family caches: keys have fixed channels of much
larger magnitude than the rest, values have no channel structure and a
spread per token.  Keys: N(0, s_c) per channel with s_c log-normal (median 1,
sigma 0.7) and 3% outlier channels x8; values: N(0, s_t) per token with s_t
log-normal (median 0.3, sigma 0.5); half of the pool each.  The parameters
are read from those figures, not fitted: the distribution is a model of the
cited measurements, not a histogram of a real cache (none is published as
numbers); ``file:<dump>`` is the way to use a real one.  fp8 pools scale
values as vLLM's calculate_kv_scales does (keys to |max|/200, values /100).

``file:<path>``: a ``.npy`` or ``.safetensors`` dump of the pool's dtype (its
bytes, every tensor of a safetensors file in order); element j of rank r in
epoch e is the dump's element (j + 104729 r + 7919 e) mod n.
"""
from __future__ import annotations

import functools
import os

import numpy as np

FILL_HELP = "pattern (the check pattern, default), realistic (modelled KV values), file:<dump.npy|.safetensors>"
ELEM = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8-e4m3": 1, "fp8-e5m2": 1}
BITS = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7), "fp8-e4m3": (4, 3), "fp8-e5m2": (5, 2)}


def _fmix(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer: every output bit depends on every input bit (in place)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _hash(rank: int, epoch: int, idx: np.ndarray, salt: int = 0) -> np.ndarray:
    seed = np.uint32(((rank + 1) * 0x9E3779B9 ^ (epoch + 1) * 0x7FEB352D ^ salt * 0x27D4EB2F) & 0xFFFFFFFF)
    h = idx.astype(np.uint32)
    h ^= seed
    return _fmix(h)


def model_sample(n: int = 1 << 20, channels: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) drawn from the model above (float32, fixed seed)."""
    rng = np.random.default_rng(20240205)
    s_c = np.exp(rng.normal(0.0, 0.7, channels))
    s_c[rng.choice(channels, max(1, channels * 3 // 100), replace=False)] *= 8.0
    k = rng.standard_normal((n // 2 // channels, channels)) * s_c
    s_t = 0.3 * np.exp(rng.normal(0.0, 0.5, n // 2 // channels))
    v = rng.standard_normal((n // 2 // channels, channels)) * s_t[:, None]
    return k.astype(np.float32).ravel(), v.astype(np.float32).ravel()


@functools.lru_cache(maxsize=8)
def exponent_table(dtype: str) -> np.ndarray:
    """65536 exponent values whose frequencies are the model's exponent distribution in ``dtype``."""
    import ml_dtypes

    k, v = model_sample()
    if dtype.startswith("fp8"):
        fmax = 448.0 if dtype == "fp8-e4m3" else 57344.0
        k, v = k / (np.abs(k).max() / 200), v / (np.abs(v).max() / 100)
        k, v = np.clip(k, -fmax, fmax), np.clip(v, -fmax, fmax)
    t = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8-e4m3": ml_dtypes.float8_e4m3fn,
         "fp8-e5m2": ml_dtypes.float8_e5m2}[dtype]
    x = np.concatenate([k, v]).astype(t)
    ebits, mbits = BITS[dtype]
    u = x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[ELEM[dtype]]).astype(np.uint64)
    e = ((u >> np.uint64(mbits)) & np.uint64((1 << ebits) - 1)).astype(np.int64)
    counts = np.bincount(e, minlength=1 << ebits).astype(np.float64)
    cdf = np.cumsum(counts) / counts.sum()
    return np.searchsorted(cdf, (np.arange(65536) + 0.5) / 65536).astype(np.uint32)


class Realistic:
    """Elements with the model's exponent distribution and uniform sign and mantissa bits."""

    def __init__(self, dtype: str):
        if dtype not in ELEM:
            raise ValueError(f"fill 'realistic' needs a floating-point dtype ({', '.join(ELEM)}), not {dtype}")
        self.dtype = dtype
        self.table = exponent_table(dtype)

    def words(self, rank: int, w0: int, n: int, epoch: int = 0) -> np.ndarray:
        return self.at(rank, np.arange(w0, w0 + n, dtype=np.int64), epoch)

    def at(self, rank: int, widx: np.ndarray, epoch: int = 0) -> np.ndarray:
        """``words`` at any 32-bit word indices (the check's vectorised path over many ranges)."""
        per = 4 // ELEM[self.dtype]
        j = (widx[:, None] * per + np.arange(per)).ravel().astype(np.uint32)  # wraps past 2^32 elements, as the pattern does
        h = _hash(rank, epoch, j)
        ebits, mbits = BITS[self.dtype]
        e = np.take(self.table, h >> np.uint32(16))
        if self.dtype == "fp32":
            low = _hash(rank, epoch, j, salt=1) & np.uint32((1 << 23) - 1)
            sign = h & np.uint32(1)
        else:
            low = h & np.uint32((1 << mbits) - 1)
            sign = (h >> np.uint32(15)) & np.uint32(1)
        u = (sign << np.uint32(ebits + mbits)) | (e << np.uint32(mbits)) | low
        elem = u.astype({4: np.uint32, 2: np.uint16, 1: np.uint8}[ELEM[self.dtype]])
        return elem.view(np.uint32)


class Dump:
    """A user's KV dump as the pool's contents, rotated per rank and epoch."""

    def __init__(self, path: str, dtype: str):
        self.dtype = dtype
        self.data = load_dump(path, ELEM.get(dtype, 1))

    def words(self, rank: int, w0: int, n: int, epoch: int = 0) -> np.ndarray:
        return self.at(rank, np.arange(w0, w0 + n, dtype=np.int64), epoch)

    def at(self, rank: int, widx: np.ndarray, epoch: int = 0) -> np.ndarray:
        """``words`` at any 32-bit word indices."""
        b = ELEM.get(self.dtype, 1)
        elems = self.data.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[b])
        per = 4 // b
        j = (widx[:, None] * per + np.arange(per)).ravel()
        return elems[(j + 104729 * rank + 7919 * epoch) % len(elems)].view(np.uint32)


def load_dump(path: str, elem: int) -> np.ndarray:
    """The bytes of a .npy or .safetensors dump (its tensors concatenated), whole elements of ``elem`` bytes."""
    if not os.path.isfile(path):
        raise ValueError(f"fill file:{path}: no such file")
    try:
        if path.endswith(".npy"):
            arrays = [np.load(path, allow_pickle=False)]
        elif path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            arrays = list(load_file(path).values())
        else:
            raise ValueError("expected a .npy or .safetensors file")
    except Exception as exc:  # numpy and safetensors raise their own types for a bad file
        raise ValueError(f"fill file:{path}: cannot read it: {exc}") from None
    for a in arrays:
        if a.dtype.itemsize != elem:
            raise ValueError(f"fill file:{path}: elements of {a.dtype.itemsize} B, the pool's dtype has {elem} B")
    data = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
    if len(data) < elem * 16:
        raise ValueError(f"fill file:{path}: fewer than 16 elements")
    return data


def check_fill(spec: str) -> str:
    """Validate a fill spec (pydantic validator); the file is read by every rank when used."""
    if spec in ("pattern", "realistic"):
        return spec
    if spec.startswith("file:") and spec.endswith((".npy", ".safetensors")):
        return spec
    raise ValueError(f"fill '{spec}' is not one of: {FILL_HELP}")


def make(spec: str, dtype: str):
    """The contents generator of a fill spec for a pool of ``dtype`` (None: the check pattern)."""
    if spec == "pattern":
        return None
    if spec == "realistic":  # nvfp4 has no exponent model here: its pools keep the check pattern
        return Realistic(dtype) if dtype in ELEM else None
    return Dump(spec[len("file:") :], dtype)
