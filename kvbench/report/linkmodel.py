"""The fitted link model: per path, t = L·γ + n·α + bytes/β from a sweep's per-case p50 times.

γ is a cost per layer (a post, a wait, a notification), α a cost per descriptor (an iovec, a work
request, a datatype entry), β the path's bandwidth.  The fit is least squares on each case's
relative error (a 30 ms case and a 300 µs case count alike), with every coefficient >= 0.  It reads
case statistics only: nothing here imports the harness or a transport.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench.model import layers as L
from kvbench.model import shapes as M

# what makes two rows the same path: the link, the direction and everything that changes its costs; "kind"
# keeps the paged rows apart from the references (bulk, chunks), which transports often move another way
# (mpi: a layer of at most -O split descriptors as contiguous Puts, more as one hindexed datatype)
PATH_KEYS = ["transport", "op", "memory", "scheme", "world_size", "inflight", "codec", "pages", "cache", "kind"]
TERMS = ("gamma", "alpha", "beta")  # per layer, per descriptor, bandwidth


@dataclass
class LinkFit:
    """One path's fitted costs; ``predict`` gives seconds for any layer count, descriptor count and bytes."""

    path: dict
    gamma_s: float  # seconds per layer
    alpha_s: float  # seconds per descriptor
    beta_bps: float  # bytes per second (inf: no bandwidth term fitted)
    points: int
    r2: float = math.nan
    rms_rel: float = math.nan  # root mean square of (predicted - measured) / measured over the fitted points
    max_rel: float = math.nan
    notes: list[str] = field(default_factory=list)
    separable: bool = True  # False: the sweep could not tell all three terms apart (see notes)

    def predict(self, layers, descriptors, nbytes):
        """Seconds for a request of ``layers`` layers, ``descriptors`` descriptors and ``nbytes`` bytes."""
        inv_beta = 0.0 if math.isinf(self.beta_bps) else 1.0 / self.beta_bps
        return (np.asarray(layers, float) * self.gamma_s + np.asarray(descriptors, float) * self.alpha_s
                + np.asarray(nbytes, float) * inv_beta)

    def label(self) -> str:
        p = self.path
        cache = p.get("cache")  # a fit of rows that began with their bytes warm or flushed says so
        extra = f" cache {cache}" if isinstance(cache, str) and cache != "as-is" else ""
        return f"{p.get('transport')} {p.get('op')} {p.get('memory')} {p.get('kind', '')}".strip() + extra

    def summary(self) -> str:
        """One line: the three costs with units and the fit quality."""
        beta = "inf" if math.isinf(self.beta_bps) else f"{self.beta_bps / 1e9:.3f}"
        return (f"{self.label():<26} γ = {self.gamma_s * 1e6:8.2f} us/layer   α = {self.alpha_s * 1e6:7.3f} "
                f"us/descriptor   β = {beta:>7} GB/s   points {self.points:3d}   R² {self.r2:.4f}   "
                f"rms err {100 * self.rms_rel:.1f}%   max {100 * self.max_rel:.1f}%"
                + (f"   ({'; '.join(self.notes)})" if self.notes else ""))


def fit_points(layers, descriptors, nbytes, seconds, path: dict | None = None) -> LinkFit:
    """Least squares of relative error with γ, α, β >= 0 (the best of the non-negative subsets of terms).

    A term the sweep cannot separate from another (e.g. one prompt length and one layer count, so
    L and bytes are constant together) is left out and named in ``notes``.
    """
    L, n, b, t = (np.asarray(x, float) for x in (layers, descriptors, nbytes, seconds))
    if len(t) < 2:
        raise ValueError(f"the link model needs at least 2 measured cases of a path, got {len(t)}")
    X = np.column_stack([L, n, b]) / t[:, None]  # each row divided by its time: errors are relative
    y = np.ones_like(t)
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    notes = []
    separable = bool(np.linalg.matrix_rank(Xs, tol=1e-9) == 3)
    if not separable:
        notes.append("the sweep does not separate all three terms: vary prompt length and layer count")
    best = None
    for k in (3, 2, 1):
        for cols in itertools.combinations(range(3), k):
            sub = Xs[:, cols]
            if np.linalg.matrix_rank(sub, tol=1e-9) < k:
                continue
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if (coef < 0).any():
                continue
            loss = float(np.sum((sub @ coef - y) ** 2))
            if best is None or loss < best[0] - 1e-15:
                best = (loss, cols, coef)
    if best is None:
        raise ValueError("no non-negative fit: the times do not grow with layers, descriptors or bytes")
    full = np.zeros(3)
    for c, v in zip(best[1], best[2]):
        full[c] = v / scale[c]
    dropped = [TERMS[i] for i in range(3) if i not in best[1]]
    if dropped:
        notes.append(f"{', '.join(dropped)} fitted as 0")
    fit = LinkFit(path or {}, gamma_s=full[0], alpha_s=full[1], beta_bps=(1 / full[2]) if full[2] > 0 else math.inf,
                  points=len(t), notes=notes, separable=separable)
    pred = fit.predict(L, n, b)
    rel = (pred - t) / t
    fit.rms_rel, fit.max_rel = float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel)))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    fit.r2 = 1 - float(np.sum((pred - t) ** 2)) / ss_tot if ss_tot > 0 else math.nan
    return fit


