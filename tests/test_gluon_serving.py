"""The Gluon serving kernel's CPU-checkable parts: its split rule, its split reduction (plain
Triton) and gluon_fused's serving record, variants and refusals; and gluon_fused's serving
schedule model: its replay of the kernel's split rule and shared memory, and what its makespan
tells a ragged batch from a uniform one."""

import itertools
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mla_tune.backends import capabilities, gluon_fused, schedule_module
from mla_tune.backends import gluon_fused_schedule as gl
from mla_tune.core import CORE_HEADS, QK_DIM, V_DIM, CallSpec, Variant
from mla_tune.gpu import fake_platform
from mla_tune.kernels import gluon_serving
from mla_tune.kernels.gluon_serving import GS_BN, GluonServingWorkspace, gs_num_splits, gs_reduce
from mla_tune.serving.inputs import reference

H200 = fake_platform("H200")


@pytest.mark.parametrize("max_splits, tokens_per_split", [(1, 512), (4, 64), (16, 512), (64, 64)])
def test_the_split_rule_makes_nonempty_splits_of_whole_tiles_within_the_cap(max_splits, tokens_per_split):
    for seq_len in [0, 1, 2, 63, 64, 65, 129, 511, 512, 513, 3000, 4133, 65536]:
        splits = gs_num_splits(seq_len, max_splits, tokens_per_split)
        if seq_len == 0:
            assert splits == 0
            continue
        tiles = math.ceil(seq_len / GS_BN)
        per = math.ceil(tiles / splits)
        assert 1 <= splits <= min(max_splits, tiles) and (splits - 1) * per < tiles <= splits * per, seq_len
        if max_splits >= tiles and tokens_per_split == GS_BN:
            assert splits == tiles  # a split per tile when the cap allows it
    assert gs_num_splits(3000, 16, 512) == 6 and gs_num_splits(300, 4, 64) == 3


def test_a_batch_budget_shares_its_splits_by_length():
    lengths = [4096, 1024, 1024, 2048]  # 8192 tokens
    # 16 splits: 8, 2, 2 and 4, whatever tokens_per_split allows beyond that
    assert [gs_num_splits(n, 32, 64, 16, sum(lengths)) for n in lengths] == [8, 2, 2, 4]
    # the per-sequence caps still hold: tokens_per_split, max_splits, at least one split
    assert [gs_num_splits(n, 32, 1024, 16, sum(lengths)) for n in lengths] == [4, 1, 1, 2]
    assert [gs_num_splits(n, 3, 64, 16, sum(lengths)) for n in lengths] == [3, 2, 2, 3]
    assert gs_num_splits(10, 32, 64, 16, 100000) == 1


def _partials(q, kv, q_lens, kv_lens, heads, max_splits, tokens_per_split, cap, budget):
    """In torch, the serving kernel's partials per (split, new token, head): normalized O and
    log2-sum-exp (0 and -inf for a split a new token sees none of)."""
    part_o = torch.full((max_splits * cap * heads, V_DIM), float("nan"))
    part_lse = torch.full((max_splits * cap * heads,), float("nan"))
    tok0 = kv0 = 0
    for q_len, seq_len in zip(q_lens, kv_lens, strict=True):
        k = kv[kv0:kv0 + seq_len]
        splits = gs_num_splits(seq_len, max_splits, tokens_per_split, budget, sum(kv_lens))
        per = math.ceil(math.ceil(seq_len / GS_BN) / splits) * GS_BN
        for i in range(q_len):
            tok = tok0 + i
            scores = q[tok] @ k.T * math.log2(math.e)  # (heads, seq_len), log2 units
            scores[:, seq_len - q_len + 1 + i:] = float("-inf")  # causal among the new tokens
            for s in range(splits):
                part = scores[:, s * per:(s + 1) * per]
                rows = (s * cap + tok) * heads + torch.arange(heads)
                m = part.max(dim=-1).values
                if bool(torch.isinf(m).all()):  # the causal mask leaves this split nothing
                    part_o[rows], part_lse[rows] = 0.0, float("-inf")
                    continue
                p = torch.exp2(part - m[:, None])
                l_sum = p.sum(-1)
                part_o[rows] = (p @ k[s * per:(s + 1) * per, :V_DIM]) / l_sum[:, None]
                part_lse[rows] = m + torch.log2(l_sum)
        tok0 += q_len
        kv0 += seq_len
    return part_o, part_lse


