"""The row schema (versioned), the writer, the metadata sidecar, and per-case statistics.

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
import socket
import sys
import threading

import numpy as np
import pandas as pd

from kvbench.fabric.carriers import COLUMNS as CARRIER_DEFAULTS
from kvbench.job import cleanup, faults
from kvbench.results import machine as hwfacts
from kvbench.results import samples as sample_stats
from kvbench.results.lock import ResultLock, lock_path, sweep_stale
from kvbench.results.machine import git_commit, library_versions  # noqa: F401  (the sidecar's facts, as before)

SCHEMA_VERSION = 7  # 2: pages, skew_s, clock_err_s, clock_offset_s, completion (1 reads as 2 with those empty: upgrade())
# 3: the codec columns below (2 reads as 3 with them empty), the GPU columns (at their defaults) and the
# time outside the wire (post_s, lib_s, notify_s, wake_s; empty); 4: cache (3 reads as 4 with "as-is"); 5: the
# blocks marked "schema 5" below (1-4 read with them at their defaults); 6: the setup rows (schema 6 below);
# 7: --register (schema 7 below; 1-6 read as "once"), carriers and the fabric columns (schema 7 below)
READS = (1, 2, 3, 4, 5, 6, 7)  # schema versions the readers (report, compare) upgrade to this one
RESUMES = (3, 4, 5, 6, 7)  # those --resume continues (a schema-3 suite and cases are this one's, but for cache)
INCOMPLETE_REASON = "the run has not ended by itself: it was killed from outside, or is still running"

CASE_COLUMNS = ["case", "variant", "transport", "op", "memory", "model", "tokens", "prefix_hit", "block_size",
                "block_bytes", "layout", "allocation", "coalesce", "dtype", "codec", "overlap", "scheme", "tp",
                "pp", "world_size", "inflight"]
CASE_COLUMNS += ["handshake", "prefill_ms_set", "workload", "layers", "pages"]
CASE_COLUMNS += ["scales", "fill"]  # v3: fp8 scale planes (formats.py); pool contents (memory/values.py)
CASE_COLUMNS += ["cache"]  # v4: where a request's bytes were when its iteration started (cachestate.py)
CASE_COLUMNS += ["flow_mode"]  # v7: a matrix's flow alone or all flows at once (harness/flows.py)
# per row: seconds = until this rank's part of the request was complete, from the iteration's start
# (the barrier, or the request's arrival under a workload); prefill_s = the prefill clock's P;
# handshake_s = allocate-then-stream round trip; exposed_s = decode's completion - prefill end;
# queue_s = wait for decode blocks (back-pressure); arrival_s = arrival time since the workload began
ROW_COLUMNS = CASE_COLUMNS + ["rank", "role", "pair", "req", "iter", "round", "seconds", "harness_seconds", "payload_bytes",
                              "wire_bytes", "descriptors", "status", "reason", "nwrong", "prefill_s", "handshake_s",
                              "exposed_s", "queue_s", "arrival_s", "skew_s", "clock_err_s", "clock_offset_s", "completion"]
# --- v3, codecs (kvbench/codecs/path.py): per row and iteration, this rank's seconds encoding (source) or decoding and
# scattering (destination) the request's layers; codec_max_abs_err / codec_max_rel_err: on a lossy codec's check
# row, the largest errors (nwrong counts the elements outside its stated tolerance, docs/codecs.md)
ROW_COLUMNS += ["codec_encode_s", "codec_decode_s", "codec_max_abs_err", "codec_max_rel_err"]
# skew_s: a destination's barrier exit minus its source's, on one clock (its seconds and exposed_s include it);
# clock_err_s: the bound on that correction (half the best ping-pong); clock_offset_s: the destination's clock minus
# its source's; completion: who stamped the landing, "transport" (its own receive or progress thread) or "harness"
# (the moment its wait or notification returned)
# --- v3, device memory: copy = the copy engine of device bytes (copy.py; "batch" for host rows, where it is unused);
# gather_s / wire_s / scatter_s = seconds this rank spent in each stage of the staged transport in this iteration
# (device -> bounce, the inner transport, bounce -> device; NaN for every other transport)
GPU_DEFAULTS = {"copy": "batch", "gather_s": np.nan, "wire_s": np.nan, "scatter_s": np.nan}
CASE_COLUMNS += ["copy"]
# prefill = how the prefill was made: "clock" (a timer of prefill_ms) or "real" (each layer's matmuls where the
# pools live, prefill.py); with "real", prefill_s is the prefill's measured seconds on the source that iteration
GPU_DEFAULTS["prefill"] = "clock"
CASE_COLUMNS += ["prefill"]
ROW_COLUMNS += ["prefill"]
ROW_COLUMNS += ["copy", "gather_s", "wire_s", "scatter_s"]

# --- schema 3, time outside the wire (costs.py; v2 rows read with them empty) ---------------------------
# post_s: this rank's seconds in the transport's prepare/post/start/serve/signal calls in the iteration;
# lib_s: the part of post_s inside the library call that moves or queues the bytes; notify_s: its seconds in the harness's own notifications; wake_s: this request's gap from the transport's
# landing stamp to the harness's wait returning (empty where the harness stamps the landing)
ROW_COLUMNS += ["post_s", "lib_s", "notify_s", "wake_s"]
# --- schema 4: cache_bytes = bytes of this request's ranges this rank read (--cache warm) or flushed from the
# CPU caches (cold) before the iteration's barrier; 0 under as-is (v3 rows read with it empty)
ROW_COLUMNS += ["cache_bytes"]
# --- schema 5, placement (harness/placing.py): gpu = this rank's GPU ordinal in a cuda row (-1: not a cuda row,
# or an older schema); nic = the RDMA device nearest that GPU by PCIe affinity, in a network transport's cuda row
# ("" where none); same_gpu = the row's pair used one GPU (its rows measure HBM copies, not a link)
PLACEMENT_DEFAULTS = {"gpu": -1, "nic": "", "same_gpu": False}
ROW_COLUMNS += ["gpu", "nic", "same_gpu"]
# --- schema 5, samples (results/samples.py): ci_stop = why the case's timed iterations ended: "fixed" (-n
# iterations, no --target-ci; older rows read so), "target" (its p50's 95% interval came within --target-ci) or
# "budget" (--ci-budget ran out first); ci_target_pct = that target, % of the p50 (empty without one)
SAMPLES_DEFAULTS = {"ci_stop": "fixed", "ci_target_pct": np.nan}
ROW_COLUMNS += list(SAMPLES_DEFAULTS)
# --- schema 5, bounds (results/bounds.py; rows of 1-4 read with them empty) --------------------------------
# stamp_lead_s: how long this request's wait ran past the later of the transport's landing stamp and the wait's
# start (empty where the harness stamps); wake_bound_s: the most it may, a thread wake-up on this rank measured at
# its transport's setup; bound_gbps / bound_kind: on a destination's rows, the GB/s the request's path can carry,
# and what bounds it ("memory copy": the harness's own copy of the same descriptors in this run; "link IF" or
# "links ...": the NIC rates across hosts; "none (...)": no bound, and why); window_s: on a destination that posts
# the request itself (a pull's reads), seconds from its first post to the landing
ROW_COLUMNS += ["stamp_lead_s", "wake_bound_s", "bound_gbps", "bound_kind", "window_s"]
# --- schema 6, setup rows (harness/setup.py; rows of 1-5 read as transfers): row_kind = "transfer" (a timed
# iteration or a check pass) or "setup" (iter -2: one phase of a transport's setup on this rank, its seconds in
# `seconds`); phase = "" on a transfer row, else alloc, fill, register (per pool), exchange, connect (per peer),
# first (a case's first transfer, per request: case, pair and req are its), pool-register / pool-deregister
# (--pool-sizes); their status is "setup" (a reader of the "ok" rows reads transfers alone); peer = the peer of a connect row (-1 elsewhere); region_bytes = the pool's bytes of an alloc,
# fill, register or pool row (empty elsewhere); a pool-register row of a transport that registers nothing has
# status "none", no seconds, and the reason
SETUP_DEFAULTS = {"row_kind": "transfer", "phase": "", "peer": -1, "region_bytes": np.nan}
ROW_COLUMNS += list(SETUP_DEFAULTS)
# --- schema 7, --register (harness/schedule.py): register = "once" (the pool at setup; older rows read so) or
# "per-request" (the initiator registers each request's local blocks inside the timed request, before its first
# post, and deregisters them after its last landing); register_s / deregister_s = on the initiator's rows of a
# per-request case, this request's seconds registering (inside `seconds`) and deregistering (after the landing,
# outside `seconds`); empty elsewhere
REGISTER_DEFAULTS = {"register": "once", "register_s": np.nan, "deregister_s": np.nan}
CASE_COLUMNS += ["register"]
ROW_COLUMNS += ["register", "register_s", "deregister_s"]
ROW_COLUMNS += list(CARRIER_DEFAULTS)  # schema 7: a timed row's NICs and carrier (fabric/carriers.py; 1-6 read empty)
# --- schema 7, fabric (rows of 1-6 read with these defaults; docs/fabric.md says what each holds): per rail of a
# striping transport its NIC, the request's bytes and descriptors, and the kernel's count per iteration
# (harness/railrows.py); per flow of a traffic matrix alone or with all flows (flow_mode), its p50 seconds alone and
# together, slowdown, fairness over the flows and GB/s into its receiver (harness/flows.py)
FABRIC_DEFAULTS = {"rails": 0, "rail_nics": "", "rail_bytes": "", "rail_descs": "", "rail_wire_bytes": "",
                   "flow_mode": "", "flow": "", "isolated_s": np.nan, "congested_s": np.nan, "slowdown": np.nan,
                   "fairness": np.nan, "receiver_gbps": np.nan}
ROW_COLUMNS += [c for c in FABRIC_DEFAULTS if c not in ROW_COLUMNS]  # flow_mode is a case column


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
                       **FABRIC_DEFAULTS}.get(col, np.nan)  # v1 pools were anonymous 4 KiB mmaps
    return df


def machine_name() -> str:
    """Short host name, safe as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname().split(".")[0]) or "unknown"


