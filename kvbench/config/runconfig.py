"""One validated run configuration, built on rank 0 before anything is allocated or written.

Flags and suite are merged here, every field typed (pydantic), ``-O`` options
checked per transport, the results directory and a resumed result set checked;
the other ranks receive the finished ``RunConfig``.  A mistake is a
``ConfigError`` whose message is the one line the user sees.
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbench import transports
from kvbench.config import ConfigError, flagcheck, sizes, tpcheck
from kvbench.config import suite as S
from kvbench.config.niccfg import check_nics, nic_arg
from kvbench.config.tracecfg import TRACE_FLAGS, read_trace, trace_flags
from kvbench.harness.state import Options
from kvbench.job import folder
from kvbench.job.guard import describe
from kvbench.memory import device, driver, host, placement
from kvbench.model import ageing, traceplan
from kvbench.model import matrix as X
from kvbench.model import shapes as M
from kvbench.model.layout import aged_n
from kvbench.model.limits import one_line
from kvbench.model.schemes import SchemeError, make_pairs
from kvbench.results import export, machine
from kvbench.results.schema import RESUMES, SCHEMA_VERSION
from kvbench.transports import options as O

FLAG_AXES = ("transport", "op", "model", "tokens", "coalesce", "alloc", "layout", "dtype", "tp", "pp", "prefix_hit",
             "inflight", "overlap", "prefill_ms", "handshake", "arrival", "codec", "scales", "memory",
             "copy", "prefill", "register")
WORKLOAD_FLAGS = {"requests": "requests", "prompt": "prompt", "decode_ms": "decode_ms",
                  "alloc_timeout": "alloc_timeout_ms", "decode_pool_tokens": "decode_pool_tokens"}
SUITE_FLAGS = ("iters", "warmup", "rounds", "seed", "pool_factor", "timeout", "setup_timeout", "scheme",
               "prefill_tflops", "pages", "fill", "cache", "target_ci", "ci_budget", "pool_sizes")
DEFAULT_RESULTS = "results/runs"  # -o's default (a --resume has none: it continues where its file is)
RESUMABLE = ("INCOMPLETE", "ERROR", "TIMEOUT", "INTERRUPTED")


class RunConfig(BaseModel):
    """Everything a run needs, validated; what rank 0 broadcasts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    suite: S.Suite
    cases: list[dict[str, Any]]
    models: dict[str, dict[str, Any]]  # name -> ModelShape fields: a YAML file or flags exist on rank 0 only
    transport_options: dict[str, dict[str, Any]]  # per transport, given keys only
    results: str
    name: str
    bind: Literal["none", "core"] = "none"
    gpu_map: list[int] | None = None  # --gpu-map: per local rank, its GPU (memory/placement.py)
    nic: list[str] | None = None  # --nic: ["auto"] or the interfaces named (memory/affinity.py)
    progress: Literal["auto", "on", "off"] = "auto"  # rank 0's progress bar (kvbench/cli/progress.py)
    inject_corruption: int = Field(0, ge=0)
    resume: str | None = None  # the .parquet being continued
    argv: list[str] = []
    trace: dict[str, Any] | None = None  # workload.trace read on rank 0: traceplan.TracePlan's fields
    expect: Literal["auto", "shm", "nvlink", "rdma", "tcp", "any"] = "auto"  # --expect (fabric/expect.py)

    def trace_plan(self) -> traceplan.TracePlan | None:
        return None if self.trace is None else traceplan.TracePlan(**self.trace)

    def workload_lines(self, world: int) -> list[str]:
        """The preamble's word on a trace's replay (what it replays, its hit rates, every clip it makes) and on
        the requests that aged each aged:<N> decode pool."""
        p = self.trace_plan()
        ages = sorted({n for n in (aged_n(c["alloc"]) for c in self.cases) if n is not None})
        if p is None:
            return [ageing.drawn_line(n) for n in ages]
        speeds = [float(a.partition(":")[2]) for a in self.suite.axes.arrival]
        contexts = {m: self.shapes()[m].context for m in dict.fromkeys(c["model"] for c in self.cases)}
        srcs = len({s for s, _ in make_pairs(self.suite.scheme, world, self.suite.matrix)})
        return (traceplan.preamble(p, srcs, speeds, contexts, self.suite.workload.decode_pool_tokens)
                + [traceplan.aged_line(p, n) for n in ages])

    def shapes(self) -> dict[str, M.ModelShape]:
        return {n: M.ModelShape(**f) for n, f in self.models.items()}

    def options(self) -> Options:
        """The harness's ``Options``, built in this one place from the suite and the run's flags."""
        s = self.suite
        return Options(matrix=s.matrix, iters=s.iters, warmup=s.warmup, rounds=s.turns(), check=s.check, seed=s.seed,
                       pool_factor=s.pool_factor, timeout=s.timeout, setup_timeout=s.setup_timeout, pages=s.pages,
                       fill=s.fill, cache=s.cache, inject_corruption=self.inject_corruption, gpu_map=self.gpu_map,
                       target_ci=s.target_ci, ci_budget=s.ci_budget, pool_sizes=tuple(s.pool_sizes),
                       variants=tuple(s.variants), transport_options=self.transport_options)


