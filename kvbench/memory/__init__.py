"""Memory kinds: allocate page-aligned pools (``host``), fill them with a checkable pattern, verify (``pattern``)."""
from __future__ import annotations

from .host import KINDS, PAGE, alloc_host, available_bytes
from .pattern import POISON, count_wrong, expected_bytes, fill, pattern_at, pattern_words, poison

__all__ = ["KINDS", "PAGE", "POISON", "alloc_host", "available_bytes", "count_wrong", "expected_bytes", "fill",
           "pattern_at", "pattern_words", "poison"]
