"""The writer (the row schema is results/schema.py, re-exported here), the metadata sidecar, and per-case statistics.

Raw samples are stored, statistics derived (pyperf/asv): one row per
(case, rank, iteration).  A file is never overwritten: a name that exists
gets a numeric suffix, and the table is replaced atomically after each case
so an interrupted run keeps every finished case.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import sys
import threading

import numpy as np
import pandas as pd

from kvbench.job import cleanup, faults
from kvbench.job.folder import ensure
from kvbench.job.safefile import check, open_own, read_text, remove
from kvbench.results import machine as hwfacts
from kvbench.results import samples as sample_stats
from kvbench.results.lock import ResultLock, sweep_stale
from kvbench.results.machine import git_commit, library_versions, machine_name  # noqa: F401  (as before)
from kvbench.results.schema import (
    CARRIER_DEFAULTS,
    CASE_COLUMNS,
    FABRIC_DEFAULTS,
    GPU_DEFAULTS,
    PLACEMENT_DEFAULTS,
    READS,
    REGISTER_DEFAULTS,
    RESUMES,  # noqa: F401  (readers find the schema's names here too)
    ROW_COLUMNS,
    SAMPLES_DEFAULTS,
    SCHEMA_VERSION,
    SETUP_DEFAULTS,
    WIRE_DEFAULTS,
)
from kvbench.results.sidecar import replace_whole, write_json

INCOMPLETE_REASON = "the run has not ended by itself: it was killed from outside, or is still running"


def transfer_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of timed transfers and check passes: every statistic of a case reads these, never a setup row."""
    return df if "row_kind" not in df else df[df["row_kind"] != "setup"]


def upgrade(df: pd.DataFrame, version: int) -> pd.DataFrame:
    """Rows of an older schema as this one's (the columns it lacked, empty)."""
    if version not in READS:
        raise ValueError(f"schema version {version} (this kvbench reads {', '.join(map(str, READS))})")
    for col in ROW_COLUMNS:
        if col not in df.columns:
            df[col] = {"completion": "", "pages": "4k", "fill": "pattern", "scales": "none",
                       "cache": "as-is", "bound_kind": "", **GPU_DEFAULTS, **PLACEMENT_DEFAULTS, **SAMPLES_DEFAULTS,
                       **SETUP_DEFAULTS, **CARRIER_DEFAULTS, **REGISTER_DEFAULTS,
                       **FABRIC_DEFAULTS, **WIRE_DEFAULTS}.get(col, np.nan)  # v1 pools were anonymous 4 KiB mmaps
    return df


