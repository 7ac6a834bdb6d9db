"""`make fuzz`: every probe list of tests/probes/ against kvbench's doors, each probe in a sandbox of its own.

    python tools/fuzz [--list door,faults] [-k NAME] [--markdown] [--keep] [--shared]

Each probe must end with its expected exit code within its limit, print at most one `kvbench:` line (exactly one,
matching its regex, where the list gives one), no Python traceback, leave nothing in its /dev/shm and write nothing
outside its scratch folder (docs/reliability.md, "make fuzz").  One line per probe, then a table of category,
probes, clean and known failures; exit 0 when every probe is clean or a known failure (xfail) that still fails.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: `fuzz` is a package there
sys.path.insert(1, str(Path(__file__).resolve().parent.parent.parent))  # the checkout: kvbench for the generators

from fuzz import judge, probes, sandbox  # noqa: E402

BIN = Path(sys.executable).parent


def tools() -> dict[str, str]:
    """What {mpiexec}, {kvbench} and {python} stand for: the venv's own."""
    mpiexec = BIN / "mpiexec"
    return {"mpiexec": str(mpiexec) if mpiexec.exists() else (shutil.which("mpiexec") or "mpiexec"),
            "kvbench": str(BIN / "kvbench"), "python": sys.executable}


def one(probe: probes.Probe, base: Path, mode: str) -> judge.Verdict:
    """Run one probe in a fresh scratch folder under ``base``; its verdict."""
    scratch = base / f"{probe.category}-{probe.name}"
    scratch.mkdir()
    try:
        argv = probes.command(probe, scratch, tools())
    except (KeyError, OSError, ValueError) as exc:  # a generator that failed is the harness's fault, said as such
        return judge.verdict(probe, judge.Result(None, "", 0.0, sandbox=f"could not prepare: {exc!r}"))
    return judge.verdict(probe, sandbox.run(argv, probe.env, probe.limit, scratch, mode))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="append", default=[], help="only these categories (comma-separated, repeatable)")
    ap.add_argument("-k", dest="names", action="append", default=[], help="only probes whose name contains this")
    ap.add_argument("--markdown", action="store_true", help="the summary table as markdown too")
    ap.add_argument("--keep", action="store_true", help="keep every probe's scratch folder (default: failures only)")
    ap.add_argument("--shared", action="store_true", help="no namespace even where unshare works (the fallback)")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.inner:
        return sandbox.inner(a.inner)
    only = [c for item in a.list for c in item.split(",") if c]
    try:
        lists = probes.load_all(only=only or None)
    except probes.ListError as exc:
        print(f"fuzz: {exc}", file=sys.stderr)
        return 1
    chosen = [p for pl in lists for p in pl.probes if not a.names or any(k in p.name for k in a.names)]
    mode = sandbox.SHARED if a.shared else sandbox.detect()
    base = Path(tempfile.mkdtemp(prefix="kvbench-fuzz-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    print(f"# fuzz: {len(chosen)} probes from {len(lists)} lists ({', '.join(pl.category for pl in lists)}); "
          f"sandbox {mode}; scratch {base}", flush=True)
    t0, verdicts = time.monotonic(), []
    for probe in chosen:
        v = one(probe, base, mode)
        verdicts.append(v)
        print(judge.report_line(v), flush=True)
        if v.clean and not a.keep:
            shutil.rmtree(base / f"{probe.category}-{probe.name}", ignore_errors=True)
    rows = judge.summary(verdicts)
    print(f"# {len(verdicts)} probes in {time.monotonic() - t0:.0f} s")
    print(judge.table(rows))
    if a.markdown:
        print()
        print(judge.table(rows, markdown=True))
    noted = [v for v in verdicts if v.notes]
    if noted:
        print(f"# MPICH's launcher (hydra) left its /tmp/hydra_hwloc_xmlfile_* after {len(noted)} of {len(verdicts)} "
              "probes (its file, not kvbench's: noted, not judged)")
    bad = [v for v in verdicts if not v.ok]
    if not a.keep and not any(base.iterdir()):
        base.rmdir()
    else:
        print(f"# scratch folders kept (failures{' and all' if a.keep else ''}): {base}")
    print(f"# {'clean' if not bad else f'{len(bad)} not clean: ' + ', '.join(v.probe.id for v in bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
