"""`kvbench probe`: the largest pool a transport registers, moves and checks, grown by doubling then bisecting.

Each size is one attempt in child processes of its own (probe_attempt.py: a ``kvbench run`` of two ranks under
mpiexec, with a deadline), so a crash or a hang is that size's row, not the end of the probe.  Here: the sizes
(pure), the memory refused before trying, the search, and the rows' CSV beside the run results.
"""
from __future__ import annotations

import csv
import dataclasses
import re
from collections.abc import Callable

from kvbench import memory, transports
from kvbench.harness import preflight
from kvbench.harness.probe_attempt import Attempt, Request
from kvbench.job import cleanup
from kvbench.memory import device

UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
         "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
COLUMNS = ("pool_bytes", "status", "signal", "reason", "gbps", "register_s", "nwrong", "seconds", "run_id")


class ProbeError(ValueError):
    """Bad input to the probe: one line, exit 1."""


def parse_size(text: str) -> int:
    """'8GiB', '512MiB', '1.5g', '4096' -> bytes (binary units; kB, MB, GB decimal)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ProbeError(f"size '{text}' is not a number with a unit (e.g. 512MiB, 8GiB)")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n <= 0:
        raise ProbeError(f"size '{text}' is not positive")
    return n


def fmt_size(n: int) -> str:
    """Bytes as the shortest exact binary unit (1.5 GiB -> '1536MiB'), else GiB with two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n / 2**30:.2f}GiB"


def sizes_between(lo: int, hi: int, step: int) -> int | None:
    """The bisection's next size: halfway between a working ``lo`` and a failing ``hi``, on the ``step`` grid;
    None once they are one step apart."""
    mid = lo + (hi - lo) // 2 // step * step
    return mid if lo < mid < hi else None


def search(attempt: Callable[[int], bool], start: int, top: int, step: int, bisect: int) -> list[int]:
    """The sizes tried, in order: ``start`` doubling up to ``top`` (the last step capped at it) until one fails,
    then at most ``bisect`` halvings of the gap between the largest that worked and the first that failed.
    ``attempt(size)`` says whether a size worked."""
    tried, lo, hi, size = [], 0, None, start
    while True:
        tried.append(size)
        if not attempt(size):
            hi = size
            break
        lo = size
        if size >= top:
            return tried
        size = min(2 * size, top)
    for _ in range(bisect if lo else 0):  # nothing worked: nothing to bisect (the smallest size holds one request)
        mid = sizes_between(lo, hi, step)
        if mid is None:
            break
        tried.append(mid)
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return tried


def shortfall(req: Request, size: int, options: dict, ranks: int = 2) -> str | None:
    """Why ``ranks`` pools of ``size`` cannot fit this host (one line with the numbers), or None; ``options``:
    the transport's parsed -O options."""
    placed = transports.load(req.transport).memory_needs(size, options)
    where = f"{ranks} ranks x {fmt_size(size)} = {ranks * size / 2**30:.2f} GiB"
    if req.memory == "cuda":
        free, total = device.free_bytes("cuda", 0)
        if ranks * size > free:  # the ranks share the GPUs they see: counted against one, the least room
            return (f"probe: --max {fmt_size(size)}: {where} of GPU memory, but GPU 0 has {free / 2**30:.2f} GiB "
                    f"free of {total / 2**30:.2f} GiB: lower --max")
        return None
    avail = memory.available_bytes()
    if ranks * size > 0.9 * avail:  # the check's temporaries and the ranks' own memory need the rest
        return (f"probe: --max {fmt_size(size)}: {where} of RAM, but MemAvailable is {avail / 2**30:.2f} GiB "
                "(at most 90% of it is used): lower --max")
    locked = preflight.memlock_limit()
    if locked is not None and placed.get("locked", 0) > locked:
        return (f"probe: --max {fmt_size(size)}: registering it pins it, but the locked-memory limit (ulimit -l) "
                f"is {locked / 2**20:.1f} MiB: raise it or lower --max")
    shm = placed.get("shm", 0) * ranks
    free = cleanup.shm_free_bytes()
    if shm > free:
        return (f"probe: --max {fmt_size(size)}: {req.transport} puts {where} in {cleanup.SHM_DIR}, but "
                f"{free / 2**30:.2f} GiB is free there: lower --max or give the container a larger /dev/shm")
    return None


@dataclasses.dataclass
class Outcome:
    """What a probe found: every row in the order tried, the largest size that worked, the first that failed."""

    rows: list
    best: int | None
    failed: object | None  # the row of the smallest size that failed


def run_probe(req: Request, start: int, top: int, bisect: int, deadline: float | None, say=print,
              scratch: str | None = None) -> Outcome:
    """Try the sizes (``search``) with one child launch each; ``say`` gets each row as it ends; each launch writes
    under ``scratch`` (removed after it)."""
    rows = []

    def attempt(size: int) -> bool:
        row = Attempt(req, size, deadline, scratch).run()
        rows.append(row)
        say(row)
        return row.status == "OK"

    search(attempt, start, top, req.step, bisect)
    ok = [r.pool_bytes for r in rows if r.status == "OK"]
    bad = sorted((r for r in rows if r.status != "OK"), key=lambda r: r.pool_bytes)
    return Outcome(rows, max(ok) if ok else None, bad[0] if bad else None)


class CsvRows:
    """The rows' file, a row appended (and flushed) as each size ends: an interrupted probe keeps what it found."""

    def __init__(self, path: str):
        self.path, self.count = path, 0
        with open(path, "w", newline="") as fh:
            csv.writer(fh).writerow(COLUMNS)

    def add(self, row) -> None:
        self.count += 1
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow(["" if getattr(row, c) is None else getattr(row, c) for c in COLUMNS])
