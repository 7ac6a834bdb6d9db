"""The link model's section of the report page: per path the fitted costs, then predicted against measured."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import linkmodel

MIN_R2 = 0.5  # a fit explaining less than half the variance of its times: drawn with a warning, never extrapolated
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
        c = c[c["kind"] == "paged"].copy()
        c.insert(0, "run", r.label)
        c["fit"] = -1
        for x in paged:  # each case carries its fit's index, so that its panel draws its path's cases alone
            c.loc[_match(c, x), "fit"] = len(fits)
            fits.append(x)
        cases.append(c)
    if not fits:
        return
    cases = pd.concat(cases, ignore_index=True)
    fit_rows = pd.DataFrame([{
        "path": f.label(), "γ us/layer": round(f.gamma_s * 1e6, 2), "α us/descriptor": round(f.alpha_s * 1e6, 3),
        "β GB/s": round(f.beta_bps / 1e9, 3), "R²": round(f.r2, 4),
        "max |err| %": round(100 * f.max_rel, 1), "cases": f.points,
        "warning": "" if f.r2 >= MIN_R2 else f"R² below {MIN_R2}: {WARNING}"} for f in fits])
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
    poor = [f for f in fits if not f.r2 >= MIN_R2]
    if poor:  # said in the text as well as on the plot: a reader of either sees it
        s.add_text(" ".join(f"Warning: {f.label()}: R² below {MIN_R2} ({f.r2:.2f}), max |err| {100 * f.max_rel:.0f}%: "
                           f"{WARNING}." for f in poor))
    for caption, fig in fit_figures(fits, cases):
        s.add_figure(caption, fig)  # png_of closes it
    page.add_data("linkmodel", fit_rows)


WARNING = "the model does not explain these rows: do not extrapolate"
MAX_PANELS = 12  # paths drawn in one figure; the table has every fit


def _match(c: pd.DataFrame, f) -> np.ndarray:
    """The cases of ``c`` on the path of fit ``f``."""
    return np.logical_and.reduce([(c[k] == v) | (c[k].isna() & pd.isna(v)) for k, v in f.path.items() if k in c])


def quality(f) -> str:
    return f"R² {f.r2:.2f}, max |err| {100 * f.max_rel:.0f}%"


def fit_figures(fits, cases: pd.DataFrame):
    """Per fitted path a panel of predicted against measured, its R² and max error in the title; a path below R²
    MIN_R2 drawn in red with the warning written across the panel."""
    from .plotstyle import _panels, plain_log

    shown = [(f, cases[cases["fit"] == i]) for i, f in enumerate(fits)][:MAX_PANELS]
    shown = [(f, c) for f, c in shown if len(c) and (c["p50"] > 0).any()]
    if not shown:
        return
    fig, axes = _panels(len(shown), "link model: predicted against measured, paged rows", w=4.6, h=4.2)
    for ax, (f, c) in zip(axes, shown):
        bad = not f.r2 >= MIN_R2
        color = "tab:red" if bad else "tab:blue"
        ax.scatter(c["p50"] * 1e3, c["pred_s"] * 1e3, s=16, color=color, label="case")
        both = pd.concat([c["p50"], c["pred_s"]]) * 1e3
        lim = [float(both[both > 0].min()) / 1.2, float(both.max()) * 1.2]
        ax.plot(lim, lim, color="grey", lw=1, ls="--", label="predicted = measured")
        ax.set_xscale("log")  # requests span microseconds to seconds: a log scale keeps each path readable
        ax.set_yscale("log")
        plain_log(ax)
        ax.set_xlabel("measured p50 per request (ms)")
        ax.set_ylabel("link model's prediction (ms)")
        name = " ".join(str(f.path.get(k)) for k in ("transport", "op") if f.path.get(k) is not None)
        ax.set_title(f"{name}\n{quality(f)}" + ("  BELOW 0.5" if bad else ""), fontsize=9,
                     color="tab:red" if bad else "black")
        if bad:
            ax.text(0.5, 0.97, "WARNING: " + WARNING.replace(": ", ":\n"), transform=ax.transAxes, ha="center",
                    va="top", fontsize=8, color="tab:red", wrap=True,
                    bbox={"facecolor": "white", "edgecolor": "tab:red", "alpha": .9})
        ax.grid(alpha=.3, which="both")
    axes[0].legend(fontsize=7, loc="lower right")
    bad = [f.label() for f, _ in shown if not f.r2 >= MIN_R2]
    yield ("link model: predicted against measured request time, one panel per path with its fit's R² and max "
           "|err| in the title (the dashed line: a perfect prediction)."
           + (f" Red: R² below {MIN_R2}, {WARNING} ({', '.join(bad)})." if bad else "")
           + (f" {len(fits) - len(shown)} more paths in the table." if len(fits) > len(shown) else ""), fig)
