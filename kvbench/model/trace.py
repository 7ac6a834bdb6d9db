"""Request traces (Mooncake's FAST'25 JSONL): read and checked, summed up, and replayed through a prefix cache.

One JSON object per line: ``timestamp`` (arrival, ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``, the hash of each ``block``-token prefix block of the prompt (512 in Mooncake's traces).  Two
requests that share leading hash ids share those blocks' KV.  The shipped traces (traces/, with their
license and NOTICE) are named inputs: ``mooncake-conversation`` and ``mooncake-synthetic``.

The prefix cache sits on the decode side: a request's longest run of leading blocks already cached is its
hit, and stays put; the rest of its prompt moves.  Its hit tokens are ``min(hit_blocks x block,
input_length)`` (the last block may be partial).  Then every block of the request is cached: touched from
its last block to its first, so under a bounded LRU a prompt's tail is evicted before its head (as vLLM
frees a request's blocks), and a shared head outlives the tails that hang off it.
"""
from __future__ import annotations

import gzip
import json
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.model.limits import MAX_DIGITS, MAX_TOKENS, clip

HERE = Path(__file__).with_name("traces")
# named inputs -> the files shipped as package data (gzip: a third of the plain JSONL's size)
NAMED = {
    "mooncake-conversation": "conversation_trace.jsonl.gz",
    "mooncake-synthetic": "synthetic_trace.jsonl.gz",
}
BLOCK = 512  # Mooncake's prefix block, in tokens
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
PERCENTILES = (50, 90, 99)
MAX_LINE = 8 << 20  # characters of one request's line: a million-token prompt's hash ids at 16-token blocks fit


class TraceError(ValueError):
    """A trace that cannot be read: one line, naming the file and, where there is one, the line."""


@dataclass(frozen=True)
class Trace:
    """A trace as columns: one entry per request, and its hash ids flat (request i's are ids[start[i]:start[i+1]])."""

    name: str
    block: int
    timestamp_ms: np.ndarray  # float64, non-decreasing
    input_len: np.ndarray  # int64 tokens
    output_len: np.ndarray  # int64 tokens
    ids: np.ndarray  # int64, all requests' hash ids in order
    start: np.ndarray  # int64, len(requests) + 1 offsets into ids

    @property
    def requests(self) -> int:
        return len(self.input_len)

    @property
    def duration_s(self) -> float:
        """First arrival to last, in seconds."""
        return float(self.timestamp_ms[-1] - self.timestamp_ms[0]) / 1e3

    @property
    def blocks_per_request(self) -> np.ndarray:
        return np.diff(self.start)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (a prefix cache replayed over them sees what it sees in the whole trace)."""
        n = min(n, self.requests)
        return Trace(self.name, self.block, self.timestamp_ms[:n], self.input_len[:n], self.output_len[:n],
                     self.ids[: self.start[n]], self.start[: n + 1])


def resolve(source: str) -> Path:
    """A named trace's shipped file, or the path given; a missing file is a TraceError."""
    path = HERE / NAMED[source] if source in NAMED else Path(source)
    if not path.is_file():
        raise TraceError(f"trace '{source}': no such file (named traces: {', '.join(NAMED)})")
    return path


def brief(source: str) -> tuple[int, float]:
    """(requests, duration in s) of a trace from its line count and its first and last lines: `kvbench list`'s
    glance, no line checked (read() checks them all)."""
    path = resolve(source)
    first = last = None
    n = 0
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                first, last, n = first or line, line, n + 1
    if not n:
        return 0, 0.0
    return n, (json.loads(last)["timestamp"] - json.loads(first)["timestamp"]) / 1e3


