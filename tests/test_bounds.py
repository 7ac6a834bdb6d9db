"""A landing time bounded from two sides (results/bounds.py, harness/bounds.py): a stamp earlier than this
machine's wake-up latency allows, or GB/s above what the path can carry, ends the run SUSPECT (exit 6) with one
line naming the case, the bound and the margin; honest runs stay OK (tests/test_honesty.py)."""
import os
import sys

import numpy as np
import pandas as pd
import pytest
from helpers.launch import liar_env
from liars import BOUND_LIARS

from kvbench.harness import bounds as HB
from kvbench.job import status as ST
from kvbench.results import bounds as B

# 128 MiB requests: a half of tcp's transfer is far beyond a wake-up on a loaded machine (several ms), and the
# request is larger than the last-level cache, so the harness's copy of it comes from memory as the transport's
# does (one the cache holds copies faster for the harness than for the transport)
BIG = ["-m", "llama-3-8b", "--tokens", "1024", "-n", "6", "-w", "1", "--variants", "bulk"]
ENV = liar_env(BOUND_LIARS)


def suspect_line(r) -> str:
    lines = [ln for ln in r.out.splitlines() if "SUSPECT:" in ln]
    assert lines, r.out + r.err
    return lines[0]


@pytest.mark.alone  # the lie against a bound measured beside it: another test's load moves them apart
@pytest.mark.parametrize("op,check", [pytest.param("pull", "1", marks=pytest.mark.check), ("push", "0")])
def test_a_stamp_halfway_to_the_landing_is_suspect(kvrun, op, check):
    """tcp stamping halfway between its receive post and the real landing.  A push posts its receives before
    the barrier: with -c 1 the check pass's ordering check sees that stamp first (ERROR, test_honesty), so
    the push runs -c 0; a pull posts its read once the layer is final, and the check pass cannot see it."""
    r = kvrun(["-t", "lie-stamp-half", "--op", op, "-c", check, *BIG], env=ENV, timeout=120)
    assert r.code == ST.exit_code("SUSPECT") == 6, r.out + r.err
    line = suspect_line(r)
    assert f"case 1 (lie-stamp-half {op} llama-3-8b 1024 tokens, bulk" in line, line
    assert "wake-up bound" in line and "% (spread" in line, line
    meta = r.meta()
    assert meta["status"] == "SUSPECT" and meta["reason"] == line[2:] and line[2:] in meta["suspects"]
    assert r.out.rstrip().splitlines()[-2].endswith("SUSPECT")
    dec = r.table().query("iter >= 0 and role == 'decode'")
    assert (dec.wake_bound_s > 0).all() and (dec.wake_p99_s > 0).all() and (dec.wake_p99_s < dec.wake_bound_s).all()


@pytest.mark.alone  # a lead of a few ms against the wake-ups beside it: another test's load raises those
@pytest.mark.parametrize("op,check", [("pull", "1"), ("push", "0")])
@pytest.mark.parametrize("tokens", ["64", "256"])  # 8 and 32 MiB: a half far below the p99 wake-up bound
def test_a_stamp_halfway_to_the_landing_of_a_small_request_is_suspect(kvrun, op, check, tokens):
    """Below the p99-based wake-up bound, a stamp halfway to the landing still leads its wait by the whole time it
    reports, where an honest one leads by a wake-up: the share rule names it (results/bounds.py, LEAD_SHARE)."""
    small = ["-m", "llama-3-8b", "--tokens", tokens, "-n", "8", "-w", "1", "--variants", "bulk"]
    r = kvrun(["-t", "lie-stamp-half", "--op", op, "-c", check, *small], env=ENV, timeout=120)
    assert r.code == 6, r.out + r.err
    line = suspect_line(r)
    assert f"case 1 (lie-stamp-half {op} llama-3-8b {tokens} tokens, bulk" in line, line
    assert "precedes its wait's return" in line, line  # by a share of its time, or beyond the p99 wake-up bound


