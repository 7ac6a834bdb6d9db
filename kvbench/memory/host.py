"""Host pools: page-aligned, pre-faulted allocations, their page size, and what the kernel gave.

``pages`` picks the page size a pool asks for:

* ``4k``: 4 KiB pages (``MADV_NOHUGEPAGE``, so that a kernel with transparent
  huge pages set to ``always`` does not hand out huge pages anyway);
* ``thp``: transparent huge pages: the mapping is aligned to the huge page
  size and marked ``MADV_HUGEPAGE`` before it is pre-faulted.  The kernel
  honours that when /sys/kernel/mm/transparent_hugepage/enabled is
  ``madvise`` or ``always`` and it finds free 2 MiB extents (fragmented
  memory can leave part of the pool on 4 KiB pages);
* ``huge``: explicit huge pages (``MAP_HUGETLB``) from the kernel's pool,
  reserved ahead by the administrator; fails with a ``PagesError`` that says
  how many are free and how to reserve more.

What the kernel actually gave shows in /proc/self/smaps: ``page_report``.

The default is ``4k``: larger pages gained nothing the noise could resolve
through kvbench's transports here, need no kernel setting, and match the pages
MPI's window and an engine's default host buffer get (docs/pages.md).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re

import numpy as np

PAGE = mmap.PAGESIZE
KINDS = ("host",)  # host memory only; memory/device.py lists the device kinds
PAGE_KINDS = ("4k", "thp", "huge")

MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux x86-64 value; Python's mmap lacks the constant
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1+
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
THP_DIR = "/sys/kernel/mm/transparent_hugepage"

# smaps fields that count bytes of a mapping backed by huge pages (PMD-mapped THP, or hugetlb)
_HUGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")
_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


class PagesError(RuntimeError):
    """The pages a pool asked for cannot be had (one line: why, and how to fix it)."""


def _round_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def thp_mode(which: str = "enabled") -> str | None:
    """The selected value of /sys/kernel/mm/transparent_hugepage/<which> (``enabled`` for anonymous memory,
    ``shmem_enabled`` for tmpfs and shared memory): "always", "madvise", "never"...; None without THP."""
    text = _read(f"{THP_DIR}/{which}")
    if text is None:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text


def thp_size() -> int:
    """Bytes of a PMD-sized transparent huge page (2 MiB on x86-64)."""
    text = _read(f"{THP_DIR}/hpage_pmd_size")
    return int(text) if text and text.isdigit() else 2 << 20


def meminfo() -> dict[str, int]:
    """/proc/meminfo as numbers: ``kB`` fields in bytes, counts (HugePages_*) as they are."""
    out: dict[str, int] = {}
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); a large number if unknown."""
    return meminfo().get("MemAvailable", 1 << 62)


def hugepage_size() -> int:
    """Bytes of the kernel's default explicit huge page (Hugepagesize; 2 MiB unless booted otherwise)."""
    return meminfo().get("Hugepagesize", 2 << 20)


def hugepages_free_bytes() -> int:
    """Bytes of explicit huge pages that a new ``huge`` pool can still take (free, not reserved by others)."""
    mi = meminfo()
    return max(0, mi.get("HugePages_Free", 0) - mi.get("HugePages_Rsvd", 0)) * mi.get("Hugepagesize", 2 << 20)


def _huge_error(nbytes: int, size: int, exc: OSError) -> PagesError:
    mi = meminfo()
    hp = mi.get("Hugepagesize", 2 << 20)
    need = size // hp
    total, free, rsvd = mi.get("HugePages_Total", 0), mi.get("HugePages_Free", 0), mi.get("HugePages_Rsvd", 0)
    taken = f", {rsvd} of them reserved by others" if rsvd else ""
    want = total + need - max(0, free - rsvd)  # the pool size that leaves this one room
    return PagesError(
        f"--pages huge: a pool of {nbytes / 2**20:.1f} MiB needs {need} huge pages of {hp >> 10} KiB but the kernel's "
        f"pool has HugePages_Free {free} of HugePages_Total {total}{taken} ({exc.strerror}): reserve more as root with "
        f"'sysctl vm.nr_hugepages={want}' (or 'echo {want} > /proc/sys/vm/nr_hugepages'; at boot: "
        f"hugepages={want}), or use --pages thp")


