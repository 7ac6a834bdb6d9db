"""make procurement tells the truth about its runs (issue 46 item 1): it exits with the worst of its runs' codes, its
plan and page say NOT OK at the top, and the plan draws no rate from a case whose check failed or that is SUSPECT."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from kvbench.job.status import exit_code, worst
from kvbench.report.summary import trusted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_worst_of_several_runs_decides_the_exit_code():
    ok, failed, suspect = exit_code("OK"), exit_code("FAILED"), exit_code("SUSPECT")
    assert worst([ok, ok]) == 0 and worst([]) == 0
    assert worst([ok, suspect]) == suspect == 6 and worst([suspect, failed]) == failed == 2
    assert worst([exit_code("NOTHING MEASURED"), ok]) == 3 and worst([exit_code("INTERRUPTED"), suspect]) == 130
    assert worst([ok, 1]) == 1 and worst([ok, 137]) == 137  # an input error, a launcher killed from outside


def test_a_plan_takes_no_rate_from_wrong_or_suspect_cases():
    st = pd.DataFrame({"case": [1, 2, 3, 4], "nwrong": [0, 16, 0, 0], "gbps": [1.0, 9.0, 8.0, 1.2]})
    meta = {"suspects": ["SUSPECT: case 3 (shm push m 16 tokens, bulk, host, serial): 8.00 GB/s beyond ..."]}
    kept, left_out = trusted(st, meta)
    assert list(kept["case"]) == [1, 4] and left_out == 2
    assert trusted(st.drop(columns=["nwrong"]), {})[1] == 0  # an older file without the counts: all kept


@pytest.mark.launches
def test_a_procurement_whose_runs_failed_their_check_exits_non_zero_and_says_so_first(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    small = ("-t shm,verbs --tokens 32 -n 2 -w 0 --ci-budget 0.2 --rounds 1 -m llama-3-8b -b 16 -e 16 --dtype fp16 "
             f"--inject-corruption 1 -o {tmp_path}")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "procurement.py"), "--kvbench-args", small,
                        "--label", "test VM"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == exit_code("FAILED") == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "NOT OK: FAILED (exit code 2)" in r.stdout
    (folder,) = os.listdir(tmp_path)
    names = os.listdir(tmp_path / folder)
    plan = (tmp_path / folder / next(n for n in names if n.endswith("plan.txt"))).read_text().splitlines()
    assert plan[0] == "# machine: test VM" and plan[1].startswith("# NOT OK: kvbench: error: plan: --fabric ")
    assert "found wrong bytes or is SUSPECT: no rate to plan with" in plan[1]
    assert not any("PAYS" in line or "[measured]" in line for line in plan)  # no verdict from the failed rows
    page = tmp_path / folder / next(n for n in names if n.endswith("procurement.report")) / "report.md"
    head = page.read_text()[:3000]
    assert "NOT OK: " in head and " ended FAILED: " in head, head
