"""Assertions on what a run said, wrote and measured: its one line, its files, its status, its checked rows."""
from __future__ import annotations

import glob
import os

import pytest

from .args import SMALL


def assert_one_line(r, *needles, code=1):
    assert r.code == code, (r.code, r.out, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.startswith("kvbench: ")]
    assert len(lines) == 1, r.err  # printed once (rank 0), not once per rank
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.err + r.out
    return lines[0]


def assert_nothing_written(tmp_path):
    """A run refused at validation creates no result file and no sidecar."""
    assert not glob.glob(str(tmp_path / "results" / "**" / "*.*"), recursive=True)


def refusal(args: list[str]) -> str:
    """What rank 0 refuses ``kvbench run ARGS`` with, for 2 ranks (the parser's or the configuration's line)."""
    from kvbench.cli.args import ArgError
    from kvbench.cli.main import build_parser
    from kvbench.config import ConfigError, runconfig

    argv = ["run", *args]
    with pytest.raises((ArgError, ConfigError)) as exc:
        runconfig.build(build_parser().parse_args(argv), argv, 2)
    return str(exc.value)


def full(args: list[str]) -> list[str]:
    """``args`` as a whole small run: on shm unless they name a transport."""
    return ["-t", "shm", *SMALL, *args] if "-t" not in args else [*SMALL, *args]


def assert_failed(r, status, code, *needles):
    """Exit code, exactly one line (on any rank's stderr), the sidecar's status and reason."""
    assert r.code == code, (r.code, r.out, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.startswith("kvbench: ")]
    assert len(lines) == 1, r.err
    assert lines[0].startswith(f"kvbench: {status.lower()}: rank "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.err + r.out
    assert "# wrong elements" not in r.out  # no footer: the run did not end by itself
    meta = r.meta()
    assert meta["status"] == status and meta["reason"] == lines[0], meta
    return lines[0]


def cases_kept(r) -> list[int]:
    return sorted(set(r.table().case)) if os.path.exists(r.results) else []


def assert_clean(r, transport):
    """A run that measured ``transport`` with every byte right and one completion rule; its measured rows."""
    assert r.code == 0, r.out + r.err
    df = r.table()
    mine = df[df.transport == transport]
    ok = mine[mine.status == "ok"]
    assert len(ok), f"no measured rows for {transport}:\n{r.out}"
    checks = ok[ok.iter == -1]
    # every case and every request has its check row on the decode side, and nothing was wrong
    assert set(checks[checks.role == "decode"].case) == set(ok.case)
    assert int(checks.nwrong.sum()) == 0
    # the one completion rule: the destination's landing is stamped by the transport's own thread when it
    # has one (as it declares), else when the harness's wait returns
    rule = {i["completion"] for i in r.meta()["transports"][transport] if i}
    timed = ok[(ok.iter >= 0) & (ok.role == "decode")]
    assert len(rule) == 1 and set(timed.completion) == rule, (rule, set(timed.completion))
    return ok


def device_matches_host(a, t, descs, src_rank: int, epoch: int, writer: int | None = None) -> None:
    """The check's two steps on one pool's bytes twice over, a host array (memory/verify.py) and a torch CPU
    tensor (memory/device.py): the destination ranges poisoned, then ``epoch`` written at the source ranges by
    ``writer`` (default ``src_rank``); after each step both hold the same bytes."""
    import numpy as np

    from kvbench.memory import device, verify

    for host_step, device_step, rank in ((verify.poison, device.poison, src_rank),
                                         (verify.write_epoch, device.write_epoch, src_rank if writer is None else writer)):
        host_step(a, descs, rank, epoch)
        device_step(t, descs, rank, epoch)
        assert np.array_equal(a, t.numpy())