def alloc_host(nbytes: int, pages: str = "4k") -> np.ndarray:
    """Anonymous, page-aligned, pre-faulted ``uint8`` array of ``nbytes`` on ``pages`` (see the module).

    mmap memory starts on a page boundary (numpy's own allocations start 16
    bytes in, which halves memcpy speed when source and destination are
    misaligned relative to each other).
    """
    if pages not in PAGE_KINDS:
        raise ValueError(f"pages must be one of {', '.join(PAGE_KINDS)}, not {pages!r}")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if pages == "huge":
        size = _round_up(nbytes, hugepage_size())
        try:  # a private hugetlb mapping reserves its pages here: a short pool fails now, not at first touch
            mm = mmap.mmap(-1, size, flags=flags | MAP_HUGETLB)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.EINVAL, errno.EPERM):
                raise _huge_error(nbytes, size, exc) from None
            raise
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    elif pages == "thp":
        hp = thp_size()
        size = _round_up(nbytes, hp)
        mm = mmap.mmap(-1, size + hp, flags=flags)  # one spare huge page: room to start on a huge page boundary
        _madvise(mm, MADV_HUGEPAGE)
        base = np.frombuffer(mm, dtype=np.uint8)
        off = -base.__array_interface__["data"][0] % hp
        arr = base[off : off + nbytes]  # the untouched rest of the mapping is never faulted in
    else:
        size = _round_up(nbytes, PAGE)
        mm = mmap.mmap(-1, size, flags=flags)
        _madvise(mm, MADV_NOHUGEPAGE)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    arr.fill(0)  # pre-fault (docs/pitfalls.md#pre-fault): first touch is slow, and where the kernel picks the page size
    return arr


def _madvise(mm: mmap.mmap, advice: int) -> bool:
    """Advise the whole mapping; False when this kernel has no such advice (no THP support)."""
    try:
        mm.madvise(advice)
        return True
    except (OSError, AttributeError):
        return False