@pytest.mark.alone  # two copies of the same bytes compared: another test's load moves them apart
@pytest.mark.check
def test_a_stamp_of_half_the_real_time_on_shm_is_suspect_and_never_the_headline(kvrun):
    """Issue 42 item 3: shm stamping half its copy's time read twice its GB/s while the transport's stamp was the
    headline; the headline is now the harness's own time (the liar's time is the honest copy's, in the same
    run), and the stamp, a diagnostic, is still judged: from the destination's post to that stamp is faster than
    the copy beside it, SUSPECT."""
    r = kvrun(["-t", "shm,lie-half-time", "--op", "pull", *BIG], env=ENV, timeout=120)
    assert r.code == 6, r.out + r.err
    line = suspect_line(r)
    assert "case 2 (lie-half-time pull llama-3-8b 1024 tokens, bulk" in line, line
    # its stamp falls halfway through its own post call, which copies: a lead of half its time over the call's
    # return, whatever the load (its post-to-landing window against the copy beside it was only 1.3x: NOISY under
    # load); or, where that window still beats the copies clearly, that too
    assert "precedes its wait's return (or its own post call's)" in line or (
        "(post to landing)" in line and "beyond the path's bound" in line), line
    t = r.table().query("iter >= 0 and role == 'decode'")
    honest, liar = (float(t[t.transport == x].seconds.median()) for x in ("shm", "lie-half-time"))
    assert liar > 0.75 * honest, (liar, honest)  # halved it reads 0.5x
    assert int(r.table().query("iter == -1 and role == 'decode'").nwrong.sum()) == 0  # every byte is right


def test_wake_bound_is_a_high_percentile_with_a_margin():
    s = np.full(100, 20e-6)
    s[-2:] = 5e-3  # two late wake-ups in a hundred: the 99th percentile
    want = B.WAKE_FACTOR * np.percentile(s, B.WAKE_PCT) + sys.getswitchinterval() + B.WAKE_FLOOR_S
    assert B.wake_bound(s) == pytest.approx(want)
    assert B.wake_bound(s, switch_s=0.005) == pytest.approx(B.WAKE_FACTOR * 5e-3 + 0.005 + B.WAKE_FLOOR_S)
    assert np.isnan(B.wake_bound([]))
    got = HB.wake_samples(n=30, budget_s=0.05)  # a real measurement on this machine
    assert len(got) >= 20 and (got > 0).all() and (got < 1).all()


def test_link_rates_from_the_kernel(tmp_path):
    assert B.link_gbps(100_000) == 12.5 and B.link_gbps(None) is None and B.link_gbps(-1) is None
    assert B.rdma_gbps("400 Gb/sec (4X NDR)") == 50.0 and B.rdma_gbps("") is None
    assert B.network_bound(root=str(tmp_path))[1].startswith("none")
    for name, speed in (("eth0", "25000"), ("lo", "x"), ("eth1", "-1")):
        os.makedirs(tmp_path / "class" / "net" / name)
        (tmp_path / "class" / "net" / name / "speed").write_text(speed)
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    os.makedirs(port)
    (port / "rate").write_text("200 Gb/sec (4X HDR)")
    assert B.network_bound("eth0", str(tmp_path)) == (3.125, "link eth0")  # the NIC the transport used
    assert B.network_bound(None, str(tmp_path)) == (3.125 + 25.0, "links eth0+mlx5_0/1")  # any NIC


def test_the_harness_copy_moves_the_same_bytes():
    pool = np.arange(1 << 16, dtype=np.uint32).view(np.uint8).copy()
    layers = [np.array([[0, 4096, 1000], [0, 9000, 24]], np.int64), np.array([[0, 100, 77]], np.int64)]
    d = HB.packed_descs(layers)
    from kvbench import _native

    scratch = np.zeros(2048, np.uint8)
    _native.copy_batch(scratch, pool, d)
    want = np.concatenate([pool[4096:5096], pool[9000:9024], pool[100:177]])
    assert (scratch[:len(want)] == want).all() and (scratch[len(want):] == 0).all()


class _Pool:
    kind = "host"

    def __init__(self, n):
        self.array = np.arange(n, dtype=np.uint8)


