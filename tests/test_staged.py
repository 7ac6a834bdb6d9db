"""staged between 2 real ranks on torch CPU tensors: device -> bounce -> tcp -> bounce -> device, chunked and
pipelined, every byte checked; its pure chunking; and, in one process with an inner transport of the test's own
(two StagedTransports, real threads), the pipeline itself: the gather of slot k+1 while slot k is on the wire,
events instead of stream syncs on (fake) CUDA pools, and each slot's copy made once per descriptor array."""
import functools
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers.asserts import assert_nothing_written, assert_one_line, full, refusal  # noqa: E402
from helpers.launch import table_rows  # noqa: E402

from kvbench.memory import copy as C  # noqa: E402
from kvbench.model.layout import Pool  # noqa: E402
from kvbench.transports import staged, staging  # noqa: E402
from kvbench.transports.base import Context, TransportError  # noqa: E402
from kvbench.transports.staging import split  # noqa: E402

# 256 tokens of llama-3-8b: 1 MiB per layer; 256 KiB chunks make 4 per layer, so slots are reused within a layer
SMALL = ["-t", "staged", "--memory", "torch-cpu", "-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1",
         "--variants", "bulk,paged", "--rounds", "1", "-O", "chunk_kib=256"]


def test_split_cuts_a_layer_at_every_chunk_boundary_and_keeps_every_byte():
    d = np.array([[0, 500, 300], [1000, 0, 700], [4000, 3000, 100], [9000, 9999, 5]], np.int64)
    chunks = split(d, 256)
    assert [int(c[:, 2].sum()) for c in chunks] == [256, 256, 256, 256, 81]
    flat = np.concatenate(chunks)
    # the pieces, in order, cover the descriptors' bytes exactly once; the 4th column is the offset in the chunk
    src = np.concatenate([np.arange(s, s + n) for s, _, n, _ in flat.tolist()])
    dst = np.concatenate([np.arange(t, t + n) for _, t, n, _ in flat.tolist()])
    assert np.array_equal(src, np.concatenate([np.arange(s, s + n) for s, _, n in d.tolist()]))
    assert np.array_equal(dst, np.concatenate([np.arange(t, t + n) for _, t, n in d.tolist()]))
    for c in chunks:
        assert c[0, 3] == 0 and np.array_equal(c[1:, 3], np.cumsum(c[:-1, 2]))
    assert split(np.zeros((0, 3), np.int64), 256) == []


@pytest.mark.parametrize("extra", [["-O", "inner=tcp", "-c", "all"], ["-O", "pipeline=off", "--copy", "kernel"]],
                         ids=["pipelined-checked-every-iteration", "unpipelined-kernel"])
def test_staged_push_and_pull_over_tcp_land_every_byte_with_stage_times(kvrun, extra):
    """Two real ranks; pipelined, every timed iteration checked (-c all): #wrong 0 in each, push and pull."""
    r = kvrun([*SMALL, "--op", "push,pull", *extra], timeout=180)
    assert r.code == 0, r.out + r.err
    df = r.table()
    ok = df[df["iter"] >= 0]
    assert set(ok["status"]) == {"ok"} and set(ok["memory"]) == {"torch-cpu"}
    assert set(ok["op"]) == {"push", "pull"} and set(ok["variant"]) == {"bulk", "paged"}
    assert set(ok["copy"]) == {"kernel" if "kernel" in extra else "batch"}
    live = table_rows(r.out)  # the live table names where the pools live, and a copy engine other than batch
    assert len(live) == 4 and {x["mem"] for x in live} == {"torch-cpu"}
    assert [x.get("copy") for x in live] == ["kernel" if "kernel" in extra else None] * 4
    check = df[(df["iter"] == -1) & (df["role"] == "decode")]
    assert len(check) == 4 and (check["nwrong"] == 0).all()
    if "all" in extra:
        timed = ok[ok["role"] == "decode"]
        assert len(timed) == 4 * 3 and (timed["nwrong"] == 0).all()
    src, dst = ok[ok["role"] == "prefill"], ok[ok["role"] == "decode"]
    assert (src["gather_s"] > 0).all() and (src["scatter_s"] == 0).all()
    assert (dst["scatter_s"] > 0).all() and (dst["gather_s"] == 0).all() and (dst["wire_s"] > 0).all()
    assert (ok["payload_bytes"] == 256 * 131072).all()  # 128 KiB per token (fp16, 32 layers, 8 KV heads x 128)
    info = r.meta()["transports"]["staged"][0]
    assert info["inner"] == "tcp" and info["bounce"] == "pageable (page-locking needs CUDA)"
    assert info["pipeline"] == ("off" if "pipeline=off" in extra else "on")
    if "pipeline=off" not in extra:  # chunk_kib, the finer name of the slot size, beats slot_mib's default
        assert (info["slot_bytes"], info["slots"]) == (256 << 10, 3)


