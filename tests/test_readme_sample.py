"""The README's sample table is what kvbench prints: its header is the live table's, its rows are a real shm run's
(up to payload(B); the timings after it vary), and its footer counts what `make bench` (the quick suite) measures."""
from __future__ import annotations

import os
import re

from helpers.launch import kvbench_cli

from kvbench import __version__
from kvbench.report.tables import header_lines

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def sample() -> list[str]:
    text = open(README).read()
    block = text.split("## Reading the table", 1)[1].split("```", 2)[1]
    return [ln for ln in block.splitlines() if ln]


def cut(line: str) -> str:
    """A sample line without its ' ...' tail: the columns it shows."""
    assert line.endswith(" ..."), line
    return line[:-4]


def test_the_first_line_and_the_header_are_the_live_tables():
    first, header, *_ = sample()
    assert first.startswith(f"# kvbench {__version__}  suite=quick  ranks=2  scheme=pairwise  hosts=")
    real = header_lines()[-1]
    assert real.startswith(cut(header)) and cut(header).endswith("payload(B)"), (header, real)


def test_the_rows_are_a_real_runs_and_the_footer_counts_make_bench(kvrun):
    *_, bulk, paged, footer = sample()
    # the quick suite's shm push at 16-token blocks, as `make bench` runs it (its timings aside)
    r = kvrun(["-t", "shm", "--op", "push", "-b", "16", "-e", "16", "-m", "llama-3-8b", "--tokens", "1024", "-n", "1",
               "-w", "0", "--variants", "bulk,paged", "--progress", "off"])
    assert r.code == 0, r.err
    rows = [ln for ln in r.out.splitlines() if ln.startswith("       shm push")]
    assert [ln[:len(cut(bulk))] for ln in rows] == [cut(bulk), cut(paged)], rows
    dry = kvbench_cli("run", "quick", "--dry-run", "--ranks", "2")
    measured = re.search(r"# \d+ cases, (\d+) measurements", dry.stdout)
    assert dry.returncode == 0 and measured, dry.stdout + dry.stderr
    assert footer == f"# wrong elements: 0   cases: {measured.group(1)} (0 skipped)   OK"
