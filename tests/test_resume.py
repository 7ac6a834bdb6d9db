"""--resume: an interrupted sweep continues in the same result set, with the same cases as an
uninterrupted run and no duplicates; a changed suite, schema or machine is refused."""
import json

import pytest
from helpers.asserts import assert_one_line

from kvbench.results.store import SCHEMA_VERSION

ARGS = ["-t", "shm,tcp", "--op", "push", "-b", "16", "-e", "64", "-f", "4", "--tokens", "256", "-n", "2", "-w", "0",
        "--variants", "bulk,paged", "--rounds", "1"]
KEYS = ["transport", "op", "variant", "block_size", "allocation", "coalesce", "rank", "iter", "phase"]  # phase: setup rows


@pytest.fixture
def interrupted(kvrun, tmp_path):
    """A sweep that failed in its second transport (tcp, case 5): shm finished, tcp's first case stored."""
    r = kvrun(ARGS, env={"KVBENCH_FAULT": "post:1:5"}, out_dir=tmp_path / "broken")
    assert r.code == 4 and r.meta()["status"] == "ERROR", r.err
    assert r.meta()["groups_done"] == ["shm"]
    assert sorted(set(r.table().case)) == [1, 2, 3, 4]
    return r


def test_resume_completes_the_sweep_with_the_same_cases_and_no_duplicates(kvrun, tmp_path, interrupted):
    whole = kvrun(ARGS, out_dir=tmp_path / "whole")
    assert whole.code == 0, whole.err
    r = kvrun(["--resume", interrupted.results], out_dir=tmp_path / "unused")
    assert r.code == 0, r.out + r.err
    assert f"# resuming {interrupted.results}: transports done shm" in r.out
    assert "# wrong elements: 0   cases: 6 (0 skipped)   OK" in r.out
    final = interrupted.table()  # the same file, continued
    want = whole.table()
    assert not final.duplicated(KEYS).any()
    assert sorted(map(tuple, final[KEYS].astype(str).values)) == sorted(map(tuple, want[KEYS].astype(str).values))
    assert sorted(set(final.case)) == [1, 2, 3, 4, 5, 6]  # tcp's half-done case 4 was dropped and measured again
    meta = interrupted.meta()
    assert meta["status"] == "OK" and meta["groups_done"] == ["shm", "tcp"]
    assert len(meta["resumed"]) == 1 and meta["resumed"][0]["dropped_rows"] > 0
    assert not (tmp_path / "unused").exists()


def test_resume_refuses_a_finished_run(kvrun, tmp_path):
    done = kvrun(["-t", "shm", "-b", "64", "-e", "64", "--tokens", "256", "-n", "1", "-w", "0"])
    assert done.code == 0
    assert_one_line(kvrun(["--resume", done.results]), "the run ended by itself (OK): nothing to resume")


def test_resume_refuses_a_changed_suite(kvrun, interrupted):
    changed = [*ARGS[:-2], "-w", "1"]
    assert_one_line(kvrun(["--resume", interrupted.results, *changed]), "the suite differ")


@pytest.mark.parametrize("field,value,needle", [
    ("schema_version", 0, "schema version 0"),
    ("hosts", ["elsewhere", "elsewhere"], "it ran on hosts ['elsewhere', 'elsewhere']"),
    ("world_size", 4, "it ran on 4 ranks"),
])
def test_resume_refuses_another_schema_or_machine(kvrun, interrupted, field, value, needle):
    path = interrupted.results.replace(".parquet", ".meta.json")
    meta = json.load(open(path))
    meta[field] = value
    json.dump(meta, open(path, "w"))
    before = len(interrupted.table())
    assert_one_line(kvrun(["--resume", interrupted.results]), needle)
    assert len(interrupted.table()) == before  # refused before anything was touched


def test_resume_continues_an_older_schema_run_as_this_one(kvrun, tmp_path, interrupted):
    path = interrupted.results
    meta_path = path.replace(".parquet", ".meta.json")
    meta = json.load(open(meta_path))
    meta["schema_version"] = 3  # as a schema-3 kvbench left it: no cache setting, no cache columns
    del meta["suite"]["cache"]
    json.dump(meta, open(meta_path, "w"))
    interrupted.table().drop(columns=["cache", "cache_bytes"]).to_parquet(path)
    r = kvrun(["--resume", path], out_dir=tmp_path / "unused")
    assert r.code == 0, r.out + r.err
    final = interrupted.table()
    assert sorted(set(final.case)) == [1, 2, 3, 4, 5, 6] and set(final.cache) == {"as-is"}
    assert final[final.transport == "shm"].cache_bytes.isna().all()  # the older rows: not recorded
    assert (final[final.transport == "tcp"].cache_bytes == 0).all()
    meta = interrupted.meta()
    assert meta["schema_version"] == SCHEMA_VERSION and meta["resumed"][0]["upgraded_from_schema"] == 3


def test_resume_continues_a_schema_4_run_with_the_placement_columns_at_their_defaults(kvrun, tmp_path, interrupted):
    path = interrupted.results
    meta_path = path.replace(".parquet", ".meta.json")
    meta = json.load(open(meta_path))
    meta["schema_version"] = 4  # as a schema-4 kvbench left it: no placement
    meta.pop("placement", None)
    meta.pop("gpu_map", None)
    json.dump(meta, open(meta_path, "w"))
    interrupted.table().drop(columns=["gpu", "nic", "same_gpu"]).to_parquet(path)
    r = kvrun(["--resume", path], out_dir=tmp_path / "unused")
    assert r.code == 0, r.out + r.err
    final = interrupted.table()
    assert sorted(set(final.case)) == [1, 2, 3, 4, 5, 6]
    assert (final.gpu == -1).all() and (final.nic == "").all() and not final.same_gpu.any()
    assert interrupted.meta()["resumed"][0]["upgraded_from_schema"] == 4
