"""The transport protocol: what a transport must do, and nothing about timing.

The harness owns *how* (timing, barriers, checking, printing); a transport
owns *what* (the one data movement).  A transport never imports mpi4py (the
``mpi`` transport alone takes its communicator from ``kvbench.job.comm``) and
never times itself: at most, ``wait`` reports when a completion it saw on a
thread of its own happened (see Completion semantics).

Descriptor arrays
-----------------
Every ``post``/``serve`` receives ``descs``: a C-contiguous ``int64`` numpy array of shape ``(n, 3)`` whose columns
are ``SRC, DST, LEN``: byte offsets into the *source* pool and the *destination* pool, and a byte count.  The source
pool belongs to the prefill rank, the destination pool to the decode rank, whichever side initiates:

* ``op == "push"``: the prefill (source) rank calls ``post``; SRC offsets are
  local, DST offsets are in the peer's pool.  The decode rank calls ``serve``.
* ``op == "pull"``: the decode (destination) rank calls ``post``; SRC offsets
  are in the peer's pool, DST offsets are local.  The prefill rank calls
  ``serve``.

Both sides receive the same array (the harness has already exchanged block
ids), so a two-sided transport knows where to receive.  ``tag`` identifies
(request, layer); two-sided transports put it in their headers so that a
mixed-up stream is detected.

Completion semantics
--------------------
``wait(handle)`` on the *destination* side returns only when the bytes are
visible in the destination pool.  A one-sided transport whose destination
cannot observe completion sets ``Caps.notifies = False`` and the harness adds
its own notification after the initiator's ``wait``; transports that deliver
a notification of their own (two-sided receives, NIXL notifications, RDMA
WRITE_WITH_IMM) set it True and make ``serve`` + ``wait`` block until then.
A transport whose receive thread sees the last byte land returns that
``time.perf_counter()`` from ``wait``; the harness's done time is then the
landing, not the moment the waiting thread was scheduled again (a wake-up
delay that is no part of the transfer; docs/evidence.md).

Prepared posts
--------------
The harness calls ``prepare`` for a layer while the prefill still runs and
``start`` on its result the moment the layer is final; ``post`` is both at
once.  Whatever does not need the layer's bytes (checks, descriptor lists,
headers) belongs in ``prepare``: only ``start`` is on the path the first
token waits for.  The default ``prepare`` does nothing ahead.

Layer-ready signals (pull)
--------------------------
A pull's destination may read a layer only once the source says it is final.
By default the harness sends that as an MPI message and the decode rank's main
loop posts the read when it arrives.  A transport with ``Caps.signals_ready``
carries it on its own channel instead: the destination posts every layer up
front with ``post_when_ready`` and the transport's thread issues each read the
moment the source's ``signal_ready`` for it arrives (a real engine's progress
thread reacting to a NIXL notification or a ready flag).  The harness packs the
signals with ``prepare_signal`` before the layers are final and sends them with
``start_signal``, as it prepares posts.  The signal, the read request and the
data are all still on the measured path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbench import memory
from kvbench.model.descriptors import DST, LEN, SRC
from kvbench.transports.probing import import_probe, rdma_present  # noqa: F401  (the transports import them here)
from kvbench.transports.registration import PerRequest

OPS = ("push", "pull")


class TransportError(RuntimeError):
    """A transfer failed; the harness turns this into a failed rank."""


class Unavailable(Exception):
    """The transport cannot run here; ``str(exc)`` is the one-line reason."""


@dataclass(frozen=True)
class Caps:
    """What a transport can do; the harness skips cases outside these."""

    memory: tuple[str, ...] = ("host",)
    ops: tuple[str, ...] = OPS
    one_sided: bool = True
    multi_node: bool = False
    notifies: bool = False
    local_only: bool = False  # source and destination in one process (loopback)
    network: bool = False  # a pair sharing a host is worth a warning
    signals_ready: bool = False  # pull: layer-ready signals on its own channel (see Layer-ready signals)
    stamps: bool = False  # a receive or progress thread of its own stamps the landing (the completion rule)
    codec_frames: str = ""  # how codec frames cross it (codecs/path.py): "stream" or "doorbell"; "": they cannot
    unregistered: str = ""  # why it registers no memory with a library ("" where it does): its register rows say so
    no_hugetlb: str = ""  # why its pool cannot take --pages huge ("" where it can): its cases are skipped rows


@dataclass
class Context:
    """What the harness tells a transport about the run (never an MPI object)."""

    rank: int
    world_size: int
    hostname: str
    run_id: str  # short, unique per launch; safe in file and segment names
    token: bytes = b""  # per-run secret, generated on rank 0, for listeners
    options: dict[str, Any] = field(default_factory=dict)
    pages: str = "4k"  # page size asked for pools: memory.PAGE_KINDS (a transport's own pool: where it can)
    memory: str = "host"  # the pools' memory kind (memory/device.py): host, torch-cpu, pinned, cuda
    copy: str = "batch"  # copy engine for device bytes (copy.py): memcpy, kernel, batch
    gpu: int = -1  # this rank's GPU (harness/placing.py); -1 without --memory cuda
    nic: str = ""  # the RDMA device nearest that GPU by PCIe affinity ("" where none is)
    netdevs: list = field(default_factory=list)  # --nic: this rank's interfaces, nearest first; nic_rails of them
    nic_rails: int = 1  # used unless told (auto: 1; names: all); duplex: a pair goes both ways (bidir, a matrix)
    duplex: bool = False
    register: str = "once"  # --register: once, or per-request (transports/registration.py)
    reached: bool = True  # peers reach into this rank's pool: under per-request it stays registered once


@dataclass
class Buffer:
    """Memory a transport allocated for a pool (shared segment, MPI window...).

    ``array`` is a page-aligned ``uint8`` numpy view of ``nbytes`` bytes; ``release`` frees it (once, by the pool).
    """

    array: np.ndarray
    release: Any = None


class Transport(PerRequest):
    """Base class with the protocol's defaults. Subclasses set name and caps."""

    name: ClassVar[str] = "?"
    caps: ClassVar[Caps] = Caps()
    # seconds this rank spent inside the library call that moves or queues the bytes during post/start
    # (a send that copies synchronously, a Put, a transfer submission): the rest of the posting time is
    # kvbench's own (costs.py); transports add to it around that one call
    lib_s: float = 0.0
    # post/serve take any descriptor array in one library call, so a request's layers that are final together
    # go as ONE post of their concatenated descriptors (prepare_request); its tag is the last layer's
    batches: ClassVar[bool] = False
    # its registrations (serve, post_when_ready) and prepared posts may be made before the iteration starts
    # (Iteration.run): False where registering starts a clock of its own (staged's stage times)
    ahead: ClassVar[bool] = True
    # an RDMA registration of its pool pins the pool: memory_needs counts it locked where RDMA devices exist
    pins_on_rdma: ClassVar[bool] = False
    # a rank done early sleeps in the barrier after the iteration: its library's threads need its CPU, not its calls
    idle_sleeps: ClassVar[bool] = False

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def probe(cls) -> str | None:
        """Return why this transport cannot run here, or None if it can.

        Must be cheap and must not initialise hardware for long; this is what
        ``kvbench list`` shows.
        """
        return None

    def require(self, pool, kinds: tuple[str, ...] = ("host",)) -> None:
        """An engine's first step in ``register``: Unavailable with ``probe``'s reason when it cannot run here,
        TransportError for a pool of a memory kind it does not take."""
        if reason := self.probe():
            raise Unavailable(reason)
        if pool.kind not in kinds:
            raise TransportError(f"{self.name}: memory kind {pool.kind} not supported ({', '.join(kinds)} only)")

    @classmethod
    def memory_needs(cls, nbytes: int, options: dict) -> dict[str, int]:
        """Besides RAM, what a pool of ``nbytes`` takes on this rank: ``shm`` (bytes in /dev/shm),
        ``locked`` (bytes pinned by registration).  The preflight refuses a run that would not fit.
        By default the whole pool is locked where ``pins_on_rdma`` and an RDMA device exists."""
        return {"locked": nbytes} if cls.pins_on_rdma and rdma_present() else {}

    def alloc(self, nbytes: int) -> Buffer | None:
        """Optionally provide the pool's memory (None: the harness allocates)."""
        return None

    def pages(self, pool) -> dict:
        """Pages of a pool this transport allocated (``alloc``): ``applied``, the page size it asked for
        (``ctx.pages`` where it honours the request, else "own": the library's or the kernel's choice, with a
        ``note`` saying why), and memory.page_report of the pool: what the kernel gave."""
        return dict(memory.page_report(pool.array), applied="own",
                    note=f"{self.name} allocates its own pool; its page size is the library's or the kernel's")

    def register(self, pool) -> bytes:
        """Register ``pool`` once; return opaque metadata for the peers.

        ``pool.array`` is the ``uint8`` view, ``pool.addr`` its address,
        ``pool.nbytes`` its size, ``pool.kind`` its memory kind.
        """
        return b""

    def register_region(self, pool):
        """--pool-sizes: after ``ready``, register one more region with the library (collective where ``register``
        is); a handle for ``deregister_region``.  None: this transport has no such registration to sweep."""
        return None

    def deregister_region(self, handle) -> None:
        """Undo ``register_region``."""

    def connect(self, peers: dict[int, bytes]) -> None:
        """Connect to ``peers`` (rank -> metadata from their ``register``)."""

    def ready(self) -> None:
        """Called after every rank has connected (after a barrier)."""

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Initiate ``op`` with ``peer``; non-blocking; return a handle."""
        raise NotImplementedError

    def prepare(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Everything ``post`` can do before the layer is final (checks, descriptor lists, headers).

        The harness prepares a layer's post while the prefill still runs and calls ``start`` the
        moment the layer is final, as an engine builds its transfer requests ahead (NIXL's prepped
        lists): only ``start`` is on the path a user's first token waits for.  Default: nothing ahead.
        """
        return op, peer, descs, tag

    def start(self, prepared):
        """Post what ``prepare`` returned; non-blocking; a handle for ``wait`` (as ``post``)."""
        return self.post(*prepared)

    def prepare_request(self, op: str, peer: int, layers: list[np.ndarray], tags: list[int]):
        """``prepare`` for several layers of one request that are final together (serial posts: all of them;
        streaming: one).  A transport that can post them in ONE native call (one transfer list, one batch,
        one vectored write) returns its own object and answers ``start_request`` and ``serve_request`` in
        kind; the default is a list of per-layer ``prepare`` results."""
        if (one := self.one_post(layers)) is not None:
            return _Whole(self.prepare(op, peer, one, tags[-1]))
        return [self.prepare(op, peer, d, t) for d, t in zip(layers, tags)]

    def start_request(self, prepared) -> list:
        """Post what ``prepare_request`` returned; the handles ``wait`` takes (one, or one per layer)."""
        if isinstance(prepared, _Whole):
            return [self.start(prepared.prepared)]
        return [self.start(p) for p in prepared]

    def serve_request(self, op: str, peer: int, layers: list[np.ndarray], tags: list[int]) -> list:
        """Target side of ``prepare_request``: the handles to wait for (default: ``serve`` per layer)."""
        if (one := self.one_post(layers)) is not None:
            return [self.serve(op, peer, one, tags[-1])]
        return [self.serve(op, peer, d, t) for d, t in zip(layers, tags)]

    def one_post(self, layers: list[np.ndarray]) -> np.ndarray | None:
        """The layers' descriptor arrays joined into one post, or None where they go layer by layer (a
        transport that does not batch, one layer, or the same array twice: the hot variant re-sends one
        buffer, and one two-sided receive may not land twice on the same bytes).  Built once per list of
        arrays: the harness reuses them every iteration and never changes them in place; the cache holds
        them, so their ids stay theirs."""
        if not self.batches or len(layers) < 2:
            return None
        # the harness passes the same list every iteration: found by its identity without a step per layer
        hit = self.__dict__.get("_joined_lists", {}).get(id(layers))
        if hit is not None and hit[0] is layers:
            return hit[1]
        joined = self._join(layers)  # may clear the caches: the dict is looked up again below
        fast = self.__dict__.setdefault("_joined_lists", {})
        if len(fast) >= 256:
            fast.clear()
        fast[id(layers)] = (layers, joined)
        return joined

    def _join(self, layers: list[np.ndarray]) -> np.ndarray | None:
        """``one_post`` for a list seen for the first time: the joined array, cached by the arrays' ids."""
        cache = self.__dict__.setdefault("_joined", {})
        key = tuple(id(d) for d in layers)
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= 4096:
                cache.clear()
                self.__dict__["_layers_in"] = {}
                self.__dict__["_joined_lists"] = {}
            distinct = len(set(key)) == len(key)
            hit = cache[key] = (layers, np.ascontiguousarray(np.concatenate(layers)) if distinct else None)
            if distinct:
                self.__dict__.setdefault("_layers_in", {})[id(hit[1])] = len(layers)
        return hit[1]

    def layers_in(self, descs: np.ndarray) -> int:
        """How many layers ``descs`` joins (1 for one layer's array)."""
        return self.__dict__.get("_layers_in", {}).get(id(descs), 1)

    def serve(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        """Target side of ``op`` (one-sided transports: nothing to do)."""
        return None

    def answer(self, handle) -> None:
        """Pull source: the layer of ``handle`` (from ``serve``) is final and its destination was told so.
        A two-sided transport whose source sends the data starts the send here, once the destination's
        request for it has arrived (a pull is the destination asking), never at ``serve``; others do nothing."""

    def post_when_ready(self, peer: int, descs: np.ndarray, tag: int = 0):
        """Pull initiator: read layer ``tag`` as soon as ``peer`` signals it final; non-blocking; a handle
        for ``wait`` (only with ``caps.signals_ready``)."""
        raise NotImplementedError

    def signal_ready(self, peer: int, tags: list[int]) -> None:
        """Pull source: tell ``peer`` that the layers ``tags`` are final, in the order it posted them
        (only with ``caps.signals_ready``): ``start_signal(prepare_signal(peer, tags))``."""
        self.start_signal(self.prepare_signal(peer, tags))

    def prepare_signal(self, peer: int, tags: list[int]):
        """What ``signal_ready`` can do before the layers are final (the messages, packed), as ``prepare``
        is to ``post``; only with ``caps.signals_ready``."""
        raise NotImplementedError

    def start_signal(self, prepared) -> None:
        """Send what ``prepare_signal`` returned: the layers are final now."""
        raise NotImplementedError

    def wait(self, handle) -> float | None:
        """Block until ``handle`` is complete; raise TransportError on failure.

        Returns None, or the ``time.perf_counter()`` at which the operation completed when the
        transport saw that on another thread (a receive thread): a diagnostic the harness compares with
        its own time (the row's stamp_lead_s); the headline ends when this call returned.
        """

    def info(self) -> dict[str, Any]:
        """Facts for the result metadata (library versions, selected paths)."""
        return {}

    def close(self) -> None:
        """Release connections and registrations. Must be idempotent."""


class _Whole:
    """A request's layers prepared as one post (``Transport.prepare_request``)."""

    __slots__ = ("prepared",)

    def __init__(self, prepared):
        self.prepared = prepared


def check_descs(descs: np.ndarray, src_nbytes: int, dst_nbytes: int) -> None:
    """Raise TransportError unless every descriptor lies inside both pools."""
    if descs.dtype != np.int64 or descs.ndim != 2 or descs.shape[1] != 3:
        raise TransportError(f"descriptors must be int64 (n, 3), got {descs.dtype} {descs.shape}")
    if len(descs) == 0:
        return
    if len(descs) <= 8:  # bulk and coalesced layers: on a few rows plain integers cost less than numpy reductions
        for s, d, n in descs.tolist():
            if s < 0 or d < 0 or n <= 0:
                raise TransportError("descriptor with a negative offset or non-positive length")
            if s + n > src_nbytes:
                raise TransportError("descriptor past the end of the source pool")
            if d + n > dst_nbytes:
                raise TransportError("descriptor past the end of the destination pool")
        return
    lo = descs.min(axis=0)
    if lo[SRC] < 0 or lo[DST] < 0 or lo[LEN] <= 0:
        raise TransportError("descriptor with a negative offset or non-positive length")
    if (descs[:, SRC] + descs[:, LEN]).max() > src_nbytes:
        raise TransportError("descriptor past the end of the source pool")
    if (descs[:, DST] + descs[:, LEN]).max() > dst_nbytes:
        raise TransportError("descriptor past the end of the destination pool")


def wait_landed(t: Transport, handles: list) -> tuple[float, bool]:
    """Wait for every handle, the last posted first; (the perf_counter time the last one completed, whether
    that time is the transport's own stamp).

    Where a transport has a receive or progress thread of its own, that thread may stamp the landing (``wait``
    returns the time); otherwise the moment ``wait`` returns is the stamp (now, when there are no handles).  The
    harness's headline is always its own time, when the wait returned: a transport's stamp is a diagnostic
    (the row's stamp_lead_s, judged in results/bounds.py).  On an in-order transport the earlier handles are
    then already done, so the waiting thread wakes once, not once per layer.
    """
    landed, stamped = 0.0, False
    for h in reversed(handles):
        at = t.wait(h)
        if at is not None:
            stamped = True
        landed = max(landed, time.perf_counter() if at is None else at)
    return (landed or time.perf_counter()), stamped
