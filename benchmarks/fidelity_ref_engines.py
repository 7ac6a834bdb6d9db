"""The engine references of fidelity_ref.py (nixl, ucx, mooncake): each library alone, the fewest calls.

* ``nixl``: one agent per rank (UCX backend, progress thread off, as kvbench's
  default); per size the request's descriptors are prepared once
  (``prep_xfer_dlist``) and made into ONE transfer (``make_prepped_xfer``)
  carrying a notification, re-posted every iteration; the initiator polls
  ``check_xfer_state``, the target polls ``get_new_notifs`` until the
  notification arrives (push: the destination learns the bytes landed; pull:
  the source's part ends).
* ``ucx``: ucxx's tag API, one endpoint per rank, progress polled.  A request
  whose layers are single ranges (bulk) goes as one tag message per layer
  straight from and into the pools; scattered blocks are packed into
  page-aligned staging with one ``numpy.take`` and sent as ONE message, then
  scattered with one indexed assignment (a two-sided path must pack).  Pull: an
  8-byte request first.
* ``mooncake``: one TransferEngine per rank over tcp (P2PHANDSHAKE, MC_FORCE_TCP),
  the request's descriptors as ONE ``batch_transfer_async_write`` / ``read`` per
  2048, ``get_batch_transfer_status``; push: then 8 bytes on a plain socket whose
  ``recv`` the destination sleeps in (kvbench's mooncake notification).

No kvbench code.  ``preload`` must run before mpi4py loads MPI (ucxx's UCX first).
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import struct

import numpy as np
from fidelity_tcp import tcp_setup  # mooncake's notification socket: the tcp reference's own connection

_NOTE = b"fid"


def preload(refs: list[str]) -> None:
    if "UCX_MODULES" not in os.environ and not os.path.exists("/sys/class/infiniband"):
        os.environ["UCX_MODULES"] = "^ib"  # NIXL's bundled libnl crashes at exit otherwise (no RDMA here)
    if "ucx" in refs:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx  # noqa: F401  (before mpi4py: one UCX per process, its own)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def _addr(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


def setup(ref: str, comm, buf: np.ndarray, a) -> dict:
    """Register the pool and connect to the other rank (untimed)."""
    me, peer = comm.rank, 1 - comm.rank
    if ref == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config

        logging.getLogger("nixl").setLevel(logging.WARNING)
        agent = nixl_agent(f"fidref{me}-{os.getpid()}",
                           nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        reg = agent.register_memory(np.array([[_addr(buf), buf.nbytes, 0]], dtype=np.uint64), "DRAM")
        mds = comm.allgather((agent.get_agent_metadata(), _addr(buf)))
        name = agent.add_remote_agent(mds[peer][0])
        return {"agent": agent, "reg": reg, "peer": name, "raddr": mds[peer][1], "handles": []}
    if ref == "ucx":
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array

        ctx = api.UCXContext({}, feature_flags=(api.Feature.TAG,))
        worker = api.UCXWorker(ctx)
        metas = comm.allgather(bytes(worker.address))
        ep = worker.create_endpoint_from_worker_address(api.UCXAddress.create_from_buffer(metas[peer]), False)
        for _ in range(100):
            worker.progress()
        return {"api": api, "Array": Array, "ctx": ctx, "worker": worker, "ep": ep, "layers": a.layers,
                "stage": np.frombuffer(mmap.mmap(-1, buf.nbytes // 2 + mmap.PAGESIZE), np.uint8)}
    if ref == "mooncake":
        from mooncake.engine import TransferEngine

        os.environ["MC_FORCE_TCP"] = "1"
        for var in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
            os.environ.setdefault(var, "65535")
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0 or te.register_memory(_addr(buf), buf.nbytes):
            raise SystemExit("fidelity_ref: mooncake initialise/register failed")
        metas = comm.allgather((f"127.0.0.1:{te.get_rpc_port()}", _addr(buf)))
        sock = tcp_setup(comm, 0)
        return {"te": te, "session": metas[peer][0], "raddr": metas[peer][1], "sock": sock, "addr": _addr(buf)}
    raise SystemExit(f"fidelity_ref: unknown engine reference {ref}")


def make_once(ref: str, comm, st: dict, buf: np.ndarray, d: np.ndarray, op: str, ready):
    """One iteration of ``ref``: everything that does not move bytes is done here, before timing."""
    me = comm.rank
    initiator = 0 if op == "push" else 1
    lcol, rcol = (0, 1) if me == 0 else (1, 0)  # my pool's column, the peer's
    if ref == "nixl":
        agent = st["agent"]
        n = len(d)
        zeros, lens = np.zeros(n, np.int64), d[:, 2]
        idx = np.arange(n, dtype=np.int32)
        xop = "WRITE" if op == "push" else "READ"
        h = None
        if me == initiator:
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([_addr(buf) + d[:, lcol], lens, zeros], 1), "DRAM")
            rh = agent.prep_xfer_dlist(st["peer"], np.stack([st["raddr"] + d[:, rcol], lens, zeros], 1), "DRAM")
            h = agent.make_prepped_xfer(xop, lh, idx, rh, idx, _NOTE)
            st["handles"] += [h, lh, rh]

        def once():
            ready(comm, op)
            if me == initiator:
                s = agent.transfer(h)
                while s == "PROC":
                    s = agent.check_xfer_state(h)
                if s != "DONE":
                    raise SystemExit(f"fidelity_ref: nixl {xop} failed ({s})")
            else:
                got = 0
                while not got:
                    for msgs in agent.get_new_notifs().values():
                        got += sum(1 for m in msgs if bytes(m) == _NOTE)
        return once
    if ref == "ucx":
        api, Array, worker, ep = st["api"], st["Array"], st["worker"], st["ep"]
        tag, req_tag = api.UCXXTag(1), api.UCXXTag(3)
        sending = me == 0
        if len(d) <= st["layers"]:  # one range per layer (bulk): no pack
            views = [Array(buf[r[lcol]:r[lcol] + r[2]]) for r in d.tolist()]
            pack = unpack = None
        else:
            block = int(d[0, 2])
            pool2d, stage2d = buf.reshape(-1, block), st["stage"][: len(d) * block].reshape(-1, block)
            blocks = d[:, lcol] // block
            views = [Array(stage2d.reshape(-1))]
            pack = (lambda: np.take(pool2d, blocks, axis=0, out=stage2d, mode="clip")) if sending else None
            unpack = None if sending else (lambda: pool2d.__setitem__(blocks, stage2d))
        one = np.zeros(1, np.uint64)
        posted = []

        def settle(reqs):
            while not all(r.completed for r in reqs):
                worker.progress()
            for r in reqs:
                r.check_error()

        def before():  # the destination's data receives; a pull source's receive of the request
            posted[:] = [worker.tag_recv(v, tag) for v in views] if not sending else \
                [worker.tag_recv(Array(one), req_tag)] if op == "pull" else []

        def once():
            ready(comm, op)
            if op == "pull" and not sending:
                reqs = [ep.tag_send(Array(one), req_tag)] + posted
            elif op == "pull":
                settle(posted)
                reqs = None
            else:
                reqs = None if sending else posted
            if sending:
                if pack:
                    pack()
                reqs = [ep.tag_send(v, tag) for v in views]
            settle(reqs)
            if unpack:
                unpack()
        once.before = before
        return once
    if ref == "mooncake":
        te, sock = st["te"], st["sock"]
        loc = (st["addr"] + d[:, lcol]).tolist()
        rem = (st["raddr"] + d[:, rcol]).tolist()
        lens = d[:, 2].tolist()
        note = struct.pack("<Q", 1)
        got = bytearray(8)

        def once():
            ready(comm, op)
            if me == initiator:
                submit = te.batch_transfer_async_write if op == "push" else te.batch_transfer_async_read
                ids = [submit(st["session"], loc[i:i + 2048], rem[i:i + 2048], lens[i:i + 2048])
                       for i in range(0, len(lens), 2048)]
                if 0 in ids or te.get_batch_transfer_status(ids) != 0:
                    raise SystemExit("fidelity_ref: mooncake batch failed")
                if op == "push":
                    sock.sendall(note)
            elif op == "push":
                sock.recv_into(got, 8, socket.MSG_WAITALL)
        return once
    raise SystemExit(f"fidelity_ref: unknown engine reference {ref}")


def release(ref: str, st: dict) -> None:
    """After a size: free its prepared transfers."""
    if ref == "nixl":
        for h in st["handles"]:
            h.release()
        st["handles"] = []


def close(ref: str, st: dict) -> None:
    """Tear the engine down (before MPI finalizes)."""
    if ref == "nixl":
        st["agent"].remove_remote_agent(st["peer"])
        st["agent"].deregister_memory(st["reg"])
    elif ref == "ucx":
        st["ep"].close_blocking()
    elif ref == "mooncake":
        st["sock"].close()
        st["te"].unregister_memory(st["addr"])
    st.clear()


def finish() -> None:
    """Nothing yet: mpi4py finalizes MPI at exit."""
