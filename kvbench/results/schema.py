"""The row schema, versioned: every column of a result row, what each holds, and the defaults an older
schema's rows read with (store.upgrade).  numpy only, so that every rank can build rows without pandas."""
from __future__ import annotations

import numpy as np

from kvbench.fabric.carriers import COLUMNS as CARRIER_DEFAULTS

SCHEMA_VERSION = 11  # 2: pages, skew_s, clock_err_s, clock_offset_s, completion (1 reads as 2 with those empty: upgrade())
# 3: the codec columns below (2 reads as 3 with them empty), the GPU columns (at their defaults) and the
# time outside the wire (post_s, lib_s, notify_s, wake_s; empty); 4: cache (3 reads as 4 with "as-is"); 5: the
# blocks marked "schema 5" below (1-4 read with them at their defaults); 6: the setup rows (schema 6 below);
# 7: --register (schema 7 below; 1-6 read as "once"), carriers and the fabric columns (schema 7 below);
# 8: wire_counted_bytes (schema 8 below; 1-7 read with it empty); 9: carrier_proto, carrier_evidence (schema 9
# below; 1-8 read with them empty); 10: head_layout, and tp as 'P:D' at --tp P:D (schema 10 below; 1-9 read with
# head_layout empty, their tp one number); 11: wake_p99_s (schema 11 below; 1-10 read with it empty)
READS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)  # schema versions the readers (report, compare) upgrade to this one
RESUMES = (3, 4, 5, 6, 7, 8, 9, 10, 11)  # those --resume continues (a schema-3 suite and cases are this one's, but for cache)

CASE_COLUMNS = ["case", "variant", "transport", "op", "memory", "model", "tokens", "prefix_hit", "block_size",
                "block_bytes", "layout", "allocation", "coalesce", "dtype", "codec", "overlap", "scheme", "tp",
                "pp", "world_size", "inflight"]
CASE_COLUMNS += ["handshake", "prefill_ms_set", "workload", "layers", "pages"]
CASE_COLUMNS += ["scales", "fill"]  # v3: fp8 scale planes (formats.py); pool contents (memory/values.py)
CASE_COLUMNS += ["cache"]  # v4: where a request's bytes were when its iteration started (cachestate.py)
CASE_COLUMNS += ["flow_mode"]  # v7: a matrix's flow alone or all flows at once (harness/flows.py)
# per row: seconds = until this rank's part of the request was complete, from the iteration's start
# (the barrier, or the request's arrival under a workload); prefill_s = the prefill clock's P;
# handshake_s = allocate-then-stream round trip; exposed_s = decode's completion - prefill end;
# queue_s = wait for decode blocks (back-pressure); arrival_s = arrival time since the workload began
ROW_COLUMNS = CASE_COLUMNS + ["rank", "role", "pair", "req", "iter", "round", "seconds", "harness_seconds", "payload_bytes",
                              "wire_bytes", "descriptors", "status", "reason", "nwrong", "prefill_s", "handshake_s",
                              "exposed_s", "queue_s", "arrival_s", "skew_s", "clock_err_s", "clock_offset_s", "completion"]
# --- v3, codecs (kvbench/codecs/path.py): per row and iteration, this rank's seconds encoding (source) or decoding and
# scattering (destination) the request's layers; codec_max_abs_err / codec_max_rel_err: on a lossy codec's check
# row, the largest errors (nwrong counts the elements outside its stated tolerance, docs/codecs.md)
ROW_COLUMNS += ["codec_encode_s", "codec_decode_s", "codec_max_abs_err", "codec_max_rel_err"]
# skew_s: a destination's barrier exit minus its source's, on one clock (its seconds and exposed_s include it);
# clock_err_s: the bound on that correction (half the best ping-pong); clock_offset_s: the destination's clock minus
# its source's; completion: "transport" where the transport offered a landing stamp of its own (receive or progress
# thread: a diagnostic, the headline is the harness's own time) or "harness"
# (the moment its wait or notification returned)
# --- v3, device memory: copy = the copy engine of device bytes (copy.py; "batch" for host rows, where it is unused);
# gather_s / wire_s / scatter_s = seconds this rank spent in each stage of the staged transport in this iteration
# (device -> bounce, the inner transport, bounce -> device; NaN for every other transport)
GPU_DEFAULTS = {"copy": "batch", "gather_s": np.nan, "wire_s": np.nan, "scatter_s": np.nan}
CASE_COLUMNS += ["copy"]
# prefill = how the prefill was made: "clock" (a timer of prefill_ms) or "real" (each layer's matmuls where the
# pools live, prefill.py); with "real", prefill_s is the prefill's measured seconds on the source that iteration
GPU_DEFAULTS["prefill"] = "clock"
CASE_COLUMNS += ["prefill"]
ROW_COLUMNS += ["prefill"]
ROW_COLUMNS += ["copy", "gather_s", "wire_s", "scatter_s"]

