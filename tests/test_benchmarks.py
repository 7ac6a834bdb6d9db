"""The bench-* scripts run end to end (tiny sizes; their numbers are checked by people, not here)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.launch import ROOT, mpiexec


def bench(script, *args, timeout=240, env=None):
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install`")
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), "--mpirun", exe, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


@pytest.mark.launches
def test_fidelity_prints_kvbench_reference_ratio_and_per_layer_cost():
    r = bench("fidelity.py", "-t", "tcp,mpi-sendrecv", "--ops", "push,pull", "--sizes", "65536", "--repeat", "1",
              "-n", "3", "-w", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith(("tcp ", "mpi-sendrecv "))]
    # path op rows size unit kvGB/s refGB/s kv-us ref-us ratio (min..max) cost post lib note wake own% ref+- verdict
    assert {(row[0], row[1], row[2]) for row in rows} == {(t, op, v) for t in ("tcp", "mpi-sendrecv")
                                                          for op in ("push", "pull") for v in ("bulk", "paged")}
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in rows)  # kvbench GB/s, reference GB/s
    for row in rows:  # the p50 request times agree with the GB/s beside them: payload = 16 layers x 64 KiB
        for gbps, us in ((row[5], row[7]), (row[6], row[8])):
            assert float(us) == pytest.approx(16 * 65536 / float(gbps) / 1e3, rel=0.05)
    assert all(float(row[11]) >= 0 and row[-1] in ("FAST", "ok", "noise", "not-own", "MISS") for row in rows)
    # own%: a rank's posting lies inside its request, so ~100% at most on a quiet machine; on a busy one (another
    # test file beside it) the slowest rank's median posting, preempted, can outlast the pair's p50 request several
    # times over: a percentage (not a fraction, not microseconds) is what holds.  One repeat: no spread
    assert all(0 <= float(row[-3]) < 1000 and row[-2] == "0" for row in rows), r.stdout
    assert "64 KiB 3/1" in r.stdout  # -n/-w: that many at every size
    assert "# barrier-exit skew" in r.stdout


@pytest.mark.launches
def test_fidelity_reports_an_unavailable_path_and_runs_the_others():
    # mooncake registered to a module that does not exist: kvbench lists it unavailable, saying why
    gone = {"KVBENCH_TRANSPORTS": "mooncake=kvbench_no_such_module:Engine"}
    r = bench("fidelity.py", "-t", "mooncake,tcp", "--ops", "push", "--sizes", "16384", "--repeat", "1", "-n", "3",
              "-w", "1", env=gone)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# mooncake unavailable: not implemented in this version of kvbench; its rows are left out" in r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith(("tcp ", "mooncake "))]
    assert sorted((row[0], row[2]) for row in rows) == [("tcp", "bulk"), ("tcp", "paged")]
    alone = bench("fidelity.py", "-t", "mooncake", "--ops", "push", "--sizes", "16384", "--repeat", "1", env=gone)
    assert alone.returncode != 0 and "none of the paths asked for is available" in alone.stderr


@pytest.mark.launches
def test_fidelity_aa_control_runs_the_reference_in_kvbenchs_place():
    r = bench("fidelity.py", "-t", "tcp", "--ops", "push", "--sizes", "16384", "--repeat", "2", "-n", "3", "-w", "1",
              "--aa")
    assert r.returncode == 0, r.stdout + r.stderr
    launches = [ln.split()[1:3] for ln in r.stderr.splitlines() if ln.startswith("#   ")]
    # two pairs, each side first once; kvbench never launched
    assert launches == [["reference", "A"], ["reference", "tcp"], ["reference", "tcp"], ["reference", "A"]], r.stderr
    assert "# A/A CONTROL" in r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("tcp ")]
    assert [(row[2], row[9] != "nan", row[11]) for row in rows] == [("bulk", True, "nan"), ("paged", True, "nan")]


@pytest.mark.launches
def test_fidelity_reference_rank_that_fails_ends_the_launch(tmp_path, monkeypatch):
    """A reference rank that raises aborts the job: its peer would otherwise wait in MPI until the launch timeout."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install`")
    script, segs = tmp_path / "fail_on_rank1.py", tmp_path / "segments"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r})\n"
        "sys.argv = ['fidelity_ref.py', '--refs', 'tcp', '--sizes', '16384', '--iters', '3', '--warmup', '1']\n"
        "import fidelity_ref as R\n"
        "run_ref = R.run_ref\n"
        "def failing(comm, *a, **k):\n"
        "    if comm.rank == 1:\n"
        "        from kvbench.job.launch import mpich_segments\n"
        f"        open({str(segs)!r}, 'w').write(' '.join(mpich_segments([os.getpid()])))\n"
        "        raise RuntimeError('injected failure on rank 1')\n"
        "    return run_ref(comm, *a, **k)\n"
        "R.run_ref = failing\n"
        "sys.exit(R.main())\n")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from jobs import launch  # timeout, whole-tree kill, this job's own MPICH segments removed

    from kvbench.job.launch import remove_orphan_segments

    rc, out = launch([exe, "-n", "2", sys.executable, str(script)], 60)
    # an abort faster than launch's poll leaves MPICH's segment unrecorded there: the failing rank named it
    assert rc not in (0, 124) and "injected failure on rank 1" in out, out
    named = segs.read_text().split()
    remove_orphan_segments(named)
    assert not [n for n in named if os.path.exists(f"/dev/shm/{n}")]  # the ranks are gone: nothing maps them


