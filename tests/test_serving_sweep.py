"""The serving sweep (mla_tune/serving/sweep.py) end to end under Triton's interpreter on a
tiny config with made-up times (tests/serving_timers.py); the config, candidates, plan, dry run."""

import copy
import functools
import itertools
import math
import re

import pytest
import yaml

from mla_tune.backends import EXTRA_BACKENDS_ENV, triton_fused, triton_splitk
from mla_tune.core import CORE_HEADS, CallSpec, Variant
from mla_tune.gpu import detect, fake_platform
from mla_tune.serving import gate as gate_module
from mla_tune.serving import measure as measure_module
from mla_tune.serving import sweep as sw
from mla_tune.serving.cells import (
    compile_key,
    edge_batch,
    kernel_us,
    measurement_s,
    parse_shard,
    plan_sweep,
)
from mla_tune.serving.config import (
    ServingConfigError,
    load_serving_config,
    serving_config_from_dict,
)
from mla_tune.serving.gate import GateJob, run_gates
from mla_tune.serving.results import read_records, results_path_for
from mla_tune.serving.table import FamilyKey, gate_refused, kv_bucket, load_serving_table
from mla_tune.tune import timing
from mla_tune.tune.timing import Timing
from tests.helpers import invoke
from tests.serving_timers import TIMES, TINY, name


class FakeTimer:
    """The made-up time (x `slow(call)`); `run`: the runner runs once per variant and cell;
    records what it timed and the calls' types; raises KeyboardInterrupt (a kill) after
    `stop_after` calls."""

    def __init__(self, stop_after: int | None = None, run: bool = False, slow=lambda call: 1.0):
        self.timed: list[tuple] = []
        self.kinds: set[str] = set()
        self.stop_after = stop_after
        self.run = run
        self.slow = slow

    def __call__(self, call: sw.TimedCall, reps: int) -> Timing:
        if self.stop_after is not None and len(self.timed) >= self.stop_after:
            raise KeyboardInterrupt
        if self.run and (call.batch, call.kv_len, str(call.variant)) not in {t[:3] for t in self.timed}:
            call()
        self.timed.append((call.batch, call.kv_len, str(call.variant), reps))
        self.kinds.add(type(call).__name__)
        t = TIMES[call.kv_len][name(call.variant)] * call.batch * self.slow(call)
        return Timing(t, t, t, reps)


def _n(variant: str) -> str:
    """The made-up name of a variant string."""
    return name(Variant.parse(variant))


def _named(picks: dict) -> dict:
    """{key: variant string} as {key: the made-up name of the variant}."""
    return {k: _n(v) for k, v in picks.items()}


_gate_cached = functools.cache(gate_module.gate_one)  # each candidate is gated once in this module


@pytest.fixture
def tiny(monkeypatch):
    """The tiny config; each (family, candidate) is gated once per module, as a resume replays it."""
    monkeypatch.setenv(EXTRA_BACKENDS_ENV, "wrong_serving=tests.serving_fakes")
    monkeypatch.setattr(gate_module, "gate_one", lambda job: copy.deepcopy(_gate_cached(job)))
    return _config("tiny.yaml")


def _config(name: str, search: dict | None = None, **changes):
    """TINY with `changes`, its search section updated by `search`, as a config named `name`."""
    raw = {**copy.deepcopy(TINY), **changes}
    raw["search"].update(search or {})
    return serving_config_from_dict(raw, name)


def _sweep(cfg, tmp_path, timer, **kw):
    """A sweep of `cfg` into tmp_path (a timer's name: timed in a worker process)."""
    kw.setdefault("log", lambda line: None)
    return sw.run_serving_sweep(cfg, "CPU", out=tmp_path / "CPU.serving.yaml", platform=detect(), timer=timer, **kw)


def _records(results, kind: str, status: str | None = None) -> list[dict]:
    """The records of one kind (and status) in a serving results file."""
    return [r for r in read_records(results)[1] if r["kind"] == kind and (status is None or r["status"] == status)]


