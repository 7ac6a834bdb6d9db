"""The p50's interval holds its level at any n (issue 42, item 4): the distribution-free order-statistic interval
for the median, its coverage by simulation over a skewed distribution, '-' where n cannot hold it (n < 6), and
--target-ci never stopping a case below the 6 samples the interval needs (pure functions, no MPI)."""
import math

import numpy as np
import pandas as pd
import pytest
from helpers import synth
from helpers.launch import table_rows

from kvbench.harness import calibrate
from kvbench.harness.state import Measurement, Record
from kvbench.report import tables
from kvbench.results import samples as S

TRIALS = 2000


@pytest.mark.parametrize("n", [6, 10, 40])
def test_the_p50_interval_covers_the_true_median_at_small_n(n):
    rng = np.random.default_rng(42 + n)
    x = rng.lognormal(0.0, 1.0, size=(TRIALS, n))  # skewed like request times; the true median is exp(0) = 1
    hits = sum(lo <= 1.0 <= hi for lo, hi in map(S.p50_ci, x))
    assert hits / TRIALS >= 0.93, (n, hits / TRIALS)


def test_the_interval_is_the_binomial_order_statistics():
    # the largest k with P(Binomial(n, 1/2) < k) <= 2.5%: textbook ranks for the median's 95% interval
    assert [S.ci_rank(n) for n in (5, 6, 8, 9, 10, 20, 40, 100)] == [0, 1, 1, 2, 2, 6, 14, 40]
    assert S.CI_MIN_SAMPLES == S.ci_min_samples(95) == 6
    x = np.arange(40.0)[::-1]  # unsorted on purpose
    assert S.p50_ci(x) == (13.0, 26.0)  # x_(14) and x_(27) of 0..39
    assert S.p50_ci(np.r_[x, np.nan]) == (13.0, 26.0)  # a missing sample is no sample


def test_five_samples_have_no_interval_and_the_table_prints_a_dash():
    lo, hi = S.p50_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert math.isnan(lo) and math.isnan(hi) and math.isnan(S.ci_half_pct([1.0, 2.0, 3.0, 4.0, 5.0]))
    rng = np.random.default_rng(5)
    for n, dash in ((5, True), (6, False)):
        df = pd.DataFrame(synth.case_rows(1, "tcp", 256, 1, 16, lambda *a: 1e-3, iters=n))
        timed = df["iter"] >= 0
        df.loc[timed, "seconds"] = 1e-3 * np.repeat(rng.lognormal(0.0, 0.3, n), 2)  # both ranks of an iteration
        st = tables.summarize(df)
        cols = tables.columns_for(st.to_dict("records"))
        out = "\n".join(tables.header_lines(cols) + [tables.format_line(r, cols) for r in st.to_dict("records")])
        (row,) = table_rows(out)
        assert row["n"] == str(n) and (row["ci%"] == "-") == dash, row


def stepped(x, stop_check):
    """next_batch's loop as calibrate runs it, from the samples ``x``, one sample per iteration, the budget spent
    from the start: the samples at which it stopped."""
    x = list(x)
    while True:
        stop, more = S.next_batch(x, 50.0, len(x), 10.0, 0.001)  # 10 s spent of a 1 ms budget
        if stop is not None:
            return stop, len(x)
        stop_check(len(x))
        x += [1.0] * more


@pytest.mark.parametrize("start", [1, 2, 3, 5])
def test_target_ci_never_stops_below_six_samples(start):
    # identical times: a zero-width interval the moment it exists, and a budget spent long before
    seen = []
    stop, n = stepped([1.0] * start, seen.append)
    assert seen and max(seen) < 6 and n >= 6 and stop == "target"
    assert S.next_batch([1.0] * 6, 50.0, 6, 10.0, 0.001) == ("target", 0)
    assert S.next_batch(np.linspace(1, 3, 6), 1.0, 6, 10.0, 0.001) == ("budget", 0)  # from 6 on, the budget rules
    assert S.next_batch([1.0] * 4, 50.0, 1, 10.0, 0.001) == (None, 1)  # 4 samples an iteration: one more is 8


def test_calibrate_runs_a_case_on_to_six_samples_past_its_budget():
    """calibrate itself, rank 0 alone: a case of -n 2 whose budget is already spent still reaches 6 samples."""
    class Rank0:
        rank, size = 0, 1

        def agree(self, mine, decide):
            return decide([mine])

    class Harness(calibrate.Calibration):
        comm = Rank0()
        opts = type("O", (), {"target_ci": 50.0, "ci_budget": 0.001, "warmup": 0, "timeout": 30.0})()

        def iterate(self, m, s, warmup, k, rnd):
            m.rec += [Record([1.0], 0.0, 0.0, [None], rnd) for _ in range(k)]
            m.ran += k
            m.spent += k

    class Itr:
        order = [type("E", (), {"pair": 0, "req": 0})()]

    m = Measurement(1, {}, {}, [], Itr())
    m.rec = [Record([1.0], 0.0, 0.0, [None], 0) for _ in range(2)]
    m.ran, m.spent = 2, 2.0
    Harness().calibrate(m, None)
    assert len(m.rec) == 6 and m.case["ci_stop"] == "target"