def usable(st: pd.DataFrame) -> pd.DataFrame:
    """Cases a link model can use: measured single requests sent after prefill, not cache-resident (hot)."""
    ok = st[(st["status"] == "ok") & st["p50"].notna() & st["layers"].notna() & (st["variant"] != "hot")]
    ok = ok[(ok["workload"].fillna("none") == "none") & (ok["overlap"].fillna("serial") == "serial")
            & (ok["prefill_s"].fillna(0) == 0) & (ok["handshake"].fillna("off") == "off")].copy()
    ok["kind"] = np.where(ok["variant"] == "paged", "paged", "reference")
    return ok


def fit_cases(st: pd.DataFrame, leave_out: set[int] = frozenset()) -> tuple[list[LinkFit], pd.DataFrame]:
    """Fit every path of a summarized result set; paged cases whose block size is in ``leave_out`` are
    not fitted but predicted.  Returns the fits and every usable case with ``pred_s``, ``err_pct``, ``used``."""
    rows = usable(st).copy()
    if rows.empty:
        raise ValueError("no usable cases: the link model needs measured single-request rows sent after prefill "
                         "(serial, no prefill clock, no workload) with their layer count (schema 2)")
    rows["used"] = ~((rows["variant"] == "paged") & rows["block_size"].isin(leave_out))
    fits, parts = [], []
    for key, g in rows.groupby([k for k in PATH_KEYS if k in rows], dropna=False, sort=False):
        path = dict(zip([k for k in PATH_KEYS if k in rows], key if isinstance(key, tuple) else (key,)))
        train = g[g["used"]]
        try:
            fit = fit_points(train["layers"], train["descriptors"], train["payload_bytes"], train["p50"], path)
        except ValueError as exc:
            fit = LinkFit(path, math.nan, math.nan, math.nan, len(train), notes=[str(exc)], separable=False)
        g = g.copy()
        g["pred_s"] = fit.predict(g["layers"], g["descriptors"], g["payload_bytes"])
        g["err_pct"] = 100 * (g["pred_s"] - g["p50"]) / g["p50"]
        fits.append(fit)
        parts.append(g)
    return fits, pd.concat(parts)


def predict_request(fit: LinkFit, shape: M.ModelShape, tokens: int, block_size: int, dtype: str) -> dict:
    """The model's time for one request of ``shape`` in ``block_size``-token blocks, one descriptor per block."""
    n = L.descriptors(shape, tokens, block_size)
    nbytes = M.request_bytes(shape, dtype, tokens)
    s = float(fit.predict(shape.layers, n, nbytes))
    return {"layers": shape.layers, "descriptors": n, "bytes": nbytes, "seconds": s, "gbps": nbytes / s / 1e9}


def lines(fits: list[LinkFit], cases: pd.DataFrame, leave_out: set[int] = frozenset()) -> list[str]:
    """The fit section: one line per path, then predicted against measured per case."""
    out = ["# link model per path: t = L·γ + n·α + bytes/β (L layers, n descriptors per request); least squares of",
           "# each case's relative error on its p50, every term >= 0; GB/s = 10^9 B/s"]
    if leave_out:
        out.append(f"# held out: paged cases with block size {', '.join(map(str, sorted(leave_out)))} tokens are "
                   "not fitted, only predicted")
    out += ["#   " + f.summary() for f in fits]
    cols = (f"#{'transport':>9} {'op':>4} {'variant':>8} {'model':>12} {'tokens':>6} {'L':>3} {'blk(tok)':>8} "
            f"{'descs':>7} {'payload(B)':>11} {'p50(us)':>9} {'pred(us)':>9} {'err%':>6}  fit")
    out += ["#", cols]
    for _, r in cases.iterrows():
        blk = f"{int(r['block_size'])}" if r["variant"] == "paged" else "-"
        out.append(f"{r['transport']:>10} {r['op']:>4} {r['variant']:>8} {r['model']:>12} {int(r['tokens']):>6} "
                   f"{int(r['layers']):>3} {blk:>8} {int(r['descriptors']):>7} {int(r['payload_bytes']):>11} "
                   f"{r['p50'] * 1e6:>9.1f} {r['pred_s'] * 1e6:>9.1f} {r['err_pct']:>+6.1f}  "
                   f"{'fitted' if r['used'] else 'HELD OUT'}")
    held = cases[~cases["used"]]
    if len(held):
        for key, g in held.groupby("transport", sort=False):
            worst = g["err_pct"].abs().max()
            out.append(f"# held out, {key}: {len(g)} cases, worst |err| {worst:.1f}%, mean |err| "
                       f"{g['err_pct'].abs().mean():.1f}%")
    return out
