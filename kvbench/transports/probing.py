"""What a transport's ``probe`` asks of the machine: an RDMA device, an engine's Python binding."""
from __future__ import annotations

import os


def rdma_present() -> bool:
    """An RDMA device exists (its registrations pin memory)."""
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def import_probe(module: str, missing: str, failed, errors: type[Exception] = Exception) -> str | None:
    """``probe`` for an engine behind a Python binding: None when ``module`` imports, ``missing`` when it is not
    installed, else ``failed(the error's first line)`` (a binding whose native libraries do not load).  The
    environment is left as it was: a binding that sets variables at import (ucxx: UCX_RNDV_FRAG_MEM_TYPE=cuda,
    UCX_RNDV_THRESH...) would hand them to every process launched later, and NIXL's UCX then chose tcp over
    shared memory."""
    import importlib
    import os

    before = dict(os.environ)  # ucxx sets UCX_* defaults at import: a probe must not hand them to later launches
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return missing
    except errors as exc:
        return failed((str(exc).splitlines() or [""])[0])
    finally:
        for k in [k for k in os.environ if k not in before]:
            del os.environ[k]
        os.environ.update(before)
    return None
