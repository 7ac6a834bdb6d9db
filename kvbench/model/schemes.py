"""Who pairs with whom: rank pairing schemes, the requests of each pair (entries), and their control bytes.

A *scheme* turns a world of ranks into (prefill, decode) pairs that transfer
at the same time; ``inflight`` requests per pair are in flight at once, each
with its own source and destination blocks.  An *entry* is one request of
one pair: its per-layer descriptor arrays, built once per case and reused
by every iteration.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.model import matrix as X
from kvbench.model.descriptors import DST, LEN, SRC

SCHEMES = ("pairwise", "many-to-one", "one-to-many", "all-pairs", "matrix", "bidir")
FLOWS = ("matrix", "bidir")  # schemes measured twice: each flow alone, then all flows at once (harness/flows.py)
SCHEME_HELP = ("pairwise: even ranks prefill, odd ranks decode, (2k, 2k+1); many-to-one: every rank but the "
               "last prefills into the last rank's pool at once; one-to-many: rank 0 prefills for every other "
               "rank; all-pairs: every even rank with every odd rank, all at once; matrix: --matrix FILE or NAME "
               "(each flow alone, then all at once: slowdown and fairness); bidir: each pairwise pair both ways at "
               "once, beside each direction alone")


class SchemeError(ValueError):
    """A scheme that cannot be formed from this many ranks."""


def make_pairs(scheme: str, world: int, matrix=None) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) pairs of ``scheme`` on ``world`` ranks (empty for a world of one); ``matrix``:
    --matrix's cells or name (model/matrix.py), for the scheme matrix."""
    if scheme.startswith("tp:"):
        return tp_pairs(scheme, world)
    if scheme not in SCHEMES:
        raise SchemeError(f"scheme '{scheme}' is not one of: {', '.join(SCHEMES)}")
    if world == 1:
        return []
    if scheme in FLOWS:
        if scheme == "matrix" and matrix is None:
            raise SchemeError("scheme 'matrix' needs --matrix FILE (CSV or YAML) or a name: " + ", ".join(X.NAMED))
        return X.flows(matrix_cells("bidir" if scheme == "bidir" else matrix, world))
    if scheme == "pairwise":
        if world % 2:
            raise SchemeError(f"scheme 'pairwise' needs an even number of ranks (got {world}): "
                              "even ranks prefill, odd ranks decode")
        return [(r, r + 1) for r in range(0, world, 2)]
    if scheme == "many-to-one":
        return [(r, world - 1) for r in range(world - 1)]
    if scheme == "one-to-many":
        return [(0, r) for r in range(1, world)]
    if world % 2:
        raise SchemeError(f"scheme 'all-pairs' needs an even number of ranks (got {world})")
    return [(s, d) for s in range(0, world, 2) for d in range(1, world, 2)]


def tp_scheme(pairs) -> str:
    """The scheme of a run at --tp P:D (its TP pairs, config/tpcheck.py): 'tp:P:D[,P:D...]'."""
    return "tp:" + ",".join(map(str, pairs))


def tp_pairs(scheme: str, world: int) -> list[tuple[int, int]]:
    """Scheme 'tp:P:D[,P:D...]': ranks 0..P-1 prefill, P..P+D-1 decode, a prefill rank paired with every decode rank
    whose share of the heads overlaps its own; a case's own pairs, its TP map's pieces (model/tpmap.py), are among
    them (all of them unless an MLA latent or a replicated head is taken from one rank of several).  The world is
    the largest pair's P + D: a smaller pair's cases run on its first ranks while the rest wait."""
    out: list[tuple[int, int]] = []
    sizes = []
    for text in scheme[3:].split(","):
        p, _, d = text.partition(":")
        if not (p.isdigit() and d.isdigit() and int(p) and int(d)):
            raise SchemeError(f"scheme '{scheme}': give tp:P:D (prefill TP : decode TP), or --tp P:D")
        p, d = int(p), int(d)
        sizes.append((p + d, p, d))
        out += [(q, p + r) for q in range(p) for r in range(d)
                if q * d < (r + 1) * p and r * p < (q + 1) * d and (q, p + r) not in out]
    n, p, d = max(sizes)
    if n != world:
        raise SchemeError(f"--tp {p}:{d} needs {n} ranks ({p} prefill + {d} decode), got {world}")
    return out


