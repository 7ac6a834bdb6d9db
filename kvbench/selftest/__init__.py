"""``kvbench selftest``: kvbench's timing against a veth link of known rate (needs root).

``netns`` builds and removes the shaped link and reads its byte counters; ``run``
launches kvbench across it, judges the rows and prints the table.
"""
from __future__ import annotations

from kvbench.selftest.run import main as run_main


def main(argv: list[str] | None = None) -> int:
    return run_main(argv)