def _smaps(lo: int, hi: int, path: str = "/proc/self/smaps") -> list[dict]:
    """The mappings of this process that overlap [lo, hi): their range and numeric fields (bytes)."""
    out: list[dict] = []
    cur: dict | None = None
    with open(path) as fh:
        for line in fh:
            m = _VMA.match(line)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                cur = {"start": start, "end": end} if start < hi and end > lo else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    cur[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def page_report(array: np.ndarray) -> dict:
    """What pages back ``array``'s bytes now, from /proc/self/smaps.

    ``huge_bytes``: bytes of the array's mappings on huge pages (AnonHugePages,
    ShmemPmdMapped/FilePmdMapped for shared memory, *_Hugetlb for explicit huge
    pages), counted per mapping up to its overlap with the array (a mapping can
    be larger than the array: an aligned THP pool, a window segment shared by
    several ranks); ``huge_share``: that over the array's bytes (0..1);
    ``kernel_page_size``: the largest KernelPageSize of those mappings (4096,
    or the hugetlb page size); ``thp_eligible``: the kernel may use THP there.
    Values are None where smaps cannot be read.  Not for a timed path: reading
    smaps walks the page tables of the whole process.
    """
    lo = int(array.__array_interface__["data"][0])
    hi = lo + int(array.nbytes)
    rep = {"bytes": int(array.nbytes), "huge_bytes": None, "huge_share": None, "kernel_page_size": None,
           "thp_eligible": None}
    try:
        vmas = _smaps(lo, hi)
    except OSError:
        return rep
    if not vmas or not array.nbytes:
        return rep
    huge = 0
    for v in vmas:
        overlap = min(hi, v["end"]) - max(lo, v["start"])
        huge += min(overlap, sum(v.get(f, 0) for f in _HUGE_FIELDS))
    rep.update(huge_bytes=huge, huge_share=round(huge / array.nbytes, 4),
               kernel_page_size=max(v.get("KernelPageSize", PAGE) for v in vmas),
               thp_eligible=any(v.get("THPeligible") == 1 for v in vmas) if any("THPeligible" in v for v in vmas)
               else None)
    return rep


def page_summary(rep: dict) -> str:
    """One phrase for a page report: "4 KiB pages", "THP 97%", "hugetlb 2048 KiB"."""
    if rep.get("huge_share") is None:
        return "unknown (no smaps)"
    kps = rep.get("kernel_page_size") or PAGE
    if kps > PAGE:
        return f"hugetlb {kps >> 10} KiB"
    if rep["huge_share"] > 0:
        return f"THP {100 * rep['huge_share']:.0f}%"
    return f"{kps >> 10} KiB pages"


def tmpfs_huge(path: str) -> str | None:
    """The ``huge=`` policy of the tmpfs mount holding ``path`` ("never" when the mount does not set it;
    None when ``path`` is not on tmpfs).  It decides whether faults and fallocate in a segment there allocate
    transparent huge pages: "never" does not, "advise" only in a mapping marked MADV_HUGEPAGE,
    "within_size"/"always" do outright (``collapse`` works apart from it).  The sysfs file
    /sys/kernel/mm/transparent_hugepage/shmem_enabled governs only the kernel's internal mount (memfd, SysV,
    shared anonymous memory), except its "force" and "deny"."""
    real = os.path.realpath(path)
    best, opts = "", None
    for line in (_read("/proc/self/mounts") or "").splitlines():
        f = line.split()
        if len(f) >= 4 and (real == f[1] or real.startswith(f[1].rstrip("/") + "/")) and len(f[1]) >= len(best):
            best, opts = f[1], (f[3] if f[2] == "tmpfs" else None)
    if opts is None:
        return None
    forced = thp_mode("shmem_enabled")
    if forced in ("force", "deny"):
        return {"force": "always", "deny": "never"}[forced]
    huge = [o.split("=", 1)[1] for o in opts.split(",") if o.startswith("huge=")]
    return huge[-1] if huge else "never"


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def map_shared(fd: int, size: int, align: int, extra_flags: int = 0) -> np.ndarray:
    """``size`` bytes of file ``fd`` mapped MAP_SHARED (read-write) at an address that is a multiple of
    ``align``, as a ``uint8`` array: a mapping of a tmpfs file can hold its huge pages with PMDs only when
    address and file offset agree modulo the huge page size, and the kernel does not align mappings of a
    huge=never mount.  The file is mapped MAP_FIXED inside an untouched anonymous reservation that Python's
    mmap owns, so the reservation's munmap, when the last array goes, takes the file mapping with it."""
    res = mmap.mmap(-1, size + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = np.frombuffer(res, dtype=np.uint8)  # never touched outside the file mapping below
    off = -int(base.__array_interface__["data"][0]) % align
    addr = int(base.__array_interface__["data"][0]) + off
    got = _libc().mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED | extra_flags,
                       fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a shared segment at a {align >> 10} KiB boundary: {os.strerror(err)}")
    return base[off : off + size]


def collapse(array: np.ndarray) -> bool:
    """Ask the kernel to move ``array``'s populated pages onto huge pages now (MADV_COLLAPSE, Linux 6.1+): for
    memory allocated before it could be marked (a tmpfs segment fallocated ahead).  Unlike page faults it does
    not follow a tmpfs mount's huge= policy (it collapsed a segment of a huge=never /dev/shm here; shmem_enabled
    "deny" refuses it), but a shared mapping needs a huge-page-aligned address (``map_shared``).  False when
    refused (EINVAL: not eligible; ENOMEM/EAGAIN: no huge page could be had)."""
    return madvise(array, MADV_COLLAPSE)


def madvise(array: np.ndarray, advice: int) -> bool:
    """madvise(2) over the pages holding ``array``; False when the kernel refuses (errno not raised)."""
    lo = int(array.__array_interface__["data"][0])
    start = lo - lo % PAGE
    return _libc().madvise(start, lo + int(array.nbytes) - start, advice) == 0
