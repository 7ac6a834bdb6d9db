"""Plots a buyer reads: comparable panels on one y-scale, an error bar from each row's own interval, labels that
never overlap or leave the figure, an exposed-time plot over whatever was swept, and a link-model fit drawn only with
its quality (R², max error) and a warning below R² 0.5. Built in-process from synthetic rows (tests/helpers/synth.py);
one Chromium test reads the rendered page's first table."""
from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pandas as pd
import pytest
from helpers import synth
from helpers.launch import chromium
from matplotlib.container import ErrorbarContainer

from kvbench.report import fabricplots, fitsection, page, plots
from kvbench.report.build import build
from kvbench.report.build import main as report
from kvbench.report.page import Page
from kvbench.report.plotstyle import _plt, err_note, gbps_err, outside, overlaps
from kvbench.report.stats import load_run


def linear(layers, n, nbytes):
    return layers * 5e-6 + n * 1e-6 + nbytes / 5e9


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Two paths of one payload, block sizes 16-256 and their bulk references; shm ten times faster than tcp."""
    p = synth.write(tmp_path_factory.mktemp("rows") / "a.parquet", linear, transports=("tcp", "shm"),
                    sweep=[(1024, 1, b) for b in (0, 16, 64, 256)])
    st = build([p])[1][0].st
    bw = st[st["kind"] == "bandwidth"].copy()
    fast = bw["transport"] == "shm"
    bw.loc[fast, ["gbps", "bulk_gbps", "ceil_gbps"]] *= 10
    bw.loc[fast, ["p50", "p50_lo", "p50_hi"]] /= 10
    return bw


def close(fig):
    _plt().close(fig)


def test_compared_bandwidth_panels_share_one_y_scale_and_carry_error_bars(rows):
    for make in (plots.bandwidth_vs_block, plots.latency_percentiles):
        (cap, fig), = make(rows)
        tcp, shm = fig.axes[:2]
        assert tcp.get_title() == "tcp" and shm.get_title() == "shm"
        assert tcp.get_ylim() == shm.get_ylim()  # loopback 0-5 beside mooncake 0-0.8 reads as equals: never again
        col = "gbps" if make is plots.bandwidth_vs_block else "p50"
        scale = 1 if col == "gbps" else 1e3
        assert tcp.get_ylim()[1] >= rows[col].max() * scale
        close(fig)
    (cap, fig), = plots.bandwidth_vs_block(rows)
    for ax in fig.axes[:2]:
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 1 and bars[0].has_yerr  # one per line: the paged push
    assert "Error bars:" in cap and "One y-scale" in cap
    close(fig)
    (cap, fig), = plots.descriptors_vs_bandwidth(rows)
    assert any(isinstance(c, ErrorbarContainer) for c in fig.axes[0].containers) and "Error bars:" in cap
    close(fig)


def test_the_error_bar_is_the_rows_own_interval_in_gbps():
    d = pd.DataFrame({"gbps": [2.0, 2.0, 2.0], "p50": [1.0, 1.0, 1.0], "p50_lo": [0.5, np.nan, np.nan],
                      "p50_hi": [2.0, np.nan, np.nan], "spread_pct": [np.nan, 10.0, np.nan]})
    err = gbps_err(d)
    # a slower bound (2 s) is the lower bar: 2 GB/s x 1/2 = 1 GB/s, 1 below; the faster (0.5 s) 4 GB/s, 2 above
    assert err[:, 0].tolist() == [1.0, 2.0]
    assert err[:, 1].tolist() == pytest.approx([0.1, 0.1])  # no interval: ± half the per-round IQR (10% of 2)
    assert err[:, 2].tolist() == [0.0, 0.0]  # neither: no bar, and the caption says so
    note = err_note(d)
    assert "95% confidence interval" in note and "interquartile" in note and "no bar" in note
    assert err_note(d.iloc[:1]) == "Error bars: the p50's 95% confidence interval (order statistics), as GB/s."


def test_bytes_per_nic_labels_never_overlap_and_stay_in_the_figure():
    moved = pd.DataFrame([{"run": "r", "case": c, "transport": "mooncake-tcp", "rank": r, "nic": nic, "bytes": b}
                          for c in range(17, 29) for r in (0, 1) for nic, b in (("eth0", 9e8), ("lo", 1e8))])
    (cap, fig), = fabricplots.per_nic(pd.DataFrame(), moved)
    assert overlaps(fig) == [] and outside(fig) == []
    assert len(fig.axes[0].get_yticklabels()) == 24  # every case and rank named, one line each
    close(fig)
    flows = pd.DataFrame({"run": "r", "case": 4, "transport": "tcp", "flow": [f"{i}->9" for i in range(20)],
                          "isolated_gbps": 0.12, "congested_gbps": 0.006})
    (cap, fig), = fabricplots.flows(flows)
    assert overlaps(fig) == [] and outside(fig) == []
    close(fig)


def test_first_transfer_legend_is_never_clipped():
    fvs = pd.DataFrame([{"run": "r", "transport": f"transport-{i}", "first_ms": 10.0 * (i + 1), "p50_ms": 1.0 + i}
                        for i in range(14)])
    (cap, fig), = plots.first_vs_steady(fvs)
    assert outside(fig) == [] and overlaps(fig) == []
    close(fig)


def test_the_bandwidth_figure_has_no_text_over_another(rows):
    (cap, fig), = plots.bandwidth_vs_block(rows)
    assert overlaps(fig) == [] and outside(fig) == []
    close(fig)


def exposed(tokens=(2048,)):
    base = dict(run="r", model="llama-3-8b", dtype="fp16", op="push", handshake="off", layers=32, exposed_samples=30,
                model_ms=3.0)
    return pd.DataFrame([dict(base, transport=t, overlap=ov, block_size=b, tokens=n, exposed_ms=e,
                              exposed_p95=(e + 0.5) / 1e3)
                         for n in tokens for t, e in (("tcp", 8.0), ("shm", 2.0))
                         for ov in ("serial", "streaming") for b in (16, 64)])


def test_exposed_time_is_plotted_over_the_sweep_with_one_prompt_length():
    (cap, fig), = plots.exposed_vs_prompt(exposed())
    assert fig is not None and "over what was swept" in cap and "2048 tokens" in cap
    ax = fig.axes[0]
    assert len(ax.patches) == 8 and any(isinstance(c, ErrorbarContainer) for c in ax.containers)
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert "tcp serial blk=16" in names and "shm streaming blk=64" in names
    assert overlaps(fig) == [] and outside(fig) == []
    close(fig)
    (cap, fig), = plots.exposed_vs_prompt(exposed((1024, 4096)))  # two prompt lengths: the line plot, shared y
    assert "against prompt length" in cap and fig.axes[0].get_ylim() == fig.axes[1].get_ylim()
    close(fig)


def fit_page(tmp_path, monkeypatch, seconds_of):
    """The Link model section of a synthetic run, with each figure kept (not turned into PNG) to read its text."""
    figs = []
    monkeypatch.setattr(page, "png_of", lambda fig: figs.append(fig) or b"png")
    path = synth.write(tmp_path / "fit.parquet", seconds_of, transports=("tcp",))
    p = Page("t")
    fitsection.add_section(p, [load_run(path)])
    (s,) = p.sections
    return s, figs


def texts(fig) -> str:
    return " ".join([ax.get_title() for ax in fig.axes] + [t.get_text() for ax in fig.axes for t in ax.texts])


def test_a_good_fit_is_drawn_with_its_quality_and_no_warning(tmp_path, monkeypatch):
    s, (fig,) = fit_page(tmp_path, monkeypatch, linear)
    assert re.search(r"R² 1\.00, max \|err\| \d+%", fig.axes[0].get_title())
    assert "do not extrapolate" not in texts(fig) + " ".join(s.text) + s.figures[0][0]
    close(fig)


def test_a_fit_below_r2_half_carries_a_warning_in_the_plot_and_the_text(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    s, (fig,) = fit_page(tmp_path, monkeypatch, lambda *_: float(rng.uniform(1e-3, 1e-1)))
    title = fig.axes[0].get_title()
    r2 = float(re.search(r"R² (-?[\d.]+)", title).group(1))
    assert r2 < 0.5 and "max |err|" in title
    warning = "the model does not explain these rows"
    assert warning in texts(fig).replace("\n", " ") and "do not extrapolate" in texts(fig)
    assert any(warning in t and "do not extrapolate" in t and "R² below 0.5" in t for t in s.text), s.text
    assert "do not extrapolate" in s.figures[0][0]
    assert overlaps(fig) == [] and outside(fig) == []
    close(fig)


def test_the_first_table_of_a_synthetic_page_is_the_verdict_table(tmp_path):
    path = synth.write(tmp_path / "a.parquet", linear, transports=("tcp", "shm"))
    p, _ = build([path])
    assert p.ordered()[0].tables[0][0].startswith("purchase verdict per path and model")


@pytest.mark.skipif(chromium() is None, reason="no chromium on PATH: apt-get install chromium")
def test_chromium_reads_the_verdict_table_first(tmp_path):
    path = synth.write(tmp_path / "a.parquet", linear, transports=("tcp", "shm"))
    assert report([path], str(tmp_path / "page"), say=lambda _: None) == 0
    probe = ("<script>window.addEventListener('load', () => { const d = document.createElement('div'); d.id = 'probe';"
             " d.textContent = JSON.stringify([...document.querySelectorAll('table')].map(x => [x.caption ?"
             " x.caption.textContent : '', [...document.querySelectorAll('img')].every(i => i.naturalWidth > 0)]));"
             " document.body.appendChild(d); });</script>")
    copy = tmp_path / "probe.html"
    copy.write_text((tmp_path / "page" / "report.html").read_text().replace("</body>", probe + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000", "--virtual-time-budget=5000"]
    dom = subprocess.run([chromium(), *flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True,
                         timeout=120)
    m = re.search(r'<div id="probe">(.*?)</div>', dom.stdout)
    assert m, dom.stderr[-2000:]
    tables = json.loads(m.group(1).replace("&quot;", '"'))
    assert tables[0][0].startswith("purchase verdict per path and model")  # the page's first table
    assert tables[0][1]  # every plot decoded
