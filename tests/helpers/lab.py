"""The lab's tests' helpers (root): whether this machine can build a lab, a lab for a test module (conftest's ``lab`` fixture), and running
`kvbench lab` and reading the results it wrote."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from kvbench.selftest import netns as N

from .launch import ROOT


def _why_not_root() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridges, tc)"
    if missing := N.missing_tools():
        return f"needs {' and '.join(missing)}"
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        return "no mpiexec (make install)"
    return None


needs_root = pytest.mark.skipif(_why_not_root() is not None, reason=_why_not_root() or "")


def _ours(tag: str) -> list[str]:
    """Namespaces and root-namespace links whose names carry ``tag``."""
    links = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [n for n in N.list_namespaces() if tag in n] + [d["ifname"] for d in json.loads(links) if tag in d["ifname"]]


def _lab(*args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "kvbench", "lab", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _results(out: str) -> pd.DataFrame:
    path = re.search(r"^# results: (\S+\.parquet)$", out, re.M).group(1)
    df = pd.read_parquet(path)
    with open(path.replace(".parquet", ".meta.json")) as fh:
        df.attrs["meta"] = json.load(fh)
    return df[df["iter"] >= 0]