@pytest.mark.parametrize("paged, budget", [(False, 0), (True, 0), (True, 5), (False, 9)])
def test_the_reduction_combines_the_splits_into_the_exact_answer(device, paged, budget):
    heads, max_splits, tokens_per_split = 2, 4, 64  # two heads: the interpreter runs a program per row
    q_lens, kv_lens = [1, 2, 2, 1, 2], [1, 17, 300, 130, 65]  # 1, 1, 3, 3 and 2 splits
    gen = torch.Generator().manual_seed(5)
    q = torch.randn((sum(q_lens), heads, QK_DIM), generator=gen) / 16
    kv = torch.randn((sum(kv_lens), QK_DIM), generator=gen)
    workspace = GluonServingWorkspace.allocate(sum(q_lens), heads, max_splits, device)
    part_o, part_lse = _partials(q, kv, q_lens, kv_lens, heads, max_splits, tokens_per_split,
                                 workspace.max_total_q, budget)
    workspace.part_o.copy_(part_o)
    workspace.part_lse.copy_(part_lse)
    qo_ptr, kv_ptr = (torch.tensor([0, *itertools.accumulate(n)]).int() for n in (q_lens, kv_lens))
    exact, exact_lse = reference(q, qo_ptr, kv[:, None], kv_indptr=kv_ptr, sm_scale=1.0, return_lse=True)
    layout = {"seq_lens": torch.tensor(kv_lens, dtype=torch.int32, device=device)} if paged else {
        "kv_indptr": kv_ptr.to(device)}
    sentinel = 7.0
    out = torch.full((sum(q_lens), heads, V_DIM), sentinel, dtype=torch.bfloat16, device=device)
    lse = torch.full((sum(q_lens), heads), sentinel, device=device)
    gs_reduce(qo_ptr.to(device), workspace, out, lse, max_q_len=2, tokens_per_split=tokens_per_split,
              split_budget=budget, **layout)
    split = [gs_num_splits(n, max_splits, tokens_per_split, budget, sum(kv_lens)) > 1 for n in kv_lens]
    rows = torch.tensor([s for s, n in zip(split, q_lens, strict=True) for _ in range(n)])
    assert 0 < int(rows.sum()) < len(rows)
    torch.testing.assert_close(out[rows].float().cpu(), exact[rows], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse[rows].cpu(), exact_lse[rows], rtol=1e-4, atol=1e-4)
    # a sequence of one split: the serving kernel wrote its rows; the reduction leaves them
    assert bool((out[~rows] == sentinel).all()) and bool((lse[~rows] == sentinel).all())


def test_the_record_serves_the_engines_layouts_and_refuses_the_rest():
    caps = capabilities("gluon_fused")
    for kv, page, heads in itertools.product(("fp8", "bf16"), (0, 64, 128), CORE_HEADS):
        spec = CallSpec(kv, page, heads, max_q_len=4, mixed_q_len=True, graph=True, return_lse=True)
        assert caps.refusal(spec) is None, spec
    assert "not pages of 16" in caps.refusal(CallSpec("fp8", 16))
    assert "q_len up to 4" in caps.refusal(CallSpec("fp8", 64, max_q_len=8))
    assert "not mxfp4" in caps.refusal(CallSpec("mxfp4", 64))


