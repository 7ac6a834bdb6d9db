"""Codecs on the path: the pool keeps its format, the wire carries one frame per layer (codecs/).

A case with a codec other than ``none`` runs through a ``CodecView`` of the
transport, three stages in threads of their own so that they overlap per layer:

    source:       gather the layer's ranges, encode into its registered staging slot (the caller),
                  then a sender thread moves the frame with the inner transport
    destination:  a receiver thread takes each frame into its staging slot, a decoder thread
                  decodes it and scatters it into the pool's ranges; the layer is done (``wait``
                  returns, stamped) when its decoded bytes are in the destination pool

Staging sits after the pool's KV bytes in the same allocation (so the inner
transport registered it with the pool): per layer and request a slot of the
largest frame, and for one-sided transports a 16-byte doorbell per slot.

Which transports carry codecs: those whose ``Caps.codec_frames`` says how (a plugin declares it too):
  * "stream" (tcp: two-sided, in-order): the 32-byte frame header, then its body, as two posts;
    the destination reads the header to learn the body's length.
  * "doorbell" (shm: one-sided copies): the source copies the frame into the destination's slot, then the
    doorbell (tag, length); the destination's receiver polls the doorbell.
  * others are refused with a reason: mpi/mpi-sendrecv, nixl, ucx and mooncake would need the
    same two steps wired to their own completion (not done yet); loopback moves within one
    process (nothing crosses a wire).  Pull is refused: the source must encode, and in a pull it
    is passive.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import numpy as np

from kvbench import _native, codecs, memory, transports
from kvbench.codecs import frame as F
from kvbench.codecs.base import calibrate
from kvbench.codecs.cast import POOL, _np_dtype, outside
from kvbench.job import faults
from kvbench.job.comm import TAG_CODEC_TABLE
from kvbench.memory import device, values, verify
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.model.schemes import control_bytes
from kvbench.transports.base import Transport, TransportError

BODY = 1 << 40  # the tag bit that marks a frame's body post (tcp headers carry 64-bit tags)
SLOT_ALIGN = 4096
DOORBELL = 16


def frames_of(transport: str) -> str:
    """How codec frames cross the registered ``transport`` (its ``Caps.codec_frames``; "": they cannot)."""
    try:
        return transports.load(transport).caps.codec_frames
    except Exception:  # noqa: BLE001 - a plugin that cannot even load carries nothing; its own run says why
        return ""


def carriers() -> tuple[str, ...]:
    """The registered transports that carry codec frames: streams first, then doorbells (registry order within)."""
    kinds = {n: frames_of(n) for n in transports.names()}
    return tuple(sorted((n for n, k in kinds.items() if k), key=lambda n: kinds[n] != "stream"))


def why_not(transport: str, op: str) -> str | None:
    """Why ``transport`` cannot carry a codec for ``op`` (None: it can)."""
    if not frames_of(transport):
        return (f"codecs run on {', '.join(carriers())} (a frame's length is known only at the source; "
                f"{transport} has no two-step receive or doorbell wired yet)")
    if op != "push":
        return "codecs need push: the source encodes, and in a pull it is passive"
    return None


def slot_bytes(layer_payload: int) -> int:
    return -(-(layer_payload + F.HEADER_BYTES) // SLOT_ALIGN) * SLOT_ALIGN


def staging_bytes(cases: list[dict], geometry, pairs: int) -> int:
    """Staging each rank's pool needs after its KV bytes for the transport's codec cases (0: none)."""
    need = 0
    for c in cases:
        if c.get("codec", "none") == "none":
            continue
        g = geometry(c)
        layers = g["shape"].layers
        nslots = max(pairs, 1) * c["inflight"] * layers
        need = max(need, nslots * (slot_bytes(g["payload"] // layers) + DOORBELL) + SLOT_ALIGN)
    return need


# ----- the harness's door (harness.py calls these; kept here so that it stays small) -------------------------
def fill_pools(pools: list, rank: int, held: tuple, want: tuple) -> tuple:
    """Untimed, per case: the pools hold the case's contents, ``want`` = (fill, dtype); ``held`` is what they
    hold now (a codec calibrates its table from them).  Returns what they hold afterwards."""
    if held[0] != want[0] or (want[0] != "pattern" and held != want):
        memory.use(values.make(*want))
        for p in pools:
            if p.array is None:  # a CUDA pool: filled where it lives, in pieces (memory/device.py)
                device.fill(p.tensor, rank)
                device.sync(p)
            else:
                memory.fill(p.array, rank)
        return want
    return held


def codec_transport(comm, t: Transport, session: Session | None, case: dict, g: dict, pairs: list):
    """Untimed, per case: the transport the iteration posts to; with a codec, the codec's view of ``t`` from the
    transport's codec ``session`` (its table exchanged once per connection)."""
    if case.get("codec", "none") == "none" or session is None:
        return t
    session.exchange_tables(comm, case, pairs)
    return session.view(case, g["payload"] // g["shape"].layers, g["shape"].layers)


def codec_refused(transport: str, case: dict) -> str | None:
    """Why this case's codec cannot run on ``transport`` (None: no codec, or it can)."""
    if case.get("codec", "none") == "none":
        return None
    if case.get("memory", "host") != "host":
        return f"codecs encode host pools (memory host), not {case['memory']} pools: none runs on a device yet"
    return why_not(transport, case["op"])


def codec_staging(transport: str, cases: list[dict], pairs, geometry) -> int:
    """Bytes of staging after each pool's KV bytes for the transport's codec cases (0: none)."""
    runnable = [c for c in cases if c.get("codec", "none") != "none" and not codec_refused(transport, c)]
    if not runnable:
        return 0
    return -(-staging_bytes(runnable, geometry, len(pairs)) // memory.PAGE) * memory.PAGE


def lossy_columns(err) -> dict:
    """A check row's max absolute and relative error of a lossy codec (NaN otherwise)."""
    if err is None:
        return {}
    return {"codec_max_abs_err": err[1], "codec_max_rel_err": err[2]}


def codec_columns(codec, it: int, e, case: dict) -> dict:
    """A row's codec columns: this rank's encode or decode seconds in iteration ``it``, and the frames' bytes."""
    if codec is None:
        return {"codec_encode_s": float("nan"), "codec_decode_s": float("nan")}
    enc, dec, wire = codec[it].get((e.pair, e.req), (0.0, 0.0, 0.0))
    out = {"codec_encode_s": enc, "codec_decode_s": dec}
    if wire:

        out["wire_bytes"] = int(wire) + control_bytes(e, case["handshake"])
    return out



class _Item:
    __slots__ = ("peer", "descs", "tag", "slot", "n", "frame", "done", "error", "at", "key", "enc", "dec", "wire")

    def __init__(self, peer, descs, tag, slot, key):
        self.peer, self.descs, self.tag, self.slot, self.key = peer, descs, tag, slot, key
        self.n = int(descs[:, LEN].sum())
        self.frame, self.error, self.at = 0, None, None
        self.enc = self.dec = 0.0
        self.wire = 0
        self.done = threading.Event()


class Session:
    """One transport's codec machinery for all its cases: staging, tables, the three worker threads."""

    def __init__(self, inner: Transport, pool: np.ndarray, kv_bytes: int, pairs: list[tuple[int, int]], rank: int):
        self.inner, self.pool, self.kv_bytes, self.pairs, self.rank = inner, pool, kv_bytes, pairs, rank
        self.mode = inner.caps.codec_frames
        self.tables: dict[tuple[int, str], codecs.Table] = {}
        self.stats: dict[tuple[int, int], list[float]] = {}
        self.lock = threading.Lock()
        self.sendq: queue.Queue = queue.Queue()
        self.recvq: queue.Queue = queue.Queue()
        self.decq: queue.Queue = queue.Queue()
        self.scratch = {"src": np.zeros(0, np.uint8), "dst": np.zeros(0, np.uint8)}
        self.threads = [threading.Thread(target=f, daemon=True, name=f"codec-{f.__name__}")
                        for f in (self._sender, self._receiver, self._decoder)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        for q in (self.sendq, self.recvq, self.decq):
            q.put(None)

    # ----- tables: calibrated once per model and dtype on the source, sent once per connection ----------
    def exchange_tables(self, comm, case: dict, pairs_here: list[tuple[int, int]]) -> None:
        """Untimed: each source calibrates its table from its pool, each destination receives it."""
        dtype = case["dtype"]
        if case["codec"] != "exp-split":
            return
        reqs = []
        for s, d in pairs_here:
            if (s, dtype) in self.tables and s == self.rank:
                continue
            if s == self.rank:
                t = calibrate(self.pool[: min(self.kv_bytes, 1 << 20)], dtype)
                self.tables[(s, dtype)] = t
                if d != s:
                    reqs.append(comm.isend_bytes(t.to_bytes(), d, TAG_CODEC_TABLE))
        for s, d in pairs_here:
            if d == self.rank and s != self.rank and (s, dtype) not in self.tables:
                buf = bytearray(24)
                comm.recv_bytes(buf, s, TAG_CODEC_TABLE)
                self.tables[(s, dtype)] = codecs.Table.from_bytes(bytes(buf))
        comm.waitall(reqs)

    def view(self, case: dict, layer_payload: int, layers: int) -> CodecView:
        return CodecView(self, case, slot_bytes(layer_payload), layers)

    def take_stats(self) -> dict[tuple[int, int], list[float]]:
        """Per (pair, request) since the last call: [encode s, decode s, wire bytes]."""
        with self.lock:
            out, self.stats = self.stats, {}
        return out

    def _add(self, key, i: int, v: float) -> None:
        with self.lock:
            self.stats.setdefault(key, [0.0, 0.0, 0.0])[i] += v

    def _buffer(self, n: int, side: str) -> np.ndarray:
        """A contiguous buffer of the layer (one per side: the encoder and the decoder run at once)."""
        if len(self.scratch[side]) < n:
            self.scratch[side] = np.ones(n, np.uint8)  # touched: no page faults on the timed path
        return self.scratch[side][:n]

    # ----- threads ------------------------------------------------------------------------------
    def _sender(self):
        while (it := self.sendq.get()) is not None:
            try:
                view, item = it
                off = view.slot_off(item.slot)
                if self.mode == "stream":
                    hdr = np.array([[off, off, F.HEADER_BYTES]], np.int64)
                    body = np.array([[off + F.HEADER_BYTES, off + F.HEADER_BYTES, item.frame - F.HEADER_BYTES]],
                                    np.int64)
                    h1 = self.inner.start(self.inner.prepare("push", item.peer, hdr, item.tag))
                    h2 = self.inner.start(self.inner.prepare("push", item.peer, body, item.tag | BODY))
                    self.inner.wait(h1)
                    self.inner.wait(h2)
                else:
                    d = np.array([[off, off, item.frame]], np.int64)
                    self.inner.wait(self.inner.start(self.inner.prepare("push", item.peer, d, item.tag)))
                    bell = view.bell_off(item.slot)
                    self.pool[bell : bell + DOORBELL].view(np.uint64)[:] = (item.tag + 1, item.frame)
                    b = np.array([[bell, bell, DOORBELL]], np.int64)
                    self.inner.wait(self.inner.start(self.inner.prepare("push", item.peer, b, item.tag)))
            except Exception as exc:  # handed to the waiting caller as one line
                item.error = exc
            item.done.set()

    def _receiver(self):
        while (it := self.recvq.get()) is not None:
            view, item = it
            try:
                off = view.slot_off(item.slot)
                if self.mode == "stream":
                    hdr = np.array([[off, off, F.HEADER_BYTES]], np.int64)
                    self.inner.wait(self.inner.serve("push", item.peer, hdr, item.tag))
                    body_len = int(self.pool[off + 24 : off + 28].view(np.uint32)[0])
                    if body_len > view.slot - F.HEADER_BYTES:
                        raise TransportError(f"codec frame of {body_len} B does not fit its slot")
                    body = np.array([[off + F.HEADER_BYTES, off + F.HEADER_BYTES, body_len]], np.int64)
                    self.inner.wait(self.inner.serve("push", item.peer, body, item.tag | BODY))
                    item.frame = F.HEADER_BYTES + body_len
                else:
                    bell = self.pool[view.bell_off(item.slot) :][:DOORBELL].view(np.uint64)
                    want = np.uint64(item.tag + 1)
                    spins = 0
                    while bell[0] != want:
                        spins += 1
                        if spins > 64:
                            time.sleep(0)
                    item.frame = int(bell[1])
                    if item.frame > view.slot:
                        raise TransportError(f"codec frame of {item.frame} B does not fit its slot")
            except Exception as exc:
                item.error = exc
                item.done.set()
                continue
            self.decq.put(it)

    def _decoder(self):
        while (it := self.decq.get()) is not None:
            view, item = it
            try:
                off = view.slot_off(item.slot)
                out = self._buffer(item.n, "dst")
                if faults.armed("codec-wire", self.rank):  # the reliability test's corrupted wire byte
                    self.pool[off + item.frame // 2] ^= 0x10
                t0 = time.perf_counter()
                view.codec_for(item.peer).decode(self.pool[off : off + item.frame], view.dtype, out)
                moved = np.empty_like(item.descs)
                moved[:, DST] = item.descs[:, DST]
                moved[:, LEN] = item.descs[:, LEN]
                moved[:, SRC] = np.cumsum(item.descs[:, LEN]) - item.descs[:, LEN]
                _native.copy_batch(self.pool, out, moved)
                item.at = time.perf_counter()
                self._add(item.key, 1, item.at - t0)
                self._add(item.key, 2, item.frame)
            except Exception as exc:
                item.error = exc
            item.done.set()


class CodecView(Transport):
    """One case's codec on the session's transport: what the harness's Iteration posts to."""

    def __init__(self, session: Session, case: dict, slot: int, layers: int):
        super().__init__(session.inner.ctx)
        self.s, self.case, self.slot, self.layers = session, case, slot, layers
        self.name = session.inner.name
        self.caps = replace(session.inner.caps, notifies=True, stamps=True, ops=("push",), signals_ready=False)
        self.dtype = case["dtype"]
        self.inflight = case["inflight"]
        self.nslots = max(len(session.pairs), 1) * self.inflight * layers
        self._codecs: dict[int, codecs.Codec] = {}

    def codec_for(self, src: int) -> codecs.Codec:
        if src not in self._codecs:
            table = self.s.tables.get((src, self.dtype))
            self._codecs[src] = codecs.get(self.case["codec"], table)
        return self._codecs[src]

    def slot_off(self, slot: int) -> int:
        return self.s.kv_bytes + SLOT_ALIGN + self.nslots * DOORBELL + slot * self.slot

    def bell_off(self, slot: int) -> int:
        return self.s.kv_bytes + SLOT_ALIGN + slot * DOORBELL

    def _slot(self, src: int, dst: int, tag: int) -> tuple[int, tuple[int, int]]:
        pair = self.s.pairs.index((src, dst)) if self.s.pairs else 0
        req, layer = (tag >> 12) & 0xF, tag & 0xFFF
        return (pair * self.inflight + req) * self.layers + layer, (pair, req)

    def prepare(self, op, peer, descs, tag=0):
        return op, peer, descs, tag

    def start(self, prepared):
        op, peer, descs, tag = prepared
        slot, key = self._slot(self.s.rank, peer, tag)
        item = _Item(peer, descs, tag, slot, key)
        data = self.s._buffer(item.n, "src")
        moved = np.empty_like(descs)
        moved[:, SRC] = descs[:, SRC]
        moved[:, LEN] = descs[:, LEN]
        moved[:, DST] = np.cumsum(descs[:, LEN]) - descs[:, LEN]
        _native.copy_batch(data, self.s.pool, moved)  # gather the layer: codecs read contiguous bytes
        off = self.slot_off(slot)
        t0 = time.perf_counter()
        item.frame = self.codec_for(self.s.rank).encode_into(data, self.dtype, self.s.pool[off : off + self.slot])
        self.s._add(key, 0, time.perf_counter() - t0)
        self.s._add(key, 2, item.frame)
        self.s.sendq.put((self, item))
        return item

    def post(self, op, peer, descs, tag=0):
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op, peer, descs, tag=0):
        slot, key = self._slot(peer, self.s.rank, tag)
        item = _Item(peer, descs, tag, slot, key)
        self.s.recvq.put((self, item))
        return item

    def wait(self, handle):
        handle.done.wait()
        if handle.error is not None:
            raise TransportError(f"codec {self.case['codec']}: {handle.error}")
        return handle.at


def lossy_check(snap: tuple, e, epoch: int, case: dict) -> tuple[int, float, float]:
    """A lossy codec's check of one request: (elements outside its tolerance, max abs error, max rel error),
    layer by layer (its block scales are per layer), against what the source held."""
    copy, where = snap
    t = _np_dtype(POOL[case["dtype"]][0])
    fmt = case["codec"].removeprefix("cast-")
    bad, max_abs, max_rel, at = 0, 0.0, 0.0, 0
    for layer in e.layers:
        rows = where[at : at + len(layer)]
        at += len(layer)
        x = verify.expected_ranges(e.src, layer, epoch)
        got = copy[int(rows[0, 1]) : int(rows[0, 1]) + len(x)] if len(rows) else x[:0]  # a snapshot: back to back
        b, a, r = outside(x.view(t), got.view(t), fmt, case["dtype"])
        bad, max_abs, max_rel = bad + b, max(max_abs, a), max(max_rel, r)
    return bad, max_abs, max_rel
