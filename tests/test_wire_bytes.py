"""The wire's own byte count (issue 42, item 2): tcp counts what its connections really carried (the kernel's
tcp_info, harness/wirerows.py), and a case whose wire carried less than its payload with no codec in the path is
named (kvbench/results/wire.py)."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers.args import LIAR_SMALL
from helpers.launch import liar_env

from kvbench.harness import wirerows
from kvbench.results import store, wire
from kvbench.transports import tcp_wire

SMALL = [*LIAR_SMALL, "--op", "push,pull"]
ENV = liar_env()


def timed(r) -> pd.DataFrame:
    t = r.transfers()
    return t[t["iter"] >= 0]


def test_honest_tcp_counts_at_least_its_payload(kvrun):
    r = kvrun(["-t", "tcp", *SMALL], timeout=180)
    assert r.meta()["status"] != "FAILED", r.out + r.err
    t = timed(r)
    assert len(t) and t["wire_counted_bytes"].notna().all(), t[["case", "role", "iter", "wire_counted_bytes"]]
    assert (t["wire_counted_bytes"] >= t["payload_bytes"]).all()  # the payload and tcp's 32-byte headers
    assert (t["wire_bytes"] == t["payload_bytes"]).all()  # wire_bytes stays the computed count
    assert r.table().query("iter == -1")["wire_counted_bytes"].isna().all()  # the check pass is not counted
    assert wire.short(r.table()) == []


@pytest.mark.parametrize("check", [pytest.param("1", marks=pytest.mark.check), "all"])
def test_a_path_that_compresses_the_fill_is_named(kvrun, check):
    """The liar knows the run's key (tests/liars.py): keyed content compresses for nothing else.  Under -c all every
    timed iteration has an epoch of its own, which it finds from the post's tag."""
    r = kvrun(["-t", "lie-compress-tcp", "-c", check, *SMALL], env=ENV, timeout=180)
    df = r.table()
    assert int(df["nwrong"].fillna(0).sum()) == 0, r.out + r.err  # every byte landed right: the check passes
    t = timed(r)
    assert len(t) and (t["wire_counted_bytes"] < t["payload_bytes"]).all(), t[["case", "wire_counted_bytes"]]
    got = wire.short(df)
    assert sorted(s["case"] for s in got) == sorted(t["case"].unique())
    assert all(s["line"].startswith(f"SUSPECT: case {s['case']} (lie-compress-tcp ") and "no codec" in s["line"]
               for s in got), got
    # the run itself ends SUSPECT (exit 6), each line in its footer and sidecar, on content and byte counts alone
    assert r.code == 6 and r.out.rstrip().splitlines()[-2].endswith("SUSPECT"), r.out
    assert all(f"# {s['line']}" in r.out for s in got) and r.meta()["suspects"] == [s["line"] for s in got]


def _rows(**over) -> dict:
    base = dict(case=1, variant="paged", transport="tcp", op="push", memory="host", model="m", tokens=256,
                block_size=64, allocation="random", overlap="serial", codec="none", iter=0, status="ok",
                row_kind="transfer", payload_bytes=1000, wire_bytes=1000, wire_counted_bytes=1032.0)
    return dict(base, **over)


def test_short_names_a_case_without_a_codec_only():
    df = pd.DataFrame([_rows(), _rows(iter=1),  # honest: never short
                       _rows(case=2, wire_counted_bytes=100.0), _rows(case=2, iter=1, wire_counted_bytes=120.0),
                       _rows(case=3, codec="lz4", wire_counted_bytes=100.0),  # a codec may carry fewer bytes
                       _rows(case=4, codec=None, wire_counted_bytes=10.0),  # an empty codec is none
                       _rows(case=5, wire_counted_bytes=float("nan")),  # not counted: not judged
                       _rows(case=6, iter=-1, wire_counted_bytes=1.0)])  # a check pass is not judged
    got = wire.short(df)
    assert [s["case"] for s in got] == [2, 4]
    assert got[0]["payload"] == 1000 and got[0]["wire_bytes"] == 110
    assert got[0]["line"] == ("SUSPECT: case 2 (tcp push m 256 tokens, random 64-token blocks, host, serial): its wire "
                              "carried 110 B for a 1000 B payload with no codec in the path: fewer bytes than it "
                              "claims to move")
    assert wire.short(df.drop(columns=["wire_counted_bytes"])) == [] and wire.short(None) == []


def test_an_iteration_count_is_split_by_payload_share():
    e = lambda src, dst, payload: SimpleNamespace(src=src, dst=dst, payload=payload)  # noqa: E731
    entries = [e(0, 1, 300), e(0, 1, 100), e(1, 0, 50), e(0, 0, 10)]
    got = wirerows.per_entry([{1: (800, 60)}, {}], entries, 0)
    assert got[0][0] == 600 and got[1][0] == 200 and got[2][0] == 60 and 3 not in got  # a local copy: no wire
    assert np.isnan(got[0][1]) and np.isnan(wirerows.at(got, 3, 0)) and wirerows.per_entry([], entries, 0) == {}


def test_the_kernel_counts_a_connection_bytes():
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    try:
        a.sendall(b"x" * 123_457)
        n = 0
        while n < 123_457:
            n += len(b.recv(1 << 20))
        assert tcp_wire.counted(a)[0] == 123_457 and tcp_wire.counted(b)[1] == 123_457
    finally:
        for s in (a, b, srv):
            s.close()


def test_older_rows_read_with_no_count():
    df = store.upgrade(pd.DataFrame({"case": [1], "seconds": [1.0]}), 7)
    assert store.SCHEMA_VERSION >= 8 and df["wire_counted_bytes"].isna().all()  # 8 added it
