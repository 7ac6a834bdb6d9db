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
layer exists); the numpy implementation is the reference (arrays.py).  The list of codecs, with their
frame ids and the dtypes each accepts, is registry.py.
"""
from __future__ import annotations

import importlib

from .base import Codec, Table
from .frame import CodecError
from .registry import NAMES, REGISTRY


def _unknown(name: str) -> str:
    return f"codec '{name}' is not one of: {', '.join(NAMES)}"


def get(name: str, table: Table | None = None) -> Codec:
    """A codec by name (exp-split takes the connection's calibrated table)."""
    if name not in REGISTRY:
        raise ValueError(_unknown(name))
    e = REGISTRY[name]
    mod, _, cls = e.target.partition(":")
    codec = getattr(importlib.import_module(mod), cls)
    return codec(table) if e.table else codec(*e.args)


def check(name: str, dtype: str) -> str | None:
    """Why ``name`` cannot carry a pool of ``dtype`` (None: it can)."""
    if name not in REGISTRY:
        return _unknown(name)
    return REGISTRY[name].check(name, dtype)


__all__ = ["NAMES", "REGISTRY", "Codec", "CodecError", "Table", "check", "get"]
