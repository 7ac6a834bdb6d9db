"""The probe lists (tests/probes/<category>.yaml): reading them, and turning one probe into a command line.

A list is a category, a sentence on what it probes, and its probes.  A probe is a command with placeholders
({mpiexec}, {kvbench}, {python}, {scratch}, {root}, {nines:N}, {gen:NAME}), the exit codes it may end with, a
regex its one ``kvbench:`` line must match (none: no line is required, but two are still a failure), a time
limit, extra environment, and ``xfail: reason`` for a known failure of kvbench's that is reported, not hidden.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
PROBES = ROOT / "tests" / "probes"
LIMIT_S = 30.0
KEYS = {"name", "run", "exit", "line", "limit", "env", "xfail"}
PRECIOUS = "precious: a planted link points here; it must not change\n"
PLACEHOLDER = re.compile(r"\{(\w+)(?::([\w^.-]+))?\}")


class ListError(ValueError):
    """A probe list that is not one: its file and what is wrong, one line."""


@dataclass
class Probe:
    category: str
    name: str
    run: str
    exit: tuple[int, ...]
    line: str | None = None  # a regex the one `kvbench:` line must match
    limit: float = LIMIT_S
    env: dict[str, str] = field(default_factory=dict)
    xfail: str | None = None
    prefix: str = "kvbench:"  # what the one line starts with (kvbench lab says "kvbench lab:")

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"


@dataclass
class ProbeList:
    category: str
    about: str
    probes: list[Probe]


def _codes(value, where: str) -> tuple[int, ...]:
    codes = value if isinstance(value, list) else [value]
    if not codes or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise ListError(f"{where}: exit must be an integer or a list of integers, not {value!r}")
    return tuple(codes)


def _probe(raw, category: str, defaults: dict, prefix: str, where: str) -> Probe:
    if not isinstance(raw, dict) or not {"name", "run"} <= raw.keys():
        raise ListError(f"{where}: a probe needs at least name and run")
    if unknown := sorted(raw.keys() - KEYS):
        raise ListError(f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(KEYS))})")
    merged = {**defaults, **raw}
    where = f"{where} ({raw['name']})"
    if "exit" not in merged:
        raise ListError(f"{where}: no exit code (give exit here or in the list's defaults)")
    line = merged.get("line")
    if line is not None:
        try:
            re.compile(line)
        except re.error as exc:
            raise ListError(f"{where}: line is not a regex: {exc}") from None
    limit = merged.get("limit", LIMIT_S)
    if not isinstance(limit, (int, float)) or not 0 < limit <= 600:
        raise ListError(f"{where}: limit must be seconds in (0, 600], not {limit!r}")
    env = {str(k): str(v) for k, v in (merged.get("env") or {}).items()}
    return Probe(category, str(raw["name"]), str(raw["run"]), _codes(merged["exit"], where), line, float(limit),
                 env, merged.get("xfail"), prefix)


def parse(text: str, source: str) -> ProbeList:
    """One probe list from its YAML text; ListError naming ``source`` when it is not one."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ListError(f"{source}: not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("category"), str) or not doc["category"]:
        raise ListError(f"{source}: no category (a list starts with `category: <name>`)")
    if not isinstance(doc.get("probes"), list) or not doc["probes"]:
        raise ListError(f"{source}: no probes")
    category, defaults = doc["category"], doc.get("defaults") or {}
    probes = [_probe(p, category, defaults, doc.get("prefix", "kvbench:"), f"{source}: probe {i + 1}")
              for i, p in enumerate(doc["probes"])]
    names = [p.name for p in probes]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ListError(f"{source}: probe names used twice: {', '.join(dup)}")
    return ProbeList(category, str(doc.get("about", "")), probes)


def load_all(folder: Path = PROBES, only: list[str] | None = None) -> list[ProbeList]:
    """Every list in ``folder`` (or those whose category is in ``only``), in file-name order."""
    lists = [parse(p.read_text(), str(p)) for p in sorted(folder.glob("*.yaml"))]
    if only:
        missing = sorted(set(only) - {pl.category for pl in lists})
        if missing:
            raise ListError(f"no probe list for {', '.join(missing)} in {folder} "
                            f"(there are: {', '.join(pl.category for pl in lists)})")
        lists = [pl for pl in lists if pl.category in only]
    return lists


# ----- the files a probe's command names, written into its scratch folder by the {gen:NAME} placeholder
GOOD_TRACE = {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}


