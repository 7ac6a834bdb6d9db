"""Samples earned (issue 31, item 4): every table shows n, a percentile only from the samples that can hold it,
the p50's order-statistic interval, --target-ci's calibration (pure, then one short real run), rank 0's word on going
on, and the readers of older schemas (schema 5 renames `iters` to `samples` and adds ci_stop)."""
import glob
import json
import os

import numpy as np
import pandas as pd
import pytest
from helpers import synth
from helpers.launch import ROOT, table_rows

from kvbench.harness import calibrate
from kvbench.harness.state import Measurement, Record
from kvbench.report import compare
from kvbench.report.build import build
from kvbench.report.stats import load_run
from kvbench.results import samples as S
from kvbench.results import store
from kvbench.results.lock import ResultLock


def test_a_percentile_is_shown_only_from_the_samples_that_hold_it():
    x = np.arange(1.0, 201.0)
    assert S.needed(95) == 20 and S.needed(99) == 100 and S.needed(50) == 1
    assert np.isnan(S.percentile(x[:19], 95)) and S.percentile(x[:20], 95) == np.percentile(x[:20], 95)
    assert np.isnan(S.percentile(x[:99], 99)) and S.percentile(x[:100], 99) == np.percentile(x[:100], 99)
    assert S.percentile(x[:1], 50) == 1.0 and np.isnan(S.percentile([], 50))


def test_the_interval_covers_the_true_median_at_its_rate():
    rng = np.random.default_rng(7)
    trials, n = 300, 40
    hits = 0
    for _ in range(trials):  # lognormal(0, 0.5): skewed like request times, true median exp(0) = 1
        lo, hi = S.p50_ci(rng.lognormal(0.0, 0.5, n))
        hits += lo <= 1.0 <= hi
    assert 0.9 <= hits / trials <= 0.995, hits / trials  # at n = 40 the exact level is 96.2%
    x = rng.lognormal(0.0, 0.5, n)
    assert S.p50_ci(x) == S.p50_ci(x.copy())  # order statistics: the same rows, the same report
    big = rng.lognormal(0.0, 0.5, 6000)
    lo, hi = S.p50_ci(big)
    assert lo < np.median(big) < hi and hi - lo < 0.1


def calibrated(sample, target=2.0, budget=5.0, per_iter=0.05, start=20):
    """next_batch's loop as the harness runs it, on a synthetic case: (why it stopped, samples taken)."""
    rng = np.random.default_rng(3)
    x = sample(rng, start)
    while True:
        stop, more = S.next_batch(x, target, len(x), len(x) * per_iter, budget)
        if stop:
            return stop, len(x)
        assert 1 <= more <= len(x)  # at most as many again as so far
        x = np.concatenate([x, sample(rng, more)])


def test_calibration_stops_on_target_when_quiet_and_on_budget_when_noisy():
    stop, n = calibrated(lambda rng, k: rng.normal(1.0, 0.01, k))
    assert (stop, n) == ("target", 20)
    stop, n = calibrated(lambda rng, k: rng.normal(1.0, 0.08, k), per_iter=0.02)  # more samples earn it
    assert stop == "target" and 20 < n <= 250
    stop, n = calibrated(lambda rng, k: rng.lognormal(0.0, 1.0, k))  # never within 2% in 5 s of 50 ms
    assert stop == "budget" and n <= 5.0 / 0.05
    assert S.next_batch([1.0], 2.0, 1, 0.1, 5.0) == (None, 5)  # one sample: no interval yet, on to 6


@pytest.mark.parametrize("text", ["0", "150%", "-1", "nan", "inf", "", "x", "100"])
def test_a_target_outside_0_to_100_percent_is_refused(text):
    with pytest.raises(ValueError, match="--target-ci"):
        S.parse_target(text)
    assert S.parse_target("2%") == S.parse_target("2") == S.parse_target(2.0) == 2.0


def measurement(times: list[list[float]], keys) -> Measurement:
    class Itr:
        order = [type("E", (), {"pair": p, "req": r})() for p, r in keys]

    m = Measurement(1, {}, {}, [], Itr())
    m.rec = [Record(t, 0.0, 0.0, [None] * len(t), 0) for t in times]
    return m


def test_rank0_decides_from_the_max_over_each_pairs_ranks():
    r0 = calibrate.my_times(measurement([[1.0], [3.0]], [(0, 0)]))
    r1 = calibrate.my_times(measurement([[2.0], [1.0]], [(0, 0)]))
    assert sorted(calibrate.pair_samples([r0, r1])) == [2.0, 3.0]


def test_every_rank_follows_rank0s_word():
    """Rank 1's own samples would go on; rank 0 says stop: rank 1 stops, with rank 0's reason."""
    sent = []

    class Rank1:
        rank, size = 1, 2

        def agree(self, mine, decide):
            sent.append(mine)
            return ("target", 0)  # rank 0's word, whatever this rank's samples say

    class Harness(calibrate.Calibration):
        comm = Rank1()
        opts = type("O", (), {"target_ci": 2.0, "ci_budget": 60.0, "warmup": 1, "timeout": 30.0})()

        def iterate(self, *a):
            raise AssertionError("rank 1 went on alone")

    m = measurement([[t] for t in np.random.default_rng(1).lognormal(0, 1, 20)], [(0, 0)])
    Harness().calibrate(m, None)
    assert m.case["ci_stop"] == "target" and len(sent) == 1


