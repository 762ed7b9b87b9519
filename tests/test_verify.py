"""`mla-tune verify` (mla_tune/serving/verify.py) on a tiny config, a made-up table whose picks
are known and a made-up timer, so that the regrets are known."""

import copy
import dataclasses
import json
import math

import pytest
import yaml

from mla_tune.backends import EXTRA_BACKENDS_ENV, get_backend
from mla_tune.core import Variant
from mla_tune.gpu import detect
from mla_tune.serving import verify as vf
from mla_tune.serving.call import Decoder
from mla_tune.serving.cells import family_plan
from mla_tune.serving.config import load_serving_config, serving_config_from_dict
from mla_tune.serving.table import (
    Cell,
    Family,
    GraphPick,
    ServingTable,
    load_serving_table,
    write_serving_table,
)
from mla_tune.tune import timing
from mla_tune.tune.timing import Timing
from tests.helpers import invoke
from tests.serving_timers import TINY as SWEEP_TINY

TINY = {**copy.deepcopy(SWEEP_TINY), "name": "tiny-verify", "batch_buckets": [2, 4]}
# Made-up times per sequence: the fused kernel C is the best correct candidate; the table's
# eager pick A is 10% slower, its graph pick B 30%, the fallback F twice; W (wrong_serving)
# is fastest but its output is wrong, so it can never be the best.
PER_SEQUENCE_US = {"A": 11.0, "B": 13.0, "C": 10.0, "F": 20.0, "W": 5.0}


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """(config, table path, {name: variant}) with the config written where the table's provenance says."""
    monkeypatch.setenv(EXTRA_BACKENDS_ENV, "wrong_serving=tests.serving_fakes")
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(TINY))
    cfg = load_serving_config(config_path)
    key = cfg.families[0]
    cands = family_plan(cfg, key, detect()).candidates
    triton = [v for v in cands if v.backend == "triton"]
    names = {"A": next(v for v in triton if v.get("tokens_per_split") == 16),
             "B": next(v for v in triton if v.get("tokens_per_split") == 64),
             "C": next(v for v in cands if v.backend == "triton_fused"),
             "W": next(v for v in cands if v.backend == "wrong_serving"),
             "F": Decoder(cfg.spec(key), device="cpu").variant}
    assert len(set(names.values())) == 5
    table_path = _write_table(tmp_path / "CPU.serving.yaml", cfg, config_path, [2, 4], [32, 64],
                              names["A"], names["B"], 0.1, 32)
    return cfg, table_path, names


def _write_table(path, cfg, config_path, batches, kvs, eager, graph, regret, worst_kv):
    """A table of the config's first family: eager everywhere, graph at every batch."""
    cells = {(b, kv): Cell(b, kv, eager, 1.0) for b in batches for kv in kvs}
    fam = Family(cfg.families[0], cells, {b: GraphPick(b, graph, regret, worst_kv) for b in batches})
    provenance = {"config": {"path": str(config_path), "hash": cfg.hash}}
    table = ServingTable(detect().name, provenance, batches, kvs, {fam.key: fam})
    return write_serving_table(path, table)


class FakeTimer:
    """The made-up time of the call's variant (nothing runs); remembers the order and call types."""

    def __init__(self, names):
        self.name = {v: n for n, v in names.items()}
        self.order: list[tuple[str, int]] = []
        self.kinds: set[str] = set()

    def __call__(self, call, reps: int) -> Timing:
        name = self.name[call.variant]
        self.order.append((name, reps))
        self.kinds.add(type(call).__name__)
        t = PER_SEQUENCE_US[name] * call.batch
        return Timing(t, t, t, reps)


def _verify(table_path, names, timer=None, **kw):
    """run_verify on the CPU, quietly, timed by `timer` (by default a FakeTimer of names)."""
    return vf.run_verify(table_path, timer=timer or FakeTimer(names), device="cpu", log=lambda _: None, **kw)


