"""mpi transport options: the sendrecv alias and one-line option errors (no MPI needed to build them); the
C calls (mpi_native.py) against the MPI library under mpiexec: bytes, errors, and what turns them off."""
import os
import subprocess
import sys

import pytest
from helpers.launch import ROOT, mpiexec, unavailable

from kvbench.transports.base import Context, TransportError
from kvbench.transports.mpi import MpiTransport
from kvbench.transports.mpi_sendrecv import MpiSendRecvTransport


def ctx(**opts):
    return Context(0, 2, "h", "t", b"", {k: str(v) for k, v in opts.items()})


def test_mode_sendrecv_selects_the_two_sided_transport_fully_initialised():
    t = MpiTransport(ctx(mode="sendrecv", prep="on"))
    assert type(t) is MpiSendRecvTransport and t.name == "mpi-sendrecv"
    assert t._types.enabled and not t._open  # its __init__ ran
    assert t.info()["mode"] == "sendrecv"
    rma = MpiTransport(ctx(split=2))
    assert type(rma) is MpiTransport and rma.split == 2 and rma.window == "allocate"


@pytest.mark.parametrize("opts,needle", [
    (dict(mode="rdma"), "mode 'rdma' is not one of: rma, sendrecv"),
    (dict(window="shared"), "window 'shared' is not one of: allocate, create"),
    (dict(epoch="fence"), "epoch 'fence' is not one of: lock_all, lock"),
    (dict(prep="maybe"), "prep='maybe' must be on or off"),
    (dict(split="two"), "split='two' must be an integer >= 0"),
    (dict(calls="c"), "calls='c' is not one of: native, mpi4py"),
])
def test_bad_option_is_one_line(opts, needle):
    with pytest.raises(TransportError, match=needle) as e:
        MpiTransport(ctx(**opts))
    assert "\n" not in str(e.value)


NATIVE_SCRIPT = r"""
import numpy as np
from mpi4py import MPI
from kvbench.transports import mpi_native
from kvbench.transports.mpi_native import NativeCalls

comm = MPI.COMM_WORLD.Dup()
me, peer = comm.rank, 1 - comm.rank
win = MPI.Win.Allocate(1 << 16, 1, MPI.INFO_NULL, comm)
win.Lock_all(MPI.MODE_NOCHECK)
arr = np.frombuffer(win.tomemory(), np.uint8)
arr[:] = 0
one, notes = np.zeros(1, np.int64), np.zeros(8, np.int64)
n = NativeCalls(MPI, comm, win, one, notes)
assert n.reason == "" and "libmpi" in n.library, (n.reason, n.library)
base = arr.ctypes.data
# rank 0 puts 3 ranges into rank 1 (a gap left untouched), rank 1 gets 1 range back from rank 0
put = np.array([[0, 1000, 100], [200, 3000, 7], [4096, 8192, 4096]], np.int64)
if me == 0:
    arr[:8192] = np.arange(8192) % 251
    assert n.rma("push", peer, base, put, 0, 1) == (0, -1)
    one[0] = 12345
    assert n.flush_send(peer, True, 77) == 0
else:
    assert n.recv_sync(peer, 77) == (0, 1) and notes[0] == 12345
    src = np.arange(8192) % 251
    for s, d, ln in put.tolist():
        assert (arr[d:d + ln] == src[s:s + ln]).all(), (s, d, ln)
    assert not arr[1100:3000].any() and not arr[3007:8192].any()  # nothing outside the ranges
    assert n.rma("pull", peer, base, np.array([[16, 60000, 64]], np.int64), 1, 0) == (0, -1)
    assert n.flush_send(peer, False, 0) == 0
    assert (arr[60000:60064] == src[16:80]).all()
comm.Barrier()
# an MPI error comes back as the library's code and the failing row (no byte moves for a bad rank)
rc, row = n.rma("push", 7, base, put, 0, 1)
assert rc != 0 and row == 0 and "rank" in MPI.Exception(rc).Get_error_string().lower(), rc
try:
    n.rma("push", peer, base, np.array([[0, 0, 1 << 31]], np.int64), 0, 1)
    raise AssertionError("a row over 2^31-1 bytes was accepted")
except ValueError as exc:
    assert "at most 2^31-1" in str(exc)
# no MPI library found: off, with the reason
mpi_native._loaded_mpi_libraries = lambda: []
off = NativeCalls(MPI, comm, win, one, notes)
assert off.reason.startswith("no loaded libmpi* library exports MPI_Put"), off.reason
comm.Barrier()
win.Unlock_all()
win.Free()
print(f"<native ok {me}>", flush=True)
"""


