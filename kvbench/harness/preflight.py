"""One preflight for the memory a run will really use, before anything is allocated or written.

Pools take RAM; shared-memory pools (shm's segments, MPICH's Win.Allocate)
also take space in /dev/shm, which a container caps at 64 MiB by default and
which fails with SIGBUS, not an error, when overfilled (docs/pitfalls.md#small-dev-shm);
registrations that pin memory (RDMA) need the locked-memory limit.  Every rank
reports its host's facts and every rank reaches the same verdict.
"""
from __future__ import annotations

import resource

from kvbench import memory, transports
from kvbench.harness.setuprows import sweepable
from kvbench.job import cleanup
from kvbench.memory import copy, device

GiB, MiB = 2**30, 2**20
SETUP_BASE_S = 120.0  # connection set-up and registration on a large cluster
SETUP_FILL_BPS = 100e6  # a pool is allocated and filled well above this rate on any host


def setup_seconds(nbytes: int) -> float:
    """The deadline of one transport's setup (allocate, fill, register, connect) for a pool of ``nbytes``."""
    return SETUP_BASE_S + nbytes / SETUP_FILL_BPS


def process_usage() -> dict:
    """Resident memory and open file descriptors of this process."""
    import psutil

    p = psutil.Process()
    return {"rss_bytes": p.memory_info().rss, "open_fds": p.num_fds()}


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _needs(name: str, nbytes: int, layer_bytes: int, options: dict, rank: int, pages: str,
           kind: str = "host", sweep: int = 0) -> dict:
    """What one rank needs for one transport's pools: RAM, /dev/shm, locked memory, device memory (bytes).
    A cuda pool takes device memory (and the device check's share, device.budget), not RAM; the check's
    snapshot and temporaries on the host stay RAM."""
    try:
        cls = transports.load(name)
    except Exception:  # unavailable: its rows are skipped, it allocates nothing
        return {"ram": 0, "shm": 0, "locked": 0, "huge": 0, "vram": 0, "sweep": 0}
    pools = (2 if rank == 0 else 0) if cls.caps.local_only else 1
    sweep = sweep if pools and sweepable(cls) else 0  # --pool-sizes' largest pool, beside this transport's own
    check = 3 * layer_bytes if pools else 0  # the check's temporaries: expected words and a diff per descriptor
    if kind == "cuda":  # device memory is neither host RAM nor pinned host pages
        return {"ram": check, "shm": 0, "locked": 0, "huge": 0, "sweep": 0,
                "vram": pools * nbytes + (device.budget(nbytes) if pools else 0) + sweep}
    placed = dict(cls.memory_needs(nbytes, options)) if pools else {}
    if pages == "huge" and pools and not placed.get("shm"):  # kvbench's own pools from the kernel's huge pages
        placed["huge"] = (pools if cls.caps.local_only else 1) * nbytes
    return {"ram": pools * nbytes + check, "shm": placed.get("shm", 0), "locked": placed.get("locked", 0),
            "huge": placed.get("huge", 0), "vram": 0, "sweep": sweep}


def device_facts(where: dict | None, groups: list[tuple]) -> tuple[str, int, int]:
    """(this rank's GPU as "host:bus", its free and total bytes) when a group uses cuda pools, else ("", 0, 0)."""
    if not where or where.get("gpu", -1) < 0 or not any(len(g) > 3 and g[3] == "cuda" for g in groups):
        return "", 0, 0
    free, total = device.free_bytes("cuda", where["gpu"])
    return f"{where['host']}:{where['gpu_bus'] or where['gpu']}", free, total


