"""The device fill and check in bounded pieces: no step holds more elements than an eighth of the pool (and
1 GiB) pays for, and the pieces cover the ranges exactly, in order, with whole elements."""
import numpy as np
import pytest
from helpers.asserts import device_matches_host

torch = pytest.importorskip("torch")

from kvbench.memory import device as D  # noqa: E402
from kvbench.memory import verify  # noqa: E402


def test_pieces_cover_every_byte_in_order_within_the_limit():
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 5000, 300)
    descs = np.stack([rng.integers(0, 1 << 20, 300), np.cumsum(lens) - lens, lens], axis=1).astype(np.int64)
    parts = D.pieces(descs, 1024)
    assert max(int(p[:, 2].sum()) for p in parts) <= 2 * 1024
    rows = np.concatenate(parts)
    assert int(rows[:, 2].sum()) == int(lens.sum())
    assert np.array_equal(rows[:, 1], np.cumsum(rows[:, 2]) - rows[:, 2])  # back to back, in order
    src = np.concatenate([np.arange(s, s + n) for s, _, n in descs.tolist()])
    assert np.array_equal(np.concatenate([np.arange(s, s + n) for s, _, n in rows.tolist()]), src)


def test_the_check_and_fill_never_take_one_index_per_payload_byte(monkeypatch):
    """A 1 MiB pool, a request of a third of it: each step's temporaries fit in budget(pool) = pool/8."""
    pool = 1 << 20
    sizes = []
    real_words = D._words
    monkeypatch.setattr(D, "_words", lambda torch, idx, *a: (sizes.append(idx.numel()), real_words(torch, idx, *a))[1])
    t = torch.zeros(pool, dtype=torch.uint8)
    D.fill(t, 3)
    descs = np.array([[0, 1 << 19, 200_000], [300_000, (1 << 19) + 300_000, 100_001]], np.int64)
    D.poison(t, descs, 3, 9)
    D.write_epoch(t, descs, 3, 9)
    copy, where = D.snapshot(t, [descs])
    assert copy.device.type == "cpu"
    assert D.count_wrong(copy, where, 3, 2, 9) == 100_000 + 100_001  # still poisoned: all wrong
    assert max(sizes) * D._PER_ELEM <= D.budget(pool) and len(sizes) > 4
    assert D.budget(1 << 40) == 1 << 30


def test_a_pool_checked_in_pieces_gives_the_host_check_counts():
    n = 1 << 20
    a = np.zeros(n, np.uint8)
    t = torch.zeros(n, dtype=torch.uint8)
    descs = np.array([[0, 600_000, 200_000], [300_000, 900_000, 99_999]], np.int64)
    device_matches_host(a, t, descs, 2, 5)
    ca, wa = verify.snapshot(a, [descs])
    ct, wt = D.snapshot(t, [descs])
    assert np.array_equal(ca, ct.numpy())
    assert D.count_wrong(ct, wt, 2, 2, 5) == verify.count_wrong(ca, wa, 2, 2, 5) == 100_000 + 99_999
