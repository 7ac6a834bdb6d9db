"""An aged decode pool (``--alloc aged:N``): the free list a long-running server's block allocator is left with.

A fresh pool hands a request adjacent blocks; a server that has admitted and
finished thousands of requests hands it whatever its free list holds by then.
This module replays ``N`` requests through a model of vLLM's free block queue
(``FreeKVCacheBlockQueue``, v1) and returns the queue they leave behind:

* the queue starts as every block in id order;
* an admitted request takes its blocks from the **head** of the queue;
* a finished request's blocks go to the **tail**, in reverse order (vLLM frees a
  request's blocks tail first, so that the blocks of a shared prefix are
  evicted last);
* admission is first come, first served: a request that does not fit waits,
  and those behind it wait with it, until enough requests have finished.

Request ``i`` arrives at ``arrival[i]`` seconds, holds
``ceil((input_len + output_len) / block_size)`` blocks (its final footprint,
taken at admission) and finishes ``output_len x tpot_s`` seconds after it was
admitted.  vLLM takes a decoding request's blocks one at a time as its tokens
fill them, interleaving concurrent requests' blocks further; that growth is
not modelled, so this free list is, if anything, less fragmented than a real
server's.  Prefix-cache hits (a cached free block pulled out of the middle of
the queue) are not modelled either.

Without a trace the requests are drawn (seeded): lognormal prompts and outputs,
Poisson arrivals at the rate that keeps the pool ``OCCUPANCY`` full on average
(Little's law).  ``age`` takes any arrays of (arrival, input_len, output_len).

Under ``run --trace`` the pool is aged by the trace's own requests instead (``TraceRequests``): its first
``N``, in trace order, cycling through the trace when it holds fewer (repeat ``r`` arrives
``r x (span + span / (requests - 1))`` seconds later: the trace's span plus its mean gap, so the gap between
the last request and the next repeat's first is an ordinary one).  Arrivals are the trace's timestamps less
the first's, divided by the replay's speed; a prompt is cut to the model's context as the replay cuts it
(0: no cut); the replay's other clip, to the decode pool, is ``footprint``'s (at most the whole pool);
output lengths are the trace's.  A request holds its whole prompt's blocks: prefix-cache hits are not
modelled (above), so what it moved and what it hit both sit in the pool.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MAX_AGE = 1_000_000  # requests: ageing is O(N log N) in Python, a few seconds at this many
PROMPT_SHARE = 64  # a drawn prompt's median is 1/64 of the pool's tokens: dozens of requests share the pool
OUTPUT_MEDIAN = 256  # tokens generated per request (median of the lognormal)
SIGMA = 1.0  # spread of both lognormals
MAX_OUTPUT = 16_384  # tokens: the lognormal's tail, clipped
OCCUPANCY = 0.8  # mean share of the pool the drawn requests hold
TPOT_S = 0.02  # seconds per generated token: only the ratio of lifetimes to arrival gaps matters


class FreeQueue:
    """A FIFO of free block ids in a ring of ``capacity`` slots: ``take`` from the head, ``put`` at the tail."""

    def __init__(self, capacity: int, ids: np.ndarray):
        self.buf = np.empty(max(capacity, 1), dtype=np.int64)
        self.head, self.count = 0, 0
        self.put(ids)

    def take(self, n: int) -> np.ndarray:
        """The ``n`` ids at the head (ValueError if fewer are free)."""
        if n > self.count:
            raise ValueError(f"free queue holds {self.count} blocks, {n} asked")
        cap, h = len(self.buf), self.head
        ids = self.buf[h:h + n].copy() if h + n <= cap else np.concatenate((self.buf[h:], self.buf[:h + n - cap]))
        self.head, self.count = (h + n) % cap, self.count - n
        return ids

    def put(self, ids: np.ndarray) -> None:
        """Append ``ids`` at the tail, in the order given."""
        n, cap = len(ids), len(self.buf)
        if self.count + n > cap:
            raise ValueError(f"free queue of {cap} slots cannot take {n} more blocks beside {self.count}")
        t = (self.head + self.count) % cap
        k = min(n, cap - t)
        self.buf[t:t + k] = ids[:k]
        self.buf[:n - k] = ids[k:]
        self.count += n

    def order(self) -> np.ndarray:
        """The free ids, head first."""
        return np.roll(self.buf, -self.head)[: self.count].copy()


def footprint(input_len: np.ndarray, output_len: np.ndarray, block_size: int, nblocks: int) -> np.ndarray:
    """Blocks each request holds: its prompt and output tokens, at most the whole pool (int64)."""
    tok = np.asarray(input_len, dtype=np.int64) + np.asarray(output_len, dtype=np.int64)
    return np.clip(-(-tok // block_size), 1, nblocks)


def age(nblocks: int, block_size: int, arrival: np.ndarray, input_len: np.ndarray, output_len: np.ndarray,
        tpot_s: float = TPOT_S, log: list | None = None) -> np.ndarray:
    """The free queue (block ids, head first) after every request was admitted and has finished (module docstring).

    ``arrival``: seconds, non-decreasing; ``input_len``, ``output_len``: tokens (>= 0).  ``log``: when given,
    ``(request, ids, +1 taken / -1 given back)`` is appended for each event, in order (for tests).
    """
    arrival = np.asarray(arrival, dtype=np.float64)
    n = len(arrival)
    if not (len(input_len) == len(output_len) == n):
        raise ValueError("ageing needs as many input and output lengths as arrivals")
    if nblocks < 1 or block_size < 1:
        raise ValueError(f"ageing needs a pool of at least one block ({nblocks} blocks of {block_size} tokens)")
    if n and (np.any(np.diff(arrival) < 0) or not np.isfinite(arrival).all()):
        raise ValueError("ageing needs arrival times that never go backwards")
    if n and (np.min(input_len) < 0 or np.min(output_len) < 0):
        raise ValueError("ageing needs input and output lengths >= 0 tokens")
    need = footprint(input_len, output_len, block_size, nblocks).tolist()
    ends = (np.asarray(output_len, dtype=np.float64) * tpot_s).tolist()
    q = FreeQueue(nblocks, np.arange(nblocks, dtype=np.int64))
    live: list = []  # (finish time, request, its ids)
    now = float("-inf")

    def finish():
        t, j, ids = heapq.heappop(live)
        q.put(ids[::-1])  # vLLM frees a request's blocks tail first
        if log is not None:
            log.append((j, ids, -1))
        return t

    for i, a in enumerate(arrival.tolist()):
        now = max(now, a)  # first come, first served: never admitted before the one ahead of it
        while live and (live[0][0] <= now or q.count < need[i]):
            now = max(now, finish())
        ids = q.take(need[i])
        if log is not None:
            log.append((i, ids, 1))
        heapq.heappush(live, (now + ends[i], i, ids))
    while live:
        finish()
    return q.order()


def drawn_requests(n: int, nblocks: int, block_size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival s, input tokens, output tokens) of ``n`` seeded requests sized for a pool of ``nblocks`` blocks."""
    # lazily: layout imports this module, and gpucheck imports layout where pydantic is missing
    from kvbench.model import workload

    rng = np.random.default_rng([seed & 0xFFFFFFFF, 0xA6ED, n])
    pool_tokens = nblocks * block_size
    median = max(block_size, pool_tokens // PROMPT_SHARE)
    inp = workload.prompts(f"lognormal:{median}:{SIGMA}", n, rng, limit=pool_tokens)
    out = workload.prompts(f"lognormal:{OUTPUT_MEDIAN}:{SIGMA}", n, rng, limit=MAX_OUTPUT)
    held = footprint(inp, out, block_size, nblocks) * out * TPOT_S  # block-seconds per request
    rate = OCCUPANCY * nblocks / float(held.mean()) if n else 1.0
    return workload.arrivals("poisson", rate, n, rng), inp, out


@lru_cache(maxsize=16)
def aged_order(nblocks: int, block_size: int, n: int, seed: int) -> np.ndarray:
    """The free queue of a pool of ``nblocks`` after ``n`` drawn requests (read-only; cached per pool and seed)."""
    out = age(nblocks, block_size, *drawn_requests(n, nblocks, block_size, seed))
    out.flags.writeable = False
    return out


FRESH_LINE = "# aged:0: each decode rank's free list is a fresh queue (no requests aged it)"


def drawn_line(n: int) -> str:
    """The preamble's word on ``aged:<n>`` without a trace: which requests aged the pool."""
    if not n:
        return FRESH_LINE
    return (f"# aged:{n}: each decode rank's free list aged by {n:,} drawn requests (seeded per rank and case: "
            f"lognormal prompts of median 1/{PROMPT_SHARE} of the pool, outputs of median {OUTPUT_MEDIAN} tokens "
            f"as lifetimes of {TPOT_S * 1e3:g} ms per token, Poisson arrivals keeping it {OCCUPANCY:.0%} full; "
            "untimed, before the case)")


@dataclass(frozen=True)
class TraceRequests:
    """A trace's head, as it ages a pool (module docstring): hashable, so its aged order is cached per pool."""

    name: str
    arrival_s: tuple[float, ...]  # timestamp less the first's, seconds at speed 1
    input_len: tuple[int, ...]  # tokens, as the trace has them
    output_len: tuple[int, ...]
    speed: float  # the replay's: arrivals are divided by it
    context: int = 0  # the model's context: a longer prompt is cut to it (0: no cut)

    def requests(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival s, input tokens, output tokens) of the first ``n``, cycling (module docstring)."""
        m = len(self.arrival_s)
        if n and not m:
            raise ValueError(f"ageing by trace '{self.name}': no requests to age with")
        reps = -(-n // m) if m else 0
        a = np.asarray(self.arrival_s, dtype=np.float64)
        period = a[-1] + a[-1] / (m - 1) if m > 1 else 0.0  # the span plus a mean gap
        arrival = (np.concatenate([a + r * period for r in range(reps)]) if reps else a)[:n] / self.speed
        inp = np.tile(np.asarray(self.input_len, dtype=np.int64), reps)[:n]
        if self.context:
            inp = np.minimum(inp, self.context)
        return arrival, inp, np.tile(np.asarray(self.output_len, dtype=np.int64), reps)[:n]


@lru_cache(maxsize=16)
def trace_aged_order(nblocks: int, block_size: int, n: int, src: TraceRequests) -> np.ndarray:
    """The free queue of a pool of ``nblocks`` after ``src``'s first ``n`` requests (read-only; cached per pool
    and trace: every decode rank's and case's is the same)."""
    out = age(nblocks, block_size, *src.requests(n))
    out.flags.writeable = False
    return out
