"""none and the general-purpose byte compressors (zstd, lz4 from their packages), in kvbench frames.

A compressor's output that is not smaller than its input is replaced by the
raw bytes (the frame's raw flag), so the wire never carries more than the
payload plus the 32-byte header.
"""
from __future__ import annotations

import numpy as np

from . import frame as F
from .base import Codec
from .frame import CodecError


def _elems(data: np.ndarray, dtype: str) -> int:
    from kvbench.model.shapes import dtype_bytes

    return len(data) // dtype_bytes(dtype) if dtype != "nvfp4" else len(data) * 2


def raw_frame(codec: str, data: np.ndarray, dtype: str, out: np.ndarray) -> int:
    """The layer's bytes as they are, behind a header flagged raw; the frame's length."""
    F.pack(out, codec, dtype, _elems(data, dtype), len(data), raw=True)
    out[F.HEADER_BYTES : F.HEADER_BYTES + len(data)] = data
    return F.HEADER_BYTES + len(data)


def body_frame(codec: str, body: bytes, data: np.ndarray, dtype: str, out: np.ndarray) -> int:
    """A compressor's output, or the raw bytes when it is not smaller; the frame's length."""
    if len(body) >= len(data):
        return raw_frame(codec, data, dtype, out)
    F.pack(out, codec, dtype, _elems(data, dtype), len(body))
    out[F.HEADER_BYTES : F.HEADER_BYTES + len(body)] = np.frombuffer(body, np.uint8)
    return F.HEADER_BYTES + len(body)


def read_raw(hdr: dict, frame: np.ndarray, out: np.ndarray) -> None:
    if hdr["body"] != len(out):
        raise CodecError(f"raw frame of {hdr['body']} B for a layer of {len(out)} B")
    out[:] = frame[F.HEADER_BYTES:]


class NoneCodec(Codec):
    """The payload as it is, in a frame (the harness's codec 'none' sends the pool's bytes with no frame)."""

    name = "none"

    def encode_into(self, data, dtype, out):
        return raw_frame(self.name, data, dtype, out)

    def decode_bytes(self, frame, dtype, out):
        hdr = F.unpack(frame, self.name, dtype, _elems(out, dtype))
        if not hdr["raw"]:
            raise CodecError("codec none carries raw frames only")
        read_raw(hdr, frame, out)


class _Compressor(Codec):
    def decode_bytes(self, frame, dtype, out):
        hdr = F.unpack(frame, self.name, dtype, _elems(out, dtype))
        if hdr["raw"]:
            return read_raw(hdr, frame, out)
        try:
            got = self._decompress(frame[F.HEADER_BYTES:], len(out))
        except Exception as exc:  # each library has its own error type; any of them means a corrupt body
            raise CodecError(f"{self.name} body corrupt: {exc}") from None
        if len(got) != len(out):
            raise CodecError(f"{self.name} body decodes to {len(got)} B, the layer has {len(out)} B")
        out[:] = np.frombuffer(got, np.uint8)


class Zstd(_Compressor):
    """zstandard level 1 (its fastest standard level), with a content checksum off: kvbench checks elements."""

    name = "zstd"

    def __init__(self, level: int = 1):
        import zstandard

        self._c = zstandard.ZstdCompressor(level=level, write_content_size=True)
        self._d = zstandard.ZstdDecompressor()

    def encode_into(self, data, dtype, out):
        return body_frame(self.name, self._c.compress(data), data, dtype, out)

    def _decompress(self, body, n):
        return self._d.decompress(body, max_output_size=n)


class LZ4(_Compressor):
    """lz4 block format (its default fast mode); the size is the layer's, known at both ends, not a stored prefix
    (a corrupted prefix would ask for any amount of memory)."""

    name = "lz4"

    def __init__(self):
        import lz4.block

        self._b = lz4.block

    def encode_into(self, data, dtype, out):
        return body_frame(self.name, self._b.compress(data, store_size=False), data, dtype, out)

    def _decompress(self, body, n):
        return self._b.decompress(body, uncompressed_size=n)