def test_default_and_offered_variants_fit_every_family_and_name_their_q_mode():
    for kv, heads, q_len in itertools.product(("fp8", "bf16"), CORE_HEADS, (1, 2, 3, 4)):
        spec = CallSpec(kv, 64, heads, max_q_len=q_len, mixed_q_len=True)
        offered = gluon_fused.serving_candidates(spec, {"num_stages": [2, 3]}, H200)
        default = gluon_fused.default_serving_variant(spec, H200)
        assert default.get("q") == {"fp8": "fp8_dynamic", "bf16": "bf16"}[kv]
        for variant in [default, *offered]:
            gluon_fused.validate(variant)
            rows = variant.get("block_h") * (1 << (q_len - 1).bit_length())
            assert rows in gluon_serving.GS_ROWS and heads % variant.get("block_h") == 0
            assert variant.get("kv") == kv and variant.get("max_splits") <= gluon_serving.GS_MAX_SPLITS
        assert offered, spec
    # bf16 at 32 rows spills with every V dim in one program: never offered so
    bf16 = gluon_fused.serving_candidates(CallSpec("bf16", 64, 128), {}, H200)
    assert not [v for v in bf16 if v.get("block_h") == 32 and v.get("v_halves") == 1]
    assert [v for v in bf16 if v.get("block_h") == 32 and v.get("v_halves") == 2]
    # batch budgets: ceil(W x 132 SMs / programs per split) splits for the batch
    budgets = gluon_fused.serving_candidates(CallSpec("fp8", 64, 128), {"rows": [32], "v_halves": [1],
                                                                        "batch_waves": [1, 2]}, H200)
    assert sorted(v.get("split_budget", 0) for v in budgets) == [0, 33, 66]
    assert all(gluon_fused.validate(v) is None for v in budgets)


def test_serving_variants_are_refused_by_name():
    spec = CallSpec("bf16", 64, 128)
    good = gluon_fused.default_serving_variant(spec, H200)
    for bad, match in (
        (good.with_params(q="fp8_dynamic"), "takes q=bf16"),
        (good.with_params(v_halves=3), "v_halves"),
        (good.with_params(max_splits=65), "max_splits"),
        (good.with_params(num_stages=3), "shared memory"),  # 3 stages of bf16 tiles: over 227 KB
    ):
        with pytest.raises(ValueError, match=match):
            gluon_fused.validate(bad)
    with pytest.raises(ValueError, match="spills registers"):
        gluon_fused.build_serving(good.with_params(block_h=32, v_halves=1), spec, "cpu")
    with pytest.raises(ValueError, match="reads bf16 KV but the call's cache is fp8"):
        gluon_fused.build_serving(good, CallSpec("fp8", 64, 128), "cpu")
    with pytest.raises(ValueError, match="leaderboard variant"):
        gluon_fused.build_serving(Variant.parse(
            "gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=rs8)"), spec, "cpu")
    with pytest.raises(ValueError, match="unknown key"):
        gluon_fused.serving_candidates(spec, {"block_n": [64]}, H200)
    if not torch.cuda.is_available():  # Gluon has no interpreter: a CPU build says so
        with pytest.raises(ValueError, match="needs an NVIDIA sm_90 GPU"):
            gluon_fused.build_serving(good, spec, "cpu")


def test_a_table_entry_naming_a_serving_variant_passes_the_tables_rules():
    # the table's check (backends/params.py, no torch) knows the serving form and its split cap
    from mla_tune.backends.params import PARAM_RULES, PR_GS_MAX_SPLITS, check_variant_rules
    from mla_tune.tables.table import TableError, check_variant_field

    assert PR_GS_MAX_SPLITS == gluon_serving.GS_MAX_SPLITS
    spec = CallSpec("fp8", 64, 128, max_q_len=2)
    for variant in [gluon_fused.default_serving_variant(spec, H200),
                    *gluon_fused.serving_candidates(spec, {"batch_waves": [1]}, H200)]:
        check_variant_rules(variant, PARAM_RULES["gluon_fused"])
        for check_params in (False, True):
            assert check_variant_field("cell", "variant", {"variant": str(variant)}, ["gluon_fused"],
                                       check_params) == variant
    bad = gluon_fused.default_serving_variant(spec, H200).with_params(max_splits=PR_GS_MAX_SPLITS + 1)
    with pytest.raises(TableError, match="max_splits"):
        check_variant_field("cell", "variant", {"variant": str(bad)}, ["gluon_fused"], False)


