"""suites/procurement*.yaml: the buyer's sweep covers what make procurement promises, and make procurement's driver
writes its report and plan beside the results without overwriting anything; Ctrl-C keeps what was measured, and the
next make procurement finishes the set."""
import argparse
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from helpers.launch import ROOT, kill_group, launch

from kvbench import transports
from kvbench.config import suite as S


def test_procurement_suites_cover_every_axis_the_buyer_needs():
    bw, ov = S.load("procurement"), S.load("procurement-overlap")
    for s in (bw, ov):
        assert set(s.axes.transport) == set(transports.names())  # every transport; unavailable ones say why
        assert s.axes.op == ["push", "pull"] and s.check == "all"  # every timed iteration checked
        assert s.axes.model == ["llama-3-70b", "llama-3-8b", "deepseek-v3"]
        assert s.timeout <= 120 and s.iters * s.axes.tokens[0] > 0  # the per-case budget is stated
        assert s.iters >= 20 and s.target_ci == 2.0 and 0 < s.ci_budget <= 10  # n >= 20 on every row, p50 earned
    assert min(bw.axes.block_size) == 16 and max(bw.axes.block_size) == 256
    assert set(bw.axes.dtype) == {"fp16", "fp8-e4m3"} and bw.axes.overlap == ["serial"]
    assert bw.axes.prefill_ms == [0.0]  # bandwidth rows: no prefill clock inside their times
    assert ov.axes.overlap == ["serial", "streaming"] and ov.axes.prefill_ms == ["auto"]
    assert len(S.expand(bw)) == 11 * 2 * 3 * 3 * 2 and len(S.expand(ov)) == 11 * 2 * 3 * 2


@pytest.mark.launches
def test_driver_writes_report_and_plan_beside_the_results(tmp_path):
    # the driver on the smallest sweep: shm and an unavailable transport, one model, one block size
    env = dict(os.environ, PYTHONPATH=ROOT)
    small = "-t shm,verbs --tokens 32 -n 2 -w 0 --ci-budget 0.2 --rounds 1 -m llama-3-8b -b 16 -e 16 --dtype fp16 -o " + str(tmp_path)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "procurement.py"), "--kvbench-args", small,
                        "--label", "test VM"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (folder,) = os.listdir(tmp_path)
    names = sorted(os.listdir(tmp_path / folder))
    assert sorted(n.split("_", 1)[1] for n in names) == [
        "procurement-overlap.meta.json", "procurement-overlap.parquet", "procurement.meta.json",
        "procurement.parquet", "procurement.plan.txt", "procurement.report", "procurement.report.txt",
        "procurement.set.json"]
    (state,) = sets(tmp_path)
    assert state["complete"] and [e["status"] for e in state["suites"]] == ["OK", "OK"]
    page = tmp_path / folder / next(n for n in names if n.endswith("procurement.report"))
    assert sorted(p.name for p in page.iterdir() if p.is_file())[:3] == ["report.csv", "report.html", "report.md"]
    report = (tmp_path / folder / next(n for n in names if n.endswith("report.txt"))).read_text()
    plan = (tmp_path / folder / next(n for n in names if n.endswith("plan.txt"))).read_text()
    assert report.startswith("# machine: test VM\n") and "unavailable" in report
    assert "[measured]" in plan and "100GbE [nominal]" in plan and "400G IB NDR [nominal]" in plan


DRIVER = os.path.join(ROOT, "benchmarks", "procurement.py")
# the smallest sweep both suites accept: shm push, one block size, one model, fp16, bulk and paged
TINY = ("-t shm --op push -b 16 -e 16 --tokens 16 -n 2 -w 0 --rounds 1 --variants bulk,paged -m llama-3-8b "
        "--ci-budget 0.2 --dtype fp16")


def sets(out) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*", "*.set.json")))]


def written(out, suffix: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, "*", "*" + suffix)))


def sidecar(parquet: str) -> dict:
    return json.load(open(parquet.removesuffix(".parquet") + ".meta.json"))


def interrupt_after_first_suite(cmd, env, err_path, timeout=150):
    """Start the driver in its own process group, Ctrl-C the whole group (as a terminal does) once the first suite's
    footer names its results; (exit code, stdout)."""
    with open(err_path, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env,
                             start_new_session=True)
    watchdog = threading.Timer(timeout, kill_group, [p])  # a driver that never ends fails the test, not the session
    watchdog.start()
    out = []
    try:
        for line in p.stdout:
            out.append(line)
            if line.startswith("# results: "):
                os.killpg(p.pid, signal.SIGINT)
                break
        out.append(p.stdout.read())
        return p.wait(), "".join(out)
    finally:
        watchdog.cancel()
        kill_group(p)


