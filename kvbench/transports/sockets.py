"""Network plumbing shared by the socket-based transports: address selection, socket tuning,
and the authenticated rendezvous (the higher rank of a pair dials the lower with its rank
and the run's token; the acceptor keeps accepting while each caller's hello arrives, and
refuses and logs a wrong one, or one not complete within HANDSHAKE_S).  The transports close
their listener once their peers are connected, so a later caller is refused by the kernel.

Address rules (NCCL's): ``options["addr"]``, else ``options["ifname"]`` or
KVBENCH_SOCKET_IFNAME (comma-separated name prefixes, ``=`` exact, ``^``
exclude), else the local address routing to this host's name (127.0.0.1 if
that is loopback).  A cluster user pins kvbench to the data-plane NIC this way.
"""
from __future__ import annotations

import hmac
import os
import selectors
import socket
import struct
import sys
import threading
import time

import numpy as np

from kvbench.transports.base import LEN, TransportError

IOV_MAX = 1024
_HELLO = struct.Struct("<4sII")  # magic, rank, token length; the token follows
_ACK = struct.Struct("<4sI")  # magic, the acceptor's rank
HELLO, ACK = b"KVBh", b"KVBa"
HANDSHAKE_S = 10.0  # seconds an accepted caller has to complete its hello


def if_addr(name: str) -> str | None:
    """IPv4 address of interface ``name`` (SIOCGIFADDR), None if it has none."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def select_addr(hostname: str, options: dict) -> tuple[str, str | None]:
    """(address, interface) to listen on, by the rules in the module docstring."""
    names = [n for _, n in socket.if_nameindex()]
    spec = options.get("ifname") or os.environ.get("KVBENCH_SOCKET_IFNAME")
    if options.get("addr"):
        addr = str(options["addr"])
    elif spec:
        exclude, exact = spec.startswith("^"), "=" in spec[:2]
        pats = [p for p in spec.lstrip("^=").split(",") if p]
        for n in names:
            if any(n == p if exact else n.startswith(p) for p in pats) != exclude and (a := if_addr(n)):
                return a, n
        have = ", ".join(f"{n} ({if_addr(n) or 'no IPv4'})" for n in names)
        raise TransportError(f"no interface with an IPv4 address matches '{spec}'; available: {have}")
    else:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(hostname), 9))  # UDP: a route lookup, nothing is sent
                addr = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
        addr = "127.0.0.1" if addr.startswith("127.") else addr
    return addr, next((n for n in names if if_addr(n) == addr), None)


def bind_device(s: socket.socket, ifname: str | None) -> bool:
    """SO_BINDTODEVICE: the socket's packets leave and arrive through ``ifname`` alone (needs CAP_NET_RAW;
    False where it is refused, the address binding then chooses the route)."""
    if not ifname:
        return False
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
    except OSError:
        return False
    return True


_TCP_INFO_ACKED, _TCP_INFO_RECEIVED = 120, 128  # struct tcp_info: tcpi_bytes_acked, tcpi_bytes_received (Linux 4.2+)


def tcp_bytes(s: socket.socket) -> tuple[int, int]:
    """The kernel's count of this connection's bytes: (sent and acknowledged, received); (-1, -1) unknown."""
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return -1, -1
    if len(info) < _TCP_INFO_RECEIVED + 8:
        return -1, -1
    return struct.unpack_from("<Q", info, _TCP_INFO_ACKED)[0], struct.unpack_from("<Q", info, _TCP_INFO_RECEIVED)[0]


def sysctl(name: str, field: int = 0) -> int:
    try:
        with open(f"/proc/sys/net/{name}") as fh:
            return int(fh.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def tune(s: socket.socket, want: int) -> None:
    """TCP_NODELAY and socket buffers (before connect/listen, so the window scale fits)."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if want <= 0:
        return  # leave it to autotuning
    for opt, force, cap, auto in ((socket.SO_SNDBUF, 32, "wmem", "tcp_wmem"),
                                  (socket.SO_RCVBUF, 33, "rmem", "tcp_rmem")):
        try:  # SO_SNDBUFFORCE=32 / SO_RCVBUFFORCE=33 need CAP_NET_ADMIN
            s.setsockopt(socket.SOL_SOCKET, force, want)
        except OSError:
            limit = sysctl(f"core/{cap}_max")
            if 2 * limit >= min(want, sysctl(f"ipv4/{auto}", 2)):  # the kernel doubles it
                s.setsockopt(socket.SOL_SOCKET, opt, min(want, limit))


