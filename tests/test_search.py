"""The budgeted search: halving, dedupe, fitting budget_s, dry runs, progress, Ctrl-C, resume."""

import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mla_tune import gpu as gpu_mod
from mla_tune.core import Shape, Variant
from mla_tune.tables.table import table_from_results
from mla_tune.tune.config import config_from_dict, load_config
from mla_tune.tune.results import read_results
from mla_tune.tune.schedule import DEFAULT_COSTS, BackendCost, CostModel, fit_plan, measured_costs
from mla_tune.tune.search import Timed, promote, ranked
from mla_tune.tune.sweep import SweepError, plan_candidates, run_sweep
from mla_tune.tune.worker import WorkerHandle
from tests.fakes import EXTRA_BACKENDS, capture, registered

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
BACKENDS = EXTRA_BACKENDS + ",fake_dup=tests.fakes.fake_dup"


@pytest.fixture(scope="module", autouse=True)
def fake_backends():
    """Register the fakes for this process and (through the environment) its workers."""
    with registered(BACKENDS):
        yield


# ---------------------------------------------------------------------- halving
def test_promote_keeps_the_best_fraction_each_backends_best_and_the_baseline_or_carried_seeds():
    timed = [Timed(f"triton(n={i})", "triton", 10.0 + i) for i in range(12)]
    timed += [Timed("flashinfer(k=a)", "flashinfer", 30.0), Timed("flashinfer(k=b)", "flashinfer", 31.0),
              Timed("torch(kv=bf16)", "torch", 90.0)]
    order, cut, n_must = promote(timed, keep=0.25, min_keep=3, baseline="torch")
    assert order[:2] == ["torch(kv=bf16)", "triton(n=0)"] and n_must == 2
    # ceil(0.25 * 15) = 4 best, plus flashinfer's best, plus the baseline
    assert set(order) == {"torch(kv=bf16)", "flashinfer(k=a)"} | {f"triton(n={i})" for i in range(4)}
    assert "flashinfer(k=b)" in cut and len(cut) + len(order) == 15
    few = promote(timed[:2], keep=0.25, min_keep=3, baseline="torch")
    assert len(few[0]) == 2 and few[1] == []  # never fewer than min_keep, never more than there are
    # the serving sweep's: no baseline or per-backend best, carried winners never cut, ties by Timed.rank
    timed = [Timed("b(x=1)", "b", 10.0, rank=3), Timed("a(x=9)", "a", 10.0, rank=1),
             Timed("a(x=2)", "a", 11.0, rank=0), Timed("c(x=1)", "c", 30.0, rank=2),
             Timed("a(x=3)", "a", 12.0, rank=4), Timed("b(x=2)", "b", 13.0, rank=5)]
    assert [t.text for t in ranked(timed)][:2] == ["a(x=9)", "b(x=1)"]  # a tie: rank, not text
    order, cut, n_must = promote(timed, keep=0.34, min_keep=1, baseline=None,
                                 carried=["c(x=1)", "z(x=0)"], each_backend=False)
    # ceil(0.34 * 6) = 3 best, plus the carried c (the slowest); z was never timed
    assert order == ["a(x=9)", "c(x=1)", "b(x=1)", "a(x=2)"] and n_must == 2
    assert cut == ["a(x=3)", "b(x=2)"]
    with_backends, _, _ = promote(timed, keep=0.34, min_keep=1, baseline=None)
    assert "c(x=1)" in with_backends  # the leaderboard's rule keeps c as its backend's best


def test_dedupe_hook_collapses_candidates_the_backend_calls_the_same_kernel():
    config = config_from_dict({
        "name": "dup", "rule": "leaderboard", "check_seeds": [1, 2], "calibration_seeds": [3],
        "timing": {"reps": 3, "prune_reps": 2, "prune_factor": 2}, "shapes": [{"batch": 2, "kv_len": 17}],
        "backends": {"torch": {}, "fake_dup": {"num_splits": [1, 2, 4], "ignored": [0, 1, 2]}}})
    planned = plan_candidates(config, gpu_mod.fake_platform("H200"))
    variants = planned.plan[Shape(2, 17)]
    dup = [v for v in variants if v.backend == "fake_dup"]
    assert [(v.get("num_splits"), v.get("ignored")) for v in dup] == [(1, 0), (2, 0), (4, 0)]
    assert planned.duplicates == 6 and len(variants) == 4


