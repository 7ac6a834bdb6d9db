"""Hybrid models (sliding-window and linear-state layers) and the whole TP group's bytes: issue 35 items 5 and 6.

Every expected number is written out from the configs docs/models.md cites; none is read back from the code.
"""
import re

import pytest
from helpers.launch import kvbench_cli

from kvbench.cli import main as cli
from kvbench.model import layers as L
from kvbench.model import shapes as M

# Qwen3-Next-80B-A3B (bf16 KV): 12 full layers x 2 regions (K, V) x 2 KV heads x 256 x 2 B = 24,576 B per token;
# 36 linear layers x (32 heads x 128 x 128 x 4 B (fp32 recurrent) + (4 - 1) x (2 x 16 x 128 + 32 x 128) x 2 B (bf16 conv))
#   = 36 x (2,097,152 + 49,152) = 36 x 2,146,304 = 77,266,944 B, whatever the prompt.
QWEN3_NEXT = {4096: {"kv": 24_576 * 4096, "window": 0, "state": 77_266_944},
              131072: {"kv": 24_576 * 131072, "window": 0, "state": 77_266_944}}
# gpt-oss-120b (bf16): per layer and token 2 x 8 KV heads x 64 x 2 B = 2,048 B; 18 full layers: 36,864 B per token;
# 18 sliding layers x 2,048 B x min(128, tokens) = 4,718,592 B once the prompt passes the 128-token window.
GPT_OSS = {4096: {"kv": 36_864 * 4096, "window": 18 * 2048 * 128, "state": 0},
           131072: {"kv": 36_864 * 131072, "window": 18 * 2048 * 128, "state": 0}}
# Qwen3-235B-A22B (bf16): 94 layers x 2 x 4 KV heads x 128 x 2 B = 192,512 B per token, all full attention.
QWEN3_235B = {4096: {"kv": 192_512 * 4096, "window": 0, "state": 0},
              131072: {"kv": 192_512 * 131072, "window": 0, "state": 0}}
EXPECTED = {"qwen3-next-80b-a3b": QWEN3_NEXT, "gpt-oss-120b": GPT_OSS, "qwen3-235b-a22b": QWEN3_235B}


@pytest.fixture
def size(capsys, monkeypatch):
    """`kvbench size ARGS` in this process (its output), for speed; the bad-input tests run the real command."""
    monkeypatch.setattr(M, "PRESETS", dict(M.PRESETS))  # flags register a 'custom' model: keep it to this test

    def run(*args):
        assert cli.main(["size", *args]) == 0
        return capsys.readouterr().out
    return run


def _row(out: str, what: str) -> tuple[int, int]:
    """(one rank, whole group) bytes of the size table's line for ``what`` (KV, window, state, per request)."""
    for ln in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+([\d,]+) B " + re.escape(what), ln)
        if m:
            return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))
    raise AssertionError(f"no '{what}' line in:\n{out}")


