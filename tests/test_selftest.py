"""kvbench selftest: the pure parts (rates, judging, tables from result rows) and, as root, the shaped
veth link's set-up and tear-down (no speed is asserted here; `make selftest` measures)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from kvbench.selftest import judge as J
from kvbench.selftest import netns as N
from kvbench.selftest import run as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- pure parts

@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("500mbit", 5 * 10**8), ("2.5Gbit", 25 * 10**8),
                                       ("100000kbit", 10**8), ("1tbit", 10**12), ("10000000", 10**7),
                                       (" 10gbit ", 10**10)])
def test_parse_rate(text, bits):
    assert N.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gbps", "1gb", "gbit", "-1gbit", "0gbit", "1e9", "10kbit", "2tbit", ""])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError, match="rate"):
        N.parse_rate(text)


def test_fmt_rate():
    assert N.fmt_rate(10**9) == "1gbit" and N.fmt_rate(5 * 10**8) == "500mbit"


def test_tbf_params():
    assert N.tbf_params(10**9) == (250_000, 8 * 2**20)  # 2 ms of the rate; the 8 MiB queue floor
    assert N.tbf_params(10**10) == (2_500_000, 62_500_000)  # 2 ms and 50 ms of the rate
    assert N.tbf_params(10**7)[0] == 64 * 1024  # one GSO packet at least


def test_judge_rate_against_iperf3():
    shaped, iperf = 1e9, 0.95e9
    assert J.judge_rate(0.95e9 / 8, shaped, iperf).ok
    v = J.judge_rate(0.9 * 0.95e9 / 8, shaped, iperf)
    assert v.ok and v.basis == "iperf3" and v.ratio == pytest.approx(0.9)
    assert not J.judge_rate(0.89 * 0.95e9 / 8, shaped, iperf).ok
    assert not J.judge_rate(1.06 * 0.95e9 / 8, shaped, iperf).ok  # faster than the link: a timing error
    assert J.judge_rate(1.05 * 0.95e9 / 8, shaped, iperf).ok


def test_judge_rate_against_shaped():
    v = J.judge_rate(0.86e9 / 8, 1e9, None)
    assert v.ok and v.basis == "shaped" and (v.lo, v.hi) == (0.85, 1.05)
    assert not J.judge_rate(0.84e9 / 8, 1e9, None).ok
    assert not J.judge_rate(1.1e9 / 8, 1e9, None).ok
    assert not J.judge_rate(0.0, 1e9, None).ok


def test_exposed_model():
    assert J.exposed_model(1.0, 2.0, 32) == pytest.approx(1 / 32)  # prefill slower: the last layer only
    assert J.exposed_model(1.0, 0.5, 32) == pytest.approx(0.5 + 1 / 32)  # link slower: the excess too


def test_judge_exposed():
    v = J.judge_exposed(0.033, 1.0, 2.0, 32)  # T/L = 31.25 ms, tolerance 20% = 6.25 ms
    assert v.ok and v.model_s == pytest.approx(0.03125) and v.tol_s == pytest.approx(0.00625)
    assert not J.judge_exposed(0.03125 + 0.0063, 1.0, 2.0, 32).ok
    assert not J.judge_exposed(0.03125 - 0.0063, 1.0, 2.0, 32).ok
    assert J.judge_exposed(0.002, 0.0032, 0.01, 32).tol_s == pytest.approx(0.002)  # the 2 ms floor


def test_choose_tokens():
    assert J.choose_tokens(1e9, 131072) == 1024  # llama-3-8b fp16: 134 MB, 1.07 s at 1 Gbit/s
    assert J.choose_tokens(1e6, 131072) == 256  # never below one block
    assert J.choose_tokens(1e10, 131072) % 256 == 0


def test_results_path():
    out = "# kvbench 0.1.0\n# results: /tmp/x/vm/20260101-000000_selftest.parquet\n"
    assert J.results_path(out) == "/tmp/x/vm/20260101-000000_selftest.parquet"
    assert J.results_path("no such line") is None


def _rows():
    rows = []
    for it in (-1, 0, 1, 2):
        for rank, role, sec in ((0, "prefill", 1.0 + it / 100), (1, "decode", 1.1 + it / 100)):
            rows.append(dict(transport="tcp", variant="bulk", role=role, rank=rank, iter=it, status="ok",
                             seconds=None if it < 0 else sec, payload_bytes=1000, layers=32,
                             exposed_s=None if it < 0 or role == "prefill" else 0.03 + it / 1000))
    return pd.DataFrame(rows)


def test_rates_and_transfers_from_rows():
    df = _rows()
    bps, sec = J.bulk_rate(df, "tcp")
    assert sec == pytest.approx(1.11) and bps == pytest.approx(1000 / 1.11)  # the slower rank, median
    exp, layers, n = J.exposed_median(df, "tcp")
    assert exp == pytest.approx(0.031) and layers == 32 and n == 3
    assert J.transfers(df, "tcp", warmup=1) == 5  # warm-up + 3 timed + the check pass
    with pytest.raises(ValueError):
        J.bulk_rate(df, "mpi")


def test_kvbench_cmd_places_ranks():
    link = N.Link("1-abc", 10**9)
    cmd = R.kvbench_cmd("mpiexec", link, ["-t", "tcp"])
    i = cmd.index(":")
    assert cmd[:6] == ["mpiexec", "-n", "1", "ip", "netns", "exec"] and cmd[6] == "kvb-1-abc-a"
    assert cmd[i + 1:i + 7] == ["-n", "1", "ip", "netns", "exec", "kvb-1-abc-b"]
    assert cmd[i - 2:i] == ["-t", "tcp"] and cmd[-2:] == ["-t", "tcp"]


def test_needs_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert R.main([]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0]


def test_bad_arguments(capsys):
    assert R.main(["--rate", "fast"]) != 0
    assert "rate 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        R.main(["--transports", "shm"])


# ---------------------------------------------------------------- the link itself (root)

def _why_not_root() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if missing := N.missing_tools():
        return f"needs {' and '.join(missing)}"
    return None


needs_root = pytest.mark.skipif(_why_not_root() is not None, reason=_why_not_root() or "")

SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 7777)); print("ready", flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 16)): n += len(b)
print(n, flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 7777), timeout=5) as c: c.sendall(b"x" * (1 << 20))
"""


