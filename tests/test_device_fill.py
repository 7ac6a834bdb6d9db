"""--fill realistic (and file: dumps) on device pools: filled where the pool lives and checked there to the bytes
of the host code; codecs on device pools are refused with one line."""
import numpy as np
import pytest
from helpers.asserts import device_matches_host

torch = pytest.importorskip("torch")

from kvbench import memory  # noqa: E402
from kvbench.cli.main import build_parser  # noqa: E402
from kvbench.codecs.path import codec_refused, fill_pools  # noqa: E402
from kvbench.config import runconfig as config  # noqa: E402
from kvbench.memory import device as D  # noqa: E402
from kvbench.memory import values, verify  # noqa: E402

DESCS = np.array([[200000, 8192, 1000], [205003, 100, 778], [270000, 30000, 4096]], np.int64)


@pytest.fixture
def realistic():
    yield values.make("realistic", "bf16")
    memory.use(None)


def test_a_cuda_pool_takes_realistic_values_where_it_lives(realistic):
    """A pool whose bytes the host cannot see (array None, as a CUDA pool's): fill_pools fills it with torch."""
    n = (1 << 19) + 8
    pool = D.alloc(n, "torch-cpu")
    pool.array = None  # as a cuda pool: no host view
    held = fill_pools([pool], 1, ("pattern", "fp16"), ("realistic", "bf16"))
    assert held == ("realistic", "bf16")
    want = memory.alloc_host(n)
    memory.fill(want, 1)  # values.make's contents are in force: the host fill of the same values
    assert np.array_equal(pool.tensor.numpy(), want)


def test_the_device_check_of_realistic_values_matches_verify(realistic):
    memory.use(realistic)
    n = 1 << 19
    a = memory.alloc_host(n)
    memory.fill(a, 3)
    t = torch.from_numpy(a.copy())
    device_matches_host(a, t, DESCS, 3, 7)
    ct, wt = D.snapshot(t, [DESCS])
    ca, wa = verify.snapshot(a, [DESCS])
    assert D.count_wrong(ct, wt, 3, 2, 7) == verify.count_wrong(ca, wa, 3, 2, 7) == 500 + 389 + 2048  # every element still poisoned
    good = torch.from_numpy(np.concatenate([verify.expected(3, s, k, 7) for s, _, k in DESCS.tolist()]))
    assert D.count_wrong(good, wt, 3, 2, 7) == 0


def test_codecs_on_device_pools_are_refused_in_one_line():
    a = build_parser().parse_args(["run", "-t", "staged", "--memory", "torch-cpu", "--codec", "zstd"])
    with pytest.raises(config.ConfigError) as exc:
        config.build(a, [], world=2)
    assert "codecs encode host pools" in str(exc.value) and "\n" not in str(exc.value)
    why = codec_refused("tcp", {"codec": "zstd", "memory": "cuda", "op": "push"})
    assert why.startswith("codecs encode host pools") and "\n" not in why