def _steps(path) -> set[tuple]:
    return {(r["batch"], r["kv_len"], r["variant"], r["samples"]) for r in _records(path, "step")}


def _families(path) -> list:
    return load_serving_table(path).as_dict()["families"]


def _picks(table) -> dict:
    fam = next(iter(table.families.values()))
    return {cell: str(c.variant) for cell, c in fam.cells.items()}, {b: str(g.variant) for b, g in fam.graph.items()}


def test_a_tiny_sweep_picks_gated_winners_and_the_worst_case_graph_pick_and_step_layers_time_a_layer(
        tiny, tmp_path, monkeypatch):
    """The picks and their gate; then search.step_layers N (0 by default, and the hash without
    it): every step of the sweep times a LayeredStep of N layers, its time over N (the made-up
    time here, halved), and the table's provenance says so; the picks follow the times as before."""
    timer = FakeTimer(run=True)
    summary = _sweep(tiny, tmp_path, timer)
    table = load_serving_table(summary["table"])
    platform = read_records(summary["results"])[0]["platform"]
    assert platform["smem_per_sm"] == platform["sm_count"] == 0  # the CPU's
    gates = {r["variant"]: r["ok"] for r in _records(summary["results"], "gate")}
    assert sorted(_n(v) for v, ok in gates.items() if ok) == ["A", "B", "C", "D"]
    assert [ok for v, ok in gates.items() if v.startswith("wrong_serving")] == [False]
    assert not any(v.startswith("wrong_serving") for _, _, v, _ in timer.timed)  # gated out: never timed
    cells, graph = _picks(table)
    assert _named(cells) == {(1, 32): "A", (1, 64): "B", (2, 32): "A", (2, 64): "B"}
    assert all(gates[v] for v in [*cells.values(), *graph.values()])
    assert _named(graph) == {1: "C", 2: "C"}
    fam = next(iter(table.families.values()))
    assert fam.graph[1].worst_regret == pytest.approx(0.12) and fam.graph[1].worst_kv_len == 32
    assert fam.cells[(1, 64)].runner_up["time_us"] == pytest.approx(16.5)
    assert table.provenance["config"]["hash"] == tiny.hash and table.provenance["rule"]["name"] == "strict"
    # the gate's refusal, with its reason, where a graph pick's re-choice reads it
    refused = {r["variant"]: r["reason"] for r in _records(summary["results"], "gate") if not r["ok"]}
    assert gate_refused(table, fam.key) == refused and len(refused) == 1
    spec = CallSpec("fp8", 16, 16, 2, mixed_q_len=True)
    assert name(table.lookup(spec, batch=2, mean_kv_len=60)) == "B"
    assert name(table.lookup(spec, batch=2, graph=True)) == "C"
    # gate workers in a spawned process reject the wrong candidate too
    spec = tiny.spec(tiny.families[0])
    good = triton_splitk.default_serving_variant(spec, detect())
    jobs = [GateJob(spec, str(v), tiny.gate, tiny.rule, "cpu")
            for v in (good, Variant.make("wrong_serving", kv="fp8", q="bf16"))]
    out = {job.variant: result for job, result in run_gates(jobs, workers=1)}
    assert out[str(good)]["ok"] and not out[jobs[1].variant]["ok"]
    assert "ragged probe" in out[jobs[1].variant]["reason"]
    assert tiny.search.step_layers == 0 and "step_layers" not in table.provenance["search"]
    stepped = _config("step.yaml", {"step_layers": 2})
    assert stepped.search.step_layers == 2 and stepped.hash != tiny.hash
    timer = FakeTimer(run=True)
    layered = load_serving_table(_sweep(stepped, tmp_path / "step", timer)["table"])
    assert timer.kinds == {"LayeredStep"}
    assert layered.provenance["search"]["step_layers"] == 2
    assert _picks(layered) == _picks(table)
    layered_fam = next(iter(layered.families.values()))
    assert {at: c.time_us * 2 for at, c in layered_fam.cells.items()} == {at: c.time_us for at, c in fam.cells.items()}
    # a cell whose KV copies would pass the bound is that measurement's failure, not the sweep's
    monkeypatch.setattr(measure_module, "LAYERED_KV_BYTES", 1)
    key, variant = stepped.families[0], next(iter(layered_fam.cells.values())).variant
    job = measure_module.MeasureJob(stepped.spec(key), key, 1, 32, (32,), 5, str(variant), 1, "cpu", layers=2)
    out = measure_module.measure(job, {}, FakeTimer(), None)
    assert out["status"] == "failed" and "2 layers need" in out["error"]
    # the dry run's estimate counts each sample as a step of that many kernels
    key = FamilyKey("bf16", 64, 128, 1)
    k = kernel_us(key, 64, 8192)
    extra = measurement_s(key, 64, 8192, 20, layers=8) - measurement_s(key, 64, 8192, 20)
    assert extra == pytest.approx((20 * 7 * k + (8 * 8 - 6) * k) / 1e6)


