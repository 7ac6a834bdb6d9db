"""The one timing loop: pools, registration, warm-up, barrier, iterations, check, rows.

The harness owns *how* a case is measured; transports own *what* moves.
An iteration starts when a barrier ends.  Each rank records, for each of
its requests, when its part was complete; for the destination that means
the bytes are visible in its pool (its own receive completed, or the
initiator's notification arrived).  The headline per request is the max
over the two ranks of its pair, computed when results are read.
"""
from __future__ import annotations

import pickle
import secrets
import time
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from . import clocks, costs, faults, memory, planes, preflight, transports, verify
from . import model as M
from .codecpath import codec_columns, codec_refused, codec_staging, codec_transport, lossy_columns
from .descriptors import CHUNKS, bulk_descs, chunked, coalesced_descs, request_descs
from .guard import GUARD
from .memory import device
from .pool import BlockAllocator, Layout, Pool
from .schedule import (
    TAG_FINAL,
    TAG_T0,
    Entry,
    Iteration,
    SchemeError,
    control_bytes,
    make_pairs,
    max_entries_per_rank,
    offset_bulk,
)
from .transports.base import LEN, Context, TransportError


class UserError(ValueError):
    """A mistake in the request (not a failure of the machine): one line, exit 1."""


@dataclass
class Options:
    iters: int = 20
    warmup: int = 3
    check: bool = True
    seed: int = 0
    pool_factor: float = 2.0
    timeout: float = 600.0
    setup_timeout: float | None = None  # None: derived from the pool bytes (preflight.setup_seconds)
    pages: str = "4k"  # host pools kvbench allocates: 4k, thp or huge (memory.PAGE_KINDS)
    variants: tuple = ("bulk", "paged")
    rounds: int = 1  # >1: a transport's cases take turns, iters/rounds iterations at a time
    inject_corruption: int = 0  # fault injection: flip this many destination bytes before verifying
    fill: str = "pattern"  # pool contents: pattern, realistic, file:<dump> (memory/values.py)
    transport_options: dict = field(default_factory=dict)


def case_geometry(case: dict) -> dict:
    """Shape numbers of a case: blocks, block bytes, payload (pure arithmetic)."""
    shape = M.shard(M.get_model(case["model"]), case["tp"], case["pp"])
    ntok = M.transferred_tokens(case["tokens"], case["prefix_hit"])
    if planes.scaled(case):  # values, block scales, tensor scales in planes of their own
        return planes.geometry(case, shape, ntok)
    bs = case["block_size"]
    bb = M.block_bytes(shape, bs, case["dtype"])
    nb = M.num_blocks(ntok, bs)
    last = (ntok - (nb - 1) * bs) * shape.row_elems * M.dtype_bytes(case["dtype"])
    return {"shape": shape, "ntok": ntok, "block_bytes": bb, "nblocks": nb, "last_bytes": last,
            "full_bytes": shape.layers * shape.regions * nb * bb,
            "payload": M.bytes_per_token(shape, case["dtype"]) * ntok}


