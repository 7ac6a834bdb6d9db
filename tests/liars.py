"""Transports that lie, each in one way, for the honesty tests (tests/test_honesty.py, tests/test_liar_matrix.py).

Registered through KVBENCH_TRANSPORTS for a launch.  A lie is a mixin over the transport contract (prepare,
start, post, serve, wait), so one lie runs over any real transport: ``lie-<lie>`` is the lie over shm
(one-sided copies between the ranks' shared pools), ``lie-<lie>-tcp`` over tcp (two-sided, a receive thread
that stamps the landing), ``lie-<lie>-staged`` over staged (device pools through bounce buffers and tcp), and
``lie-early-<engine>`` an engine's own completion (nixl, ucx, mooncake, mpi) a few microseconds before the
bytes land (liars_engines.py).
The harness must catch every one: as wrong elements, or as a time that cannot be.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import replace

import liars_engines
import numpy as np

from kvbench import _native
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.transports.base import Transport
from kvbench.transports.shm import ShmTransport
from kvbench.transports.tcp import TcpTransport

SKIPPED = object()  # the handle of a transfer a liar did not make
EARLY_S = 5e-6  # how long after the completion it reported a liar starts moving the bytes
RATE = 1e9  # lie-early: bytes per second it moves them at once it starts
MAILBOX = 4096  # lie-early: the page after each pool where the ranks count transfers said and taken


def iteration(tag: int) -> int:
    """The iteration a post's tag belongs to (the harness's tag: ((case << 8) + it) << 16; 255: the check pass)."""
    return (tag >> 16) & 0xFF


class _Lie:
    """A mixin: the base transport with one lie.  ``lie_descs`` rewrites a post's descriptors (on both sides
    alike, so a two-sided pair stays in step); ``skips`` drops a transfer on both sides."""

    frames_honest = False  # under a codec the lie is the codec view's (_codec_lies): the frames move honestly

    def lie_descs(self, descs: np.ndarray) -> np.ndarray:
        return descs

    def skips(self, tag: int) -> bool:
        return False

    @classmethod
    def _prepares(cls) -> bool:  # the base prepares posts itself: the lie goes there, else into post
        return any("prepare" in vars(k) for k in cls.__mro__[cls.__mro__.index(_Lie) + 1:] if k is not Transport)

    def prepare(self, op, peer, descs, tag=0):
        if self.frames_honest:
            return super().prepare(op, peer, descs, tag)
        if self.skips(tag):
            return SKIPPED
        return super().prepare(op, peer, self.lie_descs(descs) if self._prepares() else descs, tag)

    def start(self, prepared):
        return SKIPPED if prepared is SKIPPED else super().start(prepared)

    def post(self, op, peer, descs, tag=0):
        if self.frames_honest:
            return super().post(op, peer, descs, tag)
        if self.skips(tag):
            return SKIPPED
        return super().post(op, peer, descs if self._prepares() else self.lie_descs(descs), tag)

    def serve(self, op, peer, descs, tag=0):
        if self.frames_honest:
            return super().serve(op, peer, descs, tag)
        return SKIPPED if self.skips(tag) else super().serve(op, peer, self.lie_descs(descs), tag)

    def post_when_ready(self, peer, descs, tag=0):
        return SKIPPED if self.skips(tag) else super().post_when_ready(peer, self.lie_descs(descs), tag)

    def answer(self, handle):
        if handle is not SKIPPED:
            super().answer(handle)

    def wait(self, handle):
        return None if handle is SKIPPED else super().wait(handle)


class _Nothing(_Lie):
    """Reports every transfer done and moves no byte."""

    def skips(self, tag):
        return True


class _SkipsOne(_Lie):
    """Skips the transfers of one timed iteration in ten (iterations 1, 11, ...), only at back-to-back speed: the
    check pass after timing is moved."""

    def skips(self, tag):
        it = iteration(tag)
        return it != 0xFF and it % 10 == 1


class _WrongBlock(_Lie):
    """Moves every byte, each block to its neighbour's place."""

    def lie_descs(self, descs):
        d = descs.copy()
        if len(d) > 1:
            d[:, DST] = np.roll(d[:, DST], 1)
            d[:, LEN] = d[:, LEN].min()
        else:  # one descriptor: half a block further on
            d[:, DST] += d[:, LEN] // 2
            d[:, LEN] -= d[:, LEN] // 2
        return d


