"""kvbench report (-o: Markdown, HTML, CSV; %line) and kvbench compare, on real runs and synthesized rows."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from helpers.launch import chromium, kvbench_cli, launch, leftovers_of, mpiexec

from kvbench.report.link import LinkOverride, add_line_rate
from kvbench.report.page import Page
from kvbench.report.writers import to_markdown, write
from kvbench.results.store import ROW_COLUMNS, SCHEMA_VERSION, ResultWriter

# llama-3-8b at tp 8: 16 KiB per token, so every run here moves a few MiB and takes seconds
SMALL = ["-m", "llama-3-8b", "--tp", "8", "-w", "1", "--rounds", "1"]
RUNS = {
    "bw": ["-t", "loopback,shm", "--op", "push,pull", "--tokens", "256", "-b", "16", "-e", "64", "-f", "4", "-n", "4",
           "--variants", "bulk,ceiling,paged"],
    "exp": ["-t", "shm", "--op", "push", "--tokens", "64,256", "-b", "16", "-e", "16", "-n", "4", "--variants",
            "bulk,paged", "--overlap", "serial,streaming", "--prefill-ms", "2", "--handshake", "overlap"],
    "wl": ["-t", "shm", "--op", "push", "--tokens", "64", "-b", "16", "--prompt", "64", "--prefill-ms", "1",
           "--overlap", "streaming", "--arrival", "poisson:20,poisson:500", "--requests", "12", "--decode-ms", "10",
           "--decode-pool-tokens", "128"],
}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """One tiny real 2-rank run of each kind: {name: parquet path}."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec: run `make install` (installs the mpich wheel)")
    import sys

    root = tmp_path_factory.mktemp("results")
    out = {}
    for name, args in RUNS.items():
        cmd = [exe, "-n", "2", sys.executable, "-m", "kvbench", "run", "-o", str(root), "--name", name, *SMALL, *args]
        code, so, se = launch(cmd, 180, dict(os.environ, PYTHONUNBUFFERED="1"))
        found = glob.glob(os.path.join(root, "*", f"*_{name}.parquet"))
        assert code == 0 and len(found) == 1, f"{name}: exit {code}\n{so}\n{se}"
        assert not leftovers_of(found[0])
        out[name] = found[0]
    return out


@pytest.fixture(scope="module")
def page_dir(real, tmp_path_factory):
    d = tmp_path_factory.mktemp("page")
    r = kvbench_cli("report", "-o", str(d), real["bw"], real["exp"], real["wl"], timeout=180)
    assert r.returncode == 0, r.stderr
    return d


