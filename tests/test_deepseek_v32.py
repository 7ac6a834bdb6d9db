"""DeepSeek-V3.2: the MLA latent with the lightning indexer's key cache as a second region of its own size, and
vLLM's packed fp8_ds_mla row (dtype fp8-ds-mla).  Bytes pinned by hand from the sources the preset cites
(model/shapes.py), a layer whose two regions differ in block bytes, and one real launch with every byte checked."""
from __future__ import annotations

import numpy as np
import pytest

from kvbench.cli import main as cli
from kvbench.model import planes
from kvbench.model import shapes as M
from kvbench.model.descriptors import LEN, SRC, byte_map, request_descs
from kvbench.model.formats import Format

V32 = M.get_model("deepseek-v3.2")


def size(capsys, *args) -> str:
    assert cli.main(["size", *args]) == 0
    return capsys.readouterr().out


def test_the_preset_is_the_v3_latent_plus_a_132_byte_indexer_key():
    assert (V32.layers, V32.attention, V32.kv_lora_rank, V32.rope_dim) == (61, "mla", 512, 64)
    # index_head_dim 128 fp8 keys + 128 / 128 = 1 fp32 scale (vLLM's DeepseekV32IndexerCache head_dim)
    assert V32.indexer_bytes == 128 + 128 // 128 * 4 == 132
    # vLLM's fp8_ds_mla row: 512 fp8-e4m3 + 4 fp32 scales (one per 128) + 64 bf16 RoPE = 656 B
    assert Format("fp8-ds-mla").value_bytes_token(V32) == 512 + 4 * 4 + 64 * 2 == 656
    assert Format("fp8-ds-mla").block_scale_bytes_token(V32) == 0  # packed in the row: no scale plane
    # a plain dtype: the latent per element, the indexer keys in their own format beside it
    assert M.bytes_per_token(V32, "bf16") == 61 * (576 * 2 + 132) == 78_324
    assert M.layer_bytes_per_token(V32, "fp16") == 1_152 + 132
    assert M.request_bytes(V32, "bf16", 1000) == 78_324_000
    assert M.bytes_per_token(M.get_model("deepseek-v3"), "bf16") == 61 * 1_152  # V3 has no indexer


def test_bytes_per_token_with_the_indexer_share(capsys):
    out = size(capsys, "-m", "deepseek-v3.2", "--dtype", "fp8-ds-mla", "--tokens", "1024", "--block-size", "64")
    # 61 layers x (656 + 132) = 48,068 B per token, of them the indexer's 61 x 132 = 8,052 (132 / 788 = 16.8%)
    assert "          48,068 B per token (61 layers)" in out
    assert "             788 B per token per layer" in out
    assert "           8,052 B per token of them the indexer's keys (132 B per layer, 16.8%" in out
    assert "      40,976,384 B values (656 B per token per region per layer)" in out  # 61 x 1024 x 656
    assert "       8,245,248 B indexer keys (132 B per token per layer)" in out  # 61 x 1024 x 132
    assert "      49,221,632 B per request" in out
    # 16 blocks of 64 tokens: per layer and block the latent's (41,984 B) and the indexer's (8,448 B)
    assert "          41,984 B per value block" in out and "           8,448 B per indexer block" in out
    assert "           1,952 descriptors per request uncoalesced" in out  # 61 x 16 x 2
    xl = size(capsys, "-m", "deepseek-v3.2", "--dtype", "fp8-ds-mla", "--tokens", "1024", "--block-size", "64",
              "--layout", "cross-layer")
    assert "              32 descriptors per request uncoalesced (cross-layer" in xl  # 16 pages x 2 planes
    bf = size(capsys, "-m", "deepseek-v3.2", "--dtype", "bf16", "--tokens", "1000")
    assert "          78,324 B per token (61 layers)" in bf and "      78,324,000 B per request" in bf


def test_fp8_ds_mla_is_the_flashmla_row_in_one_plane():
    # fp8-e4m3 with block:128 scales stores the same 656 B in two planes (values 640, scales 16): two descriptors
    # per block; fp8-ds-mla packs them in one row: one
    v3 = M.get_model("deepseek-v3")
    split = Format("fp8-e4m3", "block:128")
    assert split.value_bytes_token(v3) + split.block_scale_bytes_token(v3) == Format("fp8-ds-mla").value_bytes_token(v3)
    assert split.descriptors(v3, 16) == 2 * Format("fp8-ds-mla").descriptors(v3, 16) == 2 * 61 * 16
    assert Format("fp8-ds-mla").parts(V32, 1000) == {"values": 61 * 1000 * 656, "block_scales": 0,
                                                     "tensor_scales": 0, "indexer": 61 * 1000 * 132}


