"""The paged KV pool: one allocation per rank, its layouts, and a block allocator.

A pool is raw, page-aligned bytes, allocated once and registered once.  A
*layout* interprets those bytes as ``layers x regions x blocks`` of
``block_bytes`` each, the way serving engines do:

* ``layer-major`` (vLLM FlashAttention): per layer, K then V, each
  ``[blocks, block_size, heads, dim]``; a block's K and V are far apart.
* ``block-major`` (FlashInfer-like): per layer ``[blocks, 2, block_size,
  heads, dim]``; a block's K and V are adjacent.
* ``mla``: one latent region per layer ``[blocks, block_size, rank+rope]``.
* ``cross-layer`` (vLLM's uniform cross-layer KV cache, Dynamo's FullyContiguous): one page per block,
  ``[blocks, layers, regions, block_size, ...]``: a block's every layer and region back to back, so a
  request is one descriptor per block (fewer once adjacent blocks coalesce).  A layer of a page is not
  contiguous: sent layer by layer (streaming), it is a strided run, one descriptor per block and region.

Because a layout is just arithmetic over offsets, cases with different block
sizes, dtypes or layouts reuse the same registered pool.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvbench.model.ageing import MAX_AGE, FreeQueue

LAYOUTS = ("layer-major", "block-major", "mla", "cross-layer")
ALLOC_HELP = ("contiguous, random, fragmented:<run> (runs of <run> adjacent blocks), tail (the pool's last "
              "blocks: kvbench probe's request touches the pool's last page) or aged:<N> (the decode pool's free "
              "list after N requests came and went, N = 0 to 1000000)")


class Pool:
    """One rank's pool: a page-aligned uint8 array plus where it came from."""

    def __init__(self, array: np.ndarray, kind: str = "host", release=None):
        self.array = array
        self.kind = kind
        self.nbytes = int(array.nbytes)
        self.addr = int(array.__array_interface__["data"][0])
        self._release = release
        self.own_pages = False  # True: a transport allocated it (alloc) and chose its pages: its pages() reports them

    def release(self) -> None:
        """Free the memory (idempotent)."""
        rel, self._release = self._release, None
        self.array = None
        if rel is not None:
            rel()


