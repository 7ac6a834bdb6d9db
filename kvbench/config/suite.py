"""Suites: YAML sweep definitions, validated, expanded into cases.

Axes are data: every list under ``axes`` is swept, and the cases are their
cartesian product (transport outermost).  Validation errors name the field
and the allowed values in one line.
"""
from __future__ import annotations

import os
import platform
import warnings
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbench import transports
from kvbench.codecs import NAMES
from kvbench.codecs import check as codec_check
from kvbench.config import tpcheck
from kvbench.config.memauto import auto_memory
from kvbench.memory.copy import default as copy_default
from kvbench.memory.values import check_fill
from kvbench.model import matrix as X
from kvbench.model import shapes as M
from kvbench.model.inputs import (
    MAX_MS,
    MAX_SECONDS,
    MAX_SEED,
    BlockSize,
    DType,
    ModelName,
    Positive,
    PrefixHit,
    Tokens,
    check_level,
    sizes,
    unique,
)
from kvbench.model.layout import misfit, parse_alloc
from kvbench.model.trace import BLOCK as TRACE_BLOCK
from kvbench.model.workload import ARRIVAL_HELP, parse_arrival, parse_prompt
from kvbench.model.yamlfile import read
from kvbench.results import samples

SUITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "suites")


class SuiteError(ValueError):
    """A bad suite or flag; the message is the one line the user sees."""


# YAML types are taken as written: "20" is not an integer, 32.5 is not a block size, inf is not a timeout
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


warnings.filterwarnings("ignore", message='Field name "copy"', category=UserWarning)  # the axis is named copy
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)  # ... and register


def _checked(check):
    """An axis value's type: ``check`` refuses a bad value with the line the user sees (its list position named)."""
    return AfterValidator(lambda v: (check(v), v)[1])


def _transport(t: str) -> None:
    if t not in transports.REGISTRY:
        raise ValueError(f"'{t}' is not one of: {', '.join(transports.names())}")


def _prefill_ms(p) -> None:
    if p != "auto" and p < 0:
        raise ValueError(f"{p} is negative (give ms >= 0, or 'auto' to derive it from the model)")
    if p != "auto" and p > MAX_MS:
        raise ValueError(f"{p} ms is longer than the longest wait a run takes ({MAX_MS:.0f} ms)")


def _scales(x: str) -> None:
    from kvbench.model.formats import parse_scales

    parse_scales(x)


def _codec(c: str) -> None:
    if c not in NAMES:
        raise ValueError(f"'{c}' is not one of: {', '.join(NAMES)}")


TransportName = Annotated[str, _checked(_transport)]
Alloc = Annotated[str, _checked(parse_alloc)]
Arrival = Annotated[str, _checked(parse_arrival)]
PrefillMs = Annotated[float | Literal["auto"], _checked(_prefill_ms)]
Scales = Annotated[str, _checked(_scales)]
Codec = Annotated[str, _checked(_codec)]


