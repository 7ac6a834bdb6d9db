"""The one timing loop: pools, registration, warm-up, barrier, iterations; then the check and the rows.

Beside it: requests.py (a case's geometry, pool size, plan), checkpass.py (the clock match and the check after
the timed iterations), rows.py (result rows), carriage.py (the NICs' counters).  The harness owns *how* a case is
measured; transports own *what* moves.  An iteration starts when a barrier ends.  Each rank records, per request,
when its part was complete (a destination: the bytes visible in its pool); the headline per request is the max
over the two ranks of its pair, computed when results are read.
"""
from __future__ import annotations

import secrets
import time
from itertools import groupby

from kvbench import memory, transports
from kvbench.codecs.path import codec_refused, codec_staging, codec_transport, fill_pools
from kvbench.fabric import procsock
from kvbench.harness import bounds, checkpass, flows, placing, preflight, railrows, registering, requests, setuprows
from kvbench.harness.calibrate import Calibration
from kvbench.harness.carriage import Carrying
from kvbench.harness.preflight import device_reason
from kvbench.harness.requests import case_geometry, case_label, pool_bytes
from kvbench.harness.rows import Rows
from kvbench.harness.schedule import Iteration
from kvbench.harness.state import Measurement, Options, Record, Session, UserError
from kvbench.harness.tprequests import pair_sets, session_tp
from kvbench.harness.tprequests import pairs as tp_pairs
from kvbench.harness.variants import of as case_variants
from kvbench.job import faults
from kvbench.job.guard import GUARD
from kvbench.memory import cachestate, keyed
from kvbench.model.layout import Pool
from kvbench.model.schemes import Entry, SchemeError, flow_cells, max_entries_per_rank
from kvbench.results import costs
from kvbench.transports.base import Context, TransportError


