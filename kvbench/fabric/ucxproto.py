"""What UCX chose, asked of UCX itself inside this process: every endpoint each loaded copy of UCX holds (its
in-process VFS tree, ``/ucp/context/<name>/worker/<ptr>/ep/<ptr>``) and ``ucp_ep_print_info`` of each (its lanes,
and per operation the protocol table the selection made).

One process may hold several copies of UCX (MPICH's, NIXL's and ucxx's wheels each bring one): each is read
through its own ``libucs``/``libucp``, found in ``/proc/self/maps``.  ctypes and the stdlib only; any failure is
an empty answer and a reason, never an exception (the rows then say ``-`` and why).
"""
from __future__ import annotations

import ctypes
import os
import re

DATA_USES = ("am", "am_bw", "rma", "rma_bw", "tag", "amo", "rkey_ptr")  # a lane's uses that carry payload
_LANE = re.compile(r"lane\[\d+\]:\s+\d+:(\S+?)/(\S+?)(?:\.\d+)?\s.*?(?:->.*?)?$")
_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p)


def copies(maps: str = "/proc/self/maps") -> list[tuple[str, str]]:
    """(libucs, libucp) of every copy of UCX loaded in this process, paired by their folder."""
    try:
        with open(maps) as fh:
            libs = {f[-1] for f in (ln.split() for ln in fh) if len(f) >= 6 and f[-1].startswith("/") and ".so" in f[-1]}
    except OSError:
        return []
    out = []
    for ucs in sorted(p for p in libs if re.match(r"libucs(-[0-9a-f]+)?\.so", os.path.basename(p))):
        ucp = [p for p in libs if os.path.dirname(p) == os.path.dirname(ucs)
               and re.match(r"libucp(-[0-9a-f]+)?\.so", os.path.basename(p))]
        if ucp:
            out.append((ucs, ucp[0]))
    return out


def _ls(ucs, path: str) -> list[str]:
    names: list[str] = []
    cb = _CB(lambda n, _arg: names.append(n.decode(errors="replace")))
    return names if ucs.ucs_vfs_path_list_dir(path.encode(), cb, None) == 0 else []


def _print_ep(ucp, ep: int) -> str:
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    ucp.ucp_ep_print_info(ctypes.c_void_p(ep), ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    text = ctypes.string_at(buf, size.value).decode(errors="replace")
    libc.free(ctypes.cast(buf, ctypes.c_void_p))
    return text


def endpoints(keep=lambda lib, context: True) -> tuple[list[dict], str]:
    """Every UCP endpoint of the copies and contexts ``keep(libucs path, context name)`` accepts: per endpoint
    {lib, context, lanes: [(transport, device, uses)], protocols: [table lines]}; and why none, if none."""
    found, why = [], "no copy of UCX is loaded in this process"
    for ucs_path, ucp_path in copies():
        try:
            ucs, ucp = ctypes.CDLL(ucs_path), ctypes.CDLL(ucp_path)
            ucs.ucs_vfs_path_list_dir.argtypes = [ctypes.c_char_p, _CB, ctypes.c_void_p]
            ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        except (OSError, AttributeError) as exc:
            why = f"UCX at {os.path.dirname(ucs_path)} cannot be asked: {exc}"
            continue
        why = "UCX holds no endpoint of this transport"
        for ctx in _ls(ucs, "/ucp/context"):
            if not keep(ucs_path, ctx):
                continue
            for w in _ls(ucs, f"/ucp/context/{ctx}/worker"):
                _ls(ucs, f"/ucp/context/{ctx}/worker/{w}")  # listing a worker refreshes its endpoints' folders
                for ep in _ls(ucs, f"/ucp/context/{ctx}/worker/{w}/ep"):
                    if not ep.startswith("0x"):  # a debug build names endpoints, not their address
                        why = "this UCX build names its endpoints: their lanes cannot be printed"
                        continue
                    text = _print_ep(ucp, int(ep, 16))
                    found.append({"lib": os.path.dirname(ucs_path), "context": ctx, "lanes": lanes(text),
                                  "protocols": protocols(text)})
    return found, "" if found else why


def lanes(text: str) -> list[tuple[str, str, str]]:
    """(transport, device, uses) per lane of ``ucp_ep_print_info``'s text ('sysv', 'memory', 'am am_bw#0')."""
    out = []
    for ln in text.splitlines():
        if "lane[" not in ln:
            continue
        m = _LANE.search(ln)
        if m:
            tail = ln.split("->", 1)[1].split()[1:] if "->" in ln else []
            uses = " ".join(t for t in tail if not t.startswith(("seg", "md[")) and not t.isdigit())
            out.append((m.group(1), m.group(2), uses))
    return out


def protocols(text: str) -> list[str]:
    """The protocol table lines (range | description | transport/device) of ``ucp_ep_print_info``'s text."""
    return [" ".join(c.strip() for c in ln.strip("# ").strip("|").split("|")) for ln in text.splitlines()
            if ln.count("|") == 4 and "cfg#" not in ln and "Range" not in ln]


def data_lanes(eps: list[dict]) -> list[tuple[str, str]]:
    """(transport, device) of the lanes that carry the payload to a peer: those for bulk data (rma_bw, am_bw)
    where an endpoint has them, else every lane for data (am, rma, tag ...).  An endpoint with a 'self' lane is
    the process's endpoint to itself, left out; so are lanes for wire-up, keepalive or small messages alone
    beside bulk lanes (NIXL's notifications ride a tcp lane while its WRITEs go through cma)."""
    out: list[tuple[str, str]] = []
    for ep in eps:
        if any(t == "self" for t, _, _ in ep["lanes"]):
            continue
        used = [(t, d, {u.split("#")[0] for u in uses.split()}) for t, d, uses in ep["lanes"]]
        bulk = [(t, d) for t, d, u in used if u & {"rma_bw", "am_bw"}]
        ls = bulk or [(t, d) for t, d, u in used if u & set(DATA_USES)]
        out += [x for x in ls if x not in out]
    return out


def short(eps: list[dict]) -> str:
    """The transports UCX puts the payload on, '/'-joined in lane order ('cma', 'tcp', 'rc_mlx5'); ''."""
    return "/".join(dict.fromkeys(t for t, _ in data_lanes(eps)))


def from_lane_words(words: list[str]) -> list[dict]:
    """Endpoints as ``endpoints`` gives them, from a transport's own words ('3:sysv/memory.0 am', ...)."""
    out = []
    for w in words:
        head, _, uses = w.partition(" ")
        tl, _, dev = head.split(":", 1)[-1].partition("/")
        out.append((tl, dev.split(".")[0], uses))
    return [{"lib": "", "context": "", "lanes": out, "protocols": []}] if out else []
