"""What a timed iteration does before its barrier and what it times (schedule.Iteration.run).

Without a handshake both block tables are known at admission, so a serial request's prepared post and the
target's registrations come before the barrier; only the start and the completion follow it.  With a
handshake, in streaming mode, or without a barrier handed in, they stay inside the iteration.
A recording transport and communicator log the order of the calls; no MPI is involved.  (The harness hands a
barrier to every iteration, the check pass's included, so the check sees the timed iterations' order.)
"""
from __future__ import annotations

import numpy as np
import pytest

from kvbench.harness.schedule import Iteration
from kvbench.model.schemes import Entry
from kvbench.transports.base import Caps, Context, Transport


class Comm:
    size = 2

    def __init__(self, rank: int, log: list):
        self.rank, self.log = rank, log

    def barrier(self):
        self.log.append("barrier")

    def notify(self, *a):
        self.log.append("notify")

    def wait_notify(self, *a):
        self.log.append("wait_notify")

    def isend_bytes(self, *a):
        return None

    def recv_bytes(self, *a):
        pass

    def waitall(self, *a):
        pass


class Recorder(Transport):
    """One-sided, completion notified by the transport (no harness messages on push)."""

    name = "recorder"
    batches = True
    caps = Caps(one_sided=True, notifies=True, network=True)

    def __init__(self, log: list):
        super().__init__(Context(0, 2, "h", "r"))
        self.log, self.tags = log, []

    def prepare_request(self, op, peer, layers, tags):
        self.log.append("prepare")
        return super().prepare_request(op, peer, layers, tags)

    def start_request(self, prepared):
        self.log.append("start")
        return super().start_request(prepared)

    def serve_request(self, op, peer, layers, tags):
        self.log.append("serve")
        return super().serve_request(op, peer, layers, tags)

    def post(self, op, peer, descs, tag=0):
        return ("posted", len(descs), tag)

    def serve(self, op, peer, descs, tag=0):
        return ("served", len(descs), tag)

    def wait(self, handle):
        self.log.append(f"wait {handle[0]} {handle[1]}")
        self.tags.append(handle[2])


def iteration(rank: int, op: str = "push", **case):
    log: list = []
    layers = [np.array([[k * 4096, k * 4096, 1024]], dtype=np.int64) for k in range(4)]
    entry = Entry(0, 0, 0, 1, layers, np.arange(4))
    spec = {"op": op, "handshake": "off", "overlap": "serial", "prefill_ms": 0.0, "prefill": "clock", **case}
    itr = Iteration(Recorder(log), Comm(rank, log), rank, [entry], spec, False)
    return itr, log


@pytest.mark.parametrize("op", ["push", "pull"])
def test_serial_prepares_before_the_barrier_and_times_start_and_completion(op):
    init_rank = 0 if op == "push" else 1
    itr, log = iteration(init_rank, op)
    done, *_ = itr.run(5 << 16, itr.comm.barrier)
    # one post of the request's 4 layers (joined), prepared before the barrier, started after it
    assert log[:2] == ["prepare", "barrier"]
    assert log[2:] == (["start"] if op == "push" else ["wait_notify", "start"]) + ["wait posted 4"]
    assert len(done) == 1 and done[0] >= 0.0
    itr, log = iteration(1 - init_rank, op)
    itr.run(5 << 16, itr.comm.barrier)
    # the target registers its one receive before the barrier
    assert log[:2] == ["serve", "barrier"]
    assert log[-1] == "wait served 4"


def test_without_a_barrier_or_with_a_handshake_everything_is_inside_the_iteration():
    itr, log = iteration(0)
    itr.run(5 << 16)  # a caller that synchronised itself: nothing can be done before the start
    assert log == ["prepare", "start", "wait posted 4"]
    itr, log = iteration(0, handshake="serial")
    itr.run(5 << 16, itr.comm.barrier)
    assert log.index("barrier") < log.index("prepare") < log.index("start")


