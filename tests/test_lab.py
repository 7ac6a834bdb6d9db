"""kvbench lab: names, addresses and the launch line (anywhere); as root, a lab of namespaces that carries a tcp
run over one rail (its carrier is that rail's NIC), reports a misroute, and leaves nothing behind after down,
after a run that made its own lab, and after a run ended by SIGTERM.  Payloads are a few MB at 1 Gbit/s."""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest
from helpers.lab import _lab, _ours, _results, needs_root
from helpers.launch import leftovers_of

from kvbench.fabric import carriers as C
from kvbench.lab import cmd, net, place
from kvbench.selftest import netns as N

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["-t", "tcp", "--tokens", "32", "-n", "3", "-w", "1", "--variants", "bulk", "--progress", "off"]  # 4 MiB


# ---------------------------------------------------------------- anywhere

def test_addresses_and_names():
    lab = net.Lab("9-abc", nodes=3, rails=2, rate_bits=10**9)
    assert [net.address(r, n) for r in (0, 1) for n in (0, 2)] == ["10.100.0.1", "10.100.0.3", "10.101.0.1",
                                                                   "10.101.0.3"]
    assert lab.node_ns(2) == "kvbl-9-abc-n2" and lab.switch_ns == "kvbl-9-abc-sw" and lab.nics() == ["rail0", "rail1"]
    assert net.NS_RE.match(lab.node_ns(0)) and net.NS_RE.match(lab.switch_ns) and not net.NS_RE.match("kvb-1-ab-a")


def test_command_places_ranks_per_node():
    lab = net.Lab("9-abc", nodes=3, rails=1, rate_bits=10**9)
    c = place.command("mpiexec", lab, 2, ["-t", "tcp"])
    parts = " ".join(c[1:]).split(" : ")
    assert c[0] == "mpiexec" and len(parts) == 3
    for n, part in enumerate(parts):
        assert part.split()[:6] == ["-n", "2", "ip", "netns", "exec", f"kvbl-9-abc-n{n}"]
        assert part.endswith(f"{sys.executable} -m kvbench run -t tcp")


def test_rank_env_pins_the_first_nic_unless_the_run_does():
    env = place.rank_env(["rail0", "rail1"], "ucx", ["-t", "tcp"])
    assert env["KVBENCH_SOCKET_IFNAME"] == "=rail0" and env["KVBENCH_LAB_NICS"] == "rail0,rail1"
    assert env["UCX_NET_DEVICES"] == "rail0,rail1" and env["MPIR_CVAR_NOLOCAL"] == "1"
    for given in (["-O", "ifname==rail1"], ["-O", "tcp.addr=10.101.0.1"], ["-Oifname=rail1"], ["--option=ifname=x"]):
        assert "KVBENCH_SOCKET_IFNAME" not in place.rank_env(["rail0"], "ucx", ["-t", "tcp", *given])
    assert place.rank_env(["rail1"], "ofi", [])["FI_TCP_IFACE"] == "rail1"


