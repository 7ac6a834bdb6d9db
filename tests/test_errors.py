"""Bad input: one clear line on rank 0, exit code 1, no traceback, no hang."""
import pytest

SMALL = ["--tokens", "256", "-n", "2", "-w", "0"]


def assert_one_line(r, *needles):
    assert r.code == 1, (r.code, r.out, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.startswith("kvbench: error:")]
    assert len(lines) == 1, r.err  # printed once (rank 0), not once per rank
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.err + r.out


@pytest.mark.parametrize("args,needles", [
    (["-m", "llama-9"], ["model 'llama-9' is not one of", "llama-2-70b"]),
    (["-t", "carrier-pigeon"], ["'carrier-pigeon' is not one of", "shm"]),
    (["--dtype", "fp12"], ["axes.dtype", "'fp16'"]),
    (["-b", "24", "-e", "24"], ["block size 24 is not a positive power of two"]),
    (["--alloc", "striped"], ["alloc 'striped' is not one of"]),
    (["--op", "shove"], ["axes.op", "'push'"]),
    (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["--rounds", "3"], ["rounds (3) cannot exceed iters (2)"]),
    (["-O", "split=-1"], ["mpi option split=-1 must be >= 0"]),
    (["-t", "tcp", "-O", "poll=often"], ["tcp option poll='often' is not one of: block, control, spin"]),
])
def test_bad_flag(kvrun, args, needles):
    default = "mpi" if "-O" in args else "shm"
    assert_one_line(kvrun(["-t", default, *SMALL, *args] if "-t" not in args else [*SMALL, *args]), *needles)


def test_unknown_suite_field(kvrun, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\naxes:\n  transport: [shm]\n  blocksize: [16]\n")
    assert_one_line(kvrun([str(p)]), "axes.blocksize", "unknown field", "block_size")


def test_bad_suite_value(kvrun, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\niters: 0\n")
    assert_one_line(kvrun([str(p)]), "field 'iters'", "greater than or equal to 1")


def test_pool_that_does_not_fit_in_memory(kvrun):
    # llama-3.1-405b fp32 at 32k tokens: 132 GB per request, far beyond this machine
    assert_one_line(kvrun(["-t", "shm", "-m", "llama-3.1-405b", "--dtype", "fp32", "--tokens", "32768"]),
                    "pools need", "GiB", "available")


def test_odd_number_of_ranks_pairwise(kvrun):
    assert_one_line(kvrun(["-t", "shm", *SMALL], n=3), "even number of ranks (got 3)")
