"""How a case is measured: pools, registration and connection (loop), the requests a case sends (requests),
one timed iteration (schedule), the prefill it overlaps with (prefill), one clock per pair (clocks), the check
pass after timing (checkpass), the result rows (rows), memory preflight (preflight), workloads (load; the
decode rank's loop in load_decode, the case both loops read in loadcase), the named state they share (state:
Session, Measurement, Record), and the largest pool that works (probe; one launch per size in probe_attempt).

Public API: ``loop.Harness`` and ``state.Options``; ``load.LoadHarness`` for workload cases; ``probe.run_probe``.
"""