def _harness(calls, rank=1, hosts=("h", "h"), any_rank=True, peer_sends=None):
    class Comm:
        def barrier_asleep(self):
            calls.append("barrier")

        def allgather(self, x):  # (copies anything, copies as a source) of this rank and its peer
            return [x, (any_rank, any_rank if peer_sends is None else peer_sends)]

    class H:
        comm, opts = Comm(), type("O", (), {"pages": "4k"})()

    H.rank, H.hosts = rank, list(hosts)
    return H()


def test_each_timed_iteration_gets_its_own_copy_between_sleeping_barriers(monkeypatch):
    """The bound beside each iteration: every rank sleeps at a barrier (no peer checking or spinning in MPI beside
    the copy), the destination copies each request it receives from its own host (the better of two), every rank
    sleeps again, the source copies its own ranges of it (the better of two), a last barrier; one GB/s per timed
    iteration on each side, and a case's rows carry them in order."""
    from kvbench.harness import rows as R
    from kvbench.model.schemes import Entry

    calls = []
    monkeypatch.setattr(HB._native, "copy_batch", lambda *a: calls.append("copy"))
    layers = [np.array([[0, 0, 4096], [0, 8192, 4096]], np.int64)]
    e = Entry(pair=0, req=0, src=0, dst=1, layers=layers)
    far = Entry(pair=1, req=0, src=2, dst=1, layers=layers)
    b = HB.Beside(_harness(calls, hosts=("h", "h", "other")), [e, far], [_Pool(1 << 16)])
    assert [k for k, _, _ in b.jobs] == [id(e)]  # across hosts a link's rate bounds it, no copy
    b.copy()
    b.copy()
    assert calls == ["barrier", "copy", "copy", "barrier", "barrier"] * 2  # its copies, then its source's
    assert len(b.gbps[id(e)]) == 2 and all(g > 0 for g in b.gbps[id(e)])
    assert R.bound_at(b.gbps[id(e)], 1) == b.gbps[id(e)][1] and np.isnan(R.bound_at(b.gbps[id(e)], 2))
    assert R.bound_at([1.0, 3.0, 2.0], None) == 2.0 and R.bound_at(5.0, 0) == 5.0
    # the source copies its own ranges after the destination's copies, never beside them
    calls.clear()
    src = HB.Beside(_harness(calls, rank=0, peer_sends=False), [e], [_Pool(1 << 16)])
    assert [k for k, _, _ in src.sends] == [id(e)] and src.sends[0][2][:, 0].tolist() == [0, 0]  # its SRC ranges
    src.copy()
    assert calls == ["barrier", "barrier", "copy", "copy", "barrier"] and len(src.gbps[id(e)]) == 1
    # where no source copies, the middle barrier is left out; where no rank copies, nobody waits
    calls.clear()
    HB.Beside(_harness(calls, hosts=("h", "h", "other"), peer_sends=False), [far], [_Pool(1 << 16)]).copy()
    assert calls == ["barrier", "barrier"]
    calls.clear()
    HB.Beside(_harness(calls, rank=0, any_rank=False), [], [_Pool(1 << 16)]).copy()
    hot = HB.Beside(_harness(calls), [e], [_Pool(1 << 16)], variant="hot")
    assert calls == [] and hot.jobs == []


def rows(case, seconds, bound, kind="memory copy", lead=np.nan, wake=np.nan, payload=1e9, rank=1):
    n = len(seconds)
    return pd.DataFrame({"case": case, "variant": "bulk", "transport": "shm", "op": "pull", "model": "m",
                         "tokens": 256, "memory": "host", "overlap": "serial", "allocation": "bulk", "block_size": 0,
                         "rank": rank, "role": "decode", "pair": 0, "req": 0, "iter": range(n), "status": "ok",
                         "seconds": seconds, "payload_bytes": payload, "clock_err_s": 0.0, "stamp_lead_s": lead,
                         "wake_bound_s": wake, "bound_gbps": bound, "bound_kind": kind})


def stats(df):
    t = df.groupby("case").agg(**{c: (c, "first") for c in ("variant", "transport", "op", "model", "tokens",
                                                             "memory", "overlap", "allocation", "block_size",
                                                             "payload_bytes")}, p50=("seconds", "median"))
    t["gbps"] = t["payload_bytes"] / t["p50"] / 1e9
    return t.reset_index()


