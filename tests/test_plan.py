"""DecodePlan: planned once, updated per step, run per layer, picking from a small serving
table built here, each result against the fp32 reference; a pick that cannot run here warns
once and steps with its stand-in (the runner-up, else the default), counted in the misses."""

import random
import sys
import threading
import warnings
from dataclasses import replace

import pytest
import torch

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.backends.triton_splitk_schedule import SplitKModel
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    load_serving_table,
)
from tests.helpers import assert_close

SPEC = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, mixed_q_len=True)
BATCHES = [2, 4, 8]
KVS = [32, 256]
GRAPH_4 = Variant.parse("triton(block_h=8,block_n=32,dot_dtype=fp16,kv=bf16,max_splits=2,num_stages=1,"
                        "num_warps=4,q=bf16,tokens_per_split=64)")
EAGER_4_256 = Variant.parse("triton_fused(block_h=8,block_n=32,kv=bf16,max_splits=4,num_stages=1,num_warps=4,"
                            "pv_dot=fp16,q=bf16,qk_dot=fp16,tokens_per_split=32)")
GRAPH_8 = Variant.parse("triton_fused(block_h=8,block_n=32,kv=bf16,max_splits=2,num_stages=1,num_warps=4,"
                        "pv_dot=fp16,q=bf16,qk_dot=fp16,tokens_per_split=128)")


def _table(spec: CallSpec = SPEC, points=None, models=None) -> ServingTable:
    """The cell (4, 256) and the graph picks of 4 and 8; points and models as given."""
    fam = Family(FamilyKey.of(spec), points=points or {}, models=models or {})
    fam.cells[(4, 256)] = Cell(4, 256, EAGER_4_256, 10.0)
    fam.graph[4] = GraphPick(4, GRAPH_4, 0.05, 32)
    fam.graph[8] = GraphPick(8, GRAPH_8, 0.02, 256)
    return ServingTable("cpu", {}, BATCHES, KVS, {fam.key: fam})


def _step(plan: DecodePlan, kv_lens: list[int], seed: int, **update):
    spec = plan.spec
    inp = serving.make_input([min(spec.max_q_len, n) for n in kv_lens], kv_lens, spec.heads, spec.page_size, "bf16",
                             seed=seed, device=plan.device)
    picked = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens, **update)
    return inp, picked


def _checked_step(plan: DecodePlan, kv_lens: list[int], seed: int, what: str = "", **update):
    """One step (update, then run, checked against the reference); the variant it picked."""
    inp, picked = _step(plan, kv_lens, seed, **update)
    assert_close(plan.run(inp.q, inp.kv, inp.kv_scale), inp.reference(), what=what)
    return picked


def test_a_plan_without_a_table_runs_the_default_variant_correctly_and_reuses_its_buffers():
    plan = DecodePlan(SPEC, max_batch=8)
    assert plan.variants == [plan.pick(3)]
    assert _checked_step(plan, [1, 17, 63, 65], seed=1).backend == "triton"  # the default
    # runs reuse the buffers warm allocated
    inp, _ = _step(plan, [3, 70], seed=7)
    first = plan.run(inp.q, inp.kv, inp.kv_scale).data_ptr()
    inp, _ = _step(plan, [3, 70, 5, 9, 11, 2, 2, 40], seed=8)  # the plan's largest batch
    assert plan.run(inp.q, inp.kv, inp.kv_scale).data_ptr() == first


