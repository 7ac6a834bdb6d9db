"""Prefill TP : decode TP: which prefill ranks a decode rank takes its KV heads from, and the descriptors and bytes
of each piece, in either head layout of a block.

Heads.  Rank ``r`` of a TP group of ``t`` holds, of a model's ``K`` KV heads, heads ``[r K/t, (r+1) K/t)`` when
``t <= K`` (``t`` divides ``K``), and head ``r // (t/K)`` when ``t > K`` (``t`` a multiple of ``K``: each head on
``t/K`` ranks, vLLM's ``num_kv_head_replicas``; shapes.shard's ``max(1, K/t)`` heads per rank).  An MLA latent is
not split by TP: every rank holds it whole.

Sources.  A decode rank ``d`` of ``D`` takes each of its heads from the prefill rank aligned with it, ``d P // D``
of ``P``, when that rank holds the head, else from the first prefill rank that does.  So TP 4 -> 2 gathers from two
prefill ranks, TP 2 -> 4 takes half of one prefill rank's heads, a replicated head is taken once, and an MLA latent
comes whole from the aligned rank: P:D changes nothing but which rank sends.

Head layouts of one block of one region (``block_size`` tokens):

* ``NHD`` ``[token, head, dim]`` (vLLM's default): a slice of the heads is contiguous only per token.
* ``HND`` ``[head, token, dim]``: a slice of the heads of a block is one contiguous run.

A *piece* (what a decode rank receives from one prefill rank) is *whole* when it is every head of the block on
both sides (as many heads as each rank holds); it then moves as at TP 1:1, a block per descriptor (a page under
``cross-layer``).  Otherwise it is a strided slice, in every layout (``cross-layer`` too), per layer and region:

* NHD: one descriptor per token, ``heads x head_dim x dtype bytes`` each (a partial last block: its tokens only);
* HND: one descriptor per block, ``heads x block_size x head_dim x dtype bytes`` each.

In HND a partial last block moves whole, as a page does under ``cross-layer``: a head's run spans the block, and
the tokens the prompt did not fill lie between filled ones.  Counts are uncoalesced (a slice of a block is never
adjacent to the next block's slice).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.model import shapes as M
from kvbench.model.descriptors import DST, LEN, SRC, in_last_layer, page_descs, request_descs
from kvbench.model.layout import Layout

HEAD_LAYOUTS = ("NHD", "HND")
HEAD_LAYOUT_HELP = ("NHD (default, vLLM's [block, token, head, dim]: a head slice is contiguous per token) or "
                    "HND ([block, head, token, dim]: a head slice of a block is one run)")


@dataclass(frozen=True)
class TPPair:
    """``--tp P:D``: prefill TP ``prefill``, decode TP ``decode``; ``paired``: given as P:D, not one number."""

    prefill: int
    decode: int
    paired: bool = True

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"


def parse_tp(text: str) -> TPPair:
    """'4:2' -> TPPair(4, 2); '4' -> TPPair(4, 4, paired=False); one line naming the form otherwise."""
    parts = text.strip().split(":")
    form = "give P:D (prefill TP : decode TP, e.g. 4:2) or one N for both"
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"'{text}' is not a TP degree: {form}")
    nums = [int(p) for p in parts]
    if min(nums) < 1:
        raise ValueError(f"'{text}': a TP degree is a positive integer; {form}")
    return TPPair(nums[0], nums[-1], len(nums) == 2)


def case_pair(tp) -> TPPair | None:
    """A case's ``tp``: a 'P:D' string (a run's --tp P:D) as its TPPair, one number (today's meaning) None."""
    return parse_tp(tp) if isinstance(tp, str) else None


def rank_pairs(tmap: TPMap) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) per piece, in piece order: prefill ranks 0..P-1, decode ranks P..P+D-1."""
    return [(q.prefill, tmap.tp.prefill + q.decode) for q in tmap.pieces]


def check_tp(m: M.ModelShape, tp: int, side: str = "") -> None:
    """One line unless ``tp`` ranks can share ``m``'s KV heads evenly (it divides them, or is a multiple of them)."""
    if tp < 1:
        raise ValueError(f"{side}TP {tp}: a TP degree is a positive integer")
    if m.attention == "mla" or m.kv_heads % tp == 0 or tp % m.kv_heads == 0:
        return
    raise ValueError(f"{side}TP {tp} does not divide {m.name}'s {m.kv_heads} KV heads (a TP degree divides the KV "
                     f"heads, or is a multiple of them: each head then on TP / heads ranks)")