class Axes(BaseModel):
    """Sweep axes; each is a list of values, none twice."""

    model_config = STRICT
    transport: list[TransportName] = Field(default=["loopback", "shm"], min_length=1)
    op: list[Literal["push", "pull"]] = Field(default=["push"], min_length=1)
    model: list[ModelName] = Field(default=["llama-3-8b"], min_length=1)
    tokens: list[Tokens] = Field(default=[1024], min_length=1)
    prefix_hit: list[PrefixHit] = Field(default=[0], min_length=1)
    block_size: list[BlockSize] = Field(default=[16], min_length=1)
    layout: list[Literal["auto", "layer-major", "block-major", "mla", "cross-layer"]] = Field(default=["auto"],
                                                                                             min_length=1)
    alloc: list[Alloc] = Field(default=["random"], min_length=1)
    coalesce: list[Literal["off", "on"]] = Field(default=["off"], min_length=1)
    dtype: list[DType] = Field(default=["fp16"], min_length=1)
    # fp8 scale planes (formats.py): none, tensor, block:<n>; nvfp4 carries its own
    scales: list[Scales] = Field(default=["none"], min_length=1)
    tp: list[Positive | tpcheck.TPText] = Field(default=[1], min_length=1)  # N, or 'P:D' (config/tpcheck.py)
    head_layout: list[Literal["NHD", "HND"]] = Field(default=["NHD"], min_length=1)  # with tp 'P:D'
    pp: list[Positive] = Field(default=[1], min_length=1)
    inflight: list[Positive] = Field(default=[1], min_length=1)
    overlap: list[Literal["serial", "streaming"]] = Field(default=["serial"], min_length=1)
    prefill_ms: list[PrefillMs] = Field(default=[0.0], min_length=1)
    handshake: list[Literal["off", "serial", "overlap"]] = Field(default=["off"], min_length=1)
    arrival: list[Arrival] = Field(default=["none"], min_length=1)
    # where the pools live (host: numpy; torch-cpu, pinned, cuda: torch tensors, memory/device.py)
    # and which copy engine moves device bytes (copy.py); host transports take memory host only
    # auto: cuda for the transports that move device memory (DEVICE_PATHS) where this machine has a GPU, else host
    memory: list[Literal["host", "torch-cpu", "pinned", "cuda", "auto"]] = Field(default=["host"], min_length=1)
    # auto: per case, kernel between device pools (cuda_ipc) and batch across PCIe (copy.default)
    copy: list[Literal["auto", "memcpy", "kernel", "batch", "batch-overlap", "batch-any"]] = Field(
        default=["auto"], min_length=1)
    # once: the pool registered at setup; per-request: each request's blocks registered around its transfer
    # (nixl, mooncake; docs/methodology.md, Registration per request)
    register: list[Literal["once", "per-request"]] = Field(default=["once"], min_length=1)
    # prefill: the clock (a timer of prefill_ms) or real (the model's matmuls where the pools live, prefill.py)
    prefill: list[Literal["clock", "real"]] = Field(default=["clock"], min_length=1)
    # wire encodings (docs/codecs.md): none, exp-split, cast-fp8-e4m3, cast-fp8-e5m2, zstd, lz4
    codec: list[Codec] = Field(default=["none"], min_length=1)

    @field_validator("*")
    @classmethod
    def _unique(cls, v):
        return unique(v)


class Workload(BaseModel):
    """Many requests through the pairs with a bounded decode pool (back-pressure); see kvbench/harness/load.py."""

    model_config = STRICT
    # per prefill rank; each request's arrays and row are held until the case ends, so a huge count fails mid-run
    requests: int = Field(default=100, ge=1, le=10**7)
    prompt: str = "1024"  # "N", "a,b,c" (cycled), "uniform:lo:hi", "lognormal:median:sigma"
    decode_ms: float = Field(default=20.0, ge=0, le=MAX_MS)  # a request holds its decode blocks this long after landing
    alloc_timeout_ms: float = Field(default=1000.0, ge=0, le=MAX_MS)  # back-pressure wait before a request is dropped
    decode_pool_tokens: int = Field(default=0, ge=0)  # decode pool capacity in tokens (0: room for every request)
    # a request trace to replay (a .jsonl[.gz] path or a named one; model/traceplan.py): arrivals, prompts and
    # prefix hits come from it, its speed from axes.arrival (trace:<speed>); 0 decode_pool_tokens: 4 x its
    # longest request
    trace: str | None = Field(default=None, min_length=1)
    cache_blocks: int | None = Field(default=None, ge=1)  # the trace's decode prefix cache, LRU (None: unbounded)
    trace_block: int = Field(default=TRACE_BLOCK, ge=1)  # tokens per hash id of the trace (Mooncake's: 512)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        parse_prompt(v)
        return v

    @model_validator(mode="after")
    def _trace(self):
        if self.cache_blocks is not None and self.trace is None:
            raise ValueError("cache_blocks is the decode prefix cache of a trace's replay: it needs a trace")
        if self.trace_block != TRACE_BLOCK and self.trace is None:
            raise ValueError("trace_block is the block size of a trace's hash ids: it needs a trace")
        return self


