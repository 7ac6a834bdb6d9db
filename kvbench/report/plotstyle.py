"""The report plots' shared style: panels (comparable ones on one y-scale), plain-number ticks, legends that stay in
the figure, the interval behind each GB/s point as its error bar, and a check that no two texts of a figure overlap."""
from __future__ import annotations

import numpy as np
import pandas as pd


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("kvbench report -o draws its plots with matplotlib: pip install 'kvbench[report]'") from None

    matplotlib.use("Agg")  # no display: a report is written, never shown
    import matplotlib.pyplot as plt

    return plt


def _panels(n: int, title: str, w: float = 5.2, h: float = 4.8, sharey: bool = False):
    """A figure of ``n`` panels, three to a line; ``sharey``: one y-scale for panels a reader compares."""
    plt = _plt()
    cols = min(n, 3)
    rows = -(-n // cols)
    # constrained: room for the legends below the panels, drawn once (bbox_inches="tight" draws twice)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False, layout="constrained",
                             sharey=sharey)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    if sharey:  # every panel keeps its own tick labels: a panel read alone still says its scale
        for ax in axes.flat[:n]:
            ax.yaxis.set_tick_params(labelleft=True)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes.flat[:n])


def floor_zero(axes) -> None:
    """Every panel from 0 to the top of the tallest (after the last line is drawn: a panel's own set_ylim would fix
    a shared scale before the later panels' data are in it)."""
    if axes:
        top = max(ax.get_ylim()[1] for ax in axes)
        for ax in axes:
            ax.set_ylim(0, top)


def _xticks(ax, values) -> None:
    """Ticks at the measured values, written as plain numbers (16, 64, 256, not 2^4)."""
    import matplotlib.ticker as mt

    vals = sorted(set(int(v) for v in values))
    ax.xaxis.set_major_locator(mt.FixedLocator(vals))
    ax.xaxis.set_major_formatter(mt.FixedFormatter([str(v) for v in vals]))
    ax.xaxis.set_minor_locator(mt.NullLocator())


def plain_log(ax, axes: str = "xy") -> None:
    """Log axes labelled 1, 2, 5, 10, 20... as plain numbers, no minor labels (2x10^0 3x10^0 ran into each other)."""
    from matplotlib import ticker

    for name in axes:
        axis = ax.xaxis if name == "x" else ax.yaxis
        axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(ticker.NullFormatter())


X_NAMES = {"block_size": "block size", "tokens": "prompt length", "rate_rps": "arrival rate (req/s)",
           "descriptors": "descriptor count", "age": "pool age"}
MAX_SERIES = 12  # legend entries a panel carries readably (more overlap below it and repeat colours)


def degenerate(g: pd.DataFrame, x: str, series: int) -> str | None:
    """Why a figure of these rows is not worth drawing (one x value, too many series for a legend), or None."""
    xs = g[x].dropna().unique()
    if len(xs) < 2:
        return (f"one {X_NAMES.get(x, x)} ({xs[0] if len(xs) else '-'}): a line needs two; the table has its numbers")
    if series > MAX_SERIES:
        return f"{series} series in one panel, more than a legend can carry; the table has every row"
    return None


def _n(d: pd.DataFrame, col: str = "samples") -> str:
    """'n=20' or 'n=20-40': the samples behind the points of ``d`` (an older reader's rows: nothing)."""
    n = d[col].dropna().astype(int) if col in d else pd.Series(dtype=int)
    if n.empty:
        return ""
    lo, hi = int(n.min()), int(n.max())
    return f"n={lo}" if lo == hi else f"n={lo}-{hi}"