def test_held_out_shapes_are_off_the_grid_deterministic_and_respect_left_out(tiny):
    # 2 sequences of 64 tokens fit, 4 of 40 do not: what is left is drawn again
    cfg = serving_config_from_dict({**TINY, "families": {**TINY["families"], "kv_format": ["fp8", "bf16"]},
                                    "left_out": [{"max_tokens": 150, "why": "a test's limit"}]}, "two.yaml")
    table = load_serving_table(tiny[1])
    keys = list(cfg.families)
    shapes, redrawn = vf.draw_shapes(table, cfg, keys, 12, 6, seed=7)
    assert shapes == vf.draw_shapes(table, cfg, keys, 12, 6, seed=7)[0]
    assert shapes != vf.draw_shapes(table, cfg, keys, 12, 6, seed=8)[0]
    assert redrawn > 0
    assert [s.key for s in shapes] == [keys[i % 2] for i in range(18)]  # round-robin
    uniform = [s for s in shapes if s.kind == "uniform"]
    mixes = [s for s in shapes if s.kind == "ragged"]
    assert len(uniform) == 12 and len(mixes) == 6
    for s in shapes:
        assert sum(s.kv_lens) <= 150 and cfg.left_out_reason(s.key, 1, sum(s.kv_lens)) is None
        assert all(32 <= n <= 64 for n in s.kv_lens) and all(1 <= q <= 2 for q in s.q_lens)
    for s in uniform:  # off the grid: batch 1 or 3 (buckets 2, 4), kv 33..63
        assert s.batch in (1, 3) and len(set(s.kv_lens)) == 1 and s.kv_lens[0] not in (32, 64)
    assert all(s.batch >= 2 for s in mixes) and any(len(set(s.kv_lens)) > 1 for s in mixes)
    assert vf.select_families(table, "kv_format=fp8,heads=16") == list(table.families)
    with pytest.raises(vf.VerifyError, match="matches none"):
        vf.select_families(table, "heads=128")


def test_regret_is_the_picks_time_over_the_best_correct_candidate_the_gate_admitted_timed_in_rotating_passes(
        tiny, tmp_path, monkeypatch):
    cfg, table_path, names = tiny
    timer = FakeTimer(names)

    def probe(call) -> float:  # W looks hopeless to the probe: pruned, never timed
        return 1000.0 if call.variant == names["W"] else PER_SEQUENCE_US[timer.name[call.variant]]

    out = tmp_path / "out" / "verify.json"
    report = _verify(table_path, names, shapes=2, ragged=1, seed=3, samples=2, json_path=out, timer=timer, probe=probe)
    assert report["exit_code"] == 0 and not report["verdict"]["failed"]
    assert len(report["shapes"]) == 3
    for r in report["shapes"]:
        assert r["best"] == str(names["C"]) and r["roles"]["eager"] == str(names["A"])
        assert r["regret"] == pytest.approx({"eager": 0.10, "graph": 0.30, "fallback": 1.0})
        assert r["pruned"] == [str(names["W"])]
        assert all(c["passed"] for c in r["checks"].values()) and str(names["A"]) in r["checks"]
    eager = report["summary"]["eager"]
    assert eager["all"]["n"] == 3 and eager["uniform"]["n"] == 2 and eager["ragged"]["n"] == 1
    assert eager["all"]["geomean"] == pytest.approx(0.10) and eager["all"]["max"] == pytest.approx(0.10)
    assert report["summary"]["fallback"]["all"]["p95"] == pytest.approx(1.0)
    # the final round: 4 passes over the same variants, not in the same order each time
    final = [n for n, reps in timer.order if reps == 2]
    size = len(final) // vf.FINAL_PASSES
    passes = [final[i * size:(i + 1) * size] for i in range(vf.FINAL_PASSES)]
    assert size >= 4 and len({tuple(p) for p in passes}) > 1 and all(sorted(p) == sorted(passes[0]) for p in passes)
    saved = json.loads(out.read_text())
    assert saved["schema"] == vf.VERIFY_SCHEMA and saved["options"]["seed"] == 3
    assert saved["config"]["hash"] == cfg.hash and saved["versions"]["torch"]
    assert saved["shapes"][0]["final_us"] and saved["shapes"][0]["input_seed"] == report["shapes"][0]["input_seed"]
    # the final round's passes rotate and reverse, and a failing call sits out the rest
    order, failed = [], []

    def turn(call, samples):
        order.append(call)
        if call == "c" and len(order) > 3:
            raise RuntimeError("lost at its second turn")
        return Timing(float(len(order)), 0.0, 0.0, samples)
    times = vf.alternating_passes({c: c for c in "abcd"}, turn, 5, passes=3, sit_out=["d"],
                                  on_error=lambda v, exc: failed.append((v, str(exc))))
    # pass 0: a b c; pass 1 starts at b, backwards: a c(fails) b; pass 2 starts at c: a b (c out, d never)
    assert order == ["a", "b", "c", "a", "c", "b", "a", "b"]
    assert times == {"a": [1.0, 4.0, 7.0], "b": [2.0, 6.0, 8.0], "c": [3.0], "d": []}
    assert failed == [("c", "lost at its second turn")]
    with pytest.raises(RuntimeError):  # without on_error it is the caller's
        vf.alternating_passes({"c": "c"}, lambda call, samples: (_ for _ in ()).throw(RuntimeError("x")), 1)

    # a candidate the gate rejects does not compete for best: the table's sweep never admitted
    # it, so the lookup is not judged against it
    def gates(jobs, workers, stop=None):
        for job in jobs:  # C, the fastest correct candidate, fails the gate's margin
            ok = job.variant != str(names["C"])
            yield job, {"ok": ok, "reason": "ok" if ok else "ragged probe: 2.6% of elements outside"}

    monkeypatch.setattr(vf, "run_gates", gates)
    report = _verify(table_path, names, shapes=1, ragged=1, samples=1, workers=1)
    assert report["compile"]["gate_failed"] == {str(names["C"]): "ragged probe: 2.6% of elements outside"}
    for r in report["shapes"]:
        assert r["best"] == str(names["A"]) and r["regret"]["eager"] == pytest.approx(0.0)
        assert str(names["C"]) not in r["final_us"]


