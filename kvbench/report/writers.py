"""The page's writers: Markdown (with its plots as PNG files), the self-contained HTML (html.py) and the CSV."""
from __future__ import annotations

import os
import re

import pandas as pd

from kvbench.job import folder, safefile

from .html import to_html
from .page import LONG_ROWS, Page, slug


def md_table(df: pd.DataFrame) -> str:
    """A GitHub Markdown table (cells as strings; '|' escaped)."""
    def cell(v) -> str:
        return "-" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v).replace("|", "\\|")

    head = "| " + " | ".join(map(cell, df.columns)) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    rows = ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join([head, rule, *rows])


def to_markdown(page: Page, img_dir: str, img_prefix: str = "plots", csv: str = "") -> str:
    """The page as Markdown; figures are written as PNG files under ``img_dir`` and linked. The lead section (the
    summary) comes first; a long table below it is collapsed, with a link to ``csv`` (the rows' CSV) when named."""
    folder.ensure(img_dir)  # another user's, or open to all: refused (job/folder.py)
    for old in os.listdir(img_dir):  # a report written here before: its numbered plots would linger unlinked
        if re.fullmatch(r"fig\d{2,}-[a-z0-9-]*\.png", old):
            safefile.remove(os.path.join(img_dir, old))  # a link under the name: refused, left as it is
    out = [f"# {page.title}", ""]
    sections = page.ordered()
    lead = [s for s in sections if s.lead]
    used: set[str] = set()
    for s in [*lead, None, *sections[len(lead):]]:
        if s is None:  # after the summary: the machines
            for cap, t in page.head:
                out += [f"**{cap}**", "", md_table(t), ""]
            continue
        out += ["#" * s.level + " " + s.title, ""]
        for para in s.text:
            out += [para, ""]
        for cap, t in s.tables:
            if s.lead or len(t) <= LONG_ROWS:
                out += [f"*{cap}*", "", md_table(t), ""]
            else:
                where = f"; every row also in [{csv}]({csv})" if csv else ""  # a link inside <details> is not one
                out += [f"*{cap}*: {len(t)} rows{where}", "", "<details><summary>the table</summary>", "",
                        md_table(t), "", "</details>", ""]
        for cap, png in s.figures:
            name = f"fig{len(used) + 1:02d}-{slug(f'{s.title}-{cap}')[:60]}"  # numbered: names stay unique
            used.add(name)
            safefile.write_whole(os.path.join(img_dir, name + ".png"), lambda fh, png=png: fh.write(png))
            out += [f"![{cap}]({img_prefix}/{name}.png)", "", f"*{cap}*", ""]
        for note in s.notes:
            out += [f"*{note}*", ""]
    return "\n".join(out)


def write(page: Page, out_dir: str, stem: str = "report") -> list[str]:
    """Writes <stem>.md (+ plots/), <stem>.html (self-contained) and <stem>.csv (+ <stem>_<name>.csv), each whole
    and never through a link (job/safefile.py: a link or another user's file under a name is refused in one line,
    as is a folder another user owns or anyone may write: job/folder.py)."""

    folder.ensure(out_dir, "plots")
    paths = []
    md = os.path.join(out_dir, f"{stem}.md")
    html = os.path.join(out_dir, f"{stem}.html")
    for p in (md, html):  # before any file is written: a refusal leaves the folder as it was
        safefile.check(p)
    text = to_markdown(page, os.path.join(out_dir, "plots"), csv=f"{stem}.csv")
    safefile.write_whole(md, lambda fh: fh.write(text.encode()))
    page_html = to_html(page, csv=f"{stem}.csv")
    safefile.write_whole(html, lambda fh: fh.write(page_html.encode()))
    paths += [md, html]
    for name, rows in page.data.items():
        p = os.path.join(out_dir, f"{stem}.csv" if not name else f"{stem}_{slug(name)}.csv")
        safefile.write_whole(p, lambda fh, rows=rows: fh.write(rows.to_csv(index=False).encode()))
        paths.append(p)
    return paths
