"""exp-split: lossless exponent coding for bf16, fp16 and fp8-e5m2 (after SplitZip, arXiv 2605.01708).

A floating-point element is sign | exponent | mantissa.  KV values use few
exponents, so each element's exponent becomes a 4-bit code into a table of the
16 most frequent ones (calibrated once per model, sent once per connection);
sign and mantissa are kept as they are.  Exponents outside the table are
*escapes*: the code slot holds 0 and the true exponent travels in a chunk-local
list (per chunk of 2^12 elements a uint16 count; per escape a uint16 position in
its chunk and a uint8 exponent: 3 B).

    dtype     element  coded              streams                                  ceiling
    bf16      16 bit   4 + 8 (s|m7)       nibbles n/2 B, sign|mantissa n B          16/12 = 1.333x
    fp16      16 bit   4 + 11 (s|m10)     low mantissa bytes n B, 7-bit (code|s|m9..8)  16/15 = 1.067x
    fp8-e5m2   8 bit   4 + 3 (s|m2)       7-bit (code|s|m1..0), 8 values in 7 B      8/7 = 1.143x
    fp8-e4m3   8 bit   4 exponent bits already: nothing to gain (the codec refuses it)

Frame body: streams | counts[nchunks] u16 | positions[n_esc] u16 | exponents[n_esc] u8.  If the
coded body is not smaller than the raw bytes, the frame carries them raw (never expands past the
header).  Decoding checks every slack bit (padding, the code slot of an escape, positions in order
and in range), so a corrupted byte is an error or wrong elements, never silently accepted.
The loops run in C (kvbench/_codec.c); the numpy functions here are the reference they must match
(vectorised: no Python loop per element or per chunk).
"""
from __future__ import annotations

import numpy as np

from . import frame as F
from .base import Codec, Table, default_table
from .frame import CodecError
from .general import raw_frame, read_raw

CHUNK_LOG2 = 12
DTYPES = ("bf16", "fp16", "fp8-e5m2")
ESC = np.uint8(0x10)  # the code lookup's mark for an exponent outside the table


