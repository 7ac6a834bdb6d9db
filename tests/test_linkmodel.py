"""The link model: t = L·γ + n·α + bytes/β fitted per path (kvbench/report/linkmodel.py, `kvbench fit`)."""
import math

import numpy as np
import pytest
from helpers import synth
from helpers.launch import kvbench_cli

from kvbench.model import shapes as M
from kvbench.report import linkmodel, read, summarize

GAMMA, ALPHA, BETA = 40e-6, 0.8e-6, 6e9  # 40 us per layer, 0.8 us per descriptor, 6 GB/s


def truth(L, n, b):
    return L * GAMMA + n * ALPHA + b / BETA


def test_fit_recovers_known_costs_from_exact_points():
    L = np.array([32, 32, 16, 16, 32, 16, 32])
    n = np.array([32, 4096, 16, 2048, 512, 64, 1024])
    b = np.array([1, 1, 0.5, 0.5, 4, 2, 4]) * 2**27
    fit = linkmodel.fit_points(L, n, b, truth(L, n, b))
    assert fit.gamma_s == pytest.approx(GAMMA, rel=1e-6)
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    assert fit.beta_bps == pytest.approx(BETA, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel < 1e-9 and not fit.notes


def test_fit_with_noise_stays_near_the_costs_and_says_how_far():
    rng = np.random.default_rng(1)
    L = np.repeat([32, 16], 40)
    n = rng.integers(16, 8192, len(L))
    b = rng.choice([2**25, 2**26, 2**27], len(L)).astype(float)
    t = truth(L, n, b) * (1 + rng.uniform(-0.02, 0.02, len(L)))
    fit = linkmodel.fit_points(L, n, b, t)
    assert fit.alpha_s == pytest.approx(ALPHA, rel=0.05)
    assert fit.beta_bps == pytest.approx(BETA, rel=0.05)
    assert 0.005 < fit.rms_rel < 0.02 and fit.max_rel < 0.03  # the quality reported is the noise put in


def test_one_payload_cannot_separate_layers_from_bytes_and_says_so():
    n = np.array([32, 512, 1024, 4096])
    fit = linkmodel.fit_points([32] * 4, n, [2**27] * 4, truth(32, n, 2**27))
    assert any("does not separate" in note for note in fit.notes)
    assert fit.predict(32, n, 2**27) == pytest.approx(truth(32, n, 2**27), rel=1e-6)  # still predicts the sweep


def test_negative_costs_are_never_fitted():
    n = np.array([16, 64, 256, 1024])
    t = 0.01 - n * 1e-6  # more descriptors faster: nonsense for a cost, so alpha is clamped to 0
    fit = linkmodel.fit_points([32] * 4, n, [2**26] * 4, t)
    assert fit.alpha_s == 0 and fit.gamma_s >= 0 and fit.beta_bps > 0


def test_left_out_block_sizes_are_predicted_from_the_others(tmp_path):
    path = synth.write(tmp_path / "s.parquet", truth, transports=("tcp", "mpi"))
    df, _ = read(path)
    fits, cases = linkmodel.fit_cases(summarize(df), {32, 128})
    # paged rows and the references (bulk) are fitted apart: transports move them different ways
    assert [(f.path["transport"], f.path["kind"]) for f in fits] == [
        ("tcp", "reference"), ("tcp", "paged"), ("mpi", "reference"), ("mpi", "paged")]
    held = cases[~cases["used"]]
    assert sorted(set(held["block_size"])) == [32, 128] and len(held) == 2 * 4 * 2
    assert held["err_pct"].abs().max() < 1e-6
    for f in fits[1::2]:  # paged: 4 payloads x 3 fitted block sizes
        assert f.points == 12 and f.separable and f.beta_bps == pytest.approx(BETA, rel=1e-6)
        assert f.gamma_s == pytest.approx(GAMMA, rel=1e-6) and f.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    for f in fits[::2]:  # bulk: one descriptor per layer, so layers and descriptors cannot be told apart
        assert f.points == 4 and not f.separable


def test_predict_request_counts_descriptors_and_bytes():
    fit = linkmodel.LinkFit({}, GAMMA, ALPHA, BETA, 3)
    shape = M.get_model("llama-3-70b")
    p = linkmodel.predict_request(fit, shape, 4096, 16, "fp16")
    assert p["descriptors"] == 80 * 2 * 256 and p["bytes"] == 327680 * 4096
    assert p["seconds"] == pytest.approx(80 * GAMMA + 40960 * ALPHA + 327680 * 4096 / BETA)


@pytest.mark.launches
def test_fit_command_prints_costs_and_held_out_errors(tmp_path):
    path = synth.write(tmp_path / "s.parquet", truth)
    r = kvbench_cli("fit", path, "--leave-out", "32,128", "--predict", "16")
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("#   tcp push host paged")]
    assert "γ =    40.00 us/layer" in line and "α =   0.800 us/descriptor" in line and "β =   6.000 GB/s" in line
    assert r.stdout.count("HELD OUT") == 8 and "held out, tcp: 8 cases, worst |err| 0.0%" in r.stdout


def test_fit_refuses_a_file_without_single_request_rows(tmp_path):
    path = synth.write(tmp_path / "s.parquet", truth, sweep=[(256, 1, 16)])
    df, _ = read(path)
    st = summarize(df)
    st["overlap"] = "streaming"
    with pytest.raises(ValueError, match="no usable cases"):
        linkmodel.fit_cases(st)


def test_fit_on_a_real_tcp_sweep(kvrun):
    run = kvrun(["-t", "tcp", "--tokens", "64,256", "-b", "16", "-e", "64", "-f", "2", "-n", "3", "-w", "1",
                 "--rounds", "1", "--variants", "bulk,paged"])
    assert run.code == 0, run.err
    df, _ = read(run.results)
    fits, cases = linkmodel.fit_cases(summarize(df), {32})
    ref, fit = fits
    assert (ref.points, fit.points, len(cases)) == (2, 4, 8)  # 2 payloads x (bulk + 16 + 64); 32 held out
    assert fit.gamma_s >= 0 and fit.alpha_s >= 0 and fit.beta_bps > 0 and not math.isnan(fit.r2)
    assert (cases["pred_s"] > 0).all()