def test_a_case_beyond_its_path_is_suspect_by_more_than_its_spread():
    honest = rows(1, [0.1, 0.11, 0.1, 0.12], bound=10.0)  # 10 GB/s under a 10 GB/s copy
    near = rows(2, [0.09, 0.085, 0.09, 0.095], bound=10.0)  # 11 GB/s: within the noise margin
    liar = rows(3, [0.05, 0.05, 0.055, 0.05], bound=10.0)  # 20 GB/s
    noisy = rows(4, [0.1 / 1.4, 0.1 / 1.35, 0.1 / 1.25, 0.5], bound=10.0)  # 13 GB/s, 13.6 at its upper quartile, but
    # its spread (14%) covers both
    df = pd.concat([honest, near, liar, noisy], ignore_index=True)
    got = B.suspects(df, stats(df))
    assert [s["case"] for s in got] == [3]
    s = got[0]
    assert s["value"] == pytest.approx(20.0) and s["bound"] == 10.0 and s["margin_pct"] == pytest.approx(100.0)
    line = B.line(s)
    assert line.startswith("SUSPECT: case 3 (shm pull m 256 tokens, bulk, host, serial): 20.00 GB/s (p50) beyond")
    assert "bound 10.00 GB/s (memory copy) by 100%" in line
    # the clock's error bound counts for the row: 0.05 s matched within 0.05 s could have taken 0.1 s
    liar["clock_err_s"] = 0.05
    assert B.suspects(liar, stats(liar)) == []
    unbound = rows(5, [0.01] * 3, bound=np.nan, kind="none (device memory)")
    assert B.suspects(unbound, stats(unbound)) == []


def test_fast_iterations_beyond_the_copy_are_suspect_where_the_median_is_not():
    """A transport whose real copy runs at 0.6 of the harness's (a peer's pages) and reports half its time: 1.2x at
    p50, within the margin; its upper quartile, 1.35x, is not.  One iteration that moved nothing is no quartile."""
    half = rows(1, [0.1 / 1.2, 0.1 / 1.2, 0.1 / 1.22, 0.1 / 1.35, 0.1 / 1.35, 0.1 / 1.1], bound=10.0)
    (s,) = B.suspects(half, stats(half))
    assert s["measure"] == "upper quartile" and s["value"] == pytest.approx(np.percentile([11, 12, 12, 12.2, 13.5, 13.5], 75))
    assert "13.17 GB/s (upper quartile) beyond the path's bound 10.00 GB/s (memory copy)" in B.line(s)
    skip = rows(2, [0.1 / 0.9] * 9 + [1e-6], bound=10.0)  # one skipped iteration in ten: 1e6 GB/s
    assert B.suspects(skip, stats(skip)) == []
    calm = rows(3, [0.1 / 1.1, 0.1 / 1.2, 0.1 / 1.2, 0.1 / 1.22], bound=10.0)  # 1.2x at its upper quartile
    assert B.suspects(calm, stats(calm)) == []


def test_a_destination_that_posts_is_judged_from_its_post_to_the_landing():
    """A pull's wait for the layer-ready word (a wake-up on a loaded machine) hides half a copy in its p50; from
    the destination's own post to its landing it does not."""
    slow = rows(1, [0.1] * 4, bound=10.0)  # 10 GB/s at p50: within the bound
    slow["window_s"] = [0.05, 0.05, 0.05, 0.05]  # but 20 GB/s from the post
    (s,) = B.suspects(slow, stats(slow))
    assert s["measure"] == "post to landing" and s["value"] == pytest.approx(20.0)
    assert "20.00 GB/s (post to landing) beyond the path's bound 10.00 GB/s (memory copy)" in B.line(s)
    hot = slow.assign(variant="hot", window_s=0.05)  # one cache-resident buffer again and again: no bound
    assert B.suspects(hot, stats(hot)) == []
    slow["window_s"] = 0.1
    assert B.suspects(slow, stats(slow)) == []


