"""NIXL WRITE/READ bandwidth the way NIXL's own tools measure it, with no kvbench code.

Plays "NIXL's own tool" next to kvbench's nixl rows (nixlbench is not in the
PyPI wheel).  Like nixlbench's defaults: one descriptor of SIZE bytes, one
transfer prepared once per size and re-posted ITERS times back to back, no
barrier between posts, progress thread off.  Rank 0 initiates: ``--op write``
puts its buffer into rank 1's, ``--op read`` gets rank 1's into its own.
mpi4py only launches the pair and swaps agent metadata.

``--regions N`` (default 1, nixlbench's way: the same SIZE bytes every time,
so from 256 KiB up they sit in the CPU caches) cycles the transfers over N
distinct SIZE regions of each buffer instead; N = kvbench's layer count gives
the working set of one kvbench bulk request.  ``--pool-bytes P`` spreads those
regions over a pool of P bytes, one every P/N bytes (rounded down to a page):
with kvbench's pool size that is where kvbench's bulk rows put their layers
(one descriptor at the start of each layer's span), so both move the same
scattered blocks.  Without it the regions lie back to back.

``--pages 4k|thp`` (default 4k) chooses the pool's pages: an anonymous mmap,
pre-faulted, marked MADV_NOHUGEPAGE (4k) or aligned to the huge page size and
marked MADV_HUGEPAGE before the first touch (thp; the kernel may still give
fewer).  Each rank prints the share of its pool that /proc/self/smaps shows on
huge pages (``# pages: rank R requested=P huge_share=S``).

    mpiexec -n 2 python benchmarks/nixl_reference.py --sizes 65536,1048576 --iters 1000 [--op read] [--regions 16]
           [--pool-bytes 268435456] [--pages thp]

Prints ``#`` header lines, then one CSV line per size: ``size_bytes,gbps``
(GB/s = 1e9 B/s, payload bytes over the initiator's wall time for the loop,
which ends when rank 1 has the last notification).
"""
import argparse
import logging
import mmap
import os
import sys
import time

import numpy as np
from mpi4py import MPI

PAGE = mmap.PAGESIZE
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def thp_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 2 << 20