# ------------------------------------------------------------------ plan fitting
def test_a_budget_too_small_cuts_samples_then_candidates_keeping_baseline_and_families():
    costs = CostModel(dict(DEFAULT_COSTS), "defaults")
    args = dict(keep=0.25, min_keep=3, costs=costs, n_devices=1, precompile={"triton": True}, processes=4)
    plan = {shape: [Variant.make("torch", kv="bf16", q="bf16"),
                    *(Variant.make("triton", kv="fp8", q="bf16", num_splits=i) for i in range(200)),
                    *(Variant.make("triton", kv="bf16", q="bf16", num_splits=i) for i in range(3)),
                    Variant.make("flashinfer", kv="bf16", q="bf16", kernel="fa3")]
            for shape in (Shape(4, 1024), Shape(64, 8192))}
    roomy = fit_plan(plan, (5, 12, 30), budget_s=10_000, **args)
    assert roomy.rungs == (5, 12, 30) and not roomy.dropped and roomy.fits
    tight = fit_plan(plan, (5, 12, 30), budget_s=120, **args)
    again = fit_plan(plan, (5, 12, 30), budget_s=120, **args)
    assert tight.fits and tight.estimate.seconds <= 120
    assert tight.plan == again.plan  # deterministic: a seeded subsample
    for shape, variants in tight.plan.items():
        backends = [(v.backend, v.get("kv")) for v in variants]
        assert ("torch", "bf16") in backends and ("flashinfer", "bf16") in backends
        assert ("triton", "fp8") in backends and ("triton", "bf16") in backends  # every family kept
        # the largest family (200 fp8 triton) pays for the cut; the small one keeps all three
        assert sum(b == ("triton", "bf16") for b in backends) == 3
        assert len(tight.dropped[shape]) == 205 - len(variants)
    assert any("dropped to fit the budget" in n for n in tight.notes)


def test_a_first_call_jit_goes_to_first_s_observed_or_measured_and_an_old_results_file_builds_a_table():
    """The pre-search H200 results: FlashInfer JIT-compiled in the timed worker then, and the
    file, without rungs, still builds a table."""
    model = CostModel({"*": BackendCost(0.01, 0.005, 0.0, 0.0)}, "test")
    model.observe("flashinfer", 0, 5, 18.0, first_call=True)  # the JIT
    for _ in range(5):
        model.observe("flashinfer", 0, 5, 0.02, first_call=False)
    model.observe("flashinfer", 0, 5, 16.0, first_call=True)
    cost = model.cost("flashinfer")  # the usual cost left alone
    assert cost.rung0_s == pytest.approx(0.02) and cost.first_s == pytest.approx(17.0, abs=0.1)
    costs, n = measured_costs(DATA / "H200.pre-search.results.jsonl")
    assert n > 500
    assert costs["flashinfer"].first_s > 5  # FlashInfer's JIT, once per variant and class
    assert 0 < costs["triton"].rung0_s < 0.1
    header, records, _ = read_results(DATA / "H200.pre-search.results.jsonl")
    config = load_config(REPO / "configs" / "leaderboard.yaml")
    header = {**header, "config": {**header["config"], "hash": config.hash}}
    table = table_from_results(header, records, config)
    assert len(table["rows"]) == 8 and all(r["winner"] for r in table["rows"])
    assert all("rung0" not in r["candidates"] and "dropped" not in r["candidates"] for r in table["rows"])


