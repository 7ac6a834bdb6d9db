"""What a buyer's engineer needs to see about a GPU/RDMA node: for ``kvbench env`` and the sidecar.

GPUs (model, memory, driver, CUDA) from nvidia-smi; the GPU-NIC PCIe topology and NVLink links from
``nvidia-smi topo -m`` / ``nvlink -s``; RDMA devices with port state, link layer, rate and MTU from sysfs;
GPUDirect support (nvidia-peermem loaded; dma-buf possible: a CUDA 11.7+ driver and kernel 5.12+); the NIC's
PCIe relaxed-ordering state (its absence halved GPUDirect bandwidth for Mooncake users) from ``lspci -vvv``;
the locked-memory limit registrations count against.  Every probe is cheap, never imports CUDA, and reports
what it could not learn instead of failing.
"""
from __future__ import annotations

import os
import platform
import re
import resource
import socket
import subprocess

from kvbench.memory.host import _read  # one reader of /sys and /proc files for the whole package

SYS = "/sys"




def _run(cmd: list[str], timeout: float = 10) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.stdout if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def rdma_devices(root: str = SYS) -> list[dict]:
    """Per RDMA device and port: state, physical state, link layer, rate, active MTU (from ``ibv_devinfo``-like
    sysfs files), its PCI address and, from its PCI config, relaxed ordering."""
    base = os.path.join(root, "class", "infiniband")
    out = []
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        d = os.path.join(base, dev)
        pci = os.path.basename(os.path.realpath(os.path.join(d, "device")))
        for port in sorted(os.listdir(os.path.join(d, "ports"))) if os.path.isdir(os.path.join(d, "ports")) else []:
            p = os.path.join(d, "ports", port)
            mtu = None
            for ndev in sorted(os.listdir(os.path.join(d, "device", "net"))) if os.path.isdir(
                    os.path.join(d, "device", "net")) else []:
                mtu = _read(os.path.join(d, "device", "net", ndev, "mtu"))
            out.append({"device": dev, "port": int(port), "state": _strip(_read(os.path.join(p, "state"))),
                        "phys_state": _strip(_read(os.path.join(p, "phys_state"))),
                        "link_layer": _read(os.path.join(p, "link_layer")), "rate": _read(os.path.join(p, "rate")),
                        "netdev_mtu": int(mtu) if mtu and mtu.isdigit() else None, "pci": pci,
                        "relaxed_ordering": relaxed_ordering(pci)})
    return out


def _strip(v: str | None) -> str | None:
    """'4: ACTIVE' -> 'ACTIVE'."""
    return v.split(":", 1)[1].strip() if v and ":" in v else v


def relaxed_ordering(pci: str, lspci: str | None = None) -> str:
    """'on' / 'off' from the device's PCIe DevCtl (``RlxdOrd+``/``RlxdOrd-`` in ``lspci -vvv``), or why unknown."""
    text = lspci if lspci is not None else _run(["lspci", "-vvv", "-s", pci])
    if text is None:
        return "unknown (lspci absent or not permitted)"
    m = re.search(r"DevCtl:.*?RlxdOrd([+-])", text, re.S)
    return {"+": "on", "-": "off"}[m.group(1)] if m else "unknown (no DevCtl line: run as root)"


def gpudirect(root: str = SYS) -> dict:
    """How GPU memory can be registered with a NIC here."""
    peer = _read(os.path.join(root, "module", "nvidia_peermem", "version")) or \
        _read(os.path.join(root, "kernel", "mm", "memory_peers", "nv_mem", "version"))
    kernel = platform.release()
    m = re.match(r"(\d+)\.(\d+)", kernel)
    dmabuf_kernel = bool(m) and (int(m.group(1)), int(m.group(2))) >= (5, 12)
    return {"nvidia_peermem": peer or "not loaded",
            "dma_buf": f"kernel {kernel} {'supports' if dmabuf_kernel else 'predates'} dma-buf RDMA (5.12+); "
                       "the GPU driver must be 515+ (CUDA 11.7)"}


