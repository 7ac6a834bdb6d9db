"""Rank 0's progress bar over a run's measurements (tqdm), when someone watches the terminal.

MPI launchers hand the ranks pipes, not the terminal, so ``auto`` can only see a terminal when the
launcher passes one through (srun --pty); ``make procurement`` asks the shell and says ``--progress on``.
"""
from __future__ import annotations

import sys
import time

from kvbench import transports

PERIOD_S = 30.0  # a progress line this often where no bar can be drawn (output to a pipe or a file)


def wanted(mode: str) -> bool:
    """on, off, or auto: rank 0's stderr is a terminal."""
    return mode == "on" or (mode == "auto" and sys.stderr.isatty())


def expected(cases: list[dict], variants) -> int:
    """How many times the harness will deliver rows: per case its paged measurement (or one skipped row),
    plus the references (bulk, 4 chunks, hot) once per payload of an available transport."""
    refs = ("bulk" in variants) + 4 * ("ceiling" in variants) + ("hot" in variants)
    total, seen, up = 0, set(), {}
    for c in cases:
        name = c["transport"]
        if name not in up:
            up[name] = transports.probe(name) is None
        if not up[name]:
            total += 1
            continue
        key = (name, c["op"], c["model"], c["tokens"], c["prefix_hit"], c["dtype"], c["tp"], c["pp"], c["inflight"])
        if key not in seen:
            seen.add(key)
            total += refs
        total += "paged" in variants
    return total


class Bar:
    """A tqdm bar on stderr; table lines go through ``write`` so they do not tear it."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="meas", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} measurements [{elapsed}<{remaining}]")

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def tick(self, label: str = "") -> None:
        if label:
            self.bar.set_description_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Lines:
    """Where stderr is no terminal (a pipe, a log file, CI): a '#' line every PERIOD_S seconds with the count and the
    time left at the pace so far, so a long run is never silent for minutes; table lines pass through."""

    def __init__(self, total: int, period: float = PERIOD_S, clock=time.monotonic):
        self.total, self.done, self.period, self.clock = total, 0, period, clock
        self.t0 = self.last = clock()

    def write(self, line: str) -> None:
        print(line, flush=True)

    def tick(self, label: str = "") -> None:
        self.done += 1
        now = self.clock()
        if now - self.last < self.period or self.done >= self.total:
            return
        self.last, spent = now, now - self.t0
        left = spent / self.done * (self.total - self.done)
        print(f"# progress: {self.done}/{self.total} measurements, {_mmss(spent)} spent, about {_mmss(left)} left at "
              f"this pace{f' (now: {label})' if label else ''}", flush=True)

    def close(self) -> None:
        pass


def _mmss(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def start(mode: str, cases: list[dict], variants) -> Bar | Lines | None:
    """A bar when wanted and tqdm is installed (it is a core dependency; a missing one is no reason to fail); under
    auto with no terminal, a progress line every PERIOD_S seconds; under off, nothing."""
    if not wanted(mode):
        return Lines(expected(cases, variants)) if mode == "auto" else None
    try:
        return Bar(expected(cases, variants))
    except ImportError:
        return None
