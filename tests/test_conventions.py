"""The conventions nccl-tests, nixlbench and perftest users bring (issue 46 item 8): -b/-e in bytes with a unit,
--json/--csv beside the parquet, --compact's table, and `kvbench env`'s NICs and memlock."""
from __future__ import annotations

import argparse
import json
import math
import os
import resource

import numpy as np
import pandas as pd
import pytest
from helpers.launch import kvbench_cli

from kvbench.cli.info import memlock_lines, nic_lines
from kvbench.config import ConfigError
from kvbench.config.sizes import ByteSize, block_arg, in_tokens
from kvbench.model import shapes as M
from kvbench.report.compact import COMPACT_LEGEND, live_table
from kvbench.results.export import COLUMNS
from kvbench.results.schema import ROW_COLUMNS, SCHEMA_VERSION

TINY = ["-t", "shm", "-m", "llama-3-8b", "--tokens", "16", "-n", "2", "-w", "0"]
COMPACT_HEADER = ["path", "op", "size", "blocks", "GB/s", "Gb/s", "p50(us)", "n", "#wrong", "status"]


def region_bytes(model: str, dtype: str, tokens: int, tp: int = 1) -> int:
    """One region's block of ``tokens`` tokens, from the model's shape (what the rows' block_bytes is)."""
    return M.block_bytes(M.shard(M.get_model(model), tp, 1), tokens, dtype)