@pytest.mark.launches
def test_native_calls_move_exact_ranges_and_return_mpi_errors(tmp_path):
    """Two ranks: the C Puts and Gets move exactly the rows' bytes, the notice arrives with its tag after the
    Flush, an invalid rank returns MPI's error code with the failing row, a row too long for one call is
    refused before anything moves, and without a loaded MPI library the calls are off with the reason."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    script = tmp_path / "native.py"
    script.write_text(NATIVE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([exe, "-n", "2", sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=env, start_new_session=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "<native ok 0>" in r.stdout and "<native ok 1>" in r.stdout, r.stdout  # the ranks' lines may interleave


class _FakeType:
    def __init__(self):
        self.freed = 0

    def Free(self):
        self.freed += 1


def test_types_retire_the_datatypes_a_prepared_post_still_holds():
    """A post prepared ahead keeps its datatypes: a cache clear or eviction before it is posted retires them,
    the post frees them; with nothing held they are freed at once, and closing frees everything."""
    from kvbench.transports.mpi_common import Types

    t, a, b, c, d = Types(True), _FakeType(), _FakeType(), _FakeType(), _FakeType()
    t.entries["a"] = (None, (a,))
    t.hold()  # a post was prepared with a
    t.clear()  # the cache was full while the next post was prepared
    assert a.freed == 0 and t.retired == [(a,)]
    t.entries["b"] = (None, (b,))
    t.hold()
    t._retire(t.entries.pop("b")[1])  # an eviction
    t.posted()
    assert a.freed == 0 and b.freed == 0  # one post is still unposted
    t.posted()
    assert (a.freed, b.freed, t.retired, t.held) == (1, 1, [], 0)
    t.entries["c"] = (None, (c,))
    t.clear()
    assert c.freed == 1  # nothing held: freed at once
    t.hold()
    t.entries["d"] = (None, (d,))
    t.clear(closing=True)
    assert d.freed == 1 and not t.retired


def test_ucx_numbers_every_post_when_prepared_in_the_order_the_target_serves():
    """A packed post prepared before a bulk one to the same peer keeps the first sequence number, whichever
    starts first: the target numbers its receives in that order (tags carry the number)."""
    import types

    import numpy as np

    from kvbench.transports.ucx import _PUSH_DATA, _PUSH_HDR, _PUSH_PART, UcxTransport, _tag

    t = UcxTransport(ctx(mode="tag"))
    t._api, t._Array = types.SimpleNamespace(UCXXTag=lambda v: v), lambda a: a
    t._views = lambda descs, col: [f"view{i}" for i in range(len(descs))]
    t._pack_area = lambda descs, may_wait: ("staged bytes", None, None)  # (no pool here: nothing to pack)
    t._rows = lambda descs, col: (None, int(descs[:, 2].sum()))
    packed = np.array([[0, 0, 8], [64, 64, 8]], np.int64)  # one layer of two ranges: packed into staging
    bulk = t.one_post([np.array([[0, 0, 8]], np.int64), np.array([[64, 64, 8]], np.int64)])  # 2 layers, 1 range
    got = []
    t._send = lambda peer, arr, tag: got.append(("message", tag)) or ("request", tag)
    t._send_parts = lambda peer, msgs, tags: got.append(("parts", tags[0])) or [("request", tags[0])]
    t._track = lambda h: h
    first, second = t.prepare("push", 1, packed, 5), t.prepare("push", 1, bulk, 6)
    t._cap = 0  # a third, over the staging cap when prepared: packed when started
    third = t.prepare("push", 1, packed, 7)
    hdrs = [("message", _tag(0, _PUSH_HDR, n)) for n in range(3)]
    assert got == hdrs  # headers: when prepared
    a, b, c = t.start(second), t.start(first), t.start(third)
    assert got[3:] == [("parts", _tag(0, _PUSH_PART, 1 << 12)), ("message", _tag(0, _PUSH_DATA, 0)),
                       ("message", _tag(0, _PUSH_DATA, 2))]
    # each header's send stays with its request's handle (its buffer lives until the send completes)
    assert a.reqs == [("request", hdrs[1][1]), ("request", _tag(0, _PUSH_PART, 1 << 12))]
    assert b.reqs == [("request", hdrs[0][1]), ("request", _tag(0, _PUSH_DATA, 0))]
    assert c.reqs == [("request", hdrs[2][1]), ("request", _tag(0, _PUSH_DATA, 2))]


def test_ucx_packed_requests_beyond_the_staging_cap_do_not_wait_on_each_other(kvrun):
    """Receive staging never waits (a destination registering several packed receives before the barrier once
    waited on the first, whose data its peer sends only after it: a hang until --timeout); a packed push over
    the cap waits only on a started send."""
    if reason := unavailable("ucx"):
        pytest.skip(f"unavailable: {reason}")
    r = kvrun(["-t", "ucx", "--op", "push,pull", "-m", "llama-3-8b", "--tokens", "256", "-b", "16", "--inflight", "2",
               "--overlap", "serial,streaming", "--prefill-ms", "1", "-O", "ucx.staging_mib=1", "-n", "3", "-w", "1",
               "--variants", "paged", "--timeout", "60"], timeout=180)
    assert r.code == 0, r.out + r.err
    checks = r.table().query("iter == -1 and role == 'decode'")
    assert len(checks) == 2 * 2 * 2 and int(checks.nwrong.sum()) == 0  # 2 ops x 2 overlaps x 2 requests
