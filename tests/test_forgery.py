"""Content no transport can predict (issue 42, item 1): the pool's bytes are keyed (memory/keyed.py), so a transport
that carries an eighth of each range and writes the rest from the public fill (tests/liars.py ForgesTheRest) ends
FAILED, under the default fill, with the check pass alone (-c 1) and with every iteration checked (-c all)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.launch import liar_env
from liars import _eighth, _forge, _public

from kvbench.memory import keyed, verify

ENV = liar_env()
SMALL = ["-m", "llama-3-8b", "--tokens", "128", "-b", "16", "-e", "16", "-n", "3", "-w", "1", "--variants", "paged",
         "--alloc", "random"]


@pytest.fixture(autouse=True)
def _secret():
    keyed.secret(0x0123456789ABCDEF)
    yield
    keyed.secret(0)


@pytest.mark.parametrize("off,n", [(0, 64), (5, 100), (16, 1000), (3, 3), (4096, 70000)])
def test_the_c_and_torch_generators_are_the_reference_bit_for_bit(off, n):
    torch = pytest.importorskip("torch")
    out = np.empty(n, np.uint8)
    keyed.ranges(out, np.array([[off, 0, n]]), 3, 7)
    assert np.array_equal(out, keyed.reference(3, 7, off, n))
    keyed.ranges(out, np.array([[off, 0, n]]), 3, 7, flip=True)
    assert np.array_equal(out, ~keyed.reference(3, 7, off, n))
    w0, w1 = off // 4, -(-(off + n) // 4)
    dev = keyed.words(torch, torch.arange(w0, w1, dtype=torch.int64), 3, 7).numpy().view(np.uint8)
    assert np.array_equal(dev[off - 4 * w0: off - 4 * w0 + n], out ^ 0xFF)


def test_the_key_decides_every_byte():
    """Another secret, epoch or rank: other bytes (each byte agrees by chance, 1 in 256)."""
    a = keyed.reference(1, 5, 0, 4096)
    for other in (keyed.reference(2, 5, 0, 4096), keyed.reference(1, 6, 0, 4096)):
        assert np.count_nonzero(a == other) < 4096 // 64
    keyed.secret(0x0123456789ABCDEE)
    assert np.count_nonzero(a == keyed.reference(1, 5, 0, 4096)) < 4096 // 64


def test_the_forger_writes_wrong_bytes_and_on_the_public_fill_it_would_not():
    """The forger in-process: on keyed content all but the eighth it carried is wrong; on the public fill of the
    old days (one XOR word per epoch) its forgery was perfect, which is the hole keyed content closes."""
    descs = np.array([[0, 8192, 4096], [4096, 16384, 4096]], np.int64)
    moved = _eighth(descs)
    for content in ("keyed", "public"):
        src = np.zeros(1 << 15, np.uint8)
        if content == "keyed":
            verify.write_epoch(src, descs, 0, 9)
        else:
            src.view(np.uint32)[:] = _public(0, np.arange(len(src) // 4)) ^ np.uint32(0x5A5A1234)
        dst = np.zeros_like(src)
        for (s, d, _), k in zip(descs.tolist(), moved.tolist()):
            dst[d: d + k] = src[s: s + k]
        _forge(dst, descs, 1, 0, moved)
        wrong = sum(int(np.count_nonzero(dst[d: d + n] != src[s: s + n])) for s, d, n in descs.tolist())
        if content == "keyed":
            assert wrong > 0.9 * int((descs[:, 2] - moved).sum())
        else:
            assert wrong == 0


@pytest.mark.parametrize("check", ["1", "all"])
def test_a_forger_on_shm_and_tcp_ends_failed(kvrun, check):
    r = kvrun(["-t", "shm,lie-forge,tcp,lie-forge-tcp", "--op", "push,pull", "-c", check, *SMALL], env=ENV, timeout=240)
    assert r.code == 2 and r.meta()["status"] == "FAILED", r.out[-3000:] + r.err[-3000:]
    wrong = r.table().query("role != 'prefill'").groupby(["transport", "op"])["nwrong"].sum()
    for liar in ("lie-forge", "lie-forge-tcp"):
        assert (wrong[liar] > 0).all(), wrong
    for honest in ("shm", "tcp"):
        assert (wrong[honest] == 0).all(), wrong