def rank_heads(m: M.ModelShape, tp: int, rank: int) -> range:
    """The KV heads (global ids) rank ``rank`` of a TP group of ``tp`` holds; empty for an MLA latent."""
    if m.attention == "mla":
        return range(0)
    if tp <= m.kv_heads:
        per = m.kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    h = rank // (tp // m.kv_heads)
    return range(h, h + 1)


def source_ranks(m: M.ModelShape, p: int, d: int, rank: int) -> list[tuple[int, range]]:
    """(prefill rank, the global heads it sends) for decode rank ``rank`` of TP ``d`` from prefill TP ``p``, in
    head order; an MLA latent: [(the aligned prefill rank, empty range)]."""
    aligned = rank * p // d
    if m.attention == "mla":
        return [(aligned, range(0))]
    out: list[tuple[int, list[int]]] = []
    for h in rank_heads(m, d, rank):
        if h in rank_heads(m, p, aligned):
            src = aligned
        else:
            src = next(q for q in range(p) if h in rank_heads(m, p, q))
        if out and out[-1][0] == src:
            out[-1][1].append(h)
        else:
            out.append((src, [h]))
    return [(q, range(hs[0], hs[-1] + 1)) for q, hs in out]


@dataclass(frozen=True)
class Piece:
    """What one decode rank receives from one prefill rank: heads, where they sit, descriptors and bytes."""

    decode: int
    prefill: int
    heads: range  # global KV heads; empty for an MLA latent (whole)
    src_head: int  # the first head's index among the prefill rank's heads
    dst_head: int  # ... among the decode rank's heads
    whole: bool  # every head of a block on both sides: moves as at TP 1:1
    descriptors: int
    nbytes: int

    @property
    def mean_bytes(self) -> float:
        return self.nbytes / self.descriptors if self.descriptors else 0.0


@dataclass(frozen=True)
class TPMap:
    """Every decode rank's pieces for one request of ``tokens`` tokens (after prefix hits)."""

    model: M.ModelShape  # the whole model (one PP stage's layers)
    tp: TPPair
    head_layout: str
    layout: str
    tokens: int
    block_size: int
    dtype: str
    pieces: tuple[Piece, ...]

    def of(self, decode: int) -> list[Piece]:
        """The pieces decode rank ``decode`` receives, in head order."""
        return [q for q in self.pieces if q.decode == decode]

    @property
    def prefill_heads(self) -> int:
        return len(rank_heads(self.model, self.tp.prefill, 0))

    @property
    def decode_heads(self) -> int:
        return len(rank_heads(self.model, self.tp.decode, 0))


def check(m: M.ModelShape, tp: TPPair, head_layout: str, layout: str) -> None:
    """One line unless a map of ``m`` under ``tp`` in ``head_layout`` and ``layout`` can be drawn."""
    if head_layout not in HEAD_LAYOUTS:
        raise ValueError(f"head layout '{head_layout}' is not one of: {', '.join(HEAD_LAYOUTS)}")
    if m.hybrid or m.indexer_bytes:
        raise ValueError(f"--tp {tp} (or --head-layout) with model '{m.name}': the per-decode-rank map of "
                         f"{'sliding windows and linear states' if m.hybrid else 'an indexer key cache'} is not "
                         "modelled; give one TP degree and no --head-layout")
    for side, t in (("prefill ", tp.prefill), ("decode ", tp.decode)):
        try:
            check_tp(m, t, side)
        except ValueError as exc:
            raise ValueError(f"--tp {tp}: {exc}") from None
    if layout == "mla" and m.attention != "mla":
        raise ValueError(f"layout 'mla' does not fit model '{m.name}' ({m.attention})")