def bomb(levels: int = 9) -> str:
    """A YAML alias bomb: ``levels`` lists of 9 aliases of the one below, 9^levels strings once expanded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _write(scratch: Path, name: str, text: str) -> str:
    (scratch / name).write_text(text)
    return str(scratch / name)


def _victim(scratch: Path) -> Path:
    """The file a planted link points at, outside the results folder: it must keep its content."""
    v = scratch / "elsewhere" / "precious.txt"
    v.parent.mkdir(exist_ok=True)
    v.write_text(PRECIOUS)
    return v


def _plant(link: Path, target: Path, scratch: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    with open(scratch / ".planted", "a") as fh:  # checked after the run: still links, their targets unchanged
        fh.write(f"{link}\t{target}\n")


def _machine_dir(scratch: Path, results: str) -> Path:
    from kvbench.results.store import machine_name

    return scratch / results / machine_name()


def _stale_links(scratch: Path) -> str:
    """A results folder holding, where a killed run's lock and half-written files would be, links to a file
    elsewhere: the start-of-run sweep must leave them (docs/reliability.md, "Files in a shared folder")."""
    d = _machine_dir(scratch, "res")
    for tail in (".lock", ".parquet.tmp", ".meta.json.tmp"):
        _plant(d / f"20200101-000000_x{tail}", _victim(scratch), scratch)
    return str(scratch / "res")


def _machine_link(scratch: Path) -> str:
    """A results folder whose <machine> folder is a link to a folder elsewhere; the results folder."""
    _plant(_machine_dir(scratch, "res"), _victim(scratch).parent, scratch)
    return str(scratch / "res")


def _folder_link(scratch: Path) -> str:
    """A results folder that is itself a link to an empty folder inside scratch; the link."""
    (scratch / "real").mkdir()
    os.symlink(scratch / "real", scratch / "res-link")
    return str(scratch / "res-link")


def _open_folder(scratch: Path) -> str:
    """A results folder anyone may write, without the sticky bit."""
    (scratch / "shared").mkdir()
    os.chmod(scratch / "shared", 0o777)
    return str(scratch / "shared")


def _export_link(scratch: Path) -> str:
    _plant(scratch / "rows.json", _victim(scratch), scratch)
    return str(scratch / "rows.json")


GENERATORS = {
    "trace64": lambda s: _write(s, "trace64.jsonl", json.dumps(GOOD_TRACE) + "\n"
                                + json.dumps(dict(GOOD_TRACE, input_length=2**64)) + "\n"),
    "trace-digits": lambda s: _write(s, "digits.jsonl", json.dumps(GOOD_TRACE) + "\n" + '{"timestamp": 1, '
                                     '"input_length": ' + "7" * 5000 + ', "output_length": 1, "hash_ids": []}\n'),
    "matrix1e999": lambda s: _write(s, "m.csv", "0,1e999\n1,0\n"),
    "bomb": lambda s: _write(s, "bomb.yaml", bomb() + "matrix: [[0, *a8], [1, 0]]\n"),
    "suitebomb": lambda s: _write(s, "suite.yaml", bomb() + "name: bomb\nscheme: matrix\nmatrix: [[0, *a8], [1, 0]]\n"),
    "nolayers": lambda s: _write(s, "model.yaml", "name: broken\nkv_heads: 8\nhead_dim: 128\n"),
    "stalelinks": _stale_links,
    "machinelink": _machine_link,
    "folderlink": _folder_link,
    "openfolder": _open_folder,
    "exportlink": _export_link,
}


def command(probe: Probe, scratch: Path, tools: dict[str, str]) -> list[str]:
    """The probe's argv, its placeholders filled in (``tools``: mpiexec, kvbench, python); a {gen:NAME} writes its
    file into ``scratch`` first.  KeyError names an unknown placeholder."""
    def fill(m: re.Match) -> str:
        key, arg = m.group(1), m.group(2)
        if key == "scratch":
            return shlex.quote(str(scratch))
        if key == "root":
            return shlex.quote(str(ROOT))
        if key == "nines":
            return "9" * int(arg)
        if key == "gen":
            return shlex.quote(GENERATORS[arg](scratch))
        return shlex.quote(tools[key])

    return shlex.split(PLACEHOLDER.sub(fill, probe.run))


def placeholders_known(probe: Probe) -> list[str]:
    """The placeholders of ``probe`` that ``command`` would not know (empty: all known)."""
    bad = []
    for key, arg in PLACEHOLDER.findall(probe.run):
        ok = (key in ("scratch", "root", "mpiexec", "kvbench", "python") or (key == "nines" and arg.isdigit())
              or (key == "gen" and arg in GENERATORS))
        if not ok:
            bad.append(f"{{{key}{':' + arg if arg else ''}}}")
    return bad
