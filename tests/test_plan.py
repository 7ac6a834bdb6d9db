"""`kvbench plan`: the seeds' arithmetic per fabric, nominal or measured (kvbench/report/plan.py)."""
import math

import pytest
from helpers import synth
from helpers.launch import kvbench_cli

from kvbench.report import plan


def data_rows(out: str) -> list[list[str]]:
    """The fabric tables' rows (the prefill-instance section after them has rows of its own: test_hybrid.py)."""
    tables = out.split("# one prefill instance")[0]
    return [ln.split() for ln in tables.splitlines() if ln and not ln.startswith("#") and "[" not in ln]


@pytest.mark.launches
def test_seeds_arithmetic_llama2_70b_4k_on_100gbe_is_nominal():
    r = kvbench_cli("plan", "-m", "llama-2-70b", "--tokens", "4096", "--fabric", "100GbE")
    assert r.returncode == 0, r.stderr
    (row,) = data_rows(r.stdout)
    # 2 x 80 layers x 8 KV heads x 128 x 2 B = 327,680 B per token; x 4096 = 1.342 GB; at 12.5 GB/s 107.37 ms
    assert row[:6] == ["llama-2-70b", "fp16", "all", "4096", "1,342,177,280", "1.342"]
    assert row[6] == "12.50" and row[8] == "107.37" and row[9] == "107.37"  # GB/s, T, serial exposure
    assert "# fabric 100GbE: 12.50 GB/s, nominal" in r.stdout
    assert "100GbE [nominal] llama-2-70b fp16:" in r.stdout


@pytest.mark.launches
def test_a_measured_result_file_gives_its_bandwidth_and_says_so(tmp_path):
    gamma, alpha, beta = 10e-6, 0.1e-6, 2e9
    path = synth.write(tmp_path / "m.parquet", lambda L, n, b: L * gamma + n * alpha + b / beta, hostname="nodeA")
    r = kvbench_cli("plan", "-m", "llama-2-70b", "--tokens", "4096", "--fabric", path, "--block-size", "16")
    assert r.returncode == 0, r.stderr
    assert "# fabric tcp push (nodeA): β = 2.000 GB/s" in r.stdout and "measured: link model of m.parquet" in r.stdout
    (row,) = data_rows(r.stdout)
    t_ms = (80 * gamma + 80 * 2 * 256 * alpha + 1342177280 / beta) * 1e3  # 16-token blocks: 40,960 descriptors
    assert float(row[8]) == pytest.approx(t_ms, abs=0.01)
    assert "tcp push (nodeA) [measured] llama-2-70b fp16:" in r.stdout and "nominal" not in r.stdout


@pytest.mark.launches
def test_percentiles_from_a_sample_and_from_a_histogram(tmp_path):
    assert plan.prompts_from([100, 200, 300, 400], None, None)[::2] == ({"p50": 200, "p95": 400, "p99": 400}, 250)
    h = tmp_path / "h.csv"
    h.write_text("tokens,count\n512,50\n2048,45\n8192,4\n32768,1\n")
    p, desc, mean = plan.prompts_from(None, None, str(h))
    assert p == {"p50": 512, "p95": 2048, "p99": 8192} and "100 requests" in desc
    assert mean == (512 * 50 + 2048 * 45 + 8192 * 4 + 32768) / 100
    assert plan.prompts_from(None, "50:1000,95:4000,99:9000", None)[0] == {"p50": 1000, "p95": 4000, "p99": 9000}
    r = kvbench_cli("plan", "-m", "llama-3-8b", "--histogram", str(h), "--fabric", "25GbE")
    assert [row[2:4] for row in data_rows(r.stdout)] == [["p50", "512"], ["p95", "2048"], ["p99", "8192"]]


def test_break_even_is_where_net_gain_is_zero():
    for p_s, layers, s in [(0.2, 80, 0.5), (0.05, 32, 1.0), (0.1, 1, 0.2)]:
        t = plan.break_even_s(p_s, layers, s)
        assert max(0, t - p_s) + t / layers == pytest.approx(s * p_s)
        assert plan.break_even_s(p_s, layers, s, "serial") == pytest.approx(s * p_s)


