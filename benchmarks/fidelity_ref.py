"""Plain references for kvbench's rows, with no kvbench code: each library alone, the fewest calls.

What ``benchmarks/fidelity.py`` divides kvbench's numbers by.  Each reference
moves what one kvbench request moves, from rank 0's pool (the prefill, the
source) into rank 1's (the decode, the destination): LAYERS layers of SIZE
bytes, each layer in its own span of 2 x SIZE bytes of a page-aligned,
pre-faulted pool (kvbench's layer-major pools at --pool-factor 2; with several
--sizes, 2 x the largest, as kvbench sizes one launch's pool), as

* ``bulk``: one descriptor per layer at the start of its span (kvbench's bulk rows);
* ``paged``: SIZE / BLOCK blocks of BLOCK bytes per layer at random places of its
  span, chosen independently on both sides and listed in that random order on both
  (kvbench's paged rows: random allocation, block tables in request order).

An iteration starts when a barrier ends; each rank stops its clock when its part
is done and the destination's part ends when it knows the bytes landed (its own
receive completed, or the initiator's notification arrived: the same completion
rule as kvbench).  As kvbench does, the destination's times are moved onto the
source's clock after timing: a ping-pong (the best of 8 round trips) gives the
clocks' offset, and each iteration's barrier-exit skew (the destination's exit
minus the source's) is added to the destination's time; the iteration's time is
then the max over the two ranks, GB/s = SIZE x LAYERS / the median time (GB = 1e9 B).  ``push``: the source initiates;
``pull``: the source says the layers are final (one zero-byte MPI message, as
kvbench's harness does) and the destination initiates.  Descriptors are built
and handed to the library before timing (prepared lists, datatypes, iovecs); a
two-sided reference that cannot send scattered blocks packs them (numpy take /
put), as kvbench must.  After timing the destination checks every byte.

* ``tcp``: one socket; per request one ``sendmsg`` / ``recvmsg_into`` per 1024
  ranges (IOV_MAX); pull: a one-byte request first (fidelity_tcp.py).
* ``mpi``: RMA on Win.Allocate windows, one Lock_all epoch; a request is its
  layers' contiguous Puts (Gets) when a layer has at most 4 ranges (MPICH copies
  non-contiguous datatypes through a bounce buffer) or ONE Put (Get) of hindexed
  datatypes, one Flush, then (push) a zero-byte Send, after which the target Win.Syncs.
* ``mpi-sendrecv``: one Isend / Irecv of hindexed datatypes per request; pull:
  a zero-byte request first.
* ``nixl``, ``ucx``, ``mooncake``: fidelity_ref_engines.py.

    mpiexec -n 2 python benchmarks/fidelity_ref.py --refs tcp --ops push,pull --variants bulk,paged \\
        --sizes 65536,1048576 --layers 16 --iters 200,30 --warmup 20,5

``--iters`` and ``--warmup`` take one number for every size or one per size.
Prints ``#`` lines, then ``ref,op,variant,size_bytes,layers,iters,p50_us,gbps_p50,skew_us`` lines
(p50_us: the median request time; skew_us: the median barrier-exit skew added to the destination's times).
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
import traceback

import numpy as np
from fidelity_tcp import tcp_once, tcp_setup

PERIOD = 4093  # the fill pattern's period (prime: a misplaced block shows)
MPI = None  # mpi4py's MPI, imported in main (a ucx reference must load ucxx first)


def page_buffer(nbytes: int) -> np.ndarray:
    """Page-aligned anonymous memory, pre-faulted."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    arr = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    arr.fill(0)
    return arr


