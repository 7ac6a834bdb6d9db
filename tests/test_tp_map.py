"""Prefill TP : decode TP (issue 43 item 2): which prefill ranks each decode rank takes its KV heads from, and the
descriptors and bytes of each piece in NHD and HND.  The counts pinned by hand on three models and an MLA model
(docs/layouts.md derives llama-3-70b's), then every byte of small pools moved by the pieces' descriptors: a decode
rank that receives a head it does not own, or a head in the wrong place, fails here."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvbench.cli import main as cli
from kvbench.model import shapes as M
from kvbench.model.descriptors import DST, LEN, SRC, stats
from kvbench.model.layout import Layout
from kvbench.model.tpmap import TPPair, parse_tp, piece_descs, rank_heads, source_ranks, tp_map

# THUDM/chatglm2-6b config.json: 28 layers, multi_query_group_num 2, kv_channels 128: few KV heads, so TP 4 replicates
GLM2 = M.ModelShape("chatglm2-6b", 28, 2, 128, "gqa", source="THUDM/chatglm2-6b config.json")


def model(name: str) -> M.ModelShape:
    return GLM2 if name == GLM2.name else M.get_model(name)


def per_decode(m, tp: str, head_layout: str, layout: str = "layer-major", tokens: int = 1024, block_size: int = 16):
    """(descriptors, bytes, source ranks) of each decode rank."""
    t = tp_map(m, tokens, block_size, "fp16", layout, head_layout, parse_tp(tp))
    return [(sum(q.descriptors for q in t.of(d)), sum(q.nbytes for q in t.of(d)), [q.prefill for q in t.of(d)])
            for d in range(t.tp.decode)]


# 1,024 tokens in 16-token blocks (64 blocks), fp16, layer-major: one decode rank's (descriptors, bytes, sources) in
# NHD and in HND.  A head of a token of a layer and region: 128 x 2 = 256 B.
COUNTS = {
    # llama-3-8b: 32 layers x 2 regions = 64 layer-regions, 8 KV heads
    ("llama-3-8b", "1:1"): ((4_096, 134_217_728), (4_096, 134_217_728), [0]),  # whole blocks of 32,768 B
    ("llama-3-8b", "2:1"): ((131_072, 134_217_728), (8_192, 134_217_728), [0, 1]),  # 64 x 1,024 per piece of 1,024 B
    ("llama-3-8b", "1:2"): ((65_536, 67_108_864), (4_096, 67_108_864), [0]),  # 4 of 8 heads: 1,024 B / 16,384 B
    ("llama-3-8b", "4:2"): ((131_072, 67_108_864), (8_192, 67_108_864), [0, 1]),  # two pieces of 2 heads: 512 / 8,192 B
    ("llama-3-8b", "2:4"): ((65_536, 33_554_432), (4_096, 33_554_432), [0]),  # 2 of 4 heads: 512 / 8,192 B
    # llama-3-70b: 80 layers (160 layer-regions), 8 KV heads (docs/layouts.md)
    ("llama-3-70b", "1:1"): ((10_240, 335_544_320), (10_240, 335_544_320), [0]),
    ("llama-3-70b", "2:1"): ((327_680, 335_544_320), (20_480, 335_544_320), [0, 1]),
    ("llama-3-70b", "1:2"): ((163_840, 167_772_160), (10_240, 167_772_160), [0]),
    ("llama-3-70b", "4:2"): ((327_680, 167_772_160), (20_480, 167_772_160), [0, 1]),
    ("llama-3-70b", "2:4"): ((163_840, 83_886_080), (10_240, 83_886_080), [0]),
    # chatglm2-6b: 28 layers (56 layer-regions), 2 KV heads; at 4:2 and 2:4 each rank holds one head, replicated
    # on 2 ranks: whole blocks of 4,096 B, each from one replica
    ("chatglm2-6b", "1:1"): ((3_584, 29_360_128), (3_584, 29_360_128), [0]),
    ("chatglm2-6b", "2:1"): ((114_688, 29_360_128), (7_168, 29_360_128), [0, 1]),
    ("chatglm2-6b", "1:2"): ((57_344, 14_680_064), (3_584, 14_680_064), [0]),
    ("chatglm2-6b", "4:2"): ((3_584, 14_680_064), (3_584, 14_680_064), [0]),
    ("chatglm2-6b", "2:4"): ((3_584, 14_680_064), (3_584, 14_680_064), [0]),
}


@pytest.mark.parametrize("name,tp", sorted(COUNTS))
def test_descriptors_and_bytes_of_a_decode_rank_are_pinned(name, tp):
    nhd, hnd, sources = COUNTS[(name, tp)]
    got_n, got_h = per_decode(model(name), tp, "NHD"), per_decode(model(name), tp, "HND")
    assert got_n[0] == (*nhd, sources) and got_h[0] == (*hnd, sources)
    # every decode rank receives as much (the heads divide evenly), each from its own prefill ranks
    assert {g[:2] for g in got_n} == {nhd} and {g[:2] for g in got_h} == {hnd}


def test_sources_gather_slice_and_replicas():
    m70 = M.get_model("llama-3-70b")
    assert source_ranks(m70, 4, 2, 1) == [(2, range(4, 6)), (3, range(6, 8))]  # 4 -> 2 gathers
    assert source_ranks(m70, 2, 4, 3) == [(1, range(6, 8))]  # 2 -> 4 slices
    assert rank_heads(GLM2, 4, 3) == range(1, 2) and rank_heads(GLM2, 2, 0) == range(0, 1)
    # replicas: decode 1 of 2 takes head 1 from the aligned prefill rank 2 (ranks 2 and 3 hold it)
    assert [s for d in range(2) for s in source_ranks(GLM2, 4, 2, d)] == [(0, range(0, 1)), (2, range(1, 2))]
    # 2 -> 4 replicated on the decode side: each prefill rank sends its head twice
    assert [source_ranks(GLM2, 2, 4, d) for d in range(4)] == [[(0, range(0, 1))]] * 2 + [[(1, range(1, 2))]] * 2
    # 4 -> 1: head 0 from the aligned rank 0, head 1 from its first holder, rank 2: two slices of one head
    assert per_decode(GLM2, "4:1", "NHD") == [(114_688, 29_360_128, [0, 2])]
    assert per_decode(m70, "16:2", "NHD")[1] == (655_360, 167_772_160, [8, 10, 12, 14])


@pytest.mark.parametrize("tp", ["1:1", "2:1", "1:2", "4:2", "2:4"])
def test_an_mla_latent_is_whole_whatever_the_tp_only_the_sender_changes(tp):
    m = M.get_model("deepseek-v3")  # 61 layers, one latent of 576 x 2 = 1,152 B per token
    p, d = parse_tp(tp).prefill, parse_tp(tp).decode
    for head_layout in ("NHD", "HND"):
        assert per_decode(m, tp, head_layout, "mla") == [(61 * 64, 71_958_528, [r * p // d]) for r in range(d)]
        # cross-layer: a page per block of 61 x 16 x 1,152 = 1,124,352 B
        assert per_decode(m, tp, head_layout, "cross-layer") == [(64, 71_958_528, [r * p // d]) for r in range(d)]


def test_cross_layer_and_a_partial_last_block():
    m = M.get_model("llama-3-8b")
    assert per_decode(m, "1:1", "NHD", "cross-layer") == [(64, 134_217_728, [0])]  # a page per block
    assert per_decode(m, "2:1", "NHD", "cross-layer") == [(131_072, 134_217_728, [0, 1])]  # a slice: strided
    assert per_decode(m, "2:1", "HND", "cross-layer") == [(8_192, 134_217_728, [0, 1])]
    # 1,000 tokens: 63 blocks, the last of 8 tokens; NHD moves its tokens, HND its slice whole
    assert per_decode(m, "1:1", "NHD", tokens=1000)[0] == (4_032, 131_072_000, [0])
    assert per_decode(m, "1:1", "HND", tokens=1000)[0] == (4_032, 132_120_576, [0])
    assert per_decode(m, "4:2", "NHD", tokens=1000)[0] == (128_000, 65_536_000, [0, 1])
    assert per_decode(m, "4:2", "HND", tokens=1000)[0] == (8_064, 66_060_288, [0, 1])


# Every byte: small pools, each element labelled with its (layer, region, token, head, element)
TINY = M.ModelShape("tiny", 2, 4, 4, "gqa")
TINY_MLA = M.ModelShape("tiny-mla", 2, attention="mla", kv_lora_rank=6, rope_dim=2)
SENTINEL = 0xFFFF
TOKENS, BS, NBLOCKS = 20, 8, 6  # 3 blocks of a request, the last of 4 tokens, in pools of 6


def _rank_shape(m, tp, rank):
    """(global heads, heads held, width of a head) of one rank; an MLA latent as one head of its width."""
    if m.attention == "mla":
        return [0], 1, m.row_elems
    heads = list(rank_heads(m, tp, rank))
    return heads, len(heads), m.head_dim


def _pool(m, kind, tp, rank, head_layout, blocks, fill: bool):
    """A rank's pool (uint16 elements, SENTINEL where no token is) and its layout; ``fill``: the labels of its heads
    at its ``blocks``."""
    heads, h, dim = _rank_shape(m, tp, rank)
    kheads = 1 if m.attention == "mla" else m.kv_heads
    lay = Layout(kind, m.layers, m.regions, BS * h * dim * 2, NBLOCKS)
    pool = np.full(lay.nbytes // 2, SENTINEL, dtype=np.uint16)
    for layer, region, tok, (j, g) in itertools.product(range(m.layers), range(m.regions), range(TOKENS),
                                                        enumerate(heads)):
        i, t = divmod(tok, BS)
        within = (t * h + j) * dim if head_layout == "NHD" else (j * BS + t) * dim
        at = int(lay.offsets(layer, region, blocks[i])) // 2 + within
        label = (((layer * m.regions + region) * TOKENS + tok) * kheads + g) * dim + 1
        if fill:
            pool[at:at + dim] = np.arange(label, label + dim)
    return pool, lay


def _expected(m, kind, tp, rank, head_layout, blocks):
    return _pool(m, kind, tp, rank, head_layout, blocks, True)[0]


CASES = [(m, kind, hl, tp) for m, kinds in ((TINY, ("layer-major", "block-major", "cross-layer")),
                                            (TINY_MLA, ("mla", "cross-layer")))
         for kind in kinds for hl in ("NHD", "HND")
         for tp in ("1:1", "2:1", "1:2", "4:2", "2:4", "8:2", "2:8", "4:1", "8:8")]


@pytest.mark.parametrize("m,kind,head_layout,tp", CASES,
                         ids=[f"{m.name}-{k}-{h}-{t}" for m, k, h, t in CASES])
def test_each_decode_rank_receives_exactly_its_heads_byte_for_byte(m, kind, head_layout, tp):
    pair = parse_tp(tp)
    tmap = tp_map(m, TOKENS, BS, "fp16", kind, head_layout, pair)
    rng = np.random.default_rng(7)
    nb = M.num_blocks(TOKENS, BS)
    src_blocks = {p: rng.permutation(NBLOCKS)[:nb] for p in range(pair.prefill)}
    pools = {p: _pool(m, kind, pair.prefill, p, head_layout, src_blocks[p], True) for p in range(pair.prefill)}
    for d in range(pair.decode):
        dst_blocks = rng.permutation(NBLOCKS)[:nb]
        got, dlay = _pool(m, kind, pair.decode, d, head_layout, dst_blocks, False)
        got8 = got.view(np.uint8)
        for piece in tmap.of(d):
            src, slay = pools[piece.prefill]
            descs = piece_descs(piece, tmap, slay, dlay, src_blocks[piece.prefill], dst_blocks)
            st = stats(descs)
            assert (st["descriptors"], st["payload_bytes"]) == (piece.descriptors, piece.nbytes)
            for rows in descs:
                for s, t, n in rows[:, [SRC, DST, LEN]].tolist():
                    got8[t:t + n] = src.view(np.uint8)[s:s + n]
        want = _expected(m, kind, pair.decode, d, head_layout, dst_blocks)
        assert np.array_equal(got, want), f"decode rank {d} of tp {tp}: {np.count_nonzero(got != want)} elements wrong"


def test_a_wrong_piece_is_caught():
    """The byte check above fails when a decode rank is sent a head of another rank (the test can fail)."""
    pair = parse_tp("2:4")
    tmap = tp_map(TINY, TOKENS, BS, "fp16", "layer-major", "NHD", pair)
    blocks = np.arange(3)
    src, slay = _pool(TINY, "layer-major", 2, 0, "NHD", blocks, True)
    got, dlay = _pool(TINY, "layer-major", 4, 0, "NHD", blocks, False)
    wrong = tmap.of(1)[0]  # decode rank 1's heads 2-3, posted into decode rank 0's pool
    for rows in piece_descs(wrong, tmap, slay, dlay, blocks, blocks):
        for s, t, n in rows.tolist():
            got.view(np.uint8)[t:t + n] = src.view(np.uint8)[s:s + n]
    assert not np.array_equal(got, _expected(TINY, "layer-major", 4, 0, "NHD", blocks))


def test_parse_tp():
    assert parse_tp("4:2") == TPPair(4, 2) and parse_tp("4") == TPPair(4, 4, paired=False)
    for bad in ("0:2", "2:0", "x", "4:2:1", "", "-1:2"):
        with pytest.raises(ValueError):
            parse_tp(bad)


def size(capsys, *args):
    rc = cli.main(["size", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("tp,hl,line", [
    ("4:2", "NHD", "         327,680 descriptors per decode rank, 167,772,160 B, from 2 prefill ranks (tp 4:2, NHD)"),
    ("4:2", "HND", "          20,480 descriptors per decode rank, 167,772,160 B, from 2 prefill ranks (tp 4:2, HND)"),
    ("2:4", "NHD", "         163,840 descriptors per decode rank, 83,886,080 B, from 1 prefill rank (tp 2:4, NHD)"),
    ("2:4", "HND", "          10,240 descriptors per decode rank, 83,886,080 B, from 1 prefill rank (tp 2:4, HND)"),
])
def test_size_acceptance_llama_3_70b(capsys, tp, hl, line):
    rc, out, _ = size(capsys, "-m", "llama-3-70b", "--tokens", "1024", "--block-size", "16", "--tp", tp,
                      "--head-layout", hl)
    assert rc == 0 and line in out.splitlines()
    if tp == "4:2":
        assert "       0       1     2-3 " in out  # decode rank 0 takes heads 2-3 from prefill rank 1


def test_size_one_tp_number_prints_no_map(capsys):
    rc, out, _ = size(capsys, "-m", "llama-3-70b", "--tp", "4")
    assert rc == 0 and "per decode rank" not in out and "tp=4 pp=1" in out


@pytest.mark.parametrize("args,says", [
    (["--tp", "3:2"], "prefill TP 3 does not divide llama-3-70b's 8 KV heads"),
    (["--tp", "0:2"], "a TP degree is a positive integer"),
    (["--tp", "2:2", "--head-layout", "xyz"], "invalid choice: 'xyz'"),
    (["--tp", "2:x"], "is not a TP degree"),
])
def test_size_bad_tp_input_is_one_line(capsys, args, says):
    rc, _, err = size(capsys, "-m", "llama-3-70b", *args)
    assert rc == 1 and err.count("\n") == 1 and says in err
