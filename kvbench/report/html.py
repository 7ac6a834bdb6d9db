"""The report page as one self-contained HTML file: inline CSS, plots embedded as base64 PNG."""
from __future__ import annotations

import base64
import html

import pandas as pd

from .page import LONG_ROWS, Page, Section, slug

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1500px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { border-bottom: 2px solid #345; padding-bottom: .2em; }
h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #eef2f6; }
td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafafa; }
caption { caption-side: top; text-align: left; font-style: italic; padding: 4px 0; }
figure { margin: 1em 0 2em; }
figcaption { font-style: italic; color: #444; }
img { max-width: 100%; border: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table.kv td, table.kv th { text-align: left; white-space: normal; max-width: 1100px; }
nav li { margin: 2px 0; }
p.note { font-style: italic; color: #555; font-size: 13px; margin: .2em 0; }
details > summary { cursor: pointer; font-style: italic; margin: .5em 0; }
"""


def _cell(v) -> str:
    return "-" if v is None or (isinstance(v, float) and pd.isna(v)) else html.escape(str(v))


def html_table(df: pd.DataFrame, caption: str = "", cls: str = "") -> str:
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r) + "</tr>" for r in df.itertuples(index=False))
    klass = f' class="{cls}"' if cls else ""
    return f'<div class="scroll"><table{klass}>{cap}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'


def _table(cap: str, t: pd.DataFrame, s: Section, csv: str) -> str:
    """A table; a long one below the summary collapsed, its summary line saying how many rows and where the CSV is."""
    if s.lead or len(t) <= LONG_ROWS:
        return html_table(t, cap)
    where = f"; every row also in {csv}" if csv else ""
    return (f"<details><summary>{html.escape(cap)}: {len(t)} rows (click to open{html.escape(where)})</summary>"
            f"{html_table(t, cap)}</details>")


def _section(s: Section, csv: str) -> list[str]:
    parts = [f'<h{s.level} id="{slug(s.title)}">{html.escape(s.title)}</h{s.level}>']
    parts += [f"<p>{html.escape(p)}</p>" for p in s.text]
    parts += [_table(cap, t, s, csv) for cap, t in s.tables]
    for cap, png in s.figures:
        b64 = base64.b64encode(png).decode("ascii")
        parts.append(f'<figure><img alt="{html.escape(cap)}" src="data:image/png;base64,{b64}">'
                     f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    parts += [f'<p class="note">{html.escape(n)}</p>' for n in s.notes]
    return parts


def to_html(page: Page, csv: str = "") -> str:
    """One file a browser opens offline: no external style, script or image. The lead section (the summary) comes
    first, then the machines, the contents and the rest; ``csv``: the name of the rows' CSV beside the page."""
    parts = [f"<h1>{html.escape(page.title)}</h1>"]
    sections = page.ordered()
    lead = [s for s in sections if s.lead]
    for s in lead:
        parts += _section(s, csv)
    for cap, t in page.head:
        parts.append(html_table(t, cap, "kv"))
    if page.sections:
        parts.append("<nav><ul>" + "".join(f'<li><a href="#{slug(s.title)}">{html.escape(s.title)}</a></li>'
                                            for s in sections if s.level == 2) + "</ul></nav>")
    for s in sections[len(lead):]:
        parts += _section(s, csv)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(page.title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