class _Outside(_Lie):
    """Moves every byte to its place, and one block more just outside the post's ranges (before its first, or
    after its last where nothing fits before)."""

    def lie_descs(self, descs):
        if not len(descs):
            return descs
        first = descs[int(np.argmin(descs[:, DST]))]
        n = int(first[LEN])
        lo, hi = int(descs[:, DST].min()), int((descs[:, DST] + descs[:, LEN]).max())
        extra = np.array([[first[SRC], lo - n if lo >= n else hi, n]], dtype=descs.dtype)
        return np.ascontiguousarray(np.concatenate([descs, extra]))

    def moved(self, descs):
        """The destination's side alone (a codec's scatter): its first block written just outside instead."""
        d = self.lie_descs(descs)
        k = int(np.argmin(descs[:, DST]))
        out = descs.copy()
        out[k, DST] = d[-1, DST]
        return out


class _Early(_Lie):
    """Reports a transfer complete before it is: the wait returns at once, the real completion is waited for at
    the next call into the transport (an engine's own completion path: its notification, its sync)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._owed: list = []

    def _settle(self):
        owed, self._owed = self._owed, []
        for h in owed:
            super().wait(h)

    def prepare(self, op, peer, descs, tag=0):
        self._settle()
        return super().prepare(op, peer, descs, tag)

    def post(self, op, peer, descs, tag=0):
        self._settle()
        return super().post(op, peer, descs, tag)

    def serve(self, op, peer, descs, tag=0):
        self._settle()
        return super().serve(op, peer, descs, tag)

    def wait(self, handle):
        if handle is None or handle is SKIPPED:
            return None
        self._owed.append(handle)
        return None

    def close(self):
        try:
            self._settle()
        finally:
            super().close()


def _pieces(descs: np.ndarray, most: int = 1 << 18) -> list[np.ndarray]:
    """The descriptors cut into pieces of at most ``most`` bytes, in order, grouped about ``most`` bytes a group."""
    n = -(-descs[:, LEN] // most)
    rows = np.repeat(descs, n, axis=0)
    k = np.arange(len(rows)) - np.repeat(np.cumsum(n) - n, n)
    rows[:, SRC] += k * most
    rows[:, DST] += k * most
    rows[:, LEN] = np.minimum(most, np.repeat(descs[:, LEN], n) - k * most)
    ends = np.cumsum(rows[:, LEN])
    cuts = np.searchsorted(ends, np.arange(most, int(ends[-1]) if len(ends) else 0, most), side="right")
    return [np.ascontiguousarray(p) for p in np.split(rows, np.unique(cuts)) if len(p)]


class _CopiesLater(ShmTransport):
    """shm's lie of early completion, by a few microseconds: the transport tells the destination itself that a
    transfer is complete (it notifies: the harness adds no message), and a thread starts moving the bytes EARLY_S
    after the destination has taken that word, at RATE as a link would deliver them (the first bytes a few
    microseconds after the completion, the last ones payload / RATE later).

    Each segment has a mailbox page after the pool: word 2p is how many transfers rank p said it completed into
    this rank, word 2p+1 how many of them this rank has taken (pull: the initiator is the destination, and the
    same counts live in this process)."""

    caps = dataclasses.replace(ShmTransport.caps, notifies=True)

    def __init__(self, ctx):
        super().__init__(ctx)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[int, int] = {}
        self._expected: dict[int, int] = {}
        self._taken: dict[int, int] = {}  # pull: this rank's own acknowledgements
        threading.Thread(target=self._copier, daemon=True).start()

    def alloc(self, nbytes):
        buf = super().alloc(nbytes + MAILBOX)
        self.mail = buf.array[nbytes:].view(np.uint64)
        return type(buf)(buf.array[:nbytes], buf.release)

    def connect(self, peers):
        super().connect(peers)
        self.remote_mail = {r: a[-MAILBOX:].view(np.uint64) for r, a in self.peers.items()}
        self.peers = {r: a[:-MAILBOX] for r, a in self.peers.items()}

    def _copier(self):
        while (job := self._jobs.get()) is not None:
            taken, seq, prepared = job
            deadline = time.perf_counter() + 30
            while taken() < seq and time.perf_counter() < deadline:
                time.sleep(0)
            t0 = time.perf_counter() + EARLY_S
            while time.perf_counter() < t0:
                pass
            dst, src, descs = prepared
            done = 0
            for piece in _pieces(descs):  # the bytes stream in at RATE, in order, as a link delivers them
                _native.copy_batch(dst, src, piece)
                done += int(piece[:, LEN].sum())
                while time.perf_counter() < t0 + done / RATE:
                    time.sleep(0)

    frames_honest = False

    def start(self, prepared):
        if self.frames_honest:
            return ShmTransport.start(self, prepared)
        remote = prepared[0] if prepared[0] is not self.pool.array else prepared[1]
        peer = next(r for r, a in self.peers.items() if a is remote)
        seq = self._sent[peer] = self._sent.get(peer, 0) + 1
        if prepared[0] is remote:  # push: tell the destination it is complete; copy once it has taken that word
            box = self.remote_mail[peer]
            box[2 * self.ctx.rank] = seq
            self._jobs.put((lambda: int(box[2 * self.ctx.rank + 1]), seq, prepared))
        else:  # pull: this rank is the destination; copy once its own wait has returned
            self._jobs.put((lambda: self._taken.get(peer, 0), seq, prepared))
        return ("pull", peer, seq) if prepared[0] is not remote else None

    def serve(self, op, peer, descs, tag=0):
        if op != "push" or self.frames_honest:
            return None
        want = self._expected[peer] = self._expected.get(peer, 0) + 1
        return ("push", peer, want)

    def wait(self, handle):
        if handle is None:
            return None
        kind, peer, seq = handle
        if kind == "pull":
            self._taken[peer] = max(self._taken.get(peer, 0), seq)
            return time.perf_counter()
        deadline = time.perf_counter() + 30
        while int(self.mail[2 * peer]) < seq:
            if time.perf_counter() > deadline:
                raise TimeoutError("lie-early: no word from the source")
        landed = time.perf_counter()
        self.mail[2 * peer + 1] = max(int(self.mail[2 * peer + 1]), seq)
        return landed

    def close(self):
        self._jobs.put(None)
        super().close()


class ReadsBeforeFinal(ShmTransport):
    """A pull that reads each layer when the read is prepared, before the source says the layer is final."""

    name = "lie-read-early"

    def prepare(self, op, peer, descs, tag=0):
        prepared = super().prepare(op, peer, descs, tag)
        if op == "pull":
            _native.copy_batch(*prepared)
            return None
        return prepared

    def start(self, prepared):
        if prepared is not None:
            _native.copy_batch(*prepared)


class StampsSendersTime(TcpTransport):
    """Moves every byte but reports, as the moment the bytes landed, the moment the receive was posted."""

    name = "lie-stamp"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._posted: dict[int, float] = {}

    def serve(self, op, peer, descs, tag=0):
        job = super().serve(op, peer, descs, tag)
        self._posted[id(job)] = time.perf_counter()
        return job

    def post_when_ready(self, peer, descs, tag=0):
        job = super().post_when_ready(peer, descs, tag)
        self._posted[id(job)] = time.perf_counter()
        return job

    def wait(self, handle):
        landed = super().wait(handle)
        return self._posted.pop(id(handle), landed)


class StampsAtHeader(StampsSendersTime):
    """Moves every byte but stamps the landing halfway between its receive's post and the real landing, as a
    stamp taken when the message's header arrived would: after the source posted, before the bytes."""

    name = "lie-stamp-header"

    def wait(self, handle):
        posted = self._posted.pop(id(handle), None)
        landed = TcpTransport.wait(self, handle)
        return landed if posted is None else (posted + landed) / 2