def test_a_stamp_that_precedes_its_wait_by_more_than_a_wake_up_is_suspect():
    honest = rows(1, [0.1] * 4, bound=np.nan, lead=[1e-4, 2e-4, 1e-4, 3e-3], wake=2e-3)  # one late wake-up
    liar = rows(2, [0.1] * 4, bound=np.nan, lead=[0.04, 0.05, 0.045, 0.05], wake=2e-3)
    df = pd.concat([honest, liar], ignore_index=True)
    (s,) = B.suspects(df, stats(df))
    assert s["case"] == 2 and s["what"] == "wake" and s["rank"] == 1
    assert "rank 1's landing stamp (pair 0, request 0) precedes its wait's return (or its own post call's) by " \
           "40000 us (in every iteration), beyond the wake-up bound 2000 us" in B.line(s)
    assert B.suspects(df.drop(columns=["stamp_lead_s"]), stats(df)) == []  # an older schema: nothing to judge


def test_suspect_has_its_own_exit_code_and_yields_to_wrong_bytes():
    assert ST.exit_code("SUSPECT") == 6 and [s for s, (c, _) in ST.STATUSES.items() if c == 6] == ["SUSPECT"]
    assert ST.verdict(3, True, 0, 1) == "SUSPECT" and ST.verdict(3, False, 0, 2) == "SUSPECT"
    assert ST.verdict(3, True, 5, 1) == "FAILED" and ST.verdict(3, True, 0) == "OK"


def test_each_iteration_is_judged_against_the_copy_beside_it():
    """Load that slows an iteration slows the copy beside it too: a case whose copies were slow in the same
    moments as its iterations is no lie (judged against one copy measured elsewhere, it read 2x); a halved time
    beats the copy beside every iteration and the best of them, and stays SUSPECT."""
    loaded = rows(1, [0.1, 0.2, 0.1, 0.3, 0.2], bound=[10.0, 5.0, 10.0, 1 / 0.3, 5.0])
    assert B.verdicts(loaded, stats(loaded)) == []
    liar = rows(2, [0.05, 0.1, 0.05, 0.15, 0.1], bound=[10.0, 5.0, 10.0, 1 / 0.3, 5.0])
    (s,) = B.verdicts(liar, stats(liar))
    assert s["verdict"] == "SUSPECT" and s["margin_pct"] == pytest.approx(100.0) and s["bound"] == 5.0
    assert s["best"] == 10.0 and B.suspects(liar, stats(liar)) == [s] and B.noisy(liar, stats(liar)) == []
    assert "(memory copy) by 100% (each iteration against the copy beside it, median; spread" in B.line(s)


def test_beyond_the_copies_beside_it_but_within_their_best_is_noisy_not_suspect():
    """Copies slowed by other work while the transfers ran free: 2x the copy beside each iteration, yet below the
    best copy of the window plus the margin.  Load can make that, so no verdict: NOISY, with how to get one."""
    df = rows(1, [0.05] * 5, bound=[10.0, 10.0, 10.0, 18.0, 10.0])  # 20 GB/s; the best copy 18 GB/s
    (s,) = B.verdicts(df, stats(df))
    assert s["verdict"] == "NOISY" and B.suspects(df, stats(df)) == [] and B.noisy(df, stats(df)) == [s]
    line = B.line(s)
    assert line.startswith("NOISY: case 1 (shm pull m 256 tokens, bulk, host, serial): 20.00 GB/s (p50) beyond")
    assert "within this run's best copy of its bytes (18.00 GB/s)" in line and "--bind core" in line


