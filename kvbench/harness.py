"""The one timing loop: pools, registration, warm-up, barrier, iterations, check, rows.

The harness owns *how* a case is measured; transports own *what* moves.
An iteration's time on a rank runs from the end of a barrier until that
rank's part is complete; for the destination that means the bytes are
visible in its pool (its own receive completed, or the initiator's
notification arrived).  The headline per iteration is the max over the
ranks of the pair, computed when results are read.
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from . import memory, transports
from . import model as M
from .descriptors import bulk_descs, coalesce, layer_descs, stats
from .pool import BlockAllocator, Layout, Pool
from .transports.base import DST, LEN, Context, TransportError, Unavailable


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
    inject_corruption: int = 0  # fault injection: flip this many destination bytes before verifying
    transport_options: dict = field(default_factory=dict)


def make_pairs(scheme: str, world: int) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) pairs of a scheme."""
    if scheme == "pairwise":
        if world > 1 and world % 2:
            raise UserError(f"scheme 'pairwise' needs an even number of ranks (got {world}): "
                            "even ranks prefill, odd ranks decode")
        return [(r, r + 1) for r in range(0, world - 1, 2)]
    raise UserError(f"scheme '{scheme}' is not one of: pairwise")


def case_geometry(case: dict) -> dict:
    """Shape numbers of a case: blocks, block bytes, payload (pure arithmetic)."""
    shape = M.shard(M.get_model(case["model"]), case["tp"], case["pp"])
    ntok = M.transferred_tokens(case["tokens"], case["prefix_hit"])
    bs = case["block_size"]
    bb = M.block_bytes(shape, bs, case["dtype"])
    nb = M.num_blocks(ntok, bs)
    last = (ntok - (nb - 1) * bs) * shape.row_elems * M.dtype_bytes(case["dtype"])
    return {"shape": shape, "ntok": ntok, "block_bytes": bb, "nblocks": nb, "last_bytes": last,
            "full_bytes": shape.layers * shape.regions * nb * bb,
            "payload": M.bytes_per_token(shape, case["dtype"]) * ntok}


