"""Bad input: one clear line on rank 0, exit code 1, no traceback, no hang, and nothing written."""
import os
import socket

import pytest
from helpers.args import SMALL
from helpers.asserts import assert_nothing_written, assert_one_line, full, refusal

BAD_FLAGS = [
    (["-m", "llama-9"], ["model 'llama-9' is not one of", "llama-2-70b"]),
    (["-t", "carrier-pigeon"], ["'carrier-pigeon' is not one of", "shm"]),
    (["--dtype", "fp12"], ["axes.dtype", "'fp16'"]),
    (["-b", "24", "-e", "24"], ["block size 24 is not a positive power of two"]),
    (["--alloc", "striped"], ["alloc 'striped' is not one of"]),
    (["--op", "shove"], ["axes.op", "'push'"]),
    (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["--rounds", "3"], ["rounds (3) cannot exceed iters (2)"]),
    # the inputs that once hung (the block sweep never ended) or passed validation and failed later
    (["-b", "0"], ["-b 0", "not a positive power of two"]),
    (["-b", "-16"], ["-b -16", "not a positive power of two"]),
    (["-b", "-16", "-e", "16"], ["-b -16", "not a positive power of two"]),
    (["-f", "1", "-b", "16", "-e", "64"], ["-f 1", "2 or more"]),
    (["--prefix-hit", "-5"], ["axes.prefix_hit", "-5 is negative"]),
    (["--timeout", "inf"], ["timeout", "finite"]),
    (["--timeout", "nan"], ["timeout", "finite"]),
    (["--timeout", "0"], ["timeout", "greater than 0"]),
    (["--setup-timeout", "-1"], ["setup_timeout", "greater than 0"]),
    (["--pool-factor", "inf"], ["pool_factor", "finite"]),
    (["-t", "shm,shm"], ["axes.transport", "'shm' is listed twice"]),
    (["--inject-corruption", "-1"], ["--inject-corruption", "greater than or equal to 0"]),
    (["--target-ci", "0"], ["--target-ci", "'0'", "above 0% and below 100%"]),
    (["--target-ci", "150%"], ["--target-ci", "'150%'", "above 0% and below 100%"]),
]
BAD_OPTIONS = [
    (["-t", "mpi", "-O", "split=-1"], ["mpi option split='-1'", "greater than or equal to 0"]),
    (["-t", "tcp", "-O", "poll=often"], ["tcp option poll='often'", "'block', 'control' or 'spin'"]),
    (["-t", "tcp", "-O", "sockbuf=abc"], ["tcp option sockbuf='abc'", "valid integer"]),
    (["-t", "shm,tcp", "-O", "polll=spin"], ["no transport of this run has an option 'polll'", "tcp: addr"]),
    (["-t", "tcp", "-O", "nixl.prep=on"], ["transport 'nixl' is not in this run"]),
    (["-t", "tcp", "-O", "tcp.window=create"], ["tcp has no option 'window'"]),
    (["-t", "tcp", "-O", "poll"], ["expected key=value"]),
    (["-t", "tcp", "-O", "connect_timeout=inf"], ["connect_timeout='inf'", "finite"]),
]
# on real ranks (one line, once, exit 1, nothing written: rank 0 refuses every input on one path): an argument the
# parser refuses, one the configuration refuses, issue 31's --target-ci inputs, and a transport's option
ON_RANKS = [BAD_FLAGS[0], BAD_FLAGS[6], BAD_FLAGS[7], *BAD_FLAGS[-2:], BAD_OPTIONS[1]]


@pytest.mark.parametrize("args,needles", BAD_FLAGS + BAD_OPTIONS)
def test_bad_flag_is_refused_in_one_line(args, needles):
    line = refusal(full(args))
    assert "\n" not in line and all(n in line for n in needles), line


@pytest.mark.parametrize("args,needles", ON_RANKS)
def test_bad_flag_on_real_ranks(kvrun, tmp_path, args, needles):
    assert_one_line(kvrun(full(args)), *needles)
    assert_nothing_written(tmp_path)


def test_scoped_and_unscoped_options_reach_only_transports_that_have_them(kvrun):
    r = kvrun(["-t", "shm,tcp", "--op", "push", "-b", "64", "-e", "64", *SMALL, "-O", "poll=spin",
               "-O", "tcp.sockbuf=1048576"])
    assert r.code == 0, r.out + r.err
    assert r.meta()["transport_options"] == {"tcp": {"poll": "spin", "sockbuf": 1048576}}