def tp_map(m: M.ModelShape, tokens: int, block_size: int, dtype: str, layout: str, head_layout: str,
           tp: TPPair) -> TPMap:
    """The pieces of every decode rank: descriptors and bytes from each prefill rank it receives from."""
    check(m, tp, head_layout, layout)
    M.check_block_size(block_size)
    pieces = []
    for d in range(tp.decode):
        for q, heads in source_ranks(m, tp.prefill, tp.decode, d):
            src0 = rank_heads(m, tp.prefill, q)
            dst0 = rank_heads(m, tp.decode, d)
            whole = m.attention == "mla" or len(heads) == len(src0) == len(dst0)
            n, nb = _counts(m, tokens, block_size, dtype, layout, head_layout, len(heads), whole)
            pieces.append(Piece(d, q, heads, heads.start - src0.start if heads else 0,
                                heads.start - dst0.start if heads else 0, whole, n, nb))
    return TPMap(m, tp, head_layout, layout, tokens, block_size, dtype, tuple(pieces))


def _counts(m: M.ModelShape, tokens: int, bs: int, dtype: str, layout: str, head_layout: str, heads: int,
            whole: bool) -> tuple[int, int]:
    """(descriptors, bytes) of one piece of ``heads`` heads (the latent's width for MLA)."""
    lr = m.layers * m.regions
    row = (m.row_elems if m.attention == "mla" else heads * m.head_dim) * M.dtype_bytes(dtype)  # a token's bytes
    nblocks = M.num_blocks(tokens, bs)
    if whole and layout == "cross-layer":
        return nblocks, nblocks * lr * bs * row  # a page per block, the last one whole
    if whole and (m.attention == "mla" or head_layout == "NHD"):
        return lr * nblocks, lr * tokens * row  # a block per descriptor, the last one cut to its tokens
    if head_layout == "HND":
        return lr * nblocks, lr * nblocks * bs * row  # a block's slice per descriptor, the last one whole
    return lr * tokens, lr * tokens * row  # NHD slice: a token's heads per descriptor


def piece_descs(piece: Piece, tmap: TPMap, src: Layout, dst: Layout, src_blocks: np.ndarray,
                dst_blocks: np.ndarray) -> list[np.ndarray]:
    """Per-layer descriptors of one piece from the prefill rank's pool (layout ``src``) into the decode rank's
    (``dst``), blocks ``src_blocks`` into ``dst_blocks``; one numpy pass, no loop per block or token."""
    m, bs = tmap.model, tmap.block_size
    s = np.asarray(src_blocks, dtype=np.int64)
    t = np.asarray(dst_blocks, dtype=np.int64)
    last = tmap.tokens - (len(s) - 1) * bs  # tokens of the last block
    if piece.whole:
        if tmap.layout == "cross-layer":
            return in_last_layer(page_descs(src, dst, s, t), m.layers)
        cut = None if tmap.head_layout == "HND" and m.attention != "mla" else last * src.block_bytes // bs
        return request_descs(src, dst, s, t, cut)
    hb = m.head_dim * M.dtype_bytes(tmap.dtype)  # one head of one token
    hp, hd, k = src.block_bytes // (bs * hb), dst.block_bytes // (bs * hb), len(piece.heads)
    lay = np.arange(m.layers)[:, None, None]
    if tmap.head_layout == "HND":
        out = np.empty((m.layers, len(s), m.regions, 3), dtype=np.int64)
        for r in range(m.regions):  # 1 or 2: regions, not descriptors
            out[:, :, r, SRC] = src.offsets(lay[:, :, 0], r, s) + piece.src_head * bs * hb
            out[:, :, r, DST] = dst.offsets(lay[:, :, 0], r, t) + piece.dst_head * bs * hb
        out[:, :, :, LEN] = k * bs * hb
        return list(out.reshape(m.layers, -1, 3))
    tok = np.arange(bs, dtype=np.int64)
    out = np.empty((m.layers, len(s), m.regions, bs, 3), dtype=np.int64)
    for r in range(m.regions):
        out[:, :, r, :, SRC] = src.offsets(lay, r, s[:, None]) + (tok * hp + piece.src_head) * hb
        out[:, :, r, :, DST] = dst.offsets(lay, r, t[:, None]) + (tok * hd + piece.dst_head) * hb
    out[..., LEN] = k * hb
    keep = np.ones((len(s), bs), dtype=bool)
    if len(s):
        keep[-1, last:] = False  # the last block's unfilled tokens
    keep = np.broadcast_to(keep[:, None, :], (len(s), m.regions, bs))
    return [layer[keep] for layer in out]


