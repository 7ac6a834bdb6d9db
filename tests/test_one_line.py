"""One line per failure (issue 45, item 5): however many ranks find rank 0 stopped, the job says it once, and a
fault switch that is not one is one line at the door, not a traceback per rank."""
from __future__ import annotations


def kvbench_lines(r) -> list[str]:
    return [ln for ln in (r.out + r.err).splitlines() if ln.startswith("kvbench: ")]


def test_rank_0_stopped_on_4_ranks_is_one_line(kvrun):
    r = kvrun(["-t", "shm", "-n", "2", "-w", "0", "--tokens", "64", "-b", "16", "-e", "16", "--timeout", "10"], n=4,
              env={"KVBENCH_FAULT": "stop@case:0"}, timeout=120)
    assert r.code == 5, r.out + r.err
    lines = kvbench_lines(r)
    assert len(lines) == 1 and lines[0].startswith("kvbench: timeout: rank ") and "did not end within 10 s" in lines[0]
    assert r.meta()["status"] == "TIMEOUT" and r.meta()["reason"] == lines[0]


def test_a_fault_switch_that_is_not_one_is_one_line(kvrun):
    r = kvrun(["-t", "shm", "-n", "1", "-w", "0", "--tokens", "16", "-b", "16", "-e", "16"], n=4,
              env={"KVBENCH_FAULT": "stop@nowhere:0"}, timeout=60)
    assert r.code == 1, r.out + r.err
    assert len(kvbench_lines(r)) == 1 and "Traceback" not in r.err
    assert kvbench_lines(r)[0].startswith("kvbench: error: KVBENCH_FAULT item 'stop@nowhere:0' is not")


def test_a_trace_replay_whose_peer_is_killed_is_incomplete_in_one_line(kvrun):
    """A replay's rank killed -9: the others' reapers keep the documented status, INCOMPLETE, not ERROR."""
    r = kvrun(["-t", "tcp", "--trace", "mooncake-conversation", "-m", "llama-3-8b", "--tokens", "64", "-n", "2",
               "-w", "0", "--requests", "8", "--speed", "100", "--timeout", "20"], env={"KVBENCH_FAULT": "kill:1"}, timeout=120)
    assert r.code == 9, r.out + r.err  # hydra's: the signal's number
    assert r.meta()["status"] == "INCOMPLETE", r.meta().get("reason")
    assert len(kvbench_lines(r)) <= 1 and "Traceback" not in r.err
