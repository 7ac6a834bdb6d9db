"""An engine's own logging kept off the run's stderr: a C library that logs its start-up (Mooncake's glog writes
"Logging before InitGoogleLogging()" lines on every OK run) writes into a file instead, and the transport keeps
the words for its sidecar record or its error line.  ``KVBENCH_ENGINE_LOGS=1`` leaves stderr alone."""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager


class Captured:
    text = ""

    def last(self, n: int = 200) -> str:
        """The last non-empty line the engine wrote, at most ``n`` characters ('' when none)."""
        lines = [ln.strip() for ln in self.text.splitlines() if ln.strip()]
        return lines[-1][-n:] if lines else ""


@contextmanager
def engine_stderr():
    """Within the block, file descriptor 2 (where C libraries log) goes to a temporary file; the words are in the
    yielded Captured's ``text`` once the block ends."""
    got = Captured()
    if os.environ.get("KVBENCH_ENGINE_LOGS"):
        yield got
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield got
            finally:
                os.dup2(saved, 2)
                tmp.seek(0)
                got.text = tmp.read(1 << 20).decode(errors="replace")
    finally:
        os.close(saved)
