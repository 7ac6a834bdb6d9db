"""`run --trace` with `--alloc aged:N`: the decode pool aged by the trace's own requests (model/ageing.py,
model/traceplan.py), a real two-rank replay from that pool, and `--trace-block` on `run`."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.args import TRACE
from helpers.asserts import assert_nothing_written, assert_one_line
from helpers.traces import write_trace

from kvbench.cli.args import ArgError
from kvbench.cli.main import build_parser
from kvbench.config import runconfig as config
from kvbench.model import ageing as A
from kvbench.model import traceplan as TP

# (timestamp ms, input tokens, output tokens): one 512-token hash id each
FOUR = [(0, 30, 2), (200, 100, 9), (300, 40, 3), (600, 16, 4)]


def write_four(path) -> str:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": [k]})
                            + "\n" for k, (t, n, o) in enumerate(FOUR)))
    return str(path)


def test_the_trace_ages_the_pool_in_the_order_computed_by_hand(tmp_path):
    # 8 blocks of 16 tokens, speed 2 (arrivals 0, 0.1, 0.15, 0.3 s), context 64, 20 ms per output token, aged:6:
    # the trace's 4 requests and then its first 2 again, one span (0.6 s) plus a mean gap (0.2 s) later: 0.4, 0.5 s
    #   r0 0.00 s: 30+2 tokens = 2 blocks, lives 0.04 s: takes 0,1              queue 2..7
    #   r1 0.10 s: A ended, gave 1,0 to the tail (last block first)             queue 2,3,4,5,6,7,1,0
    #        prompt 100 cut to the context's 64: 64+9 = 73 tokens = 5 blocks (uncut: 7), lives 0.18 s (to 0.28):
    #        takes 2,3,4,5,6                                                    queue 7,1,0
    #   r2 0.15 s: 40+3 = 43 tokens = 3 blocks, lives 0.06 s (to 0.21): takes 7,1,0   queue empty
    #   r3 0.30 s: r2 (0.21) then r1 (0.28) ended: 0,1,7 then 6,5,4,3,2         queue 0,1,7,6,5,4,3,2
    #        16+4 = 20 tokens = 2 blocks, lives 0.08 s (to 0.38): takes 0,1     queue 7,6,5,4,3,2
    #   r0' 0.40 s: r3 ended, gave 1,0                                          queue 7,6,5,4,3,2,1,0
    #        2 blocks to 0.44: takes 7,6                                        queue 5,4,3,2,1,0
    #   r1' 0.50 s: r0' gave 6,7                                                queue 5,4,3,2,1,0,6,7
    #        5 blocks to 0.68: takes 5,4,3,2,1                                  queue 0,6,7
    #   end: r1' gives 1,2,3,4,5                                                queue 0,6,7,1,2,3,4,5
    p = TP.plan(write_four(tmp_path / "four.jsonl"), 4, age=6)
    src = TP.ageing(p, speed=2.0, context=64)
    arrival, inp, out = src.requests(6)
    assert np.allclose(arrival, [0, 0.1, 0.15, 0.3, 0.4, 0.5])
    assert inp.tolist() == [30, 64, 40, 16, 30, 64] and out.tolist() == [2, 9, 3, 4, 2, 9]
    assert A.trace_aged_order(8, 16, 6, src).tolist() == [0, 6, 7, 1, 2, 3, 4, 5]
    # aged:3, the first 3 alone: as above to r2, then r2 (ends 0.21) gives 0,1,7 and r1 (0.28) 6,5,4,3,2
    assert A.trace_aged_order(8, 16, 3, src).tolist() == [0, 1, 7, 6, 5, 4, 3, 2]
    assert "the trace's 4 requests cycled to 6 (2 passes" in TP.aged_line(p, 6)
    assert "the trace's first 3 requests" in TP.aged_line(p, 3)
    assert TP.ageing(TP.plan(str(tmp_path / "four.jsonl"), 4), 2.0) is None  # no aged:<N>: nothing carried


def test_a_replay_from_a_trace_aged_pool_is_checked_and_says_what_aged_it(kvrun, tmp_path):
    src = write_trace(tmp_path / "hand.jsonl")
    r = kvrun([*TRACE, "--trace", src, "--requests", "5", "--speed", "10", "--alloc", "aged:50", "--coalesce", "on",
               "-c", "all", "--progress", "off"], timeout=240)
    assert r.code == 0, r.out[-3000:] + r.err[-3000:]
    assert "# wrong elements: 0" in r.out
    assert ("# aged:50: each decode rank's free list aged by the trace's 5 requests cycled to 50 (10 passes"
            in r.out)
    dec = r.transfers().query("role == 'decode'").sort_values("iter")
    assert (dec.status == "ok").all() and dec.nwrong.sum() == 0
    # request 0 takes the head of the trace-aged queue (pool: 4 x its 63 blocks; llama-3-8b's context 8,192 cuts
    # nothing): prefill's slot is contiguous, so it moves one descriptor per run of that head per layer and region
    p = TP.plan(src, 5, age=50)
    head = A.trace_aged_order(4 * 63, 16, 50, TP.ageing(p, 10.0, 8192))[:63]
    runs = 1 + int((np.diff(head) != 1).sum())
    assert 1 < runs and dec.descriptors.iloc[0] == 32 * 2 * runs


# ----- --trace-block on run --------------------------------------------------------------------
def build(args, world=2):
    a = build_parser().parse_args(["run", *args])
    return config.build(a, ["run", *args], world)


def test_run_reads_a_trace_in_other_blocks(tmp_path):
    cfg = build(["-t", "shm", "--trace", write_trace(tmp_path / "hand.jsonl"), "--requests", "5",
                 "--trace-block", "256"])
    p = cfg.trace_plan()
    # hits of 256-token blocks: r2 shares 2 blocks (512 tokens), r3 its one (256 of 300), r5 two (512)
    assert p.block == 256 and p.hit == [0, 512, 256, 0, 512]
    assert "(256-token blocks)" in "\n".join(cfg.workload_lines(2))


@pytest.mark.parametrize("value", ["0", "-4", "abc", "1.5"])
def test_a_bad_trace_block_is_refused_by_the_parser(value):
    with pytest.raises(ArgError, match=f"'{value}' is not a positive number of tokens"):
        build_parser().parse_args(["run", "--trace", "mooncake-synthetic", "--trace-block", value])


@pytest.mark.parametrize("args,needle", [
    (["--trace-block", "16"], "--trace-block applies to a trace's replay: give --trace"),
    (["--trace", "HAND", "--requests", "5", "--trace-block", "1024"], "is the trace's block size 1024 tokens"),
])
def test_trace_block_mistakes_are_one_line(tmp_path, args, needle):
    args = [write_trace(tmp_path / "hand.jsonl") if x == "HAND" else x for x in args]
    with pytest.raises(config.ConfigError) as exc:
        build(["-t", "shm", *args])
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_bad_trace_block_on_real_ranks_is_one_line(kvrun, tmp_path):
    r = kvrun(["-t", "shm", "--trace", "mooncake-synthetic", "--trace-block", "-4"])
    assert_one_line(r, "'-4' is not a positive number of tokens")
    assert_nothing_written(tmp_path)
