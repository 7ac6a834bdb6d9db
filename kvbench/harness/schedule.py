"""One timed iteration of a case on one rank: handshake, prefill clock, posts, completion (model/schemes.py
says who pairs with whom and what each entry moves)."""
from __future__ import annotations

import time

import numpy as np

from kvbench.harness.prefill import PrefillClock
from kvbench.job.comm import TAG_CLOCK, TAG_GRANT, TAG_LAYER_READY, TAG_REQUEST, TAG_STATE
from kvbench.model.schemes import REQUEST_BYTES, STATE_BYTES, Entry, roles
from kvbench.transports.base import wait_landed


class Iteration:
    """One timed iteration of a case on this rank: handshake, prefill clock, posts, completion.

    Times are perf_counter offsets from ``t0`` (the end of the barrier that
    started the iteration).  ``done[k]`` is when entry k was complete on this
    rank; for a destination that is when its bytes were visible.
    """

    def __init__(self, t, comm, rank: int, entries: list[Entry], case: dict, local: bool):
        self.t, self.comm, self.rank, self.case, self.local = t, comm, rank, case, local
        self.op = case["op"]
        self.init, self.serve = roles(entries, rank, self.op, local)
        self.order = [e for e, _ in self.init] + [e for e, _ in self.serve]
        self.entries = entries
        self.notify = self.op == "push" and not t.caps.notifies and not local
        # pull: the layer-ready signal travels on the transport's channel and its thread issues the read
        self.signal = self.op == "pull" and t.caps.signals_ready and not local
        self.handshake = case.get("handshake", "off")
        self.state_msg = self.handshake != "off" and not local  # decode waits for the sampler state
        self.streaming = case.get("overlap", "serial") == "streaming"
        self.prefill_s = float(case.get("prefill_ms", 0.0)) / 1e3
        self.layers = len(entries[0].layers) if entries else 0
        self.sources = sorted({e.src for e in entries if e.dst == rank and e.src != rank})
        self.dests = sorted({e.dst for e in entries if e.src == rank and e.dst != rank})
        self.is_prefill = any(e.src == rank for e in entries)
        from kvbench.harness.prefill import make_clock  # prefill: real computes each layer's matmuls (prefill.py)

        self.real = case.get("prefill", "clock") == "real"
        self.clock = make_clock(case, self.layers, self.prefill_s, self.is_prefill or local)
        self.t0 = 0.0
        # the check pass's hooks (None while timing): a layer became final on the source; an entry's
        # completion is known on the destination
        self.on_final = self.on_landed = None
        # check pass, source: per (pair, request), when its last layer was posted (a pull: made final)
        self.bound_at: dict[tuple[int, int], float] = {}
        self.rule: dict[int, str] = {}  # per entry: who stamped its completion ("transport" or "harness")
        # the last iteration's time outside the wire on this rank (costs.py): seconds in the transport's
        # prepare/post/start/serve/signal calls (lib_s of them inside the library's data call), in the
        # harness's own notifications, and per entry in
        # `order` the gap from the transport's landing stamp to its wait's return (None: harness-stamped)
        self.cost: dict = {"post_s": 0.0, "lib_s": 0.0, "notify_s": 0.0, "wake_s": [], "lead_s": [], "window_s": []}
        # serial: every layer at once; streaming: one layer at a time.  Per entry and group, its layers'
        # descriptor arrays and tag offsets, built once: the same list every iteration lets a transport find
        # what it derived from it (the joined arrays of one post, datatypes) without a step per layer
        self.groups = [list(range(self.layers))] if not self.streaming else [[k] for k in range(self.layers)]
        # (an empty array posts nothing: a cross-layer request's whole pages lie in its last layer's array)
        self.lists = {id(e): [[e.layers[k] for k in ks if len(e.layers[k])] for ks in self.groups] for e in entries}
        self.offs = {id(e): [[(e.req << 12) | k for k in ks if len(e.layers[k])] for ks in self.groups]
                     for e in entries}
        # a request's layers as one post where the transport joins them (base.one_post)
        self.one = {id(e): t.one_post(self.lists[id(e)][0]) for e in entries}
        # --register per-request: the initiator registers each request's blocks inside the timed request, before
        # its first post, and deregisters them once its transfers completed (docs/methodology.md)
        self.per_req = case.get("register", "once") == "per-request"
        if self.per_req and self.signal:  # its reads are posted before the iteration starts
            raise ValueError("--register per-request with a transport that posts pulls on its own signals")

    def run(self, tag0: int, barrier=None):
        """Returns (done per entry, seconds inside the transport, handshake seconds, clock offset).

        With ``barrier`` (timed iterations), the iteration starts when it returns (``t0``), and what depends
        only on the block tables is done before it: both tables are known when a request is admitted, so an
        engine registers its receives and builds its transfer requests before the prefill's last layer is
        final (a serial post's prepare, every target's registrations; not with a handshake, whose grant
        arrives inside the iteration).  Only starting the transfer and completing it are timed."""
        t, op = self.t, self.op
        ahead = barrier is not None and self.handshake == "off" and t.ahead
        handles = ready = None
        if ahead:
            handles = self._register(tag0)
            if not self.streaming and not self.signal:
                ready = self._prepare(0, tag0)
        if barrier is not None:
            barrier()
        inside, note, wake, lead, window, lib0 = 0.0, 0.0, [], [], [], t.lib_s
        posted: dict[int, float] = {}  # per entry this rank posts inside the iteration: its first post
        returned: dict[int, float] = {}  # ... and when its last post call returned
        t0 = self.t0 = time.perf_counter()
        hs = self._handshake(t0) if self.handshake != "off" else 0.0
        self.clock.start(t0 + (hs if self.handshake == "serial" else 0.0))
        if handles is None:
            a = time.perf_counter()
            handles = self._register(tag0)
            inside += time.perf_counter() - a
        offs, one = self.offs, self.one
        regs, reg_s = {}, {}
        for e, peer in self.init if self.per_req else ():
            a = time.perf_counter()
            regs[id(e)] = t.register_request(op, peer, self.lists[id(e)])
            reg_s[id(e)] = time.perf_counter() - a
        inside += sum(reg_s.values())
        for g, ks in enumerate(self.groups):
            last = ks[-1] if len(ks) else -1
            # what can be done before the layers are final: the posts' checks and headers, the signals' tags
            a = time.perf_counter()
            if self.signal:
                # a request read as one gets one signal, its last layer's
                signals = [t.prepare_signal(peer, [tag0 | offs[id(e)][g][-1]] if one[id(e)] is not None else
                                            [tag0 | x for x in offs[id(e)][g]]) for e, peer in self.serve]
            elif ready is None or g:
                ready = self._prepare(g, tag0)
            inside += time.perf_counter() - a
            if self.is_prefill or self.local:  # the prefill side owns the clock
                self.clock.wait_layer(last)
                if self.on_final is not None:
                    self.on_final(ks)
                    now = time.perf_counter()  # check pass: no byte of these layers can land earlier
                    self.bound_at.update({(e.pair, e.req): now for e in self.entries if e.src == self.rank})
                if self.signal:  # tell each decode rank the layer(s) are final, in the order it posted them
                    a = time.perf_counter()
                    for s in signals:
                        t.start_signal(s)
                    inside += time.perf_counter() - a
                elif op == "pull" and not self.local:  # the harness's MPI message: not the transport's time
                    a = time.perf_counter()
                    for dst in self.dests:
                        self.comm.notify(dst, TAG_LAYER_READY)
                    note += time.perf_counter() - a
                    a = time.perf_counter()
                    for e, _ in self.serve:  # a two-sided source sends a layer once its destination asked
                        # (a request served as one handle is answered once)
                        for h in handles[id(e)][ks[0]:last + 1] if ks else ():
                            t.answer(h)
                    inside += time.perf_counter() - a
            if op == "pull" and not self.signal and not self.local:  # (bidir: a rank is source and destination)
                for src in self.sources:
                    self.comm.wait_notify(src, TAG_LAYER_READY)
            if self.signal:
                continue
            a = time.perf_counter()
            for e, prepared in ready:
                posted.setdefault(id(e), a)
                if self.on_final is not None and isinstance(prepared, list) and prepared:
                    # check pass: when the last layer was posted
                    handles[id(e)] += t.start_request(prepared[:-1])
                    self.bound_at[(e.pair, e.req)] = time.perf_counter()
                    prepared = prepared[-1:]
                elif self.on_final is not None:  # posted as one: no byte can land before this
                    self.bound_at[(e.pair, e.req)] = time.perf_counter()
                handles[id(e)] += t.start_request(prepared)
                returned[id(e)] = time.perf_counter()
            inside += time.perf_counter() - a
        post, lib = inside - sum(reg_s.values()), t.lib_s - lib0  # everything so far was posting: the waits follow
        done = []
        for e in self.order:
            a = time.perf_counter()
            landed, stamped = wait_landed(t, handles[id(e)])
            back = time.perf_counter()
            wake.append(back - landed if stamped else None)
            # what the wake-up bound holds (bounds.py): the stamp's lead over the wait's return, or over the return
            # of the destination's own post call where the stamp falls inside it (a transport that copies in its
            # post lands its last byte as the call ends, not halfway through it)
            mine = returned.get(id(e)) if e.dst == self.rank else None
            lead.append(max(back - max(landed, a), mine - landed if mine is not None else 0.0) if stamped else None)
            # a destination that posted: from its post to the landing, no barrier or notification in it (bounds.py)
            window.append(landed - posted[id(e)] if id(e) in posted and e.dst == self.rank else None)
            if self.notify:  # completion the harness adds for one-sided transports: waiting, not overhead
                if e.src == self.rank:
                    self.comm.notify(e.dst)
                    note += time.perf_counter() - back
                else:
                    self.comm.wait_notify(e.src)
            if self.notify:
                self.rule[id(e)] = "harness"
                landed = time.perf_counter()
            else:
                self.rule[id(e)] = "transport" if stamped else "harness"
            if self.on_landed is not None and e.dst == self.rank:  # before any further word from the source
                self.on_landed(e, landed)
            if self.state_msg:  # decode cannot start without the sampler state
                if e.src == self.rank:
                    self.comm.waitall([self.comm.isend_bytes(bytes(STATE_BYTES), e.dst, TAG_STATE)])
                else:
                    self.comm.recv_bytes(bytearray(STATE_BYTES), e.src, TAG_STATE)
            b = time.perf_counter()
            inside += b - a
            # done when the harness saw the bytes landed (its wait returned: a transport's own stamp is a diagnostic,
            # stamp_lead_s), or when the message that completes them arrived
            done.append((b if self.state_msg else back if stamped and not self.notify else landed) - t0)
        dereg_s = {}
        for e, _ in self.init if regs else ():  # after every landing: no request's time waits for another's
            a = time.perf_counter()
            t.deregister_request(regs.pop(id(e)))
            dereg_s[id(e)] = time.perf_counter() - a
        inside += sum(dereg_s.values())
        self.cost = {"post_s": post, "lib_s": lib, "notify_s": note, "wake_s": wake, "lead_s": lead, "window_s": window,
                     "register_s": [reg_s.get(id(e)) for e in self.order],
                     "deregister_s": [dereg_s.get(id(e)) for e in self.order]}
        return done, inside, hs, self.clock.t0 - t0

    def _register(self, tag0: int) -> dict[int, list]:
        """Every target's registrations, in the order the initiator will post (a stream transport, tcp, pairs a
        peer's posts and serves first-in first-out); with signals, so do pull's reads.  Per entry: handles."""
        t, op, offs, one = self.t, self.op, self.offs, self.one
        handles: dict[int, list] = {id(e): [] for e in self.order}
        for g in range(len(self.groups)):
            for e, peer in self.serve:
                if self.signal and one[id(e)] is None:  # the initiator reads layer by layer as each is signalled
                    handles[id(e)] += [t.serve(op, peer, d, tag0 | x) for d, x in zip(self.lists[id(e)][g], offs[id(e)][g])]
                else:  # as the initiator posts them (prepare_request)
                    handles[id(e)] += t.serve_request(op, peer, self.lists[id(e)][g],
                                                      [tag0 | x for x in offs[id(e)][g]])
            if self.signal:
                for e, peer in self.init:
                    if one[id(e)] is not None:  # one read of the whole request, on the last layer's signal
                        handles[id(e)].append(t.post_when_ready(peer, one[id(e)], tag0 | offs[id(e)][g][-1]))
                    else:
                        handles[id(e)] += [t.post_when_ready(peer, d, tag0 | x)
                                           for d, x in zip(self.lists[id(e)][g], offs[id(e)][g])]
        return handles

    def _prepare(self, g: int, tag0: int) -> list:
        """Group ``g``'s posts, prepared: a request's layers at once, which a transport may post in one native
        call (base.prepare_request)."""
        t, op, offs = self.t, self.op, self.offs
        return [(e, t.prepare_request(op, peer, self.lists[id(e)][g], [tag0 | x for x in offs[id(e)][g]]))
                for e, peer in self.init]

    def _handshake(self, t0: float) -> float:
        """Allocate-then-stream: prefill asks, decode answers with its block table; returns the round trip."""
        reqs = []
        for e in self.entries:
            if e.src == self.rank and not self.local:
                reqs.append(self.comm.isend_bytes(bytes(REQUEST_BYTES), e.dst, TAG_REQUEST))
        for e in self.entries:
            if e.dst == self.rank and not self.local:
                self.comm.recv_bytes(bytearray(REQUEST_BYTES), e.src, TAG_REQUEST)
                reqs.append(self.comm.isend_bytes(e.blocks_dst.astype(np.int32).tobytes(), e.src,
                                                  TAG_GRANT))
        for e in self.entries:
            if e.src == self.rank and not self.local:
                self.comm.recv_bytes(bytearray(4 * len(e.blocks_dst)), e.dst, TAG_GRANT)
        self.comm.waitall(reqs)
        return time.perf_counter() - t0

    def prefill_ends(self, offset: float) -> tuple[dict[int, float], dict[int, float]]:
        """After timing: per source of this rank, when its prefill ended on its own iteration clock, and how long
        it took (real prefill: measured there; the clock: prefill_ms, and the handshake's delay if serial)."""
        if not self.real:
            starts = self.exchange_clock(offset) if self.handshake == "serial" else {}
            return {s: v + self.prefill_s for s, v in starts.items()}, {}
        mine = not isinstance(self.clock, PrefillClock)  # this rank computed a real prefill
        ends = self.exchange_clock(self.clock.end - self.t0 if mine else 0.0)
        took = self.exchange_clock(self.clock.measured_s if mine else 0.0)
        if mine:  # this rank's own rows (as a source) carry its measured prefill too
            took[self.rank] = self.clock.measured_s
        return ends, took

    def exchange_clock(self, offset: float) -> dict[int, float]:
        """After timing: each decode rank learns its sources' prefill start offsets (untimed)."""
        reqs = [self.comm.isend_bytes(np.float64(offset).tobytes(), d, TAG_CLOCK) for d in self.dests]
        got = {}
        for s in self.sources:
            buf = bytearray(8)
            self.comm.recv_bytes(buf, s, TAG_CLOCK)
            got[s] = float(np.frombuffer(buf, np.float64)[0])
        self.comm.waitall(reqs)
        if self.local:
            got[self.rank] = offset
        return got
