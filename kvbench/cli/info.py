"""`kvbench size`, `kvbench list` and `kvbench env`: what a request weighs, what can run here, what this machine is."""
from __future__ import annotations

import os
import resource
import shutil
import sys

from kvbench import __version__, transports
from kvbench.config import suite as S
from kvbench.config.runconfig import custom_model
from kvbench.job import cleanup, comm
from kvbench.memory import affinity
from kvbench.model import layers as L
from kvbench.model import shapes as M
from kvbench.model import trace as T
from kvbench.model.layout import misfit
from kvbench.model.tpmap import TPPair, map_lines, tp_map
from kvbench.results import machine as hwfacts


def _first(v, default):
    return v[0] if v else default


def cmd_size(a) -> int:
    name = custom_model(a) or _first(a.model, "llama-3-8b")
    shape0 = M.get_model(name)
    pair = _first(a.tp, None)  # a TPPair (cli/tpargs.py): P:D, or one number for both
    tp, pp, hit = pair.decode if pair else 1, _first(a.pp, 1), _first(a.prefix_hit, 0)
    M.check_block_size(a.block_size)
    layout = a.layout if a.layout != "auto" else "mla" if shape0.attention == "mla" else "layer-major"
    if why := misfit(layout, shape0):
        raise ValueError(why)
    tmap = _tp_map(a, shape0, pair, pp, hit, layout)  # before shard: a P:D that cannot split the heads is one line
    shape = M.shard(shape0, tp, pp)
    if a.dtype in ("nvfp4", "fp8-ds-mla") or a.scales != "none" or shape0.indexer_bytes:  # planes (formats.py)
        if shape0.hybrid:
            raise ValueError(f"--dtype {a.dtype} --scales {a.scales}: scale planes of a hybrid model "
                             f"({shape0.name}) are not modelled; give a plain dtype")
        return size_scaled(a, shape0, shape, tp, pp, hit, layout)
    db = M.dtype_bytes(a.dtype)
    ntok = M.transferred_tokens(a.tokens, hit)
    bpt = M.bytes_per_token(shape, a.dtype)
    req = M.request_bytes(shape, a.dtype, a.tokens, hit)
    bb = M.block_bytes(shape, a.block_size, a.dtype)
    nb = M.num_blocks(ntok, a.block_size)
    kind = (f"mla, latent {shape.kv_lora_rank}+{shape.rope_dim}" if shape.attention == "mla"
            else f"{shape.attention}, {shape.kv_heads} KV heads x {shape.head_dim}")
    tps = f"{pair} (one decode rank)" if tmap else tp
    print(f"# {shape.name}: {shape.layers} layers{_kinds(shape)}, {kind}, {a.dtype} ({db} B/element), tp={tps} pp={pp}"
          f"{'  [per rank]' if tp > 1 or pp > 1 else ''}")
    if shape0.source:
        print(f"# source: {shape0.source}")
    if shape.linear_layers:
        print(f"# linear layers: state {shape.state_heads} heads x {shape.state_k_dim} x {shape.state_v_dim} "
              f"{shape.state_dtype} + convolution ({shape.conv_kernel} - 1) x {shape.conv_dim} {shape.conv_dtype} "
              f"= {L.state_layer_bytes(shape):,} B per layer per request, whatever the prompt")
    print(f"{bpt:>16,} B per token{' (full-attention layers)' if shape.hybrid else ''}")
    print(f"{M.layer_bytes_per_token(shape, a.dtype):>16,} B per token per layer")
    print(f"{ntok:>16,} tokens transferred ({a.tokens:,} prompt - {hit:,} prefix hit)")
    for line in parts_lines(shape0, shape, a.dtype, ntok, tp, pp):
        print(line)
    print(f"{req:>16,} B per request ({req / 1e9:.3f} GB, {req / 2**30:.3f} GiB)")
    if not shape.hybrid:
        print(f"{req // shape.layers:>16,} B per layer per request")
    print(f"{bb:>16,} B per block ({a.block_size} tokens, one region; {shape.regions} region(s) per layer)")
    print(f"{nb:>16,} blocks per layer")
    if shape.hybrid:
        print(f"{L.descriptors(shape, ntok, a.block_size):>16,} descriptors per request uncoalesced (a block and "
              "region each in the full and window layers, one state each in the linear layers)")
    elif layout == "cross-layer":
        print(f"{shape.layers * shape.regions * bb:>16,} B per page (cross-layer: a block of every layer and region)")
        print(f"{nb:>16,} descriptors per request uncoalesced (cross-layer: one page per block; fewer once adjacent "
              "blocks coalesce)")
        print(f"{nb * shape.regions * shape.layers:>16,} descriptors per request streamed layer by layer (a layer of "
              f"a page is a strided run: {shape.regions} x {shape.layers} layers x {nb} blocks)")
    else:
        at = f" at tp {tp}:{tp}; at tp {pair}: below" if tmap and pair.prefill != tp else ""
        print(f"{nb * shape.regions * shape.layers:>16,} descriptors per request uncoalesced "
              f"({shape.regions} x {shape.layers} layers x {nb} blocks{at})")
    for line in map_lines(tmap) if tmap else ():
        print(line)
    print("# transfer time at line rate (GB = 10^9 B; achieved bandwidth is lower: measure it with kvbench run)")
    for link, gbps in M.LINKS.items():
        ms = req / (gbps * 1e9) * 1e3
        print(f"  {link:<18} {gbps:8.1f} GB/s {ms:12.2f} ms")
    return 0


