"""Issue 44: the path that really carried the bytes (carrier_proto on every row), the path a case is meant to
measure (--expect, derived under auto) and FALLBACK (exit 7) when they differ; per-process evidence only."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pandas as pd
import pytest
from helpers.launch import kvbench_cli, unavailable

from kvbench.fabric import expect as X
from kvbench.fabric import procsock, ucxproto
from kvbench.fabric import proto as P
from kvbench.job import status as ST
from kvbench.results import store
from kvbench.transports import options as O

TINY = ["-m", "llama-3-8b", "--tokens", "16", "-n", "2", "-w", "0", "--variants", "paged"]


def _need(*names):
    for n in names:
        why = unavailable(n)
        if why:
            pytest.skip(f"{n}: {why}")


def _ucx_tag() -> list[str]:
    """ucx over tcp needs its two-sided mode where the transport has a one-sided one (a passive target)."""
    return ["-O", "ucx.mode=tag"] if "mode" in O.known("ucx") else []


def _timed(run) -> pd.DataFrame:
    df = run.transfers()
    return df[(df["iter"] >= 0) & (df["status"] == "ok")]


# ---- in-process -----------------------------------------------------------------------------------------------
def test_status_fallback_has_its_own_code_below_suspect():
    assert ST.exit_code("FALLBACK") == 7 and [s for s, (c, _) in ST.STATUSES.items() if c == 7] == ["FALLBACK"]
    assert ST.verdict(3, True, 0, 0, 1) == "FALLBACK" and ST.verdict(3, True, 0, 1, 1) == "SUSPECT"
    assert ST.verdict(3, True, 2, 0, 1) == "FAILED" and ST.verdict(0, True, 0, 0, 1) == "NOTHING MEASURED"
    assert ST.worst([7, 6]) == 6 and ST.worst([7, 0, 3]) == 7 and ST.worst([4, 7]) == 4


def test_older_schemas_read_with_empty_carrier_proto():
    assert store.SCHEMA_VERSION >= 9 and 8 in store.READS and 9 in store.RESUMES
    old = pd.DataFrame({"case": [1], "iter": [0]})
    got = store.upgrade(old, 8)
    assert got["carrier_proto"].tolist() == [""] and got["carrier_evidence"].tolist() == [""]


def test_classes_and_expectations():
    assert [P.klass(p) for p in ("ucx:sysv/cma", "nixl/ucx:tcp", "mpich:shm", "tcp:lo", "memcpy", "shm",
                                 "mooncake:tcp", "cuda_ipc:nvlink", "verbs:mlx5_0", "-")] == \
        ["shm", "tcp", "shm", "tcp", "shm", "shm", "tcp", "nvlink", "rdma", ""]
    assert X.expected("nixl", "host", True, {}, "auto", rdma=False)[0] == "shm"
    assert X.expected("nixl", "cuda", True, {}, "auto", rdma=True)[0] == "nvlink"
    assert X.expected("nixl", "host", False, {}, "auto", rdma=True)[0] == "rdma"
    assert X.expected("mpi", "host", False, {}, "auto", rdma=False)[0] == "tcp"
    assert X.expected("tcp", "host", True, {}, "auto")[0] == "tcp"  # over lo on one host: that IS its path
    assert X.expected("ucx", "host", True, {"tls": "tcp"}, "auto")[0] == "tcp"
    assert X.expected("nixl", "host", True, {}, "tcp")[0] == "tcp"
    assert X.fallback("shm", "tcp") and not X.fallback("tcp", "tcp") and not X.fallback("any", "tcp")
    assert not X.fallback("shm", "")  # an unknown carrier is no verdict
    with pytest.raises(X.ExpectError):
        X.parse("ethernet")


def test_expect_refuses_a_wrong_word_in_one_line():
    r = kvbench_cli("run", "--expect", "ethernet", "-t", "shm")
    assert r.returncode != 0 and "--expect" in r.stderr and r.stderr.strip().count("\n") <= 1, r.stderr


def test_own_sockets_are_counted_not_the_hosts():
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    before = procsock.sample()
    a.sendall(b"x" * 65536)
    got = 0
    while got < 65536:
        got += len(b.recv(65536))
    moved = procsock.delta(before, procsock.sample())
    assert moved["lo"][0] >= 65536 and moved["lo"][1] >= 65536
    c = P.carried("shm", {}, "r", 0, True, moved, 65536, 0)
    assert c.proto == "shm:tcp" and "over lo" in c.evidence  # the sockets outrank the engine's word
    for s in (a, b, srv):
        s.close()


def test_ucx_lanes_parse():
    text = ("#                 lane[0]:  1:tcp/lo.0 md[1]  -> md[1]/tcp/sysdev[255] seg 4294967295 am keepalive wireup\n"
            "#                 lane[1]:  5:cma/memory.0 md[3]  -> md[3]/cma/sysdev[255] rma_bw#0\n")
    eps = [{"lanes": ucxproto.lanes(text), "protocols": []}]
    assert eps[0]["lanes"][0][:2] == ("tcp", "lo") and ucxproto.short(eps) == "cma"  # the bulk lane carries


# ---- launched --------------------------------------------------------------------------------------------------
def test_nixl_and_ucx_over_tcp_are_fallback(kvrun, tmp_path):
    _need("nixl", "ucx")
    r = kvrun(["-t", "nixl,ucx", *_ucx_tag(), *TINY], env={"UCX_TLS": "tcp,self"}, timeout=240,
              out_dir=tmp_path / "tcp")
    assert r.code == ST.exit_code("FALLBACK"), r.out + r.err
    lines = [ln for ln in r.out.splitlines() if ln.startswith("# FALLBACK")]
    for name in ("nixl", "ucx"):
        ln = next(x for x in lines if x.startswith(f"# FALLBACK {name} "))
        assert "expected shared memory" in ln and "tcp over lo" in ln, ln
    assert "# path expected (--expect auto" in r.out
    meta = r.meta()
    assert meta["status"] == "FALLBACK" and meta["reason"].startswith("FALLBACK") and meta["fallbacks"]
    assert set(_timed(r)["carrier_proto"]) == {"nixl/ucx:tcp", "ucx:tcp"}
    # --expect any: no verdict, the column stays
    r = kvrun(["-t", "nixl", "--expect", "any", *TINY], env={"UCX_TLS": "tcp,self"}, timeout=240,
              out_dir=tmp_path / "any")
    assert r.code == 0 and "# FALLBACK" not in r.out, r.out + r.err
    assert set(_timed(r)["carrier_proto"]) == {"nixl/ucx:tcp"}


def test_nixl_and_ucx_on_shared_memory_are_ok(kvrun, tmp_path):
    _need("nixl", "ucx")
    r = kvrun(["-t", "nixl,ucx", *TINY], timeout=240, out_dir=tmp_path / "shm")
    assert r.code == 0 and "# FALLBACK" not in r.out, r.out + r.err
    for name, head in (("nixl", "nixl/ucx:"), ("ucx", "ucx:")):
        protos = set(_timed(r)[lambda d, n=name: d["transport"] == n]["carrier_proto"])
        assert protos and all(p.startswith(head) and P.klass(p) == "shm" for p in protos), protos
    assert r.meta()["carrier_raw"]  # the engine's own words (lanes, protocol tables) in the sidecar


def test_mpich_without_its_shared_memory(kvrun, tmp_path):
    env = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}  # no shared memory for MPICH, and its netmod on tcp
    r = kvrun(["-t", "mpi", *TINY], env=env, out_dir=tmp_path / "a")
    if "mpich" not in str(r.meta().get("mpi", "")).lower():
        pytest.skip("not MPICH")
    assert r.code == ST.exit_code("FALLBACK") and "# FALLBACK mpi " in r.out and "tcp over lo" in r.out, r.out
    assert set(_timed(r)["carrier_proto"]) == {"mpich/ucx:tcp"}
    r = kvrun(["-t", "mpi", "--expect", "tcp", *TINY], env=env, out_dir=tmp_path / "b")
    assert r.code == 0 and "# FALLBACK" not in r.out, r.out + r.err
    # NOLOCAL alone: MPICH's netmod carries the pair, and its UCX keeps it in shared memory (cma): not a detour
    r = kvrun(["-t", "mpi", *TINY], env={"MPIR_CVAR_NOLOCAL": "1"}, out_dir=tmp_path / "c")
    protos = set(_timed(r)["carrier_proto"])
    assert r.code == 0 and protos and all(p.startswith("mpich/ucx:") for p in protos), (protos, r.out)
    assert all("NOLOCAL" in e for e in _timed(r)["carrier_evidence"])
    r = kvrun(["-t", "mpi", *TINY], out_dir=tmp_path / "d")
    assert r.code == 0 and set(_timed(r)["carrier_proto"]) == {"mpich:shm"}


NOISE = """
import socket, sys, time
srv = socket.create_server(("127.0.0.1", 0)); a = socket.create_connection(srv.getsockname()); b, _ = srv.accept()
import threading
threading.Thread(target=lambda: [b.recv(1 << 20) for _ in iter(int, 1)], daemon=True).start()
buf = b"n" * (1 << 20); print("ready", flush=True); end = time.time() + float(sys.argv[1])
while time.time() < end:
    a.sendall(buf)
