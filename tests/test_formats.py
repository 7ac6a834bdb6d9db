"""Formats with scale planes: the bytes of values, block scales and tensor scales, pinned by hand."""
from __future__ import annotations

import pytest

from kvbench import cli
from kvbench import model as M
from kvbench.formats import Format, parse_scales


def size(capsys, *args) -> str:
    assert cli.main(["size", *args]) == 0
    return capsys.readouterr().out


def test_nvfp4_llama_3_8b_4096_tokens(capsys):
    out = size(capsys, "-m", "llama-3-8b", "--dtype", "nvfp4", "--tokens", "4096")
    # llama-3-8b: 32 layers x 2 regions (K, V) x 8 KV heads x 128 = 1024 elements per token per region.
    # values:        32 x 2 x 4096 tokens x 1024 elements x 4 bits / 8       = 134,217,728 B
    # block scales:  32 x 2 x 4096 x (1024 / 16 = 64 scales) x 1 B (fp8)    =  16,777,216 B
    # tensor scales: 32 layers x 2 regions x 4 B (fp32), once per request   =         256 B
    # total 150,995,200 B; 256 blocks of 16 tokens per layer; descriptors: 32 x (2 x 256 x 2 planes + 1)
    assert "134,217,728 B values" in out
    assert "16,777,216 B block scales" in out
    assert "256 B tensor scales" in out
    assert "150,995,200 B per request" in out
    assert "32,800 descriptors per request" in out


def test_deepseek_fp8_block128_is_flashmla_656_bytes_per_token_layer():
    # FlashMLA fp8_ds_mla: 512 e4m3 latent + 4 fp32 scales (one per 128) + 64 bf16 RoPE = 656 B per token per layer
    f = Format("fp8-e4m3", "block:128")
    shape = M.get_model("deepseek-v3")
    assert f.value_bytes_token(shape) + f.block_scale_bytes_token(shape) == 656
    p = f.parts(shape, 1000)
    assert p == {"values": 61 * 1000 * 640, "block_scales": 61 * 1000 * 16, "tensor_scales": 0}


def test_fp8_tensor_scales_and_plain_formats_unchanged(capsys):
    shape = M.get_model("llama-3-8b")
    p = Format("fp8-e5m2", "tensor").parts(shape, 4096)
    assert p == {"values": 32 * 2 * 4096 * 1024, "block_scales": 0, "tensor_scales": 32 * 2 * 4}
    for dt in M.DTYPES:  # today's dtypes: the same bytes as model.py's arithmetic
        assert sum(Format(dt).parts(shape, 4096).values()) == M.request_bytes(shape, dt, 4096)
    # today's `size` output for a plain dtype: the lines it always printed
    out = size(capsys, "-m", "llama-3-8b", "--dtype", "fp16", "--tokens", "4096")
    assert "     536,870,912 B per request (0.537 GB, 0.500 GiB)" in out and "block scales" not in out


@pytest.mark.parametrize("dtype,scales", [("fp16", "tensor"), ("nvfp4", "block:16"), ("fp8-e4m3", "block:3"),
                                          ("fp8-e4m3", "rows")])
def test_bad_formats_are_one_line_errors(dtype, scales, capsys):
    assert cli.main(["size", "--dtype", dtype, "--scales", scales]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


def test_parse_scales():
    assert parse_scales("block:64") == ("block", 64) and parse_scales("tensor") == ("tensor", 0)