@pytest.mark.launches
def test_ctrl_c_keeps_a_report_and_the_next_run_finishes_the_set(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    out = tmp_path / "runs"
    cmd = [sys.executable, DRIVER, "--out", str(out), "--kvbench-args", TINY, "--label", "test VM"]
    code, stdout = interrupt_after_first_suite(cmd, env, tmp_path / "err.txt")
    err = (tmp_path / "err.txt").read_text()
    assert code == 130, stdout[-2000:] + err[-2000:]
    assert "Traceback" not in err + stdout
    assert "the set is incomplete" in stdout and "make procurement` again resumes it" in stdout
    (state,) = sets(out)
    assert not state["complete"] and state["suites"][0]["results"]
    assert state["suites"][1]["status"] in ("NOT STARTED", "INTERRUPTED", "INCOMPLETE")
    assert len(written(out, ".report.txt")) == len(written(out, ".plan.txt")) == 1  # what was kept, reported

    code, stdout, err = launch(cmd, 150, env)
    assert code == 0, stdout[-2000:] + err[-2000:]
    assert "# make procurement: resuming " in stdout and "Traceback" not in err
    (state,) = sets(out)  # the same set, finished: no second one
    assert state["complete"] and [e["status"] for e in state["suites"]] == ["OK", "OK"]
    assert [sidecar(e["results"])["status"] for e in state["suites"]] == ["OK", "OK"]
    reports, plans = written(out, ".report.txt"), written(out, ".plan.txt")
    assert len(reports) == len(plans) == 2 and len(state["reports"]) == 2  # the first ones kept, new ones beside
    assert state["reports"][-1]["report"] in reports and "[measured]" in open(state["reports"][-1]["plan"]).read()


def driver():
    spec = importlib.util.spec_from_file_location("procurement_driver", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def args(out, **kw) -> argparse.Namespace:
    base = dict(out=str(out), kvbench_args=TINY, np=2, label="", resume=None, fresh=False)
    return argparse.Namespace(**{**base, **kw})


def a_set(mod, out, statuses, **kw) -> str:
    """A set's state file (and its suites' sidecars) as an interrupted driver leaves it."""
    state = {**mod.new_set(args(out, **kw)), "file": str(out / "vm" / "20260101-000000_procurement.set.json")}
    os.makedirs(out / "vm", exist_ok=True)
    for entry, status in zip(state["suites"], statuses):
        if status != mod.NOT_STARTED:
            entry["results"] = str(out / "vm" / f"20260101-000000_{entry['suite']}.parquet")
            json.dump({"status": status}, open(entry["results"].replace(".parquet", ".meta.json"), "w"))
        entry["status"] = status
    state["complete"] = all(s == "OK" for s in statuses)
    mod.save(state)
    return state["file"]


def test_the_newest_incomplete_set_is_resumed_unless_asked_otherwise(tmp_path, capsys):
    mod = driver()
    path = a_set(mod, tmp_path, ["OK", "INTERRUPTED"])
    chosen = mod.choose(args(tmp_path))
    assert chosen["file"] == path and [mod.action(e) for e in chosen["suites"]] == ["skip", "resume"]
    assert "# make procurement: resuming " in capsys.readouterr().out
    assert mod.choose(args(tmp_path, fresh=True))["file"] is None  # FRESH=1: a new set
    assert mod.choose(args(tmp_path, kvbench_args="--tokens 4096"))["file"] is None  # other ARGS: a new set
    assert f"RESUME={path} finishes that one" in capsys.readouterr().out


def test_a_finished_set_is_not_resumed(tmp_path, capsys):
    mod = driver()
    path = a_set(mod, tmp_path, ["OK", "OK"])
    assert mod.choose(args(tmp_path))["file"] is None  # the newest set ended: a new one starts
    assert mod.choose(args(tmp_path, resume=path)) is None
    assert "nothing to resume" in capsys.readouterr().err
    a_set(mod, tmp_path, ["INTERRUPTED", mod.NOT_STARTED])
    chosen = mod.choose(args(tmp_path, resume=path))
    assert [mod.action(e) for e in chosen["suites"]] == ["resume", "launch"]


def test_quick_runs_one_model_at_two_block_sizes_and_is_a_set_of_its_own(tmp_path, capsys):
    """QUICK=1: its per-suite flags come before ARGS (which still win), and a quick set is not resumed by a full run."""
    mod = driver()
    state = mod.new_set(args(tmp_path, quick=True, kvbench_args="-n 5"))
    cmd = mod.launch_cmd(argparse.Namespace(mpirun="mpiexec", progress="off"), state, state["suites"][0])
    tail = cmd[cmd.index("procurement") + 1:]
    assert tail == ["--progress", "off", "-o", str(tmp_path), *mod.QUICK["procurement"], "-n", "5"]
    over = mod.launch_cmd(argparse.Namespace(mpirun="mpiexec", progress="off"), state, state["suites"][1])
    assert over[over.index("procurement-overlap") + 1:] == ["--progress", "off", "-o", str(tmp_path), "-m",
                                                            "llama-3-8b", "-n", "5"]
    path = a_set(mod, tmp_path, ["OK", "INTERRUPTED"], quick=True)
    assert mod.choose(args(tmp_path))["file"] is None  # a full run does not finish a quick set
    assert mod.choose(args(tmp_path, quick=True))["file"] == path