# --- schema 3, time outside the wire (costs.py; v2 rows read with them empty) ---------------------------
# post_s: this rank's seconds in the transport's prepare/post/start/serve/signal calls in the iteration;
# lib_s: the part of post_s inside the library call that moves or queues the bytes; notify_s: its seconds in the harness's own notifications; wake_s: this request's gap from the transport's
# landing stamp to the harness's wait returning (empty where the harness stamps the landing)
ROW_COLUMNS += ["post_s", "lib_s", "notify_s", "wake_s"]
# --- schema 4: cache_bytes = bytes of this request's ranges this rank read (--cache warm) or flushed from the
# CPU caches (cold) before the iteration's barrier; 0 under as-is (v3 rows read with it empty)
ROW_COLUMNS += ["cache_bytes"]
# --- schema 5, placement (harness/placing.py): gpu = this rank's GPU ordinal in a cuda row (-1: not a cuda row,
# or an older schema); nic = the RDMA device nearest that GPU by PCIe affinity, in a network transport's cuda row
# ("" where none); same_gpu = the row's pair used one GPU (its rows measure HBM copies, not a link)
PLACEMENT_DEFAULTS = {"gpu": -1, "nic": "", "same_gpu": False}
ROW_COLUMNS += ["gpu", "nic", "same_gpu"]
# --- schema 5, samples (results/samples.py): ci_stop = why the case's timed iterations ended: "fixed" (-n
# iterations, no --target-ci; older rows read so), "target" (its p50's 95% interval came within --target-ci) or
# "budget" (--ci-budget ran out first); ci_target_pct = that target, % of the p50 (empty without one)
SAMPLES_DEFAULTS = {"ci_stop": "fixed", "ci_target_pct": np.nan}
ROW_COLUMNS += list(SAMPLES_DEFAULTS)
# --- schema 5, bounds (results/bounds.py; rows of 1-4 read with them empty) --------------------------------
# stamp_lead_s: how long this request's wait ran past the later of the transport's landing stamp and the wait's
# start (empty where the harness stamps); wake_bound_s: the most it may, a thread wake-up on this rank measured at
# its transport's setup (inf where the transport does not stamp, empty where ranks outnumber CPUs); bound_gbps / bound_kind: on a destination's rows, the GB/s the request's path can carry,
# and what bounds it ("memory copy": the harness's own copy of the same descriptors in this run; "link IF" or
# "links ...": the NIC rates across hosts; "none (...)": no bound, and why); window_s: on a destination that posts
# the request itself (a pull's reads), seconds from its first post to the landing
ROW_COLUMNS += ["stamp_lead_s", "wake_bound_s", "bound_gbps", "bound_kind", "window_s"]
# --- schema 11: wake_p99_s, the p99 of the wake-ups behind wake_bound_s (the later of its setup's and those after
# the case): a landing stamp's lead within it is one of them (results/bounds.py; rows of 1-10 read with it empty)
ROW_COLUMNS += ["wake_p99_s"]
# --- schema 6, setup rows (harness/setup.py; rows of 1-5 read as transfers): row_kind = "transfer" (a timed
# iteration or a check pass) or "setup" (iter -2: one phase of a transport's setup on this rank, its seconds in
# `seconds`); phase = "" on a transfer row, else alloc, fill, register (per pool), exchange, connect (per peer),
# first (a case's first transfer, per request: case, pair and req are its), pool-register / pool-deregister
# (--pool-sizes); their status is "setup" (a reader of the "ok" rows reads transfers alone); peer = the peer of a connect row (-1 elsewhere); region_bytes = the pool's bytes of an alloc,
# fill, register or pool row (empty elsewhere); a pool-register row of a transport that registers nothing has
# status "none", no seconds, and the reason
SETUP_DEFAULTS = {"row_kind": "transfer", "phase": "", "peer": -1, "region_bytes": np.nan}
ROW_COLUMNS += list(SETUP_DEFAULTS)
# --- schema 7, --register (harness/schedule.py): register = "once" (the pool at setup; older rows read so) or
# "per-request" (the initiator registers each request's local blocks inside the timed request, before its first
# post, and deregisters them after its last landing); register_s / deregister_s = on the initiator's rows of a
# per-request case, this request's seconds registering (inside `seconds`) and deregistering (after the landing,
# outside `seconds`); empty elsewhere
REGISTER_DEFAULTS = {"register": "once", "register_s": np.nan, "deregister_s": np.nan}
CASE_COLUMNS += ["register"]
ROW_COLUMNS += ["register", "register_s", "deregister_s"]
ROW_COLUMNS += list(CARRIER_DEFAULTS)  # schema 7: a timed row's NICs and carrier (fabric/carriers.py; 1-6 read empty)
# --- schema 7, fabric (rows of 1-6 read with these defaults; docs/fabric.md says what each holds): per rail of a
# striping transport its NIC, the request's bytes and descriptors, and the kernel's count per iteration
# (harness/railrows.py); per flow of a traffic matrix alone or with all flows (flow_mode), its p50 seconds alone and
# together, slowdown, fairness over the flows and GB/s into its receiver (harness/flows.py)
FABRIC_DEFAULTS = {"rails": 0, "rail_nics": "", "rail_bytes": "", "rail_descs": "", "rail_wire_bytes": "",
                   "flow_mode": "", "flow": "", "isolated_s": np.nan, "congested_s": np.nan, "slowdown": np.nan,
                   "fairness": np.nan, "receiver_gbps": np.nan}
