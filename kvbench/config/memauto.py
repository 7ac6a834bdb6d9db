"""memory 'auto' (the procurement suites' memory axis): device pools for the transports that move device memory
where this machine has a GPU, host memory for the rest, and the preamble's line saying which."""
from __future__ import annotations

import functools

from kvbench.memory import device, driver

# the transports that move device memory (their caps.memory holds cuda): what memory 'auto' gives device pools
DEVICE_PATHS = ("cuda_ipc", "staged", "verbs")


@functools.lru_cache(maxsize=1)
def _gpu_here() -> bool:
    """A GPU the driver sees and torch can allocate on (device pools are torch tensors: memory/device.py)."""
    return driver.device_count() > 0 and device.probe("cuda") is None


def auto_memory(transport: str) -> str:
    """memory 'auto' for one transport: cuda where it moves device memory and this machine has a GPU, else host."""
    return "cuda" if transport in DEVICE_PATHS and _gpu_here() else "host"


def memory_lines(suite, cases: list[dict]) -> list[str]:
    """The preamble's word on memory 'auto': which transports run device pools, or that there is no GPU here."""
    if "auto" not in suite.axes.memory:
        return []
    dev = sorted({c["transport"] for c in cases if c["memory"] == "cuda" and c["transport"] in DEVICE_PATHS})
    if dev:
        return [f"# memory auto: device pools (cuda) for {', '.join(dev)}; host memory for the rest"]
    wanted = [t for t in suite.axes.transport if t in DEVICE_PATHS]
    return ["# memory auto: no GPU: host memory only" + (f" ({', '.join(wanted)} move device memory: their rows "
                                                          "say why they cannot run)" if wanted else "")]
