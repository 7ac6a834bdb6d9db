"""The run's trace replay as configuration: ``--trace``'s flags read into workload fields, and the trace read on
rank 0 into the plan its ranks replay (runconfig calls both)."""
from __future__ import annotations

import os

from kvbench.config import ConfigError
from kvbench.config import suite as S
from kvbench.model import traceplan
from kvbench.model.layout import aged_n
from kvbench.model.schemes import make_pairs
from kvbench.model.trace import NAMED

TRACE_FLAGS = ("trace", "speed", "cache_blocks", "trace_block")


def trace_flags(a, axes: dict) -> dict:
    """--trace, --speed, --cache-blocks -> workload fields (and the arrival axis); flags they contradict refused."""
    trace, speeds, cache, block = (getattr(a, k, None) for k in TRACE_FLAGS)
    if trace is None:
        for flag, v in (("--speed", speeds), ("--cache-blocks", cache), ("--trace-block", block)):
            if v is not None:
                raise ConfigError(f"{flag} applies to a trace's replay: give --trace FILE|NAME")
        return {}
    for flag, v, what in (("--arrival", a.arrival, "arrivals"), ("--prompt", a.prompt, "prompt lengths"),
                          ("--prefix-hit", a.prefix_hit, "prefix hits (its decode prefix cache)")):
        if v:
            raise ConfigError(f"{flag}: --trace replays the trace's {what}: leave {flag} out")
    for x in speeds or [1.0]:
        if not (x > 0 and x < float("inf")):  # nan compares false: refused
            raise ConfigError(f"--speed {x:g}: give a positive factor (50 replays the trace 50 times faster)")
    axes["arrival"] = [f"trace:{x:.15g}" for x in speeds or [1.0]]  # whole: :g kept 6 digits
    if trace not in NAMED and os.path.isfile(trace):  # a file: stored whole, so that --resume from another folder reads the same one
        trace = os.path.abspath(trace)
    return ({"trace": trace} | ({"cache_blocks": cache} if cache is not None else {})
            | ({"trace_block": block} if block is not None else {}))



def read_trace(suite: S.Suite, world: int) -> dict | None:
    """workload.trace read on rank 0 (the other ranks need no copy of the file): the requests its prefill ranks
    replay, with their hits; one line when the trace is unreadable, too short or slower than --timeout."""
    w = suite.workload
    if w is None or w.trace is None:
        return None
    srcs = len({s for s, _ in make_pairs(suite.scheme, world, suite.matrix)})
    try:
        age = max((n for n in (aged_n(a) for a in suite.axes.alloc) if n is not None), default=0)
        p = traceplan.plan(w.trace, w.requests * srcs, w.cache_blocks, w.trace_block, age)
    except traceplan.T.TraceError as exc:
        raise ConfigError(f"--trace: {exc}") from None
    for spec in suite.axes.arrival:
        speed = float(spec.partition(":")[2])
        if p.arrival_s[-1] / speed > suite.timeout:
            raise ConfigError(f"--speed {speed:g}: the replay's arrivals span {p.arrival_s[-1] / speed:,.0f} s, more "
                              f"than one case may take (--timeout {suite.timeout:g} s): raise --speed or --timeout, "
                              "or replay fewer --requests")
    return p.as_dict()