def test_the_graph_pick_is_judged_on_the_buckets_ragged_mix_too(tiny, tmp_path, monkeypatch):
    """C, 2x slower on the ragged mix, loses the graph pick to B; the mix's lengths (fixed, in
    range) are recorded; a pick whose worst case is the mix says kv_len 0."""
    def slow(call):
        return 2.0 if call.kv_len == sw.RAGGED_PROBE_KV and name(call.variant) == "C" else 1.0

    lens = sw.ragged_probe_lengths(64, [512, 1024, 65536])
    assert lens == sw.ragged_probe_lengths(64, [512, 1024, 65536]) and len(lens) == 64
    assert min(lens) >= 512 and max(lens) <= 65536 and len(set(lens)) > 32
    summary = _sweep(tiny, tmp_path, FakeTimer(slow=slow))
    graphs = {r["batch"]: r for r in _records(summary["results"], "graph")}
    assert _named({b: g["variant"] for b, g in graphs.items()}) == {1: "B", 2: "B"}
    assert [len(graphs[b]["ragged_kv_lens"]) for b in (1, 2)] == [1, 2]
    assert all(32 <= n <= 64 for b in (1, 2) for n in graphs[b]["ragged_kv_lens"])
    assert {_n(v) for _, kv, v, _ in _steps(summary["results"]) if kv == 0} >= {"A", "B", "C"}
    # C 15.6% over B on the mix, more than its 12% at kv 32 and less than B's 20% there:
    # C is the pick and its worst case is the mix, recorded as kv_len 0
    mix = {**TIMES[sw.RAGGED_PROBE_KV], "A": 30.0, "B": 16.0, "C": 18.5}
    monkeypatch.setitem(TIMES, sw.RAGGED_PROBE_KV, mix)
    table = load_serving_table(_sweep(tiny, tmp_path / "2", FakeTimer())["table"])
    fam = next(iter(table.families.values()))
    for b in (1, 2):
        assert name(fam.graph[b].variant) == "C" and fam.graph[b].worst_kv_len == 0
        assert fam.graph[b].worst_regret == pytest.approx(18.5 / 16.0 - 1, abs=1e-4)  # 4 places in the table


def test_a_probe_prunes_a_hopeless_candidate_at_the_first_rung(tiny, tmp_path):
    """A probe over PRUNE_FACTOR x the cell's best is recorded as pruned, never timed."""
    def probe(call: sw.TimedCall) -> float:
        slow = 100.0 if name(call.variant) == "C" else 1.0
        return TIMES[call.kv_len][name(call.variant)] * call.batch * slow

    timer = FakeTimer()
    summary = _sweep(tiny, tmp_path, timer, probe=probe)
    pruned = _records(summary["results"], "step", "pruned")
    # C (slow by its probe) and D (triton's default, 50 us against 10-20) are over 4x
    assert pruned and {_n(r["variant"]) for r in pruned} == {"C", "D"}
    assert all(r["probe_us"] > sw.PRUNE_FACTOR * 1.0 for r in pruned)
    assert not any(_n(v) == "C" for _, _, v, _ in timer.timed)
    cells, graph = _picks(load_serving_table(summary["table"]))
    assert {*_named(cells).values(), *_named(graph).values()} <= {"A", "B"}
    # a resume replays the pruned steps instead of probing again
    again = FakeTimer()
    _sweep(tiny, tmp_path, again, probe=lambda call: pytest.fail("probed again on resume"))
    assert again.timed == []


