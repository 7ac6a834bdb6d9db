"""Hostile inputs at the door (issue 45, items 1, 3 and 8): a trace past 2^63, a line nested 200,000 deep, a
5000-digit integer, matrix cells and pool sizes of 1e999, a YAML alias bomb, a fill file that is not there,
--ci-budget without --target-ci, --nic naming a missing NIC beside loopback: each is one line naming the input
(its file and line where it has one) and exit 1, within seconds, with no traceback and nothing written; and a
reader's unexpected exception on rank 0 is one line and exit 1 on every rank, not a 120 s start-up timeout."""
from __future__ import annotations

import json
import time

import pytest
from helpers.args import SHM_SMALL
from helpers.asserts import assert_nothing_written, assert_one_line
from helpers.launch import kvbench_cli

from kvbench.cli.main import build_parser
from kvbench.config import runconfig
from kvbench.model import matrix as X
from kvbench.model import trace as T

GOOD = {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}


def bomb(levels: int = 9) -> str:
    """A YAML alias bomb: ``levels`` lists of 9 aliases of the one below, 9^levels strings once expanded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def trace_file(tmp_path, name: str, bad_line: str) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(GOOD) + "\n" + bad_line + "\n")
    return str(p)


HOSTILE_TRACES = {
    "input-past-2^63": (json.dumps(dict(GOOD, input_length=2**64)), ["'input_length'", "18446744073709551616"]),
    "output-past-2^63": (json.dumps(dict(GOOD, output_length=2**63)), ["'output_length'", "9223372036854775808"]),
    "nested-200000": ("[" * 200_000 + "]" * 200_000, ["nested too deep"]),
    "5000-digits": ('{"timestamp": 1, "input_length": ' + "7" * 5000 + ', "output_length": 1, "hash_ids": []}',
                    ["5,000 digits"]),
}


def door(args: list[str], tmp_path) -> str | None:
    """Rank 0's door on ``kvbench run ARGS`` for 2 ranks: None (accepted) or its one line."""
    argv = ["run", "-o", str(tmp_path / "results"), *SHM_SMALL, *args]
    t0 = time.monotonic()
    cfg, line = runconfig.door(build_parser().parse_args(argv), argv, 2)
    assert time.monotonic() - t0 < 10
    assert (cfg is None) != (line is None)
    if line is not None:
        assert "\n" not in line and len(line) < 400, line
    return line


@pytest.mark.parametrize("kind", sorted(HOSTILE_TRACES))
def test_hostile_trace_is_a_trace_error_naming_file_and_line(tmp_path, kind):
    bad, needles = HOSTILE_TRACES[kind]
    path = trace_file(tmp_path, f"{kind}.jsonl", bad)
    with pytest.raises(T.TraceError) as exc:
        T.read(path)
    line = str(exc.value)
    assert line.startswith(f"{path}:2: ") and "\n" not in line and len(line) < 300, line
    assert all(n in line for n in needles), line


