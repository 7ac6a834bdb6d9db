"""What carried a case's bytes, in each engine's own words: the rows' ``carrier_proto`` (a short name such as
``ucx:sysv/cma``, ``nixl/ucx:tcp``, ``mpich:shm``, ``tcp:lo``), its path class (shm, tcp, rdma, nvlink, pcie)
and the engine's raw words for the sidecar.

Two sources, both of this process: the engine (a transport's ``info()``; UCX's endpoints through ucxproto;
MPICH's control variables through mpich) and this process's own TCP connections (procsock): when they carried
at least half of the payload this rank moved, the bytes went over TCP whatever the engine said, and the row
says so.  ``-`` with a reason where neither can tell.  Stdlib only.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from kvbench.fabric import mpich, ucxproto

UNKNOWN = "-"
# a transport's (UCX's, libfabric's) name -> its path class; the first class of a name's parts decides
_CLASS = {"memcpy": "shm", "shm": "shm", "sysv": "shm", "posix": "shm", "cma": "shm", "xpmem": "shm",
          "knem": "shm", "sm": "shm", "tcp": "tcp", "sockets": "tcp", "rc": "rdma", "rc_mlx5": "rdma",
          "rc_verbs": "rdma", "dc": "rdma", "dc_mlx5": "rdma", "ud": "rdma", "ud_mlx5": "rdma", "ud_verbs": "rdma",
          "gga": "rdma", "verbs": "rdma", "rdma": "rdma", "efa": "rdma", "ib": "rdma", "nvlink": "nvlink",
          "cuda_ipc": "nvlink", "pcie": "pcie"}
STAGING = ("cuda_copy", "rocm_copy", "ze_copy")  # UCX's own device<->host copies: not a path between ranks


class Carried(NamedTuple):
    """One rank's account of what carried its bytes."""

    proto: str  # the short name, or UNKNOWN
    evidence: str  # what says so (or, with UNKNOWN, why nobody can)
    raw: dict  # the engine's own words (the sidecar)


def klass(proto: str) -> str:
    """The path class of a short name ('ucx:sysv/cma' -> 'shm', 'tcp:lo' -> 'tcp', 'verbs:mlx5_0' -> 'rdma');
    classes joined by '+' where lanes differ; '' when unknown."""
    if not proto or proto == UNKNOWN:
        return ""
    head, _, tail = proto.rpartition(":")
    words = [w.split(";")[0] for w in tail.split("/") if w and w not in STAGING]
    found = [c for c in dict.fromkeys(_CLASS.get(w, "") for w in words) if c]
    if not found:  # the tail names devices or interfaces (tcp:lo, verbs:mlx5_0): the engine's name says
        found = [_CLASS.get(head.rpartition("/")[2], "")]
    return "+".join(c for c in found if c)


def _ucx(eps: list[dict], why: str, prefix: str) -> tuple[str, str, dict]:
    tls = ucxproto.short(eps)
    raw = {"endpoints": [{"context": e["context"], "lanes": [" ".join(x).strip() for x in e["lanes"]],
                          "protocols": e["protocols"][:12]} for e in eps]}
    if not tls:
        return UNKNOWN, why or "UCX named no lane to a peer", raw
    return f"{prefix}:{tls}", "UCX's endpoint lanes (ucp_ep_print_info)", raw


def _mpi(info: dict, same_host: bool) -> tuple[str, str, dict]:
    words = mpich.read()
    if words is None:
        lib = str(info.get("mpi_library", "this MPI library"))
        return UNKNOWN, f"{lib}: only MPICH says which path carried a pair", {"mpi_library": lib}
    shm, why_not = mpich.shm_carries(words, same_host)
    if shm:
        return "mpich:shm", "MPICH's control variables: ranks of one host, its shared memory", words
    nm = mpich.netmod(words)
    if nm == "ucx":
        lib_dir = os.path.dirname(words["path"])
        proto, why, raw = _ucx(*ucxproto.endpoints(
            lambda lib, ctx: lib.startswith(lib_dir) and "site-packages" not in lib and not ctx.startswith("kvb-")),
            "mpich/ucx")
        return proto, f"{why_not}; its netmod ucx: {why}", dict(words, ucx=raw)
    if nm == "ofi":
        prov = words.get("MPIR_CVAR_OFI_USE_PROVIDER") or os.environ.get("FI_PROVIDER", "")
        name = f"mpich/ofi:{prov.split(';')[0]}" if prov else UNKNOWN
        return name, f"{why_not}; its netmod ofi" + ("" if prov else ": provider not named"), words
    return f"mpich/{nm}", f"{why_not}; its netmod {nm}", words


