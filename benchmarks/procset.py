"""The state of one `make procurement` set (benchmarks/procurement.py drives it): <stamp>_procurement.set.json beside
its first result file, each suite's result file and status, and which set a call resumes."""
from __future__ import annotations

import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = ("procurement", "procurement-overlap")
NOT_STARTED = "NOT STARTED"
# what `kvbench run --resume` continues (kvbench/config/runconfig.py's, not imported: it loads pydantic)
RESUMABLE = ("INCOMPLETE", "ERROR", "TIMEOUT", "INTERRUPTED")


def at(path: str) -> str:
    """A path kvbench printed, from the checkout it ran in (this script may run from elsewhere)."""
    return os.path.join(ROOT, path)


def stem_of(path: str) -> str:
    return os.path.join(os.path.dirname(path), os.path.basename(path).removesuffix(".parquet"))


def sidecar_status(path: str | None) -> str:
    """What a suite's sidecar says (INCOMPLETE when it cannot be read: the run never ended by itself)."""
    if path is None:
        return NOT_STARTED
    try:
        with open(at(stem_of(path) + ".meta.json")) as fh:
            return json.load(fh).get("status", "INCOMPLETE")
    except (OSError, ValueError):
        return "INCOMPLETE"


def rows_in(path: str | None) -> int:
    """The rows a result file holds (0 when it has none yet, or none can be read)."""
    if path is None or not os.path.exists(at(path)):
        return 0
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(at(path)).num_rows
    except Exception:  # a file cut short by the interruption holds nothing to report
        return 0


def save(state: dict) -> None:
    """Rewrite the set's state file whole (a reader never sees half of it)."""
    path = state["file"]
    with open(path + ".tmp", "w") as fh:
        json.dump({k: v for k, v in state.items() if k != "file"}, fh, indent=1)
    os.replace(path + ".tmp", path)


def load(path: str) -> dict:
    with open(path) as fh:
        state = json.load(fh)
    if [s.get("suite") for s in state.get("suites", [])] != list(SUITES):
        raise ValueError(f"its suites are not {', '.join(SUITES)}")
    return {**state, "file": path}


def new_set(a) -> dict:
    """A set not started: no state file until its first launch names its result file."""
    return {"file": None, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "np": a.np, "kvbench_args": a.kvbench_args,
            "out": a.out, "label": a.label, "quick": bool(getattr(a, "quick", False)), "complete": False, "reports": [],
            "suites": [{"suite": s, "results": None, "status": NOT_STARTED} for s in SUITES]}


def results_root(a) -> str:
    """Where the launches write (--out, else -o in --kvbench-args, else kvbench's default): the sets are under it."""
    words = a.kvbench_args.split()
    given = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-o", "--results")), None)
    return a.out or at(given or os.path.join("results", "runs"))


def newest_set(root: str) -> str | None:
    found = glob.glob(os.path.join(root, "*", "*_procurement*.set.json"))
    return max(found, key=lambda p: (os.path.basename(p), os.path.getmtime(p))) if found else None


def action(entry: dict) -> str:
    """skip (it ended by itself), resume (its file can be continued) or launch (never started)."""
    if entry["results"] is None:
        return "launch"
    entry["status"] = sidecar_status(entry["results"])  # the sidecar, not the state file, has the last word
    return "resume" if entry["status"] in RESUMABLE else "skip"


def resuming_line(state: dict) -> str:
    says = {"skip": "done ({status})", "resume": "--resume {results} ({status})", "launch": "not started: launched now"}
    parts = [f"{e['suite']}: {says[action(e)].format(**e)}" for e in state["suites"]]
    return (f"# make procurement: resuming {state['file']} (-n {state['np']}, ARGS '{state['kvbench_args']}'): "
            f"{'; '.join(parts)}; FRESH=1 starts a new set")


def choose(a) -> dict | None:
    """The set this call runs: --resume's, the newest one when it is incomplete and ran as asked, or a new one."""
    if a.resume:
        try:
            state = load(a.resume)
        except (OSError, ValueError) as exc:
            print(f"# make procurement: RESUME={a.resume}: not a set of make procurement: {exc}", file=sys.stderr)
            return None
        if all(action(e) == "skip" for e in state["suites"]):
            print(f"# make procurement: RESUME={a.resume}: every suite of the set has ended "
                  f"({', '.join(e['status'] for e in state['suites'])}): nothing to resume", file=sys.stderr)
            return None
    elif a.fresh or (last := newest_set(results_root(a))) is None:
        return new_set(a)
    else:
        try:
            state = load(last)
        except (OSError, ValueError) as exc:
            print(f"# make procurement: {last} unreadable ({exc}): a new set starts", file=sys.stderr)
            return new_set(a)
        if state.get("complete"):
            return new_set(a)
        if (state.get("np"), state.get("kvbench_args"), state.get("quick", False)) != (
                a.np, a.kvbench_args, bool(getattr(a, "quick", False))):
            print(f"# make procurement: the last set {last} is incomplete but ran with -n {state.get('np')} and ARGS "
                  f"'{state.get('kvbench_args')}': a new set starts (RESUME={last} finishes that one)")
            return new_set(a)
    print(resuming_line(state), flush=True)
    return state