def pattern(nbytes: int, salt: int) -> np.ndarray:
    """The source pool's bytes for one size (salt: a new pattern per size, so stale bytes fail)."""
    base = ((np.arange(PERIOD + 1, dtype=np.int64) * 7 + 3 + salt) % 251).astype(np.uint8)
    return np.tile(base[:PERIOD], -(-nbytes // PERIOD))[:nbytes]


def descriptors(size: int, block: int, layers: int, variant: str, seed: int, span: int | None = None) -> np.ndarray:
    """(n, 3) int64 [src offset, dst offset, bytes], layer by layer; every offset a multiple of the block.  Layer j
    lives in [j x span, (j + 1) x span), span 2 x SIZE unless given: kvbench sizes its pool for the largest request
    of a launch, so the smaller sizes of that launch spread over the larger spans."""
    span = 2 * size if span is None else span
    if variant == "bulk":
        offs = np.arange(layers, dtype=np.int64) * span
        return np.stack([offs, offs, np.full(layers, size, np.int64)], 1)
    rng, per, places, out = np.random.default_rng(seed), size // block, span // block, []
    for j in range(layers):
        base = j * span
        # unsorted, as kvbench lists them: sorted, the source would read ascending, faster than kvbench does
        src = rng.choice(places, per, replace=False) * block + base
        dst = rng.choice(places, per, replace=False) * block + base
        out.append(np.stack([src, dst, np.full(per, block, np.int64)], 1))
    return np.concatenate(out)


def verify(comm, src_pool_pattern: np.ndarray | None, dst: np.ndarray | None, d: np.ndarray, what: str) -> None:
    """Rank 1 compares every received range with the source's pattern (untimed)."""
    bad = 0
    if comm.rank == 1:
        for s, t, n in d.tolist():
            bad += int(np.count_nonzero(dst[t:t + n] != src_pool_pattern[s:s + n]))
    bad = comm.bcast(bad, root=1)
    if bad:
        raise SystemExit(f"fidelity_ref: {what}: {bad} wrong bytes at the destination")


def per_size(text: str, sizes: list[int], what: str) -> list[int]:
    """``--iters``/``--warmup``: one count for every size, or one per size (comma-separated, as --sizes)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if len(counts) == 1:
        counts *= len(sizes)
    if len(counts) != len(sizes) or min(counts) < 0:
        raise SystemExit(f"fidelity_ref: --{what}: one count >= 0, or one per size ({len(sizes)}), got {text!r}")
    return counts


SYNC_TAG, SYNC_ROUNDS = 11, 8


def skews(comm, t0s: np.ndarray) -> np.ndarray | None:
    """On rank 1 (the destination): per iteration, its barrier exit minus rank 0's, on rank 0's clock.

    The clocks' offset comes from the best (shortest) of SYNC_ROUNDS ping-pongs, as kvbench's
    one_clock does, so both sides time from the source's barrier exit.
    """
    stamp = np.zeros(1)
    if comm.rank == 0:
        for _ in range(SYNC_ROUNDS):
            comm.Recv(stamp, source=1, tag=SYNC_TAG)
            stamp[0] = time.perf_counter()
            comm.Send(stamp, dest=1, tag=SYNC_TAG)
        comm.Send(t0s, dest=1, tag=SYNC_TAG)
        return None
    best = (float("inf"), 0.0)  # (round trip, this clock minus rank 0's)
    for _ in range(SYNC_ROUNDS):
        a = time.perf_counter()
        comm.Send(stamp, dest=0, tag=SYNC_TAG)
        comm.Recv(stamp, source=0, tag=SYNC_TAG)
        c = time.perf_counter()
        best = min(best, (c - a, (a + c) / 2 - float(stamp[0])))
    theirs = np.empty_like(t0s)
    comm.Recv(theirs, source=0, tag=SYNC_TAG)
    return t0s - best[1] - theirs


EVICT = None  # --evict: a buffer written before each barrier, so every iteration starts on cold caches
CACHE = "as-is"  # --cache warm: before each barrier, every rank reads one byte of each line of its ranges
WARM = None  # (pool, its (offset, length) ranges to read) of the reference timed now, under --cache warm


def warm_ranges(d: np.ndarray, col: int) -> list[tuple[int, int]]:
    """--cache warm: the (offset, length) ranges a rank reads (column col: 0 source, 1 destination), built once
    per case."""
    return [(o, n) for o, n in d[:, [col, 2]].tolist() if n > 0]


def touch(buf: np.ndarray, ranges: list[tuple[int, int]]) -> int:
    """--cache warm: read what kvbench's touch reads of each (offset, length) range, one byte of every 64-byte
    line from its start and its last byte, through strided views: a gather through an index array would also
    read the index (8 bytes a line) and write its result, a few MiB more in the caches than kvbench's touch."""
    return sum(int(np.add.reduce(buf[o:o + n:64], dtype=np.uint64)) + int(buf[o + n - 1]) for o, n in ranges)


def timed(comm, warmup: int, iters: int, once) -> tuple[float, float]:
    """Run ``once()`` warmup + iters times, each from the end of a barrier: (median over iterations of the
    max over ranks, the destination's time moved onto the source's clock; median barrier-exit skew), seconds.
    ``once.before()``, where a reference has it, runs before each barrier: it posts the receives, which need
    nothing from the peer (kvbench posts its receives before the barrier too)."""
    global EVICT
    t0s, times = np.zeros(iters), np.zeros(iters)
    before = getattr(once, "before", None)
    for it in range(warmup + iters):
        comm.Barrier()  # as kvbench: both ranks done with the last iteration before either prepares the next
        if EVICT is not None:
            EVICT += 1
        if before is not None:
            before()
        if WARM is not None:  # as kvbench's --cache warm: last thing before the barrier
            touch(*WARM)
        comm.Barrier()
        t0 = time.perf_counter()
        once()
        if it >= warmup:
            t0s[it - warmup], times[it - warmup] = t0, time.perf_counter() - t0
    sk = skews(comm, t0s)
    if comm.rank == 1:
        comm.Send(times + sk, dest=0, tag=SYNC_TAG)
        return 0.0, float(np.median(sk))
    theirs = np.empty_like(times)
    comm.Recv(theirs, source=1, tag=SYNC_TAG)
    return float(np.median(np.maximum(times, theirs))), 0.0


def ready(comm, op: str) -> None:
    """A pull: the source tells the destination the layers are final (kvbench's MPI layer-ready message)."""
    if op == "pull":
        if comm.rank == 0:
            comm.Send([b"", 0, MPI.BYTE], dest=1, tag=9)
        else:
            comm.Recv([bytearray(0), 0, MPI.BYTE], source=0, tag=9)


# ---- MPI ---------------------------------------------------------------------------------------
def hindexed(offs: np.ndarray, lens: np.ndarray):
    return MPI.BYTE.Create_hindexed(lens.tolist(), offs.tolist()).Commit()


def mpi_once(comm, win, buf: np.ndarray, d: np.ndarray, op: str, layers: int):
    """RMA: contiguous calls when a layer has <= 4 ranges, else one call of hindexed datatypes."""
    me = comm.rank
    ocol, tcol = (0, 1) if op == "push" else (1, 0)
    empty = np.empty(0, np.uint8)
    if len(d) <= 4 * layers:
        calls = [([buf[r[ocol]:r[ocol] + r[2]], r[2], MPI.BYTE], (r[tcol], r[2], MPI.BYTE)) for r in d.tolist()]
    else:
        calls = [([buf, 1, hindexed(d[:, ocol], d[:, 2])], (0, 1, hindexed(d[:, tcol], d[:, 2])))]
    initiator = 0 if op == "push" else 1

    def once():
        ready(comm, op)
        if me == initiator:
            call = win.Put if op == "push" else win.Get
            for o, t in calls:
                call(o, 1 - me, t)
            win.Flush(1 - me)
            if op == "push":
                comm.Send([empty, 0, MPI.BYTE], dest=1, tag=7)
        elif op == "push":
            comm.Recv([empty, 0, MPI.BYTE], source=0, tag=7)
            win.Sync()
    return once


def sendrecv_once(comm, buf: np.ndarray, d: np.ndarray, op: str):
    """Two-sided: one Isend / Irecv of hindexed datatypes per request."""
    me = comm.rank
    dtype = hindexed(d[:, me], d[:, 2])
    empty = np.empty(0, np.uint8)
    posted = []

    def before():  # the destination's data receive; a pull source's receive of the ask
        posted[:] = [comm.Irecv([buf, 1, dtype], 0, 6) if me == 1 else
                     comm.Irecv([empty, 0, MPI.BYTE], 1, 5) if op == "pull" else None]

    def once():
        if op == "pull":
            ready(comm, op)  # the source's layer-ready message, then the destination asks
            if me == 1:
                ask = comm.Isend([empty, 0, MPI.BYTE], 0, 5)
                posted[0].Wait()
                ask.Wait()
            else:
                posted[0].Wait()
                comm.Send([buf, 1, dtype], 1, 6)
            return
        (comm.Isend([buf, 1, dtype], 1, 6) if me == 0 else posted[0]).Wait()
    once.before = before
    return once


def run_ref(comm, ref: str, a, ops, variants, engines=None) -> list[tuple]:
    """Every (op, variant, size) of one reference: rows (ref, op, variant, size, iters, p50 s, skew s) on rank 0."""
    global WARM
    out = []
    span = 2 * max(a.sizes)  # every size's layers in the spans of the largest, as kvbench's one pool per launch
    nbytes = span * a.layers
    win = None
    if ref == "mpi":
        win = MPI.Win.Allocate(nbytes, 1, MPI.INFO_NULL, comm)
        buf = np.frombuffer(win.tomemory(), dtype=np.uint8, count=nbytes)
        buf.fill(0)
        win.Lock_all(MPI.MODE_NOCHECK)
    else:
        buf = page_buffer(nbytes)
    state = tcp_setup(comm, nbytes) if ref == "tcp" else (engines.setup(ref, comm, buf, a) if engines else None)
    for op in ops:  # kvbench's case order (op, then size, then variant): each case finds the memory its predecessor left
        for size, iters, warmup in zip(a.sizes, a.iters, a.warmup):
            for variant in variants:
                d = descriptors(size, min(a.block, size), a.layers, variant, a.seed + size, span)
                src = pattern(nbytes, size % 251)
                buf[:] = src if comm.rank == 0 else 0
                if win is not None:
                    win.Sync()
                comm.Barrier()
                if ref == "tcp":
                    once = tcp_once(comm, state, buf, d, op)
                elif ref == "mpi":
                    once = mpi_once(comm, win, buf, d, op, a.layers)
                elif ref == "mpi-sendrecv":
                    once = sendrecv_once(comm, buf, d, op)
                else:
                    once = engines.make_once(ref, comm, state, buf, d, op, ready)
                WARM = (buf, warm_ranges(d, comm.rank)) if CACHE == "warm" else None
                t, skew = timed(comm, warmup, iters, once)
                if win is not None:
                    win.Sync()
                verify(comm, src, buf, d, f"{ref} {op} {variant} {size} B")
                skew = comm.bcast(skew, root=1)
                out.append((ref, op, variant, size, iters, t, skew))
                if engines and ref not in ("tcp", "mpi", "mpi-sendrecv"):
                    engines.release(ref, state)
    if ref == "tcp":
        state.close()
    elif engines and ref not in ("mpi", "mpi-sendrecv"):
        engines.close(ref, state)
    if win is not None:
        win.Unlock_all()
        del buf
        win.Free()
    return out


REFS = ("tcp", "mpi", "mpi-sendrecv", "nixl", "ucx", "mooncake")


def main() -> int:
    global MPI, EVICT, CACHE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", default="tcp,mpi", help=f"references to run: {', '.join(REFS)}")
    ap.add_argument("--ops", default="push", help="push, pull or push,pull")
    ap.add_argument("--variants", default="bulk", help="bulk, paged or bulk,paged")
    ap.add_argument("--sizes", default="16384,65536,262144,1048576,4194304", help="bytes per layer")
    ap.add_argument("--block", type=int, default=16384, help="paged: bytes per block (default 16384)")
    ap.add_argument("--layers", type=int, default=16, help="layers per request (default 16)")
    ap.add_argument("--iters", default="30", help="timed iterations: one count, or one per size (default 30)")
    ap.add_argument("--warmup", default="5", help="untimed iterations: one count, or one per size (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the paged blocks' places")
    ap.add_argument("--evict", type=int, default=0, metavar="MIB",
                    help="write MIB MiB before each iteration's barrier, on every rank (a diagnostic: the caches "
                         "as cold as a harness's work between iterations may leave them; default 0: off)")
    ap.add_argument("--cache", choices=("as-is", "warm"), default="as-is",
                    help="warm: every rank reads each 64-byte line of its ranges (source or destination) before "
                         "each iteration's barrier, as kvbench's --cache warm does (default as-is)")
    a = ap.parse_args()
    CACHE = a.cache
    EVICT = np.zeros(a.evict << 20, np.uint8) if a.evict > 0 else None
    a.sizes = [int(s) for s in a.sizes.split(",")]
    # every block (min(block, size) bytes) must start at a multiple of its length, in spans of 2 x the largest size
    if a.block < 1 or any(s < 1 or s % min(a.block, s) or 2 * max(a.sizes) % min(a.block, s) for s in a.sizes):
        raise SystemExit("fidelity_ref: --sizes: each a multiple of --block, or smaller and dividing 2 x the largest")
    a.iters, a.warmup = per_size(a.iters, a.sizes, "iters"), per_size(a.warmup, a.sizes, "warmup")
    if min(a.iters) < 1:
        raise SystemExit("fidelity_ref: --iters: at least 1 per size")
    refs = [r for r in a.refs.split(",") if r]
    if any(r not in REFS for r in refs):
        print(f"fidelity_ref: --refs: {', '.join(REFS)}", file=sys.stderr)
        return 1
    engines = None
    if set(refs) & {"nixl", "ucx", "mooncake"}:
        import fidelity_ref_engines as engines  # loads ucxx before MPI when asked (its UCX first)

        engines.preload(refs)
    from mpi4py import MPI as _MPI

    MPI = _MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("fidelity_ref: run with exactly 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 1
    rows = []
    try:
        for ref in refs:
            rows += run_ref(comm, ref, a, a.ops.split(","), a.variants.split(","), engines)
    except BaseException as e:  # the peer would wait for this rank in its next call until the launch's timeout
        # one write, the error's line first, and a moment for the launcher to forward it: Abort tears the job
        # down at once and may drop what the launcher has not read yet
        sys.stderr.flush()
        os.write(2, (f"fidelity_ref: rank {comm.rank}: {type(e).__name__}: {e}\n"
                     + traceback.format_exc()).encode())
        time.sleep(0.5)
        comm.Abort(1)
        os._exit(1)  # Abort can return with the mpich wheel (docs/pitfalls.md#abort-returns)
    if comm.rank == 0:
        print(f"# fidelity_ref: {', '.join(refs)}; {a.layers} layers per request, block {a.block} B (paged), cache {CACHE}, "
              f"iters={','.join(map(str, a.iters))} warmup={','.join(map(str, a.warmup))}; GB/s = size x layers / "
              "median(max over ranks, destination on the source's clock) / 1e9")
        print("ref,op,variant,size_bytes,layers,iters,p50_us,gbps_p50,skew_us")
        for ref, op, variant, size, iters, t, skew in rows:
            print(f"{ref},{op},{variant},{size},{a.layers},{iters},{t * 1e6:.2f},{size * a.layers / t / 1e9:.4f},"
                  f"{skew * 1e6:.2f}")
        sys.stdout.flush()
    if engines:
        engines.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