def flow_cells(scheme: str, world: int, matrix=None) -> list[str] | None:
    """Per pair of ``make_pairs``, its matrix cell (model/matrix.py: tokens, bytes or the case's); None for the
    schemes whose pairs all move the case's tokens."""
    if scheme not in FLOWS or world == 1:
        return None
    cells = matrix_cells("bidir" if scheme == "bidir" else matrix, world)
    return [cells[s][d] for s, d in X.flows(cells)]


def matrix_cells(matrix: list[list[str]] | str, world: int) -> list[list[str]]:
    """A matrix's cells for ``world`` ranks: a name (a scheme as a matrix of the case's tokens; incast is
    many-to-one, bidir pairwise both ways) expanded, a file's cells checked against the rank count."""
    if not isinstance(matrix, str):
        if len(matrix) != world:
            raise SchemeError(f"--matrix: a {len(matrix)}x{len(matrix)} matrix for {world} ranks (it must be "
                              f"{world}x{world}: one row and one column per rank)")
        return matrix
    if matrix == "bidir":
        pairs = [p for s, d in make_pairs("pairwise", world) for p in ((s, d), (d, s))]
    else:
        pairs = make_pairs("many-to-one" if matrix == "incast" else matrix, world)
    cells = [["0"] * world for _ in range(world)]
    for s, d in pairs:
        cells[s][d] = X.ALL
    return cells


def max_entries_per_rank(pairs: list[tuple[int, int]], inflight: int) -> int:
    """The most requests any one rank's pool must hold at once (sizes the pool)."""
    count: dict[int, int] = {}
    for s, d in pairs:
        count[s] = count.get(s, 0) + 1
        count[d] = count.get(d, 0) + 1
    return max(count.values(), default=1) * inflight


@dataclass
class Entry:
    """One request of one pair, as this rank sees it."""

    pair: int
    req: int  # index among the pair's in-flight requests
    src: int
    dst: int
    layers: list[np.ndarray]
    blocks_dst: np.ndarray | None = None  # the block table decode granted (sent in the handshake)
    tokens: int = 0  # a matrix's flow: its own tokens (0: the case's)

    @property
    def payload(self) -> int:
        return int(sum(int(d[:, LEN].sum()) for d in self.layers))

    @property
    def descriptors(self) -> int:
        return sum(len(d) for d in self.layers)


def roles(entries: list[Entry], rank: int, op: str, local: bool):
    """Split entries into what this rank initiates and what it serves, with the peer of each."""
    init, serve = [], []
    for e in entries:
        initiator = e.src if op == "push" else e.dst
        peer = e.dst if initiator == e.src else e.src
        if local or initiator == rank:
            init.append((e, peer))
        else:
            serve.append((e, rank_other(e, rank)))
    return init, serve


def rank_other(e: Entry, rank: int) -> int:
    return e.dst if e.src == rank else e.src


def offset_bulk(layers: list[np.ndarray], src_slot: int, dst_slot: int, stride: int | None = None) -> list[np.ndarray]:
    """Shift one-descriptor-per-layer (bulk) arrays so that several requests do not overlap (``stride``: bytes per
    slot, where requests differ in size; default each array's own length)."""
    out = []
    for d in layers:
        d = d.copy()
        d[:, SRC] += src_slot * (stride or d[:, LEN])
        d[:, DST] += dst_slot * (stride or d[:, LEN])
        out.append(d)
    return out


# control-plane message sizes: what real engines send beside the KV
REQUEST_BYTES = 64  # request id, prompt length, sampling parameters
STATE_BYTES = 64  # first token and sampler state, sent with the completion


def control_bytes(e: Entry, handshake: str) -> int:
    """Metadata bytes a request adds to the wire: request, block table grant, sampler state."""
    if handshake == "off":
        return 0
    return REQUEST_BYTES + 4 * len(e.blocks_dst) + STATE_BYTES


