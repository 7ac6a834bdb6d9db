"""The page's first screen: what failed, what carried the bytes, the purchase verdict per path and model (the plan's,
verdicts.py), per path the typical paged GB/s (typical.py), exposed time per model, the machine.

A buyer reads this before any long table: each figure with its sample count (and its p50 confidence interval when
the rows carry one), its share of the ceiling and of the line, and its status. Columns a newer result or statistic
adds (``samples``, a p50 interval, a status) are used when present; older ones fall back to what they hold.
"""
from __future__ import annotations

import pandas as pd

from .rowstatus import STATUS_COLUMNS, status, suspect_cases, trusted, untrusted  # noqa: F401
from .verdicts import IN_PROCESS

CI_PAIRS = (("p50_lo", "p50_hi"), ("p50_lo_s", "p50_hi_s"), ("p50_ci_lo", "p50_ci_hi"))  # seconds, as p50
CI_PCT = ("p50_ci_pct", "ci_pct", "ci_half_pct")  # the half-width, % of p50


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def samples(r) -> str:
    """n: the timed samples behind the row's p50 (``samples``, or ``iters`` in files that counted them so)."""
    for col in ("samples", "iters"):
        if col in r and not pd.isna(r[col]):
            return str(int(r[col]))
    return "-"


def ci(r) -> str:
    """The p50's 95% confidence interval as GB/s low-high, or ±% when only the half-width is stored; '-' without."""
    for lo, hi in CI_PAIRS:
        if lo in r and hi in r and not (pd.isna(r[lo]) or pd.isna(r[hi])) and r[lo] > 0 and r[hi] > 0:
            gb = r["payload_bytes"] / 1e9
            return f"{gb / r[hi]:.2f}-{gb / r[lo]:.2f}"  # a longer time is a lower rate
    for col in CI_PCT:
        if col in r and not pd.isna(r[col]):
            return f"±{r[col]:.1f}%"
    return "-"


def best_paged(bw: pd.DataFrame) -> pd.DataFrame:
    """Per run, path (transport, memory) and op: the paged row with the highest GB/s, as the summary shows it."""
    paged = bw[(bw["variant"] == "paged") & bw["gbps"].notna()]
    if paged.empty:
        return pd.DataFrame()
    top = paged.loc[paged.groupby(["run", "transport", "memory", "op"], sort=False)["gbps"].idxmax()]
    return pd.DataFrame([{
        "run": r["run"], "path": r["transport"] + ("" if r["memory"] == "host" else f" ({r['memory']})"),
        "op": r["op"], "best paged GB/s": _f(r["gbps"], ".2f"), "n": samples(r), "p50 CI (GB/s)": ci(r),
        "at": f"{r['model']} {r['tokens']} tok {r['dtype']}, {r['block_size']}-token blocks",
        "% of ceiling": _f(r["bulk_pct"], ".0f"), "% of line": _f(r["pct_line"], ".0f"), "status": status(r)}
        for _, r in top.iterrows()])


def verdict(exposed_ms: float, t_ms: float) -> str:
    """How much of the transfer the first token still waits for."""
    if pd.isna(exposed_ms) or pd.isna(t_ms) or t_ms <= 0:
        return "-"
    share = exposed_ms / t_ms
    return ("hidden: the first token waits for under a quarter of the transfer" if share < 0.25 else
            "partly hidden" if share < 0.75 else "exposed: the first token waits for most of the transfer")


def exposed_per_model(ex: pd.DataFrame) -> pd.DataFrame:
    """Per run, model and prompt length: the candidate path (no in-process copy) with the least exposed time (p50),
    against its transfer time."""
    d = ex[ex["exposed_ms"].notna()]
    cand = d[~d["transport"].isin(IN_PROCESS)]
    d = cand if len(cand) else d  # only in-process rows: shown, each named a reference below
    if d.empty:
        return pd.DataFrame()
    top = d.loc[d.groupby(["run", "model", "tokens"], sort=False)["exposed_ms"].idxmin()]
    return pd.DataFrame([{
        "run": r["run"], "model": r["model"], "tokens": r["tokens"],
        "best path": f"{r['transport']} {r['op']} {r['overlap']}" + (" (reference)" * (r["transport"] in IN_PROCESS)), "exposed p50 (ms)": _f(r["exposed_ms"], ".2f"),
        "n": samples(r), "transfer T (ms)": _f(r["T_ms"], ".2f"), "prefill P (ms)": _f(r["prefill_s"] * 1e3, ".2f"),
        "model (ms)": _f(r["model_ms"], ".2f"), "verdict": verdict(r["exposed_ms"], r["T_ms"])}
        for _, r in top.iterrows()])


def machine_line(meta: dict) -> str:
    """The machine in one line: hosts, CPU, GPUs, NICs with speeds, RDMA."""
    s = meta.get("system") or {}
    speeds = s.get("nic_speed_mbps") or {}
    nics = ", ".join(f"{n} {speeds[n]} Mb/s" for n in s.get("nics", []) if speeds.get(n)) or "no NIC speed recorded"
    hosts = ", ".join(dict.fromkeys(meta.get("hosts") or [s.get("hostname", "?")]))
    return (f"{hosts}: {meta.get('world_size', '?')} ranks; {s.get('cpu_model', '?')}, {s.get('cpus', '?')} cores; "
            f"GPUs: {', '.join(s.get('gpus') or []) or 'none'}; NICs: {nics}; "
            f"RDMA: {', '.join(s.get('rdma_devices') or []) or 'none'}")


