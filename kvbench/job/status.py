"""The one list of run statuses and exit codes, shared by the footer, the sidecar and the README.

Pure data and one pure function: report, compare and resume read it too.
"""
from __future__ import annotations

INPUT_ERROR = 1  # a mistake in what the user typed: one line, nothing allocated or written

# status -> (exit code, meaning).  INCOMPLETE is the sidecar's status from the moment it is
# created until the run ends one way or another: a job killed from outside (SIGKILL, the
# launcher ending it after a peer died) cannot write anything, so its sidecar keeps saying so.
STATUSES: dict[str, tuple[int | None, str]] = {
    "OK": (0, "at least one case was measured, every measured case was checked, no element was wrong"),
    "UNCHECKED": (0, "cases were measured but not checked (-c 0)"),
    "FAILED": (2, "the check found wrong elements at a destination"),
    "NOTHING MEASURED": (3, "every case was skipped (each row says why)"),
    "ERROR": (4, "a rank failed (an exception, a transport error, a refused resource); the line names it"),
    "TIMEOUT": (5, "a deadline passed (--timeout per case, --setup-timeout per transport's setup)"),
    "SUSPECT": (6, "a case beat a physical bound of its path by more than its spread (a landing stamp earlier than "
                   "this machine's wake-up latency allows, or GB/s above the link rate or the harness's own copy); "
                   "the line names it"),
    "FALLBACK": (7, "a case's bytes took another path than the one it was meant to measure (--expect, derived from "
                    "its transport, memory and placement): its numbers are that path's; the line names the case, the "
                    "path expected and what carried the bytes"),
    "INTERRUPTED": (130, "a signal ended the run (Ctrl-C = SIGINT, SIGTERM, SIGHUP)"),
    "INCOMPLETE": (None, "the run never ended by itself: killed from outside, or still running"),
}


def exit_code(status: str) -> int:
    """The process exit code for ``status`` (INCOMPLETE never exits by itself; 1 if asked)."""
    code = STATUSES[status][0]
    return INPUT_ERROR if code is None else code


def verdict(measured: int, checked: bool, wrong: int, suspect: int = 0, fallback: int = 0) -> str:
    """The footer's word for a run that ended by itself (wrong bytes outrank a time beyond physics, which outranks
    an honest time of another path than the one meant)."""
    if measured == 0:
        return "NOTHING MEASURED"
    if wrong:
        return "FAILED"
    if suspect:
        return "SUSPECT"
    if fallback:
        return "FALLBACK"
    return "OK" if checked else "UNCHECKED"


# the worst first, for a driver of several runs (make procurement): wrong bytes, then a run that did not finish or
# whose times beat physics, then one whose bytes took another path, then one that measured nothing; an input error
# is the caller's own
WORST_FIRST = ("FAILED", "ERROR", "TIMEOUT", "INTERRUPTED", "SUSPECT", "FALLBACK", "NOTHING MEASURED", "UNCHECKED",
               "OK")


def worst(codes: list[int]) -> int:
    """The exit code of the worst of several runs' exit codes (an unknown code outranks them all but 1)."""
    rank = {exit_code(s): i for i, s in enumerate(WORST_FIRST)}
    known = [c for c in codes if c in rank]
    other = [c for c in codes if c not in rank]
    if other:
        return INPUT_ERROR if INPUT_ERROR in other else other[0]
    return min(known, key=rank.__getitem__) if known else 0
