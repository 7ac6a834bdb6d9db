"""Plain references for kvbench's tcp and mpi bulk rows, with no kvbench code.

What ``benchmarks/fidelity.py`` divides kvbench's numbers by.  Each reference
moves what one kvbench bulk request moves: LAYERS messages of SIZE bytes from
rank 0 into rank 1, one contiguous message per layer, and times an iteration
the way kvbench's harness does: it starts when a barrier ends, each rank stops
its clock when its part is done (the receiver: when every byte is in its
buffer), and the iteration's time is the max over the two ranks; GB/s is
SIZE x LAYERS / the median time (GB = 1e9 B).

* ``tcp``: one plain TCP socket, tuned like kvbench's tcp transport (TCP_NODELAY;
  buffers left to the kernel's autotuning, as kvbench's default; --sockbuf N
  forces them, set before listen/connect so the window scale fits).  Rank 0 ``sendall``s
  each layer out of a page-aligned, pre-faulted buffer; rank 1 ``recv_into``s
  it (MSG_WAITALL) into a page-aligned, pre-faulted buffer.
* ``mpi``: MPI RMA as kvbench's mpi transport does it: Win.Allocate on both
  ranks, one Lock_all(MODE_NOCHECK) epoch for the whole run, per iteration
  LAYERS contiguous Puts out of the origin's own window memory, one
  Win.Flush, then ONE zero-byte Send to the target, which Recv's it and calls
  Win.Sync (as kvbench's target does before it reads).

mpi4py launches the pair and swaps the port; it is not on the tcp timed path
except for the barrier that starts an iteration.  After timing, rank 1 checks
every byte it received (untimed), so a reference that moves nothing fails.

    mpiexec -n 2 python benchmarks/fidelity_ref.py --sizes 1048576 --layers 16 --iters 30 --warmup 5

Prints ``#`` comment lines, then ``ref,size_bytes,layers,gbps_p50`` lines.
"""
from __future__ import annotations

import argparse
import mmap
import socket
import sys
import time

import numpy as np
from mpi4py import MPI


def page_buffer(nbytes: int, value: int) -> np.ndarray:
    """Page-aligned anonymous memory, pre-faulted (PLATFORM pitfalls 1 and 2)."""
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    arr = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    arr.fill(value)
    return arr


def pattern(nbytes: int, size: int) -> np.ndarray:
    """The source bytes: every layer differs, so a misplaced layer is caught."""
    base = ((np.arange(size, dtype=np.int64) * 7 + 3) % 251).astype(np.uint8)
    return (np.tile(base, nbytes // size).reshape(-1, size) + np.arange(nbytes // size, dtype=np.uint8)[:, None]).ravel()


def sysctl(name: str, field: int = 0) -> int:
    try:
        with open(f"/proc/sys/net/{name}") as fh:
            return int(fh.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def tune(s: socket.socket, want: int) -> None:
    """The same socket settings as kvbench's tcp transport: TCP_NODELAY; buffers autotuned unless want > 0."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if want <= 0:
        return
    for opt, force, cap, auto in ((socket.SO_SNDBUF, 32, "wmem", "tcp_wmem"),
                                  (socket.SO_RCVBUF, 33, "rmem", "tcp_rmem")):
        try:  # SO_SNDBUFFORCE / SO_RCVBUFFORCE (root)
            s.setsockopt(socket.SOL_SOCKET, force, want)
        except OSError:
            limit = sysctl(f"core/{cap}_max")
            if 2 * limit >= min(want, sysctl(f"ipv4/{auto}", 2)):
                s.setsockopt(socket.SOL_SOCKET, opt, min(want, limit))


def local_addr() -> str:
    """The address routing to this host's name, 127.0.0.1 for loopback (kvbench tcp's default)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(socket.gethostname()), 9))
            addr = s.getsockname()[0]
    except OSError:
        addr = "127.0.0.1"
    return "127.0.0.1" if addr.startswith("127.") else addr


def headline(comm, mine: list[float]) -> float:
    """Median over iterations of the max over ranks (rank 0's answer)."""
    both = comm.gather(mine)
    return float(np.median(np.max(np.array(both), axis=0))) if comm.rank == 0 else 0.0


def prepare(buf: np.ndarray, rank: int, size: int, layers: int) -> None:
    """Rank 0 (the source) holds the pattern, rank 1 zeros, in the first size x layers bytes."""
    buf[: size * layers] = pattern(size * layers, size) if rank == 0 else 0


def timed(comm, warmup: int, iters: int, once, *args) -> float:
    """Run ``once(*args)`` warmup + iters times, each from the end of a barrier; the headline seconds."""
    times = []
    for it in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        once(*args)
        dt = time.perf_counter() - t0
        if it >= warmup:
            times.append(dt)
    return headline(comm, times)


def verify(comm, dst: np.ndarray | None, size: int, what: str) -> None:
    """Rank 1 compares everything it received with the source pattern (untimed)."""
    bad = 0
    if comm.rank == 1:
        bad = int(np.count_nonzero(dst != pattern(dst.nbytes, size)))
    bad = comm.bcast(bad, root=1)
    if bad:
        raise SystemExit(f"fidelity_ref: {what} size {size}: {bad} wrong bytes at the receiver")