def test_a_corrupted_byte_is_caught_through_the_staged_path(kvrun):
    r = kvrun([*SMALL, "--op", "push", "--variants", "paged", "--inject-corruption", "1"], timeout=120)
    assert r.code == 2 and r.meta()["total_wrong"] == 1


def test_staged_with_host_memory_is_refused_with_the_reason(kvrun):
    r = kvrun(["-t", "staged", "--tokens", "256", "-n", "1"], timeout=60)
    assert r.code == 1
    assert "staged: --memory host has nothing to stage" in r.err and r.err.count("\n") == 1


def test_host_transports_skip_device_memory_and_staged_skips_host_rows(kvrun):
    r = kvrun(["-t", "tcp,staged", "--memory", "host,torch-cpu", "--tokens", "256", "-n", "1", "-w", "0",
               "--variants", "paged", "--rounds", "1"], timeout=120)
    assert r.code == 0, r.out + r.err
    df = r.table()
    sk = df[df["status"] == "skipped"].set_index(["transport", "memory"])["reason"]
    assert sk[("tcp", "torch-cpu")] == "unavailable: tcp moves host memory, not torch-cpu"
    assert sk[("staged", "host")].startswith("unavailable: staged: --memory host has nothing to stage")
    ran = df[(df["status"] == "ok") & (df["iter"] == -1) & (df["role"] == "decode")]
    assert set(zip(ran["transport"], ran["memory"])) == {("tcp", "host"), ("staged", "torch-cpu")}
    assert (ran["nwrong"] == 0).all()


def test_cuda_memory_without_a_gpu_is_refused_in_one_line_with_the_reason(kvrun, tmp_path):
    """--memory cuda where no GPU is: one line, exit 1, nothing written (it once gave skipped rows, exit 3)."""
    from kvbench.memory import device

    if device.probe("cuda") is None:
        pytest.skip("a GPU is present")
    r = kvrun(["-t", "staged,cuda_ipc", "--memory", "cuda", "--tokens", "256", "-n", "1", "-w", "0",
               "--variants", "paged", "--rounds", "1"], timeout=60)
    assert_one_line(r, "--memory cuda: no CUDA device (no CUDA driver: libcuda.so.1 does not load)")
    assert_nothing_written(tmp_path)


def test_the_check_computed_with_torch_ops_holds_through_the_harness(kvrun):
    """The path a CUDA pool's check takes (memory/device.py's poison, epoch, snapshot, count), forced on CPU
    tensors: clean, then one flipped byte counted."""
    args = ["-t", "staged", "--memory", "torch-cpu", "--tokens", "64", "-n", "1", "-w", "0", "--variants", "paged",
            "--rounds", "1", "--op", "push,pull"]
    env = {"KVBENCH_CHECK_ON_DEVICE": "1"}
    r = kvrun(args, env=env, timeout=120)
    assert r.code == 0 and r.meta()["total_wrong"] == 0, r.out + r.err
    r = kvrun([*args, "--inject-corruption", "1"], env=env, timeout=120)
    assert r.code == 2 and r.meta()["total_wrong"] == 2  # one element in each of the two checked cases