def py_vec(sock, mv: memoryview, descs: np.ndarray, col: int, writing: bool) -> None:
    """Fallback for kvbench._native.sendv/recvv: sendmsg/recvmsg_into, IOV_MAX ranges a call."""
    offs, lens = descs[:, col].tolist(), descs[:, LEN].tolist()
    i, skip, n = 0, 0, len(offs)
    while i < n:
        j = min(n, i + IOV_MAX)
        iov = [mv[o : o + k] for o, k in zip(offs[i:j], lens[i:j])]
        iov[0] = iov[0][skip:]
        moved = sock.sendmsg(iov) if writing else sock.recvmsg_into(iov, 0, socket.MSG_WAITALL)[0]
        if moved == 0 and not writing:
            raise ConnectionError("peer closed the connection mid-transfer")
        moved += skip  # counted from the start of range i
        while i < j and moved >= lens[i]:
            moved -= lens[i]
            i += 1
        skip = moved


def hello(rank: int, token: bytes) -> bytes:
    """The bytes a dialling peer sends first (public so tests can forge a rogue one)."""
    return _HELLO.pack(HELLO, rank, len(token)) + token


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf, got = bytearray(n), 0
    while got < n:
        r = sock.recv_into(memoryview(buf)[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
    return bytes(buf)


def dial(addr: str, port: int, peer: int, me: int, token: bytes, deadline: float, sockbuf: int = 0,
         what: str = "tcp", local: tuple[str, str | None] | None = None) -> socket.socket:
    """Connect to ``peer`` (retrying until ``deadline``), present rank and token, expect its ack;
    ``what`` names the transport in errors; ``local``: (address, interface) the connection leaves from (a rail)."""
    where = f"{addr}:{port}"
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tune(s, sockbuf)
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if local is not None:
                bind_device(s, local[1])
                s.bind((local[0], 0))
            s.connect((addr, port))
            break
        except OSError as exc:
            s.close()
            if time.monotonic() + 0.1 >= deadline:
                raise TransportError(f"{what}: rank {me} cannot reach rank {peer} at {where}: {exc}") from None
            time.sleep(0.1)
    try:  # no retry once the hello is out: the acceptor would see a duplicate
        s.sendall(hello(me, token))
        answer = _ACK.unpack(recv_exact(s, _ACK.size))
    except OSError as exc:
        answer = exc
    if answer != (ACK, peer):
        s.close()
        raise TransportError(f"{what}: rank {peer} at {where} did not accept rank {me}: {answer}")
    return s


def _hello_rank(buf: bytearray, token: bytes) -> int | str | None:
    """The rank a complete hello in ``buf`` presents, why it is refused, or None while bytes are missing."""
    if len(buf) < _HELLO.size:
        return None
    magic, rank, n = _HELLO.unpack_from(buf)
    if magic != HELLO or n > 4096:
        return "bad handshake"
    if len(buf) < _HELLO.size + n:
        return None
    return rank if hmac.compare_digest(bytes(buf[_HELLO.size:]), token) else "bad token"


def accept_peers(listener: socket.socket, want: set[int], me: int, token: bytes, deadline: float,
                 timeout: float, what: str = "tcp", channels: int = 1) -> dict[int, list[socket.socket]]:
    """Accept ``channels`` connections from each rank in ``want`` on ``listener`` (see ``Acceptor``)."""
    return Acceptor(listener, me, token, what).take(want, deadline, timeout, channels)


class Acceptor:
    """Accepts on a listener from the moment it listens, on a thread of its own, until ``take`` has the peers.

    A caller that connects before this rank knows its peers (they are still filling their pools) is
    accepted at once, not left in the kernel's accept queue: its HANDSHAKE_S run from its connect, so a
    flood of silent callers is refused on time and never fills the queue against a real peer.  A caller
    whose hello is complete and carries the run's token waits for ``take`` to say whether its rank is
    wanted; ``take`` acks ``channels`` connections of each wanted rank, in the order it dialled them (a
    dialler waits for each ack before its next dial), and refuses (and logs) every other caller."""

    def __init__(self, listener: socket.socket, me: int, token: bytes, what: str = "tcp"):
        self.listener, self.me, self.token, self.what = listener, me, token, what
        self._cond = threading.Condition()
        self._want: set[int] | None = None
        self._channels = 1
        self._stop = False
        self._done = False
        self._failed: BaseException | None = None
        self.got: dict[int, list[socket.socket]] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        listener.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"kvbench-{what}-accept", daemon=True)
        self._thread.start()

    def take(self, want: set[int], deadline: float, timeout: float, channels: int = 1) -> dict[int, list[socket.socket]]:
        """The wanted ranks' connections, once all arrived; TransportError at ``deadline``.  Closes the listener."""
        try:
            with self._cond:
                self._want, self._channels = set(want), channels
                self._wake()
                while not self._done and self._failed is None and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                if self._failed is not None:
                    raise self._failed
                if not self._done:
                    host, port = self.listener.getsockname()[:2]
                    raise TransportError(f"{self.what}: rank {self.me} waited {timeout:g} s at {host}:{port} for "
                                         f"ranks {sorted(r for r in want if len(self.got.get(r, ())) < channels)}")
                got, self.got = self.got, {}
            return got
        finally:
            self.close()

    def close(self) -> None:
        """Stop accepting: the thread ends (refusing callers in their handshake), the listener closes."""
        with self._cond:
            self._stop = True
            self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for s in (s for ss in self.got.values() for s in ss):
            s.close()
        self.got = {}
        for s in (self._wake_r, self._wake_w, self.listener):
            s.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        pending: dict[socket.socket, tuple[tuple, float, bytearray]] = {}  # caller, its hello's deadline, bytes
        held: list[tuple[int, socket.socket, tuple]] = []  # complete hellos, in arrival order, until want is known
        sel = selectors.DefaultSelector()

        def refuse(s: socket.socket, who: tuple, why: str) -> None:
            try:
                sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
            print(f"kvbench {self.what}: refused connection from {who[0]}:{who[1]}: {why}", file=sys.stderr, flush=True)

        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                with self._cond:
                    if self._stop:
                        break
                    if self._want is not None:
                        self._settle(held, refuse)
                        if self._done:
                            break
                now = time.monotonic()
                for s in [s for s, (_, until, _) in pending.items() if until <= now]:
                    refuse(s, pending.pop(s)[0], f"no handshake within {HANDSHAKE_S:g} s")
                wait = min((until for _, until, _ in pending.values()), default=None)
                for key, _ in sel.select(None if wait is None else max(0.0, wait - now)):
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                    elif key.fileobj is self.listener:
                        self._accept(pending, sel)
                    else:
                        s = key.fileobj
                        who, _, buf = pending[s]
                        rank = self._read(s, buf)
                        if rank is None:
                            continue
                        del pending[s]
                        if isinstance(rank, str):
                            refuse(s, who, rank)
                        else:
                            sel.unregister(s)
                            held.append((rank, s, who))
        except BaseException as exc:  # the waiting take() raises it
            with self._cond:
                self._failed = TransportError(f"{self.what}: rank {self.me}: accepting peers failed: {exc}")
        finally:
            for s, (who, _, _) in list(pending.items()):
                refuse(s, who, "setup ended before its handshake")
            for _, s, who in held:
                refuse(s, who, "setup ended before its rank was wanted")
            sel.close()
            with self._cond:
                self._cond.notify_all()

    def _accept(self, pending: dict, sel) -> None:
        while True:  # everything the kernel queued: a flood does not wait in the queue for its deadline
            try:
                s, who = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a caller that reset: the next one may fit
                return
            s.setblocking(False)
            pending[s] = (who, time.monotonic() + HANDSHAKE_S, bytearray())
            sel.register(s, selectors.EVENT_READ)

    def _read(self, s: socket.socket, buf: bytearray) -> int | str | None:
        """The rank a now complete hello presents, why it is refused, or None while bytes are missing."""
        need = _HELLO.size + (_HELLO.unpack_from(buf)[2] if len(buf) >= _HELLO.size else 0) - len(buf)
        try:
            data = s.recv(max(1, need))
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            return "no handshake"
        buf += data
        return _hello_rank(buf, self.token)

    def _settle(self, held: list, refuse) -> None:
        """(Under the lock, once want is known) ack the held callers of wanted ranks, refuse the others."""
        for rank, s, who in held:
            if rank not in self._want or len(self.got.get(rank, ())) == self._channels:
                refuse(s, who, f"unexpected rank {rank}")
                continue
            try:
                s.setblocking(True)
                s.sendall(_ACK.pack(ACK, self.me))
            except OSError:
                refuse(s, who, "hung up before the ack")
                continue
            self.got.setdefault(rank, []).append(s)
        held.clear()
        if sum(map(len, self.got.values())) >= self._channels * len(self._want):
            self._done = True
            self._cond.notify_all()
