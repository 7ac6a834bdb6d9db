"""Traffic matrices and bidir (model/matrix.py, harness/flows.py): parsing and its refusals, and real runs where
each flow runs alone and then all flows at once, every byte checked."""
from __future__ import annotations

import numpy as np
import pytest

from kvbench.model import matrix as X
from kvbench.model.schemes import SchemeError, flow_cells, make_pairs


def test_named_matrices_are_the_schemes_and_bidir_goes_both_ways():
    assert make_pairs("matrix", 4, "incast") == make_pairs("many-to-one", 4) == [(0, 3), (1, 3), (2, 3)]
    assert make_pairs("matrix", 4, "all-pairs") == make_pairs("all-pairs", 4)
    assert make_pairs("bidir", 4) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert flow_cells("bidir", 2) == [X.ALL, X.ALL] and flow_cells("pairwise", 2) is None
    with pytest.raises(SchemeError, match="needs --matrix"):
        make_pairs("matrix", 2)


def test_cells_are_tokens_or_bytes_and_files_read_as_csv_or_yaml(tmp_path):
    (tmp_path / "m.csv").write_text("# sender rows\n0, 128, 0\n0, 0, 1MiB\n64, 0, 0\n")
    (tmp_path / "m.yaml").write_text("matrix:\n  - [0, 128, 0]\n  - [0, 0, 1MiB]\n  - [64, 0, 0]\n")
    a, b = X.load(str(tmp_path / "m.csv")), X.load(str(tmp_path / "m.yaml"))
    assert a == b == [["0", "128", "0"], ["0", "0", "1MiB"], ["64", "0", "0"]]
    assert make_pairs("matrix", 3, a) == [(0, 1), (1, 2), (2, 0)]
    assert X.tokens("128", 999, 4096) == 128 and X.tokens("1MiB", 999, 4096) == 256 and X.tokens("*", 999, 1) == 999
    assert X.tokens("1KiB", 1, 4096) == 1  # at least a token


@pytest.mark.parametrize("text, why", [("0,-5\n0,0\n", "'-5'"), ("0,abc\n0,0\n", "'abc'"), ("0,1.5\n0,0\n", "whole"),
                                       ("0,1\n0\n", "square"), ("3,0\n0,0\n", "itself"), ("0,0\n0,0\n", "every cell is 0"),
                                       ("0,2XB\n0,0\n", "'2XB'")])
def test_bad_cells_are_one_line(tmp_path, text, why):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(X.MatrixError, match=why):
        X.load(str(f))


def test_a_matrix_of_the_wrong_size_is_refused():
    with pytest.raises(SchemeError, match="a 3x3 matrix for 2 ranks"):
        make_pairs("matrix", 2, [["0", "1", "0"], ["0", "0", "1"], ["1", "0", "0"]])


@pytest.mark.parametrize("args, why", [
    (["--scheme", "matrix", "--matrix", "WRONG_SIZE"], "a 3x3 matrix for 2 ranks"),
    (["--scheme", "matrix", "--matrix", "NEGATIVE"], "'-5'"),
    (["--scheme", "matrix", "--matrix", "NONNUMERIC"], "'x'"),
    (["--scheme", "matrix"], "needs --matrix"),
    (["--matrix", "incast"], "--matrix needs --scheme matrix"),
])
def test_bad_matrices_exit_1_with_one_line_and_nothing_written(kvrun, tmp_path, args, why):
    files = {"WRONG_SIZE": "0,1,1\n0,0,1\n0,0,0\n", "NEGATIVE": "0,-5\n0,0\n", "NONNUMERIC": "0,x\n0,0\n"}
    args = [str(tmp_path / f"{a}.csv") if a in files else a for a in args]
    for name, text in files.items():
        (tmp_path / f"{name}.csv").write_text(text)
    r = kvrun(["-t", "tcp", "-n", "1", "-w", "0", "--tokens", "16", *args], timeout=60)
    assert r.code == 1 and why in r.err and len(r.err.strip().splitlines()) == 1, r.out + r.err
    assert r.results is None


