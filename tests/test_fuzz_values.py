"""Validation at the door (issue 32): NaN, inf, huge, negative, empty and duplicate values of every `kvbench run`
flag, every ``-O`` option and every suite field are refused with one line before anything is allocated or
written, or accepted for a reason stated here.  Checked in-process on rank 0's validation (argparse, RunConfig,
the suite, the -O models); test_errors.py launches the real runs that show the line and exit code 1."""
import math
import os

import pytest
from helpers.args import SHM_SMALL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cli.main import ArgError, build_parser
from kvbench.config import runconfig as config
from kvbench.config import suite as S
from kvbench.transports import options as O

KINDS = ("nan", "inf", "huge", "negative", "empty", "duplicate")
HUGE_INT = "99999999999999999999"  # past int64: a C call or numpy index taking it would overflow mid-run
VALUES = {"nan": "nan", "inf": "inf", "negative": "-1", "empty": ""}

# a valid value of each flag (for its duplicate) and what else it needs to reach its own validation
GOOD = {"--ranks": "2", "-t": "shm", "-b": "16", "-e": "64", "-f": "4", "-n": "2", "-w": "1", "--target-ci": "5%", "--ci-budget": "10", "--bind": "core", "--rounds": "2",
        "--progress": "off", "-c": "1", "--tokens": "256", "--op": "push", "--coalesce": "on", "--alloc": "random",
        "--layout": "auto", "--dtype": "fp16", "--memory": "host", "--copy": "batch", "--scheme": "pairwise",
        "--inflight": "2", "--seed": "7", "--pool-factor": "2", "--timeout": "60", "--setup-timeout": "60",
        "--pages": "4k", "--cache": "as-is", "--codec": "none", "--scales": "none", "--fill": "pattern",
        "--overlap": "serial", "--prefill-ms": "1", "--prefill": "clock", "--prefill-tflops": "100",
        "--handshake": "off", "--arrival": "interval:10", "--requests": "5", "--prompt": "64", "--decode-ms": "1",
        "--alloc-timeout": "10", "--decode-pool-tokens": "0", "--variants": "bulk", "-O": "poll=spin",
        "-o": "x", "--name": "n", "--inject-corruption": "0", "-m": "llama-3-8b", "--layers": "2",
        "--kv-heads": "8", "--head-dim": "64", "--attention": "gqa", "--kv-lora-rank": "64", "--rope-dim": "16",
        "--tp": "1", "--head-layout": "NHD", "--pp": "1", "--prefix-hit": "0", "--pool-sizes": "1MiB,2MiB", "--register": "once",
        "--trace": "mooncake-synthetic", "--speed": "100", "--cache-blocks": "100", "--trace-block": "512",
        "--matrix": "pairwise", "--nic": "auto", "--json": "rows.jsonl", "--csv": "rows.csv", "--expect": "auto"}
CONTEXT = {"--requests": ["--arrival", "interval:10"], "--prompt": ["--arrival", "interval:10"],
           "--decode-ms": ["--arrival", "interval:10"], "--alloc-timeout": ["--arrival", "interval:10"],
           "--decode-pool-tokens": ["--arrival", "interval:10"], "--prefill-tflops": ["--prefill-ms", "auto"],
           "-O": ["-t", "tcp"], "--head-layout": ["--tp", "1:1"], "--kv-heads": ["--layers", "2", "--head-dim", "64"],
           "--head-dim": ["--layers", "2", "--kv-heads", "8"], "--layers": ["--kv-heads", "8", "--head-dim", "64"],
           "--attention": ["--layers", "2", "--kv-heads", "8", "--head-dim", "64"],
           "--kv-lora-rank": ["--layers", "2", "--attention", "mla", "--head-dim", "64"],
           "--rope-dim": ["--layers", "2", "--attention", "mla", "--head-dim", "64", "--kv-lora-rank", "64"],
           "-b": ["-e", "1024"], "-e": ["-b", "16"], "-f": ["-b", "16", "-e", "64"],
           "--ci-budget": ["--target-ci", "5%"],  # what a case may spend reaching a target: alone, refused
           # a replay's flags need a trace; the trace, a speed that fits its arrivals into --timeout
           "--trace": ["--speed", "100"], "--matrix": ["--scheme", "matrix"], "--nic": ["-t", "tcp"], **{f: ["--trace", "mooncake-synthetic"] for f in ("--speed", "--cache-blocks", "--trace-block")}}
