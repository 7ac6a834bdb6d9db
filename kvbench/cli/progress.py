"""Rank 0's progress bar over a run's measurements (tqdm), when someone watches the terminal.

MPI launchers hand the ranks pipes, not the terminal, so ``auto`` can only see a terminal when the
launcher passes one through (srun --pty); ``make procurement`` asks the shell and says ``--progress on``.
"""
from __future__ import annotations

import sys

from kvbench import transports


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


def start(mode: str, cases: list[dict], variants) -> Bar | None:
    """A bar when wanted and tqdm is installed (it is a core dependency; a missing one is no reason to fail)."""
    if not wanted(mode):
        return None
    try:
        return Bar(expected(cases, variants))
    except ImportError:
        return None