# ---------------------------------------------------------------- the schedule model
def _variant(max_splits=16, block_h=16, v_halves=1, kv="fp8"):
    return Variant.make("gluon_fused", kv=kv, q="fp8_dynamic" if kv == "fp8" else "bf16", block_h=block_h,
                        max_splits=max_splits, num_stages=2, tokens_per_split=512, v_halves=v_halves)


def test_the_backends_schedule_model_splits_and_holds_shared_memory_as_the_kernel_does():
    """gluon_splits is gs_num_splits, with and without a batch budget, empty sequences
    included; each split holds per tokens but the last, which holds the rest (> 0). The
    shared memory is the kernel's, and the occupancy what an SM holds of it."""
    assert schedule_module("gluon_fused") is gl and gl.TILE == GS_BN
    rng = random.Random(7)
    for _ in range(300):
        lens = np.asarray([int(2 ** rng.uniform(0, 16.5)) * (rng.random() > 0.1) for _ in range(rng.randint(1, 64))])
        max_splits, tps = rng.choice([1, 4, 16, 33, 64]), rng.choice([64, 128, 512, 2048])
        budget = rng.choice([0, 0, 66, 264])
        splits, per = gl.gluon_splits(lens, max_splits, tps, budget)
        total = int(lens.sum())
        assert splits.tolist() == [gs_num_splits(int(n), max_splits, tps, budget, total) for n in lens]
        live = lens > 0
        last = lens[live] - (splits[live] - 1) * per[live]
        assert (last > 0).all() and (last <= per[live]).all()
    for rows, stages, fp8 in itertools.product(gluon_serving.GS_ROWS, (2, 3, 4), (True, False)):
        assert gl.smem_bytes(rows, stages, fp8) == gluon_serving.gs_smem_bytes(rows, stages, fp8)
    fp8_16 = _variant(block_h=16)  # 16 rows at q_len 1: two programs of ~85 KB
    assert gl.occupancy_cap(fp8_16, 1) == 228 * 1024 // gluon_serving.gs_smem_bytes(16, 2, True) == 2
    assert gl.occupancy_cap(_variant(block_h=16, kv="bf16"), 1) == 1
    assert gl.occupancy_cap(_variant(block_h=8), 4) == 228 * 1024 // gluon_serving.gs_smem_bytes(32, 2, True)


def test_a_ragged_batch_waits_on_a_small_split_cap_and_more_programs_per_split_past_a_wave():
    """One 64k sequence among short ones bounds the call at max_splits 16, far less at 64; a
    uniform short batch (fewer splits than either cap) has the same makespan under both. Two
    V halves or 8-head tiles double the programs per split: past a wave the makespan grows,
    within one it does not."""
    def makespan(lens, q_len, **variant):  # 16 heads on 132 SMs
        return gl.gluon_schedule(lens, 16, _variant(**variant).p, q_len, 132)

    ragged = [64000] + [1000] * 31
    few, many = makespan(ragged, 2, max_splits=16), makespan(ragged, 2, max_splits=64)
    assert few >= 4000 and many < 0.5 * few
    assert makespan([1000] * 32, 2, max_splits=16) == makespan([1000] * 32, 2, max_splits=64)
    lens = [8192] * 64
    base = makespan(lens, 1)
    assert makespan(lens, 1, v_halves=2) > 1.5 * base
    assert makespan(lens, 1, block_h=8) > 1.5 * base
    assert makespan([512] * 4, 1, v_halves=2) == makespan([512] * 4, 1)


def test_the_leaderboards_variants_get_no_model():
    """The leaderboard's gluon_fused variants (no tokens_per_split) are not serving variants."""
    lb = Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_n=64, num_splits=8, num_stages=2)
    points = {(b, k): {lb: 10.0 + b * k / 1e4} for b in (1, 8, 32) for k in (1024, 4096, 16384)}
    assert gl.fit(SimpleNamespace(heads=16, q_len=1), [lb], points, {}, {"sm_count": 132},
                  lambda *a: {}) == []
