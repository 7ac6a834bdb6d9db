"""The purchase verdict (pays / marginal / does not pay) and the numbers behind it: one function, ``verdicts``, that
`kvbench plan` prints and the page's summary shows, so the two never read different numbers.

The arithmetic is the plan's (kvbench/report/plan.py describes it); the page asks it the question
`make procurement` asks the plan (``PROCUREMENT``), of the paths its own result files measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.model import shapes as M
from kvbench.model import tpmap as T

# a PlanInput and Fabrics of plan.py (which imports this module) are read by attribute: no import back
PlanInput = Fabric = object

PAYS_MARGIN = 0.5  # pays: the exposed transfer costs at most half of what disaggregation saves
BUSY_LIMIT = 0.7  # a fabric busier than this at the request rate queues transfers (the tail grows)
WORDS = ("does not pay", "marginal", "pays")  # worst first
# in-process copies: the machine's memory-copy reference every path is read against, never a path to buy
IN_PROCESS = frozenset({"loopback"})
# the question `make procurement` asks `kvbench plan` (benchmarks/procurement.py, kvbench/cli/plan.py's defaults):
# a chat-like prompt mix, 400 TFLOP/s achieved prefill, a 200 ms TTFT budget, 1 req/s, half the prefill saved
PROCUREMENT = dict(prompts={"p50": 1024, "p95": 4096, "p99": 8192}, prompt_desc="percentiles p50 1024, p95 4096, "
                   "p99 8192", prefill_tflops=400.0, ttft_ms=200.0, rate=1.0, saving=0.5, block_size=16, tp=1, pp=1,
                   decode_tp=0, prefix_hit=0, overlap="streaming")


def break_even_s(p_s: float, layers: int, saving: float, overlap: str = "streaming") -> float:
    """The longest transfer T whose exposure (serial: T; streaming: max(0, T - P) + T/L) still fits in the
    saving s·P."""
    if overlap == "serial":
        return saving * p_s
    if saving * layers <= 1:  # even T <= P exposes T/L: the saving caps T at s·P·L
        return saving * p_s * layers
    return p_s * (1 + saving) / (1 + 1 / layers)


def prefill_s(name: str, tokens: int, inp: PlanInput) -> float:
    """P from the model's FLOPs at the achieved rate (TP and PP ranks share them)."""
    try:
        return M.prefill_ms(M.get_model(name), tokens, inp.prefill_tflops * inp.tp * inp.pp) / 1e3
    except ValueError:
        raise ValueError(f"plan: model '{name}' has no parameter count for its prefill time: use a preset, or a "
                         "model YAML file with params_b (and q_heads)") from None


def received(name: str, dtype: str, ntok: int, inp: PlanInput) -> tuple[M.ModelShape, int, int | None]:
    """What one decode rank receives of a request: its shard, its bytes and, at --tp P:D, its descriptors (the
    decode rank that receives the most, model/tpmap.py; None at one TP degree: one per block, the link model's)."""
    whole = M.get_model(name)
    if not inp.decode_tp:
        shape = M.shard(whole, inp.tp, inp.pp)
        return shape, M.request_bytes(shape, dtype, ntok), None
    layout = "mla" if whole.attention == "mla" else "layer-major"
    tmap = T.tp_map(M.shard(whole, 1, inp.pp), ntok, inp.block_size, dtype, layout, inp.head_layout,
                    T.TPPair(inp.tp, inp.decode_tp))
    most = max((tmap.of(d) for d in range(inp.decode_tp)), key=lambda ps: sum(q.nbytes for q in ps))
    return M.shard(whole, inp.decode_tp, inp.pp), sum(q.nbytes for q in most), sum(q.descriptors for q in most)


def rows(inp: PlanInput, fabrics: list[Fabric]) -> list[dict]:
    """One dict per (model, dtype, fabric, prompt percentile) with every number the table shows."""
    out = []
    for name in inp.models:
        for dtype in inp.dtypes:
            for fab in fabrics:
                for label, tokens in inp.prompts.items():
                    ntok = M.transferred_tokens(tokens, min(inp.prefix_hit, tokens - 1))
                    shape, nbytes, ndesc = received(name, dtype, ntok, inp)
                    t_s, how = fab.transfer_s(shape, ntok, dtype, inp.block_size, nbytes, ndesc)
                    p_s = prefill_s(name, tokens, inp)
                    stream = max(0.0, t_s - p_s) + t_s / shape.layers
                    be = break_even_s(p_s, shape.layers, inp.saving, inp.overlap)
                    exposed = stream if inp.overlap == "streaming" else t_s
                    out.append(dict(model=name, dtype=dtype, fabric=fab.name, source=fab.source, how=how,
                                    pct=label, tokens=tokens, bytes=nbytes, gbps=nbytes / t_s / 1e9,
                                    transfer_ms=t_s * 1e3, prefill_ms=p_s * 1e3, serial_ms=t_s * 1e3,
                                    stream_ms=stream * 1e3, ttft_serial=100 * (p_s + t_s) * 1e3 / inp.ttft_ms,
                                    ttft_stream=100 * (p_s + stream) * 1e3 / inp.ttft_ms,
                                    need_gbps=inp.rate * nbytes / 1e9, busy=inp.rate * t_s,
                                    exposed_ms=exposed * 1e3, ttft_pct=100 * (p_s + exposed) * 1e3 / inp.ttft_ms,
                                    saved_ms=inp.saving * p_s * 1e3, net_ms=(inp.saving * p_s - exposed) * 1e3,
                                    breakeven_gbps=nbytes / be / 1e9 if be > 0 else math.inf))
    return out


