"""tcp fixtures beyond the conformance suite: the per-run token and the listener address."""
import json
import socket
import threading
import time

import numpy as np
import pytest

from kvbench import memory
from kvbench.model.layout import Pool
from kvbench.transports.base import Context, TransportError, wait_landed
from kvbench.transports.sockets import hello
from kvbench.transports.tcp import TcpTransport


def pair(token=b"s3cret-token", nbytes=1 << 20):
    host = socket.gethostname()
    a = TcpTransport(Context(0, 2, host, "t", token, {"addr": "127.0.0.1", "connect_timeout": 10}))
    b = TcpTransport(Context(1, 2, host, "t", token, {"addr": "127.0.0.1", "connect_timeout": 10}))
    pa, pb = Pool(memory.alloc_host(nbytes)), Pool(memory.alloc_host(nbytes))
    memory.fill(pa.array, 0)
    return a, b, pa, pb, a.register(pa), b.register(pb)


def connected_pair(nbytes=1 << 20):
    """Two transports on loopback, connected (rank 0 accepts on a thread while rank 1 dials)."""
    a, b, pa, pb, ma, mb = pair(nbytes=nbytes)
    th = threading.Thread(target=a.connect, args=({1: mb},))
    th.start()
    b.connect({0: ma})
    th.join(15)
    assert not th.is_alive()
    return a, b, pa, pb


def test_peer_with_wrong_token_is_refused_and_real_peer_connects(capfd):
    a, b, pa, pb, ma, mb = pair()
    meta = json.loads(ma)
    assert meta["addr"] == "127.0.0.1"  # bound to the chosen address, not 0.0.0.0
    rogue = socket.create_connection((meta["addr"], meta["port"]))
    rogue.sendall(hello(1, b"not-the-token"))
    err = []
    th = threading.Thread(target=lambda: err.append(a.connect({1: mb})))
    th.start()
    b.connect({0: ma})
    th.join(15)
    assert not th.is_alive()
    rogue.settimeout(5)
    assert rogue.recv(16) == b""  # the acceptor hung up on the rogue
    assert "refused connection from 127.0.0.1" in capfd.readouterr().err
    # the real connection works: push 3 descriptors and check every byte
    d = np.array([[0, 4096, 1000], [8192, 0, 3000], [65536, 100000, 7]], dtype=np.int64)
    h_b = b.serve("push", 0, d, tag=5)
    h_a = a.post("push", 1, d, tag=5)
    a.wait(h_a)
    b.wait(h_b)
    assert memory.count_wrong(pb.array, d, 0, 1) == 0
    a.close()
    b.close()
    rogue.close()


def test_mixed_up_stream_is_detected():
    a, b, pa, pb = connected_pair()
    d = np.array([[0, 0, 4096]], dtype=np.int64)
    h_b = b.serve("push", 0, d, tag=(7 << 16) | 1)  # expects layer 1
    h_a = a.post("push", 1, d, tag=(7 << 16) | 2)  # sends layer 2
    with pytest.raises(TransportError, match="expected push data req 7 layer 1"):
        b.wait(h_b)
    try:  # the sender may have finished before the receiver hung up; it must not hang either way
        a.wait(h_a)
    except TransportError:
        pass
    a.close()
    b.close()


def test_receive_wait_reports_when_the_bytes_landed():
    """The done time is the receive thread's landing, not when the waiting thread got round to it."""
    a, b, pa, pb = connected_pair()
    memory.fill(pa.array, 0)
    d = np.array([[0, 0, 300000], [400000, 500000, 4096]], dtype=np.int64)
    h_b = b.serve("push", 0, d, tag=3)
    posted = time.perf_counter()
    a.wait(a.post("push", 1, d, tag=3))
    time.sleep(1.0)  # the bytes land while nobody waits
    called = time.perf_counter()
    landed, stamped = wait_landed(b, [h_b])
    assert posted <= landed < called and stamped  # the receive thread's stamp, not the moment of the call
    assert memory.count_wrong(pb.array, d, 0, 1) == 0
    a.close()
    b.close()


