"""Where each rank's device work runs: its GPU (local rank, or --gpu-map) bound before any pool, the RDMA NIC nearest
that GPU, and what the rows, the sidecar and the preamble say about it (memory/placement.py holds the rules).

``place`` is collective: every rank learns every rank's placement, so a row can say whether its pair shares a GPU.
Without --memory cuda no rank touches CUDA: its placement says gpu -1.
"""
from __future__ import annotations

import os

from kvbench import transports
from kvbench.memory import affinity, device, driver, placement

NO_GPU = {"gpu": -1, "gpu_bus": "", "nic": "", "nic_hops": -1, "netdevs": [], "nic_rails": 1, "nic_level": "",
          "nic_why": ""}
UCX_BASED = ("ucx", "nixl", "mpi", "mpi-sendrecv")  # the transports --nic reaches through UCX_NET_DEVICES


def place_nics(mine: dict, nic: list[str] | None, sysfs: str = "/sys") -> None:
    """--nic: this rank's interfaces, nearest first (auto: all of them ranked, one used unless tcp's -O rails says
    more; names: those, every one used), the nearest's path type and why; UCX learns them through
    UCX_NET_DEVICES / UCX_MAX_RNDV_RAILS unless the user set those."""
    if not nic:
        return
    gpu_pci = os.path.join(sysfs, "bus", "pci", "devices", mine["gpu_bus"].lower()) if mine["gpu_bus"] else ""
    ranked = affinity.rank_nics(os.sched_getaffinity(0), sysfs, gpu_pci if os.path.exists(gpu_pci) else "",
                                None if nic == ["auto"] else nic)
    names = [n["name"] for n in ranked] if nic == ["auto"] else list(nic)
    if not names:
        mine["error"] = f"--nic auto: rank on {mine['host']} has no network interface but loopback"
        return
    first = next(n for n in ranked if n["name"] == names[0])
    mine.update(netdevs=names, nic_rails=1 if nic == ["auto"] else len(names), nic_level=first["level"],
                nic_why=f"{names[0]}: {first['why']}" + (" (--nic auto)" if nic == ["auto"] else " (--nic)"))
    used = names[: mine["nic_rails"]]
    os.environ.setdefault("UCX_NET_DEVICES", ",".join(used))
    os.environ.setdefault("UCX_MAX_RNDV_RAILS", str(len(used)))


def place(comm, cases: list[dict], gpu_map: list[int] | None, nic: list[str] | None = None) -> list[dict]:
    """Bind this rank's GPU (cuda cases only) and find the NIC nearest it; every rank's placement, by rank."""
    mine = dict(NO_GPU, host=comm.hostname, local_rank=comm.local_rank(), error="")
    if any(c.get("memory") == "cuda" for c in cases) and device.probe("cuda") is None:
        gpu = placement.gpu_for(mine["local_rank"], driver.device_count(), gpu_map)
        try:
            device.bind(gpu)
            mine["gpu"] = gpu
            mine["gpu_bus"] = driver.pci_bus_id(gpu)
        except Exception as exc:  # said by every rank below: none is left waiting in the gather
            mine["error"] = f"rank {comm.rank} on {comm.hostname}: binding GPU {gpu} failed: {exc}"
        near = placement.nearest_nic(mine["gpu_bus"]) if mine["gpu_bus"] else None
        if near is not None:
            mine["nic"], mine["nic_hops"] = near
    place_nics(mine, nic)
    where = comm.allgather(mine)
    failed = [w["error"] for w in where if w["error"]]
    if failed:
        raise placement.PlacementError(failed[0])
    return where


def context_fields(where: dict, rank: int, pairs) -> dict:
    """What a transport's Context takes from this rank's placement: its GPU, NICs and rails, and whether one of
    its pairs also runs the other way (a duplex pair: bidir, a matrix)."""
    return {"gpu": where["gpu"], "nic": where["nic"], "netdevs": where.get("netdevs", []),
            "nic_rails": where.get("nic_rails", 1), "duplex": any((d, s) in pairs for s, d in pairs if rank in (s, d))}


def same_gpu(where: list[dict], a: int, b: int) -> bool:
    """Ranks ``a`` and ``b`` use one GPU (one host, one device)."""
    x, y = where[a], where[b]
    if x["gpu"] < 0 or y["gpu"] < 0 or x["host"] != y["host"]:
        return False
    return (x["gpu_bus"] or x["gpu"]) == (y["gpu_bus"] or y["gpu"])


def columns(where: list[dict] | None, rank: int, case: dict, src: int, dst: int) -> dict:
    """A row's placement columns: this rank's GPU and NIC for a cuda row, and whether its pair shares the GPU."""
    if not where or case.get("memory") != "cuda":
        return {"gpu": -1, "nic": "", "same_gpu": False}
    me = where[rank]
    try:
        network = transports.load(case["transport"]).caps.network
    except Exception:  # unavailable: its row is skipped anyway
        network = False
    return {"gpu": me["gpu"], "nic": me["nic"] if network else "", "same_gpu": same_gpu(where, src, dst)}


def nic_lines(where: list[dict] | None) -> list[str]:
    """--nic: each rank's NIC(s) and why, and a warning for a rank whose NIC is on the far socket (SYS)."""
    if not where or not any(w.get("netdevs") for w in where):
        return []
    out = [f"# nic rank{r}: {','.join(w['netdevs'][: w['nic_rails']])}  {w['nic_why']}" for r, w in enumerate(where[:8])]
    out += ["# ..."] if len(where) > 8 else []
    far = [(r, w) for r, w in enumerate(where) if w.get("nic_level") == "SYS"]
    if far:
        r, w = far[0]
        out.append(f"# WARNING: {len(far)} rank(s) use a NIC on the far socket, e.g. rank {r}: {w['nic_why']}: its "
                   "bytes cross the sockets' interconnect (Mooncake's EFA note: half the throughput); pin the rank "
                   "to the NIC's socket (--bind, numactl) or give it a near NIC")
    virt = [r for r, w in enumerate(where) if w.get("nic_level") == "VIRT"]
    if virt and len(virt) == len(where):
        out.append("# NOTE: every rank's NIC is virtual (no PCI device): affinity cannot say which is near")
    return out


def preamble(where: list[dict] | None, cases: list[dict], pairs) -> list[str]:
    """The preamble's placement lines: each rank's NIC (--nic), its GPU and NIC, and a note for pairs sharing a GPU."""
    nics = nic_lines(where)
    if not where or not any(c.get("memory") == "cuda" for c in cases):
        return nics
    shown = "  ".join(f"rank{r}={w['gpu']}" + (f"({w['nic']})" if w["nic"] else "") for r, w in enumerate(where[:8]))
    out = nics + [f"# gpus: {shown}" + (" ..." if len(where) > 8 else "")]
    shared = [(s, d) for s, d in pairs if same_gpu(where, s, d)]
    if shared:
        s, d = shared[0]
        out.append(f"# NOTE: ranks {s} and {d} share GPU {where[s]['gpu']} on {where[s]['host']}: their cuda rows "
                   "measure HBM copies on one GPU, not a link between GPUs (give each rank its own GPU: --gpu-map)")
    return out