class Suite(BaseModel):
    """A whole sweep: axes plus how to run each case."""

    model_config = STRICT
    name: str = Field(default="cli", min_length=1)  # it names the result file
    description: str = ""
    iters: int = Field(default=20, ge=1)
    warmup: int = Field(default=3, ge=0)
    # >1: a transport's cases take turns (iters split over rounds), so noise hits every row alike;
    # 0 (default): min(5, iters); 1 for a workload and under cache warm (turns())
    rounds: int = Field(default=0, ge=0)
    # False (-c 0), True (-c 1: one checked transfer after timing) or "all" (-c all: every timed iteration too)
    check: bool | Literal["all"] = True
    scheme: tpcheck.Scheme = "pairwise"  # model/schemes.py's, or tp:P:D (what --tp P:D sets)
    # scheme matrix: cell [i][j] = tokens (or bytes with a unit) rank i sends rank j, or a name (model/matrix.py)
    matrix: list[list[str]] | str | None = None
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    # a pool a million requests deep is already beyond any machine's memory; far larger overflows the byte count
    pool_factor: float = Field(default=2.0, ge=1.0, le=1e6)
    timeout: float = Field(default=600.0, gt=0, le=MAX_SECONDS)  # seconds one case may take (warm-up, iterations, check)
    setup_timeout: float | None = Field(default=None, gt=0, le=MAX_SECONDS)  # a transport's setup; None: derived from its pool bytes
    pages: Literal["4k", "thp", "huge"] = "4k"
    # pool contents: pattern (the check pattern), realistic (modelled KV values), file:<dump.npy|.safetensors>
    fill: str = "pattern"  # host pools kvbench allocates (docs/pages.md says why 4k)
    # bulk: one descriptor per layer; ceiling: the same bytes in 64 KiB-4 MiB contiguous chunks (bulk% is
    # against the best of bulk and these); hot: one layer's buffer re-sent (as perftest does); paged: the block table
    variants: list[Literal["bulk", "ceiling", "hot", "paged"]] = Field(default=["bulk", "ceiling", "paged"],
                                                                       min_length=1)
    prefill_tflops: float = Field(default=400.0, gt=0)  # for prefill_ms: auto (achieved, not peak)
    # where a request's bytes are when its iteration starts (host pools; cachestate.py)
    cache: Literal["as-is", "warm", "cold"] = "as-is"
    # adapt each case's iterations (iters is then the least) until its p50's 95% interval is within target_ci
    # (% of the p50; "2%" or 2) or ci_budget seconds of its iterations are spent (results/samples.py)
    target_ci: float | None = None
    ci_budget: float = Field(default=samples.DEFAULT_BUDGET_S, gt=0, le=MAX_SECONDS)
    # bytes of the pools whose registration is swept after each transport's setup ("0.25,1,4GiB"; setuprows.py)
    pool_sizes: list[int] = []
    workload: Workload | None = None
    axes: Axes = Field(default_factory=Axes)

    @field_validator("fill")
    @classmethod
    def _fill(cls, v):
        return check_fill(v)

    @field_validator("check", mode="before")
    @classmethod
    def _check(cls, v):
        return check_level(v)

    @field_validator("variants")
    @classmethod
    def _variants(cls, v):
        return unique(v)

    @field_validator("matrix", mode="before")
    @classmethod
    def _matrix(cls, v):
        return X.suite_value(v)

    @model_validator(mode="after")
    def _matrix_scheme(self):
        if self.matrix is not None and self.scheme != "matrix":
            raise ValueError(f"a matrix needs scheme matrix (this suite's scheme is {self.scheme})")
        if self.scheme in ("matrix", "bidir") and self.workload is not None:
            raise ValueError(f"scheme {self.scheme} runs in bandwidth sweeps, not under a workload")
        return self

    @field_validator("pool_sizes", mode="before")
    @classmethod
    def _pool_sizes(cls, v):
        return sizes(v)

    @field_validator("target_ci", mode="before")
    @classmethod
    def _target_ci(cls, v):
        return None if v is None else samples.parse_target(v, "target_ci")

    @model_validator(mode="after")
    def _rounds(self):
        if self.rounds > self.iters:
            raise ValueError(f"rounds ({self.rounds}) cannot exceed iters ({self.iters}): each round needs an iteration")
        if self.target_ci is not None and self.workload is not None:
            raise ValueError("target_ci applies to bandwidth sweeps: a workload's requests are its samples")
        if self.rounds > 1 and self.workload is not None:
            raise ValueError("rounds applies to bandwidth sweeps, not to a workload (its requests already interleave)")
        return self

    @model_validator(mode="after")
    def _cache(self):
        if self.cache != "as-is" and self.workload is not None:
            raise ValueError(f"cache {self.cache} applies to bandwidth sweeps: a workload's requests arrive while "
                             "others are in flight, with no barrier before each to set the caches at")
        if self.cache == "cold" and platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
            raise ValueError(f"cache cold flushes cache lines with clflush (x86-64) or dc civac (aarch64); this CPU "
                             f"is {platform.machine() or 'unknown'}")
        if self.cache != "as-is" and "cuda" in self.axes.memory:
            raise ValueError(f"cache {self.cache} sets the CPU caches over host pools; memory cuda pools are device "
                             "memory (run the cuda rows with cache as-is)")
        return self

    def turns(self) -> int:
        """Rounds in force: as given, or by default min(5, iters), so references and paged rows share the
        machine's slow and fast phases; 1 for a workload, and 1 under cache warm, which promises what a loop
        re-sending one request measures (a resumed case starts from the cache state the others' turns left)."""
        if self.rounds:
            return self.rounds
        return 1 if self.workload is not None or self.cache == "warm" else min(5, self.iters)


