"""The page's purchase-verdict table: the plan's verdicts (verdicts.py) for the paths one result file measured, asked as
`make procurement` asks them, one row per candidate path and one column per model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from .verdicts import IN_PROCESS, PROCUREMENT, WORDS, Verdict, verdicts

if TYPE_CHECKING:
    from .plan import Fabric

def _cell(v: Verdict) -> str:
    """A verdict in one cell: the word, the net gain of the deciding prompt against what disaggregation saves, and
    the deciding reason when it is the fabric's load or the TTFT budget (the plan's numbers, shortened)."""
    w = v.worst
    pct = "" if w["pct"] == "all" else f" {w['pct']}"
    cell = f"{v.word.upper()} {_ms(w['net_ms'], '+')}/{_ms(w['saved_ms'])} ms{pct}"
    lead = v.why.split("; ")[0]
    if "busy" in lead:
        return f"{cell}, link {lead.rsplit('the fabric ', 1)[-1]}"
    return f"{cell}, {lead.split(' at ')[0]}" if lead.startswith("TTFT") else cell


def _ms(x: float, sign: str = "") -> str:
    return format(x, f"{sign}.0f" if abs(x) >= 100 else f"{sign}.1f")


def page_verdicts(path: str, models: list[str], dtypes: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """The plan's verdicts for the measured paths of one result file, asked as `make procurement` asks them: one row
    per candidate path, one column per model (its worst dtype), and the lines to say beside them (in-process paths
    left out as references, a file the plan cannot read)."""
    from pydantic import ValidationError

    from .plan import PlanInput, measured_fabrics, one_line

    try:
        inp = PlanInput(models=models, dtypes=dtypes, fabrics=[path], **PROCUREMENT)
        found = verdicts(inp, measured_fabrics(path, inp.block_size))
    except ValidationError as exc:
        return pd.DataFrame(), [f"No purchase verdict: {one_line(exc)}."]
    except ValueError as exc:
        return pd.DataFrame(), [f"No purchase verdict: {exc}."]
    cand = [v for v in found if v.fabric.name.split()[0] not in IN_PROCESS]
    refs = sorted({v.fabric.name.split(" (")[0] for v in found if v not in cand})
    notes = [f"No verdict for {', '.join(refs)}: an in-process copy (the reference, not a candidate)."] if refs else []
    table: dict[str, dict] = {}
    for v in cand:
        row = table.setdefault(v.fabric.name, {"path": v.fabric.name.split(" (")[0], "plan GB/s": _rate(v.fabric)})
        prev = row.get(v.model)
        if prev is None or WORDS.index(v.word) < WORDS.index(prev.word):
            row[v.model] = v  # a model's cell: its worst dtype
    out = pd.DataFrame([{k: (x if isinstance(x, str) else _cell(x)) for k, x in r.items()} for r in table.values()])
    return out, notes


def _rate(fab: Fabric) -> str:
    """The rate behind the verdicts, and where it came from, in a few words."""
    how = "link model" if fab.fit is not None else fab.source.split("; NOT OK")[0].split(": ")[-1].split(" in ")[0]
    return f"{fab.gbps:.2f} ({how.removeprefix('median GB/s of ').replace('-token paged rows', '-tok median')})"
