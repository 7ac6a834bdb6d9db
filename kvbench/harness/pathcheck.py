"""The path that really carried the bytes (issue 44): on every rank, each case's ``carrier_proto`` from its
engine's words and this process's own TCP connections (fabric/proto.py, fabric/procsock.py); on rank 0, the
path each case is meant to measure (fabric/expect.py, ``--expect``), printed in the preamble, and the footer's
FALLBACK lines for rows that took another.

A mixin of the harness beside ``Carrying``: ``sock_mark``/``sock_take`` bracket a case's timed iterations as
the NIC counters do; ``proto_columns`` gives a case's rows their two columns.
"""
from __future__ import annotations

import re

from kvbench.fabric import carriers as C
from kvbench.fabric import expect as X
from kvbench.fabric import procsock
from kvbench.fabric import proto as P
from kvbench.job import status as ST
from kvbench.model.schemes import make_pairs

DEFAULTS = {"carrier_proto": P.UNKNOWN, "carrier_evidence": "no transfer was measured in this row"}


class Protocols:
    """Per case on this rank: its sockets' bytes over the timed iterations and the engine's words."""

    proto_raw: dict = {}  # case number -> this rank's engine words, until its rows go to rank 0 (rows.deliver)

    def sock_mark(self, m) -> None:
        """Before a case's timed iterations: this process's TCP connections' counts."""
        m.sock_before = procsock.sample()

    def sock_take(self, m) -> None:
        """After them: add what this process's connections moved since ``sock_mark`` to ``m.sockets`` (a case
        measured in rounds adds each round's; its engine rails are read from them too, railrows.columns)."""
        if m.sock_before is not None:
            m.sockets = C.add(m.sockets, procsock.delta(m.sock_before, procsock.sample()))
            m.sock_before = None

    def proto_columns(self, m, s) -> dict:
        """A case's carrier_proto and carrier_evidence on this rank (every row of the case carries them)."""
        n = len(m.rec)
        sent = n * sum(e.payload for e in m.entries if e.src == self.rank)
        received = n * sum(e.payload for e in m.entries if e.dst == self.rank)
        peers = {e.dst if e.src == self.rank else e.src for e in m.entries if self.rank in (e.src, e.dst)}
        same = all(self.places[p] == self.places[self.rank] for p in peers)
        try:
            info = s.t.info()
        except Exception as exc:  # a transport whose info fails has nothing to say, its rows say why
            info = {"error": str(exc)}
        c = P.carried(m.case["transport"], info, self.run_id, self.rank, same, m.sockets, sent, received)
        self.proto_raw = {**self.proto_raw, m.no: {"proto": c.proto, "evidence": c.evidence, **c.raw}}
        return {"carrier_proto": c.proto, "carrier_evidence": c.evidence[:300]}

    fallbacks: list = []  # rank 0, after judge_paths: the footer's FALLBACK lines (without their "# ")

    def path_lines(self, cfg) -> list[str]:
        """Rank 0's preamble: the path each transport is meant to measure."""
        return preamble(cfg, self.places)

    def judge_paths(self, df, cfg) -> list[str]:
        """Rank 0's footer: the FALLBACK lines over the result set's rows (kept in ``fallbacks``; the sidecar's
        paths, fallbacks and carrier_raw go with the harness's extra_meta)."""
        self.fallbacks, paths = judge(df, cfg, self.places)
        self.extra_meta = dict(getattr(self, "extra_meta", {}), paths=paths, fallbacks=self.fallbacks, expect=cfg.expect)
        return self.fallbacks

    def status_reason(self, status: str) -> str:
        """The sidecar's reason for ``status``: a FALLBACK's first line, else the status's meaning."""
        return self.fallbacks[0] if status == "FALLBACK" and self.fallbacks else ST.STATUSES[status][1]

    def take_raw(self) -> dict:
        """This rank's engine words gathered since the last call (rows.deliver sends them with the rows)."""
        raw, self.proto_raw = self.proto_raw, {}
        return raw


def _same_host(rank: int, hosts: list[str], pairs) -> bool:
    peers = {d if s == rank else s for s, d in pairs if rank in (s, d)}
    return all(hosts[p] == hosts[rank] for p in peers)