def test_the_dry_run_plans_each_shape_per_rung_with_an_estimate_within_budget_and_writes_nothing(tmp_path):
    """The leaderboard's H200 plan, its estimate's basis the results beside --out, else the GPU's
    committed ones, else (MI355X: none yet) the defaults; MI355X's plan fits its budget."""
    console, buf = capture()
    summary = run_sweep(REPO / "configs" / "leaderboard.yaml", "H200", out=tmp_path / "H200.yaml",
                        dry_run=True, console=console)
    text = buf.getvalue()
    assert summary.dry_run and summary.table_path is None
    assert set(summary.plan) == {"4x1024", "4x8192", "32x1024", "32x8192", "64x1024", "64x8192", "256x1024", "256x8192"}
    for per_backend in summary.plan.values():
        assert per_backend["torch"] == ["torch(kv=bf16,q=bf16)"]
        # triton is planned (its candidates listed) or named unavailable with its reason
        assert per_backend.get("triton") or "triton" in summary.unavailable
    assert "8 shapes" in text and "planned for H200" in text and "256x8192" in text
    assert list(tmp_path.iterdir()) == []  # no lock, no results, no table
    assert "search: rungs [5, 12, 30] samples" in text
    n0, n1, n2 = summary.rung_plan["256x8192"]
    assert n0 > n1 > n2 >= 3 and f"per rung {n0} -> {n1} -> {n2}" in text
    assert re.search(r"estimated \d+ s: start \d+ s, compile \d+ s, first calls \d+ s, candidates \d+ s; "
                     r"fits the budget of 540 s", text)
    assert "estimate basis: measured from tables/H200.results.jsonl" in text
    shutil.copy(REPO / "tables" / "H200.results.jsonl", tmp_path / "H200.results.jsonl")
    console, buf = capture()
    run_sweep(REPO / "configs" / "leaderboard.yaml", "H200", out=tmp_path / "H200.yaml", dry_run=True, console=console)
    assert f"estimate basis: measured from {tmp_path / 'H200.results.jsonl'}" in buf.getvalue()
    console, buf = capture()
    summary = run_sweep(REPO / "configs" / "mi355x.yaml", "MI355X", out=Path("/nonexistent/MI355X.yaml"),
                        dry_run=True, console=console)
    budget = load_config(REPO / "configs" / "mi355x.yaml").budget_s
    assert summary.estimate_s <= budget
    assert f"fits the budget of {budget:.0f} s" in buf.getvalue()
    assert "estimate basis: defaults" in buf.getvalue()


# ------------------------------------------------------------- the budget, for real
def test_a_sweep_over_its_budget_ends_within_10_percent_of_it_says_how_plainly_and_plans_ahead(tmp_path):
    """The clock cuts candidates, the sweep ends within budget + 10%; without a terminal it
    prints a plain line per shape and rung; the next dry run plans from the measured costs."""
    config = DATA / "sweep_search_budget.yaml"
    console, buf = capture()
    t0 = time.monotonic()
    summary = run_sweep(config, "cpu", out=tmp_path / "cpu.yaml", console=console)
    wall_s, text = time.monotonic() - t0, buf.getvalue()
    budget = load_config(config).budget_s
    assert wall_s <= 1.1 * budget, f"the sweep took {wall_s:.1f} s against a budget of {budget} s"
    lines = [json.loads(x) for x in summary.results_path.read_text().splitlines()[1:]]
    finals = [r for r in lines if r["kind"] == "candidate"]
    decisions = [r for r in lines if r["kind"] == "rung"]
    not_run = sum(len(d["skipped"]) for d in decisions) + sum(d["cut_budget"] for d in decisions)
    assert not_run > 0  # the clock, not the plan, cut: the defaults said it fits
    assert len(finals) < 2 * 21
    assert set(summary.winners) == {"1x17", "2x17"}  # every shape still has a winner
    assert {r["backend"] for r in finals if r["status"] == "ok"} >= {"torch"}
    table = yaml.safe_load(summary.table_path.read_text())
    skipped = {(d["shape"]["batch"], d["shape"]["kv_len"]): len(d["skipped"]) for d in decisions if d["rung"] == 0}
    for row in table["rows"]:
        assert row["candidates"]["rung0"] >= row["candidates"]["rung1"] >= 1
        # what the clock left untimed at rung 0 is counted, and said (a resume with room times it)
        assert row["candidates"].get("skipped", 0) == skipped.get((row["batch"], row["kv_len"]), 0)
    assert ("skipped at rung 0 to fit the budget" in " ".join(text.split())) == (sum(skipped.values()) > 0)
    pattern = re.compile(r"^(1x17|2x17): rung [12]/2 done; \d+/\d+ candidates done; best [\d.]+ us \S+; "
                         r"elapsed \d+ s, ETA \d+ s$", re.M)
    assert {m.group(1) for m in pattern.finditer(text)} == {"1x17", "2x17"}
    assert "\x1b[" not in text  # no terminal codes
    console, buf = capture()
    dry = run_sweep(config, "cpu", out=summary.table_path, dry_run=True, console=console)
    assert f"estimate basis: measured from {summary.results_path}" in buf.getvalue()
    assert any("dropped to fit the budget" in n or "cut from" in n for n in dry.notes)


