"""Crash safety end to end, and the fake_oob backend: a sweep with an injected crashing
candidate, killed with kill -9 halfway and started again, keeps every other result and the
uninterrupted sweep's clear winners.

A: the sweep, uninterrupted; B: the same sweep SIGKILLed (its whole process group) at half of
A's candidates, a torn line appended where the kill left none, then the same command again,
which resumes.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from mla_tune.backends import EXTRA_BACKENDS_ENV
from mla_tune.core import Shape
from mla_tune.tune.results import candidate_key, lock_path_for, read_results, results_path_for
from tests.fakes import EXTRA_BACKENDS, fake_oob
from tests.helpers import REPO

DATA = REPO / "tests" / "data"
CLEAR_GAP = 0.10  # a winner this much faster than its runner-up must win the resumed sweep too
CRASH_REASON = re.compile(r"illegal|worker died|launch failure", re.IGNORECASE)
TORN_LINE = b'{"kind": "candidate", "shape": {"ba'  # what a kill in the middle of a write leaves
SWEEP_MAIN = "from mla_tune.cli import app; app()"  # mla_tune.cli has no __main__ guard


def _key(record: dict) -> tuple[int, int, str]:
    return candidate_key(record["shape"], record["variant"])


def _candidate_lines(results: Path) -> int:
    """Complete candidate lines in a results file (a torn last line is not counted)."""
    data = results.read_bytes() if results.exists() else b""
    return sum(b'"kind": "candidate"' in line for line in data.split(b"\n")[:-1])


def _sweep(args: list[str], env: dict, log: Path, deadline: float, kill_at: int = 0) -> str:
    """`mla-tune sweep ARGS` in its own process group, its output in `log` (returned, its
    whitespace collapsed); with kill_at, SIGKILL to the group at that many candidate lines."""
    results = results_path_for(Path(args[args.index("--out") + 1]))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SWEEP_MAIN, "sweep", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while kill_at and _candidate_lines(results) < kill_at:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            if kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text(errors="replace")
    assert code == (-signal.SIGKILL if kill_at else 0), text[-3000:]
    return " ".join(text.split())


def _crash(records: list[dict], backend: str) -> dict:
    """The injected candidate is crashed or failed with a telling reason, and ok ones follow it."""
    index = next(i for i, r in enumerate(records) if r["backend"] == backend)
    crash = records[index]
    assert crash["status"] in ("crashed", "failed") and CRASH_REASON.search(crash["reason"]), crash
    assert any(r["status"] == "ok" for r in records[index + 1 :])  # candidates after it still ran
    return crash


def _winners(table_a: Path, table_b: Path) -> dict[str, dict]:
    """Per shape of A: its winner, its lead over its runner-up, and whether B has that winner."""
    rows_b = {(r["batch"], r["kv_len"]): r for r in yaml.safe_load(table_b.read_text())["rows"]}
    shapes = {}
    for row in yaml.safe_load(table_a.read_text())["rows"]:
        shape, runner = {"batch": row["batch"], "kv_len": row["kv_len"]}, row.get("runner_up")
        a_win, b_win = row["winner"], rows_b[(row["batch"], row["kv_len"])]["winner"]
        gap = runner["time_us"] / row["time_us"] - 1.0 if a_win and runner and row["time_us"] else None
        same = bool(a_win and b_win) and (
            candidate_key(shape, a_win["variant"]) == candidate_key(shape, b_win["variant"]))
        name = f"{row['batch']}x{row['kv_len']}"
        shapes[name] = {"a_winner": a_win and a_win["variant"], "gap": gap, "same": same,
                        "compared": gap is not None and gap > CLEAR_GAP}
        assert same or not shapes[name]["compared"], f"{name}: B lost A's clear winner: {shapes[name]}"
    return shapes


def _kill_and_resume(out: Path, gpu: str, config: Path, extra_backends: str, crash_backend: str,
                     candidate_timeout: float | None = None) -> SimpleNamespace:
    """A, then B killed halfway and resumed (module docstring), checked as every run must be."""
    deadline = time.monotonic() + 400
    env = {**os.environ, EXTRA_BACKENDS_ENV: extra_backends, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200"}  # rich wraps at 80 columns in a log file otherwise
    tables = {run: out / run / f"{gpu}.yaml" for run in ("a", "b")}
    for table in tables.values():
        table.parent.mkdir(parents=True)
    common = ["--gpu", gpu, "--config", str(config)]
    if candidate_timeout is not None:
        common += ["--candidate-timeout", str(candidate_timeout)]
    _sweep([*common, "--out", str(tables["a"])], env, out / "a" / "sweep.log", deadline)
    a_records = read_results(results_path_for(tables["a"]))[1]
    assert len(a_records) >= 2, "A needs at least 2 candidates to kill one halfway"
    target = min(len(a_records) - 1, max(1, int(0.5 * len(a_records) + 0.5)))

    b_results = results_path_for(tables["b"])
    b_args = [*common, "--out", str(tables["b"])]
    _sweep(b_args, env, out / "b" / "sweep_killed.log", deadline, kill_at=target)
    lines_at_kill = _candidate_lines(b_results)
    assert 0 < lines_at_kill < len(a_records)  # killed halfway
    assert lock_path_for(tables["b"]).exists()  # the killed sweep left its lock behind
    snapshot = b_results.read_bytes()
    kept = snapshot[: snapshot.rfind(b"\n") + 1]
    if snapshot == kept:  # the kill landed between writes: torn as if it had not
        with open(b_results, "ab") as f:
            f.write(TORN_LINE)
    text = _sweep(b_args, env, out / "b" / "sweep_resumed.log", deadline)
    assert "stale lock" in text and "truncated last line" in text, text[-3000:]
    assert f"{lines_at_kill} already recorded" in text, text[-3000:]  # resumed, not started over
    assert not lock_path_for(tables["b"]).exists()

    _, b_records, warnings = read_results(b_results)
    assert not warnings
    assert b_results.read_bytes().startswith(kept)  # what was recorded stays as it was
    assert sorted(map(_key, b_records)) == sorted(set(map(_key, a_records)))  # each exactly once
    lines = read_results(b_results, ("step", "rung"))[1]
    steps = [(r["rung"], *_key(r)) for r in lines if r["kind"] == "step"]
    assert len(steps) == len(set(steps))  # no step ran twice
    decisions = [(r["shape"]["batch"], r["shape"]["kv_len"], r["rung"]) for r in lines if r["kind"] == "rung"]
    assert len(decisions) == len(set(decisions))  # each rung decided once
    return SimpleNamespace(lines_at_kill=lines_at_kill, decisions=decisions,
                           crashes=[_crash(records, crash_backend) for records in (a_records, b_records)],
                           shapes=_winners(tables["a"], tables["b"]))


def test_a_sweep_killed_halfway_resumes_to_the_uninterrupted_sweeps_results_and_winners(tmp_path):
    run = _kill_and_resume(tmp_path, "cpu", DATA / "resume_demo_cpu.yaml", EXTRA_BACKENDS,
                           "fake_crash", candidate_timeout=20)
    assert 0 < run.lines_at_kill < 13
    assert sorted(run.decisions) == [(1, 33, 0), (2, 17, 0), (3, 9, 0)]
    for crash in run.crashes:
        assert crash["status"] == "crashed" and "worker died (exit code 139)" in crash["reason"]
    assert set(run.shapes) == {"1x33", "2x17", "3x9"}
    for name, s in run.shapes.items():
        batch = int(name.split("x")[0])
        assert s["compared"] and s["same"] and s["gap"] > CLEAR_GAP
        assert s["a_winner"] == f"fake_ok(delay_us=30000,fast_for_batch={batch},kv=fp8,q=bf16)"


@pytest.mark.gpu
def test_on_the_gpu_an_out_of_bounds_candidate_and_a_kill_halfway_leave_the_results_and_winners(tmp_path):
    """fake_oob (a Triton store 2**47 bytes past its buffer) is recorded as failed in A and B."""
    from mla_tune import gpu

    run = _kill_and_resume(tmp_path, gpu.detect().name, DATA / "resume_demo_gpu.yaml",
                           "fake_oob=tests.fakes.fake_oob", "fake_oob")
    assert any(s["compared"] for s in run.shapes.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal, runs the kernel interpreted")
def test_fake_oob_is_offered_at_its_batches_says_why_it_cannot_build_on_the_cpu_and_stores_zeros_there():
    reason = fake_oob.unavailable_reason()
    assert reason.startswith("fake_oob needs a CUDA GPU")
    assert "segfault or corrupt memory" in reason
    assert fake_oob.candidates(Shape(4, 1024), {"batches": [32]}, None) == []
    (variant,) = fake_oob.candidates(Shape(32, 8192), {"batches": [32]}, None)
    assert fake_oob.candidates(Shape(32, 8192), {}, None) == [variant]
    assert str(variant) == "fake_oob(kv=bf16,q=bf16)"
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        fake_oob.build(variant, Shape(32, 8192), "cpu")
    # its kernel in bounds, under the interpreter: the same kernel the runner sends 2**47 bytes away
    out = torch.ones(2 * 16 * 512, dtype=torch.bfloat16)
    fake_oob.oob_store(out, 96)
    assert out[96:112].eq(0).all() and out[:96].eq(1).all() and out[112:].eq(1).all()