LIES = {"nothing": _Nothing, "wrong-block": _WrongBlock, "skip": _SkipsOne, "outside": _Outside}
BASES = {"": ShmTransport, "-tcp": TcpTransport}
LIARS: dict[str, str] = {}


def _make(name: str, lie: type, base: type) -> None:
    cls = type(name.replace("-", "_"), (lie, base), {"name": name, "__module__": __name__})
    globals()[cls.__name__] = cls
    LIARS[name] = f"liars:{cls.__name__}"


for _lie, _cls in LIES.items():
    for _suffix, _base in BASES.items():
        _make(f"lie-{_lie}{_suffix}", _cls, _base)
LIARS["lie-early"] = "liars:_CopiesLater"
_CopiesLater.name = "lie-early"
class _EarlyTcp(_Early, TcpTransport):
    """tcp's early completion: the wait returns at once, and the sender holds each layer back EARLY_TCP_S, so the
    bytes are still on their way when the harness believes them landed, however loaded the machine."""

    def connect(self, peers):
        super().connect(peers)
        for conn in (c for lanes in self.lanes.values() for rails in lanes for c in rails):
            conn.send = self._late(conn.send)

    @staticmethod
    def _late(send):
        def late(hdr, descs, col):
            if len(descs):
                time.sleep(EARLY_TCP_S)
            return send(hdr, descs, col)

        return late