def claim_path(root: str, name: str, ext: str) -> str:
    """``<root>/<machine>/<stamp>_<name><ext>``, created empty and atomically (O_EXCL, never through a link): a
    name that exists, or whose result set has any file already (a link planted under its table's name), gets
    ``-1``, ``-2``... so no file is ever overwritten."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = ensure(root, machine_name())  # another user's folder, or one open to all: refused (job/folder.py)
    base = os.path.join(folder, f"{stamp}_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}")
    n = 0
    while True:
        cand = base if n == 0 else f"{base}-{n}"
        n += 1
        taken = (cand + ".parquet", cand + ".meta.json", cleanup.lock_path(cand + ".parquet"),
                 *cleanup.set_tmp_files(cand + ".parquet"))
        if any(map(os.path.lexists, taken)):
            continue
        try:
            os.close(open_own(cand + ext, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            return cand + ext
        except FileExistsError:
            continue


class ResultWriter:
    """Writes ``<dir>/<machine>/<timestamp>_<suite>.parquet`` plus ``.meta.json``."""

    _sealed = False  # the exit path recorded the run's end: a later footer write (another thread) may not undo it
    _closed = False  # the run is over (or ending): no more writes, so none leaves a .tmp behind

    def __init__(self, root: str, suite_name: str, meta: dict):
        folder = ensure(root, machine_name())  # another user's folder, or one open to all: refused (job/folder.py)
        sweep_stale(folder)  # a killed run's .tmp and .lock files
        cand = claim_path(root, suite_name, ".meta.json")[: -len(".meta.json")]
        self.path = cand + ".parquet"
        self.meta_path = cand + ".meta.json"
        self.lock = None
        # until the run ends by itself or through the exit path, the sidecar says it has not
        self.meta = dict(meta, schema_version=SCHEMA_VERSION, results=os.path.basename(self.path),
                         status="INCOMPLETE", reason=INCOMPLETE_REASON, groups_done=[])
        self.frames: list[pd.DataFrame] = []
        self._mu = threading.Lock()
        try:
            self.lock = ResultLock(self.path)  # held until the run ends: a resume of a live run is refused
            self._write_meta()
        except BaseException:  # (a full disk) the claimed name and its lock go: nothing of this run stays
            os.unlink(self.meta_path)
            if self.lock is not None:  # (a lock whose own write failed removed itself: results/lock.py)
                self.lock.release()
            raise

    @classmethod
    def reopen(cls, path: str, meta: dict, lock: ResultLock) -> ResultWriter:
        """Continue an interrupted result set (``lock``: its lock, taken by the caller): keep the transports it
        finished, drop a half-done one's rows."""
        self = cls.__new__(cls)
        self.path, self.meta_path, self.lock = path, path[: -len(".parquet")] + ".meta.json", lock
        self._mu = threading.Lock()
        for name in (path, self.meta_path):  # a link in place of the set's files: refused, not read through
            check(name)
        for tmp in cleanup.set_tmp_files(self.path):  # a write the kill interrupted (a link there: refused)
            remove(tmp)
        sweep_stale(os.path.dirname(os.path.abspath(path)))
        old = json.loads(read_text(self.meta_path))
        done = list(old.get("groups_done", []))
        df = pd.read_parquet(path) if os.path.exists(path) else pd.DataFrame(columns=ROW_COLUMNS)
        version = old.get("schema_version", SCHEMA_VERSION)
        df = upgrade(df, version)[ROW_COLUMNS]  # an older schema's rows as this one's: one schema per file
        kept = df[df["transport"].isin(done)]
        # a run killed before any case finished has no table: an empty frame (untyped columns) would make
        # every column of the continued table untyped, so it starts with none
        self.frames = [kept] if len(kept) else []
        if os.path.exists(path):  # the half-done transport's rows go now, not when the first new case lands
            self._write_frame(kept)
        resumes = [*old.get("resumed", []), {"started": meta["started"], "argv": meta["argv"],
                                             "dropped_rows": int(len(df) - len(kept))}]
        if version != SCHEMA_VERSION:
            resumes[-1]["upgraded_from_schema"] = version
        self.meta = dict(old, status="INCOMPLETE", reason=INCOMPLETE_REASON, resumed=resumes, schema_version=SCHEMA_VERSION,
                         git_commit=meta["git_commit"], run_id=meta["run_id"], shm_segments=meta["shm_segments"])
        self._write_meta()
        return self

    def last_case(self) -> int:
        """The highest case number stored (new cases continue after it)."""
        return max((int(f["case"].max()) for f in self.frames if len(f)), default=0)

    def group_done(self, transport: str) -> None:
        """Every case of ``transport`` is stored: a resume will not run it again."""
        self.meta["groups_done"].append(transport)
        self._write_meta()

    def add(self, rows: list[dict]) -> None:
        """Append one case's rows and rewrite the table atomically."""
        self.frames.append(pd.DataFrame(rows, columns=ROW_COLUMNS))
        case = int(rows[0]["case"]) if rows else None
        self._write_frame(pd.concat(self.frames, ignore_index=True), lambda: faults.at("table-write", 0, case))

    def _write_frame(self, df: pd.DataFrame, midway=None) -> None:
        with self._mu:  # (the exit path's close, on another thread, waits for a write under way)
            if not self._closed:
                replace_whole(self.path, lambda fh: df.to_parquet(fh, index=False), midway=midway)

    def finish(self, final: bool = False, **extra) -> None:
        """Record end-of-run facts (status, totals) in the sidecar; ``final`` (the exit path's record) seals it."""
        with self._mu:
            if self._sealed or self._closed:
                return
            self.meta.update(extra)
            write_json(self.meta_path, self.meta, midway=None if final else lambda: faults.at("sidecar-finish", 0))
            self._sealed = final

    def close(self) -> None:
        """The run is over: no more writes, no .tmp left (the exit path may come while the main thread writes),
        and another run (a resume) may have the result set."""
        with self._mu:
            self._closed = True
            for tmp in cleanup.set_tmp_files(self.path):
                try:
                    remove(tmp)  # a link planted under its name stays, its target untouched
                except OSError:
                    pass
        self.lock.release()

    def _write_meta(self) -> None:
        with self._mu:
            if not self._closed:
                write_json(self.meta_path, self.meta)


