"""Codec rows from result files: ratio, encode/decode/wire/effective GB/s, and the link rate at which each pays.

Reads result files only (nothing here imports the harness or a transport).  Per (transport, codec,
case keys) of the paged rows, over the timed iterations of one run:

    P  payload bytes of a request, W wire bytes (the frames), r = P / W
    T  the pair's time per iteration (max over its ranks: until the decoded bytes are in the
       destination pool), p50; effective GB/s = P / T; wire GB/s = W / T
    E  encode GB/s = P / the source's seconds encoding (p50), D = P / the destination's seconds
       decoding and scattering (p50); measured in the same iterations, on the same data
    B  the path's rate for the pool's bytes as they are: the effective GB/s of codec none in the
       same run and case (its frames are the raw bytes)

The models (docs/codecs.md):
    serial     t = P/E + W/B + P/D                       break-even B* = (1 - 1/r) / (1/E + 1/D)
    pipelined  t = max(max(P/E, W/B, P/D) + (P/L)(1/E + 1/D),  (P/E + P/D + 2 W/H) / C)
               per layer the slowest stage plus filling and draining one layer of the other two; but the
               stages share the host's C cores, and moving W bytes through the host costs two cores for
               W/H (H: the same transport's rate between two ranks of this host, where the copy is CPU
               work: its none row on a same-host path); B* solves P/B = t(B)
The predicted effective GB/s is P / t at the measured B with the pipelined model (codecs/path.py runs
encode, wire and decode in threads of their own, layer by layer).  The prediction against none: "win"
when even the serial model beats B, "lose" when even the pipelined one does not, "overlap" between the
two (B between the two break-evens: how well the stages overlap on this machine decides); the
pipelined model's own call is printed beside it.  A measured or predicted difference from none within
the two rows' spreads (interquartile range of the per-round medians) counts as a tie, which agrees with
anything.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

KEYS = ["transport", "op", "model", "tokens", "dtype", "block_size", "alloc", "layers"]


def predicted(P: float, W: float, E: float, D: float, B: float, L: int, model: str = "pipelined",
              H: float = math.inf, C: int = 1 << 30) -> float:
    """Effective GB/s the model predicts for a codec at link rate B (all rates in the same unit)."""
    if model == "serial":
        return P / (P / E + W / B + P / D)
    stages = max(P / E, W / B, P / D) + (P / L) * (1 / E + 1 / D)
    return P / max(stages, (P / E + P / D + 2 * W / H) / C)


def break_even(P: float, W: float, E: float, D: float, L: int, model: str = "pipelined", H: float = math.inf,
               C: int = 1 << 30, same_host: bool = False) -> float:
    """The link rate below which the codec beats none (0 when it never does).  On a same-host path the
    link is the host's copy itself (H = B)."""
    if W >= P:
        return 0.0
    if model == "serial":
        return (1 - W / P) / (1 / E + 1 / D)

    def gain(B):
        return predicted(P, W, E, D, B, L, "pipelined", B if same_host else H, C) - B

    lo, hi = 1e-9, 1e9  # gain is positive for small B and negative for large: bisect (log space)
    if gain(lo) <= 0:
        return 0.0
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if gain(mid) > 0:
            lo = mid
        else:
            hi = mid
    return lo


def _spread(g: pd.DataFrame) -> float:
    """Relative IQR of per-round medians of the pair time (0 with one round)."""
    per = g.groupby("round")["t"].median()
    if len(per) < 2:
        return 0.0
    q1, q3 = np.percentile(per, [25, 75])
    return float((q3 - q1) / per.median())


