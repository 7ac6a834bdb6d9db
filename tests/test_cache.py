"""--cache: a request's bytes read (warm) or flushed (cold) on each rank before every iteration's barrier."""
import platform

import numpy as np
import pytest

from kvbench import _native
from kvbench.cli.main import ArgError, build_parser
from kvbench.config import runconfig as config
from kvbench.memory import cachestate
from kvbench.model.layout import Pool
from kvbench.model.schemes import Entry

SMALL = ["-m", "llama-3-8b", "--tokens", "64", "-b", "16", "-n", "3", "-w", "1", "--variants", "bulk,paged",
         "--rounds", "1"]


def descs(rows) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def test_touch_reads_one_byte_of_every_line_and_refuses_a_range_outside():
    buf = np.zeros(1 << 16, np.uint8)
    buf[::64] = 1
    buf[1::64] = 7  # not a line's first byte: not read
    buf[-1] = 5  # a range's last byte is read too (a range that starts mid-line ends in a line of its own)
    d = descs([[0, 4096, 4096], [8192, 0, 1000]])  # 64 lines, then 16 (the last one partial)
    assert _native.touch(buf, d, 0) == 64 + 16
    assert _native.touch(buf, d, 1) == 64 + 16  # the DST column: lines of [4096, 8192) and [0, 1000)
    mid = np.zeros(256, np.uint8)
    mid[32], mid[95] = 3, 4
    assert _native.touch(mid, descs([[32, 0, 64]]), 0) == 7  # starts mid-line: bytes 32 (line 0) and 95 (line 1)
    assert _native.touch(buf, descs([[(1 << 16) - 33, 0, 33]]), 0) == 5  # ends at the buffer's end
    with pytest.raises(ValueError, match="descriptor 1 .* outside the pool buffer"):
        _native.touch(buf, descs([[0, 0, 64], [1 << 16, 0, 1]]), 0)
    with pytest.raises(ValueError, match="col must be"):
        _native.touch(buf, d, 2)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="no cache-line flush on this CPU")
def test_evict_flushes_without_changing_a_byte():
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    want = buf.copy()
    assert _native.evict(buf, descs([[0, 0, 1 << 20], [100, 0, 3], [(1 << 20) - 65, 0, 65]]), 0) is True
    assert np.array_equal(buf, want)
    with pytest.raises(ValueError, match="outside the pool buffer"):
        _native.evict(buf, descs([[1 << 20, 0, 1]]), 0)


def entry(src, dst, layers):
    return Entry(pair=0, req=0, src=src, dst=dst, layers=[descs(x) for x in layers])


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_each_rank_sets_exactly_its_side_of_every_request(monkeypatch, mode):
    pool = Pool(np.zeros(1 << 16, np.uint8))
    other = Pool(np.zeros(1 << 16, np.uint8))
    e = entry(0, 1, [[[0, 4096, 1024], [2048, 8192, 512]], [[16384, 0, 4096]]])
    seen = []
    fake = lambda buf, d, col: seen.append((id(buf), int(d[:, col].sum()), int(d[:, 2].sum()), col))  # noqa: E731
    monkeypatch.setattr(_native, "evict" if mode == "cold" else "touch", fake)
    src = cachestate.make(mode, [pool], [e], rank=0, local=False)
    src.apply()
    assert seen == [(id(pool.array), 2048, 1536, 0), (id(pool.array), 16384, 4096, 0)]  # source ranges, SRC column
    seen.clear()
    cachestate.make(mode, [pool], [e], rank=1, local=False).apply()
    assert seen == [(id(pool.array), 12288, 1536, 1), (id(pool.array), 0, 4096, 1)]  # destination ranges, DST column
    seen.clear()
    cachestate.make(mode, [pool, other], [entry(0, 0, [[[0, 64, 128]]])], rank=0, local=True).apply()
    assert seen == [(id(pool.array), 0, 128, 0), (id(other.array), 64, 128, 1)]  # one rank: both pools
    assert src.per_entry == [1536 + 4096] and src.count == 1
    assert cachestate.make(mode, [pool], [e], rank=2, local=False).ranges == []  # not in this request
    assert cachestate.make("as-is", [pool], [e], rank=0, local=False) is None


