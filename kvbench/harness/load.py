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
decode row's harness_seconds.
"""
from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque

import numpy as np

from kvbench import memory, transports
from kvbench.harness import clocks
from kvbench.harness.loop import Harness, UserError, case_geometry
from kvbench.harness.prefill import PrefillClock
from kvbench.harness.state import Session
from kvbench.job import faults
from kvbench.job.comm import TAG_D2P, TAG_FACTS, TAG_P2D
from kvbench.job.guard import GUARD
from kvbench.memory.verify import layer_is_right
from kvbench.model import shapes as M
from kvbench.model import workload as W
from kvbench.model.descriptors import DST, LEN, coalesce, request_descs
from kvbench.model.layout import BlockAllocator, Layout, block_array
from kvbench.model.schemes import REQUEST_BYTES, STATE_BYTES, SchemeError, make_pairs
from kvbench.transports.base import TransportError, wait_landed

SLOTS = 4  # source-side request slots: a prefill rank's pool holds this many of its largest request
POLL_S = 0.0  # idle loops yield the core but keep polling (as MPI waits do): wake-up latency is ms under load
NAN = float("nan")
DROPPED = "dropped: no decode blocks within alloc_timeout_ms"


class _Waiter(threading.Thread):
    """Waits on two-sided receives off the decode loop (the contract has no non-blocking test)."""

    def __init__(self, t, t0: float):
        super().__init__(daemon=True)
        self.t, self.t0, self.jobs, self.done = t, t0, queue.Queue(), queue.Queue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            rid, handles = job
            try:
                self.done.put((rid, wait_landed(self.t, handles)[0] - self.t0, None))
            except Exception as exc:  # re-raised in the event loop, which fails the rank
                self.done.put((rid, NAN, exc))


class LoadHarness(Harness):
    """Harness for suites with a ``workload:`` section: one row per (case, rank, request)."""

    def __init__(self, comm, opts, workload):
        super().__init__(comm, opts)
        self.wl = workload
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
    def run(self, cases: list[dict], scheme: str) -> None:
        try:
            W.parse_prompt(self.wl.prompt)
            self._pairs = make_pairs(scheme, self.comm.size)
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
            limit = cap * bs + hit if cap else None  # a prompt never needs more than the whole pool
            tok = np.maximum(W.prompts(w.prompt, w.requests, W.rng_for(self.opts.seed, "prompt", i), limit), hit + 1)
            ntok = tok - hit
            nb = -(-ntok // bs)
            plans[s] = {"arrival": W.arrivals(kind, rate, w.requests, W.rng_for(self.opts.seed, "arrival", i)),
                        "ntok": ntok, "nblocks": nb,
                        "prefill_s": float(case["prefill_ms"]) / 1e3 * self._work(g, ntok) / ref}
            for k, b in enumerate(nb.tolist()):
                d = dests[s][k % len(dests[s])]
                demand[d] = demand.get(d, 0) + b
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
        x = {"case": case, "g": g, "t": s.t, "cap": cap, "plans": plans, "srcs": srcs, "dests": dests,
             "lay": Layout.fit(case["layout"], sh.layers, sh.regions, g["block_bytes"], s.nbytes),
             "pool": s.pools[0].array, "elem": M.dtype_bytes(case["dtype"]), "n": self.wl.requests,
             "bpt": M.bytes_per_token(sh, case["dtype"]), "seed": self.opts.seed * 1_000_003 + self.case_no}
        self._watchdog(self.case_no, case)
        rows, info = [], {}
        try:
            self.comm.barrier()
            x["t0"] = t0 = time.perf_counter()  # the workload's clock: clk() = perf_counter() - t0
            x["clk"] = lambda: time.perf_counter() - t0
            clock = self._sync_clocks(x)
            self.comm.barrier()
            if self.rank in srcs:
                rows = self._prefill(x)
            elif any(self.rank in d for d in dests.values()):
                rows, info = self._decode(x, clock)
        finally:
            GUARD.disarm()
        self.deliver(rows)
        infos = self.comm.gather(dict(info, clock=clock) if info else None)
        if self.rank == 0:
            self._summary(case, cap, self._seen, [i for i in infos if i])

    def _sync_clocks(self, x) -> dict:
        """Decode side: {prefill rank: (this clock minus the prefill's, round trip of that sample)}."""
        mine = [s for s in x["srcs"] if self.rank in x["dests"][s]]
        return clocks.sync(self.comm, mine, x["dests"].get(self.rank, []), x["clk"])

    def _descs(self, x, src_ids, dst_ids, ntok) -> list[np.ndarray]:
        last = (ntok - (len(src_ids) - 1) * x["case"]["block_size"]) * x["g"]["shape"].row_elems * x["elem"]
        out = request_descs(x["lay"], x["lay"], src_ids, dst_ids, last)
        return [coalesce(d) for d in out] if x["case"]["coalesce"] == "on" else out

    def _row(self, x, role, k, pair, status, ntok, **kw) -> dict:
        ok, nb = status == "ok", -(-ntok // x["case"]["block_size"])
        wire = ntok * x["bpt"] + REQUEST_BYTES + 4 * nb + STATE_BYTES if ok else REQUEST_BYTES  # + control plane
        return dict(self.base_row(x["case"], x["g"]), rank=self.rank, role=role, pair=pair, req=0, iter=k,
                    status=status, reason="" if ok else DROPPED, seconds=NAN, harness_seconds=NAN, nwrong=None,
                    payload_bytes=ntok * x["bpt"], wire_bytes=wire, descriptors=0, prefill_s=NAN, handshake_s=NAN,
                    exposed_s=NAN, queue_s=NAN, arrival_s=NAN) | kw

    # ----- prefill rank --------------------------------------------------------------
    def _prefill(self, x) -> list[dict]:
        case, t, lay, clk, w = x["case"], x["t"], x["lay"], x["clk"], self.comm.world
        me, n, L, op = self.rank, x["n"], x["lay"].layers, case["op"]
        p, dests = x["plans"][me], x["dests"][me]
        rid0 = x["srcs"].index(me) * n
        streaming, hs_serial = case["overlap"] == "streaming", case["handshake"] == "serial"
        notify = op == "push" and not t.caps.notifies
        nb, ntok = p["nblocks"], p["ntok"]
        P = np.broadcast_to(p["prefill_s"], (n,)).astype(float)
        cum = PrefillClock(1.0, L).cum
        slots_alloc = BlockAllocator(lay.nblocks, seed=x["seed"] * 7919 + me * 2)
        slots = [slots_alloc.allocate(int(nb.max()), case["alloc"]) for _ in range(SLOTS)]
        if any(sl is None for sl in slots):
            raise TransportError("source pool too small for the workload's requests")
        start = clk()
        arr = start + p["arrival"]
        sent, grant, pstart, done, q = (np.full(n, NAN) for _ in range(5))
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
                        status[k], resolved = "dropped", resolved + 1
                    else:
                        descs[k] = self._descs(x, slots[k % SLOTS][: nb[k]], ids, int(ntok[k]))
                        heapq.heappush(granted, k)
            if granted:  # one request streams at a time, oldest first
                k = granted[0]
                d = dests[k % len(dests)]
                el = clk() - pstart[k]
                upto = int(np.searchsorted(P[k] * cum, el, side="right")) if streaming else (L if el >= P[k] else 0)
                if upto > posted[k]:
                    idle = False
                    if faults.armed("post", self.rank, self.case_no):
                        raise TransportError("injected fault (KVBENCH_FAULT)")
                    fn = t.post if op == "push" else t.serve
                    handles[k] += [fn(op, d, descs[k][i], (((rid0 + k) & 0xFFFF) << 16) | i)
                                   for i in range(posted[k], upto)]
                    posted[k] = upto
                    if op == "pull":  # the decode rank reads what is final
                        sends.append(w.isend(("layer", rid0 + k, upto), dest=d, tag=TAG_P2D))
                if posted[k] == L:
                    for h in handles[k]:
                        t.wait(h)
                    done[k] = clk()
                    if notify:
                        sends.append(w.isend(("done", rid0 + k), dest=d, tag=TAG_P2D))
                    resolved += 1
                    heapq.heappop(granted)
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
                          descriptors=sum(len(a) for a in descs[k]) if descs[k] else 0, arrival_s=arr[k] - start)
                for k in range(n)]

    # ----- decode rank ---------------------------------------------------------------
    def _decode(self, x, clock) -> tuple[list[dict], dict]:
        case, t, lay, clk, w, cap, pool = x["case"], x["t"], x["lay"], x["clk"], self.comm.world, x["cap"], x["pool"]
        me, n, L, check = self.rank, x["n"], x["lay"].layers, self.opts.check
        srcs = [s for s in x["srcs"] if me in x["dests"][s]]
        expect = sum(1 for s in srcs for k in range(n) if x["dests"][s][k % len(x["dests"][s])] == me)
        alloc = BlockAllocator(cap, seed=x["seed"] * 7919 + me * 2 + 1)
        blocks = block_array(pool, lay)
        wide = np.uint64 if lay.block_bytes % 8 == 0 else np.uint8  # poison checks 8 bytes at a time
        words = block_array(pool, lay, wide)
        poison8 = wide(int.from_bytes(bytes([memory.POISON]) * np.dtype(wide).itemsize, "little"))
        bs, row = case["block_size"], x["g"]["shape"].row_elems * x["elem"]
        if check:
            blocks[:, :, :cap] = memory.POISON
        fifo, holds, live, rec, sends, tasks = deque(), [], {}, {}, [], deque()
        occ, resolved, corrupt, busy = [(clk(), 0)], 0, self.opts.inject_corruption, [0.0]
        timeout_s, hold_s = self.wl.alloc_timeout_ms / 1e3, self.wl.decode_ms / 1e3
        waiter = _Waiter(t, x["t0"]) if case["op"] == "push" and t.caps.notifies else None
        if waiter:
            waiter.start()

        def verify(rid, r):  # one layer per step, between events
            last, r["nwrong"] = (r["ntok"] - (len(r["ids"]) - 1) * bs) * row, 0
            for i in range(L):  # the vectorized check reads 4-byte words; anything else takes the reference
                if (last | lay.block_bytes) % 4 or not layer_is_right(pool, lay, i, r["src_ids"], r["ids"], last, r["src"]):
                    r["nwrong"] += memory.count_wrong(pool, r["descs"][i], r["src"], x["elem"])
                yield

        def release(rid, r):
            for i in range(L):
                blocks[i][:, r["ids"]] = memory.POISON
                yield
            free(rid)

        def free(rid):
            r = rec[rid] = live.pop(rid)
            alloc.release(r["ids"])
            occ.append((clk(), cap - alloc.nfree))
            r.update(status="ok", ndesc=sum(len(d) for d in r.pop("descs")))

        def landed(rid, when):
            nonlocal resolved, corrupt
            r, resolved = live[rid], resolved + 1
            r["landed"] = when
            heapq.heappush(holds, (when + hold_s, rid))
            if check:
                if corrupt:  # fault injection: proves the check catches it
                    d0 = r["descs"][0][0]
                    pool[d0[DST]: d0[DST] + min(corrupt, int(d0[LEN]))] ^= 0xFF
                    corrupt = 0
                tasks.append(verify(rid, r))

        try:
            while resolved < expect or live:
                idle = True
                for s in srcs:
                    while w.iprobe(source=s, tag=TAG_P2D):
                        msg, idle = w.recv(source=s, tag=TAG_P2D), False
                        if msg[0] == "req":
                            fifo.append((s, msg[1], msg[2], msg[3], clk()))
                        elif msg[0] == "done":
                            landed(msg[1], clk())
                        else:  # pull: read the layers prefill says are final
                            r = live[msg[1]]
                            r["h"] += [t.post("pull", s, r["descs"][i], ((msg[1] & 0xFFFF) << 16) | i)
                                       for i in range(len(r["h"]), msg[2])]
                            if msg[2] == L:
                                landed(msg[1], wait_landed(t, r["h"])[0] - x["t0"])
                while fifo:  # strict FIFO: the head blocks those behind it (no overtaking)
                    s, rid, ntok, src_ids, t_in = fifo[0]
                    ids = alloc.allocate(len(src_ids), case["alloc"])
                    if ids is None:
                        break
                    fifo.popleft()
                    a = clk()
                    bad = int((words[:, :, ids] != poison8).any(axis=(0, 1, 3)).sum()) if check else 0
                    r = live[rid] = {"src": s, "src_ids": src_ids, "ids": ids, "h": [], "queue": a - t_in, "bad": bad,
                                     "ntok": ntok, "descs": self._descs(x, src_ids, ids, ntok), "check_s": clk() - a}
                    if waiter:  # two-sided: receives are in place before the grant goes out
                        r["h"] = [t.serve("push", s, d, ((rid & 0xFFFF) << 16) | i) for i, d in enumerate(r["descs"])]
                        waiter.jobs.put((rid, r["h"]))
                    sends.append(w.isend(("grant", rid, ids, r["queue"]), dest=s, tag=TAG_D2P))
                    occ.append((a, cap - alloc.nfree))
                    idle = False
                while fifo and clk() - fifo[0][4] >= timeout_s:
                    s, rid, ntok, _, t_in = fifo.popleft()
                    rec[rid] = {"src": s, "status": "dropped", "queue": clk() - t_in, "ntok": ntok}
                    sends.append(w.isend(("drop", rid, None, rec[rid]["queue"]), dest=s, tag=TAG_D2P))
                    resolved, idle = resolved + 1, False
                while waiter and not waiter.done.empty():
                    rid, when, exc = waiter.done.get()
                    if exc:
                        raise exc
                    landed(rid, when)
                while holds and holds[0][0] <= clk():
                    rid = heapq.heappop(holds)[1]
                    if check:  # reusable only once poisoned again, after its check (same queue)
                        tasks.append(release(rid, live[rid]))
                    else:
                        free(rid)
                if tasks:
                    a = time.perf_counter()
                    if next(tasks[0], StopIteration) is StopIteration:
                        tasks.popleft()
                    busy[0] += time.perf_counter() - a
                elif idle:
                    time.sleep(POLL_S)
        finally:
            if waiter:
                waiter.jobs.put(None)
        for r in sends:
            r.wait()
        final_bad = int((words[:, :, :cap] != poison8).any(axis=(0, 1, 3)).sum()) if check else 0
        facts = {}
        for s in srcs:
            facts.update(w.recv(source=s, tag=TAG_FACTS))
        rows = []
        for rid, r in sorted(rec.items()):
            k, arr_s, arr, pend, P = facts[rid]
            land = r.get("landed", NAN) - clock[r["src"]][0]  # on the prefill rank's clock
            ok = r["status"] == "ok"
            rows.append(self._row(x, "decode", k, self._pairs.index((r["src"], me)), r["status"], r["ntok"],
                                  seconds=land - arr, descriptors=r.get("ndesc", 0), prefill_s=P, queue_s=r["queue"],
                                  exposed_s=land - pend, arrival_s=arr_s, harness_seconds=r.get("check_s", NAN),
                                  nwrong=r.get("nwrong") if ok and check else None))
            if r.get("bad"):
                rows[-1]["reason"] = f"{r['bad']} granted blocks were written while free"
        viol = sum(r.get("bad", 0) for r in rec.values()) + final_bad
        return rows, {"rank": me, "cap_blocks": cap, "occupancy": [(round(a, 6), u) for a, u in occ],
                      "violations": viol if check else None, "check_s": round(busy[0], 4)}

    # ----- summary (rank 0) ----------------------------------------------------------
    def _summary(self, case, cap, rows, infos) -> None:
        st = W.summarize(rows, infos)
        self.violations += st["violations"]  # a write into a block nobody granted fails the run like a wrong byte
        if not self.extra_meta["load"]:
            print(W.SUMMARY_HEADER, flush=True)
        print(W.summary_line(self.case_no, case, cap, st, self.opts.check), flush=True)
        self.extra_meta["load"][self.case_no] = {"arrival": case["arrival"], "cap_blocks": cap, **st, "per_rank": infos}
