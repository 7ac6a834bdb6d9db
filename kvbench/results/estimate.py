"""How long a run will take, said before it starts (``kvbench run --dry-run`` and the preamble of every run).

The estimate is a sum over what the harness will do, from the suite's sizes and this machine's rates:

- a measurement is one paged case, or one of its payload's references (bulk, the four ceiling chunks, hot),
  each once per payload and transport, as the harness runs them (``harness/loop.py`` ``variants``);
- its transfers: (warm-up + iterations + the check pass) x the request's bytes / the transport's rate, plus
  ``ITER_S`` each and the prefill clock when one is set;
- its check: ``check: all`` verifies every timed iteration's bytes outside the timed window at ``VERIFY_GBPS``
  (1: the check pass only); ``--target-ci`` is taken to spend ``CI_SHARE`` of its ``ci_budget`` of timed seconds per
  case (the shipped procurement run's average here), verified as well under ``check: all``;
- fixed costs: ``START_S`` once (MPI, imports, validation), ``SETUP_S`` per transport plus its two pools filled
  at ``FILL_GBPS``, and ``MEASURE_S`` per measurement (barriers, block tables, rows, the live table);
- a transport that cannot run here costs nothing (its rows are skipped with the reason); a workload case costs
  its requests' bytes at the rate plus their arrival span.

A transport's rate is the bytes over the seconds of the timed rows (``iter >= 0``, status ok) of this machine's
newest result sets: ``<results>/<machine>/`` (the runs it made) and ``results/reference/<machine>/`` (the
committed ones), the median over those sets; ``DEFAULT_GBPS`` where none measured it.  The fixed costs were
fitted to the wall times of the committed reference runs (docs/usage.md, "How long a run takes").
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from statistics import median

from kvbench import transports
from kvbench.model import shapes as M
from kvbench.results.machine import machine_name

START_S = 6.0  # MPI start, imports (pandas on rank 0), validation, the broadcast, the footer
SETUP_S = 2.0  # per transport: its library, registration, the connection, the first-transfer probe
MEASURE_S = 0.25  # per measurement: barriers, block tables, descriptor lists, its rows stored and printed
ITER_S = 0.002  # per iteration: the barrier and clock exchange around each timed window
FILL_GBPS = 1.0  # pattern fill of each rank's pool at set-up
VERIFY_GBPS = 0.6  # check: every landed byte compared to the pattern, outside the timed window
CI_SHARE = 0.25  # --target-ci: the share of ci_budget a case spends on average (procurement here: 331 s timed, 384 rows)
DEFAULT_GBPS = 0.5  # a transport no result set of this machine measured: a slow host path
CHUNKS = 4  # the ceiling's contiguous chunk sizes (model/descriptors.py CHUNKS)
NEWEST = 6  # result sets read per folder, newest first (each read is a few columns of one parquet)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Estimate:
    """Seconds a run is expected to take, and what they are made of."""

    seconds: float
    measurements: int
    cases: int
    skipped: list[str] = field(default_factory=list)  # transports that cannot run here (cost nothing)
    rates: dict[str, tuple[float, str]] = field(default_factory=dict)  # transport -> (GB/s, where it came from)

    def words(self) -> str:
        """``about 3 min`` / ``about 40 s`` / ``about 1.2 h``."""
        return duration(self.seconds)


def duration(s: float) -> str:
    """A wall time in the unit a person reads it in."""
    if s < 90:
        return f"about {max(1, round(s))} s"
    if s < 5400:
        return f"about {round(s / 60)} min"
    return f"about {s / 3600:.1f} h"


def measured_rates(results: str | None = None) -> dict[str, tuple[float, str]]:
    """Per transport (GB/s, the folder it was read from): the median over this machine's newest result sets."""
    here = machine_name()
    folders = [os.path.join(results or os.path.join(REPO, "results", "runs"), here),
               os.path.join(REPO, "results", "reference", here)]
    per: dict[str, list[float]] = {}
    where: dict[str, str] = {}
    for folder in folders:
        files = sorted(glob.glob(os.path.join(folder, "*.parquet")), reverse=True)[:NEWEST]
        for path in files:
            for name, gbps in file_rates(path).items():
                per.setdefault(name, []).append(gbps)
                where.setdefault(name, os.path.relpath(folder, REPO) if folder.startswith(REPO) else folder)
    return {n: (median(v), where[n]) for n, v in per.items()}


def file_rates(path: str) -> dict[str, float]:
    """GB/s per transport of one result set's timed rows ({} when it cannot be read)."""
    try:
        import pyarrow.parquet as pq

        t = pq.read_table(path, columns=["transport", "payload_bytes", "seconds", "iter", "status"]).to_pandas()
    except Exception:  # an older schema, a damaged or locked file: this set says nothing
        return {}
    t = t[(t["iter"] >= 0) & (t["status"] == "ok") & (t["seconds"] > 0)]
    sums = t.groupby("transport")[["payload_bytes", "seconds"]].sum()
    return {str(n): float(r.payload_bytes / r.seconds / 1e9) for n, r in sums.iterrows() if r.seconds > 0}


