"""`kvbench compare A B`: the same cases in two result sets, ratio and spread, with a significance test.

Cases are joined on their keys (everything that defines a case but its number). Each case compares
the samples that fit its kind: request times for bandwidth rows, exposed times for exposed-time and
workload rows (never GB/s of times that include a prefill or a queue). A regression is B slower than
A by more than the threshold at p50 with a Mann-Whitney U test over the iterations below alpha.  A percentile
is shown by the tables' rule (p95 from 20 samples a side, samples.py), and a set holding a run that did not end
cleanly (FAILED, SUSPECT, TIMEOUT, INCOMPLETE, ...) makes compare exit with that run's own code (job/status.py).
"""
from __future__ import annotations

import glob
import math
import os
import sys

import numpy as np
import pandas as pd

from kvbench.job.status import INPUT_ERROR, STATUSES
from kvbench.results.samples import FOOTNOTE, percentile
from kvbench.results.store import CASE_COLUMNS, pair_times

from .stats import Run, load_run

KEYS = [c for c in CASE_COLUMNS if c != "case"]
REGRESSED = 2  # exit code: a case regressed beyond --fail-above (1 stays "a mistake in the input")
# a run that did not end cleanly, worst first (wrong bytes outrank a time beyond physics, as in status.verdict)
UNSOUND = ("FAILED", "SUSPECT", "FALLBACK", "TIMEOUT", "ERROR", "INTERRUPTED", "INCOMPLETE")
MACHINE_FIELDS = ("hostname", "cpu_model", "cpus", "mem_total_bytes", "machine", "platform", "gpus", "rdma_devices",
                  "nic_speed_mbps")


def parse_threshold(text: str) -> float:
    """'5%' or '5' -> 5.0 (percent of the p50 time)."""
    try:
        v = float(str(text).strip().rstrip("%"))
    except ValueError:
        raise ValueError(f"--fail-above '{text}': expected a percentage such as 5%") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"--fail-above '{text}': a percentage >= 0")
    return v