def ref_tcp(comm, sizes, layers, iters, warmup, sockbuf) -> dict[int, float]:
    rank, out = comm.rank, {}
    nbytes = max(sizes) * layers
    buf = page_buffer(nbytes, 0)
    if rank == 1:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(ls, sockbuf)  # accepted sockets inherit the buffers
        ls.bind((local_addr(), 0))
        ls.listen(1)
        comm.send(ls.getsockname(), dest=0)
        sock, _ = ls.accept()
        ls.close()
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(sock, sockbuf)
        sock.connect(comm.recv(source=1))
    granted = (sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    mv = memoryview(buf)

    def once(size):
        if rank == 0:
            for j in range(layers):
                sock.sendall(mv[j * size:(j + 1) * size])
            return
        for j in range(layers):
            got, end = j * size, (j + 1) * size
            while got < end:
                n = sock.recv_into(mv[got:end], end - got, socket.MSG_WAITALL)
                if n == 0:
                    raise SystemExit("fidelity_ref: tcp peer closed the connection")
                got += n

    for size in sizes:
        prepare(buf, rank, size, layers)
        out[size] = timed(comm, warmup, iters, once, size)
        verify(comm, buf[: size * layers], size, "tcp")
    sock.close()
    if rank == 0:
        print(f"# tcp: addr {local_addr()}, SO_SNDBUF/SO_RCVBUF granted {granted[0]}/{granted[1]} B "
              f"({'autotuned' if sockbuf <= 0 else f'requested {sockbuf}'})")
    return out


def ref_mpi(comm, sizes, layers, iters, warmup) -> dict[int, float]:
    rank, out = comm.rank, {}
    nbytes = max(sizes) * layers
    win = MPI.Win.Allocate(nbytes, 1, MPI.INFO_NULL, comm)
    buf = np.frombuffer(win.tomemory(), dtype=np.uint8, count=nbytes)
    buf.fill(0)  # pre-fault
    empty = np.empty(0, dtype=np.uint8)
    win.Lock_all(MPI.MODE_NOCHECK)

    def once(size, src):
        if rank == 0:
            for j in range(layers):
                win.Put([src[j * size:(j + 1) * size], size, MPI.BYTE], 1, (j * size, size, MPI.BYTE))
            win.Flush(1)
            comm.Send([empty, 0, MPI.BYTE], dest=1, tag=7)
        else:
            comm.Recv([empty, 0, MPI.BYTE], source=0, tag=7)
            win.Sync()

    for size in sizes:
        prepare(buf, rank, size, layers)
        win.Sync()  # our own stores to the window, before the peer's Puts land on top
        comm.Barrier()
        out[size] = timed(comm, warmup, iters, once, size, buf)
        verify(comm, buf[: size * layers], size, "mpi")
    win.Unlock_all()
    del buf
    win.Free()
    if rank == 0:
        print(f"# mpi: window=Win.Allocate, epoch=Lock_all(MODE_NOCHECK), {layers} contiguous Puts + one Flush, "
              "one zero-byte notification per iteration")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", default="tcp,mpi", help="references to run: tcp, mpi")
    ap.add_argument("--sizes", default="16384,65536,262144,1048576,4194304", help="message sizes, bytes")
    ap.add_argument("--layers", type=int, default=16, help="messages per iteration (kvbench: layers)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per size")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations per size")
    ap.add_argument("--sockbuf", type=int, default=0,
                    help="tcp socket buffer bytes (default 0: kernel autotuning, as kvbench's tcp)")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        print("fidelity_ref: run with exactly 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 1
    sizes = [int(s) for s in a.sizes.split(",")]
    refs = [r for r in a.refs.split(",") if r]
    sockbuf = a.sockbuf
    if comm.rank == 0:
        print(f"# fidelity_ref: {', '.join(refs)}; {a.layers} messages per iteration, iters={a.iters} "
              f"warmup={a.warmup}; GB/s = size x layers / median(max over ranks) / 1e9")
        print(f"# MPI: {MPI.Get_library_version().splitlines()[0].strip()}, thread level "
              f"{MPI.Query_thread()} (3 = MULTIPLE, like kvbench)")
    results = {}
    for ref in refs:
        if ref == "tcp":
            results[ref] = ref_tcp(comm, sizes, a.layers, a.iters, a.warmup, sockbuf)
        elif ref == "mpi":
            results[ref] = ref_mpi(comm, sizes, a.layers, a.iters, a.warmup)
        else:
            if comm.rank == 0:
                print(f"fidelity_ref: unknown reference '{ref}' (tcp, mpi)", file=sys.stderr)
            return 1
    if comm.rank == 0:
        print("ref,size_bytes,layers,gbps_p50")
        for ref, per in results.items():
            for size, t in per.items():
                print(f"{ref},{size},{a.layers},{size * a.layers / t / 1e9:.4f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
