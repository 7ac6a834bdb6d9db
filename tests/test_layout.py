"""The house in wings (docs/layout.md): no import cycle, no import against the wing order, the map current."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import layout as L  # noqa: E402

modules = functools.cache(L.modules)  # every module parsed once for the file's tests (the tests that plant an import read their own)


def test_no_import_cycle():
    assert L.cycles(modules()) == []


def test_no_import_against_the_wing_order():
    assert L.upward(modules()) == []


def test_the_checks_can_fail():
    """A cycle and an upward import planted in freshly read modules are each found."""
    mods = L.modules()
    mods["kvbench.job.comm"].imports.append(("kvbench.job.status", 1, True))
    mods["kvbench.job.status"].imports.append(("kvbench.job.comm", 1, False))  # function-level counts too
    assert ["kvbench.job.comm", "kvbench.job.status"] in L.cycles(mods)
    mods = L.modules()
    mods["kvbench.model.shapes"].imports.append(("kvbench.cli.main", 2, False))
    assert [line for line in L.upward(mods) if "kvbench.cli.main" in line] == [
        "kvbench/model/shapes.py:2: model imports kvbench.cli.main (cli is not below model)"]


def test_function_level_imports_only_for_what_loads_an_optional_library():
    """An import inside a function is for a module that loads an optional or slow package (torch, pandas, an
    engine, MPI), or a probe inside a try; every other kvbench import stands at the top of its module."""
    assert L.needless_lazy(modules()) == []


def test_a_needless_function_level_import_is_found():
    mods = L.modules()
    mods["kvbench.model.shapes"].imports.append(("kvbench.model.yamlfile", 99, False))
    assert L.needless_lazy(mods) == ["kvbench/model/shapes.py:99: kvbench.model.yamlfile imported inside a "
                                     "function, though it loads nothing optional"]


def test_only_the_package_doors_and_c_sources_at_the_top():
    top = {n for n in os.listdir(os.path.join(ROOT, "kvbench")) if not n.startswith((".", "__pycache__"))}
    loose = {n for n in top if n.endswith(".py") and n not in ("__init__.py", "__main__.py")}
    assert loose == set()


def test_no_module_over_400_lines():
    assert {m.name: m.lines for m in modules().values() if m.lines > 400} == {}


def test_every_wing_says_its_job():
    mods = modules()
    for line in L.WINGS:
        for w in line:
            if w in ("kvbench", "__main__"):
                continue
            doc = mods[f"kvbench.{w}"].doc
            assert len(doc) > 40, f"kvbench/{w}/__init__.py has no docstring that says its job"


def test_layout_doc_is_generated_from_the_tree():
    with open(L.DOC) as fh:
        assert fh.read() == L.render(modules()), "docs/layout.md is stale: run python tools/layout.py"


@pytest.mark.launches
def test_a_rank_loads_no_pandas_until_it_writes_a_table():
    # every rank imports the run's modules; only rank 0's writer (results/store.py) needs frames, and pandas
    # costs a rank most of a second of CPU at every launch, which matters where ranks outnumber cores
    code = ("import sys, kvbench.cli.main, kvbench.cli.run, kvbench.harness.loop, kvbench.harness.load\n"
            "print(sorted(m for m in ('pandas', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=L.ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