def test_a_case_whose_copies_all_sat_in_a_slow_phase_is_judged_against_the_run_s_best_copy_of_its_bytes():
    """Two iterations whose copies were both slowed by another job (the CI machine's false SUSPECT: 15 GB/s
    against 9.4 GB/s copies) while an earlier case copied the same bytes at 25 GB/s on the same rank: NOISY.
    The same case with no faster copy of its bytes anywhere in the run, or a faster copy only of other bytes or on
    another rank, stays SUSPECT: the run's best copy bounds only the bytes it copied, where it copied them."""
    slow = rows(2, [1 / 15.0] * 2, bound=[9.4, 9.4])  # 15 GB/s against 9.4 GB/s copies
    fast = rows(1, [0.1] * 2, bound=[25.0, 24.0])  # the same payload on the same rank, copied at 25 GB/s
    df = pd.concat([fast, slow], ignore_index=True)
    (s,) = B.verdicts(df, stats(df))
    assert s["case"] == 2 and s["verdict"] == "NOISY" and s["best"] == 25.0 and B.suspects(df, stats(df)) == []
    for other in (rows(1, [0.2] * 2, bound=[25.0] * 2, payload=2e9), rows(1, [0.1] * 2, bound=[25.0] * 2, rank=3)):
        df = pd.concat([other, slow], ignore_index=True)
        (s,) = B.verdicts(df, stats(df))
        assert s["case"] == 2 and s["verdict"] == "SUSPECT" and s["best"] == 9.4


def test_a_case_whose_clocks_are_matched_only_loosely_is_named_skew_and_not_ok_on_the_page():
    from kvbench.report.summary import status

    df = pd.concat([rows(1, [1e-3] * 4, bound=np.nan), rows(2, [1e-3] * 4, bound=np.nan)], ignore_index=True)
    st = stats(df)
    st["clock_err_s"], st["clock_flag"] = [1e-5, 2e-4], [False, True]  # 1% and 20% of a 1 ms p50
    (line,) = B.skew_lines(st)
    assert line.startswith("SKEW: case 2 (shm pull m 256 tokens, bulk, host, serial): the ranks' clocks are matched "
                           "only within 200 us, 20% of its p50 (1000 us)"), line
    assert [status(r) for _, r in st.iterrows()] == ["ok", "SKEW"]
    assert B.skew_lines(st.drop(columns="clock_flag")) == [] and B.skew_lines(None) == []


def test_a_stamp_that_leads_by_a_share_of_its_own_time_is_suspect_below_the_wake_up_bound():
    """An honest stamp leads its wait's return by a wake-up (tens of us, even beside two busy loops); one halfway
    to the landing leads by the whole time it reports.  At 8 MiB (1 ms reported) that is far below the p99-based
    wake-up bound (5 ms here), but a quarter of its own time and more than 0.5 ms: SUSPECT.  Below the floor
    (a 0.3 ms lead) or below the share (1 ms of a 10 ms time) it is not."""
    honest = rows(1, [1e-3] * 6, bound=np.nan, lead=[3e-5, 5e-5, 4e-5, 6e-5, 3e-5, 1e-3], wake=5e-3)
    liar = rows(2, [1e-3] * 6, bound=np.nan, lead=[1.0e-3, 1.1e-3, 0.9e-3, 1.0e-3, 1.05e-3, 1e-3], wake=5e-3)
    small = rows(3, [0.6e-3] * 6, bound=np.nan, lead=[3e-4] * 6, wake=5e-3)
    long_ = rows(4, [10e-3] * 6, bound=np.nan, lead=[1e-3] * 6, wake=5e-3)
    df = pd.concat([honest, liar, small, long_], ignore_index=True)
    (s,) = B.verdicts(df, stats(df))
    assert s["case"] == 2 and s["what"] == "lead" and s["value"] == pytest.approx(1e-3)
    line = B.line(s)
    assert line.startswith("SUSPECT: case 2 (shm pull m 256 tokens, bulk, host, serial): rank 1's landing stamp "
                           "(pair 0, request 0) precedes its wait's return (or its own post call's) by 1000 us, 100% "
                           "of the 1000 us that iteration reports (beyond 25% and 500 us by 100%, in most "
                           "iterations)"), line