def test_wait_landed_without_times_is_when_the_last_wait_returned():
    class Sync:
        def wait(self, h):
            return h

    t = Sync()
    before = time.perf_counter()
    assert wait_landed(t, [5.0, 7.0, 6.0]) == (7.0, True)  # every handle reported: the latest, stamped
    at, stamped = wait_landed(t, [None, 2.0])
    assert before <= at <= time.perf_counter() and stamped  # one synchronous: now
    at, stamped = wait_landed(t, [None])
    assert before <= at <= time.perf_counter() and not stamped  # the harness's rule: when wait returned
    assert before <= wait_landed(t, [])[0] <= time.perf_counter()


def test_unknown_interface_is_one_line():
    t = TcpTransport(Context(0, 2, socket.gethostname(), "t", b"x", {"ifname": "=nosuchnic0"}))
    with pytest.raises(TransportError, match="available: "):
        t.register(Pool(memory.alloc_host(4096)))
    t.close()


def test_busy_poll_receive_moves_every_byte(kvrun):
    """-O poll=spin: receives busy-poll (non-blocking reads) instead of sleeping; same bytes, push and pull."""
    r = kvrun(["-t", "tcp", "-O", "poll=spin", "--op", "push,pull", "--overlap", "serial,streaming", "--prefill-ms", "5",
               "-m", "llama-3-8b", "--tokens", "128", "-b", "16", "-e", "16", "-n", "2", "-w", "1", "--variants", "bulk,paged"], timeout=180)
    assert r.code == 0, r.out + r.err
    df = r.table()
    checks = df[(df.iter == -1) & (df.role == "decode")]
    assert len(checks) == 2 * 3 and int(checks.nwrong.sum()) == 0  # (bulk + serial + streaming) x push/pull
    assert {i["poll"] for i in r.meta()["transports"]["tcp"]} == {"spin"}


def test_signalled_pull_reads_only_after_each_signal():
    """ready=socket: reads posted up front go out when the source signals their layer, not before."""
    a, b, pa, pb = connected_pair()  # a (rank 0) is the pull source, b (rank 1) reads
    d = [np.array([[k * 65536, k * 131072, 40000], [k * 65536 + 50000, k * 131072 + 70000, 9]], dtype=np.int64)
         for k in range(4)]
    memory.fill(pb.array, 1)
    before = pb.array.copy()
    served = [a.serve("pull", 1, d[k], tag=k) for k in range(4)]
    reads = [b.post_when_ready(0, d[k], tag=k) for k in range(3)]
    time.sleep(0.3)
    assert not any(h.done.is_set() for h in reads)  # no read issued without its signal
    assert np.array_equal(pb.array, before)
    a.signal_ready(1, [0])
    b.wait(reads[0])
    assert memory.count_wrong(pb.array, d[0], 0, 1) == 0
    assert not reads[1].done.wait(0.2)
    a.signal_ready(1, [1, 2, 3])  # layer 3's signal comes before its read is posted
    time.sleep(0.2)
    reads.append(b.post_when_ready(0, d[3], tag=3))
    for h in reads + served:
        (b if h in reads else a).wait(h)
    assert memory.count_wrong(pb.array, np.concatenate(d), 0, 1) == 0
    assert b.info()["ready"] == "socket"
    a.close()
    b.close()


def test_ready_option_is_checked():
    with pytest.raises(TransportError, match="ready='x' is not one of: socket, mpi"):
        TcpTransport(Context(0, 2, socket.gethostname(), "t", b"x", {"ready": "x"}))
    t = TcpTransport(Context(0, 2, socket.gethostname(), "t", b"x", {"ready": "mpi"}))
    assert not t.caps.signals_ready and TcpTransport.caps.signals_ready
    with pytest.raises(TransportError, match="needs -O ready=socket"):
        t.signal_ready(1, [0])
    t.close()