def test_a_killed_a_sharded_and_a_worker_timed_sweep_each_end_as_the_table_of_one_run(tiny, tmp_path):
    """A killed sweep resumes without retiming (another config's, refused, leaves its results
    alone); shards merge; a sweep timed in a worker process writes the same steps and table, and
    a worker killed by D (batch 1, kv 32) costs only that step, recorded as crashed."""
    whole = _sweep(tiny, tmp_path / "whole", FakeTimer())
    with pytest.raises(KeyboardInterrupt):
        _sweep(tiny, tmp_path, FakeTimer(stop_after=4))
    results = results_path_for(tmp_path / "CPU.serving.yaml")
    before = _steps(results)
    assert len(before) == 4
    with open(results, "ab") as f:  # a kill in the middle of a line
        f.write(b'{"kind": "step", "fam')
    again, lines = FakeTimer(), []
    summary = _sweep(tiny, tmp_path, again, log=lines.append)
    assert not before & set(again.timed) and again.timed  # nothing recorded is timed again
    cells = [line for line in lines if line.startswith("[")]  # a line per cell, with an ETA
    assert [line.split("]")[0] for line in cells] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert all(re.search(r"elapsed \d+ s, ETA \d+ s$", line) for line in cells), cells
    assert _steps(results) == _steps(whole["results"])
    assert _picks(load_serving_table(summary["table"])) == _picks(load_serving_table(whole["table"]))
    kept = results.read_bytes()
    with pytest.raises(Exception, match="config_hash .*--fresh"):
        _sweep(_config("other.yaml", {"keep": 1.0}), tmp_path, FakeTimer())
    assert results.read_bytes() == kept
    # timed in a worker process
    there = _sweep(tiny, tmp_path / "worker", "tests.serving_timers:crashing_time")
    crashed = _records(there["results"], "step", "crashed")
    assert [(r["batch"], r["kv_len"], _n(r["variant"])) for r in crashed] == [(1, 32, "D")]
    assert "exit code 11" in crashed[0]["error"] and "worker-0.log" in crashed[0]["error"]
    assert _steps(there["results"]) == _steps(whole["results"])
    assert _families(there["table"]) == _families(whole["table"])
    assert (tmp_path / "worker" / "CPU.serving.worker-0.log").exists()
    # in shards, merged
    shards, paths = tmp_path / "shards", []
    for i in (1, 2):
        summary = _sweep(tiny, shards, FakeTimer(), shard=(i, 2))
        assert summary["table"] is None and summary["cells"] == 2
        paths.append(summary["results"])
    config = shards / "tiny.yaml"  # the command line reads the config from its file
    config.write_text(yaml.safe_dump(TINY))
    out = shards / "merged.serving.yaml"
    result = invoke("sweep", "--gpu", "CPU", "--config", config, "--out", out, "--merge", ",".join(map(str, paths)))
    assert result.exit_code == 0, result.output
    assert _families(out) == _families(whole["table"])  # every pick, time and reason
    with pytest.raises(sw.ServingSweepError, match="merge only the shards of one config"):
        sw.merge(tiny, "H200", paths, out=shards / "x.yaml", log=lambda line: None)
    assert sw.sweep_from_cli(config, "H200", out=shards / "x.yaml", merge_results=paths) == 1
    with pytest.raises(sw.ServingSweepError, match="hold shards 1/2, 1/2: merge the shards of one split"):
        sw.merge(tiny, "CPU", [paths[0], paths[0]], out=shards / "x.yaml", log=lambda line: None)
    said = []
    sw.merge(tiny, "CPU", paths[1:], out=shards / "half.yaml", log=said.append)
    assert any(line.startswith("warning: shard(s) 1/2 not merged") for line in said), said


