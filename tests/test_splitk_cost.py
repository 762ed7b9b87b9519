"""The split-K schedule model (backends/triton_splitk_schedule.py): schedule, fit and lookup."""

from unittest import mock

import pytest
import torch

from mla_tune.backends import schedule_module, triton_splitk, triton_splitk_schedule
from mla_tune.backends.gluon_fused_schedule import GluonModel
from mla_tune.backends.makespan import EXACT_WAVES
from mla_tune.backends.triton_splitk_schedule import (
    SPLITK_FLOOR,
    SplitKModel,
    occupancy_cap,
    reduce_steps,
    splitk_schedule,
    uniform_reduce_steps,
)
from mla_tune.core import CallSpec, Variant
from mla_tune.kernels import flash_decode
from mla_tune.kernels.split_rule import reduce_splits_per_step
from mla_tune.serving.call import Decoder
from mla_tune.serving.estimate import interpolate
from mla_tune.serving.table import Family, FamilyKey, ServingTable, load_serving_table
from mla_tune.xcompile import capture, check, targets
from mla_tune.xcompile.resources import SMEM_PER_SM, cuda_ctas_per_sm
from tests.helpers import REPO, call_with_host_lengths, cell_spec, serving_input

# max_splits 1: one program per sequence, so a batch's items are its lengths
ONE = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits=1,num_stages=2,"
                    "num_warps=4,q=bf16,tokens_per_split=128)")
SPLIT = Variant.parse("triton(block_h=16,block_n=64,dot_dtype=bf16,kv=bf16,max_splits=64,num_stages=2,"
                      "num_warps=4,q=bf16,tokens_per_split=512)")
FM = Variant.parse("flashmla(kv=bf16,q=bf16)")
KEY = FamilyKey("bf16", 64, 16, 1)
SPEC = CallSpec("bf16", 64, 16, 1)
UNIFORM = [1024] * 100
RAGGED = [100] * 99 + [1024 * 100 - 9900]  # UNIFORM's mean, one long sequence
TABLE = REPO / "tables" / "H200.serving.yaml"


def _splitk_models(key, points, sm_count, smem_per_sm=0) -> dict:
    """The schedule module's fit for the family's split-K point variants, by variant."""
    variants = sorted({v for times in points.values() for v in times if v.backend == "triton"}, key=str)
    platform = {"sm_count": sm_count, "smem_per_sm": smem_per_sm}
    return {m.variant: m for m in triton_splitk_schedule.fit(key, variants, points, {}, platform, interpolate)}


def _splitk(table, spec, kv_lens, calibrated=True) -> dict:
    """The split-K models' own estimates (no window, no floor)."""
    return {v: t for v, t in table.model_estimates(spec, kv_lens, calibrated).items() if v.backend == "triton"}


def _span(lens, occupancy=1, heads=16, variant=ONE, sm=132, item_tokens=0):
    return splitk_schedule(lens, heads, 1, dict(variant.params), occupancy, sm, item_tokens)[0]


def test_the_makespan_counts_waves_waits_for_the_longest_and_charges_each_items_fixed_tokens():
    assert _span([100] * 132) == 100            # one wave
    assert _span([100] * 133) == 200            # one program more: a second wave
    assert _span([100] * 264, occupancy=2) == 100  # two programs per SM: one wave again
    assert _span([1000] + [10] * 10) == 1000    # a ragged batch waits for its longest
    # 128 heads in 16-head tiles: 8 programs an item, so 132 SMs hold 16 items at once
    assert _span([100] * 16, heads=128) == 100 and _span([100] * 17, heads=128) == 200
    # programs, not items, fill the SMs: 33 items x 8 tiles are exactly two waves of 132
    # (whole items on 16 groups of 8 SMs would take three)
    assert _span([100] * 33, heads=128) == 200
    # past EXACT_WAVES waves: the mean load plus half the longest item
    n = 132 * (EXACT_WAVES + 1)
    assert _span([100] * n) == pytest.approx(n * 100 / 132 + 50)
    # each item costs its fixed tokens, so more splits are not free
    assert _span([100] * 132, item_tokens=50) == 150
    assert _span([100] * 133, item_tokens=50) == 300  # the second wave's item pays it again
    assert _span([100] * n, item_tokens=50) == pytest.approx(n * 150 / 132 + 75)
    # 5 x 1688 tokens, 128 heads, 64-head tiles: budget 132 runs 70 items (13 of 128 tokens and
    # one of 24 a sequence) on 66 slots, budget 66 runs 45 of 192 (one wave): faster by tokens,
    # slower at 128 tokens a program (as measured)
    def budget(b, cost):
        return _span([1688] * 5, heads=128, variant=SPLIT.with_params(
            block_h=64, tokens_per_split=128, split_budget=b), item_tokens=cost)
    assert budget(132, 0) == 152 < budget(66, 0) == 192
    assert budget(132, 128) == 152 + 2 * 128 > budget(66, 128) == 192 + 128


