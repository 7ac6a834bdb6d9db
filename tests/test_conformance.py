"""One suite every transport passes: real ranks, push and pull, every byte checked.

A transport's own test file only supplies fixtures; this file is the contract, for every registered
transport that can run it (a plugin from KVBENCH_TRANSPORTS included). Unavailable transports skip with
the reason `kvbench list` gives.
"""
import os
import subprocess
import sys

import pytest
from helpers.asserts import assert_clean
from helpers.launch import ROOT, python_path, unavailable

from kvbench import transports
from kvbench.transports.base import Unavailable

# llama-3-8b's layer (8 KV heads of 128, fp16: 4 KiB a token) in 4 layers, not its 32: the same descriptors per
# layer, an eighth of the bytes to fill and check
LAYERS = 4
SHAPE = ["--layers", str(LAYERS), "--kv-heads", "8", "--head-dim", "128"]
TOKEN_BYTES = LAYERS * 2 * 8 * 128 * 2  # K and V, fp16
TINY = [*SHAPE, "--tokens", "200", "-n", "3", "-w", "1", "--variants", "bulk,paged", "--rounds", "1"]


def between_ranks() -> list[str]:
    """The registered transports this suite runs, in registry order: by their Caps, pools in host memory moved
    between ranks (not within one process, as loopback does).  One whose module cannot be imported is kept:
    its test skips with the reason."""
    names = []
    for name in transports.names():
        try:
            caps = transports.load(name).caps
        except Unavailable:
            names.append(name)
            continue
        if "host" in caps.memory and not caps.local_only:
            names.append(name)
    return names


NETWORK = between_ranks()
PLUGIN = {"KVBENCH_TRANSPORTS": "site-shm=plugin:SiteShm", "PYTHONPATH": python_path()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.check) if n in ("shm", "tcp") else n for n in NETWORK])
def test_two_ranks_push_pull_paged_and_coalesced(kvrun, name):
    reason = unavailable(name)
    if reason:
        pytest.skip(f"unavailable: {reason}")
    r = kvrun(["-t", name, "--op", "push,pull", "-b", "16", "-e", "64", "-f", "4", "--alloc", "random,contiguous",
               "--coalesce", "off,on", *TINY], timeout=240)
    ok = assert_clean(r, name)
    # a partial last block: 200 tokens = 12 blocks of 16 + 8 tokens; payload is exact
    assert set(ok.payload_bytes) == {200 * TOKEN_BYTES}
    paged = ok[(ok.variant == "paged") & (ok.block_size == 16)]
    assert set(paged[paged.coalesce == "off"].descriptors) == {LAYERS * 2 * 13}
    # contiguous + coalesced = one descriptor per region per layer
    cc = paged[(paged.coalesce == "on") & (paged.allocation == "contiguous")]
    assert set(cc.descriptors) == {LAYERS * 2}
    skipped = r.table()
    skipped = skipped[(skipped.transport == name) & (skipped.status == "skipped")]
    assert skipped.empty or skipped.reason.str.startswith("unavailable:").all()


# the ceiling's four chunk sizes are four cases more of each transport, op and in-flight: one scheme carries them
# (many-to-one: three sources' chunks into one pool), at 2 requests in flight only (the others run 1 and 2)
@pytest.mark.parametrize("scheme,pairs,variants", [("pairwise", 2, "bulk,paged"), ("many-to-one", 3, "bulk,ceiling,paged"),
                                                   ("one-to-many", 3, "bulk,paged"), ("all-pairs", 4, "bulk,paged")])
def test_four_ranks_every_scheme(kvrun, scheme, pairs, variants):
    names = [n for n in ("shm", "tcp", "mpi") if not unavailable(n)]
    inflight = "2" if "ceiling" in variants else "1,2"
    r = kvrun(["-t", ",".join(names), "--op", "push,pull", "--scheme", scheme, "-b", "16", "-e", "16",
               "--inflight", inflight, *SHAPE, "--tokens", "64", "-n", "2", "-w", "1", "--variants", variants], n=4,
              timeout=300)
    for name in names:
        ok = assert_clean(r, name)
        assert set(ok.scheme) == {scheme}
        assert set(ok.variant.str.replace(r"^chunk-.*", "ceiling", regex=True)) == set(variants.split(","))
        assert ok.groupby("case").pair.nunique().eq(pairs).all()
        # inflight 2: two requests per pair, each checked
        two = ok[(ok.inflight == 2) & (ok.iter == -1) & (ok.role == "decode")]
        assert len(two) and two.groupby(["case", "pair"]).req.nunique().eq(2).all()


@pytest.mark.parametrize("split", ["0", "64"])
def test_mpi_hindexed_and_split_calls_move_the_same_bytes(kvrun, split):
    """split=0: every layer is one hindexed call (bulk too); split=64: every layer of 16-token blocks
    (13 per region, 26 per layer) is contiguous calls.  Both must land every byte."""
    if unavailable("mpi"):
        pytest.skip(f"unavailable: {unavailable('mpi')}")
    r = kvrun(["-t", "mpi", "-O", f"split={split}", "--op", "push,pull", "-b", "16", "-e", "16", "--alloc", "random",
               *TINY], timeout=240)
    ok = assert_clean(r, "mpi")
    assert set(ok[ok.variant == "paged"].descriptors) == {LAYERS * 2 * 13}
    meta = r.meta()
    assert {i["split"] for i in meta["transports"]["mpi"]} == {int(split)}


@pytest.mark.parametrize("opts,calls", [
    (["-O", "calls=mpi4py"], "mpi4py: -O calls=mpi4py"),
    (["-O", "epoch=lock", "-O", "split=64"], "native"),
    (["-O", "prep=off", "-O", "window=create"], "native"),
])
def test_mpi_native_and_mpi4py_calls_move_the_same_bytes(kvrun, opts, calls):
    """The C calls (the default) and mpi4py's, under each epoch, window and prep, two requests in flight (one
    notice lists both tags): every byte lands, and the sidecar says who made the calls."""
    if unavailable("mpi"):
        pytest.skip(f"unavailable: {unavailable('mpi')}")
    r = kvrun(["-t", "mpi", *opts, "--op", "push,pull", "-b", "16", "--inflight", "1,2", *TINY], timeout=240)
    ok = assert_clean(r, "mpi")
    assert set(ok.inflight) == {1, 2}
    assert {i["calls"] for i in r.meta()["transports"]["mpi"]} == {calls}


def test_the_list_is_every_registered_transport_its_caps_allow(monkeypatch):
    plugins = transports._extra(os.environ.get("KVBENCH_TRANSPORTS", ""))  # the ones this process was given
    builtin = [n for n in between_ranks() if n not in plugins]
    assert builtin == ["shm", "tcp", "mpi", "mpi-sendrecv", "nixl", "ucx", "mooncake", "verbs"]
    monkeypatch.setitem(transports.REGISTRY, "site-shm", ("plugin:SiteShm", ""))
    assert between_ranks()[-1] == "site-shm"


@pytest.mark.launches
def test_a_registered_plugin_is_tested_for_free():
    """A transport registered through KVBENCH_TRANSPORTS (tests/plugin.py) is in this suite's list without a
    line here, and passes the same contract as the built-in one it extends."""
    node = "tests/test_conformance.py::test_two_ranks_push_pull_paged_and_coalesced[site-shm]"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=ROOT,
                       env=dict(os.environ, **PLUGIN), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
