"""The ucx transport's buffers: its pool ranges as ucxx views, the pack rows of scattered layers, and the
page-aligned staging they are packed into (sends capped by ``staging_mib``), each built once per descriptor array
(the harness never changes one in place); and the lanes UCX selected (``ep_info``)."""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from kvbench._native import copy_batch
from kvbench.memory import alloc_host

from .base import DST, LEN, SRC, check_descs, import_probe


class UcxBuffers:
    """Mixin of UcxTransport: needs ``_pool``, ``_Array``, ``_parts``, ``_free``, ``_free_bytes``, ``_staged``, ``_in_use``,
    ``_cap``, ``wait`` and ``lib_s``."""

    def _views(self, descs: np.ndarray, col: int) -> list:
        """The pool ranges of ``descs``'s column ``col`` as ucxx buffers, checked and built once per array (the
        harness never changes one in place), as a program keeps its registered views."""
        hit = self._parts.get((id(descs), col))
        if hit is not None and hit[0] is descs:
            return hit[1]
        check_descs(descs, *((self._pool.nbytes, 1 << 62) if col == SRC else (1 << 62, self._pool.nbytes)))
        arr = self._pool.array
        views = [self._Array(arr[o:o + n]) for o, n in zip(descs[:, col].tolist(), descs[:, LEN].tolist())]
        if len(self._parts) >= 4096:
            self._parts.clear()
        self._parts[(id(descs), col)] = (descs, views)
        return views

    def _track(self, h):
        if h.stage is not None:
            if len(self._staged) > 256:  # completed handles are dropped lazily
                self._staged = [x for x in self._staged if x.stage is not None]
            self._staged.append(h)
        return h

    def _over_cap(self, nbytes: int) -> bool:
        return self._in_use + nbytes > self._cap

    def _staging(self, nbytes: int, may_wait: bool) -> np.ndarray:
        while may_wait and self._over_cap(nbytes):
            self._staged = [h for h in self._staged if h.stage is not None]
            sends = [h for h in self._staged if h.sends]  # never a receive: its peer may not have sent yet
            if not sends or self._over_cap(nbytes - sum(h.stage.nbytes for h in sends)):
                break  # what holds the rest is receives or posts not started: waiting cannot make room
            self.wait(sends[0])  # frees the oldest started send's staging
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))  # best fit
            self._free_bytes -= buf.nbytes
        else:

            if self._free_bytes + self._in_use + nbytes > self._cap:
                self._free.clear()  # drop idle buffers of the wrong size before growing
                self._free_bytes = 0
            buf = alloc_host(1 << max(20, (nbytes - 1).bit_length()))  # page-aligned, pre-faulted
        self._in_use += buf.nbytes
        return buf

    def _release(self, stage: np.ndarray) -> None:
        """A finished post's staging: kept for reuse while idle and busy staging fit the cap, else dropped (a
        large case's buffers do not stay resident through the cases after it)."""
        self._in_use -= stage.nbytes
        if self._in_use + self._free_bytes + stage.nbytes <= self._cap:
            self._free.append(stage)
            self._free_bytes += stage.nbytes

    def _rows(self, descs: np.ndarray, col: int) -> tuple[np.ndarray, int]:
        """copy_batch's rows between the pool's ranges (column ``col``) and packed staging, and the packed
        bytes: checked and built once per array (the harness never changes one in place)."""
        key = (id(descs), col, "rows")
        hit = self._parts.get(key)
        if hit is not None and hit[0] is descs:
            return hit[1]
        check_descs(descs, *((self._pool.nbytes, 1 << 62) if col == SRC else (1 << 62, self._pool.nbytes)))
        offs, total = _packed(descs)
        cols = [descs[:, SRC], offs] if col == SRC else [offs, descs[:, DST]]
        rows = np.ascontiguousarray(np.stack(cols + [descs[:, LEN]], 1))
        if len(self._parts) >= 4096:
            self._parts.clear()
        self._parts[key] = (descs, (rows, total))
        return rows, total

    def _pack(self, descs, may_wait: bool):
        """(bytes to send, staging or None): the pool range itself when n == 1."""
        data, stage, rows = self._pack_area(descs, may_wait)
        self._pack_now(stage, rows)
        return data, stage

    def _pack_area(self, descs, may_wait: bool):
        """What a pack needs before the layers are final: (bytes to send, staging or None, pack rows or None);
        the pool range itself when n == 1."""
        if len(descs) == 1:
            check_descs(descs, self._pool.nbytes, 1 << 62)
            s, n = int(descs[0, SRC]), int(descs[0, LEN])
            return self._pool.array[s : s + n], None, None
        rows, total = self._rows(descs, SRC)
        stage = self._staging(total, may_wait)
        return stage[:total], stage, rows

    def _push_area(self, descs):
        """A packed push's ``_pack_area`` reserved when it is prepared, or (None, None, None) when its staging
        would pass the cap: ``start`` reserves it then, waiting for a started send (none may be started yet)."""
        if len(descs) > 1 and self._over_cap(self._rows(descs, SRC)[1]):
            return None, None, None
        return self._pack_area(descs, may_wait=False)

    def _pack_now(self, stage, rows) -> None:
        """The pack a two-sided path must do (data movement, as the library's call: costs.py)."""
        if rows is not None:

            a = time.perf_counter()
            copy_batch(stage, self._pool.array, rows)
            self.lib_s += time.perf_counter() - a

    def _recv_area(self, descs):
        """(receive buffer, staging or None, completion callback that scatters into the pool)."""
        if len(descs) == 1:
            check_descs(descs, 1 << 62, self._pool.nbytes)
            d, n = int(descs[0, DST]), int(descs[0, LEN])
            return self._pool.array[d : d + n], None, lambda h: None
        rows, total = self._rows(descs, DST)
        stage = self._staging(total, may_wait=False)  # receives in flight: not capped (_staging)
        return stage[:total], stage, lambda h: copy_batch(self._pool.array, stage, rows)