def codec_rows(df: pd.DataFrame, cores: int, host_rate: dict | None = None) -> pd.DataFrame:
    """One row per (case keys, codec) of the paged rows: the quantities above.  ``cores``: the host's CPUs;
    ``host_rate``: per transport, H in GB/s when this run's path is not between two ranks of one host
    (a shaped link: H is the same transport's none rate on this host's loopback); absent: same host, H = B."""
    df = df[(df.status == "ok") & (df.variant == "paged")].copy()
    if "allocation" in df:
        df["alloc"] = df["allocation"]
    timed = df[df.iter >= 0]
    pair = timed.groupby(KEYS + ["codec", "case", "pair", "req", "iter"]).agg(
        t=("seconds", "max"), round=("round", "first"), P=("payload_bytes", "max"), W=("wire_bytes", "max"),
        enc=("codec_encode_s", "max"), dec=("codec_decode_s", "max")).reset_index()
    out = []
    for key, g in pair.groupby(KEYS + ["codec"]):
        row = dict(zip(KEYS + ["codec"], key))
        P, W, T = float(g.P.median()), float(g.W.median()), float(g.t.median())
        checks = df[df.nwrong.notna() & (df.codec == row["codec"])]  # the check pass and, under -c all, every iteration
        for k in KEYS:
            checks = checks[checks[k] == row[k]]
        row.update(P=P, W=W, ratio=P / W, T=T, eff=P / T / 1e9, wire=W / T / 1e9, spread=_spread(g),
                   enc=P / g.enc.median() / 1e9 if g.enc.median() > 0 else math.nan,
                   dec=P / g.dec.median() / 1e9 if g.dec.median() > 0 else math.nan,
                   nwrong=int(checks.nwrong.fillna(0).sum()) if len(checks) else -1,
                   max_rel=float(checks["codec_max_rel_err"].max()) if "codec_max_rel_err" in checks and len(checks)
                   else math.nan)
        out.append(row)
    rows = pd.DataFrame(out)
    if rows.empty:
        return rows
    base = rows[rows.codec == "none"].set_index(KEYS)
    for i, r in rows.iterrows():
        k = tuple(r[c] for c in KEYS)
        if k not in base.index:
            continue
        b = base.loc[k]
        B, L = float(b["eff"]), int(r["layers"])
        rows.loc[i, "B"] = B
        rows.loc[i, "none_spread"] = float(b["spread"])
        if r.codec == "none":
            rows.loc[i, ["pred", "be_serial", "be_pipe"]] = [B, math.nan, math.nan]
            continue
        P, W, E, D = r.P / 1e9, r.W / 1e9, r.enc, r.dec
        same = not host_rate or r.transport not in host_rate
        H = B if same else host_rate[r.transport]
        rows.loc[i, "H"] = H
        rows.loc[i, "pred"] = predicted(P, W, E, D, B, L, "pipelined", H, cores)
        rows.loc[i, "pred_serial"] = predicted(P, W, E, D, B, L, "serial")
        rows.loc[i, "be_serial"] = break_even(P, W, E, D, L, "serial")
        rows.loc[i, "be_pipe"] = break_even(P, W, E, D, L, "pipelined", H, cores, same)
    return rows


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """Per codec row: measured and predicted winner against none (win / lose / tie), and whether they agree."""
    rows = rows.copy()
    for i, r in rows.iterrows():
        if r.codec == "none" or pd.isna(r.get("B")):
            continue
        tol = max(r.spread, r.none_spread) + 0.0
        rel = r.eff / r.B - 1
        measured = "tie" if abs(rel) <= tol else ("win" if rel > 0 else "lose")
        # the two models bound the prediction: a codec that wins without overlap wins; one that loses even
        # perfectly pipelined loses; between them (serial B* < B < pipelined B*) the overlap decides
        if r.pred_serial > r.B * (1 + tol):
            pred = "win"
        elif r.pred < r.B * (1 - tol):
            pred = "lose"
        elif abs(r.pred / r.B - 1) <= tol:
            pred = "tie"
        else:
            pred = "overlap"
        rows.loc[i, "measured"] = measured
        rows.loc[i, "predicted"] = pred
        rows.loc[i, "agree"] = "tie" in (measured, pred) or measured == pred or pred == "overlap"
        # the pipelined model's own call (what codecs/path.py aims at), and whether the measurement bore it out
        pipe = "win" if r.pred > r.B * (1 + tol) else ("lose" if r.pred < r.B * (1 - tol) else "tie")
        rows.loc[i, "pipelined"] = pipe
        rows.loc[i, "pipe_agree"] = "tie" in (measured, pipe) or measured == pipe
    return rows