def test_a_resume_times_what_rung_0_skipped_decides_again_and_keeps_what_was_kept(tmp_path, monkeypatch):
    """The first run's clock (here: a stand-in) skips the variant fast at batch 2 and four others
    at rung 0; the resume times them, and its re-decided rungs find the fast one."""
    from mla_tune.tune.runner import DeviceRunner

    config, out = DATA / "sweep_reopen.yaml", tmp_path / "cpu.yaml"
    skip = {2, 3, 4, 5, 6}
    real = DeviceRunner._fits_rung0
    monkeypatch.setattr(DeviceRunner, "_fits_rung0",
                        lambda self, search, v, deadline: v.get("fast_for_batch") not in skip)
    first = run_sweep(config, "cpu", out=out, console=capture()[0])
    before = [json.loads(x) for x in first.results_path.read_text().splitlines()[1:]]
    (decision,) = [d for d in before if d["kind"] == "rung"]
    assert len(decision["skipped"]) == 5 and "fast_for_batch=2" not in first.winners["2x17"]["variant"]
    assert yaml.safe_load(first.table_path.read_text())["rows"][0]["candidates"]["skipped"] == 5
    monkeypatch.setattr(DeviceRunner, "_fits_rung0", real)
    console, buf = capture()
    again = run_sweep(config, "cpu", out=out, console=console)
    after = [json.loads(x) for x in again.results_path.read_text().splitlines()[1:]][len(before):]
    timed0 = {r["variant"] for r in after if r["kind"] == "step" and r["rung"] == 0}
    assert timed0 == set(decision["skipped"])  # the skipped ones only: the others' times stand
    (redone,) = [d for d in after if d["kind"] == "rung"]
    assert not redone["skipped"] and set(decision["kept"]) <= set(redone["kept"])
    ok_before = {r["variant"] for r in before if r["kind"] == "candidate" and r["status"] == "ok"}
    assert not ok_before & {r["variant"] for r in after if r["kind"] == "candidate"}  # not cut, not re-timed
    assert "fast_for_batch=2" in again.winners["2x17"]["variant"]
    row = yaml.safe_load(again.table_path.read_text())["rows"][0]
    assert "skipped" not in row["candidates"] and "skipped at rung 0" not in buf.getvalue()
    third = run_sweep(config, "cpu", out=out, console=capture()[0])  # nothing left: nothing re-opens
    assert third.results_path.read_text() == again.results_path.read_text()


def test_another_gpu_is_refused_from_its_name_before_any_worker_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_mod, "quick_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(WorkerHandle, "launch", lambda self: pytest.fail("a worker was started"))
    with pytest.raises(SweepError, match=r"this machine has an NVIDIA H200 \(H200\), not MI355X"):
        run_sweep(DATA / "sweep_torch.yaml", "MI355X", out=tmp_path / "MI355X.yaml", console=capture()[0])
    assert list(tmp_path.iterdir()) == []


def test_a_worker_reaped_from_two_threads_at_once_is_closed_once(tmp_path):
    """Ctrl-C and the runner thread may both reap the worker: the pipe is closed once."""
    closes = []
    gate = threading.Barrier(2)

    class Conn:
        def close(self):  # as slow as a real close can be, so that the other thread gets there
            time.sleep(0.002)
            closes.append(threading.get_ident())

    def reap(handle):
        gate.wait()
        handle.reap()

    for _ in range(20):
        handle = WorkerHandle(0, tmp_path / "w.log")
        handle._proc = SimpleNamespace(is_alive=lambda: False, join=lambda _timeout: None)
        handle._conn = Conn()
        closes.clear()
        with ThreadPoolExecutor(2) as pool:  # two threads: each waits at the barrier for the other
            list(pool.map(reap, [handle, handle]))
        assert len(closes) == 1 and handle._conn is None and handle._proc is None
