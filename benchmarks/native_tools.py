#!/usr/bin/env python3
"""Run the engines' own benchmarks at given message sizes; print CSV ``tool,size_bytes,gbps``.

These are the reference numbers kvbench's ``ucx`` and ``mooncake`` rows are
read against (GB/s = 1e9 B/s):

* ``ucx_put`` / ``ucx_get`` / ``ucx_tag``: ``ucx_perftest`` from the ucxx wheel
  (``libucx/bin``; needs ``LD_LIBRARY_PATH=<site-packages>/libucx/lib``), tests
  ``ucp_put_bw``, ``ucp_get`` and ``tag_bw`` (the last is what the two-sided
  ``ucx`` transport does), server and client on 127.0.0.1, one message of
  SIZE per iteration, the same buffer every time.  ``--tls`` sets UCX_TLS
  (default ``sm``: on one host kvbench's ucx rows resolve to sysv/posix for
  eager and cma for rendezvous, which ``sm`` covers; ``tcp`` for a network
  path).  ucx_perftest reports MiB/s; converted here.
* ``mooncake_write`` / ``mooncake_read``: Mooncake's ``transfer_engine_bench``
  (shipped in the wheel), a target and an initiator, P2P handshake, protocol
  tcp, ``--batch`` requests of SIZE per batch, ``--duration`` seconds.

Everything binds or connects to 127.0.0.1 where the tool allows it
(ucx_perftest's server and Mooncake's listeners bind all interfaces); every
child runs in its own process group with a timeout and is killed on exit.

usage: python benchmarks/native_tools.py [--sizes 262144,1048576,4194304]
       [--tools ucx_put,ucx_get,ucx_tag,mooncake_write,mooncake_read] [--tls sm]
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time

_CHILDREN: list[subprocess.Popen] = []
UCX_TESTS = {"ucx_put": "ucp_put_bw", "ucx_get": "ucp_get", "ucx_tag": "tag_bw"}
MC_OPS = {"mooncake_write": "write", "mooncake_read": "read"}


def _site() -> str:
    return sysconfig.get_paths()["purelib"]


def _spawn(cmd, env, log=None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    _CHILDREN.append(p)
    return p


def _kill_all() -> None:
    for p in _CHILDREN:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    _CHILDREN.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_run(test: str, size: int, tls: str, budget: float, timeout: float) -> float:
    """One ucx_perftest client/server pair; returns overall GB/s (1e9)."""
    libucx = os.path.join(_site(), "libucx")
    exe = os.path.join(libucx, "bin", "ucx_perftest")
    if not os.path.exists(exe):
        raise RuntimeError("ucx_perftest not found: pip install ucxx-cu12")
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(libucx, "lib"), UCX_TLS=tls,
               UCX_WARN_UNUSED_ENV_VARS="n")
    iters = int(min(20000, max(200, budget / size)))
    port = _free_port()
    server = _spawn([exe, "-p", str(port)], env)
    client_cmd = [exe, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                  "-n", str(iters), "-w", str(max(20, iters // 10)), "-f", "-v"]
    deadline = time.monotonic() + timeout
    try:
        while True:  # the server may not be listening yet: the client fails fast, retry
            out = subprocess.run(client_cmd, env=env, capture_output=True, text=True,
                                 timeout=max(1.0, deadline - time.monotonic()))
            rows = [ln.strip() for ln in out.stdout.splitlines() if re.match(r"^\s*\d+,", ln)]
            if out.returncode == 0 and rows:
                overall_mib = float(rows[-1].split(",")[5])  # iterations,p50,avg,overall lat,avg_bw,overall_bw,...
                return overall_mib * 1048576 / 1e9
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"ucx_perftest {test} failed: {(out.stdout + out.stderr).strip()[-300:]}")
            time.sleep(0.2)
    finally:
        _kill_all()


def mooncake_target(buffer_size: int, logpath: str):
    """Start a transfer_engine_bench target; return (process, session id host:rpc_port)."""
    exe = os.path.join(_site(), "mooncake", "transfer_engine_bench")
    if not os.path.exists(exe):
        raise RuntimeError("transfer_engine_bench not found: pip install mooncake-transfer-engine-non-cuda")
    env = dict(os.environ, MC_FORCE_TCP="1")
    log = open(logpath, "w")
    p = _spawn([exe, "--mode=target", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                f"--local_server_name=127.0.0.1:{_free_port()}", f"--buffer_size={buffer_size}"], env, log)
    for _ in range(100):  # its RPC port is chosen at random; it logs it
        time.sleep(0.1)
        m = re.search(r"listening on (127\.0\.0\.1:\d+)", open(logpath).read())
        if m:
            return p, m.group(1)
        if p.poll() is not None:
            break
    raise RuntimeError(f"transfer_engine_bench target did not start: {open(logpath).read()[-300:]}")


def mooncake_run(session: str, op: str, size: int, batch: int, threads: int, duration: int,
                 buffer_size: int, timeout: float) -> float:
    """One transfer_engine_bench initiator run; returns its GB/s (1e9)."""
    exe = os.path.join(_site(), "mooncake", "transfer_engine_bench")
    env = dict(os.environ, MC_FORCE_TCP="1")
    cmd = [exe, "--mode=initiator", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
           "--local_server_name=127.0.0.1", f"--segment_id={session}", f"--operation={op}",
           f"--block_size={size}", f"--batch_size={batch}", f"--threads={threads}",
           f"--duration={duration}", f"--buffer_size={buffer_size}", "--report_unit=GB",
           "--report_precision=4"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    m = re.search(r"throughput ([\d.]+) GB/s", out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"transfer_engine_bench {op} failed: {(out.stdout + out.stderr).strip()[-300:]}")
    return float(m.group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="262144,1048576,4194304")
    ap.add_argument("--tools", default="ucx_put,ucx_get,ucx_tag,mooncake_write,mooncake_read")
    ap.add_argument("--tls", default="sm", help="UCX_TLS for ucx_perftest (sm, tcp, ...)")
    ap.add_argument("--budget", type=float, default=2e9, help="bytes per ucx_perftest run (sets -n)")
    ap.add_argument("--batch", type=int, default=128, help="Mooncake requests per batch")
    ap.add_argument("--threads", type=int, default=1, help="Mooncake submission threads")
    ap.add_argument("--duration", type=int, default=3, help="seconds per Mooncake run")
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a run is killed")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    tools = args.tools.split(",")
    unknown = [t for t in tools if t not in UCX_TESTS and t not in MC_OPS]
    if unknown:
        ap.error(f"unknown tool(s) {unknown}; choose from {list(UCX_TESTS) + list(MC_OPS)}")
    atexit.register(_kill_all)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"# ucx_perftest UCX_TLS={args.tls}; mooncake tcp batch={args.batch} threads={args.threads} "
          f"duration={args.duration}s; GB/s = 1e9 B/s")
    print("tool,size_bytes,gbps")
    status = 0
    for tool in [t for t in tools if t in UCX_TESTS]:
        for size in sizes:
            try:
                gbps = ucx_run(UCX_TESTS[tool], size, args.tls, args.budget, args.timeout)
                print(f"{tool},{size},{gbps:.3f}", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"# {tool} {size}: {str(exc).splitlines()[0]}", flush=True)
                status = 1
    mc = [t for t in tools if t in MC_OPS]
    if mc:
        buffer_size = max(256 << 20, max(sizes) * args.batch * args.threads)
        logpath = f"/tmp/kvbench_mc_target_{os.getpid()}.log"
        try:
            _, session = mooncake_target(buffer_size, logpath)
            for tool in mc:
                for size in sizes:
                    try:
                        gbps = mooncake_run(session, MC_OPS[tool], size, args.batch, args.threads,
                                            args.duration, buffer_size, args.timeout)
                        print(f"{tool},{size},{gbps:.3f}", flush=True)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(f"# {tool} {size}: {str(exc).splitlines()[0]}", flush=True)
                        status = 1
        except RuntimeError as exc:
            print(f"# mooncake: {exc}", flush=True)
            status = 1
        finally:
            _kill_all()
            if os.path.exists(logpath):
                os.unlink(logpath)
    return status


if __name__ == "__main__":
    sys.exit(main())