def _grid(overhead=10.0, rate=30 / 512, occupancy=1, kvs=(512, 1024, 2048), item_tokens=0):
    """A variant's times at uniform grid points from a known model."""
    return {(b, k): {ONE: overhead + rate * _span([k] * b, occupancy, item_tokens=item_tokens)}
            for b in (64, 128, 132, 133, 200, 264, 265, 300) for k in kvs}


def test_the_fit_recovers_the_overhead_and_an_occupancy_within_the_cap_of_warps_registers_and_memory():
    assert occupancy_cap(SPLIT) == 2 and occupancy_cap(ONE) == 2  # 4 warps at 186+ registers: 2 CTAs
    assert occupancy_cap(SPLIT.with_params(num_warps=8)) == 1
    assert occupancy_cap(ONE, 60 * 1024) == 1  # one KV tile of 32 tokens (36 KiB) and a reserved KiB
    assert occupancy_cap(SPLIT, 100 * 1024) == 1 and occupancy_cap(ONE, 300 * 1024) == 2
    # the fit keeps to the cap: two programs an SM fit the data, one fits the memory
    grid = _grid(occupancy=2, kvs=(1024,))
    assert _splitk_models(KEY, grid, 132)[ONE].occupancy == 2
    assert _splitk_models(KEY, grid, 132, smem_per_sm=60 * 1024)[ONE].occupancy == 1
    assert schedule_module("triton") is triton_splitk_schedule and schedule_module("torch") is None
    # overhead 10 us = a quarter of the fastest point's 40 us, one of the fractions tried
    m = _splitk_models(KEY, _grid(), 132)[ONE]
    assert (m.occupancy, m.overhead_us, m.item_tokens, m.sm_count) == (1, pytest.approx(10.0), 0, 132)
    assert m.fit_error < 1e-9
    # a program's fixed cost in tokens, one of ITEM_TOKENS (overhead 12.5 of 12.5 + 30/512 x 640)
    m = _splitk_models(KEY, _grid(overhead=12.5, item_tokens=128), 132)[ONE]
    assert (m.occupancy, m.overhead_us, m.item_tokens) == (1, pytest.approx(12.5), 128) and m.fit_error < 1e-9
    # two programs an SM fit a grid of one length a batch (above); on the
    # full grid a left-out point's neighbours share its batch's rate: occupancies look alike
    assert _splitk_models(KEY, _grid(occupancy=2), 132)[ONE].occupancy == 1
    assert _splitk_models(KEY, _grid(), 0) == {}  # no SM count, no model
    few = dict(list(_grid().items())[:5])
    assert _splitk_models(KEY, few, 132) == {}  # too few points


def _serving(points, models, calibration=None, batches=(64, 128, 256, 512), kvs=(512, 1024, 2048)):
    fam = Family(KEY, points=points, models=models, calibration=calibration or {})
    return ServingTable("H200", {}, list(batches), list(kvs), {KEY: fam})


