"""The harness's named state: the run's ``Options``, a transport's ``Session``, a case's ``Measurement`` and the ``Record`` of one timed
iteration, in place of dicts that grow keys across files and positional tuples.

Plain data: the loop (loop.py) fills them, its helpers (requests, checkpass, rows) read what they need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvbench.model.layout import Pool
from kvbench.model.schemes import Entry


@dataclass
class Session:
    """One transport's connection on this rank, shared by all its cases."""

    t: Any  # the connected transport
    pools: list[Pool]  # this rank's pools: one, or a source and a destination pool for a local-only transport
    pairs: list[tuple[int, int]]  # the (source, destination) pairs this transport serves
    local: bool  # source and destination in one process
    nbytes: int  # KV bytes of each pool (codec staging comes after them)
    bulk: set = field(default_factory=set)  # the payloads whose references (bulk, ceiling, hot) are measured
    codec: Any = None  # the codec machinery (codecs/path.py Session) when a case carries a codec
    fill: tuple = ("pattern", None)  # what the pools hold now: (fill, dtype)
    # seconds a landing stamp may precede its wait's return here, and the p99 wake-up it came from (bounds.py)
    wake: tuple[float, float] = (float("nan"), float("nan"))
    ifname: str | None = None  # the network interface the transport says it uses (tcp), for the link-rate bound
    cells: list | None = None  # --scheme matrix/bidir: per pair its matrix cell (its tokens; model/matrix.py)


class Record(NamedTuple):
    """One timed iteration on this rank: per entry when its part was done and its exposed time."""

    done: list  # per entry: seconds from the iteration's start to its completion
    harness_s: float  # the iteration's time outside the transfers (the rows' harness_seconds)
    handshake_s: float
    exposed: list  # per entry: seconds after its source's prefill ended (None where this rank is no destination)
    round: int  # the turn it was measured in (rounds > 1)


class _NoCopies:
    """A Measurement built without the harness's copies beside its iterations (harness/bounds.Beside): none made."""

    gbps: dict = {}

    def copy(self) -> None:
        pass


NO_COPIES = _NoCopies()


@dataclass
class Measurement:
    """One case on this rank: its plan and iteration, then what each timed iteration recorded."""

    no: int  # the case's number in the run
    case: dict
    g: dict  # the case's geometry (requests.case_geometry)
    entries: list[Entry]
    itr: Any  # its schedule.Iteration
    cache: Any = None  # the --cache setter (memory/cachestate.py), None for as-is
    codec: list | None = None  # per timed iteration the codec's stats; None without a codec
    next: int = 0  # the next iteration's number (tags stay distinct across rounds)
    rec: list[Record] = field(default_factory=list)
    took: list = field(default_factory=list)  # per timed iteration: a real prefill's measured seconds per source
    cost: list = field(default_factory=list)  # per timed iteration: time outside the wire (results/costs.py)
    t0s: list[float] = field(default_factory=list)  # per timed iteration: this rank's barrier exit
    cache_set: list[bool] = field(default_factory=list)  # per timed iteration: did it start with the bytes set
    stages: list = field(default_factory=list)  # per timed iteration: a staged transport's per-stage seconds
    warm: bool = False  # its first iterations are done (resources sampled)
    mid: bool = False  # half-way (resources sampled)
    clock: dict = field(default_factory=dict)  # per source: skews, error bound, offset (checkpass.one_clock)
    errors: dict = field(default_factory=dict)  # a lossy codec's check: id(entry) -> (wrong, max abs, max rel)
    spent: float = 0.0  # seconds in its iterations so far, warm-ups included (--ci-budget; calibrate.py)
    ran: int = 0  # iterations so far, warm-ups included
    every: Any = None  # -c all: the check of every timed iteration (checkpass.Every)
    bounds: dict = field(default_factory=dict)  # id(entry) -> (GB/s its path can carry, kind) (harness/bounds.py)
    beside: Any = field(default_factory=lambda: NO_COPIES)  # the harness's copies beside each timed iteration
    first: list | None = None  # per entry in the iteration's order: its first transfer's seconds (setuprows.py)
    rail_wire: dict = field(default_factory=dict)  # per peer and rail: kernel-counted [sent, received] bytes, timed
    sockets: dict = field(default_factory=dict)  # per interface: this process's TCP [sent, received] bytes, timed
    sock_before: dict | None = None  # this process's TCP connections' counts before the timed iterations under way
    timed: int = 0  # timed iterations so far (the rail counts' divisor)
    rails_before: dict | None = None  # the rails' kernel counts before the timed iterations under way (carriage.py)
    nic_before: dict | None = None  # every NIC's counters before the timed iterations under way (carriage.py)
    nic_moved: dict | None = None  # per NIC (tx, rx) bytes over the case's timed iterations so far
    wire: list = field(default_factory=list)  # per timed iteration: per peer the counted (sent, received) bytes
    wire_before: dict | None = None  # the transport's wire count at the last sample (harness/wirerows.py)


class UserError(ValueError):
    """A mistake in the request (not a failure of the machine): one line, exit 1."""


@dataclass
class Options:
    iters: int = 20
    warmup: int = 3
    check: bool | str = True  # False, True (the check pass after timing) or "all" (every timed iteration too)
    seed: int = 0
    pool_factor: float = 2.0
    timeout: float = 600.0
    setup_timeout: float | None = None  # None: derived from the pool bytes (preflight.setup_seconds)
    pages: str = "4k"  # host pools kvbench allocates: 4k, thp or huge (memory.PAGE_KINDS)
    variants: tuple = ("bulk", "paged")
    rounds: int = 1  # >1: a transport's cases take turns, iters/rounds iterations at a time
    inject_corruption: int = 0  # fault injection: flip this many destination bytes before verifying
    fill: str = "pattern"  # pool contents: pattern, realistic, file:<dump> (memory/values.py)
    cache: str = "as-is"  # where a request's bytes are when its iteration starts (cachestate.py)
    gpu_map: list | None = None  # --gpu-map: per local rank, its GPU (memory/placement.py)
    target_ci: float | None = None  # --target-ci (% of p50) and --ci-budget (s per case): calibrate.py
    ci_budget: float = 60.0
    pool_sizes: tuple = ()  # --pool-sizes: bytes of each pool whose registration is swept (setuprows.py)
    transport_options: dict = field(default_factory=dict)
    matrix: Any = None  # --scheme matrix: --matrix's cells or name (model/matrix.py)
