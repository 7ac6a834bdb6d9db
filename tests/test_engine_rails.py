"""Rails for engines that pick their own lanes (issue 44 item 4): the NICs handed to nixl and ucx (--nic, the lab's,
-O rails=N), each rail's bytes from this process's own sockets, and FALLBACK for a rail that carried under half
its share.  In-process rules first; then the lab (root): nixl and ucx over two shaped rails."""
from __future__ import annotations

import os
import types

import pandas as pd
import pytest
from helpers.lab import _lab, _results, needs_root

from kvbench.fabric import carriers as C
from kvbench.harness import pathcheck, railrows
from kvbench.transports import rails
from kvbench.transports.base import TransportError


def ctx(netdevs=(), nic_rails=1, **options):
    return types.SimpleNamespace(netdevs=list(netdevs), nic_rails=nic_rails, options=options)


def test_handed_nics_come_from_nic_else_the_lab_and_rails_keeps_the_first(monkeypatch):
    monkeypatch.setenv("KVBENCH_LAB_NICS", "rail0,rail1,rail2")
    assert rails.handed(ctx()) == ["rail0", "rail1", "rail2"]
    assert rails.handed(ctx(rails=2)) == ["rail0", "rail1"]
    assert rails.handed(ctx(["eth1", "eth0"], nic_rails=2)) == ["eth1", "eth0"]  # --nic beats the lab
    assert rails.handed(ctx(["eth1", "eth0"], nic_rails=1)) == ["eth1"]  # --nic auto uses one


def test_rails_sets_ucx_devices_unless_the_user_named_others(monkeypatch):
    monkeypatch.setenv("KVBENCH_LAB_NICS", "rail0,rail1")
    monkeypatch.setenv("UCX_NET_DEVICES", "rail0,rail1")  # the lab's own list: -O rails=1 narrows it
    monkeypatch.setenv("UCX_MAX_RNDV_RAILS", "2")  # set, so that teardown restores what was there
    monkeypatch.setenv("UCX_MAX_RMA_RAILS", "1")
    assert rails.ucx_devices(ctx(rails=1), "nixl") == "UCX_NET_DEVICES=rail0 UCX_MAX_RNDV_RAILS=1 UCX_MAX_RMA_RAILS=1"
    assert os.environ["UCX_NET_DEVICES"] == "rail0" and os.environ["UCX_MAX_RNDV_RAILS"] == "1"
    monkeypatch.setenv("UCX_NET_DEVICES", "rail1")  # the user's: it stands
    assert rails.ucx_devices(ctx(rails=2), "nixl") == "" and os.environ["UCX_NET_DEVICES"] == "rail1"
    assert rails.ucx_devices(ctx(), "nixl") == ""  # no -O rails: nothing set
    with pytest.raises(TransportError, match=r"nixl: -O rails=3: this rank was handed 2 NIC\(s\) \(rail0,rail1\)"):
        rails.ucx_devices(ctx(rails=3), "nixl")


def test_an_engines_rails_are_what_its_sockets_counted_per_nic():
    got = railrows.engine_rails(["rail0", "rail1"], {"rail0": (600, 10), "rail1": (390, 0), "lo": (5, 5)}, 10)
    assert got["rails"] == 2 and got["rail_nics"] == "rail0,rail1" and got["rail_wire_bytes"] == "61,39"
    assert got["rail_bytes"] == ""  # the engine split the request, not kvbench
    one = railrows.engine_rails(["rail0"], {"rail0": (600, 0)}, 10)
    assert one["rails"] == 0 and one["rail_nics"] == "rail0" and one["rail_wire_bytes"] == ""
    assert railrows.engine_rails(["rail0", "rail1"], {}, 10)["rail_wire_bytes"] == ""  # RDMA: no socket saw it


@pytest.mark.parametrize("wire,idle", [("50,50", ""), ("60,40", ""), ("76,24", "rail1 carried 24%"),
                                       ("100,0", "rail1 carried 0%"), ("", ""), ("1,x", "")])
def test_a_rail_under_half_its_share_is_named(wire, idle):
    assert pathcheck.idle_rails({"rail_nics": "rail0,rail1", "rail_wire_bytes": wire}) == idle