def _number(rec: dict, key: str, where: str, integer: bool) -> float:
    v = rec[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
    if isinstance(v, bool) or not ok or v < 0:
        kind = "integer" if integer else "number"
        raise TraceError(f"{where}: '{key}' is {clip(v)}, not a non-negative {kind}")
    if integer and v > MAX_TOKENS:
        raise TraceError(f"{where}: '{key}' is {clip(v)}, more than {MAX_TOKENS:,} tokens (longer than any "
                         "model's context)")
    return v


def _integer(where: str):
    """json's parse_int for one line: an integer of more than MAX_DIGITS digits is refused before it is built
    (Python's own limit would say so without the file and line)."""
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > MAX_DIGITS:
            raise TraceError(f"{where}: an integer of {digits:,} digits (a length or hash id has at most {MAX_DIGITS})")
        return int(text)
    return parse


def _record(line: str, where: str, block: int) -> tuple[float, int, int, list]:
    """One line's (timestamp, input, output, hash ids), checked."""
    try:
        rec = json.loads(line, parse_int=_integer(where))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceError(f"{where}: nested too deep (a request is one JSON object with a list of hash ids)") from None
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: not a JSON object")
    missing = [k for k in FIELDS if k not in rec]
    if missing:
        raise TraceError(f"{where}: no {', '.join(missing)} (a request needs {', '.join(FIELDS)})")
    ts = _number(rec, "timestamp", where, integer=False)
    n_in = _number(rec, "input_length", where, integer=True)
    n_out = _number(rec, "output_length", where, integer=True)
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceError(f"{where}: 'hash_ids' is not a list of integers")
    if len(ids) > -(-n_in // block):  # more blocks than the prompt fills: the block size is not the trace's
        raise TraceError(f"{where}: {len(ids)} hash ids for {n_in} tokens, more than ceil({n_in} / {block}) "
                         f"blocks: is the trace's block size {block} tokens (--trace-block)?")
    return ts, n_in, n_out, ids


def read(source: str, block: int = BLOCK) -> Trace:
    """The trace ``source`` (a named trace or a .jsonl / .jsonl.gz path), every line checked."""
    if not isinstance(block, int) or block <= 0:
        raise TraceError(f"trace block size {block!r} is not a positive number of tokens")
    path = resolve(source)
    ts, n_in, n_out, flat, lens = [], [], [], [], []
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), ""), 1):
                if len(line) > MAX_LINE:
                    raise TraceError(f"{source}:{lineno}: a line longer than {MAX_LINE:,} characters")
                if not line.strip():
                    continue
                where = f"{source}:{lineno}"
                t, a, b, ids = _record(line, where, block)
                if ts and t < ts[-1]:
                    raise TraceError(f"{where}: timestamp {t} ms is before the previous line's {ts[-1]} ms "
                                     f"(a trace is in arrival order)")
                ts.append(t)
                n_in.append(a)
                n_out.append(b)
                flat.extend(ids)
                lens.append(len(ids))
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceError(f"trace '{source}': unreadable ({exc})") from None
    if not ts:
        raise TraceError(f"trace '{source}': no requests in it")
    try:
        ids_arr = np.array(flat, dtype=np.int64)
    except OverflowError:
        raise TraceError(f"trace '{source}': a hash id beyond 64 bits") from None
    start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=start[1:])
    return Trace(source, block, np.array(ts, dtype=np.float64), np.array(n_in, dtype=np.int64),
                 np.array(n_out, dtype=np.int64), ids_arr, start)


def percentiles(values: np.ndarray, qs=PERCENTILES) -> dict[int, int]:
    """Nearest-rank percentiles (a value some request really has)."""
    return {q: int(v) for q, v in zip(qs, np.percentile(values, qs, method="inverted_cdf"))}


@dataclass(frozen=True)
class CacheStats:
    """A trace replayed through a decode-side prefix cache of ``capacity`` blocks (None: unbounded)."""

    capacity: int | None
    block: int
    hit_blocks: np.ndarray  # per request: its longest run of leading blocks already cached
    blocks: int  # hash ids in the trace
    tokens: int  # prompt tokens in the trace
    hit_tokens: int  # sum of min(hit_blocks x block, input_length)

    @property
    def block_hit_rate(self) -> float:
        return int(self.hit_blocks.sum()) / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def hit_tokens_each(self, input_len: np.ndarray) -> np.ndarray:
        """Per request: its hit tokens, min(hit_blocks x block, input_length)."""
        return np.minimum(self.hit_blocks * self.block, input_len)

    @property
    def moved_tokens(self) -> int:
        """Prompt tokens whose KV is not cached at decode, and must move there."""
        return self.tokens - self.hit_tokens


def hits_unbounded(trace: Trace) -> np.ndarray:
    """Leading blocks of each request already cached when nothing is evicted (vectorised)."""
    lens = trace.blocks_per_request
    req = np.repeat(np.arange(trace.requests), lens)
    pos = np.arange(len(trace.ids)) - trace.start[req]  # a block's place in its prompt
    _, first, inv = np.unique(trace.ids, return_index=True, return_inverse=True)
    miss = req[first][inv.reshape(-1)] >= req  # first seen in this request: an earlier one did not cache it
    hits = lens.copy()
    missed, at = np.unique(req[miss], return_index=True)  # each request's first miss (positions ascend)
    hits[missed] = pos[miss][at]
    return hits


def hits_lru(trace: Trace, capacity: int) -> np.ndarray:
    """Leading blocks of each request already cached under an LRU of ``capacity`` blocks.

    An OrderedDict walk per block: analysis, not a timed path.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(trace.requests, dtype=np.int64)
    ids = trace.ids.tolist()
    start = trace.start.tolist()
    for r in range(trace.requests):
        blocks = ids[start[r]:start[r + 1]]
        h = 0
        for b in blocks:
            if b not in cache:
                break
            h += 1
        hits[r] = h
        for b in reversed(blocks):  # tail first: the head ends most recent, evicted last
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def check_capacity(capacity: int | None) -> int | None:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise TraceError(f"cache of {capacity!r} blocks: give a positive number of blocks (or none: unbounded)")
    return capacity


def replay(trace: Trace, capacity: int | None = None) -> CacheStats:
    """The trace through a prefix cache of ``capacity`` blocks, LRU (None: unbounded, nothing evicted)."""
    check_capacity(capacity)
    hits = hits_unbounded(trace) if capacity is None else hits_lru(trace, capacity)
    hit_tokens = int(np.minimum(hits * trace.block, trace.input_len).sum())  # as hit_tokens_each
    return CacheStats(capacity, trace.block, hits, int(len(trace.ids)), int(trace.input_len.sum()), hit_tokens)
