"""The report's plots (matplotlib, Agg): each yields (caption, Figure) pairs, one open figure at a time; units on
every axis."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from .plotstyle import _legend, _n, _panels, _plt, _xticks, degenerate, err_note, floor_zero, gbps_err, plain_log

GROUP_KEYS = ["model", "tokens", "dtype", "tp", "pp", "world_size"]  # one payload: one figure
LINE_KEYS = ["run", "op", "allocation", "coalesce", "layout", "inflight", "memory"]  # one line within a panel


def _label(keys: tuple, varying: list[str]) -> str:
    d = dict(zip(LINE_KEYS, keys))
    return " ".join(str(d[k]) for k in varying) or str(d["op"])


def _varying(df: pd.DataFrame, keys: list[str]) -> list[str]:
    return [k for k in keys if df[k].nunique() > 1] or ["op"]


def _group_title(key: tuple) -> str:
    d = dict(zip(GROUP_KEYS, key))
    return (f"{d['model']}, {d['tokens']} tokens, {d['dtype']}, tp={d['tp']} pp={d['pp']}, "
            f"{d['world_size']} ranks") + (f", {key[-1]}" if len(key) > len(GROUP_KEYS) else "")


def _groups(d: pd.DataFrame):
    """One figure per payload; per payload and run when more than two runs measured it (lines stay readable)."""
    for key, g in d.groupby(GROUP_KEYS):
        if g["run"].nunique() > 2:
            for run, gr in g.groupby("run"):
                yield (*key, run), gr
        else:
            yield key, g


def _transport_panels(d: pd.DataFrame, title: str, x: str = "block_size", per_line: int = 1):
    """Per payload group (``_groups``): its key, a figure with one panel per transport (None when ``degenerate``:
    then the reason), the line keys that vary, and (panel, transport, that transport's rows) for each panel."""
    for key, g in _groups(d):
        transports = list(dict.fromkeys(g["transport"]))
        lines = max(g[g["transport"] == t].groupby(LINE_KEYS, dropna=False).ngroups for t in transports)
        why = degenerate(g, x, lines * per_line)
        if why:
            yield key, None, why, [], []
            continue
        fig, axes = _panels(len(transports), f"{title}: {_group_title(key)}", sharey=True)  # paths compared
        yield key, fig, None, _varying(g, LINE_KEYS), [(ax, t, g[g["transport"] == t]) for ax, t in zip(axes, transports)]


def _block_panels(bw: pd.DataFrame, col: str, title: str, per_line: int):
    """The paged rows that measured ``col``, per figure (``_transport_panels``): its key, the figure (or None and
    why), and per panel (panel, transport, its rows, its lines as (colour, label, the line's rows by block size))."""
    paged = bw[(bw["variant"] == "paged") & bw[col].notna()]
    for key, fig, why, vary, panels in _transport_panels(paged, title, per_line=per_line):
        yield key, fig, why, [(ax, t, gt, [(f"C{i}", _label(lk, vary), gl.sort_values("block_size"))
                                           for i, (lk, gl) in enumerate(gt.groupby(LINE_KEYS))]) for ax, t, gt in panels]


def _finish(ax, ticks, xlabel: str, ylabel: str, title: str) -> None:
    """A panel over a power-of-two axis (block size, prompt length): scale, ticks, labels, grid, legend."""
    ax.set_xscale("log", base=2)
    _xticks(ax, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=.3)
    _legend(ax)


def bandwidth_vs_block(bw: pd.DataFrame) -> Iterator[tuple]:
    """Paged GB/s against block size per transport and op, with the bulk (dashed) and ceiling (dotted) lines; a
    paged point above its ceiling is ringed in red and the caption says what that means."""
    for key, fig, why, panels in _block_panels(bw, "gbps", "Achieved bandwidth against block size", per_line=3):
        if fig is None:
            yield f"Plot of GB/s against block size, {_group_title(key)}: not drawn: {why}.", None
            continue
        above = 0
        paged = pd.concat([gt for _, _, gt, _ in panels])
        for ax, t, gt, lines in panels:
            for color, label, gl in lines:
                ax.errorbar(gl["block_size"], gl["gbps"], yerr=gbps_err(gl), fmt="o-", color=color, capsize=3,
                            label=f"paged {label} {_n(gl)}")
                bulk, ceil = gl["bulk_gbps"].dropna(), gl["ceil_gbps"].dropna()
                if len(bulk):
                    ax.axhline(bulk.iloc[0], color=color, ls="--", lw=1, label=f"bulk {label}")
                if len(ceil) and (not len(bulk) or ceil.iloc[0] != bulk.iloc[0]):
                    ax.axhline(ceil.iloc[0], color=color, ls=":", lw=1.2,
                               label=f"ceiling {label} ({gl['ceil_name'].iloc[0]})")
                over = gl[gl["gbps"] > gl["ceil_gbps"]]
                if len(over):
                    ax.plot(over["block_size"], over["gbps"], "o", ms=12, mfc="none", mec="red", mew=1.6,
                            label="above its ceiling" if not above else None)
                    above += len(over)
            _finish(ax, gt["block_size"], "block size (tokens)", "GB/s (10^9 B/s)", t)
        floor_zero([p[0] for p in panels])
        note = (f" Red rings: {above} paged point{'s' * (above != 1)} above {'their' if above != 1 else 'its'} "
                "ceiling. Blocks cannot truly move faster than the same bytes in one piece, so such a point is the "
                "machine's noise: within both spreads its bulk% carries ~ (status at ceiling), beyond them * (status "
                "noise), and beyond a physical bound the run calls it SUSPECT.") if above else ""
        yield (f"GB/s against block size, {_group_title(key)}: lines = paged block tables (GB/s at p50; n = "
               "samples per point, in the legend); dashed = bulk (one descriptor per layer); dotted = ceiling (best "
               f"of bulk and contiguous chunks). One y-scale for every panel of the figure. {err_note(paged)}{note}",
               fig)


def descriptors_vs_bandwidth(bw: pd.DataFrame) -> Iterator[tuple]:
    """Achieved GB/s against descriptors per request, every bandwidth row: colour = transport, marker = op."""
    from matplotlib.lines import Line2D

    d = bw[bw["gbps"].notna() & (bw["descriptors"] > 0)]
    if d.empty:
        return
    transports, ops = list(dict.fromkeys(d["transport"])), list(dict.fromkeys(d["op"]))
    why = degenerate(d, "descriptors", len(transports) + len(ops))
    if why:
        yield f"Plot of GB/s against descriptors per request: not drawn: {why}.", None
        return
    fig, (ax,) = _panels(1, "Descriptors per request against achieved bandwidth", w=7.5, h=4.5)
    colors = _plt().cm.tab20.colors
    marks = dict(zip(ops, "o^sDv<>"))
    for (t, op), g in d.groupby(["transport", "op"], sort=False):
        ax.errorbar(g["descriptors"], g["gbps"], yerr=gbps_err(g), ls="none", color=colors[transports.index(t) % 20],
                    marker=marks[op], ms=4.5, capsize=2, elinewidth=.8)
    # one legend entry per transport (colour) and per op (marker), not one per pair: it stays within a legend
    handles = [Line2D([], [], ls="", marker="s", color=colors[i % 20], label=t) for i, t in enumerate(transports)]
    handles += [Line2D([], [], ls="", marker=marks[op], color="grey", label=op) for op in ops]
    ax.set_xscale("log")
    ax.set_xlabel("descriptors per request (contiguous copies)")
    ax.set_ylabel("GB/s (10^9 B/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=.3)
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    yield ("GB/s against descriptors per request (all payloads; more descriptors = smaller copies; GB/s at p50, "
           f"{_n(d)} samples per point); colour = transport, marker = op. {err_note(d)}", fig)


def pool_age(alloc: str) -> float:
    """Requests a case's decode pool had served: aged:<N> -> N; a fresh pool (random, contiguous) -> 0; else NaN."""
    kind, _, n = str(alloc).partition(":")
    return float(n) if kind == "aged" else 0.0 if kind in ("random", "contiguous") else float("nan")


AGE_KEYS = ["run", "op", "coalesce", "layout", "block_size", "inflight", "memory"]  # one line of an age panel
FRESH_MARKS = {"random": "s", "contiguous": "^"}


def bandwidth_vs_age(bw: pd.DataFrame) -> Iterator[tuple]:
    """Paged GB/s against the decode pool's age (aged:<N>, model/ageing.py), per transport; fresh pools (random,
    contiguous) as markers at age 0; each point labelled with its descriptors per request.  Nothing when no run
    has an aged pool."""
    d = bw[(bw["variant"] == "paged") & bw["gbps"].notna()].copy()
    if not d["allocation"].astype(str).str.startswith("aged:").any():
        return
    d["age"] = d["allocation"].map(pool_age)
    d = d[d["age"].notna()]
    for key, g in _groups(d):
        transports = list(dict.fromkeys(g["transport"]))
        lines = max(g[g["transport"] == t].groupby(AGE_KEYS, dropna=False).ngroups for t in transports)
        why = degenerate(g, "age", lines * 3)
        if why:
            yield f"Plot of GB/s against pool age, {_group_title(key)}: not drawn: {why}.", None
            continue
        fig, axes = _panels(len(transports), f"GB/s against decode pool age: {_group_title(key)}",
                            w=7.5 if len(transports) == 1 else 5.2, sharey=True)
        vary = [k for k in AGE_KEYS if g[k].nunique() > 1] or ["op"]
        for ax, t in zip(axes, transports):
            gt = g[g["transport"] == t]
            for i, (lk, gl) in enumerate(gt.groupby(AGE_KEYS, dropna=False)):
                label = " ".join(str(dict(zip(AGE_KEYS, lk))[k]) for k in vary)
                aged = gl[gl["allocation"].str.startswith("aged:")].sort_values("age")
                ax.errorbar(aged["age"], aged["gbps"], yerr=gbps_err(aged), fmt="o-", color=f"C{i}", capsize=3,
                            label=f"aged {label} {_n(aged)}")
                for name, mark in FRESH_MARKS.items():
                    fresh = gl[gl["allocation"] == name]
                    ax.plot(fresh["age"], fresh["gbps"], mark, ms=8, mfc="none", color=f"C{i}",
                            label=f"fresh {name} {label}" if len(fresh) else None)
                for _, r in gl.iterrows():
                    ax.annotate(f"{int(r['descriptors'])}", (r["age"], r["gbps"]), fontsize=6,
                                textcoords="offset points", xytext=(4, 4))
            pos = gt.loc[gt["age"] > 0, "age"]
            ax.set_xscale("symlog", linthresh=float(pos.min()) if len(pos) else 1.0)  # age 0 sits on the axis
            _xticks(ax, gt["age"])
            ax.set_xlabel("pool age (requests served before the case)")
            ax.set_ylabel("GB/s (10^9 B/s)")
            ax.set_title(t)
            ax.grid(alpha=.3)
            _legend(ax)
        floor_zero(axes)
        yield (f"GB/s against the decode pool's age, {_group_title(key)}: aged:N = the free list vLLM's free queue "
               "is left with after N requests came and went (docs/usage.md); age 0 = a fresh pool (circle: aged:0, "
               "square: random, triangle: contiguous); numbers = descriptors per request; GB/s at p50, n = samples "
               f"per point (legend); one y-scale for every panel. {err_note(g)}", fig)


def latency_percentiles(bw: pd.DataFrame) -> Iterator[tuple]:
    """p50, p95 and p99 request time (ms) against block size, per transport; colour = op."""
    for key, fig, why, panels in _block_panels(bw, "p50", "Request time percentiles", per_line=3):
        if fig is None:
            yield f"Plot of request time percentiles, {_group_title(key)}: not drawn: {why}.", None
            continue
        for ax, t, gt, lines in panels:
            for color, label, gl in lines:
                for q, ls in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                    ax.plot(gl["block_size"], gl[q] * 1e3, ls, marker="o", ms=3, color=color,
                            label=f"{label} {q}" + (f" {_n(gl)}" if q == "p50" else ""))
            _finish(ax, gt["block_size"], "block size (tokens)", "time per request (ms)", t)
        yield (f"Request time p50 (solid), p95 (dashed), p99 (dotted), {_group_title(key)}; n = samples per point "
               "(legend); a p95 is drawn from 20 samples, a p99 from 100 (fewer: no point)", fig)


def exposed_vs_prompt(ex: pd.DataFrame) -> Iterator[tuple]:
    """Exposed ms (p50, bar to p95) against prompt length, with the model's line (dashed), per transport."""
    d = ex[ex["exposed_ms"].notna()]
    if d.empty:
        return
    for (model, dtype), g in d.groupby(["model", "dtype"]):
        transports = list(dict.fromkeys(g["transport"]))
        series = max(g[g["transport"] == t].groupby(["run", "op", "overlap", "handshake", "block_size"]).ngroups
                     for t in transports)
        if g["tokens"].nunique() < 2:  # one prompt length: the plot is over what was swept instead
            yield from exposed_swept(g, f"{model}, {dtype}")
            continue
        why = degenerate(g, "tokens", 2 * series)
        if why:
            yield f"Plot of exposed time against prompt length, {model} {dtype}: not drawn: {why}.", None
            continue
        fig, axes = _panels(len(transports), f"Exposed time against prompt length: {model}, {dtype}", sharey=True)
        multi = g["run"].nunique() > 1
        for ax, t in zip(axes, transports):
            for i, ((run, op, ov, hs, bs), gl) in enumerate(g[g["transport"] == t].groupby(
                    ["run", "op", "overlap", "handshake", "block_size"])):
                tag = f"{run} " if multi else ""
                gl = gl.sort_values("tokens")
                x, y = gl["tokens"].to_numpy(), gl["exposed_ms"].to_numpy()
                up = np.nan_to_num(np.maximum(gl["exposed_p95"].to_numpy() * 1e3 - y, 0))  # no p95 below 20: no bar
                ax.errorbar(x, y, yerr=[np.zeros_like(up), up], fmt="o-", color=f"C{i}", capsize=3, ms=4,
                            label=f"{tag}{op} {ov} hs={hs} blk={bs} {_n(gl, 'exposed_samples')}")
                if gl["model_ms"].notna().any():
                    ax.plot(x, gl["model_ms"], "--", color=f"C{i}", lw=1, label=f"model {tag}{op} {ov}")
            _finish(ax, g[g["transport"] == t]["tokens"], "prompt length (tokens)", "exposed time (ms)", t)
        floor_zero(axes)
        yield (f"Exposed ms p50 (bar to p95) against prompt length, {model} {dtype}; dashed = the model "
                    "max(0, T - P) + T/L streaming, T serial; n = samples per point (legend; no bar below 20); "
               "one y-scale for every panel", fig)


SWEPT = ["run", "transport", "op", "overlap", "handshake", "block_size", "layers"]  # what an exposed row may vary in
SWEPT_NAMES = {"block_size": "blk", "handshake": "hs", "layers": "L"}
MAX_BARS = 40  # bars one exposed-time figure carries with readable labels


def exposed_swept(g: pd.DataFrame, title: str) -> Iterator[tuple]:
    """One prompt length: a bar per row (exposed p50, bar to p95) over what was swept (transport, op, overlap,
    handshake, block size), with the model's time as a cross; labels on the y axis, never overlapping."""
    vary = [k for k in SWEPT if k in g and g[k].astype(str).nunique() > 1] or ["transport", "op", "overlap"]
    g = g.sort_values(vary, kind="stable")
    if len(g) > MAX_BARS:
        yield f"Plot of exposed time over the sweep, {title}: not drawn: {len(g)} rows, more than {MAX_BARS}.", None
        return
    labels = [" ".join(f"{SWEPT_NAMES[k]}={r[k]}" if k in SWEPT_NAMES else str(r[k]) for k in vary)
              for _, r in g.iterrows()]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 1.8 + 0.32 * len(g)), layout="constrained")
    y = np.arange(len(g))[::-1]
    p50 = g["exposed_ms"].to_numpy(dtype=float)
    up = np.nan_to_num(np.maximum(g["exposed_p95"].to_numpy(dtype=float) * 1e3 - p50, 0))  # no p95 below 20: no bar
    colors = [f"C{list(dict.fromkeys(g['transport'])).index(t) % 10}" for t in g["transport"]]
    ax.barh(y, p50, xerr=[np.zeros_like(up), up], color=colors, height=.6, capsize=3, label="exposed p50 (bar to p95)")
    if g["model_ms"].notna().any():
        ax.plot(g["model_ms"], y, "x", color="black", ms=7, mew=1.5, label="model")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("exposed time (ms)")
    ax.set_xlim(left=0)
    ax.set_title(f"Exposed time over the sweep: {tokens_of(g)} tokens, {title}", fontsize=10)
    ax.grid(alpha=.3, axis="x")
    _legend(ax)
    yield (f"Exposed ms p50 per row (bar to p95; no bar below 20 samples) over what was swept ({', '.join(vary)}), "
           f"one prompt length ({tokens_of(g)} tokens), {title}; x = the model max(0, T - P) + T/L streaming, T "
           f"serial; n = {_n(g, 'exposed_samples') or 'not recorded'}", fig)


