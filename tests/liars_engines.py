"""Early completion through an engine's own completion path (tests/liars.py's ``lie-early-<engine>``): the
engine tells the destination a push is complete a few microseconds before its bytes start to land.

One-sided engines with a completion notice of their own (Mooncake's notice, NIXL's notification, MPI's note
that the destination receives and ``Win.Sync``s on): the source holds the engine's transfer back.  At its wait
it first sends the engine's notice for it, then waits for the destination's word that its wait returned on that
notice, and only EARLY_S later submits the transfer and waits for the engine's real completion of it (whose
own notice is then left out).  So the destination's wait, the engine's own code, returns on a completion that
came before the bytes, and the harness's copy at that completion holds what had not landed.

Nothing is left owed past the iteration.  A wait deferred to the next call into the transport hangs the
run: the destination's deferred wait needs the notice the source sends in its own deferred wait, and the
source makes its next call only after a barrier or gather that the blocked destination never reaches.

UCX (ucxx) is two-sided: its completion is the receive request's.  The destination's wait polls until UCX
completes its receives into staging and reports done; the unpack into the pool starts EARLY_S later on a
thread, at RATE (joined at the next call into the transport): UCX's request completion taken for the
bytes' landing.  A pull, and a UCX receive without staging (one range per layer), pass honestly.
"""
from __future__ import annotations

import select
import socket
import threading
import time

from kvbench import _native
from kvbench.model.descriptors import DST, LEN
from kvbench.transports.base import TransportError
from kvbench.transports.sockets import accept_peers, dial, recv_exact, select_addr

EARLY_S = 5e-6  # how long after the destination took the completion the bytes start to move
RATE = 1e9  # UCX's late unpack: bytes per second it moves them at, as a link would deliver them
TOOK = b"\x01"  # the destination's word: its wait returned on the notice


def _spin(until: float) -> None:
    while time.perf_counter() < until:
        time.sleep(0)  # the GIL goes to the thread that took the completion meanwhile


class _Held:
    """A push the source has not given to the engine yet: its peer, tag and the engine's prepared post."""

    __slots__ = ("peer", "tag", "inner")

    def __init__(self, peer, tag, inner):
        self.peer, self.tag, self.inner = peer, tag, inner


class _Served:
    """The destination's handle of a push: the engine's, and whom to tell it returned."""

    __slots__ = ("peer", "inner")

    def __init__(self, peer, inner):
        self.peer, self.inner = peer, inner


class _NoticeFirst:
    """A mixin over a one-sided engine: its notice before its transfer.  The engine's hooks: ``notice`` (send
    its completion notice for a tag), ``submit`` (give it the prepared post, with no notice of its own; the
    engine's handle)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._words: dict[int, socket.socket] = {}
        self._word_ear = None

    # a connection per pair for the destination's word, its address beside the engine's own metadata
    def register(self, pool):
        meta = super().register(pool)
        host = select_addr(self.ctx.hostname, {})[0]
        self._word_ear = socket.create_server((host, 0), backlog=max(16, 2 * self.ctx.world_size))
        return b"%s %d\n" % (host.encode(), self._word_ear.getsockname()[1]) + meta

    def connect(self, peers):
        split = {p: m.split(b"\n", 1) for p, m in peers.items()}
        super().connect({p: m for p, (_, m) in split.items()})
        me, tok, deadline = self.ctx.rank, self.ctx.token, time.monotonic() + 60
        try:
            for p in sorted(p for p in split if p < me):
                host, port = split[p][0].split()
                self._words[p] = dial(host.decode(), int(port), p, me, tok, deadline, what="lie-early")
            for p, (s,) in accept_peers(self._word_ear, {p for p in split if p > me}, me, tok, deadline, 60,
                                        what="lie-early").items():
                self._words[p] = s
        finally:
            self._word_ear.close()
        for s in self._words.values():
            s.settimeout(60)  # a lost word is an error, never a hang
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def prepare(self, op, peer, descs, tag=0):
        inner = super().prepare(op, peer, descs, tag)
        return _Held(peer, tag, inner) if op == "push" else inner

    def start(self, prepared):
        return prepared if isinstance(prepared, _Held) else super().start(prepared)

    def post(self, op, peer, descs, tag=0):
        if op != "push":
            return super().post(op, peer, descs, tag)
        return self.start(self.prepare(op, peer, descs, tag))

    def serve(self, op, peer, descs, tag=0):
        h = super().serve(op, peer, descs, tag)
        return _Served(peer, h) if op == "push" and h is not None else h

    def wait(self, handle):
        if isinstance(handle, _Served):  # the engine's own completion path, then the word that it returned
            super().wait(handle.inner)
            self._words[handle.peer].sendall(TOOK)
            return None
        if not isinstance(handle, _Held):
            return super().wait(handle)
        self.notice(handle.peer, handle.tag)  # complete, says the engine: before one byte moved
        self._hear(handle.peer)
        _spin(time.perf_counter() + EARLY_S)
        super().wait(self.submit(handle.inner))  # the bytes move now; the engine completes them in this iteration
        return None

    def _hear(self, peer) -> None:
        """The destination's word, progressing the engine meanwhile (its notice may wait in a send queue)."""
        s, deadline = self._words[peer], time.monotonic() + 60
        try:
            while not select.select([s], [], [], 0 if self.progress() else 0.01)[0]:
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
            recv_exact(s, 1)
        except OSError as exc:
            raise TransportError(f"{self.name}: no word from rank {peer}: {exc}") from None

    def progress(self) -> bool:
        """Advance the engine once; whether it needs this (else the wait for the word sleeps)."""
        return False

    def close(self):
        for s in self._words.values():
            s.close()
        self._words.clear()
        super().close()


