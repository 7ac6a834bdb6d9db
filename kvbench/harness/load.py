"""Workloads: many requests through a bounded decode pool, allocate-then-stream, back-pressure.

Each prefill rank runs ``requests`` requests arriving per ``arrival``, one
prefill at a time: request k starts at max(arrival, previous prefill's end)
and takes the prefill clock's P (scaled by its prompt's prefill FLOPs).  At
prefill start it asks its decode rank for blocks; the handshake overlaps the
prefill (with ``handshake: serial`` the prefill waits for the grant).  The
decode rank reserves blocks from a real bounded allocator, strictly FIFO: a
request that does not fit waits (back-pressure) up to ``alloc_timeout_ms``,
then is dropped.  Only granted requests stream, only into granted blocks;
a request holds them ``decode_ms`` after its KV landed.

Clocks: every rank takes ``t0`` at the end of one barrier; each (prefill,
decode) pair then estimates the offset between their clocks NTP-style (8
ping-pongs, the sample with the smallest round trip; error <= rtt/2, in the
sidecar).  Intervals are measured on one rank where they can be (queue_s on
decode, handshake_s on prefill); only exposed_s and the decode row's seconds
cross ranks, through that offset.

Checking stays off the critical path: the byte check of every admitted
request and the re-poisoning of freed blocks run one layer at a time between
events of the decode rank's loop, during the ``decode_ms`` hold (a freed
block is reusable only once poisoned again, so a slow check shows up as
occupancy, never as a hidden gap).  The one inline check, that granted
blocks still hold poison, runs before the grant is sent; its cost is the
decode row's harness_seconds.  Under ``-c all`` each request's source layers take
its own epoch when final, and the decode rank copies its ranges aside the moment
its completion is reported and checks that copy (docs/methodology.md, Workloads).

This file holds the harness (sizing, one case, the prefill rank's loop, rows
and the summary); the decode rank's loop is load_decode.py, and the case both
loops read is loadcase.py.
"""
from __future__ import annotations

import heapq
import time
from functools import partial

import numpy as np

from kvbench import memory, transports
from kvbench.harness import clocks
from kvbench.harness.load_decode import decode_rank
from kvbench.harness.loadcase import NAN, POLL_S, SLOTS, LoadCase
from kvbench.harness.loop import Harness, case_geometry
from kvbench.harness.prefill import PrefillClock
from kvbench.harness.state import Session, UserError
from kvbench.job import faults
from kvbench.job.comm import TAG_D2P, TAG_FACTS, TAG_P2D
from kvbench.job.guard import GUARD
from kvbench.memory import verify
from kvbench.model import shapes as M
from kvbench.model import traceplan as TP
from kvbench.model import workload as W
from kvbench.model.descriptors import SRC
from kvbench.model.layout import Layout
from kvbench.model.schemes import REQUEST_BYTES, STATE_BYTES, SchemeError, make_pairs
from kvbench.transports.base import TransportError

DROPPED = "dropped: no decode blocks within alloc_timeout_ms"