def load_of(inp: PlanInput, fab: Fabric, name: str, dtype: str) -> dict:
    """The fabric's load at ``inp.rate``: rate x the mean request's transfer time (p50 when no mean is known)."""
    tokens = inp.mean_tokens or inp.prompts.get("p50") or next(iter(inp.prompts.values()))
    ntok = max(1, round(tokens) - inp.prefix_hit)
    shape, nbytes, ndesc = received(name, dtype, ntok, inp)
    t_s, _ = fab.transfer_s(shape, ntok, dtype, inp.block_size, nbytes, ndesc)
    return dict(label="mean" if inp.mean_tokens else "p50", tokens=tokens, rate=inp.rate, busy=inp.rate * t_s,
                need_gbps=inp.rate * nbytes / 1e9, gbps=nbytes / t_s / 1e9)


def verdict(group: list[dict], overlap: str = "streaming", ttft_ms: float = math.inf,
            load: dict | None = None) -> tuple[str, str]:
    """pays / marginal / does not pay, with the deciding reason first, in numbers.

    does not pay: at some prompt percentile the exposed transfer costs more than disaggregation saves
    (net < 0), or the request rate needs more than the fabric moves.  marginal: net below half the saving,
    the fabric over 70% busy (its queue grows the tail), or the exposed transfer pushes a request past
    its TTFT budget.  pays: otherwise.
    """
    worst = min(group, key=lambda r: (r["net_ms"] - PAYS_MARGIN * r["saved_ms"]))
    pct = "" if worst["pct"] == "all" else f"{worst['pct']} ({worst['tokens']} tokens): "
    net = (f"{pct}{overlap} exposes {worst['exposed_ms']:.2f} ms (T = {worst['transfer_ms']:.2f} ms at "
           f"{worst['gbps']:.2f} GB/s) against {worst['saved_ms']:.2f} ms of prefill saved (net "
           f"{worst['net_ms']:+.2f} ms; break-even {worst['breakeven_gbps']:.3f} GB/s)")
    busy = 0.0 if load is None else load["busy"]
    rate = "" if not busy else (f"{load['rate']:g} req/s of {load['label']} prompts ({load['tokens']:.0f} tokens) "
                                f"need {load['need_gbps']:.3f} GB/s: the fabric {100 * busy:.0f}% busy")
    late = [r for r in group if r["ttft_pct"] > 100]
    pushed = [r for r in late if r["prefill_ms"] <= ttft_ms]  # prefill alone fits, prefill + exposed does not
    ttft = ""
    if late:
        r = max(pushed or late, key=lambda r: r["ttft_pct"])
        over = "the transfer pushes it past" if pushed else "prefill alone exceeds"
        ttft = f"TTFT {r['prefill_ms'] + r['exposed_ms']:.1f} ms at {r['pct']} ({over} the {ttft_ms:g} ms budget)"
    if busy >= 1:
        word, lead = "does not pay", rate
    elif worst["net_ms"] < 0:
        word, lead = "does not pay", net
    elif worst["net_ms"] < PAYS_MARGIN * worst["saved_ms"]:
        word, lead = "marginal", net
    elif busy > BUSY_LIMIT:
        word, lead = "marginal", rate
    elif pushed:
        word, lead = "marginal", ttft
    else:
        word, lead = "pays", net
    return word, "; ".join([lead] + [x for x in (net, rate, ttft) if x and x != lead])


@dataclass
class Verdict:
    """One fabric, model and dtype: the verdict, its reasons in numbers, and the prompt percentile that decided it."""

    fabric: Fabric
    model: str
    dtype: str
    word: str  # one of WORDS
    why: str  # the deciding reason first, then the others ('; '-separated), as the plan prints it
    worst: dict  # the rows() entry of the deciding percentile


def verdicts(inp: PlanInput, fabrics: list[Fabric]) -> list[Verdict]:
    """Per fabric, model and dtype (in that order): the verdict from the worst prompt percentile."""
    table = rows(inp, fabrics)
    out = []
    for fab in fabrics:
        for name in inp.models:
            for dtype in inp.dtypes:
                group = [r for r in table if (r["fabric"], r["model"], r["dtype"]) == (fab.name, name, dtype)]
                word, why = verdict(group, inp.overlap, inp.ttft_ms, load_of(inp, fab, name, dtype))
                worst = min(group, key=lambda r: (r["net_ms"] - PAYS_MARGIN * r["saved_ms"]))
                out.append(Verdict(fab, name, dtype, word, why, worst))
    return out
