"""The report's Fabric section draws per-NIC bars and per-flow isolated-against-congested bars, and only when a
run has what they show."""
import pandas as pd
import pytest

from kvbench.fabric import carriers as C
from kvbench.report import fabricplots as F

pytest.importorskip("matplotlib")


def test_nic_bytes_reads_the_timed_rows_counters_per_case_rank_and_nic():
    df = pd.DataFrame({"case": [1, 1, 1], "rank": [0, 0, 1], "iter": [0, -1, 0], "transport": "tcp",
                       "nic_bytes": [C.encode({"rail0": (100, 4), "rail1": (0, 0)}), "", C.encode({"lo": (7, 3)})]})
    got = F.nic_bytes(df).sort_values(["rank", "nic"]).reset_index(drop=True)
    assert got.to_dict("records") == [{"case": 1, "transport": "tcp", "rank": 0, "nic": "rail0", "bytes": 104},
                                      {"case": 1, "transport": "tcp", "rank": 1, "nic": "lo", "bytes": 10}]
    assert F.nic_bytes(df.drop(columns="nic_bytes")).empty  # older schemas: no counters, no bars


def test_bars_per_rail_and_per_flow_and_none_without_data():
    rails = pd.DataFrame({"run": "r", "case": [1, 1], "transport": "tcp", "op": "push", "nic": ["rail0", "rail1"],
                          "gbps": [0.11, 0.12]})
    flows = pd.DataFrame({"run": "r", "case": [4, 4], "transport": "tcp", "flow": ["0->2", "1->2"],
                          "isolated_gbps": [0.12, 0.12], "congested_gbps": [0.06, 0.061]})
    (cap, fig), = F.per_nic(rails, pd.DataFrame())
    assert "rail" in cap and len(fig.axes[0].patches) == 2
    (cap, fig), = F.flows(flows)
    assert "slowdown" in cap and len(fig.axes[0].patches) == 4  # alone and congested per flow
    assert list(F.per_nic(pd.DataFrame(), pd.DataFrame())) == [] and list(F.flows(pd.DataFrame())) == []