@dataclass(frozen=True)
class Layout:
    """Offsets of (layer, region, block) inside a pool of ``nblocks`` per layer."""

    kind: str
    layers: int
    regions: int  # 2 for K/V, 1 for MLA or fused
    block_bytes: int  # bytes of one block of one region
    nblocks: int  # blocks per layer (per region)

    @classmethod
    def fit(cls, kind: str, layers: int, regions: int, block_bytes: int, pool_bytes: int) -> Layout:
        """The largest layout of this shape that fits in ``pool_bytes``."""
        if kind == "mla" and regions != 1:
            raise ValueError("layout 'mla' needs a model with MLA attention (one latent region)")
        if kind not in ("mla", "cross-layer") and regions != 2:
            raise ValueError(f"layout '{kind}' needs K and V regions; use layout 'mla' for MLA models")
        nblocks = pool_bytes // (layers * regions * block_bytes)
        return cls(kind, layers, regions, block_bytes, int(nblocks))

    @property
    def nbytes(self) -> int:
        return self.layers * self.regions * self.nblocks * self.block_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of every layer and region (``cross-layer``: one contiguous page)."""
        return self.layers * self.regions * self.block_bytes

    def offsets(self, layer: int, region: int, blocks: np.ndarray) -> np.ndarray:
        """Byte offsets of ``blocks`` (int64 array) of one layer and region."""
        b = np.asarray(blocks, dtype=np.int64)
        bb, nb, r = self.block_bytes, self.nblocks, self.regions
        if self.kind == "block-major":
            return (layer * nb + b) * (r * bb) + region * bb
        if self.kind == "cross-layer":
            return ((b * self.layers + layer) * r + region) * bb
        return ((layer * r + region) * nb + b) * bb  # layer-major and mla

    def layer_span(self, layer: int) -> tuple[int, int]:
        """(offset, nbytes) of the contiguous bytes that hold one layer (``cross-layer``, where no layer is
        contiguous: the pool's ``layer``-th slice of a layer's size, the bulk reference's range)."""
        per = self.regions * self.nblocks * self.block_bytes
        return layer * per, per


def aged_n(spec: str) -> int | None:
    """'aged:1000' -> 1000; any other allocation, or one parse_alloc refuses, -> None."""
    try:
        kind, n = parse_alloc(spec)
    except ValueError:
        return None
    return n if kind == "aged" else None


def parse_alloc(spec: str) -> tuple[str, int]:
    """'random' -> ('random', 1); 'fragmented:4' -> ('fragmented', 4); 'aged:1000' -> ('aged', 1000)."""
    m = re.fullmatch(r"(contiguous|random|tail|fragmented:(\d+)|aged:(\d+))", spec)
    if not m:
        raise ValueError(f"alloc '{spec}' is not one of: {ALLOC_HELP}")
    if spec.startswith("aged"):
        n = int(m.group(3))
        if n > MAX_AGE:
            raise ValueError(f"alloc '{spec}': aged:<N> takes at most {MAX_AGE} requests")
        return "aged", n
    if spec.startswith("fragmented"):
        run = int(m.group(2))
        if run < 1:
            raise ValueError("fragmented:<run> needs run >= 1")
        return "fragmented", run
    return spec, 1


class BlockAllocator:
    """Hands out block ids of one pool; seeded, so runs are reproducible.

    ``allocate`` returns ``None`` when there are not enough free blocks
    (the caller decides between back-pressure and failure).  After ``age``
    it is a free queue (model/ageing.py): ``aged:<N>`` takes from its head and
    ``release`` gives back to its tail, a request's blocks last first.
    """

    def __init__(self, nblocks: int, seed: int = 0):
        self.nblocks = nblocks
        self.free_mask = np.ones(nblocks, dtype=bool)
        self.rng = np.random.default_rng(seed)
        self.queue: FreeQueue | None = None

    def age(self, order: np.ndarray) -> BlockAllocator:
        """Hand out blocks from now on in the order of ``order`` (every block, head first: ageing.aged_order)."""
        if self.nfree != self.nblocks or len(order) != self.nblocks:
            raise ValueError("an aged free list replaces a whole, unused pool")
        self.queue = FreeQueue(self.nblocks, np.asarray(order, dtype=np.int64))
        return self

    @property
    def nfree(self) -> int:
        return int(self.free_mask.sum())

    def allocate(self, n: int, spec: str = "random") -> np.ndarray | None:
        """Reserve ``n`` blocks with pattern ``spec``; int64 ids in request order."""
        kind, run = parse_alloc(spec)
        if (kind == "aged") != (self.queue is not None):
            raise ValueError(f"alloc '{spec}' on a pool that was {'' if self.queue is not None else 'not '}aged")
        if n > self.nfree:
            return None
        if kind == "aged":
            ids = self.queue.take(n)
            self.free_mask[ids] = False
            return ids
        free = np.flatnonzero(self.free_mask)
        if kind == "contiguous":
            ids = self._first_run(n)
        elif kind == "tail":  # the last free blocks: with a pool the layout fills, its last page is among them
            ids = free[-n:]
        elif kind == "random" or run == 1:
            ids = self.rng.choice(free, size=n, replace=False)
        else:
            ids = self._runs(n, run)
        if ids is None:
            return None
        ids = ids.astype(np.int64)
        self.free_mask[ids] = False
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Return ``ids`` to the free set."""
        self.free_mask[ids] = True
        if self.queue is not None:
            self.queue.put(np.asarray(ids, dtype=np.int64)[::-1])

    def _first_run(self, n: int) -> np.ndarray | None:
        # first fit: the first window of n consecutive free blocks
        f = self.free_mask.astype(np.int64)
        c = np.concatenate(([0], np.cumsum(f)))
        ok = np.flatnonzero(c[n:] - c[:-n] == n) if n <= self.nblocks else []
        if len(ok) == 0:
            return None
        return np.arange(ok[0], ok[0] + n)

    def _runs(self, n: int, run: int) -> np.ndarray | None:
        # run-aligned chunks that are entirely free, chosen at random, in random order
        nchunks = self.nblocks // run
        chunks = self.free_mask[: nchunks * run].reshape(nchunks, run).all(axis=1)
        cand = np.flatnonzero(chunks)
        need = -(-n // run)
        if len(cand) < need:
            return None
        pick = self.rng.choice(cand, size=need, replace=False)
        ids = (pick[:, None] * run + np.arange(run)[None, :]).ravel()
        return ids[:n]


def block_array(pool: np.ndarray, lay, dtype=np.uint8) -> np.ndarray:
    """A (layers, regions, blocks, block_bytes / itemsize) view of a pool: ``[:, :, ids]`` is blocks ``ids``."""
    L, R, nb = lay.layers, lay.regions, lay.nblocks
    w = lay.block_bytes // np.dtype(dtype).itemsize
    flat = pool[: lay.nbytes].view(dtype)
    if lay.kind == "block-major":
        return flat.reshape(L, nb, R, w).transpose(0, 2, 1, 3)
    if lay.kind == "cross-layer":
        return flat.reshape(nb, L, R, w).transpose(1, 2, 0, 3)
    return flat.reshape(L, R, nb, w)


def misfit(kind: str, shape, codec: str = "none") -> str | None:
    """Why layout ``kind`` cannot hold a case of model ``shape`` (a shapes.ModelShape), one line; None: it can."""
    if kind not in LAYOUTS:
        return f"layout '{kind}' is not one of: auto, {', '.join(LAYOUTS)}"
    if kind != "cross-layer" and (kind == "mla") != (shape.attention == "mla"):
        return (f"layout '{kind}' does not fit model '{shape.name}' ({shape.attention}); use 'auto', or one of: "
                f"{', '.join(LAYOUTS)}")
    if kind == "cross-layer" and shape.hybrid:
        return f"layout 'cross-layer' with model '{shape.name}': pages of mixed layer kinds are not modelled"
    if kind == "cross-layer" and codec != "none":
        return f"layout 'cross-layer' with codec '{codec}': a codec codes layer by layer, a page holds every layer"
    return None


def preamble(cases: list[dict]) -> list[str]:
    """The run preamble's word on what a cross-layer case posts: whole pages, or a strided run per layer."""
    xl = [c for c in cases if c.get("layout") == "cross-layer"]
    out = []
    if any(c.get("overlap") != "streaming" and c.get("arrival", "none") == "none" for c in xl):
        out.append("# cross-layer serial cases: one descriptor per page (a block of every layer and region; a "
                   "prompt's last, partial block too, whole), adjacent pages merged under coalesce on")
    if any(c.get("overlap") == "streaming" or c.get("arrival", "none") != "none" for c in xl):
        out.append("# cross-layer streaming cases and workloads send layer by layer: a layer of a page is a strided "
                   "run, one descriptor per block and region of each layer (a block's regions merged under coalesce on)")
    return out