def test_report_writes_markdown_html_and_csv(real, page_dir):
    md = (page_dir / "report.md").read_text()
    html = (page_dir / "report.html").read_text()
    csv = pd.read_csv(page_dir / "report.csv")
    for title in ("## Bandwidth", "## Exposed time", "## Workload", "Machine A"):
        assert title in md
    cases = sum(pd.read_parquet(p)["case"].nunique() for p in real.values())
    assert len(csv) == cases and set(csv["kind"]) == {"bandwidth", "exposed", "workload"}
    pngs = sorted(os.listdir(page_dir / "plots"))
    assert len(pngs) >= 5 and all(f"plots/{p}" in md for p in pngs)
    assert all((page_dir / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    # self-contained: every image inline, nothing fetched
    assert html.count('src="data:image/png;base64,') == len(pngs)
    assert not re.search(r'(src|href)="(https?:|file:|/)', html)
    # the machine heads the page: this host's CPU count from its sidecar
    meta = json.load(open(real["bw"].replace(".parquet", ".meta.json")))
    assert html.index("Machine A") < html.index('id="bandwidth"')
    assert f"{meta['system']['cpus']} cores" in html
    assert "nic_speed_mbps" in meta["system"] and "lo" in meta["system"]["nic_speed_mbps"]  # recorded at run time


def test_report_on_the_committed_reference_results(tmp_path):
    """The result files kept in the repository (any schema the readers upgrade) make a page."""
    from kvbench.report.build import main

    # results/reference/ only: a user's own runs (results/runs/, ignored by git) are not the references
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "reference")
    files = sorted(glob.glob(os.path.join(root, "**", "*.parquet"), recursive=True))
    if not files:
        pytest.skip("no result files committed under results/reference/")
    # the newest file of each suite and machine: every kind of result kept there, in seconds on 2 cores
    newest = {}
    for f in files:
        newest[(os.path.dirname(f), os.path.basename(f).split("_", 1)[-1])] = f
    files = sorted(newest.values())
    said = []
    assert main(files, str(tmp_path), say=said.append) == 0
    wrote = [os.path.basename(s.split()[-1]) for s in said]
    assert {"report.md", "report.html", "report.csv"} <= set(wrote), wrote
    # the link-fit sweep is committed: its section's fitted costs come with their own CSV
    assert "report_linkmodel.csv" in wrote, wrote
    csv = pd.read_csv(tmp_path / "report.csv")
    assert csv["run"].nunique() == len(files) and len(os.listdir(tmp_path / "plots")) > 0


def test_without_o_the_terminal_table_is_printed(real):
    r = kvbench_cli("report", real["bw"])
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout and "bulk%" in r.stdout
    e = kvbench_cli("report", real["exp"])  # an exposed-time file: its own table, no GB/s of prefill-inclusive times
    assert e.returncode == 0 and "exp p50" in e.stdout and "GB/s =" not in e.stdout


def _section(html: str, sid: str) -> str:
    start = html.index(f'id="{sid}"')
    nxt = html.find("<h2 ", start + 1)
    return html[start: nxt if nxt > 0 else len(html)]


def test_exposed_rows_show_exposed_statistics_never_gbps(real, page_dir):
    html = (page_dir / "report.html").read_text()
    sec = _section(html, "exposed-time")
    assert "exposed p50 (ms)" in sec and "model (ms)" in sec and "GB/s</th>" not in sec and "%line" not in sec
    csv = pd.read_csv(page_dir / "report.csv")
    ex = csv[csv["kind"] == "exposed"]
    assert len(ex) == 4 and ex["pct_line"].isna().all()  # 2 prompt lengths x serial/streaming, paged
    # the exposed-time cases do not appear among the bandwidth rows
    bw_sec = _section(html, "bandwidth")
    assert "streaming" not in bw_sec
    # the number is the decode ranks' exposed time, p50 over iterations, straight from the rows
    df = pd.read_parquet(real["exp"])
    case = int(ex[(ex["overlap"] == "streaming") & (ex["tokens"] == 256)]["case"].iloc[0])
    rows = df[(df["case"] == case) & (df["iter"] >= 0) & df["exposed_s"].notna() & (df["status"] == "ok")]
    want = np.median(rows["exposed_s"]) * 1e3
    got = float(ex[ex["case"] == case]["exposed_p50_s"].iloc[0]) * 1e3
    assert got == pytest.approx(want, rel=1e-9)
    assert f"{want:.2f}" in sec


def test_workload_rows_show_tails_against_arrival_rate(real, page_dir):
    html = (page_dir / "report.html").read_text()
    sec = _section(html, "workload")
    assert "rate (req/s)" in sec and "exposed p50/p95/p99 (ms)" in sec and "GB/s</th>" not in sec
    csv = pd.read_csv(page_dir / "report.csv")
    wl = csv[csv["kind"] == "workload"].sort_values("rate_rps")
    assert wl["rate_rps"].tolist() == [20.0, 500.0]
    assert (wl["admitted"] + wl["dropped"] == 12).all() and wl["pct_line"].isna().all()
    df = pd.read_parquet(real["wl"])
    for _, r in wl.iterrows():
        dec = df[(df["case"] == r["case"]) & (df["role"] == "decode") & (df["status"] == "ok")]
        assert r["exposed_p50_ms"] == pytest.approx(np.percentile(dec["exposed_s"], 50) * 1e3, rel=1e-9)
        assert len(dec) < 100 and np.isnan(r["exposed_p99_ms"])  # 12 requests hold no p99 (results/samples.py)
        assert r["queue_p50_ms"] == pytest.approx(np.percentile(dec["queue_s"], 50) * 1e3, rel=1e-9)


def test_the_terminal_report_keeps_a_workloads_arrival(real, page_dir):
    # rows of two arrival rates differ by their arrival alone: without it they read as duplicates
    r = kvbench_cli("report", real["wl"])
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("#transport"))
    assert "arrival" in header.split()
    rows = [ln.split() for ln in r.stdout.splitlines() if not ln.startswith("#")]
    assert sorted(ln[header.split().index("arrival")] for ln in rows) == ["poisson:20", "poisson:500"]
    md = (page_dir / "report.md").read_text()
    assert "| arrival |" in md[md.index("## Workload"):] and "tokens 64" in md[md.index("## Workload"):]


def test_bandwidth_rows_carry_line_rate(page_dir):
    csv = pd.read_csv(page_dir / "report.csv")
    bw = csv[csv["kind"] == "bandwidth"]
    # one host: every row's line is kvbench's own copy of its bytes beside its iterations, never a row of the run
    assert (bw["link_source"] == "measured: kvbench's own copy of the same bytes beside its iterations").all()
    assert (bw["link_gbps_1e9"] > 0).all()
    assert np.allclose(bw["pct_line"], 100 * bw["gbps_1e9"] / bw["link_gbps_1e9"])


