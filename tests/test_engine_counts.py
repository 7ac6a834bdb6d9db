"""kvbench's descriptor counts held to what engines publish (docs/layouts.md, Held to the engines' counts): each
row of that table's kvbench column, from `kvbench size` and from the descriptors the harness builds, on the model
files in docs/models/ (Qwen3-0.6B, GLM-5.3, a 48-layer 4-KV-head shape)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvbench.cli import main as cli
from kvbench.model import planes
from kvbench.model import shapes as M
from kvbench.model.descriptors import LEN, coalesced_descs, page_descs, request_descs, stats
from kvbench.model.layout import BlockAllocator, Layout

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "models")


def model(name: str) -> M.ModelShape:
    return M.load_model_yaml(os.path.join(DOCS, f"{name}.yaml"))


def size(capsys, *args) -> str:
    assert cli.main(["size", *args]) == 0
    return capsys.readouterr().out


# vLLM PR #30207 (cross-layer KV layout), Qwen3-0.6B (28 layers, 8 KV heads x 128, bf16), block 16, TP 1:
# tokens -> (per-layer descriptors, cross-layer pages); the report: 56 -> 1, 3,528 -> 1, 34,000 -> 422
@pytest.mark.parametrize("tokens, per_layer, pages", [(16, 56, 1), (1024, 3_584, 64), (10_240, 35_840, 640)])
def test_qwen3_0_6b_per_layer_against_cross_layer(capsys, tokens, per_layer, pages):
    path = os.path.join(DOCS, "qwen3-0.6b.yaml")
    base = ["-m", path, "--tokens", str(tokens), "--block-size", "16", "--dtype", "bf16"]
    assert f"{per_layer:>16,} descriptors per request uncoalesced (2 x 28 layers x {pages} blocks)" in size(capsys, *base)
    out = size(capsys, *base, "--layout", "cross-layer")
    assert f"{pages:>16,} descriptors per request uncoalesced (cross-layer" in out
    assert "       1,835,008 B per page" in out  # 28 x 2 x 16 x 8 x 128 x 2 B
    shape = model("qwen3-0.6b")
    bb = M.block_bytes(shape, 16, "bf16")
    lay = Layout.fit("cross-layer", shape.layers, shape.regions, bb, 2 * pages * 56 * bb)
    run = BlockAllocator(lay.nblocks).allocate(pages, "contiguous")
    # contiguous blocks on both sides: the whole request is one descriptor (the report's "after" at 16 and 1,024)
    assert len(page_descs(lay, lay, run, run + pages, coalesce=True)) == 1


def test_glm_5_3_regions_and_fragmentation(capsys):
    """vLLM #55434: ~4.9 GB per TP-rank transfer, 64-token blocks, fp8_ds_mla latent + indexer keys on 78 layers."""
    out = size(capsys, "-m", os.path.join(DOCS, "glm-5.3.yaml"), "--tokens", "80000", "--block-size", "64",
               "--dtype", "fp8-ds-mla")
    assert "   4,917,120,000 B per request" in out  # 80,000 x 78 x (656 + 132)
    assert "         195,000 descriptors per request uncoalesced" in out  # 2 planes x 78 layers x 1,250 blocks
    shape = model("glm-5.3")
    case = {"dtype": "fp8-ds-mla", "scales": "none", "block_size": 64, "model": "glm-5.3"}
    g = planes.geometry(case, shape, 640)  # 10 blocks
    fitted = planes.fit("mla", g, 4 * g["full_bytes"])
    run = np.arange(10)
    # fresh, contiguous blocks: one descriptor per layer and plane, 156, whatever the length (the report: 101)
    co = planes.request_layers(fitted, g, run, run + 10, coalesced_descs, False)
    assert sum(len(d) for d in co) == 2 * 78
    # fragmented (no two blocks adjacent): one per block, layer and plane; the latent's 41,984 B, the indexer's 8,448
    scattered = planes.request_layers(fitted, g, run * 2, run * 3, request_descs, False)
    assert stats(scattered)["descriptors"] == 2 * 78 * 10
    assert {int(n) for d in scattered for n in d[:, LEN]} == {41_984, 8_448}


def test_a_48_layer_4_head_page_is_96_descriptors_of_16_kib(capsys):
    """Dynamo #12750: a 1,572,864 B block read as 96 pieces of 16,384 B (per-layer on device, whole on disk)."""
    out = size(capsys, "-m", os.path.join(DOCS, "qwen3-30b-a3b.yaml"), "--tokens", "16", "--block-size", "16",
               "--dtype", "bf16", "--layout", "cross-layer")
    assert "          16,384 B per block (16 tokens, one region" in out and "       1,572,864 B per page" in out
    assert "              96 descriptors per request streamed layer by layer" in out
