"""gluon_fused's serving schedule model: its replay of the kernel's split rule and shared
memory, and what its makespan tells a ragged batch from a uniform one."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from mla_tune.backends import gluon_fused_schedule as gl
from mla_tune.backends import schedule_module
from mla_tune.core import Variant
from mla_tune.kernels.gluon_serving import GS_BN, GS_ROWS, gs_num_splits, gs_smem_bytes


def _params(**kw) -> dict:
    return dict(_variant(**kw).params)


def _variant(max_splits=16, tokens_per_split=512, block_h=16, v_halves=1, split_budget=0, kv="fp8"):
    extra = {"split_budget": split_budget} if split_budget else {}
    return Variant.make("gluon_fused", kv=kv, q="fp8_dynamic" if kv == "fp8" else "bf16", block_h=block_h,
                        max_splits=max_splits, num_stages=2, tokens_per_split=tokens_per_split,
                        v_halves=v_halves, **extra)


def test_the_backends_schedule_model_splits_as_the_kernel_does():
    """gluon_splits is gs_num_splits, with and without a batch budget, empty sequences
    included; each split holds per tokens but the last, which holds the rest (> 0)."""
    assert schedule_module("gluon_fused") is gl
    assert gl.TILE == GS_BN
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


@pytest.mark.parametrize("rows", GS_ROWS)
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("fp8", [True, False])
def test_the_shared_memory_is_the_kernels(rows, stages, fp8):
    assert gl.smem_bytes(rows, stages, fp8) == gs_smem_bytes(rows, stages, fp8)


def test_the_occupancy_is_what_the_shared_memory_holds():
    fp8_16 = _variant(block_h=16)  # 16 rows at q_len 1: two programs of ~85 KB
    assert gl.occupancy_cap(fp8_16, 1) == 228 * 1024 // gs_smem_bytes(16, 2, True) == 2
    assert gl.occupancy_cap(_variant(block_h=16, kv="bf16"), 1) == 1
    assert gl.occupancy_cap(_variant(block_h=8), 4) == 228 * 1024 // gs_smem_bytes(32, 2, True)


def test_a_ragged_batch_waits_on_a_small_split_cap_and_more_programs_per_split_past_a_wave():
    """One 64k sequence among short ones bounds the call at max_splits 16, far less at 64; a
    uniform short batch (fewer splits than either cap) has the same makespan under both. Two
    V halves or 8-head tiles double the programs per split: past a wave the makespan grows,
    within one it does not."""
    ragged = [64000] + [1000] * 31
    few = gl.gluon_schedule(ragged, 16, _params(max_splits=16), 2, 132)
    many = gl.gluon_schedule(ragged, 16, _params(max_splits=64), 2, 132)
    assert few >= 4000 and many < 0.5 * few
    uniform = [1000] * 32
    assert (gl.gluon_schedule(uniform, 16, _params(max_splits=16), 2, 132)
            == gl.gluon_schedule(uniform, 16, _params(max_splits=64), 2, 132))
    lens = [8192] * 64
    base = gl.gluon_schedule(lens, 16, _params(), 1, 132)
    assert gl.gluon_schedule(lens, 16, _params(v_halves=2), 1, 132) > 1.5 * base
    assert gl.gluon_schedule(lens, 16, _params(block_h=8), 1, 132) > 1.5 * base
    short = [512] * 4
    assert (gl.gluon_schedule(short, 16, _params(v_halves=2), 1, 132)
            == gl.gluon_schedule(short, 16, _params(), 1, 132))


def test_the_leaderboards_variants_get_no_model():
    """The leaderboard's gluon_fused variants (no tokens_per_split) are not serving variants."""
    lb = Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_n=64, num_splits=8, num_stages=2)
    points = {(b, k): {lb: 10.0 + b * k / 1e4} for b in (1, 8, 32) for k in (1024, 4096, 16384)}
    assert gl.fit(SimpleNamespace(heads=16, q_len=1), [lb], points, {}, {"sm_count": 132},
                  lambda *a: {}) == []
