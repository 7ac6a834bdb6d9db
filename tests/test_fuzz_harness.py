"""`make fuzz`'s harness (tools/fuzz/), in-process: reading probe lists, filling a probe's command, judging a result,
the summary table; and every list in tests/probes/ parses.  No launch: the probes themselves run under `make fuzz`."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from fuzz import judge, probes, sandbox  # noqa: E402

LIST = """
category: demo
about: a list for the tests
defaults: {exit: 1, limit: 10}
probes:
  - name: refused
    run: "{mpiexec} -n 2 {kvbench} run -o {scratch}/res --tokens 0"
    line: '^kvbench: error: .*tokens'
  - name: crash
    run: "{kvbench} run"
    exit: [4, 5]
  - name: known
    run: "{kvbench} x"
    xfail: a bug filed elsewhere
"""
LINE = "kvbench: error: command line: field 'axes.tokens.0': 0 is not a positive prompt length"


@pytest.fixture
def demo() -> probes.ProbeList:
    return probes.parse(LIST, "demo.yaml")


def clean_result(**kw) -> judge.Result:
    return judge.Result(**{"code": 1, "output": "# a comment\n" + LINE + "\n", "seconds": 2.0, **kw})


def test_a_list_parses_with_its_defaults(demo):
    refused, crash, known = demo.probes
    assert demo.category == "demo" and refused.id == "demo/refused"
    assert refused.exit == (1,) and refused.limit == 10 and refused.line and refused.prefix == "kvbench:"
    assert crash.exit == (4, 5) and crash.line is None
    assert known.xfail == "a bug filed elsewhere"


@pytest.mark.parametrize("text,needle", [
    ("probes: [{name: a, run: x, exit: 1}]\n", "no category"),
    ("category: c\nprobes: []\n", "no probes"),
    ("category: c\nprobes: [{name: a, run: x}]\n", "no exit code"),
    ("category: c\nprobes: [{name: a, run: x, exit: 1, colour: red}]\n", "unknown keys colour"),
    ("category: c\nprobes: [{name: a, run: x, exit: 1, line: '('}]\n", "not a regex"),
    ("category: c\nprobes: [{name: a, run: x, exit: one}]\n", "exit must be an integer"),
    ("category: c\nprobes: [{name: a, run: x, exit: 1, limit: 0}]\n", "limit must be seconds"),
    ("category: c\nprobes: [{name: a, run: x, exit: 1}, {name: a, run: y, exit: 1}]\n", "used twice: a"),
    ("category: [\n", "not YAML"),
])
def test_a_bad_list_is_one_line_naming_its_file(text, needle):
    with pytest.raises(probes.ListError) as exc:
        probes.parse(text, "bad.yaml")
    assert str(exc.value).startswith("bad.yaml: ") and needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_clean_result_passes(demo):
    v = judge.verdict(demo.probes[0], clean_result())
    assert v.clean and v.word == "PASS" and v.ok, v.why


def test_two_kvbench_lines_fail(demo):
    why = judge.judge(demo.probes[0], clean_result(output=f"{LINE}\n{LINE.replace('error', 'timeout')}\n"))
    assert why and "2 lines start with 'kvbench:'" in why[0]


def test_two_lines_fail_even_where_no_line_is_required(demo):
    assert judge.judge(demo.probes[1], clean_result(code=4, output="kvbench: a\nkvbench: b\n"))


def test_no_line_fails_where_one_is_required(demo):
    assert judge.judge(demo.probes[0], clean_result(output="nothing\n")) == ["no line starts with 'kvbench:'"]


def test_a_line_that_does_not_match_fails(demo):
    why = judge.judge(demo.probes[0], clean_result(output="kvbench: error: something else\n"))
    assert why and why[0].startswith("its line does not match")


def test_a_traceback_fails(demo):
    out = LINE + "\nTraceback (most recent call last):\n  File 'x', line 1\nValueError: x\n"
    assert judge.judge(demo.probes[0], clean_result(output=out)) == ["a Python traceback in its output"]


def test_a_leftover_fails(demo):
    why = judge.judge(demo.probes[0], clean_result(shm_left=["mpich_shm_abc", "kvbench_r1_r0_p7"]))
    assert why == ["left in /dev/shm: mpich_shm_abc, kvbench_r1_r0_p7"]


def test_a_wrong_exit_code_fails(demo):
    assert judge.judge(demo.probes[0], clean_result(code=0)) == ["exit 0, expected 1"]
    assert judge.judge(demo.probes[1], clean_result(code=1)) == ["exit 1, expected 4 or 5"]


def test_the_launchers_own_file_is_noted_not_judged(demo):
    v = judge.verdict(demo.probes[0], clean_result(written=["/tmp/hydra_hwloc_xmlfile_Ab12"]))
    assert v.clean and v.notes == ["/tmp/hydra_hwloc_xmlfile_Ab12"] and "note: the launcher left" in judge.report_line(v)
    assert not judge.verdict(demo.probes[0], clean_result(written=["/tmp/hydra_hwloc_xmlfile_x/../../etc"])).clean


@pytest.mark.parametrize("kw,needle", [
    ({"code": None, "timed_out": True}, "did not end within its limit of 10 s"),
    ({"seconds": 12.5}, "took 12.5 s, over its limit of 10 s"),
    ({"written": ["/work/x"]}, "wrote outside its scratch folder: /work/x"),
    ({"stray": ["python (pid 7)"]}, "processes still running after it ended"),
    ({"planted": ["/s/rows.json is no longer a link"]}, "a planted link was followed or removed"),
    ({"sandbox": "mount: denied"}, "sandbox: mount: denied"),
])
def test_the_other_checks_fail(demo, kw, needle):
    why = judge.judge(demo.probes[0], clean_result(**kw))
    assert any(needle in w for w in why), why


def test_a_known_failure_is_reported_apart(demo):
    known = demo.probes[2]
    failing = judge.verdict(known, clean_result(code=3))
    assert failing.word == "XFAIL" and failing.ok and "known: a bug filed elsewhere" in judge.report_line(failing)
    passing = judge.verdict(known, clean_result())
    assert passing.word == "XPASS" and not passing.ok and "remove its xfail" in judge.report_line(passing)


def test_the_summary_counts_per_category(demo):
    vs = [judge.verdict(demo.probes[0], clean_result()), judge.verdict(demo.probes[1], clean_result()),
          judge.verdict(demo.probes[2], clean_result(code=3))]
    rows = judge.summary(vs)
    assert rows == [("demo", 3, 1, 1), ("all", 3, 1, 1)]
    md = judge.table(rows, markdown=True).splitlines()
    assert md[0] == "| category | probes | clean | known failures |" and md[2] == "| demo | 3 | 1 | 1 |"
    assert judge.table(rows).splitlines()[1].split() == ["demo", "3", "1", "1"]


def test_a_command_fills_its_placeholders(demo, tmp_path):
    tools = {"mpiexec": "/v/mpiexec", "kvbench": "/v/kvbench", "python": "/v/python"}
    argv = probes.command(demo.probes[0], tmp_path, tools)
    assert argv == ["/v/mpiexec", "-n", "2", "/v/kvbench", "run", "-o", f"{tmp_path}/res", "--tokens", "0"]
    p = probes.Probe("c", "n", "{kvbench} run --tokens {nines:50} --matrix {gen:bomb}", (1,))
    argv = probes.command(p, tmp_path, tools)
    assert argv[3] == "9" * 50 and argv[5] == str(tmp_path / "bomb.yaml")
    assert "*a8" in (tmp_path / "bomb.yaml").read_text()


def test_a_planted_link_is_checked_after_the_run(tmp_path):
    p = probes.Probe("c", "n", "{kvbench} run --json {gen:exportlink}", (1,))
    link = probes.command(p, tmp_path, {"kvbench": "k"})[-1]
    assert os.path.islink(link) and sandbox.planted(tmp_path) == []
    (tmp_path / "elsewhere" / "precious.txt").write_text("overwritten through the link")
    assert sandbox.planted(tmp_path) == [f"{tmp_path / 'elsewhere' / 'precious.txt'} changed"]
    os.unlink(link)
    assert sandbox.planted(tmp_path) == [f"{link} is no longer a link"]


def test_an_unknown_list_is_named():
    with pytest.raises(probes.ListError, match="no probe list for nosuch"):
        probes.load_all(only=["nosuch"])


def test_every_probe_list_parses_and_names_a_category():
    files = sorted(probes.PROBES.glob("*.yaml"))
    assert files, f"no probe lists in {probes.PROBES}"
    lists = probes.load_all()
    assert len({pl.category for pl in lists}) == len(lists) == len(files)  # one category per file
    for path, pl in zip(files, lists):
        assert pl.category == path.stem, f"{path}: category {pl.category!r}, expected the file's name"
        assert pl.about, f"{path}: no `about`"
        for p in pl.probes:
            assert not probes.placeholders_known(p), f"{p.id}: unknown placeholders {probes.placeholders_known(p)}"
            # results go inside the probe's scratch folder: {scratch}/... or a folder a {gen:...} made there
            assert not re.search(r" -o (?!\{scratch\}|\{gen:)", p.run), f"{p.id}: -o outside its scratch folder"
    assert sum(len(pl.probes) for pl in lists) <= 60  # `make fuzz` stays a few minutes
