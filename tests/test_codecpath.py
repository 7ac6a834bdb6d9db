"""Codecs through the harness between real ranks: every element checked, wire bytes exact, corruption caught."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from kvbench.memory import values
from kvbench.report.codecs import break_even, predicted
from kvbench.transports.loopback import LoopbackTransport

SMALL = ["-m", "llama-3-8b", "--tokens", "32", "--dtype", "bf16", "-n", "2", "-w", "1", "--variants", "paged",
         "--rounds", "1", "-b", "16", "-e", "16"]
PAYLOAD = 32 * 32 * 2 * 8 * 128 * 2  # tokens x layers x (K, V) x heads x dim x 2 B


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_codecs_move_realistic_values_exactly(kvrun, transport):
    r = kvrun(["-t", transport, "--codec", "none,exp-split,zstd,lz4,cast-fp8-e4m3", "--fill", "realistic", *SMALL],
              timeout=240)
    assert r.code == 0, r.out + r.err
    df = r.table()
    ok = df[df.status == "ok"]
    assert set(ok.codec) == {"none", "exp-split", "zstd", "lz4", "cast-fp8-e4m3"} and set(ok.fill) == {"realistic"}
    checks = ok[ok.iter == -1]
    assert int(checks.nwrong.sum()) == 0  # lossless: bit-exact; cast: every element within its tolerance
    timed = ok[ok.iter >= 0]
    assert set(timed.payload_bytes) == {PAYLOAD}
    wire = timed.groupby("codec").wire_bytes.median()
    assert wire["none"] == PAYLOAD
    # exp-split on the realistic values: at least 1.2x (32 layers, one frame each: 32-byte headers counted)
    assert PAYLOAD / wire["exp-split"] >= 1.2
    # cast: 1 B per value + one fp32 scale per 128 + the header, per layer
    assert wire["cast-fp8-e4m3"] == 32 * (32 + PAYLOAD // 32 // 2 + 4 * (PAYLOAD // 32 // 2 // 128))
    assert wire["lz4"] <= PAYLOAD + 32 * 32  # never more than the raw bytes plus a header per layer
    dec = timed[(timed.role == "decode") & (timed.codec == "exp-split")]
    enc = timed[(timed.role == "prefill") & (timed.codec == "exp-split")]
    assert (dec.codec_decode_s > 0).all() and (enc.codec_encode_s > 0).all()
    lossy = checks[(checks.codec == "cast-fp8-e4m3") & (checks.role == "decode")]
    assert (lossy.codec_max_rel_err > 0).all()  # lossy, and said so


def test_a_corrupted_wire_byte_fails_the_run(kvrun):
    r = kvrun(["-t", "tcp", "--codec", "exp-split", "--fill", "realistic", *SMALL], env={"KVBENCH_FAULT": "codec-wire:1"},
              timeout=180, leftovers_ok=True)
    assert r.code in (2, 4), r.out + r.err  # wrong elements (FAILED) or a frame refused (ERROR): never OK
    if r.code == 2:
        df = r.table()
        assert int(df[df.iter == -1].nwrong.sum()) > 0


def test_codecs_refused_where_they_cannot_run(kvrun):
    r = kvrun(["-t", "loopback,shm", "--op", "push,pull", "--codec", "exp-split", *SMALL], timeout=120)
    assert r.code == 0, r.out + r.err
    df = r.table()
    skipped = df[df.status == "skipped"]
    assert set(zip(skipped.transport, skipped.op)) == {("loopback", "push"), ("loopback", "pull"), ("shm", "pull")}
    assert skipped.reason.str.contains("unavailable").all()


class FramedLoopback(LoopbackTransport):
    """A plugin that declares it carries codec frames (its Caps), as a site's transport would."""

    name = "framed-loopback"
    caps = replace(LoopbackTransport.caps, codec_frames="stream")


