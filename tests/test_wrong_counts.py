"""A row's #wrong sums every checked iteration (issue 42, item 3): under -c all a timed iteration's wrong elements
show in the live table, in `kvbench report` (terminal, md, csv, html) and on the page, with the count of checked
iterations (#chk) they cover; an older file without per-iteration counts reads the check pass's, as before."""
from __future__ import annotations

import html as H
import re

import numpy as np
import pandas as pd
from helpers.args import TEN
from helpers.launch import kvbench_cli, liar_env, table_rows

from kvbench.report import tables as T

ENV = liar_env()
# lie-skip skips timed iteration 1 of 10 and moves the check pass: only -c all sees it
TEN_ALL = [*TEN, "-c", "all"]


def _rows(case: int, iters, nwrong, role: str = "decode", workload: str = "none") -> list[dict]:
    return [{"case": case, "iter": it, "nwrong": w, "role": role, "workload": workload} for it, w in zip(iters, nwrong)]


def test_wrong_counts_sum_every_checked_iteration_of_the_destination():
    df = pd.DataFrame(
        _rows(1, [-1, 0, 1, 2], [0, 0, 7, 0]) + _rows(1, [-1, 0, 1, 2], [0, 0, 0, 0], role="prefill")  # -c all
        + _rows(1, [-1, 0, 1, 2], [1, 2, 3, 0], role="both")  # a loopback entry of the same case: same iterations
        + _rows(2, [-1, 0, 1], [5, np.nan, np.nan])  # -c 1 (or a file older than -c all): the check pass alone
        + _rows(3, [-1, 0], [np.nan, np.nan])  # -c 0: not checked
        + _rows(4, [0, 1, 2], [1, 0, np.nan], workload="poisson:20")  # a workload: each checked request
        + _rows(5, [-1, 0, 0], [np.nan, 4, np.nan]))  # a timed count without a check pass
    got = T.wrong_counts(df)
    assert got["nwrong_checked"].to_dict() == {1: 13.0, 2: 5.0, 4: 1.0, 5: 4.0}
    assert got["nwrong_iters"].to_dict() == {1: 4.0, 2: 1.0, 4: 2.0, 5: 1.0}
    assert 3 not in got.index  # nothing checked: the table says '-'
    assert T.wrong_counts(pd.DataFrame(_rows(1, [-1], [np.nan]))).empty
    old = pd.DataFrame(_rows(1, [-1, 0], [2, np.nan])).drop(columns=["role", "workload"])  # columns a file may lack
    assert T.wrong_counts(old).to_dict("list") == {"nwrong_checked": [2.0], "nwrong_iters": [1.0]}
    r = {"nwrong_checked": 13.0, "nwrong_iters": 4.0}
    assert (T.wrong_text(r), T.checks_text(r)) == ("13", "4")
    r = {"nwrong_checked": np.nan, "nwrong_iters": np.nan}
    assert (T.wrong_text(r), T.checks_text(r)) == ("-", "-")


def _md_cells(md: str, header: str) -> list[dict]:
    """The rows of the Markdown table whose header has ``header``, keyed by its header."""
    lines = md.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("| ") and f"| {header} |" in ln)
    head = [c.strip() for c in lines[at].strip("|").split(" | ")]
    out = []
    for ln in lines[at + 2:]:
        if not ln.startswith("| "):
            break
        out.append(dict(zip(head, (c.strip() for c in ln.strip("|").split(" | ")), strict=True)))
    return out


def _html_cells(page: str, sid: str) -> list[dict]:
    """The rows of the first table in section ``sid`` of the HTML page, keyed by its header."""
    start = page.index(f'id="{sid}"')
    table = page[start: page.index("</table>", start)]
    head = [H.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
    return [dict(zip(head, (H.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)), strict=True))
            for row in re.findall(r"<tr>(<td>.*?)</tr>", table)]


def test_a_timed_iteration_that_failed_shows_in_wrong_everywhere_a_row_is_shown(kvrun, tmp_path):
    r = kvrun(TEN_ALL, env=ENV, timeout=120)
    assert r.code == 2 and r.meta()["status"] == "FAILED", r.out + r.err
    dec = r.transfers().query("role == 'decode'")
    want = int(dec["nwrong"].sum())
    assert want > 0 and int(dec.query("iter == -1")["nwrong"].sum()) == 0  # the check pass alone would read 0
    # the live table: every checked iteration (10 timed + the check pass) behind the row's count, said so
    (row,) = table_rows(r.out)
    assert (row["#wrong"], row["#chk"]) == (str(want), "11"), r.out
    assert "# #wrong = destination elements that failed the check, summed over the #chk checked iterations" in r.out
    # `kvbench report`: the terminal table as the live one
    term = kvbench_cli("report", r.results)
    assert term.returncode == 0, term.stderr
    (row,) = table_rows(term.stdout)
    assert (row["#wrong"], row["#chk"]) == (str(want), "11"), term.stdout
    # the page: md, csv and html; the summary's status says the bytes were wrong
    out = tmp_path / "page"
    rep = kvbench_cli("report", "-o", str(out), r.results, timeout=180)
    assert rep.returncode == 0, rep.stderr
    md = (out / "report.md").read_text()
    (row,) = _md_cells(md, "#chk")
    assert (row["#wrong"], row["#chk"]) == (str(want), "11"), md
    assert _md_cells(md, "status")[0]["status"].startswith("push WRONG: 1 of 1 rows left out (wrong bytes")
    csv = pd.read_csv(out / "report.csv")
    assert csv["nwrong_checked"].tolist() == [want] and csv["nwrong_iters"].tolist() == [11]
    (row,) = _html_cells((out / "report.html").read_text(), "bandwidth")
    assert (row["#wrong"], row["#chk"]) == (str(want), "11")