def alloc(nbytes: int, pages: str):
    """(mapping, page-aligned pre-faulted uint8 array of nbytes): 4 KiB pages, or THP aligned to a huge page."""
    align = thp_bytes() if pages == "thp" else PAGE
    size = -(-nbytes // align) * align
    # private: a shared anonymous mapping (mmap's default) is shmem and ignores MADV_HUGEPAGE;
    # thp: a spare huge page is room to start on a huge page boundary
    mm = mmap.mmap(-1, size + (align if pages == "thp" else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(MADV_HUGEPAGE if pages == "thp" else MADV_NOHUGEPAGE)  # before the first touch
    except (OSError, AttributeError):
        pass  # no THP in this kernel: 4 KiB pages either way; the share printed says so
    whole = np.frombuffer(mm, dtype=np.uint8)
    off = -whole.__array_interface__["data"][0] % align
    return mm, whole[off : off + nbytes]


def huge_share(lo: int, nbytes: int) -> float:
    """Share of [lo, lo + nbytes) on huge pages: AnonHugePages of the overlapping mappings in /proc/self/smaps."""
    hi, huge, cur = lo + nbytes, 0, None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                cur = min(hi, end) - max(lo, start) if start < hi and end > lo else None
            elif cur is not None and line.startswith("AnonHugePages:"):
                huge += min(cur, int(line.split()[1]) * 1024)
    return huge / nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="65536,262144,1048576,4194304", help="comma-separated message sizes, bytes")
    ap.add_argument("--iters", type=int, default=1000, help="timed transfers per size")
    ap.add_argument("--warmup", type=int, default=100, help="untimed transfers per size")
    ap.add_argument("--progress-thread", action="store_true", help="enable NIXL's progress thread")
    ap.add_argument("--op", choices=("write", "read"), default="write", help="WRITE into rank 1 or READ from it")
    ap.add_argument("--regions", type=int, default=1, help="distinct SIZE regions cycled over (default 1)")
    ap.add_argument("--pool-bytes", type=int, default=0,
                    help="pool size: the regions lie one every pool/regions bytes (default: back to back)")
    ap.add_argument("--pages", choices=("4k", "thp"), default="4k", help="pool pages: 4k or thp (default 4k)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.regions < 1:
        ap.error("--regions must be >= 1")
    stride = a.pool_bytes // a.regions // PAGE * PAGE  # 0: back to back (one region after the other, per size)
    if a.pool_bytes and stride < max(sizes):
        ap.error(f"--pool-bytes {a.pool_bytes} cannot hold {a.regions} regions of {max(sizes)} bytes")
    xop = a.op.upper()

    if "UCX_MODULES" not in os.environ and not os.path.exists("/sys/class/infiniband"):
        # NIXL's bundled libnl (loaded by UCX's ib module) can segfault at exit (docs/pitfalls.md#nixl-exit);
        # without RDMA devices that module is useless, so leave it out, as kvbench's nixl transport does
        os.environ["UCX_MODULES"] = "^ib"
    from nixl._api import nixl_agent, nixl_agent_config

    logging.getLogger("nixl").setLevel(logging.WARNING)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        print("nixl_reference: run with exactly 2 ranks", file=sys.stderr)
        return 1
    nbytes = max(a.pool_bytes, max(sizes) * a.regions)
    mm, buf = alloc(nbytes, a.pages)  # page-aligned, like every kvbench pool
    buf.fill(rank + 1)  # pre-fault (and where the kernel picks the page size)
    addr = buf.__array_interface__["data"][0]
    shares = comm.allgather(huge_share(addr, nbytes))
    agent = nixl_agent(f"ref{rank}", nixl_agent_config(enable_prog_thread=a.progress_thread, backends=["UCX"]))
    reg = agent.register_memory(np.array([[addr, nbytes, 0]], dtype=np.uint64), "DRAM")
    mds = comm.allgather((agent.get_agent_metadata(), addr))
    peer_name = agent.add_remote_agent(mds[1 - rank][0])
    peer_addr = mds[1 - rank][1]
    comm.Barrier()
    if rank == 0:
        print(f"# nixl_reference: NIXL {xop} initiated by rank 0, 1 descriptor per transfer, GB/s = 1e9 B/s, "
              f"iters={a.iters} warmup={a.warmup} regions={a.regions} stride={stride or 'size'} pool={nbytes} "
              f"progress_thread={a.progress_thread}")
        for r, share in enumerate(shares):
            print(f"# pages: rank {r} requested={a.pages} huge_share={share:.4f}")
        print("size_bytes,gbps", flush=True)
    for size in sizes:
        if rank == 0:
            offs = np.arange(a.regions, dtype=np.int64) * (stride or size)
            ones = np.full(a.regions, size, dtype=np.int64)
            zeros = np.zeros(a.regions, dtype=np.int64)
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([addr + offs, ones, zeros], 1), "DRAM")
            remote = agent.prep_xfer_dlist(peer_name, np.stack([peer_addr + offs, ones, zeros], 1), "DRAM")
            # one prepared transfer per region, made once: re-posting them is all the loop does
            hs = [agent.make_prepped_xfer(xop, local, [r], remote, [r], b"x") for r in range(a.regions)]
            comm.Barrier()
            for i in range(a.warmup + a.iters):
                if i == a.warmup:
                    t0 = time.perf_counter()
                last = i == a.warmup + a.iters - 1
                h = hs[i % a.regions]
                st = agent.transfer(h, b"end" if last else b"x")
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                if st != "DONE":
                    raise RuntimeError(f"{xop} of {size} B failed")
            comm.recv(source=1)  # rank 1 saw the last notification: the last transfer is complete
            dt = time.perf_counter() - t0
            print(f"{size},{size * a.iters / dt / 1e9:.3f}", flush=True)
            if a.op == "read" and buf[size - 1] != 2:
                raise RuntimeError("data did not land")
            for h in hs:
                h.release()
            local.release()
            remote.release()
        else:
            comm.Barrier()
            # the passive side must keep polling notifications or the transfers stall
            done = False
            while not done:
                for msgs in agent.get_new_notifs().values():
                    done = done or b"end" in msgs
            comm.send(None, dest=0)
            if a.op == "write" and buf[size - 1] != 1:
                raise RuntimeError("data did not land")
    comm.Barrier()
    agent.remove_remote_agent(peer_name)
    agent.deregister_memory(reg)
    del agent
    # a normal exit: os._exit() would skip MPICH's exit handlers and leave /dev/shm/mpich_shm_* behind
    MPI.Finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
