"""--target-ci: a case's timed iterations continue, a batch at a time, until its p50's 95% interval is within the
target or its --ci-budget runs out (pyperf's calibration: warm-up, then rounds of iterations).  A case never stops
below samples.CI_MIN_SAMPLES (6), the fewest its interval needs, whatever the budget (``samples.next_batch``).

Rank 0 decides from every rank's times (results/samples.py, a pure function) and every rank follows its word
(``Comm.agree``), so ranks that would judge their own samples differently still take the same turns.
``Calibration`` is mixed into the harness like ``Rows``: it reads ``comm``, ``opts`` and calls ``iterate``.
"""
from __future__ import annotations

import numpy as np

from kvbench.harness.state import Measurement, Session
from kvbench.job.guard import GUARD
from kvbench.results import samples


def my_times(m: Measurement) -> tuple[list, np.ndarray]:
    """This rank's part of the case's samples: its entries' (pair, req) keys and, per timed iteration and entry,
    the seconds until its part was done (before the clock correction the rows apply: a decision, not a figure)."""
    keys = [(e.pair, e.req) for e in m.itr.order]
    return keys, np.array([r.done for r in m.rec], dtype=float).reshape(len(m.rec), len(keys))


def pair_samples(parts: list) -> np.ndarray:
    """Per (pair, request, iteration) the max over the ranks that took part: the samples the rows' p50 reads."""
    best: dict = {}
    for keys, times in parts:
        for j, key in enumerate(keys):
            col = times[:, j]
            best[key] = np.maximum(best[key], col) if key in best and len(best[key]) == len(col) else col
    return np.concatenate(list(best.values())) if best else np.zeros(0)


class Calibration:
    """The --target-ci loop (a mixin of ``Harness``)."""

    def calibrate(self, m: Measurement, s: Session) -> None:
        """More timed iterations of ``m`` while rank 0 says so; the case's rows record why it stopped."""
        o = self.opts
        if not o.target_ci:
            return
        while True:
            with GUARD.deadline(f"case {m.no}: --target-ci's decision (all ranks)", o.timeout):
                stop, more = self.comm.agree(my_times(m), lambda parts: samples.next_batch(
                    pair_samples(parts), o.target_ci, len(m.rec), m.spent, o.ci_budget, m.ran))
            if stop is not None:
                m.case["ci_stop"] = stop
                return
            self.iterate(m, s, min(1, o.warmup), more, m.rec[-1].round if m.rec else 0)  # the last round, continued