def _tp_map(a, shape0, pair, pp: int, hit: int, layout: str):
    """--tp P:D (or --head-layout): what each decode rank receives from which prefill ranks; None otherwise."""
    if not (pair and pair.paired) and not a.head_layout:
        return None
    pair = pair or TPPair(1, 1)
    if a.dtype in ("nvfp4", "fp8-ds-mla") or a.scales != "none":
        raise ValueError(f"--tp {pair} (or --head-layout) with --dtype {a.dtype} --scales {a.scales}: the "
                         "per-decode-rank map of scale planes is not modelled; give one TP degree, or a plain dtype")
    return tp_map(M.shard(shape0, 1, pp), M.transferred_tokens(a.tokens, hit), a.block_size, a.dtype, layout,
                  a.head_layout or "NHD", pair)


def _kinds(m) -> str:
    if not m.hybrid:
        return ""
    n = {"full": m.full_layers, "sliding": m.sliding_layers, "linear": m.linear_layers}
    window = f", window {m.window} tokens" if m.sliding_layers else ""
    return " (" + ", ".join(f"{v} {k}" for k, v in n.items() if v) + window + ")"


def parts_lines(shape0, shape, dtype: str, ntok: int, tp: int, pp: int) -> list[str]:
    """KV, window and state bytes apart, one rank's beside the whole TP x PP group's, and the replication."""
    one, group = L.parts(shape, dtype, ntok), M.group_parts(shape0, dtype, ntok, tp)
    wt = L.window_tokens(shape, ntok)
    what = {"kv": f"KV, {shape.full_layers} full-attention layers x {ntok:,} tokens",
            "window": f"window, {shape.sliding_layers} sliding layers x {wt:,} tokens (at most {shape.window})",
            "state": f"state, {shape.linear_layers} linear layers x {L.state_layer_bytes(shape):,} B"}
    out = [f"# {'one rank':>14} {f'whole group ({tp * pp} ranks: tp={tp} x pp={pp})':>40}"]
    for k, v in one.items():
        if v or group[k] or k == "kv":
            out.append(f"{v:>16,} {group[k]:>40,} B {what[k]}")
    out.append(f"{sum(one.values()):>16,} {sum(group.values()):>40,} B per request (one rank; whole group)")
    rep = M.replication(shape0, tp)
    if rep > 1:
        held = ("the MLA latent whole on every rank" if shape0.attention == "mla" else
                f"{shape0.kv_heads} KV heads < tp={tp}: each rank holds max(1, {shape0.kv_heads}/{tp}) = "
                f"{shape.kv_heads}, the group {shape.kv_heads * tp}")
        out.append(f"# replication factor {rep:g}: {held}; the group moves {rep:g}x the model's logical KV")
    return out


