"""gpu-check's floors and goals: what each row is compared with, and the goals a reader judges the table by.

A floor is a rate measured (or, for PCIe, read from the device) in the same run: the device's own copy (a large
torch ``copy_`` device to device) for copies and the check, the PCIe link (generation x width) for host<->device,
host tcp between host pools for staged, a plain torch matmul for the real prefill.  Each row carries its ratio
to its floor; a row with a goal says so, and on a GPU one that misses it reads "below goal" (FAIL stays for wrong
bytes and errors).  Pure functions here; the steps (checks.py, ipc.py, launched.py) measure.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

# GB/s per lane and direction after line coding: 8b/10b up to gen2, 128b/130b for gen3 to gen5, FLIT for gen6
PER_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
GEN_OF_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
SYSFS_PCI = "/sys/bus/pci/devices"

DEVICE_COPY, PCIE, HOST_TCP, MATMUL = "device copy", "PCIe", "host tcp", "matmul"


def pcie_gbps(gen: int, width: int) -> float:
    """A PCIe link's rate per direction, GB/s (10^9 B/s), from its generation and lane count."""
    if gen not in PER_LANE_GBPS:
        raise ValueError(f"PCIe generation {gen} is not one of {sorted(PER_LANE_GBPS)}")
    if width < 1:
        raise ValueError(f"a PCIe link has 1 lane or more, not {width}")
    return PER_LANE_GBPS[gen] * width


def gen_of_speed(text: str) -> int | None:
    """The generation sysfs's link speed names ("32.0 GT/s PCIe", "8 GT/s"), or None ("Unknown", garbage)."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text or "")
    return GEN_OF_GTS.get(float(m.group(1))) if m else None


@dataclass
class Link:
    """A PCIe link: generation and width the rate is taken from, where they were read, and the current ones
    (a GPU at rest trains its link down, so the rate is the link's maximum)."""

    gen: int
    width: int
    source: str
    current: str = ""

    @property
    def gbps(self) -> float:
        return pcie_gbps(self.gen, self.width)

    def text(self) -> str:
        now = f"; now {self.current}" if self.current else ""
        return f"gen{self.gen} x{self.width} ({self.source}{now}): {self.gbps:.1f} GB/s per direction"


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


def link_from_sysfs(bus_id: str, root: str = SYSFS_PCI) -> Link:
    """The link of PCI device ``bus_id`` (domain:bus:device.function) from sysfs: the lower of its own maximum and
    its upstream port's, speed and width each (a gen5 GPU in a gen4 slot runs gen4).  OSError/ValueError when
    sysfs does not say."""
    here = os.path.join(root, bus_id)
    gen, width = gen_of_speed(_read(os.path.join(here, "max_link_speed"))), int(_read(os.path.join(here, "max_link_width")))
    if gen is None:
        raise ValueError(f"{here}/max_link_speed names no PCIe generation")
    source = "sysfs max"
    up = os.path.dirname(os.path.realpath(here))
    try:
        ugen, uwidth = gen_of_speed(_read(os.path.join(up, "max_link_speed"))), int(_read(os.path.join(up, "max_link_width")))
        if ugen:
            gen, width, source = min(gen, ugen), min(width, uwidth), "sysfs max, with its upstream port"
    except (OSError, ValueError):  # the root complex: no upstream port to read
        pass
    try:
        cur = f"gen{gen_of_speed(_read(os.path.join(here, 'current_link_speed')))} x{_read(os.path.join(here, 'current_link_width'))}"
    except OSError:
        cur = ""
    return Link(gen, width, source, cur)


def norm_bus(bus) -> str:
    """A PCI bus id as sysfs writes it: 4-digit domain, lower case (NVML writes 8 digits)."""
    b = (bus.decode() if isinstance(bus, bytes) else str(bus)).strip("\x00 ").lower()
    parts = b.split(":")
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}" if len(parts) == 3 else b


def link_from_nvml(bus_id: str) -> Link:
    """The link of the GPU at ``bus_id`` through NVML (pynvml): the maximum for this GPU in this system."""
    import pynvml

    pynvml.nvmlInit()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        if norm_bus(pynvml.nvmlDeviceGetPciInfo(h).busId) != bus_id:
            continue
        cur = f"gen{pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)}"
        return Link(int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)), int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
                    "NVML max", cur)
    raise LookupError(f"NVML lists no GPU at {bus_id}")


