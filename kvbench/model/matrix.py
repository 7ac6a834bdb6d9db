"""Traffic matrices: cell [i][j] is what rank i sends rank j at once, as tokens (a bare number) or bytes (a number
with a unit: 64MiB, 1GB); 0 sends nothing.  The pairing schemes are named matrices whose cells are the case's
tokens (``*``); ``incast`` is many-to-one, ``bidir`` every pairwise pair in both directions.

A matrix comes from a CSV file (one row per line), a YAML file (a list of rows, or ``matrix:`` holding one), or a
name (model/schemes.py expands it for the run's ranks).  Pure data: parsing and checking here, the runs that
measure each flow alone and all flows together in harness/flows.py.
"""
from __future__ import annotations

import csv
import math
import os
import re

from kvbench.model import yamlfile
from kvbench.model.limits import MAX_BYTES, MAX_CELL, MAX_FILE_BYTES, MAX_TOKENS, clip, whole

ALL = "*"  # a named matrix's cell: the case's own tokens
MAX_CELLS = 250_000  # a 500 x 500 matrix
NAMED = ("pairwise", "many-to-one", "one-to-many", "all-pairs", "incast", "bidir")
_CELL = re.compile(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)")
UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


class MatrixError(ValueError):
    """A matrix that cannot be read or does not fit the run (one line)."""


def load(spec: str) -> list[list[str]] | str:
    """``--matrix``: a name (kept as it is, expanded for the run's ranks) or a file's cells, checked."""
    if spec in NAMED:
        return spec
    if not os.path.isfile(spec):
        raise MatrixError(f"--matrix {clip(spec)}: no such file (or a name: {', '.join(NAMED)})")
    if spec.endswith((".yaml", ".yml")):
        try:  # held to the YAML limits (model/limits.py): an alias bomb is refused before it is built
            data = yamlfile.read(spec)
        except ValueError as exc:
            raise MatrixError(f"--matrix {exc}") from None
        rows = data.get("matrix") if isinstance(data, dict) else data
    else:
        rows = csv_rows(spec)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise MatrixError(f"--matrix {spec}: expected rows of cells (CSV lines, or a YAML list of lists)")
    if sum(len(r) for r in rows) > MAX_CELLS:
        raise MatrixError(f"--matrix {spec}: more than {MAX_CELLS:,} cells")
    cells = [[str(c).strip() for c in r] for r in rows]
    check_cells(cells, f"--matrix {spec}")
    return cells


def csv_rows(spec: str) -> list[list[str]]:
    """A CSV matrix's rows (``#`` lines are comments), the file no larger than a YAML one may be."""
    try:
        if os.path.getsize(spec) > MAX_FILE_BYTES:
            raise MatrixError(f"--matrix {spec}: larger than {MAX_FILE_BYTES:,} bytes")
        with open(spec, newline="", encoding="utf-8") as fh:
            return [r for r in csv.reader(fh, skipinitialspace=True) if r and not r[0].lstrip().startswith("#")]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise MatrixError(f"--matrix {spec}: cannot read it: {str(exc)[:200]}") from None


def check_cells(cells: list[list[str]], what: str = "--matrix") -> None:
    """Square, every cell a non-negative number of tokens or bytes, nothing on the diagonal, some flow."""
    n = len(cells)
    for i, row in enumerate(cells):
        if len(row) != n:
            raise MatrixError(f"{what}: row {i} has {len(row):,} cells, the matrix has {n} rows (it must be square)")
        for j, c in enumerate(row):
            if c != ALL:
                nbytes, tokens = parse_cell(c, f"{what}: cell [{i}][{j}]")
                if i == j and (nbytes or tokens):
                    raise MatrixError(f"{what}: cell [{i}][{j}] = {clip(c)}: a rank does not send to itself")
    if not any(c != ALL and sum(parse_cell(c)) for row in cells for c in row) and ALL not in sum(cells, []):
        raise MatrixError(f"{what}: every cell is 0: no flow to measure")


def parse_cell(c: str, what: str = "cell") -> tuple[int, int]:
    """(bytes, tokens) of one cell, one of them 0; MatrixError for a negative or non-numeric one."""
    m = _CELL.fullmatch(c) if len(c) <= MAX_CELL else None
    unit = m.group(2).lower() if m else ""
    if m is None or (unit and unit not in UNITS):
        raise MatrixError(f"{what} = {clip(c)}: not a number of tokens, or of bytes with a unit (KiB, MiB, GiB, "
                          "B): cells are 0 or more")
    x = float(m.group(1))
    try:
        if unit:
            return whole(x * UNITS[unit], MAX_BYTES, f"{what} = {clip(c)} in bytes"), 0
        n = whole(x, MAX_TOKENS, f"{what} = {clip(c)} in tokens")
    except ValueError as exc:
        raise MatrixError(str(exc)) from None
    if x != n:
        raise MatrixError(f"{what} = {clip(c)}: tokens are whole numbers")
    return 0, n


def flows(cells: list[list[str]]) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs with something to send, row by row."""
    return [(i, j) for i, row in enumerate(cells) for j, c in enumerate(row) if c == ALL or sum(parse_cell(c))]


def tokens(cell: str, case_tokens: int, bytes_per_token: int) -> int:
    """A flow's tokens: the case's (``*``), the cell's, or its bytes in whole tokens of the case's model (at least 1)."""
    if cell == ALL:
        return case_tokens
    nbytes, ntok = parse_cell(cell)
    return ntok if ntok else max(1, math.ceil(nbytes / bytes_per_token))


def suite_value(v):
    """A suite's ``matrix``: a name from NAMED, or its rows as strings, checked (ValueError: the one line)."""
    if isinstance(v, str):
        if v not in NAMED:
            raise ValueError(f"matrix {clip(v)} is not one of: {', '.join(NAMED)} (or give its rows)")
        return v
    if isinstance(v, list):
        v = [[str(c).strip() for c in row] if isinstance(row, list) else row for row in v]
        if not all(isinstance(row, list) for row in v):
            raise ValueError("matrix: expected a list of rows")
        check_cells(v, "matrix")
    return v