# --resume is a file of an earlier run (test_resume.py owns its refusals); --gpu-map names GPUs, and a machine with
# none has no valid value (test_placement.py owns its refusals, test_gpu_map_values below the values')
SKIP = {"-h", "--resume", "--gpu-map", "--compact", "--dry-run"}  # --compact: a switch, no value to fuzz

# (flag, kind) -> why the value is accepted at the door; anything not here must be refused
ACCEPTED = {
    **{(f, k): "a new file's name" for f in ("--json", "--csv") for k in ("nan", "inf", "huge", "negative", "duplicate")},
    ("--expect", "duplicate"): "argparse: the last of a repeated flag counts",
    ("--ranks", "duplicate"): "argparse: the last of a repeated flag counts",
    # a flag given twice: the last one counts, as in every argparse and getopt tool (a list flag's values
    # are what a duplicate means there, and those are refused)
    **{(f, "duplicate"): "argparse: the last of a repeated flag counts"
       for f in ("-b", "-e", "-f", "-n", "-w", "--target-ci", "--ci-budget", "--bind", "--rounds", "--progress", "-c", "--scheme", "--seed",
                 "--pool-factor", "--timeout", "--setup-timeout", "--pages", "--cache", "--fill", "--prefill-tflops",
                 "--requests", "--prompt", "--decode-ms", "--alloc-timeout", "--decode-pool-tokens", "-o", "--name",
                 "--inject-corruption", "--layers", "--kv-heads", "--head-dim", "--attention", "--kv-lora-rank",
                 "--rope-dim", "--pool-sizes", "--trace", "--trace-block", "--cache-blocks", "--matrix", "--nic")},
    ("--cache-blocks", "huge"): "a cache larger than the trace: every block stays, as unbounded",
    ("--speed", "huge"): "every arrival at once: a burst is a replay too",
    ("-O", "duplicate"): "the same option twice with the same value is one option (different values are refused)",
    # sizes whose bytes only the ranks' memory preflight can weigh against the machine: it refuses them with
    # one line and exit 1 before any pool is allocated (test_errors.py test_pool_that_does_not_fit_in_memory)
    ("--tokens", "huge"): "memory preflight", ("--inflight", "huge"): "memory preflight",
    ("--decode-pool-tokens", "huge"): "memory preflight", ("--layers", "huge"): "memory preflight",
    ("--kv-heads", "huge"): "memory preflight", ("--head-dim", "huge"): "memory preflight",
    ("--kv-lora-rank", "huge"): "memory preflight", ("--rope-dim", "huge"): "memory preflight",
    # a long run asked for: every case is still bounded by --timeout
    ("-n", "huge"): "--timeout bounds it", ("-w", "huge"): "--timeout bounds it",
    # a step past -e ends the sweep: one block size
    ("-f", "huge"): "the sweep is -b alone",
    # fault injection flips at most every destination byte
    ("--inject-corruption", "huge"): "flips every byte at most",
    # a huge rate makes prefill_ms auto tiny: a prefill of zero ms is a valid case
    ("--prefill-tflops", "huge"): "prefill_ms auto near 0",
    # more TP ranks than KV heads: each holds one replicated head, as vLLM does
    ("--tp", "huge"): "replicated heads",
    # text: 'nan', 'inf', '-1' and a long number are a valid run name and directory name
    **{(f, k): "text" for f in ("--name", "-o") for k in ("nan", "inf", "huge", "negative")},
}


def value(flag: str, kind: str) -> list[str]:
    if kind == "duplicate":
        good = GOOD[flag]
        list_flag = build_parser()._subparsers._group_actions[0].choices["run"]._option_string_actions[flag]
        if getattr(list_flag.type, "__name__", "").startswith("list of"):
            return [flag, f"{good},{good}"]
        return [flag, good, flag, good]
    if kind == "huge":
        flt = RUN_FLAGS[flag] in (float,) or flag == "--prefill-ms"
        return [flag, "1e308" if flt else HUGE_INT]
    v = VALUES[kind]
    if flag == "-O":
        v = f"sockbuf={v}"
    elif flag == "--arrival":
        v = f"poisson:{v}" if v else v
    return [flag, v]


