"""NIXL WRITE bandwidth the way NIXL's own tools measure it, with no kvbench code.

Plays "NIXL's own tool" next to kvbench's nixl rows (nixlbench is not in the
PyPI wheel).  Like nixlbench's defaults: one descriptor of SIZE bytes, one
transfer prepared once per size and re-posted ITERS times back to back, no
barrier between posts, progress thread off.  Rank 0 writes into rank 1;
mpi4py only launches the pair and swaps agent metadata.

    mpiexec -n 2 python benchmarks/nixl_reference.py --sizes 65536,1048576 --iters 1000

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="65536,262144,1048576,4194304", help="comma-separated message sizes, bytes")
    ap.add_argument("--iters", type=int, default=1000, help="timed transfers per size")
    ap.add_argument("--warmup", type=int, default=100, help="untimed transfers per size")
    ap.add_argument("--progress-thread", action="store_true", help="enable NIXL's progress thread")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]

    from nixl._api import nixl_agent, nixl_agent_config

    logging.getLogger("nixl").setLevel(logging.WARNING)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        print("nixl_reference: run with exactly 2 ranks", file=sys.stderr)
        return 1
    nbytes = max(sizes)
    mm = mmap.mmap(-1, nbytes)  # page-aligned, like every kvbench pool
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf.fill(rank + 1)  # pre-fault
    addr = buf.__array_interface__["data"][0]
    agent = nixl_agent(f"ref{rank}", nixl_agent_config(enable_prog_thread=a.progress_thread, backends=["UCX"]))
    reg = agent.register_memory(np.array([[addr, nbytes, 0]], dtype=np.uint64), "DRAM")
    mds = comm.allgather((agent.get_agent_metadata(), addr))
    peer_name = agent.add_remote_agent(mds[1 - rank][0])
    peer_addr = mds[1 - rank][1]
    comm.Barrier()
    if rank == 0:
        print(f"# nixl_reference: NIXL WRITE rank0 -> rank1, 1 descriptor per transfer, GB/s = 1e9 B/s, "
              f"iters={a.iters} warmup={a.warmup} progress_thread={a.progress_thread}")
        print("size_bytes,gbps", flush=True)
    for size in sizes:
        if rank == 0:
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[addr, size, 0]], dtype=np.int64), "DRAM")
            remote = agent.prep_xfer_dlist(peer_name, np.array([[peer_addr, size, 0]], dtype=np.int64), "DRAM")
            h = agent.make_prepped_xfer("WRITE", local, [0], remote, [0], b"x")
            comm.Barrier()
            for i in range(a.warmup + a.iters):
                if i == a.warmup:
                    t0 = time.perf_counter()
                last = i == a.warmup + a.iters - 1
                st = agent.transfer(h, b"end" if last else b"x")
                while st == "PROC":
                    st = agent.check_xfer_state(h)
                if st != "DONE":
                    raise RuntimeError(f"WRITE of {size} B failed")
            comm.recv(source=1)  # rank 1 saw the last notification: the data has landed
            dt = time.perf_counter() - t0
            print(f"{size},{size * a.iters / dt / 1e9:.3f}", flush=True)
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
            if buf[size - 1] != 1:
                raise RuntimeError("data did not land")
    comm.Barrier()
    agent.remove_remote_agent(peer_name)
    agent.deregister_memory(reg)
    del agent
    # NIXL's bundled libnl can crash at exit (PLATFORM pitfall 3): finalize MPI, then leave without teardown
    MPI.Finalize()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