ROW_COLUMNS += [c for c in FABRIC_DEFAULTS if c not in ROW_COLUMNS]  # flow_mode is a case column
# --- schema 8, the wire's own count (harness/wirerows.py; rows of 1-7 read with it empty): wire_counted_bytes = on a
# timed row of a transport that counts its connections' bytes (tcp: the kernel's tcp_info), this request's share of
# what its connection to the peer carried in that iteration (sent, on the source's row; received, on the
# destination's); NaN where nothing was counted (every other transport, check-pass and setup rows).  wire_bytes stays
# the computed payload + control-plane bytes (a codec's frames), which the socket never sees all of
WIRE_DEFAULTS = {"wire_counted_bytes": np.nan}
ROW_COLUMNS += list(WIRE_DEFAULTS)
# --- schema 9, the path that carried the bytes (harness/pathcheck.py, fabric/proto.py; rows of 1-8 read with them
# empty): carrier_proto = on every row of a measured case, what this rank's engine chose, in a short name of its own
# words checked against this process's own TCP connections ("ucx:sysv/cma", "nixl/ucx:tcp", "mpich:shm", "tcp:lo",
# "shm", "memcpy", "mooncake:tcp", "cuda_ipc:nvlink", "verbs:mlx5_0"), "-" where nobody can tell;
# carrier_evidence = what says so, or why "-" (the engine's raw words are the sidecar's carrier_raw).  Whether that
# is the path the case was meant to measure is the footer's FALLBACK (the sidecar's paths), not a row's status
PROTO_DEFAULTS = {"carrier_proto": "", "carrier_evidence": ""}
ROW_COLUMNS += list(PROTO_DEFAULTS)
# --- schema 10, prefill TP : decode TP (harness/tprequests.py, docs/layouts.md; rows of 1-9 read with it empty):
# tp = one number (both sides, as ever) or 'P:D' (prefill TP : decode TP: ranks 0..P-1 prefill, P..P+D-1 decode, a
# pair per piece of the TP map); head_layout = NHD or HND, the heads' order in a block, at P:D ("" at one degree)
TP_DEFAULTS = {"head_layout": ""}
CASE_COLUMNS += list(TP_DEFAULTS)
ROW_COLUMNS += list(TP_DEFAULTS)
CARRIER_DEFAULTS = {**CARRIER_DEFAULTS, **PROTO_DEFAULTS, **TP_DEFAULTS}  # store.upgrade's: an older row reads them empty