def norm(v):
    """A value as the exports carry it: numpy as Python, NaN, infinities and empty strings as None."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or v == "" or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return v


def written(tmp_path) -> list[str]:
    res = tmp_path / "results"
    return sorted(str(p) for p in res.rglob("*")) if res.exists() else []


# ----- -b/-e in bytes ----------------------------------------------------------------------------------------

def test_block_arg_reads_tokens_or_bytes_with_a_unit():
    assert block_arg("16") == 16 and isinstance(block_arg("16"), int)
    assert block_arg("32KiB") == ByteSize(32768, "32KiB")
    assert block_arg("1MiB").nbytes == 2**20 and block_arg("0.5KiB").nbytes == 512 and block_arg("4096B").nbytes == 4096
    for bad in ("32XB", "KiB", "1.3B", "0KiB", "-"):
        with pytest.raises(argparse.ArgumentTypeError):
            block_arg(bad)


def axes(model="llama-3-8b", dtype="fp16", tp=1):
    return {"model": [model], "dtype": [dtype], "scales": ["none"], "tp": [tp], "pp": [1]}


def flags(b=None, e=None):
    return argparse.Namespace(minblock=b, maxblock=e, stepfactor=2)


def test_bytes_become_the_tokens_whose_region_holds_them():
    assert region_bytes("llama-3-8b", "fp16", 16) == 32768  # 8 KV heads x 128 x 2 B = 2048 B per token
    out = in_tokens(flags(block_arg("32KiB"), block_arg("1MiB")), axes())
    assert (out.minblock, out.maxblock) == (16, 512)
    assert region_bytes("llama-3-8b", "fp16", out.minblock) == 32768
    assert in_tokens(flags(block_arg("32KiB")), axes(tp=2)).minblock == 32  # TP halves the heads a rank holds
    assert in_tokens(flags(block_arg("32KiB")), axes(dtype="fp8-e4m3")).minblock == 32
    mixed = flags(16, block_arg("64KiB"))
    assert (in_tokens(mixed, axes()).minblock, in_tokens(mixed, axes()).maxblock) == (16, 32)
    plain = flags(16, 64)
    assert in_tokens(plain, axes()) is plain  # tokens pass as they are


def test_a_byte_size_that_is_no_power_of_two_of_tokens_names_the_nearest():
    with pytest.raises(ConfigError) as exc:
        in_tokens(flags(block_arg("48KiB")), axes())
    assert str(exc.value) == ("-b 48KiB: not a whole power-of-two number of tokens for llama-3-8b fp16 (2,048 B per "
                              "token in a region): nearest 32KiB (16 tokens) or 64KiB (32 tokens)")
    with pytest.raises(ConfigError, match=r"nearest 1\.125KiB \(1 token\) or 2\.25KiB \(2 tokens\)"):
        in_tokens(flags(block_arg("2KiB")), axes("deepseek-v3"))  # MLA: (512 + 64) x 2 B = 1152 B per token
    with pytest.raises(ConfigError, match="larger than -e 32KiB"):
        in_tokens(flags(block_arg("64KiB"), block_arg("32KiB")), axes())
    two = {**axes(), "model": ["llama-3-8b", "deepseek-v3"]}
    with pytest.raises(ConfigError, match="llama-3-8b fp16: 2,048 B; deepseek-v3 fp16: 1,152 B"):
        in_tokens(flags(block_arg("32KiB")), two)


def test_run_b_32kib_moves_32_kib_blocks_and_a_bad_size_is_refused(kvrun, tmp_path):
    r = kvrun([*TINY, "-b", "32KiB"])
    assert r.code == 0, r.err
    paged = r.transfers().query("variant == 'paged'")
    assert set(paged["block_size"]) == {16} and set(paged["block_bytes"]) == {region_bytes("llama-3-8b", "fp16", 16)}
    assert set(paged["block_bytes"]) == {32768}

    bad = kvrun([*TINY, "-b", "48KiB"], out_dir=tmp_path / "bad")
    assert bad.code == 1 and bad.results is None
    assert bad.err.strip() == ("kvbench: error: -b 48KiB: not a whole power-of-two number of tokens for llama-3-8b "
                               "fp16 (2,048 B per token in a region): nearest 32KiB (16 tokens) or 64KiB (32 tokens)")
    assert not (tmp_path / "bad").exists()


# ----- --json / --csv ----------------------------------------------------------------------------------------

def test_json_and_csv_rows_are_the_parquet_rows(kvrun, tmp_path):
    js, cs = tmp_path / "rows.jsonl", tmp_path / "rows.csv"
    r = kvrun([*TINY, "--json", str(js), "--csv", str(cs)])
    assert r.code == 0, r.err
    table = r.table()
    assert f"# json: {js} ({len(table)} rows)" in r.out and f"# csv: {cs} ({len(table)} rows)" in r.out

    rows = [json.loads(line) for line in js.read_text().splitlines()]
    assert len(rows) == len(table) > 0
    assert all(list(row) == COLUMNS for row in rows) and COLUMNS == ["schema_version", *ROW_COLUMNS]
    assert {row["schema_version"] for row in rows} == {SCHEMA_VERSION}
    for col in ROW_COLUMNS:
        assert [norm(row[col]) for row in rows] == [norm(v) for v in table[col].tolist()], col
    assert "NaN" not in js.read_text() and "Infinity" not in js.read_text()  # strict JSON: null

    text = [c for c in table if not pd.api.types.is_numeric_dtype(table[c]) and table[c].dtype != bool]
    back = pd.read_csv(cs, dtype={c: str for c in text})
    assert list(back.columns) == COLUMNS and len(back) == len(table)
    for col in ROW_COLUMNS:
        assert [norm(v) for v in back[col].tolist()] == [norm(v) for v in table[col].tolist()], col

    # kvbench report FILE --json OUT: the same rows from the parquet afterwards
    again = tmp_path / "again.jsonl"
    rep = kvbench_cli("report", r.results, "--json", str(again))
    assert rep.returncode == 0, rep.stderr
    assert again.read_text() == js.read_text()
    refused = kvbench_cli("report", r.results, "--json", str(again))
    assert refused.returncode == 1 and "results are never overwritten" in refused.stderr


def test_an_existing_or_linked_export_file_is_refused_at_the_door(kvrun, tmp_path):
    js = tmp_path / "mine.jsonl"
    js.write_text("keep\n")
    r = kvrun([*TINY, "--json", str(js)], out_dir=tmp_path / "a")
    assert r.code == 1 and r.results is None, r.out
    assert r.err.strip() == (f"kvbench: error: --json {js}: the file exists, and results are never overwritten: "
                             "give a new name")
    assert js.read_text() == "keep\n" and not (tmp_path / "a").exists()

    link, target = tmp_path / "link.csv", tmp_path / "target.csv"
    link.symlink_to(target)
    r = kvrun([*TINY, "--csv", str(link)], out_dir=tmp_path / "b")
    assert r.code == 1 and "a symbolic link" in r.err and len(r.err.strip().splitlines()) == 1
    assert not target.exists() and not (tmp_path / "b").exists()


# ----- --compact -------------------------------------------------------------------------------------------

def test_compact_header_is_three_legend_lines_and_the_named_columns():
    cases = [{"overlap": "serial", "prefill_ms": 0, "handshake": "off", "transport": "shm"}]
    columns, header = live_table(cases, compact=True)
    assert [h for h, _, _ in columns] == COMPACT_HEADER
    assert header[:3] == COMPACT_LEGEND and len(COMPACT_LEGEND) == 3 and header[3] == "#"
    assert header[4].split() == ["#", *COMPACT_HEADER] and len(header) == 5
    full, _ = live_table(cases)
    assert len(full) > len(columns)


def test_run_compact_prints_exactly_the_named_columns(kvrun):
    r = kvrun([*TINY, "--compact"])
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.split() == ["#", *COMPACT_HEADER])
    assert lines[at - 4: at - 1] == COMPACT_LEGEND and lines[at - 1] == "#"
    assert "blk(tok)" not in r.out and "aggGB/s" not in r.out  # the full table's header is not printed
    body = lines[at + 1: lines.index("#", at)]
    n = r.transfers()["case"].nunique()
    assert len(body) == n == 6  # bulk, four chunk references, paged
    for ln in body:
        f = ln.split()
        assert len(f) == len(COMPACT_HEADER) and f[1] == "push" and f[2] == "2MiB" and f[8] == "0", ln
        assert f[-1] in ("ok", "SKEW", "noise"), ln  # SKEW, noise: a loaded machine's clocks and spreads
        assert float(f[5]) == pytest.approx(8 * float(f[4]), abs=0.1)  # Gb/s = 8 x GB/s, each rounded
    assert [ln.split()[0] for ln in body][-1] == "shm" and "shm/bulk" in r.out


# ----- kvbench env ---------------------------------------------------------------------------------------------

def test_env_lists_each_nic_with_speed_mtu_numa_and_the_memlock():
    r = kvbench_cli("env")
    assert r.returncode == 0, r.stderr
    assert "MTU" in r.stdout and "NUMA" in r.stdout and "speed(Mb/s)" in r.stdout
    assert any(ln.startswith("memlock ") for ln in r.stdout.splitlines())
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert ("# WARNING: memlock" in r.stdout) == (soft != resource.RLIM_INFINITY)


def test_nic_lines_read_sysfs(tmp_path):
    net = tmp_path / "class" / "net"
    (net / "eth9" / "device").mkdir(parents=True)
    (net / "eth9" / "speed").write_text("25000\n")
    (net / "eth9" / "mtu").write_text("9000\n")
    (net / "eth9" / "device" / "numa_node").write_text("1\n")
    (net / "lo").mkdir()
    (net / "lo" / "mtu").write_text("65536\n")  # no speed (the kernel says EINVAL), no device: '-'
    lines = nic_lines(str(tmp_path))
    assert lines[0].split()[:5] == ["#", "NIC", "speed(Mb/s)", "MTU", "NUMA"]
    assert lines[1].split() == ["eth9", "25000", "9000", "1"]
    assert lines[2].split() == ["lo", "-", "65536", "-"]
    assert nic_lines(str(tmp_path / "none")) == []


def test_memlock_warns_unless_unlimited(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    (line,) = memlock_lines()
    assert line.startswith("# WARNING: memlock (RLIMIT_MEMLOCK) is 8 MiB") and "'unlimited' is recommended" in line
    assert "ulimit -l unlimited" in line
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memlock_lines() == []


def test_export_files_never_through_a_link(tmp_path):
    from kvbench.results.export import ExportError, check_new

    (tmp_path / "x").symlink_to(tmp_path / "y")
    with pytest.raises(ExportError, match="a symbolic link"):
        check_new("--json", str(tmp_path / "x"))
    with pytest.raises(ExportError, match="no folder"):
        check_new("--json", str(tmp_path / "no" / "x.jsonl"))
    check_new("--json", str(tmp_path / "new.jsonl"))  # a new name in a folder of ours: fine, nothing created
    assert not os.path.exists(tmp_path / "new.jsonl")
