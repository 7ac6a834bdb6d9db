"""Engines' own logging kept off an OK run's stderr (issue 46 item 9): what a C library writes to fd 2 inside
``engine_stderr`` lands in the transport's record, not on the terminal; KVBENCH_ENGINE_LOGS=1 keeps it there."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.launch import python_path

from kvbench import transports

SNIPPET = """
import os, sys
from kvbench.transports.quiet import engine_stderr
with engine_stderr() as log:
    os.write(2, b"E1207 glog: Local segment descriptor not found\\n")  # as a C library writes it
print("captured:", log.last())
os.write(2, b"after\\n")
"""


@pytest.mark.parametrize("keep", [False, True])
def test_fd2_inside_the_block_is_captured_and_restored_after(keep):
    env = dict(os.environ, PYTHONPATH=python_path())
    env.pop("KVBENCH_ENGINE_LOGS", None)
    if keep:
        env["KVBENCH_ENGINE_LOGS"] = "1"
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    if keep:
        assert "Local segment descriptor" in r.stderr and "captured: \n" in r.stdout + "\n"
    else:
        assert "E1207 glog: Local segment descriptor not found" in r.stdout and "Local segment" not in r.stderr
    assert r.stderr.endswith("after\n")  # fd 2 is the terminal's again


def test_an_ok_mooncake_run_keeps_glog_off_stderr_and_in_its_record(kvrun):
    if reason := transports.probe("mooncake"):
        pytest.skip(f"unavailable: {reason}")
    r = kvrun(["-t", "mooncake", "--tokens", "16", "-n", "2", "-w", "0", "--variants", "bulk"], timeout=120)
    assert r.code == 0, r.out + r.err
    assert "InitGoogleLogging" not in r.err and "transfer_metadata.cpp" not in r.err, r.err
    assert any("InitGoogleLogging" in (i or {}).get("engine_log", "") for i in r.meta()["transports"]["mooncake"])