def _cli(*args):  # `mla-tune verify ARGS` in 100 columns
    return invoke("verify", *args, env={"COLUMNS": "100", "NO_COLOR": "1"})


def test_thresholds_set_the_exit_code_on_the_command_line_too_a_wrong_fast_pick_fails_and_steps_are_verified(
        tiny, tmp_path, monkeypatch):
    """The regret thresholds set the exit code; a wrong fast candidate is never the best, and as
    the eager pick it fails the run. Under a config's search.step_layers N each candidate is timed
    as a LayeredStep of N layers (its figures over N: the same regrets) and the report says so.
    The command refuses a bad option or no GPU, writes its JSON and rescores it."""
    cfg, table_path, names = tiny
    kw = dict(shapes=1, ragged=0, seed=3, samples=1)
    report = _verify(table_path, names, max_p95=0.05, **kw)
    assert report["exit_code"] == 1 and "p95 regret 10.0% is over 5.0%" in report["verdict"]["reasons"][0]
    timer = FakeTimer(names)
    stepped = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, step_layers=2))
    steps = _verify(table_path, names, config=stepped, timer=timer, **kw)
    assert timer.kinds == {"LayeredStep"} and steps["protocol"]["step_layers"] == 2
    assert "step_layers" not in report["protocol"]
    (r,), (p,) = steps["shapes"], report["shapes"]
    assert r["regret"] == pytest.approx(p["regret"]) and r["best_us"] == pytest.approx(p["best_us"] / 2)
    records = report["shapes"]
    summary = vf.summarize(records)
    assert vf.verdict_of(summary, records, None, 0.2, "graph", False)["failed"]  # graph pick: 30%
    assert vf.verdict_of(summary, records, None, None, "both", False) == {
        "failed": False, "reasons": [], "judged": [], "partial": False, "checks": 5, "checks_failed": 0}
    stopped = _verify(table_path, names, budget_s=1e-9, **kw)  # spent at once
    assert stopped["stopped"] and stopped["exit_code"] == 3 and stopped["shapes"] == []
    s = vf.regret_stats([0.0] * 18 + [0.10, 0.20])
    assert s["n"] == 20 and s["p95"] == pytest.approx(0.10) and s["max"] == pytest.approx(0.20)
    assert s["geomean"] == pytest.approx((1.1 * 1.2) ** (1 / 20) - 1)
    assert vf.regret_stats([0.1, math.inf])["max"] == math.inf
    assert vf.regret_stats([])["n"] == 0
    assert _cli("--table", tmp_path / "x.yaml", "--max-p95", "5").exit_code == 2  # a fraction
    monkeypatch.delenv("TRITON_INTERPRET")  # no GPU and no interpreter: verify cannot time here
    result = _cli("--table", table_path)
    assert result.exit_code == 1 and "torch sees none here" in result.output and "--rescore" in result.output
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a missing table: test_cli.py's path errors
    monkeypatch.setattr(timing, "cpu_time", FakeTimer(names))  # the CPU's default timer
    out = tmp_path / "v.json"
    result = _cli("--table", table_path, "--shapes", 1, "--ragged", 1, "--samples", 1,
                  "--max-p95", "0.2", "--max-regret", "0.2", "--json", out)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "eager pick" in result.output and "elapsed" in result.output
    assert max(map(len, result.output.splitlines())) <= 100  # fitted to the COLUMNS given
    assert len(json.loads(out.read_text())["shapes"]) == 2
    result = _cli("--table", table_path, "--shapes", 1, "--ragged", 0, "--samples", 1, "--max-regret", "0.05")
    assert result.exit_code == 1 and "FAIL" in result.output
    # --rescore: no timing, the picks' times read back from the report just written
    monkeypatch.setattr(timing, "cpu_time", lambda *a: pytest.fail("a rescore timed something"))
    result = _cli("--table", table_path, "--rescore", out, "--max-regret", "0.12")
    assert result.exit_code == 0 and "PASS (on recorded times)" in result.output, result.output
    result = _cli("--table", table_path, "--rescore", out, "--max-regret", "0.05")
    assert result.exit_code == 1 and "max regret 10.0% is over 5.0%" in result.output
    table_path.write_text(table_path.read_text().replace(str(names["A"]), str(names["W"])))  # eager pick: W
    report = _verify(table_path, names, **kw)
    r = report["shapes"][0]
    assert r["best"] == str(names["C"]) and r["checks"][str(names["W"])]["passed"] is False
    assert r["regret"]["eager"] == pytest.approx(-0.5)  # faster than the best correct one, and wrong
    assert report["verdict"]["failed"] and report["exit_code"] == 1
    assert "outside the rule" in report["verdict"]["reasons"][0]


