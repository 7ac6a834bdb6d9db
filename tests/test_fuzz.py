"""Fuzzing what a user types: flags, -O options, suite and model YAML.  Every malformed input ends
within seconds with one line (ConfigError, or argparse's error) and never a traceback, a hang or a
file; every accepted input expands into cases whose geometry holds."""
import os

import yaml
from helpers.asserts import assert_one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cli.main import ArgError, build_parser
from kvbench.config import runconfig as config
from kvbench.harness.loop import case_geometry

NUM = st.one_of(st.integers(-3, 4).map(str), st.integers(-3, 70000).map(str),
                st.sampled_from(["0", "-16", "16", "64", "256", "inf", "nan", "1e309", "32.5", "abc", "", "16,16",
                                 "1,-1", "0x10", " 8", "-5"]))
BAD = st.sampled_from(["", "x", "shm,shm", "inf", "nan", "-1", "0", "32.5", "1,,2"])


def pick(*good: str):
    """Mostly values a user would type for this flag, sometimes a wrong one."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), BAD, NUM)


FLAGS = {"-t": pick("shm", "tcp", "mpi", "loopback", "verbs", "shm,tcp"), "--op": pick("push", "pull", "push,pull"),
         "-b": NUM, "-e": NUM, "-f": pick("2", "4"), "-n": pick("1", "2", "5"), "-w": pick("0", "1"),
         "--rounds": pick("1", "2"), "--tokens": pick("16", "256", "1000", "4096"), "--prefix-hit": NUM,
         "--alloc": pick("random", "contiguous", "fragmented:4", "fragmented:0"), "--coalesce": pick("on", "off"),
         "--dtype": pick("fp16", "bf16", "fp8-e4m3", "fp32"), "-m": pick("llama-3-8b", "deepseek-v3", "opt-66b"),
         "--tp": pick("1", "2", "8", "3"), "--pp": pick("1", "2", "200"), "--timeout": pick("5", "600", "1e-9"),
         "--setup-timeout": pick("5", "1e6"), "--pool-factor": pick("1", "2.5", "0.5"), "--inflight": NUM,
         "--overlap": pick("serial", "streaming"), "--prefill-ms": pick("0", "10", "auto", "-1"),
         "--arrival": pick("none", "poisson:5", "interval:10", "poisson:0"), "--requests": NUM,
         "--prompt": pick("256", "16,64", "uniform:16:64", "lognormal:128:0.5", "uniform:64:16"),
         "--layers": pick("2", "32"), "--kv-heads": pick("1", "8"), "--head-dim": pick("64", "128"),
         "-c": pick("0", "1"), "--inject-corruption": pick("0", "1"), "--scheme": pick("pairwise", "all-pairs"),
         "--handshake": pick("off", "serial", "overlap"), "--decode-pool-tokens": NUM,
         "--cache": pick("as-is", "warm", "cold"), "--memory": pick("host", "cuda"),
         # a trace read per example would pass the deadline: test_trace_replay.py runs the real ones
         "--trace": pick("mooncake-nope", "no/such.jsonl"), "--speed": pick("50", "0", "-1", "nan"),
         "--cache-blocks": pick("2", "0", "-1"), "--trace-block": pick("16", "0", "-1", "x")}
OPTION = st.tuples(st.sampled_from(["", "tcp.", "mpi.", "nixl.", "shm.", "x."]),
                   st.sampled_from(["poll", "polll", "sockbuf", "split", "window", "prep", "batch", "connect_timeout",
                                    "ready", ""]),
                   st.sampled_from(["=", ""]), st.one_of(NUM, BAD, st.sampled_from(["spin", "on", "create"]))).map(lambda t: "".join(t))
ARGV = st.tuples(st.lists(st.tuples(st.sampled_from(sorted(FLAGS)), st.data()), max_size=6),
                 st.lists(OPTION, max_size=3))


def check(argv: list[str], results: str) -> None:
    """What rank 0 does with ``argv`` before anything starts."""
    try:
        a = build_parser().parse_args(["run", "-o", results, *argv])
    except ArgError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    try:
        cfg = config.build(a, argv, world=2)
    except config.ConfigError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return
    for case in cfg.cases:  # accepted input: its geometry must hold (no late failure on the ranks)
        g = case_geometry(case)
        assert g["payload"] > 0 and g["nblocks"] > 0


@settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(ARGV)
def test_flags_and_options(tmp_path_factory, args):
    flags, opts = args
    argv = []
    for flag, data in flags:
        argv += [flag, data.draw(FLAGS[flag])]
    for o in opts:
        argv += ["-O", o]
    out = str(tmp_path_factory.getbasetemp() / "never-written")
    check(argv, out)
    assert not os.path.exists(out)


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(FLAGS)), st.data())
def test_one_flag_on_a_valid_run(tmp_path_factory, flag, data):
    """A valid command line with one flag fuzzed: whatever slips past validation must still expand."""
    argv = ["-t", "shm", "--tokens", "256", "-n", "2", "-w", "0", flag, data.draw(FLAGS[flag])]
    out = str(tmp_path_factory.getbasetemp() / "never-written")
    check(argv, out)
    assert not os.path.exists(out)


SCALAR = st.one_of(st.integers(-5, 5000), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.booleans(), st.none(), st.sampled_from(["shm", "push", "auto", "16", "llama-3-8b"]))
VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=3), st.dictionaries(st.text(max_size=5), SCALAR, max_size=2))
SUITE_KEYS = ["name", "iters", "warmup", "rounds", "check", "scheme", "seed", "pool_factor", "timeout", "variants",
              "prefill_tflops", "workload", "axes", "bogus"]
AXES_KEYS = ["transport", "op", "model", "tokens", "prefix_hit", "block_size", "alloc", "dtype", "tp", "overlap",
             "prefill_ms", "arrival", "blocksize"]


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(SUITE_KEYS), VALUE, max_size=5),
       st.dictionaries(st.sampled_from(AXES_KEYS), st.one_of(VALUE, st.lists(SCALAR, min_size=1, max_size=3)),
                       max_size=4),
       st.booleans())
def test_suite_yaml(tmp_path_factory, top, axes, duplicate):
    d = tmp_path_factory.mktemp("suite")
    data = dict(top)
    if axes:
        data["axes"] = axes
    text = yaml.safe_dump(data, allow_unicode=True)
    if duplicate and top:
        text += f"{next(iter(top))}: 1\n"
    p = d / "s.yaml"
    p.write_text(text)
    check([str(p)], str(d / "never-written"))
    assert not (d / "never-written").exists()


MODEL_KEYS = ["name", "layers", "kv_heads", "head_dim", "attention", "kv_lora_rank", "rope_dim", "params_b", "q_heads",
              "extra"]


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(MODEL_KEYS), st.one_of(SCALAR, st.sampled_from(["mla", "gqa", 8, 128, 32])),
                       max_size=6))
def test_model_yaml(tmp_path_factory, fields):
    d = tmp_path_factory.mktemp("model")
    p = d / "m.yaml"
    p.write_text(yaml.safe_dump(fields, allow_unicode=True))
    check(["-t", "shm", "-m", str(p)], str(d / "never-written"))


@settings(max_examples=int(os.environ.get('KVBENCH_FUZZ_REAL', 8)), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(set(FLAGS) - {"-c", "--inject-corruption", "-t", "--layers", "--kv-heads",
                                             "--head-dim"})),
       st.sampled_from(["inf", "nan", "-1", "x", "0,0"]))
def test_malformed_flag_on_real_ranks(kvrun, tmp_path_factory, flag, value):
    """On 2 real ranks: a malformed value ends with one line and exit 1, no traceback, no file, no OK footer."""
    out = tmp_path_factory.mktemp("real") / "results"
    r = kvrun(["-t", "shm", "--tokens", "256", "-n", "1", "-w", "0", flag, value], timeout=60, out_dir=out)
    assert_one_line(r)
    assert "OK" not in r.out and not out.exists()