def test_hand_numbers_of_the_presets():
    assert QWEN3_NEXT[4096]["kv"] == 100_663_296 and QWEN3_NEXT[131072]["kv"] == 3_221_225_472
    assert GPT_OSS[4096]["kv"] == 150_994_944 and GPT_OSS[4096]["window"] == 4_718_592
    assert QWEN3_235B[4096]["kv"] == 788_529_152 and QWEN3_235B[131072]["kv"] == 25_232_932_864
    for name, by_tokens in EXPECTED.items():
        m = M.get_model(name)
        for tokens, parts in by_tokens.items():
            assert L.parts(m, "bf16", tokens) == parts, (name, tokens)
            assert M.request_bytes(m, "bf16", tokens) == sum(parts.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_size_prints_kv_window_and_state_apart_at_4k_and_128k(name, size):
    for tokens, parts in EXPECTED[name].items():
        out = size("-m", name, "--tokens", str(tokens), "--dtype", "bf16")
        assert _row(out, "KV") == (parts["kv"], parts["kv"])  # tp=1: one rank is the whole group
        if parts["window"]:
            assert _row(out, "window") == (parts["window"], parts["window"])
        if parts["state"]:
            assert _row(out, "state") == (parts["state"], parts["state"])
        total = sum(parts.values())
        assert _row(out, "per request (one rank; whole group)") == (total, total)
        assert f"{total:>16,} B per request (" in out


def test_window_and_state_stop_growing_with_the_prompt(size):
    for name, part in (("gpt-oss-120b", "window"), ("qwen3-next-80b-a3b", "state")):
        short = _row(size("-m", name, "--tokens", "4096", "--dtype", "bf16"), part)
        long = _row(size("-m", name, "--tokens", "131072", "--dtype", "bf16"), part)
        assert short == long and short[0] > 0
        kv_short = _row(size("-m", name, "--tokens", "4096", "--dtype", "bf16"), "KV")[0]
        kv_long = _row(size("-m", name, "--tokens", "131072", "--dtype", "bf16"), "KV")[0]
        assert kv_long == 32 * kv_short  # full attention grows with every token
    m = M.get_model("gpt-oss-120b")  # inside the window a sliding layer moves every token
    assert L.parts(m, "bf16", 100)["window"] == 18 * 2048 * 100


def test_whole_group_and_replication_factor_from_flags(size):
    out = size("--layers", "94", "--kv-heads", "4", "--head-dim", "128", "--tp", "8", "--tokens", "32768",
                "--dtype", "bf16")
    rank = 94 * 2 * 1 * 128 * 2 * 32768  # each of 8 ranks holds max(1, 4/8) = 1 KV head
    assert rank == 1_577_058_304
    assert _row(out, "KV") == (rank, 8 * rank)
    assert 8 * rank == 2 * (94 * 2 * 4 * 128 * 2 * 32768)  # twice the model's logical KV
    assert "replication factor 2:" in out


def test_qwen3_next_under_tp8_splits_its_state_and_replicates_its_two_kv_heads(size):
    out = size("-m", "qwen3-next-80b-a3b", "--tp", "8", "--tokens", "4096", "--dtype", "bf16")
    # one rank: 12 x 2 x 1 head x 256 x 2 B x 4096 tokens; 36 x (4 heads x 128 x 128 x 4 + 3 x 1024 x 2)
    assert _row(out, "KV") == (12 * 2 * 256 * 2 * 4096, 8 * 12 * 2 * 256 * 2 * 4096)
    assert _row(out, "state") == (36 * (4 * 128 * 128 * 4 + 3 * 1024 * 2), 77_266_944)
    assert "replication factor 4:" in out
    assert "replication factor" not in size("-m", "gpt-oss-120b", "--tp", "8", "--dtype", "bf16")


def test_pp_takes_the_first_stage_layers_in_the_models_order():
    m = M.shard(M.get_model("qwen3-next-80b-a3b"), pp=4)  # 12 layers: (l, l, l, f) x 3
    assert (m.layers, m.linear_layers, m.full_layers) == (12, 9, 3)
    assert L.layer_kinds(M.get_model("gpt-oss-120b"))[:4] == ["sliding", "full", "sliding", "full"]
    with pytest.raises(ValueError, match="does not divide the model's 32 state heads"):
        M.shard(M.get_model("qwen3-next-80b-a3b"), tp=3)


@pytest.mark.launches
def test_plan_prints_group_bytes_and_egress():
    r = kvbench_cli("plan", "-m", "qwen3-235b-a22b", "--tp", "8", "--tokens", "32768", "--dtype", "bf16",
                    "--rate", "2", "--fabric", "100GbE")
    assert r.returncode == 0, r.stderr
    group = 2 * 94 * 2 * 4 * 128 * 2 * 32768  # replicated 2x
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("qwen3-235b-a22b") and f"{group:,}" in ln)
    assert line.split()[-2:] == ["2", f"{2 * group * 8 / 1e9:.3f}"]  # repl, egress Gbit/s at 2 req/s


def _bad_model(tmp_path, text: str):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    out = tmp_path / "out"
    r = kvbench_cli("size", "-m", str(p), "--tokens", "4096")
    assert r.returncode == 1
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    return r.stderr


HYBRID = "layers: 48\nkv_heads: 2\nhead_dim: 256\nstate_heads: 32\nstate_k_dim: 128\nstate_v_dim: 128\n"


