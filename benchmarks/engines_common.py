"""What engines.py's comparisons share: kvbench's side of a pair, pool and size arithmetic, the pair ratios.

kvbench's rows come from one ``kvbench run`` launch, read back from its parquet file and sidecar.  No MPI and
no engine is imported here; every launch is a child process with a timeout (jobs.launch).
"""
from __future__ import annotations

import glob
import json
import math
import os
import shlex

import native_tools as nt  # (subprocess only: ucx_perftest, transfer_engine_bench)
import numpy as np
from jobs import launch

from kvbench.job.launch import LIVE, kill_tree
from kvbench.results.samples import ci_rank
from kvbench.results.store import case_stats  # (pandas only; no MPI)

KIB = 1024
ENGINES = ("nixl", "ucx", "mooncake")
MODEL_YAML = "name: engines-mla512\nlayers: {layers}\nattention: mla\nkv_lora_rank: 512\nrope_dim: 0\n"
TARGET_SIZE, TARGET_RATIO = 256 * KIB, 0.95  # bulk / tool (issue 48's target)
HOT_TARGET = 0.95  # hot / tool, at >= TARGET_SIZE
MIN_PAIRS = 5  # interleaved kvbench/tool pairs a verdict needs (make bench-engines runs this many repeats)
PAGES_TARGET = 0.95  # kvbench bulk / nixl_reference on the same pages and scattered blocks
PAGE = 4096


# ----- processes and leftovers --------------------------------------------------------------
def kill_live() -> None:
    for root in list(LIVE):
        kill_tree(root)
    LIVE.clear()
    nt._kill_all()


def native_missing(tool: tuple[str, ...] | None) -> str | None:
    """Why an engine's own tool (its path under site-packages; None: a script of ours) cannot run here, or None."""
    site = nt._site()
    exe = os.path.join(site, *tool) if tool else None
    if exe and not os.access(exe, os.X_OK):
        return f"{os.path.basename(exe)} not found under {site}"
    return None


# ----- kvbench's side of a repeat -----------------------------------------------------------
def pool_bytes(sizes: list[int], layers: int) -> int:
    """kvbench's pool for these bulk cases: --pool-factor 2 x the largest request, rounded up to a page."""
    return -(-2 * max(sizes) * layers // PAGE) * PAGE


def kvbench_run(a, kv, mpirun, engine, model, outdir, sizes, variants="bulk,hot", pages=None):
    """kvbench's rows: {"gbps"|"p50_us"|"over_us": {(variant, op, size): value}, "infos": every rank's
    transport info() (page shares in "pages"), "pool": pool bytes}."""
    import pandas as pd

    extra = [x.split(":", 1)[1] for x in a.kvbench_args if x.split(":", 1)[0] == engine]
    if engine == "nixl":
        extra.insert(0, f"-O prep={a.nixl_prep}")
    cmd = mpirun + ["-n", "2"] + kv + [
        "run", "-t", engine, "--op", "push,pull", "--variants", variants, "-m", model, "--dtype", "fp16",
        "--tokens", ",".join(str(s // KIB) for s in sizes), "-n", str(a.iters), "-w", str(a.warmup),
        "-c", str(a.check), "--timeout", str(a.case_timeout), "-o", outdir, "--name", f"engines-{engine}",
    ] + (["--pages", pages] if pages else []) + [w for x in extra for w in shlex.split(x)]
    rc, out = launch(cmd, a.launch_timeout)
    paths = glob.glob(os.path.join(outdir, "*", "*.parquet"))
    if rc != 0 or len(paths) != 1:
        raise RuntimeError(f"kvbench {engine} failed (exit {rc}): {shlex.join(cmd)}\n" + tail(out))
    with open(paths[0][: -len(".parquet")] + ".meta.json") as fh:
        meta = json.load(fh)
    st = case_stats(pd.read_parquet(paths[0]))
    st = st[(st["status"] == "ok") & st["variant"].isin(variants.split(","))]
    over = meta.get("harness_overhead_us", {})
    infos = [i or {} for i in next(iter(meta.get("transports", {}).values()), [{}])]
    got: dict = {"gbps": {}, "p50_us": {}, "over_us": {}, "infos": infos,
                 "pool": next((i.get("pool_bytes") for i in infos if i.get("pool_bytes")), None)}
    for r in st.itertuples():
        key = (r.variant, r.op, int(r.tokens) * KIB)
        got["gbps"][key] = float(r.gbps)
        got["p50_us"][key] = float(r.p50) * 1e6
        o = over.get(str(int(r.case)), {}).get("mean_us")
        if o is not None:
            got["over_us"][key] = float(o)
    return got


def tail(out: str, n: int = 12) -> str:
    return "\n".join((out or "").strip().splitlines()[-n:])


def fmt_size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n // KIB} KiB"


# ----- ratios over repeats ------------------------------------------------------------------
def pair_ratios(num: dict, den: dict) -> list[float]:
    """kvbench / tool of each back-to-back pair (the repeats both sides have)."""
    return [num[r] / den[r] for r in num if r in den and den[r] > 0]


def pair_stats(num: dict, den: dict) -> tuple[float, float, float, str]:
    """(median of num, median of den, median ratio of pairs, 'min..max' of the ratios) over repeats."""
    ratios = pair_ratios(num, den)
    n = float(np.median(list(num.values()))) if num else float("nan")
    d = float(np.median(list(den.values()))) if den else float("nan")
    med = float(np.median(ratios)) if ratios else float("nan")
    return n, d, med, (f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-")


def judge(ratios: list[float], target: float, pairs: int) -> str:
    """One tool's verdict from its pair ratios: the median with an order-statistic interval [x_(k), x_(n-k+1)]
    (the tables' p50 interval, 95%; with 5 ratios min..max, 93.8%); meets when the whole interval is at or above
    the target, MISSES when it is all below, ``not decided`` when it straddles the target or fewer than
    MIN_PAIRS pairs ran."""
    if not ratios:
        return "-"
    x, n = np.sort(ratios), len(ratios)
    med = float(np.median(x))
    if pairs < MIN_PAIRS or n < MIN_PAIRS:
        return f"{med:.2f} (n={n} from {pairs} pairs: not decided, a verdict needs {MIN_PAIRS} pairs)"
    k = max(1, ci_rank(n))
    lo, hi = float(x[k - 1]), float(x[n - k])
    cover = 100 * (1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n)
    word = "meets" if lo >= target else "MISSES" if hi < target else "not decided"
    return f"{med:.2f} [{cover:.1f}% {lo:.2f}..{hi:.2f}, n={n} from {pairs} pairs] {word}"


def verdict(per_tool: dict, target: float, pairs: int) -> str:
    """``judge`` per tool, the tools in one line: per_tool = {tool: [pair ratios at the target's sizes]}."""
    return "; ".join(f"vs {t}: {judge(v, target, pairs)}" for t, v in per_tool.items()) or "-"


def tool_order(t: str) -> int:
    for i, key in enumerate(("WRITE", "tag_bw", "put_bw", "write", "READ", "get", "read")):
        if key in t:
            return i
    return 99
