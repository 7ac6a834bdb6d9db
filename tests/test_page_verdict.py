"""The page leads with the decision: the plan's purchase verdict per path and model (read from the same function as
`kvbench plan`), then each path's typical paged GB/s, the median of its paged rows (never the best), both on the first
screen. Reads a committed reference run (results/reference/vm)."""
from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from helpers.launch import chromium

from kvbench.report import plan, summary
from kvbench.report.build import main as report
from kvbench.report.stats import load_run
from kvbench.report.typical import by_path, typical_paged
from kvbench.report.verdicts import PROCUREMENT
from kvbench.report.verdicttable import page_verdicts
from kvbench.results.samples import p50_ci

REF = Path(__file__).resolve().parents[1] / "results" / "reference" / "vm" / "20261201-184435_procurement.parquet"
MODELS, DTYPES = ["llama-3-70b", "llama-3-8b", "deepseek-v3"], ["fp16", "fp8-e4m3"]


@pytest.fixture(scope="module")
def page_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("page") / "page"
    assert report([str(REF)], str(out), say=lambda _: None) == 0
    return out


def test_typical_gbps_is_the_median_of_the_paged_rows_never_the_best():
    st = load_run(str(REF)).st
    paged = st[(st["kind"] == "bandwidth") & (st["variant"] == "paged") & (st["status"] == "ok")]
    t = typical_paged(paged).set_index(["path", "op"])
    for (tr, op), rows in paged.groupby(["transport", "op"]):
        got = t.loc[(tr, op)]
        assert got["typical paged GB/s"] == f"{rows['gbps'].median():.2f}" != f"{rows['gbps'].max():.2f}"
        assert got["n (rows)"] == str(len(rows))
        lo, hi = p50_ci(rows["gbps"])
        assert got["95% interval"] == f"{lo:.2f}-{hi:.2f}" and lo <= rows["gbps"].median() <= hi
    assert t.loc[("loopback", "push"), "status"] == "reference"  # in-process: a reference, never a candidate
    assert list(t.reset_index()["path"])[-2:] == ["loopback", "loopback"]
    shm = by_path(typical_paged(paged)).set_index("path").loc["shm"]
    assert shm["push GB/s"].startswith(t.loc[("shm", "push"), "typical paged GB/s"] + " (")


def test_median_interval_is_the_order_statistics_that_hold_95_percent():
    assert all(math.isnan(x) for x in p50_ci([1, 2, 3, 4, 5]))  # five rows hold no 95% interval
    assert p50_ci([6, 1, 5, 2, 4, 3]) == (1.0, 6.0)  # 1 - 2/64 = 96.9%
    assert p50_ci(range(1, 21)) == (6.0, 15.0)  # n = 20: the 6th and 15th


def test_a_path_mostly_short_of_its_ci_target_is_not_measured_to_the_target():
    base = dict(run="r", transport="tcp", memory="host", op="push", variant="paged", nwrong_checked=0, noise=False,
                ci_target_pct=2.0, payload_bytes=1e9)
    rows = pd.DataFrame([dict(base, gbps=g, ci_pct=c) for g, c in ((1.0, 1.5), (9.0, 16.0), (2.0, 12.0))])
    (r,) = typical_paged(rows).to_dict("records")
    assert r["typical paged GB/s"] == "2.00" and r["status"] == "not measured to the target"
    assert "2 of 3 rows missed the ±2% CI target" in r["why"]


def test_the_page_and_the_plan_read_the_same_verdicts():
    table, notes = page_verdicts(str(REF), MODELS, DTYPES)
    assert "loopback" not in set(table["path"]) and any("loopback" in n for n in notes)
    inp = plan.PlanInput(models=MODELS, dtypes=DTYPES, fabrics=[str(REF)], **PROCUREMENT)
    said = plan.lines(inp, plan.measured_fabrics(str(REF), inp.block_size))
    order = ["DOES NOT PAY", "MARGINAL", "PAYS"]
    for _, row in table.iterrows():
        for model in MODELS:
            words = [re.search(r": (PAYS|MARGINAL|DOES NOT PAY): ", ln).group(1) for ln in said
                     if ln.startswith(f"{row['path']} (") and f"] {model} " in ln]
            assert len(words) == 2 and row[model].startswith(min(words, key=order.index) + " ")


def test_the_exposed_time_verdict_never_names_an_in_process_copy():
    base = dict(run="r", model="m", tokens=1024, op="push", overlap="streaming", T_ms=2.0, prefill_s=0.1,
                model_ms=1.0, samples=10)
    ex = pd.DataFrame([dict(base, transport="loopback", exposed_ms=0.1), dict(base, transport="tcp", exposed_ms=1.0)])
    assert summary.exposed_per_model(ex).iloc[0]["best path"] == "tcp push streaming"


def test_the_first_screen_is_the_verdict_then_the_typical_gbps(page_dir, tmp_path):
    md = (page_dir / "report.md").read_text()
    sec = md[md.index("## Summary"):]
    assert sec.index("*purchase verdict per path") < sec.index("*typical paged GB/s per path") < sec.index("\n## ")
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: apt-get install chromium")
    probe = ("<script>window.addEventListener('load', () => { const d = document.createElement('div'); d.id = 'probe';"
             " const t = [...document.querySelectorAll('table')].map(x => [x.caption ? x.caption.textContent : '',"
             " x.getBoundingClientRect().bottom]);"
             " d.textContent = JSON.stringify(t); document.body.appendChild(d); });</script>")
    copy = tmp_path / "probe.html"
    copy.write_text((page_dir / "report.html").read_text().replace("</body>", probe + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([exe, *flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<div id="probe">(.*?)</div>', dom.stdout)
    assert m, dom.stderr[-2000:]
    tables = json.loads(m.group(1).replace("&quot;", '"'))
    assert tables[0][0].startswith("purchase verdict per path and model")  # the page's first table
    assert tables[1][0].startswith("typical paged GB/s per path")
    assert tables[1][1] <= 1000  # both end within a 1400 x 1000 first screen
    shot = tmp_path / "first.png"
    subprocess.run([exe, *flags[:-1], f"--screenshot={shot}", (page_dir / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000