def test_the_budget_stops_cleanly_and_a_step_its_hard_deadline_kills_is_not_recorded_but_resumed(
        tiny, tmp_path, monkeypatch):
    """A measurement cut by the budget, not by its own limit (D hangs at batch 1, kv 32): no
    record, the sweep stops; the resume times it under its own limit (a timeout, recorded).
    A sweep stopped by its budget says in its table what was left out."""
    timer, lines = "tests.serving_timers:hanging_time", []
    with monkeypatch.context() as m:  # the budget's end: every limit cut to 1.5 s, and come when one is
        m.setattr(sw.BudgetClock, "timeout", lambda self, limit_s: min(limit_s, 1.5))
        m.setattr(sw.BudgetClock, "past_hard_deadline", lambda self: True)
        first = _sweep(tiny, tmp_path, timer, candidate_timeout_s=120, log=lines.append)
    assert first["stopped"] and all(r["status"] == "ok" for r in _records(first["results"], "step"))
    assert any("budget spent" in line and "without --fresh" in line for line in lines), lines
    again = _sweep(tiny, tmp_path, timer, candidate_timeout_s=2)
    timeouts = [(r["batch"], r["kv_len"], _n(r["variant"])) for r in _records(again["results"], "step", "timeout")]
    assert not again["stopped"] and timeouts == [(1, 32, "D")]
    checks = iter(range(10**6))
    # past the budget after the 4 gate jobs and 7 measurements: in the second cell
    monkeypatch.setattr(sw.Sweeper, "_over_budget", lambda self: next(checks) >= 4 + 7)
    summary = _sweep(tiny, tmp_path / "2", timing.cpu_time)  # the CPU stand-in timer, as the CLI uses here
    assert summary["stopped"]
    table = load_serving_table(summary["table"])
    fam = next(iter(table.families.values()))
    assert 1 <= len(fam.cells) < 4
    assert all("budget" in c["reason"] for c in fam.left_out)
    assert len(fam.cells) + len(fam.left_out) == 4
    assert table.provenance["sweep"]["stopped"] is True


def test_serving_candidates_are_valid_for_every_family_use_fp16_dots_without_a_gpu_and_offer_budgets():
    """batch_waves W: split_budget ceil(W x SMs / head tiles), a runtime argument (no compile),
    instead of a per-sequence cap."""
    h200, cpu = fake_platform("H200"), detect()
    for module, rows in ((triton_splitk, "mma_rows"), (triton_fused, "mma_columns")):
        space = {rows: [16, 32], "tokens_per_split": [256, 4096], "split_waves": [1, 2], "max_splits": [1]}
        for heads, q_len, kv in itertools.product(CORE_HEADS, (1, 2, 3, 4), ("fp8", "bf16")):
            spec = CallSpec(kv, 64, heads, q_len, mixed_q_len=q_len > 1)
            offered = module.serving_candidates(spec, space, h200)
            assert offered and len(set(offered)) == len(offered)
            for v in offered:
                module.build_serving(v, spec, "cpu")  # builds (no launch): accepts spec and variant
                assert v.get("kv") == kv and v.get("block_h") * (1 << (q_len - 1).bit_length()) >= 16
            one = [v for v in offered if v.get("max_splits") == 1]
            assert {v.get("tokens_per_split") for v in one} == {4096}
        on_cpu = module.serving_candidates(CallSpec("fp8", 16, 16, 1), {}, cpu)
        assert on_cpu and all("bf16" not in (v.get("dot_dtype"), v.get("qk_dot"), v.get("pv_dot")) for v in on_cpu)
    assert triton_splitk.serving_candidates(CallSpec("bf16", 64, 128, 1), {"kv": ["fp8"]}, h200) == []
    splits = {v.get("max_splits") for v in triton_splitk.serving_candidates(
        CallSpec("fp8", 64, 128, 1), {"split_waves": [1, 2]}, h200)}
    assert splits == {math.ceil(132 / 8), math.ceil(2 * 132 / 8)}  # 8 head tiles of 16
    spec = CallSpec("fp8", 64, 128, 4)

    def rules(spec, space):
        offered = triton_splitk.serving_candidates(spec, space, h200)
        return offered, sorted((v.get("max_splits"), v.p.get("split_budget", 0)) for v in offered)

    offered, split_rules = rules(spec, {"mma_rows": [64], "batch_waves": [1, 2], "max_splits": [1],
                                        "tokens_per_split": [128]})
    assert split_rules == [(1, 0), (17, 17), (33, 33)]  # 8 head tiles of 16 heads x 4 tokens
    assert compile_key(offered[-1]) == compile_key(offered[-1].with_params(split_budget=5))
    both = rules(spec, {"mma_rows": [64], "batch_waves": [1], "split_waves": [1]})[1]
    assert both == [(17, 0), (17, 17)]
    wide = rules(CallSpec("fp8", 64, 16, 1), {"batch_waves": [4]})[1]
    assert wide == [(64, 528)]  # capped at 64
    for v in offered:
        triton_splitk.build_serving(v, spec, "cpu")
    with pytest.raises(ValueError, match="batch_waves must hold positive numbers"):
        rules(spec, {"batch_waves": [0]})
    with pytest.raises(ValueError, match="split_budget"):
        triton_splitk.validate(offered[-1].with_params(split_budget=-1))