def carried_by(runs) -> pd.DataFrame:
    """Per run, path (transport, memory), expected path and carrier: what carried the bytes, from the sidecar's
    paths (schema 9, harness/pathcheck.py; older runs have none), FALLBACK first."""
    rows: dict = {}
    for r in runs:
        keys = r.st.drop_duplicates("case").set_index("case")[["transport", "memory"]] if len(r.st) else None
        for case, ranks in (r.meta.get("paths") or {}).items():
            if keys is None or int(case) not in keys.index:
                continue
            transport, memory = keys.loc[int(case)]
            for p in ranks.values():
                k = (r.name, transport, memory, p["expected"], p["carried"])
                got = rows.setdefault(k, {"cases": set(), "verdict": "OK"})
                got["cases"].add(int(case))
                got["verdict"] = "FALLBACK" if "FALLBACK" in (got["verdict"], p["verdict"]) else p["verdict"]
    out = pd.DataFrame([{"run": k[0], "path": f"{k[1]} {k[2]}", "expected": k[3], "carried by": k[4],
                         "cases": len(v["cases"]), "verdict": v["verdict"]} for k, v in rows.items()])
    return out.sort_values("verdict", key=lambda v: v != "FALLBACK", kind="stable") if len(out) else out


def _one_run(table: pd.DataFrame) -> pd.DataFrame:
    """With one run, its name is said once (in the machine line's run list), not on every row."""
    return table.drop(columns=["run"]) if len(table) and table["run"].nunique() == 1 else table


def sweeps(runs) -> list:
    """Per machine, the run whose paged sweep the first screen decides on: the one with the most paged bandwidth
    rows (`make procurement`'s bandwidth file; the others' rows are in the sections below)."""
    best: dict = {}
    for r in runs:
        n = int(((r.st["kind"] == "bandwidth") & (r.st["variant"] == "paged") & (r.st["status"] == "ok")).sum())
        key = machine_line(r.meta)
        if n and n > best.get(key, (0, None))[0]:
            best[key] = (n, r)
    return [r for _, r in best.values()]


def decision(runs, st: pd.DataFrame) -> tuple[list[str], list[tuple[str, pd.DataFrame]]]:
    """The purchase verdict per path and model (the plan's, verdicts.py) and the typical paged GB/s per path, of each
    machine's sweep: the lines to say and the two tables."""
    from .typical import by_path, typical_paged
    from .verdicts import PROCUREMENT
    from .verdicttable import page_verdicts

    text, tables = [], []
    for r in sweeps(runs):
        paged = st[(st["run"] == r.label) & (st["kind"] == "bandwidth") & (st["variant"] == "paged")]
        verdicts, notes = page_verdicts(r.path, list(dict.fromkeys(paged["model"])), list(dict.fromkeys(paged["dtype"])))
        p = PROCUREMENT
        text.append(f"Purchase verdict on the paths of {r.name}, the plan's as make procurement asks it (prompts "
                    f"{p['prompt_desc'].removeprefix('percentiles ')}; prefill {p['prefill_tflops']:g} TFLOP/s; TTFT "
                    f"{p['ttft_ms']:g} ms; {p['rate']:g} req/s; {100 * p['saving']:g}% of prefill saved; "
                    f"{p['overlap']}): net/saved ms at the deciding prompt and dtype (net = saved - exposed).")
        if len(verdicts):
            tables.append((" ".join(["purchase verdict per path and model (PAYS / MARGINAL / DOES NOT PAY).", *notes]),
                           verdicts))
        else:
            text += notes
        typical = typical_paged(paged)
        if len(typical):
            tables.append(("typical paged GB/s per path: the median of its paged rows (never the best), the 95% "
                           "interval of that median, n rows", _one_run(by_path(typical))))
    return text, tables


def add_section(page, runs) -> None:
    """The summary, made the page's lead (rendered first, before the machines and the contents): what failed, what
    carried the bytes, the purchase verdict, the typical GB/s, then exposed time per model."""
    st = pd.concat([r.st.assign(suspect=r.st["suspect"] if "suspect" in r.st else
                                r.st["case"].isin(suspect_cases(r.meta)),
                                noisy_case=r.st["case"].isin(suspect_cases(r.meta, "noisy"))) for r in runs],
                   ignore_index=True)
    st = st[st["status"] != "skipped"]
    good = ~untrusted(st, st["suspect"])  # no exposed-time verdict on wrong bytes or a time beyond physics
    ex = exposed_per_model(st[(st["kind"] == "exposed") & good])
    machines = list(dict.fromkeys(machine_line(r.meta) for r in runs))
    text = [f"NOT OK: {r.name} ended {r.status}: {r.meta.get('reason') or 'no reason recorded'}. Its wrong and "
            "SUSPECT cases are marked below; the plan draws no verdict from them." for r in runs if r.status]
    names = ", ".join(r.label for r in runs) if len(runs) <= 3 else f"{len(runs)} (under Runs below)"
    text.append(f"Machine{'s' * (len(machines) > 1)}: " + " | ".join(machines) + f". Runs: {names}.")
    tables = []
    carried = carried_by(runs)  # before bandwidth: a rate of another path than the one meant is not that path's
    if len(carried):
        text.append("What carried the bytes, per path: each engine's own words checked against its process's own "
                    "sockets (carrier_proto), against the path each case was meant to measure (--expect); FALLBACK "
                    "= another path carried them, its rates are that path's.")
        tables.append(("what carried the bytes", _one_run(carried)))
    said, decided = decision(runs, st)
    text += said
    tables += decided
    if len(ex):
        tables.append(("exposed time per model: the candidate path (no in-process copy) whose first token waits "
                       "least for its KV after prefill, against its transfer time T alone", _one_run(ex)))
    s = page.add_section("Summary", text, tables=tables)
    s.lead = True
