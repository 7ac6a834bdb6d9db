"""suites/procurement*.yaml: the buyer's sweep covers what make procurement promises, and make procurement's driver
writes its report and plan beside the results without overwriting anything."""
import os
import subprocess
import sys

import pytest
from helpers.launch import ROOT

from kvbench import transports
from kvbench.config import suite as S


def test_procurement_suites_cover_every_axis_the_buyer_needs():
    bw, ov = S.load("procurement"), S.load("procurement-overlap")
    for s in (bw, ov):
        assert set(s.axes.transport) == set(transports.names())  # every transport; unavailable ones say why
        assert s.axes.op == ["push", "pull"] and s.check == "all"  # every timed iteration checked
        assert s.axes.model == ["llama-3-70b", "llama-3-8b", "deepseek-v3"]
        assert s.timeout <= 120 and s.iters * s.axes.tokens[0] > 0  # the per-case budget is stated
        assert s.iters >= 20 and s.target_ci == 2.0 and 0 < s.ci_budget <= 10  # n >= 20 on every row, p50 earned
    assert min(bw.axes.block_size) == 16 and max(bw.axes.block_size) == 256
    assert set(bw.axes.dtype) == {"fp16", "fp8-e4m3"} and bw.axes.overlap == ["serial"]
    assert bw.axes.prefill_ms == [0.0]  # bandwidth rows: no prefill clock inside their times
    assert ov.axes.overlap == ["serial", "streaming"] and ov.axes.prefill_ms == ["auto"]
    assert len(S.expand(bw)) == 11 * 2 * 3 * 3 * 2 and len(S.expand(ov)) == 11 * 2 * 3 * 2


@pytest.mark.launches
def test_driver_writes_report_and_plan_beside_the_results(tmp_path):
    # the driver on the smallest sweep: shm and an unavailable transport, one model, one block size
    env = dict(os.environ, PYTHONPATH=ROOT)
    small = "-t shm,verbs --tokens 32 -n 2 -w 0 --ci-budget 0.2 --rounds 1 -m llama-3-8b -b 16 -e 16 --dtype fp16 -o " + str(tmp_path)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "procurement.py"), "--kvbench-args", small,
                        "--label", "test VM"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (folder,) = os.listdir(tmp_path)
    names = sorted(os.listdir(tmp_path / folder))
    assert sorted(n.split("_", 1)[1] for n in names) == [
        "procurement-overlap.meta.json", "procurement-overlap.parquet", "procurement.meta.json",
        "procurement.parquet", "procurement.plan.txt", "procurement.report", "procurement.report.txt"]
    page = tmp_path / folder / next(n for n in names if n.endswith("procurement.report"))
    assert sorted(p.name for p in page.iterdir() if p.is_file())[:3] == ["report.csv", "report.html", "report.md"]
    report = (tmp_path / folder / next(n for n in names if n.endswith("report.txt"))).read_text()
    plan = (tmp_path / folder / next(n for n in names if n.endswith("plan.txt"))).read_text()
    assert report.startswith("# machine: test VM\n") and "unavailable" in report
    assert "[measured]" in plan and "100GbE [nominal]" in plan and "400G IB NDR [nominal]" in plan