def pack7(v: np.ndarray) -> np.ndarray:
    """Values < 128, 8 to every 7 bytes (the last group zero-padded)."""
    n = len(v)
    g = -(-n // 8)
    w = np.zeros((g, 8), np.uint64)
    w.reshape(-1)[:n] = v
    acc = w[:, 0].copy()
    for i in range(1, 8):
        acc |= w[:, i] << np.uint64(7 * i)
    return np.ascontiguousarray(acc.view(np.uint8).reshape(g, 8)[:, :7]).reshape(-1)


def unpack7(b: np.ndarray, n: int) -> np.ndarray:
    g = -(-n // 8)
    if len(b) != 7 * g:
        raise CodecError(f"7-bit stream of {len(b)} B for {n} values")
    w = np.zeros((g, 8), np.uint8)
    w[:, :7] = b.reshape(g, 7)
    acc = w.view(np.uint64).reshape(-1)
    out = np.empty((g, 8), np.uint8)
    for i in range(8):
        out[:, i] = (acc >> np.uint64(7 * i)) & np.uint64(0x7F)
    flat = out.reshape(-1)
    if flat[n:].any():
        raise CodecError("7-bit stream padding is not zero")
    return flat[:n]


def pack4(v: np.ndarray) -> np.ndarray:
    if len(v) % 2:
        v = np.concatenate([v, np.zeros(1, np.uint8)])
    return v[0::2] | (v[1::2] << 4)


def unpack4(b: np.ndarray, n: int) -> np.ndarray:
    if len(b) != -(-n // 2):
        raise CodecError(f"nibble stream of {len(b)} B for {n} values")
    out = np.empty(2 * len(b), np.uint8)
    out[0::2] = b & 0x0F
    out[1::2] = b >> 4
    if n % 2 and out[n]:
        raise CodecError("nibble stream padding is not zero")
    return out[:n]


def _native():
    try:
        from .. import _codec

        return _codec
    except ImportError:  # not built: the numpy reference (slower, the same frames)
        return None


class ExpSplit(Codec):
    """The lossless exponent codec; one instance per connection, holding the table both ends agreed."""

    name = "exp-split"

    def __init__(self, table: Table | None = None, native: bool = True):
        self.native = _native() if native else None  # None: the numpy reference
        self.tables: dict[str, Table] = {}
        if table is not None:
            self.tables[table.dtype] = table

    def table(self, dtype: str) -> Table:
        if dtype not in DTYPES:
            raise CodecError(f"exp-split codes {', '.join(DTYPES)}, not {dtype}")
        if dtype not in self.tables:
            self.tables[dtype] = default_table(dtype)
        return self.tables[dtype]

    def max_frame(self, nbytes, dtype):
        return nbytes + F.HEADER_BYTES  # the raw fallback bounds every frame

    def _luts(self, t: Table):
        code = np.full(256, ESC, np.uint8)
        code[list(t.exps)] = np.arange(16, dtype=np.uint8)
        return code, np.array(t.exps, np.uint8)

    # ----- encode --------------------------------------------------------------------------
    def encode_into(self, data, dtype, out):
        t = self.table(dtype)
        lut, _ = self._luts(t)
        kind = KINDS[dtype]
        n = len(data) // (1 if kind == 2 else 2)
        nchunks = -(-n // (1 << CHUNK_LOG2))
        slen = stream_len(kind, n)
        # escapes cost 3 B each: past this many the coded body is no smaller than the raw bytes
        cap = max(0, (len(data) - slen - 2 * nchunks - 1) // 3)
        streams = out[F.HEADER_BYTES : F.HEADER_BYTES + slen]
        counts = out[F.HEADER_BYTES + slen : F.HEADER_BYTES + slen + 2 * nchunks]
        if len(counts) != 2 * nchunks:  # the coded body cannot fit below the raw size
            return raw_frame(self.name, data, dtype, out)
        pos, val = np.empty(cap, np.uint16), np.empty(cap, np.uint8)
        if self.native is not None:
            nesc = self.native.encode(kind, data, lut, streams, counts, pos, val, CHUNK_LOG2)
        else:
            nesc = encode_ref(kind, data, lut, streams, counts.view(np.uint16), pos, val)
        if nesc < 0:
            return raw_frame(self.name, data, dtype, out)
        at = F.HEADER_BYTES + slen + 2 * nchunks
        out[at : at + 2 * nesc] = pos[:nesc].view(np.uint8)
        out[at + 2 * nesc : at + 3 * nesc] = val[:nesc]
        body = slen + 2 * nchunks + 3 * nesc
        F.pack(out, self.name, dtype, n, body, chunk_log2=CHUNK_LOG2, table_id=t.id, n_esc=nesc)
        return F.HEADER_BYTES + body

    # ----- decode --------------------------------------------------------------------------
    def decode_bytes(self, frame, dtype, out):
        t = self.table(dtype)
        kind = KINDS[dtype]
        n = len(out) // (1 if kind == 2 else 2)
        hdr = F.unpack(frame, self.name, dtype, n)
        if hdr["raw"]:
            return read_raw(hdr, frame, out)
        if hdr["table_id"] != t.id:
            raise CodecError("frame was coded with another exponent table than this connection's")
        if hdr["chunk_log2"] != CHUNK_LOG2:
            raise CodecError(f"frame chunk 2^{hdr['chunk_log2']}, expected 2^{CHUNK_LOG2}")
        nesc, nchunks, slen = hdr["n_esc"], -(-n // (1 << CHUNK_LOG2)), stream_len(kind, n)
        at = F.HEADER_BYTES
        if at + slen + 2 * nchunks + 3 * nesc != len(frame):
            raise CodecError("frame length does not match its streams and escapes")
        streams = frame[at : at + slen]
        counts = frame[at + slen : at + slen + 2 * nchunks]
        at += slen + 2 * nchunks
        pos, val = frame[at : at + 2 * nesc], frame[at + 2 * nesc :]
        _, exps = self._luts(t)
        try:
            if self.native is not None:
                self.native.decode(kind, streams, counts, pos, val, exps, out, CHUNK_LOG2)
            else:
                decode_ref(kind, streams, counts.view(np.uint16), pos.view(np.uint16), val, exps, out)
        except ValueError as exc:
            raise CodecError(f"exp-split frame corrupt: {exc}") from None
        return None


KINDS = {"bf16": 0, "fp16": 1, "fp8-e5m2": 2}


def stream_len(kind: int, n: int) -> int:
    """Bytes of the code and sign|mantissa streams of ``n`` elements."""
    if kind == 0:
        return -(-n // 2) + n
    return (n if kind == 1 else 0) + 7 * -(-n // 8)


def encode_ref(kind, data, lut, streams, counts, pos, val) -> int:
    """The numpy reference of _codec.encode (same streams, counts and escapes; -1 past len(val) escapes)."""
    if kind == 0:
        b = data.reshape(-1, 2)
        lo, hi = b[:, 0], b[:, 1]
        e = (hi << 1) | (lo >> 7)
    else:
        b = data.reshape(-1, 2) if kind == 1 else data.reshape(-1, 1)
        lo, hi = b[:, 0], b[:, -1]
        e = (hi >> 2) & 0x1F
    code = lut[e]
    n = len(code)
    idx = np.flatnonzero(code & ESC)
    if len(idx) > len(val):
        return -1
    code &= 0x0F
    counts[:] = np.bincount(idx >> CHUNK_LOG2, minlength=len(counts))
    pos[: len(idx)] = idx & ((1 << CHUNK_LOG2) - 1)
    val[: len(idx)] = e[idx]
    if kind == 0:
        parts = [pack4(code), (hi & 0x80) | (lo & 0x7F)]
    else:
        parts = ([lo] if kind == 1 else []) + [pack7((code << 3) | ((hi >> 5) & 0x04) | (hi & 0x03))]
    at = 0
    for p in parts:
        streams[at : at + len(p)] = p
        at += len(p)
    assert at == len(streams) and n >= 0
    return len(idx)


def decode_ref(kind, streams, counts, pos, val, exps, out) -> None:
    """The numpy reference of _codec.decode; ValueError on the same corruptions."""
    n = len(out) // (1 if kind == 2 else 2)
    nesc, nchunks = len(val), len(counts)
    if int(counts.sum(dtype=np.int64)) != nesc:
        raise ValueError("escape counts do not add up to the escapes")
    idx = np.repeat(np.arange(nchunks, dtype=np.int64) << CHUNK_LOG2, counts) + pos
    if nesc and ((np.diff(idx) <= 0).any() or idx[-1] >= n or (pos >> CHUNK_LOG2).any()):
        raise ValueError("escape positions out of order or out of range")
    if nesc and np.isin(val, exps).any():
        raise ValueError("an escape carries an exponent that has a code")
    if kind == 0:
        h = -(-n // 2)
        code = unpack4(streams[:h], n)
        sm = streams[h:]
    else:
        lo_len = n if kind == 1 else 0
        r = unpack7(streams[lo_len:], n)
        code = r >> 3
    if nesc and code[idx].any():
        raise ValueError("an escape's code slot is not zero")
    e = exps[code]
    e[idx] = val
    if kind == 0:
        o = out.reshape(-1, 2)
        o[:, 1] = (sm & 0x80) | (e >> 1)
        o[:, 0] = (e << 7) | (sm & 0x7F)
        return
    hi = ((r & 0x04) << 5) | (e << 2) | (r & 0x03)
    if kind == 1:
        o = out.reshape(-1, 2)
        o[:, 0] = streams[:n]
        o[:, 1] = hi
    else:
        out[:] = hi
