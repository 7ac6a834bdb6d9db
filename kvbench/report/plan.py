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
from kvbench.model import tpmap as T
from kvbench.model.inputs import BlockSize, KVDType, ModelName, Positive, PrefixHit, Tokens, check_tokens, unique

# the arithmetic and the verdict live in verdicts.py, shared with the page's summary; named here as before
from .verdicts import BUSY_LIMIT, PAYS_MARGIN, break_even_s, load_of, prefill_s, rows, verdict, verdicts  # noqa: F401

RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GB/s|Gb/s|Gbps|Gbit)\s*$")
MIN_R2 = 0.8  # a link model that explains less of its own sweep than this is not trusted to extrapolate


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
    tp: Positive  # the prefill side's TP (the one TP degree unless decode_tp is given)
    decode_tp: int = Field(0, ge=0)  # --tp P:D: the decode side's (0: the same as tp, one TP degree)
    head_layout: Literal["NHD", "HND"] = "NHD"  # a block's head order at P:D (model/tpmap.py)
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

    def transfer_s(self, shape: M.ModelShape, tokens: int, dtype: str, block_size: int, nbytes: int | None = None,
                   descriptors: int | None = None) -> tuple[float, str]:
        """Seconds to move one request (``nbytes`` in ``descriptors``, where a TP map gives them), and how they
        were obtained."""
        nbytes = M.request_bytes(shape, dtype, tokens) if nbytes is None else nbytes
        if self.fit is not None and descriptors is not None:
            return float(self.fit.predict(shape.layers, descriptors, nbytes)), "link model"
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
    from .rowstatus import trusted
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
    for _, path_rows in st.groupby([k for k in PATH_KEYS if k in st], dropna=False, sort=False):
        fit = fit_cases(path_rows)[0][0]
        paged = path_rows[path_rows["variant"] == "paged"]
        plain = paged[(paged["allocation"] == "random") & (paged["coalesce"] == "off")]
        paged = plain if len(plain) else paged  # scattered, uncoalesced blocks: what a busy pool gives
        name = f"{fit.path['transport']} {fit.path['op']} ({host})"
        if not paged.empty:
            near = paged.iloc[(np.log2(paged["block_size"].astype(float)) - math.log2(block_size)).abs().argsort()]
            blk = int(near["block_size"].iloc[0])
            gbps = float(near[near["block_size"] == blk]["gbps"].median())
            desc = f"{blk}-token paged rows"
        else:
            gbps, desc = float(path_rows["gbps"].median()), "bulk rows"
        good = fit.separable and fit.points >= 4 and fit.r2 >= MIN_R2
        src = (f"measured: link model of {os.path.basename(path)} (R² {fit.r2:.3f}, {fit.points} cases)" if good
               else f"measured: median GB/s of {desc} in {os.path.basename(path)}")
        not_ok = (f"its run ended {meta.get('status')}, {left_out} case(s) left out (wrong bytes or SUSPECT)"
                  if left_out or meta.get("status") not in (None, "OK", "UNCHECKED") else "")
        out.append(Fabric(name, gbps, src + (f"; NOT OK: {not_ok}" if not_ok else ""), fit if good else None,
                          not_ok=not_ok))
    return out


# ---- the arithmetic --------------------------------------------------------------------------------------

def lines(inp: PlanInput, fabrics: list[Fabric]) -> list[str]:
    """The plan as text: a header of assumptions, per fabric its source and rows, then the verdicts."""
    shard = f", tp={inp.tp} pp={inp.pp} (per rank)" if inp.tp > 1 or inp.pp > 1 else ""
    if inp.decode_tp:
        shard = (f", tp {inp.tp}:{inp.decode_tp} (prefill : decode, {inp.head_layout} heads) pp={inp.pp}: bytes and "
                 "descriptors per decode rank (the one that receives the most)")
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
    for v in verdicts(inp, fabrics):
        out.append(f"{v.fabric.name} [{'measured' if v.fabric.measured else 'nominal'}] {v.model} {v.dtype}: "
                   f"{v.word.upper()}: {v.why}")
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
    tp, heads = (a.tp or [1])[0], getattr(a, "head_layout", None) or []
    pair = T.parse_tp(tp) if isinstance(tp, str) else None
    if len(heads) > 1 or (heads and pair is None):
        raise ValueError("plan: --head-layout takes one value, with --tp P:D (prefill TP : decode TP)")
    try:
        inp = PlanInput(models=a.model or ["llama-3-70b"], dtypes=a.dtype or ["fp16"], prompts=prompts,
                        prompt_desc=desc, mean_tokens=mean, prefill_tflops=a.prefill_tflops, ttft_ms=a.ttft_ms,
                        rate=a.rate, saving=a.saving, block_size=a.block_size, tp=pair.prefill if pair else tp,
                        decode_tp=pair.decode if pair else 0, head_layout=(heads or ["NHD"])[0],
                        pp=(a.pp or [1])[0], prefix_hit=(a.prefix_hit or [0])[0], fabrics=a.fabric or list(M.LINKS),
                        overlap=a.overlap)
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None
    for name in inp.models if pair else ():  # both sides split the model's heads (one line when they do not)
        whole = M.get_model(name)
        try:
            T.check(whole, pair, inp.head_layout, "mla" if whole.attention == "mla" else "layer-major")
        except ValueError as exc:
            raise ValueError(f"plan: {exc}") from None
    return inp


def main(a) -> int:
    """`kvbench plan`: print the plan."""
    inp = build(a)
    for line in lines(inp, fabrics_from(inp.fabrics, inp.block_size)):
        print(line)
    return 0
