"""`kvbench run --trace`: a trace replayed through the workload harness (model/traceplan.py, harness/load.py).

Exact moved tokens per request against the prefix-cache replay of model/trace.py, the clips said aloud, real
two-rank replays with #wrong 0, the report's trace section, and bad input refused in one line."""

import numpy as np
import pytest
from helpers.args import TRACE
from helpers.asserts import assert_nothing_written, assert_one_line
from helpers.traces import write_trace

from kvbench.cli.main import build_parser
from kvbench.config import runconfig as config
from kvbench.model import shapes as M
from kvbench.model import trace as T
from kvbench.model import traceplan as TP

# the five requests of helpers/traces.py's HAND (512-token blocks): moved tokens with no cache limit and with 2 blocks
MOVED_UNBOUNDED = [1000, 1500 - 1024, 1, 700, 1200 - 1024]  # request 3: its whole prompt hits, 1 token moves
MOVED_LRU2 = [1000, 476, 1, 700, 1200]  # --cache-blocks 2: requests 4's blocks evict 1 and 2 before request 5


# ----- the plan (no MPI) ---------------------------------------------------------------------
@pytest.mark.parametrize("capacity,expect", [(None, MOVED_UNBOUNDED), (2, MOVED_LRU2)])
def test_moved_tokens_are_the_prompt_less_the_replayed_hit(tmp_path, capacity, expect):
    src = write_trace(tmp_path / "hand.jsonl")
    p = TP.plan(src, 5, capacity)
    st = T.replay(T.read(src), capacity)
    from_replay = np.maximum(T.read(src).input_len - st.hit_tokens_each(T.read(src).input_len), 1)
    got = TP.deal(p, 0, 1, 5)
    assert got.ntok.tolist() == expect == from_replay.tolist()
    assert got.arrival_s.tolist() == [0, 0.01, 0.02, 0.03, 0.04]
    assert (got.cut_context, got.cut_pool, got.full_hits) == (0, 0, 1)
    assert p.hit_blocks == int(st.hit_blocks.sum()) and p.blocks == 11
    assert sum(p.hit) == st.hit_tokens


def test_two_prefill_ranks_take_turns_over_the_trace(tmp_path):
    p = TP.plan(write_trace(tmp_path / "hand.jsonl"), 4)
    a, b = TP.deal(p, 0, 2, 2), TP.deal(p, 1, 2, 2)
    assert a.ntok.tolist() == [1000, 1] and b.ntok.tolist() == [476, 700]  # requests 1,3 and 2,4
    assert a.arrival_s.tolist() == [0, 0.02] and b.arrival_s.tolist() == [0.01, 0.03]


def test_clips_are_counted():
    # a prompt beyond the context is cut to its first 8,192 tokens, its hit to what lies within them
    ntok, cut_c, cut_p, full = TP.moved([10_000, 9_000, 100], [0, 8_704, 0], context=8_192)
    assert ntok.tolist() == [8_192, 1, 100] and (cut_c, cut_p, full) == (2, 0, 1)
    ntok, cut_c, cut_p, full = TP.moved([10_000, 9_000, 100], [0, 8_704, 0], pool=4_096)
    assert ntok.tolist() == [4_096, 296, 100] and (cut_c, cut_p, full) == (0, 1, 0)


def test_the_preamble_says_every_clip(tmp_path):
    p = TP.plan("mooncake-conversation", 200)
    lines = TP.preamble(p, 1, [50.0], {"llama-3-8b": 8192, "mine.yaml": 0}, 0)
    text = "\n".join(lines)
    assert "the first 200 of 12,031 requests" in text and "at 50x" in text
    cut = sum(1 for n in p.input if n > 8192)
    assert cut > 0 and f": {cut} of 200 prompts are cut to their first 8,192 tokens" in text
    assert f"mine.yaml has no known context: prompts run to the trace's {max(p.input):,} tokens" in text
    assert f"block hit {100 * p.hit_blocks / p.blocks:.2f}%" in text


# ----- bad input (in process: rank 0's validation; two on real ranks below) -------------------
def build(args, world=2):
    a = build_parser().parse_args(["run", *args])
    return config.build(a, ["run", *args], world)