def pool_bytes(cases: list[dict], factor: float, entries: int = 1) -> int:
    """One pool size for a transport's cases: ``factor`` x the requests one rank holds at once.

    ``entries`` is the number of pairs the busiest rank belongs to; each case
    multiplies it by its own ``inflight``.
    """
    need = max(case_geometry(c)["full_bytes"] * c.get("inflight", 1) for c in cases) * entries
    return -(-int(need * factor) // memory.PAGE) * memory.PAGE


class Harness:
    """Runs expanded cases on every rank; rank 0 gets the rows through ``sink``."""

    def __init__(self, comm, opts: Options, sink=None):
        self.comm, self.opts, self.sink = comm, opts, sink
        self.rank = comm.rank
        self.run_id = comm.bcast(secrets.token_hex(4) if self.rank == 0 else None)
        self.token = comm.bcast(secrets.token_bytes(16) if self.rank == 0 else None)
        self.case_no = 0
        self.transport_info: dict[str, list] = {}  # name -> info() of every rank (rank 0 only)
        self.resources: list[dict] = []  # RSS and open files per rank around each transport's cases
        self.on_group_done = None  # rank 0: called with a transport's name once all its rows are stored

    def set_sink(self, sink) -> None:
        """Rank 0: where finished cases' rows go."""
        self.sink = sink

    # ----- whole run ---------------------------------------------------------------------
    def preflight(self, cases: list[dict], scheme: str) -> None:
        """Refuse, before anything is allocated or written, pools that do not fit (collective)."""
        try:
            entries = max_entries_per_rank(make_pairs(scheme, self.comm.size), 1)
        except SchemeError as exc:
            raise UserError(str(exc)) from None
        groups = []
        for name, g in groupby(cases, key=lambda c: c["transport"]):
            g = list(g)
            layer = max(case_geometry(c)["payload"] // case_geometry(c)["shape"].layers for c in g)
            groups.append((name, self.pool_size(g, entries), layer))
        why = preflight.check(self.comm, groups, self.opts.transport_options, self.opts.pages)
        if why:
            raise UserError(why)

    def run(self, cases: list[dict], scheme: str) -> None:
        try:
            pairs = make_pairs(scheme, self.comm.size)
        except SchemeError as exc:
            raise UserError(str(exc)) from None
        for name, group in groupby(cases, key=lambda c: c["transport"]):
            # one pool and one transport per (memory kind, copy engine): the pool's kind is fixed at allocation
            for _, sub in groupby(group, key=lambda c: (c.get("memory", "host"), c.get("copy", "batch"))):
                self.run_transport(name, list(sub), pairs)
            if self.on_group_done is not None:
                self.on_group_done(name)
        self.resources = [x for part in self.comm.gather(self.resources) or [] for x in part]

    def sample(self, group: str, phase: str, case: int = 0) -> None:
        """This rank's resident memory and open files now (the soak's leak check reads them); one sample per
        (case, phase), the last one kept."""
        self.resources = [x for x in self.resources if (x["case"], x["phase"], x["transport"]) != (case, phase, group)]
        self.resources.append(dict(preflight.process_usage(), rank=self.rank, transport=group, case=case, phase=phase))

    # ----- one transport -----------------------------------------------------------------
    def run_transport(self, name: str, cases: list[dict], pairs) -> None:
        memory.use(None)  # pools start with the check pattern; a case's fill is put in place by its prepare
        reason = transports.probe(name)
        cls = None
        if reason is None:
            cls = transports.load(name)
            if not cls.caps.local_only and self.comm.size < 2:
                reason = "needs 2 ranks or more (mpirun -np 2 kvbench run ...)"
            elif all(c["op"] not in cls.caps.ops for c in cases):
                reason = f"supports only {', '.join(cls.caps.ops)}"
            else:
                reason = device_reason(cls, cases[0])
        reasons = [r for r in self.comm.allgather(reason) if r]
        if reasons:
            for case in cases:
                self.emit_skipped(case, f"unavailable: {reasons[0]}")
            return
        local = cls.caps.local_only
        my_pairs = [(0, 0)] if local else pairs
        token = self.token if not faults.armed("token", self.rank) else bytes(16)
        ctx = Context(self.rank, self.comm.size, self.comm.hostname, self.run_id, token,
                      dict(self.opts.transport_options.get(name, {})), pages=self.opts.pages,
                      memory=cases[0].get("memory", "host"), copy=cases[0].get("copy", "batch"))
        entries = 1 if local else max_entries_per_rank(pairs, 1)
        nbytes = self.pool_size(cases, entries)
        staging = codec_staging(name, cases, my_pairs, case_geometry)  # codec cases: frames' slots after the KV bytes
        GUARD.case = f"setup of {name}"
        GUARD.arm(f"setup of {name} (allocate and fill {nbytes / 2**30:.2f} GiB, register, connect)",
                  self.opts.setup_timeout or preflight.setup_seconds(nbytes))
        t = cls(ctx)
        pools: list[Pool] = []
        try:
            active = not local or self.rank == 0
            if active:
                pools.append(self._alloc(t, nbytes + staging, ctx.memory))
                if local:
                    pools.append(Pool(memory.alloc_host(nbytes, pages=self.opts.pages)))
                r0 = time.perf_counter()
                metas = [t.register(p) for p in pools]
                register_s = time.perf_counter() - r0  # once per pool, never per request
            c0 = time.perf_counter()
            if not local:
                allm = self.comm.allgather(metas[0])
                peers = {}
                for s, d in pairs:
                    if self.rank in (s, d):
                        other = d if s == self.rank else s
                        peers[other] = allm[other]
                t.connect(peers)
            elif active:
                t.connect({})
            self.comm.barrier()
            t.ready()
            connect_s = time.perf_counter() - c0
            infos = self.comm.gather(dict(t.info(), register_s=register_s, connect_s=connect_s, pool_bytes=nbytes,
                                          completion="transport" if t.caps.stamps else "harness",
                                          pages=self.pages_of(t, pools)) if active else None)
            if self.rank == 0:
                self.transport_info[name] = infos
            GUARD.disarm()
            self.sample(name, "ready")
            session = {"t": t, "pools": pools, "pairs": my_pairs, "local": local, "bulk": set(), "nbytes": nbytes}
            if staging and active:
                from .codecpath import Session

                session["codec"] = Session(t, pools[0].array, nbytes, my_pairs, self.rank)
            runnable = []
            for case in cases:
                if case["op"] not in cls.caps.ops:
                    self.emit_skipped(case, f"unavailable: {name} supports only {', '.join(cls.caps.ops)}")
                elif codec_refused(name, case):
                    self.emit_skipped(case, f"unavailable: {codec_refused(name, case)}")
                else:
                    runnable.append(case)
            if self.opts.rounds > 1:
                self.run_rounds(runnable, session)
            else:
                for case in runnable:
                    self.run_case(case, session)
            # one-sided peers may still be reading our pool: nobody closes until everybody is done
            with GUARD.deadline(f"the end of {name}'s cases (barrier)", self.opts.timeout):
                self.comm.barrier()
        finally:
            if "session" in locals() and "codec" in session:
                session["codec"].close()
            t.close()
            for p in pools:
                p.release()
        GUARD.case = ""  # (kept when an exception passes: the one line names the case)
        self.sample(name, "closed")

    def pages_of(self, t, pools: list[Pool]) -> dict:
        """For the sidecar: the page size asked for, and per pool what was applied and what the kernel gave."""
        got = [t.pages(p) if p.own_pages else dict(memory.page_report(p.array), applied=self.opts.pages)
               if p.array is not None else {"applied": p.kind, "note": "device memory: no host pages"} for p in pools]
        out = {"requested": self.opts.pages, **(got[0] if got else {})}
        if len(got) > 1:
            out["more_pools"] = got[1:]
        return out

    def pool_size(self, cases: list[dict], entries: int) -> int:
        """Bytes of each rank's pool for a transport's cases (subclasses size it differently)."""
        return pool_bytes(cases, self.opts.pool_factor, entries)

    def _alloc(self, t, nbytes: int, kind: str = "host") -> Pool:
        if kind != "host":  # a device pool, filled where it lives (memory/device.py)
            try:
                pool = device.alloc(nbytes, kind, pages=self.opts.pages)
            except device.DeviceMemoryError as exc:
                raise UserError(str(exc)) from None
            device.fill(pool.tensor, self.rank)
            device.sync(pool)
            return pool
        buf = t.alloc(nbytes)
        if buf is not None:
            pool = Pool(buf.array, "host", buf.release)
            pool.own_pages = True
        else:
            pool = Pool(memory.alloc_host(nbytes, pages=self.opts.pages))
        faults.hit("stall-setup", self.rank)
        memory.fill(pool.array, self.rank)
        return pool

    # ----- one case ----------------------------------------------------------------------
    def variants(self, case: dict, s: dict) -> list[dict]:
        """What a case measures: once per payload its references (bulk: one descriptor per layer; the
        ceiling: the same bytes in contiguous chunks of 64 KiB to 4 MiB; hot: one layer's buffer again and
        again), then the paged transfer."""
        out = []
        bulk_key = tuple(case.get(k) for k in ("op", "model", "tokens", "prefix_hit", "dtype", "tp", "pp", "inflight",
                                               "scales"))
        if bulk_key not in s["bulk"]:
            s["bulk"].add(bulk_key)  # plain transfers: no clock, no handshake
            refs = ["bulk"] if "bulk" in self.opts.variants else []
            refs += list(CHUNKS) if "ceiling" in self.opts.variants else []
            refs += ["hot"] if "hot" in self.opts.variants else []
            out += [dict(case, variant=v, overlap="serial", prefill_ms=0.0, prefill_ms_set="0", handshake="off",
                         codec="none", prefill="clock") for v in refs]  # references: the pool's bytes as they are
        if "paged" in self.opts.variants:
            out.append(dict(case, variant="paged"))
        return out

    def run_case(self, case: dict, s: dict) -> None:
        for v in self.variants(case, s):
            self.measure(v, s)

    def run_rounds(self, cases: list[dict], s: dict) -> None:
        """Interleave: every measurement gets its share of iterations in turn, ``rounds`` times over.

        A slow phase of a noisy machine (another job, a frequency step) then
        hits every row of the comparison alike instead of one of them.  The
        first round warms up with ``warmup`` iterations, later ones with one
        (the caches held another case's ranges meanwhile).
        """
        o = self.opts
        ms = [self.prepare(v, s) for case in cases for v in self.variants(case, s)]
        for r in range(o.rounds):
            share = o.iters // o.rounds + (r < o.iters % o.rounds)
            for m in ms:
                self.iterate(m, s, o.warmup if r == 0 else min(1, o.warmup), share, r)
        for m in ms:
            self.finish(m, s)

    def plan(self, case: dict, g: dict, s: dict) -> list[Entry]:
        """Control plane (untimed): decode reserves its blocks, prefill picks its own; both learn both."""
        fmt = planes.fit(case["layout"], g, s["nbytes"]) if "fmt" in g else None
        lay = fmt[0] if fmt else Layout.fit(case["layout"], g["shape"].layers, g["shape"].regions,
                                            g["block_bytes"], s["nbytes"])
        bulk = case["variant"] != "paged"  # a reference: contiguous blocks, one range per layer to start from
        seed = self.opts.seed * 1_000_003 + self.case_no
        allocs: dict[str, BlockAllocator] = {}
        mine, slots = {}, {}
        for i, (src, dst) in enumerate(s["pairs"]):
            for req in range(case["inflight"]):
                for side, r in (("src", src), ("dst", dst)):
                    if r != self.rank:
                        continue
                    if side not in allocs:
                        allocs[side] = BlockAllocator(lay.nblocks, seed=seed * 7919 + r * 2 + (side == "dst"))
                    ids = allocs[side].allocate(g["nblocks"], "contiguous" if bulk else case["alloc"])
                    if ids is None:
                        raise TransportError(f"pool of {lay.nblocks} blocks per layer cannot hold the requests "
                                             f"in flight; raise --pool-factor")
                    mine[(i, req, side)] = ids
                    slots[(i, req, side)] = sum(1 for key in slots if key[2] == side)
        blocks, allslots = {}, {}
        for part, sl in ([(mine, slots)] if s["local"] else self.comm.allgather((mine, slots))):
            blocks.update(part)
            allslots.update(sl)
        entries = []
        for i, (src, dst) in enumerate(s["pairs"]):
            if self.rank not in (src, dst):
                continue
            for req in range(case["inflight"]):
                layers = []
                descs = coalesced_descs if case["coalesce"] == "on" else request_descs  # bulk only sums lengths
                if fmt:  # scale planes beside the values: their own descriptors
                    entries.append(Entry(i, req, src, dst, planes.request_layers(
                        fmt, g, blocks[(i, req, "src")], blocks[(i, req, "dst")], descs, bulk), blocks[(i, req, "dst")]))
                    continue
                per_layer = descs(lay, lay, blocks[(i, req, "src")], blocks[(i, req, "dst")], g["last_bytes"])
                for layer, d in enumerate(per_layer):
                    if bulk:
                        d = bulk_descs(lay, lay, layer, int(d[:, LEN].sum()))
                    layers.append(np.ascontiguousarray(d))
                if bulk:  # requests sharing a pool get disjoint slices of each layer
                    if case["variant"] == "hot":  # every layer is layer 0's range: the same buffer, cache-hot
                        layers = [layers[0]] * len(layers)
                    layers = offset_bulk(layers, allslots[(i, req, "src")], allslots[(i, req, "dst")])
                    for j, d in enumerate(layers):
                        start, span = lay.layer_span(0 if case["variant"] == "hot" else j)
                        if int((d[:, :2] + d[:, 2:3]).max()) > start + span:
                            raise TransportError("bulk requests in flight do not fit a layer; raise --pool-factor")
                    if case["variant"] in CHUNKS:
                        layers = [chunked(d, CHUNKS[case["variant"]]) for d in layers]
                entries.append(Entry(i, req, src, dst, layers, blocks[(i, req, "dst")]))
        return entries

    def measure(self, case: dict, s: dict) -> None:
        m = self.prepare(case, s)
        self.iterate(m, s, self.opts.warmup, self.opts.iters)
        self.finish(m, s)

    def prepare(self, case: dict, s: dict) -> dict:
        """Number the case, plan its requests (untimed) and build its iteration."""
        self.case_no += 1
        GUARD.case = case_label(self.case_no, case)
        g = case_geometry(case)
        entries = self.plan(case, g, s)
        t = codec_transport(self, case, g, s)
        itr = Iteration(t, self.comm, self.rank, entries, case, s["local"])
        return {"no": self.case_no, "case": case, "g": g, "entries": entries, "itr": itr, "rec": [], "next": 0,
                "codec": [] if t is not s["t"] else None}

    def _once(self, m: dict, it: int):
        if faults.armed("post", self.rank, m["no"]):  # inert unless KVBENCH_FAULT names this rank
            raise TransportError("injected fault (KVBENCH_FAULT)")
        if it >= 0:
            faults.hit("stall-case", self.rank, m["no"])
            if it >= 1:  # the peer is in the middle of this case's transfers
                faults.hit("kill", self.rank, m["no"])
        # a timed iteration starts when the barrier ends; what it may do before that, Iteration.run does first
        return m["itr"].run((((m["no"] << 8) + it) & 0xFFFF) << 16, self.comm.barrier if it >= 0 else None)

    def _watchdog(self, m: dict) -> None:
        GUARD.case = case_label(m["no"], m["case"])
        GUARD.arm(f"case {m['no']} (--timeout)", self.opts.timeout)

    def iterate(self, m: dict, s: dict, warmup: int, iters: int, rnd: int = 0) -> None:
        """``warmup`` untimed then ``iters`` timed iterations; each starts when a barrier ends."""
        itr = m["itr"]
        self._watchdog(m)
        try:
            for k in range(warmup + iters):
                done, inside, hs, offset = self._once(m, m["next"])  # from the end of a barrier
                t0 = itr.t0
                total = time.perf_counter() - t0
                stages = s["t"].take_stages() if hasattr(s["t"], "take_stages") else None  # staged: per-stage seconds
                m["next"] += 1  # tags stay distinct across rounds
                stats = s["codec"].take_stats() if m["codec"] is not None else None
                ends, took = itr.prefill_ends(offset)  # per source: its prefill's end (real: measured there)
                if k >= warmup:  # per timed iteration: done per entry, harness overhead, handshake, exposed
                    exposed = [d - ends.get(e.src, itr.prefill_s) if e.dst == self.rank else None
                               for d, e in zip(done, itr.order)]
                    m.setdefault("took", []).append(took)
                    m["rec"].append((done, total - inside, hs, exposed, rnd))
                    if stats is not None:
                        m["codec"].append(stats)
                    m.setdefault("cost", []).append(itr.cost)  # time outside the wire (costs.py)
                    m.setdefault("t0s", []).append(t0)
                    m.setdefault("stages", []).append(stages)
                if k + 1 == max(warmup, 1) and not m.get("warm"):  # once per case: its first iterations done
                    m["warm"] = True
                    self.sample(m["case"]["transport"], "warm", m["no"])
                if k + 1 == warmup + iters // 2 and not m.get("mid"):  # half-way: the steady state's start
                    m["mid"] = True
                    self.sample(m["case"]["transport"], "mid", m["no"])
        finally:
            GUARD.disarm()
        self.sample(m["case"]["transport"], "end", m["no"])

    def finish(self, m: dict, s: dict) -> None:
        """Check every byte (if asked), then deliver the case's rows."""
        case, entries, itr = m["case"], m["entries"], m["itr"]
        nwrong = None
        self._watchdog(m)
        try:
            m["clock"] = self.one_clock(m)
            if self.opts.check:
                nwrong = self.check(m, s)
        finally:
            GUARD.disarm()
        # rows follow `entries`; the iteration completed them in `itr.order`
        pos = [itr.order.index(e) for e in entries]
        rec = [([r[0][p] for p in pos], r[1], r[2], [r[3][p] for p in pos], r[4]) for r in m["rec"]]
        self.emit(case, m["g"], entries, rec, nwrong, m["no"], m["clock"], [itr.rule.get(id(e), "") for e in entries],
                  m["codec"], {entries.index(e): v for e in entries for k, v in m.get("errors", {}).items() if k == id(e)},
                  stages=m.get("stages"), cost=costs.reorder(m.get("cost", []), pos), took=m.get("took"))

    def one_clock(self, m: dict) -> dict[int, tuple]:
        """On a destination, per source: (barrier-exit skew per timed iteration, on the source's clock; the
        offset's error bound, half the best round trip; the offset).  Exposed times and the pair's time are
        corrected by the skew (clocks.py)."""
        itr = m["itr"]
        offsets = clocks.sync(self.comm, itr.sources, itr.dests)
        t0s = np.asarray(m.get("t0s", []), dtype=np.float64)
        reqs = [self.comm.isend_bytes(t0s.tobytes(), d, TAG_T0) for d in itr.dests]
        out = {self.rank: (np.zeros(len(t0s)), 0.0, 0.0)}  # source and destination in one process
        for src, (off, rtt) in offsets.items():
            theirs = bytearray(t0s.nbytes)
            self.comm.recv_bytes(theirs, src, TAG_T0)
            out[src] = (t0s - off - np.frombuffer(theirs, np.float64), rtt / 2, off)
        self.comm.waitall(reqs)
        return out

    def check(self, m: dict, s: dict) -> list[int]:
        """One more transfer, built to catch lies (verify.py): the source's layers take a new epoch of the
        pattern when final, the destination's ranges hold the complement of what they must receive, and the
        destination copies them aside the moment it believes them complete; wrong elements per entry."""
        case, entries, itr = m["case"], m["entries"], m["itr"]
        epoch = 1 + (m["no"] * 40503) % 0xFFFF
        src_pool, dst_pool = (device.buf(s["pools"][0]), device.buf(s["pools"][-1])) if s["pools"] else (None, None)
        chk = device.checker(s["pools"][-1]) if s["pools"] else verify  # device pools: the same rules, on the device
        mine = [e for e in entries if e.dst == self.rank]
        for e in mine:
            for d in e.layers:
                chk.poison(dst_pool, d, e.src, epoch)
        copies: dict[int, tuple] = {}
        landed: dict[int, float] = {}

        def final(ks):
            for e in entries:
                if e.src == self.rank:
                    for k in ks:
                        chk.write_epoch(src_pool, e.layers[k], self.rank, epoch)

        itr.on_final = final
        itr.on_landed = lambda e, at: (copies.setdefault(id(e), chk.snapshot(dst_pool, e.layers)),
                                       landed.setdefault(id(e), at))
        self.comm.barrier()
        try:
            self._once(m, -1)
        finally:
            itr.on_final = itr.on_landed = None
        self.landed_after_posted(m, mine, landed, dict(itr.bound_at))
        if mine and self.opts.inject_corruption:
            copy = copies[id(mine[0])][0]
            copy[: self.opts.inject_corruption] ^= 0xFF
        elem = m["g"].get("elem") or M.dtype_bytes(case["dtype"])  # scaled formats: bytes (values share them)
        if case.get("codec", "").startswith("cast-"):  # lossy: elements outside the codec's stated tolerance
            from .codecpath import lossy_check

            m["errors"] = {id(e): lossy_check(copies[id(e)], e, epoch, case) for e in mine}
            return [m["errors"][id(e)][0] if e.dst == self.rank else 0 for e in entries]
        return [chk.count_wrong(*copies[id(e)], e.src, elem, epoch) if e.dst == self.rank else 0 for e in entries]

    def landed_after_posted(self, m: dict, mine: list, landed: dict, bounds: dict) -> None:
        """A destination's completion stamp cannot precede the moment its source posted the request's last layer
        (a pull: made it final), on one clock: a transport whose stamp does is not reporting when bytes landed."""
        itr = m["itr"]
        reqs = [self.comm.isend_bytes(pickle.dumps(bounds), d, TAG_FINAL) for d in itr.dests]
        for src in itr.sources:
            st = self.comm.probe(src, TAG_FINAL)
            buf = bytearray(st)
            self.comm.recv_bytes(buf, src, TAG_FINAL)
            bounds = {**pickle.loads(bytes(buf)), **bounds}
        self.comm.waitall(reqs)
        for e in mine:
            _, err, off = m["clock"][e.src]
            early = bounds[(e.pair, e.req)] - (landed[id(e)] - off)
            if early > err + 1e-4:
                raise TransportError(
                    f"its completion stamp says the bytes landed {early * 1e6:.0f} us before the source posted the "
                    f"last layer (clocks matched within {err * 1e6:.0f} us): the transport's completion time "
                    "is not when the bytes landed")

    # ----- rows --------------------------------------------------------------------------
    def base_row(self, case: dict, g: dict | None = None, no: int | None = None) -> dict:
        bulk = case.get("variant", "paged") != "paged"
        return {
            "case": self.case_no if no is None else no, "variant": case.get("variant", "paged"), "transport": case["transport"],
            "op": case["op"], "memory": case.get("memory", "host"), "copy": case.get("copy", "batch"),
            "prefill": case.get("prefill", "clock"), "model": case["model"], "tokens": case["tokens"],
            "prefix_hit": case["prefix_hit"], "block_size": 0 if bulk else case["block_size"],
            "block_bytes": CHUNKS.get(case.get("variant"), 0) if bulk or g is None else g["block_bytes"],
            "layout": case["layout"],
            "allocation": case["variant"] if bulk else case["alloc"], "coalesce": "bulk" if bulk else case["coalesce"],
            "dtype": case["dtype"], "codec": case.get("codec", "none"), "fill": self.opts.fill,
            "scales": case.get("scales", "none"),
            "overlap": case["overlap"], "scheme": case["scheme"],
            "handshake": case["handshake"], "prefill_ms_set": case["prefill_ms_set"], "workload": case["workload"],
            "layers": (g or case_geometry(case))["shape"].layers,
            "tp": case["tp"], "pp": case["pp"], "world_size": self.comm.size, "inflight": case["inflight"],
            "pages": self.opts.pages,
        }

    def emit(self, case, g, entries, rec, nwrong, no: int, clock: dict, rules: list[str], codec=None,
             errors=None, stages=None, cost=None, took=None) -> None:
        rows = []
        nan = float("nan")
        prefill_s = float(case["prefill_ms"]) / 1e3
        for k, e in enumerate(entries):
            role = "both" if e.src == e.dst else ("prefill" if e.src == self.rank else "decode")
            base = dict(self.base_row(case, g, no), rank=self.rank, role=role, pair=e.pair, req=e.req,
                        payload_bytes=e.payload, wire_bytes=e.payload + control_bytes(e, case["handshake"]),
                        descriptors=e.descriptors, status="ok", reason="", prefill_s=prefill_s,
                        queue_s=nan, arrival_s=nan, completion=rules[k])
            # a destination's times move onto its source's clock: + (its barrier exit - the source's)
            skews, err, off = clock[e.src] if e.dst == self.rank else (None, nan, nan)
            for it, (done, over, hs, exposed, rnd) in enumerate(rec):
                skew = float(skews[it]) if skews is not None else 0.0
                rows.append(dict(base, **stage_columns(stages[it] if stages else None),
                                 iter=it, round=rnd, seconds=done[k] + skew, harness_seconds=over, nwrong=None,
                                 handshake_s=hs if e.src == self.rank else nan,
                                 exposed_s=nan if exposed[k] is None else exposed[k] + skew,
                                 skew_s=skew if skews is not None else nan, clock_err_s=err, clock_offset_s=off,
                                 **codec_columns(codec, it, e, case), **costs.row(cost, it, k),
                                 **real_prefill_s(took, it, e.src)))
            if nwrong is not None:
                rows.append(dict(base, iter=-1, round=-1, seconds=nan, harness_seconds=nan, handshake_s=nan, exposed_s=nan,
                                 nwrong=nwrong[k] if role != "prefill" else 0, skew_s=nan, clock_err_s=nan,
                                 clock_offset_s=nan, **lossy_columns((errors or {}).get(k))))
        self.deliver(rows)

    def emit_skipped(self, case: dict, reason: str) -> None:
        self.case_no += 1
        row = dict(self.base_row(dict(case, variant="paged")), rank=self.rank, role="", pair=-1, req=0, iter=-1,
                   seconds=float("nan"), harness_seconds=float("nan"),
                   payload_bytes=case_geometry(case)["payload"], wire_bytes=0, descriptors=0,
                   status="skipped", reason=reason, nwrong=None, prefill_s=float("nan"), handshake_s=float("nan"),
                   exposed_s=float("nan"), queue_s=float("nan"), arrival_s=float("nan"), skew_s=float("nan"),
                   clock_err_s=float("nan"), clock_offset_s=float("nan"), completion="")
        self.deliver([row] if self.rank == 0 else [])

    def deliver(self, rows: list[dict]) -> None:
        everything = self.comm.gather(rows)
        if self.rank == 0:
            flat = [r for part in everything for r in part]
            if self.sink:
                self.sink(flat)


def device_reason(cls, case: dict) -> str | None:
    """Why a transport cannot run a case's memory kind and copy engine here, or None."""
    kind = case.get("memory", "host")
    if kind not in cls.caps.memory:
        if cls.name == "staged" and kind == "host":
            return "staged: --memory host has nothing to stage (use torch-cpu, pinned or cuda)"
        return f"{cls.name} moves {', '.join(cls.caps.memory)} memory, not {kind}"
    from . import copy

    return device.probe(kind) or copy.probe(case.get("copy", "batch"), "cuda" if kind == "cuda" else "cpu")


def real_prefill_s(took: list | None, it: int, src: int) -> dict:
    """A real prefill's measured seconds (on the source, sent to its destinations) as the row's prefill_s."""
    return {"prefill_s": took[it][src]} if took and src in took[it] else {}


def stage_columns(stages: dict | None) -> dict:
    """A row's per-stage seconds (staged: gather, wire, scatter on this rank in this iteration; else empty)."""
    nan = float("nan")
    stages = stages or {}
    return {f"{k}_s": float(stages.get(k, nan)) for k in ("gather", "wire", "scatter")}


def case_label(no: int, case: dict) -> str:
    """How the one-line failure message names a case."""
    what = "bulk" if case.get("variant") == "bulk" else f"{case['alloc']} {case['block_size']}-token blocks"
    return f"case {no} ({case['transport']} {case['op']} {case['model']} {case['tokens']} tokens, {what})"
