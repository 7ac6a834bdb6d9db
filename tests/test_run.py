"""Real two-rank runs through mpiexec: every byte checked, results on disk."""
import json

import pytest

from kvbench.results.store import SCHEMA_VERSION

SMALL = ["-m", "llama-3-8b", "--tokens", "256", "-n", "3", "-w", "1", "--variants", "bulk,paged", "--rounds", "1"]


@pytest.mark.parametrize("op", ["push", "pull"])
def test_shm_two_ranks_no_wrong_bytes(kvrun, op):
    r = kvrun(["-t", "shm", "--op", op, "-b", "16", "-e", "64", "-f", "4", *SMALL])
    assert r.code == 0, r.out + r.err
    df = r.table()
    ok = df[df.status == "ok"]
    assert set(ok.transport) == {"shm"} and set(ok.op) == {op}
    checks = ok[ok.iter == -1]
    assert len(checks) == 3 * 2  # (bulk + 2 block sizes) x 2 ranks
    assert int(checks.nwrong.sum()) == 0
    # one row per (case, rank, iteration): 3 timed iterations per rank per case
    timed = ok[ok.iter >= 0]
    assert (timed.groupby(["case", "rank"]).size() == 3).all()
    assert set(timed["rank"]) == {0, 1}
    # exact bytes and descriptors: llama-3-8b, 256 tokens, fp16: 131072 B/token
    assert set(ok.payload_bytes) == {256 * 131072}
    paged = ok[ok.variant == "paged"]
    assert sorted(set(zip(paged.block_size, paged.descriptors))) == [(16, 32 * 2 * 16), (64, 32 * 2 * 4)]
    assert set(ok[ok.variant == "bulk"].descriptors) == {32}
    assert "# wrong elements: 0" in r.out and "OK" in r.out
    assert "bulk%" in r.out


def test_loopback_and_shm_quick_table_and_meta(kvrun):
    r = kvrun(["-t", "loopback,shm", "--op", "push,pull", "-b", "16", "-e", "256", "-f", "4", *SMALL])
    assert r.code == 0, r.out + r.err
    df = r.table()
    assert set(df.transport) == {"loopback", "shm"}
    assert set(df.op) == {"push", "pull"}
    assert int(df.nwrong.fillna(0).sum()) == 0
    meta = json.load(open(r.results.replace(".parquet", ".meta.json")))
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["world_size"] == 2 and meta["suite"]["axes"]["transport"] == ["loopback", "shm"]
    assert meta["status"] == "OK" and "system" in meta and "libraries" in meta and "git_commit" in meta
    # table rows: 2 transports x 2 ops x (3 block sizes + bulk)
    rows = [ln for ln in r.out.splitlines() if ln and not ln.startswith("#")]
    assert len(rows) == 16


def test_corrupted_byte_is_caught_and_fails_the_job(kvrun):
    r = kvrun(["-t", "shm", "--op", "push", "-b", "16", "-e", "16", "--inject-corruption", "3", *SMALL])
    assert r.code != 0
    df = r.table()
    checks = df[(df.iter == -1) & (df.role == "decode")]
    # 3 flipped bytes in the first fp16 descriptor = 2 wrong elements, in the bulk case and the paged case
    assert checks.nwrong.tolist() == [2, 2]
    assert "FAILED" in r.out and r.code == 2 and r.meta()["status"] == "FAILED"


def test_results_are_never_overwritten(kvrun):
    a = kvrun(["-t", "loopback", "-b", "16", "-e", "16", *SMALL, "--name", "same"])
    b = kvrun(["-t", "loopback", "-b", "16", "-e", "16", *SMALL, "--name", "same"])
    assert a.code == b.code == 0
    import glob
    import os

    files = glob.glob(os.path.join(os.path.dirname(b.results), "*_same*.parquet"))
    assert len(files) == 2


def test_unavailable_transport_is_a_skipped_row_not_a_crash(kvrun):
    r = kvrun(["-t", "verbs,shm", "-b", "16", "-e", "16", *SMALL])
    assert r.code == 0, r.out + r.err
    df = r.table()
    sk = df[df.transport == "verbs"]
    assert (sk.status == "skipped").all() and sk.reason.str.startswith("unavailable: ").all()
    assert "skipped: unavailable:" in r.out


def test_rounds_interleave_cases_and_keep_every_iteration(kvrun):
    r = kvrun(["-t", "shm", "--op", "push", "-b", "16", "-e", "64", "-f", "4", "-m", "llama-3-8b", "--tokens", "256",
               "-n", "5", "-w", "1", "--rounds", "2", "--variants", "bulk,paged"])
    assert r.code == 0, r.out + r.err
    assert "rounds=2" in r.out
    ok = r.table()
    timed = ok[ok.iter >= 0]
    # 5 iterations split 3 + 2 over the two rounds, for every case (bulk, 16, 64) and rank
    per = timed.groupby(["case", "rank", "round"]).size().unstack()
    assert len(per) == 3 * 2 and (per[0] == 3).all() and (per[1] == 2).all()
    assert sorted(set(timed.case)) == [1, 2, 3]
    checks = ok[ok.iter == -1]
    assert len(checks) == 3 * 2 and int(checks.nwrong.sum()) == 0