def test_a_lying_row_does_not_become_the_line_it_is_measured_against():
    """%line on one host comes from the harness's copies beside each case's iterations (bound_gbps): a bulk row
    that claims 10x moves neither its own line nor the paged row's; an older file without those copies falls
    back to the best host copy row of its run, and says so."""
    from kvbench.report.link import add_line_rate

    st = pd.DataFrame({"case": [1, 2], "variant": ["bulk", "paged"], "transport": "shm", "memory": "host",
                       "gbps": [100.0, 5.0], "ceil_gbps": [100.0, 100.0], "ceil_name": "bulk", "model": "m",
                       "tokens": 64, "prefix_hit": 0, "dtype": "fp16", "tp": 1, "pp": 1, "scheme": "pairwise",
                       "world_size": 2, "inflight": 1})
    df = pd.DataFrame({"case": [1, 1, 2, 2, 1], "iter": [0, 1, 0, 1, -1], "bound_kind": "memory copy",
                       "bound_gbps": [9.0, 11.0, 10.0, 10.0, 500.0], "rank": 1, "host": "h"})
    got = add_line_rate(st, df, {"hosts": ["h", "h"], "world_size": 2})
    assert list(got["link_gbps"]) == [10.0, 10.0] and list(got["pct_line"]) == [1000.0, 50.0]
    assert (got["link"] == "measured: kvbench's own copy of the same bytes beside its iterations").all()
    old = add_line_rate(st, df.drop(columns=["bound_gbps", "bound_kind"]), {"hosts": ["h", "h"], "world_size": 2})
    assert list(old["link_gbps"]) == [100.0, 100.0] and old["link"].str.contains("an older file").all()


def test_report_link_gbps_overrides(real, tmp_path):
    r = kvbench_cli("report", "-o", str(tmp_path), "--link-gbps", "shm=12.5", real["bw"])
    assert r.returncode == 0, r.stderr
    csv = pd.read_csv(tmp_path / "report.csv")
    shm = csv[csv["transport"] == "shm"]
    assert (shm["link_gbps_1e9"] == 12.5).all() and (shm["link_source"] == "given: --link-gbps").all()
    assert (csv[csv["transport"] == "loopback"]["link_source"].str.startswith("measured")).all()
    bad = kvbench_cli("report", "-o", str(tmp_path), "--link-gbps", "shm=0", real["bw"])
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "positive" in bad.stderr


# ----- %line without a run: the sources of a link rate --------------------------------------------------------

def _summary(transport="tcp", memory="host"):
    st = pd.DataFrame([{"case": 1, "transport": transport, "op": "push", "memory": memory, "model": "m", "tokens": 64,
                        "prefix_hit": 0, "dtype": "fp16", "tp": 1, "pp": 1, "scheme": "pairwise", "world_size": 2,
                        "inflight": 1, "gbps": 5.0, "ceil_gbps": 8.0, "ceil_name": "bulk"}])
    df = pd.DataFrame({"case": [1, 1], "pair": [0, 0], "rank": [0, 1]})
    return st, df


def test_line_rate_sources():
    st, df = _summary()
    two_hosts = {"hosts": ["a", "b"], "system": {"nic_speed_mbps": {"eth0": 100000, "lo": None}}}
    r = add_line_rate(st, df, two_hosts).iloc[0]
    assert r["link_gbps"] == 12.5 and r["pct_line"] == 40.0 and r["link"].startswith("nominal: NIC eth0")
    # the transport names its interface, and it has no speed: unknown, not the other NIC's
    named = dict(two_hosts, transports={"tcp": [{"ifname": "ib0"}]})
    r = add_line_rate(st, df, named).iloc[0]
    assert np.isnan(r["link_gbps"]) and r["link"].startswith("unknown")
    # the device layer's hook: a rate in the transport's info()
    hooked = dict(two_hosts, transports={"tcp": [{"link_gbps": 450.0, "link": "NVLink 4 x18"}]})
    assert add_line_rate(st, df, hooked).iloc[0]["link"] == "nominal: NVLink 4 x18"
    one_host = {"hosts": ["a", "a"], "system": {}}
    r = add_line_rate(st, df, one_host).iloc[0]
    assert r["link_gbps"] == 8.0 and r["link"].startswith("measured")
    dst, ddf = _summary(memory="cuda")
    assert add_line_rate(dst, ddf, one_host).iloc[0]["link"].startswith("unknown: cuda memory")
    r = add_line_rate(st, df, two_hosts, LinkOverride.parse("25")).iloc[0]
    assert r["link_gbps"] == 25 and r["pct_line"] == 20.0
    with pytest.raises(ValueError, match="GBPS"):
        LinkOverride.parse("tcp=fast")


