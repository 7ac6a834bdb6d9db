"""Judging one probe's result, and the summary table: pure functions over what the sandbox measured."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from fuzz.probes import Probe

# Files a probe may leave that are its launcher's, not kvbench's: MPICH's hydra writes its hwloc topology to /tmp and
# leaves it whenever the job ends by MPI_Abort (kvbench's exit path).  Reported with each probe and counted in the
# summary, not judged: kvbench neither writes nor names them.
LAUNCHER_FILES = re.compile(r"/tmp/hydra_hwloc_xmlfile_\w+")


@dataclass
class Result:
    """What the sandbox saw of one probe's command."""
    code: int | None  # None: it did not end (killed at its limit)
    output: str  # stdout and stderr together
    seconds: float
    timed_out: bool = False
    shm_left: list[str] = field(default_factory=list)  # files in its /dev/shm after it (and its reapers) ended
    written: list[str] = field(default_factory=list)  # files it wrote outside its scratch folder
    stray: list[str] = field(default_factory=list)  # processes still running after it ended
    planted: list[str] = field(default_factory=list)  # planted links removed or their targets changed
    sandbox: str = ""  # the sandbox itself failed (not kvbench): why


@dataclass
class Verdict:
    probe: Probe
    result: Result
    why: list[str]  # empty: clean
    notes: list[str] = field(default_factory=list)  # the launcher's own leftovers (LAUNCHER_FILES)

    @property
    def clean(self) -> bool:
        return not self.why

    @property
    def word(self) -> str:
        """PASS, FAIL, XFAIL (a known failure, still failing) or XPASS (a known failure that no longer fails)."""
        if self.probe.xfail:
            return "XPASS" if self.clean else "XFAIL"
        return "PASS" if self.clean else "FAIL"

    @property
    def ok(self) -> bool:
        """Counts as clean for the exit code: a pass, or a known failure reported as such."""
        return self.word in ("PASS", "XFAIL")


def _short(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def one_lines(probe: Probe, output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith(probe.prefix)]


def judge(probe: Probe, r: Result) -> list[str]:
    """Why ``r`` is not what ``probe`` expects, one sentence each; empty when it is clean."""
    if r.sandbox:
        return [f"sandbox: {r.sandbox}"]
    why = []
    if r.timed_out or r.code is None:
        why.append(f"did not end within its limit of {probe.limit:g} s (killed)")
    elif r.seconds > probe.limit:
        why.append(f"took {r.seconds:.1f} s, over its limit of {probe.limit:g} s")
    if r.code is not None and r.code not in probe.exit:
        why.append(f"exit {r.code}, expected {' or '.join(map(str, probe.exit))}")
    if "Traceback (most recent call last)" in r.output:
        why.append("a Python traceback in its output")
    lines = one_lines(probe, r.output)
    if len(lines) > 1:  # one failure is one line, from one rank
        why.append(f"{len(lines)} lines start with '{probe.prefix}', expected one: {lines[0][:100]!r} ...")
    elif probe.line is not None and not lines:
        why.append(f"no line starts with '{probe.prefix}'")
    elif probe.line is not None and not re.search(probe.line, lines[0]):
        why.append(f"its line does not match /{probe.line}/: {lines[0][:160]!r}")
    if r.shm_left:
        why.append(f"left in /dev/shm: {_short(r.shm_left)}")
    written = [w for w in r.written if not LAUNCHER_FILES.fullmatch(w)]
    if written:
        why.append(f"wrote outside its scratch folder: {_short(written)}")
    if r.stray:
        why.append(f"processes still running after it ended: {_short(r.stray)}")
    if r.planted:
        why.append(f"a planted link was followed or removed: {_short(r.planted)}")
    return why


def launcher_files(r: Result) -> list[str]:
    return [w for w in r.written if LAUNCHER_FILES.fullmatch(w)]


def verdict(probe: Probe, r: Result) -> Verdict:
    return Verdict(probe, r, judge(probe, r), launcher_files(r))


def report_line(v: Verdict) -> str:
    """One line per probe: the word, the probe, its exit and seconds, and why when it is not clean."""
    code = "-" if v.result.code is None else str(v.result.code)
    tail = "; ".join(v.why)
    if v.probe.xfail:
        tail = f"known: {v.probe.xfail}" + (f" ({tail})" if tail else " -- it passes now: remove its xfail")
    if v.notes:
        tail += ("; " if tail else "") + f"note: the launcher left {_short(v.notes)}"
    return f"{v.word:5} {v.probe.id:36} exit {code:>3} {v.result.seconds:5.1f} s" + (f"  {tail}" if tail else "")


def summary(verdicts: list[Verdict]) -> list[tuple[str, int, int, int]]:
    """(category, probes, clean, known failures) per category in the order first seen, then a total row."""
    rows: dict[str, list[int]] = {}
    for v in verdicts:
        row = rows.setdefault(v.probe.category, [0, 0, 0])
        row[0] += 1
        row[1] += v.clean
        row[2] += v.word == "XFAIL"
    out = [(c, *r) for c, r in rows.items()]
    return out + [("all", *(sum(r[i] for r in rows.values()) for i in range(3)))]


def table(rows, markdown: bool = False) -> str:
    head = ("category", "probes", "clean", "known failures")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| --- | ---: | ---: | ---: |"]
        return "\n".join(lines + [f"| {c} | {n} | {k} | {x} |" for c, n, k, x in rows])
    lines = [f"{head[0]:10} {head[1]:>6} {head[2]:>6} {head[3]:>15}"]
    return "\n".join(lines + [f"{c:10} {n:6d} {k:6d} {x:15d}" for c, n, k, x in rows])
