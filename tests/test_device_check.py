"""The device check at memory speed (memory/device.py count_now, poison, write_epoch): in place per 32-bit word,
a constant number of launches per piece, no wait for the device inside it, and the same counts as verify.py.
torch-cpu pools stand in for device memory; a dispatch mode counts every torch op (a launch on a GPU) and the ops
that make the host wait for the device."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvbench.memory import device, verify  # noqa: E402

SYNCS = {"_local_scalar_dense", "nonzero", "item", "masked_select", "unique", "_unique2"}  # ops the host waits on


class Ops(TorchDispatchMode):
    """Counts the ops run (launches on a GPU), those that wait for the device, and the bytes they produce."""

    def __init__(self):
        super().__init__()
        self.ops, self.waits, self.out = [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in SYNCS or (name == "repeat_interleave" and kwargs.get("output_size") is None):
            self.waits.append(name)
        out = func(*args, **kwargs)
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in ins:  # new memory, not a view
            self.out = max(self.out, out.numel() * out.element_size())
        return out


def _pool(nbytes, rank=0):
    p = device.alloc(nbytes, "torch-cpu")
    device.fill(p.tensor, rank)
    return p


def _blocks(n, block, pool, seed=3):
    rng = np.random.default_rng(seed)
    half = pool // 2 // block
    s, d = rng.choice(half, n, replace=False), rng.choice(half, n, replace=False)
    return np.stack([s * block, pool // 2 + d * block, np.full(n, block)], 1).astype(np.int64)


@pytest.mark.parametrize("elem", [1, 2, 4, 8])
def test_in_place_counts_match_verify_and_catch_each_flip(elem):
    src, dst = _pool(1 << 20, 1), _pool(1 << 20, 0)
    descs = _blocks(40, 1024, 1 << 20)
    device.write_epoch(src.tensor, descs, 1, 7)
    device.poison(dst.tensor, descs, 1, 7)
    assert int(device.count_now(dst.tensor, descs, 1, elem, 7)) == int(descs[:, 2].sum()) // elem  # all poison
    for s, d, n in descs:
        dst.array[d:d + n] = src.array[s:s + n]
    assert int(device.count_now(dst.tensor, descs, 1, elem, 7)) == 0
    assert int(device.count_now(dst.tensor, descs, 1, elem, 8)) > 0  # another epoch: stale bytes are wrong
    at = int(descs[5, 1]) + 12
    dst.array[at] ^= 0x40
    dst.array[at + 1] ^= 0x01  # the same element for elem >= 2
    want = verify.count_wrong(*verify.snapshot(dst.array, [descs]), 1, elem, 7)
    assert int(device.count_now(dst.tensor, descs, 1, elem, 7)) == want == (2 if elem == 1 else 1)


def test_a_check_is_a_constant_number_of_launches_per_piece_and_never_waits():
    """Today's path made an int64 index per byte, waited 3-4 times per 128 KiB piece and took every byte to the
    host; this one: a bounded op count per piece, no wait inside it, temporaries within the pool's budget."""
    pool = 64 << 20
    dst = _pool(pool, 1)
    counts = {}
    for n in (64, 1024):
        descs = _blocks(n, 16 << 10, pool)
        descs[:, 1] = descs[:, 0]  # the fill against itself: nothing wrong
        with Ops() as ops:
            got = device.count_now(dst.tensor, descs, 1, 2, 0)
        npieces = len(device.pieces(descs, max(64, device.budget(pool) // device._PER_WORD * 4 // 64 * 64)))
        counts[n] = (len(ops.ops), npieces)
        assert not ops.waits, ops.waits
        assert ops.out <= device.budget(pool)
        assert int(got) == 0  # the fill is epoch 0: nothing wrong; read once, after: the caller's only wait
    (ops64, p64), (ops1k, p1k) = counts[64], counts[1024]
    assert p1k > p64 >= 1
    per = (ops1k - ops64) / (p1k - p64)
    # per piece, whatever its descriptor count: ~25 for the index, gather and compare, ~135 elementwise ops for
    # the keyed generator's ten rounds (memory/keyed.py)
    assert per <= 175 and ops64 <= 5 + 175 * p64


def test_poison_and_epoch_writes_take_the_word_path_without_waiting():
    pool = 8 << 20
    p = _pool(pool)
    descs = _blocks(256, 4096, pool)
    with Ops() as ops:
        device.write_epoch(p.tensor, descs, 0, 3)
        device.poison(p.tensor, descs, 0, 3)
    assert not ops.waits and "repeat_interleave" in ops.ops
    snap = verify.snapshot(p.array, [descs])
    assert verify.count_wrong(*snap, 0, 1, 3) == int(descs[:, 2].sum())  # every destination byte poisoned
    src = descs.copy()
    src[:, 1] = src[:, 0]
    assert verify.count_wrong(*verify.snapshot(p.array, [src]), 0, 1, 3) == 0  # the sources hold epoch 3


def test_unaligned_ranges_fall_back_to_the_byte_path_with_the_same_count():
    dst = _pool(1 << 16, 0)
    descs = np.array([[1, 40001, 333], [8192, 30000, 1000]], np.int64)
    device.poison(dst.tensor, descs, 1, 2)
    assert int(device.count_now(dst.tensor, descs, 1, 1, 2)) == 1333