def memlock() -> str:
    """The locked-memory limit (RLIMIT_MEMLOCK) RDMA and pinned registrations count against."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v / 2**20:.0f} MiB"  # noqa: E731
    return f"{fmt(soft)} (hard {fmt(hard)})"


def gpus() -> list[dict]:
    """Model, memory, driver and CUDA version per GPU (nvidia-smi; empty without it)."""
    text = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
                 "--format=csv,noheader,nounits"])
    cuda = re.search(r"CUDA Version: ([\d.]+)", _run(["nvidia-smi"]) or "")
    out = []
    for line in (text or "").splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 5:
            out.append({"index": int(f[0]), "name": f[1], "memory_mib": int(f[2]) if f[2].isdigit() else f[2],
                        "driver": f[3], "pci": f[4], "cuda": cuda.group(1) if cuda else None})
    return out


def topology() -> str | None:
    """``nvidia-smi topo -m``: which GPUs and NICs share a PCIe switch (PIX/PXB) or only the CPU (NODE/SYS),
    and NVLink (NV#) between GPUs."""
    return _run(["nvidia-smi", "topo", "-m"])


def facts() -> dict:
    """Everything above, for the sidecar."""
    return {"gpus": gpus(), "rdma": rdma_devices(), "gpudirect": gpudirect(), "memlock": memlock(),
            "topology": topology()}


def lines(f: dict) -> list[str]:
    """``kvbench env``'s lines for these facts."""
    out = []
    for g in f["gpus"]:
        out.append(f"{'GPU ' + str(g['index']):<16} {g['name']}, {g['memory_mib']} MiB, driver {g['driver']}, "
                   f"CUDA {g['cuda']}, PCI {g['pci']}")
    for r in f["rdma"]:
        out.append(f"{r['device'] + ':' + str(r['port']):<16} {r['state']} ({r['phys_state']}), {r['link_layer']}, "
                   f"{r['rate']}, MTU {r['netdev_mtu']}, PCI {r['pci']}, relaxed ordering {r['relaxed_ordering']}")
    out.append(f"{'GPUDirect':<16} nvidia-peermem {f['gpudirect']['nvidia_peermem']}; {f['gpudirect']['dma_buf']}")
    out.append(f"{'memlock':<16} {f['memlock']}")
    if f["topology"]:
        out += ["# nvidia-smi topo -m (PIX/PXB: same PCIe switch; NODE/SYS: through the CPU; NV#: NVLink)",
                *f["topology"].rstrip().splitlines()]
    return out


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi when it exists and answers (no CUDA import)."""
    text = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    return [ln.strip() for ln in (text or "").splitlines() if ln.strip()]


def nic_speed_mbps(ifname: str, root: str = SYS) -> int | None:
    """The NIC's reported link speed (Mb/s), or None when it has none (loopback, virtual, link down)."""
    try:
        with open(os.path.join(root, "class", "net", ifname, "speed")) as fh:
            v = int(fh.read().strip())
        return v if v > 0 else None
    except (OSError, ValueError):  # loopback answers EINVAL; a link that is down, -1
        return None


def rdma_rates(root: str = SYS) -> dict[str, str]:
    """Per RDMA device port, the rate the kernel reports (e.g. '400 Gb/sec (4X NDR)')."""
    out = {}
    base = os.path.join(root, "class", "infiniband")
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        ports = os.path.join(base, dev, "ports")
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            try:
                with open(os.path.join(ports, port, "rate")) as fh:
                    out[f"{dev}/{port}"] = fh.read().strip()
            except OSError:
                pass
    return out


# git's optional locks off: `git status` refreshes the index under .git/index.lock otherwise, and a user's commit
# in the checkout at that moment fails (or kvbench's call does)
GIT_ENV = {"GIT_OPTIONAL_LOCKS": "0"}


def git_commit() -> str:
    """The commit of the kvbench checkout, with -dirty if it has local changes (nothing in .git is written)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **GIT_ENV)
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             env=env)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, env=env).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_name() -> str:
    """Short host name, safe as a directory name (a result set's folder: <results>/<machine>/)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname().split(".")[0]) or "unknown"


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape the numbers."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("kvbench", "numpy", "pandas", "pyarrow", "mpi4py", "mpich", "openmpi", "nixl", "ucxx-cu12",
                "mooncake-transfer-engine-non-cuda", "torch", "cupy-cuda12x"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