# ----- older schemas: report, compare, resume ----------------------------------------------------------------
def as_schema4(path):
    """The synthetic file as a schema-4 kvbench wrote it: no schema-5 samples columns."""
    df = pd.read_parquet(path).drop(columns=list(store.SAMPLES_DEFAULTS))
    df.to_parquet(path, index=False)
    meta_path = path.replace(".parquet", ".meta.json")
    meta = json.load(open(meta_path)) | {"schema_version": 4}
    json.dump(meta, open(meta_path, "w"))
    return path


def test_older_files_read_in_report_and_compare(tmp_path):
    old = as_schema4(synth.write(str(tmp_path / "a.parquet"), lambda L, n, b: 1e-3 + b / 5e9,
                                 sweep=[(256, 1, 0), (256, 1, 16)]))
    run = load_run(old)
    assert set(run.df["ci_stop"]) == {"fixed"} and (run.st["samples"] == 4).all()
    assert "iters" not in run.st and run.st["p99"].isna().all() and run.st["p50_lo"].isna().all()  # n = 4: no CI
    page, _ = build([old])
    csv = page.data[""]
    assert {"samples", "p50_lo_s", "p50_hi_s", "ci_pct", "ci_stop"} <= set(csv.columns) and "iters" not in csv
    text = "\n".join(t for s in page.sections for t in s.text)
    assert "p95 from 20, p99 from 100" in text
    bw = next(t for s in page.sections if s.title == "Bandwidth" for _, t in s.tables)
    assert "n" in bw.columns and "p50 95% CI (ms)" in bw.columns
    table, _, _ = compare.join([load_run(old)], [load_run(old)])
    assert len(table) == 2 and (table["verdict"] == "same").all()


def test_committed_results_of_the_oldest_schemas_still_read():
    """results/reference/vm/ holds schema-1 and schema-2 files (the oldest this version reads)."""
    ref = os.path.join(ROOT, "results", "reference", "vm")
    quick = glob.glob(os.path.join(ref, "*_quick.parquet"))[0]
    procurement = os.path.join(ref, "20261201-184435_procurement.parquet")  # the schema-2 run (n = 4), kept for this
    run = load_run(procurement)
    assert run.meta["schema_version"] == 2 and (run.st["status"] == "skipped").any()
    measured = run.st[run.st["status"] != "skipped"]
    assert (measured["samples"] == 4).all() and measured["p95"].isna().all()  # n = 4 holds no tail
    assert set(run.df["ci_stop"]) == {"fixed"}
    table, _, _ = compare.join([load_run(quick)], [load_run(quick)])
    assert len(table) and (table["verdict"] == "same").all()


def test_a_schema4_run_resumes_as_schema5(tmp_path):
    path = as_schema4(synth.write(str(tmp_path / "r.parquet"), lambda L, n, b: 1e-3, sweep=[(256, 1, 0)]))
    meta_path = path.replace(".parquet", ".meta.json")
    json.dump(json.load(open(meta_path)) | {"groups_done": ["tcp"], "status": "INCOMPLETE"}, open(meta_path, "w"))
    assert 4 in store.RESUMES
    w = store.ResultWriter.reopen(path, {"started": "now", "argv": [], "git_commit": "x", "run_id": "r",
                                         "shm_segments": {}}, ResultLock(path))
    try:
        assert set(w.frames[0]["ci_stop"]) == {"fixed"} and w.frames[0]["ci_target_pct"].isna().all()
        assert w.meta["schema_version"] == store.SCHEMA_VERSION and w.meta["resumed"][0]["upgraded_from_schema"] == 4
        assert list(pd.read_parquet(path).columns) == store.ROW_COLUMNS
    finally:
        w.close()


# ----- real runs -----------------------------------------------------------------------------------------------
def test_n_column_and_no_p99_from_8_iterations(kvrun):
    r = kvrun(["-t", "shm", "--tokens", "64", "-b", "16", "-e", "16", "-n", "8", "-w", "1", "--variants", "paged",
               "--progress", "off"], timeout=90)
    assert r.code == 0, r.out + r.err
    (row,) = table_rows(r.out)
    assert row["n"] == "8" and row["p99(us)"] == "-" and row["ci%"] != "-"
    assert "p95 from 20, p99 from 100" in r.out
    assert set(r.table()["ci_stop"]) == {"fixed"}


def test_target_ci_adapts_a_case_and_records_why_it_stopped(kvrun):
    r = kvrun(["-t", "shm", "--tokens", "64", "-b", "16", "-e", "16", "-n", "4", "-w", "1", "--variants", "paged",
               "--progress", "off", "--target-ci", "0.01%", "--ci-budget", "1"], timeout=90)
    assert r.code == 0, r.out + r.err
    df = r.table()
    timed = df[df["iter"] >= 0]
    assert set(df["ci_stop"]) == {"budget"} and set(df["ci_target_pct"]) == {0.01}
    assert timed["iter"].nunique() > 4  # more than -n: it went on until the budget ran out
    (row,) = table_rows(r.out)
    assert row["ci%"].endswith("+") and int(row["n"]) == timed["iter"].nunique()