def map_lines(tmap: TPMap) -> list[str]:
    """`kvbench size --tp P:D`'s section: per decode rank, what it receives from each prefill rank."""
    m, tp, hl = tmap.model, tmap.tp, tmap.head_layout
    mla = m.attention == "mla"
    out = [f"# tp {tp} (prefill : decode), {'MLA latent, not split by TP' if mla else f'head layout {hl}'}, "
           f"layout {tmap.layout}, {tmap.tokens:,} tokens in {tmap.block_size}-token blocks"]
    if mla:
        out.append(f"# every rank holds the latent whole: decode rank d receives it from prefill rank d x {tp.prefill}"
                   f" // {tp.decode}")
    else:
        out.append(f"# a prefill rank holds {tmap.prefill_heads} of {m.kv_heads} KV heads, a decode rank "
                   f"{tmap.decode_heads}; {_why(tmap)}")
    out.append(f"# {'decode':>6} {'prefill':>7} {'heads':>7} {'descriptors':>14} {'B/descriptor':>14} {'bytes':>16}")
    for d in range(tp.decode):
        ps = tmap.of(d)
        for q in ps:
            heads = "latent" if mla else _heads(q.heads)
            out.append(f"  {d:>6} {q.prefill:>7} {heads:>7} {q.descriptors:>14,} {_mean(q.mean_bytes):>14} "
                       f"{q.nbytes:>16,}")
        if len(ps) == 1:
            continue
        n, nb = sum(q.descriptors for q in ps), sum(q.nbytes for q in ps)
        heads = "latent" if mla else _heads(range(ps[0].heads.start, ps[-1].heads.stop))
        out.append(f"  {d:>6} {'all ' + str(len(ps)):>7} {heads:>7} {n:>14,} {_mean(nb / n if n else 0):>14} "
                   f"{nb:>16,}")
    per = [sum(q.descriptors for q in tmap.of(d)) for d in range(tp.decode)]
    nbs = [sum(q.nbytes for q in tmap.of(d)) for d in range(tp.decode)]
    srcs = {len(tmap.of(d)) for d in range(tp.decode)}
    same = len(set(per)) == 1 and len(set(nbs)) == 1 and len(srcs) == 1
    if same:
        k = srcs.pop()
        out.append(f"{per[0]:>16,} descriptors per decode rank, {nbs[0]:,} B, from {k} prefill rank"
                   f"{'s' * (k != 1)} (tp {tp}, {'latent' if mla else hl})")
    return out


def _why(tmap: TPMap) -> str:
    if all(q.whole for q in tmap.pieces):
        return "each piece is every head of a block on both sides: a block per descriptor, as at 1:1"
    if tmap.head_layout == "NHD":
        return "a slice of a block's heads is contiguous only per token (NHD): a descriptor per token"
    return "a slice of a block's heads is one run (HND): a descriptor per block, a partial last block whole"


def _heads(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def _mean(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"