def size_scaled(a, shape0, shape, tp: int, pp: int, hit: int, layout: str = "auto") -> int:
    """`kvbench size` of a format with scale planes: values, block scales and tensor scales apart."""
    from kvbench.model.formats import Format, size_lines

    fmt = Format(a.dtype, a.scales)
    fmt.check(shape0)
    ntok = M.transferred_tokens(a.tokens, hit)
    print(f"# {shape.name}: {shape.layers} layers, tp={tp} pp={pp}{'  [per rank]' if tp > 1 or pp > 1 else ''}")
    if shape0.source:
        print(f"# source: {shape0.source}")
    print(f"{ntok:>16,} tokens transferred ({a.tokens:,} prompt - {hit:,} prefix hit)")
    for line in size_lines(shape, fmt, ntok, a.block_size, layout):
        print(line)
    return 0


def cmd_list(a) -> int:
    comm.preload(transports.names())  # ucxx must load before mpi4py does (docs/pitfalls.md#ucx-first)
    print("# transports (name: status)")
    for name in transports.names():
        reason = transports.probe(name)
        print(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print("# models")
    for m in M.PRESETS.values():
        desc = (f"mla {m.kv_lora_rank}+{m.rope_dim}" if m.attention == "mla"
                else f"{m.attention} {m.kv_heads}x{m.head_dim}")
        ctx = f"{m.context:>8,} tokens context" if m.context else ""
        print(f"  {m.name:<16} {m.layers:>4} layers  {desc:<16} {M.bytes_per_token(m, 'fp16'):>9,} B/token (fp16{', full-attention layers' if m.hybrid else ''})  {ctx}")
    print("# traces (kvbench run --trace NAME, kvbench trace NAME; Apache-2.0, Mooncake FAST'25)")
    for name in T.NAMED:
        n, dur = T.brief(name)
        print(f"  {name:<22} {n:>7,} requests {dur:>9,.1f} s  {n / dur if dur else 0:>6.2f} req/s")
    print("# suites")
    for name in S.list_suites():
        try:
            desc = S.load(name).description
        except S.SuiteError as exc:
            desc = f"invalid: {exc}"
        print(f"  {name:<16} {desc}")
    if getattr(a, "sweep", False):
        removed = cleanup.sweep_orphans()
        print(f"# swept {len(removed)} file(s) of ended runs from {cleanup.SHM_DIR}")
    for line in shm_lines(cleanup.survey()):
        print(line)
    return 0


def _mib(paths) -> str:
    return f"{cleanup.held_bytes(paths) / 2**20:.1f} MiB"


def _runs(ids: list[str]) -> str:
    return f"run{'s' * (len(ids) != 1)} {', '.join(ids)}" if ids else "MPICH segments only"


def shm_lines(s: cleanup.Survey) -> list[str]:
    """`kvbench list`'s word on SHM_DIR: the leftovers of ended runs, with what removes them, and what is in use."""
    where = cleanup.SHM_DIR
    lines = [f"# {where} (shared memory: pool segments, MPICH segments)"]
    if s.orphans:
        lines.append(f"  leftovers  {len(s.orphans)} file(s) of ended kvbench runs ({_runs(s.orphan_runs)}), "
                     f"{_mib(s.orphans)}: their processes are gone; the next `kvbench run` on this host removes "
                     f"them at its start, or now: kvbench list --sweep")
    if s.stray_mpich:
        lines.append(f"  leftovers  {len(s.stray_mpich)} MPICH segment(s) no live process maps, "
                     f"{_mib(s.stray_mpich)}: a job ended without MPI_Finalize; no kvbench sweep takes a segment "
                     f"no rank registered: when no MPI job runs here, rm {where}/mpich_shm_*")
    if s.in_use:
        lines.append(f"  in use     {len(s.in_use)} kvbench file(s) of live processes ({_runs(s.live_runs)}), "
                     f"{_mib(s.in_use)}")
    if len(lines) == 1:
        lines.append("  no leftovers of kvbench or MPICH")
    return lines


def _sys_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):  # absent (a virtual device has no device/), or EINVAL
        return None


