"""The ucx transport with what each rank handed to UCX written down at close (tests/test_ucx_rma.py), and liars
over its one-sided path (a block put in its neighbour's place; one byte from the wrong place).

Registered over "ucx" itself (KVBENCH_TRANSPORTS=ucx=ucx_counted:Counted), so that ``-O mode=...`` applies: the
one-sided mode writes the bytes the C extension handed to ucp_put_nbx / ucp_get_nbx (its own counters), the tag
mode the bytes this wrapper saw handed to ucxx's tag sends; each rank's file is $KVBENCH_UCX_COUNTS/<rank>.json.
"""
from __future__ import annotations

import json
import os

import numpy as np
from liars import _Lie, _WrongBlock

from kvbench.model.descriptors import LEN, SRC
from kvbench.transports.ucx import UcxTransport
from kvbench.transports.ucx_rma import UcxRmaTransport


def _write(rank: int, counts: dict) -> None:
    where = os.environ.get("KVBENCH_UCX_COUNTS")
    if where:
        with open(os.path.join(where, f"{rank}.json"), "w") as fh:
            json.dump(counts, fh)


class _CountedRma(UcxRmaTransport):
    def close(self):
        if self._pool is not None and self._worker is not None:
            _write(self.ctx.rank, dict(self.counts(), mode="rma", tag_bytes=0))
        super().close()


class _CountedTag(UcxTransport):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.tag_bytes = 0

    def _send(self, peer, arr, tag):
        self.tag_bytes += arr.nbytes
        return super()._send(peer, arr, tag)

    def _send_parts(self, peer, views, tags):
        self.tag_bytes += sum(v.nbytes for v in views)
        return super()._send_parts(peer, views, tags)

    def close(self):
        if self._worker is not None:
            from kvbench import _ucx

            put, get, posts = _ucx.counts()
            _write(self.ctx.rank, {"mode": "tag", "put_bytes": put, "get_bytes": get, "rma_posts": posts,
                                   "tag_bytes": self.tag_bytes})
        super().close()


class Counted(UcxTransport):
    """``ucx`` as the registry builds it, counted: the one-sided class, or the tag class under -O mode=tag."""

    def __new__(cls, ctx):
        return (_CountedTag if ctx.options.get("mode", "rma") == "tag" else _CountedRma)(ctx)


class WrongBlockRma(_WrongBlock, UcxRmaTransport):
    """Puts (gets) every block into its neighbour's place, one-sided."""

    name = "lie-wrong-block-ucx"


class _OneByte(_Lie):
    """Moves every byte but one: the first block's last byte comes from the first byte of the block."""

    def lie_descs(self, descs):
        d = descs[:1].copy()
        first = d[0].copy()
        d[0, LEN] -= 1
        first[SRC], first[1], first[LEN] = first[SRC], first[1] + first[LEN] - 1, 1
        return np.ascontiguousarray(np.concatenate([d, first[None], descs[1:]]))


class OneByteRma(_OneByte, UcxRmaTransport):
    name = "lie-one-byte-ucx"
