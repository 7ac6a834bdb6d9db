"""Rank 0's progress bar (--progress): it counts what the harness really delivers, and stays off by default."""
from kvbench.cli import progress
from kvbench.cli.main import build_parser
from kvbench.config import runconfig as config


def cases_of(*argv):
    a = build_parser().parse_args(["run", *argv])
    return config.build(a, ["run", *argv], 2)


def test_bar_counts_every_measurement_of_a_real_run(kvrun):
    args = ["-t", "shm,cuda_ipc", "--tokens", "64,128", "-b", "16", "-e", "64", "-f", "4", "-n", "2", "-w", "0",
            "--variants", "bulk,paged", "--progress", "on"]
    cfg = cases_of(*args)
    # shm: 2 payloads x (bulk + 2 block sizes); cuda_ipc is unavailable here: one skipped row per case
    assert progress.expected(cfg.cases, cfg.suite.variants) == 2 * 3 + 4
    run = kvrun(args)
    assert run.code == 0, run.err
    assert run.table()["case"].nunique() == 10
    assert "10/10 measurements" in run.err.replace("\r", "\n")
    assert "/10 measurements" not in run.out  # the bar is on stderr; the table on stdout stays clean


def test_bar_is_off_when_rank_0_has_no_terminal(kvrun):
    run = kvrun(["-t", "shm", "--tokens", "64", "-b", "16", "-e", "16", "-n", "2", "-w", "0", "--variants", "paged"])
    assert run.code == 0, run.err
    assert "measurements" not in run.err


def test_references_are_counted_once_per_payload():
    cfg = cases_of("-t", "shm", "--tokens", "64", "-b", "16", "-e", "256", "-f", "4", "--op", "push,pull")
    # default variants bulk, ceiling (4 chunks), paged: per op 5 references + 3 block sizes
    assert progress.expected(cfg.cases, cfg.suite.variants) == 2 * (5 + 3)


def test_without_a_terminal_a_line_every_30_s_says_count_and_time_left(capsys):
    now = [100.0]
    lines = progress.Lines(10, clock=lambda: now[0])
    for t in (10.0, 29.0):  # under 30 s since the start: silent
        now[0] = 100.0 + t
        lines.tick("shm push")
    assert capsys.readouterr().out == ""
    now[0] = 130.0
    lines.tick("tcp pull")  # 3 of 10 in 30 s: 70 s left at this pace
    assert capsys.readouterr().out == "# progress: 3/10 measurements, 0m30s spent, about 1m10s left at this pace (now: tcp pull)\n"
    now[0] = 140.0
    lines.tick()  # 10 s since the last line: silent
    now[0] = 1000.0
    for _ in range(6):
        lines.tick()  # the last measurement: the footer says the rest
    assert capsys.readouterr().out.count("# progress:") == 1
    assert isinstance(progress.start("auto", [], ["paged"]), progress.Lines)  # pytest's stderr is no terminal
    assert progress.start("off", [], ["paged"]) is None
