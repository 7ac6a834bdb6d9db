"""One engine used directly, in the call pattern of its own tool and in the one kvbench needs, alternating.

No kvbench code: what a request costs an engine's Python API before any harness adds to it.  Two ranks,
``LAYERS`` messages of SIZE bytes per request, all from and into one buffer (kvbench's hot variant):

* ucx (ucxx's tag API, as kvbench's ucx transport uses it: a 32-byte header, then the messages):
  ``stream``: the tool's way (ucx_perftest tag_bw): no barrier, the receiver keeps the next request's
  receives posted; ``poll``: kvbench's way, receives posted ahead, an MPI barrier, send, each rank spins on
  ``worker.progress()`` until its requests completed, a barrier after; ``sleep``: the same, waiting in
  ``worker.progress_worker_event`` (blocking progress mode: progress, then sleep on the worker's event fd);
  ``spin+sleep``: spin ``--spin-us`` (default 50), then one sleeping call, again (kvbench's default).
* mooncake (TransferEngine over tcp, one batch of LAYERS descriptors, ``--op read|write``): ``stream``: the
  tool's way (transfer_engine_bench): the initiator loops submit + ``get_batch_transfer_status``, the target
  idle; ``spin``: kvbench's way before the target slept, a barrier, submit, status, the target straight into
  the MPI barrier after (MPICH spins in it); ``asleep``: the target sleeps in that barrier (Ibarrier, tested
  every 50 us); ``sync``: as asleep, the batch as one ``batch_transfer_sync_read``/``write`` call.

Per pattern: the p50 over requests of the slower rank's time from the barrier's end (stream: wall time per
request), and GB/s = LAYERS x SIZE / p50.

    mpiexec -n 2 python benchmarks/engine_patterns.py ucx|mooncake [--sizes 262144,1048576] [--requests 30]
            [--rounds 3] [--layers 16] [--op read|write] [--spin-us 50]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import numpy as np

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("engine", choices=("ucx", "mooncake"))
ap.add_argument("--sizes", default="262144,1048576", help="bytes per message (comma-separated)")
ap.add_argument("--requests", type=int, default=30, help="requests per pattern and round")
ap.add_argument("--rounds", type=int, default=3, help="rounds, patterns alternating within each")
ap.add_argument("--layers", type=int, default=16, help="messages per request")
ap.add_argument("--op", choices=("read", "write"), default="read", help="mooncake: the initiator reads or writes")
ap.add_argument("--spin-us", type=float, default=50.0, help="ucx spin+sleep: microseconds of spinning per wake-up")
A = ap.parse_args()
L = A.layers
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
if A.engine == "ucx":
    import ucxx._lib.libucxx as api  # before mpi4py: ucxx's UCX first
    from ucxx._lib.arr import Array
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
me, peer = comm.rank, 1 - comm.rank
if comm.size != 2:
    sys.exit("engine_patterns: run on 2 ranks")
sizes = [int(s) for s in A.sizes.split(",")]
buf = np.ones(2 * max(sizes), np.uint8)
addr = buf.__array_interface__["data"][0]


def asleep_barrier():
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(50e-6)


def ucx_setup():
    ctx = api.UCXContext({}, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
    w = api.UCXWorker(ctx)
    w.init_blocking_progress_mode()
    ep = w.create_endpoint_from_worker_address(api.UCXAddress.create_from_buffer(comm.allgather(bytes(w.address))[peer]),
                                               False)
    for _ in range(100):
        w.progress()
    return w, ep


def ucx_patterns(w, ep, size):
    view, hdr, seq = Array(buf[:size]), np.zeros(4, np.uint64), [0]

    def tags():
        seq[0] += 1
        return [api.UCXXTag((seq[0] << 12) | i) for i in range(L + 1)]

    def recvs():
        t = tags()
        return [w.tag_recv(Array(hdr), t[0])] + [w.tag_recv(view, x) for x in t[1:]]

    def sends():
        t = tags()
        return [ep.tag_send(Array(hdr), t[0])] + [ep.tag_send(view, x) for x in t[1:]]

    def settle(reqs, event, spin_s=0.0):
        step = (lambda: w.progress_worker_event(1)) if event else w.progress
        while not all(r.completed for r in reversed(reqs)):
            if spin_s:  # spin for spin_s, then one sleeping call, then spin again
                until = time.perf_counter() + spin_s
                while time.perf_counter() < until and not reqs[-1].completed:
                    w.progress()
                if reqs[-1].completed:
                    continue
            step()
        for r in reqs:
            r.check_error()

    def stream(n):
        comm.Barrier()
        t0 = time.perf_counter()
        if me == 1:
            nxt = recvs()
            for _ in range(n):
                cur, nxt = nxt, recvs()
                settle(cur, False)
            settle(nxt, False)
        else:
            for _ in range(n + 1):  # the last one fills the receives posted ahead
                settle(sends(), False)
        return [(time.perf_counter() - t0) / n]

    def request(n, event, spin_s=0.0):
        out = []
        for _ in range(n):
            posted = recvs() if me == 1 else None
            comm.Barrier()
            t0 = time.perf_counter()
            settle(posted if me == 1 else sends(), event, spin_s)
            out.append(time.perf_counter() - t0)
            comm.Barrier()
        return out

    return {"stream": stream, "poll": lambda n: request(n, False), "sleep": lambda n: request(n, True),
            "spin+sleep": lambda n: request(n, True, A.spin_us * 1e-6)}


def mooncake_setup():
    from mooncake.engine import TransferEngine

    os.environ["MC_FORCE_TCP"] = "1"
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0 or te.register_memory(addr, buf.nbytes) != 0:
        sys.exit("engine_patterns: mooncake initialise/register failed")
    session, raddr = comm.allgather((f"127.0.0.1:{te.get_rpc_port()}", addr))[peer]
    if me == 0:  # the stream's end: the initiator tells the idle target on a socket it sleeps on
        srv = socket.create_server(("127.0.0.1", 0))
        comm.send(srv.getsockname()[1], 1)
        s = srv.accept()[0]
        srv.close()
    else:
        s = socket.create_connection(("127.0.0.1", comm.recv(source=0)))
    return te, session, raddr, s


def mooncake_patterns(te, session, raddr, s, size):
    loc, rem, lens = [addr] * L, [raddr + max(sizes)] * L, [size] * L
    read = A.op == "read"
    submit = te.batch_transfer_async_read if read else te.batch_transfer_async_write
    sync = te.batch_transfer_sync_read if read else te.batch_transfer_sync_write

    def one():
        bid = submit(session, loc, rem, lens)
        if bid == 0 or te.get_batch_transfer_status([bid]) != 0:
            sys.exit("engine_patterns: mooncake batch failed")

    def stream(n):
        comm.Barrier()
        t0 = time.perf_counter()
        if me == 1:
            for _ in range(n):
                one()
            s.sendall(b"done")
        else:
            s.recv(4, socket.MSG_WAITALL)
        return [(time.perf_counter() - t0) / n]

    def request(n, after, whole=False):
        out = []
        for _ in range(n):
            comm.Barrier()
            t0 = time.perf_counter()
            if me == 1:
                if whole:
                    if sync(session, loc, rem, lens) != 0:
                        sys.exit("engine_patterns: mooncake batch failed")
                else:
                    one()
            out.append(time.perf_counter() - t0)
            after()
        return out

    return {"stream": stream, "spin": lambda n: request(n, comm.Barrier),
            "asleep": lambda n: request(n, asleep_barrier), "sync": lambda n: request(n, asleep_barrier, True)}


def main() -> None:
    st = ucx_setup() if A.engine == "ucx" else mooncake_setup()
    rows = []
    for size in sizes:
        pats = ucx_patterns(*st, size) if A.engine == "ucx" else mooncake_patterns(*st, size)
        got: dict = {}
        for _ in range(A.rounds):
            for name, run in pats.items():
                got.setdefault(name, []).extend(run(A.requests))
        both = comm.gather(got)
        if me == 0:
            for name in pats:
                t = np.maximum(both[0][name], both[1][name]) if name != "stream" else np.array(both[1][name])
                p50 = float(np.median(t))
                rows.append(f"{A.engine:>8} {A.op if A.engine == 'mooncake' else 'tag':>5} {size:>9} {name:>10}"
                            f" {p50 * 1e6:>10.0f} {L * size / p50 / 1e9:>7.3f}")
    if me == 0:
        print(f"# engine_patterns: {L} messages per request, {A.requests} requests x {A.rounds} rounds per pattern,"
              f" alternating; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'engine':>8} {'op':>5} {'size(B)':>9} {'pattern':>10} {'p50(us)':>10} {'GB/s':>7}")
        print("\n".join(rows))
    comm.Barrier()
    if A.engine == "ucx":
        st[1].close_blocking()
    else:
        st[3].close()
        st[0].unregister_memory(addr)


if __name__ == "__main__":
    main()