def expand(path: str) -> list[str]:
    """A result file, or a folder of them."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
        if not found:
            raise ValueError(f"{path}: no result files (*.parquet) in this folder")
        return found
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such result file")
    return [path]


def samples(run: Run) -> pd.DataFrame:
    """One row per case: its keys, kind, metric name and the samples (seconds) compared."""
    df, st = run.df, run.st.set_index("case")
    times = pair_times(df).groupby(level="case").apply(lambda s: s.to_numpy())
    ok = df[(df["status"] == "ok") & (df["iter"] >= 0) & df["exposed_s"].notna()]
    ok = ok[(ok["workload"].fillna("none") == "none") | (ok["role"] == "decode")]
    exposed = ok.groupby("case")["exposed_s"].apply(lambda s: s.to_numpy())
    rows = []
    for case, r in st.iterrows():
        if r["status"] == "skipped":
            continue
        bw = r["kind"] == "bandwidth"
        vals = (times if bw else exposed).get(case)
        if vals is None or len(vals) == 0:
            continue
        rows.append({**{k: r[k] for k in KEYS}, "kind": r["kind"], "metric": "time" if bw else "exposed",
                     "payload_bytes": r["payload_bytes"], "x": np.asarray(vals, dtype=float), "run": run.label})
    return pd.DataFrame(rows)


def _key(df: pd.DataFrame) -> pd.Series:
    # missing keys (columns an older schema did not have) join as "-": astype(str) keeps NaN as missing
    return df[KEYS].astype(object).where(df[KEYS].notna(), "-").astype(str).agg("|".join, axis=1)


def _pool(s: pd.DataFrame) -> pd.DataFrame:
    """Cases repeated within a set (the same keys in several files) pool their samples."""
    s = s.assign(key=_key(s))
    x = s.groupby("key")["x"].apply(lambda v: np.concatenate(list(v)))
    return s.drop_duplicates("key").drop(columns="x").set_index("key").join(x)


def min_p(n1: int, n2: int) -> float:
    """The smallest two-sided p-value a Mann-Whitney U test can give with these sample counts."""
    return min(1.0, 2.0 / math.comb(n1 + n2, n1))


def join(a: list[Run], b: list[Run], threshold: float = 5.0, alpha: float = 0.05) -> tuple[pd.DataFrame, int, int]:
    """The joined table (one row per case in both sets), and the counts of cases only in A and only in B."""
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        raise ValueError("kvbench compare tests significance with scipy: pip install 'kvbench[report]'") from None

    sa = _pool(pd.concat([samples(r) for r in a], ignore_index=True))
    sb = _pool(pd.concat([samples(r) for r in b], ignore_index=True))
    both = sa.index.intersection(sb.index)
    rows = []
    for k in both:
        ra, rb = sa.loc[k], sb.loc[k]
        xa, xb = ra["x"], rb["x"]
        pa50, pb50 = np.percentile(xa, 50), np.percentile(xb, 50)
        pa95, pb95 = percentile(xa, 95), percentile(xb, 95)  # NaN below 20 samples: the tables' rule
        ident = len(xa) == len(xb) and np.array_equal(np.sort(xa), np.sort(xb))
        p = 1.0 if ident else float(mannwhitneyu(xa, xb, alternative="two-sided").pvalue)
        testable = min_p(len(xa), len(xb)) <= alpha
        d50 = 100 * (pb50 / pa50 - 1) if pa50 > 0 else math.nan
        beyond = d50 > threshold
        if beyond and (p < alpha or not testable):
            verdict = "REGRESSION" + ("" if testable else " (too few samples to test)")
        elif d50 < -threshold and (p < alpha or not testable):
            verdict = "faster"
        else:
            verdict = "same" if not beyond else "slower, not significant"
        bw = ra["metric"] == "time"  # GB/s of a request timed alone; never of times that include a prefill or queue
        rows.append({**{c: ra[c] for c in KEYS}, "kind": ra["kind"], "metric": ra["metric"],
                     "payload_bytes": ra["payload_bytes"], "n_a": len(xa), "n_b": len(xb),
                     "a_p50_ms": pa50 * 1e3, "b_p50_ms": pb50 * 1e3, "d_p50_pct": d50,
                     "a_gbps": ra["payload_bytes"] / pa50 / 1e9 if bw and pa50 > 0 else math.nan,
                     "b_gbps": rb["payload_bytes"] / pb50 / 1e9 if bw and pb50 > 0 else math.nan,
                     "a_p95_ms": pa95 * 1e3, "b_p95_ms": pb95 * 1e3,
                     "d_p95_pct": 100 * (pb95 / pa95 - 1) if pa95 > 0 else math.nan,
                     "p_value": p, "verdict": verdict})
    return pd.DataFrame(rows), len(sa.index.difference(sb.index)), len(sb.index.difference(sa.index))


def machine_differences(a: list[Run], b: list[Run]) -> list[str]:
    """'field: A vs B' for each machine fact that differs between the sets' first files."""
    ma, mb = a[0].meta, b[0].meta
    sa, sb = ma.get("system") or {}, mb.get("system") or {}
    out = [f"{f}: {sa.get(f)!r} vs {sb.get(f)!r}" for f in MACHINE_FIELDS
           if f in sa and f in sb and not _same(f, sa.get(f), sb.get(f))]
    ha, hb = ma.get("hosts") or [], mb.get("hosts") or []
    if len(set(ha)) != len(set(hb)) or len(ha) != len(hb):
        out.append(f"hosts: {len(set(ha))} host(s), {len(ha)} ranks vs {len(set(hb))} host(s), {len(hb)} ranks")
    return out


LABEL_KEYS = ["model", "tokens", "dtype", "block_size", "overlap", "handshake", "prefill_ms_set", "workload",
              "allocation", "coalesce", "layout", "head_layout", "inflight", "memory", "tp", "pp", "prefix_hit", "world_size",
              "scheme", "codec", "pages", "cache"]  # shown (as key=value) when they vary across the joined cases


def _case_label(r, vary: list[str]) -> str:
    bits = [str(r["variant"]), str(r["transport"]), str(r["op"])]
    for k in vary:
        if k == "block_size" and r["variant"] != "paged":
            continue
        bits.append(f"{'blk' if k == 'block_size' else k}={r[k]}")
    return " ".join(bits)


def _same(f: str, x, y) -> bool:
    if f == "mem_total_bytes" and isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return abs(x - y) <= 0.01 * max(x, y)  # the kernel's reservation moves by a few pages between boots
    return x == y


def unsound(a: list[Run], b: list[Run]) -> tuple[int, str] | None:
    """(exit code, one line) when a run of either set did not end cleanly: the worst one's own exit code, and every
    such run named with its status; None when all ended OK, UNCHECKED or NOTHING MEASURED."""
    bad = [(side, r) for side, runs in (("A", a), ("B", b)) for r in runs if r.status is not None]
    if not bad:
        return None
    worst = min((r.status for _, r in bad), key=lambda st: UNSOUND.index(st) if st in UNSOUND else len(UNSOUND))
    code = STATUSES.get(worst, (INPUT_ERROR,))[0]
    names = ", ".join(f"{side}'s {r.name} ended {r.status}" for side, r in bad)
    whose = "its" if len(bad) == 1 else "their"
    return (INPUT_ERROR if code is None else code), f"kvbench compare: {names}: {whose} rows are not to be trusted"