def test_up_when_not_root_is_one_line_and_creates_nothing(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def no(*a, **k):
        raise AssertionError("nothing may be created")

    monkeypatch.setattr(net, "up", no)
    for argv in (["up", "--nodes", "2", "--rails", "2", "--rate", "1gbit"], ["run", "--", "-t", "tcp"], ["down"]):
        assert cmd.main(argv) == 1
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and "needs root" in err[0]


@pytest.mark.parametrize("argv,word", [(["up", "--nodes", "1"], "--nodes 1"), (["up", "--rails", "9"], "--rails 9"),
                                       (["up", "--rate", "fast"], "rate 'fast'"), (["run"], "after --"),
                                       (["up", "--spine", "1gbps"], "rate '1gbps'"),
                                       (["up", "--nodes", "0"], "--nodes 0"), (["up", "--rails", "0"], "--rails 0"),
                                       (["run", "--nodes", "0", "--", "-t", "tcp"], "--nodes 0"),
                                       (["up", "--id", ""], "--id ''"), (["up", "--nodes", "x"], "invalid int"),
                                       (["run", "--timeout", "-1", "--", "-t", "tcp"], "--timeout -1.0"),
                                       (["run", "--timeout", "nan", "--", "-t", "tcp"], "--timeout nan"),
                                       (["run", "--mpiexec", "/nonexistent", "--", "-t", "tcp"], "--mpiexec /none")])
def test_bad_input_is_one_line(argv, word, capsys, monkeypatch):
    monkeypatch.setattr(net, "up", lambda *a, **k: (_ for _ in ()).throw(AssertionError("nothing may be created")))
    assert cmd.main(argv) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and word in err[0]


@pytest.mark.launches
def test_up_with_the_id_of_a_lab_up_refuses_and_leaves_that_lab_alone(monkeypatch, tmp_path):
    """A second `up --id X` must not tear down lab X (its failure path removed every kvbl-X-* namespace)."""
    old = net.Lab("x1", nodes=2, rails=1, rate_bits=10**9, created="t", namespaces=["kvbl-x1-sw", "kvbl-x1-n0",
                                                                                    "kvbl-x1-n1"])
    monkeypatch.setattr(net, "STATE_DIR", str(tmp_path))
    net.save(old)
    ran = []

    def fake_run(cmd, check=True, **_):
        ran.append(cmd)
        if cmd[:3] == ["ip", "netns", "add"] and cmd[3] in old.namespaces:
            raise N.NetnsError(f"'{' '.join(cmd)}' failed (1): File exists")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(net, "run", fake_run)
    monkeypatch.setattr(N, "list_namespaces", lambda: list(old.namespaces))
    monkeypatch.setattr(N, "kill_inside", lambda ns: ran.append(["kill", ns]) or [])
    with pytest.raises(N.NetnsError, match="x1"):
        net.up(2, 1, 10**9, lab_id="x1")
    assert not [c for c in ran if c[:3] == ["ip", "netns", "del"] or c[0] == "kill"]
    assert [lab.namespaces for lab in net.labs()] == [old.namespaces]


# ---------------------------------------------------------------- the lab itself (root)

@needs_root
def test_lab_is_built(lab):
    assert sorted(_ours(lab.id)) == sorted([lab.switch_ns, lab.node_ns(0), lab.node_ns(1)])
    assert lab.id in {x.id for x in net.labs()}
    for n in (0, 1):
        devs = json.loads(subprocess.run(["ip", "-n", lab.node_ns(n), "-j", "addr", "show"], capture_output=True,
                                         text=True, check=True).stdout)
        got = {d["ifname"]: [a["local"] for a in d["addr_info"] if a["family"] == "inet"] for d in devs}
        assert got["rail0"] == [net.address(0, n)] and got["rail1"] == [net.address(1, n)]
        for ns, dev in ((lab.node_ns(n), "rail1"), (lab.switch_ns, f"n{n}r1")):  # both ends shaped
            q = json.loads(subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], capture_output=True,
                                          text=True, check=True).stdout)
            assert q[0]["kind"] == "tbf" and q[0]["options"]["rate"] == 10**9 // 8