"""


def test_verdict_ignores_other_traffic_on_loopback(kvrun, tmp_path):
    """Another process pushes bytes through lo throughout: the machine's lo counter moves, this process's
    sockets do not, and the verdicts stay what they are alone (tcp: tcp over lo, OK; shm: shm, OK)."""
    args = ["-t", "tcp,shm", *TINY]
    quiet = kvrun(args, out_dir=tmp_path / "quiet")
    noise = subprocess.Popen([sys.executable, "-c", NOISE, "120"], stdout=subprocess.PIPE, text=True)
    try:
        assert noise.stdout.readline().strip() == "ready"
        lo0 = int(open("/sys/class/net/lo/statistics/tx_bytes").read())
        loud = kvrun(args, out_dir=tmp_path / "loud")
        lo_moved = int(open("/sys/class/net/lo/statistics/tx_bytes").read()) - lo0
    finally:
        noise.kill()
        noise.wait()
    assert lo_moved > 10 * (1 << 20)  # the noise really went through lo meanwhile
    for r in (quiet, loud):
        assert r.code == 0 and "# FALLBACK" not in r.out, r.out + r.err
    got = [_timed(r).groupby("transport")["carrier_proto"].agg(lambda x: sorted(set(x))).to_dict() for r in (quiet, loud)]
    assert got[0] == got[1] == {"shm": ["shm"], "tcp": ["tcp:lo"]}
    assert [r.meta()["status"] for r in (quiet, loud)] == ["OK", "OK"]


def test_every_row_of_every_transport_says_its_carrier(kvrun, tmp_path):
    names = ["loopback", "shm", "tcp", "mpi", "mpi-sendrecv", "nixl", "ucx", "mooncake", "cuda_ipc", "verbs", "staged"]
    r = kvrun(["-t", ",".join(names), *TINY], timeout=300)
    assert r.code in (0, 7), r.out + r.err
    df = r.table()
    assert set(names) <= set(df["transport"])
    assert (df["carrier_proto"].astype(str) != "").all()
    unknown = df[df["carrier_proto"] == P.UNKNOWN]
    assert (unknown["carrier_evidence"].astype(str).str.len() > 0).all()
    measured = df[df["status"] == "ok"]
    assert not (measured["carrier_proto"] == P.UNKNOWN).any(), measured.groupby("transport")["carrier_evidence"].first()
    assert all(P.klass(p) for p in measured["carrier_proto"])


def test_probing_an_engine_leaves_the_environment_as_it_found_it():
    """ucxx sets UCX_* defaults when imported (UCX_RNDV_FRAG_MEM_TYPE=cuda among them); a probe in a parent process
    (kvbench list, a test's availability check) handed them to every later launch, where NIXL's UCX then carried
    the bytes over tcp: FALLBACK, on a fresh clone's make test.  The probe puts the environment back."""
    from kvbench import transports

    if transports.probe("ucx"):
        pytest.skip("ucxx not installed")
    code = ("import os, json; from kvbench import transports; b = dict(os.environ); transports.probe('ucx'); "
            "print(json.dumps([sorted(set(os.environ) - set(b)), transports.probe('ucx')]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[[], null]", r.stdout  # nothing added, ucx available
    raw = subprocess.run([sys.executable, "-c", "import os; b = set(os.environ); import ucxx; "
                          "print(sorted(set(os.environ) - b))"], capture_output=True, text=True, timeout=120, env=env)
    assert "UCX_RNDV_FRAG_MEM_TYPE" in raw.stdout  # the import alone does add them: the test can fail