COLS = [("path", "{}", 12), ("codec", "{}", 13), ("payload(B)", "{:,.0f}", 12), ("wire(B)", "{:,.0f}", 12),
        ("ratio", "{:.3f}", 6), ("enc GB/s", "{:.3f}", 8), ("dec GB/s", "{:.3f}", 8), ("wire GB/s", "{:.3f}", 9),
        ("eff GB/s", "{:.4f}", 8), ("±%", "{:.0f}", 4), ("pred GB/s", "{:.4f}", 9), ("serial", "{:.4f}", 7),
        ("B* serial", "{:.3f}", 9), ("B* pipe", "{:.3f}", 8), ("measured", "{}", 8), ("predicted", "{}", 9),
        ("agree", "{}", 5), ("pipelined", "{}", 9), ("agree", "{}", 5), ("#wrong", "{}", 6)]


def _cells(r, path_names: dict | None = None) -> list[str]:
    """One codec row's values in COLS order, formatted ('-' where there is none)."""
    vals2 = {"pipelined": r.get("pipelined", "-"), "agree2": r.get("pipe_agree", "-")}
    vals = {"path": (path_names or {}).get(r.transport, r.transport), "codec": r.codec, "payload(B)": r.P,
            "wire(B)": r.W, "ratio": r.ratio, "enc GB/s": r.enc, "dec GB/s": r.dec, "wire GB/s": r.wire,
            "eff GB/s": r.eff, "±%": 100 * r.spread, "pred GB/s": r.get("pred"), "serial": r.get("pred_serial"),
            "B* serial": r.get("be_serial"), "B* pipe": r.get("be_pipe"), "measured": r.get("measured", "-"),
            "predicted": r.get("predicted", "-"), "agree": r.get("agree", "-"), "#wrong": r.nwrong}
    cells = []
    seen = set()
    for h, fmt, _ in COLS:
        v = vals2["agree2"] if (h == "agree" and h in seen) else vals2.get(h, vals.get(h))
        seen.add(h)
        cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
    return cells


def table(rows: pd.DataFrame, path_names: dict | None = None) -> list[str]:
    """The printed table: one line per path and codec (GB = 10^9 B)."""
    lines = ["#" + " ".join(f"{h:>{w}}" for h, _, w in COLS)]
    for _, r in rows.iterrows():
        lines.append(" " + " ".join(f"{c:>{w}}" for c, (_, _, w) in zip(_cells(r, path_names), COLS)))
    return lines


def add_section(page, runs) -> None:
    """The report page's codec section (report/build.py): per run with codec rows, each codec against none on
    the same path and case; nothing is added when no run has a measured codec other than none."""
    shown = []
    for run in runs:
        df = run.df
        if "codec" not in df or not ((df["codec"].fillna("none") != "none") & (df["status"] == "ok")).any():
            continue
        cores = int((run.meta.get("system") or {}).get("cpus") or 0) or (1 << 30)  # unknown: no core limit
        rows = verdicts(codec_rows(df, cores))
        if rows.empty:
            continue
        heads = ["transport" if h == "path" else h for h, _, _ in COLS]
        heads[len(heads) - 1 - heads[::-1].index("agree")] = "pipelined agrees"
        t = pd.DataFrame([_cells(r) for _, r in rows.iterrows()], columns=heads)
        t.insert(0, "run", run.label)
        shown.append(t)
    if not shown:
        return
    page.add_section("Codecs", [
        "Each codec against none on the same path and case, paged rows (docs/codecs.md). ratio = payload / wire "
        "bytes; eff GB/s = payload / p50 time until the decoded bytes are in the destination pool; enc and dec GB/s "
        "= payload / the source's encode or the destination's decode seconds (p50); ±% = interquartile range of the "
        "per-round medians. pred = the pipelined model at the measured B (none's eff GB/s), with C = the machine's "
        "CPUs and the host's copy rate taken as B (both ranks on one host), serial = the serial model; B* = the "
        "link rates (GB/s) below which the codec beats none, serial and pipelined. measured, predicted and "
        "pipelined: win, lose or tie against none (tie: within the two rows' spreads)."],
        tables=[("codec rows", pd.concat(shown, ignore_index=True))])