EARLY_TCP_S = 0.05
_make("lie-early-tcp", _EarlyTcp, TcpTransport)
LIARS["lie-read-early"] = "liars:ReadsBeforeFinal"
LIARS["lie-stamp"] = "liars:StampsSendersTime"
LIARS["lie-stamp-header"] = "liars:StampsAtHeader"


def _late(name: str, module: str, cls: str) -> None:
    """A liar over a transport whose library is optional: its class is made when the registry loads it."""
    LIARS[name] = f"liars:{name.replace('-', '_')}"
    LATE[name.replace("-", "_")] = (name, module, cls)


LATE: dict[str, tuple] = {}
# an engine's own completion path, a few microseconds early (liars_engines.py)
for _name, _base, _lie in [("nixl", "NixlTransport", "NixlNoticeFirst"), ("ucx", "UcxTransport", "UcxUnpacksLater"),
                           ("mooncake", "MooncakeTransport", "MooncakeNoticeFirst"), ("mpi", "MpiTransport", "MpiNoticeFirst")]:
    _late(f"lie-early-{_name}", f"kvbench.transports.{_name}", _base)
    LATE[f"lie_early_{_name}"] += (getattr(liars_engines, _lie),)
for _lie, _cls in {"nothing": _Nothing, "wrong-block": _WrongBlock, "skip": _SkipsOne, "outside": _Outside,
                   "early": _Early}.items():
    _late(f"lie-{_lie}-staged", "kvbench.transports.staged", "StagedTransport")
    LATE[f"lie_{_lie}_staged".replace("-", "_")] += (_cls,)


def __getattr__(attr: str):
    """The registry's ``liars:<class>`` for an optional library's liar: built on first use."""
    if attr not in LATE:
        raise AttributeError(attr)
    import importlib

    name, module, base, *lie = LATE[attr]
    _make(name, lie[0] if lie else _Early, getattr(importlib.import_module(module), base))
    return globals()[attr]


