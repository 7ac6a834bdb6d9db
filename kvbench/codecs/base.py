"""The codec interface and the exponent table one connection shares."""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from kvbench.codecs.arrays import is_torch

from .arrays import as_bytes, write_back
from .frame import HEADER_BYTES

# bits of the floating-point dtypes the codecs read: (element bits, exponent bits, mantissa bits)
FLOAT_BITS = {"fp32": (32, 8, 23), "bf16": (16, 8, 7), "fp16": (16, 5, 10), "fp8-e4m3": (8, 4, 3),
              "fp8-e5m2": (8, 5, 2)}


@dataclass(frozen=True)
class Table:
    """The 16 exponent values that get a 4-bit code, most frequent first; sent once per connection."""

    dtype: str
    exps: tuple[int, ...]

    def __post_init__(self):
        if len(self.exps) != 16 or len(set(self.exps)) != 16:
            raise ValueError("an exponent table holds 16 distinct exponent values")
        if not all(0 <= e < (1 << FLOAT_BITS[self.dtype][1]) for e in self.exps):
            raise ValueError(f"exponent out of range for {self.dtype}")

    @property
    def id(self) -> int:
        """What each frame names so that a table mix-up is an error, not wrong values."""
        return zlib.crc32(self.dtype.encode() + bytes(self.exps))

    def to_bytes(self) -> bytes:
        return self.dtype.encode().ljust(8, b"\0") + bytes(self.exps)

    @classmethod
    def from_bytes(cls, b: bytes) -> Table:
        return cls(b[:8].rstrip(b"\0").decode(), tuple(b[8:24]))


def exponents(data: np.ndarray, dtype: str) -> np.ndarray:
    """The biased exponent field of every element of ``data`` (bytes of ``dtype``), as uint8."""
    bits, ebits, mbits = FLOAT_BITS[dtype]
    u = data.view({8: np.uint8, 16: np.uint16, 32: np.uint32}[bits])
    return ((u >> mbits) & ((1 << ebits) - 1)).astype(np.uint8)


def calibrate(sample, dtype: str) -> Table:
    """The table for a model: its 16 most frequent exponents in ``sample`` (ties: the smaller exponent);
    exponents never seen fill the rest, nearest the most frequent one first."""
    counts = np.bincount(exponents(as_bytes(sample), dtype), minlength=1 << FLOAT_BITS[dtype][1])
    order = np.lexsort((np.arange(len(counts)), -counts))
    seen = [int(e) for e in order if counts[e] > 0][:16]
    mode = seen[0] if seen else (1 << (FLOAT_BITS[dtype][1] - 1)) - 1
    rest = sorted((e for e in range(len(counts)) if e not in seen), key=lambda e: (abs(e - mode), e))
    return Table(dtype, tuple(seen + rest[: 16 - len(seen)]))


def default_table(dtype: str) -> Table:
    """Without a sample: the exponents of |x| in [2^-11, 2^5) (where KV values live), bias-centred."""
    ebits = FLOAT_BITS[dtype][1]
    bias = (1 << (ebits - 1)) - 1
    lo = max(0, bias - 11)
    return Table(dtype, tuple(range(lo, lo + 16)))


class Codec:
    """One wire encoding.  ``encode`` returns one frame per call (one layer); ``decode`` writes the layer back."""

    name = "?"
    lossless = True

    def encode(self, data, dtype: str) -> np.ndarray:
        """The frame (uint8 numpy array) for ``data``: a numpy array or torch tensor holding ``dtype`` elements."""
        src = as_bytes(data)
        out = np.empty(self.max_frame(len(src), dtype), np.uint8)
        return out[: self.encode_into(src, dtype, out)]

    def encode_into(self, data: np.ndarray, dtype: str, out: np.ndarray) -> int:
        """Write the frame of ``data`` (uint8 bytes) into ``out`` (at least ``max_frame`` bytes, e.g. a
        registered staging region); return its length."""
        raise NotImplementedError

    def decode(self, frame, dtype: str, out) -> None:
        """Decode ``frame`` into ``out`` (numpy array or torch tensor of the layer's size); CodecError if corrupt."""
        dst = np.empty(as_bytes(out).nbytes, np.uint8) if _needs_copy(out) else as_bytes(out)
        self.decode_bytes(as_bytes(frame), dtype, dst)
        if dst is not None and _needs_copy(out):
            write_back(out, dst)

    def max_frame(self, nbytes: int, dtype: str) -> int:
        """The largest frame for ``nbytes`` of payload (staging regions are sized by it)."""

        return nbytes + HEADER_BYTES

    def decode_bytes(self, frame: np.ndarray, dtype: str, out: np.ndarray) -> None:
        raise NotImplementedError


def _needs_copy(x) -> bool:
    return is_torch(x) and x.device.type != "cpu"