def test_config_errors_name_the_field_the_hash_ignores_order_and_the_committed_one_plans_tier_1(tiny, capsys):
    """The committed config plans tier 1 within 21 GPU minutes and dry runs from the CLI."""
    bad_triton = {**TINY["backends"], "triton": {"mma_rows": [12]}}
    for changes, match in (
            ({"backends": bad_triton}, r"backends\.triton.*mma_rows"), ({"budget": 5}, "unknown field"),
            ({"search": {"rungs": [2, 1]}}, "search.rungs"), ({"kv_buckets": [64, 32]}, "kv_buckets"),
            ({"left_out": [{"max_tokens": 10}]}, r"left_out\[0\]\.why"),
            ({"search": {"cell_lengths": "uniform"}}, r"search\.cell_lengths.*aligned, spread.*'uniform'"),
            ({"search": {"batch_edge": "yes"}, "batch_buckets": [1, 4]}, r"search\.batch_edge.*true or false.*'yes'"),
            *(({"search": {**TINY["search"], "step_layers": bad}}, r"search\.step_layers.*integer 0\.\.64")
              for bad in (-1, 65, 1.5, True))):
        with pytest.raises(ServingConfigError, match=match):
            _config("bad.yaml", **changes)
    reordered = dict(reversed(list(copy.deepcopy(TINY).items())))
    assert serving_config_from_dict(reordered, "other.yaml").hash == tiny.hash
    cfg = load_serving_config("configs/serving.yaml")
    assert len(cfg.families) == 12 and cfg.budget_s <= 600
    est = sw.dry_run(cfg, "H200")
    out = capsys.readouterr().out
    assert est["total"] <= 21 * 60 and "left out batch 192, 224, 256: kv 8192, 16384" in out  # 1242 s, edge 219
    plan = plan_sweep(cfg, fake_platform("H200"), check_available=False)
    # every family gets every backend, and a choice of split rules and head tiles
    backends = {"triton", "triton_fused", "flashmla", "flashinfer", "gluon_fused"}
    assert all(len(f.candidates) >= 8 and set(f.per_backend()) == backends for f in plan.families.values())
    # bf16 caches over 768 MiB per layer are left out; fp8 ones fit twice the tokens
    fp8 = next(f for k, f in plan.families.items() if k.kv_format == "fp8")
    assert (256, 4096) not in [(c["batch"], c["kv_len"]) for c in fp8.left_out]
    shards = [plan_sweep(cfg, fake_platform("H200"), (i, 3), check_available=False) for i in (1, 2, 3)]
    assert sorted(u.index for s in shards for u in s.units) == list(range(plan.all_units))
    # `mla-tune sweep --config` (sweep_from_cli): a bad option is one line and exit 1
    for options, says in (({"shard": "3/2", "dry_run": True}, "--shard must be i/n"),
                          ({"shard": "1/2", "devices": [0, 1]}, "not both"),
                          ({"dry_run": True, "budget": 60, "devices": [0, 1]}, "--budget, --devices")):
        assert sw.sweep_from_cli("configs/serving.yaml", "H200", **options) == 1
        assert says in capsys.readouterr().err  # (a dry run would ignore --budget and --devices)
    with pytest.raises(ValueError):
        parse_shard("0/2")