class _Done:
    """A codec item that a liar reports complete at once."""

    error = at = None  # no stamp of its own: the harness's wait stamps it

    def __init__(self):
        self.done = threading.Event()
        self.done.set()


def _codec_lies() -> None:
    """Under a codec the harness posts to the codec's view of the transport, which moves frames through it: the
    liar's lie then applies where the view gathers and scatters the KV bytes (the frames move honestly), so the
    lie reaches the pool as it would through an engine that encodes on the wire."""
    from kvbench.codecs import path as P

    V = P.CodecView
    if getattr(V, "lied", False):
        return
    init, start, serve, wait = V.__init__, V.start, V.serve, V.wait

    def __init__(self, session, *a, **k):
        init(self, session, *a, **k)
        self.lie = session.inner if isinstance(session.inner, (_Lie, _CopiesLater)) else None
        if self.lie is not None:
            self.lie.frames_honest = True

    def lied(self, prepared_or_args, f, side):
        op, peer, descs, tag = prepared_or_args
        lie = self.lie
        if isinstance(lie, _Lie):
            if lie.skips(tag):
                return _Done()
            if not isinstance(lie, _Outside):  # a frame holds what its slot holds: no block more
                descs = lie.lie_descs(descs)
            elif side == "dst":
                descs = lie.moved(descs)
        return f(self, (op, peer, descs, tag))

    V.__init__ = __init__
    V.start = lambda self, p: lied(self, p, start, "src")
    V.serve = lambda self, op, peer, descs, tag=0: lied(self, (op, peer, descs, tag),
                                                        lambda v, a: serve(v, *a), "dst")
    V.wait = lambda self, h: None if isinstance(self.lie, _CopiesLater) else wait(self, h)
    V.lied = True


try:
    _codec_lies()
except ImportError:  # no codec machinery: nothing to lie through
    pass
# liars about the time only, for the bounds on a landing time (tests/test_bounds.py): every byte lands where it
# must, the check passes, and only a bound measured in the run can tell
BOUND_LIARS = {
    "lie-stamp-half": "liars:StampsHalfway",
    "lie-half-time": "liars:HalvesTheTime",
}


class StampsHalfway(StampsSendersTime):
    """Moves every byte but reports, as the moment the bytes landed, the moment halfway between its receive post
    and the real landing (the wait returns long after such a stamp: beyond the wake-up bound)."""

    name = "lie-stamp-half"

    def __init__(self, ctx):
        super().__init__(ctx)
        # a pull's layer-ready signal by the harness (tcp -O ready=mpi): the read is posted once the layer is final
        self.ready_via, self.caps = "mpi", replace(self.caps, signals_ready=False)

    def start(self, prepared):
        a = time.perf_counter()
        job = super().start(prepared)
        if prepared[1] is not None:  # a pull's read request: its receive
            self._posted[id(job)] = a
        return job

    def wait(self, handle):
        landed = TcpTransport.wait(self, handle)  # the real landing, not StampsSendersTime's lie
        posted = self._posted.pop(id(handle), None)
        return landed if posted is None else (posted + landed) / 2


class HalvesTheTime(ShmTransport):
    """Copies every byte in its post (a pull's reads) and reports half the time since the request's first post as
    its landing: twice the GB/s the copy made, beyond the harness's own copy of the same bytes."""

    name = "lie-half-time"
    batches = True  # a request's layers in one post (one copy): its first post is its last
    _since: float | None = None

    def start(self, prepared):
        if self._since is None:
            self._since = time.perf_counter()
        super().start(prepared)
        return self._since

    def wait(self, handle):
        if handle is None:
            return super().wait(handle)
        self._since = None
        return handle + (time.perf_counter() - handle) / 2