def _one_line(exc: ValidationError, where: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = Axes if err["loc"][:1] == ("axes",) else Suite
        msg = f"unknown field (allowed: {', '.join(parent.model_fields)})"
    return f"{where}: field '{loc}': {msg}"


def validate(data: dict, where: str = "suite") -> Suite:
    """Validate a suite mapping; raise SuiteError with one line on failure."""
    if not isinstance(data, dict):
        raise SuiteError(f"{where}: expected a mapping with 'name' and 'axes'")
    try:
        return Suite.model_validate(data)
    except ValidationError as exc:
        raise SuiteError(_one_line(exc, where)) from None


def resolve_path(name: str) -> str:
    """A suite path, or a bare name looked up in suites/ (``quick`` -> suites/quick.yaml)."""
    if os.path.exists(name):
        return name
    cand = os.path.join(SUITE_DIR, name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if os.path.exists(cand):
        return cand
    raise SuiteError(f"suite '{name}' not found (suites: {', '.join(list_suites())})")


def load(name: str) -> Suite:
    """Read and validate a suite file (or a name from suites/)."""
    path = resolve_path(name)
    try:
        data = read(path)
    except ValueError as exc:
        raise SuiteError(str(exc)) from None
    return validate(data, path)


def list_suites() -> list[str]:
    """Names of the suites shipped in suites/."""
    if not os.path.isdir(SUITE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(SUITE_DIR) if f.endswith(".yaml"))


# Sweep order: a transport's session axes first (memory, copy, register, P:D pair: harness/loop.py), so each runs once
CASE_KEYS = ("transport", "memory", "copy", "register", "tp", "op", "model", "tokens", "prefix_hit", "block_size",
             "layout", "alloc", "coalesce", "dtype", "pp", "inflight", "overlap", "prefill_ms", "handshake", "arrival",
             "codec", "scales", "prefill")


def expand(suite: Suite) -> list[dict]:
    """The cases of a suite, in sweep order; layout 'auto' resolved per model."""
    ax = suite.axes
    cases, dropped = [], []
    for case in tpcheck.cases(ax, CASE_KEYS):  # --tp P:D: once per head layout
        if case["memory"] == "auto":
            case["memory"] = auto_memory(case["transport"])
        if case["copy"] == "auto":
            case["copy"] = copy_default(case["transport"], case["memory"])[0]
        shape = M.get_model(case["model"])
        if case["layout"] == "auto":
            case["layout"] = "mla" if shape.attention == "mla" else "layer-major"
        if why := misfit(case["layout"], shape, case["codec"]):  # model/layout.py
            raise SuiteError(why)
        if case["prefix_hit"] >= case["tokens"]:
            raise SuiteError(f"prefix_hit {case['prefix_hit']} leaves nothing to transfer of {case['tokens']} tokens")
        try:
            tpcheck.shard(shape, case)
        except ValueError as exc:
            raise SuiteError(str(exc)) from None
        case["scheme"] = suite.scheme
        case["prefill_ms_set"] = str(case["prefill_ms"])
        if case["prefill_ms"] == "auto":
            ntok = case["tokens"] - case["prefix_hit"]
            # TP and PP split the FLOPs: each rank computes 1/(tp x pp) of them at prefill_tflops
            case["prefill_ms"] = M.prefill_ms(shape, ntok, suite.prefill_tflops * tpcheck.prefill_tp(case["tp"]) * case["pp"])
            if not case["prefill_ms"] <= MAX_MS:  # a tiny prefill_tflops: a prefill no case could wait out
                raise SuiteError(f"prefill_ms auto: {case['prefill_ms']:.3g} ms for {ntok} tokens of "
                                 f"{case['model']} at prefill_tflops {suite.prefill_tflops:g} is longer than the "
                                 f"longest wait a run takes ({MAX_MS:.0f} ms)")
        if (case["arrival"] == "none") != (suite.workload is None):
            raise SuiteError("an arrival other than 'none' needs a 'workload:' section, and a workload needs "
                             f"axes.arrival ({ARRIVAL_HELP})")
        traced = suite.workload is not None and suite.workload.trace is not None
        if case["arrival"].startswith("trace:") != traced:
            raise SuiteError(f"workload.trace takes its arrivals from the trace: arrival {case['arrival']} is not "
                             "trace:<speed>" if traced else
                             f"arrival {case['arrival']} replays a trace: it needs workload.trace")
        if traced and case["prefix_hit"]:
            raise SuiteError(f"prefix_hit {case['prefix_hit']}: a trace's replay takes each request's prefix hit "
                             "from its decode prefix cache (leave prefix_hit 0)")
        case["workload"] = case["arrival"]
        from kvbench.model.formats import Format

        try:
            fmt = Format(case["dtype"], case["scales"])
            fmt.check(shape)
        except ValueError as exc:  # a dtype x scales pair that does not exist (fp16 with scales, nvfp4 with others')
            dropped.append(str(exc))
            continue
        if why := fmt.misfit(shape, suite.workload is not None, case["inflight"], case["codec"]):
            raise SuiteError(why)
        if shape.hybrid and (not fmt.plain or suite.workload is not None or case["codec"] != "none"
                             or not shape.attn_layers or case["prefill"] != "clock"):
            raise SuiteError(f"model '{case['model']}' mixes layer kinds (docs/models.md): it runs in bandwidth "
                             "sweeps of a plain dtype with attention layers, no codec, no workload, prefill clock "
                             "(those are not yet layer-kind aware)")
        if case["codec"] != "none" and (why := codec_check(case["codec"], case["dtype"])):
            dropped.append(why)  # a codec x dtype pair that does not exist (exp-split on e4m3): the sweep skips it
            continue
        cases.append(case)
    if dropped and not cases:
        raise SuiteError(dropped[0])
    return cases
