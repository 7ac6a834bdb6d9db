"""gpu-check's steps run guarded: a wall-time budget each, a failure is a FAIL row, every row printed and saved at once.

A step that raises, or outlives its budget, becomes one FAIL row with a one-line reason and the next step
runs.  The budget is a SIGALRM timer in the main thread (CUDA work stays on the thread that made the context);
a launch inside a step is killed whole when the alarm interrupts it (job/launch.py).  Each step's rows are
printed as it ends and the JSON under results/ is rewritten whole after each step (a new file per run, never
another run's), so a run cut short still leaves what it measured.

``KVBENCH_GPUCHECK_FAULT`` (tests only; inert unless set), items separated by commas:
``raise:STEP`` makes STEP raise, ``hang:STEP`` makes it sleep past its budget, ``noop:ENGINE`` makes that
copy engine copy nothing (its rows must FAIL).
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import sys
import time


class StepTimeout(BaseException):
    """A step ran past its wall-time budget (a BaseException: a step's own ``except Exception`` must not eat it)."""


def faults() -> dict[str, set[str]]:
    """KVBENCH_GPUCHECK_FAULT as {kind: {target}}."""
    out: dict[str, set[str]] = {}
    for item in filter(None, os.environ.get("KVBENCH_GPUCHECK_FAULT", "").split(",")):
        kind, _, target = item.partition(":")
        out.setdefault(kind, set()).add(target)
    return out


# The clock that timed a row: the stream carrying its work, or the host after that stream was waited for.
COPY_EVENTS = "copy-stream events"  # C.Timer: two driver events on the stream the copy engines queue on
TORCH_EVENTS = "torch events"  # torch.cuda.Event on torch's current stream, which carries torch's own ops
HOST_AFTER_SYNC = "host clock after sync"  # perf_counter around work that ends waiting for its stream
HOST = "host clock"  # the CPU rehearsal: host work is done when its call returns
FAKE_EVENTS = "fake copy-stream events"  # C.Timer on the fake driver's modelled clock: a bracket check, no rate
RUN = "kvbench run"  # the harness's own clock (docs/methodology.md)


def row(check, what, gbps=math.nan, status="ok", note="", clock="") -> dict:
    """One line of the table: check, what, GB/s (or nan), ratio to its floor (nan), status (ok / FAIL / skipped /
    SKIP), the clock that timed it, note."""
    return {"check": check, "what": what, "gbps": float(gbps), "ratio": math.nan, "floor": "", "status": status,
            "clock": clock, "note": note}


def one_line(exc: BaseException, limit: int = 160) -> str:
    """An exception as one line: its type and the last non-empty line of its message."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:limit].rstrip(": ")


FLOORS = ("# of its floor: device copy = torch copy_ device to device, PCIe = the link's generation x width (read "
          "from the device), host tcp = kvbench run -t tcp between host pools, matmul = a plain torch matmul; each "
          "measured in this run")


def header(rehearsal: bool) -> str:
    if rehearsal:
        return ("# gpu-check REHEARSAL on the CPU (torch-cpu pools; no GPU figure here: it proves the imports, "
                "steps, budgets and table) (GB/s = 10^9 B/s)\n" + FLOORS)
    return "# gpu-check (GB/s = 10^9 B/s)\n" + FLOORS


def _ratio(r: dict) -> str:
    x = r.get("ratio", math.nan)
    return f"{100 * x:.0f}% {r.get('floor', '')}".rstrip() if isinstance(x, float) and x == x else "-"


def line(r: dict) -> str:
    g = r.get("gbps")
    gs = f"{g:8.2f}" if isinstance(g, float) and g == g else f"{'-':>8}"
    return (f"{r['check']:<10} {r['what']:<34} {gs}  {_ratio(r):<17} {r['status']:<8} {r.get('clock') or '-':<23} "
            f"{r.get('note', '')}").rstrip()


def columns() -> str:
    return f"{'check':<10} {'what':<34} {'GB/s':>8}  {'of its floor':<17} {'status':<8} {'clock':<23} note"


def table(rows: list[dict], rehearsal: bool = False) -> str:
    """The closing table: one line per row, GB/s = 10^9 B/s, each rate's share of its floor and its clock."""
    return "\n".join([header(rehearsal), columns(), *(line(r) for r in rows)])


def new_path(folder: str, stem: str) -> str:
    """A results file name no earlier run has taken (never overwrite a result)."""
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, dt.datetime.now().strftime("%Y%m%d-%H%M%S") + stem)
    path, k = base + ".json", 1
    while os.path.exists(path):
        path, k = f"{base}-{k}.json", k + 1
    with open(path, "x") as fh:  # taken now, atomically: a run started in the same second picks the next name
        fh.write("{}")
    return path


class Recorder:
    """The run's rows: each printed as it comes and the JSON file rewritten whole (via a temporary) each time."""

    def __init__(self, path: str, meta: dict, out=None):
        self.path, self.meta, self.rows, self.out = path, meta, [], out or sys.stdout
        self.steps: list[dict] = []

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            self.rows.append(r)
            print(line(r), file=self.out, flush=True)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump({**self.meta, "steps": self.steps, "rows": self.rows}, fh, indent=1, default=str)
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk costs the file, never the printed rows or the next step
            print(f"# gpu-check: could not write {self.path}: {exc.strerror}", file=sys.stderr, flush=True)


def _alarm(signum, frame):
    raise StepTimeout()


def run_step(rec: Recorder, name: str, fn, budget: float) -> None:
    """Run ``fn() -> rows`` for at most ``budget`` s; its rows, or one FAIL row, go to ``rec`` at once."""
    t0 = time.monotonic()
    f = faults()
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, max(budget, 0.01))
    try:
        if name in f.get("raise", ()):
            raise RuntimeError(f"injected fault in step {name} (KVBENCH_GPUCHECK_FAULT)")
        if name in f.get("hang", ()):
            time.sleep(budget + 60)
        rows = fn()
    except StepTimeout:
        rows = [row(name, "step", status="FAIL", note=f"over its budget of {budget:.0f} s: stopped (launches "
                    f"killed whole)")]
    except Exception as exc:  # one failed step is a row; the others still run
        rows = [row(name, "step", status="FAIL", note=one_line(exc))]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # an outer timer (a test runner's) goes on with what it had left
            signal.setitimer(signal.ITIMER_REAL, max(0.01, old_delay - (time.monotonic() - t0)), old_interval)
    took = time.monotonic() - t0
    rec.steps.append({"step": name, "seconds": round(took, 2), "budget_s": budget})
    rec.add(rows)
