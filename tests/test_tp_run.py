"""`kvbench run --tp P:D --head-layout NHD|HND`: prefill ranks 0..P-1 send each decode rank P..P+D-1 the heads the TP
map gives it (model/tpmap.py, harness/tprequests.py), every byte checked; a liar that sends a head the decode rank
does not own is caught; the wrong rank count and bad flags are one line at the door."""
from __future__ import annotations

import pytest
from helpers.launch import kvbench_cli, liar_env
from tpliars import LIARS

from kvbench.config import suite as S
from kvbench.model import shapes as M
from kvbench.model import tpmap as T
from kvbench.model.schemes import SchemeError, make_pairs

# 8 KV heads of 128 in fp16 over 2 layers: a launch takes seconds; 72 tokens leave a partial last block
SMALL = ["--layers", "2", "--kv-heads", "8", "--head-dim", "128", "--attention", "gqa", "--tokens", "72",
         "-n", "2", "-w", "1", "-c", "all", "--variants", "bulk,paged"]


@pytest.mark.parametrize("args, line", [
    (["--tp", "2:2", "--ranks", "3"], "--tp 2:2 needs 4 ranks (2 prefill + 2 decode), got 3"),
    (["--tp", "0:2", "--ranks", "2"], "a TP degree is a positive integer"),
    (["--tp", "3:2", "--ranks", "5"], "prefill TP 3 does not divide llama-3-8b's 8 KV heads"),
    (["--tp", "2:1", "--ranks", "3", "--head-layout", "xyz"], "head layout 'xyz' is not one of: NHD, HND"),
    (["--tp", "2", "--head-layout", "HND"], "--head-layout goes with --tp P:D"),
    (["--tp", "2:1,2", "--ranks", "3"], "give every TP degree as P:D, or none"),
    (["--tp", "2:1", "--ranks", "3", "--scheme", "many-to-one"], "it does not take --scheme"),
    (["--scheme", "tp:2:1", "--ranks", "3"], "comes with --tp P:D"),
    (["--tp", "2:1", "--ranks", "4"], "--tp 2:1 needs 3 ranks (2 prefill + 1 decode), got 4"),
    (["--tp", "1:1,2:1", "--ranks", "4"], "a sweep of TP pairs runs on the largest pair's ranks"),
])
def test_refused_in_one_line(args, line):
    r = kvbench_cli("run", "--dry-run", "-t", "shm", *args)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and line in r.stderr, r.stderr


def test_one_number_keeps_its_meaning():
    r = kvbench_cli("run", "--dry-run", "-t", "shm", "--tp", "2,4", "--ranks", "2")
    assert r.returncode == 0, r.stderr
    cases = S.expand(S.validate({"name": "x", "axes": {"tp": [2, 4]}}))
    assert {c["tp"] for c in cases} == {2, 4} and all("head_layout" not in c for c in cases)
    assert all(c["scheme"] == "pairwise" for c in cases)


def test_a_pair_is_a_case_per_head_layout():
    cases = S.expand(S.validate({"name": "x", "axes": {"tp": ["1:2"], "head_layout": ["NHD", "HND"]}}))
    assert [(c["tp"], c["head_layout"]) for c in cases[:2]] == [("1:2", "NHD"), ("1:2", "HND")]
    assert {c["head_layout"] for c in cases} == {"NHD", "HND"}


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)])
def test_scheme_pairs_hold_every_piece(p, d):
    """The scheme's pairs (what the preamble and the path checks pair) hold each TP map's own pairs."""
    pairs = make_pairs(f"tp:{p}:{d}", p + d)
    for model in ("llama-3-8b", "llama-3-70b", "deepseek-v3"):
        m = M.get_model(model)
        tmap = T.tp_map(m, 64, 16, "fp16", "mla" if m.attention == "mla" else "layer-major", "NHD", T.TPPair(p, d))
        assert set(T.rank_pairs(tmap)) <= set(pairs)
    with pytest.raises(SchemeError, match=f"needs {p + d} ranks"):
        make_pairs(f"tp:{p}:{d}", p + d + 1)
    assert set(make_pairs(f"tp:1:1,{p}:{d}", p + d)) == set(pairs) | {(0, 1)}  # a sweep: the largest pair's ranks


def _check_all(r, tp: str, nlayouts: int = 2):
    assert r.code == 0, r.err[-2000:]
    df = r.transfers()
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["status", "reason"]].head()
    assert set(df["tp"]) == {tp} and set(df["scheme"]) == {f"tp:{tp}"}
    paged = df[df["variant"] == "paged"]
    assert len(set(paged["head_layout"])) == nlayouts and set(df["op"]) == {"push", "pull"}
    assert (df["nwrong"].fillna(0) == 0).all() and df["nwrong"].notna().any()
    return paged