def test_codec_carriers_are_the_transports_whose_caps_say_how(monkeypatch):
    from kvbench import transports
    from kvbench.codecs import path as CP

    builtin = ["loopback", "shm", "tcp", "mpi", "mpi-sendrecv", "nixl", "ucx", "mooncake", "cuda_ipc", "verbs",
               "staged"]
    assert {n: CP.frames_of(n) for n in builtin if CP.frames_of(n)} == {"shm": "doorbell", "tcp": "stream"}
    assert CP.why_not("tcp", "push") is None and CP.why_not("shm", "push") is None
    assert "push" in CP.why_not("tcp", "pull")
    for n in set(builtin) - {"shm", "tcp"}:
        assert CP.why_not(n, "push").startswith("codecs run on tcp, shm (a frame's length is known only at the source")
    monkeypatch.setitem(transports.REGISTRY, "framed-loopback", (f"{__name__}:FramedLoopback", ""))
    assert CP.why_not("framed-loopback", "push") is None
    assert CP.carriers() == ("tcp", "framed-loopback", "shm")  # streams first, then doorbells


def test_exp_split_on_e4m3_is_a_one_line_error(kvrun):
    r = kvrun(["-t", "shm", "--codec", "exp-split", "--dtype", "fp8-e4m3", "-m", "llama-3-8b", "--tokens", "16"])
    assert r.code == 1 and "nothing" in r.err and r.err.strip().count("\n") == 0


def test_user_dump_is_the_pool_contents(kvrun, tmp_path):
    import ml_dtypes

    dump = tmp_path / "kv.npy"
    rng = np.random.default_rng(0)
    np.save(dump, (rng.standard_normal(100_003) * 0.3).astype(ml_dtypes.bfloat16).view(np.uint16))
    r = kvrun(["-t", "tcp", "--codec", "none,exp-split", "--fill", f"file:{dump}", *SMALL], timeout=180)
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert int(df[df.iter == -1].nwrong.sum()) == 0
    wire = df[df.iter >= 0].groupby("codec").wire_bytes.median()
    assert PAYLOAD / wire["exp-split"] > 1.25  # a Gaussian dump: ~16/12


def test_realistic_values_compress_with_exp_split_and_are_reproducible():
    from kvbench import codecs
    from kvbench.codecs.base import calibrate

    r = values.Realistic("bf16")
    data = r.words(0, 0, 1 << 18).view(np.uint8)
    assert np.array_equal(data, r.words(0, 0, 1 << 18).view(np.uint8))  # a pure function of (rank, index, epoch)
    assert not np.array_equal(data, r.words(0, 0, 1 << 18, epoch=3).view(np.uint8))
    table = calibrate(r.words(1, 1 << 22, 1 << 14).view(np.uint8), "bf16")  # another rank's bytes
    f = codecs.get("exp-split", table).encode(data, "bf16")
    assert len(data) / len(f) >= 1.2


def test_break_even_formulas():
    # serial: B* = (1 - 1/r) / (1/E + 1/D); r = 4/3, E = D = 1 GB/s -> 0.25 / 2 = 0.125 GB/s
    assert break_even(1.0, 0.75, 1.0, 1.0, 32, "serial") == pytest.approx(0.125)
    assert predicted(1.0, 0.75, 1.0, 1.0, 0.125, 32, "serial") == pytest.approx(0.125)
    # pipelined, no CPU limit: the codec pays up to nearly min(E, D) (less one layer's fill and drain)
    b = break_even(1.0, 0.75, 1.0, 2.0, 32)
    assert 0.9 < b < 1.0 and predicted(1.0, 0.75, 1.0, 2.0, b, 32) == pytest.approx(b, rel=1e-6)
    # a codec that does not compress never pays
    assert break_even(1.0, 1.0, 5.0, 5.0, 32) == 0.0 and break_even(1.0, 1.0, 5.0, 5.0, 32, "serial") == 0.0
    # two cores shared: encode + decode + the host's copy of the wire bytes bound the rate
    assert predicted(1.0, 0.75, 1.0, 1.0, 10.0, 32, "pipelined", H=1.0, C=2) == pytest.approx(1 / 1.75)
    assert math.isfinite(predicted(1.0, 0.75, 1.0, 1.0, 0.1, 32))
