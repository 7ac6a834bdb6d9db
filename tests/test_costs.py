"""kvbench's own time per layer outside the wire (costs.py), and serial requests posted as one call."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers.launch import kvbench_cli

from kvbench.results import costs
from kvbench.results.store import ROW_COLUMNS, SCHEMA_VERSION, upgrade
from kvbench.transports.base import Transport


class Recorder(Transport):
    """Records every prepare and serve (what one library call would receive)."""

    batches = True

    def __init__(self):
        self.calls = []

    def prepare(self, op, peer, descs, tag=0):
        self.calls.append(("prepare", descs, tag))
        return descs

    def start(self, prepared):
        return ("h", prepared)

    def serve(self, op, peer, descs, tag=0):
        self.calls.append(("serve", descs, tag))
        return ("s", descs)


def layers(n=3, per=4):
    rng = np.random.default_rng(1)
    return [np.ascontiguousarray(rng.integers(0, 1 << 20, (per, 3)), dtype=np.int64) for _ in range(n)]


def test_a_batching_transport_posts_a_requests_layers_as_one_call_with_the_last_tag():
    t, ls = Recorder(), layers()
    handles = t.start_request(t.prepare_request("push", 1, ls, [10, 11, 12]))
    assert len(t.calls) == 1 and len(handles) == 1
    kind, descs, tag = t.calls[0]
    assert tag == 12 and np.array_equal(descs, np.concatenate(ls))
    assert t.layers_in(descs) == 3
    # the next iteration reuses the joined array (no per-iteration concatenation) and serves in kind
    t.prepare_request("push", 1, ls, [20, 21, 22])
    assert t.calls[1][1] is descs
    assert len(t.serve_request("push", 0, ls, [20, 21, 22])) == 1 and t.calls[2][1] is descs


def test_one_layer_or_a_transport_that_does_not_batch_posts_per_layer():
    t, ls = Recorder(), layers()
    assert len(t.start_request(t.prepare_request("push", 1, ls[:1], [5]))) == 1 and t.calls[0][1] is ls[0]
    t.batches = False
    t.calls.clear()
    handles = t.start_request(t.prepare_request("push", 1, ls, [1, 2, 3]))
    assert [c[2] for c in t.calls] == [1, 2, 3] and len(handles) == 3


def test_v2_rows_upgrade_with_empty_cost_columns_and_give_no_costs():
    assert SCHEMA_VERSION >= 4
    df = pd.DataFrame({"case": [1], "status": ["ok"], "iter": [0]})
    up = upgrade(df, 2)
    assert set(costs.COLUMNS) <= set(up.columns) and set(ROW_COLUMNS) <= set(up.columns)
    assert up["post_s"].isna().all() and up["cache_bytes"].isna().all() and (up["cache"] == "as-is").all()
    # schema 5's bounds: empty, so an older run is never judged against a bound it did not measure
    assert up["stamp_lead_s"].isna().all() and up["bound_gbps"].isna().all() and (up["bound_kind"] == "").all()
    assert costs.per_case(up).empty


def test_per_case_takes_the_slowest_rank_per_iteration_and_divides_by_layers():
    rows = []
    for it in range(3):
        for rank, post, lib, wake in ((0, 40e-6, 8e-6, np.nan), (1, 8e-6, 0.0, 4e-6)):
            rows.append(dict(case=1, status="ok", iter=it, rank=rank, req=0, pair=0, layers=4,
                             post_s=post, lib_s=lib, notify_s=0.0, wake_s=wake))
    got = costs.per_case(pd.DataFrame(rows)).loc[1]
    assert got["post_us"] == pytest.approx(8.0)  # (40 - 8) us / 4 layers
    assert got["lib_us"] == pytest.approx(2.0)
    assert got["wake_us"] == pytest.approx(1.0)
    assert got["cost_us"] == pytest.approx(9.0)


@pytest.mark.parametrize("transport", ["tcp", "mpi"])
def test_costs_are_in_rows_sidecar_and_report(kvrun, transport):
    r = kvrun(["-t", transport, "--op", "push,pull", "-m", "llama-3-8b", "--tokens", "64", "-n", "4", "-w", "1",
               "--variants", "bulk,paged", "--rounds", "1"])
    assert r.code == 0, r.err
    df = r.table()
    timed = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    assert int(df["nwrong"].fillna(0).sum()) == 0
    assert timed["post_s"].notna().all() and (timed["post_s"] >= timed["lib_s"]).all() and (timed["lib_s"] >= 0).all()
    dest = timed[timed["role"] == "decode"]
    if transport == "tcp":  # its receive thread stamps the landing: the wake-up gap is measured
        assert dest["wake_s"].notna().all() and (dest["wake_s"] >= 0).all()
    else:
        assert dest["wake_s"].isna().all()
    with open(r.results[: -len(".parquet")] + ".meta.json") as fh:
        meta = json.load(fh)
    cases = {str(int(c)) for c in timed["case"].unique()}
    assert set(meta["layer_cost_us"]) == cases
    assert all(v["cost_us"] >= 0 and v["post_us"] is not None for v in meta["layer_cost_us"].values())
    rep = kvbench_cli("report", r.results)
    assert rep.returncode == 0, rep.stderr
    assert "us/L" in rep.stdout
    lines = [ln for ln in rep.stdout.splitlines() if ln.strip().startswith(transport)]
    assert len(lines) == len(cases) and all(ln.split()[-1] != "-" for ln in lines)


def test_the_same_array_twice_goes_layer_by_layer():
    # the hot variant re-sends one buffer: one two-sided receive may not land twice on the same bytes
    t, ls = Recorder(), layers(1)
    handles = t.start_request(t.prepare_request("push", 1, [ls[0]] * 4, [1, 2, 3, 4]))
    assert len(handles) == 4 and [c[2] for c in t.calls] == [1, 2, 3, 4]
    assert len(t.serve_request("push", 0, [ls[0]] * 4, [1, 2, 3, 4])) == 4
