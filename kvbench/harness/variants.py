"""What a case measures: its references once per payload, then the paged transfer (split out of loop.py)."""
from __future__ import annotations

from kvbench.harness import flows
from kvbench.model.descriptors import CHUNKS

# a payload's identity: cases alike in these share their references (report/tables.py's BULK_KEYS match them: a
# P:D pair's head layouts share theirs, the first one's bytes)
BULK_KEYS = ("op", "model", "tokens", "prefix_hit", "dtype", "tp", "pp", "inflight", "scales")


def of(case: dict, s, names: list[str]) -> list[dict]:
    """What a case measures (``names``: the run's variants): once per payload its references (bulk: one
    descriptor per layer; the ceiling: the same bytes in contiguous chunks of 64 KiB to 4 MiB; hot: one layer's
    buffer again and again), then the paged transfer."""
    out = []
    bulk_key = tuple(case.get(k) for k in BULK_KEYS)
    if bulk_key not in s.bulk:
        s.bulk.add(bulk_key)  # plain transfers: no clock, no handshake
        refs = ["bulk"] if "bulk" in names else []
        refs += list(CHUNKS) if "ceiling" in names else []
        refs += ["hot"] if "hot" in names else []
        out += [dict(case, variant=v, overlap="serial", prefill_ms=0.0, prefill_ms_set="0", handshake="off",
                     codec="none", prefill="clock") for v in refs]  # references: the pool's bytes as they are
    if "paged" in names:
        out.append(dict(case, variant="paged"))
    return flows.expand(out, len(s.pairs)) if s.cells else out