def tokens_of(g: pd.DataFrame) -> str:
    return "/".join(str(t) for t in dict.fromkeys(g["tokens"]))


def workload_tails(wl: pd.DataFrame) -> Iterator[tuple]:
    """Exposed and queue tails (ms) against arrival rate (req/s), per transport and op; drops annotated."""
    d = wl[wl["rate_rps"].notna()]
    if d.empty:
        return
    keys = list(dict.fromkeys(zip(d["transport"], d["op"], d["overlap"])))
    series = d.drop_duplicates(["transport", "op", "overlap", "run", "model", "tokens"]).groupby(
        ["transport", "op", "overlap"]).size().max()
    why = degenerate(d, "rate_rps", 4 * int(series))
    if why:
        yield f"Plot of workload tails against arrival rate: not drawn: {why}.", None
        return
    fig, axes = _panels(len(keys), "Workload tails against arrival rate")
    for ax, k in zip(axes, keys):
        panel = d[(d["transport"] == k[0]) & (d["op"] == k[1]) & (d["overlap"] == k[2])]
        multi, shapes = panel["run"].nunique() > 1, panel[["model", "tokens"]].drop_duplicates().shape[0] > 1
        for i, ((run, model, tokens), g) in enumerate(panel.groupby(["run", "model", "tokens"], sort=False)):
            g = g.sort_values("rate_rps")
            tag = (f"{run} " if multi else "") + (f"{model} {tokens} tok " if shapes else "")
            for q, ls in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                ax.plot(g["rate_rps"], g[f"exposed_{q}_ms"], ls, marker="o", ms=4, color=f"C{i}",
                        label=f"{tag}exposed {q}" + (f" {_n(g, 'admitted')}" if q == "p50" else ""))
            ax.plot(g["rate_rps"], g["queue_p99_ms"], "-.", marker="s", ms=4, color=f"C{i}", alpha=.6,
                    label=f"{tag}queue p99")
            for _, r in g[g["dropped"] > 0].iterrows():
                ax.annotate(f"{int(r['dropped'])} dropped", (r["rate_rps"], r["exposed_p99_ms"]), fontsize=7,
                            textcoords="offset points", xytext=(-20, 6))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s per prefill rank)")
        ax.set_ylabel("time (ms)")
        ax.set_title(" ".join(k))
        ax.grid(alpha=.3, which="both")
        _legend(ax)
    yield ("Exposed time (prefill end to KV landed) and queue wait (for decode blocks) of admitted requests "
           "against arrival rate; n = admitted requests per point (legend); p95 from 20, p99 from 100", fig)