def preamble(cfg, hosts: list[str]) -> list[str]:
    """Rank 0: the path each transport and memory kind is meant to measure, one line."""
    pairs = make_pairs(cfg.suite.scheme, len(hosts), cfg.suite.matrix) if len(hosts) > 1 else []
    one = all(_same_host(r, hosts, pairs) for r in range(len(hosts)))
    parts = {}
    for c in cfg.cases:
        key = (c["transport"], c.get("memory", "host"))
        if key not in parts:
            got, why = X.expected(key[0], key[1], one, cfg.transport_options.get(key[0], {}), cfg.expect)
            parts[key] = f"{key[0]}/{key[1]}={got} ({why})" if got != "any" else f"{key[0]}/{key[1]}=any"
    verdict = "no verdict, the column stays" if cfg.expect == "any" else "a row carried by another path is FALLBACK"
    return [f"# path expected (--expect {cfg.expect}; {verdict}): {'; '.join(parts.values())}"]


def spans(xs: set) -> str:
    """{1, 2, 3, 7} -> '1-3,7'."""
    out, run = [], []
    for x in sorted(xs):
        if run and x != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(x)
    return ",".join(out + [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0])])


def judge(df, cfg, hosts: list[str]) -> tuple[list[str], dict]:
    """Rank 0, the footer: (one FALLBACK line per transport, case span, expected and carrier; the sidecar's
    {case: {rank: {expected, carried, class, evidence, verdict}}}) over the timed rows."""
    if df is None or "carrier_proto" not in df:
        return [], {}
    pairs = make_pairs(cfg.suite.scheme, len(hosts), cfg.suite.matrix) if len(hosts) > 1 else []
    d = df[(df["iter"] >= 0) & (df["status"] == "ok")]
    side: dict = {}
    bad: dict = {}
    rails_bad: dict = {}
    for (case, rank), g in d.groupby(["case", "rank"]):
        r = g.iloc[0]
        carried = str(r["carrier_proto"] or P.UNKNOWN)
        same = _same_host(int(rank), hosts, pairs) if pairs else True
        want, why = X.expected(r["transport"], r.get("memory", "host"), same,
                               cfg.transport_options.get(r["transport"], {}), cfg.expect)
        cls = P.klass(carried)
        word = "FALLBACK" if X.fallback(want, cls) else ("-" if want == "any" or not cls else "OK")
        side.setdefault(str(int(case)), {})[str(int(rank))] = {
            "expected": want, "why": why, "carried": carried, "class": cls, "evidence": str(r["carrier_evidence"]),
            "verdict": word}
        if word == "FALLBACK":  # one line per transport, path expected and carrier (byte counts differ per case)
            over = re.search(r"over ([\w.,:-]+)", str(r["carrier_evidence"]))
            key = (r["transport"], want, why, carried, f"{cls} over {over.group(1)}" if over else cls)
            _where(bad, key, case, rank)
        idle = idle_rails(r)
        if idle:
            side[str(int(case))][str(int(rank))].update(verdict="FALLBACK", idle_rails=idle)
            _where(rails_bad, (r["transport"], str(r["rail_nics"]), idle), case, rank)
    lines = [f"{_head(name, c, rk)}expected {X.WORDS.get(want, want)} ({why}), carried by {carried} ({ev})"
             for (name, want, why, carried, ev), (c, rk) in bad.items()]
    lines += [f"{_head(name, c, rk)}handed rails {nics}, {idle} (each rail's share {100 / len(nics.split(',')):.0f}%; "
              "under half of it is a rail the engine did not use)" for (name, nics, idle), (c, rk) in rails_bad.items()]
    return lines, side


def _where(into: dict, key, case, rank) -> None:
    """Add a (case, rank) to the cases and ranks of one FALLBACK line."""
    cases, ranks = into.setdefault(key, (set(), set()))
    cases.add(int(case))
    ranks.add(int(rank))


def _head(name: str, cases: set, ranks: set) -> str:
    return f"FALLBACK {name} case{'s' * (len(cases) > 1)} {spans(cases)} rank{'s' * (len(ranks) > 1)} {spans(ranks)}: "


def idle_rails(row) -> str:
    """'rail1 carried 0%' for each rail of a row handed two or more that carried under half its share of the
    bytes counted on the rails ('' when none, or nothing was counted)."""
    nics = [n for n in str(row.get("rail_nics") or "").split(",") if n]
    try:
        per = [float(x) for x in str(row.get("rail_wire_bytes") or "").split(",") if x]
    except ValueError:
        return ""
    if len(nics) < 2 or len(per) != len(nics) or sum(per) <= 0:
        return ""
    total = sum(per)
    return ", ".join(f"{n} carried {100 * b / total:.0f}%" for n, b in zip(nics, per) if b < 0.5 * total / len(nics))