def _flow_checks(rows, flows: set[str]) -> None:
    """Every measurement of a matrix: each flow alone (only its two ranks' rows), then all of them; the derived
    columns follow from the rows' own times."""
    timed = rows[(rows.iter >= 0) & (rows.status == "ok")]
    iso, cong = timed[timed.flow_mode == "isolated"], timed[timed.flow_mode == "congested"]
    assert set(iso.flow) == set(cong.flow) == flows
    for _, c in iso.groupby("case"):
        assert c.flow.nunique() == 1 and c["rank"].nunique() == 2  # one flow alone: the others wait at barriers
    for _, c in cong.groupby("case"):
        assert set(c.flow) == flows
        per = c.groupby(["flow", "iter"]).seconds.max().groupby("flow").median()
        first = c.groupby("flow").first()
        assert np.allclose(first.congested_s, per.loc[first.index])  # p50 of the later of its two ranks
        assert (first.isolated_s > 0).all() and (first.congested_s > 0).all()
        assert np.allclose(first.slowdown, first.congested_s / first.isolated_s)
        gbps = first.payload_bytes / first.congested_s / 1e9
        assert np.allclose(first.fairness, gbps.min() / gbps.max()) and (0 < first.fairness).all()
        assert (first.fairness <= 1).all()


def test_incast_3_to_1_matrix_runs_alone_then_together(kvrun, tmp_path):
    """4 ranks, 3 -> 1 (named incast), -c all: nothing wrong, each flow alone then all three into rank 3."""
    r = kvrun(["-t", "shm", "--scheme", "matrix", "--matrix", "incast", "-m", "llama-3-8b", "--tokens", "128",
               "-b", "16", "-e", "16", "-n", "3", "-w", "1", "-c", "all", "--variants", "paged"], n=4, timeout=400)
    assert r.code == 0, r.out + r.err
    rows = r.transfers()
    assert int(rows.nwrong.fillna(0).sum()) == 0 and rows.nwrong.notna().any()
    _flow_checks(rows, {"0->3", "1->3", "2->3"})
    cong = rows[(rows.flow_mode == "congested") & (rows.iter >= 0) & (rows.role == "decode")]
    first = cong.groupby("flow").first()
    # rxGB/s: the three flows' bytes into rank 3 over the slowest flow's p50
    assert np.allclose(first.receiver_gbps, first.payload_bytes.sum() / first.congested_s.max() / 1e9)
    assert "slowdown" in r.out and "0->3" in r.out  # the flow table after the bandwidth table


def test_matrix_file_flows_move_their_own_sizes(kvrun, tmp_path):
    """A CSV matrix on tcp: 0 -> 1 moves 128 tokens, 1 -> 0 1 MiB (8 tokens of llama-3-8b): a rank that sends
    and receives, both sides' blocks disjoint, every byte checked."""
    f = tmp_path / "m.csv"
    f.write_text("0,128\n1MiB,0\n")
    r = kvrun(["-t", "tcp", "--scheme", "matrix", "--matrix", str(f), "-m", "llama-3-8b", "-b", "16", "-e", "16",
               "-n", "2", "-w", "1", "-c", "all", "--variants", "bulk,paged"], timeout=300)
    assert r.code == 0, r.out + r.err
    rows = r.transfers()
    assert int(rows.nwrong.fillna(0).sum()) == 0
    got = rows[rows.role == "decode"].groupby("flow").agg(tokens=("tokens", "first"), payload=("payload_bytes", "first"))
    assert got.loc["0->1"].tokens == 128 and got.loc["1->0"].tokens == 8
    assert got.loc["1->0", "payload"] == 2**20 and got.loc["0->1", "payload"] == 128 * 2**17
    _flow_checks(rows, {"0->1", "1->0"})


@pytest.mark.parametrize("op", ["push", "pull"])
def test_bidir_rows_per_direction_beside_each_direction_alone(kvrun, op):
    r = kvrun(["-t", "tcp,shm", "--scheme", "bidir", "--op", op, "-m", "llama-3-8b", "--tokens", "128", "-b", "16",
               "-e", "16", "-n", "2", "-w", "1", "-c", "all", "--variants", "paged"], timeout=300)
    assert r.code == 0, r.out + r.err
    rows = r.transfers()
    assert int(rows.nwrong.fillna(0).sum()) == 0
    for _, t in rows.groupby("transport"):
        _flow_checks(t, {"0->1", "1->0"})
        both = t[(t.flow_mode == "congested") & (t.iter >= 0)]
        assert set(both[both.role == "prefill"]["rank"]) == {0, 1} == set(both[both.role == "decode"]["rank"])
