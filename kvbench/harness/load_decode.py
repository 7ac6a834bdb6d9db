"""A workload's decode rank: its bounded pool granted strictly FIFO, the receives, the checks between events.

The event loop of one case on a decode rank (LoadHarness.measure, load.py):
requests from the prefill ranks queue for blocks from a real bounded
allocator; the head of the queue blocks those behind it and is dropped after
``alloc_timeout_ms``; a granted request's KV lands in its blocks and is held
``decode_ms``.  The byte check of every admitted request and the re-poisoning
of freed blocks run one layer per step between events (load.py's docstring
says why).
"""
from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvbench import _native, memory
from kvbench.harness.loadcase import NAN, POLL_S, LoadCase
from kvbench.job.comm import TAG_D2P, TAG_FACTS, TAG_P2D
from kvbench.memory import verify
from kvbench.memory.verify import layer_is_right
from kvbench.model.descriptors import DST, LEN
from kvbench.model.layout import block_array
from kvbench.transports.base import wait_landed


class _Waiter(threading.Thread):
    """Waits on two-sided receives off the decode loop (the contract has no non-blocking test); under ``-c all``
    copies the request's ranges aside the moment its wait returns (``snap``)."""

    def __init__(self, t, t0: float, snap=None):
        super().__init__(daemon=True)
        self.t, self.t0, self.snap, self.jobs, self.done = t, t0, snap, queue.Queue(), queue.Queue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            rid, handles, descs = job
            try:
                wait_landed(self.t, handles)  # the landing is the harness's time, not a stamp the transport returns
                when = time.perf_counter() - self.t0
                self.done.put((rid, when, self.snap(descs) if self.snap else None, None))
            except Exception as exc:  # re-raised in the event loop, which fails the rank
                self.done.put((rid, NAN, None, exc))


def unpoisoned(pool: np.ndarray, blocks: np.ndarray, lay, ids) -> int:
    """How many of blocks ``ids`` hold a byte other than poison in some layer or region (``blocks``: the pool's
    block_array view).  The grant's check, on the timed path: scanned in place, no gathered copy."""
    s0, s1, s2 = blocks.strides[:3]
    offs = (np.asarray(ids, np.int64)[:, None, None] * s2 + np.arange(lay.layers, dtype=np.int64)[None, :, None] * s0
            + np.arange(lay.regions, dtype=np.int64)[None, None, :] * s1).ravel()
    d = np.zeros((len(offs), 3), np.int64)
    d[:, DST], d[:, LEN] = offs, lay.block_bytes
    flags = np.zeros(len(offs), np.uint8)
    _native.unlike(pool, d, DST, memory.POISON, flags)
    return int(flags.reshape(len(ids), -1).any(axis=1).sum())