@pytest.mark.parametrize("layout", ["mla", "cross-layer"])
def test_a_layer_whose_regions_differ_in_block_bytes_moves_each_exactly(layout):
    case = {"dtype": "fp8-ds-mla", "scales": "none", "block_size": 16, "model": "deepseek-v3.2"}
    assert planes.scaled(case, V32)
    g = planes.geometry(case, V32, 40)  # 3 blocks, the last of 8 tokens
    assert (g["block_bytes"], g["index_block_bytes"], g["last_bytes"], g["index_last_bytes"]) == (
        16 * 656, 16 * 132, 8 * 656, 8 * 132)
    assert g["payload"] == 40 * 61 * 788 and g["full_bytes"] == 61 * 3 * 16 * 788
    values, scales, tbase, index = planes.fit(layout, g, 4 * g["full_bytes"])
    assert scales is None and tbase is None and index.base == values.nbytes
    assert values.nblocks == index.nblocks == 12 and (values.block_bytes, index.block_bytes) == (10_496, 2_112)
    src, dst = np.array([2, 0, 3]), np.array([1, 3, 0])
    layers = planes.request_layers((values, scales, tbase, index), g, src, dst, request_descs, False)
    assert len(layers) == 61 and {len(d) for d in layers} == {3 + 3}  # per block: the latent's and the indexer's
    assert sum(int(d[:, LEN].sum()) for d in layers) == g["payload"]
    # byte by byte: layer k's latent block lands in the latent plane, its indexer block in the indexer plane
    moved = byte_map(np.concatenate(layers))
    expect = {}
    for plane, lens in ((values, (10_496, 10_496, 8 * 656)), (index, (2_112, 2_112, 8 * 132))):
        for k in range(61):
            for s, d, n in zip(src, dst, lens):
                a, b = int(plane.offsets(k, 0, s)), int(plane.offsets(k, 0, d))
                expect.update({b + j: a + j for j in range(n)})
    assert moved == expect
    if layout == "cross-layer":  # posted at once: whole pages of each plane, the last layer's array holds them
        whole = planes.request_layers((values, scales, tbase, index), g, src, dst, request_descs, False, True)
        assert [len(d) for d in whole] == [0] * 60 + [6]
        assert sorted(whole[-1][:, LEN].tolist()) == [61 * 2_112] * 3 + [61 * 10_496] * 3
        assert set(whole[-1][3:, SRC].tolist()) == {index.base + int(b) * 61 * 2_112 for b in src}


def test_what_it_refuses_in_one_line(capsys):
    assert cli.main(["size", "-m", "llama-3-8b", "--dtype", "fp8-ds-mla"]) == 1
    assert cli.main(["size", "-m", "deepseek-v3.2", "--dtype", "fp8-ds-mla", "--scales", "block:128"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "MLA model" in err[0] and "packs its own scales" in err[1]
    fmt = Format("fp8-ds-mla")
    assert fmt.misfit(V32, False, 1, "none") is None
    assert "workloads" in fmt.misfit(V32, True, 1, "none")
    assert "indexer" in Format("bf16").misfit(V32, False, 2, "none")
    assert "codec" in Format("bf16").misfit(V32, False, 1, "zstd")


def test_deepseek_v32_fp8_ds_mla_runs_on_shm_and_tcp_with_every_byte_checked(kvrun):
    r = kvrun(["-t", "shm,tcp", "-m", "deepseek-v3.2", "--dtype", "fp8-ds-mla", "--tokens", "64", "-b", "16", "-e",
               "16", "--layout", "mla,cross-layer", "--op", "push,pull", "--coalesce", "off", "-n", "2", "-w", "0",
               "--rounds", "1", "-c", "all", "--variants", "bulk,paged"], timeout=400)
    assert r.code == 0, r.out + r.err
    ok = r.transfers()
    assert set(ok.status) == {"ok"} and set(ok.transport) == {"shm", "tcp"}
    # 64 tokens x 61 layers x (656 + 132) B, four full 16-token blocks
    assert set(ok.payload_bytes) == {64 * 61 * 788} == {3_076_352}
    paged = ok[ok.variant == "paged"]
    assert set(paged[paged.layout == "mla"].descriptors) == {61 * 4 * 2}  # per layer and block: latent, indexer
    assert set(paged[paged.layout == "cross-layer"].descriptors) == {4 * 2}  # per block: a page of each plane
    assert set(ok[ok.variant == "bulk"].descriptors) == {61 * 2}  # per layer: each plane's range
    assert ok.nwrong.notna().any() and int(ok.nwrong.fillna(0).sum()) == 0
    assert "wrong elements: 0" in r.out