@pytest.mark.gpu
def test_verify_on_the_gpu(tmp_path):
    """Two shapes and a mix against a tiny made-up table (128 heads, paged 64, fp8): the
    leaderboard timer, the probe, kernels compiled in 2 processes, vendors where installed."""
    raw = copy.deepcopy(TINY)
    raw.update(families={"kv_format": ["fp8"], "page_size": [64], "heads": [128], "q_len": [1]},
               call={"mixed_q_len": False}, batch_buckets=[1, 32], kv_buckets=[512, 4096], gate_workers=2,
               gate={"ragged_kv_lens": [1, 17, 63, 64, 65, 3000], "tail_kv_len": 4133, "tail_batch": 3,
                     "margin": 0.5, "reference_q": "variant"},
               backends={"triton": {"tokens_per_split": [256, 4096], "max_splits": [1]},
                         "triton_fused": {"tokens_per_split": [1024]}, "flashmla": {}, "flashinfer": {}})
    cfg = serving_config_from_dict(raw, tmp_path / "gpu_tiny.yaml")
    (tmp_path / "gpu_tiny.yaml").write_text(yaml.safe_dump(raw))
    key = cfg.families[0]
    cands = family_plan(cfg, key, detect()).candidates
    eager = cands[0]
    graph = next((v for v in cands if v.backend == "flashmla"), cands[-1])
    path = _write_table(tmp_path / "GPU.serving.yaml", cfg, tmp_path / "gpu_tiny.yaml", [1, 32], [512, 4096],
                        eager, graph, 0.0, 512)
    report = vf.run_verify(path, shapes=2, ragged=1, samples=3, json_path=tmp_path / "v.json", log=print)
    assert len(report["shapes"]) == 3 and report["protocol"]["name"] == "leaderboard-emulation"
    for r in report["shapes"]:
        assert r["best"] is not None and all(0 <= r["regret"][role] < math.inf for role in vf.ROLES)
        assert all(c["passed"] for v, c in r["checks"].items() if v in r["roles"].values())
    assert get_backend("triton") and Variant.parse(report["shapes"][0]["best"])
