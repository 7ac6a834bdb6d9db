"""The README stays a page a newcomer reads, and no link in it or in docs/ points nowhere.

Relative links (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``) must name an existing file
and, with an anchor, a heading of that file under GitHub's slug rule (or an explicit ``<a id>``). http(s) links are not fetched.
"""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_LIMIT = 12_000
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """The lines outside fenced code blocks (a heading or link there is an example)."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation out, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*\*|\*)(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # emphasis markers (underscores stay, as on GitHub)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores, as GitHub does
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading's slug in a Markdown file, duplicates numbered -1, -2 ... as GitHub numbers them, and every
    explicit ``<a id="name">`` anchor."""
    seen: dict[str, int] = {}
    out = set()
    with open(path, encoding="utf-8") as f:
        for line in prose_lines(f.read()):
            out.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
            m = HEADING.match(line)
            if not m:
                continue
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: str):
    """(line number, target) for every link and image in a Markdown file's prose."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = CODE_SPAN.sub("", line)  # a link inside inline code is an example, not a link
        for m in (*LINK.finditer(line), *IMAGE.finditer(line)):
            yield no, m.group(1)


def test_slug_follows_githubs_rule():
    assert slug("Where the bytes are when an iteration starts: `--cache`") == \
        "where-the-bytes-are-when-an-iteration-starts---cache"
    assert slug("Exposed time: what the first token still waits for") == \
        "exposed-time-what-the-first-token-still-waits-for"
    assert slug("`make procurement`: from a sweep to a purchase decision") == \
        "make-procurement-from-a-sweep-to-a-purchase-decision"
    assert slug("KV formats and on-path codecs") == "kv-formats-and-on-path-codecs"
    assert slug("The link model (`kvbench fit`)") == "the-link-model-kvbench-fit"


def test_readme_is_at_most_12000_bytes():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    bad = []
    for no, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http(s), mailto: never fetched
            continue
        file, _, anchor = target.partition("#")
        dest = page if not file else os.path.normpath(os.path.join(os.path.dirname(page), file))
        where = f"{os.path.relpath(page, ROOT)}:{no}: {target}"
        if not os.path.exists(dest):
            bad.append(f"{where}: no such file")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{where}: no heading with that anchor in {os.path.relpath(dest, ROOT)}")
    assert not bad, "\n".join(bad)


def test_user_runs_land_outside_the_committed_references():
    """`kvbench run` writes to results/runs/ by default, which git ignores; the references stay apart."""
    from kvbench.cli.main import build_parser
    from kvbench.config.runconfig import DEFAULT_RESULTS

    # no -o given (None, so that -o with --resume can be told apart) means results/runs
    assert build_parser().parse_args(["run"]).results is None and DEFAULT_RESULTS == "results/runs"
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        assert "results/runs/" in f.read().split()
    assert glob.glob(os.path.join(ROOT, "results", "reference", "*", "*.parquet"))


def test_explicit_anchors_count_and_missing_ones_do_not(tmp_path):
    page = tmp_path / "p.md"
    page.write_text('<a id="page-align"></a>\n## Page-align every pool\n\n```\n<a id="in-code"></a>\n```\n')
    assert anchors(str(page)) == {"page-align", "page-align-every-pool"}


def test_the_schema_version_is_stated_once_and_is_the_codes():
    """docs/methodology.md states the version the results are written in; no other page names a current one."""
    from kvbench.results.schema import SCHEMA_VERSION

    text = open(os.path.join(ROOT, "docs", "methodology.md")).read()
    assert f"is tidy (schema version {SCHEMA_VERSION}: stated here only" in text
    for page in ("README.md", "docs/usage.md", "results/README.md"):
        assert not re.search(r"(schema version|writes version) \d", open(os.path.join(ROOT, page)).read()), page
