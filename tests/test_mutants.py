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