@needs_root
def test_tcp_over_one_rail_is_carried_by_that_rail(lab, tmp_path):
    before = net.counters(lab, 0)
    p = _lab("run", "--id", lab.id, "--", *RUN, "-o", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    after = net.counters(lab, 0)
    df = _results(p.stdout)
    payload = int(df["payload_bytes"].iloc[0]) * 3
    # seen from outside: node 0's rail0 sent at least the timed payload, plus the warm-up and check transfers
    assert after["rail0"][0] - before["rail0"][0] >= payload * 5 // 3
    for rank, field in ((0, "carrier_tx_bytes"), (1, "carrier_rx_bytes")):
        g = df[df["rank"] == rank]
        assert set(g["carrier"]) == {"rail0"} and set(g["nic_asked"]) == {"rail0"} and set(g["carrier_note"]) == {""}
        assert g[field].iloc[0] >= payload and g["wire_over_payload"].iloc[0] >= 1.0
        assert C.decode(g["nic_bytes"].iloc[0]).get("rail1", (0, 0))[0] < payload / 10  # rail1 carried no payload
    assert "# CARRIER" not in p.stdout and "leaves by" not in p.stdout


@needs_root
def test_misroute_is_reported_in_preamble_rows_and_sidecar(lab, tmp_path):
    peer = net.address(0, 1)
    subprocess.run(["ip", "-n", lab.node_ns(0), "route", "add", f"{peer}/32", "dev", "rail1"], check=True)
    try:
        p = _lab("run", "--id", lab.id, "--", *RUN, "-o", str(tmp_path))
    finally:
        subprocess.run(["ip", "-n", lab.node_ns(0), "route", "del", f"{peer}/32", "dev", "rail1"], check=True)
    assert p.returncode == 0, p.stdout + p.stderr
    head = p.stdout.split("#transport")[0]
    assert f"rank 0 was asked for rail0 ({net.address(0, 0)}) but its route to rank 1 ({peer}) leaves by rail1" in head
    df = _results(p.stdout)
    g = df[df["rank"] == 0]
    assert set(g["carrier"]) == {"rail1"} and set(g["carrier_note"]) == {"misrouted: asked rail0, carried by rail1"}
    assert g["carrier_tx_bytes"].iloc[0] >= int(g["payload_bytes"].iloc[0]) * 3
    assert re.search(r"# CARRIER case 1 ranks? 0(-1)?: misrouted: asked rail0, carried by rail1", p.stdout)
    assert df.attrs["meta"]["carriers"]["1"]["0"]["note"] == "misrouted: asked rail0, carried by rail1"


@pytest.mark.launches
@needs_root
def test_up_then_down_leaves_nothing():
    tag = f"d{os.getpid()}-{secrets.token_hex(2)}"
    p = _lab("up", "--nodes", "3", "--rails", "2", "--rate", "1gbit", "--spine", "500mbit", "--id", tag)
    assert p.returncode == 0, p.stdout + p.stderr
    try:
        assert len(_ours(tag)) == 4 and os.path.exists(net.state_path(tag))
        rule = subprocess.run(["ip", "-n", f"kvbl-{tag}-n0", "route", "get", net.address(1, 2), "from",
                               net.address(0, 0)], capture_output=True, text=True, check=True).stdout
        assert f"via {net.spine_address(0)} dev rail0" in rule  # cross-rail goes by the spine
    finally:
        d = _lab("down", "--id", tag)
    assert d.returncode == 0 and "removed 4 namespace(s)" in d.stdout, d.stdout + d.stderr
    assert _ours(tag) == [] and not os.path.exists(net.state_path(tag))


@pytest.mark.launches
@needs_root
def test_run_that_made_its_lab_removes_it(tmp_path):
    p = _lab("run", "--nodes", "2", "--rails", "1", "--rate", "1gbit", "--", *RUN, "-o", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    lab_id = re.search(r"^# lab (\S+):", p.stdout, re.M).group(1)
    assert _ours(f"kvbl-{lab_id}-") == [] and not os.path.exists(net.state_path(lab_id))
    assert set(_results(p.stdout)["carrier"]) == {"rail0"}


@pytest.mark.launches
@needs_root
def test_sigterm_during_run_removes_the_lab(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "lab", "run", "--nodes", "2", "--rate", "100mbit", "--",
                             *RUN[:2], "--tokens", "256", "-n", "50", "-w", "1", "--variants", "bulk", "-o",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env)
    tag = f"kvbl-{proc.pid}-"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not glob.glob(os.path.join(str(tmp_path), "*", "*.meta.json")):
            time.sleep(0.5)  # the result files are open: the ranks are in the namespaces, the first case starts
        assert _ours(tag), "the lab was not built"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert _ours(tag) == []
    left = subprocess.run(["pgrep", "-f", f"ip netns exec {tag}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"ranks left behind: {left}"
    # each node's rank maps an MPICH segment of its own: rank 0's exit path removes rank 1's too (by its registry)
    meta = glob.glob(os.path.join(str(tmp_path), "*", "*.meta.json"))[0]
    assert leftovers_of(meta.replace(".meta.json", ".parquet")) == []


@pytest.mark.launches
@needs_root
def test_a_lab_whose_run_was_killed_is_found_dead_and_removed_by_the_next_lab_command(tmp_path):
    """kill -9 of `lab run`: its lab stays recorded and its launch runs on, until the next `kvbench lab` command."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "lab", "run", "--nodes", "2", "--rate", "100mbit", "--",
                             *RUN[:2], "--tokens", "256", "-n", "50", "-w", "1", "--variants", "bulk", "-o",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    tag = f"kvbl-{proc.pid}-"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not glob.glob(os.path.join(str(tmp_path), "*", "*.meta.json")):
            time.sleep(0.5)  # the ranks are in the namespaces
        assert _ours(tag), "the lab was not built"
        proc.kill()
        proc.wait(timeout=30)
        assert _ours(tag), "kill -9 left nothing to find"  # nothing of the dead run removed its lab
        p = _lab("status", timeout=120)
    finally:
        for lab in net.labs():
            if lab.id.startswith(f"{proc.pid}-"):
                net.down(lab)
    assert p.returncode == 0 and f"the lab run that made it (pid {proc.pid}) is gone" in p.stdout, p.stdout + p.stderr
    assert _ours(tag) == [] and not any(lab.id.startswith(f"{proc.pid}-") for lab in net.labs())
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"ip netns exec {tag}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"ranks left behind: {left}"


@needs_root
def test_rails_in_the_lab_stripe_over_its_nics(lab, tmp_path):
    """No ifname/addr: tcp's rails are the lab's NICs (KVBENCH_LAB_NICS), each carrying its share."""
    p = _lab("run", "--id", lab.id, "--", *RUN, "-O", "rails=2", "-o", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    df = _results(p.stdout)
    assert set(df["rails"]) == {2} and set(df["rail_nics"]) == {"rail0,rail1"}
    payload = int(df["payload_bytes"].iloc[0]) * 3
    for rank, side in ((0, 0), (1, 1)):  # the sender's tx, the receiver's rx, per rail by the NICs' counters
        g = df[df["rank"] == rank]
        assert set(g["carrier"]) == {"rail0,rail1"} and set(g["nic_asked"]) == {"rail0,rail1"}
        assert set(g["carrier_note"]) == {""}
        moved = C.decode(g["nic_bytes"].iloc[0])
        per = [moved["rail0"][side], moved["rail1"][side]]
        assert sum(per) >= payload and all(0.4 <= x / sum(per) <= 0.6 for x in per), per
    assert "# CARRIER" not in p.stdout and "leaves by" not in p.stdout
