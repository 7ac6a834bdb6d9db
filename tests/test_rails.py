"""Rails (transports/rails.py, tcp's -O addr=A,B / ifname=X,Y / rails=N): the byte split, the choice of NICs and
a real striped run over two loopback addresses whose kernel counts show each rail carried its share."""
from __future__ import annotations

import numpy as np
import pytest

from kvbench.model.descriptors import LEN
from kvbench.transports.base import TransportError
from kvbench.transports.rails import Splits, select_rails, shares, split


def _bytes_of(descs: np.ndarray) -> np.ndarray:
    """Every byte a descriptor array moves, as (source offset, destination offset) rows in order."""
    rows = [np.stack([np.arange(s, s + n), np.arange(d, d + n)], 1) for s, d, n in descs.tolist()]
    return np.concatenate(rows) if rows else np.empty((0, 2), dtype=np.int64)


@pytest.mark.parametrize("rails", [1, 2, 3, 7])
def test_split_gives_each_rail_an_equal_share_of_exactly_the_same_bytes(rails):
    rng = np.random.default_rng(rails)
    for _ in range(200):
        n = int(rng.integers(0, 30))
        d = np.stack([rng.integers(0, 4096, n), rng.integers(0, 4096, n), rng.integers(0, 300, n)], 1).astype(np.int64)
        parts = split(d, rails)
        total = int(d[:, LEN].sum())
        got = [int(p[:, LEN].sum()) for p in parts]
        assert len(parts) == rails and sum(got) == total
        assert got == [(total * (r + 1)) // rails - (total * r) // rails for r in range(rails)]
        if rails > 1:  # (one rail: the array as it is)
            assert all((p[:, LEN] > 0).all() for p in parts)  # no empty descriptor goes on a wire
        assert (_bytes_of(np.concatenate(parts)) == _bytes_of(d)).all()


def test_split_cuts_a_straddling_descriptor_and_the_cache_keeps_the_split():
    d = np.array([[0, 1000, 10], [100, 2000, 10]], dtype=np.int64)  # 20 bytes: the cut at 10 falls between them
    assert [p.tolist() for p in split(d, 2)] == [[[0, 1000, 10]], [[100, 2000, 10]]]
    d = np.array([[0, 1000, 15], [100, 2000, 5]], dtype=np.int64)  # the cut at 10 falls inside the first
    assert [p.tolist() for p in split(d, 2)] == [[[0, 1000, 10]], [[10, 1010, 5], [100, 2000, 5]]]
    s = Splits(2)
    assert s.of(d) is s.of(d)
    assert shares([d, d], 2) == ([20, 20], [2, 4])
    with pytest.raises(ValueError):
        split(d, 0)


def test_rails_choice_and_its_refusals():
    assert select_rails("h", {"addr": "127.0.0.1,127.0.0.2"}) == [("127.0.0.1", "lo"), ("127.0.0.2", None)]
    assert select_rails("h", {"addr": "127.0.0.1,127.0.0.2", "rails": 1}) == [("127.0.0.1", "lo")]
    assert select_rails("h", {"ifname": "lo", "rails": 1}) == [("127.0.0.1", "lo")]
    with pytest.raises(TransportError, match="more rails than the 2 addresses"):
        select_rails("h", {"addr": "127.0.0.1,127.0.0.2", "rails": 3})
    with pytest.raises(TransportError, match="more rails than the 1 NICs"):
        select_rails("h", {"ifname": "lo", "rails": 2})
    with pytest.raises(TransportError, match="no interface with an IPv4 address matches 'kvbnope9'"):
        select_rails("h", {"ifname": "lo,kvbnope9"})
    with pytest.raises(TransportError, match="name the NICs"):
        select_rails("h", {"rails": 2})
    with pytest.raises(TransportError, match="two rails on one address"):
        select_rails("h", {"addr": "127.0.0.1,127.0.0.1"})


@pytest.mark.parametrize("op", ["push", "pull"])
def test_two_rails_over_loopback_move_every_byte_each_rail_its_share(kvrun, op):
    """-c all over two loopback addresses: nothing wrong, and by the kernel's count of each rail's connection
    each carried half of the request (its share plus one header per post)."""
    r = kvrun(["-t", "tcp", "-O", "addr=127.0.0.1,127.0.0.2", "--op", op, "-m", "llama-3-8b", "--tokens", "256",
               "-b", "16", "-e", "16", "-n", "3", "-w", "1", "-c", "all", "--variants", "bulk,paged"], timeout=240)
    assert r.code == 0, r.out + r.err
    rows = r.transfers()
    assert len(rows) and int(rows.nwrong.fillna(0).sum()) == 0
    dec = rows[(rows.role == "decode") & (rows.iter >= 0)]
    for _, row in dec.iterrows():
        assert row.rails == 2 and len(row.rail_nics.split(",")) == 2
        share = [int(x) for x in row.rail_bytes.split(",")]
        wire = [int(x) for x in row.rail_wire_bytes.split(",")]
        assert sum(share) == row.payload_bytes and abs(share[0] - share[1]) <= 1
        assert sum(int(x) for x in row.rail_descs.split(",")) >= row.descriptors
        for s, w in zip(share, wire):  # the payload and a few 32-byte headers a post, nothing else
            assert s <= w <= s + 64 * row.layers, (share, wire)
    infos = r.meta()["transports"]["tcp"]
    assert {tuple(i["rail_addrs"]) for i in infos} == {("127.0.0.1", "127.0.0.2")}


def test_more_rails_than_nics_and_a_missing_nic_are_one_line_and_nothing_written(kvrun, tmp_path):
    for opts, why in ((["ifname=lo", "rails=2"], "more rails than the 1 NICs"), (["ifname=lo,kvbnope9"], "kvbnope9"),
                      (["ifname=kvbnope9"], "kvbnope9"), (["rails=2"], "name the NICs")):
        r = kvrun(["-t", "tcp", *[x for o in opts for x in ("-O", o)], "-n", "1", "-w", "0", "--tokens", "16"], timeout=60)
        assert r.code == 1 and why in r.err and len(r.err.strip().splitlines()) == 1, r.out + r.err
        assert r.results is None
