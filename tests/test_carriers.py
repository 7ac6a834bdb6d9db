"""Carriers: the NICs' counter deltas, the carrier (>= 90% of the bytes), wire over payload, the note, RDMA's
4-byte words; and on one host, a real run's rows, footer and sidecar (tcp over loopback, shm through memory),
and a pinned NIC that does not exist refused in one line."""
from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest

from kvbench.fabric import carriers as C
from kvbench.fabric import nics
from kvbench.results import store

# ---------------------------------------------------------------- counters

def _write(path, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"{value}\n")


def _fake_sys(root, net: dict, rdma: dict) -> str:
    for name, (tx, rx) in net.items():
        _write(os.path.join(root, "class", "net", name, "statistics", "tx_bytes"), tx)
        _write(os.path.join(root, "class", "net", name, "statistics", "rx_bytes"), rx)
    for name, (tx, rx) in rdma.items():
        dev, port = name.split(":")
        c = os.path.join(root, "class", "infiniband", dev, "ports", port, "counters")
        _write(os.path.join(c, "port_xmit_data"), tx)
        _write(os.path.join(c, "port_rcv_data"), rx)
    return str(root)


def test_sample_reads_net_bytes_and_rdma_words(tmp_path):
    root = _fake_sys(tmp_path, {"eth0": (1000, 2000), "lo": (7, 7)}, {"mlx5_0:1": (250, 3), "mlx5_1:1": (0, 1)})
    got = nics.sample(root)
    assert got == {"eth0": (1000, 2000), "lo": (7, 7), "mlx5_0:1": (1000, 12), "mlx5_1:1": (0, 4)}
    assert nics.names(root) == ["eth0", "lo"]
    os.unlink(os.path.join(root, "class", "net", "eth0", "statistics", "rx_bytes"))  # unreadable: left out
    assert "eth0" not in nics.sample(root)


def test_sample_without_sysfs_is_empty(tmp_path):
    assert nics.sample(str(tmp_path)) == {}


def test_rdma_delta_is_words_times_four(tmp_path):
    root = _fake_sys(tmp_path, {}, {"mlx5_0:1": (100, 100)})
    before = nics.sample(root)
    _fake_sys(tmp_path, {}, {"mlx5_0:1": (100 + 262_144, 101)})  # 1 MiB sent, 4 B received
    assert C.delta(before, nics.sample(root)) == {"mlx5_0:1": (1 << 20, 4)}


def test_delta_exact_bytes():
    before = {"eth0": (10, 20), "eth1": (5, 5), "lo": (100, 100), "gone": (1, 1)}
    after = {"eth0": (10 + 4_194_304, 20 + 3_000), "eth1": (5, 5), "lo": (99, 150), "new": (9, 9)}
    # eth1 moved nothing (left out); lo's tx went backwards (a reset counts 0); gone/new are not in both
    assert C.delta(before, after) == {"eth0": (4_194_304, 3_000), "lo": (0, 50)}
    assert C.add({"a": (1, 2)}, {"a": (10, 20), "b": (3, 0)}) == {"a": (11, 22), "b": (3, 0)}


@pytest.mark.parametrize("moved,want", [
    ({"a": (910, 0), "b": (90, 0)}, ["a"]),  # exactly 91%
    ({"a": (900, 0), "b": (100, 0)}, ["a"]),  # exactly 90%: enough
    ({"a": (899, 0), "b": (101, 0)}, ["a", "b"]),  # just under
    ({"a": (500, 0), "b": (0, 500)}, ["a", "b"]),  # two rails, half each (sent + received count)
    ({"a": (600, 0), "b": (310, 0), "c": (90, 0)}, ["a", "b"]),
    ({"b": (500, 0), "a": (500, 0), "c": (1, 0)}, ["a", "b"]),  # ties: by name
    ({}, []),
])
def test_carrier_ninety_percent_rule(moved, want):
    assert C.carrier(moved) == want


def test_carriage_bytes_and_wire_over_payload():
    c = C.carriage({"eth0": (4_390_000, 90_000), "eth1": (1_000, 2_000)}, sent=4_194_304, received=0)
    assert c.carrier == "eth0" and (c.tx_bytes, c.rx_bytes) == (4_390_000, 90_000)
    assert c.wire_over_payload == 4_390_000 / 4_194_304  # the sender's direction only
    assert json.loads(c.nic_bytes) == {"eth0": [4_390_000, 90_000], "eth1": [1_000, 2_000]}
    d = C.carriage({"eth0": (90_000, 4_390_000)}, sent=0, received=4_194_304)
    assert d.wire_over_payload == 4_390_000 / 4_194_304
    both = C.carriage({"eth0": (1_100, 1_000)}, sent=1_000, received=1_000)
    assert both.wire_over_payload == 2_100 / 2_000