@pytest.mark.parametrize("tp, n", [("2:2", 4), ("1:2", 3), ("2:1", 3)])
def test_tp_pairs_move_every_head(kvrun, tp, n):
    """Push and pull over shm and tcp, in NHD and HND, -c all: every destination byte as its source rank wrote it."""
    r = kvrun(["-t", "shm,tcp", "--op", "push,pull", "--tp", tp, "--head-layout", "NHD,HND", *SMALL], n=n,
              timeout=240)
    paged = _check_all(r, tp)
    p, d = (int(x) for x in tp.split(":"))
    tmap = T.tp_map(M.get_model("llama-3-8b"), 72, 16, "fp16", "layer-major", "NHD", T.TPPair(p, d))  # 8 heads too
    for hl, per in (("NHD", 2 * 2 * 72), ("HND", 2 * 2 * 5)):  # layers x regions x tokens, or x blocks
        rows = paged[(paged["head_layout"] == hl) & (paged["role"] == "decode")]
        whole = all(q.whole for q in tmap.pieces)
        assert set(rows["descriptors"]) == ({2 * 2 * 5} if whole else {per}), (hl, set(rows["descriptors"]))
        assert set(rows["rank"]) == set(range(p, p + d)) and rows["pair"].nunique() == len(tmap.pieces)


def test_a_sweep_of_pairs_runs_on_the_largest_pairs_ranks(kvrun):
    """--tp 1:1,2:1 on 3 ranks: 1:1's cases move between ranks 0 and 1 while rank 2 waits; 2:1's gather on rank 2."""
    r = kvrun(["-t", "shm", "--op", "push", "--tp", "1:1,2:1", "--head-layout", "HND", *SMALL], n=3, timeout=240)
    assert r.code == 0, r.err[-2000:]
    df = r.transfers()
    assert (df["status"] == "ok").all() and (df["nwrong"].fillna(0) == 0).all() and df["nwrong"].notna().any()
    assert set(df["scheme"]) == {"tp:1:1,2:1"}
    paged = df[df["variant"] == "paged"]
    one, two = paged[paged["tp"] == "1:1"], paged[paged["tp"] == "2:1"]
    assert set(one["rank"]) == {0, 1} and set(one[one["role"] == "decode"]["rank"]) == {1}
    assert set(two["rank"]) == {0, 1, 2} and set(two[two["role"] == "decode"]["rank"]) == {2}
    assert set(one["descriptors"]) == {2 * 2 * 5}  # 1:1: whole blocks; 2:1 HND: a slice per block, two pieces
    assert set(two[two["role"] == "decode"]["pair"]) and two[two["role"] == "decode"]["pair"].nunique() == 2


def test_an_interrupted_pair_sweep_resumes_with_its_pairs_and_head_layouts(kvrun, tmp_path):
    """--resume of a --tp 1:2 run that failed in tcp: the stored scheme and cases continue (no flags given)."""
    args = ["-t", "shm,tcp", "--op", "push", "--tp", "1:2", "--head-layout", "NHD,HND", *SMALL]
    broken = kvrun(args, n=3, env={"KVBENCH_FAULT": "post:1:5"}, out_dir=tmp_path / "broken", timeout=240)
    assert broken.code == 4 and broken.meta()["groups_done"] == ["shm"], broken.err[-2000:]
    r = kvrun(["--resume", broken.results], n=3, out_dir=tmp_path / "unused", timeout=240)
    assert r.code == 0 and broken.meta()["status"] == "OK", r.out[-2000:] + r.err[-2000:]
    df = broken.transfers()  # the same file, continued
    keys = ["transport", "variant", "head_layout", "pair", "role", "rank", "iter", "phase"]
    assert not df.duplicated(keys).any() and set(df["tp"]) == {"1:2"}
    paged = df[df["variant"] == "paged"]
    assert {(t, h) for t, h in zip(paged["transport"], paged["head_layout"])} == {
        (t, h) for t in ("shm", "tcp") for h in ("NHD", "HND")}
    assert (df["nwrong"].fillna(0) == 0).all() and df["nwrong"].notna().any()


def test_a_block_size_in_bytes_is_a_decode_ranks_block():
    """-b 16KiB at --tp 2:1: the decode rank holds all 8 heads (2,048 B per token in a region): 8 tokens."""
    r = kvbench_cli("run", "--dry-run", "-t", "shm", "--tp", "2:1", "--ranks", "3", "-b", "16KiB", "-m", "llama-3-8b")
    assert r.returncode == 0 and "block_size=8" in r.stdout, r.stdout + r.stderr
    r = kvbench_cli("run", "--dry-run", "-t", "shm", "--tp", "2:1,1:2", "--ranks", "3", "-b", "16KiB")
    assert r.returncode == 1 and "llama-3-8b fp16 tp 1:2: 1,024 B" in r.stderr, r.stderr


@pytest.mark.parametrize("liar", sorted(LIARS))
def test_a_head_the_decode_rank_does_not_own_is_caught(kvrun, liar):
    """One head on in every source range: the next head, another decode rank's, lands here; the check counts it."""
    env = liar_env(LIARS)
    r = kvrun(["-t", liar, "--op", "push", "--tp", "1:2", "--head-layout", "NHD,HND", *SMALL], n=3, env=env,
              timeout=240)
    assert r.code == 2 and r.meta()["status"] == "FAILED", r.out[-2000:] + r.err[-2000:]
    paged = r.transfers()
    paged = paged[paged["variant"] == "paged"]
    for hl in ("NHD", "HND"):
        caught = paged[(paged["head_layout"] == hl) & (paged["role"] == "decode")]
        assert len(caught) and (caught.groupby("rank")["nwrong"].sum() > 0).all(), (hl, r.out[-3000:])