@pytest.mark.parametrize("args,needle", [
    (["--trace", "mooncake-nope"], "trace 'mooncake-nope': no such file (named traces: mooncake-conversation"),
    (["--trace", "mooncake-synthetic", "--speed", "0"], "--speed 0: give a positive factor"),
    (["--trace", "mooncake-synthetic", "--speed", "-2"], "--speed -2: give a positive factor"),
    (["--trace", "mooncake-synthetic", "--speed", "nan"], "--speed nan: give a positive factor"),
    (["--trace", "mooncake-synthetic", "--requests", "0"], "field 'workload.requests'"),
    (["--trace", "mooncake-synthetic", "--requests", "4000"], "has 3,993 requests: it cannot replay 4,000"),
    (["--trace", "mooncake-synthetic", "--arrival", "poisson:5"], "--arrival: --trace replays the trace's arrivals"),
    (["--trace", "mooncake-synthetic", "--prompt", "64"], "--prompt: --trace replays the trace's prompt lengths"),
    (["--trace", "mooncake-synthetic", "--prefix-hit", "16"], "--prefix-hit: --trace replays the trace's prefix hits"),
    (["--speed", "50"], "--speed applies to a trace's replay: give --trace"),
    (["--cache-blocks", "20"], "--cache-blocks applies to a trace's replay: give --trace"),
    (["--trace", "mooncake-conversation", "--requests", "2000"], "the replay's arrivals span 669 s, more than one case may take (--timeout 600 s)"),
])
def test_bad_trace_flags_are_one_line(args, needle):
    with pytest.raises(config.ConfigError) as exc:
        build(["-t", "shm", *args])
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_each_speed_is_replayed_as_given():
    """--speed's factor reaches the arrival axis whole: 6 significant digits made 1234567 1234570 and 1.0000001 1."""
    cfg = build(["-t", "shm", "--trace", "mooncake-synthetic", "--speed", "1234567,1,1.0000001"])
    assert cfg.suite.axes.arrival == ["trace:1234567", "trace:1", "trace:1.0000001"]


def test_a_trace_file_is_stored_whole_and_a_named_one_by_name(tmp_path, monkeypatch):
    """--resume reads the trace from the sidecar's config, maybe in another folder: a relative path is stored whole."""
    write_trace(tmp_path / "hand.jsonl")
    monkeypatch.chdir(tmp_path)
    cfg = build(["-t", "shm", "--trace", "hand.jsonl", "--requests", "2"])
    assert cfg.suite.workload.trace == str(tmp_path / "hand.jsonl")
    assert build(["-t", "shm", "--trace", "mooncake-synthetic"]).suite.workload.trace == "mooncake-synthetic"


def test_cache_blocks_zero_is_refused_by_the_parser():
    from kvbench.cli.args import ArgError

    with pytest.raises(ArgError, match="'0' is not a positive number of blocks"):
        build_parser().parse_args(["run", "--trace", "mooncake-synthetic", "--cache-blocks", "0"])


def test_a_suite_trace_needs_trace_arrivals():
    with pytest.raises(Exception, match="arrival poisson:5 is not trace:<speed>"):
        from kvbench.config import suite as S

        S.expand(S.validate({"name": "x", "workload": {"trace": "mooncake-synthetic"},
                             "axes": {"arrival": ["poisson:5"]}}))


