import pytest
from helpers.launch import kvbench_cli

from kvbench.model import shapes as M


def test_llama2_70b_numbers():
    m = M.get_model("llama-2-70b")
    assert M.bytes_per_token(m, "fp16") == 327_680  # 2 x 80 x 8 x 128 x 2
    assert M.request_bytes(m, "fp16", 4096) == 1_342_177_280


def test_mla_preset_has_one_latent_and_no_factor_two():
    m = M.get_model("deepseek-v3")
    assert m.regions == 1
    assert M.bytes_per_token(m, "fp16") == 61 * (512 + 64) * 2 == 70_272
    assert M.bytes_per_token(m, "fp8-e4m3") == 35_136


def test_opt66b_mha_matches_distserve_scale():
    m = M.get_model("opt-66b")
    # DistServe: ~1.13 GB for OPT-66B at 512 tokens
    assert M.request_bytes(m, "fp16", 512) == 2 * 64 * 72 * 128 * 2 * 512 == 1_207_959_552


def test_tp8_on_8_kv_heads_gives_one_head_per_rank():
    m = M.shard(M.get_model("llama-3-70b"), tp=8)
    assert m.kv_heads == 1
    assert M.bytes_per_token(m, "fp16") == 327_680 // 8


def test_tp_larger_than_heads_replicates_one_head():
    m = M.shard(M.get_model("qwen2.5-7b"), tp=8)  # 4 KV heads
    assert m.kv_heads == 1


def test_tp_that_does_not_divide_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        M.shard(M.get_model("opt-66b"), tp=5)


def test_pp_divides_layers_and_mla_ignores_tp():
    assert M.shard(M.get_model("llama-2-70b"), pp=4).layers == 20
    assert M.shard(M.get_model("llama-3.1-405b"), pp=4).layers == 32  # ceil(126 / 4)
    assert M.shard(M.get_model("deepseek-v3"), tp=8).kv_lora_rank == 512


def test_prefix_hit_reduces_request_bytes():
    m = M.get_model("llama-3-8b")
    assert M.request_bytes(m, "bf16", 4096, prefix_hit=1024) == M.bytes_per_token(m, "bf16") * 3072
    with pytest.raises(ValueError):
        M.request_bytes(m, "bf16", 100, prefix_hit=200)


def test_dtypes_and_bad_dtype():
    assert [M.dtype_bytes(d) for d in ("fp32", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2")] == [4, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="fp16"):
        M.dtype_bytes("int3")


def test_block_size_must_be_power_of_two():
    assert M.check_block_size(16) == 16
    for bad in (0, -16, 24):
        with pytest.raises(ValueError, match="power of two"):
            M.check_block_size(bad)


def test_model_from_yaml(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: tiny\nlayers: 4\nkv_heads: 2\nhead_dim: 64\n")
    m = M.get_model(str(p))
    assert M.bytes_per_token(m, "fp16") == 2 * 4 * 2 * 64 * 2
    p.write_text("name: tiny\nlayers: 4\nheads: 2\n")
    with pytest.raises(ValueError, match="field 'heads': unknown field"):
        M.get_model(str(p))


@pytest.mark.launches
def test_size_command_prints_the_issue_numbers():
    r = kvbench_cli("size", "-m", "llama-2-70b", "--tokens", "4096", "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    assert "327,680 B per token" in r.stdout
    assert "1,342,177,280 B per request" in r.stdout
    assert "100GbE" in r.stdout and "ms" in r.stdout


@pytest.mark.launches
def test_size_with_flags_model():
    r = kvbench_cli("size", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--tokens", "10")
    assert r.returncode == 0, r.stderr
    assert f"{2 * 2 * 1 * 64 * 2:,} B per token" in r.stdout