def _legend(ax, ncol: int = 2) -> None:
    """Below the panel, so that no line is hidden behind it; the constrained layout makes room for it."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False,
              handlelength=3.5)


def _col(d: pd.DataFrame, name: str) -> np.ndarray:
    return d[name].to_numpy(dtype=float) if name in d else np.full(len(d), np.nan)


def gbps_err(d: pd.DataFrame) -> np.ndarray:
    """Per row its GB/s error bar as (below, above), in GB/s: the p50's 95% interval (p50_lo-p50_hi seconds, order
    statistics) turned into GB/s (GB/s x p50 / time, so a slower bound is the lower bar); a row without one (under 6
    samples) carries ± half the interquartile range of its per-round medians (spread_pct); neither: no bar (0)."""
    g, p50 = _col(d, "gbps"), _col(d, "p50")
    lo_s, hi_s, spread = _col(d, "p50_lo"), _col(d, "p50_hi"), _col(d, "spread_pct")
    with np.errstate(divide="ignore", invalid="ignore"):
        ci = np.isfinite(lo_s) & np.isfinite(hi_s) & (lo_s > 0) & (hi_s > 0)
        below = np.where(ci, g - g * p50 / hi_s, g * spread / 200)
        above = np.where(ci, g * p50 / lo_s - g, g * spread / 200)
    return np.nan_to_num(np.clip(np.vstack([below, above]), 0, None))


def err_kinds(d: pd.DataFrame) -> set[str]:
    """Which bars ``gbps_err`` drew for these rows: 'ci', 'spread', 'none'."""
    ci = np.isfinite(_col(d, "p50_lo")) & np.isfinite(_col(d, "p50_hi"))
    spread = ~ci & np.isfinite(_col(d, "spread_pct"))
    return {k for k, m in (("ci", ci), ("spread", spread), ("none", ~ci & ~spread)) if m.any()}


def err_note(d: pd.DataFrame) -> str:
    """The caption's words for the error bars of these rows (what each bar is, in GB/s)."""
    kinds = err_kinds(d)
    said = []
    if "ci" in kinds:
        said.append("the p50's 95% confidence interval (order statistics), as GB/s")
    if "spread" in kinds:
        said.append(("where a case has fewer than 6 samples (no interval), " if "ci" in kinds else "")
                    + "± half the interquartile range of its per-round median times, as GB/s")
    if "none" in kinds:
        said.append("no bar: neither an interval nor a per-round spread was measured")
    return "Error bars: " + "; ".join(said) + "."


def text_boxes(fig) -> list[tuple[str, object]]:
    """Every visible, non-empty text of a drawn figure (titles, labels, tick labels, legend entries, annotations)
    with its box in display pixels."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    texts = list(fig.texts) + [t for lg in fig.legends for t in lg.get_texts()]
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        box = ax.bbox  # a tick label of a tick beyond the view is kept by matplotlib but never drawn
        texts += [t for t in ax.xaxis.get_ticklabels(which="both")
                  if box.x0 - 1 <= sum(t.get_window_extent(r).intervalx) / 2 <= box.x1 + 1]
        texts += [t for t in ax.yaxis.get_ticklabels(which="both")
                  if box.y0 - 1 <= sum(t.get_window_extent(r).intervaly) / 2 <= box.y1 + 1]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    return [(t.get_text(), t.get_window_extent(r)) for t in texts if t.get_visible() and t.get_text().strip()]


def overlaps(fig, pad: float = 0.5) -> list[tuple[str, str]]:
    """Pairs of texts of ``fig`` whose boxes overlap (by more than ``pad`` pixels either way)."""
    boxes = text_boxes(fig)
    hits = []
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            if min(ba.x1, bb.x1) - max(ba.x0, bb.x0) > pad and min(ba.y1, bb.y1) - max(ba.y0, bb.y0) > pad:
                hits.append((a, b))
    return hits


def outside(fig, pad: float = 0.5) -> list[str]:
    """Texts of ``fig`` that reach beyond its edges (clipped when it is saved)."""
    w, h = fig.canvas.get_width_height()
    return [t for t, b in text_boxes(fig) if b.x0 < -pad or b.y0 < -pad or b.x1 > w + pad or b.y1 > h + pad]