def custom_model(a) -> str | None:
    """Register a model given by flags under the name 'custom'; return that name."""
    if a.layers is None:
        return None
    attention = a.attention or ("mla" if a.kv_lora_rank else "gqa")
    try:
        M.PRESETS["custom"] = M.ModelShape("custom", a.layers, a.kv_heads or 0, a.head_dim or 0, attention,
                                           a.kv_lora_rank, a.rope_dim, source="command-line flags")
    except ValueError as exc:
        raise ConfigError(f"custom model: {exc}") from None
    return "custom"


def gave_sweep(a) -> bool:
    """Did the user name a suite or override any of its fields?"""
    return bool(a.suite or a.layers is not None or sizes.blocks_given(a) or a.variants or a.check is not None
                or any(getattr(a, k, None) for k in FLAG_AXES)
                or any(getattr(a, k, None) is not None for k in (*SUITE_FLAGS, *WORKLOAD_FLAGS, *TRACE_FLAGS)))


def merge(a) -> S.Suite:
    """The suite file (or defaults) with command-line overrides applied, validated."""
    base = S.load(a.suite) if a.suite else S.Suite(name=a.name or "cli")
    data = base.model_dump()
    if a.suite is None:
        data["axes"] = S.Axes().model_dump()
    axes = data["axes"]
    for key in FLAG_AXES:
        if getattr(a, key, None):
            axes[key] = getattr(a, key)
    custom = custom_model(a)
    if custom:
        axes["model"] = [custom]
    sweep = sizes.block_sweep(a, axes)  # -b/-e/-f: tokens, or bytes with a unit in the run's model's tokens
    if sweep:
        axes["block_size"] = sweep
    if a.variants:
        data["variants"] = a.variants
    wl = {key: getattr(a, attr) for attr, key in WORKLOAD_FLAGS.items() if getattr(a, attr) is not None}
    wl.update(trace_flags(a, axes))
    if wl or (a.arrival and any(x != "none" for x in a.arrival) and data.get("workload") is None):
        data["workload"] = dict(data.get("workload") or {}, **wl)
    if (data.get("workload") or {}).get("trace") and axes["arrival"] == ["none"]:
        axes["arrival"] = ["trace:1"]  # a suite's trace replayed at its own pace
    for key in SUITE_FLAGS:
        if getattr(a, key, None) is not None:
            data[key] = getattr(a, key)
    if a.check is not None:
        data["check"] = a.check
    if getattr(a, "matrix", None) is not None:
        if (a.scheme or data.get("scheme")) != "matrix":
            raise ConfigError("--matrix needs --scheme matrix")
        data["matrix"] = X.load(a.matrix)
    if a.name:
        data["name"] = a.name
    return S.validate(data, a.suite or "command line")


# a result set's files are <stamp>_<name>[-N]<suffix> (results/store.py); the longest suffix is the sidecar's
# temporary written by a rank standing in for rank 0, .meta.json.<pid>.tmp
FILE_NAME_EXTRA = len("20261203-224900_") + len("-999") + len(".meta.json.4194304.tmp")