class LoadHarness(Harness):
    """Harness for suites with a ``workload:`` section: one row per (case, rank, request)."""

    def __init__(self, comm, opts, workload, trace=None):
        super().__init__(comm, opts)
        self.wl = workload
        self.trace = trace  # a TracePlan (model/traceplan.py): its requests replace the drawn arrivals and prompts
        self.extra_meta: dict = {"load": {}}  # for the sidecar: occupancy timelines, clock sync, check time
        self.violations = 0  # rank 0: writes into blocks nobody granted (they fail the run like wrong elements)
        self._seen: list[dict] = []
        self._pairs: list = []

    def set_sink(self, sink) -> None:
        def keep(rows):
            self._seen = rows
            sink(rows)
        self.sink = keep

    # ----- sizing --------------------------------------------------------------------
    def preflight(self, cases: list[dict], scheme: str) -> None:
        try:  # the pools are sized from the requests of each prefill rank: the ranks must be known here already
            self._pairs = make_pairs(scheme, self.comm.size, self.opts.matrix)
        except SchemeError:
            pass  # the base class says it, in its words
        super().preflight(cases, scheme)

    def run(self, cases: list[dict], scheme: str) -> None:
        try:
            W.parse_prompt(self.wl.prompt)
            self._pairs = make_pairs(scheme, self.comm.size, self.opts.matrix)
        except (ValueError, SchemeError) as exc:
            raise UserError(str(exc)) from None
        super().run(cases, scheme)

    def run_transport(self, name: str, cases: list[dict], pairs) -> None:
        if transports.probe(name) is None and transports.load(name).caps.local_only:
            for c in cases:
                self.emit_skipped(c, f"unavailable: a workload needs separate prefill and decode ranks ({name} "
                                     "is one process)")
            return
        super().run_transport(name, cases, pairs)

    def routes(self) -> tuple[list[int], dict[int, list[int]]]:
        """Prefill ranks, and each one's decode ranks (its requests go round-robin over them)."""
        srcs = sorted({s for s, _ in self._pairs})
        return srcs, {s: [d for s2, d in self._pairs if s2 == s] for s in srcs}

    def workload(self, case: dict, g: dict) -> tuple[dict, int]:
        """Per prefill rank: arrivals (s), prompt and transferred tokens, blocks, prefill s; decode capacity."""
        bs, hit, w = case["block_size"], case["prefix_hit"], self.wl
        cap = w.decode_pool_tokens // bs
        if w.decode_pool_tokens and cap < 1:
            raise UserError(f"workload decode_pool_tokens {w.decode_pool_tokens} is less than one block ({bs} tokens)")
        kind, rate = W.parse_arrival(case["arrival"])
        srcs, dests = self.routes()
        ref = self._work(g, M.transferred_tokens(case["tokens"], hit))
        plans, demand = {}, {}
        for i, s in enumerate(srcs):
            if self.trace is not None:  # arrivals, prompts and hits from the trace, clipped as the preamble says
                got = TP.deal(self.trace, i, len(srcs), w.requests, g["shape"].context, cap * bs)
                arrival, ntok = got.arrival_s / rate, got.ntok
            else:
                limit = cap * bs + hit if cap else None  # a prompt never needs more than the whole pool
                tok = np.maximum(W.prompts(w.prompt, w.requests, W.rng_for(self.opts.seed, "prompt", i), limit), hit + 1)
                arrival, ntok, got = W.arrivals(kind, rate, w.requests, W.rng_for(self.opts.seed, "arrival", i)), tok - hit, None
            nb = -(-ntok // bs)
            plans[s] = {"arrival": arrival, "ntok": ntok, "nblocks": nb, "trace": got,
                        "prefill_s": float(case["prefill_ms"]) / 1e3 * self._work(g, ntok) / ref}
            for k, b in enumerate(nb.tolist()):
                d = dests[s][k % len(dests[s])]
                demand[d] = demand.get(d, 0) + b
        if self.trace is not None and not cap:  # a trace's summed demand is no pool: the prefill side's size
            cap = SLOTS * max((int(p["nblocks"].max()) for p in plans.values()), default=1)
        return plans, cap or max(demand.values(), default=1)  # 0: room for every request

    @staticmethod
    def _work(g: dict, ntok):
        """Prefill work of ``ntok`` tokens: FLOPs when the model has a parameter count, else tokens."""
        try:
            return M.prefill_flops(g["shape"], ntok)
        except ValueError:
            return np.asarray(ntok, dtype=float)

    def pool_size(self, cases: list[dict], entries: int) -> int:
        """Decode: the capacity; prefill: SLOTS x its largest request (one size serves both roles)."""
        need = 0
        for c in cases:
            g = case_geometry(c)
            plans, cap = self.workload(c, g)
            most = max((int(p["nblocks"].max()) for p in plans.values()), default=1)
            per = g["shape"].layers * g["shape"].regions * g["block_bytes"]
            need = max(need, per * max(cap, SLOTS * most))
        return -(-need // memory.PAGE) * memory.PAGE

    # ----- one case ------------------------------------------------------------------
    def run_case(self, case: dict, s: Session) -> None:
        self.measure(dict(case, variant="paged"), s)  # no bulk ceiling: a workload is not a bandwidth sweep

    def measure(self, case: dict, s: Session) -> None:
        self.case_no += 1
        g = case_geometry(case)
        plans, cap = self.workload(case, g)
        sh = g["shape"]
        srcs, dests = self.routes()
        x = LoadCase(case=case, g=g, t=s.t, cap=cap, plans=plans, srcs=srcs, dests=dests,
                     lay=Layout.fit(case["layout"], sh.layers, sh.regions, g["block_bytes"], s.nbytes),
                     pool=s.pools[0].array, elem=M.dtype_bytes(case["dtype"]), n=self.wl.requests,
                     bpt=M.bytes_per_token(sh, case["dtype"]), seed=self.opts.seed * 1_000_003 + self.case_no,
                     no=self.case_no)
        if self.trace is not None:  # aged:<N> ages the decode pool with the trace's requests at the replay's speed
            x.aged_by = TP.ageing(self.trace, W.parse_arrival(case["arrival"])[1], sh.context)
        self._watchdog(self.case_no, case)
        rows, info = [], {}
        if self.opts.check == "all":  # what each request's slot holds, computed before any clock runs
            x.prime([r for r in srcs if r == self.rank or self.rank in dests[r]])
        if any(self.rank in d for d in dests.values()) and self.rank not in srcs:
            x.dalloc = x.decode_allocator(self.rank)  # aged:<N> ages its free list here, before any clock runs
        try:
            self.comm.barrier()
            x.t0 = t0 = time.perf_counter()  # the workload's clock: clk() = perf_counter() - t0
            x.clk = lambda: time.perf_counter() - t0
            clock = self._sync_clocks(x)
            self.comm.barrier()
            faults.hit("kill", self.rank, self.case_no)  # a node dying as the replay starts (inert unless set)
            if self.rank in srcs:
                rows = self._prefill(x)
            elif any(self.rank in d for d in dests.values()):
                rows, info = self._decode(x, clock)
                self.check_s += info.get("check_s") or 0.0  # verifying between events: the footer's check cost
        finally:
            GUARD.disarm()
        self.deliver(rows)
        infos = self.comm.gather(dict(info, clock=clock) if info else None)
        if self.rank == 0:
            self._summary(case, cap, self._seen, [i for i in infos if i], plans)

    def _sync_clocks(self, x: LoadCase) -> dict:
        """Decode side: {prefill rank: (this clock minus the prefill's, round trip of that sample)}."""
        mine = [s for s in x.srcs if self.rank in x.dests[s]]
        return clocks.sync(self.comm, mine, x.dests.get(self.rank, []), x.clk)

    def _row(self, x: LoadCase, role, k, pair, status, ntok, **kw) -> dict:
        ok, nb = status == "ok", -(-ntok // x.case["block_size"])
        wire = ntok * x.bpt + REQUEST_BYTES + 4 * nb + STATE_BYTES if ok else REQUEST_BYTES  # + control plane
        return dict(self.base_row(x.case, x.g), rank=self.rank, role=role, pair=pair, req=0, iter=k,
                    status=status, reason="" if ok else DROPPED, seconds=NAN, harness_seconds=NAN, nwrong=None,
                    payload_bytes=ntok * x.bpt, wire_bytes=wire, descriptors=0, prefill_s=NAN, handshake_s=NAN,
                    exposed_s=NAN, queue_s=NAN, arrival_s=NAN) | kw

    # ----- prefill rank --------------------------------------------------------------
    def _prefill(self, x: LoadCase) -> list[dict]:
        case, t, clk, w = x.case, x.t, x.clk, self.comm.world
        me, n, L, op = self.rank, x.n, x.lay.layers, case["op"]
        p, dests = x.plans[me], x.dests[me]
        rid0 = x.srcs.index(me) * n
        streaming, hs_serial = case["overlap"] == "streaming", case["handshake"] == "serial"
        every = self.opts.check == "all"  # each request's layers take its own epoch when final
        notify = op == "push" and not t.caps.notifies
        nb, ntok = p["nblocks"], p["ntok"]
        P = np.broadcast_to(p["prefill_s"], (n,)).astype(float)
        cum = PrefillClock(1.0, L).cum
        slots = x.slots(me)
        if any(sl is None for sl in slots):
            raise TransportError("source pool too small for the workload's requests")
        start = clk()
        arr = start + p["arrival"]
        sent, grant, pstart, done, q = (np.full(n, NAN) for _ in range(5))
        fin, made, wrote = np.zeros(n, bool), np.zeros(n, int), np.zeros(n)  # resolved; -c all: layers holding
        # its epoch, seconds writing them on its path

        mine = {}

        def make(k, upto):  # -c all: request k's layers up to ``upto`` take its epoch (its slot is free)
            if upto > made[k]:
                if k not in mine:
                    ids = slots[k % SLOTS][: nb[k]]
                    mine[k] = x.pats[me].layers(ids, x.last(len(ids), int(ntok[k])), x.epoch(rid0 + k))
                verify.scatter(x.pool, mine[k][made[k]: upto].ravel(), np.concatenate(descs[k][made[k]: upto]), SRC)
                made[k] = upto
                if upto == L:
                    del mine[k]

        status, descs, handles, posted = ["ok"] * n, [None] * n, [[] for _ in range(n)], [0] * n
        sends, granted, resolved, k_next, waiting, free_at = [], [], 0, 0, None, start
        while resolved < n:
            now, idle = clk(), True
            if k_next < n and waiting is None and now >= max(arr[k_next], free_at):
                k = k_next  # prefill k starts now: ask for decode blocks
                sends.append(w.isend(("req", rid0 + k, int(ntok[k]), slots[k % SLOTS][: nb[k]]),
                                     dest=dests[k % len(dests)], tag=TAG_P2D))
                sent[k], idle = now, False
                if hs_serial:
                    waiting = k
                else:
                    pstart[k] = max(arr[k], free_at)
                    free_at, k_next = pstart[k] + P[k], k + 1
            for d in dests:
                while w.iprobe(source=d, tag=TAG_D2P):
                    _, rid, ids, qs = w.recv(source=d, tag=TAG_D2P)
                    k, now, idle = rid - rid0, clk(), False
                    grant[k], q[k] = now, qs
                    if waiting == k:  # serial handshake: the prefill starts once decode answered
                        waiting, k_next = None, k + 1
                        pstart[k] = now if ids is not None else NAN
                        free_at = now + (P[k] if ids is not None else 0.0)
                    if ids is None:
                        status[k], resolved, fin[k] = "dropped", resolved + 1, True
                    else:
                        descs[k] = x.descs(slots[k % SLOTS][: nb[k]], ids, int(ntok[k]))
                        heapq.heappush(granted, k)
            # one request streams at a time, oldest first; under -c all not while its source slot still holds an
            # earlier request's bytes (that one is not granted yet: its epoch must not overwrite them)
            ready = granted and not (every and granted[0] >= SLOTS and not fin[granted[0] - SLOTS])
            if ready:
                k = granted[0]
                d = dests[k % len(dests)]
                el = clk() - pstart[k]
                upto = int(np.searchsorted(P[k] * cum, el, side="right")) if streaming else (L if el >= P[k] else 0)
                if upto > posted[k]:
                    idle = False
                    if faults.armed("post", self.rank, self.case_no):
                        raise TransportError("injected fault (KVBENCH_FAULT)")
                    if every:  # final now: what idle steps did not write ahead is written on the request's path
                        a = time.perf_counter()
                        make(k, upto)
                        wrote[k] += time.perf_counter() - a
                    fn = t.post if op == "push" else t.serve
                    handles[k] += [fn(op, d, descs[k][i], (((rid0 + k) & 0xFFFF) << 16) | i)
                                   for i in range(posted[k], upto)]
                    posted[k] = upto
                    if op == "pull":  # the decode rank reads what is final
                        sends.append(w.isend(("layer", rid0 + k, upto), dest=d, tag=TAG_P2D))
                if posted[k] == L:
                    for h in handles[k]:
                        t.wait(h)
                    done[k], fin[k] = clk(), True
                    if notify:
                        sends.append(w.isend(("done", rid0 + k), dest=d, tag=TAG_P2D))
                    resolved += 1
                    heapq.heappop(granted)
            if idle and every and ready and op == "push" and made[granted[0]] < L:
                make(granted[0], made[granted[0]] + 1)  # ahead, one layer a step (a pull's read must find a
                idle = False  # layer's epoch only once final: it writes none ahead)
            if idle:
                time.sleep(POLL_S)
        for r in sends:
            r.wait()
        pend = pstart + P
        facts = {rid0 + k: (k, arr[k] - start, arr[k], pend[k], P[k]) for k in range(n)}
        for d in dests:
            w.send({r: f for r, f in facts.items() if dests[f[0] % len(dests)] == d}, dest=d, tag=TAG_FACTS)
        return [self._row(x, "prefill", k, self._pairs.index((me, dests[k % len(dests)])), status[k], int(ntok[k]),
                          seconds=done[k] - arr[k], prefill_s=P[k], handshake_s=grant[k] - sent[k], queue_s=q[k],
                          descriptors=sum(len(a) for a in descs[k]) if descs[k] else 0, arrival_s=arr[k] - start,
                          harness_seconds=wrote[k] if every else NAN)
                for k in range(n)]

    # ----- decode rank ---------------------------------------------------------------
    def _decode(self, x: LoadCase, clock) -> tuple[list[dict], dict]:
        return decode_rank(x, clock, self.comm.world, self.rank, self._pairs, self.opts.check,
                           self.opts.inject_corruption, self.wl.alloc_timeout_ms / 1e3, self.wl.decode_ms / 1e3,
                           partial(self._row, x))

    # ----- summary (rank 0) ----------------------------------------------------------
    def _summary(self, case, cap, rows, infos, plans) -> None:
        st = W.summarize(rows, infos)
        self.violations += st["violations"]  # a write into a block nobody granted fails the run like a wrong byte
        if not self.extra_meta["load"]:
            print(W.SUMMARY_HEADER, flush=True)
        print(W.summary_line(self.case_no, case, cap, st, self.opts.check), flush=True)
        facts = {"arrival": case["arrival"], "cap_blocks": cap, **st, "per_rank": infos}
        if self.trace is not None:
            line, facts["trace"] = TP.summary_line(self.case_no, self.trace, W.parse_arrival(case["arrival"])[1],
                                                   [p["trace"] for p in plans.values()])
            print(line, flush=True)
        self.extra_meta["load"][self.case_no] = facts