def test_bind_core_pins_each_rank_to_its_own_cpu(kvrun):
    import os

    ncpu = len(os.sched_getaffinity(0))
    r = kvrun(["-t", "shm", "--op", "push", "-b", "64", "-e", "64", *SMALL, "--bind", "core"])
    assert r.code == 0, r.out + r.err
    meta = r.meta()
    assert meta["cpu_bind"] == "core" and all(len(c) == 1 for c in meta["cpus"])
    if ncpu >= 2:
        assert meta["cpus"][0] != meta["cpus"][1]
        assert "# NOTE: ranks 0 and 1" not in r.out
    assert "bound by kvbench (--bind core)" in r.out
    # as launched (mpiexec here does not bind): both ranks may use every CPU, and the preamble says so
    u = kvrun(["-t", "shm", "--op", "push", "-b", "64", "-e", "64", *SMALL])
    if ncpu >= 2 and len(u.meta()["cpus"][0]) > 1:
        assert "# NOTE: ranks 0 and 1" in u.out and "--bind core" in u.out


def test_footer_says_unchecked_when_nothing_was_checked(kvrun):
    r = kvrun(["-t", "shm", "-b", "64", "-e", "64", *SMALL, "-c", "0"])
    assert r.code == 0, r.err
    assert "# wrong elements: -   cases: 2 (0 skipped)   UNCHECKED" in r.out
    assert r.meta()["status"] == "UNCHECKED" and r.table().nwrong.isna().all()


def test_footer_says_nothing_measured_when_every_case_was_skipped(kvrun):
    r = kvrun(["-t", "verbs", "-b", "64", "-e", "64", *SMALL])
    assert r.code == 3, r.out + r.err
    assert r.out.rstrip().splitlines()[-2].endswith("NOTHING MEASURED")
    assert r.meta()["status"] == "NOTHING MEASURED"


def test_pages_huge_on_shm_is_a_skipped_row_that_says_why(kvrun):
    """A /dev/shm segment takes no hugetlb pages: shm's rows say so (exit 3), not a 4k-page row that reads OK."""
    r = kvrun(["-t", "shm", "-b", "64", "-e", "64", *SMALL, "--pages", "huge"])
    assert r.code == 3 and r.meta()["status"] == "NOTHING MEASURED", r.out + r.err
    assert "skipped: unavailable: --pages huge: shm's pool is a /dev/shm segment (tmpfs)" in r.out


@pytest.mark.parametrize("pages", ["4k", "thp"])
def test_sidecar_records_the_pages_asked_for_and_got(kvrun, pages):
    """--pages: the sidecar says what each pool asked for and got, and every row says the page size."""
    from kvbench import memory

    r = kvrun(["-t", "loopback,shm", "--op", "push", "-b", "16", "-e", "16", *SMALL, "--pages", pages])
    assert r.code == 0, r.out + r.err
    assert set(r.table().pages) == {pages}
    infos = r.meta()["transports"]
    assert set(infos) == {"loopback", "shm"}
    for name, per_rank in infos.items():
        for info in filter(None, per_rank):
            p = info["pages"]
            assert p["requested"] == pages and p["applied"] == pages and p["bytes"] == info["pool_bytes"]
            assert 0 <= p["huge_share"] <= 1 and p["kernel_page_size"] == memory.PAGE
            if pages == "4k":
                assert p["huge_share"] == 0
            elif memory.thp_mode() in ("madvise", "always"):
                assert p["huge_share"] > 0 or "note" in p, (name, p)
    assert len(infos["loopback"][0]["pages"]["more_pools"]) == 1  # loopback's second pool is recorded too


def test_the_ceiling_is_the_best_contiguous_copy_measured_alongside(kvrun):
    r = kvrun(["-t", "shm", "--op", "push", "-b", "64", "-e", "64", "-m", "llama-3-8b", "--tokens", "256", "-n", "4",
               "-w", "1"])
    assert r.code == 0, r.out + r.err
    t = r.table()
    assert set(t["round"]) == {-1, 0, 1, 2, 3}  # interleaved by default: min(5, iterations) rounds
    ok = t[t.status == "ok"]
    # llama-3-8b, 256 tokens: 32 layers of 1 MiB; the same 32 MiB as 64 KiB .. 4 MiB contiguous chunks
    descs = ok.groupby("variant").descriptors.first().to_dict()
    assert descs == {"bulk": 32, "chunk-64K": 512, "chunk-256K": 128, "chunk-1M": 32, "chunk-4M": 32, "paged": 256}
    assert int(ok.nwrong.fillna(0).sum()) == 0 and set(ok[ok.iter == -1].variant) == set(descs)
    from kvbench.report import summarize

    st = summarize(t).set_index("variant")
    refs = st.loc[["bulk", "chunk-64K", "chunk-256K", "chunk-1M", "chunk-4M"]]
    winner = refs.gbps.idxmax()
    assert (st.ceil_name == winner).all() and st.loc[winner, "bulk_pct"] == pytest.approx(100.0)
    assert (refs.bulk_pct <= 100.0 + 1e-9).all() and "ceiling" in r.out and winner in r.out