class _OutsideFirstRequest(_Outside):
    """A workload's request 0 alone also writes one block just outside its ranges: under ``--alloc contiguous``
    a block free then, which the next request is granted and overwrites (only the grant's check can see it)."""

    lying = True

    def prepare(self, op, peer, descs, tag=0):
        self.lying = tag >> 16 == 0  # a workload's tag: (request id << 16) | layer
        return super().prepare(op, peer, descs, tag)

    def post(self, op, peer, descs, tag=0):
        self.lying = tag >> 16 == 0
        return super().post(op, peer, descs, tag)

    def lie_descs(self, descs):
        return super().lie_descs(descs) if self.lying else descs


_make("lie-outside-first", _OutsideFirstRequest, ShmTransport)


def _fill_model(rank: int, descs: np.ndarray, epoch: int = 0) -> np.ndarray:
    """What ``rank``'s pool holds at the source ranges in ``epoch``, gathered, computed with the run's own key
    (this liar reads the harness's secret, which no transport is handed): the strongest compressor there can be, one
    that knows the content.  Without the key keyed content does not compress at all."""
    from kvbench.memory import keyed

    out = np.empty(int(descs[:, LEN].sum()), np.uint8)
    keyed.ranges(out, descs, rank, epoch)
    return out


def _epoch_of_tag(tag: int) -> int:
    """The epoch the harness gives the iteration of a post's tag (checkpass.epoch_of): its case and iteration."""
    from kvbench.harness.checkpass import epoch_of

    it, case = iteration(tag), (tag >> 24) & 0xFF
    return epoch_of(case + 1, -1) if it == 0xFF else epoch_of(case, it)


def _public(rank: int, widx: np.ndarray) -> np.ndarray:
    """The fill kvbench used before its content was keyed: a public function of (rank, word index), each epoch
    one XOR word away from it."""
    return (np.asarray(widx, np.uint64) * 2654435761 ^ ((rank + 1) * 0x9E3779B9)).astype(np.uint32)