def row(net, saved, ttft_pct=50, **kw):
    return dict(pct="p50", tokens=1024, exposed_ms=saved - net, transfer_ms=1, gbps=10, saved_ms=saved, net_ms=net,
                breakeven_gbps=1, ttft_pct=ttft_pct, prefill_ms=2 * saved) | kw


def load(busy):
    return dict(label="mean", tokens=2000, rate=10, busy=busy, need_gbps=10 * busy, gbps=10)


def test_verdicts_lead_with_their_reason():
    assert plan.verdict([row(60, 100)])[0] == "pays"
    assert plan.verdict([row(60, 100), row(20, 100, pct="p99")])[0] == "marginal"  # the tail decides
    word, why = plan.verdict([row(-5, 100)])
    assert word == "does not pay" and why.startswith("p50 (1024 tokens): streaming exposes 105.00 ms")
    assert "net -5.00 ms" in why
    word, why = plan.verdict([row(60, 100)], load=load(1.2))  # the fabric cannot carry the rate
    assert word == "does not pay" and why.startswith("10 req/s of mean prompts (2000 tokens) need 12.000 GB/s")
    assert plan.verdict([row(60, 100)], load=load(0.8))[0] == "marginal"
    word, why = plan.verdict([row(60, 100, ttft_pct=120)], ttft_ms=500)
    assert word == "marginal" and why.startswith("TTFT 240.0 ms at p50 (the transfer pushes it past the 500 ms")
    word, why = plan.verdict([row(60, 100, ttft_pct=120)], ttft_ms=100)  # prefill (200 ms) alone is too long
    assert word == "pays" and "prefill alone exceeds the 100 ms budget" in why


@pytest.mark.launches
def test_fp8_halves_the_bytes_and_the_time():
    r = kvbench_cli("plan", "-m", "llama-2-70b", "--tokens", "4096", "--dtype", "fp16,fp8-e4m3", "--fabric", "100GbE")
    fp16, fp8 = data_rows(r.stdout)
    assert fp8[4] == "671,088,640" and float(fp8[8]) == pytest.approx(float(fp16[8]) / 2, abs=0.01)


@pytest.mark.launches
@pytest.mark.parametrize("args,msg", [
    (["--ttft-ms", "-1"], "plan: --ttft-ms: Input should be greater than 0"),
    (["--fabric", "carrier-pigeon"], "plan: --fabric: 'carrier-pigeon' is not a result file or one of: 25GbE"),
    (["--dtype", "fp7"], "plan: --dtype:"),
    (["--tokens", "0"], "plan: --tokens: 0 is not a positive prompt length"),
    (["--tokens", "10", "--percentiles", "50:10"], "give the prompt lengths one way"),
    (["--block-size", "24"], "not a positive power of two"),
    (["-m", "gpt-9"], "model 'gpt-9' is not one of"),
    (["--tp", "2,4"], "plan: --tp takes one value, not 2,4"),
    (["-m", "llama-3-8b,llama-3-8b"], "plan: -m: 'llama-3-8b' is listed twice"),  # once printed its rows twice
    (["--percentiles", "50:0"], "plan: prompt lengths p50: 0 is not a positive prompt length"),
    (["--tp", "3:2", "-m", "llama-3-70b"], "plan: --tp 3:2: prefill TP 3 does not divide llama-3-70b's 8 KV heads"),
    (["--head-layout", "HND"], "plan: --head-layout takes one value, with --tp P:D"),
    (["--tp", "2:1", "--head-layout", "NHD,HND"], "plan: --head-layout takes one value"),
])
def test_bad_input_is_one_line(args, msg):
    r = kvbench_cli("plan", *args)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and msg in r.stderr, r.stderr