def test_pull_layer_ready_socket_and_mpi_move_every_byte(kvrun):
    """Streaming pull with the signal on the control connection (default; control messages busy-polled)
    and as an MPI message."""
    for ready, poll in (("socket", "control"), ("mpi", "block")):
        r = kvrun(["-t", "tcp", "-O", f"ready={ready}", "-O", f"poll={poll}", "--op", "pull", "--overlap", "serial,streaming",
                   "--prefill-ms", "5", "-m", "llama-3-8b", "--tokens", "128", "-b", "16", "-e", "16", "-n", "2",
                   "-w", "1", "--variants", "bulk,paged"], timeout=180)
        assert r.code == 0, r.out + r.err
        checks = r.table().query("iter == -1 and role == 'decode'")
        assert len(checks) == 3 and int(checks.nwrong.sum()) == 0  # bulk + serial + streaming
        assert {i["ready"] for i in r.meta()["transports"]["tcp"]} == {ready}


def test_control_stream_out_of_step_fails_the_waiting_read():
    """Anything but a READY on the control connection stops the pair with a line naming it."""
    from kvbench.transports.tcp_conn import HDR, MAGIC, PUSH

    a, b, pa, pb = connected_pair()
    d = np.array([[0, 0, 4096]], dtype=np.int64)
    a.serve("pull", 1, d, tag=(3 << 16) | 1)
    h = b.post_when_ready(0, d, tag=(3 << 16) | 1)
    a.conns[1].ctl.sendall(HDR.pack(MAGIC, PUSH, (3 << 16) | 1, 4096, 1))
    with pytest.raises(TransportError, match="control stream from rank 0 out of step: expected a layer-ready "
                                             "signal, got push data req 3 layer 1"):
        b.wait(h)
    a.close()
    b.close()


@pytest.mark.parametrize("op", ["push", "pull"])
def test_prepare_checks_ahead_and_only_start_moves_the_layer(op):
    """The harness prepares a layer's post during the prefill: checks fail there, and nothing is on the
    wire until start."""
    a, b, pa, pb = connected_pair()  # a (rank 0) holds the source pool, b (rank 1) the destination
    memory.fill(pb.array, 1)
    before = pb.array.copy()
    d = np.array([[0, 4096, 30000], [200000, 600000, 5]], dtype=np.int64)
    init, target, peer = (a, b, 1) if op == "push" else (b, a, 0)
    with pytest.raises(TransportError, match="past the end of the destination pool"):
        init.prepare(op, peer, d + np.array([0, 1 << 20, 0]))
    served = target.serve(op, 1 - peer, d, tag=9)
    prepared = init.prepare(op, peer, d, tag=9)
    time.sleep(0.2)
    assert not served.done.is_set() and np.array_equal(pb.array, before)
    init.wait(init.start(prepared))
    target.wait(served)
    assert memory.count_wrong(pb.array, d, 0, 1) == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_listener_is_closed_after_tcp_setup():
    """After connect nobody accepts, so the old port refuses a caller instead of leaving it queued."""
    a, b, pa, pb, ma, mb = pair()
    th = threading.Thread(target=a.connect, args=({1: mb},))
    th.start()
    try:
        b.connect({0: ma})
        th.join(15)
        assert not th.is_alive() and a.listener is None and b.listener is None
        for meta in (ma, mb):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", json.loads(meta)["port"]), timeout=5).close()
        assert {"sndbuf", "rcvbuf"} <= set(a.info())
    finally:
        th.join(15)
        a.close()
        b.close()