def existing_parent(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def name_fits(name: str, results: str) -> str:
    """Refuse a run name too long for its result files' names on the results' file system (NAME_MAX)."""
    probe = existing_parent(results)
    try:
        limit = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(name) + FILE_NAME_EXTRA > limit:  # (the file name has one ASCII character per character of the name)
        raise ConfigError(f"--name: '{name[:24]}...' ({len(name)} characters) is too long for a result file's name "
                          f"on {probe}: at most {limit - FILE_NAME_EXTRA}")
    return name


def results_dir(path: str) -> str:
    """Refuse a results directory that cannot be created or written, without creating anything."""
    probe = existing_parent(path)
    if not os.path.isdir(probe):
        raise ConfigError(f"-o {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"-o {path}: {probe} is not writable by this user")
    st = os.statvfs(probe)
    if st.f_flag & os.ST_RDONLY:
        raise ConfigError(f"-o {path}: {probe} is on a read-only file system")
    flagcheck.creatable(path, probe)
    folder.door(path, ConfigError, machine.machine_name())  # another's, or open to all: job/folder.py
    flagcheck.planted_files(path)
    return path


def build(a, argv: list[str], world: int) -> RunConfig:
    """The run's configuration from the parsed command line; raises ConfigError."""
    try:
        export.check_flags(a)  # --json/--csv: new files (never one that exists, nor a link)
        if a.resume:
            return resumed(a, argv, world)
        return fresh(a, argv, world)
    except ValidationError as exc:  # a flag that is not a suite field (RunConfig's own)
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"--{field.replace('_', '-')}: {err['msg']}") from None
    except (S.SuiteError, SchemeError, O.OptionError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None


def door(a, argv: list[str], world: int) -> tuple[dict | None, str | None]:
    """Rank 0's door: (the run's configuration, None), or (None, the one line that refuses it), whatever the
    readers raised: a reader's unexpected exception is a line too, broadcast to every rank like a ConfigError,
    not a traceback here while the other ranks wait out the start-up deadline."""
    try:
        return build(a, argv, world).model_dump(), None
    except ConfigError as exc:
        return None, one_line(str(exc))
    except Exception as exc:  # a reader's bug (OverflowError, RecursionError, ...): still the one line
        return None, one_line(f"the run's configuration could not be checked: {describe(exc)}", 300)


def fresh(a, argv: list[str], world: int) -> RunConfig:
    suite = merge(a)
    tpcheck.check(a, suite, world) or make_pairs(suite.scheme, world, suite.matrix)  # --tp P:D: its own pairs
    ram = host.meminfo().get("MemTotal", 0)
    if suite.pool_sizes and ram and max(suite.pool_sizes) > ram:  # the rest is the preflight's, on every host
        raise ConfigError(f"--pool-sizes: {max(suite.pool_sizes) / 2**30:.2f} GiB is more than this machine's "
                          f"memory ({ram / 2**30:.2f} GiB)")
    cases = S.expand(suite)
    topts = O.parse(a.option or [], suite.axes.transport)
    nic = nic_arg(getattr(a, "nic", None))
    check_nics(topts, nic, suite.axes.transport)
    # staged alone on host pools can measure nothing: say so at once; in a sweep of several transports (a shipped
    # suite such as procurement) its host cases are skipped rows with the reason, as any unavailable path's are
    if suite.axes.transport == ["staged"] and suite.axes.memory == ["host"]:
        raise ConfigError("staged: --memory host has nothing to stage: it moves device pools through a host "
                          "bounce buffer (use --memory torch-cpu, pinned or cuda)")
    flagcheck.ci_budget(a, suite)
    flagcheck.fill_file(suite)
    real_prefill(suite)
    per_request(suite)
    gpu_map = device_memory(suite, getattr(a, "gpu_map", None))
    flagcheck.one_rank(suite.axes.transport, world)  # last: a flag's own mistake is the line a user needs first
    models = {c["model"]: vars(M.get_model(c["model"])) for c in cases}
    return RunConfig(suite=suite, cases=cases, models=models, transport_options=topts, gpu_map=gpu_map, nic=nic,
                     trace=read_trace(suite, world),
                     results=results_dir(DEFAULT_RESULTS if a.results is None else a.results), bind=a.bind,
                     name=name_fits(a.name or suite.name, DEFAULT_RESULTS if a.results is None else a.results),
                     progress=getattr(a, "progress", "auto"),
                     inject_corruption=a.inject_corruption, argv=argv, expect=getattr(a, "expect", "auto"))


def device_memory(suite: S.Suite, gpu_map_text: str | None) -> list[int] | None:
    """--memory cuda and --gpu-map against the transports and this node's GPUs; the map as ordinals."""
    try:
        gpu_map = placement.parse_gpu_map(gpu_map_text)
    except placement.PlacementError as exc:
        raise ConfigError(str(exc)) from None
    kinds = suite.axes.memory
    coded = [c for c in suite.axes.codec if c != "none"]
    if coded and "host" not in kinds:  # in a sweep with host pools too, the device rows are skipped with the reason
        raise ConfigError(f"--codec {coded[0]}: codecs encode host pools, and --memory {', '.join(kinds)} has none: "
                          "no codec runs on a device yet (add --memory host)")
    if "cuda" in kinds:
        for name in suite.axes.transport:
            try:
                caps = transports.load(name).caps
            except Exception:  # unavailable here: its rows say why
                continue
            if not set(kinds) & set(caps.memory):
                raise ConfigError(f"--memory cuda: {name} moves {', '.join(caps.memory)} memory, not "
                                  f"{', '.join(kinds)} (GPU memory: cuda_ipc, staged, nixl, verbs)")
        why = device.probe("cuda")
        if why:
            raise ConfigError(f"--memory cuda: {why}")
    if gpu_map:
        try:
            placement.check_gpu_map(gpu_map, driver.device_count())
        except placement.PlacementError as exc:
            raise ConfigError(str(exc)) from None
    return gpu_map


def per_request(suite: S.Suite) -> None:
    """--register per-request needs a transport that registers memory with a library; among several, those that
    do not are skipped rows with the reason (harness/loop.py per_request_reason)."""
    if "per-request" not in suite.axes.register:
        return
    if suite.workload is not None:
        raise ConfigError("--register per-request runs in bandwidth sweeps, not under a workload (not yet)")
    able = []
    for name in suite.axes.transport:
        try:
            cls = transports.load(name)
        except Exception:  # its library is missing here: its rows say so
            able.append(name)
            continue
        if cls.per_request() and not cls.caps.local_only:
            able.append(name)
    if not able:
        names = suite.axes.transport
        raise ConfigError(f"--register per-request: {', '.join(names)} {'registers' if len(names) == 1 else 'register'} "
                          "nothing per request (per-request registration: nixl, mooncake)")


def real_prefill(suite: S.Suite) -> None:
    """--prefill real computes where the pools live: host pools have no device to compute on."""
    if "real" not in suite.axes.prefill:
        return
    if "host" in suite.axes.memory:
        raise ConfigError("--prefill real: --memory host has no device to compute on (the layers' matmuls run "
                          "where the pools live: use --memory torch-cpu, pinned or cuda)")
    if suite.workload is not None:
        raise ConfigError("--prefill real runs in bandwidth sweeps, not under a workload (not yet)")


def read_sidecar(parquet: str) -> dict:
    """The sidecar of a result file; ConfigError when missing or unreadable."""
    if not parquet.endswith(".parquet"):
        raise ConfigError(f"--resume {parquet}: expected a results .parquet file")
    meta = parquet[: -len(".parquet")] + ".meta.json"
    try:
        with open(meta) as fh:
            return json.load(fh)
    except OSError as exc:
        raise ConfigError(f"--resume {parquet}: cannot read its sidecar {meta}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--resume {parquet}: its sidecar {meta} is not valid JSON: {exc}") from None


def resumed(a, argv: list[str], world: int) -> RunConfig:
    """Continue ``--resume FILE``: the same suite, schema and machine, or a refusal."""
    path = a.resume
    meta = read_sidecar(path)
    if meta.get("schema_version") not in RESUMES:  # an older one: its rows are upgraded when the file is reopened
        raise ConfigError(f"--resume {path}: schema version {meta.get('schema_version')}, this kvbench writes "
                          f"{SCHEMA_VERSION} and continues {', '.join(map(str, RESUMES))}: start a new run")
    status = meta.get("status", "INCOMPLETE")
    if status not in RESUMABLE:
        raise ConfigError(f"--resume {path}: the run ended by itself ({status}): nothing to resume")
    if meta.get("world_size") != world:
        raise ConfigError(f"--resume {path}: it ran on {meta.get('world_size')} ranks, this launch has {world}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if a.results is not None and os.path.realpath(a.results) != os.path.realpath(root):
        raise ConfigError(f"--resume {path}: -o {a.results}: a resumed run continues its own result set, in "
                          f"{root}: leave -o out")
    # the shapes it ran with, before its suite is read: a model given by flags ('custom') or a file edited since
    M.PRESETS.update({n: M.ModelShape(**f) for n, f in meta.get("models", {}).items()})
    stored = RunConfig(suite=S.Suite.model_validate(meta["suite"]), cases=meta["cases"], models=meta["models"],
                       transport_options=meta.get("transport_options", {}),
                       results=root,
                       name=meta.get("name", meta["suite"]["name"]), bind=meta.get("cpu_bind", "none"),
                       gpu_map=meta.get("gpu_map"), nic=meta.get("nic"), resume=path, argv=meta.get("argv", []))
    stored.trace = read_trace(stored.suite, world)
    flagcheck.fill_file(stored.suite)  # a dump moved away since
    if gave_sweep(a) or a.option:
        mine = fresh(a, argv, world)
        for field in ("suite", "cases", "transport_options"):
            if getattr(mine, field) != getattr(stored, field):
                raise ConfigError(f"--resume {path}: the {field.replace('_', ' ')} differ from the interrupted run's; "
                                  "resume with no suite or flags (the stored ones are used) or start a new run")
    results_dir(os.path.dirname(os.path.abspath(path)))
    readable_table(path)
    return stored


def readable_table(path: str) -> None:
    """A truncated or corrupt table is refused here, before any rank allocates (no table at all is fine: the run
    was killed before its first case was stored)."""
    if not os.path.exists(path):
        return
    import pyarrow.parquet as pq

    try:
        pq.read_table(path)
    except Exception as exc:  # pyarrow says ArrowInvalid, OSError or worse for a damaged file
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"--resume {path}: the table cannot be read (truncated or corrupt): {why}") from None
