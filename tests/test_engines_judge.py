"""make bench-engines' verdict (benchmarks/engines_common.judge): meets, MISSES or not decided from the pairs'
ratios, by an interval around their median, never by the median alone."""
from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.launch import ROOT


@pytest.fixture
def judge(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from engines_common import judge
    return judge


def test_a_median_above_the_target_whose_interval_straddles_it_is_not_decided(judge):
    out = judge([0.90, 0.99, 1.0, 1.0, 1.1, 1.2], 0.95, 5)
    assert out.startswith("1.00 [96.9% 0.90..1.20, n=6 from 5 pairs]") and out.endswith("not decided")


def test_meets_and_misses_need_the_whole_interval_on_one_side(judge):
    assert judge([0.97, 0.99, 1.0, 1.1, 1.2], 0.95, 5).endswith("] meets")  # 5 ratios: min..max, 93.8%
    assert "93.8% 0.97..1.20" in judge([0.97, 0.99, 1.0, 1.1, 1.2], 0.95, 5)
    assert judge([0.80, 0.85, 0.88, 0.90, 0.91, 0.93], 0.95, 6).endswith("] MISSES")
    assert judge([0.80, 0.85, 0.88, 0.90, 0.91, 0.96], 0.95, 6).endswith("] not decided")  # the top one reaches it


def test_fewer_than_five_pairs_are_never_a_verdict(judge):
    out = judge([1.5, 1.6, 1.7, 1.5, 1.6, 1.7], 0.95, 3)  # many ratios (sizes) from three pairs
    assert out == "1.60 (n=6 from 3 pairs: not decided, a verdict needs 5 pairs)"
    assert judge([], 0.95, 5) == "-"


def test_the_interval_holds_its_level_on_pairs_drawn_around_the_target(judge):
    """Ratios drawn with median exactly at the target: 'meets' or 'MISSES' would be a wrong verdict; the
    interval keeps them to its 5% (n=15, three sizes of five pairs)."""
    rng = np.random.default_rng(7)
    wrong = sum(not judge(list(0.95 * rng.lognormal(0, 0.1, 15)), 0.95, 5).endswith("not decided")
                for _ in range(2000))
    assert wrong / 2000 <= 0.05
