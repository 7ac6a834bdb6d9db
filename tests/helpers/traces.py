"""Request traces written for a test (the Mooncake trace's format: one JSON object a line)."""
from __future__ import annotations

import json

# five requests with shared prefixes (512-token blocks): 1 opens blocks 1,2; 2 shares them and adds 3; 3 is one
# partial block already cached (a full hit); 4 shares nothing; 5 shares 1,2 and adds 6
HAND = [(0, 1000, [1, 2]), (10, 1500, [1, 2, 3]), (20, 300, [1]), (30, 700, [4, 5]), (40, 1200, [1, 2, 6])]


def write_trace(path, reqs=HAND) -> str:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 8, "hash_ids": ids})
                            + "\n" for t, n, ids in reqs))
    return str(path)