def request_bytes(case: dict, shapes: dict) -> int:
    """One request's bytes (one pair), as ``kvbench size`` counts them."""
    m = shapes.get(case["model"]) or M.get_model(case["model"])
    try:
        return M.request_bytes(m, case["dtype"], int(case["tokens"]), int(case.get("prefix_hit", 0)))
    except (ValueError, KeyError):  # a format of its own (nvfp4, fp8-ds-mla): a byte per element is near enough
        return M.request_bytes(m, "fp8-e4m3", int(case["tokens"]), int(case.get("prefix_hit", 0)))


def estimate(suite, cases: list[dict], shapes: dict | None = None, rates: dict | None = None,
             available=None) -> Estimate:
    """The run's expected wall time on this machine (module docstring). ``available(name)`` says whether a
    transport runs here (default: its probe); ``rates`` default to ``measured_rates()``."""
    shapes = shapes or {}
    rates = measured_rates() if rates is None else rates
    available = available or (lambda name: transports.probe(name) is None)
    memory: dict[str, tuple] = {}
    variants = list(getattr(suite, "variants", ["bulk", "ceiling", "paged"]))
    refs = ("bulk" in variants) + CHUNKS * ("ceiling" in variants) + ("hot" in variants)
    check = getattr(suite, "check", True)
    passes = suite.warmup + suite.iters + (1 if check else 0)
    verified = (suite.iters + 1) if check == "all" else (1 if check else 0)
    budget = CI_SHARE * float(getattr(suite, "ci_budget", 0) or 0) if getattr(suite, "target_ci", None) else 0.0
    workload = getattr(suite, "workload", None)
    up: dict[str, bool] = {}
    largest: dict[str, int] = {}
    seen: set = set()
    total, count = START_S, 0
    for c in cases:
        name = c["transport"]
        if name not in up:
            up[name] = available(name)
        if not up[name] or not fits(name, c.get("memory", "host"), memory):
            continue
        gbps = rates.get(name, (DEFAULT_GBPS, ""))[0] * 1e9
        nbytes = request_bytes(c, shapes)
        largest[name] = max(largest.get(name, 0), nbytes)
        if workload is not None:
            n = workload.requests
            rate = str(c.get("arrival", "none"))
            span = n / float(rate.split(":")[1]) if rate.startswith("poisson:") else 0.0
            total += MEASURE_S + max(span, n * (nbytes / gbps + workload.decode_ms / 1e3 / max(1, c.get("inflight", 1))))
            count += 1
            continue
        key = (name, c["op"], c["model"], c["tokens"], c.get("prefix_hit"), c["dtype"], c.get("tp"), c.get("pp"),
               c.get("inflight"), c.get("scales"))
        kinds = []
        if key not in seen:
            seen.add(key)
            kinds += [0.0] * refs  # references: no prefill clock
        if "paged" in variants:
            kinds.append(float(c.get("prefill_ms") or 0.0) / 1e3)
        for prefill_s in kinds:
            xfer = nbytes / gbps
            total += MEASURE_S + passes * (xfer + ITER_S + prefill_s) + verified * nbytes / (VERIFY_GBPS * 1e9)
            if budget:
                total += budget * (1 + (nbytes / (VERIFY_GBPS * 1e9) / xfer if check == "all" else 0.0))
            count += 1
    pool_factor = float(getattr(suite, "pool_factor", 2.0) or 2.0)
    total += sum(SETUP_S + 2 * pool_factor * b / (FILL_GBPS * 1e9) for b in largest.values())
    return Estimate(seconds=total, measurements=count, cases=len(cases),
                    skipped=[n for n, ok in up.items() if not ok],
                    rates={n: rates.get(n, (DEFAULT_GBPS, "default")) for n, ok in up.items() if ok})


def fits(name: str, kind: str, memory: dict) -> bool:
    """The transport takes pools of this kind (staged on host memory: a skipped row that costs nothing)."""
    if name not in memory:
        try:
            memory[name] = tuple(transports.load(name).caps.memory)
        except Exception:  # no caps to read: assume it runs
            memory[name] = (kind,)
    return kind in memory[name]


def preamble_line(suite, cases: list[dict], shapes: dict | None = None, results: str | None = None) -> str:
    """The preamble's one line: ``# 48 measurements of 18 cases, about 2 min here (estimate: docs/usage.md)``."""
    try:
        e = estimate(suite, cases, shapes, measured_rates(results))
    except Exception as exc:  # the estimate is a courtesy: never the reason a run fails
        return f"# {len(cases)} cases (no estimate: {type(exc).__name__})"
    return (f"# {e.cases} cases, {e.measurements} measurements, {e.words()} here "
            "(estimate: docs/usage.md, How long a run takes)")
