"""Formats with scale planes: the bytes of values, block scales and tensor scales, pinned by hand."""
from __future__ import annotations

import pytest

from kvbench.cli import main as cli
from kvbench.model import shapes as M
from kvbench.model.formats import Format, parse_scales


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
    for dt in M.DTYPES:  # today's dtypes: the same bytes as model/shapes.py's arithmetic
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


def test_scale_planes_move_between_real_ranks(kvrun):
    """nvfp4 and fp8 with block or tensor scales: the planes' bytes and descriptors, every byte checked."""
    r = kvrun(["-t", "shm", "--dtype", "nvfp4,fp8-e4m3", "--scales", "none,block:128,tensor", "-m", "llama-3-8b",
               "--tokens", "64", "-b", "16", "-e", "16", "-n", "2", "-w", "1", "--variants", "bulk,paged",
               "--rounds", "1"], timeout=180)
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert int(df[df.iter == -1].nwrong.sum()) == 0
    paged = df[(df.variant == "paged") & (df.iter >= 0)]
    got = {(d, s): (int(p), int(n)) for (d, s), g in paged.groupby(["dtype", "scales"])
           for p, n in [(g.payload_bytes.iloc[0], g.descriptors.iloc[0])]}
    # llama-3-8b, 64 tokens = 4 blocks of 16 per region, 32 layers x 2 regions, 1024 values per token and region
    assert got == {
        # values 32x2x64x1024/2 + block scales 32x2x64x64x1 B + tensor scales 32x2x4 B; per layer 2x4x2 + 1 descriptors
        ("nvfp4", "none"): (2_097_152 + 262_144 + 256, 32 * 17),
        ("fp8-e4m3", "none"): (4_194_304, 32 * 8),  # today's plain fp8
        # block:128: 8 fp32 scales per token and region = 32 B: 32x2x64x32; per layer 2x4x2 descriptors
        ("fp8-e4m3", "block:128"): (4_194_304 + 131_072, 32 * 16),
        ("fp8-e4m3", "tensor"): (4_194_304 + 256, 32 * 9),  # one 8-byte tensor-scale descriptor per layer
    }
