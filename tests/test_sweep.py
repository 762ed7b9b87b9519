"""The sweep end to end on the CPU: the torch baseline and fake backends that are correct,
wrong, raise, crash their worker, hang, or need a GPU; its lock (SweepLock), refusals, resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from mla_tune.backends import EXTRA_BACKENDS_ENV
from mla_tune.core import Shape, Variant
from mla_tune.tune.config import load_config
from mla_tune.tune.results import (
    ResultsError,
    SweepLock,
    candidate_key,
    lock_path_for,
    read_results,
)
from mla_tune.tune.sweep import SweepError, assign_shapes, run_sweep
from tests.fakes import EXTRA_BACKENDS, capture, registered
from tests.helpers import REPO, sigint_as_in_a_terminal

DATA = REPO / "tests" / "data"
TINY, BUDGET, TORCH = (DATA / f"sweep_{n}.yaml" for n in ("tiny", "budget", "torch"))


@pytest.fixture(scope="module", autouse=True)
def fake_backends():
    """Register the fakes for this process and (through the environment) its workers."""
    with registered(EXTRA_BACKENDS):
        yield


def test_every_outcome_is_recorded_with_a_reason_the_fastest_wins_and_the_header_names_the_timer(tmp_path):
    """The dry run lists the candidates of a backend that only lacks the GPU; every outcome is
    recorded with its status and a reason (an out-of-memory one costs only itself); the ok
    candidates passed every seed, the fastest wins each shape, an fp8_static one is built with a
    calibrated q_amax; the header carries the provenance and names the CPU timer."""
    console, buf = capture()
    summary = run_sweep(TINY, "H200", out=tmp_path / "t.yaml", dry_run=True, console=console)
    assert summary.plan["2x17"]["fake_nogpu"] == [f"fake_nogpu(kv=bf16,num_splits={n},q=bf16)" for n in (1, 2)]
    assert "needs a GPU" in summary.unavailable["fake_nogpu"]
    assert "not runnable here" in buf.getvalue()
    assert summary.plan["1x33"].get("fake_crash") is None  # it offers nothing at batch 1
    console, buf = capture()
    summary = run_sweep(TINY, "cpu", out=tmp_path / "cpu.yaml", console=console, candidate_timeout_s=4)
    header, records, warnings = read_results(summary.results_path)
    text = buf.getvalue()
    assert not warnings
    got = {(r["shape"]["batch"], r["backend"]): r["status"] for r in records if r["backend"] != "fake_ok"}
    assert got == {(2, "torch"): "ok", (1, "torch"): "ok", (2, "fake_wrong"): "rejected", (1, "fake_wrong"): "rejected",
                   (2, "fake_raise"): "failed", (1, "fake_raise"): "failed", (2, "fake_crash"): "crashed",
                   (2, "fake_hang"): "timeout", (1, "fake_poison"): "failed"}
    # rungs [2, 3] (the timing's defaults): of 4 timed per shape the best 3 (min_keep) and
    # the baseline go on; a cut fake_ok is "pruned" with its rung-0 time
    fake_ok = [r for r in records if r["backend"] == "fake_ok"]
    assert len(fake_ok) == 6 and {r["status"] for r in fake_ok} <= {"ok", "pruned"}
    n_pruned = sum(r["status"] == "pruned" for r in fake_ok)
    assert summary.counts == {"ok": 8 - n_pruned, "rejected": 2, "failed": 3, "crashed": 1, "timeout": 1,
                              "pruned": n_pruned}
    for r in records:
        assert (r["reason"] == "") == (r["status"] == "ok"), r
        assert r["device"] == 0 and r["elapsed_s"] >= 0
    reasons = {r["variant"].split("(")[0] + ":" + r["status"]: r["reason"] for r in records}
    assert "outside rtol=0.1" in reasons["fake_wrong:rejected"]
    assert reasons["fake_raise:failed"].startswith("RuntimeError: fake_raise: this variant does not compile")
    assert "exit code 139" in reasons["fake_crash:crashed"]
    assert "4 s limit" in reasons["fake_hang:timeout"]
    assert reasons["fake_poison:failed"].startswith("RuntimeError: CUDA error: an illegal memory access")
    crash = next(r for r in records if r["status"] == "crashed")
    assert "fake_crash: simulating a segfault" in crash["stderr_tail"]
    assert "crashed: 2x17 fake_crash" in text and "timeout: 2x17 fake_hang" in text
    # the poisoned worker left, and the candidates after it ran on a fresh one
    log = (summary.results_path.parent / "cpu.worker0.log").read_text()
    assert "exiting after a context-poisoning error" in log
    at_rung0 = [r for r in records if r["shape"]["batch"] == 1 and r["rung"] == 0 and r["status"] != "pruned"]
    assert [(r["backend"], r["status"]) for r in at_rung0] == [
        ("fake_poison", "failed"), ("fake_wrong", "rejected"), ("fake_raise", "failed")]
    for r in records:
        if r["status"] == "ok":
            assert [c["seed"] for c in r["checks"]] == [1001, 2002]
            assert all(c["passed"] and c["mismatch"] <= 0.025 for c in r["checks"])
            assert r["time"]["samples"] == 3 and r["wall"]["samples"] == 3
    fast = "fake_ok(delay_us=20000,fast_for_batch={},kv=fp8,q=bf16)"
    assert summary.winners["2x17"]["variant"] == fast.format(2)
    assert summary.winners["1x33"]["variant"] == fast.format(1)
    # what a rung cut was slow against the fast one: pruned, its rung-0 time kept
    pruned = [r for r in records if r["status"] == "pruned"]
    assert {r["backend"] for r in pruned} <= {"fake_ok"} and all(r["time"]["median_us"] > 15000 for r in pruned)
    assert all(r["rung"] == 0 and "not among the" in r["reason"] for r in pruned)
    assert "sweep summary" in text and fast.format(2) in text
    static = [r for r in records if r["params"].get("q") == "fp8_static"]
    assert len(static) == 2
    for r in static:
        q_amax = r["params"]["q_amax"]
        assert f"q_amax={q_amax}" in r["variant"]
        assert r["calibration"]["seeds"] == [11, 12] and "x 1.1" in r["calibration"]["method"]
        assert q_amax == pytest.approx(r["calibration"]["observed_amax"] * 1.1, rel=1e-3)
        assert r["status"] in ("ok", "pruned")  # fake_ok raises when q_amax is missing
    config = load_config(TINY)
    assert header["schema"] == 1
    assert header["config"]["hash"] == config.hash and header["config"]["path"] == str(TINY)
    assert header["rule"] == config.rule.as_dict()
    assert header["protocol"]["name"] == "cpu-wall-clock"
    assert header["copy_bandwidth_gbps"] is None
    assert header["unavailable"] == {"fake_nogpu": "fake_nogpu needs a GPU; this machine has none"}
    assert header["platform"]["versions"]["torch"] == torch.__version__
    assert header["date"].startswith("20") and header["mla_tune_version"]
    summary = run_sweep(DATA / "sweep_oom.yaml", "cpu", out=tmp_path / "oom" / "cpu.yaml",
                        console=capture()[0], candidate_timeout_s=30)
    by_backend = {r["backend"]: r for r in read_results(summary.results_path)[1]}
    assert by_backend["fake_oom"]["status"] == "failed"
    assert by_backend["fake_oom"]["reason"].startswith("OutOfMemoryError: fake_oom: CUDA out of memory")
    assert by_backend["torch"]["status"] == "ok"  # ran after it, in the same sweep
    assert summary.winners["1x17"]["variant"].startswith("torch(")


# ------------------------------------------------------------------- refusals, lock
def test_another_configs_results_or_a_table_another_sweep_holds_is_refused_and_fresh_moves_them(tmp_path):
    results = tmp_path / "cpu.results.jsonl"
    old = json.dumps({"kind": "header", "config": {"path": "old.yaml", "hash": "0" * 64}}) + "\n"
    results.write_text(old)
    with pytest.raises(SweepError, match="another config .*--fresh"):
        run_sweep(TORCH, "cpu", out=tmp_path / "cpu.yaml", console=capture()[0])
    assert results.read_text() == old
    summary = run_sweep(TORCH, "cpu", out=tmp_path / "cpu.yaml", fresh=True, console=capture()[0])
    aside = list(tmp_path.glob("cpu.results.jsonl.*.old"))
    assert len(aside) == 1 and aside[0].read_text() == old
    header, records, _ = read_results(results)
    assert header["config"]["hash"] == load_config(TORCH).hash
    assert [r["status"] for r in records] == ["ok"] and summary.counts["ok"] == 1
    assert summary.winners["2x9"]["variant"] == "torch(kv=bf16,q=bf16)"
    lock = lock_path_for(tmp_path / "cpu.yaml")
    assert lock == lock_path_for(tmp_path / "cpu") == tmp_path / "cpu.results.jsonl.lock"  # one results file, one lock
    lock.write_text(f"{os.getpid()}\n")  # a live process holds it
    with pytest.raises(SweepError, match=f"another sweep \\(pid {os.getpid()}\\) holds"):
        run_sweep(TORCH, "cpu", out=tmp_path / "cpu.yaml", console=capture()[0])
    assert lock.read_text().strip() == str(os.getpid())  # the refused sweep left it alone


# a sweep that only holds the lock a moment, through run_sweep's real lock handling
_RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from types import SimpleNamespace
    import mla_tune.tune.sweep as sweep
    from mla_tune.tune.sweep import SweepError, run_sweep

    def hold(*args, **kwargs):
        print("RAN", flush=True)
        time.sleep(1.5)
        return SimpleNamespace(stopped=False)

    sweep._sweep = hold
    ready, config, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (ready / str(os.getpid())).touch()
    while len(list(ready.iterdir())) < 2:  # both imported: go at the same moment
        pass
    try:
        run_sweep(config, "cpu", out=out)
    except SweepError as exc:
        print(f"REFUSED {exc}", flush=True)
        sys.exit(1)
""")