def pair_times(df: pd.DataFrame) -> pd.Series:
    """Headline seconds per (case, pair, req, iter): the max over the two ranks of that transfer."""
    df = transfer_rows(df)
    ok = df[(df["status"] == "ok") & (df["iter"] >= 0)]
    return ok.groupby(["case", "pair", "req", "iter"])["seconds"].max()


def case_stats(df: pd.DataFrame) -> pd.DataFrame:
    """One line per case: percentiles (us) and GB/s (10^9 B/s) at p50, from raw rows.  ``samples`` = n behind
    them; a percentile n cannot hold is NaN, and the p50 has its 95% interval (samples.py)."""
    df = transfer_rows(df)
    t = pair_times(df).rename("t").reset_index()
    # aggregate: every request of every pair per iteration; the iteration ends when the last one lands
    ok = df[(df["status"] == "ok") & (df["iter"] >= 0)]
    per_req = ok.groupby(["case", "pair", "req"])["payload_bytes"].first().groupby("case").sum()
    makespan = t.groupby(["case", "iter"])["t"].max().groupby("case").median()
    agg = t.groupby("case")["t"].agg(
        p50=lambda s: float(np.percentile(s, 50)),
        p95=lambda s: sample_stats.percentile(s, 95),
        p99=lambda s: sample_stats.percentile(s, 99),
        samples="count",
    )
    ci = {case: sample_stats.p50_ci(s.to_numpy()) for case, s in t.groupby("case")["t"]}  # none: no ok row yet
    agg["p50_lo"] = pd.Series({case: lo for case, (lo, _) in ci.items()}, dtype=float)
    agg["p50_hi"] = pd.Series({case: hi for case, (_, hi) in ci.items()}, dtype=float)
    agg["ci_pct"] = 100 * (agg["p50_hi"] - agg["p50_lo"]) / 2 / agg["p50"]
    keys = df.groupby("case").agg(
        **{c: (c, "first") for c in CASE_COLUMNS if c != "case"},
        payload_bytes=("payload_bytes", "first"),
        descriptors=("descriptors", "first"),
        nwrong=("nwrong", "sum"),
        status=("status", "first"),
        reason=("reason", "first"),
        **{c: (c, "first") for c in SAMPLES_DEFAULTS},
    )
    dec = ok[ok["exposed_s"].notna()].groupby("case")["exposed_s"]
    for q in (50, 95, 99):
        agg[f"exposed_p{q}"] = dec.agg(lambda s, q=q: sample_stats.percentile(s, q))
    agg["exposed_samples"] = dec.count()
    agg["handshake_p50"] = ok.groupby("case")["handshake_s"].median()
    for col in ("register_s", "deregister_s"):  # --register per-request: per request, on its initiator (schema 7)
        if col in ok:
            agg[col.replace("_s", "_p50")] = ok.groupby("case")[col].median()
    agg["prefill_s"] = df.groupby("case")["prefill_s"].first()
    out = keys.join(agg, how="left")
    out["pairs"] = ok.groupby("case")["pair"].nunique()
    out["gbps"] = out["payload_bytes"] / out["p50"] / 1e9
    out["agg_gbps"] = per_req / makespan / 1e9
    return out.reset_index()


def system_description() -> dict:
    """An allowlisted description of this machine: nothing secret, enough to compare."""
    info = {"hostname": machine_name(), "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            info["mem_total_bytes"] = int(fh.readline().split()[1]) * 1024
    except OSError:
        pass
    info["rdma_devices"] = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    info["nics"] = sorted(n for n in os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    info["nic_speed_mbps"] = {n: hwfacts.nic_speed_mbps(n) for n in info["nics"]}  # the line rate %line divides by
    info["rdma_rates"] = hwfacts.rdma_rates()
    info["gpus"] = hwfacts.gpu_names()
    info["gpu_rdma"] = hwfacts.facts()  # GPUs, RDMA ports, GPUDirect, memlock, topology
    info["argv0"] = os.path.basename(sys.argv[0])
    return info
