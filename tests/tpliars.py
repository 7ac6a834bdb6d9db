"""A liar for --tp P:D (tests/test_tp_run.py): it sends the decode rank a head it does not own.

Registered through KVBENCH_TRANSPORTS (helpers/launch.py liar_env).  Every descriptor's source is moved one head on
(``HEAD`` bytes: one head of one token, head_dim 128 in fp16), so a slice of heads [h, h+k) arrives as [h+1, h+k+1):
the next prefill head, which the map gave another decode rank (or none), lands in this one's blocks.
"""
from __future__ import annotations

from liars import _Lie

from kvbench.model.descriptors import SRC
from kvbench.transports.shm import ShmTransport
from kvbench.transports.tcp import TcpTransport

HEAD = 128 * 2  # one head of one token: head_dim 128, fp16


class _NextHead(_Lie):
    def lie_descs(self, descs):
        d = descs.copy()
        d[:, SRC] += HEAD
        return d


class NextHeadShm(_NextHead, ShmTransport):
    name = "lie-next-head"


class NextHeadTcp(_NextHead, TcpTransport):
    name = "lie-next-head-tcp"


LIARS = {"lie-next-head": "tpliars:NextHeadShm", "lie-next-head-tcp": "tpliars:NextHeadTcp"}
