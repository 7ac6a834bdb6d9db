"""Codecs: bit-exact round trips (random and adversarial data), stated tolerances, corruption never accepted."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench import codecs
from kvbench.codecs import frame as F
from kvbench.codecs.base import Table, calibrate
from kvbench.codecs.cast import outside, tolerance
from kvbench.codecs.exp_split import ExpSplit
from kvbench.codecs.frame import CodecError

LOSSLESS = ("none", "exp-split", "zstd", "lz4")
WIDTH = {"bf16": 2, "fp16": 2, "fp8-e5m2": 1, "fp8-e4m3": 1}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def adversarial(kind: str, dtype: str, n: int, rng) -> np.ndarray:
    """Bytes of n elements of dtype: the cases a codec gets wrong first."""
    w = WIDTH[dtype]
    if kind == "random":
        return rng.integers(0, 256, n * w, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(n * w, np.uint8)
    if kind == "nan-inf":
        vals = {2: [0x7FC0, 0xFF80, 0x7F80, 0x7C00, 0xFC00, 0x7E00, 0xFFFF], 1: [0x7C, 0xFC, 0x7F, 0xFF, 0x7E]}[w]
        return np.array(rng.choice(vals, n), {2: np.uint16, 1: np.uint8}[w]).view(np.uint8)
    if kind == "denormals":  # exponent field 0, any mantissa and sign
        u = rng.integers(0, 1 << 16, n, dtype=np.uint16) if w == 2 else rng.integers(0, 256, n, dtype=np.uint8)
        mask = {"bf16": 0x807F, "fp16": 0x83FF, "fp8-e5m2": 0x83, "fp8-e4m3": 0x87}[dtype]
        return (u & u.dtype.type(mask)).view(np.uint8)
    if kind == "one-exponent":
        x = rng.uniform(1, 2, n).astype(np.float32)
        return _cast(x, dtype)
    if kind == "every-exponent":  # each exponent value in turn: most are escapes
        with np.errstate(over="ignore"):
            x = (2.0 ** (np.arange(n) % 300 - 150)).astype(np.float32) * np.where(np.arange(n) % 2, 1, -1)
        return _cast(x, dtype)
    raise AssertionError(kind)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    t = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8-e5m2": ml_dtypes.float8_e5m2,
         "fp8-e4m3": ml_dtypes.float8_e4m3fn}[dtype]
    with np.errstate(over="ignore"):
        return x.astype(t).view(np.uint8)


def roundtrip(codec, data: np.ndarray, dtype: str) -> np.ndarray:
    f = codec.encode(data, dtype)
    out = np.full_like(data, 0x5A)
    codec.decode(f, dtype, out)
    assert len(f) <= len(data) + F.HEADER_BYTES, "a frame never expands past the raw bytes plus the header"
    return out


KINDS = ("random", "zeros", "nan-inf", "denormals", "one-exponent", "every-exponent")


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8-e5m2"])
@pytest.mark.parametrize("kind", KINDS)
def test_lossless_adversarial(name, dtype, kind):
    rng = np.random.default_rng(1)
    for n in (1, 7, 4097, 20011):
        data = adversarial(kind, dtype, n, rng)
        codec = codecs.get(name, calibrate(data, dtype) if name == "exp-split" else None)
        assert np.array_equal(roundtrip(codec, data, dtype), data)


@SETTINGS
@given(st.sampled_from(["bf16", "fp16", "fp8-e5m2"]), st.binary(min_size=0, max_size=9000),
       st.integers(0, 40), st.booleans())
def test_lossless_random_property(dtype, raw, spread, calibrated):
    """Any bytes round-trip bit-exactly, whatever the exponent spread, with or without a calibrated table."""
    w = WIDTH[dtype]
    data = np.frombuffer(raw[: len(raw) // w * w], np.uint8).copy()
    if spread and len(data):  # a narrow exponent range: the coded (not raw) path
        x = np.frombuffer(raw, np.uint8)[: len(data) // w].astype(np.float32) / 255 * spread - spread / 2
        data = _cast(np.random.default_rng(len(raw)).standard_normal(len(data) // w) * 2.0 ** x, dtype).copy()
    for name in LOSSLESS:
        codec = codecs.get(name, calibrate(data, dtype) if calibrated and name == "exp-split" else None)
        assert np.array_equal(roundtrip(codec, data, dtype), data), name


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8-e5m2"])
def test_native_matches_numpy_reference(dtype):
    rng = np.random.default_rng(2)
    x = (rng.uniform(1, 1.5, 50_001) * 2.0 ** rng.integers(-6, 10, 50_001)).astype(np.float32)  # 16 exponents
    x[::97] = 2.0 ** 12  # and 1% escapes
    x = _cast(x, dtype)
    t = calibrate(x[:5000], dtype)
    fast, ref = ExpSplit(t), ExpSplit(t, native=False)
    if fast.native is None:
        pytest.skip("kvbench._codec not built (python setup.py build_ext --inplace)")
    f = fast.encode(x, dtype)
    assert np.array_equal(f, ref.encode(x, dtype))
    hdr = F.unpack(f, "exp-split", dtype, len(x) // WIDTH[dtype])
    assert not hdr["raw"] and hdr["n_esc"] > 0  # the coded path with escapes, not the fallback
    out = np.empty_like(x)
    ref.decode(f, dtype, out)
    assert np.array_equal(out, x)


@pytest.mark.parametrize("dtype,ceiling", [("bf16", 16 / 12), ("fp16", 16 / 15), ("fp8-e5m2", 8 / 7)])
def test_exp_split_ratio_reaches_its_ceiling_without_escapes(dtype, ceiling):
    rng = np.random.default_rng(3)
    n = 1 << 20
    # 16 exponents, mantissas that stay below the next power of two in every format: no escape at all
    x = _cast((rng.uniform(1, 1.5, n) * 2.0 ** rng.integers(-8, 8, n)).astype(np.float32), dtype)
    f = codecs.get("exp-split", calibrate(x, dtype)).encode(x, dtype)
    # header + streams (n x bits / 8) + one u16 escape count per 4096-element chunk
    assert len(f) == F.HEADER_BYTES + int(n * WIDTH[dtype] / ceiling) + 2 * (n // 4096)
    assert len(x) / len(f) > ceiling * 0.99


def test_exp_split_refuses_e4m3():
    assert "nothing" in codecs.check("exp-split", "fp8-e4m3")
    with pytest.raises(CodecError):
        codecs.get("exp-split").encode(np.zeros(16, np.uint8), "fp8-e4m3")


def test_the_registry_is_the_one_list_and_its_frame_ids_are_the_wire_format():
    """NAMES, the frame's codec ids and get/check all read the registry; the ids are what frames on the wire
    carry, so they never change."""
    from kvbench.codecs.registry import REGISTRY

    assert codecs.NAMES == tuple(REGISTRY) == ("none", "exp-split", "cast-fp8-e4m3", "cast-fp8-e5m2", "zstd", "lz4")
    assert F.CODEC_IDS == {"none": 0, "exp-split": 1, "cast-fp8-e4m3": 2, "cast-fp8-e5m2": 3, "zstd": 4, "lz4": 5}
    assert F.DTYPE_IDS == {"fp32": 0, "fp16": 1, "bf16": 2, "fp8-e4m3": 3, "fp8-e5m2": 4, "nvfp4": 5}
    for name in ("none", "exp-split", "cast-fp8-e4m3", "cast-fp8-e5m2"):
        assert codecs.get(name).name == name
    accepts = {n: [d for d in F.DTYPE_IDS if codecs.check(n, d) is None] for n in codecs.NAMES}
    assert accepts == {"none": list(F.DTYPE_IDS), "exp-split": ["fp16", "bf16", "fp8-e5m2"],
                       "cast-fp8-e4m3": ["fp16", "bf16"], "cast-fp8-e5m2": ["fp16", "bf16"],
                       "zstd": list(F.DTYPE_IDS), "lz4": list(F.DTYPE_IDS)}
    assert codecs.check("exp-split", "fp32") == "exp-split codes bf16, fp16 and fp8-e5m2 pools, not fp32"
    assert codecs.check("cast-fp8-e5m2", "fp32") == "cast-fp8-e5m2 converts fp16 or bf16 pools, not fp32"
    assert codecs.check("gzip", "bf16") == ("codec 'gzip' is not one of: none, exp-split, cast-fp8-e4m3, "
                                            "cast-fp8-e5m2, zstd, lz4")
    with pytest.raises(ValueError, match="not one of"):
        codecs.get("gzip")


def test_table_travels_and_a_mixup_is_an_error():
    rng = np.random.default_rng(4)
    x = _cast(rng.standard_normal(10_000).astype(np.float32), "bf16")
    t = calibrate(x, "bf16")
    assert Table.from_bytes(t.to_bytes()) == t
    f = ExpSplit(t).encode(x, "bf16")
    other = Table("bf16", tuple(reversed(t.exps)))
    with pytest.raises(CodecError, match="table"):
        ExpSplit(other).decode(f, "bf16", np.empty_like(x))


@pytest.mark.parametrize("name", LOSSLESS + ("cast-fp8-e4m3", "cast-fp8-e5m2"))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_corrupted_wire_byte_is_never_accepted(name, dtype):
    """Every byte position of a frame, flipped: the decode raises, or elements come out wrong."""
    rng = np.random.default_rng(5)
    n = 5000
    x = _cast((rng.standard_normal(n) * 2.0 ** rng.integers(-12, 4, n)).astype(np.float32), dtype)
    rare = _cast(np.array([2.0 ** -100, 2.0 ** 60, 1e-30, 3e30, 2.0 ** -120, 2.0 ** 100], np.float32), dtype)
    x[: len(rare)] = rare  # escapes (fp16: flushed to 0 or inf, also rare exponents)
    codec = codecs.get(name, calibrate(x[:2000], dtype) if name == "exp-split" else None)
    f = codec.encode(x, dtype)
    clean = np.empty_like(x)
    codec.decode(f, dtype, clean)
    positions = np.unique(np.concatenate([np.arange(min(len(f), 64)), rng.integers(0, len(f), 400)]))
    for p in positions:
        for flip in (0x01, 0x80, 0xFF):
            bad = f.copy()
            bad[p] ^= flip
            out = clean.copy()
            try:
                codec.decode(bad, dtype, out)
            except CodecError:
                continue
            assert not np.array_equal(out, clean), f"{name}: byte {p} ^ {flip:#x} of {len(f)} decoded as if intact"


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "fp8-e5m2"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cast_within_stated_tolerance(fmt, dtype):
    rng = np.random.default_rng(6)
    n = 100_003
    # wide dynamic range inside blocks (tiny values fall to fp8 subnormals), finite in both pool dtypes
    x = _cast((rng.standard_normal(n) * 2.0 ** rng.uniform(-14, 10, n)).astype(np.float32), dtype)
    c = codecs.get(f"cast-{fmt}")
    f = c.encode(x, dtype)
    out = np.empty_like(x)
    c.decode(f, dtype, out)
    t = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[dtype]
    bad, max_abs, max_rel = outside(x.view(t), out.view(t), fmt, dtype)
    assert bad == 0
    assert 0 < max_rel <= 1.0  # lossy: some error, bounded (values below the block's fp8 range flush to 0)
    rel, _ = tolerance(fmt, dtype)
    # half an ulp of fp8, half an ulp of the pool dtype (two roundings), and their product
    assert rel == pytest.approx(2.0 ** -{"fp8-e4m3": 4, "fp8-e5m2": 3}[fmt] + 2.0 ** -{"bf16": 8, "fp16": 11}[dtype], rel=0.02)
    assert len(x) / len(f) == pytest.approx(2 * 128 / 132, rel=0.01)  # fp8 values + one fp32 scale per 128
    # the check can fail: values off by 25% are counted outside (all but those under the abs floor)
    assert outside(x.view(t), (out.view(t).astype(np.float32) * 0.75).astype(t), fmt, dtype)[0] > n // 4


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=g).to(torch.bfloat16)
    for name in LOSSLESS:
        c = codecs.get(name)
        f = c.encode(x, "bf16")
        assert np.array_equal(f, c.encode(x.view(torch.int16).numpy().view(np.uint8), "bf16"))
        out = torch.empty_like(x)
        c.decode(torch.from_numpy(f), "bf16", out)
        assert torch.equal(out.view(torch.int16), x.view(torch.int16))