def _packed(descs: np.ndarray):
    ends = np.cumsum(descs[:, LEN])
    return ends - descs[:, LEN], int(ends[-1])


_TABLES = {"ucp_tag_send*": "tag_send", "ucp_put*": "put", "ucp_get*": "get"}


def ep_info(ep_handle: int, tables: tuple = ("ucp_tag_send*",)) -> dict:
    """Lanes and the protocol tables ``tables`` (from host memory) from ``ucp_ep_print_info`` (ucxx does not
    expose it): {"lanes": [...], "tag_send"/"put"/"get": [rows]}."""
    try:
        import libucx

        ucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
        libc = ctypes.CDLL(None)
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.fclose.argtypes = [ctypes.c_void_p]
        ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        ucp.ucp_ep_print_info(ep_handle, fp)
        libc.fclose(fp)
        lines = ctypes.string_at(buf, size.value).decode(errors="replace").splitlines()
    except Exception as exc:
        return {"error": str(exc)}
    out: dict = {"lanes": [_lane(ln) for ln in lines if "lane[" in ln]}
    for title in tables:
        rows, table = out.setdefault(_TABLES[title], []), False
        for ln in lines:
            table = table or f"{title} from host memory" in ln
            if table and ln.count("|") == 4:
                rows.append(" ".join(c.strip() for c in ln.strip("# ").strip("|").split("|")))
            elif table and rows:
                break
    return out


def _lane(line: str) -> str:
    """A ``lane[i]:`` line as "<index>:<transport>/<device> <uses>" (uses: am, rma_bw#0, ... after ``seg N``)."""
    words = line.split("lane[", 1)[1].split()
    uses = words[words.index("seg") + 2:] if "seg" in words else words[-1:]
    return " ".join(words[1:2] + uses)


def rma_lanes(info: dict) -> list[str]:
    """The transports of the lanes UCX chose for put/get (``ep_info``'s lanes whose uses name rma)."""
    return [ln.split()[0].split(":", 1)[-1].split("/")[0] for ln in info.get("lanes", [])
            if any(u.startswith("rma") for u in ln.split()[1:])]


def probe_ucxx() -> str | None:
    """Why ucxx cannot run here, or None (both ucx modes make their context, worker and endpoints with it)."""
    # an OSError "undefined symbol" on import: MPI's UCX was loaded first (docs/pitfalls.md#ucx-first)
    return import_probe("ucxx", "install kvbench[ucx]",
                        lambda msg: f"ucxx import failed ({msg}); import ucxx before mpi4py loads MPI")


def versions(uctx) -> dict:
    """info()'s words on the UCX in use: ucxx's and UCX's versions, the context's UCX_TLS and the UCX_ variables."""
    out = {}
    try:
        import ucxx

        out["ucxx"], out["ucx"] = ucxx.__version__, ucxx.__ucx_version__
    except Exception:  # a version is a footnote: never a reason for info() to fail
        pass
    if uctx is not None:
        out["UCX_TLS"] = uctx.config.get("TLS", "?")
        out["env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return out
