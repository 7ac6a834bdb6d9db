"""Layout cross-layer (vLLM's uniform cross-layer KV cache, Dynamo's FullyContiguous): one page per block holding
every layer's regions.  The descriptor arithmetic pinned by hand on three models (docs/layouts.md derives it), the
fast coalescing path against the sorting one, and one real launch with every byte checked."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.cli import main as cli
from kvbench.model import shapes as M
from kvbench.model.descriptors import (
    LEN,
    byte_map,
    coalesce,
    coalesced_descs,
    in_last_layer,
    page_descs,
    request_descs,
    stats,
)
from kvbench.model.layout import BlockAllocator, Layout, block_array, misfit, preamble


def size(capsys, *args) -> str:
    assert cli.main(["size", *args]) == 0
    return capsys.readouterr().out


def test_acceptance_llama_3_8b_1024_tokens_is_64_descriptors(capsys):
    out = size(capsys, "-m", "llama-3-8b", "--tokens", "1024", "--block-size", "16", "--layout", "cross-layer")
    # 1024 / 16 = 64 blocks, one page each: 32 layers x 2 regions x 16 tokens x 8 x 128 x 2 B = 2,097,152 B
    assert "              64 descriptors per request uncoalesced (cross-layer" in out
    assert "       2,097,152 B per page" in out
    # layer by layer: 2 regions x 32 layers x 64 blocks, a strided run each
    assert "           4,096 descriptors per request streamed layer by layer" in out


# (model, tokens, block size): blocks, bytes of a block of one region, layers x regions, page bytes
MODELS = [
    # llama-3-8b: 8 KV heads x 128 x fp16 = 2,048 B per token and region; 16 tokens: 32,768 B
    ("llama-3-8b", 1024, 16, 64, 32_768, 32 * 2, 2_097_152),
    # llama-3-70b: the same per token and region, 80 layers
    ("llama-3-70b", 1024, 16, 64, 32_768, 80 * 2, 5_242_880),
    # deepseek-v3: one latent region of 512 + 64 = 576 values x fp16 = 1,152 B per token; 64 tokens: 73,728 B
    ("deepseek-v3", 1024, 64, 16, 73_728, 61 * 1, 4_497_408),
]


@pytest.mark.parametrize("model,tokens,bs,nb,bb,lr,page", MODELS)
def test_descriptor_arithmetic_on_three_models(model, tokens, bs, nb, bb, lr, page):
    shape = M.get_model(model)
    assert M.block_bytes(shape, bs, "fp16") == bb and lr * bb == page
    lay = Layout.fit("cross-layer", shape.layers, shape.regions, bb, 3 * nb * page)
    assert lay.nblocks == 3 * nb and lay.page_bytes == page
    src = BlockAllocator(lay.nblocks, seed=1).allocate(nb, "random")
    dst = BlockAllocator(lay.nblocks, seed=2).allocate(nb, "random")
    total = tokens * M.bytes_per_token(shape, "fp16")
    assert total == nb * page
    # posted at once: one descriptor per page, every byte of the request
    pages = page_descs(lay, lay, src, dst)
    assert stats([pages]) == {"descriptors": nb, "payload_bytes": total, "mean_desc_bytes": page}
    # whole pages that are adjacent on both sides merge: contiguous blocks are one descriptor
    run = BlockAllocator(lay.nblocks).allocate(nb, "contiguous")
    merged = page_descs(lay, lay, run, run + nb, coalesce=True)
    assert merged.tolist() == [[int(run[0]) * page, int(run[0] + nb) * page, total]]
    # layer by layer (streaming): a layer of a page is a strided run, one descriptor per block and region
    strided = request_descs(lay, lay, src, dst)
    assert stats(strided) == {"descriptors": nb * lr, "payload_bytes": total, "mean_desc_bytes": bb}
    # coalesced, a block's regions (adjacent inside its layer of the page) merge; blocks never do across layers
    co = coalesced_descs(lay, lay, run, run + nb)
    assert stats(co)["descriptors"] == nb * shape.layers and {int(d[:, LEN].max()) for d in co} == {shape.regions * bb}
    # the same bytes to the same places either way: a page's strided runs, joined, are the page
    assert coalesce(pages).tolist() == coalesce(np.concatenate(strided)).tolist()


def test_a_partial_last_block_moves_its_whole_page_when_posted_at_once():
    # llama-3-8b, 1000 tokens in 16-token blocks: 62 full blocks and one of 8 tokens
    shape = M.get_model("llama-3-8b")
    lay = Layout.fit("cross-layer", 32, 2, 32_768, 200 * 2_097_152)
    ids = np.arange(63)
    pages = page_descs(lay, lay, ids, ids + 100)
    assert len(pages) == 63 and int(pages[:, LEN].sum()) == 63 * 2_097_152  # 132,120,576 B: the page is the unit
    strided = request_descs(lay, lay, ids, ids + 100, nbytes_last=8 * 2_048)
    assert stats(strided)["descriptors"] == 63 * 64
    assert stats(strided)["payload_bytes"] == 1000 * M.bytes_per_token(shape, "fp16") == 131_072_000
    # posted at once, every row waits for the last layer: the earlier layers post nothing
    layers = in_last_layer(pages, 32)
    assert [len(d) for d in layers] == [0] * 31 + [63]


def test_offsets_and_the_block_view_agree():
    lay = Layout("cross-layer", 3, 2, 4, 5)  # 3 layers, K and V, 4 B per block and region, 5 blocks
    pool = np.arange(lay.nbytes, dtype=np.uint8)
    view = block_array(pool, lay)
    assert view.shape == (3, 2, 5, 4)
    for layer in range(3):
        for region in range(2):
            offs = lay.offsets(layer, region, np.arange(5))
            assert offs.tolist() == [((b * 3 + layer) * 2 + region) * 4 for b in range(5)]
            assert all(view[layer, region, b].tolist() == pool[o : o + 4].tolist() for b, o in enumerate(offs))
    # a page is a block of every layer and region, back to back
    assert lay.offsets(0, 0, 2) == 2 * lay.page_bytes and lay.page_bytes == 3 * 2 * 4


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 4), regions=st.sampled_from([1, 2]), bb=st.sampled_from([1, 8, 64]),
       n=st.integers(1, 10), seed=st.integers(0, 2**16),
       spec=st.sampled_from(["random", "contiguous", "fragmented:2", "fragmented:3"]), last=st.integers(1, 8))
def test_fast_coalescing_matches_sorting_and_pages_cover_the_same_bytes(layers, regions, bb, n, seed, spec, last):
    lay = Layout("cross-layer", layers, regions, bb, 24)
    src = BlockAllocator(lay.nblocks, seed).allocate(n, spec)
    dst = BlockAllocator(lay.nblocks, seed + 1).allocate(n, spec)
    last = min(last, bb)
    ref = [coalesce(d) for d in request_descs(lay, lay, src, dst, last)]
    fast = coalesced_descs(lay, lay, src, dst, last)
    assert [f.tobytes() for f in fast] == [r.tobytes() for r in ref]
    # whole pages move every byte of the request's blocks (their full blocks), each to its place, coalesced or not
    full = byte_map(np.concatenate(request_descs(lay, lay, src, dst)))
    assert byte_map(page_descs(lay, lay, src, dst)) == full == byte_map(page_descs(lay, lay, src, dst, True))


def test_which_models_and_cases_take_it():
    assert misfit("cross-layer", M.get_model("llama-3-8b")) is None
    assert misfit("cross-layer", M.get_model("deepseek-v3")) is None  # one latent region per layer: pages of it
    assert "mixed layer kinds" in misfit("cross-layer", M.get_model("gpt-oss-120b"))
    assert "codec" in misfit("cross-layer", M.get_model("llama-3-8b"), "zstd")
    assert "does not fit" in misfit("mla", M.get_model("llama-3-8b"))
    lines = preamble([{"layout": "cross-layer", "overlap": "serial", "arrival": "none"},
                      {"layout": "cross-layer", "overlap": "streaming", "arrival": "none"}])
    assert len(lines) == 2 and "one descriptor per page" in lines[0] and "strided run" in lines[1]
    assert preamble([{"layout": "layer-major", "overlap": "streaming", "arrival": "none"}]) == []


@pytest.mark.parametrize("args", [["-m", "gpt-oss-120b", "--layout", "cross-layer"], ["--layout", "pages"]])
def test_a_layout_that_cannot_hold_the_model_is_one_line(args, capsys):
    assert cli.main(["size", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layout" in err


def test_a_cross_layer_run_posts_pages_or_strided_runs_with_every_byte_checked(kvrun):
    r = kvrun(["-t", "shm,tcp", "-m", "llama-3-8b", "--layout", "cross-layer", "--tokens", "1000", "-b", "16", "-e",
               "16", "--op", "push,pull", "--overlap", "serial,streaming", "--coalesce", "off", "--alloc", "random",
               "-n", "2", "-w", "0", "--rounds", "1", "-c", "all", "--variants", "bulk,paged"], timeout=400)
    assert r.code == 0, r.out + r.err
    assert "# cross-layer serial cases: one descriptor per page" in r.out
    assert "# cross-layer streaming cases and workloads send layer by layer" in r.out
    ok = r.transfers()
    assert set(ok.status) == {"ok"} and set(ok.layout) == {"cross-layer"}
    paged = ok[ok.variant == "paged"]
    serial, streaming = paged[paged.overlap == "serial"], paged[paged.overlap == "streaming"]
    assert len(serial) and len(streaming)
    # serial: 63 whole pages (62 full blocks and the 8-token last one) of 2,097,152 B
    assert set(serial.descriptors) == {63} and set(serial.payload_bytes) == {63 * 2_097_152}
    # streaming: per layer one strided run per block and region; the last block holds 8 tokens
    assert set(streaming.descriptors) == {32 * 63 * 2} and set(streaming.payload_bytes) == {131_072_000}
    bulk = ok[ok.variant == "bulk"]
    assert set(bulk.descriptors) == {32} and set(bulk.payload_bytes) == {131_072_000}
    # -c all: every timed iteration and the check pass verified; not one wrong element
    assert ok.nwrong.notna().any() and int(ok.nwrong.fillna(0).sum()) == 0
    assert "wrong elements: 0" in r.out