def test_a_waiting_caller_reads_its_receive_itself():
    """With the caller already waiting, the layer is read on the caller's thread (the landing wakes it), not
    on the receive thread that would then have to wake the caller."""
    a, b, pa, pb = connected_pair()
    try:
        conn = b.conns[0]
        readers, errors = [], []
        run = conn._do
        conn._do = lambda job, inline=False: (readers.append(threading.get_ident()), run(job, inline))[1]
        d = np.array([[0, 0, 200000], [300000, 600000, 8192]], dtype=np.int64)
        h = b.serve("push", 0, d, tag=5)
        deadline = time.monotonic() + 10
        while getattr(conn, "head", None) is not h and time.monotonic() < deadline:  # the thread reached it
            time.sleep(0.001)

        def send():
            try:  # once the caller has taken the job (no byte exists before), so the order is certain
                deadline = time.monotonic() + 10
                while not (getattr(h, "claim", None) is not None and h.claim.locked()) and time.monotonic() < deadline:
                    time.sleep(0.001)
                a.wait(a.post("push", 1, d, tag=5))
            except Exception as exc:  # reported below; the closed socket ends b's read
                errors.append(exc)
                a.close()

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        landed = b.wait(h)
        sender.join(10)
        assert not errors
        assert readers == [threading.get_ident()]  # the waiter, not the receive thread
        assert landed is not None and memory.count_wrong(pb.array, d, 0, 1) == 0
    finally:
        a.close()
        b.close()


def test_crossed_pushes_larger_than_the_socket_buffers_do_not_deadlock():
    """Both ranks post a push the kernel cannot buffer before either waits: a caller blocked in its own send
    cannot read, so the peer's bytes must be drained by its receive thread; every byte lands."""
    n = 48 << 20
    a, b, pa, pb = connected_pair(n)
    ts, pools = [a, b], [pa, pb]
    try:
        memory.fill(pb.array, 1)  # pa holds rank 0's pattern
        half = n // 2  # each rank sends from its first half into the peer's second half
        d = np.array([[0, half, half]], dtype=np.int64)
        errors = []

        def rank(r):
            try:
                t = ts[r]
                h = t.serve("push", 1 - r, d, tag=1)
                t.wait(t.post("push", 1 - r, d, tag=1))  # blocks in the send until the peer's thread drains it
                t.wait(h)
            except Exception as exc:  # reported below
                errors.append(exc)

        ranks = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
        for x in ranks:
            x.start()
        for x in ranks:
            x.join(30)
        assert not any(x.is_alive() for x in ranks), "crossed pushes deadlocked"
        assert not errors
        for r, p in enumerate(pools):
            assert memory.count_wrong(p.array, d, 1 - r, 1) == 0  # the peer's bytes, every one
    finally:
        for t in ts:
            t.close()


@pytest.mark.timeout(60)
def test_a_flood_while_the_peer_fills_its_pool_is_refused_on_time(capfd, monkeypatch):
    """Silent callers that come once rank 0 listens but before it connects (its peer still fills its pool)
    are refused HANDSHAKE_S after they connect, not left in the kernel's accept queue until connect starts
    (issue 32: a flood of 300 held the 10 s deadline to 47-54 s); the real peer then connects."""
    from kvbench.transports import sockets as net

    monkeypatch.setattr(net, "HANDSHAKE_S", 2.0)
    fill_s = 6.0  # the peer's pool fill: rank 0 waits this long before its connect
    a, b, pa, pb, ma, mb = pair()
    meta = json.loads(ma)
    flood, began = [], time.monotonic()
    for _ in range(300):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((meta["addr"], meta["port"]))
        flood.append(s)
    closed: dict[socket.socket, float] = {}
    while len(closed) < len(flood) and time.monotonic() - began < fill_s:
        for s in flood:
            if s in closed:
                continue
            try:
                if s.recv(1) == b"":
                    closed[s] = time.monotonic() - began
            except BlockingIOError:
                pass
            except OSError:  # reset
                closed[s] = time.monotonic() - began
        time.sleep(0.05)
    for s in flood:
        s.close()
    try:
        assert len(closed) == len(flood), f"{len(flood) - len(closed)} of {len(flood)} silent callers still open " \
                                          f"after {fill_s} s"
        assert max(closed.values()) < net.HANDSHAKE_S + 2.5, sorted(closed.values())[-5:]  # + a SYN's retry
        th = threading.Thread(target=a.connect, args=({1: mb},))
        th.start()
        b.connect({0: ma})
        th.join(15)
        assert not th.is_alive() and a.conns and b.conns
        assert "no handshake within 2 s" in capfd.readouterr().err
    finally:
        a.close()
        b.close()
        pa.release()
        pb.release()
