"""The selftest's verdicts and its table: rates and exposed times judged against the link, from kvbench's results.

Pure parts (unit-tested): the bands a measurement must fall in, what a
results table says about one transport, and how the rows are printed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

BLOCK = 256  # tokens per block of the streaming row (contiguous + coalesced: it runs at the bulk ceiling)
TARGET_S = 1.0  # a bulk transfer lasts about this long at the shaped rate
RATE_BAND_IPERF = (0.90, 1.05)
RATE_BAND_SHAPED = (0.85, 1.05)
EXPOSED_TOL = (0.20, 0.002)  # the streaming row passes within max(20% of T/L, 2 ms) of the model


@dataclass
class RateVerdict:
    ok: bool
    ratio: float  # measured / basis
    basis: str  # "iperf3" or "shaped"
    lo: float
    hi: float


def judge_rate(measured_bytes_s: float, shaped_bits: float, iperf_bits: float | None = None) -> RateVerdict:
    """kvbench's bulk rate against iperf3 on the same link (0.90-1.05), or the shaped rate without it (0.85-1.05)."""
    bits = measured_bytes_s * 8
    if iperf_bits:
        (lo, hi), basis, ref = RATE_BAND_IPERF, "iperf3", iperf_bits
    else:
        (lo, hi), basis, ref = RATE_BAND_SHAPED, "shaped", shaped_bits
    ratio = bits / ref if ref > 0 else math.nan
    return RateVerdict(bool(lo <= ratio <= hi), ratio, basis, lo, hi)


@dataclass
class ExposedVerdict:
    ok: bool
    model_s: float
    diff_s: float
    tol_s: float


def exposed_model(t_s: float, p_s: float, layers: int) -> float:
    """The seeds' model of streaming exposed time: max(0, T - P) + T/L."""
    return max(0.0, t_s - p_s) + t_s / layers


def judge_exposed(exposed_s: float, t_s: float, p_s: float, layers: int) -> ExposedVerdict:
    """Within max(20% of T/L, 2 ms) of the model."""
    model = exposed_model(t_s, p_s, layers)
    tol = max(EXPOSED_TOL[0] * t_s / layers, EXPOSED_TOL[1])
    diff = exposed_s - model
    return ExposedVerdict(bool(abs(diff) <= tol), model, diff, tol)


def choose_tokens(rate_bits: float, bytes_per_token: int, seconds: float = TARGET_S, block: int = BLOCK) -> int:
    """Prompt tokens (a multiple of ``block``) whose KV takes about ``seconds`` at the shaped rate."""
    want = rate_bits / 8 * seconds / bytes_per_token
    return max(block, math.ceil(want / block) * block)


def results_path(output: str) -> str | None:
    """The parquet file kvbench names on its ``# results:`` line."""
    for ln in output.splitlines():
        if ln.startswith("# results:"):
            return ln.split(":", 1)[1].strip()
    return None


def bulk_rate(df, transport: str) -> tuple[float, float]:
    """(bytes/s, seconds): payload / the median over timed iterations of the pair's slower rank (kvbench's GB/s)."""
    d = df[(df["transport"] == transport) & (df["variant"] == "bulk") & (df["iter"] >= 0) & (df["status"] == "ok")]
    if d.empty:
        raise ValueError(f"no timed bulk rows for {transport}")
    sec = float(d.groupby("iter")["seconds"].max().median())
    return float(d["payload_bytes"].iloc[0]) / sec, sec


def exposed_median(df, transport: str) -> tuple[float, int, int]:
    """(median exposed_s over the decode rank's timed iterations, layers, iterations)."""
    d = df[(df["transport"] == transport) & (df["role"] == "decode") & (df["iter"] >= 0) & (df["status"] == "ok")]
    if d.empty:
        raise ValueError(f"no timed decode rows for {transport}")
    return float(d["exposed_s"].median()), int(d["layers"].iloc[0]), len(d)


def transfers(df, transport: str, warmup: int) -> int:
    """Transfers of the request in a launch: warm-up + timed iterations + check passes (iter -1)."""
    d = df[(df["transport"] == transport) & (df["role"] == "decode")]
    return warmup + int((d["iter"] >= 0).sum()) + int((d["iter"] == -1).sum())


@dataclass
class Row:
    kind: str
    transport: str
    ok: bool
    cells: dict = field(default_factory=dict)
    note: str = ""


BULK_COLS = [("xfers", "{:d}", 5), ("crossed(MB)", "{:.1f}", 11), ("wire/pay", "{:.3f}", 8), ("GB/s", "{:.4f}", 7),
             ("Gbit/s", "{:.3f}", 7), ("/shaped", "{:.3f}", 7), ("/iperf3", "{:.3f}", 7), ("want", "{}", 18)]
STREAM_COLS = [("xfers", "{:d}", 5), ("crossed(MB)", "{:.1f}", 11), ("L", "{:d}", 3), ("P(ms)", "{:.1f}", 8),
               ("T(ms)", "{:.1f}", 8), ("exp p50(ms)", "{:.2f}", 11), ("model(ms)", "{:.2f}", 9),
               ("diff(ms)", "{:+.2f}", 8), ("tol(ms)", "{:.2f}", 7)]


def _cell(v, fmt: str, width: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{fmt.format(v):>{width}}"


def print_tables(rows: list[Row]) -> None:
    for kind, cols, what in (("bulk", BULK_COLS, "bulk rate: GB/s = payload / p50 time; /shaped and /iperf3 in bits"),
                             ("streaming", STREAM_COLS, "streaming: exposed = prefill end -> decode knows the last "
                              "byte (median); model = max(0, T-P) + T/L, T = payload / this transport's bulk GB/s")):
        mine = [r for r in rows if r.kind == kind]
        if not mine:
            continue
        print(f"# {what}")
        print(f"#{'row':>9} {'transport':>9} " + " ".join(f"{c:>{w}}" for c, _, w in cols) + "  verdict")
        for r in mine:
            print(f" {r.kind:>9} {r.transport:>9} " + " ".join(_cell(r.cells.get(c), f, w) for c, f, w in cols)
                  + f"  {'PASS' if r.ok else 'FAIL'}")
            for ln in r.note.splitlines():
                print(f"#   {r.transport}: {ln}" if not ln.startswith("#") else ln)
