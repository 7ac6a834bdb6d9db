"""tools/mutants.py (`make check-mutants`) takes each honesty mechanism out of the tree in turn: each of its lines
is still in the tree exactly once, and each mutated file still compiles (a mutant that fails to import would be
killed by any test, and prove nothing about the mechanism)."""
import ast
import os
import sys

import pytest
from helpers.launch import ROOT

TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, TOOLS)
try:
    import mutants as M
finally:
    sys.path.remove(TOOLS)


@pytest.mark.parametrize("m", M.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_finds_its_line_once_and_still_compiles(m):
    f, text, line = M.locate(m)
    assert f.is_file() and line > 1
    mutated = text.replace(m.old, m.new)
    assert mutated != text
    ast.parse(mutated, filename=str(f))


def test_the_five_mechanisms_are_each_taken_out():
    assert [m.name for m in M.MUTANTS] == ["every-iteration", "path-bound", "wake-bound", "exit-deadline", "poison"]
    assert len({(m.path, m.old) for m in M.MUTANTS}) == len(M.MUTANTS)


def test_an_unknown_mutant_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        M.main(["--only", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown mutant(s) nope" in err and "poison" in err


def test_a_first_failure_is_read_from_pytest_s_summary():
    out = "....F\nFAILED tests/test_x.py::test_y - AssertionError\nFAILED tests/test_z.py::t\n1 failed"
    assert M.first_failure(out) == "FAILED tests/test_x.py::test_y"
    assert M.first_failure("make: *** [check] Error 1\n") == "make: *** [check] Error 1"


def test_a_mutated_file_is_put_back_when_make_check_is_interrupted(tmp_path, monkeypatch):
    m = M.MUTANTS[-1]
    (tmp_path / m.path).parent.mkdir(parents=True)
    original = (M.ROOT / m.path).read_text()
    (tmp_path / m.path).write_text(original)
    monkeypatch.setattr(M, "ROOT", tmp_path)
    seen = []

    def interrupted(args, timeout):
        seen.append((tmp_path / m.path).read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(M, "make_check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        M.run(m, "-x", 10, tmp_path / "log")
    assert seen and m.new in seen[0] and (tmp_path / m.path).read_text() == original


def test_the_tool_s_own_test_is_always_left_out_and_a_failing_tree_judges_no_mutant(tmp_path, monkeypatch, capsys):
    calls = []

    class Done:
        pid, returncode = 0, 2

        def __init__(self, args, **kw):
            calls.append(args)

        def communicate(self, timeout=None):
            return "FAILED tests/test_x.py::test_y\n", None

    monkeypatch.setattr(M.subprocess, "Popen", Done)
    monkeypatch.setattr(M.signal, "signal", lambda *a: None)  # main's SIGTERM handler stays out of pytest
    monkeypatch.setattr(M, "dirty", lambda paths: [])
    assert M.main(["--only", "poison", "--pytest-args", "-k nothing", "--logs", str(tmp_path)]) == 1
    assert calls == [["make", "-s", "check", "PYTEST_ARGS=-k nothing --ignore=tests/test_mutants.py"]]
    assert "make check fails on the tree as it is: no mutant can be judged" in capsys.readouterr().out
