"""The rendezvous in kvbench.net: concurrent accepts, refused callers named in the log."""
import re
import socket
import threading
import time

import pytest

from kvbench.transports import sockets as net
from kvbench.transports.base import TransportError
from kvbench.transports.sockets import accept_peers, dial, hello

HANDSHAKE_S = 3.0  # the tests shorten the per-caller deadline (net.HANDSHAKE_S) to keep them quick

TOKEN = b"s3cret-token"


def listener():
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    return ls, ls.getsockname()[1]


def dial_later(port, rank, delay, deadline, out):
    """A real peer that dials after ``delay`` s; ``out[rank]``: its socket and when its ack came, or the error."""
    def run():
        time.sleep(delay)
        try:
            out[rank] = (dial("127.0.0.1", port, 0, rank, TOKEN, deadline), time.monotonic())
        except TransportError as exc:
            out[rank] = (exc, time.monotonic())

    th = threading.Thread(target=run)
    th.start()
    return th


def refusals(err):
    """{port: why} from the acceptor's one-line logs."""
    return {int(p): why for p, why in re.findall(r"kvbench tcp: refused connection from 127\.0\.0\.1:(\d+): (.*)", err)}


@pytest.mark.timeout(30)
def test_slow_caller_does_not_hold_up_real_peers(capfd, monkeypatch):
    """A caller that trickles its hello (a byte every 4 s) is refused at its handshake deadline while
    the real peers are accepted as they come; the old one-at-a-time accept waited on it to the deadline."""
    monkeypatch.setattr(net, "HANDSHAKE_S", HANDSHAKE_S)
    ls, port = listener()
    slow = socket.create_connection(("127.0.0.1", port))
    stop = threading.Event()

    def trickle():
        for b in hello(1, TOKEN):
            try:
                slow.send(bytes([b]))
            except OSError:
                return
            if stop.wait(4):
                return

    trickler = threading.Thread(target=trickle)
    trickler.start()
    time.sleep(0.2)  # the slow caller is first in the queue
    out, got, start = {}, {}, time.monotonic()
    deadline = start + 20
    dialers = [dial_later(port, 1, 0, deadline, out), dial_later(port, 2, HANDSHAKE_S + 1, deadline, out)]
    try:
        got = accept_peers(ls, {1, 2}, 0, TOKEN, deadline, 20)
        took = time.monotonic() - start
        for th in dialers:
            th.join(10)
        assert sorted(got) == [1, 2] and all(len(v) == 1 for v in got.values())
        assert out[1][1] - start < HANDSHAKE_S  # rank 1 was acked without waiting for the slow caller
        assert took < HANDSHAKE_S + 1 + 2  # rank 2 dialled at HANDSHAKE_S + 1 and was taken at once
        why = refusals(capfd.readouterr().err)
        assert why[slow.getsockname()[1]] == f"no handshake within {HANDSHAKE_S:g} s"
        slow.settimeout(5)
        assert slow.recv(16) == b""  # hung up on
    finally:
        stop.set()
        trickler.join(10)
        for th in dialers:
            th.join(10)
        for s, _ in out.values():
            if isinstance(s, socket.socket):
                s.close()
        for s in (s for ss in got.values() for s in ss):
            s.close()
        slow.close()
        ls.close()


@pytest.mark.timeout(30)
def test_wrong_callers_are_refused_and_named_and_the_real_peer_connects(capfd):
    ls, port = listener()
    callers = {
        "bad token": hello(1, b"not-the-token"),
        "bad handshake": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "unexpected rank 5": hello(5, TOKEN),
        "no handshake": b"KVB",  # hangs up mid-hello
    }
    socks = {}
    for why, data in callers.items():
        socks[why] = socket.create_connection(("127.0.0.1", port))
        socks[why].sendall(data)
    socks["no handshake"].close()
    out, got = {}, {}
    th = dial_later(port, 1, 0.2, time.monotonic() + 20, out)
    try:
        got = accept_peers(ls, {1}, 0, TOKEN, time.monotonic() + 20, 20)
        th.join(10)
        assert list(got) == [1] and isinstance(out[1][0], socket.socket)
        logged = refusals(capfd.readouterr().err)
        for why, s in socks.items():
            if why != "no handshake":
                assert logged[s.getsockname()[1]] == why
        assert "no handshake" in logged.values()
    finally:
        th.join(10)
        for s in [*socks.values(), *(s for ss in got.values() for s in ss)]:
            s.close()
        for s, _ in out.values():
            if isinstance(s, socket.socket):
                s.close()
        ls.close()


@pytest.mark.timeout(30)
def test_missing_peer_still_fails_at_the_deadline_naming_it():
    ls, port = listener()
    silent = socket.create_connection(("127.0.0.1", port))
    try:
        with pytest.raises(TransportError, match=r"waited 1 s at 127\.0\.0\.1:\d+ for ranks \[1\]"):
            accept_peers(ls, {1}, 0, TOKEN, time.monotonic() + 1, 1)
    finally:
        silent.close()
        ls.close()