def _ours(run_id: str) -> list[str]:
    return [n for n in N.list_namespaces() if run_id in n]


@pytest.mark.launches
@needs_root
def test_link_setup_counters_teardown():
    link = N.setup(N.new_run_id(), 10**9)
    sleeper = None
    try:
        assert sorted(_ours(link.run_id)) == [link.ns_a, link.ns_b]
        for ns, addr in ((link.ns_a, N.ADDR_A), (link.ns_b, N.ADDR_B)):
            dev = json.loads(subprocess.run(["ip", "-n", ns, "-j", "addr", "show", "dev", N.IFNAME],
                                            capture_output=True, text=True, check=True).stdout)[0]
            assert "UP" in dev["flags"] and dev["link_type"] == "ether"
            assert {(x["local"], x["prefixlen"]) for x in dev["addr_info"] if x["family"] == "inet"} == {(addr, 30)}
            lo = json.loads(subprocess.run(["ip", "-n", ns, "-j", "link", "show", "lo"],
                                           capture_output=True, text=True, check=True).stdout)[0]
            assert "UP" in lo["flags"]
            q = N.qdisc_stats(ns)
            assert q["kind"] == "tbf" and q["options"]["rate"] == 10**9 // 8
        before = N.counters(link)
        server = subprocess.Popen([*link.prefix("a"), sys.executable, "-c", SERVER, N.ADDR_A],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        subprocess.run([*link.prefix("b"), sys.executable, "-c", CLIENT, N.ADDR_A], check=True, timeout=20)
        assert int(server.communicate(timeout=20)[0].strip()) == 1 << 20
        moved = N.counters(link) - before
        assert moved.b_to_a >= 1 << 20  # the client in b sent 1 MiB through b's tbf
        assert moved.a_to_b > 0 and moved.drops == 0  # a's ACKs
        sleeper = subprocess.Popen([*link.prefix("a"), "sleep", "60"])
        time.sleep(0.2)
    finally:
        removed = N.teardown(link)
    assert sorted(removed) == [link.ns_a, link.ns_b]
    assert _ours(link.run_id) == []
    assert sleeper.wait(timeout=5) == -signal.SIGKILL  # what lived in a namespace went with it
    assert not os.path.exists(os.path.join(N.LOCK_DIR, f"{link.run_id}.lock"))


@pytest.mark.launches
@needs_root
def test_leftovers_of_a_dead_run_are_removed_and_a_live_run_is_kept():
    dead = N.setup(N.new_run_id(), 10**8)
    os.close(dead.lock_fd)  # as if its process had died: the namespaces stay, nobody holds the lock
    live = N.setup(N.new_run_id(), 10**8)
    try:
        removed = N.sweep_leftovers()
        assert dead.ns_a in removed and dead.ns_b in removed and _ours(dead.run_id) == []
        assert sorted(_ours(live.run_id)) == [live.ns_a, live.ns_b]
    finally:
        N.teardown(live)
        dead.lock_fd = None
        N.teardown(dead)
    assert _ours(live.run_id) == []


@pytest.mark.launches
@needs_root
def test_sigint_tears_down():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    p = subprocess.Popen([sys.executable, "-m", "kvbench.selftest", "--no-iperf", "--transports", "tcp",
                          "--streaming", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    run_id = None
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not run_id:
            mine = [n for n in N.list_namespaces() if n.startswith(f"kvb-{p.pid}-")]
            run_id = mine[0][4:-2] if len(mine) == 2 else None
            time.sleep(0.1)
        assert run_id, "the selftest did not create its namespaces"
        time.sleep(1.0)  # into the kvbench launch
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, out
    assert "# selftest: INTERRUPTED" in out
    assert _ours(run_id) == []
    assert not os.path.exists(os.path.join(N.LOCK_DIR, f"{run_id}.lock"))