class MooncakeNoticeFirst(_NoticeFirst):
    def notice(self, peer, tag):
        from kvbench.transports import mooncake as M

        self._socks[peer].sendall(M._TAG.pack(tag & M._MASK))

    def submit(self, inner):
        from kvbench.transports.mooncake import MooncakeTransport

        h = MooncakeTransport.post(self, *inner)  # its prepare is the base's: (op, peer, descs, tag)
        h[1] = None  # its notice went first
        return h


class NixlNoticeFirst(_NoticeFirst):
    def __init__(self, ctx):
        # NIXL's progress thread: the destination's worker must advance the WRITE after its wait returned on the
        # early notification (its main thread then waits in the harness's barrier, never in the agent), as a
        # serving engine's does; without it the source's transfer never completes and the pair hangs
        ctx.options = {**ctx.options, "progress_thread": ctx.options.get("progress_thread", "on")}
        super().__init__(ctx)

    def progress(self):
        self._drain()  # the agent's worker advances when polled (its notifications: counted for their waits)
        return True

    def notice(self, peer, tag):
        self.agent.send_notif(self.peers[peer][0], b"kvb%d" % tag)

    def submit(self, inner):
        from kvbench.transports.nixl import NixlTransport

        op, peer, descs, msg = inner
        return NixlTransport.start(self, (op, peer, descs, b"late-" + msg))  # a notification nobody waits for


class MpiNoticeFirst(_NoticeFirst):
    def notice(self, peer, tag):
        self._notify(peer, [tag])

    def submit(self, inner):
        from kvbench.transports.mpi import MpiTransport

        h = MpiTransport.start(self, inner)
        tags = self._pending.get(inner[1], [])
        if inner[2] in tags:  # its note went first: the Flush notifies nothing more
            tags.remove(inner[2])
        return h


class UcxUnpacksLater:
    """A mixin over ucx: a packed push's receive reports done when UCX completes it into staging; the unpack
    into the pool starts EARLY_S later, on a thread, at RATE."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._unpacks: list[tuple[threading.Thread, object, list]] = []

    def _settle_unpacks(self) -> None:
        late, self._unpacks = self._unpacks, []
        for th, stage, err in late:
            th.join()
            self._release(stage)
            if err:
                raise TransportError(f"{self.name}: {err[0]}")

    def serve(self, op, peer, descs, tag=0):
        self._settle_unpacks()
        h = super().serve(op, peer, descs, tag)
        if op != "push" or getattr(h, "stage", None) is None:
            return h
        from kvbench.transports import ucx

        stage, hdr, want = h.stage, h.keep[0], ucx._header(tag, descs)
        rows = self._rows(descs, DST)[0]  # (staging offset, pool offset, length) per range
        h.stage = None  # released once the late unpack is joined

        def later(_h):
            err: list = []
            took = time.perf_counter()

            def unpack():
                try:
                    ucx._check(hdr, want, "push header")
                    _spin(took + EARLY_S)
                    t0, done = time.perf_counter(), 0
                    for i in range(0, len(rows), 16):  # in order, as a link delivers them
                        piece = rows[i:i + 16]
                        _native.copy_batch(self._pool.array, stage, piece)
                        done += int(piece[:, LEN].sum())
                        _spin(t0 + done / RATE)
                except Exception as exc:  # raised at the join
                    err.append(exc)

            th = threading.Thread(target=unpack, daemon=True)
            self._unpacks.append((th, stage, err))
            th.start()

        h.then = later
        return h

    def prepare(self, op, peer, descs, tag=0):
        self._settle_unpacks()
        return super().prepare(op, peer, descs, tag)

    def post(self, op, peer, descs, tag=0):
        self._settle_unpacks()
        return super().post(op, peer, descs, tag)

    def close(self):
        try:
            self._settle_unpacks()
        finally:
            super().close()