@pytest.mark.launches
def test_bad_hybrid_models_are_one_line_exit_1(tmp_path):
    err = _bad_model(tmp_path, HYBRID + "kinds: {full: 12, linear: 35}\n")
    assert "12 full + 35 linear = 47 layers, not the model's 48" in err
    err = _bad_model(tmp_path, HYBRID + "kinds: {full: 12, sliding: 36}\nwindow: -5\n")
    assert "window -5 is negative" in err
    err = _bad_model(tmp_path, HYBRID + "kinds: {full: 12, linear: 36}\nstate_dtype: fp12\n")
    assert "state_dtype 'fp12' is not one of" in err
    err = _bad_model(tmp_path, HYBRID + "kinds: {full: 12, sliding: 36}\n")
    assert "36 sliding layers need a window > 0" in err
    err = _bad_model(tmp_path, "layers: 4\nkv_heads: 2\nhead_dim: 64\nkinds: {full: 2, linear: 2}\n")
    assert "2 linear layers need state_heads" in err


def test_a_hybrid_model_file_reads_back(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(HYBRID + "kinds: {full: 12, linear: 36}\nconv_kernel: 4\nconv_dim: 8192\n")
    m = M.get_model(str(p))
    assert (m.full_layers, m.linear_layers, L.state_layer_bytes(m)) == (12, 36, 2_146_304)
    assert L.layer_kinds(m)[:4] == ["linear", "linear", "linear", "full"]


# ---- the transfer: a hybrid request's descriptors (kvbench/model/hybridpool.py) ------------------------------

TOY = M.ModelShape("toy-hybrid", 8, 2, 16, "gqa", sliding_layers=2, window=40, linear_layers=4, state_heads=2,
                   state_k_dim=8, state_v_dim=4, conv_kernel=4, conv_dim=24, conv_dtype="fp16")
# kinds: gcd(4, 2, 2) = 2 groups of (linear, linear, sliding, full)
# per layer and token: 2 regions x 2 heads x 16 x 2 B = 128 B; a state: 2 x 8 x 4 x 4 B + 3 x 24 x 2 B = 400 B


@pytest.mark.parametrize("layout", ["layer-major", "block-major"])
@pytest.mark.parametrize("coalesce_on", [False, True])
def test_hybrid_request_moves_each_kind_exactly(layout, coalesce_on):
    import numpy as np

    from kvbench.model import hybridpool
    from kvbench.model.descriptors import LEN, byte_map, coalesced_descs, request_descs

    assert L.layer_kinds(TOY) == ["linear", "linear", "sliding", "full"] * 2
    assert L.state_layer_bytes(TOY) == 2 * 8 * 4 * 4 + 3 * 24 * 2 == 400
    ntok, bs = 100, 16  # 7 blocks, the last of 4 tokens; the window: tokens 60..99, from block 3 (token 60 = 3 x 16 + 12)
    case = {"block_size": bs, "dtype": "fp16"}
    g = hybridpool.geometry(case, TOY, ntok)
    assert (g["nblocks"], g["win_first"], g["win_skip"]) == (7, 3, 12 * 64)  # 64 B: one token of one region
    hp = hybridpool.fit(layout, g, 4 * g["full_bytes"])
    assert hp.nslots == 4 and hp.attn.layers == 4
    rng = np.random.default_rng(1)
    src_ids, dst_ids = rng.permutation(hp.attn.nblocks)[:7], rng.permutation(hp.attn.nblocks)[:7]
    descs = coalesced_descs if coalesce_on else request_descs
    layers = hybridpool.request_layers(hp, g, src_ids, dst_ids, (1, 2), descs, coalesce_on)
    assert len(layers) == 8
    kinds = L.layer_kinds(TOY)
    if not coalesce_on:  # a block and region each in a full layer, in a window layer from block 3, one per state
        assert [len(d) for d in layers] == [{"full": 14, "sliding": 8, "linear": 1}[k] for k in kinds]
    per = {k: sum(int(d[:, LEN].sum()) for d, kk in zip(layers, kinds) if kk == k) for k in ("full", "sliding", "linear")}
    assert per == {"full": 2 * 128 * 100, "sliding": 2 * 128 * 40, "linear": 4 * 400}
    assert sum(per.values()) == g["payload"] == M.request_bytes(TOY, "fp16", ntok)
    # byte by byte: every byte lands where the block tables and slots say, and nowhere else
    expect = {}
    attn = [0, 0, 0, 1, 0, 0, 2, 3]  # each layer's index in its plane: attention (sliding, full) or state
    for layer, (k, a) in enumerate(zip(kinds, attn)):
        if k == "linear":
            lin = [0, 1, None, None, 2, 3][layer]
            s, t = hp.state_offset(lin, 1), hp.state_offset(lin, 2)
            expect.update({t + j: s + j for j in range(400)})
            continue
        for tok in range(60 if k == "sliding" else 0, ntok):
            for r in range(2):
                s = int(hp.attn.offsets(a, r, src_ids[tok // bs])) + tok % bs * 64
                t = int(hp.attn.offsets(a, r, dst_ids[tok // bs])) + tok % bs * 64
                expect.update({t + j: s + j for j in range(64)})
    got = byte_map(np.concatenate(layers))
    assert got == expect
    assert max(got) < hp.state_base + 4 * hp.nslots * 400 and min(hp.state_offset(0, 0), *got) >= 0


def test_hybrid_bulk_reference_keeps_states_in_their_slots():
    import numpy as np

    from kvbench.model import hybridpool
    from kvbench.model.descriptors import LEN, request_descs
    from kvbench.model.schemes import offset_bulk

    g = hybridpool.geometry({"block_size": 16, "dtype": "fp16"}, TOY, 100)
    hp = hybridpool.fit("layer-major", g, 4 * g["full_bytes"])
    ids = np.arange(7)
    layers = offset_bulk(hybridpool.request_layers(hp, g, ids, ids, (0, 0), request_descs, False, "bulk"), 1, 3)
    assert [len(d) for d in layers] == [1] * 8
    assert [int(d[0, LEN]) for d in layers] == [400, 400, 40 * 128, 100 * 128] * 2  # a state, a window, all
    assert layers[0][0, 0] == hp.state_offset(0, 1) and layers[0][0, 1] == hp.state_offset(0, 3)
    assert hybridpool.check_bulk(hp, g, layers, False)


TOY_YAML = """name: toy-hybrid
layers: 8
kinds: {full: 2, sliding: 2, linear: 4}
kv_heads: 2
head_dim: 16
window: 40
state_heads: 2
state_k_dim: 8
state_v_dim: 4
conv_kernel: 4
conv_dim: 24
conv_dtype: fp16
"""


def test_a_hybrid_run_moves_windows_and_states_with_every_byte_checked(kvrun, tmp_path):
    model = tmp_path / "toy.yaml"
    model.write_text(TOY_YAML)  # TOY above, as a model file
    base = ["-m", str(model), "--tokens", "100", "-b", "16", "-e", "16", "-n", "2", "-w", "1", "--rounds", "1",
            "--variants", "bulk,paged"]
    r = kvrun(["-t", "shm,tcp", "--op", "push", "--coalesce", "off", *base], timeout=300)
    assert r.code == 0, r.out + r.err
    ok = r.transfers()
    ok = ok[ok.status == "ok"]
    assert set(ok.transport) == {"shm", "tcp"}
    assert set(ok.payload_bytes) == {2 * 100 * 128 + 2 * 40 * 128 + 4 * 400}  # KV, windows, states: 37,440 B
    # paged: 14 per full layer, 8 per window layer (blocks 3..6, K and V), 1 per linear layer; bulk: 1 per layer
    assert set(ok[ok.variant == "paged"].descriptors) == {2 * 14 + 2 * 8 + 4}
    assert set(ok[ok.variant == "bulk"].descriptors) == {8}
    checks = ok[ok.iter == -1]
    assert len(checks) == 2 * 2 * 2 and int(checks.nwrong.sum()) == 0  # 2 transports x 2 variants x 2 ranks
    # the first descriptor is layer 0's, a linear layer's state: corrupting it is caught like any KV byte
    bad = kvrun(["-t", "shm", "--op", "push", "--inject-corruption", "3", *base], timeout=300)
    assert bad.code == 2 and "FAILED" in bad.out
    dec = bad.table()
    assert dec[(dec.iter == -1) & (dec.role == "decode")].nwrong.tolist() == [2, 2]


def test_a_hybrid_model_outside_bandwidth_sweeps_is_refused(kvrun, tmp_path):
    model = tmp_path / "toy.yaml"
    model.write_text(TOY_YAML)
    r = kvrun(["-t", "shm", "-m", str(model), "--tokens", "100", "--dtype", "nvfp4"], timeout=120)
    assert r.code == 1 and r.results is None
    assert "mixes layer kinds" in r.err and len(r.err.strip().splitlines()) == 1, r.err