def test_two_sweeps_started_together_exactly_one_runs_the_other_names_lock_and_pid(tmp_path):
    out = tmp_path / "cpu.yaml"
    lock = lock_path_for(out)
    lock.write_text("")  # what a sweep killed between creating and writing it leaves
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(ready), str(TORCH), str(out)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60) for p in procs]
    by_code = {p.returncode: (p, stdout) for p, (stdout, _) in zip(procs, outputs, strict=True)}
    assert sorted(by_code) == [0, 1], outputs
    (winner, ran), (_, refused) = by_code[0], by_code[1]
    assert ran.strip() == "RAN"
    lines = refused.strip().splitlines()
    assert len(lines) == 1, refused
    assert str(lock) in lines[0] and f"pid {winner.pid}" in lines[0], lines[0]
    assert not lock.exists()  # the winner removed it on the way out


@pytest.mark.parametrize("write_pid", [False, True], ids=["pid-not-yet-written", "pid-written"])
def test_a_live_holder_is_never_taken_over_and_a_killed_ones_lock_is_with_a_warning_naming_its_pid(tmp_path, write_pid):
    """The holder, a process holding the flock (no torch: fast), before its pid is written (the
    file just created) or after (what SweepLock.acquire leaves)."""
    path = tmp_path / "t.yaml.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if {write_pid}:
            os.write(fd, f"{{os.getpid()}}\\n".encode())
        print("held", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert path.read_text() == (f"{holder.pid}\n" if write_pid else "")
        with pytest.raises(ResultsError, match="another sweep .* holds the lock"):
            SweepLock(path).acquire()
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    lock = SweepLock(path).acquire()  # the holder died: its flock went with it
    if write_pid:
        assert "stale lock" in lock.warning and f"left by pid {holder.pid}" in lock.warning
    else:
        assert lock.warning is None
    assert path.read_text().strip() == str(os.getpid())
    with pytest.raises(ResultsError, match=f"pid {os.getpid()}"):
        SweepLock(path).acquire()  # a second sweep in this very process is refused too
    lock.release()
    assert not path.exists()


# --------------------------------------------------------------- multi device, budget
def test_a_candidate_the_budgets_hard_deadline_kills_is_not_recorded_and_a_resume_runs_it(tmp_path):
    """A candidate cut by the budget's deadline leaves no record (it is no timeout); the sweep stops
    naming the command that resumes it, and the resume times it under its own limit."""
    out = tmp_path / "cpu.yaml"
    console, buf = capture()
    summary = run_sweep(DATA / "sweep_hang_budget.yaml", "cpu", out=out, console=console)
    lines = [json.loads(line) for line in summary.results_path.read_text().splitlines()]
    timed = [r["variant"].split("(")[0] for r in lines if r["kind"] in ("step", "candidate")]
    assert summary.stopped and timed == ["torch"]  # the baseline ran; the hung candidate left no line
    text = " ".join(buf.getvalue().split())
    assert "fake_hang(kv=bf16,q=bf16) was still running at the budget's hard deadline; it is not recorded" in text
    assert f"resume with: mla-tune sweep --gpu cpu --config {DATA / 'sweep_hang_budget.yaml'} --out {out}" in text
    again = run_sweep(DATA / "sweep_hang_budget.yaml", "cpu", out=out, console=capture()[0], budget_s=60,
                      candidate_timeout_s=2)
    _, records, _ = read_results(again.results_path)
    hang = [r for r in records if r["kind"] == "candidate" and r["backend"] == "fake_hang"]
    assert not again.stopped and len(hang) == 1 and hang[0]["status"] == "timeout"
    assert "the 2 s limit" in hang[0]["reason"]


def test_two_devices_share_the_shapes_whole_and_balanced_an_impossible_budget_keeps_the_baseline(tmp_path):
    v = [Variant.make("torch", kv="bf16", q="bf16")]
    pending = {Shape(256, 8192): v, Shape(4, 1024): v, Shape(64, 8192): v, Shape(32, 1024): v * 0}
    one, two = assign_shapes(pending, 2)
    assert [s for s, _ in one] == [Shape(256, 8192)]
    assert [s for s, _ in two] == [Shape(64, 8192), Shape(4, 1024)]  # empty shapes dropped
    assert assign_shapes(pending, 1) == [[(s, vs) for s, vs in pending.items() if vs]]
    console, buf = capture()
    summary = run_sweep(BUDGET, "H200", out=tmp_path / "H200.yaml", devices=[0, 1], force=True, console=console)
    header, records, _ = read_results(summary.results_path)
    assert header["gpu"] == "cpu" and header["requested_gpu"] == "H200" and header["forced"] is True
    assert header["devices"] == [0, 1]
    assert {r["device"] for r in records} == {0, 1}
    for shape in ({"batch": b, "kv_len": n} for b, n in ((1, 17), (2, 17), (3, 9), (4, 5))):
        assert len({r["device"] for r in records if r["shape"] == shape}) == 1  # one device per shape
    # budget_s 0.001: the samples go to the floor, then each family keeps one candidate, and
    # the clock lets nothing but the baseline start; every shape still gets a winner
    search = header["search"]
    assert search["configured_rungs"] == [2, 3, 8] and search["rungs"] == [2, 3, 5]
    assert not search["fits"] and any("dropped to fit the budget" in n for n in search["notes"])
    assert all(len(v) == 3 for v in search["dropped"].values())  # 4 fake_ok, one family: 1 kept
    assert "dropped to fit the budget" in buf.getvalue()
    assert {r["backend"] for r in records} == {"torch"} and len(records) == 4
    assert all(r["time"]["samples"] == 5 and r["budget_reduced"] for r in records)
    assert all(len(r["checks"]) == 2 for r in records)  # the gate in full
    assert set(summary.winners) == {"1x17", "2x17", "3x9", "4x5"}
    table = yaml.safe_load(summary.table_path.read_text())
    assert all(row["candidates"]["dropped"] == 3 for row in table["rows"])


# ----------------------------------------------------------------------------- resume
def _lines(path: Path) -> list[dict]:
    """Every record after the header, a torn last line left out."""
    return read_results(path, ("candidate", "step", "rung", "note"))[1]


def test_a_ctrl_c_mid_rung_0_stops_the_workers_and_the_same_command_resumes_running_no_step_twice(tmp_path):
    """A Ctrl-C stops the workers, prints how to resume and leaves no lock; the same command
    then resumes. A kill -9 (mid rung 1: its stale lock, its torn line) is
    tests/test_crash_resume.py's."""
    config = DATA / "sweep_interrupt.yaml"
    out = tmp_path / "cpu.yaml"
    results = tmp_path / "cpu.results.jsonl"
    env = {**os.environ, EXTRA_BACKENDS_ENV: EXTRA_BACKENDS, "PYTHONPATH": str(REPO), "COLUMNS": "400"}
    proc = subprocess.Popen([sys.executable, "-m", "mla_tune", "sweep", "--gpu", "cpu", "--config",
                             str(config), "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=sigint_as_in_a_terminal)
    deadline = time.monotonic() + 120
    while len(_lines(results)) < 2:
        assert proc.poll() is None, f"the sweep ended early: {proc.stdout.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "the sweep wrote too few records in 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0].decode()
    before = _lines(results)
    assert sum(r["kind"] == "candidate" and r["status"] == "ok" and r["rung"] == 1 for r in before) < 8
    assert proc.returncode == 130, output
    line = [x for x in output.splitlines() if x.startswith("interrupted:")]
    assert len(line) == 1, output
    assert f"kept in {results}" in line[0]
    assert line[0].endswith(f"resume with: mla-tune sweep --gpu cpu --config {config} --out {out}")
    assert "Traceback" not in output
    assert not (tmp_path / "cpu.results.jsonl.lock").exists()
    log = (tmp_path / "cpu.worker0.log").read_text()
    assert "KeyboardInterrupt" not in log  # the worker ignored it; the sweep stopped it
    assert read_results(results, kinds=("candidate", "step", "rung"))[2] == []  # no warnings

    summary = run_sweep(config, "cpu", out=out, console=capture()[0])
    lines = _lines(results)
    steps = [(r["kind"], r["rung"], *candidate_key(r["shape"], r["variant"])) for r in lines if r["kind"] == "step"]
    assert len(steps) == len(set(steps))  # no step ran twice
    decisions = [(r["shape"]["batch"], r["rung"]) for r in lines if r["kind"] == "rung"]
    assert sorted(decisions) == [(1, 0), (2, 0)]
    finals = [candidate_key(r["shape"], r["variant"]) for r in lines if r["kind"] == "candidate"]
    assert len(finals) == len(set(finals)) == 8  # each candidate ends exactly once
    assert sum(r["kind"] == "step" for r in lines) == 8  # each passed rung 0 once
    assert set(summary.winners) == {"2x17", "1x33"}
    # the key a resume matches records by drops the calibrated q_amax
    offered = Variant.make("triton", q="fp8_static", kv="fp8", num_splits=4)
    built = offered.with_params(q_amax=4.3)
    shape = {"batch": 4, "kv_len": 1024}
    assert candidate_key(shape, str(built)) == candidate_key(shape, str(offered)) == (4, 1024, str(offered))
