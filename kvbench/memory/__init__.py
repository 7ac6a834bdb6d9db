"""Memory kinds: allocate page-aligned pools (``host``), fill them with a checkable pattern, verify (``pattern``)."""
from __future__ import annotations

from .host import (
    KINDS,
    PAGE,
    PAGE_KINDS,
    PagesError,
    alloc_host,
    available_bytes,
    collapse,
    hugepage_size,
    hugepages_free_bytes,
    map_shared,
    page_report,
    page_summary,
    thp_mode,
    thp_size,
    tmpfs_huge,
)
from .pattern import (
    POISON,
    count_wrong,
    epoch_words,
    epoch_words_at,
    expected_bytes,
    fill,
    pattern_at,
    pattern_words,
    poison,
    use,
)

__all__ = ["KINDS", "PAGE", "PAGE_KINDS", "POISON", "PagesError", "alloc_host", "available_bytes", "collapse", "count_wrong",
           "expected_bytes", "fill", "hugepage_size", "hugepages_free_bytes", "map_shared", "page_report", "page_summary",
           "pattern_at", "pattern_words", "poison", "epoch_words", "epoch_words_at", "use", "thp_mode", "thp_size",
           "tmpfs_huge"]