def nic_lines(sysfs: str = "/sys") -> list[str]:
    """`kvbench env`'s NICs: each interface's link speed (Mb/s), MTU and NUMA node, '-' where the kernel reports
    none (loopback, a virtual device, a link that is down; a NUMA node of -1: the machine has one)."""
    base = os.path.join(sysfs, "class", "net")
    names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    out = [f"{'# NIC':<16} {'speed(Mb/s)':>11} {'MTU':>6} {'NUMA':>5}   ({base}/IF/speed, mtu, device/numa_node)"]
    for n in names:
        speed, mtu = hwfacts.nic_speed_mbps(n, sysfs), _sys_int(os.path.join(base, n, "mtu"))
        numa = _sys_int(os.path.join(base, n, "device", "numa_node"))
        out.append(f"{'  ' + n:<16} {speed or '-':>11} {'-' if mtu is None else mtu:>6} "
                   f"{'-' if numa is None or numa < 0 else numa:>5}")
    return out if names else []


def memlock_lines() -> list[str]:
    """A warning when the locked-memory limit would cap RDMA registration (any limit but unlimited can)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return []
    return [f"# WARNING: memlock (RLIMIT_MEMLOCK) is {soft / 2**20:g} MiB: RDMA registration (verbs, nixl, ucx, "
            "mooncake) pins every byte of a pool and fails beyond it; 'unlimited' is recommended (ulimit -l unlimited, "
            "or memlock in /etc/security/limits.conf; docker run --ulimit memlock=-1)"]


def cmd_env(a) -> int:
    from kvbench.results.store import library_versions, system_description

    sysd = system_description()
    print(f"# kvbench {__version__}")
    for k in ("hostname", "platform", "cpu_model", "cpus"):
        print(f"{k:<16} {sysd.get(k, '-')}")
    print(f"{'memory':<16} {sysd.get('mem_total_bytes', 0) / 2**30:.1f} GiB")
    venv_mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = shutil.which("mpirun") or (venv_mpiexec if os.path.exists(venv_mpiexec) else None)
    print(f"{'mpirun':<16} {launcher or '- (none on PATH)'}")
    try:
        from mpi4py import MPI

        print(f"{'MPI':<16} {MPI.Get_library_version().strip().splitlines()[0]}")
    except Exception as exc:  # no libmpi: say so, do not crash
        print(f"{'MPI':<16} unavailable: {exc}")
    print(f"{'GPUs':<16} {', '.join(sysd['gpus']) or 'none (nvidia-smi absent or no devices)'}")
    print(f"{'RDMA devices':<16} {', '.join(sysd['rdma_devices']) or 'none (/sys/class/infiniband absent)'}")
    print(f"{'NICs':<16} {', '.join(sysd['nics']) or '-'}")
    for line in nic_lines():
        print(line)
    for line in hwfacts.lines(sysd.get("gpu_rdma") or hwfacts.facts()) + memlock_lines():  # GPUs, RDMA, GPUDirect
        print(line)
    for line in affinity.matrix_lines(gpus=affinity.gpus()):  # what --nic auto picks from (memory/affinity.py)
        print(line)
    for k, v in library_versions().items():
        print(f"{k:<16} {v}")
    return 0
