"""kvbench's layout, read from the tree: wings, modules, imports; writes docs/layout.md and checks the layering.

`python tools/layout.py` rewrites docs/layout.md; `python tools/layout.py --check` (in `make lint`) exits 1 on an
import cycle anywhere in the repository (kvbench/, benchmarks/, tools/, tests/, setup.py), a Python file over 400
lines outside tests/, an import from a lower wing into a higher one, or a docs/layout.md that no longer matches the
tree.  tests/test_layout.py runs the same checks on kvbench/.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvbench"
DOC = ROOT / "docs" / "layout.md"

# Bottom first: a wing imports only wings on lower lines, or itself.  Wings on one line are peers and may not
# import each other.  "kvbench" is the package root: its __init__ and the C extensions.
WINGS: list[tuple[str, ...]] = [
    ("kvbench",),
    ("job",),
    ("fabric",),
    ("model",),
    ("memory",),
    ("transports",),
    ("codecs",),
    ("results",),
    ("report",),
    ("harness",),
    ("config",),
    ("selftest", "gpucheck"),
    ("lab",),
    ("cli",),
    ("__main__",),
]
LEVEL = {w: i for i, line in enumerate(WINGS) for w in line}
C_EXTENSIONS = ("_native", "_codec", "_mpicalls", "_keyed")
# third-party packages every kvbench process may import at once (a base dependency that loads quickly); any
# other (torch, pandas, matplotlib, mpi4py, pydantic, an engine...) is optional or slow, and a kvbench module
# that imports one at its top is the one kind another module may import inside a function
LIGHT = {"numpy", "yaml", "psutil", "__future__"}
# the C extensions: _mpicalls links the MPI library mpi4py loads (imported after MPI); _native and _codec are
# built by the install, and a command that needs no batched copy (list, size, help) must start without them
LAZY_C = {"kvbench._mpicalls", "kvbench._native", "kvbench._codec", "kvbench._keyed"}
# the repository's Python code, for the checks beyond kvbench's wings: no import cycle anywhere, and no file over
# MAX_LINES lines outside tests/
CODE = ("kvbench", "benchmarks", "tools", "tests", "setup.py")
MAX_LINES = 400


@dataclass
class Module:
    name: str  # dotted
    path: Path
    doc: str
    lines: int
    imports: list[tuple[str, int, bool]] = field(default_factory=list)  # (target module, line, at top level)
    heavy: set[str] = field(default_factory=set)  # optional or slow third-party packages imported at top level
    probes: set[int] = field(default_factory=set)  # lines of imports inside a try: whether they work is the point

    @property
    def wing(self) -> str:
        parts = self.name.split(".")
        if len(parts) == 1 or parts[1] in C_EXTENSIONS:
            return "kvbench"
        return parts[1]


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _find(name: str, dirs: list[Path]) -> str | None:
    """The repository module an absolute import of ``name`` loads, searching ``dirs`` in order, else None."""
    for d in dirs:
        p = d / name.replace(".", "/")
        for f in (p.with_suffix(".py"), p / "__init__.py"):
            if f.exists():
                return _name(f)
    return name if name.startswith("kvbench.") and name.split(".")[-1] in C_EXTENSIONS else None


def modules(code: tuple[str, ...] = ("kvbench",)) -> dict[str, Module]:
    """Every module under ``code`` (folders or files; kvbench's by default) with its imports of the repository's
    own modules, function-level ones included.  A script's folder (one without __init__.py: benchmarks/, tests/)
    is on its sys.path before the repository's root, as Python puts it there."""
    out = {}
    for path in sorted(p for c in code for p in ((ROOT / c).rglob("*.py") if (ROOT / c).is_dir() else [ROOT / c])):
        name = _name(path)
        dirs = [ROOT] if (path.parent / "__init__.py").exists() else [path.parent, ROOT]
        src = path.read_text()
        tree = ast.parse(src)
        doc = (ast.get_docstring(tree) or "").strip().split("\n\n")[0].replace("\n", " ")
        m = Module(name, path, doc, len(src.splitlines()))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top = {id(n) for n in tree.body}
        for t in ast.walk(tree):
            if isinstance(t, ast.Try):
                m.probes.update(n.lineno for b in t.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                for top_name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]):
                    root = top_name.split(".")[0]
                    if root not in LIGHT and root not in sys.stdlib_module_names and root != "kvbench":
                        m.heavy.add(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [_find(a.name, dirs) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                search = [ROOT] if node.level else dirs
                targets = [_find(f"{base}.{a.name}", search) or _find(base, search) for a in node.names]
            else:
                continue
            for t in dict.fromkeys(targets):
                if t:
                    m.imports.append((t, node.lineno, id(node) in top))
        out[name] = m
    return out


def _wing_of(name: str) -> str:
    parts = name.split(".")
    return "kvbench" if len(parts) == 1 or parts[1] in C_EXTENSIONS else parts[1]


def upward(mods: dict[str, Module]) -> list[str]:
    """Imports from a lower wing into a higher one (or between peers)."""
    bad = []
    for m in mods.values():
        for t, line, _ in m.imports:
            a, b = m.wing, _wing_of(t)
            if a != b and LEVEL[b] >= LEVEL[a]:
                bad.append(f"{m.path.relative_to(ROOT)}:{line}: {m.wing} imports {t} ({b} is not below {a})")
    return bad


def closure_heavy(mods: dict[str, Module]) -> dict[str, set[str]]:
    """Per module: the optional or slow packages that importing it loads, through its top-level imports."""
    memo: dict[str, set[str]] = {}

    def walk(n: str, seen: set[str]) -> set[str]:
        if n in memo:
            return memo[n]
        if n in LAZY_C:
            return {n}
        m = mods.get(n)
        if m is None or n in seen:
            return set()
        seen.add(n)
        out = set(m.heavy)
        for t, _, top in m.imports:
            if top:
                out |= walk(t, seen)
        memo[n] = out
        return out

    return {n: walk(n, set()) for n in mods}


def needless_lazy(mods: dict[str, Module]) -> list[str]:
    """Function-level kvbench imports of modules that load nothing optional or slow: they belong at the top."""
    heavy = closure_heavy(mods)
    return [f"{m.path.relative_to(ROOT)}:{line}: {t} imported inside a function, though it loads nothing optional"
            for m in mods.values() for t, line, top in m.imports
            if not top and line not in m.probes and not heavy.get(t) and t not in LAZY_C]


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Import cycles between modules (each strongly connected component of more than one module)."""
    graph = {n: sorted({t for t, _, _ in m.imports if t in mods and t != n}) for n, m in mods.items()}
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan; the graph is small, so recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def too_long(mods: dict[str, Module]) -> list[str]:
    """Python files over MAX_LINES lines outside tests/."""
    return [f"{m.path.relative_to(ROOT)}: {m.lines} lines, over {MAX_LINES}" for m in mods.values()
            if m.lines > MAX_LINES and m.path.relative_to(ROOT).parts[0] != "tests"]


def render(mods: dict[str, Module]) -> str:
    """docs/layout.md: the wings bottom first, each with its job and its modules."""
    out = ["# Code layout", "",
           "Generated by `python tools/layout.py` from the tree (a test fails when it is stale): do not edit by hand.",
           "",
           "kvbench is one package in wings. Each wing is a folder whose `__init__` says its one job and names its "
           "public API. **Wing order, bottom first** (a wing imports only wings above it in this list, never a later "
           "one; wings on one line are peers and import neither way); `tests/test_layout.py` fails on an import "
           "cycle or an import against this order, function-level imports included:", ""]
    for i, line in enumerate(WINGS):
        out.append(f"{i}. " + ", ".join(f"`{w}`" for w in line))
    out.append("")
    by_wing: dict[str, list[Module]] = {}
    for m in mods.values():
        by_wing.setdefault(m.wing, []).append(m)
    for line in WINGS:
        for w in line:
            ms = sorted(by_wing.get(w, []), key=lambda m: m.name)
            if not ms:
                continue
            head = next((m for m in ms if m.path.name == "__init__.py" and m.name.count(".") == 1), None)
            title = "kvbench/ (root)" if w == "kvbench" else f"kvbench/{w}/"
            out += [f"## {title}", ""]
            if head and head.doc and w != "kvbench":
                out += [head.doc, ""]
            out += ["| module | what it is for |", "| --- | --- |"]
            for m in ms:
                if m is head and w != "kvbench":
                    continue
                rel = m.path.relative_to(ROOT)
                out.append(f"| `{rel}` | {m.doc.replace('|', '/')} |")
            if w == "kvbench":
                for c in sorted(PKG.glob("*.c")):
                    out.append(f"| `{c.relative_to(ROOT)}` | {_c_doc(c)} |")
            out.append("")
    out += ["## Outside the package", "",
            "| folder | what it is for |", "| --- | --- |",
            "| `suites/` | YAML sweep definitions (axes are data, not code) |",
            "| `results/` | committed reference runs under `results/reference/<machine>/`; user runs land in "
            "`results/runs/` (ignored by git) |",
            "| `benchmarks/` | the `make bench-*` jobs and their plain library references (no kvbench code in a "
            "reference) |",
            "| `tests/` | unit, property, conformance, honesty, faults and lab tests (`make test`; the tests marked `alone` run last, by themselves) |",
            "| `tools/` | this generator and the layering check (`--check`, in `make lint`: also no import cycle "
            "anywhere in the repository and no Python file over 400 lines outside `tests/`) |",
            "| `docs/` | methodology, evidence and per-path notes |", ""]
    return "\n".join(out)


def _c_doc(path: Path) -> str:
    text = path.read_text()
    if text.startswith("/*"):
        return " ".join(text[2:text.index("*/")].split()).split(". ")[0].rstrip(".")
    return ""


def main(argv: list[str]) -> int:
    mods = modules()
    if "--check" in argv:
        code = modules(CODE)
        problems = upward(mods) + [" <-> ".join(c) for c in cycles(code)] + needless_lazy(mods) + too_long(code)
        if DOC.read_text() != render(mods):
            problems.append("docs/layout.md is stale: run python tools/layout.py")
        for p in problems:
            print(p)
        return 1 if problems else 0
    DOC.write_text(render(mods))
    print(f"wrote {DOC.relative_to(ROOT)} ({len(mods)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