def claim_path(root: str, name: str, ext: str) -> str:
    """``<root>/<machine>/<stamp>_<name><ext>``, created empty and atomically (O_EXCL): a name that exists gets
    ``-1``, ``-2``... so no file is ever overwritten."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = os.path.join(root, machine_name())
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"{stamp}_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}")
    n = 0
    while True:
        cand = base if n == 0 else f"{base}-{n}"
        try:
            os.close(os.open(cand + ext, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return cand + ext
        except FileExistsError:
            n += 1


class ResultWriter:
    """Writes ``<dir>/<machine>/<timestamp>_<suite>.parquet`` plus ``.meta.json``."""

    _sealed = False  # the exit path recorded the run's end: a later footer write (another thread) may not undo it
    _closed = False  # the run is over (or ending): no more writes, so none leaves a .tmp behind

    def __init__(self, root: str, suite_name: str, meta: dict):
        folder = os.path.join(root, machine_name())
        os.makedirs(folder, exist_ok=True)
        sweep_stale(folder)  # a killed run's .tmp and .lock files
        cand = claim_path(root, suite_name, ".meta.json")[: -len(".meta.json")]
        self.path = cand + ".parquet"
        self.meta_path = cand + ".meta.json"
        self.lock = ResultLock(self.path)  # held until the run ends: a resume of a live run is refused
        # until the run ends by itself or through the exit path, the sidecar says it has not
        self.meta = dict(meta, schema_version=SCHEMA_VERSION, results=os.path.basename(self.path),
                         status="INCOMPLETE", reason=INCOMPLETE_REASON, groups_done=[])
        self.frames: list[pd.DataFrame] = []
        self._mu = threading.Lock()
        try:
            self._write_meta()
        except BaseException:  # (a full disk) the claimed name and its lock go: nothing of this run stays
            os.unlink(self.meta_path)
            self.lock.release()
            raise

    @classmethod
    def reopen(cls, path: str, meta: dict, lock: ResultLock) -> ResultWriter:
        """Continue an interrupted result set (``lock``: its lock, taken by the caller): keep the transports it
        finished, drop a half-done one's rows."""
        self = cls.__new__(cls)
        self.path, self.meta_path, self.lock = path, path[: -len(".parquet")] + ".meta.json", lock
        self._mu = threading.Lock()
        for tmp in cleanup.set_tmp_files(self.path):  # a write the kill interrupted
            if os.path.exists(tmp):
                os.unlink(tmp)
        sweep_stale(os.path.dirname(os.path.abspath(path)))
        with open(self.meta_path) as fh:
            old = json.load(fh)
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
                _replace(self.path, lambda tmp: df.to_parquet(tmp, index=False), midway=midway)

    def finish(self, final: bool = False, **extra) -> None:
        """Record end-of-run facts (status, totals) in the sidecar; ``final`` (the exit path's record) seals it."""
        with self._mu:
            if self._sealed or self._closed:
                return
            self.meta.update(extra)
            _write_json(self.meta_path, self.meta, midway=None if final else lambda: faults.at("sidecar-finish", 0))
            self._sealed = final

    def close(self) -> None:
        """The run is over: no more writes, no .tmp left (the exit path may come while the main thread writes),
        and another run (a resume) may have the result set."""
        with self._mu:
            self._closed = True
            for tmp in cleanup.set_tmp_files(self.path):
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.lock.release()

    def _write_meta(self) -> None:
        with self._mu:
            if not self._closed:
                _write_json(self.meta_path, self.meta)