def run_flags() -> dict:
    r = build_parser()._subparsers._group_actions[0].choices["run"]
    return {a.option_strings[0]: a.type for a in r._actions if a.option_strings and a.option_strings[0] not in SKIP}


RUN_FLAGS = run_flags()


def door(argv: list[str], results: str):
    """Rank 0's validation of ``argv``: None if accepted, else the one line it refuses with."""
    try:
        a = build_parser().parse_args(["run", "-o", results, *argv])
        config.build(a, argv, world=2)
    except (ArgError, config.ConfigError) as exc:
        return str(exc)
    return None


def test_every_flag_has_a_good_value(tmp_path):
    """A new flag of `kvbench run` joins this fuzz: give it a valid value in GOOD."""
    assert set(RUN_FLAGS) <= set(GOOD), sorted(set(RUN_FLAGS) - set(GOOD))
    for flag in RUN_FLAGS:  # each flag's valid value passes, so its refusals below are its own
        assert door([*SHM_SMALL, *CONTEXT.get(flag, []), flag, GOOD[flag]], str(tmp_path / "r")) is None, flag


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", sorted(RUN_FLAGS))
def test_run_flag(tmp_path, flag, kind):
    out = str(tmp_path / "never-written")
    line = door([*SHM_SMALL, *CONTEXT.get(flag, []), *value(flag, kind)], out)
    if (flag, kind) in ACCEPTED:
        assert line is None, f"{flag} {kind}: listed as accepted ({ACCEPTED[flag, kind]}) but refused: {line}"
    else:
        assert line is not None, f"{flag} {kind}: accepted at the door"
        assert line.strip() and "\n" not in line and "Traceback" not in line, line
    assert not os.path.exists(out) and not os.path.exists("vm")


# ----- -O options: every field of every transport -----------------------------------------------------------
OPT_VALUES = {"nan": "nan", "inf": "inf", "huge": HUGE_INT, "negative": "-1", "empty": ""}
# (transport, key, kind) accepted, and why
OPT_ACCEPTED = {
    # free text (an address, an interface or device name, UCX_TLS): the transport resolves it at setup and
    # says which name it could not use
    **{(t, k, kind): "a name" for t, k in (("tcp", "addr"), ("tcp", "ifname"), ("mooncake", "addr"),
                                            ("mooncake", "ifname"), ("mooncake", "host"), ("mooncake", "device"),
                                            ("ucx", "tls"), ("verbs", "device"))
       for kind in ("nan", "inf", "huge", "negative")},
    # layers of at most N descriptors move as N calls: a huge N is every layer, which Python ints compare with
    ("mpi", "split", "huge"): "a bound, compared",
}


def option_fields():
    return [(t, k) for t, schema in sorted(O.SCHEMAS.items()) for k in schema.model_fields]


@pytest.mark.parametrize("kind", [*OPT_VALUES, "duplicate"])
@pytest.mark.parametrize("transport,key", option_fields())
def test_transport_option(transport, key, kind):
    if kind == "duplicate":  # the same key twice with different values is refused; with the same value, one
        field = O.SCHEMAS[transport].model_fields[key]
        default = field.default if field.default is not None else "x"
        items = [f"{transport}.{key}={default}", f"{transport}.{key}=__other__"]
    else:
        items = [f"{transport}.{key}={OPT_VALUES[kind]}"]
    try:
        O.parse(items, [transport])
    except O.OptionError as exc:
        assert (transport, key, kind) not in OPT_ACCEPTED, f"refused: {exc}"
        assert "\n" not in str(exc) and str(exc).startswith("-O")
        return
    assert (transport, key, kind) in OPT_ACCEPTED, f"-O {items}: accepted at the door"