def decode_rank(x: LoadCase, clock: dict, world, me: int, pairs: list, check: bool, corrupt: int, timeout_s: float,
                hold_s: float, make_row: Callable[..., dict]) -> tuple[list[dict], dict]:
    """Run one case's decode side on rank ``me``: (its rows, its facts for the sidecar).

    ``clock``: per prefill rank (this clock minus the prefill's, round trip); ``pairs``: the scheme's (prefill,
    decode) pairs, whose index is a row's pair; ``corrupt``: bytes to flip in the first landed request (fault
    injection: proves the check catches it); ``timeout_s``, ``hold_s``: alloc_timeout_ms and decode_ms in
    seconds; ``make_row(role, k, pair, status, ntok, **columns)``: one result row.

    ``check``: False, True (-c 1: each admitted request verified during its hold) or "all" (each request's ranges
    copied aside when its completion is reported, verified against its own epoch, and compared again before its
    blocks are freed; the whole pool, not only the granted blocks, must hold poison when free)."""
    case, t, lay, clk, w, cap, pool = x.case, x.t, x.lay, x.clk, world, x.cap, x.pool
    n, L = x.n, x.lay.layers
    srcs = [s for s in x.srcs if me in x.dests[s]]
    expect = sum(1 for s in srcs for k in range(n) if x.dests[s][k % len(x.dests[s])] == me)
    alloc = x.dalloc or x.decode_allocator(me)
    blocks = block_array(pool, lay)
    bs, row = case["block_size"], x.g["shape"].row_elems * x.elem
    every = check == "all"

    def timed_snapshot(descs):  # a request's ranges copied aside in one native call (every layer the same size)
        return verify.snapshot(pool, descs)[0]

    if every:  # every byte of the pool, the blocks past cap and the tail included: a canary for stray writes
        pool[:] = memory.POISON
    elif check:
        blocks[:, :, :cap] = memory.POISON
    fifo, holds, live, rec, sends, tasks = deque(), [], {}, {}, [], deque()
    occ, resolved, busy = [(clk(), 0)], 0, [0.0]
    snap = timed_snapshot if every else None
    waiter = _Waiter(t, x.t0, snap) if case["op"] == "push" and t.caps.notifies else None
    if waiter:
        waiter.start()

    def check_held(rid, r):  # -c 1: the pool's blocks during the hold, one layer per step, between events
        last, r["nwrong"] = (r["ntok"] - (len(r["ids"]) - 1) * bs) * row, 0
        for i in range(L):  # the vectorized check reads 4-byte words; anything else takes the reference
            if (last | lay.block_bytes) % 4 or not layer_is_right(pool, lay, i, r["src_ids"], r["ids"], last, r["src"]):
                r["nwrong"] += memory.count_wrong(pool, r["descs"][i], r["src"], x.elem)
            yield

    def verify_copy(rid, r):  # -c all: the copy taken at completion, against this request's epoch
        copy, r["nwrong"] = r["snap"].reshape(L, -1), 0
        src_ids = r["src_ids"]
        exp = x.pats[r["src"]].layers(src_ids, x.last(len(src_ids), r["ntok"]), x.epoch(rid))
        yield
        for i, d in enumerate(r["descs"]):
            r["nwrong"] += verify.count_diff(exp[i], copy[i], d[:, LEN], x.elem)
            yield

    def release(rid, r):
        for i in range(L):
            if every:  # held bytes that changed after the completion (a write by another transfer) are wrong
                d = r["descs"][i]
                r["nwrong"] += verify.count_diff(verify.snapshot(pool, [d])[0], r["snap"].reshape(L, -1)[i],
                                                 d[:, LEN], x.elem)
            blocks[i][:, r["ids"]] = memory.POISON
            yield
        r.pop("snap", None)
        free(rid)

    def free(rid):
        r = rec[rid] = live.pop(rid)
        alloc.release(r["ids"])
        occ.append((clk(), cap - alloc.nfree))
        r.update(status="ok", ndesc=sum(len(d) for d in r.pop("descs")))

    def landed(rid, when, copy=None):
        nonlocal resolved, corrupt
        r, resolved = live[rid], resolved + 1
        if every:  # copied aside now, before anything else (the waiter copied it as its wait returned)
            a = time.perf_counter()
            r["snap"] = copy if copy is not None else timed_snapshot(r["descs"])
            busy[0] += time.perf_counter() - a
        r["landed"] = when
        heapq.heappush(holds, (when + hold_s, rid))
        if check:
            if corrupt:  # fault injection: proves the check catches it
                d0 = r["descs"][0][0]
                if every:
                    r["snap"][: min(corrupt, int(d0[LEN]))] ^= 0xFF  # the copy's first bytes are layer 0's first
                else:
                    pool[d0[DST]: d0[DST] + min(corrupt, int(d0[LEN]))] ^= 0xFF
                corrupt = 0
            tasks.append(verify_copy(rid, r) if every else check_held(rid, r))

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
                            wait_landed(t, r["h"])
                            landed(msg[1], time.perf_counter() - x.t0, None)
            while fifo:  # strict FIFO: the head blocks those behind it (no overtaking)
                s, rid, ntok, src_ids, t_in = fifo[0]
                ids = alloc.allocate(len(src_ids), case["alloc"])
                if ids is None:
                    break
                fifo.popleft()
                a = clk()
                bad = unpoisoned(pool, blocks, lay, ids) if check else 0
                r = live[rid] = {"src": s, "src_ids": src_ids, "ids": ids, "h": [], "queue": a - t_in, "bad": bad,
                                 "ntok": ntok, "descs": x.descs(src_ids, ids, ntok), "check_s": clk() - a}
                if waiter:  # two-sided: receives are in place before the grant goes out
                    r["h"] = [t.serve("push", s, d, ((rid & 0xFFFF) << 16) | i) for i, d in enumerate(r["descs"])]
                    waiter.jobs.put((rid, r["h"], r["descs"]))
                sends.append(w.isend(("grant", rid, ids, r["queue"]), dest=s, tag=TAG_D2P))
                occ.append((a, cap - alloc.nfree))
                idle = False
            while fifo and clk() - fifo[0][4] >= timeout_s:
                s, rid, ntok, _, t_in = fifo.popleft()
                rec[rid] = {"src": s, "status": "dropped", "queue": clk() - t_in, "ntok": ntok}
                sends.append(w.isend(("drop", rid, None, rec[rid]["queue"]), dest=s, tag=TAG_D2P))
                resolved, idle = resolved + 1, False
            while waiter and not waiter.done.empty():
                rid, when, copy, exc = waiter.done.get()
                if exc:
                    raise exc
                landed(rid, when, copy)
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
    final_bad = unpoisoned(pool, blocks, lay, np.arange(lay.nblocks if every else cap)) if check else 0
    if every:  # the pool's tail past its blocks: a canary
        final_bad += int(bool(np.count_nonzero(pool[lay.nbytes:] != memory.POISON)))
    facts = {}
    for s in srcs:
        facts.update(w.recv(source=s, tag=TAG_FACTS))
    rows = []
    for rid, r in sorted(rec.items()):
        k, arr_s, arr, pend, P = facts[rid]
        land = r.get("landed", NAN) - clock[r["src"]][0]  # on the prefill rank's clock
        ok = r["status"] == "ok"
        rows.append(make_row("decode", k, pairs.index((r["src"], me)), r["status"], r["ntok"],
                             seconds=land - arr, descriptors=r.get("ndesc", 0), prefill_s=P, queue_s=r["queue"],
                             exposed_s=land - pend, arrival_s=arr_s, harness_seconds=r.get("check_s", NAN),
                             nwrong=r.get("nwrong") if ok and check else None))
        if r.get("bad"):
            rows[-1]["reason"] = f"{r['bad']} granted blocks were written while free"
    viol = sum(r.get("bad", 0) for r in rec.values()) + final_bad
    return rows, {"rank": me, "cap_blocks": cap, "occupancy": [(round(a, 6), u) for a, u in occ],
                  "violations": viol if check else None, "check_s": round(busy[0], 4)}