def register_vs_pool(reg: pd.DataFrame) -> Iterator[tuple]:
    """--pool-sizes: seconds to register a pool against its size, one line per run and transport (the slowest
    rank at each size; setup rows, report/setup.py)."""
    if reg.empty:
        return
    fig, (ax,) = _panels(1, "registration against pool size")
    for (run, name), g in reg.groupby(["run", "transport"], sort=False):
        g = g.sort_values("pool_gib")
        ax.plot(g["pool_gib"], g["seconds"], marker="o", label=f"{name} ({run})" if reg["run"].nunique() > 1 else name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pool (GiB)")
    ax.set_ylabel("register (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=.3)
    _legend(ax)
    yield "Seconds to register one pool of each --pool-sizes size (then deregistered), per transport.", fig


def first_vs_steady(fvs: pd.DataFrame) -> Iterator[tuple]:
    """Each case's first transfer against its steady p50 (ms, log-log), one series per transport (and run, and
    --register where it varies), with the line where the two are equal: a point far above it is a cold start
    (setup rows, report/setup.py first_vs_steady)."""
    fvs = fvs.dropna(subset=["first_ms", "p50_ms"])
    fvs = fvs[(fvs["first_ms"] > 0) & (fvs["p50_ms"] > 0)]
    if fvs.empty:
        return
    fig, (ax,) = _panels(1, "first transfer against steady p50")
    keys = ["run", "transport"] + (["register"] if "register" in fvs and fvs["register"].nunique() > 1 else [])
    for key, g in fvs.groupby(keys, sort=False):
        run, rest = key[0], " ".join(str(k) for k in key[1:])
        ax.scatter(g["p50_ms"], g["first_ms"], s=18, label=f"{rest} ({run})" if fvs["run"].nunique() > 1 else rest)
    lo = min(fvs["p50_ms"].min(), fvs["first_ms"].min())
    hi = max(fvs["p50_ms"].max(), fvs["first_ms"].max())
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--", label="first = steady")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log(ax)
    ax.set_xlabel("steady p50 (ms)")
    ax.set_ylabel("first transfer (ms)")
    ax.grid(alpha=.3, which="both")
    # the figure's legend beside the panel: the constrained layout narrows the panel for it, never clips it
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside right upper", frameon=False,
               ncol=1 + len(ax.collections) // 20)
    yield ("Each case's first transfer (its first warm-up: connections, descriptor lists and handles built) against "
           "its steady p50, per transport; above the dashed line the first costs more.", fig)
