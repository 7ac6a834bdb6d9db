"""A request trace as a workload (`kvbench run --trace`): which requests each prefill rank replays, when they
arrive, and how many tokens each moves after its decode-side prefix hit.

The replay takes the trace's first ``requests x S`` requests (S prefill ranks; with one, the first ``requests``)
and deals request j to prefill rank j mod S.  A request arrives at its timestamp less the first's, divided by the
speed.  Its hit is the decode prefix cache's (trace.replay over the replayed requests: one cache, as if every
request met the same decode instance), so a request moves ``input_length - hit_tokens`` tokens, after two clips
the run says aloud, never silently:

- a prompt longer than the model's context (ModelShape.context, when known) is cut to its first ``context``
  tokens, its hit to what lies within them;
- what moves is cut to the decode pool's capacity when ``decode_pool_tokens`` bounds it (a request never needs
  more than the whole pool).

A request whose whole prompt hits still moves one token (the harness moves no empty request); those are counted
and said as well.  Under a trace the decode pool, unless ``decode_pool_tokens`` sizes it, holds SLOTS times the
longest request: the pool a prefill rank already allocates (one size serves both roles), where the summed demand
of a trace's requests would be no machine's pool.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from kvbench.model import trace as T
from kvbench.model.ageing import FRESH_LINE, TPOT_S, TraceRequests


@dataclass(frozen=True)
class TracePlan:
    """The replayed requests of a trace, in trace order, and their prefix hits: what rank 0 reads and broadcasts."""

    name: str
    block: int  # tokens per hash id
    capacity: int | None  # the decode prefix cache in blocks (None: unbounded)
    total: int  # requests in the whole trace
    duration_s: float  # the whole trace's, first arrival to last
    arrival_s: list[float]  # per replayed request: timestamp less the first's, in seconds (speed 1)
    input: list[int]  # prompt tokens
    hit: list[int]  # hit tokens: min(hit blocks x block, input)
    hit_blocks: int  # summed over the replayed requests
    blocks: int  # hash ids of the replayed requests
    # aged:<N>: the trace's first min(N, total) requests, which age the decode pool (model/ageing.py)
    age_arrival_s: list[float] = field(default_factory=list)  # as arrival_s
    age_input: list[int] = field(default_factory=list)
    age_output: list[int] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.input)

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        tokens = sum(self.input)
        return sum(self.hit) / tokens if tokens else 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def facts(self) -> dict:
        """For the sidecar: the plan without its per-request lists (the rows hold those)."""
        return {k: v for k, v in self.as_dict().items() if not isinstance(v, list)} | {
            "replayed": self.requests, "block_hit_rate": round(self.block_hit_rate, 6),
            "token_hit_rate": round(self.token_hit_rate, 6)}


def plan(source: str, requests: int, capacity: int | None = None, block: int = T.BLOCK, age: int = 0) -> TracePlan:
    """The first ``requests`` requests of trace ``source`` with their hits; TraceError when it has fewer.
    ``age``: the largest aged:<N> of the run, whose first min(N, total) requests the plan carries as well."""
    T.check_capacity(capacity)
    tr = T.read(source, block)
    if requests > tr.requests:
        raise T.TraceError(f"trace '{source}' has {tr.requests:,} requests: it cannot replay {requests:,}")
    head = tr.head(requests)
    st = T.replay(head, capacity)
    arrival = (head.timestamp_ms - head.timestamp_ms[0]) / 1e3
    aged = tr.head(age)
    return TracePlan(source, block, capacity, tr.requests, tr.duration_s, arrival.tolist(), head.input_len.tolist(),
                     st.hit_tokens_each(head.input_len).tolist(), int(st.hit_blocks.sum()), int(len(head.ids)),
                     ((aged.timestamp_ms - tr.timestamp_ms[0]) / 1e3).tolist(), aged.input_len.tolist(),
                     aged.output_len.tolist())


def ageing(p: TracePlan, speed: float, context: int = 0) -> TraceRequests | None:
    """The requests that age a decode pool under aged:<N> at ``speed``, prompts cut to ``context`` (0: no cut);
    None when the plan carries none (no aged:<N> in the run)."""
    if not p.age_input:
        return None
    return TraceRequests(p.name, tuple(p.age_arrival_s), tuple(p.age_input), tuple(p.age_output), speed, context)


def aged_line(p: TracePlan, n: int) -> str:
    """The preamble's word on ``aged:<n>`` under a replay: which of the trace's requests aged the pool."""
    held = len(p.age_input)
    if not n:
        return FRESH_LINE
    which = (f"the trace's first {n:,} requests" if n <= held else
             f"the trace's {held:,} requests cycled to {n:,} ({-(-n // held)} passes, each starting the trace's "
             "span plus a mean gap after the one before)")
    return (f"# aged:{n}: each decode rank's free list aged by {which}: their arrivals at the replay's speed, "
            f"prompts cut to the model's context, outputs as lifetimes of {TPOT_S * 1e3:g} ms per token "
            "(untimed, before the case)")


@dataclass(frozen=True)
class Moved:
    """What each request of a prefill rank moves, and what the clips did to them."""

    arrival_s: np.ndarray  # float64, at speed 1
    ntok: np.ndarray  # int64 tokens that move, >= 1
    cut_context: int  # prompts cut to the model's context
    cut_pool: int  # requests whose tokens were cut to the decode pool
    full_hits: int  # requests whose whole (cut) prompt hit: each moves one token


def moved(input_len, hit, context: int = 0, pool: int = 0) -> tuple[np.ndarray, int, int, int]:
    """(tokens moved per request, prompts cut to ``context``, requests cut to ``pool``, full hits); 0: no bound."""
    inp, hit = np.asarray(input_len, dtype=np.int64), np.asarray(hit, dtype=np.int64)
    prompt = np.minimum(inp, context) if context else inp
    ntok = prompt - np.minimum(hit, prompt)
    over = ntok > pool if pool else np.zeros(len(ntok), dtype=bool)
    if pool:
        ntok = np.minimum(ntok, pool)
    full = ntok < 1
    return np.maximum(ntok, 1), int((prompt < inp).sum()), int(over.sum()), int(full.sum())


def deal(p: TracePlan, index: int, ranks: int, n: int, context: int = 0, pool: int = 0) -> Moved:
    """Prefill rank ``index`` of ``ranks``: its ``n`` requests (trace requests index, index + ranks, ...)."""
    sl = slice(index, index + ranks * n, ranks)
    ntok, cut_c, cut_p, full = moved(p.input[sl], p.hit[sl], context, pool)
    return Moved(np.asarray(p.arrival_s[sl], dtype=np.float64), ntok, cut_c, cut_p, full)


def preamble(p: TracePlan, ranks: int, speeds: list[float], models: dict[str, int], pool: int) -> list[str]:
    """Rank 0's lines before the table: what is replayed, the hit rates, and every clip the run makes.

    ``models``: name -> context (0: not known); ``pool``: decode_pool_tokens (0: the trace's default)."""
    span = p.arrival_s[-1] if p.arrival_s else 0.0
    at = ", ".join(f"{span / s:.3f} s at {s:g}x" for s in speeds)
    cap = "unbounded" if p.capacity is None else f"an LRU of {p.capacity:,} blocks"
    tokens = sum(p.input)
    out = [f"# trace {p.name}: the first {p.requests:,} of {p.total:,} requests (the trace spans {p.duration_s:,.3f} s), dealt "
           f"round-robin to {ranks} prefill rank{'s' * (ranks != 1)}; {span:,.3f} s of arrivals, replayed in {at}",
           f"# trace: decode prefix cache {cap} ({p.block}-token blocks): block hit {100 * p.block_hit_rate:.2f}% "
           f"({p.hit_blocks:,} of {p.blocks:,} blocks), token hit {100 * p.token_hit_rate:.2f}% "
           f"({sum(p.hit):,} of {tokens:,} prompt tokens); a request moves only its prompt's uncached tokens"]
    for name, context in models.items():
        _, cut_c, _, full = moved(p.input, p.hit, context)
        if context:
            out.append(f"# trace: {name} takes {context:,}-token prompts (its context): {cut_c} of {p.requests:,} "
                       f"prompts are cut to their first {context:,} tokens")
        else:
            out.append(f"# trace: {name} has no known context: prompts run to the trace's {max(p.input):,} tokens")
        if full:
            out.append(f"# trace: {full} request{'s' * (full != 1)} hit in full with {name}: each moves 1 token "
                       "(the harness moves no empty request)")
    out.append(f"# trace: decode pool {pool:,} tokens (--decode-pool-tokens): a request moves at most that"
               if pool else "# trace: decode pool 4 x the longest request, the prefill side's pool (--decode-pool-"
               "tokens sets it)")
    return out


def summary_line(case_no: int, p: TracePlan, speed: float, parts: list[Moved]) -> tuple[str, dict]:
    """Rank 0, after a case: its '# trace:' line and its facts for the sidecar."""
    ntok = int(sum(int(m.ntok.sum()) for m in parts))
    cut_c, cut_p, full = (sum(getattr(m, k) for m in parts) for k in ("cut_context", "cut_pool", "full_hits"))
    facts = {"trace": p.name, "speed": speed, "requests": sum(len(m.ntok) for m in parts),
             "block_hit_rate": round(p.block_hit_rate, 6), "token_hit_rate": round(p.token_hit_rate, 6),
             "hit_blocks": p.hit_blocks, "blocks": p.blocks, "hit_tokens": sum(p.hit), "tokens": sum(p.input),
             "moved_tokens": ntok, "cut_context": cut_c, "cut_pool": cut_p, "full_hits": full}
    q = [int(x) for x in np.percentile(p.input, [50, 95, 100], method="inverted_cdf")] if len(p.input) else [0] * 3
    facts["prompt_p50_p95_max"] = q
    line = (f"# trace: case {case_no} {p.name} at {speed:g}x: {facts['requests']} requests, prompts p50/p95/max "
            f"{q[0]:,}/{q[1]:,}/{q[2]:,} tokens (the row's tokens column is the suite's, not theirs), block hit "
            f"{100 * p.block_hit_rate:.2f}%, token hit {100 * p.token_hit_rate:.2f}%; {ntok:,} tokens to move "
            f"({cut_c} prompts cut to the context, {cut_p} to the pool, {full} full hits moving 1 token)")
    return line, facts
