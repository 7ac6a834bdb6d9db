"""The suite's own rules (issue 47): no test module is a library for another, no non-strict xfail, one way in to
the helpers.  A grep over tests/: each rule fails on the line that breaks it."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SOURCES = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)

RULES = {
    "a test module imports another (its helpers belong in tests/helpers/)": re.compile(r"^\s*(from|import) test_\w+"),
    "a non-strict xfail (it cannot fail)": re.compile(r"xfail\([^)]*strict\s*=\s*False"),
    "conftest imported as a module (pytest loads it once; helpers/ is the way in)":
        re.compile(r"^\s*(from|import) (tests\.)?conftest\b"),
}


def breaches(rules=RULES, sources=SOURCES) -> list[str]:
    out = []
    for p in sources:
        for no, line in enumerate(p.read_text().splitlines(), 1):
            out += [f"{p.name}:{no}: {why}" for why, rx in rules.items() if rx.search(line)]
    return out


def test_no_test_module_imports_another_no_lax_xfail_no_conftest_import():
    assert breaches() == []


def test_each_rule_catches_its_breach(tmp_path):
    bad = tmp_path / "test_bad.py"
    lax = "strict" + "=False"  # spelled apart, so that this file does not break its own rule
    bad.write_text(f"from test_report import chromium\n@pytest.mark.xfail(reason='x', {lax})\nimport tests.conftest\n")
    assert [f.split(": ", 1)[0] for f in breaches(sources=[bad])] == ["test_bad.py:1", "test_bad.py:2", "test_bad.py:3"]
