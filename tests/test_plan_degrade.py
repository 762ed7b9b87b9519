"""DecodePlan degrades as runtime.load does: a table pick whose backend cannot serve the spec
here warns once when the plan is made and is replaced per step by the cell's best runnable
variant (the runner-up, else the default), each replacement counted in the plan's misses."""

from __future__ import annotations

import random
import sys
import threading
import warnings

import torch

from mla_tune import problem
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

SPEC = CallSpec("bf16", page_size=64, heads=16, max_q_len=1)
FLASHMLA = Variant.make("flashmla", kv="bf16", q="bf16")
RUNNER_UP = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=fp16,kv=bf16,max_splits=2,num_stages=1,"
                          "num_warps=4,q=bf16,tokens_per_split=64)")


def _table() -> ServingTable:
    fam = Family(FamilyKey.of(SPEC))
    fam.cells[(4, 256)] = Cell(4, 256, FLASHMLA, 10.0, runner_up={"variant": str(RUNNER_UP), "time_us": 11.0})
    fam.graph[4] = GraphPick(4, FLASHMLA, 0.05, 32)
    return ServingTable("H200", {}, [2, 4], [32, 256], {fam.key: fam})


def _plan(spec: CallSpec, table: ServingTable, max_batch: int = 256, **kw) -> tuple[DecodePlan, list[str]]:
    """The plan (warm=False unless kw says), and what it warned when it was made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = DecodePlan(spec, max_batch=max_batch, table=table, **{"warm": False, **kw})
    return plan, [str(w.message) for w in caught]


def test_a_plan_whose_table_picks_flashmla_runs_here_and_says_so_once():
    plan, messages = _plan(SPEC, _table(), 4, warm=True)
    said = [m for m in messages if "cannot serve it here" in m]
    assert len(said) == 1, messages
    assert "flashmla" in said[0]
    assert FLASHMLA not in plan.variants and RUNNER_UP in plan.variants
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further word per step
        for step, kv_lens in enumerate(([200, 250, 300], [190, 260, 220, 240])):
            inp = serving.make_input([1] * len(kv_lens), kv_lens, 16, 64, "bf16", seed=30 + step)
            picked = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens,
                                 mean_kv_len=sum(kv_lens) / len(kv_lens))
            assert picked == RUNNER_UP  # the cell's runner-up stands in
            out = plan.run(inp.q, inp.kv)
            result = problem.check(out.float(), inp.reference(), problem.RULES["strict"])
            assert result.passed, result.reason
    assert plan.misses == {"flashmla cannot run here": 2}


def test_a_graph_plan_falls_back_to_the_default_where_no_runner_up_is_kept():
    spec = CallSpec("bf16", page_size=64, heads=16, max_q_len=1, graph=True)
    fam = Family(FamilyKey.of(spec))
    fam.graph[4] = GraphPick(4, FLASHMLA, 0.05, 32)
    table = ServingTable("H200", {}, [2, 4], [32, 256], {fam.key: fam})
    plan, messages = _plan(spec, table, 4)
    assert sum("cannot serve it here" in m for m in messages) == 1
    inp = serving.make_input([1, 1, 1], [70, 129, 3], 16, 64, "bf16", seed=40)
    default = plan.variants[0]  # the plan's default: its first variant
    assert default.backend == "triton"
    assert plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens) == default
    out = plan.run(inp.q, inp.kv)
    assert problem.check(out.float(), inp.reference(), problem.RULES["strict"]).passed
    assert plan.misses == {"flashmla cannot run here": 1}
    assert torch.isfinite(out).all()


def test_the_tables_plan_pick_is_what_a_plan_steps_with_where_picks_cannot_run():
    """ServingTable.plan_pick (what `verify --rescore --unrunnable` scores) against DecodePlan.pick
    on the committed table, here where gluon_fused, FlashInfer and FlashMLA cannot run."""
    table = load_serving_table("tables/H200.serving.yaml")
    rng = random.Random(7)
    replaced = 0
    for key in sorted(table.families, key=str):
        for graph in (False, True):
            spec = CallSpec(key.kv_format, key.page_size, key.heads, key.q_len, graph=graph)
            plan, _ = _plan(spec, table)
            built = set(plan.variants)
            for _ in range(60):
                batch = rng.randint(1, 256)
                lens = [int(2 ** rng.uniform(0, 17)) for _ in range(batch)]
                mean = sum(lens) / batch
                want = plan.pick(batch, mean, lens)
                got = table.plan_pick(spec, batch, built.__contains__, mean, lens)
                assert (got or plan.variants[0]) == want, (key, graph, batch)
                replaced += table.lookup(spec, batch, mean, graph=graph, kv_lens=lens) not in built
    assert replaced > 100  # the stand-ins were exercised


def test_plans_of_one_table_stepped_on_two_threads_pick_as_each_alone():
    """Each plan owns its compiled estimate's buffers: two plans of one ServingTable object,
    stepped on two threads switching every microsecond, pick what each picks alone (here on
    the CPU the fastest runnable stand-in matters: gluon_fused and the vendors cannot run)."""
    table = load_serving_table("tables/H200.serving.yaml")
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


def test_a_steps_pick_is_the_plans_own_variant_object():
    """update() returns the very object the plan keys its runner by (plan.variants), so a
    step's dict lookups match by identity rather than by comparing the variants' fields."""
    table = load_serving_table("tables/H200.serving.yaml")
    spec = CallSpec("bf16", 64, 16, 1, host_lengths=True)
    plan, _ = _plan(spec, table)
    own = {id(v) for v in plan.variants}
    rng = random.Random(5)
    for _ in range(60):
        lens = [int(2 ** rng.uniform(6, 16)) for _ in range(rng.randint(1, 256))]
        batch = len(lens)
        picked = plan.update(torch.arange(batch + 1, dtype=torch.int32),
                             block_table=torch.zeros((batch, -(-max(lens) // 64)), dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), q_lens_host=[1] * batch,
                             kv_lens_host=lens)
        assert id(picked) in own and picked == plan.pick(batch, sum(lens) / batch, lens)
