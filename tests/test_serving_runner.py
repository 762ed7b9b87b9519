"""kernels/serving_runner.py: the own kernels' serving runner, its scratch and shared launch
checks; every call is refused or built before a launch."""

import runpy
import sys
from dataclasses import replace

import pytest

from mla_tune import core, gpu
from mla_tune.backends import get_backend
from mla_tune.core import CallSpec, Variant
from mla_tune.kernels.flash_decode import fill_splits
from mla_tune.kernels.fused_decode import FusedServingWorkspace
from mla_tune.kernels.serving_runner import (
    OwnServingRunner,
    SharedScratch,
    check_serving_build,
    serving_launch_args,
)
from mla_tune.kernels.split_rule import most_items
from mla_tune.serving import inputs as serving
from tests.helpers import REPO, assert_close


@pytest.mark.parametrize("backend", ["triton", "triton_fused"])
def test_both_own_backends_build_an_own_serving_runner_with_the_shared_launch_args(backend):
    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, sm_scale=0.125)
    module = get_backend(backend)
    variant = module.default_serving_variant(spec, gpu.fake_platform("H200"))
    runner = module.build_serving(variant, spec, "cpu")
    assert isinstance(runner, OwnServingRunner) and runner.name == backend and runner.spec == spec
    shared = serving_launch_args(variant, spec)
    assert shared["sm_scale"] == 0.125 and shared["max_q_len"] == 2
    assert shared["max_splits"] == variant.get("max_splits") and shared["block_h"] == variant.get("block_h")
    # the build's checks return next_pow2(max_q_len): q_len 3 fills 4 rows of each head
    three = replace(spec, max_q_len=3)
    assert check_serving_build(backend, variant, three, module.CAPABILITIES, True, 16) == 4


def test_a_split_k_runner_with_a_batch_budget_splits_by_batch_size_and_sizes_its_scratch_to_it(device):
    """Budget 7 over 3 sequences of 300: 2 splits each (192 tokens in 64-token tiles) where
    max_splits alone gives 3; on a GPU fill_splits raises the share to 3. Its workspace holds
    what the budget launches (split_rule.most_items), not max_splits per sequence."""
    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=1)
    triton = get_backend("triton")
    variant = triton.default_serving_variant(spec, gpu.fake_platform("cpu")).with_params(
        max_splits=4, tokens_per_split=32, split_budget=7)
    runner = triton.build_serving(variant, spec, device)
    inp = serving.make_input([1, 1, 1], [300, 300, 300], 16, 16, "bf16", seed=5, device=device)
    out = runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    assert_close(out, inp.reference(), 1e-2, "split_budget")
    sm_count = core.device_sm_count(device)
    share = fill_splits(7, 3, 16 // variant.get("block_h"), 4, sm_count)
    assert runner.workspace.split_count[:3].tolist() == {2: [2, 2, 2], 4: [3, 3, 3]}[share]
    most = most_items(3, 4, 1, 7, 1, sm_count)
    assert runner.workspace.max_items == most == runner.workspace.part_out.shape[0] <= 4 * 3 + 3
    assert device == "cuda" or most == 2 * 3 + 3  # the CPU: 7 // 3 = 2 splits each, plus one each
    with pytest.raises(ValueError, match="before the runner's first call"):
        runner.share_scratch(SharedScratch(device), 3)
    unbudgeted = triton.build_serving(variant.with_params(split_budget=0), spec, device)
    unbudgeted(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    assert unbudgeted.workspace.split_count[:3].tolist() == [3, 3, 3]


def test_shared_scratch_reserves_first_places_views_and_keeps_a_larger_workspace_its_own():
    scratch = SharedScratch("cpu")
    small = FusedServingWorkspace.allocate(4, 16, 2, "meta")
    large = FusedServingWorkspace.allocate(8, 16, 4, "meta")
    scratch.reserve(scratch.shared_bytes(small))
    placed = scratch.place(FusedServingWorkspace.allocate(4, 16, 2, "meta"))
    assert scratch.nbytes == scratch.shared_bytes(small) and placed.part_o.device.type == "cpu"
    assert placed.part_o.data_ptr() == scratch.buffer.data_ptr()
    assert placed.part_lse.data_ptr() == scratch.buffer.data_ptr() + -(-placed.part_o.nbytes // 256) * 256
    assert int(placed.count.abs().sum()) == 0  # not shared, and zeroed as allocate makes it
    with pytest.raises(ValueError, match="before the first call"):
        scratch.reserve(scratch.shared_bytes(large))
    alone = scratch.place(large)  # past the buffer: its own tensors
    assert tuple(alone.part_o.shape) == (8, 4, 16, 512)
    assert not scratch.buffer.data_ptr() <= alone.part_o.data_ptr() < scratch.buffer.data_ptr() + scratch.nbytes


@pytest.mark.parametrize("heads, q_len, budget", [(128, 1, 66), (128, 2, 33), (128, 4, 17), (16, 4, 132),
                                                   (16, 1, 0), (16, 2, 0)])
def test_the_gpu_default_of_64_rows_shares_one_wave_of_splits_and_holds_what_that_launches(heads, q_len, budget):
    """On a GPU (an H200's 132 SMs) the split-K default whose head tile makes 64 MMA rows takes
    a batch budget of one wave over its head tiles (docs/perf.md 7), so its scratch is what
    that budget launches; a 16- or 32-row default and the interpreter's keep none."""
    spec = CallSpec("fp8", page_size=64, heads=heads, max_q_len=q_len)
    triton = get_backend("triton")
    variant = triton.default_serving_variant(spec, gpu.fake_platform("H200"))
    assert variant.get("split_budget", 0) == budget
    assert (variant.get("num_warps"), variant.get("tokens_per_split")) == ((8, 128) if budget else (4, 512))
    assert "split_budget" not in triton.default_serving_variant(spec, gpu.fake_platform("cpu")).p
    if budget:
        unbudgeted = Variant.parse(str(variant).replace(f"split_budget={budget},", ""))
        # built here, on the CPU's SM count; on an H200's 132: scripts/compare_recorded.py --defaults
        alone = [triton.build_serving(v, spec, "cpu").scratch_bytes(256 * q_len) for v in (variant, unbudgeted)]
        assert alone[0] * 2 < alone[1]


def test_the_recorded_comparison_behind_the_gpu_default_runs_on_the_committed_sweep(capsys, monkeypatch):
    """scripts/compare_recorded.py --defaults (docs/perf.md 7's figures) pairs today's default
    with the sweep's unbudgeted one in the eight families of 64-row defaults."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["compare_recorded.py", "--defaults"])
    runpy.run_path(str(REPO / "scripts" / "compare_recorded.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    compared = [line for line in lines if " cells, B / A median " in line]
    assert len(compared) == 8 and all(float(line.split("median ")[1].split(",")[0]) < 0.9 for line in compared)
    assert sum("is the one the sweep timed" in line for line in lines) == 4  # 16 heads, q_len 1-2