def test_streaming_prepares_each_layer_inside_the_iteration():
    itr, log = iteration(0, overlap="streaming")
    itr.run(5 << 16, itr.comm.barrier)
    assert log[0] == "barrier"
    assert log[1:] == ["prepare", "start"] * 4 + ["wait posted 1"] * 4


def test_tags_are_new_every_iteration_and_the_same_lists_are_reused():
    itr, log = iteration(0)
    itr.run(5 << 16, itr.comm.barrier)
    joined = itr.t.one_post(itr.lists[id(itr.entries[0])][0])
    itr.run(6 << 16, itr.comm.barrier)
    assert itr.t.one_post(itr.lists[id(itr.entries[0])][0]) is joined  # found by the list's identity
    assert len(joined) == 4 and joined[:, 2].sum() == 4096
    # the joined post carries the last layer's tag, new in every iteration
    assert itr.t.tags == [(5 << 16) | 3, (6 << 16) | 3]


@pytest.mark.parametrize("asleep", [False, True])
def test_an_iteration_ends_with_a_barrier_before_any_bookkeeping_or_cache_setting(monkeypatch, asleep):
    """A rank done first (a pull's source) waits for its peers before it records its times or sets its caches
    for the next iteration, so none of the harness's work runs beside a peer's timed transfer; asleep where its
    transport's own threads move the peer's bytes (``idle_sleeps``), spinning in MPI otherwise."""
    from kvbench.harness.loop import Harness
    from kvbench.harness.state import Measurement, Options, Session

    log: list = []

    class HarnessComm(Comm):
        hostname = "here"

        def bcast(self, obj, root=0):
            return obj

        def allgather(self, obj):
            return [obj] * self.size

        def barrier_asleep(self):
            self.log.append("barrier asleep")

    class Itr:  # the iteration's transfer and the bookkeeping the harness asks of it afterwards
        t0, order, cost, prefill_s = 0.0, [], {}, 0.0

        def run(self, tag, start):
            start()
            log.append("transfer")
            return [], 0.0, 0.0, 0.0

        def prefill_ends(self, offset):
            log.append("bookkeeping")
            return {}, None

    class Cache:
        count = 0

        def apply(self):
            log.append("apply")
            self.count += 1

    h = Harness(HarnessComm(0, log), Options(iters=2, warmup=1, cache="warm"))
    monkeypatch.setattr(h, "sample", lambda *a, **k: None)
    case = {"transport": "recorder", "op": "pull", "model": "m", "tokens": 1, "variant": "bulk"}
    m = Measurement(1, case, {}, [], Itr(), cache=Cache())
    class T:
        idle_sleeps = asleep

    h.iterate(m, Session(T(), [], [], False, 0), warmup=1, iters=2)
    end = "barrier asleep" if asleep else "barrier"
    assert log == ["apply", "barrier", "transfer", end, "bookkeeping"] * 3
    assert len(m.rec) == 2 and m.cache_set == [True, True]


class Stamper(Recorder):
    """A transport with a receive thread of its own: its wait returns 50 ms after it is asked, with a landing stamp
    5 ms after that (a stamp that leads the wait's return by 45 ms)."""

    def wait(self, handle):
        import time

        a = time.perf_counter()
        time.sleep(0.05)
        return a + 0.005


def test_the_headline_is_the_harness_s_own_time_and_the_stamp_a_diagnostic():
    """Issue 42 item 3: a destination's time ends when its wait returned, never at a stamp the transport hands
    back; the stamp's lead over that return is kept (lead_s -> the row's stamp_lead_s) for the footer to judge."""
    log: list = []
    layers = [np.array([[k * 4096, k * 4096, 1024]], dtype=np.int64) for k in range(4)]
    spec = {"op": "push", "handshake": "off", "overlap": "serial", "prefill_ms": 0.0, "prefill": "clock"}
    itr = Iteration(Stamper(log), Comm(1, log), 1, [Entry(0, 0, 0, 1, layers, np.arange(4))], spec, False)
    done, *_ = itr.run(5 << 16, itr.comm.barrier)
    assert done[0] >= 0.05  # the stamp would say 5 ms
    assert 0.03 <= itr.cost["lead_s"][0] <= done[0]
