"""The frame every codec writes per layer: a fixed 32-byte header, then the codec's body.

    magic  'KF'   u8 version  u8 codec id  u8 dtype id  u8 flags (bit 0: raw body)
    u8 chunk_log2  u8 reserved (0)  u32 table id  u64 elements  u32 escapes  u32 body bytes  u32 reserved (0)

Every field is checked on decode: a corrupted header is an error, never a frame read wrongly.
"""
from __future__ import annotations

import struct

import numpy as np

from .registry import CODEC_IDS


class CodecError(ValueError):
    """A frame that cannot be decoded (corrupt, or not what the destination expects): one line."""


HEADER = struct.Struct("<2sBBBBBBIQIII")
HEADER_BYTES = HEADER.size  # 32
MAGIC, VERSION = b"KF", 1
RAW = 1
DTYPE_IDS = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8-e4m3": 3, "fp8-e5m2": 4, "nvfp4": 5}


def pack(out: np.ndarray, codec: str, dtype: str, n: int, body_len: int, *, raw: bool = False, chunk_log2: int = 0,
         table_id: int = 0, n_esc: int = 0) -> None:
    """Write the header into ``out[:32]``."""
    HEADER.pack_into(out, 0, MAGIC, VERSION, CODEC_IDS[codec], DTYPE_IDS[dtype], RAW if raw else 0, chunk_log2, 0,
                     table_id, n, n_esc, body_len, 0)


def unpack(frame: np.ndarray, codec: str, dtype: str, n: int) -> dict:
    """The checked header of ``frame``, which must carry ``n`` elements of ``dtype`` coded by ``codec``."""
    if len(frame) < HEADER_BYTES:
        raise CodecError(f"frame of {len(frame)} B is shorter than its {HEADER_BYTES}-byte header")
    magic, ver, cid, did, flags, clog, r0, tid, nn, nesc, blen, r1 = HEADER.unpack_from(frame, 0)
    if magic != MAGIC or ver != VERSION or r0 or r1 or flags & ~RAW:
        raise CodecError("frame header corrupt (magic, version or reserved bits)")
    if cid != CODEC_IDS[codec] or did != DTYPE_IDS[dtype]:
        raise CodecError(f"frame is codec {cid} dtype {did}, expected {codec} {dtype}")
    if nn != n:
        raise CodecError(f"frame carries {nn} elements, the destination expects {n}")
    if (flags & RAW or codec != "exp-split") and (clog or tid or nesc):
        raise CodecError("frame header corrupt (fields this frame does not use are not zero)")
    if blen != len(frame) - HEADER_BYTES:
        raise CodecError(f"frame body is {len(frame) - HEADER_BYTES} B, its header says {blen}")
    return {"raw": bool(flags & RAW), "chunk_log2": clog, "table_id": tid, "n_esc": nesc, "body": blen}