def check(comm, groups: list[tuple], options: dict[str, dict], pages: str = "4k", where: dict | None = None,
          sweep: int = 0) -> str | None:
    """Collective: the first shortfall as one line (same on every rank), or None.

    ``groups`` are (transport, pool bytes per rank, largest layer bytes[, memory kind]) in run order;
    transports run one after the other, so each is checked on its own.  ``where``: this rank's placement
    (harness/placing.py): cuda pools are counted against its GPU's free memory, summed over the ranks sharing it.
    ``sweep``: the largest --pool-sizes pool, allocated beside a registering transport's own.
    """
    mine = [_needs(g[0], g[1], g[2], options.get(g[0], {}), comm.rank, pages, g[3] if len(g) > 3 else "host", sweep)
            for g in groups]
    gpu, gpu_free, gpu_total = device_facts(where, groups)
    facts = comm.allgather((comm.hostname, mine, memory.available_bytes(), cleanup.shm_free_bytes(),
                            memlock_limit(), memory.hugepages_free_bytes(), (gpu, gpu_free, gpu_total)))
    for i, g in enumerate(groups):
        name = g[0]
        gpus: dict[str, list] = {}
        for *_, (gid, free, total) in facts:
            if gid:
                gpus.setdefault(gid, [0, free, total, 0])
        for _, needs, *_, (gid, _, _) in facts:
            if gid:
                gpus[gid][0] += needs[i]["vram"]
                gpus[gid][3] += 1
        for gid, (need, free, total, ranks) in gpus.items():
            if need > free:
                return (f"{name}: --memory cuda pools need {need / GiB:.2f} GiB on GPU {gid} ({ranks} rank"
                        f"{'s' if ranks > 1 else ''}) but it has {free / GiB:.2f} GiB free of {total / GiB:.2f} GiB: "
                        "lower --tokens, --pool-factor or the model size")
        hosts: dict[str, dict] = {}
        for host, needs, avail, shm_free, locked, huge_free, _ in facts:
            h = hosts.setdefault(host, {"ram": 0, "shm": 0, "huge": 0, "ranks": 0, "avail": avail, "shm_free": shm_free,
                                        "huge_free": huge_free, "sweep": 0})
            h["ram"] += needs[i]["ram"]
            h["shm"] += needs[i]["shm"]
            h["huge"] += needs[i]["huge"]
            h["sweep"] += needs[i]["sweep"]
            h["ranks"] += 1
            if locked is not None and needs[i]["locked"] > locked:
                return (f"{name}: registering a {needs[i]['locked'] / GiB:.2f} GiB pool pins it, but this rank's "
                        f"locked-memory limit (ulimit -l) on {host} is {locked / MiB:.1f} MiB: raise it "
                        "(ulimit -l unlimited; systemd LimitMEMLOCK=infinity; docker --ulimit memlock=-1)")
        for host, h in hosts.items():
            if h["ram"] > 0.9 * h["avail"]:
                return (f"{name}: pools need {h['ram'] / GiB:.2f} GiB on host {host} ({h['ranks']} ranks) but only "
                        f"{h['avail'] / GiB:.2f} GiB is available: lower --tokens, --pool-factor or the model size")
            if h["ram"] + h["sweep"] > 0.9 * h["avail"]:
                return (f"{name}: --pool-sizes up to {sweep / GiB:.2f} GiB needs {h['sweep'] / GiB:.2f} GiB on host "
                        f"{host} ({h['ranks']} ranks) beside {h['ram'] / GiB:.2f} GiB of pools, but only "
                        f"{h['avail'] / GiB:.2f} GiB is available: give smaller sizes")
            if h["huge"] > h["huge_free"]:
                return (f"{name}: --pages huge needs {h['huge'] / GiB:.2f} GiB of reserved huge pages on host {host} "
                        f"({h['ranks']} ranks) but {h['huge_free'] / GiB:.2f} GiB is free: reserve more "
                        "(sysctl vm.nr_hugepages=N, or hugepages=N at boot) or use --pages thp")
            if h["shm"] > h["shm_free"]:
                return (f"{name}: pools need {h['shm'] / GiB:.2f} GiB in {cleanup.SHM_DIR} on host {host} "
                        f"({h['ranks']} ranks) but {h['shm_free'] / MiB:.1f} MiB is free there: give the container a "
                        "larger /dev/shm (docker run --shm-size=8g; Kubernetes: an emptyDir with medium: Memory), "
                        "or lower --tokens or --pool-factor, or run without this transport")
    return None


def device_reason(cls, case: dict) -> str | None:
    """Why a transport cannot run a case's memory kind and copy engine here, or None."""
    kind = case.get("memory", "host")
    if kind not in cls.caps.memory:
        if cls.name == "staged" and kind == "host":
            return "staged: --memory host has nothing to stage (use torch-cpu, pinned or cuda)"
        return f"{cls.name} moves {', '.join(cls.caps.memory)} memory, not {kind}"
    return device.probe(kind) or copy.probe(case.get("copy", "batch"), "cuda" if kind == "cuda" else "cpu")