def test_per_nic_wire_over_payload():
    moved = {"rail0": (2_100, 30), "rail1": (2_000, 20)}
    assert C.per_nic(moved, sent=4_000, received=0) == {"rail0": 2_100 / 4_000, "rail1": 2_000 / 4_000}
    assert C.per_nic(moved, sent=0, received=50) == {"rail0": 30 / 50, "rail1": 20 / 50}
    assert C.per_nic(moved, 0, 0) == {}


def test_carriage_memory_path_and_nothing():
    c = C.carriage({"eth0": (400, 0)}, sent=1_000, received=0)  # under half the payload: not a NIC
    assert c.carrier == C.NONE and c.tx_bytes == 0 and c.wire_over_payload == 0.0
    assert C.carriage({"eth0": (500, 0)}, sent=1_000, received=0).carrier == "eth0"  # half: it did
    empty = C.carriage({}, sent=0, received=0)
    assert empty.carrier == "" and math.isnan(empty.wire_over_payload) and empty.nic_bytes == "{}"


def test_note():
    assert C.note("rail1", ["rail0"], True) == "misrouted: asked rail0, carried by rail1"
    assert C.note("rail0,rail1", ["rail0"], True) == "misrouted: asked rail0, carried by rail0,rail1"
    assert C.note("rail0", ["rail0"], True) == ""
    assert C.note("rail0", ["rail0", "rail1"], True) == ""
    assert C.note("lo", [], True).startswith("loopback: carried by lo")
    assert C.note("lo", ["eth0"], True) == "misrouted: asked eth0, carried by lo"
    assert C.note("none", ["eth0"], True).startswith("no NIC carried the payload")
    assert C.note("lo", [], False) == "" and C.note("", ["eth0"], True) == ""


def test_encode_decode():
    moved = {"rail1": (3, 4), "mlx5_0:1": (1 << 40, 0)}
    text = C.encode(moved)
    assert text == '{"mlx5_0:1":[1099511627776,0],"rail1":[3,4]}'
    assert C.decode(text) == moved and C.decode("") == {} and C.decode(None) == {}


def test_older_schema_reads_with_empty_carriers():
    df = store.upgrade(pd.DataFrame({"case": [1], "iter": [0]}), 6)
    assert df["carrier"].iloc[0] == "" and df["nic_bytes"].iloc[0] == "" and math.isnan(df["carrier_tx_bytes"].iloc[0])
    assert set(C.COLUMNS) <= set(store.ROW_COLUMNS) and store.SCHEMA_VERSION >= 7


# ---------------------------------------------------------------- a real run on one host

def test_tcp_over_loopback_and_shm_through_memory(kvrun):
    r = kvrun(["-t", "tcp,shm", "--tokens", "32", "-n", "3", "-w", "1", "--variants", "bulk"], timeout=240)
    assert r.code == 0, r.out + r.err
    df = r.transfers()
    timed = df[df["iter"] >= 0]
    tcp, shm = timed[timed["transport"] == "tcp"], timed[timed["transport"] == "shm"]
    payload = int(tcp["payload_bytes"].iloc[0]) * 3
    for _, g in tcp.groupby("rank"):
        assert set(g["carrier"]) == {"lo"} and set(g["nic_asked"]) == {""}
        assert g["carrier_note"].iloc[0].startswith("loopback: carried by lo")
        moved = C.decode(g["nic_bytes"].iloc[0])
        assert moved["lo"][0] >= payload and moved["lo"][1] >= payload  # lo counts a packet sent and received
        assert g["wire_over_payload"].iloc[0] >= 1.0
    assert set(shm["carrier"]) == {"none"} and set(shm["carrier_note"]) == {""}
    assert (df[df["iter"] < 0]["carrier"] == "").all()  # check pass and setup rows: nothing sampled
    assert "# CARRIER case 1 rank 0: loopback" in r.out
    side = r.meta()["carriers"]
    assert side["1"]["0"]["carrier"] == "lo" and side["2"]["1"]["carrier"] == "none"


def test_pinned_nic_that_does_not_exist(kvrun, tmp_path):
    r = kvrun(["-t", "tcp", "--tokens", "32", "-n", "1", "-w", "0", "-O", "ifname=nosuch"], timeout=120)
    assert r.code == 1 and r.results is None, r.out + r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no interface with an IPv4 address matches 'nosuch'" in lines[0]