def _ms(x: float) -> str:
    return f"{'-':>9}" if math.isnan(x) else f"{x:>9.3f}"


def main(a_path: str, b_path: str, fail_above: str | None, alpha: float = 0.05, out=print, err=None) -> int:
    """Print the comparison; the exit code: a run that did not end cleanly gives its own (``unsound``, one line on
    ``err``), else REGRESSED when --fail-above is given and exceeded, else 0."""
    threshold = parse_threshold(fail_above) if fail_above is not None else 5.0
    if not (0 < alpha < 1):
        raise ValueError(f"--alpha {alpha}: a probability between 0 and 1")
    a = [load_run(p) for p in expand(a_path)]
    b = [load_run(p) for p in expand(b_path)]
    table, only_a, only_b = join(a, b, threshold, alpha)
    out(f"# A: {a_path} ({len(a)} file(s), commit {a[0].meta.get('git_commit', '?')})")
    out(f"# B: {b_path} ({len(b)} file(s), commit {b[0].meta.get('git_commit', '?')})")
    for d in machine_differences(a, b):
        out(f"# WARNING: the machines differ: {d}")
    for side, runs in (("A", a), ("B", b)):  # SUSPECT, FAILED, ...: its times or bytes are not to be trusted
        for r in runs:
            if r.status is not None:
                out(f"# WARNING: {side}'s {r.name} ended {r.status}: {r.meta.get('reason', '')}")
    out("# time = request time (bandwidth rows; max over the pair's ranks), exposed = prefill end to landed")
    out("# (exposed-time and workload rows), ms; d% = B / A - 1 (positive = B slower); p = Mann-Whitney U,")
    out(f"# two-sided, over the iterations; REGRESSION = B slower at p50 by more than {threshold:g}% with p < {alpha:g}")
    if only_a or only_b:
        out(f"# not compared: {only_a} case(s) only in A, {only_b} only in B")
    if table.empty:
        raise ValueError(f"{a_path} and {b_path} have no case in common: nothing to compare")
    # a key that differs only between variants (bulk's allocation is 'bulk') names nothing: vary within one
    vary = [k for k in LABEL_KEYS if (table[k].astype(str).groupby(table["variant"]).nunique() > 1).any()]
    out("# GB/s = payload / p50 time (10^9 B/s), bandwidth rows only; case = the full key of the case")
    out(f"# {FOOTNOTE}")
    verdicts = max(len("verdict"), int(table["verdict"].str.len().max()))
    head = (f"{'metric':>7} {'n A/B':>7} {'p50 A':>9} {'p50 B':>9} {'d%':>7} {'GB/s A':>7} {'GB/s B':>7} "
            f"{'p95 A':>9} {'p95 B':>9} {'d%':>7} {'p':>8}  {'verdict':<{verdicts}}  case")
    out("# " + head)
    for _, r in table.iterrows():
        gb = " ".join(f"{x:>7.2f}" if not math.isnan(x) else f"{'-':>7}" for x in (r["a_gbps"], r["b_gbps"]))
        d95 = f"{'-':>7}" if math.isnan(r["d_p95_pct"]) else f"{r['d_p95_pct']:>+7.1f}"
        out(f"  {r['metric']:>7} {r['n_a']:>3}/{r['n_b']:<3} {r['a_p50_ms']:>9.3f} {r['b_p50_ms']:>9.3f} "
            f"{r['d_p50_pct']:>+7.1f} {gb} {_ms(r['a_p95_ms'])} {_ms(r['b_p95_ms'])} {d95} "
            f"{r['p_value']:>8.2g}  {r['verdict']:<{verdicts}}  {_case_label(r, vary)}")
    bad = int(table["verdict"].str.startswith("REGRESSION").sum())
    out(f"# {len(table)} case(s) compared: {bad} regression(s) beyond {threshold:g}%, "
        f"{int((table['verdict'] == 'faster').sum())} faster")
    failed = unsound(a, b)
    if failed is not None:  # its times or bytes are not to be trusted, so no verdict on them may read as a pass
        (err or (lambda line: print(line, file=sys.stderr, flush=True)))(failed[1])
        return failed[0]
    return REGRESSED if (fail_above is not None and bad) else 0