def build(argv):
    a = build_parser().parse_args(["run", *argv])
    return config.build(a, argv, world=2)


@pytest.mark.parametrize("argv,needle", [
    (["--cache", "cold", "--memory", "cuda"], "memory cuda pools are device memory"),
    (["--cache", "warm", "--prompt", "64", "--requests", "4"], "applies to bandwidth sweeps"),
])
def test_cache_refuses_what_it_cannot_set_in_one_line(argv, needle):
    with pytest.raises(config.ConfigError, match=needle) as exc:
        build(["-t", "shm", *argv])
    assert "\n" not in str(exc.value)


def test_cache_flag_reaches_the_suite_and_defaults_to_as_is():
    assert build(["-t", "shm"]).suite.cache == "as-is"
    assert build(["-t", "shm", "--cache", "cold"]).suite.cache == "cold"


def test_a_warm_case_runs_to_the_end_unless_rounds_are_asked_for():
    assert build(["-t", "shm", "-n", "20"]).suite.turns() == 5  # cases take turns by default ...
    assert build(["-t", "shm", "-n", "20", "--cache", "cold"]).suite.turns() == 5
    assert build(["-t", "shm", "-n", "20", "--cache", "warm"]).suite.turns() == 1  # ... but not a warm loop
    assert build(["-t", "shm", "-n", "20", "--cache", "warm", "--rounds", "3"]).suite.turns() == 3


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_run_under_each_setting_moves_every_byte_and_says_so(kvrun, mode):
    r = kvrun(["-t", "shm,tcp", "--op", "push,pull", "--cache", mode, *SMALL])
    assert r.code == 0, r.out + r.err
    assert f"# cache {mode}: each rank " in r.out
    df = r.table()
    assert set(df.cache) == {mode} and set(df.transport) == {"shm", "tcp"}
    timed = df[df.iter >= 0]  # every timed iteration began with this rank's side of its request set: all its bytes
    assert len(timed) == 8 * 3 * 2 and (timed.cache_bytes == timed.payload_bytes).all()
    checks = df[(df.iter == -1) & (df.role == "decode")]
    assert len(checks) == 8 and int(checks.nwrong.sum()) == 0  # 2 transports x 2 ops x (bulk, paged)
    assert r.meta()["suite"]["cache"] == mode


def test_as_is_sets_nothing(kvrun):
    r = kvrun(["-t", "shm", "--op", "push", *SMALL])
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert set(df.cache) == {"as-is"} and (df.cache_bytes == 0).all() and "# cache" not in r.out


def test_an_unknown_setting_is_refused_in_one_line():
    with pytest.raises(ArgError, match="--cache: invalid choice: 'hot'") as exc:
        build(["-t", "shm", "--cache", "hot"])
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("it", [-1, 0, 5])  # the check pass, the first timed iteration, a later one
def test_the_setting_is_the_last_thing_before_the_barrier_that_starts_an_iteration(it):
    from types import SimpleNamespace

    from kvbench.harness.loop import Harness
    from kvbench.harness.state import Measurement

    calls = []

    class Itr:
        def run(self, tag, start):
            calls.append("register and prepare")  # what Iteration.run does before calling start()
            start()
            calls.append("timed")
            return [], 0.0, 0.0, 0.0

    state = SimpleNamespace(apply=lambda: calls.append("cache"))
    h = SimpleNamespace(rank=3, comm=SimpleNamespace(barrier=lambda: calls.append("barrier")))
    Harness._once(h, Measurement(1, {}, {}, [], Itr(), cache=state), it)
    assert calls == ["register and prepare", "cache", "barrier", "timed"]
    calls.clear()
    Harness._once(h, Measurement(1, {}, {}, [], Itr()), it)  # as-is
    assert calls == ["register and prepare", "barrier", "timed"]


def test_one_rank_sets_both_sides_of_its_requests(kvrun):
    r = kvrun(["-t", "loopback", "--op", "push", "--cache", "cold", *SMALL], n=1)
    assert r.code == 0, r.out + r.err
    timed = r.table().query("iter >= 0")
    assert len(timed) == 2 * 3 and (timed.role == "both").all()  # bulk and paged, 3 iterations
    assert (timed.cache_bytes == 2 * timed.payload_bytes).all()  # its source ranges and its destination ranges