# ----- real two-rank replays -------------------------------------------------------------------
def test_replay_moves_exactly_the_uncached_tokens(kvrun, tmp_path):
    src = write_trace(tmp_path / "hand.jsonl")
    r = kvrun([*TRACE, "--trace", src, "--requests", "5", "--speed", "10"], timeout=240)
    assert r.code == 0, r.out + r.err
    assert "# wrong elements: 0" in r.out
    df = r.transfers()
    bpt = M.bytes_per_token(M.shard(M.get_model("llama-3-8b"), 8, 1), "fp16")
    for role in ("prefill", "decode"):
        rows = df[df.role == role].sort_values("iter")
        assert (rows.payload_bytes // bpt).tolist() == MOVED_UNBOUNDED, role
        assert (rows.payload_bytes % bpt == 0).all()
    dec = df[df.role == "decode"].sort_values("iter")
    assert (dec.status == "ok").all() and dec.nwrong.sum() == 0
    assert np.allclose(dec.arrival_s.to_numpy(), [0, 0.001, 0.002, 0.003, 0.004])  # timestamps / 10, in s
    assert (dec.workload == "trace:10").all()
    st = T.replay(T.read(src))
    facts = r.meta()["load"]["1"]["trace"]
    assert facts["moved_tokens"] == sum(MOVED_UNBOUNDED) and facts["full_hits"] == 1
    assert facts["block_hit_rate"] == round(st.block_hit_rate, 6)
    assert r.meta()["trace"]["replayed"] == 5
    assert f"block hit {100 * st.block_hit_rate:.2f}%, token hit {100 * st.token_hit_rate:.2f}%" in r.out
    assert "1 request hit in full with llama-3-8b: each moves 1 token" in r.out
    load = next(ln for ln in r.out.splitlines() if ln.startswith("# load: case 1"))
    assert "exposed p50/p95/p99" in load and "queue p50/p95/p99" in load
    # the report's trace section reads the same run
    from kvbench.report.build import build as report_build

    page, _ = report_build([r.results])
    table = next(s for s in page.sections if s.title == "Trace replay").tables[0][1].iloc[0]
    assert table["tokens moved"] == f"{sum(MOVED_UNBOUNDED):,}" and table["speed"] == "10x"
    assert table["block hit %"] == f"{100 * st.block_hit_rate:.2f}" and table["admitted"] == 5 and table["trace"] == "hand.jsonl"


def test_replay_of_the_conversation_trace_says_its_cuts(kvrun):
    r = kvrun([*TRACE, "--trace", "mooncake-conversation", "--requests", "30", "--speed", "50",
               "--decode-pool-tokens", "2048", "-c", "all"], timeout=300)
    assert r.code == 0, r.out + r.err
    assert "# wrong elements: 0" in r.out
    p = TP.plan("mooncake-conversation", 30)
    cut = sum(1 for n in p.input if n > 8192)
    assert f": {cut} of 30 prompts are cut to their first 8,192 tokens" in r.out
    assert "# trace: decode pool 2,048 tokens (--decode-pool-tokens): a request moves at most that" in r.out
    dec = r.transfers().query("role == 'decode'")
    assert len(dec) == 30 and dec.payload_bytes.max() == 2048 * 16384
    assert dec[dec.status == "ok"].nwrong.sum() == 0 and (dec.status == "ok").any()


def test_bad_trace_input_on_real_ranks(kvrun, tmp_path):
    assert_one_line(kvrun(["-t", "shm", "--trace", "mooncake-nope"]), "trace 'mooncake-nope': no such file")
    assert_one_line(kvrun(["-t", "shm", "--trace", "mooncake-synthetic", "--speed", "0"]), "--speed 0")
    assert_nothing_written(tmp_path)


def test_a_replay_line_gives_the_prompt_lengths_and_says_when_most_requests_were_dropped():
    from kvbench.model import workload as W

    p = TP.plan("mooncake-conversation", 30)
    line, facts = TP.summary_line(1, p, 50.0, [])
    q = [int(x) for x in np.percentile(p.input, [50, 95, 100], method="inverted_cdf")]
    assert facts["prompt_p50_p95_max"] == q and q[2] == max(p.input)
    assert f"prompts p50/p95/max {q[0]:,}/{q[1]:,}/{q[2]:,} tokens (the row's tokens column is the suite's" in line
    st = {"admitted": 9, "dropped": 191, "violations": 0, "peak": 1, "mean": 1.0,
          **{f"{k}_p{q}": 0.001 for k in ("queue", "exposed") for q in (50, 95, 99)}}
    case = {"transport": "tcp", "op": "push", "overlap": "serial", "arrival": "trace:50"}
    assert "MOST DROPPED: 191 of 200 requests found no decode blocks" in W.summary_line(1, case, 8, st, True)
    assert "DROPPED" not in W.summary_line(1, case, 8, dict(st, admitted=100, dropped=100), True)