def _write_json(path: str, obj: dict, tmp: str | None = None, midway=None) -> None:
    def write(t):
        with open(t, "w") as fh:
            json.dump(obj, fh, indent=2, default=str)

    _replace(path, write, tmp, midway)


def _replace(path: str, write, tmp: str | None = None, midway=None) -> None:
    """Write ``path`` whole or not at all: into ``tmp`` (``path.tmp``), then renamed over it; a failed write (a
    full disk) leaves no temporary file behind.  ``midway`` runs between the two (the fault matrix's point)."""
    tmp = tmp or cleanup.tmp_of(path)
    try:
        write(tmp)
        if midway is not None:
            midway()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def record_for_rank0(meta_path: str, status: str, reason: str) -> bool:
    """Another rank records a failure in the sidecar when rank 0, its writer, is stopped or hung: only while
    the sidecar still says INCOMPLETE (rank 0's own word wins), and only where the file is (a shared file
    system or rank 0's host).  Rank 0's lock and half-written files go too: the job's abort ends it, stopped
    as it is, and nobody else would remove them.  True when written."""
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return False
    try:
        if meta.get("status") != "INCOMPLETE":
            return False
        meta.update(status=status, reason=reason,
                    finished=dt.datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z"))
        _write_json(meta_path, meta, tmp=cleanup.own_tmp_of(meta_path))  # not rank 0's .tmp: it may be mid-write
        return True
    finally:
        parquet = meta_path[: -len(".meta.json")] + ".parquet"
        for path in (*cleanup.set_tmp_files(parquet), lock_path(parquet)):
            try:
                os.unlink(path)
            except OSError:
                pass


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