def test_a_waiter_woken_late_in_one_of_two_iterations_is_no_lie():
    """CI's false SUSPECT: an honest tcp push of 2 MiB, two iterations, its waiter woken ~3.9 ms after the landing
    in one of them on a loaded machine (median lead 1965 us, 72% of a 2.7 ms median).  A lie leads in every
    iteration; a late wake-up only in some: the least lead judges, and the same lead in both iterations is caught."""
    late = rows(1, [5.0e-3, 0.44e-3], bound=np.nan, lead=[3.9e-3, 3e-5], wake=5e-3)
    assert B.verdicts(late, stats(late)) == []
    both = rows(2, [5.0e-3, 4.4e-3], bound=np.nan, lead=[3.9e-3, 3.4e-3], wake=5e-3)
    (s,) = B.verdicts(both, stats(both))
    assert s["case"] == 2 and s["what"] == "lead" and s["value"] == pytest.approx(3.4e-3)
    # a liar whose receive was posted late in three of eight iterations (its half-way stamp then near the landing)
    # still leads in five: caught; an honest waiter woken late in three of eight is not
    most = rows(3, [2e-3] * 8, bound=np.nan, lead=[1e-3] * 5 + [5e-5] * 3, wake=5e-3)
    assert [s["case"] for s in B.verdicts(most, stats(most))] == [3]
    some = rows(4, [2e-3] * 8, bound=np.nan, lead=[1e-3] * 3 + [5e-5] * 5, wake=5e-3)
    assert B.verdicts(some, stats(some)) == []
    # a transport that does not stamp (an infinite wake-up bound) is judged by the share; ranks that outnumber
    # their CPUs (no bound) are not judged at all
    assert [s["what"] for s in B.verdicts(both.assign(wake_bound_s=np.inf), stats(both))] == ["lead"]
    assert B.verdicts(both.assign(wake_bound_s=np.nan), stats(both)) == []


def test_a_waiter_late_by_no_more_than_the_wake_ups_measured_beside_it_is_no_lie():
    """The busy machine's false SUSPECT (make test two files at a time): an honest tcp push of 3.3 MiB, three
    iterations of ~4.8 ms, its waiter woken 1.36-1.4 ms after the landing in two of them (beyond a quarter of its
    time and 0.5 ms).  The wake-ups the rank measured beside that case reached 2 ms at p99 (wake_p99_s): a lead
    within them is one of them.  The same leads where the wake-ups beside it took 50 us at p99, or in rows of an
    older schema (no wake_p99_s), are SUSPECT, and the line names the floor it used."""
    loaded = rows(1, [4.79e-3] * 3, bound=np.nan, lead=[1.36e-3, 1.4e-3, 5e-5], wake=12e-3).assign(wake_p99_s=2e-3)
    assert B.verdicts(loaded, stats(loaded)) == []
    for quiet in (loaded.assign(wake_p99_s=5e-5), loaded.drop(columns="wake_p99_s")):
        (s,) = B.verdicts(quiet, stats(quiet))
        assert s["what"] == "lead" and s["value"] == pytest.approx(1.36e-3) and s["floor"] == pytest.approx(5e-4)
        assert "beyond 25% and 500 us by" in B.line(s)
    # beyond the loaded p99 in most iterations, the lead is judged again: a stamp that leads by 3 ms of 4.8
    worse = loaded.assign(stamp_lead_s=[3e-3, 3.1e-3, 5e-5])
    (s,) = B.verdicts(worse, stats(worse))
    assert s["what"] == "lead" and s["floor"] == pytest.approx(2e-3) and "beyond 25% and 2000 us by" in B.line(s)
    assert B.wake_p99([1e-5] * 99 + [1.0]) == pytest.approx(np.percentile([1e-5] * 99 + [1.0], B.WAKE_PCT))
    assert np.isnan(B.wake_p99([]))


def test_one_iteration_is_not_judged_by_its_stamp_and_two_are():
    """An honest staged push, one timed iteration beside the other test worker: its waiter woke 10.6 ms after the
    landing, beyond the 5.9 ms wake-up bound.  One iteration cannot tell a lie (it leads in each) from a waiter
    woken late once: not judged; the same lead in both of two iterations is SUSPECT."""
    one = rows(1, [80e-3], bound=np.nan, lead=[10.6e-3], wake=5.87e-3).assign(wake_p99_s=2.7e-4)
    assert B.verdicts(one, stats(one)) == []
    two = rows(1, [80e-3] * 2, bound=np.nan, lead=[10.6e-3] * 2, wake=5.87e-3).assign(wake_p99_s=2.7e-4)
    assert [s["what"] for s in B.verdicts(two, stats(two))] == ["wake"]