# not dtype: a run also takes nvfp4, which plan cannot price (its bytes depend on its scale planes)
@pytest.mark.parametrize("plan_field,axis,value", [
    ("models", "model", "gpt-9"), ("block_size", "block_size", 24),
    ("prompts", "tokens", 0), ("tp", "tp", 0), ("prefix_hit", "prefix_hit", -5),
])
def test_plan_and_run_refuse_a_value_in_the_same_words(plan_field, axis, value):
    """One validator (kvbench/model/inputs.py) for both: the words after the flag or field name are the same."""
    from kvbench.config import suite as S

    ok = dict(models=["llama-3-8b"], dtypes=["fp16"], prompts={"p50": 1024}, prompt_desc="", prefill_tflops=400,
              ttft_ms=200, rate=1, saving=0.5, block_size=16, tp=1, pp=1, prefix_hit=0, fabrics=["100GbE"])
    bad = {"p50": value} if plan_field == "prompts" else [value] if plan_field == "models" else value
    with pytest.raises(plan.ValidationError) as exc:
        plan.PlanInput(**dict(ok, **{plan_field: bad}))
    said_plan = plan.one_line(exc.value).split(": ", 2)[2]
    with pytest.raises(S.SuiteError) as exc:
        S.validate({"axes": {axis: [value]}})
    said_run = str(exc.value).split("': ", 1)[1]
    assert said_plan == said_run, (said_plan, said_run)
    assert str(value) in said_run


@pytest.mark.launches
def test_a_named_rate_in_gbit():
    r = kvbench_cli("plan", "-m", "llama-3-8b", "--tokens", "1000", "--fabric", "200 Gb/s")
    (row,) = data_rows(r.stdout)
    assert row[6] == "25.00" and math.isclose(float(row[8]), 131072 * 1000 / 25e9 * 1e3, abs_tol=0.01)


@pytest.mark.launches
def test_prefill_tp_to_decode_tp_plans_a_decode_ranks_bytes_and_descriptors():
    """--tp 4:2: bytes of one decode rank (TP 2's shard); on a link model, NHD's descriptor per token costs more
    than HND's per block for the same bytes; prefill time from prefill TP 4."""
    r = kvbench_cli("plan", "-m", "llama-3-70b", "--tokens", "4096", "--fabric", "100GbE", "--tp", "4:2")
    assert r.returncode == 0, r.stderr
    (row,) = data_rows(r.stdout)
    # a decode rank at TP 2: 4 of 8 KV heads, 2 x 80 layers x 4 x 128 x 2 B x 4096 tokens
    assert row[4] == "671,088,640" and "tp 4:2 (prefill : decode, NHD heads)" in r.stdout
    one = data_rows(kvbench_cli("plan", "-m", "llama-3-70b", "--tokens", "4096", "--fabric", "100GbE", "--tp",
                                "4").stdout)[0]
    assert row[7] == one[7]  # P: prefill TP 4 either way
    from kvbench.report.plan import Fabric

    class Fit:  # a link model: t = L x 1 ms + n x 5 us + bytes / 1 GB/s
        def predict(self, layers, n, nbytes):
            return layers * 1e-3 + n * 5e-6 + nbytes / 1e9

    fab, times = Fabric("fit", 1.0, "measured: test", Fit()), {}
    for h in ("NHD", "HND"):
        inp = plan.PlanInput(models=["llama-3-8b"], dtypes=["fp16"], prompts={"all": 1024}, prompt_desc="x",
                             prefill_tflops=400, ttft_ms=200, rate=1, saving=0.5, block_size=16, tp=2,
                             decode_tp=1, head_layout=h, pp=1, prefix_hit=0, fabrics=["fit"])
        (r0,) = plan.rows(inp, [fab])
        times[h] = r0["transfer_ms"]
        assert r0["bytes"] == 2 * 32 * 1024 * 8 * 128 * 2  # the decode rank gathers every head
    # NHD: 2 pieces x 64 layer-regions x 1,024 tokens; HND: 2 x 64 x 64 blocks; 32 layers, 134 MB either way
    assert times["NHD"] == pytest.approx((32e-3 + 131_072 * 5e-6 + 134_217_728 / 1e9) * 1e3)
    assert times["HND"] == pytest.approx((32e-3 + 8_192 * 5e-6 + 134_217_728 / 1e9) * 1e3)