def test_the_plan_builds_every_pick_up_front_into_one_scratch_and_picks_by_bucket_and_mean_length():
    """The split partials of every own runner are views of plan.scratch, which is the largest runner's at max_batch,
    not their sum, and their outputs views of plan.outputs, one runner's; the fused kernel's arrival counters stay
    each runner's own; steps that alternate between the variants stay right."""
    plan = DecodePlan(SPEC, max_batch=8, table=_table())
    assert set(plan.variants) == {plan._default.variant, GRAPH_4, EAGER_4_256, GRAPH_8}
    runners = list(plan.runners.values())
    assert len(runners) == 4 and plan.max_total_q == 8 * SPEC.max_q_len
    base, end = plan.scratch.buffer.data_ptr(), plan.scratch.buffer.data_ptr() + plan.scratch.nbytes
    own = []
    for runner in runners:
        workspace = runner.workspace
        for name in type(workspace).SHARED:
            assert base <= getattr(workspace, name).data_ptr() < end or getattr(workspace, name).numel() == 0
        own.append(plan.scratch.shared_bytes(workspace))
        assert runner.scratch_bytes(plan.max_total_q) == own[-1]
        counts = getattr(workspace, "count", None)
        assert counts is None or not base <= counts.data_ptr() < end
    assert plan.scratch.nbytes == max(own) < sum(own)
    assert f"{max(own) / 2**20:.1f} MiB of shared split partials" in repr(plan)
    assert plan.outputs.nbytes == plan.max_total_q * SPEC.heads * 512 * 2
    assert {r.out.data_ptr() for r in runners} == {plan.outputs.buffer.data_ptr()}
    assert all(r.out.shape == (plan.max_total_q, SPEC.heads, 512) for r in runners)
    # eager: batch 3 -> bucket 4; mean length 200 -> kv bucket 256: the cell
    assert _checked_step(plan, [190, 200, 210], seed=2, mean_kv_len=200) == EAGER_4_256
    # eager, mean 40 -> kv bucket 32: no cell there, so the bucket's nearest cell (256)
    assert _checked_step(plan, [30, 40, 50], seed=3, mean_kv_len=40) == EAGER_4_256
    assert plan.misses == {}
    # batch 1 -> bucket 2: nothing there at all, so the default, counted as a miss
    assert _checked_step(plan, [40], seed=3, mean_kv_len=40) == plan._default.variant
    assert plan.misses == {"batch 2, kv_len ~40": 1}
    # no mean length known: the graph pick of the bucket
    assert _checked_step(plan, [5, 9, 300, 17, 2, 64], seed=4) == GRAPH_8
    # the mean from host lengths
    lens = [250, 260, 270]
    assert _checked_step(plan, lens, seed=5, kv_lens_host=lens) == EAGER_4_256
    assert _checked_step(plan, [30, 2, 70, 1, 40, 9, 300, 3], seed=23) == GRAPH_8  # the whole batch


def test_an_eager_plan_does_the_lookups_one_off_work_when_made_and_picks_the_fastest_estimate(monkeypatch):
    """The split-K rates over the points are computed, and point variants built, with the plan."""
    table = _table(points={(4, 32): {GRAPH_4: 5.0, GRAPH_8: 9.0}, (4, 256): {GRAPH_4: 20.0, GRAPH_8: 12.0}},
                   models={GRAPH_4: SplitKModel(GRAPH_4, occupancy=1, overhead_us=1.0, sm_count=132, fit_error=0.0)})
    made = []
    real = SplitKModel.point_rate
    monkeypatch.setattr(SplitKModel, "point_rate", lambda self, *a: made.append(a[1:3]) or real(self, *a))
    DecodePlan(SPEC, max_batch=4, table=table, warm=False)
    assert sorted(made) == [(4, 32), (4, 256)]  # each point's rate once, at the plan
    rates = table.estimator.derived("rates", table.families[FamilyKey.of(SPEC)])
    assert set(rates) == {(4, 32), (4, 256)} and len(made) == 2
    # measured points: the graph pick of 8 is estimated fastest near 256
    table = _table(points={(4, 32): {EAGER_4_256: 5.0, GRAPH_8: 9.0}, (4, 256): {EAGER_4_256: 20.0, GRAPH_8: 12.0},
                           (8, 32): {EAGER_4_256: 6.0, GRAPH_8: 9.5}, (8, 256): {EAGER_4_256: 24.0, GRAPH_8: 13.0}})
    plan = DecodePlan(SPEC, max_batch=4, table=table)
    assert GRAPH_8 in plan.variants  # a point variant, though no cell or graph pick <= 4 has it
    long, short = [240, 250, 260], [30, 40, 50]
    assert _checked_step(plan, long, 11, "the estimated pick", kv_lens_host=long) == GRAPH_8
    assert _step(plan, short, seed=12, kv_lens_host=short)[1] == EAGER_4_256


def test_a_graph_plan_ignores_lengths_and_takes_the_graph_pick():
    spec = replace(SPEC, graph=True)
    plan = DecodePlan(spec, max_batch=4, table=_table(spec))
    assert EAGER_4_256 not in plan.variants  # eager cells are not built for a graph plan
    lens = [190, 200, 210]
    assert _checked_step(plan, lens, seed=6, kv_lens_host=lens) == GRAPH_4