def engine(name: str, info: dict, run_id: str, rank: int, same_host: bool) -> tuple[str, str, dict]:
    """(short name, evidence or reason, raw words) from the engine alone."""
    if name == "loopback":
        return "memcpy", "one process copies pool to pool", {}
    if name == "shm":
        return "shm", "kvbench's shared-memory segment, mapped by its peer", {"segment": info.get("segment", "")}
    if name == "tcp":
        ifs = [i for i in info.get("rail_ifnames") or [info.get("ifname")] if i]
        return ("tcp:" + ",".join(ifs) if ifs else UNKNOWN, "tcp's sockets" if ifs else "tcp named no interface",
                {"rail_addrs": info.get("rail_addrs", []), "ifnames": ifs})
    if name == "ucx":
        if isinstance(info.get("lanes"), dict) and info["lanes"]:  # the transport's own endpoints' lanes
            eps = [e for v in info["lanes"].values() for e in ucxproto.from_lane_words(v.get("lanes") or [])]
            return _ucx(eps, "ucx reported no lanes", "ucx")
        return _ucx(*ucxproto.endpoints(lambda lib, ctx: not ctx.startswith("kvb-") and "mpich" not in lib), "ucx")
    if name == "nixl":
        proto, why, raw = _ucx(*ucxproto.endpoints(lambda lib, ctx: ctx.startswith(f"kvb-{run_id}-{rank}-")),
                               "nixl/ucx")
        return proto, f"NIXL backend {info.get('backend', 'UCX')}: {why}", dict(raw, nixl=info.get("nixl", ""))
    if name in ("mpi", "mpi-sendrecv"):
        return _mpi(info, same_host)
    if name == "mooncake":
        used = info.get("protocol")
        return (f"mooncake:{used}" if used else UNKNOWN, "Mooncake's protocol in use (its topology)" if used
                else "Mooncake named no protocol", {k: info.get(k) for k in ("protocol", "requested", "session")})
    if name == "cuda_ipc":
        links = {str(k): str(v) for k, v in (info.get("link") or {}).items()}
        kinds = {"pcie" if v.lower().startswith("pcie") else "nvlink" for v in links.values()}
        if not kinds:
            return UNKNOWN, "cuda_ipc named no link to its peer (no NVML)", {"link": links}
        return "cuda_ipc:" + "/".join(sorted(kinds)), "NVML's links to the peer's GPU", {"link": links}
    if name == "verbs":
        dev = info.get("device")
        return (f"verbs:{dev}" if dev else UNKNOWN, f"the verbs device ({info.get('link', '')})",
                {k: info.get(k) for k in ("device", "link", "gid_index")})
    if name == "staged":
        inner = str(info.get("inner", "?"))
        proto, why, raw = engine(inner, info.get("inner_info") or {}, run_id + "s", rank, same_host)
        return (f"staged/{proto}" if proto != UNKNOWN else UNKNOWN), f"staged over {inner}: {why}", raw
    return UNKNOWN, f"{name} does not say which path it used", {}


def carried(name: str, info: dict, run_id: str, rank: int, same_host: bool, sockets: dict[str, tuple[int, int]],
            sent: int, received: int) -> Carried:
    """The engine's words, checked against this process's own TCP connections over the same timed iterations
    (``sockets``: procsock.delta; ``sent``/``received``: the payload this rank moved in them)."""
    try:
        proto, why, raw = engine(name, info, run_id, rank, same_host)
    except Exception as exc:  # an engine's words that cannot be read are an unknown, never a failed case
        proto, why, raw = UNKNOWN, f"{name}'s words could not be read: {type(exc).__name__}: {exc}", {}
    need = sent + received
    along = sum(tx for tx, _ in sockets.values()) * (sent > 0) + sum(rx for _, rx in sockets.values()) * (received > 0)
    raw = dict(raw, sockets={k: list(v) for k, v in sockets.items()})
    if need and 2 * along >= need:  # this process's own sockets carried the payload: it went over TCP
        via = ",".join(sorted(sockets, key=lambda k: -sum(sockets[k])))
        said = f"{proto} ({why})" if proto != UNKNOWN else why
        if name == "tcp":
            return Carried(f"tcp:{via}", f"this process's sockets carried {along} B over {via}", raw)
        if klass(proto) != "tcp":
            head = proto.split(":")[0] if proto != UNKNOWN else name
            return Carried(f"{head}:tcp", f"this process's sockets carried {along} B over {via}; the engine said {said}",
                           raw)
        return Carried(proto, f"{why}; this process's sockets carried {along} B over {via}", raw)
    return Carried(proto, why, raw)


def via(raw: dict) -> str:
    """The interfaces this process's sockets used ('' when they carried nothing)."""
    return ",".join(k for k, v in (raw.get("sockets") or {}).items() if sum(v))
