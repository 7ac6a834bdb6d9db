"""Limits on what a user's input may hold before it is parsed (a file's size, nesting, aliases, an integer's
digits, a number's size), and how a one-line error quotes a value: at most ``QUOTE`` characters of it.

A reader checks these first, so that a hostile input (a YAML alias bomb, a JSON line nested 200,000 deep, a
5000-digit integer, ``1e999``) is refused in one line naming the input, never an OverflowError, a
RecursionError or a gigabyte-long message.  Standard library only.
"""
from __future__ import annotations

import math
import sys

QUOTE = 80  # characters of a value a message quotes
MAX_FILE_BYTES = 1 << 20  # a suite, a model or a matrix YAML file: a few KiB in practice
MAX_NODES = 250_000  # YAML nodes after aliases are expanded (a 500 x 500 matrix)
MAX_DEPTH = 64  # YAML nesting
MAX_DIGITS = 20  # an integer's digits: 2^64 has 20
MAX_TOKENS = 2**32  # a prompt (a trace's lengths, a matrix cell): no model's context comes near
MAX_BYTES = 2**50  # a size in bytes (a pool, a matrix cell): 1 PiB
MAX_CELL = 64  # characters of a number as text (a matrix cell, a pool size)


def clip(value, n: int = QUOTE) -> str:
    """``value`` quoted as a message quotes it (``repr``), cut to ``n`` characters with its length said: a
    message quotes a value, not a file (a container is summed up: an alias bomb's repr would be gigabytes)."""
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value):,} items"
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:  # an integer past Python's digit limit cannot even be printed
        return f"an integer of more than {sys.get_int_max_str_digits():,} digits"
    quote = repr if isinstance(value, str) else str
    if len(text) <= n:
        return quote(text)
    return f"{quote(text[:n])}... ({len(text):,} characters)"


def one_line(text: str, n: int = 1000) -> str:
    """``text`` as one line of at most ``n`` characters (the door's last word on what a reader put in it)."""
    line = " ".join(text.splitlines())
    return line if len(line) <= n else f"{line[:n]}... ({len(line):,} characters)"


def whole(x: float, most: float, what: str) -> int:
    """A finite number from 0 to ``most`` as an int; ValueError (one line, ``what`` first) otherwise."""
    if not math.isfinite(x) or x < 0 or x > most:
        raise ValueError(f"{what} is {x:g}: give 0 to {most:,.0f}")
    return int(x)