def test_a_step_the_plan_was_not_made_for_is_refused_and_a_table_without_the_family_warns():
    plan = DecodePlan(SPEC, max_batch=2, warm=False)

    def no_step_to_run():
        for run in (plan.run, plan.run_checked):
            with pytest.raises(ValueError, match=r"call update\(...\) with the step's lengths before run"):
                run(inp.q, inp.kv)

    inp = serving.make_input([1, 1, 1], [5, 6, 7], 16, 16, "bf16", seed=9, device=plan.device)
    no_step_to_run()
    with pytest.raises(ValueError, match="up to 2; make a plan with a larger max_batch"):
        plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    inp = serving.make_input([1, 1], [5, 6], 16, 16, "bf16", seed=9, device=plan.device)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    # a refused step leaves no step to run (not the last one's kernels and buffers)
    with pytest.raises(ValueError, match="block_table must be an int32"):
        plan.update(inp.qo_indptr, block_table=inp.block_table.long(), seq_lens=inp.seq_lens)
    no_step_to_run()
    layout = dict(block_table=inp.block_table, seq_lens=inp.seq_lens)
    for bad, match in [(dict(kv_lens_host=[5]), "kv_lens_host holds 1 lengths for a step of 2 sequences"),
                       (dict(mean_kv_len=float("nan")), "mean_kv_len must be a finite number of tokens")]:
        with pytest.raises(ValueError, match=match):
            plan.update(inp.qo_indptr, **layout, **bad)
    with pytest.raises(ValueError, match="a step needs at least one sequence: skip attention"):
        plan.update(inp.qo_indptr[:1], **layout)
    # a table without the family: a warning, and the default
    other = CallSpec("bf16", page_size=64, heads=16, max_q_len=1)
    with pytest.warns(UserWarning, match=r"no family for bf16 KV, paged 64.*The table has: bf16/p16/h16/q2; sweep"):
        plan = DecodePlan(other, max_batch=2, table=_table(), warm=False)
    assert plan.variants == [plan.pick(2)]


# ---------------------------------------------- picks that cannot run here
COMMITTED = "tables/H200.serving.yaml"
SPEC64 = CallSpec("bf16", page_size=64, heads=16, max_q_len=1)
FLASHMLA = Variant.make("flashmla", kv="bf16", q="bf16")
RUNNER_UP = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=fp16,kv=bf16,max_splits=2,num_stages=1,"
                          "num_warps=4,q=bf16,tokens_per_split=64)")


@pytest.fixture
def vendors_cannot_run(monkeypatch):
    """The stand-in tests' premise on any machine: gluon_fused, FlashInfer and FlashMLA cannot
    run here (as on the CPU machine; on an H100 or H200 they could)."""
    for name in ("gluon_fused", "flashinfer", "flashmla"):
        monkeypatch.setattr(get_backend(name), "unavailable_reason", lambda name=name: f"{name} is left out here")


def _plan(spec: CallSpec, table: ServingTable, max_batch: int = 256, **kw) -> tuple[DecodePlan, list[str]]:
    """The plan (warm=False unless kw says), and what it warned when it was made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = DecodePlan(spec, max_batch=max_batch, table=table, **{"warm": False, **kw})
    return plan, [str(w.message) for w in caught]


def test_empty_host_lengths_are_refused_where_the_lookups_replays_would_divide_by_them():
    # fp8, q_len 4: split-K models that divide a split budget by the batch (a SIGFPE in C)
    spec = CallSpec("fp8", page_size=64, heads=16, max_q_len=4, mixed_q_len=True, host_lengths=True)
    plan, _ = _plan(spec, load_serving_table(COMMITTED), max_batch=8)
    dev = plan.device
    qo = torch.arange(0, 4 * 8 + 1, 4, dtype=torch.int32, device=dev)
    layout = dict(block_table=torch.zeros((8, 50), dtype=torch.int32, device=dev),
                  seq_lens=torch.full((8,), 3000, dtype=torch.int32, device=dev), q_lens_host=[4] * 8)
    with pytest.raises(ValueError, match="kv_lens_host holds 0 lengths for a step of 8 sequences"):
        plan.update(qo, **layout, kv_lens_host=[], mean_kv_len=3000.0)
    with pytest.raises(ValueError, match="kv_lens_host holds 0 lengths"):
        plan.pick(8, 3000.0, [])
    assert plan.update(qo, **layout, kv_lens_host=[3000] * 8) == plan.pick(8, 3000.0, [3000] * 8)


@pytest.mark.parametrize("tuned_on, here, warned", [("H200", "H100", True), ("H100", "H100", False),
                                                     ("H200", "cpu", False)])
def test_a_table_tuned_on_another_gpu_is_used_with_one_warning(tuned_on, here, warned, monkeypatch):
    """The plan runs another GPU's table (the leaderboard runtime refuses one) and says so once,
    naming both GPUs and the sweep that tunes this one; not on the CPU, whose tables are tests'."""
    monkeypatch.setattr("mla_tune.serving.call.detect", lambda index=None: gpu.fake_platform(here))
    plan, messages = _plan(SPEC, replace(_table(), gpu=tuned_on), max_batch=8)
    said = [m for m in messages if "was tuned on" in m]
    assert said == ([f"serving table {plan.table.path} was tuned on {tuned_on} but this process runs on "
                     f"{here}: its picks run right here, but the fastest on {tuned_on} need not be the "
                     f"fastest here; tune this GPU with `mla-tune sweep --config configs/serving.yaml "
                     f"--gpu {here}`"] if warned else []), messages
    assert plan.pick(4, 256.0, [256] * 4) == EAGER_4_256  # the table's pick all the same


