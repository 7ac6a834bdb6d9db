"""Writing a result set's files whole or not at all (the table and its sidecar), and another rank's word in
the sidecar when rank 0 is stuck.  Standard library only: every rank may need ``record_for_rank0``."""
from __future__ import annotations

import datetime as dt
import json

from kvbench.job import cleanup
from kvbench.job.safefile import UnsafeFile, read_text, remove, write_whole
from kvbench.results.lock import lock_path


def write_json(path: str, obj: dict, tmp: str | None = None, midway=None) -> None:
    """``obj`` as indented JSON at ``path``, whole or not at all (replace_whole)."""
    replace_whole(path, lambda fh: fh.write(json.dumps(obj, indent=2, default=str).encode()), tmp, midway)


def replace_whole(path: str, write, tmp: str | None = None, midway=None) -> None:
    """Write ``path`` whole or not at all (job/safefile.py write_whole: the temporary ``path.tmp`` created new,
    never through a link, then renamed over ``path``; a link at ``path`` itself is replaced, never followed)."""
    write_whole(path, write, tmp or cleanup.tmp_of(path), midway, over_link=True)


def record_for_rank0(meta_path: str, status: str, reason: str) -> bool:
    """Another rank records a failure in the sidecar when rank 0, its writer, is stopped or hung: only while
    the sidecar still says INCOMPLETE (rank 0's own word wins), and only where the file is (a shared file
    system or rank 0's host).  Rank 0's lock and half-written files go too: the job's abort ends it, stopped
    as it is, and nobody else would remove them.  True when written."""
    try:
        meta = json.loads(read_text(meta_path))
    except (OSError, ValueError, UnsafeFile):
        return False
    try:
        if meta.get("status") != "INCOMPLETE":
            return False
        meta.update(status=status, reason=reason,
                    finished=dt.datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z"))
        try:
            write_json(meta_path, meta, tmp=cleanup.own_tmp_of(meta_path))  # not rank 0's .tmp: it may be mid-write
        except UnsafeFile:  # a link planted under its name: not written through (the job's own line says why it ends)
            return False
        return True
    finally:
        parquet = meta_path[: -len(".meta.json")] + ".parquet"
        for path in (*cleanup.set_tmp_files(parquet), lock_path(parquet)):
            try:
                remove(path)  # a link or another user's file under the name stays (job/safefile.py)
            except OSError:
                pass
