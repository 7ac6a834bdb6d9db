"""cuda_ipc: GPU to GPU within a node (NVLink, or PCIe peer-to-peer; two ranks on one GPU too), one-sided.

Written from torch's documented sharing of CUDA storages; these machines have no GPU, so none of it has run
here (docs/gpu.md lists it).

* Export once: each rank's pool is one device allocation (memory ``cuda``); ``register`` exports the whole
  storage through torch's CUDA IPC (``UntypedStorage._share_cuda_``: the handle of the *base* allocation plus
  this storage's offset in it, so a pool carved from the caching allocator is still addressed right).
* Open once: ``connect`` maps each peer's pool (``UntypedStorage._new_shared_cuda``; the mapping costs up to
  100s of ms, never per request) and views it as a uint8 tensor.  A handle cannot be opened by the process that
  exported it, and the exporter must outlive the mapping: ``close`` drops the mappings, then the harness's
  barrier, then the pools go.
* Move: push writes into the peer's pool, pull reads from it, with the copy engine of the case (copy.py:
  ``memcpy`` one cuMemcpyAsync per descriptor, ``kernel`` one gather/scatter launch, ``batch``
  cuMemcpyBatchAsync) on a stream of this transport that first waits for the work already queued on the
  pool (the check pass writes its epoch there).  ``wait`` synchronises the layer's CUDA event, so the host
  clock is stamped when the device says the copy completed.  The destination learns it from the harness's
  notification (one-sided: ``notifies`` False).
* The copy runs on this rank's GPU (the initiator's stream), never the peer buffer's: a kernel launched on a
  stream of another device fails.  ``copy`` auto takes the kernel engine (copy.default).
* Link: from NVML (nvidia-ml-py, when installed), found by the GPU's UUID (NVML's index follows PCI order, not
  CUDA_VISIBLE_DEVICES or CUDA's FASTEST_FIRST), the active NVLink links whose far end is the peer's GPU (its
  PCI bus id) or an NVSwitch, and their generation; else "PCIe (no NVLink to the peer)"; in ``info()`` and so
  in the sidecar.
"""
from __future__ import annotations

import pickle
import time

import numpy as np

from kvbench.memory import copy as C

from ..memory import device
from .base import Caps, Transport, TransportError, check_descs


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    caps = Caps(memory=("cuda",), ops=("push", "pull"), one_sided=True, multi_node=False, notifies=False)

    @classmethod
    def probe(cls) -> str | None:
        why = device.probe("cuda")
        if why:
            return why
        return C.probe("memcpy", "cuda")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.peers: dict[int, object] = {}
        self.stream = None
        self.engine = C.default(self.name, "cuda")[0] if ctx.copy == C.AUTO else ctx.copy

    def register(self, pool) -> bytes:
        import torch

        if getattr(pool, "tensor", None) is None or pool.tensor.device.type != "cuda":
            raise TransportError("cuda_ipc: the pool must be CUDA memory (--memory cuda)")
        self.pool, self.dev = pool, pool.tensor
        self.stream = torch.cuda.Stream(device=self.dev.device)
        storage = self.dev.untyped_storage()
        off = self.dev.data_ptr() - storage.data_ptr()  # the tensor's start in its storage (0 for our pools)
        self.uuid = str(torch.cuda.get_device_properties(self.dev.device).uuid)
        return pickle.dumps({"share": storage._share_cuda_(), "offset": off, "nbytes": pool.nbytes,
                             "host": self.ctx.hostname, "device": self.dev.device.index, "uuid": self.uuid,
                             "bus": _bus_id(self.dev.device.index)})

    def connect(self, peers: dict[int, bytes]) -> None:
        import torch

        self.link = {}
        for rank, blob in peers.items():
            m = pickle.loads(blob)
            if m["host"] != self.ctx.hostname:
                raise TransportError(f"cuda_ipc: rank {rank} is on {m['host']}, not {self.ctx.hostname}: CUDA IPC "
                                     "works within one node (use verbs, nixl or staged between nodes)")
            with torch.cuda.device(self.dev.device):
                storage = torch.UntypedStorage._new_shared_cuda(*m["share"])
            t = torch.empty(0, dtype=torch.uint8, device=storage.device)
            t.set_(storage, m["offset"], (m["nbytes"],))
            self.peers[rank] = t
            self.link[rank] = link_between(self.uuid, m["uuid"], m.get("bus", ""))

    def post(self, op: str, peer: int, descs: np.ndarray, tag: int = 0):
        import torch

        there = self.peers[peer]
        src, dst = (self.dev, there) if op == "push" else (there, self.dev)
        check_descs(descs, C._nbytes(src), C._nbytes(dst))
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))  # after the pool's queued writes
        with torch.cuda.stream(self.stream):
            C.copy(self.engine, dst, src, descs, stream=self.stream, device=self.dev.device.index)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def wait(self, handle) -> float | None:
        if handle is None:  # the target of a one-sided copy (serve): nothing of its own to wait for
            return None
        handle.synchronize()
        return time.perf_counter()  # the host clock when the device reported the copy complete

    def info(self) -> dict:
        return {"copy": self.engine, "link": {str(r): v for r, v in getattr(self, "link", {}).items()}}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.peers.clear()  # unmapped before the exporters free their pools (the harness's barrier follows)


def _bus_id(index: int) -> str:
    """This GPU's PCI bus id through the driver (the key NVML's links name their far end by), or ""."""
    try:
        from kvbench.memory import driver

        return driver.pci_bus_id(index)
    except Exception:  # a fact for the link's name only
        return ""


def _norm_bus(bus) -> str:
    """A PCI bus id as domain:bus:device.function in lower case (NVML writes an 8-digit domain, sysfs 4)."""
    b = (bus.decode() if isinstance(bus, bytes) else str(bus)).strip("\x00 ").lower()
    parts = b.split(":")
    if len(parts) != 3:
        return b
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def link_between(uuid: str, peer_uuid: str, peer_bus: str) -> str:
    """NVLink links (and version) from this GPU to the peer's, or why that is unknown; NVML, lazily."""
    try:
        import pynvml
    except ImportError:
        return "unknown (nvidia-ml-py not installed)"
    try:
        pynvml.nvmlInit()
        if uuid.removeprefix("GPU-") == peer_uuid.removeprefix("GPU-"):
            return "same GPU"
        h = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid.removeprefix("GPU-"))
        up, version, via = 0, None, set()
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if not pynvml.nvmlDeviceGetNvLinkState(h, link):
                    continue
                far = _norm_bus(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                switch = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
            except pynvml.NVMLError:
                break
            if switch or (peer_bus and far == _norm_bus(peer_bus)):
                up += 1
                version = pynvml.nvmlDeviceGetNvLinkVersion(h, link)
                via.add("NVSwitch" if switch else "direct")
        return f"NVLink{version} x{up} ({'+'.join(sorted(via))})" if up else "PCIe (no NVLink to the peer)"
    except Exception as exc:  # NVML missing or refusing: a fact to report, never a failure
        return f"unknown (NVML: {exc})"
