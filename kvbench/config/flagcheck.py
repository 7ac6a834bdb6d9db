"""Checks at the door that a suite's fields cannot make alone: a fill file that is not there or not a dump (read
by every rank at its first case otherwise), ``--ci-budget`` given where no ``--target-ci`` spends it, a link
planted in the results folder under a lock's or temporary file's name, a results folder no one can make, and a
one-rank launch of transports that need a peer."""
from __future__ import annotations

import os

import numpy as np

from kvbench import transports
from kvbench.config import ConfigError
from kvbench.config import suite as S
from kvbench.job.safefile import UnsafeFile
from kvbench.model.limits import clip
from kvbench.results.lock import planted
from kvbench.results.machine import machine_name


def fill_file(suite: S.Suite) -> None:
    """``fill: file:<dump>``: the file is there, readable, and its header reads as the kind its name says (the
    tensors are read by the ranks when the pools are filled; only the header here, however large the dump)."""
    if not suite.fill.startswith("file:"):
        return
    path = suite.fill[len("file:"):]
    flag = f"--fill {clip(suite.fill)}"
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag}: not readable by this user")
    try:
        if path.endswith(".npy"):
            np.load(path, mmap_mode="r", allow_pickle=False)  # the header only: the data stays on disk
        else:
            from safetensors import safe_open

            with safe_open(path, framework="numpy") as f:
                list(f.keys())
    except ImportError as exc:
        raise ConfigError(f"{flag}: cannot read it here: {exc} (pip install safetensors)") from None
    except Exception as exc:  # numpy and safetensors raise their own types for a damaged file
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"{flag}: not a .npy or .safetensors dump: {why}") from None


def ci_budget(a, suite: S.Suite) -> None:
    """``--ci-budget`` is what a case may spend reaching ``--target-ci``: without a target it would do nothing."""
    if getattr(a, "ci_budget", None) is not None and suite.target_ci is None:
        raise ConfigError(f"--ci-budget {a.ci_budget:g}: it bounds --target-ci's iterations, and this run has no "
                          "--target-ci (give one, e.g. --target-ci 2%, or leave --ci-budget out)")


def planted_files(results: str) -> None:
    """The folder this run's files go in (``<results>/<machine>/``): a `.lock` or `.tmp` there that is a link, not
    a regular file or another user's is refused now, before any rank starts (results/lock.py)."""
    try:
        planted(os.path.join(results, machine_name()))
    except UnsafeFile as exc:
        raise ConfigError(f"-o {results}: {exc}") from None


def creatable(path: str, probe: str) -> None:
    """The first folder of ``path`` that is not there yet can be made (made and removed at once): root may write
    anywhere by its permissions, yet /proc or /sys refuse every new name."""
    full = os.path.abspath(path)
    if full == probe:
        return
    first = os.path.join(probe, os.path.relpath(full, probe).split(os.sep)[0])
    try:
        os.mkdir(first)
        os.rmdir(first)
    except OSError as exc:
        raise ConfigError(f"-o {clip(path)}: cannot make {clip(first)} there: {exc.strerror}") from None


def one_rank(names: list[str], world: int) -> None:
    """Launched without mpirun (one rank), a run whose every transport needs a peer would measure nothing: an input
    error, said before any file is written.  In-process transports (loopback) run alone; beside one, the others'
    rows say why they did not run."""
    if world != 1:
        return
    for name in names:
        try:
            if transports.load(name).caps.local_only:
                return
        except Exception:  # its library is missing here: it needs a peer as much as any other
            continue
    raise ConfigError(f"{', '.join(names)}: one rank launched, and {'this transport needs' if len(names) == 1 else 'these transports need'} "
                      "a peer: launch with mpirun -np 2 kvbench run ... (or -t loopback, which runs in one process)")