# ----- the pipeline in one process: two StagedTransports over an inner transport of the test's own -------------
class _Handle:
    def __init__(self, peer, d, tag):
        self.peer, self.d, self.tag, self.done = peer, d, tag, threading.Event()


class _Exchange:
    """What the two ends' wires share: their bounce buffers, the receives posted, a hook run before each send."""

    def __init__(self, before_send=None):
        self.bufs, self.recvs, self.cv = {}, {}, threading.Condition()
        self.before_send = before_send or (lambda: None)
        self.rows: list[np.ndarray] = []  # every descriptor array a send was given


class _Wire:
    """A two-sided inner transport inside one process: a send (push: post; pull: answer) waits for its receive,
    matched by tag, checks both ends gave the same descriptors (the same slots), runs the exchange's hook (the
    slow wire) and copies between the two bounce buffers, in the calling thread (as tcp's push does)."""

    def __init__(self, ex, ctx):
        self.ex, self.rank = ex, ctx.rank

    def alloc(self, nbytes):
        return None

    def register(self, pool):
        self.ex.bufs[self.rank] = pool.array
        return b""

    def connect(self, peers):
        pass

    def ready(self):
        pass

    def info(self):
        return {}

    def close(self):
        pass

    def post(self, op, peer, d, tag=0):
        return self._send(_Handle(peer, d, tag)) if op == "push" else self._recv(peer, d, tag)

    def serve(self, op, peer, d, tag=0):
        return self._recv(peer, d, tag) if op == "push" else _Handle(peer, d, tag)

    def answer(self, h):
        self._send(h)

    def wait(self, h):
        if not h.done.wait(30):
            raise TransportError("fake wire: no matching send in 30 s")

    def _recv(self, peer, d, tag):
        h = _Handle(peer, d, tag)
        with self.ex.cv:
            self.ex.recvs[(peer, self.rank, tag)] = h
            self.ex.cv.notify_all()
        return h

    def _send(self, h):
        key = (self.rank, h.peer, h.tag)
        with self.ex.cv:
            if not self.ex.cv.wait_for(lambda: key in self.ex.recvs, 30):
                raise TransportError(f"fake wire: no receive for tag {h.tag} in 30 s")
            r = self.ex.recvs.pop(key)
        if not np.array_equal(r.d, h.d):
            raise TransportError(f"fake wire: the ends chose different slots: {h.d.tolist()} != {r.d.tolist()}")
        self.ex.rows.append(h.d)
        self.ex.before_send()
        (s, t, n), = h.d.tolist()
        self.ex.bufs[h.peer][t:t + n] = self.ex.bufs[self.rank][s:s + n]
        r.done.set()
        h.done.set()
        return h


def _pair(monkeypatch, pools, ex=None, copy="batch", **opts):
    """Rank 0 (the source) and rank 1 (the destination), registered and connected over ``_Wire``."""
    ex = ex or _Exchange()
    monkeypatch.setattr(staged, "load", lambda name: functools.partial(_Wire, ex))
    ts = [staged.StagedTransport(Context(r, 2, "here", "t", options=dict(opts), copy=copy)) for r in (0, 1)]
    meta = [t.register(p) for t, p in zip(ts, pools)]
    ts[0].connect({1: meta[1]})
    ts[1].connect({0: meta[0]})
    return ts


def _move(a, b, op, descs, tag):
    """One layer from rank 0's pool to rank 1's: (seconds from the first post to the landing, a's handle)."""
    t0 = time.perf_counter()
    if op == "push":
        hb, ha = b.serve("push", 0, descs, tag), a.post("push", 1, descs, tag)
    else:
        ha, hb = a.serve("pull", 1, descs, tag), b.post("pull", 0, descs, tag)
        a.answer(ha)
    a.wait(ha)
    landed = b.wait(hb)
    return (landed or time.perf_counter()) - t0, ha