def test_the_footer_says_fallback_for_an_idle_rail_and_not_for_an_even_one():
    cfg = types.SimpleNamespace(suite=types.SimpleNamespace(scheme="pairwise", matrix=None), expect="auto",
                                transport_options={"nixl": {"rails": 2}})
    rows = [dict(case=c, rank=r, iter=0, status="ok", transport="nixl", memory="host", carrier_proto="nixl/ucx:tcp",
                 carrier_evidence="", rails=2, rail_nics="rail0,rail1", rail_wire_bytes=w)
            for c, w in ((1, "500,500"), (2, "1000,0")) for r in (0, 1)]
    lines, side = pathcheck.judge(pd.DataFrame(rows), cfg, ["a#1", "b#2"])  # two hosts: tcp is the path
    assert lines == ["FALLBACK nixl case 2 ranks 0-1: handed rails rail0,rail1, rail1 carried 0% (each rail's share"
                     " 50%; under half of it is a rail the engine did not use)"]
    assert side["1"]["0"]["verdict"] == "OK" and side["2"]["1"]["verdict"] == "FALLBACK"


# ---------------------------------------------------------------- the lab (root)

RUN = ["-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1", "--variants", "bulk", "--progress", "off"]  # 1 MiB layers: UCX stripes a tag message over two tcp rails from 1 MiB (512 KiB: one rail)


def _shares(g: pd.DataFrame) -> list[float]:
    per = [float(x) for x in g["rail_wire_bytes"].iloc[0].split(",")]
    return [x / sum(per) for x in per]


@needs_root
@pytest.mark.parametrize("args", [["-t", "nixl", "--op", "push"], ["-t", "ucx", "-O", "mode=tag", "--op", "push,pull"]])
def test_engines_stripe_over_two_rails_by_their_sockets_and_the_nics(lab, tmp_path, args):
    p = _lab("run", "--id", lab.id, "--", *args, "-O", "rails=2", *RUN, "-o", str(tmp_path))
    assert p.returncode == 0 and "# FALLBACK" not in p.stdout, p.stdout + p.stderr
    df = _results(p.stdout)
    assert set(df["rails"]) == {2} and set(df["rail_nics"]) == {"rail0,rail1"}
    for _, g in df.groupby(["case", "rank"]):
        assert all(0.4 <= x <= 0.6 for x in _shares(g)), _shares(g)  # this process's sockets
        moved = C.decode(g["nic_bytes"].iloc[0])  # the kernel's counters of the node's NICs
        per = [sum(moved["rail0"]), sum(moved["rail1"])]
        assert all(0.4 <= x / sum(per) <= 0.6 for x in per), per
    assert "# rails:" in p.stdout


@needs_root
def test_nixl_pull_over_tcp_rides_one_rail_and_says_so(lab, tmp_path):
    """UCX emulates a get over tcp on one lane, whatever UCX_MAX_RMA_RAILS says: the run names the idle rail."""
    p = _lab("run", "--id", lab.id, "--", "-t", "nixl", "--op", "pull", "-O", "rails=2", *RUN, "-o", str(tmp_path))
    assert p.returncode == 7, p.stdout + p.stderr
    assert "# FALLBACK nixl case 1 ranks 0-1: handed rails rail0,rail1, rail1 carried 0%" in p.stdout, p.stdout


@needs_root
def test_a_nic_left_out_of_ucx_net_devices_is_a_fallback_naming_the_idle_rail(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "rail0")  # the user's list, which the lab passes on
    p = _lab("run", "--id", lab.id, "--", "-t", "nixl", "--op", "push", *RUN, "-o", str(tmp_path))
    assert p.returncode == 7, p.stdout + p.stderr  # FALLBACK's exit code (job/status.py)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("# FALLBACK nixl"))
    assert "handed rails rail0,rail1, rail1 carried 0%" in line, line
    assert _results(p.stdout).attrs["meta"]["status"] == "FALLBACK"


def test_the_page_says_what_carried_the_bytes_fallback_first():
    """The page's summary (report/summary.carried_by) from the sidecar's paths: per path, expected and carrier,
    a FALLBACK row ahead of the OK ones."""
    from kvbench.report.summary import carried_by

    st = pd.DataFrame({"case": [1, 2], "transport": ["shm", "nixl"], "memory": ["host", "host"]})
    paths = {"1": {"0": {"expected": "shm", "carried": "shm", "verdict": "OK"}},
             "2": {"0": {"expected": "shm", "carried": "nixl/ucx:tcp", "verdict": "FALLBACK"},
                   "1": {"expected": "shm", "carried": "nixl/ucx:tcp", "verdict": "OK"}}}
    run = types.SimpleNamespace(name="r1", st=st, meta={"paths": paths})
    got = carried_by([run])
    assert got[["path", "expected", "carried by", "verdict"]].values.tolist() == [
        ["nixl host", "shm", "nixl/ucx:tcp", "FALLBACK"], ["shm host", "shm", "shm", "OK"]]
