"""Transport registry: name -> lazy import string + install hint (fsspec style).

Nothing here imports an optional library; ``load(name)`` imports the one
module that implements the transport, and ``probe`` asks it whether it can
run on this machine.
"""
from __future__ import annotations

import importlib
import os

from .base import Transport, Unavailable

# name: (module:Class, install hint shown when its import fails)
REGISTRY: dict[str, tuple[str, str]] = {
    "loopback": ("kvbench.transports.loopback:LoopbackTransport", ""),
    "shm": ("kvbench.transports.shm:ShmTransport", ""),
    "tcp": ("kvbench.transports.tcp:TcpTransport", ""),
    "mpi": ("kvbench.transports.mpi:MpiTransport", ""),
    "mpi-sendrecv": ("kvbench.transports.mpi_sendrecv:MpiSendRecvTransport", ""),
    "nixl": ("kvbench.transports.nixl:NixlTransport", "pip install 'kvbench[nixl]'"),
    "ucx": ("kvbench.transports.ucx:UcxTransport", "pip install 'kvbench[ucx]'"),
    "mooncake": ("kvbench.transports.mooncake:MooncakeTransport", "pip install 'kvbench[mooncake]'"),
    "cuda_ipc": ("kvbench.transports.cuda_ipc:CudaIpcTransport", "pip install 'kvbench[gpu]'"),
    "verbs": ("kvbench.transports.verbs:VerbsTransport", "apt-get install python3-pyverbs"),
    "staged": ("kvbench.transports.staged:StagedTransport", "pip install 'kvbench[gpu]'"),
}


def _extra(spec: str) -> dict[str, tuple[str, str]]:
    """KVBENCH_TRANSPORTS="name=module:Class,...": transports from outside kvbench (tests' lying transports,
    a site's own plugin), registered like the built-in ones."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"KVBENCH_TRANSPORTS item '{item}' is not name=module:Class")
        out[name.strip()] = (target.strip(), "")
    return out


REGISTRY.update(_extra(os.environ.get("KVBENCH_TRANSPORTS", "")))


def names() -> list[str]:
    """All registered transport names, in registry order."""
    return list(REGISTRY)


def load(name: str) -> type[Transport]:
    """Import and return the class for ``name``.

    Raises KeyError for an unknown name and Unavailable (with the install
    hint) when the module or its optional dependency cannot be imported.
    """
    target, hint = REGISTRY[name]
    mod_name, cls_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name == mod_name:
            raise Unavailable("not implemented in this version of kvbench") from None
        raise Unavailable(f"install {hint or exc.name}") from None
    except ImportError as exc:
        raise Unavailable(f"{exc}; {hint}" if hint else str(exc)) from None
    return getattr(mod, cls_name)


def probe(name: str) -> str | None:
    """Why ``name`` cannot run here (one line), or None when it can."""
    try:
        cls = load(name)
    except Unavailable as exc:
        return str(exc)
    try:
        return cls.probe()
    except Exception as exc:  # a probe must never take the run down
        return f"probe failed: {type(exc).__name__}: {exc}"