# ----- suite fields ------------------------------------------------------------------------------------------
SUITE_VALUES = {"nan": math.nan, "inf": math.inf, "huge": 10**20, "negative": -1, "empty": ""}
SUITE_ACCEPTED = {  # (YAML takes types as written: a number is not a name, so those are refused)
    ("description", "empty"): "free text, empty by default", ("axes.tp", "huge"): "replicated heads",
    ("iters", "huge"): "--timeout bounds it", ("warmup", "huge"): "--timeout bounds it",
    ("workload.decode_pool_tokens", "huge"): "memory preflight", ("axes.tokens", "huge"): "memory preflight",
    ("axes.inflight", "huge"): "memory preflight", ("prefill_tflops", "huge"): "prefill_ms auto near 0",
}


LIST_GOOD = {"pool_sizes": "1MiB"}  # suite list fields empty by default, and a valid item of each


def suite_fields():
    out = [f for f in S.Suite.model_fields if f not in ("workload", "axes")]
    out += [f"workload.{f}" for f in S.Workload.model_fields]
    return out + [f"axes.{f}" for f in S.Axes.model_fields]


def suite_with(field: str, kind: str) -> dict:
    data = {"name": "fuzz", "axes": {"transport": ["shm"], "tokens": [256]}, "iters": 2, "warmup": 0}
    if field.startswith("workload."):
        data |= {"workload": {"requests": 5}, "axes": {"arrival": ["interval:10"], "transport": ["shm"]}}
    part, _, key = field.rpartition(".")
    target = data[part] if part else data
    if kind == "duplicate":  # a list field with one value twice; a scalar field has no duplicate but a YAML key's
        default = (S.Axes if part == "axes" else S.Suite).model_fields[key].default if part != "workload" else None
        if not isinstance(default, list):
            return {}
        one = default[0] if default else LIST_GOOD[key]  # a list empty by default (no sweep): a value it takes
        target[key] = [one, one]
        return data
    v = SUITE_VALUES[kind]
    is_list = part == "axes" or key in ("variants", *LIST_GOOD)
    target[key] = [v] if is_list else v
    return data


def suite_cells() -> list:
    """Every suite field with every bad kind of value, but a scalar field's duplicate: a scalar holds one value, and
    its duplicate is a repeated YAML key, which test_errors.py's test_bad_suite refuses in one line."""
    return [pytest.param(f, k, id=f"{f}-{k}") for k in KINDS for f in suite_fields() if suite_with(f, k)]


@pytest.mark.parametrize("field,kind", suite_cells())
def test_suite_field(field, kind):
    data = suite_with(field, kind)
    try:
        S.expand(S.validate(data, "s.yaml"))
    except S.SuiteError as exc:
        assert (field, kind) not in SUITE_ACCEPTED, f"refused: {exc}"
        assert "\n" not in str(exc)
        return
    assert (field, kind) in SUITE_ACCEPTED, f"{field}={data}: accepted"


@settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(RUN_FLAGS)), st.sampled_from(["nan", "-nan", "inf", "-inf", "1e308", "-1e308", HUGE_INT,
                                                             f"-{HUGE_INT}", "", " ", ",", "0", "-0", "1e-308"]))
def test_flag_values_end_in_one_line_or_a_bounded_run(tmp_path_factory, flag, v):
    """Values around the edges on any flag: refused with one line, or a config whose waits are all bounded."""
    argv = [*SHM_SMALL, *CONTEXT.get(flag, []), flag, v]
    try:
        a = build_parser().parse_args(["run", "-o", str(tmp_path_factory.getbasetemp() / "never"), *argv])
        cfg = config.build(a, argv, world=2)
    except (ArgError, config.ConfigError) as exc:
        assert str(exc).strip() and "\n" not in str(exc)
        return
    s = cfg.suite
    assert 0 < s.timeout <= 7 * 86400 and 0 <= s.seed < 2**32 and math.isfinite(s.pool_factor)
    for case in cfg.cases:
        assert math.isfinite(float(case["prefill_ms"]))


@pytest.mark.parametrize("kind", ["nan", "inf", "huge", "negative", "empty"])
def test_gpu_map_values(tmp_path, kind):
    """--gpu-map's bad values are refused at the door in one line, whatever GPUs the machine has."""
    v = {"huge": HUGE_INT, "empty": ""}.get(kind, VALUES.get(kind))
    line = door([*SHM_SMALL, "--gpu-map", v], str(tmp_path / "r"))
    assert line is not None and "\n" not in line and "--gpu-map" in line, line