@pytest.mark.gpu
def test_a_small_serving_sweep_on_the_gpu(tmp_path):
    """The pipeline on the GPU: every planned cell and batch bucket gets a pick."""
    raw = copy.deepcopy(TINY)
    raw.update(families={"kv_format": ["fp8"], "page_size": [64], "heads": [128], "q_len": [2]},
               call={"mixed_q_len": False}, batch_buckets=[1, 32], kv_buckets=[512, 4096], gate_workers=2,
               gate={"ragged_kv_lens": [1, 17, 63, 64, 65, 3000], "tail_kv_len": 4133, "tail_batch": 3,
                     "margin": 0.5, "reference_q": "variant"},
               search={"rungs": [3, 10], "keep": 0.5, "min_keep": 2, "cross_top": 3},
               backends={"triton": {"tokens_per_split": [256, 4096], "max_splits": [1]},
                         "triton_fused": {"tokens_per_split": [1024]}, "flashmla": {}, "flashinfer": {}})
    cfg = serving_config_from_dict(raw, "gpu_tiny.yaml")
    summary = sw.run_serving_sweep(cfg, detect().name, out=tmp_path / "GPU.serving.yaml", log=print)
    table = load_serving_table(summary["table"])
    fam = next(iter(table.families.values()))
    assert set(fam.cells) == {(b, kv) for b in (1, 32) for kv in (512, 4096)} and set(fam.graph) == {1, 32}
    assert table.provenance["protocol"]["name"] == "leaderboard-emulation"
    assert all(c.time_us > 0 for c in fam.cells.values())


@pytest.mark.parametrize("kv_len", [32, 512, 4096, 65536])
@pytest.mark.parametrize("batch", [1, 2, 7, 64, 256])
def test_spread_cell_lengths_stay_in_their_bucket_and_off_its_split_steps(batch, kv_len):
    buckets = [32, 64, 512, 1024, 2048, 4096, 8192, 32768, 65536]
    assert sw.cell_kv_lens(batch, kv_len) == [kv_len] * batch
    lens = sw.cell_kv_lens(batch, kv_len, "spread")
    assert len(lens) == batch and lens == sorted(lens) == sw.cell_kv_lens(batch, kv_len, "spread")
    assert all(kv_len / math.sqrt(2) <= n < kv_len * math.sqrt(2) for n in lens)  # within half an octave
    assert kv_bucket(buckets, sum(lens) / batch) == kv_len
    geo = math.exp(sum(math.log(n / kv_len) for n in lens) / batch)
    assert abs(math.log2(geo)) <= 0.5 / batch + 0.01  # centred on the bucket, within a step
    if batch == 1:
        assert lens[0] != kv_len and lens[0] % 16 != 0  # not at a step of any split of 16..kv_len
    if batch >= 7:
        assert lens[0] < kv_len < lens[-1]
    if kv_len >= 4096:
        assert len(set(lens)) == batch
    with pytest.raises(ValueError, match="aligned or spread"):
        sw.cell_kv_lens(batch, kv_len, "ragged")


def test_cell_lengths_are_a_search_option_that_changes_the_hash_and_the_timed_lengths(tiny, tmp_path, monkeypatch):
    assert tiny.search.cell_lengths == "aligned"
    spread = _config("spread.yaml", {"cell_lengths": "spread"})
    assert spread.search.cell_lengths == "spread" and spread.hash != tiny.hash
    seen = {}
    real = measure_module.make_input

    def spy(q_lens, kv_lens, *args, **kw):
        seen.setdefault(len(q_lens), set()).add(tuple(kv_lens))
        return real(q_lens, kv_lens, *args, **kw)

    monkeypatch.setattr(measure_module, "make_input", spy)
    table = load_serving_table(_sweep(spread, tmp_path, FakeTimer())["table"])
    for batch in (1, 2):
        assert {tuple(sw.cell_kv_lens(batch, kv, "spread")) for kv in (32, 64)} <= seen[batch]
    assert not {(32, 32), (64, 64)} & seen[2]  # no cell of 2 was timed aligned
    assert _named(_picks(table)[0]) == {(1, 32): "A", (1, 64): "B", (2, 32): "A", (2, 64): "B"}