def test_the_reduction_steps_follow_the_longest_sequences_splits():
    params = dict(SPLIT.params)  # a split per 512 tokens, up to the batch's budget of 64 each
    # 49 sequences, one of 56161 tokens: its 110 splits take 7 steps of 16 (the narrow grid:
    # 49 x 16 heads x 4 > 2048 programs); the uniform batch of the same tokens runs 18 each, 2 steps
    ragged = [56161] + [7600] * 48
    assert reduce_steps(ragged, 16, 1, params, 132) == 7
    assert reduce_steps([8722] * 49, 16, 1, params, 132) == 2
    # 31 sequences stay in the wide grid (31 x 16 x 4 <= 2048): 64 splits a step
    assert reduce_splits_per_step(31, 1, 16) == 64 and reduce_splits_per_step(33, 1, 16) == 16
    assert reduce_steps([56161] + [7600] * 30, 16, 1, params, 132) == 2
    # one split per sequence writes the output: no reduction; nor for a sequence of one split
    assert reduce_steps(ragged, 16, 1, dict(ONE.params), 132) == 0
    assert reduce_steps([100] * 49, 16, 1, params, 132) == 0
    assert splitk_schedule(ragged, 16, 1, params, 1, 132, 64)[1] == 7  # the schedule's steps


def test_the_models_estimate_a_ragged_batch_by_its_schedule_and_its_measured_reduction_steps():
    points = {pt: {**t, FM: 1.15 * t[ONE]} for pt, t in _grid().items()}  # FlashMLA 15% behind on every uniform batch
    table = _serving(points, _splitk_models(KEY, _grid(), 132))
    assert table.lookup(SPEC, 100, 1024.0, kv_lens=UNIFORM) == ONE
    est = table.estimates(SPEC, 100, 1024.0, kv_lens=RAGGED)
    assert est[ONE] == pytest.approx(10 + 30 / 512 * 92500, rel=1e-6)  # the long one alone
    assert table.lookup(SPEC, 100, 1024.0, kv_lens=RAGGED) == FM
    # without its model the split-K variant is interpolated as if uniform, and kept
    assert _serving(points, {}).lookup(SPEC, 100, 1024.0, kv_lens=RAGGED) == ONE
    # the reduction steps a ragged batch takes beyond a uniform batch's, at their measured cost
    split = SPLIT.with_params(tokens_per_split=16)  # many splits at the grid's short lengths
    points = {pt: {**t, split: 1.02 * t[ONE]} for pt, t in _grid().items()}
    models = _splitk_models(KEY, {pt: {split: t[split]} for pt, t in points.items()}, 132)
    table = _serving(points, models)
    params = dict(split.params)  # RAGGED's long sequence has most splits
    extra = reduce_steps(RAGGED, 16, 1, params, 132) - reduce_steps(UNIFORM, 16, 1, params, 132)
    assert extra > 1
    before = table.estimates(SPEC, 100, 1024.0, kv_lens=RAGGED)[split]
    assert _splitk(table, SPEC, RAGGED) == {split: pytest.approx(before)}
    # 100 x 16 heads: the narrow grid's 16 splits a step
    table = _serving(points, models, {"triton": {"reduce_step_us": {16: 5.0, 64: 1.0}}})
    after = table.estimates(SPEC, 100, 1024.0, kv_lens=RAGGED)[split]
    assert after == pytest.approx(before + 5.0 * extra)
    assert _splitk(table, SPEC, RAGGED, calibrated=False) == {split: pytest.approx(before)}
    # a uniform batch, and a call without its lengths, add nothing
    flat = table.estimates(SPEC, 100, 1024.0, kv_lens=UNIFORM)[split]
    assert flat == pytest.approx(table.estimates(SPEC, 100, 1024.0)[split])
    assert _splitk(table, SPEC, UNIFORM) == _splitk(table, SPEC, UNIFORM, calibrated=False)


@pytest.mark.parametrize("variant", [SPLIT, SPLIT.with_params(tokens_per_split=128, block_n=32, split_budget=264),
                                     SPLIT.with_params(tokens_per_split=16, max_splits=33, split_budget=33), ONE])
