"""A result set's rows as JSON Lines or CSV beside its parquet (``kvbench run --json/--csv``, ``kvbench report
--json``), for tools that read neither parquet nor pandas.

One JSON object (one CSV line) per row of the table, in the table's order: ``schema_version``, then every column of
``schema.ROW_COLUMNS`` under its own name.  The names carry their units (``seconds`` and ``*_s``: seconds;
``*_bytes``: bytes; ``*_ms``: milliseconds; ``*_gbps``: 10^9 B/s; ``*_pct``: percent) and the values are the
table's own, not rescaled, so a JSON row equals its parquet row value for value; a value the table has not
(NaN, and the infinite wake-up bound of a transport that does not stamp) is JSON ``null``, an empty CSV field.
Each file is new: written with ``O_EXCL | O_NOFOLLOW``, never over an existing file nor through a link (results
are never overwritten), and checked at the door (runconfig.build) before the run allocates anything.  No pandas
at import: every rank imports this module, and only rank 0 writes.
"""
from __future__ import annotations

import json
import math
import os

from kvbench.job.safefile import UnsafeFile, open_own
from kvbench.results.schema import ROW_COLUMNS, SCHEMA_VERSION

COLUMNS = ["schema_version", *ROW_COLUMNS]
FLAGS = ("json", "csv")  # kvbench run's export flags, by their argparse names


class ExportError(ValueError):
    """An export file that cannot be written: the one line."""


def check_new(flag: str, path: str) -> None:
    """ExportError unless ``path`` names a new file in a folder this user may write (nothing is created here)."""
    if os.path.islink(path):
        raise ExportError(f"{flag} {path}: a symbolic link: kvbench writes no result through a link (give a new "
                          "file name)")
    if os.path.lexists(path):
        raise ExportError(f"{flag} {path}: the file exists, and results are never overwritten: give a new name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ExportError(f"{flag} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"{flag} {path}: {folder} is not writable by this user")


def wanted(a) -> dict[str, str]:
    """The run's export flags given: {"json": FILE, "csv": FILE}."""
    return {k: getattr(a, k) for k in FLAGS if getattr(a, k, None)}


def check_flags(a) -> None:
    """The run's door (config/runconfig.py build): --json and --csv name new files, not one file; ExportError."""
    files = wanted(a)
    if len(set(map(os.path.abspath, files.values()))) < len(files):
        raise ExportError(f"--json and --csv name one file ({files['json']}): give each its own")
    for kind, path in files.items():
        check_new(f"--{kind}", path)


def native(v):
    """A value as JSON has it: numpy scalars as Python's, NaN and infinities as None."""
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is not None and not isinstance(v, (str, int, float, bool)):  # pandas' NA, NaT
        return None if str(v) in ("<NA>", "NaT", "nan") else str(v)
    return v


def framed(df):
    """The rows in the export's columns (a column an older table lacks: empty)."""
    out = df.reindex(columns=ROW_COLUMNS)
    out.insert(0, "schema_version", SCHEMA_VERSION)
    return out


def records(df) -> list[dict]:
    """Every row as a dict of JSON-native values, keys in COLUMNS' order."""
    f = framed(df)
    cols = {c: [native(v) for v in f[c].tolist()] for c in COLUMNS}
    return [{c: cols[c][i] for c in COLUMNS} for i in range(len(f))]


def _new_file(path: str, fill) -> None:
    """Create ``path`` (never an existing file, never through a link) and ``fill(fh)``; a failed write leaves no
    part of the file behind."""
    try:
        fd = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except UnsafeFile as exc:
        raise ExportError(str(exc)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fill(fh)
    except BaseException:
        os.unlink(path)
        raise


def write_json(df, path: str) -> int:
    """The rows as JSON Lines in a new file; returns how many."""
    rows = records(df)
    _new_file(path, lambda fh: fh.writelines(json.dumps(r, allow_nan=False) + "\n" for r in rows))
    return len(rows)


def write_csv(df, path: str) -> int:
    """The rows as CSV (a header line, then one line per row) in a new file; returns how many."""
    f = framed(df)
    _new_file(path, lambda fh: f.to_csv(fh, index=False, columns=COLUMNS))
    return len(f)


WRITERS = {"json": write_json, "csv": write_csv}


def write(df, a) -> list[str]:
    """Rank 0 at the end of a run: every export the flags ask for, of the result set's rows ``df``; the footer's
    lines naming them."""
    out = []
    for kind, path in wanted(a).items():
        n = WRITERS[kind](_empty() if df is None else df, path)
        out.append(f"# {kind}: {path} ({n} rows)")
    return out


def _empty():
    import pandas as pd

    return pd.DataFrame(columns=ROW_COLUMNS)


def export_files(files: list[str], out: str) -> int:
    """``kvbench report FILE... --json OUT``: the files' rows (each read as this schema's) as JSON Lines."""
    import pandas as pd

    from kvbench.results.store import upgrade

    check_new("--json", out)
    frames = []
    for path in files:
        if not os.path.isfile(path):
            raise ExportError(f"{path}: no such result file")
        meta_path = (path[: -len(".parquet")] if path.endswith(".parquet") else path) + ".meta.json"
        version = SCHEMA_VERSION
        if os.path.exists(meta_path):
            with open(meta_path) as fh:
                version = json.load(fh).get("schema_version", SCHEMA_VERSION)
        try:
            frames.append(upgrade(pd.read_parquet(path), version))
        except ValueError as exc:
            raise ExportError(f"{path}: {exc}") from None
    n = write_json(pd.concat(frames, ignore_index=True) if frames else _empty(), out)
    print(f"# json: {out} ({n} rows of {len(files)} file{'s' * (len(files) != 1)})")
    return 0
