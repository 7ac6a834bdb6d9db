"""The ucx transport's one-sided default (transports/ucx_rma.py, kvbench/_ucx.c): every byte of a paged push and
pull goes through ucp_put_nbx / ucp_get_nbx, none through a tag message; ``-O mode=tag`` is still the two-sided
path; the check still catches a block put in the wrong place and a single wrong byte."""
from __future__ import annotations

import json

import pytest
from helpers.asserts import assert_clean
from helpers.launch import python_path, unavailable

ARGS = ["--op", "push,pull", "--variants", "paged", "-c", "all", "--overlap", "serial", "--tokens", "64", "-b", "16",
        "-e", "16", "-n", "3", "-w", "1"]


def _env(tmp_path, liars: str = "") -> dict:
    return {"KVBENCH_TRANSPORTS": "ucx=ucx_counted:Counted" + liars, "PYTHONPATH": python_path(),
            "KVBENCH_UCX_COUNTS": str(tmp_path)}


def _counts(tmp_path) -> list[dict]:
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(autouse=True)
def _ucx_here():
    if reason := unavailable("ucx"):
        pytest.skip(f"unavailable: {reason}")
    try:
        import kvbench._ucx  # noqa: F401
    except ImportError:
        pytest.skip("kvbench._ucx is not built (make install builds it once ucxx is installed)")


def test_a_paged_push_and_pull_move_every_byte_one_sided(kvrun, tmp_path):
    """Every post's payload is handed to put (push, the source) or get (pull, the destination), whole; the
    destination's check finds every byte right in every iteration; no tag send carried anything."""
    r = kvrun(["-t", "ucx", *ARGS], env=_env(tmp_path), timeout=180)
    ok = assert_clean(r, "ucx")
    assert {i["mode"] for i in r.meta()["transports"]["ucx"] if i} == {"rma"}
    assert set(ok[(ok.iter >= 0) & (ok.role == "decode")].completion) == {"harness"}  # notifies=False: the harness
    payload = int(ok.payload_bytes.iloc[0])
    src, dst = _counts(tmp_path)
    assert src["mode"] == dst["mode"] == "rma"
    # rank 0 is the source: it puts every push and serves pulls passively; rank 1 gets every pull
    assert src["get_bytes"] == 0 and dst["put_bytes"] == 0
    assert src["rma_posts"] >= 3 + 1 + 1 and dst["rma_posts"] >= 3 + 1 + 1  # timed, warm-up, check pass
    assert src["put_bytes"] == src["rma_posts"] * payload
    assert dst["get_bytes"] == dst["rma_posts"] * payload
    assert src["tag_bytes"] == dst["tag_bytes"] == 0


def test_mode_tag_is_the_two_sided_path(kvrun, tmp_path):
    """-O mode=tag: the same request moves right through tag messages, and nothing through put/get (so the counts
    above can tell the two paths apart)."""
    r = kvrun(["-t", "ucx", *ARGS, "-O", "ucx.mode=tag"], env=_env(tmp_path), timeout=180)
    ok = assert_clean(r, "ucx")
    assert {i["mode"] for i in r.meta()["transports"]["ucx"] if i} == {"tag"}
    payload = int(ok.payload_bytes.iloc[0])
    src, dst = _counts(tmp_path)
    assert src["mode"] == "tag" and src["put_bytes"] == src["get_bytes"] == dst["put_bytes"] == dst["get_bytes"] == 0
    assert src["tag_bytes"] >= 2 * 5 * payload  # the source sends both ops' data: 5 iterations each at least


def test_a_wrong_block_and_a_wrong_byte_put_one_sided_are_caught(kvrun, tmp_path):
    """Liars over the one-sided path (tests/ucx_counted.py): each block put into its neighbour's place, and one
    byte from the wrong place; the honest ucx beside them is clean."""
    liars = ",lie-wrong-block-ucx=ucx_counted:WrongBlockRma,lie-one-byte-ucx=ucx_counted:OneByteRma"
    r = kvrun(["-t", "ucx,lie-wrong-block-ucx,lie-one-byte-ucx", *ARGS], env=_env(tmp_path, liars), timeout=240)
    assert r.code != 0
    checks = r.table().query("iter == -1 and role == 'decode'")
    per = checks.groupby(["transport", "op"]).nwrong.sum()
    assert per["ucx"].eq(0).all(), per
    assert (per["lie-wrong-block-ucx"] > 1000).all() and (per["lie-one-byte-ucx"] > 0).all(), per


def test_put_get_over_a_lane_that_needs_the_target_is_refused_in_one_line(kvrun, tmp_path):
    """tls=tcp: UCX's put over a socket completes only when the target progresses UCX, which a passive target never
    does: the run fails at setup saying so (rather than hanging), and -O mode=tag runs there."""
    r = kvrun(["-t", "ucx", "--op", "push", "--variants", "paged", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2",
               "-w", "1", "-O", "ucx.tls=tcp"], timeout=120, leftovers_ok=True)
    assert r.code != 0
    assert "needs the target to progress UCX" in r.err + r.out and "-O mode=tag" in r.err + r.out
    r = kvrun(["-t", "ucx", "--op", "push", "--variants", "paged", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2",
               "-w", "1", "-O", "ucx.tls=tcp", "-O", "ucx.mode=tag"], timeout=120)
    assert_clean(r, "ucx")