def pool_bytes(cases: list[dict], factor: float) -> int:
    """One pool size for a transport's cases: room for ``factor`` x the largest request."""
    need = max(case_geometry(c)["full_bytes"] for c in cases)
    return -(-int(need * factor) // memory.PAGE) * memory.PAGE


class Harness:
    """Runs expanded cases on every rank; rank 0 gets the rows through ``sink``."""

    def __init__(self, comm, opts: Options, sink=None):
        self.comm, self.opts, self.sink = comm, opts, sink
        self.rank = comm.rank
        self.run_id = comm.bcast(secrets.token_hex(4) if self.rank == 0 else None)
        self.token = comm.bcast(secrets.token_bytes(16) if self.rank == 0 else None)
        self.total_wrong = 0
        self.case_no = 0
        # fault injection, inert by default: KVBENCH_FAULT=post:<rank> fails that rank's first transfer
        spec = os.environ.get("KVBENCH_FAULT", "")
        self.fault = spec.partition(":")[0] == "post" and spec.partition(":")[2] == str(self.rank)

    # ----- whole run ---------------------------------------------------------------------
    def check_memory(self, cases: list[dict], pairs) -> None:
        """Refuse, before allocating, a run whose pools do not fit in this host's memory."""
        need = 0
        for name, group in groupby(cases, key=lambda c: c["transport"]):
            group = list(group)
            local = name == "loopback"
            nb = pool_bytes(group, self.opts.pool_factor)
            mine = (2 * nb if self.rank == 0 else 0) if local else nb
            need = max(need, mine)
        rows = self.comm.allgather((self.comm.hostname, need, memory.available_bytes()))
        per_host: dict[str, list] = {}
        for host, n, avail in rows:
            per_host.setdefault(host, [0, avail, 0])
            per_host[host][0] += n
            per_host[host][2] += 1
        for host, (total, avail, nranks) in per_host.items():
            if total > 0.9 * avail:
                raise UserError(f"pools need {total / 2**30:.2f} GiB on host {host} ({nranks} ranks) but only "
                                f"{avail / 2**30:.2f} GiB is available: lower --tokens, --pool-factor or the model size")

    def run(self, cases: list[dict], scheme: str) -> None:
        pairs = make_pairs(scheme, self.comm.size)
        self.check_memory(cases, pairs)
        for name, group in groupby(cases, key=lambda c: c["transport"]):
            self.run_transport(name, list(group), pairs)

    # ----- one transport -----------------------------------------------------------------
    def run_transport(self, name: str, cases: list[dict], pairs) -> None:
        reason = transports.probe(name)
        cls = None
        if reason is None:
            cls = transports.load(name)
            if not cls.caps.local_only and self.comm.size < 2:
                reason = "needs 2 ranks or more (mpirun -np 2 kvbench run ...)"
        reasons = [r for r in self.comm.allgather(reason) if r]
        if reasons:
            for case in cases:
                self.emit_skipped(case, f"unavailable: {reasons[0]}")
            return
        local = cls.caps.local_only
        my_pairs = [(0, 0)] if local else pairs
        ctx = Context(self.rank, self.comm.size, self.comm.hostname, self.run_id, self.token,
                      dict(self.opts.transport_options))
        t = cls(ctx)
        nbytes = pool_bytes(cases, self.opts.pool_factor)
        pools: list[Pool] = []
        try:
            active = not local or self.rank == 0
            if active:
                pools.append(self._alloc(t, nbytes))
                if local:
                    pools.append(Pool(memory.alloc_host(nbytes)))
                metas = [t.register(p) for p in pools]
            if not local:
                allm = self.comm.allgather(metas[0])
                peers = {d if s == self.rank else s: allm[d if s == self.rank else s]
                         for s, d in pairs if self.rank in (s, d)}
                t.connect(peers)
            elif active:
                t.connect({})
            self.comm.barrier()
            t.ready()
            session = {"t": t, "pools": pools, "pairs": my_pairs, "local": local, "bulk": {}}
            for case in cases:
                self.run_case(case, session)
        finally:
            t.close()
            for p in pools:
                p.release()

    def _alloc(self, t, nbytes: int) -> Pool:
        buf = t.alloc(nbytes)
        pool = Pool(buf.array, "host", buf.release) if buf is not None else Pool(memory.alloc_host(nbytes))
        memory.fill(pool.array, self.rank)
        return pool

    # ----- one case ----------------------------------------------------------------------
    def run_case(self, case: dict, s: dict) -> None:
        bulk_key = tuple(case[k] for k in ("op", "model", "tokens", "prefix_hit", "dtype", "tp", "pp"))
        if bulk_key not in s["bulk"]:
            s["bulk"][bulk_key] = True
            self.measure(dict(case, variant="bulk"), s)
        self.measure(dict(case, variant="paged"), s)

    def measure(self, case: dict, s: dict) -> None:
        self.case_no += 1
        g = case_geometry(case)
        t, pools, local = s["t"], s["pools"], s["local"]
        nbytes = pools[0].nbytes if pools else pool_bytes([case], self.opts.pool_factor)
        lay = Layout.fit(case["layout"], g["shape"].layers, g["shape"].regions, g["block_bytes"], nbytes)
        # control plane (untimed): decode reserves its blocks, prefill picks its own; both learn both
        seed = self.opts.seed * 1_000_003 + self.case_no
        mine = {}
        for i, (src, dst) in enumerate(s["pairs"]):
            for side, r in (("src", src), ("dst", dst)):
                if r == self.rank:
                    alloc = BlockAllocator(lay.nblocks, seed=seed * 7919 + r * 2 + (side == "dst"))
                    spec = case["alloc"] if case["variant"] == "paged" else "contiguous"
                    mine[(i, side)] = alloc.allocate(g["nblocks"], spec)
        blocks = {}
        for part in ([mine] if local else self.comm.allgather(mine)):
            blocks.update(part)
        plan = []  # (pair index, src rank, dst rank, per-layer descs)
        for i, (src, dst) in enumerate(s["pairs"]):
            if self.rank not in (src, dst):
                continue
            layers = []
            for layer in range(lay.layers):
                d = layer_descs(lay, lay, blocks[(i, "src")], blocks[(i, "dst")], layer, g["last_bytes"])
                if case["variant"] == "bulk":
                    d = bulk_descs(lay, lay, layer, int(d[:, LEN].sum()))
                elif case["coalesce"] == "on":
                    d = coalesce(d)
                layers.append(np.ascontiguousarray(d))
            plan.append((i, src, dst, layers))
        seconds, nwrong = self.timed(case, t, pools, plan, local)
        self.emit(case, g, lay, plan, seconds, nwrong)

    def timed(self, case, t, pools, plan, local):
        op, o = case["op"], self.opts
        init, serve, notify_to, notify_from = [], [], [], []
        for i, src, dst, layers in plan:
            initiator = src if op == "push" else dst
            if local or initiator == self.rank:
                init.append((dst if op == "push" else src, layers))
            else:
                serve.append((src if op == "push" else dst, layers))
            if op == "push" and not t.caps.notifies and not local:
                (notify_to if src == self.rank else notify_from).append(dst if src == self.rank else src)
        req = self.case_no << 8

        def once(it):
            if self.fault:
                raise TransportError("injected fault (KVBENCH_FAULT)")
            tag0 = ((req + it) & 0xFFFF) << 16
            hs = [t.post(op, p, d, tag0 | k) for p, ls in init for k, d in enumerate(ls)]
            hs += [t.serve(op, p, d, tag0 | k) for p, ls in serve for k, d in enumerate(ls)]
            for h in hs:
                t.wait(h)
            for p in notify_to:
                self.comm.notify(p)
            for p in notify_from:
                self.comm.wait_notify(p)

        watchdog = threading.Timer(o.timeout, self._timeout, args=(case,))
        watchdog.daemon = True
        watchdog.start()
        try:
            seconds = []
            for it in range(o.warmup + o.iters):
                self.comm.barrier()
                t0 = time.perf_counter()
                once(it)
                dt = time.perf_counter() - t0
                if it >= o.warmup:
                    seconds.append(dt)
            nwrong = self.check(case, pools, plan, local, once) if o.check else None
        finally:
            watchdog.cancel()
        return seconds, nwrong

    def check(self, case, pools, plan, local, once) -> int:
        """Poison the destination ranges, transfer once more, count wrong elements."""
        dst_pool = pools[-1] if pools else None
        mine = [(src, layers) for i, src, dst, layers in plan if dst == self.rank]
        for _, layers in mine:
            for d in layers:
                memory.poison(dst_pool.array, d, DST)
        self.comm.barrier()
        once(-1)
        if mine and self.opts.inject_corruption:
            first = mine[0][1][0]
            off = int(first[0, DST])
            n = min(self.opts.inject_corruption, int(first[0, LEN]))
            dst_pool.array[off:off + n] ^= 0xFF
        elem = M.dtype_bytes(case["dtype"])
        return sum(memory.count_wrong(dst_pool.array, d, src, elem) for src, layers in mine for d in layers)

    def _timeout(self, case):
        print(f"kvbench: rank {self.rank}: case {self.case_no} ({case['transport']} {case['op']}) exceeded its "
              f"timeout of {self.opts.timeout:g} s; aborting the job", flush=True)
        self.comm.abort(1)

    # ----- rows --------------------------------------------------------------------------
    def base_row(self, case: dict, g: dict | None = None) -> dict:
        bulk = case.get("variant") == "bulk"
        return {
            "case": self.case_no, "variant": case.get("variant", "paged"), "transport": case["transport"],
            "op": case["op"], "memory": "host", "model": case["model"], "tokens": case["tokens"],
            "prefix_hit": case["prefix_hit"], "block_size": 0 if bulk else case["block_size"],
            "block_bytes": 0 if bulk or g is None else g["block_bytes"], "layout": case["layout"],
            "allocation": "bulk" if bulk else case["alloc"], "coalesce": "bulk" if bulk else case["coalesce"],
            "dtype": case["dtype"], "codec": "none", "overlap": "serial", "scheme": case["scheme"],
            "tp": case["tp"], "pp": case["pp"], "world_size": self.comm.size,
        }

    def emit(self, case, g, lay, plan, seconds, nwrong) -> None:
        rows = []
        if plan:
            i, src, dst, layers = plan[0]
            st = stats(layers)
            role = "both" if src == dst else ("prefill" if src == self.rank else "decode")
            base = dict(self.base_row(case, g), rank=self.rank, role=role, pair=i,
                        payload_bytes=st["payload_bytes"], wire_bytes=st["payload_bytes"],
                        descriptors=st["descriptors"], status="ok", reason="")
            rows = [dict(base, iter=k, seconds=sec, nwrong=None) for k, sec in enumerate(seconds)]
            if nwrong is not None:
                rows.append(dict(base, iter=-1, seconds=float("nan"), nwrong=nwrong if role != "prefill" else 0))
        self.deliver(rows)

    def emit_skipped(self, case: dict, reason: str) -> None:
        self.case_no += 1
        row = dict(self.base_row(dict(case, variant="paged")), rank=self.rank, role="", pair=-1, iter=-1,
                   seconds=float("nan"), payload_bytes=case_geometry(case)["payload"], wire_bytes=0,
                   descriptors=0, status="skipped", reason=reason, nwrong=None)
        self.deliver([row] if self.rank == 0 else [])

    def deliver(self, rows: list[dict]) -> None:
        everything = self.comm.gather(rows)
        if self.rank == 0:
            flat = [r for part in everything for r in part]
            self.total_wrong += sum(r["nwrong"] or 0 for r in flat)
            if self.sink:
                self.sink(flat)


def unavailable_reason(name: str) -> str | None:
    """Probe without raising (for ``kvbench list``)."""
    try:
        return transports.probe(name)
    except Unavailable as exc:
        return str(exc)
