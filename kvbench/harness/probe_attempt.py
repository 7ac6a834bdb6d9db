"""One size of `kvbench probe`: a ``kvbench run`` of two ranks under mpiexec with a deadline, read back as a row.

The run's pools are exactly the size tried (``--pool-factor``: pool / request) and its request takes the pools'
last blocks (``--alloc tail``): the layout fills a pool that is a whole number of block strides, so the request
touches its last page on both sides, and a registration that silently covers less than the pool fails the check.
A rank that dies by a signal, a run past its deadline or a failed run is the row's status, with why.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time

from kvbench import memory
from kvbench.job import cleanup
from kvbench.job.launch import launch
from kvbench.model import shapes as M

FAULT_ENV = "KVBENCH_PROBE_FAULT"  # "<pool bytes>:<KVBENCH_FAULT spec>": that size's attempt alone gets the fault
EXIT_WORDS = {2: "FAILED", 5: "TIMEOUT"}  # kvbench run's exit codes (job/status.py) the rows name as they are


def default_mpiexec() -> str | None:
    """The mpiexec beside this interpreter (the venv's MPICH), else the one on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


@dataclasses.dataclass(frozen=True)
class Request:
    """The one request every attempt moves, and how it is moved."""

    transport: str
    memory: str = "host"
    model: str = "llama-3-8b"
    tokens: int = 1024
    block_size: int = 16
    dtype: str = "fp16"
    op: str = "push"
    iters: int = 5
    options: tuple[str, ...] = ()  # -O items, as given
    mpiexec: str = ""

    @property
    def shape(self) -> M.ModelShape:
        return M.get_model(self.model)

    @property
    def stride(self) -> int:
        """Bytes of one block id across every layer and region: pools are whole multiples of it."""
        s = self.shape
        return s.layers * s.regions * M.block_bytes(s, self.block_size, self.dtype)

    @property
    def step(self) -> int:
        """The grid of sizes tried: whole block strides and whole pages."""
        return math.lcm(self.stride, memory.PAGE)

    @property
    def whole_tokens(self) -> int:
        """The tokens sent: whole blocks, so the request's last block reaches its end (and the pool's)."""
        return M.num_blocks(self.tokens, self.block_size) * self.block_size

    @property
    def nbytes(self) -> int:
        """The request's bytes as the pool holds them (whole blocks)."""
        return self.stride * M.num_blocks(self.tokens, self.block_size)

    @property
    def smallest(self) -> int:
        """The smallest pool that holds the request."""
        return -(-self.nbytes // self.step) * self.step


@dataclasses.dataclass
class Row:
    """One size tried: OK, FAILED (wrong elements), SIGNAL (a rank died by one), TIMEOUT or ERROR."""

    pool_bytes: int
    status: str
    signal: str = ""
    reason: str = ""
    gbps: float | None = None
    register_s: float | None = None
    nwrong: int | None = None
    seconds: float = 0.0
    run_id: str = ""  # the run's id: its /dev/shm files are named by it (job/cleanup.py)


def attempt_deadline(size: int) -> float:
    """Seconds one attempt may take: start-up, then two pools allocated, filled and checked at a slow 100 MB/s."""
    return 60.0 + 4 * size / 100e6


class Attempt:
    """One size: the launch, and its row."""

    def __init__(self, req: Request, size: int, deadline: float | None = None, scratch: str | None = None):
        self.req, self.size, self.scratch = req, size, scratch  # scratch: where its run writes (under -o)
        self.deadline = deadline or attempt_deadline(size)

    def command(self, out: str) -> list[str]:
        r = self.req
        inner = max(10.0, self.deadline - 15)  # the run's own deadlines end it first, with its one line
        cmd = [r.mpiexec or default_mpiexec() or "mpiexec", "-n", "2", sys.executable, "-m", "kvbench", "run",
               "-t", r.transport, "--memory", r.memory, "-m", r.model, "--tokens", str(r.whole_tokens),
               "-b", str(r.block_size), "-e", str(r.block_size), "--dtype", r.dtype, "--op", r.op,
               "--alloc", "tail", "--coalesce", "on", "--variants", "paged", "-n", str(r.iters), "-w", "1",
               "-c", "1", "--pool-factor", repr(self.size / r.nbytes), "--timeout", f"{inner:g}",
               "--setup-timeout", f"{inner:g}", "--progress", "off", "-o", out, "--name", f"probe-{self.size}"]
        return cmd + [w for o in r.options for w in ("-O", o)]

    def env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        size, _, spec = os.environ.get(FAULT_ENV, "").partition(":")
        if size.isdigit() and int(size) == self.size:
            env["KVBENCH_FAULT"] = spec
        return env

    def run(self) -> Row:
        if self.scratch:
            os.makedirs(self.scratch, exist_ok=True)
        t0, out = time.monotonic(), None
        try:  # made inside: an interrupt right after it still removes it
            out = tempfile.mkdtemp(prefix="kvbench-probe-", dir=self.scratch)
            rc, text = launch(self.command(out), self.deadline, self.env(), grace=2.0)
            row = self.read(rc, text, out)
        finally:
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
        row.seconds = round(time.monotonic() - t0, 2)
        return row

    def read(self, rc: int, text: str, out: str) -> Row:
        """The row from the launch's exit code, its output and the run's files."""
        row = Row(self.size, "OK")
        meta, table = _results(out)
        row.run_id = meta.get("run_id", "")
        if meta.get("run_id") and rc != 0:  # a rank killed by a signal leaves its segments to whoever looks
            cleanup.unlink_run(meta["run_id"])
        if table is not None:
            row.gbps, row.nwrong = _measured(table)
        infos = [i for i in next(iter(meta.get("transports", {}).values()), []) if i]
        reg = [i["register_s"] for i in infos if i.get("register_s") is not None]
        row.register_s = round(max(reg), 4) if reg else None
        sig = _signal(rc, text)
        if rc == 124:  # the probe's own deadline killed it: its ranks' SIGTERM is the probe's doing, not theirs
            row.status, row.reason = "TIMEOUT", f"no end within {self.deadline:g} s (--deadline): the probe ended it"
        elif sig:
            row.status, row.signal = "SIGNAL", sig
            row.reason = f"a rank died by {sig}" + _says(text, " after: ")
        elif rc != 0:
            row.status = EXIT_WORDS.get(rc, "ERROR")
            row.reason = _says(text) or f"kvbench run exited {rc}"
        elif row.nwrong:
            row.status, row.reason = "FAILED", f"{row.nwrong} wrong elements"
        elif row.gbps is None:
            row.status, row.reason = "ERROR", "no measured row"
        elif any(i.get("pool_bytes") != self.size for i in infos):  # the probe's premise: the pool is the size tried
            row.status, row.reason = "ERROR", f"the run's pools were {[i.get('pool_bytes') for i in infos]} bytes"
        return row


def _results(out: str):
    """The run's sidecar (a dict, empty when there is none) and its rows (None when there are none)."""
    metas = glob.glob(os.path.join(out, "*", "*.meta.json"))
    if not metas:
        return {}, None
    try:
        with open(metas[0]) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return {}, None
    table = metas[0][: -len(".meta.json")] + ".parquet"
    if not os.path.exists(table):
        return meta, None
    import pandas as pd

    return meta, pd.read_parquet(table)


def _measured(df) -> tuple[float | None, int | None]:
    """(GB/s of the paged request at p50, wrong elements of its check) from a run's rows."""
    from kvbench.report.tables import case_stats

    st = case_stats(df)
    st = st[(st["status"] == "ok") & (st["variant"] == "paged")]
    gbps = round(float(st["gbps"].iloc[0]), 3) if len(st) else None
    checked = df[df["iter"] == -1]["nwrong"].dropna()
    return gbps, int(checked.sum()) if len(checked) else None


def _signal(rc: int, text: str) -> str:
    """The signal a rank died by ('SIGSEGV'), from the launcher's words or its exit code; '' when none."""
    m = re.search(r"EXIT STRING: .*\(signal (\d+)\)", text) or re.search(r"killed by signal (\d+)", text)
    num = int(m.group(1)) if m else (-rc if rc < 0 else 0)
    if not num:
        return ""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _says(text: str, lead: str = "") -> str:
    """kvbench's own one line in a run's output ('kvbench: error: ...'), prefixed by ``lead``; '' when none."""
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("kvbench: ")]
    return lead + lines[0].removeprefix("kvbench: ") if lines else ""
