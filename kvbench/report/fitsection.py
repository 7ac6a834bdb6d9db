"""The link model's section of the report page: per path the fitted costs, then predicted against measured."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import linkmodel
from .plots import _plt

MIN_R2 = 0.5  # a fit explaining less than half the variance of its times predicts nothing worth plotting
MIN_BLOCK_SIZES = 3  # three unknowns (γ, α, β): a path needs at least three distinct paged shapes to be fitted


def add_section(page, runs) -> None:
    """Fit every run's paged bandwidth rows that sweep enough block sizes; nothing is added when none do."""
    fits, cases = [], []
    for r in runs:
        bw = r.st[(r.st["kind"] == "bandwidth") & (r.st["variant"] == "paged")]
        if bw.empty or bw.groupby(["transport", "op"])["block_size"].nunique().max() < MIN_BLOCK_SIZES:
            continue
        try:
            f, c = linkmodel.fit_cases(r.st.drop(columns=["run"]))
        except ValueError:
            continue
        paged = [x for x in f if x.path.get("kind") == "paged" and x.separable]
        fits += paged
        c = c[c["kind"] == "paged"].copy()
        c.insert(0, "run", r.label)
        c["r2"] = np.nan
        for x in paged:  # each case carries its path's R², so that a poor fit's points can be left off the plot
            same = np.logical_and.reduce([(c[k] == v) | (c[k].isna() & pd.isna(v)) for k, v in x.path.items()
                                          if k in c])
            c.loc[same, "r2"] = x.r2
        cases.append(c)
    if not fits:
        return
    cases = pd.concat(cases, ignore_index=True)
    fit_rows = pd.DataFrame([{
        "path": f.label(), "γ us/layer": round(f.gamma_s * 1e6, 2), "α us/descriptor": round(f.alpha_s * 1e6, 3),
        "β GB/s": round(f.beta_bps / 1e9, 3), "R²": round(f.r2, 4),
        "max |err| %": round(100 * f.max_rel, 1), "cases": f.points} for f in fits])
    shown = cases[["run", "transport", "op", "model", "tokens", "layers", "block_size", "descriptors",
                   "payload_bytes", "p50", "pred_s", "err_pct"]].copy()
    shown["p50"] = (shown["p50"] * 1e3).round(3)
    shown["pred_s"] = (shown["pred_s"] * 1e3).round(3)
    shown["err_pct"] = shown["err_pct"].round(1)
    shown = shown.rename(columns={"block_size": "blk(tok)", "payload_bytes": "payload (B)", "p50": "p50 ms",
                                  "pred_s": "predicted ms", "err_pct": "err %"})
    s = page.add_section("Link model", [
        "Per path, from its paged rows: t = L·γ + n·α + bytes/β (L layers, n descriptors per request), fitted by "
        "least squares of each case's relative error; γ = cost per layer, α = cost per descriptor, β = bandwidth "
        "(GB/s = 10^9 B/s). `kvbench fit FILE --leave-out BLOCKS` fits without some block sizes and predicts them; "
        "`kvbench plan --fabric FILE` uses these fits (docs/planning.md)."],
        tables=[("fitted link model per path", fit_rows), ("predicted against measured", shown)])
    poor = [f.label() for f in fits if not f.r2 >= MIN_R2]
    drawn = cases[cases["r2"] >= MIN_R2]
    left_off = (f" Not drawn: {', '.join(poor)}: R² below {MIN_R2} (the fit explains less than half of what was "
                "measured; its table row says so).") if poor else ""
    if drawn.empty:
        s.add_text(f"Plot of predicted against measured: not drawn: no path's fit reaches R² {MIN_R2}.{left_off}")
        page.add_data("linkmodel", fit_rows)
        return
    cases = drawn
    plt = _plt()  # matplotlib, or one line saying how to install it
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(7.2, 4.8), layout="constrained")
    groups = list(cases.groupby(["transport", "op"], sort=False))
    # one colour per path: the ten strong colours first, then the light ones (the default cycle repeats after ten)
    colors = list(plt.cm.tab10.colors) + list(plt.cm.tab20.colors[1::2])
    for i, ((t, op), g) in enumerate(groups):
        ax.scatter(g["p50"] * 1e3, g["pred_s"] * 1e3, label=f"{t} {op}", s=16, color=colors[i % len(colors)],
                   marker="o" if i < len(colors) else "^")
    both = pd.concat([cases["p50"], cases["pred_s"]]) * 1e3
    lim = [float(both[both > 0].min()) / 1.2, float(both.max()) * 1.2]
    ax.plot(lim, lim, color="grey", lw=1, ls="--", label="predicted = measured")
    ax.set_xscale("log")  # requests span microseconds to seconds: a log scale keeps each path readable
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("measured p50 per request (ms)")
    ax.set_ylabel("link model's prediction (ms)")
    ax.set_title("link model: predicted against measured, paged rows")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    s.add_figure(f"link model: predicted against measured request time.{left_off}", fig)  # png_of closes it
    page.add_data("linkmodel", fit_rows)