@pytest.mark.launches
@pytest.mark.parametrize("kind", sorted(HOSTILE_TRACES))
def test_kvbench_trace_refuses_a_hostile_trace_in_one_line(tmp_path, kind):
    bad, needles = HOSTILE_TRACES[kind]
    path = trace_file(tmp_path, f"{kind}.jsonl", bad)
    r = kvbench_cli("trace", path, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvbench: error: {path}:2: "), r.stderr
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize("kind", sorted(HOSTILE_TRACES))
def test_run_door_refuses_a_hostile_trace(tmp_path, kind):
    bad, needles = HOSTILE_TRACES[kind]
    path = trace_file(tmp_path, f"{kind}.jsonl", bad)
    line = door(["--trace", path, "--speed", "100"], tmp_path)
    assert line and line.startswith(f"--trace: {path}:2: ") and all(n in line for n in needles), line


@pytest.mark.parametrize("cell", ["1e999", "1e999MiB", "1e300", "9" * 5000])
def test_matrix_cell_past_any_size_is_one_line(tmp_path, cell):
    p = tmp_path / "m.csv"
    p.write_text(f"0,{cell}\n1,0\n")
    line = door(["--scheme", "matrix", "--matrix", str(p)], tmp_path)
    assert line and line.startswith(f"--matrix {p}: cell [0][1]"), line
    assert len(line) < 300  # the cell is quoted, 80 characters of it at most
    with pytest.raises(X.MatrixError):
        X.parse_cell(cell)


@pytest.mark.parametrize("sizes", ["1e999", "1e999MiB", "1,1e999GiB", "9" * 5000])
def test_pool_sizes_past_any_size_are_one_line(tmp_path, sizes):
    line = door(["--pool-sizes", sizes], tmp_path)
    assert line and "pool_sizes" in line and len(line) < 300, line


def test_matrix_alias_bomb_is_refused_at_once(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(bomb() + "matrix: [[0, *a8], [1, 0]]\n")
    line = door(["--scheme", "matrix", "--matrix", str(p)], tmp_path)  # door() asserts < 10 s
    assert line and line.startswith(f"--matrix {p}: ") and "alias" in line, line


@pytest.mark.parametrize("text,needle", [
    ("matrix: &a [[0, 1], *a]\n", "contains itself"),
    ("matrix: [[0, " + "9" * 5000 + "], [1, 0]]\n", "5,000 digits"),
    ("matrix: " + "[" * 1000 + "]" * 1000 + "\n", "nested more than"),
])
def test_matrix_yaml_past_its_limits_is_one_line(tmp_path, text, needle):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    line = door(["--scheme", "matrix", "--matrix", str(p)], tmp_path)
    assert line and line.startswith(f"--matrix {p}: ") and needle in line, line


def test_suite_alias_bomb_in_a_field_is_refused_at_once(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(bomb() + "name: bomb\nscheme: matrix\nmatrix: [[0, *a8], [1, 0]]\n")
    line = door([str(p)], tmp_path)
    assert line and str(p) in line and "alias" in line, line


def test_an_unexpected_exception_on_rank_0_is_one_line(monkeypatch, tmp_path):
    def boom(*_a, **_k):
        raise OverflowError("x" * 10_000)

    monkeypatch.setattr(runconfig, "fresh", boom)
    line = door([], tmp_path)
    assert line.startswith("the run's configuration could not be checked: OverflowError: xxx")
    assert len(line) < 400


@pytest.mark.parametrize("args,needles", [
    (["--fill", "file:/nonexistent.npy"], ["--fill 'file:/nonexistent.npy'", "no such file"]),
    (["--ci-budget", "5"], ["--ci-budget 5", "--target-ci"]),
    (["--nic", "lo,nosuch0"], ["--nic lo,nosuch0", "'nosuch0'"]),
])
def test_leftovers_refused_at_the_door(tmp_path, args, needles):
    line = door(args, tmp_path)
    assert line and all(n in line for n in needles), line


def test_a_fill_file_that_is_no_dump_is_refused_at_the_door(tmp_path):
    p = tmp_path / "kv.npy"
    p.write_bytes(b"not numpy at all")
    line = door(["--fill", f"file:{p}"], tmp_path)
    assert line and "not a .npy or .safetensors dump" in line, line


def test_ci_budget_with_a_target_passes(tmp_path):
    assert door(["--ci-budget", "5", "--target-ci", "5%"], tmp_path) is None


# on real ranks: one line, exit 1 from every rank within seconds, nothing written --------------------------------

def test_hostile_trace_on_real_ranks(kvrun, tmp_path):
    bad, needles = HOSTILE_TRACES["input-past-2^63"]
    path = trace_file(tmp_path, "big.jsonl", bad)
    r = kvrun([*SHM_SMALL, "--trace", path, "--speed", "100"], timeout=60)
    assert_one_line(r, f"{path}:2", *needles)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("what", ["matrix", "pool-sizes", "fill"])
def test_refused_on_real_ranks(kvrun, tmp_path, what):
    p = tmp_path / "m.csv"
    p.write_text("0,1e999MiB\n1,0\n")
    args, needle = {"matrix": (["--scheme", "matrix", "--matrix", str(p)], f"--matrix {p}: cell [0][1]"),
                    "pool-sizes": (["--pool-sizes", "1e999"], "pool_sizes': '1e999'"),
                    "fill": (["--fill", "file:/nonexistent.npy"], "--fill 'file:/nonexistent.npy': no such file")}[what]
    assert_one_line(kvrun([*SHM_SMALL, *args], timeout=60), needle)
    assert_nothing_written(tmp_path)


def test_unexpected_exception_on_rank_0_ends_every_rank_at_once(kvrun, tmp_path):
    """A reader that raises something other than ConfigError (planted through sitecustomize) is one line and
    exit 1 on every rank, not a traceback while rank 1 waits out the 120 s start-up deadline."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(
        "import os, sys\n"
        "sys.path.insert(0, os.getcwd())  # the checkout the runs start in (site runs before -m adds it)\n"
        "import kvbench.model.trace as T\n"
        "def read(*a, **k):\n"
        "    raise OverflowError('planted by the test')\n"
        "T.read = read\n")
    t0 = time.monotonic()
    r = kvrun([*SHM_SMALL, "--trace", "mooncake-synthetic", "--speed", "100"], timeout=60,
              env={"PYTHONPATH": str(tmp_path / "hook")})
    assert_one_line(r, "could not be checked", "OverflowError: planted by the test")
    assert time.monotonic() - t0 < 60
    assert_nothing_written(tmp_path)
