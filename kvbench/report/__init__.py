"""Readers of result files: tables (the live printer and `kvbench report`'s table).

Nothing in this package imports the harness or a transport (docs/layout.md).
"""
from .tables import *  # noqa: F401,F403
from .tables import read, summarize  # noqa: F401  (explicit: the readers' entry points)