class Harness(Rows, Calibration, Carrying):
    """Runs expanded cases on every rank; rank 0 gets the rows through ``sink``."""

    def __init__(self, comm, opts: Options, sink=None):
        self.comm, self.opts, self.sink = comm, opts, sink
        self.rank = comm.rank
        # the run's id, the transports' rendezvous token and the content's secret (never handed to a transport)
        self.run_id, self.token, secret = comm.bcast(
            (secrets.token_hex(4), secrets.token_bytes(16), secrets.randbits(64)) if self.rank == 0 else None)
        keyed.secret(secret)
        # where a pair's path is meant to run: one host and one network namespace (a lab's nodes are namespaces);
        # a pair on one host moves bytes through memory (bounds.py)
        self.places = comm.allgather(f"{comm.hostname}#{procsock.netns()}")
        self.hosts = [p.rpartition("#")[0] for p in self.places]
        self.case_no = 0
        self.transport_info: dict[str, list] = {}  # name -> info() of every rank (rank 0 only)
        self.resources: list[dict] = []  # RSS and open files per rank around each transport's cases
        self.on_group_done = None  # rank 0: called with a transport's name once all its rows are stored
        self.placement: list[dict] | None = None  # every rank's GPU and NIC (placing.place, before preflight)
        self.check_s = self.timed_s = 0.0  # this rank's seconds verifying (outside the timed windows), and timed
        self.setup_rows: list[dict] = []  # this rank's setup rows of the transport, until its first case's rows go
        self.cells: list[str] | None = None  # --scheme matrix/bidir: per pair its matrix cell (flows.py)
        self.flow_state: dict = {}  # rank 0: each flow's isolated time until its congested rows (flows.derive)
        self.extra_meta: dict = {}  # rank 0: more sidecar fields (registering.count: per_request)

    def my_place(self) -> dict:  # this rank's placement (placing.place), or NO_GPU before it or without one
        return self.placement[self.rank] if self.placement else placing.NO_GPU

    def set_sink(self, sink) -> None:  # rank 0: where finished cases' rows go
        self.sink = sink

    # ----- whole run ---------------------------------------------------------------------
    def preflight(self, cases: list[dict], scheme: str) -> None:
        """Refuse, before anything is allocated or written, pools that do not fit (collective)."""
        try:
            entries = max(max_entries_per_rank(p, 1) for p in pair_sets(cases, scheme, self.comm.size, self.opts.matrix))
            self.cells = flow_cells(scheme, self.comm.size, self.opts.matrix)
        except SchemeError as exc:
            raise UserError(str(exc)) from None
        groups = []
        for (name, kind), g in groupby(cases, key=lambda c: (c["transport"], c.get("memory", "host"))):
            g = list(g)
            layer = max(requests.layer_bytes(c, self.cells) for c in g)
            groups.append((name, self.pool_size(g, entries), layer, kind))
        why = preflight.check(self.comm, groups, self.opts.transport_options, self.opts.pages, self.my_place(),
                              max(self.opts.pool_sizes, default=0))
        if why:
            raise UserError(why)
        self.check_routes(cases, scheme)  # pinned NICs: one that does not exist, a route leaving by another

    def run(self, cases: list[dict], scheme: str) -> None:
        try:
            pairs = pair_sets(cases, scheme, self.comm.size, self.opts.matrix)[0]  # --tp P:D: each case's own
            self.cells = flow_cells(scheme, self.comm.size, self.opts.matrix)
        except SchemeError as exc:
            raise UserError(str(exc)) from None
        faults.at("before-setup", self.rank)
        for i, (name, group) in enumerate(groupby(cases, key=lambda c: c["transport"])):
            if i:
                faults.at("between-transports", self.rank)
            # one pool and one transport per (memory kind, copy engine, --register): a pool's kind is fixed at allocation
            for _, sub in groupby(group, key=lambda c: (registering.session_key(c), session_tp(c))):
                sub = list(sub)
                self.run_transport(name, sub, tp_pairs(sub[0]) or pairs)
            if self.on_group_done is not None:
                self.on_group_done(name)
        faults.at("after-last", self.rank)
        self.resources = [x for part in self.comm.gather(self.resources) or [] for x in part]
        self.check_cost = self.comm.gather((self.check_s, self.timed_s))  # rank 0: per rank (verifying, timed) s

    def sample(self, group: str, phase: str, case: int = 0) -> None:
        """This rank's resident memory and open files now, the last per (case, phase) kept (the soak reads them)."""
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
                reason = device_reason(cls, cases[0]) or registering.reason(cls, cases[0]) or (
                    f"--pages huge: {cls.caps.no_hugetlb}" if self.opts.pages == "huge" and cls.caps.no_hugetlb else None)
        reasons = [r for r in self.comm.allgather(reason) if r]
        if reasons:
            for case in cases:
                self.emit_skipped(case, f"unavailable: {reasons[0]}")
                GUARD.disarm()  # a skipped case is a case that ended: the deadline between cases runs from here
            return
        local = cls.caps.local_only
        my_pairs = [(0, 0)] if local else pairs
        token = self.token if not faults.armed("token", self.rank) else bytes(16)
        ctx = Context(self.rank, self.comm.size, self.comm.hostname, self.run_id, token,
                      dict(self.opts.transport_options.get(name, {})), pages=self.opts.pages,
                      memory=cases[0].get("memory", "host"), copy=cases[0].get("copy", "batch"),
                      register=cases[0].get("register", "once"), reached=registering.reached(self.rank, cases[0]["op"], pairs),
                      **placing.context_fields(self.my_place(), self.rank, pairs))
        entries = 1 if local else max_entries_per_rank(pairs, 1)
        nbytes = self.pool_size(cases, entries)
        staging = codec_staging(name, cases, my_pairs, case_geometry)  # codec cases: frames' slots after the KV bytes
        GUARD.case = f"setup of {name}"
        sweep = self.opts.pool_sizes if setuprows.sweepable(cls) else ()
        GUARD.arm(f"setup of {name} (allocate and fill {nbytes / 2**30:.2f} GiB, register, connect"
                  + (", --pool-sizes)" if sweep else ")"),
                  self.opts.setup_timeout or preflight.setup_seconds(nbytes + sum(sweep)))
        t = cls(ctx)
        pools: list[Pool] = []
        ph = setuprows.Phases()
        try:
            active = not local or self.rank == 0
            if active:
                pools.append(setuprows.alloc_pool(self, t, nbytes + staging, ctx.memory, ph))
                if local:
                    a = time.perf_counter()
                    pools.append(Pool(memory.alloc_host(nbytes, pages=self.opts.pages)))
                    ph.add("alloc", time.perf_counter() - a, nbytes)
                metas = []
                for p in pools:  # once per pool, never per request
                    a = time.perf_counter()
                    metas.append(t.register(p))
                    ph.add("register", time.perf_counter() - a, p.nbytes, reason=registering.setup_note(t))
                register_s = sum(g[1] for g in ph.got if g[0] == "register")
            c0 = time.perf_counter()
            peers = {}
            if not local:
                allm = self.comm.allgather(metas[0])
                ph.add("exchange", time.perf_counter() - c0)
                for s, d in pairs:
                    if self.rank in (s, d):
                        other = d if s == self.rank else s
                        peers[other] = allm[other]
                faults.at("connect", self.rank)
            a = time.perf_counter()
            if active:
                t.connect(peers)
            took = time.perf_counter() - a
            self.comm.barrier()
            a = time.perf_counter()
            t.ready()
            if active:  # this rank's own calls: the barrier's wait for the slowest rank is in nobody's row
                ph.connect(took + time.perf_counter() - a, sorted(peers))
            connect_s = time.perf_counter() - c0
            if active:
                setuprows.sweep(self, t, self.opts.pool_sizes, ctx.memory, not local, ph)
            infos = self.comm.gather(dict(t.info(), register_s=register_s, connect_s=connect_s, pool_bytes=nbytes,
                                          completion="transport" if t.caps.stamps else "harness",
                                          pages=setuprows.pages_of(t, pools, self.opts.pages))
                                if active else None)
            if self.rank == 0:
                self.transport_info[name] = infos
            GUARD.disarm()
            GUARD.retake()  # a transport's library may have taken a signal (UCX: SIGHUP)
            self.sample(name, "ready")
            self.setup_rows = ph.rows(dict(self.base_row(dict(cases[0], variant="setup"), no=0), rank=self.rank,
                                           role="", pair=-1, req=0, payload_bytes=0, wire_bytes=0, descriptors=0,
                                           completion=""))
            session = Session(t, pools, my_pairs, local, nbytes, wake=bounds.setup_wake(t, self.rank, self.hosts),
                              ifname=t.info().get("ifname") if active else None, cells=None if local else self.cells)
            if staging and active:
                from kvbench.codecs.path import Session as CodecSession

                session.codec = CodecSession(t, pools[0].array, nbytes, my_pairs, self.rank)
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
            if any(self.comm.allgather(bool(self.setup_rows))):  # no case took them (all skipped; a workload)
                self.deliver(self.take_setup(self.case_no), setup=True)
            # one-sided peers may still be reading our pool: nobody closes until everybody is done
            with GUARD.deadline(f"the end of {name}'s cases (barrier)", self.opts.timeout):
                self.comm.barrier()
                registering.count(self, t, cases[0], active)
        except Exception as exc:  # the exit path before this rank's pools go: a peer opening them would be named instead
            GUARD.fail_early(exc)
            raise
        finally:
            if "session" in locals() and session.codec is not None:
                session.codec.close()
            t.close()
            for p in pools:
                p.release()
        GUARD.case = ""  # (kept when an exception passes: the one line names the case)
        self.sample(name, "closed")

    def base_row(self, case: dict, g: dict | None = None, no: int | None = None) -> dict:
        """rows.py's row, with --tp P:D's head layout beside its tp (schema 10; "" at one TP degree)."""
        return dict(super().base_row(case, g, no), head_layout=case.get("head_layout", ""))

    def pool_size(self, cases: list[dict], entries: int) -> int:
        """Bytes of each rank's pool for a transport's cases (subclasses size it differently)."""
        return pool_bytes([flows.largest(c, self.cells) for c in cases], self.opts.pool_factor, entries)

    # ----- one case ----------------------------------------------------------------------
    def variants(self, case: dict, s: Session) -> list[dict]:
        """What a case measures: its references once per payload, then the paged transfer (variants.py)."""
        return case_variants(case, s, self.opts.variants)

    def run_case(self, case: dict, s: Session) -> None:
        for v in self.variants(case, s):
            self.measure(v, s)

    def run_rounds(self, cases: list[dict], s: Session) -> None:
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
            self.calibrate(m, s)
            self.finish(m, s)

    def plan(self, case: dict, g: dict, s: Session) -> list[Entry]:
        """Control plane (untimed): the case's entries (requests.py)."""
        return requests.plan(self.comm, self.rank, self.opts.seed * 1_000_003 + self.case_no, case, g, s)

    def measure(self, case: dict, s: Session) -> None:
        m = self.prepare(case, s)
        self.iterate(m, s, self.opts.warmup, self.opts.iters)
        self.calibrate(m, s)
        self.finish(m, s)

    def prepare(self, case: dict, s: Session) -> Measurement:
        """Number the case, plan its requests (untimed) and build its iteration."""
        self.case_no += 1
        GUARD.case = case_label(self.case_no, case)
        g = case_geometry(case)
        entries = flows.only(case, self.plan(case, g, s))  # a matrix's flow alone: the others wait at barriers
        s.fill = fill_pools(s.pools, self.rank, s.fill, (self.opts.fill, case["dtype"]))
        t = codec_transport(self.comm, s.t, s.codec, case, g, s.pairs)
        itr = Iteration(t, self.comm, self.rank, entries, case, s.local)
        m = Measurement(self.case_no, case, g, entries, itr, codec=[] if t is not s.t else None,
                        cache=cachestate.make(self.opts.cache, s.pools, entries, self.rank, s.local),
                        bounds=bounds.entry_bounds(entries, self.rank, self.hosts, s.pools, s.ifname),
                        beside=bounds.Beside(self, entries, s.pools, case["variant"]))
        if self.opts.check == "all" and s.pools:  # -c all: every timed iteration checked (checkpass.Every)
            m.every = checkpass.Every(self.rank, m, s.pools, s.nbytes)
        return m

    def _once(self, m: Measurement, it: int):
        if faults.armed("post", self.rank, m.no):  # inert unless KVBENCH_FAULT names this rank
            raise TransportError("injected fault (KVBENCH_FAULT)")

        def start():  # the iteration starts when the barrier ends (Iteration.run first does what may precede it)
            if m.cache is not None:  # --cache warm/cold: the request's bytes where asked, last thing before it
                m.cache.apply()
            self.comm.barrier()
            # faults armed for a case strike as its transfers start (inert unless KVBENCH_FAULT is set)
            faults.at("case" if it >= 0 else "check", self.rank, m.no)
            if it >= 1:  # the peer is in the middle of this case's transfers
                faults.hit("kill", self.rank, m.no)

        # timed iterations and the check pass (it -1) alike: the same calls in the same order
        return m.itr.run((((m.no << 8) + it) & 0xFFFF) << 16, start)

    def _watchdog(self, no: int, case: dict) -> None:
        GUARD.case = case_label(no, case)
        GUARD.arm(f"case {no} (--timeout)", self.opts.timeout)

    def iterate(self, m: Measurement, s: Session, warmup: int, iters: int, rnd: int = 0) -> None:
        """``warmup`` untimed then ``iters`` timed iterations; each starts when a barrier ends."""
        itr, began = m.itr, time.perf_counter()
        self._watchdog(m.no, m.case)
        try:
            for k in range(warmup + iters):
                cache0 = m.cache.count if m.cache is not None else 0
                every = m.every if k >= warmup else None  # -c all: this timed iteration is checked
                if k == warmup:  # the NICs' and rails' (railrows.py) counters before the first timed iteration
                    self.nic_mark(m, s.t)
                if every is not None:
                    every.before(m.next)
                done, inside, hs, offset = self._once(m, m.next)  # from the end of a barrier
                if m.next == 0:  # the case's first transfer, the cold one (setuprows.py)
                    m.first = list(done)
                t0 = itr.t0
                total = time.perf_counter() - t0
                if every is not None:  # its last completion: the copy aside comes before any word from a peer
                    every.landed()
                # every rank done before any rank's bookkeeping (and --cache setting): a pull's source is done
                # first, and its work would otherwise share the CPU caches with its peer's timed transfer
                # asleep where the transport asks: a pull's source would otherwise spin beside its library's threads
                (self.comm.barrier_asleep if s.t.idle_sleeps else self.comm.barrier)()
                if every is not None:
                    every.count()
                stages = self.after_iteration(m, s.t, k >= warmup)  # staged: per-stage seconds; tcp: its wire count
                m.next += 1  # tags stay distinct across rounds
                stats = s.codec.take_stats() if m.codec is not None else None
                ends, took = itr.prefill_ends(offset)  # per source: its prefill's end (real: measured there)
                if k >= warmup:  # per timed iteration: done per entry, harness overhead, handshake, exposed
                    m.beside.copy()  # the harness's own copy of the same bytes, beside this iteration (bounds.py)
                    self.timed_s += total
                    exposed = [d - ends.get(e.src, itr.prefill_s) if e.dst == self.rank else None
                               for d, e in zip(done, itr.order)]
                    m.took.append(took)
                    m.rec.append(Record(done, total - inside, hs, exposed, rnd))
                    if stats is not None:
                        m.codec.append(stats)
                    m.cost.append(itr.cost)  # time outside the wire (costs.py)
                    m.t0s.append(t0)
                    if m.cache is not None:  # did this iteration start with the bytes set (the rows' cache_bytes)
                        m.cache_set.append(m.cache.count - cache0 == 1)
                    m.stages.append(stages)
                if k + 1 == max(warmup, 1) and not m.warm:  # once per case: its first iterations done
                    m.warm = True
                    self.sample(m.case["transport"], "warm", m.no)
                if k + 1 == warmup + iters // 2 and not m.mid:  # half-way: the steady state's start
                    m.mid = True
                    self.sample(m.case["transport"], "mid", m.no)
            self.nic_take(m, s.t, iters)
        finally:
            GUARD.disarm()
        m.spent, m.ran = m.spent + time.perf_counter() - began, m.ran + warmup + iters  # --ci-budget's clock
        self.sample(m.case["transport"], "end", m.no)

    def finish(self, m: Measurement, s: Session) -> None:
        """Check every byte (if asked), then deliver the case's rows."""
        case, entries, itr = m.case, m.entries, m.itr
        nwrong = None
        self._watchdog(m.no, m.case)
        try:
            m.clock = checkpass.one_clock(self.comm, self.rank, m)
            a = time.perf_counter()
            if self.opts.check:
                nwrong = checkpass.check(self.comm, self.rank, m, s.pools, self._once, self.opts.inject_corruption)
            self.check_s += time.perf_counter() - a + (m.every.seconds if m.every is not None else 0.0)
            wake_and_paths = bounds.after_case(m, s)  # bounds on its times
        finally:
            GUARD.disarm()
        faults.at("between-cases", self.rank, m.no)  # before its rows reach rank 0 (a gather)
        # rows follow `entries`; the iteration completed them in `itr.order`
        pos = [itr.order.index(e) for e in entries]
        rec = [r._replace(done=[r.done[p] for p in pos], exposed=[r.exposed[p] for p in pos]) for r in m.rec]
        self.emit(case, m.g, entries, rec, nwrong, m.no, m.clock, [itr.rule.get(id(e), "") for e in entries],
                  m.codec, {entries.index(e): v for e in entries for k, v in m.errors.items() if k == id(e)},
                  stages=m.stages, cost=costs.reorder(m.cost, pos), took=m.took,
                  cache=(m.cache.per_entry, m.cache_set) if m.cache is not None else None,
                  every=m.every.wrong if m.every is not None else None, bounds=wake_and_paths,
                  first=[m.first[p] for p in pos] if m.first else None, carry=self.carrier_columns(m, s),
                  rails=railrows.columns(s.t, itr, entries, self.rank, m.rail_wire, m.timed, m.sockets), wire=m.wire)