def test_fidelity_iterations_scale_with_size_and_parse_per_size(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fidelity
    import fidelity_ref

    sizes = [16384, 65536, 262144, 1048576, 4194304]
    iters = fidelity.iterations(sizes)
    assert iters == sorted(iters, reverse=True) and iters[0] > 100 and iters[-1] == fidelity.MIN_ITERS
    assert fidelity.iterations(sizes, budget_mib=1 << 20) == [fidelity.MAX_ITERS] * 5
    assert fidelity.iterations(sizes, fixed=7) == [7] * 5
    warm = fidelity.warmups(iters)
    assert all(w >= 3 and w >= n // 10 for n, w in zip(iters, warm)) and fidelity.warmups(iters, 0) == [0] * 5
    grouped = fidelity.groups(sizes, iters, warm)  # every size once, one launch per distinct (iterations, warm-up)
    assert sorted(s for ss, _, _ in grouped for s in ss) == sizes
    assert len({(n, w) for _, n, w in grouped}) == len(grouped)
    assert fidelity_ref.per_size("400,200,60,15,15", sizes, "iters") == [400, 200, 60, 15, 15]
    assert fidelity_ref.per_size("30", sizes, "iters") == [30] * 5
    for bad in ("400,200", "x", "", "5,-1,1,1,1"):
        with pytest.raises(SystemExit, match="--iters"):
            fidelity_ref.per_size(bad, sizes, "iters")


def test_fidelity_reference_paged_blocks_are_unsorted_disjoint_and_inside_their_layer(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fidelity_ref

    size, block, layers, span = 1 << 20, 16384, 16, 8 << 20  # 1 MiB layers in a launch sized for 4 MiB
    d = fidelity_ref.descriptors(size, block, layers, "paged", 7, span)
    assert d.shape == (layers * size // block, 3) and (d[:, 2] == block).all()
    for j, layer in enumerate(d.reshape(layers, -1, 3)):
        for col in (0, 1):
            offs = layer[:, col]
            assert (offs % block == 0).all() and len(set(offs.tolist())) == len(offs)  # whole, distinct blocks
            assert offs.min() >= j * span and offs.max() + block <= (j + 1) * span
            assert (np.diff(offs) < 0).any()  # block-table order, as kvbench lists them: not sorted
    bulk = fidelity_ref.descriptors(size, block, layers, "bulk", 7, span)
    assert bulk[:, 0].tolist() == [j * span for j in range(layers)] and (bulk[:, 2] == size).all()
    assert fidelity_ref.descriptors(size, block, 2, "bulk", 7)[:, 0].tolist() == [0, 2 * size]  # default span


def test_fidelity_reference_warms_exactly_the_lines_kvbench_warms(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fidelity_ref
    import numpy as np

    from kvbench import _native

    d = np.array([[0, 4096, 4096], [8192, 0, 1000], [65568, 32768, 64]], np.int64)  # the last: two lines, mid-line
    src = [*range(0, 4096, 64), 4095, *range(8192, 9192, 64), 9191, 65568, 65631]
    dst = [*range(4096, 8192, 64), 8191, *range(0, 1000, 64), 999, 32768, 32831]
    buf = np.arange(1 << 17, dtype=np.int64).astype(np.uint8)
    for col, want in ((0, src), (1, dst)):  # the reference reads these bytes, as kvbench's touch does ...
        ranges = fidelity_ref.warm_ranges(d, col)
        assert fidelity_ref.touch(buf, ranges) == int(buf[want].astype(np.int64).sum()) == _native.touch(buf, d, col)
        elsewhere = np.ones_like(buf)
        elsewhere[want] = 0
        assert fidelity_ref.touch(elsewhere, ranges) == 0  # ... and no other byte of the pool


def test_fidelity_verdict_separates_noise_and_costs_that_are_not_kvbenchs(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fidelity

    assert fidelity.judge([0.8, 0.95, 1.0], 0.9, own=0.5) == "ok"  # the median pair
    assert fidelity.judge([0.8, 0.85, 0.86, 0.95, 1.0], 0.9, own=0.0) == "noise"  # 2 of 5 pairs meet it
    assert fidelity.judge([0.8, 0.85, 0.86, 0.87, 0.95], 0.9, own=0.0) == "not-own"  # 1 of 5: consistent
    assert fidelity.judge([0.84, 0.85, 0.86], 0.9, own=0.01) == "not-own"  # 1% own time cannot mend 6%
    assert fidelity.judge([0.84, 0.85, 0.86], 0.9, own=0.10) == "MISS"  # 10% own time would


def test_fidelity_flags_kvbench_faster_than_the_library_alone(monkeypatch):
    """A ratio above 1.15 is not a success: kvbench cannot beat the plain library it wraps (a stamp too early)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fidelity

    assert fidelity.judge([1.3, 1.4, 2.6], 0.9, own=0.0) == "FAST"
    assert fidelity.judge([1.1, 1.15, 1.2], 0.9, own=0.0) == "ok"  # the median, 1.15, is not above it
    assert fidelity.judge([1.0, 1.16, 1.3], 0.8, own=0.0) == "FAST"


@pytest.mark.launches
def test_overlap_prints_a_verdict_per_row():
    r = bench("overlap.py", "-t", "shm", "--tokens", "128", "--ratios", "2", "-n", "3", "--repeats", "2")
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1 = a row outside the tolerance or a SUSPECT launch; still a table
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith("shm ")]
    assert len(rows) == 4 and {row[-1] for row in rows} <= {"PASS", "FAIL"}, r.stdout + r.stderr  # push/pull x serial/streaming
    for row in rows:  # exp p50 is the median of the two launches' p50s, so it lies within their range
        lo, hi = map(float, row[7].split(".."))
        assert lo <= float(row[6]) <= hi


@pytest.mark.launches
def test_engines_prints_kvbench_beside_the_native_tool():
    # one page size (4k, where a huge page would be a fault): thp's rows are the same code, two launches more
    r = bench("engines.py", "--engines", "nixl", "--sizes", "262144", "--repeat", "1", "-n", "3", "-w", "1",
              "--pages-sizes", "262144", "--pages", "4k", "--ref-iters", "50")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    if "unavailable" in out and "nixl push" not in out:
        pytest.skip("nixl unavailable here")
    assert "nixl_reference WRITE" in out and "# nixl: bulk/tool at >= 256 KiB" in out and "# nixl: hot/tool at >=" in out
    assert "from 1 pairs: not decided, a verdict needs 5 pairs" in out  # one repeat: no verdict
    assert "# nixl: hot cost per request" in out and "harness" in out  # the harness's own time, measured
    assert "bulk/tool" in out.split() and "hot/tool" in out.split()
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("nixl ")]
    # engine op size unit bulk hot tool-GB/s tool-name... bulk/tool (range) hot/tool (range): both GB/s columns filled
    assert rows and all(float(row[4]) > 0 and float(row[5]) > 0 for row in rows)
    hot = [row for row in rows if not row[-5].startswith("x")]  # one-buffer tools: hot/tool is a number
    assert hot and all(float(row[-2]) > 0 for row in hot)
    # the comparison by page size: a row per page size and op, kvbench and the script, page shares per rank
    pages = {(row[0], row[1]): row for row in (ln.split() for ln in out.splitlines()) if row[:1] in (["4k"], ["thp"])}
    assert set(pages) == {("4k", op) for op in ("push", "pull")}
    for row in pages.values():
        assert float(row[4]) > 0 and float(row[5]) > 0 and float(row[6]) > 0  # kvbench, script, ratio
        assert all(0 <= float(x) <= 1 for col in row[-2:] for x in col.split("/"))  # huge shares r0/r1
    assert pages[("4k", "push")][-2:] == ["0.00/0.00"] * 2  # MADV_NOHUGEPAGE: no huge page in either pool
    assert "# pages: kvbench / script (target 0.95)" in out


@pytest.mark.launches
def test_connect_prints_connect_per_peer_and_in_all_per_transport_and_rank_count():
    r = bench("connect.py", "-t", "shm,tcp", "--ranks", "2,4", timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(x[0], int(x[1])): x for x in (ln.split() for ln in r.stdout.splitlines())
            if x and x[0] in ("shm", "tcp")}
    assert set(rows) == {(t, n) for t in ("shm", "tcp") for n in (2, 4)}, r.stdout
    cpus = len(os.sched_getaffinity(0))
    for (_, n), x in rows.items():
        peers, per_peer, total = int(x[2]), float(x[3]), float(x[4])
        assert peers == n // 2  # all-pairs: every even rank with every odd rank
        assert per_peer > 0 and total == pytest.approx(per_peer * peers, rel=0.01, abs=0.02)
        assert ("oversubscribed" in " ".join(x[6:])) == (n > cpus)
