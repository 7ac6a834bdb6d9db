"""Synthetic result files with known link costs, for the readers' tests (fit, plan)."""
from __future__ import annotations

import json

import pandas as pd

from kvbench.model import shapes as M
from kvbench.results.store import ROW_COLUMNS, SCHEMA_VERSION

SWEEP = [(tokens, pp, blk) for tokens in (256, 1024) for pp in (1, 2) for blk in (0, 16, 32, 64, 128, 256)]


def case_rows(case, transport, tokens, pp, blk, seconds_of, model="llama-3-8b", iters=4):
    """Raw rows (2 ranks x iters + check pass) of one case; blk 0 = the bulk variant."""
    shape = M.shard(M.get_model(model), 1, pp)
    nbytes = M.bytes_per_token(shape, "fp16") * tokens
    n = shape.layers * (1 if blk == 0 else shape.regions * M.num_blocks(tokens, blk))
    t = seconds_of(shape.layers, n, nbytes)
    base = dict.fromkeys(ROW_COLUMNS, float("nan"))  # numeric columns stay float (NaN = not measured)
    base.update(case=case, variant="bulk" if blk == 0 else "paged", transport=transport, op="push", memory="host",
                model=model, tokens=tokens, prefix_hit=0, block_size=blk or 16, block_bytes=0, layout="layer-major",
                allocation="bulk" if blk == 0 else "random", coalesce="bulk" if blk == 0 else "off", dtype="fp16",
                codec="none", overlap="serial", scheme="pairwise", tp=1, pp=pp, world_size=2, inflight=1,
                handshake="off", prefill_ms_set="0.0", workload="none", layers=shape.layers, pages="4k", pair=0,
                req=0, payload_bytes=nbytes, wire_bytes=nbytes, descriptors=n, status="ok", reason="", prefill_s=0.0,
                completion="harness")
    rows = []
    for it in range(-1, iters):
        for rank in (0, 1):
            rows.append(dict(base, rank=rank, role="prefill" if rank == 0 else "decode", iter=it,
                             round=float("nan") if it < 0 else it % 2, seconds=float("nan") if it < 0 else t * (0.99 if rank else 1),
                             harness_seconds=0.0, nwrong=0 if it < 0 and rank == 1 else float("nan")))
    return rows


def write(path, seconds_of, transports=("tcp",), sweep=SWEEP, hostname="synth"):
    """A parquet + sidecar whose every case takes seconds_of(layers, descriptors, bytes)."""
    rows, case = [], 0
    for tr in transports:
        for tokens, pp, blk in sweep:
            case += 1
            rows += case_rows(case, tr, tokens, pp, blk, seconds_of)
    pd.DataFrame(rows, columns=ROW_COLUMNS).to_parquet(path, index=False)
    with open(str(path).replace(".parquet", ".meta.json"), "w") as fh:
        json.dump({"schema_version": SCHEMA_VERSION, "suite": {"name": "synth"}, "system": {"hostname": hostname}}, fh)
    return str(path)
