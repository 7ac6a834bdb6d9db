"""What a buyer reads: the page opens with a one-screen summary, long tables are collapsed, a plot is drawn only when it
says something (and a point above its ceiling is marked and explained), and `kvbench compare` names every case in
full with its GB/s. Synthesized result files: no MPI, seconds in all."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from helpers import synth

from kvbench.report import fitsection, plots, summary
from kvbench.report.build import main as report
from kvbench.report.page import Page
from kvbench.report.stats import load_run
from kvbench.results.store import ROW_COLUMNS, SCHEMA_VERSION

BLOCKS = (0, 16, 64, 256)  # 0: the bulk reference


def linear(layers, n, nbytes):
    return layers * 20e-6 + n * 2e-6 + nbytes / 5e9


def write(path, seconds_of=linear, transports=("tcp", "shm"), models=("llama-3-8b",), sweep=None, faster=None,
          **meta_extra):
    """A result file of paged rows and their bulk reference; ``faster``: (transport, block) that beats its bulk."""
    rows, case = [], 0
    for model in models:
        for tr in transports:
            for tokens, pp, blk in sweep or [(1024, 1, b) for b in BLOCKS]:
                case += 1
                f = seconds_of
                if faster == (tr, blk):
                    def f(layers, n, nbytes):
                        return 0.5 * linear(layers, 32, nbytes)  # half the bulk time: above the ceiling
                rows += synth.case_rows(case, tr, tokens, pp, blk, f, model=model)
    df = pd.DataFrame(rows, columns=ROW_COLUMNS).assign(scales="none")
    df.to_parquet(path, index=False)
    meta = {"schema_version": SCHEMA_VERSION, "suite": {"name": "synth"}, "hosts": ["h1", "h1"], "world_size": 2,
            "system": {"hostname": "h1", "cpu_model": "Test CPU", "cpus": 64, "gpus": ["H100"], "nics": ["eth0"],
                       "nic_speed_mbps": {"eth0": 100000}}, **meta_extra}
    with open(str(path).replace(".parquet", ".meta.json"), "w") as fh:
        json.dump(meta, fh)
    return str(path)


def test_the_page_opens_with_the_summary_and_collapses_its_long_tables(tmp_path):
    f = write(tmp_path / "a.parquet", sweep=[(t, pp, b) for t in (256, 1024) for pp in (1, 2) for b in BLOCKS],
              faster=("tcp", 256))
    assert report([f], str(tmp_path / "page"), say=lambda _: None) == 0
    md = (tmp_path / "page" / "report.md").read_text()
    html = (tmp_path / "page" / "report.html").read_text()
    assert re.findall(r"^## .*", md, re.M)[0] == "## Summary"
    assert html.index('id="summary"') < html.index("Machine A") < html.index('id="bandwidth"')
    sec = md[md.index("## Summary"): md.index("**Machine A")]
    assert "Test CPU, 64 cores; GPUs: H100; NICs: eth0 100000 Mb/s" in sec
    # the purchase verdict first (one row per path and op), then the typical paged GB/s (one row per path)
    assert sec.index("purchase verdict per path") < sec.index("typical paged GB/s per path")
    assert [ln.split("|")[1].strip() for ln in sec.splitlines() if ln.startswith(("| tcp", "| shm"))] == \
        ["tcp push", "shm push", "tcp", "shm"]
    head = [ln for ln in sec.splitlines() if ln.startswith("| path | push GB/s")][0]
    tcp = dict(zip([c.strip() for c in head.split("|")],
                   [c.strip() for c in [ln for ln in sec.splitlines() if ln.startswith("| tcp |")][0].split("|")]))
    # the median of its 12 paged rows, with its interval: the one faster case does not make the headline
    assert tcp["push GB/s"].endswith("n 12") and tcp["status"] == "typical", tcp
    # the bandwidth rows (16 per transport) are collapsed below the summary, with the CSV linked from Markdown
    assert "<details><summary>bandwidth rows" in html and "every row also in report.csv" in html
    assert "[report.csv](report.csv)" in md and "<details>" in md


def test_the_summary_reads_samples_ci_and_status_columns_when_present():
    base = {"run": "r", "transport": "tcp", "memory": "host", "op": "push", "variant": "paged", "model": "m",
            "tokens": 256, "dtype": "fp16", "block_size": 16, "payload_bytes": 1e9, "bulk_pct": 90.0, "pct_line": 40.0,
            "noise": False, "nwrong_checked": 0, "iters": 4}
    old = summary.best_paged(pd.DataFrame([dict(base, gbps=1.0), dict(base, gbps=2.0, block_size=64)]))
    assert old.iloc[0][["best paged GB/s", "n", "p50 CI (GB/s)", "status"]].tolist() == ["2.00", "4", "-", "ok"]
    assert "64-token blocks" in old.iloc[0]["at"]
    new = summary.best_paged(pd.DataFrame([dict(base, gbps=2.0, samples=40, p50_ci_lo=0.4, p50_ci_hi=0.5,
                                                suspect=True)]))
    assert new.iloc[0][["n", "p50 CI (GB/s)", "status"]].tolist() == ["40", "2.00-2.50", "SUSPECT"]
    noisy = summary.best_paged(pd.DataFrame([dict(base, gbps=2.0, noise=True)]))
    assert noisy.iloc[0]["status"] == "noise"


def test_the_summary_marks_the_cases_a_run_called_suspect(tmp_path):
    # tcp's 256-token case (case 4) named in the sidecar's SUSPECT lines: its row says so, shm's does not
    f = write(tmp_path / "s.parquet", suspects=["SUSPECT: case 4 (tcp push llama-3-8b 1024 tokens, random 256-token "
                                                "blocks, host, serial): 9.00 GB/s beyond the path's bound"])
    page = Page("t")
    summary.add_section(page, [load_run(f)])
    (_, t), = [(c, t) for c, t in page.sections[0].tables if c.startswith("typical paged GB/s")]
    said = dict(zip(t["path"], t["status"]))
    assert page.sections[0].lead and said["shm"] == "typical", said
    assert said["tcp"] == "push typical without its SUSPECT or wrong rows: 1 of 3 rows left out (wrong bytes or " \
                          "SUSPECT)", said


def test_a_point_above_its_ceiling_is_ringed_and_explained(tmp_path):
    st = load_run(write(tmp_path / "a.parquet", transports=("tcp",), faster=("tcp", 256))).st
    (cap, fig), = [x for x in plots.bandwidth_vs_block(st[st["kind"] == "bandwidth"])]
    rings = [ln for ax in fig.axes for ln in ax.lines if ln.get_markeredgecolor() == "red"]
    assert len(rings) == 1 and list(rings[0].get_xdata()) == [256]
    assert "Red rings: 1 paged point above its ceiling" in cap and "noise" in cap
    plots._plt().close(fig)
    clean = load_run(write(tmp_path / "b.parquet", transports=("tcp",))).st
    (cap, fig), = plots.bandwidth_vs_block(clean[clean["kind"] == "bandwidth"])
    assert "Red rings" not in cap
    plots._plt().close(fig)


def test_degenerate_plots_are_not_drawn_and_say_why(tmp_path):
    one = load_run(write(tmp_path / "one.parquet", sweep=[(1024, 1, 0), (1024, 1, 16)])).st
    for make in (plots.bandwidth_vs_block, plots.latency_percentiles):
        (cap, fig), = make(one)
        assert fig is None and "not drawn: one block size (16)" in cap
    # five runs' lines in one panel: 15 legend entries
    st = load_run(write(tmp_path / "many.parquet", transports=("tcp",))).st
    many = pd.concat([st.assign(run=f"run{i}") for i in range(5)], ignore_index=True)
    many = many[many["run"].isin(["run0", "run1"])].assign(allocation="random").pipe(
        lambda d: pd.concat([d] + [d.assign(allocation=a) for a in ("fragmented:2", "fragmented:4", "contiguous")]))
    (cap, fig), = plots.latency_percentiles(many)
    assert fig is None and "series in one panel, more than a legend can carry" in cap
    # a page section carries the reason where the plot would have been
    page = Page("t")
    page.add_section("Bandwidth", "x", figures=plots.bandwidth_vs_block(one))
    assert page.sections[0].figures == [] and "not drawn" in page.sections[0].notes[0]


def test_a_link_model_fit_below_r2_half_is_plotted_with_its_warning(tmp_path):
    rng = np.random.default_rng(0)
    sweep = [(t, pp, b) for t in (256, 1024) for pp in (1, 2) for b in BLOCKS]
    good = load_run(write(tmp_path / "good.parquet", transports=("tcp",), sweep=sweep))
    page = Page("t")
    fitsection.add_section(page, [good])
    assert len(page.sections[0].figures) == 1 and "R² below" not in page.sections[0].figures[0][0]
    noise = load_run(write(tmp_path / "noise.parquet", transports=("tcp",), sweep=sweep,
                           seconds_of=lambda layers, n, nbytes: float(rng.uniform(1e-3, 1e-1))))
    page = Page("t")
    fitsection.add_section(page, [noise])
    s = page.sections[0]
    assert len(s.figures) == 1 and "do not extrapolate" in s.figures[0][0], s.figures
    assert any("R² below 0.5" in t for t in s.text), s.text


@pytest.fixture
def kv(capsys):
    from kvbench.cli.main import main

    def call(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        return code, capsys.readouterr().out

    return call


def test_compare_prints_each_case_in_full_with_its_gbps(tmp_path, kv):
    sweep = [(1024, pp, b) for pp in (1, 2) for b in BLOCKS]
    a = write(tmp_path / "a.parquet", transports=("tcp",), models=("llama-3-8b", "deepseek-v3"), sweep=sweep)
    b = write(tmp_path / "b.parquet", transports=("tcp",), models=("llama-3-8b", "deepseek-v3"), sweep=sweep,
              seconds_of=lambda *x: 2 * linear(*x))
    code, out = kv("compare", a, b)
    assert code == 0
    head = next(ln for ln in out.splitlines() if "GB/s A" in ln)
    assert "GB/s B" in head and head.rstrip().endswith("case")
    label = "paged tcp push model=deepseek-v3 blk=256 pp=2"  # longer than the 52 characters once kept
    line = next(ln for ln in out.splitlines() if ln.endswith(label))
    st = load_run(a).st
    r = st[(st["model"] == "deepseek-v3") & (st["block_size"] == 256) & (st["pp"] == 2) & (st["variant"] == "paged")]
    gbps = float(r["payload_bytes"].iloc[0] / r["p50"].iloc[0] / 1e9)
    assert f"{gbps:.2f} {gbps / 2:7.2f}" in line
    assert sum(ln.startswith("  ") for ln in out.splitlines()) == 2 * 2 * len(BLOCKS)
