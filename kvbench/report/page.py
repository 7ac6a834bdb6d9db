"""The report page as data: a head (the machines), then sections of text, tables and figures.

Anything that builds a section (this package's builders, the link model, the planner) calls
``Page.add_section``; the renderers (Markdown here, HTML in html.py, CSV) read only the page.
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field

import pandas as pd


def png_of(fig) -> bytes:
    """A matplotlib figure as PNG bytes (closed afterwards: a report makes many)."""
    from .plots import _plt

    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


@dataclass
class Section:
    """A titled part of the page: paragraphs, captioned tables (already in display units), captioned figures."""

    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[tuple[str, bytes]] = field(default_factory=list)
    level: int = 2

    def add_text(self, para: str) -> Section:
        self.text.append(para)
        return self

    def add_table(self, caption: str, table: pd.DataFrame) -> Section:
        self.tables.append((caption, table))
        return self

    def add_figure(self, caption: str, fig) -> Section:
        """``fig``: a matplotlib Figure or PNG bytes."""
        self.figures.append((caption, fig if isinstance(fig, bytes) else png_of(fig)))
        return self


@dataclass
class Page:
    title: str
    head: list[tuple[str, pd.DataFrame]] = field(default_factory=list)  # per machine: a two-column table
    sections: list[Section] = field(default_factory=list)
    data: dict[str, pd.DataFrame] = field(default_factory=dict)  # name -> rows for CSV (report.csv, report_<name>.csv)

    def add_section(self, title: str, text: str | list[str] = (), tables=(), figures=(), level: int = 2) -> Section:
        """Append a section; ``tables``: (caption, DataFrame) pairs; ``figures``: (caption, Figure or PNG) pairs."""
        s = Section(title, [text] if isinstance(text, str) else list(text), level=level)
        for cap, t in tables:
            s.add_table(cap, t)
        for cap, f in figures:
            s.add_figure(cap, f)
        self.sections.append(s)
        return s

    def add_data(self, name: str, rows: pd.DataFrame) -> None:
        """Rows written as CSV beside the page ('' = report.csv)."""
        self.data[name] = pd.concat([self.data[name], rows], ignore_index=True) if name in self.data else rows


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def md_table(df: pd.DataFrame) -> str:
    """A GitHub Markdown table (cells as strings; '|' escaped)."""
    def cell(v) -> str:
        return "-" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v).replace("|", "\\|")

    head = "| " + " | ".join(map(cell, df.columns)) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    rows = ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join([head, rule, *rows])


def to_markdown(page: Page, img_dir: str, img_prefix: str = "plots") -> str:
    """The page as Markdown; figures are written as PNG files under ``img_dir`` and linked."""
    os.makedirs(img_dir, exist_ok=True)
    for old in os.listdir(img_dir):  # a report written here before: its numbered plots would linger unlinked
        if re.fullmatch(r"fig\d{2,}-[a-z0-9-]*\.png", old):
            os.remove(os.path.join(img_dir, old))
    out = [f"# {page.title}", ""]
    for cap, t in page.head:
        out += [f"**{cap}**", "", md_table(t), ""]
    used: set[str] = set()
    for s in page.sections:
        out += ["#" * s.level + " " + s.title, ""]
        for para in s.text:
            out += [para, ""]
        for cap, t in s.tables:
            out += [f"*{cap}*", "", md_table(t), ""]
        for cap, png in s.figures:
            name = f"fig{len(used) + 1:02d}-{slug(f'{s.title}-{cap}')[:60]}"  # numbered: names stay unique
            used.add(name)
            with open(os.path.join(img_dir, name + ".png"), "wb") as fh:
                fh.write(png)
            out += [f"![{cap}]({img_prefix}/{name}.png)", "", f"*{cap}*", ""]
    return "\n".join(out)


def write(page: Page, out_dir: str, stem: str = "report") -> list[str]:
    """Writes <stem>.md (+ plots/), <stem>.html (self-contained) and <stem>.csv (+ <stem>_<name>.csv)."""
    from .html import to_html

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as fh:
        fh.write(to_markdown(page, os.path.join(out_dir, "plots")))
    html = os.path.join(out_dir, f"{stem}.html")
    with open(html, "w") as fh:
        fh.write(to_html(page))
    paths += [md, html]
    for name, rows in page.data.items():
        p = os.path.join(out_dir, f"{stem}.csv" if not name else f"{stem}_{slug(name)}.csv")
        rows.to_csv(p, index=False)
        paths.append(p)
    return paths
