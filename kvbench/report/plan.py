"""`kvbench plan`: does disaggregated prefill pay on a fabric, for these models and prompt lengths?

Per model, dtype, fabric and prompt percentile (p50/p95/p99): bytes per request, transfer time,
exposed time (serial: T; streaming: max(0, T - P) + T/L, the seeds' model), share of the TTFT
budget, the bandwidth a request rate needs, and the seeds' net gain = the prefill time that
disaggregation saves (interference with decode removed) - the exposed transfer.  A fabric is a
named line rate (nominal) or a result file (measured).  Reads result files only: nothing here
imports the harness or a transport.
"""
from __future__ import annotations

import math
import os
import re
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from kvbench.model import shapes as M
from kvbench.model.inputs import BlockSize, KVDType, ModelName, Positive, PrefixHit, Tokens, check_tokens, unique

RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GB/s|Gb/s|Gbps|Gbit)\s*$")
PAYS_MARGIN = 0.5  # pays: the exposed transfer costs at most half of what disaggregation saves
MIN_R2 = 0.8  # a link model that explains less of its own sweep than this is not trusted to extrapolate
BUSY_LIMIT = 0.7  # a fabric busier than this at the request rate queues transfers (the tail grows)


class PlanInput(BaseModel):
    """Everything `kvbench plan` takes, validated; errors name the flag."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    models: Annotated[list[ModelName], AfterValidator(unique)] = Field(min_length=1)
    dtypes: Annotated[list[KVDType], AfterValidator(unique)] = Field(min_length=1)
    prompts: dict[str, Tokens] = Field(min_length=1)  # percentile label -> prompt tokens
    prompt_desc: str
    mean_tokens: float | None = Field(None, gt=0)  # the mean prompt when the distribution gives one (load)
    prefill_tflops: float = Field(gt=0)
    ttft_ms: float = Field(gt=0)
    rate: float = Field(ge=0)  # requests per second per prefill instance (each of its ranks moves its shard)
    saving: float = Field(ge=0, le=10)  # share of the prefill time disaggregation saves
    block_size: BlockSize
    tp: Positive
    pp: Positive
    prefix_hit: PrefixHit
    fabrics: list[str] = Field(min_length=1)
    overlap: Literal["serial", "streaming"] = "streaming"  # which exposure the net gain and the verdict use


def one_line(exc: ValidationError) -> str:
    """A pydantic error as the one line the user sees, naming the flag."""
    err = exc.errors()[0]
    flag = {"models": "-m", "dtypes": "--dtype", "prompts": "prompt lengths", "prefill_tflops": "--prefill-tflops",
            "ttft_ms": "--ttft-ms", "rate": "--rate", "saving": "--saving", "block_size": "--block-size",
            "tp": "--tp", "pp": "--pp", "prefix_hit": "--prefix-hit", "fabrics": "--fabric", "overlap": "--overlap"}
    loc = str(err["loc"][0]) if err["loc"] else ""
    # a prompt length is named by its percentile label (p95), a list item by its value in the message
    key = "".join(f" {p}" for p in err["loc"][1:2] if isinstance(p, str))
    return f"plan: {flag.get(loc, loc)}{key}: {err['msg'].removeprefix('Value error, ')}"


# ---- prompt-length distributions -------------------------------------------------------------------------

QUANTILES = {"p50": 50, "p95": 95, "p99": 99}


def _weighted_percentiles(lengths, weights) -> dict[str, int]:
    """p50/p95/p99 of a weighted sample, each an actual prompt length of it (inverted CDF)."""
    order = np.argsort(lengths)
    x, w = np.asarray(lengths)[order], np.asarray(weights, float)[order]
    if w.sum() <= 0:
        raise ValueError("the prompt histogram has no requests (all counts 0)")
    cdf = np.cumsum(w) / w.sum()
    return {k: int(x[min(np.searchsorted(cdf, q / 100 - 1e-12), len(x) - 1)]) for k, q in QUANTILES.items()}


def prompts_from(tokens: list[int] | None, percentiles: str | None,
                 histogram: str | None) -> tuple[dict, str, float | None]:
    """The p50/p95/p99 prompt lengths from exactly one of: --tokens (one = fixed, several = a sample),
    --percentiles 50:N,95:N,99:N, --histogram FILE (lines 'tokens count', comma or space separated); with a
    description and the mean prompt (None for percentiles: they do not give one)."""
    given = [x for x in (tokens, percentiles, histogram) if x]
    if len(given) > 1:
        raise ValueError("plan: give the prompt lengths one way: --tokens, --percentiles or --histogram")
    if histogram:
        return _histogram(histogram)
    if percentiles:
        out = {}
        for part in percentiles.split(","):
            q, _, n = part.partition(":")
            label = f"p{q.strip().removeprefix('p')}"
            try:
                out[label] = int(n)
            except ValueError:
                raise ValueError(f"plan: --percentiles: '{part}' is not PERCENTILE:TOKENS (e.g. 50:1024)") from None
        return out, "percentiles " + ", ".join(f"{k} {v}" for k, v in out.items()), None
    tokens = tokens or [4096]
    try:  # each length of a sample: a bad one could hide behind the percentiles PlanInput checks
        for t in tokens:
            check_tokens(t)
    except ValueError as exc:
        raise ValueError(f"plan: --tokens: {exc}") from None
    if len(set(tokens)) == 1:
        return {"all": tokens[0]}, f"fixed {tokens[0]} tokens", float(tokens[0])
    return (_weighted_percentiles(tokens, [1] * len(tokens)), f"a sample of {len(tokens)} prompt lengths",
            float(np.mean(tokens)))


def _histogram(path: str) -> tuple[dict, str, float]:
    if not os.path.exists(path):
        raise ValueError(f"plan: --histogram: {path} does not exist")
    lengths, counts = [], []
    with open(path) as fh:
        for no, line in enumerate(fh, 1):
            parts = [p for p in re.split(r"[,\s]+", line.strip()) if p]
            if not parts or parts[0].startswith("#"):
                continue
            try:
                t, c = int(parts[0]), float(parts[1]) if len(parts) > 1 else 1.0
            except ValueError:
                if no == 1:
                    continue  # a header line
                raise ValueError(f"plan: --histogram {path}, line {no}: expected 'tokens count'") from None
            if t <= 0 or c < 0 or not math.isfinite(c):
                raise ValueError(f"plan: --histogram {path}, line {no}: tokens must be > 0 and count >= 0")
            lengths.append(t)
            counts.append(c)
    if not lengths:
        raise ValueError(f"plan: --histogram {path}: no 'tokens count' lines")
    return (_weighted_percentiles(lengths, counts), f"histogram {os.path.basename(path)} ({sum(counts):g} requests)",
            float(np.average(lengths, weights=counts)))


# ---- fabrics ---------------------------------------------------------------------------------------------

class Fabric:
    """A link: a nominal rate, or measured rows of one path with their link model."""

    def __init__(self, name: str, gbps: float, source: str, fit=None, paged=None, not_ok: str = ""):
        self.name, self.gbps, self.source, self.fit, self.paged = name, gbps, source, fit, paged
        self.not_ok = not_ok  # why its run's rows are not all to be trusted (said at the plan's top)

    @property
    def measured(self) -> bool:
        return self.source != "nominal"

    def transfer_s(self, shape: M.ModelShape, tokens: int, dtype: str, block_size: int) -> tuple[float, str]:
        """Seconds to move one request, and how they were obtained."""
        nbytes = M.request_bytes(shape, dtype, tokens)
        if self.fit is not None:
            from .linkmodel import predict_request

            return predict_request(self.fit, shape, tokens, block_size, dtype)["seconds"], "link model"
        return nbytes / (self.gbps * 1e9), "rate"


def fabrics_from(specs: list[str], block_size: int) -> list[Fabric]:
    """Named link rates (nominal), '<x> GB/s' or '<x> Gb/s' (nominal), or result files (measured, per path)."""
    out = []
    for spec in specs:
        if spec in M.LINKS:
            out.append(Fabric(spec, M.LINKS[spec], "nominal"))
        elif m := RATE_RE.match(spec):
            gbps = float(m.group(1)) / (1 if m.group(2) == "GB/s" else 8)
            out.append(Fabric(spec.strip(), gbps, "nominal"))
        elif spec.endswith(".parquet") or os.path.exists(spec):
            out += measured_fabrics(spec, block_size)
        else:
            raise ValueError(f"plan: --fabric: '{spec}' is not a result file or one of: {', '.join(M.LINKS)} "
                             "(or a rate such as '40 GB/s', '200 Gb/s')")
    return out


def measured_fabrics(path: str, block_size: int) -> list[Fabric]:
    """One fabric per measured path of a result file: its link model when the sweep separates all three terms
    and the fit explains it (R² >= 0.8), else the median GB/s of its paged rows at the block size nearest ``block_size``."""
    from .linkmodel import PATH_KEYS, fit_cases, usable
    from .summary import trusted
    from .tables import read, summarize

    if not os.path.exists(path):
        raise ValueError(f"plan: --fabric: {path} does not exist")
    df, meta = read(path)
    st, left_out = trusted(usable(summarize(df)), meta)
    if st.empty and left_out:
        raise ValueError(f"plan: --fabric {path}: NOT OK: its run ended {meta.get('status')} and each of its {left_out} "
                         "measured case(s) found wrong bytes or is SUSPECT: no rate to plan with")
    if st.empty:
        raise ValueError(f"plan: --fabric {path}: no measured single-request rows to take a bandwidth from")
    host = meta.get("system", {}).get("hostname", "?")
    if (st["kind"] == "paged").any():  # a request moves as paged blocks: the references only stand in without them
        st = st[st["kind"] == "paged"]
    out = []
    for _, rows in st.groupby([k for k in PATH_KEYS if k in st], dropna=False, sort=False):
        fit = fit_cases(rows)[0][0]
        paged = rows[rows["variant"] == "paged"]
        plain = paged[(paged["allocation"] == "random") & (paged["coalesce"] == "off")]
        paged = plain if len(plain) else paged  # scattered, uncoalesced blocks: what a busy pool gives
        name = f"{fit.path['transport']} {fit.path['op']} ({host})"
        if not paged.empty:
            near = paged.iloc[(np.log2(paged["block_size"].astype(float)) - math.log2(block_size)).abs().argsort()]
            blk = int(near["block_size"].iloc[0])
            gbps = float(near[near["block_size"] == blk]["gbps"].median())
            desc = f"{blk}-token paged rows"
        else:
            gbps, desc = float(rows["gbps"].median()), "bulk rows"
        good = fit.separable and fit.points >= 4 and fit.r2 >= MIN_R2
        src = (f"measured: link model of {os.path.basename(path)} (R² {fit.r2:.3f}, {fit.points} cases)" if good
               else f"measured: median GB/s of {desc} in {os.path.basename(path)}")
        not_ok = (f"its run ended {meta.get('status')}, {left_out} case(s) left out (wrong bytes or SUSPECT)"
                  if left_out or meta.get("status") not in (None, "OK", "UNCHECKED") else "")
        out.append(Fabric(name, gbps, src + (f"; NOT OK: {not_ok}" if not_ok else ""), fit if good else None,
                          not_ok=not_ok))
    return out


# ---- the arithmetic --------------------------------------------------------------------------------------

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


def rows(inp: PlanInput, fabrics: list[Fabric]) -> list[dict]:
    """One dict per (model, dtype, fabric, prompt percentile) with every number the table shows."""
    out = []
    for name in inp.models:
        shape = M.shard(M.get_model(name), inp.tp, inp.pp)
        for dtype in inp.dtypes:
            for fab in fabrics:
                for label, tokens in inp.prompts.items():
                    ntok = M.transferred_tokens(tokens, min(inp.prefix_hit, tokens - 1))
                    nbytes = M.request_bytes(shape, dtype, ntok)
                    t_s, how = fab.transfer_s(shape, ntok, dtype, inp.block_size)
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
    shape = M.shard(M.get_model(name), inp.tp, inp.pp)
    ntok = max(1, round(tokens) - inp.prefix_hit)
    t_s, _ = fab.transfer_s(shape, ntok, dtype, inp.block_size)
    nbytes = M.request_bytes(shape, dtype, ntok)
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


def lines(inp: PlanInput, fabrics: list[Fabric]) -> list[str]:
    """The plan as text: a header of assumptions, per fabric its source and rows, then the verdicts."""
    shard = f", tp={inp.tp} pp={inp.pp} (per rank)" if inp.tp > 1 or inp.pp > 1 else ""
    out = [f"# kvbench plan: prompts {inp.prompt_desc}; prefill at {inp.prefill_tflops:g} TFLOP/s achieved{shard}; "
           f"TTFT budget {inp.ttft_ms:g} ms; {inp.rate:g} req/s; disaggregation saves {100 * inp.saving:g}% of the "
           "prefill time (--saving)",
           "# GB = 10^9 B. P = prefill ms (FLOPs / rate); T = transfer ms; serial exposes T, streaming "
           "max(0, T - P) + T/L;",
           f"# %TTFT = (P + exposed) / budget; need = rate x bytes; net = saved - {inp.overlap} exposed (the seeds' "
           "net gain); b-even = the GB/s at which net = 0 (--overlap picks serial or streaming)"]
    table = rows(inp, fabrics)
    out[:0] = [f"# NOT OK: fabric {f.name}: {f.not_ok}" for f in fabrics
               if f.not_ok]  # said first: a verdict below rests on a run that did not end OK
    for fab in fabrics:
        if not fab.measured:
            head = f"{fab.gbps:.2f} GB/s, nominal: line rate, achieved is lower (measure it with kvbench run)"
        elif fab.fit is not None:
            head = (f"β = {fab.fit.beta_bps / 1e9:.3f} GB/s, γ = {fab.fit.gamma_s * 1e6:.2f} us/layer, "
                    f"α = {fab.fit.alpha_s * 1e6:.3f} us/descriptor at {inp.block_size}-token blocks; {fab.source}")
        else:
            head = f"{fab.gbps:.2f} GB/s, {fab.source}"
        out += ["#", f"# fabric {fab.name}: {head}",
                f"#{'model':>13} {'dtype':>8} {'prompt':>5} {'tokens':>6} {'bytes(B)':>14} {'GB':>7} {'GB/s':>7} "
                f"{'P(ms)':>9} {'T(ms)':>9} {'serial':>9} {'stream':>8} {'%TTFT ser':>9} {'%TTFT str':>9} "
                f"{'need GB/s':>9} {'b-even GB/s':>11} {'net(ms)':>9}"]
        for r in (r for r in table if r["fabric"] == fab.name):
            out.append(f"{r['model']:>14} {r['dtype']:>8} {r['pct']:>5} {r['tokens']:>6} {r['bytes']:>14,} "
                       f"{r['bytes'] / 1e9:>7.3f} {r['gbps']:>7.2f} {r['prefill_ms']:>9.2f} {r['transfer_ms']:>9.2f} "
                       f"{r['serial_ms']:>9.2f} {r['stream_ms']:>8.2f} {r['ttft_serial']:>8.1f}% "
                       f"{r['ttft_stream']:>8.1f}% {r['need_gbps']:>9.3f} {r['breakeven_gbps']:>11.3f} "
                       f"{r['net_ms']:>+9.2f}")
    out += group_lines(inp)
    out += ["#", "# verdict per fabric, model and dtype, from the worst percentile (pays: net >= half the saving, "
            f"fabric under {100 * BUSY_LIMIT:.0f}% busy, TTFT kept; does not: net < 0 or the fabric saturated)"]
    for fab in fabrics:
        for name in inp.models:
            for dtype in inp.dtypes:
                group = [r for r in table if (r["fabric"], r["model"], r["dtype"]) == (fab.name, name, dtype)]
                word, why = verdict(group, inp.overlap, inp.ttft_ms, load_of(inp, fab, name, dtype))
                tag = "nominal" if not fab.measured else "measured"
                out.append(f"{fab.name} [{tag}] {name} {dtype}: {word.upper()}: {why}")
    return out


def group_lines(inp: PlanInput) -> list[str]:
    """One prefill instance (its tp x pp ranks) per request: one rank's bytes, the whole group's (replicated KV
    heads counted on every rank that holds them), and the egress the instance needs at ``inp.rate``."""
    out = ["#", f"# one prefill instance = tp={inp.tp} x pp={inp.pp} ranks; egress = rate x the group's bytes at "
           f"{inp.rate:g} req/s (Gbit/s = 10^9 bit/s); repl = copies of each KV head in the group",
           f"#{'model':>17} {'dtype':>8} {'prompt':>6} {'tokens':>7} {'rank bytes(B)':>16} {'group bytes(B)':>17} "
           f"{'repl':>5} {'egress Gbit/s':>13}"]
    for name in inp.models:
        shape0 = M.get_model(name)
        shape = M.shard(shape0, inp.tp, inp.pp)
        for dtype in inp.dtypes:
            for label, tokens in inp.prompts.items():
                ntok = M.transferred_tokens(tokens, min(inp.prefix_hit, tokens - 1))
                rank = M.request_bytes(shape, dtype, ntok)
                group = sum(M.group_parts(shape0, dtype, ntok, inp.tp).values())
                out.append(f"{name:>18} {dtype:>8} {label:>6} {tokens:>7} {rank:>16,} {group:>17,} "
                           f"{M.replication(shape0, inp.tp):>5g} {inp.rate * group * 8 / 1e9:>13.3f}")
    return out


def build(a) -> PlanInput:
    """PlanInput from the parsed `kvbench plan` flags (one-line ValueError on bad input)."""
    for flag, v in (("--tp", a.tp), ("--pp", a.pp), ("--prefix-hit", a.prefix_hit)):
        if v and len(v) > 1:
            raise ValueError(f"plan: {flag} takes one value, not {','.join(map(str, v))}")
    prompts, desc, mean = prompts_from(a.tokens, a.percentiles, a.histogram)
    try:
        return PlanInput(models=a.model or ["llama-3-70b"], dtypes=a.dtype or ["fp16"], prompts=prompts,
                         prompt_desc=desc, mean_tokens=mean, prefill_tflops=a.prefill_tflops, ttft_ms=a.ttft_ms, rate=a.rate,
                         saving=a.saving, block_size=a.block_size, tp=(a.tp or [1])[0], pp=(a.pp or [1])[0],
                         prefix_hit=(a.prefix_hit or [0])[0], fabrics=a.fabric or list(M.LINKS),
                         overlap=a.overlap)
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None


def main(a) -> int:
    """`kvbench plan`: print the plan."""
    inp = build(a)
    for line in lines(inp, fabrics_from(inp.fabrics, inp.block_size)):
        print(line)
    return 0