BAD_SUITES = [
    ("name: bad\naxes:\n  transport: [shm]\n  blocksize: [16]\n", ["axes.blocksize", "unknown field", "block_size"]),
    ("name: bad\niters: 0\n", ["field 'iters'", "greater than or equal to 1"]),
    ("name: bad\niters: 5\niters: 6\n", ["duplicate key 'iters'", "line 3"]),
    ("name: bad\naxes:\n  prefix_hit: [-5]\n", ["axes.prefix_hit", "-5 is negative"]),
    ("name: bad\niters: '20'\n", ["field 'iters'", "valid integer"]),
    ("name: bad\naxes:\n  block_size: [32.5]\n", ["axes.block_size", "valid integer"]),
    ("name: bad\ntimeout: .inf\n", ["field 'timeout'", "finite"]),
    ("name: bad\naxes: [shm\n", ["not valid YAML"]),
]
BAD_MODELS = [
    ("name: m\nkv_heads: 8\nhead_dim: 128\n", ["field 'layers'", "required"]),
    ("name: m\nlayers: many\nkv_heads: 8\nhead_dim: 128\n", ["field 'layers'", "valid integer"]),
    ("name: m\nlayers: 32.5\nkv_heads: 8\nhead_dim: 128\n", ["field 'layers'", "valid integer"]),
    ("name: m\nlayers: 32\nlayers: 16\nkv_heads: 8\nhead_dim: 128\n", ["duplicate key 'layers'"]),
    ("name: m\nlayers: 32\nkv_heads: 8\nhead_dims: 128\n", ["field 'head_dims'", "unknown field"]),
    ("name: m\nlayers: 32\n", ["kv_heads and head_dim must be positive"]),
]


# Each refusal in-process, as rank 0 makes it (refusal: the parser and runconfig.build); one of each kind on real
# ranks below shows the same path ends a launch in one line with nothing written.
@pytest.mark.parametrize("text,needles", BAD_SUITES)
def test_bad_suite(tmp_path, text, needles):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    line = refusal([str(p)])
    assert "\n" not in line and all(n in line for n in [str(p), *needles]), line


@pytest.mark.parametrize("text,needles", BAD_MODELS)
def test_bad_model_file(tmp_path, text, needles):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    line = refusal(full(["-m", str(p)]))
    assert "\n" not in line and all(n in line for n in ["model file", *needles]), line


@pytest.mark.parametrize("kind,text,needles", [("suite", *BAD_SUITES[2]), ("model", *BAD_MODELS[3])])
def test_a_bad_file_on_real_ranks(kvrun, tmp_path, kind, text, needles):
    p = tmp_path / f"{kind}.yaml"
    p.write_text(text)
    args = [str(p)] if kind == "suite" else ["-t", "shm", *SMALL, "-m", str(p)]
    assert_one_line(kvrun(args), str(p), *needles)
    assert_nothing_written(tmp_path)


def test_unwritable_results_directory(kvrun, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = kvrun(["-t", "shm", *SMALL, "-o", str(blocker / "results")], timeout=30)
    assert_one_line(r, f"-o {blocker}/results", "is not a directory")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_pool_that_does_not_fit_in_memory(kvrun, tmp_path):
    # llama-3.1-405b fp32 at 32k tokens: 132 GB per request, far beyond this machine
    assert_one_line(kvrun(["-t", "shm", "-m", "llama-3.1-405b", "--dtype", "fp32", "--tokens", "32768"]),
                    "pools need", "GiB", "available")
    assert_nothing_written(tmp_path)


def test_odd_number_of_ranks_pairwise(kvrun):
    assert_one_line(kvrun(["-t", "shm", *SMALL], n=3), "even number of ranks (got 3)")


def test_a_step_factor_without_a_sweep_is_still_checked():
    """Found by the fuzzer: -f -1 alone was ignored (no -b/-e to step), a silent substitution."""
    line = refusal(full(["-f", "-1"]))
    assert "-f -1" in line and "2 or more" in line, line


DOOR_VALUES = [
    # issue 32: values that passed validation and then hung (nan never compares) or failed on the ranks
    (["--arrival", "poisson:nan", "--requests", "3"], ["arrival 'poisson:nan'"]),
    (["--seed", "-1"], ["seed", "greater than or equal to 0"]),
    (["--timeout", "1e308"], ["timeout", "less than or equal to"]),
    (["-t", "tcp", "-O", "sockbuf=99999999999999999999"], ["tcp option sockbuf=", "less than or equal to"]),
    # an empty value is refused, never read as the default (nor -o '' as the working directory)
    (["-t", ""], ["-t/--transport", "empty"]),
    (["--tokens", ""], ["--tokens", "empty"]),
    (["-o", ""], ["-o/--results", "empty"]),
    (["--variants", "bulk,bulk"], ["variants", "'bulk' is listed twice"]),
    (["-e", "0"], ["-e 0", "not a positive power of two"]),  # named as typed, not as -b
]


@pytest.mark.parametrize("args,needles", DOOR_VALUES)
def test_value_refused_in_process(args, needles):
    line = refusal(["-t", "shm", *SMALL, *args])
    assert "\n" not in line and all(n in line for n in needles), line


@pytest.mark.parametrize("args,needles", [DOOR_VALUES[0], DOOR_VALUES[6]])  # a hang once; -o '' once wrote ./<host>
def test_value_refused_at_the_door(kvrun, tmp_path, args, needles):
    r = kvrun(["-t", "shm", *SMALL, *args], timeout=60)
    line = assert_one_line(r, *needles)
    assert line.startswith("kvbench: error: ")
    assert_nothing_written(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the runs' working directory
    assert not os.path.exists(os.path.join(root, socket.gethostname()))  # -o '' once wrote ./<host>/ there


def test_garbage_suite_file_is_named(kvrun, tmp_path):
    p = tmp_path / "garbage.yaml"
    p.write_bytes(bytes(range(128, 256)) * 4)  # not text at all
    assert_one_line(kvrun([str(p)], timeout=60), str(p), "not a UTF-8 text file")
    assert_nothing_written(tmp_path)
