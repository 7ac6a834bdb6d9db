"""The report's trace section: each workload case that replayed a request trace (`kvbench run --trace`) with its
decode prefix-cache hit rates, the tokens that moved after the clips, and its exposed and queue tails with n."""
from __future__ import annotations

import os

import pandas as pd

TEXT = ("Workload cases that replayed a request trace: its requests arrive at its timestamps divided by the speed; "
        "each request's prefix hit is its longest run of leading blocks already in the decode prefix cache (hit % "
        "over the replayed requests: blocks, and tokens, min(hit blocks x block, prompt)), and only the rest of its "
        "prompt moves. cut = prompts cut to the model's context / requests cut to the decode pool / requests hit in "
        "full that still move one token. Tails over the admitted requests (their n); a percentile they "
        "cannot hold is '-' (p99 needs 100).")


def _ms(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{x:.2f}"


def trace_table(runs) -> pd.DataFrame:
    """One row per replayed workload case of ``runs`` (report.stats.Run); empty when none replayed a trace."""
    rows = []
    for r in runs:
        load = r.meta.get("load") or {}
        for _, w in r.wl.iterrows():
            t = (load.get(str(w["case"])) or {}).get("trace")
            if not t:
                continue
            rows.append({
                "run": r.label, "transport": w["transport"], "op": w["op"], "model": w["model"], "trace": os.path.basename(t["trace"]),
                "speed": f"{t['speed']:g}x", "requests": t["requests"],
                "block hit %": f"{100 * t['block_hit_rate']:.2f}", "token hit %": f"{100 * t['token_hit_rate']:.2f}",
                "tokens moved": f"{t['moved_tokens']:,}",
                "cut (context/pool/full)": f"{t['cut_context']}/{t['cut_pool']}/{t['full_hits']}",
                "admitted": w["admitted"], "dropped": w["dropped"],
                "exposed p50/p99 (ms)": f"{_ms(w['exposed_p50_ms'])}/{_ms(w['exposed_p99_ms'])}",
                "queue p50/p99 (ms)": f"{_ms(w['queue_p50_ms'])}/{_ms(w['queue_p99_ms'])}"})
    return pd.DataFrame(rows)


def add_section(page, runs) -> None:
    """The trace section, when some run replayed a trace; nothing otherwise."""
    table = trace_table(runs)
    if len(table):
        page.add_section("Trace replay", [TEXT], tables=[("replayed workload cases", table)])
