"""Wire encodings between a pool and a transport: the pool keeps its format, the wire carries a frame.

Each codec turns one layer's payload (its bytes, read as elements of the pool's
dtype) into one *frame* (frame.py: a header, then the body) and back.  Lossless
codecs give back every bit; the cast codecs are lossy and state their tolerance.

    none            the bytes as they are (the baseline every row is compared with)
    exp-split       lossless exponent coding (bf16, fp16, fp8-e5m2): exp_split.py
    cast-fp8-e4m3   fp16/bf16 -> fp8 e4m3 with one fp32 scale per block (lossy): cast.py
    cast-fp8-e5m2   fp16/bf16 -> fp8 e5m2 with one fp32 scale per block (lossy)
    zstd, lz4       general-purpose byte compressors (their packages): general.py

Arrays may be numpy arrays or torch tensors (CPU here, CUDA where the device
layer exists); the numpy implementation is the reference (arrays.py).
"""
from __future__ import annotations

from .base import Codec, Table
from .frame import CodecError

NAMES = ("none", "exp-split", "cast-fp8-e4m3", "cast-fp8-e5m2", "zstd", "lz4")


def get(name: str, table: Table | None = None) -> Codec:
    """A codec by name (exp-split takes the connection's calibrated table)."""
    if name == "none":
        from .general import NoneCodec

        return NoneCodec()
    if name == "exp-split":
        from .exp_split import ExpSplit

        return ExpSplit(table)
    if name in ("cast-fp8-e4m3", "cast-fp8-e5m2"):
        from .cast import CastFP8

        return CastFP8(name.removeprefix("cast-"))
    if name == "zstd":
        from .general import Zstd

        return Zstd()
    if name == "lz4":
        from .general import LZ4

        return LZ4()
    raise ValueError(f"codec '{name}' is not one of: {', '.join(NAMES)}")


def check(name: str, dtype: str) -> str | None:
    """Why ``name`` cannot carry a pool of ``dtype`` (None: it can)."""
    if name not in NAMES:
        return f"codec '{name}' is not one of: {', '.join(NAMES)}"
    if name == "exp-split" and dtype == "fp8-e4m3":
        return ("exp-split on fp8-e4m3: its 4 exponent bits already are 16 values, a 4-bit code saves nothing "
                "(use none)")
    if name == "exp-split" and dtype not in ("bf16", "fp16", "fp8-e5m2"):
        return f"exp-split codes bf16, fp16 and fp8-e5m2 pools, not {dtype}"
    if name.startswith("cast-") and dtype not in ("bf16", "fp16"):
        return f"{name} converts fp16 or bf16 pools, not {dtype}"
    return None


__all__ = ["NAMES", "Codec", "CodecError", "Table", "check", "get"]