@pytest.mark.parametrize("graph", [False, True], ids=["eager-runner-up", "graph-default"])
def test_a_flashmla_pick_warns_once_and_steps_with_its_stand_in(graph, vendors_cannot_run):
    """The cell's runner-up stands in for it; a graph pick, which keeps none, the default."""
    fam = Family(FamilyKey.of(replace(SPEC64, graph=graph)))
    if not graph:
        fam.cells[(4, 256)] = Cell(4, 256, FLASHMLA, 10.0, runner_up={"variant": str(RUNNER_UP), "time_us": 11.0})
    fam.graph[4] = GraphPick(4, FLASHMLA, 0.05, 32)
    table = ServingTable("H200", {}, [2, 4], [32, 256], {fam.key: fam})
    plan, messages = _plan(replace(SPEC64, graph=graph), table, 4, warm=True)
    said = [m for m in messages if "cannot serve it here" in m]
    assert len(said) == 1 and "flashmla" in said[0], messages
    stand_in = plan.variants[0] if graph else RUNNER_UP  # the plan's default: its first variant
    assert FLASHMLA not in plan.variants and stand_in in plan.variants and stand_in.backend == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further word per step
        for step, kv_lens in enumerate(([200, 250, 300], [70, 129, 3, 240])):
            mean = sum(kv_lens) / len(kv_lens)
            assert _checked_step(plan, kv_lens, 30 + step, f"step {step}", mean_kv_len=mean) == stand_in
    assert plan.misses == {"flashmla cannot run here": 2}


def test_the_tables_plan_pick_is_what_plans_step_with_alone_and_on_two_threads(vendors_cannot_run):
    """ServingTable.plan_pick (what `verify --rescore --unrunnable` scores) against DecodePlan.pick
    on the committed table, where gluon_fused, FlashInfer and FlashMLA cannot run; an eager
    step's pick, stand-ins too, is the very object the plan keys its runner by (plan.variants),
    so a step's dict lookups match by identity rather than by comparing the variants' fields."""
    table = load_serving_table(COMMITTED)
    rng = random.Random(7)
    replaced = 0
    for key in sorted(table.families, key=str):
        for graph in (False, True):
            spec = CallSpec(key.kv_format, key.page_size, key.heads, key.q_len, graph=graph)
            plan, _ = _plan(spec, table)
            # an engine's eager step, its lengths on the host: update's one C call and stand-in
            stepped, _ = _plan(replace(spec, host_lengths=True), table) if not graph else (None, None)
            built = set(plan.variants)
            for _ in range(60):
                batch = rng.randint(1, 256)
                lens = [int(2 ** rng.uniform(0, 17)) for _ in range(batch)]
                mean = sum(lens) / batch
                want = plan.pick(batch, mean, lens)
                got = table.plan_pick(spec, batch, built.__contains__, mean, lens)
                assert (got or plan.variants[0]) == want, (key, graph, batch)
                replaced += table.lookup(spec, batch, mean, graph=graph, kv_lens=lens) not in built
                if stepped is not None:
                    qo = torch.arange(0, batch * key.q_len + 1, key.q_len, dtype=torch.int32)
                    ran = stepped.update(qo, block_table=torch.zeros((batch, 1), dtype=torch.int32),
                                         seq_lens=torch.tensor(lens, dtype=torch.int32),
                                         q_lens_host=[key.q_len] * batch, kv_lens_host=lens)
                    assert ran == want and any(ran is v for v in stepped.variants), (key, batch)
    assert replaced > 100  # the stand-ins were exercised
    # Each plan owns its compiled estimate's buffers: two plans of one ServingTable object,
    # stepped on two threads switching every microsecond, pick what each picks alone (the
    # fastest runnable stand-in matters).
    spec = CallSpec("fp8", 64, 16, 1)
    plans = [_plan(spec, table)[0] for _ in range(2)]
    rng = random.Random(3)
    steps = [[int(2 ** rng.uniform(6, 16)) for _ in range(rng.randint(1, 256))] for _ in range(300)]
    alone = [plans[0].pick(len(lens), sum(lens) / len(lens), lens) for lens in steps]
    got: list[list] = [[], []]

    def step(i: int) -> None:
        got[i] = [plans[i].pick(len(lens), sum(lens) / len(lens), lens) for lens in steps]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got[0] == alone and got[1] == alone
    finally:
        sys.setswitchinterval(interval)