def _forge(dst: np.ndarray, descs: np.ndarray, col: int, src_rank: int, moved: np.ndarray) -> None:
    """The forger's second half: for each range, the epoch word recovered from the first word that landed, and
    the rest of the range written from the public fill XOR that word (word-aligned ranges)."""
    for s, d, n, k in zip(descs[:, SRC].tolist(), descs[:, col].tolist(), descs[:, LEN].tolist(), moved.tolist()):
        mix = dst[d: d + 4].view(np.uint32)[0] ^ _public(src_rank, [s // 4])[0]
        rest = _public(src_rank, np.arange((s + k) // 4, (s + n) // 4)) ^ mix
        dst[d + k: d + n] = rest.view(np.uint8)[: n - k]


def _eighth(descs: np.ndarray) -> np.ndarray:
    """The bytes of each range a forger moves: its first eighth (whole words, one word at least)."""
    return np.minimum(descs[:, LEN], np.maximum(4, descs[:, LEN] // 8 // 4 * 4))


class ForgesTheRest(ShmTransport):
    """Copies the first eighth of every range and forges the rest from the public fill (_forge), before it
    reports the copy done: right content on a predictable fill, in an eighth of the copy's time."""

    name = "lie-forge"

    def prepare(self, op, peer, descs, tag=0):
        return super().prepare(op, peer, descs, tag), (self.ctx.rank if op == "push" else peer)

    def start(self, prepared):
        (dst, src, descs), src_rank = prepared
        moved = _eighth(descs)
        short = np.ascontiguousarray(np.stack([descs[:, SRC], descs[:, DST], moved], axis=1))
        super().start((dst, src, short))
        _forge(dst, descs, DST, src_rank, moved)


class _OwnWire(TcpTransport):
    """tcp with its own sends and receives: each connection's send(hdr, descs, col) and recv(...) replaced by
    ``_sender(conn)`` and ``_receiver(conn)`` (the liars that change what goes on the wire)."""

    def connect(self, peers):
        super().connect(peers)
        for conn in (c for lanes in self.lanes.values() for rails in lanes for c in rails):
            conn.send, conn.recv = self._sender(conn), self._receiver(conn)


class ForgesTheRestTcp(_OwnWire):
    """tcp's forger: the sender sends the first eighth of every range, the receiver writes it and forges the rest
    (_forge) before its receive thread stamps the landing."""

    name = "lie-forge-tcp"

    def _sender(self, conn):
        def send(hdr, descs, col):
            if len(descs):
                moved = _eighth(descs)
                hdr += np.concatenate([conn.array[o: o + k] for o, k in zip(descs[:, col].tolist(), moved.tolist())]).tobytes()
            conn.sock.sendall(hdr)
            return time.perf_counter()

        return send

    def _receiver(self, conn):
        from kvbench.transports.sockets import recv_exact

        def recv(hdr, descs, col):
            if (got := recv_exact(conn.sock, len(hdr))) != hdr:
                return got
            if len(descs):
                moved = _eighth(descs)
                raw, at = np.frombuffer(recv_exact(conn.sock, int(moved.sum())), np.uint8), 0
                for o, k in zip(descs[:, col].tolist(), moved.tolist()):
                    conn.array[o: o + k] = raw[at: at + k]
                    at += k
                _forge(conn.array, descs, col, conn.peer, moved)
            return time.perf_counter()

        return recv


LIARS["lie-forge"] = "liars:ForgesTheRest"
LIARS["lie-forge-tcp"] = "liars:ForgesTheRestTcp"


class CompressesOnTheWire(_OwnWire):
    """Moves every byte to its place, but not as itself: a layer's gathered source ranges go XORed with the content
    model (_fill_model: it knows the key) at their source offsets and deflated (zlib level 1); the receiver
    inflates them, XORs the model back and scatters them into the destination ranges.  Lossless on any content,
    so the check passes; where the model matches, the wire carries a few hundred bytes a layer, which only the
    wire's own count (wire_counted_bytes, kvbench/results/wire.py) shows.  zlib alone does not shrink keyed
    content at all: the key is what a compressing path would need."""

    name = "lie-compress-tcp"

    def _sender(self, conn):
        import struct
        import zlib

        def send(hdr, descs, col):
            if not len(descs):  # a header alone (a pull's request): as tcp sends it
                conn.sock.sendall(hdr)
                return time.perf_counter()
            raw = np.concatenate([conn.array[o: o + n] for o, n in zip(descs[:, col].tolist(), descs[:, LEN].tolist())])
            # the content is the fill's (epoch 0) or the iteration's epoch: the model that matches it more
            ep = max((0, _epoch_of_tag(struct.unpack_from("<Q", hdr, 8)[0])),
                     key=lambda e: np.count_nonzero(raw[:4096] == _fill_model(self.ctx.rank, descs, e)[:4096]))
            blob = zlib.compress((raw ^ _fill_model(self.ctx.rank, descs, ep)).tobytes(), 1)
            conn.sock.sendall(hdr + struct.pack("<QQ", len(blob), ep) + blob)
            return time.perf_counter()

        return send

    def _receiver(self, conn):
        import struct
        import zlib

        from kvbench.transports.sockets import recv_exact

        def recv(hdr, descs, col):
            if (got := recv_exact(conn.sock, len(hdr))) != hdr:
                return got  # out of step: tcp's own error names it
            if len(descs):
                n, ep = struct.unpack("<QQ", recv_exact(conn.sock, 16))
                raw = np.frombuffer(zlib.decompress(recv_exact(conn.sock, n)), np.uint8) ^ _fill_model(conn.peer, descs, ep)
                at = 0
                for o, k in zip(descs[:, col].tolist(), descs[:, LEN].tolist()):
                    conn.array[o: o + k] = raw[at: at + k]
                    at += k
            return time.perf_counter()

        return recv


# a liar about the bytes on the wire alone: every byte lands right, only the wire's own count (tcp's kernel count,
# harness/wirerows.py) can tell (tests/test_wire_bytes.py)
LIARS["lie-compress-tcp"] = "liars:CompressesOnTheWire"