def test_a_paged_row_above_the_ceiling_by_more_than_the_spread_is_flagged():
    import pandas as pd

    from kvbench.report import summarize
    from kvbench.results.store import CASE_COLUMNS, ROW_COLUMNS

    def rows(case, variant, times, rounds=5):
        base = {c: 0 for c in CASE_COLUMNS} | {"case": case, "variant": variant, "transport": "shm", "op": "push",
                                                "model": "m", "tokens": 1, "layers": 1, "overlap": "serial",
                                                "prefill_ms_set": "0", "workload": "none", "status": "ok",
                                                "payload_bytes": 10**9, "descriptors": 1, "pair": 0, "req": 0,
                                                "prefill_s": 0.0}
        return [dict(base, iter=i, round=i % rounds, seconds=s, rank=0) for i, s in enumerate(times)]

    steady = [1.0] * 10
    df = pd.DataFrame(rows(1, "bulk", steady) + rows(2, "paged", [0.5] * 10) + rows(3, "paged", [1.25] * 10)
                      + rows(4, "paged", [0.5, 0.9, 0.5, 0.9, 0.7] * 2), columns=ROW_COLUMNS)
    st = summarize(df).set_index("case")
    assert st.loc[1, "ceil_name"] == "bulk" and st.loc[2, "bulk_pct"] == 200.0
    assert st.loc[2, "noise"]  # twice the ceiling, no spread on either: noise, flagged
    assert st.loc[3, "bulk_pct"] == 80.0 and not st.loc[3, "noise"]
    # per-round medians 0.5, 0.9, 0.5, 0.9, 0.7: spread (0.9 - 0.5) / 0.7 = 57%; 1/0.7 = 143% is within 100 + 57
    assert round(st.loc[4, "spread_pct"]) == 57 and round(st.loc[4, "bulk_pct"]) == 143 and not st.loc[4, "noise"]
    # from 4 rounds a spread is 4 medians: printed with its n, and it decides no * (twice the ceiling reads ~)
    few = summarize(pd.DataFrame(rows(1, "bulk", steady, 4) + rows(2, "paged", [0.5, 0.6] * 5, 4),
                                 columns=ROW_COLUMNS)).set_index("case")
    assert few.loc[2, "bulk_pct"] > 150 and not few.loc[2, "noise"] and few.loc[2, "at_ceiling"]
    from kvbench.report.tables import bulk_pct_text, spread_text
    assert spread_text(few.loc[2]).endswith("(4)") and bulk_pct_text(few.loc[2]).endswith("~")
    assert spread_text(st.loc[4]) == "57.1" and bulk_pct_text(st.loc[2]) == "200.0*"
    one = pd.DataFrame([dict(r, round=0) for r in rows(5, "bulk", [1.0, 2.0] * 4)], columns=ROW_COLUMNS)
    assert pd.isna(summarize(one)["spread_pct"].iloc[0])  # one round: no spread measured, not a 0% one


def test_the_harness_reads_its_options_from_the_run_config():
    """Every flag the harness uses reaches its Options through RunConfig.options(), the one place they are read."""
    from kvbench.cli.main import build_parser
    from kvbench.config import runconfig

    argv = ["-t", "tcp", "-n", "7", "-w", "2", "--rounds", "3", "--seed", "5", "--pool-factor", "3",
            "--timeout", "90", "--setup-timeout", "30", "--pages", "thp", "--fill", "realistic", "--cache", "cold",
            "--variants", "bulk,paged", "-O", "tcp.sockbuf=65536", "--inject-corruption", "4", "-c", "0"]
    o = runconfig.build(build_parser().parse_args(["run", *argv]), argv, world=2).options()
    assert (o.iters, o.warmup, o.rounds, o.seed, o.pool_factor, o.timeout, o.setup_timeout) == (7, 2, 3, 5, 3.0, 90.0, 30.0)
    assert (o.pages, o.fill, o.cache, o.variants, o.check, o.inject_corruption) == (
        "thp", "realistic", "cold", ("bulk", "paged"), False, 4)
    assert o.transport_options == {"tcp": {"sockbuf": 65536}}
