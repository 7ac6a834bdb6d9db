"""`kvbench report RESULTS... -o DIR`: the page from result files (machines, then one section per kind of row)."""
from __future__ import annotations

import json
from itertools import chain

import pandas as pd

from kvbench.results.samples import FOOTNOTE

from . import codecs, fabric, fitsection, plots, setup, summary, tracesection
from .link import LinkOverride
from .page import Page
from .stats import Run, load_run
from .tables import WRONG_NOTE, bulk_pct_text, checks_text, spread_text, wrong_text

SAMPLES_NOTE = ("n = samples behind the percentiles (requests x iterations). p50 95% CI = the p50's order-statistic "
                "confidence interval (- below 6 samples); (target) or (budget) after it: --target-ci ran the case until the interval's "
                f"half-width was within the target, or until --ci-budget ran out first. {FOOTNOTE}.")


def _f(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def machine_key(meta: dict) -> str:
    sysd = {k: v for k, v in (meta.get("system") or {}).items() if k != "argv0"}
    return json.dumps([sysd, sorted(set(meta.get("hosts") or []))], sort_keys=True, default=str)


def machine_table(meta: dict, runs: list[Run]) -> pd.DataFrame:
    """What machine produced these runs (the sidecar's allowlisted description)."""
    s = meta.get("system") or {}
    speeds = s.get("nic_speed_mbps") or {}
    nics = ", ".join(f"{n} ({speeds[n]} Mb/s)" if speeds.get(n) else n for n in s.get("nics", [])) or "-"
    rdma = s.get("rdma_rates") or {}
    libs = meta.get("libraries") or {}
    rows = [("hosts", ", ".join(dict.fromkeys(meta.get("hosts") or [s.get("hostname", "?")]))),
            ("ranks", meta.get("world_size", "-")),
            ("CPU", f"{s.get('cpu_model', '?')}, {s.get('cpus', '?')} cores ({s.get('machine', '?')})"),
            ("memory", _f(s.get("mem_total_bytes", float("nan")) / 2**30, ".1f") + " GiB"),
            ("GPUs", ", ".join(s.get("gpus") or []) or "none"),
            ("NICs (speed)", nics + ("" if speeds else "  [speed not recorded by this kvbench version]")),
            ("RDMA devices", ", ".join(f"{k}: {v}" for k, v in rdma.items()) or ", ".join(s.get("rdma_devices") or [])
             or "none"),
            ("OS", s.get("platform", "-")),
            ("MPI", str(meta.get("mpi", "-")).splitlines()[0] if meta.get("mpi") else "-"),
            ("libraries", ", ".join(f"{k} {v}" for k, v in libs.items())),
            ("kvbench", f"{meta.get('kvbench_version', '?')} (commit {meta.get('git_commit', '?')})"),
            ("runs", ", ".join(r.label for r in runs))]
    return pd.DataFrame(rows, columns=["machine", "value"])


def runs_table(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for r in runs:
        m = r.meta
        kinds = r.st["kind"].value_counts()
        rows.append({"run": r.label, "suite": (m.get("suite") or {}).get("name", "?"), "started": m.get("started", "-"),
                     "status": m.get("status", "-"), "schema (as written)": m.get("schema_version", "-"),
                     "cases": len(r.st), "bandwidth / exposed / workload": " / ".join(
                         str(int(kinds.get(k, 0))) for k in ("bandwidth", "exposed", "workload")),
                     "skipped": int((r.st["status"] == "skipped").sum()),
                     "wrong elements": m.get("total_wrong", "-")})
    return pd.DataFrame(rows)


KEY_COLUMNS = ("run", "transport", "op", "memory", "model", "tokens", "dtype", "alloc", "overlap", "handshake",
               "layers", "arrival", "layout", "coal", "tp", "heads")  # a key column with one value in every row moves into the caption


def compact(caption: str, table: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """Say a column that is the same in every row once, in the caption, and keep the table narrow."""
    same = [c for c in table.columns if c in KEY_COLUMNS and len(table) > 1 and table[c].astype(str).nunique() == 1]
    if not same:
        return caption, table
    return (f"{caption} (every row: {', '.join(f'{c} {table[c].iloc[0]}' for c in same)})",
            table.drop(columns=same))


def _n(x) -> str:
    return "-" if x is None or pd.isna(x) else str(int(x))


def _ci(r) -> str:
    """The p50's 95% interval in ms, and why its case stopped when --target-ci ran it (samples.py)."""
    if pd.isna(r.get("p50_lo")):
        return "-"
    stop = r.get("ci_stop")
    return (f"{r['p50_lo'] * 1e3:.3f}-{r['p50_hi'] * 1e3:.3f}"
            + (f" ({stop})" if isinstance(stop, str) and stop not in ("", "fixed") else ""))


def bandwidth_table(bw: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "transport": r["transport"], "op": r["op"], "memory": r["memory"], "model": r["model"],
        "tokens": r["tokens"], "dtype": r["dtype"], "variant": r["variant"],
        "block (tok)": r["block_size"] if r["variant"] == "paged" else "-", "layout": r["layout"],
        "alloc": r["allocation"], "coal": r["coalesce"], "tp": _tp(r.get("tp")), "heads": r.get("head_layout") or "-",
        "descs": r["descriptors"], "payload (MB)": _f(r["payload_bytes"] / 1e6, ".2f"), "n": _n(r.get("samples")),
        "p50 (ms)": _f(r["p50"] * 1e3, ".3f"), "p50 95% CI (ms)": _ci(r), "p95 (ms)": _f(r["p95"] * 1e3, ".3f"),
        "p99 (ms)": _f(r["p99"] * 1e3, ".3f"), "GB/s": _f(r["gbps"], ".2f"), "±%": spread_text(r),
        "bulk%": bulk_pct_text(r), "ceiling": r["ceil_name"] or "-",
        "link (GB/s)": _f(r["link_gbps"], ".2f"), "%line": _f(r["pct_line"], ".1f"), "link rate from": r["link"],
        "#wrong": wrong_text(r), "#chk": checks_text(r)} for _, r in bw.iterrows()])


def _tp(v) -> str:
    """A row's tp: 'P:D', or one number (read as a float where a column mixes them with gaps)."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def exposed_table(ex: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "transport": r["transport"], "op": r["op"], "overlap": r["overlap"],
        "handshake": r["handshake"], "model": r["model"], "tokens": r["tokens"], "layers": r["layers"],
        "block (tok)": r["block_size"] if r["variant"] == "paged" else "-", "payload (MB)": _f(r["payload_bytes"] / 1e6, ".2f"),
        "prefill P (ms)": _f(r["prefill_s"] * 1e3, ".2f"), "transfer T (ms)": _f(r["T_ms"], ".2f"),
        "handshake (us)": _f(r["handshake_p50"] * 1e6, ".0f"), "n": _n(r.get("exposed_samples")), "exposed p50 (ms)": _f(r["exposed_p50"] * 1e3, ".2f"),
        "p95 (ms)": _f(r["exposed_p95"] * 1e3, ".2f"), "p99 (ms)": _f(r["exposed_p99"] * 1e3, ".2f"),
        "model (ms)": _f(r["model_ms"], ".2f"), "diff (ms)": _f(r["diff_ms"], "+.2f"), "#wrong": wrong_text(r),
        "#chk": checks_text(r)}
        for _, r in ex.iterrows()])


def workload_table(wl: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "transport": r["transport"], "op": r["op"], "overlap": r["overlap"], "model": r["model"],
        "tokens": r["tokens"], "arrival": r["arrival"], "rate (req/s)": _f(r["rate_rps"], "g"), "requests": r["requests"],
        "admitted": r["admitted"], "dropped": r["dropped"],
        "queue p50/p95/p99 (ms)": "/".join(_f(r[f"queue_p{q}_ms"], ".2f") for q in (50, 95, 99)),
        "exposed p50/p95/p99 (ms)": "/".join(_f(r[f"exposed_p{q}_ms"], ".2f") for q in (50, 95, 99)),
        "landed p99 (ms from arrival)": _f(r["landed_p99_ms"], ".2f"),
        "pool peak/cap (blocks)": f"{_f(r['pool_peak'], '.0f')}/{_f(r['pool_cap'], '.0f')}",
        "pool mean": _f(r["pool_mean"], ".1f"), "#wrong": wrong_text(r), "#chk": checks_text(r)}
        for _, r in wl.iterrows()])


CSV_RENAME = {"p50": "p50_s", "p95": "p95_s", "p99": "p99_s", "p50_lo": "p50_lo_s", "p50_hi": "p50_hi_s", "exposed_p50": "exposed_p50_s",
              "exposed_p95": "exposed_p95_s", "exposed_p99": "exposed_p99_s", "handshake_p50": "handshake_p50_s",
              "gbps": "gbps_1e9", "agg_gbps": "agg_gbps_1e9", "bulk_gbps": "bulk_gbps_1e9",
              "ceil_gbps": "ceil_gbps_1e9", "link_gbps": "link_gbps_1e9", "link": "link_source"}


def _rows(runs: list[Run]) -> pd.DataFrame:
    return pd.concat([r.st for r in runs], ignore_index=True)


WRONG = ["nwrong_checked", "nwrong_iters"]  # a case's wrong elements over its checked requests (tables.wrong_counts)


def _workload(runs: list[Run]) -> pd.DataFrame | None:
    wl = [r.wl.merge(r.st[["run", "case", *WRONG]], on=["run", "case"], how="left") for r in runs if len(r.wl)]
    return pd.concat(wl, ignore_index=True) if wl else None


def _measured(runs: list[Run], kind: str) -> pd.DataFrame:
    st = _rows(runs)
    ok = st[st["status"] != "skipped"]
    return ok[ok["kind"] == kind]


def runs_section(page: Page, runs: list[Run]) -> None:
    text = ["Each result file with what it holds. GB/s = 10^9 B/s throughout; MB = 10^6 B."]
    ended = [r for r in runs if r.status is not None]
    if ended:
        text.append(f"Not every run ended cleanly: {len(ended)} of {len(runs)} did not, and each is marked with its "
                    "status after its name in every table and figure (FAILED: the check found wrong elements; any "
                    "other: the rows are the cases the run stored before it ended). " + " ".join(f"{r.label}: {r.meta.get('reason') or 'no reason recorded'}."
                                              for r in ended))
    page.add_section("Runs", text, tables=[("result files", runs_table(runs))])


def bandwidth_section(page: Page, runs: list[Run]) -> None:
    bw = _measured(runs, "bandwidth")
    if len(bw):
        page.add_section("Bandwidth", [
            "One request at a time, nothing else on its clock: time = until the destination knows the last byte "
            "landed (max over the pair's ranks). GB/s = payload / p50 time. bulk% = GB/s / the ceiling (the best of "
            "the same payload as one descriptor per layer or contiguous 64K-4M chunks, measured alongside; * = "
            "above it by more than both spreads: noise). ±% = interquartile range of the per-round medians.",
            SAMPLES_NOTE, WRONG_NOTE + ".",
            "%line = GB/s / the rate of the link: the NIC's reported speed when the pair's ranks are on different "
            "hosts (nominal), a rate the transport or device layer reported (nominal), or, when they share a host, "
            "kvbench's own copy of the same bytes beside the case's iterations (measured, not nominal); "
            "--link-gbps overrides; 'unknown' where kvbench cannot tell."],
            tables=[compact("bandwidth rows", bandwidth_table(bw))],
            figures=chain(plots.bandwidth_vs_block(bw), plots.descriptors_vs_bandwidth(bw),
                          plots.bandwidth_vs_age(bw),
                          plots.latency_percentiles(bw)))


def _timed_section(page: Page, title: str, text: str, label: str, df, table, figures) -> None:
    """A section of timed requests (no GB/s): its text, its rows and its plots, when the runs hold any."""
    if df is not None and len(df):
        page.add_section(title, [text], tables=[compact(label, table(df))], figures=figures(df))


def exposed_section(page: Page, runs: list[Run]) -> None:
    _timed_section(
        page, "Exposed time",
        "Requests timed against a prefill clock or an allocate-then-stream handshake: exposed = from prefill end "
        "until decode knows the last byte landed. No GB/s here: these times include the prefill and the "
        "handshake. Model = max(0, T - P) + T/L streaming, T serial, with T = payload / this path's bulk GB/s. "
        f"n = exposed-time samples; {FOOTNOTE}. {WRONG_NOTE}.",
        "exposed-time rows", _measured(runs, "exposed"), exposed_table, plots.exposed_vs_prompt)


def workload_section(page: Page, runs: list[Run]) -> None:
    _timed_section(
        page, "Workload",
        "Requests arriving at a rate into a bounded decode pool (allocate-then-stream, back-pressure): tails over "
        "the admitted requests; queue = wait for decode blocks; exposed = prefill end to KV landed; landed = "
        f"arrival to KV landed. No GB/s here: these times include the queue. {FOOTNOTE} (n = admitted). {WRONG_NOTE}.",
        "workload rows", _workload(runs), workload_table, plots.workload_tails)


def skipped_section(page: Page, runs: list[Run]) -> None:
    st = _rows(runs)
    skipped = st[st["status"] == "skipped"]
    if len(skipped):
        page.add_section("Skipped", "Cases that did not run here, with the reason (never a number).",
                         tables=[("skipped cases", skipped[["run", "transport", "op", "memory", "variant", "reason"]]
                                  .drop_duplicates(["run", "transport", "op", "reason"]))])


# The page's sections, in order: each a callable (page, runs) -> None that adds its section, or nothing when the
# runs hold no rows of its kind.  ``register`` adds one before Skipped (the reasons close the page).
SECTIONS: list = [summary.add_section,  # the first screen: the best of each path, exposed time per model, the machine
                  runs_section, bandwidth_section, exposed_section, workload_section,
                  tracesection.add_section,  # a workload that replayed a trace: its hit rates and tails
                  setup.add_section,  # what each transport's setup cost, when a run has setup rows (schema 6)
                  fabric.add_section,  # flows isolated against congested, per-NIC rails (schema 7)
                  fitsection.add_section,  # the link model, when a run sweeps enough block sizes
                  codecs.add_section,  # codecs against none, when a run has codec rows
                  skipped_section]


def register(section) -> None:
    """Add a section to every page built from now on, after the measured ones and before Skipped."""
    SECTIONS.insert(SECTIONS.index(skipped_section), section)


def build(paths: list[str], override: LinkOverride | None = None) -> tuple[Page, list[Run]]:
    """Read every file and lay out the page (callers may add sections before writing it)."""
    runs = [load_run(p, override) for p in paths]
    machines: dict[str, list[Run]] = {}
    for r in runs:
        machines.setdefault(machine_key(r.meta), []).append(r)
    names = [" + ".join(dict.fromkeys(rs[0].meta.get("hosts") or ["?"])) for rs in machines.values()]
    page = Page(f"kvbench report: {', '.join(names)} ({len(runs)} result file{'s' * (len(runs) != 1)})")
    for i, rs in enumerate(machines.values()):
        page.head.append((f"Machine {chr(65 + i)}: {names[i]}", machine_table(rs[0].meta, rs)))
    for section in SECTIONS:
        section(page, runs)
    rows = _rows(runs).rename(columns=CSV_RENAME)
    wl = _workload(runs)
    if wl is not None:
        rows = rows.merge(wl.drop(columns=["transport", "op", "model", "tokens", "block_size", "overlap", "variant", *WRONG]),
                          on=["run", "case"], how="left")
    # the CSV keeps the file's name as the run's key and says its status in a column of its own
    rows["run"] = rows["run"].map({r.label: r.name for r in runs})
    rows.insert(1, "run_status", rows["run"].map({r.name: r.meta.get("status", "") for r in runs}))
    page.add_data("", rows)
    return page, runs


def main(files: list[str], out_dir: str | None, link_gbps: str | None = None, say=print) -> int:
    """`kvbench report`: with -o, the page (md, html, csv) in out_dir; without, today's terminal table."""
    from . import tables
    from .link import LinkOverride
    from .writers import write

    override = LinkOverride.parse(link_gbps)
    if out_dir:
        page, runs = build(files, override)
        for p in write(page, out_dir):
            say(f"# wrote {p}")
        return 0
    for path in files:
        df, meta = tables.read(path)
        st = tables.summarize(df)
        cases = meta.get("cases") or st.rename(columns={"prefill_ms_set": "prefill_ms"}).to_dict("records")
        exposed = tables.uses_overlap(cases)
        columns = tables.columns_for(cases, exposed)
        status = tables.run_status(meta)
        say(f"# {path}  suite={meta.get('suite', {}).get('name', '?')}  commit={meta.get('git_commit', '?')}"
            + (f"  status={status}" if status else ""))
        for line in tables.status_lines(meta):
            say(line)
        for line in tables.overlap_header_lines(columns) if exposed else tables.header_lines(columns):
            say(line)
        for _, r in st.iterrows():
            say(tables.format_line(r.to_dict(), columns))
        for line in setup.table_lines(df, st) + fabric.table_lines(df):  # after the bandwidth table, as run prints
            say(line)
    return 0
