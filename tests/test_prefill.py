"""Real prefill (kvbench/harness/prefill.py): the model's matmuls layer by layer where the pools live, replacing the clock."""
import pytest

from kvbench.model import shapes as M

torch = pytest.importorskip("torch")

from kvbench.harness import prefill as P  # noqa: E402
from kvbench.harness.prefill import PrefillClock  # noqa: E402

pytestmark = pytest.mark.alone  # a real prefill's time hiding a transfer: a neighbour's load stretches one and not the other

TINY = ["--layers", "8", "--kv-heads", "2", "--head-dim", "64"]  # hidden 128: CPU matmuls of ~1 GFLOP per layer


def test_sizes_follow_the_model():
    s = P.sizes(M.get_model("llama-3-8b"))  # config.json: hidden 4096, intermediate 14336, 32 q / 8 kv heads
    assert s == {"hidden": 4096, "qkv": (32 + 2 * 8) * 128, "inter": 14336}
    assert P.sizes(M.get_model("llama-3-8b"), tp=2)["inter"] == 7168  # a TP rank computes its share
    assert P.sizes(M.get_model("deepseek-v3"))["hidden"] == 7168  # MLA: 14 x kv_lora_rank
    custom = M.ModelShape("c", 4, 2, 64)  # no q_heads: taken as MHA
    assert P.sizes(custom)["hidden"] == 128 and P.sizes(custom)["qkv"] == 6 * 64


def test_real_prefill_layers_become_ready_in_order():
    rp = P.RealPrefill(M.ModelShape("c", 4, 2, 64), 512, 4, "cpu")
    for _ in range(2):  # reused across iterations like the clock
        rp.start()
        for i in range(4):
            rp.wait_layer(i)
            assert rp.ready_at(i) > rp.t0
        assert all(a < b for a, b in zip(rp.times, rp.times[1:]))
        assert rp.end == rp.times[-1] and rp.measured_s > 0
    rp.wait_all()


def test_make_clock_picks_real_only_where_the_rank_computes():
    case = {"prefill": "real", "model": "llama-3-8b", "tp": 1, "pp": 1, "tokens": 16, "prefix_hit": 0,
            "memory": "torch-cpu", "dtype": "fp16"}
    assert isinstance(P.make_clock(case, 2, 0.0, True), P.RealPrefill)
    assert isinstance(P.make_clock(case, 2, 0.0, False), PrefillClock)  # decode-only: learns the times after
    assert isinstance(P.make_clock(dict(case, prefill="clock"), 2, 0.0, True), PrefillClock)


def test_real_prefill_with_host_memory_is_refused(kvrun):
    r = kvrun(["-t", "tcp", "--prefill", "real", "-m", "llama-3-8b", "--tokens", "64"], n=1, timeout=60)
    assert r.code == 1
    assert "--prefill real: --memory host has no device to compute on" in r.err


def test_streaming_real_prefill_hides_the_transfer(kvrun):
    """Two real ranks, torch-cpu pools through staged over tcp: streaming's exposed time is below serial's,
    every byte lands right, and rows carry the prefill kind and its measured seconds.  The model is made by flags
    on rank 0: the other ranks must know it too (cli/run.py registers it before validating)."""
    r = kvrun(["-t", "staged", "-O", "inner=tcp", "--op", "push,pull", "--memory", "torch-cpu", "--prefill", "real",
               "--overlap", "serial,streaming", *TINY, "--tokens", "4096",
               "--variants", "paged", "--rounds", "1", "-n", "5", "-w", "1"], timeout=240)
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert (df.prefill == "real").all()
    checks = df[df.iter == -1]
    assert len(checks) == 2 * 2 * 2 and int(checks.nwrong.sum()) == 0  # 2 ops x 2 overlaps x 2 ranks
    timed = df[df.iter >= 0]
    assert (timed.prefill_s > 0).all()  # measured on the source, carried to the decode rows
    pre = timed[timed.role == "prefill"].set_index(["op", "overlap", "iter"]).prefill_s
    dec = timed[timed.role == "decode"].set_index(["op", "overlap", "iter"])
    assert (dec.prefill_s == pre.loc[dec.index]).all()
    exp = dec.groupby(["op", "overlap"]).exposed_s.median()
    for op in ("push", "pull"):
        assert exp[(op, "streaming")] < exp[(op, "serial")], exp
