"""Crash safety end to end (tests/crash_resume.py) and the fake_oob backend."""

import json

import pytest
import torch

from mla_tune.backends import EXTRA_BACKENDS_ENV
from mla_tune.core import Shape
from tests import crash_resume
from tests.fakes import EXTRA_BACKENDS, fake_oob
from tests.helpers import REPO

DATA = REPO / "tests" / "data"
CPU_CONFIG = DATA / "resume_demo_cpu.yaml"
GPU_CONFIG = DATA / "resume_demo_gpu.yaml"
EXPECTED_CHECKS = ("B was killed halfway", "B2 took over the stale lock", "B2 dropped the torn last line",
                   "every candidate of A is in B exactly once",
                   "B's first lines are byte-identical to those written before the kill",
                   "A: candidates after the crash still ran", "B: candidates after the crash still ran")


def _passed(demo: crash_resume.Demo, code: int) -> dict:
    """The report, once every check passed (else the failed checks and the logs' tails)."""
    report = json.loads(demo.report.read_text())
    failed = [c for c in report["checks"] if not c["passed"]]
    assert code == 0 and report["passed"] and not failed, json.dumps(
        {"failed": failed, "logs": report["log_tails"]}, indent=1)[-6000:]
    assert {c["check"] for c in report["checks"]} >= set(EXPECTED_CHECKS)
    kill = report["steps"]["b_killed"]
    assert kill["lock_left"] and kill["stragglers"] == [] and kill["torn_tail"] != "none"
    return report


# ----------------------------------------------------------------- the demo, end to end
def test_a_sweep_killed_halfway_resumes_to_the_uninterrupted_sweeps_results_and_winners(tmp_path, capsys):
    demo = crash_resume.Demo(gpu="cpu", config=CPU_CONFIG, out=tmp_path / "demo", extra_backends=EXTRA_BACKENDS,
                             crash_backend="fake_crash", candidate_timeout=20, deadline=400)
    report = _passed(demo, crash_resume.run(demo))
    assert 0 < report["steps"]["b_killed"]["lines_at_kill"] < 13
    for crash in report["crash_records"].values():
        assert crash["status"] == "crashed" and "worker died (exit code 139)" in crash["reason"]
    shapes = {s["shape"]: s for s in report["shapes"]}
    assert set(shapes) == {"1x33", "2x17", "3x9"}
    for name, s in shapes.items():
        batch = int(name.split("x")[0])
        assert s["compared"] and s["same"] and s["gap"] > 0.10
        assert s["a_winner"] == f"fake_ok(delay_us=30000,fast_for_batch={batch},kv=fp8,q=bf16)"
    # the table comes last, then the verdict
    tail = capsys.readouterr().out.strip().splitlines()
    assert tail[-1].startswith("PASS: ") and "0 failed" in tail[-1]
    assert any(line.startswith("3x9 ") and "yes" in line for line in tail[-6:])
    assert (demo.out / "a" / "sweep.log").exists() and (demo.out / "b" / "sweep_resumed.log").exists()


@pytest.mark.gpu
def test_on_the_gpu_an_out_of_bounds_candidate_and_a_kill_halfway_leave_the_results_and_winners(tmp_path):
    """fake_oob (a Triton store 2**47 bytes past its buffer) is recorded as failed in A and B."""
    from mla_tune import gpu

    demo = crash_resume.Demo(gpu=gpu.detect().name, config=GPU_CONFIG, out=tmp_path / "demo", deadline=400)
    report = _passed(demo, crash_resume.run(demo))
    for crash in report["crash_records"].values():
        assert crash["status"] in ("crashed", "failed") and crash_resume.CRASH_REASON.search(crash["reason"])
    assert any(s["compared"] for s in report["shapes"]) and all(s["same"] for s in report["shapes"] if s["compared"])


def test_the_demo_refuses_an_out_folder_holding_an_earlier_run_and_a_kill_point_outside_0_1(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "cpu.results.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="would resume, not start fresh"):
        crash_resume.Demo(gpu="cpu", config=CPU_CONFIG, out=tmp_path)
    with pytest.raises(ValueError, match="kill_after must lie strictly between 0 and 1"):
        crash_resume.Demo(gpu="cpu", config=CPU_CONFIG, out=tmp_path / "x", kill_after=1.5)
    with pytest.raises(ValueError, match="is not a file"):
        crash_resume.Demo(gpu="cpu", config=tmp_path / "none.yaml", out=tmp_path / "x")


def test_the_demo_adds_its_backends_to_those_already_registered(monkeypatch):
    monkeypatch.setenv(EXTRA_BACKENDS_ENV, "fake_ok=tests.fakes.fake_ok")
    env = crash_resume.sweep_env("fake_oob=tests.fakes.fake_oob")
    assert env[EXTRA_BACKENDS_ENV] == "fake_ok=tests.fakes.fake_ok,fake_oob=tests.fakes.fake_oob"
    assert env["PYTHONPATH"].split(":")[0] == str(REPO)


# ------------------------------------------------------------------------- fake_oob
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fake_oob_says_in_a_sentence_why_it_cannot_run_on_the_cpu_and_refuses_to_build():
    reason = fake_oob.unavailable_reason()
    assert isinstance(reason, str) and reason.startswith("fake_oob needs a CUDA GPU")
    assert "segfault or corrupt memory" in reason
    variant = fake_oob.candidates(Shape(32, 8192), {}, None)[0]
    assert str(variant) == "fake_oob(kv=bf16,q=bf16)"
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        fake_oob.build(variant, Shape(32, 8192), "cpu")


def test_fake_oob_is_offered_only_at_the_batches_its_space_names():
    assert fake_oob.candidates(Shape(4, 1024), {"batches": [32]}, None) == []
    assert len(fake_oob.candidates(Shape(32, 8192), {"batches": [32]}, None)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check of the kernel body")
def test_the_oob_kernel_stores_zeros_at_the_offset_it_is_given():
    # in bounds, under the interpreter: the same kernel the runner sends 2**47 bytes away
    out = torch.ones(2 * 16 * 512, dtype=torch.bfloat16)
    fake_oob.oob_store(out, 96)
    assert out[96:112].eq(0).all() and out[:96].eq(1).all() and out[112:].eq(1).all()
