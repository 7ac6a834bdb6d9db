"""What MPICH decided about a pair, asked of the MPI library loaded in this process: its device line
(``MPI_Get_library_version``) and, through the MPI tool interface (MPI_T), the control variables that decide
whether its shared memory carries a pair of one host (MPIR_CVAR_NOLOCAL, the clique splits) and which netmod
carries the rest (MPIR_CVAR_CH4_NETMOD; the first of the build's list when empty).

ctypes only, no mpi4py: MPI_T may be initialised at any time, even while MPI runs.  Any failure is None.
"""
from __future__ import annotations

import ctypes
import os

CVARS = ("MPIR_CVAR_NOLOCAL", "MPIR_CVAR_ODD_EVEN_CLIQUES", "MPIR_CVAR_NUM_CLIQUES", "MPIR_CVAR_CH4_NETMOD",
         "MPIR_CVAR_OFI_USE_PROVIDER")
_MAX_VERSION = 8192  # MPI_MAX_LIBRARY_VERSION_STRING of MPICH


def libmpi(maps: str = "/proc/self/maps") -> str | None:
    """The path of the MPI library this process loaded, or None."""
    try:
        with open(maps) as fh:
            for f in (ln.split() for ln in fh):
                if len(f) >= 6 and os.path.basename(f[-1]).startswith("libmpi.so"):
                    return f[-1]
    except OSError:
        pass
    return None


def read(path: str | None = None) -> dict | None:
    """{"path", "version" (its first lines), "device", and each of CVARS this library has (int or str)}; None
    where no MPI library is loaded or it is not MPICH."""
    path = path or libmpi()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        buf, n = ctypes.create_string_buffer(_MAX_VERSION), ctypes.c_int()
        if lib.MPI_Get_library_version(buf, ctypes.byref(n)) != 0:
            return None
        version = buf.value.decode(errors="replace")
        if "MPICH" not in version:
            return None
        out: dict = {"path": path, "version": " / ".join(ln.strip() for ln in version.splitlines()[:4] if ln.strip())}
        for ln in version.splitlines():
            if ln.startswith("MPICH Device:"):
                out["device"] = ln.split(":", 1)[1].strip()
        out.update(_cvars(lib))
        return out
    except (OSError, AttributeError, ValueError):
        return None


def _cvars(lib) -> dict:
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
        return {}
    out: dict = {}
    try:
        for name in CVARS:
            idx, count, handle = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
            if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(idx)) != 0:
                continue
            if lib.MPI_T_cvar_handle_alloc(idx, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
                continue
            buf = ctypes.create_string_buffer(max(16, count.value + 1))
            if lib.MPI_T_cvar_read(handle, buf) == 0:
                # the string cvars are counted in characters (count > 1); the rest here are one int
                out[name] = buf.value.decode(errors="replace") if count.value > 1 else \
                    int.from_bytes(buf.raw[:4], "little", signed=True)
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()
    return out


def netmod(words: dict) -> str:
    """The netmod that carries what shared memory does not: the CVAR, else the first the build has."""
    chosen = str(words.get("MPIR_CVAR_CH4_NETMOD") or "").strip()
    if chosen:
        return chosen
    dev = str(words.get("device", ""))  # "ch4:ucx ofi", "ch4:ofi", "ch3:nemesis"
    return (dev.split(":", 1)[1].split() or ["?"])[0] if ":" in dev else dev or "?"


def shm_carries(words: dict, same_host: bool) -> tuple[bool, str]:
    """Whether MPICH's own shared memory carries a pair of ranks (one host or not), and why not."""
    if not same_host:
        return False, "the pair spans hosts"
    if int(words.get("MPIR_CVAR_NOLOCAL", 0) or 0):
        return False, "MPIR_CVAR_NOLOCAL=1: MPICH treats every rank as remote"
    if int(words.get("MPIR_CVAR_ODD_EVEN_CLIQUES", 0) or 0) or int(words.get("MPIR_CVAR_NUM_CLIQUES", 1) or 1) > 1:
        return False, "MPICH split this host's ranks into cliques (MPIR_CVAR_ODD_EVEN_CLIQUES / NUM_CLIQUES)"
    return True, ""