def test_a_uniform_batchs_steps_need_no_pass_over_its_lengths(variant):
    params = dict(variant.params)
    for batch in (1, 2, 7, 31, 33, 49, 100, 256):
        for kv_len in (1, 17, 512, 3000, 8722, 65536):
            for heads, q_len in ((16, 1), (16, 4), (128, 2)):
                assert uniform_reduce_steps(batch, kv_len, heads, q_len, params, 132) == \
                    reduce_steps([kv_len] * batch, heads, q_len, params, 132), (batch, kv_len, heads, q_len)


def test_a_split_k_estimate_stays_near_its_interpolated_time_and_a_gluon_one_does_not():
    """A split-K model may not say much faster than its uniform neighbours (SPLITK_FLOOR): at
    600 tokens a split per 512 makes 2 of 320 where the grid's 512 made one of 512, so a time
    of the longest item would be 38% faster. gluon_fused's model has no floor (GluonModel.floor).
    Where no split-K rate blends around the call, it comes from the interpolated time."""
    gluon = Variant.parse("gluon_fused(block_h=16,kv=bf16,max_splits=64,num_stages=2,q=bf16,"
                          "tokens_per_split=512,v_halves=1)")
    points = {(b, k): {SPLIT: 0.1 * k, FM: 0.12 * k, gluon: 0.11 * k}  # in proportion
              for b in (64, 128) for k in (512, 1024)}
    models = {v: cls(v, 1, 0.0, 132, 0.0) for v, cls in ((SPLIT, SplitKModel), (gluon, GluonModel))}
    table = _serving(points, models, batches=[64, 128], kvs=[512, 1024])
    interp = table.estimator.interpolated("times", table.families[KEY], 64, 600.0)
    assert interp[SPLIT] == pytest.approx(60.0, rel=0.01)  # the memo takes lengths to ~1%
    own = table.model_estimates(SPEC, [600] * 64)
    assert own[SPLIT] < 0.7 * interp[SPLIT] and own[gluon] < 0.7 * interp[gluon]
    estimates = table.estimates(SPEC, 64, 600.0, kv_lens=[600] * 64)
    assert estimates[SPLIT] == pytest.approx(SPLITK_FLOOR * interp[SPLIT])
    assert estimates[gluon] == pytest.approx(own[gluon])
    # at a grid point the model is exact, over the floor
    assert table.estimates(SPEC, 64, 1024.0, kv_lens=[1024] * 64)[SPLIT] == pytest.approx(102.4)
    # with no split-K variant in common at the two kv points around the call, the model takes the
    # rate of the variant's interpolated time, so a ragged call still sees its long sequence
    other = SPLIT.with_params(split_budget=264, tokens_per_split=128, block_n=32)
    points = {(64, 512): {ONE: 51.2, FM: 60.0}, (64, 1024): {other: 90.0, FM: 110.0}}
    models = {ONE: SplitKModel(ONE, 1, 0.0, 132, 0.0), other: SplitKModel(other, 1, 0.0, 132, 0.0)}
    table = _serving(points, models, batches=[64], kvs=[512, 1024])
    fam = table.families[KEY]
    assert table.estimator.interpolated("rates", fam, 64, 700.0) == {}  # nothing in common to blend by
    times = table.estimator.interpolated("times", fam, 64, 700.0)
    assert ONE in times  # (other, at the point of weight 0.45 alone, sits out: MIN_MEASURED_WEIGHT)
    uniform = _splitk(table, SPEC, [700] * 64)
    assert uniform[ONE] == pytest.approx(times[ONE], rel=0.02)  # a uniform call: the interpolated time
    ragged = [100] * 63 + [700 * 64 - 6300]  # the same tokens, one long sequence (one program each)
    assert table.estimates(SPEC, 64, 700.0, kv_lens=ragged)[ONE] > 10 * uniform[ONE]