def _paged(nblocks, block, seed=0):
    """A paged layer: ``nblocks`` blocks of ``block`` bytes, scattered in both pools (distinct blocks)."""
    rng = np.random.default_rng(seed)
    src, dst = rng.permutation(nblocks * 2)[:nblocks], rng.permutation(nblocks * 2)[:nblocks]
    return np.ascontiguousarray(np.stack([src * block, dst * block, np.full(nblocks, block)], axis=1).astype(np.int64))


def _expect(src, dst, descs):
    for s, d, n in descs.tolist():
        assert np.array_equal(dst[d:d + n], src[s:s + n])


def _host_pools(nbytes):
    a = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    return Pool(a, "torch-cpu"), Pool(np.zeros(nbytes, np.uint8), "torch-cpu")


def test_the_next_slot_is_gathered_while_a_slot_is_on_the_wire(monkeypatch):
    """A slow gather (each copy into a slot sleeps G) and a slow wire (each send sleeps G): every send k waits for
    the gather of chunk k+1 to start, and every gather k+1 for send k to start, so with the gather and the wire in
    threads of their own each pair overlaps by at least G; the old single source thread gathered only after its
    send returned, so its sends waited in vain (saw False).  The source's gather_s + wire_s then exceeds the
    transfer (each stage is counted whole by its own thread), where one thread's stages add up to less."""
    G, N, CHUNK = 0.08, 8, 64 << 10
    src, dst = _host_pools(4 * N * CHUNK)
    descs = _paged(N * CHUNK // (16 << 10), 16 << 10)  # N chunks of 4 blocks each
    gathers, sends = [], []  # (start, end) of each
    gather_began = [threading.Event() for _ in range(N)]
    send_began = [threading.Event() for _ in range(N)]
    saw = []
    copy = C.copy

    def slow_copy(engine, d, s, rows, **kw):
        if s is not src.array:  # a scatter: at full speed
            return copy(engine, d, s, rows, **kw)
        k = len(gathers)
        if k:
            send_began[k - 1].wait(5)
        gather_began[k].set()
        t = time.perf_counter()
        time.sleep(G)
        copy(engine, d, s, rows, **kw)
        gathers.append((t, time.perf_counter()))

    def slow_send():
        k = len(sends)
        send_began[k].set()
        t = time.perf_counter()
        saw.append(gather_began[k + 1].wait(2) if k + 1 < N else True)
        time.sleep(G)
        sends.append((t, time.perf_counter()))

    monkeypatch.setattr(C, "copy", slow_copy)
    a, b = _pair(monkeypatch, [src, dst], _Exchange(slow_send), chunk_kib=CHUNK >> 10, slots=2)
    try:
        took, _ = _move(a, b, "push", descs, 5)
        stages = a.take_stages()
    finally:
        a.close()
        b.close()
    _expect(src.array, dst.array, descs)
    assert len(gathers) == len(sends) == N
    assert all(saw), saw  # each send saw the next gather begin while it was on the wire
    for k in range(N - 1):  # structural: gather k+1 began inside send k, and each lasts at least G from there
        (gs, ge), (ws, we) = gathers[k + 1], sends[k]
        assert min(ge, we) - max(gs, ws) > G / 2, (k, gathers[k + 1], sends[k])
    assert stages["gather"] >= N * G and stages["wire"] >= N * G
    assert stages["gather"] + stages["wire"] > took, (stages, took)


@pytest.mark.parametrize("engine", ["batch", "memcpy", "kernel"])
@pytest.mark.parametrize("op", ["push", "pull"])
def test_cuda_slots_are_handed_on_with_events_not_stream_syncs(monkeypatch, op, engine):
    """(Fake) CUDA pools, whose copies complete only when something waits for them: a layer of N slots makes no
    cuStreamSynchronize at all, at most one cuEventSynchronize per slot copy (the gather's by the wire thread,
    the scatter's by the next receive or the layer's end), and every byte lands; the old code synchronised the
    copy stream after every chunk (2N stream syncs)."""
    from fakes import cuda_driver

    from kvbench.memory.device import DevicePool

    fake = cuda_driver.install(monkeypatch)
    waits = {"cuStreamSynchronize": 0, "cuEventSynchronize": 0, "cuCtxSynchronize": 0}

    def counted(name, fn):
        def call(*args):
            waits[name] += 1
            return fn(*args)
        return call

    for name in waits:
        monkeypatch.setattr(fake, name, counted(name, getattr(fake, name)))

    def bounce(inner, nbytes, kind, pages):
        t = torch.zeros(nbytes, dtype=torch.uint8)
        fake.host(t)  # the fake driver's copies touch only memory it knows
        return Pool(t.numpy(), "pinned"), t

    monkeypatch.setattr(staged, "bounce_buffer", bounce)
    N, CHUNK = 6, 64 << 10
    nbytes = 4 * N * CHUNK
    src, dst = fake.alloc(nbytes), fake.alloc(nbytes)
    src.t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    descs = _paged(N * CHUNK // (16 << 10), 16 << 10)
    a, b = _pair(monkeypatch, [DevicePool(src, "cuda"), DevicePool(dst, "cuda")], copy=engine,
                 chunk_kib=CHUNK >> 10, slots=3)
    try:
        _move(a, b, op, descs, 9)
        _expect(src.t.numpy(), dst.t.numpy(), descs)  # read after the wait: nothing more is synchronised
        sa, sb = a.take_stages(), b.take_stages()
    finally:
        a.close()
        b.close()
    assert waits["cuStreamSynchronize"] == 0 and waits["cuCtxSynchronize"] == 0, waits
    assert N <= waits["cuEventSynchronize"] <= 2 * N + 3, waits
    assert sa["gather"] > 0 and sb["scatter"] > 0  # the events' device time
    assert not fake.pending()


def test_each_slot_copy_is_made_once_per_descriptor_array(monkeypatch):
    """The harness posts a request's arrays again every iteration: the chunks' copy arrays are made once per array
    and role (split called once by each end), then reused, and so are the inner transport's one-row arrays; the
    old code split the layer in every post and stacked a new array for every chunk."""
    calls = []
    real = staging.split

    def counted(d, chunk):
        calls.append(id(d))
        return real(d, chunk)

    monkeypatch.setattr(staging, "split", counted)
    monkeypatch.setattr(staged, "split", counted, raising=False)  # where the old code called it
    src, dst = _host_pools(1 << 20)
    descs = _paged(16, 16 << 10)
    ex = _Exchange()
    a, b = _pair(monkeypatch, [src, dst], ex, chunk_kib=64, slots=2)
    try:
        chunks = []
        for tag in (1, 2, 3):
            dst.array[:] = 0
            _, h = _move(a, b, "push", descs, tag)
            _expect(src.array, dst.array, descs)
            chunks.append(h.chunks)
    finally:
        a.close()
        b.close()
    assert len(calls) == 2  # the source's gathers and the destination's scatters, once each
    assert chunks[0] is chunks[1] is chunks[2]
    assert len({id(r) for r in ex.rows}) == 2  # 4 chunks of 64 KiB over 2 slots: one array per slot


@pytest.mark.parametrize("value,needle", [("0", "greater than or equal to 1"), ("-4", "greater than or equal to 1"),
                                          ("1.5", "valid integer"), ("four", "valid integer")])
def test_a_slot_size_that_is_not_a_positive_integer_is_refused_in_one_line(value, needle):
    line = refusal(full(["-t", "staged", "--memory", "torch-cpu", "-O", f"slot_mib={value}"]))
    assert "\n" not in line and f"staged option slot_mib='{value}'" in line and needle in line, line


def test_slot_mib_0_is_refused_on_real_ranks(kvrun, tmp_path):
    r = kvrun(["-t", "staged", "--memory", "torch-cpu", "--tokens", "256", "-n", "1", "-O", "slot_mib=0"], timeout=60)
    assert_one_line(r, "staged option slot_mib='0'", "greater than or equal to 1")
    assert_nothing_written(tmp_path)