def _edge_timer() -> FakeTimer:
    """TIMES, except that A is twice as slow at batch 2 (the edge of the bucket of 4 after 1)."""
    return FakeTimer(slow=lambda call: 2.0 if call.batch == 2 and name(call.variant) == "A" else 1.0)


def _edge_union(summary) -> set[str]:
    """The cross stage's union of finalists for the bucket of 4, by made-up name."""
    graphs = _records(summary["results"], "graph")
    return next({_n(v) for v in r["union"]} for r in graphs if r["batch"] == 4)


def test_the_edge_stage_times_finalists_and_the_last_rung_at_the_buckets_smallest_batch(tiny, tmp_path):
    """search.batch_edge (off by default): the bucket of 4 also times its finalists and its
    cells' last rung at batch 2, so 4 x 32 picks C over A (twice as slow at 2); resume and dry run."""
    buckets = [1, 2, 4, 8, 12, 96, 112]
    assert [edge_batch(buckets, b) for b in buckets] == [None, None, 3, 5, 9, 13, 97]
    assert edge_batch([4, 1, 2], 4) == 3  # any order
    assert tiny.search.batch_edge is False
    plain = _config("plain.yaml", batch_buckets=[1, 4])
    edged = _config("edge.yaml", {"batch_edge": True}, batch_buckets=[1, 4])
    assert edged.search.batch_edge and edged.hash != plain.hash
    without = load_serving_table(_sweep(plain, tmp_path / "plain", _edge_timer())["table"])
    timer = _edge_timer()
    summary = _sweep(edged, tmp_path / "edge", timer)
    table = load_serving_table(summary["table"])
    at_edge = {(kv, _n(v)) for b, kv, v, _ in timer.timed if b == 2}
    union = _edge_union(summary)
    assert {"A", "B", "C"} <= union
    assert at_edge == {(kv, n) for kv in (32, 64) for n in union}  # the bucket's finalists at every kv
    assert {b for b, _, _, _ in timer.timed} == {1, 2, 4}  # the bucket of 1 has no edge
    assert _named(_picks(without)[0])[(4, 32)] == "A"
    picks = _named(_picks(table)[0])
    assert picks[(4, 32)] == "C" and picks[(1, 32)] == "A" and picks[(4, 64)] == "B"
    assert _picks(table)[1] == _picks(without)[1]  # graph picks ignore the edge
    assert table.provenance["search"]["batch_edge"] is True
    again = _edge_timer()
    _sweep(edged, tmp_path / "edge", again)
    assert again.timed == []
    # cross_top 1: the union is each cell's winner, and the last rung also holds C
    narrow = _config("narrow.yaml", {"batch_edge": True, "cross_top": 1}, batch_buckets=[1, 4])
    timer = _edge_timer()
    summary = _sweep(narrow, tmp_path / "narrow", timer)
    union = _edge_union(summary)
    last = {(r["kv_len"], _n(r["variant"])) for r in _records(summary["results"], "step")
            if r["batch"] == 4 and r["samples"] == 2 and r["kv_len"] in (32, 64)}
    assert union == {"A", "B"} and {n for _, n in last} == {"A", "B", "C"}
    at_edge = {(kv, _n(v)) for b, kv, v, _ in timer.timed if b == 2}
    assert at_edge == last | {(kv, n) for kv in (32, 64) for n in union}
    assert _named(_picks(load_serving_table(summary["table"]))[0])[(4, 32)] == "C"
    assert sw.dry_run(edged, "H200", log=lambda line: None)["edge"] > 0
    assert sw.dry_run(plain, "H200", log=lambda line: None)["edge"] == 0
