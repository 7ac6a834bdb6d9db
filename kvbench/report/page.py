"""The report page as data: a head (the machines), then sections of text, tables and figures.

Anything that builds a section (this package's builders, the link model, the planner) calls
``Page.add_section``; the renderers (Markdown here, HTML in html.py, CSV) read only the page.
"""
from __future__ import annotations

import io
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
    notes: list[str] = field(default_factory=list)  # after the figures: plots not drawn, and why
    level: int = 2
    lead: bool = False  # the page's first screen (the summary): rendered before the machines and the contents

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
        for cap, f in figures:  # a figure of None is a plot not drawn: its caption says why, after the figures
            if f is None:
                s.notes.append(cap)
            else:
                s.add_figure(cap, f)
        self.sections.append(s)
        return s

    def ordered(self) -> list[Section]:
        """The sections as rendered: the lead ones (the summary) first, then the rest in the order added."""
        return [s for s in self.sections if s.lead] + [s for s in self.sections if not s.lead]

    def add_data(self, name: str, rows: pd.DataFrame) -> None:
        """Rows written as CSV beside the page ('' = report.csv)."""
        self.data[name] = pd.concat([self.data[name], rows], ignore_index=True) if name in self.data else rows


LONG_ROWS = 20  # a table longer than this is collapsed (HTML <details>; Markdown too) below the summary


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"