# ----- the page API others add sections through -----------------------------------------------------------------

def test_page_api_renders_added_sections(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    page = Page("t")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    page.add_section("Link model", "fit text", tables=[("fit", pd.DataFrame({"path": ["tcp"], "a|b": [1.5]}))],
                     figures=[("pred vs measured", fig)])
    page.add_data("linkmodel", pd.DataFrame({"x": [1]}))
    paths = write(page, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["report.md", "report.html", "report_linkmodel.csv"]
    md = (tmp_path / "report.md").read_text()
    assert "## Link model" in md and "| tcp | 1.5 |" in md and "a\\|b" in md and "![pred vs measured](plots/" in md
    assert to_markdown(page, str(tmp_path / "p2")).count("![") == 1


def test_registered_sections_join_every_report(monkeypatch, tmp_path):
    from kvbench.report import build as B

    path = synth(tmp_path / "a", "a")
    monkeypatch.setattr(B, "SECTIONS", list(B.SECTIONS))
    B.register(lambda page, runs: page.add_section("Extra", f"{len(runs)} run(s), {len(runs[0].st)} cases"))
    page, _ = B.build([path])
    assert [s.title for s in page.sections] == ["Summary", "Runs", "Bandwidth", "Exposed time", "Extra"]
    assert page.sections[-1].text == ["1 run(s), 2 cases"]
    assert B.SECTIONS[-1] is B.skipped_section  # the reasons still close the page


def synth_codecs(root) -> str:
    """A result file with codec rows: none and exp-split (ratio 4/3) on one path, 2 ranks, 4 iterations."""
    w = ResultWriter(str(root), "codecs", {"suite": {"name": "codecs"}, "hosts": ["h", "h"],
                                           "system": {"hostname": "h", "cpus": 2}})
    base = {c: None for c in ROW_COLUMNS} | {
        "variant": "paged", "transport": "tcp", "op": "push", "memory": "host", "model": "m", "tokens": 64,
        "prefix_hit": 0, "block_size": 16, "block_bytes": 4096, "layout": "layer-major", "allocation": "random",
        "coalesce": "off", "dtype": "bf16", "scheme": "pairwise", "tp": 1, "pp": 1, "world_size": 2, "inflight": 1,
        "handshake": "off", "workload": "none", "layers": 2, "pages": "4k", "pair": 0, "req": 0, "round": 0,
        "payload_bytes": 1 << 20, "descriptors": 16, "status": "ok", "reason": "", "prefill_s": 0.0,
        "handshake_s": 0.0, "queue_s": np.nan, "arrival_s": np.nan, "exposed_s": np.nan, "overlap": "serial",
        "prefill_ms_set": "0"}
    for case, codec, wire, t in ((1, "none", 1 << 20, 0.010), (2, "exp-split", 3 << 18, 0.008)):
        coded = codec != "none"
        w.add([base | {"case": case, "codec": codec, "wire_bytes": wire, "rank": rank, "role": role, "iter": it,
                       "seconds": np.nan if it < 0 else t, "harness_seconds": 0.0, "nwrong": 0 if it < 0 else np.nan,
                       "codec_encode_s": 0.002 if coded and rank == 0 else np.nan,
                       "codec_decode_s": 0.002 if coded and rank == 1 else np.nan}
               for it in range(-1, 4) for rank, role in ((0, "prefill"), (1, "decode"))])
    w.finish(status="OK")
    return w.path


def test_the_codec_section_joins_the_page_only_when_a_run_has_codec_rows(tmp_path):
    from kvbench.report import build as B

    page, _ = B.build([synth(tmp_path / "a", "a")])
    assert "Codecs" not in [s.title for s in page.sections]
    page, _ = B.build([synth_codecs(tmp_path / "c")])
    assert [s.title for s in page.sections] == ["Summary", "Runs", "Bandwidth", "Codecs"]
    rows = page.sections[-1].tables[0][1].set_index("codec")
    assert list(rows.index) == ["exp-split", "none"] and set(rows["transport"]) == {"tcp"}
    assert rows.loc["exp-split", "ratio"] == "1.333" and rows.loc["none", "ratio"] == "1.000"
    assert rows.loc["exp-split", "eff GB/s"] == "0.1311" and rows.loc["exp-split", "measured"] == "win"


# ----- the page in a browser ---------------------------------------------------------------------------------------

def test_html_renders_in_headless_chromium(page_dir, tmp_path):
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: apt-get install chromium")
    html = (page_dir / "report.html").read_text()
    # a probe added to a copy (the page itself has no script): after load, how each image decoded and how many
    # table rows the browser laid out
    # the collapsed long tables are opened first, so that every table's laid-out height is measured
    probe = ("<script>window.addEventListener('load', () => { const d = document.createElement('div'); d.id = 'probe';"
             " const first = document.querySelector('h2').id;"
             " document.querySelectorAll('details').forEach(x => { x.open = true; });"
             " d.textContent = JSON.stringify({first, imgs: [...document.images].map(i => [i.naturalWidth, i.complete]),"
             " rows: document.querySelectorAll('table tbody tr').length,"
             " heights: [...document.querySelectorAll('table')].map(t => t.offsetHeight)});"
             " document.body.appendChild(d); });</script>")
    copy = tmp_path / "probe.html"
    copy.write_text(html.replace("</body>", probe + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
    dom = subprocess.run([exe, *flags, "--dump-dom", copy.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<div id="probe">(.*?)</div>', dom.stdout)
    assert m, dom.stderr[-2000:]
    got = json.loads(m.group(1).replace("&quot;", '"'))
    assert got["first"] == "summary"  # the page opens with the one-screen summary
    n_png = html.count("data:image/png;base64,")
    assert len(got["imgs"]) == n_png >= 5 and all(w > 300 and ok for w, ok in got["imgs"])
    csv = pd.read_csv(page_dir / "report.csv")
    assert got["rows"] >= len(csv) and all(h > 0 for h in got["heights"])
    shot = tmp_path / "page.png"
    # tall enough for the plots below however many notes a loaded machine's run adds above them (SKEW, NOISY)
    subprocess.run([exe, *flags, "--window-size=1400,6000", f"--screenshot={shot}", (page_dir / "report.html").as_uri()],
                   capture_output=True, text=True, timeout=120)
    import matplotlib.image as mpimg

    px = (mpimg.imread(str(shot))[..., :3] * 255).astype(int)
    assert px.shape[:2] == (6000, 1400)
    # the plots' first line colour (matplotlib C0, #1f77b4) is on screen: an image was painted, not a broken icon
    c0 = (np.abs(px - [31, 119, 180]).sum(axis=2) < 30).sum()
    assert c0 > 500, c0
    if os.environ.get("KVBENCH_SHOT"):  # to look at it: KVBENCH_SHOT=path pytest ...
        shutil.copy(shot, os.environ["KVBENCH_SHOT"])


# ----- compare ------------------------------------------------------------------------------------------------------

@pytest.fixture
def kv(capsys):
    """kvbench's command line in this process (no MPI is started by report or compare): (code, stdout, stderr)."""
    from types import SimpleNamespace

    from kvbench.cli.main import main

    def call(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return call


def synth(root, name, scale=1.0, n=20, seed=0, system=None, schema=None, status="OK") -> str:
    """A result set written by results/store.py's writer: one bandwidth case and one exposed case, 2 ranks, n iterations
    of ~10 ms (2% noise) times ``scale``; its sidecar ends with ``status`` (INCOMPLETE: it never ends, as a killed
    run's does not)."""
    rng = np.random.default_rng(seed)
    meta = {"suite": {"name": name}, "hosts": ["h", "h"], "git_commit": name,
            "system": system or {"hostname": "h", "cpu_model": "X", "cpus": 2, "mem_total_bytes": 2**34}}
    w = ResultWriter(str(root), name, meta)
    base = {c: None for c in ROW_COLUMNS} | {
        "variant": "paged", "transport": "tcp", "op": "push", "memory": "host", "model": "m", "tokens": 64,
        "prefix_hit": 0, "block_size": 16, "block_bytes": 4096, "layout": "layer-major", "allocation": "random",
        "coalesce": "off", "dtype": "fp16", "codec": "none", "scheme": "pairwise", "tp": 1, "pp": 1,
        "world_size": 2, "inflight": 1, "handshake": "off", "workload": "none", "layers": 2, "pages": "4k",
        "pair": 0, "req": 0, "round": 0, "payload_bytes": 1 << 20, "wire_bytes": 1 << 20, "descriptors": 16,
        "status": "ok", "reason": "", "nwrong": np.nan, "prefill_s": 0.0, "handshake_s": 0.0, "queue_s": np.nan,
        "arrival_s": np.nan}
    for case, overlap, pms in ((1, "serial", "0"), (2, "streaming", "5")):
        rows = []
        for it in range(-1, n):
            t = 0.01 * scale * (1 + 0.02 * rng.standard_normal())
            for rank, role in ((0, "prefill"), (1, "decode")):
                rows.append(base | {"case": case, "overlap": overlap, "prefill_ms_set": pms, "rank": rank, "role": role,
                                    "iter": it, "seconds": t if rank else t * 0.9, "harness_seconds": 0.0,
                                    "exposed_s": t if rank else np.nan, "nwrong": 0 if it == -1 else np.nan,
                                    "prefill_s": float(pms) / 1e3})
        w.add(rows)
    if status != "INCOMPLETE":
        w.finish(status=status, reason="" if status == "OK" else f"kvbench: {status.lower()}: rank 1: synthesized")
    if schema is not None:
        meta = json.load(open(w.meta_path))
        json.dump(dict(meta, schema_version=schema), open(w.meta_path, "w"))
    return w.path


def test_compare_exits_nonzero_on_a_20pct_regression_and_zero_on_identical(tmp_path, kv):
    a = synth(tmp_path / "a", "a")
    b = synth(tmp_path / "b", "b", scale=1.2, seed=1)
    same = kv("compare", a, a, "--fail-above", "5%")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "0 regression(s)" in same.stdout and "WARNING" not in same.stdout
    bad = kv("compare", a, b, "--fail-above", "5%")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    lines = [ln for ln in bad.stdout.splitlines() if "REGRESSION" in ln and not ln.startswith("#")]
    assert len(lines) == 2  # the bandwidth case (request time) and the exposed case (exposed time)
    cols = [re.search(r"\s(time|exposed)\s+(\d+)/(\d+)\s+(\S+)\s+(\S+)\s+(\S+)", ln).groups() for ln in lines]
    assert {c[0] for c in cols} == {"time", "exposed"} and all(c[1:3] == ("20", "20") for c in cols)
    d50 = [float(c[5]) for c in cols]
    assert all(17 < d < 23 for d in d50), d50
    # without --fail-above it reports and exits 0; above the threshold it passes
    assert kv("compare", a, b).returncode == 0
    assert kv("compare", a, b, "--fail-above", "30%").returncode == 0
    faster = kv("compare", b, a, "--fail-above", "5%")
    assert faster.returncode == 0 and "faster" in faster.stdout


def test_compare_real_run_against_itself(real):
    r = kvbench_cli("compare", real["bw"], real["bw"], "--fail-above", "5%")
    assert r.returncode == 0, r.stdout + r.stderr
    n = pd.read_parquet(real["bw"])["case"].nunique()
    assert f"{n} case(s) compared: 0 regression(s)" in r.stdout


def test_compare_warns_when_the_machines_differ(tmp_path, kv):
    a = synth(tmp_path / "a", "a")
    b = synth(tmp_path / "b", "b", system={"hostname": "h", "cpu_model": "Y", "cpus": 64, "mem_total_bytes": 2**34})
    r = kv("compare", a, b)
    assert r.returncode == 0
    warn = [ln for ln in r.stdout.splitlines() if ln.startswith("# WARNING: the machines differ")]
    assert len(warn) == 2 and "cpu_model: 'X' vs 'Y'" in warn[0] and "cpus: 2 vs 64" in warn[1]


def test_compare_and_report_name_a_suspect_run(tmp_path, kv):
    a = synth(tmp_path / "a", "a")
    b = synth(tmp_path / "b", "b", status="SUSPECT")
    for args in ((), ("--fail-above", "5%")):  # a gate or a look: a suspect run never reads as a pass
        r = kv("compare", a, b, *args)
        assert r.returncode == 6, r.stdout + r.stderr  # SUSPECT's own exit code (job/status.py)
        warn = [ln for ln in r.stdout.splitlines() if "ended SUSPECT" in ln]
        assert len(warn) == 1 and warn[0].startswith("# WARNING: B's ") and "kvbench: suspect: rank 1" in warn[0]
        name = os.path.basename(b).removesuffix(".parquet")
        assert r.stderr.count("\n") == 1 and f"B's {name} ended SUSPECT" in r.stderr, r.stderr
    rep = kv("report", b)
    assert rep.returncode == 0 and ("[SUSPECT]" in rep.stdout or "status=SUSPECT" in rep.stdout), rep.stdout


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("status", ["FAILED", "SUSPECT", "TIMEOUT", "INCOMPLETE"])
def test_compare_fails_the_gate_when_a_run_did_not_end_cleanly(tmp_path, kv, status, side):
    from kvbench.job.status import exit_code

    ok, bad = synth(tmp_path / "a", "a"), synth(tmp_path / "b", "b", status=status)
    r = kv("compare", *((bad, ok) if side == "A" else (ok, bad)), "--fail-above", "5%")
    assert r.returncode == exit_code(status) != 0, r.stdout + r.stderr  # INCOMPLETE never exited: 1
    name = os.path.basename(bad).removesuffix(".parquet")
    (line,) = r.stderr.splitlines()
    assert f"{side}'s {name} ended {status}" in line and "0 regression(s)" in r.stdout


def test_compare_names_every_unsound_run_and_exits_with_the_worst(tmp_path, kv):
    a = synth(tmp_path / "a", "a", status="SUSPECT")
    b = synth(tmp_path / "b", "b", scale=1.2, seed=1, status="FAILED")
    r = kv("compare", a, b, "--fail-above", "5%")
    assert r.returncode == 2, r.stdout + r.stderr  # FAILED (2) outranks SUSPECT (6) and the regression (2)
    (line,) = r.stderr.splitlines()
    assert "A's " in line and "ended SUSPECT" in line and "B's " in line and "ended FAILED" in line


def test_compare_prints_p95_only_from_20_samples(tmp_path, kv):
    rows = {}
    for n in (19, 20):
        a, b = synth(tmp_path / f"a{n}", "a", n=n), synth(tmp_path / f"b{n}", "b", n=n, seed=1)
        r = kv("compare", a, b)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "p95 from 20, p99 from 100" in r.stdout
        rows[n] = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("  ")]
    # metric, n A/B, p50 A, p50 B, d%, GB/s A, GB/s B (or -), p95 A, p95 B, d%
    assert all(f[1] == "19/19" and f[7:10] == ["-", "-", "-"] for f in rows[19]), rows[19]
    assert all(f[1] == "20/20" and all(float(v) > 0 for v in f[7:9]) for f in rows[20]), rows[20]


def test_readers_refuse_an_unknown_schema_in_one_line(tmp_path, kv):
    a = synth(tmp_path / "a", "a")
    future = synth(tmp_path / "f", "f", schema=SCHEMA_VERSION + 97)
    for args in (["compare", a, future], ["compare", future, a], ["report", future],
                 ["report", "-o", str(tmp_path / "o"), future]):
        r = kv(*args)
        assert r.returncode == 1 and r.stdout == "", args
        assert r.stderr.count("\n") == 1 and f"schema version {SCHEMA_VERSION + 97}" in r.stderr, r.stderr


def test_compare_reads_an_older_schema_it_can_upgrade(tmp_path, kv):
    a = synth(tmp_path / "a", "a")
    old = synth(tmp_path / "o", "o", schema=1)
    df = pd.read_parquet(old).drop(columns=["pages", "skew_s", "clock_err_s", "clock_offset_s", "completion"])
    df.to_parquet(old)  # as a version-1 writer left it
    r = kv("compare", a, old, "--fail-above", "5%")
    assert r.returncode == 0 and "2 case(s) compared" in r.stdout, r.stdout + r.stderr


def test_a_schema_4_file_reads_in_report_and_compare_with_placement_at_defaults(tmp_path, kv):
    from kvbench.report.tables import read

    a = synth(tmp_path / "a", "a")
    old = synth(tmp_path / "o", "o", schema=4)
    pd.read_parquet(old).drop(columns=["gpu", "nic", "same_gpu"]).to_parquet(old)  # as a schema-4 writer left it
    r = kv("compare", a, old, "--fail-above", "5%")
    assert r.returncode == 0 and "2 case(s) compared" in r.stdout, r.stdout + r.stderr
    r = kv("report", old, "-o", str(tmp_path / "page"))
    assert r.returncode == 0, r.stdout + r.stderr
    df, _ = read(old)
    assert (df.gpu == -1).all() and (df.nic == "").all() and not df.same_gpu.any()


def test_the_live_table_adds_a_column_only_for_an_axis_a_case_leaves_at_its_default():
    from kvbench.report import tables as T

    heads = lambda cols: [h for h, _, _ in cols]  # noqa: E731
    host = {"memory": "host", "copy": "batch", "scales": "none", "codec": "none", "prefill": "clock"}
    assert T.columns_for([host, {}]) == T.COLUMNS  # a result from before these columns reads as defaults
    assert T.columns_for([host, {"codec": float("nan")}], overlap=True) == T.OVERLAP_COLUMNS
    mixed = [host, host | {"codec": "zstd", "scales": "block:32", "prefill": "real"}]
    h = heads(T.columns_for(mixed))
    assert h[h.index("dtype"):h.index("dtype") + 3] == ["dtype", "scales", "codec"]
    assert h[h.index("infl") + 1] == "prefill" and "mem" not in h and len(h) == len(T.COLUMNS) + 3
    h = heads(T.columns_for(mixed + [host | {"memory": "cuda"}], overlap=True))  # no dtype, infl: beside their kin
    assert h[:2] == ["transport", "mem"] and h[h.index("handshk") + 1] == "prefill"
    assert h[h.index("tokens") + 1:h.index("tokens") + 3] == ["scales", "codec"]
    cols = T.columns_for(mixed)
    row = T.format_line(dict.fromkeys(["transport", "op", "model", "tokens", "dtype"], "x") | mixed[1]
                        | {"status": "skipped", "reason": "why"}, cols)
    assert row.split() == ["x"] * 4 + ["skipped:", "why"]
    assert any(ln.startswith("# scales = fp8 scale planes; codec = the wire encoding; prefill = clock")
               for ln in T.header_lines(cols))
    assert not any("codec =" in ln for ln in T.header_lines())


# ----- the run's status on every table -----------------------------------------------------------------------------

@pytest.mark.parametrize("status", ["INCOMPLETE", "TIMEOUT", "ERROR", "FAILED", "INTERRUPTED"])
def test_report_marks_a_run_that_did_not_end_cleanly_on_every_table_and_the_page(tmp_path, kv, status):
    from kvbench.report import build as B

    ok, bad = synth(tmp_path / "a", "fine"), synth(tmp_path / "b", "broken", status=status)
    name_ok, name_bad = (os.path.basename(p).removesuffix(".parquet") for p in (ok, bad))
    mark = f"{name_bad} [{status}]"
    page, runs = B.build([ok, bad])
    cells = [cap + "\n" + t.to_csv(index=False) for cap, t in page.head]
    cells += [cap + "\n" + t.to_csv(index=False) for s in page.sections for cap, t in s.tables]
    named = [c for c in cells if name_bad in c]
    assert len(named) >= 4  # the machine, the runs, bandwidth and exposed-time tables at least
    assert all(c.count(name_bad) == c.count(mark) for c in named)  # never named without its status
    assert all(name_ok in c and f"{name_ok} [" not in c for c in named)  # the OK run looks as it did
    runs_text = " ".join(next(s for s in page.sections if s.title == "Runs").text)
    assert "1 of 2 did not" in runs_text
    if status != "INCOMPLETE":
        assert "synthesized" in runs_text  # the sidecar's reason, from the one exit path's line
    out = tmp_path / "page"
    assert kv("report", "-o", out, ok, bad).returncode == 0
    for f in ("report.md", "report.html"):
        assert mark in (out / f).read_text() or mark.replace("[", "\\[") in (out / f).read_text()
    csv = pd.read_csv(out / "report.csv")
    assert set(csv["run"]) == {name_ok, name_bad}  # the CSV keeps the name as the key, the status beside it
    assert dict(zip(csv["run"], csv["run_status"])) == {name_ok: "OK", name_bad: status}
    # the terminal table: its header says the status, and why
    r = kv("report", bad)
    head = r.stdout.splitlines()
    assert r.returncode == 0 and head[0].endswith(f"status={status}") and head[1].startswith(f"# status {status}: ")
    assert "status" not in kv("report", ok).stdout.splitlines()[0]


@pytest.mark.parametrize("status", ["OK", "UNCHECKED"])
def test_a_run_that_ended_cleanly_looks_as_before(tmp_path, kv, status):
    from kvbench.report import build as B

    path = synth(tmp_path, "fine", status=status)
    page, (run,) = B.build([path])
    runs = next(s for s in page.sections if s.title == "Runs")
    assert run.label == run.name and run.status is None and len(runs.text) == 1
    assert page.head[0][1].set_index("machine").loc["runs", "value"] == run.name
    r = kv("report", path)
    assert "status" not in r.stdout.splitlines()[0] and "# status" not in r.stdout


def test_the_footer_reuses_the_last_flushs_summary_only_for_the_same_rows():
    """The footer's case statistics are the live table's last ones when it covered the set's every transfer row
    (no second summarize of the same rows), and computed anew when the set holds more (a resumed run's)."""
    from kvbench.report.tables import LivePrinter, summarize
    from kvbench.results.store import transfer_rows, upgrade

    path = os.path.join(os.path.dirname(__file__), "..", "results", "reference", "vm", "20261204-112838_procurement-overlap")
    df = upgrade(pd.read_parquet(path + ".parquet"), json.load(open(path + ".meta.json"))["schema_version"])
    lines: list[str] = []
    printer = LivePrinter(lines.append)
    cases = sorted(set(df["case"]))
    for case in cases:
        printer.add(df[df["case"] == case][ROW_COLUMNS].to_dict("records"))
    printer.flush()
    assert len(lines) == len(cases)
    rows = transfer_rows(pd.concat(printer.frames, ignore_index=True))
    st = printer.summary_of(rows)
    assert st is printer._last[1]  # reused
    pd.testing.assert_frame_equal(st, summarize(rows))
    paged = rows[rows["variant"] == "paged"]["case"].iloc[0]
    earlier = rows[rows["case"] == paged].assign(case=0)  # a resumed set: rows the printer never held
    more = pd.concat([earlier, rows], ignore_index=True)
    anew = printer.summary_of(more)
    assert anew is not st and len(anew) == len(st) + 1
    printer.add(df[df["case"] == cases[0]][ROW_COLUMNS].to_dict("records"))  # rows since the last flush
    assert printer.summary_of(rows) is not st
