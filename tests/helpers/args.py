"""Argument presets that more than one test file runs, each with the values those files ran before they shared it.
A preset one file alone runs stays in that file."""

# a run refused at the door (tests/test_errors.py): 256 tokens, 2 timed iterations, no warm-up
SMALL = ["--tokens", "256", "-n", "2", "-w", "0"]
SHM_SMALL = ["-t", "shm", *SMALL]

# faults on real ranks (tests/test_faults.py, tests/test_nohang_deadlines.py): 3 ranks' worth of cases, short ones
SHM = ["-t", "shm", "--op", "push", "-b", "16", "-e", "64", "-f", "4", "--tokens", "256", "-n", "3", "-w", "1",
       "--variants", "bulk,paged", "--rounds", "1"]
# a run still under way long after its first row, its cases short: 400 iterations of llama-3-8b's layer in 4 layers
LONG = [*SHM[:-4], "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "-n", "400", "-w", "1", "--rounds", "1"]

# the liars against the harness (tests/test_honesty.py, tests/test_wire_bytes.py): 32 MiB requests, bulk and paged
LIAR_SMALL = ["-m", "llama-3-8b", "--tokens", "256", "-b", "64", "-e", "64", "-n", "2", "-w", "1",
              "--variants", "bulk,paged"]

# a transport that skips timed iteration 1 of ten (tests/test_check_every.py, tests/test_wrong_counts.py)
TEN = ["-t", "lie-skip", "--op", "push", "-m", "llama-3-8b", "--tokens", "64", "-b", "16", "-e", "16", "-n", "10",
       "-w", "0", "--rounds", "1", "--variants", "paged"]

# a trace replayed (tests/test_trace_replay.py, tests/test_trace_ageing.py): llama-3-8b at tp 8, one KV head,
# 16 KiB per token; the workload's pool and timeout leave no request dropped
TRACE = ["-t", "shm", "-m", "llama-3-8b", "--tp", "8", "-b", "16", "--alloc-timeout", "60000"]

# the liars judged beside two busy loops (tests/test_under_load.py, benchmarks/underload.py): verdicts that rest
# on content and byte counts, not on time
UNDER_LOAD = {
    "skip": [*TEN, "-c", "all"],
    "compress": ["-t", "lie-compress-tcp", "--op", "push", "-m", "llama-3-8b", "--tokens", "64", "-n", "5",
                 "--variants", "bulk"],
    "forge": ["-t", "lie-forge,lie-forge-tcp", "--op", "push", "-m", "llama-3-8b", "--tokens", "64", "-b", "16",
              "-e", "16", "-n", "4", "-w", "0", "--variants", "paged"],
}
