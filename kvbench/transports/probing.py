"""What a transport's ``probe`` asks of the machine: an RDMA device, an engine's Python binding."""
from __future__ import annotations

import os


def rdma_present() -> bool:
    """An RDMA device exists (its registrations pin memory)."""
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def import_probe(module: str, missing: str, failed, errors: type[Exception] = Exception) -> str | None:
    """``probe`` for an engine behind a Python binding: None when ``module`` imports, ``missing`` when it is not
    installed, else ``failed(the error's first line)`` (a binding whose native libraries do not load)."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return missing
    except errors as exc:
        return failed((str(exc).splitlines() or [""])[0])
    return None
