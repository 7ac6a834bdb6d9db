"""staged between 2 real ranks on torch CPU tensors: device -> bounce -> tcp -> bounce -> device, chunked and
double-buffered, every byte checked; and its pure chunking."""
import numpy as np
import pytest

pytest.importorskip("torch")

from kvbench.transports.staging import split  # noqa: E402
from tests.conftest import table_rows  # noqa: E402

# 256 tokens of llama-3-8b: 1 MiB per layer; 256 KiB chunks make 4 per layer, so slots are reused within a layer
SMALL = ["-t", "staged", "--memory", "torch-cpu", "-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1",
         "--variants", "bulk,paged", "--rounds", "1", "-O", "chunk_kib=256"]


def test_split_cuts_a_layer_at_every_chunk_boundary_and_keeps_every_byte():
    d = np.array([[0, 500, 300], [1000, 0, 700], [4000, 3000, 100], [9000, 9999, 5]], np.int64)
    chunks = split(d, 256)
    assert [int(c[:, 2].sum()) for c in chunks] == [256, 256, 256, 256, 81]
    flat = np.concatenate(chunks)
    # the pieces, in order, cover the descriptors' bytes exactly once; the 4th column is the offset in the chunk
    src = np.concatenate([np.arange(s, s + n) for s, _, n, _ in flat.tolist()])
    dst = np.concatenate([np.arange(t, t + n) for _, t, n, _ in flat.tolist()])
    assert np.array_equal(src, np.concatenate([np.arange(s, s + n) for s, _, n in d.tolist()]))
    assert np.array_equal(dst, np.concatenate([np.arange(t, t + n) for _, t, n in d.tolist()]))
    for c in chunks:
        assert c[0, 3] == 0 and np.array_equal(c[1:, 3], np.cumsum(c[:-1, 2]))
    assert split(np.zeros((0, 3), np.int64), 256) == []


@pytest.mark.parametrize("extra", [["-O", "inner=tcp"], ["-O", "pipeline=off", "--copy", "kernel"]],
                         ids=["pipelined", "unpipelined-kernel"])
def test_staged_push_and_pull_over_tcp_land_every_byte_with_stage_times(kvrun, extra):
    r = kvrun([*SMALL, "--op", "push,pull", *extra], timeout=180)
    assert r.code == 0, r.out + r.err
    df = r.table()
    ok = df[df["iter"] >= 0]
    assert set(ok["status"]) == {"ok"} and set(ok["memory"]) == {"torch-cpu"}
    assert set(ok["op"]) == {"push", "pull"} and set(ok["variant"]) == {"bulk", "paged"}
    assert set(ok["copy"]) == {"kernel" if "kernel" in extra else "batch"}
    live = table_rows(r.out)  # the live table names where the pools live, and a copy engine other than batch
    assert len(live) == 4 and {x["mem"] for x in live} == {"torch-cpu"}
    assert [x.get("copy") for x in live] == ["kernel" if "kernel" in extra else None] * 4
    check = df[(df["iter"] == -1) & (df["role"] == "decode")]
    assert len(check) == 4 and (check["nwrong"] == 0).all()
    src, dst = ok[ok["role"] == "prefill"], ok[ok["role"] == "decode"]
    assert (src["gather_s"] > 0).all() and (src["scatter_s"] == 0).all()
    assert (dst["scatter_s"] > 0).all() and (dst["gather_s"] == 0).all() and (dst["wire_s"] > 0).all()
    assert (ok["payload_bytes"] == 256 * 131072).all()  # 128 KiB per token (fp16, 32 layers, 8 KV heads x 128)
    info = r.meta()["transports"]["staged"][0]
    assert info["inner"] == "tcp" and info["bounce"] == "pageable (page-locking needs CUDA)"
    assert info["pipeline"] == ("off" if "pipeline=off" in extra else "on")


def test_a_corrupted_byte_is_caught_through_the_staged_path(kvrun):
    r = kvrun([*SMALL, "--op", "push", "--variants", "paged", "--inject-corruption", "1"], timeout=120)
    assert r.code == 2 and r.meta()["total_wrong"] == 1


def test_staged_with_host_memory_is_refused_with_the_reason(kvrun):
    r = kvrun(["-t", "staged", "--tokens", "256", "-n", "1"], timeout=60)
    assert r.code == 1
    assert "staged: --memory host has nothing to stage" in r.err and r.err.count("\n") == 1


def test_host_transports_skip_device_memory_and_staged_skips_host_rows(kvrun):
    r = kvrun(["-t", "tcp,staged", "--memory", "host,torch-cpu", "--tokens", "256", "-n", "1", "-w", "0",
               "--variants", "paged", "--rounds", "1"], timeout=120)
    assert r.code == 0, r.out + r.err
    df = r.table()
    sk = df[df["status"] == "skipped"].set_index(["transport", "memory"])["reason"]
    assert sk[("tcp", "torch-cpu")] == "unavailable: tcp moves host memory, not torch-cpu"
    assert sk[("staged", "host")].startswith("unavailable: staged: --memory host has nothing to stage")
    ran = df[(df["status"] == "ok") & (df["iter"] == -1) & (df["role"] == "decode")]
    assert set(zip(ran["transport"], ran["memory"])) == {("tcp", "host"), ("staged", "torch-cpu")}
    assert (ran["nwrong"] == 0).all()


def test_cuda_memory_without_a_gpu_is_refused_in_one_line_with_the_reason(kvrun, tmp_path):
    """--memory cuda where no GPU is: one line, exit 1, nothing written (it once gave skipped rows, exit 3)."""
    from test_errors import assert_nothing_written, assert_one_line

    from kvbench.memory import device

    if device.probe("cuda") is None:
        pytest.skip("a GPU is present")
    r = kvrun(["-t", "staged,cuda_ipc", "--memory", "cuda", "--tokens", "256", "-n", "1", "-w", "0",
               "--variants", "paged", "--rounds", "1"], timeout=60)
    assert_one_line(r, "--memory cuda: no CUDA device (no CUDA driver: libcuda.so.1 does not load)")
    assert_nothing_written(tmp_path)


def test_the_check_computed_with_torch_ops_holds_through_the_harness(kvrun):
    """The path a CUDA pool's check takes (memory/device.py's poison, epoch, snapshot, count), forced on CPU
    tensors: clean, then one flipped byte counted."""
    args = ["-t", "staged", "--memory", "torch-cpu", "--tokens", "64", "-n", "1", "-w", "0", "--variants", "paged",
            "--rounds", "1", "--op", "push,pull"]
    env = {"KVBENCH_CHECK_ON_DEVICE": "1"}
    r = kvrun(args, env=env, timeout=120)
    assert r.code == 0 and r.meta()["total_wrong"] == 0, r.out + r.err
    r = kvrun([*args, "--inject-corruption", "1"], env=env, timeout=120)
    assert r.code == 2 and r.meta()["total_wrong"] == 2  # one element in each of the two checked cases