def read_link(bus_id: str, root: str = SYSFS_PCI) -> tuple[Link | None, str]:
    """(the link of the GPU at ``bus_id``, "") from NVML, else sysfs; (None, why) when neither says."""
    whys = []
    for name, fn in (("NVML", lambda: link_from_nvml(bus_id)), ("sysfs", lambda: link_from_sysfs(bus_id, root))):
        try:
            return fn(), ""
        except Exception as exc:  # a missing pynvml or sysfs file costs the floor, never the run
            whys.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
    return None, "; ".join(whys)


@dataclass
class Floors:
    """The floors measured in this run so far (nan / None / empty until their step has run)."""

    device_copy: float = math.nan  # GB/s of the device's own copy_
    link: Link | None = None
    host_tcp: dict = field(default_factory=dict)  # (op, variant[, block]) -> GB/s of tcp between host pools
    matmul_tflops: float = math.nan

    @property
    def pcie(self) -> float:
        return self.link.gbps if self.link is not None else math.nan


@dataclass(frozen=True)
class Goal:
    """A goal a row is judged by: at least ``fraction`` of its floor, or at least ``gbps`` outright."""

    text: str
    fraction: float = math.nan
    gbps: float = math.nan

    def met(self, rate: float, floor: float) -> bool | None:
        """Whether ``rate`` meets the goal; None when it cannot be judged (no rate, or no floor measured)."""
        if not (rate == rate):
            return None
        if self.gbps == self.gbps:
            return rate >= self.gbps
        if not (floor == floor and floor > 0):
            return None
        return rate >= self.fraction * floor


KERNEL = Goal(">= 75% of the device copy", fraction=0.75)
CHECK = Goal(">= 100 GB/s", gbps=100.0)
STAGED = Goal(">= 80% of host tcp", fraction=0.8)
EXPOSED_LAYERS = 2.0  # streaming with the kernel engine exposes at most this many layers' compute time


def ratio(rate: float, floor: float) -> float:
    """``rate`` as a fraction of ``floor``; nan where either is missing or the floor is not positive."""
    if not (rate == rate and floor == floor and floor > 0):
        return math.nan
    return rate / floor


def ratio_text(r: float, floor_name: str) -> str:
    """'82% device copy', or '-' without a ratio."""
    return "-" if not (r == r) else f"{100 * r:.0f}% {floor_name}"


def goal_note(goal: Goal, rate: float, floor: float, judged: bool) -> tuple[str, bool]:
    """(the note a row with ``goal`` carries, whether it is below its goal).  ``judged`` is False on the CPU
    rehearsal: its rates say nothing about a GPU, so the goal is named and not judged."""
    if not judged:
        return f"goal {goal.text} (not judged on the rehearsal)", False
    met = goal.met(rate, floor)
    if met is None:
        return f"goal {goal.text}: not judged (no rate or no floor)", False
    return (f"goal {goal.text}: met", False) if met else (f"below goal ({goal.text})", True)


def rate(row: dict, floor: float, floor_name: str, goal: Goal | None = None, judged: bool = True) -> dict:
    """``row`` (runner.row) with its ratio to ``floor`` and, where it has one, its goal in the note."""
    r = ratio(row["gbps"], floor)
    row["ratio"], row["floor"] = r, floor_name if r == r else ""
    if goal is not None:
        note, _ = goal_note(goal, row["gbps"], floor, judged)
        row["goal"] = goal.text
        row["note"] = "; ".join(x for x in (row.get("note", ""), note) if x)
    return row


def exposed_note(exposed_s: float, prefill_s: float, layers: int, judged: bool) -> tuple[str, bool]:
    """(note, below goal) for streaming's exposed time against a layer's compute time (prefill / layers)."""
    if not (exposed_s == exposed_s and prefill_s == prefill_s and prefill_s > 0 and layers > 0):
        return f"goal <= {EXPOSED_LAYERS:g} layers' compute exposed: not judged (no time)", False
    k = exposed_s / (prefill_s / layers)
    said = f"exposed {k:.2f} layers' compute"
    if not judged:
        return f"{said}; goal <= {EXPOSED_LAYERS:g} (not judged on the rehearsal)", False
    if k <= EXPOSED_LAYERS:
        return f"{said}; goal <= {EXPOSED_LAYERS:g}: met", False
    return f"{said}; below goal (<= {EXPOSED_LAYERS:g})", True