# Variants of the committed serving table's split-K models, one of each (block_n, num_warps)
COMPILE_CASES = [
    (KEY, "triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits=64,num_stages=2,"
          "num_warps=4,q=bf16,split_budget=264,tokens_per_split=128)"),
    (KEY, "triton(block_h=16,block_n=64,dot_dtype=bf16,kv=bf16,max_splits=64,num_stages=2,"
          "num_warps=4,q=bf16,tokens_per_split=512)"),
    (FamilyKey("fp8", 64, 16, 4), "triton(block_h=16,block_n=64,dot_dtype=bf16,kv=fp8,max_splits=64,num_stages=2,"
                                  "num_warps=8,q=bf16,split_budget=132,tokens_per_split=128)"),
]


def compiled_ctas() -> list[dict]:
    """Each COMPILE_CASES variant's serving stage-1 launch (build_serving's real path) compiled
    for sm_90: registers, shared memory, CTAs per SM. Runs without TRITON_INTERPRET."""
    facts = check.facts_for("H200")
    out = []
    with mock.patch.object(triton_splitk, "device_sm_count", lambda device=None: facts.sm_count):
        for key, text in COMPILE_CASES:
            spec = cell_spec("triton", key.page_size, key.heads, key.q_len, key.kv_format)
            with capture.recording(facts) as launches:
                call_with_host_lengths(triton_splitk.build_serving(Variant.parse(text), spec, "cpu"),
                                       serving_input(spec, [1024, 700, 64, 3000], 5, "cpu"))
            x = next(x for x in launches if x.kernel.fn.__name__ == "_fd_serving_stage1_kernel")
            bound = targets.bind(x.kernel, x.grid, x.args, x.kwargs, targets.target_for(facts))
            record = targets.compile_bound(bound, facts.lds_bytes)
            out.append({k: record.get(k) for k in ("error", "registers", "lds", "ctas_per_sm")})
    return out


def test_the_occupancy_cap_is_what_the_kernel_compiled_for_sm90_gets():
    """On the CPU, with the installed Triton (the H200's 3.6 gives the same CTAs)."""
    from tests.helpers import run_outside_the_interpreter

    records = run_outside_the_interpreter("tests.test_splitk_cost", "compiled_ctas", timeout=900)
    for (_key, text), record in zip(COMPILE_CASES, records, strict=True):
        assert record["error"] is None, record
        assert record["ctas_per_sm"] == occupancy_cap(Variant.parse(text), SMEM_PER_SM["sm_90"]), (text, record)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_the_occupancy_cap_is_what_the_compiled_kernel_gets_on_the_gpu(monkeypatch, capsys):
    """Each split-K variant of the committed table, launched here, holds as many CTAs per SM
    (cuda_ctas_per_sm) as `occupancy_cap` lets the fit choose."""
    launched = []
    kernel = flash_decode._fd_serving_stage1_kernel
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: launched.append(run(*a, **kw)) or launched[-1], raising=False)
    smem = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    rows, wrong = [], []
    for key, family in load_serving_table(TABLE).families.items():
        spec = cell_spec("triton", key.page_size, key.heads, key.q_len, key.kv_format)
        inp = serving_input(spec, [1024, 700, 64, 3000], 5, "cuda")
        for variant in (v for v in family.models if v.backend == "triton"):
            launched.clear()
            call_with_host_lengths(Decoder(spec, variant=variant, device="cuda"), inp)
            torch.cuda.synchronize()
            assert launched, f"{variant}: no stage-1 launch seen"
            compiled = launched[-1]
            ctas = cuda_ctas_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, "sm_90")
            cap = occupancy_cap(variant, smem)
            rows.append(f"{ctas} {cap} regs {compiled.n_regs} smem {compiled.metadata.shared} {key} {variant}")
            if ctas != cap:
                wrong.append(rows[-1])
    with capsys.disabled():
        print("\ncompiled CTAs/SM, occupancy_cap, registers, shared memory, family, variant:\n" + "\n".join(rows))
    assert rows
    assert not wrong, wrong
