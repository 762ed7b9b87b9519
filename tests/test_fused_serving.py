"""fused_decode_serving against the fp32 reference (fp16 dots on the CPU), output and partials
poisoned with NaN first: fp8 q, odd page sizes, q_len 3, a padding slot, counters, refusals."""

from __future__ import annotations

import pytest
import torch

from mla_tune.kernels.fused_decode import FusedServingWorkspace, fused_decode_serving
from mla_tune.serving import inputs as serving
from tests.helpers import assert_close, refill, rel_l2, row_quantized_q
from tests.test_serving_layouts import small_call


def _q_lens(kv_lens: list[int], q_len: int) -> list[int]:
    """Ragged q_len: even sequences bring q_len new tokens, odd ones about half."""
    return [min(n, q_len if i % 2 == 0 else (q_len + 1) // 2) for i, n in enumerate(kv_lens)]


def _dots(device: str, q_fp8: bool) -> dict:
    if q_fp8:
        return dict(q_fp8=True, qk_dot="fp8", pv_dot="fp16")  # as the H200 table's picks
    dot = "bf16" if device == "cuda" else "fp16"  # the interpreter's bf16 dot is wrong
    return dict(q_fp8=False, qk_dot=dot, pv_dot=dot)


def _launch(inp: serving.ServingInput, device: str, *, max_splits: int, tokens_per_split: int,
            block_n: int, block_h: int, q_fp8: bool = False, num_warps: int = 4, num_stages: int = 1,
            workspace=None, out=None) -> torch.Tensor:
    heads = inp.q.shape[1]
    if workspace is None:
        workspace = FusedServingWorkspace.allocate(inp.q.shape[0], heads, max_splits, device)
    workspace.part_o.fill_(float("nan"))  # the reduction must read only what was written
    workspace.part_lse.fill_(float("nan"))
    if out is None:
        out = torch.empty((inp.q.shape[0], heads, 512), dtype=torch.bfloat16, device=device)
    out.fill_(float("nan"))  # every element must be written
    fused_decode_serving(
        inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout,
        max_q_len=max(inp.q_lens), max_splits=max_splits, tokens_per_split=tokens_per_split,
        block_n=block_n, block_h=block_h, num_warps=num_warps, num_stages=num_stages,
        workspace=workspace, **_dots(device, q_fp8),
    )
    return out


@pytest.mark.parametrize("layout,q_len", [(0, 1), (64, 2)])
def test_fused_serving_fp8_q_and_fp8_dot(layout, q_len, device):
    """q quantized per (new token, head), QK dot fp8 x fp8. The interpreter rounds some fp32 ->
    fp8 casts wrongly, so the CPU bound is the error of fp8 q itself."""
    inp = serving.make_input(_q_lens([65, 17, 1], q_len), [65, 17, 1], 16, layout, "fp8", seed=5, device=device)
    out = _launch(inp, device, max_splits=4, tokens_per_split=16, block_n=16, block_h=16, q_fp8=True)
    ref = serving.reference(row_quantized_q(inp.q), inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    if device == "cuda":
        assert_close(out, ref, 1e-2, "fp8 q")
    else:
        assert bool(torch.isfinite(out).all()) and rel_l2(out, ref) < 8e-2, f"fp8 q: {rel_l2(out, ref):.4f}"


@pytest.mark.parametrize("page_size,heads,block_n,block_h", [(128, 64, 32, 16), (8, 32, 16, 8)])
def test_fused_serving_other_page_sizes_heads_and_q_len_3(page_size, heads, block_n, block_h, device):
    """Pages larger and smaller than a tile, 32 and 64 heads, q_len 3 (padded to 4 rows)."""
    kv_lens = [100, 3, 70]
    inp = serving.make_input([3, 3, 2], kv_lens, heads, page_size, "fp8", seed=9, device=device)
    out = _launch(inp, device, max_splits=4, tokens_per_split=48, block_n=block_n, block_h=block_h)
    assert_close(out, inp.reference(), 1e-2, f"page {page_size} heads {heads} q_len 3")


def test_a_sequence_of_length_0_is_left_untouched(device):
    """A CUDA graph's padding slot (seq_len 0): no program of it writes anything."""
    inp = serving.make_input([2, 1, 2], [70, 5, 33], 16, 16, "bf16", seed=12, device=device)
    ref = inp.reference()
    inp.seq_lens[1] = 0
    out = _launch(inp, device, max_splits=4, tokens_per_split=16, block_n=16, block_h=8)
    assert bool(out[2].isnan().all())  # sequence 1's one new token
    keep = torch.tensor([0, 1, 3, 4], device=device)
    assert_close(out[keep], ref[keep], 1e-2, "the other sequences")


def test_the_reduction_resets_its_counters_so_a_workspace_serves_new_calls(device):
    """A graph replay: the same buffers refilled with other lengths, q_lens and tables."""
    first = serving.make_input([2, 1, 2], [40, 1, 100], 16, 16, "fp8", seed=21, device=device)
    workspace = FusedServingWorkspace.allocate(6, 16, 4, device)
    out = torch.empty((5, 16, 512), dtype=torch.bfloat16, device=device)
    kwargs = dict(max_splits=4, tokens_per_split=16, block_n=16, block_h=8, workspace=workspace, out=out)
    _launch(first, device, **kwargs)
    assert_close(out, first.reference(), 1e-2, "first call")
    assert int(workspace.count.abs().sum()) == 0
    second = serving.make_input([1, 2, 2], [90, 3, 2], 16, 16, "fp8", seed=22, device=device)
    refill(first, second)
    _launch(first, device, **kwargs)
    assert_close(out, second.reference(), 1e-2, "second call")
    assert int(workspace.count.abs().sum()) == 0


@pytest.mark.parametrize("change,message", [
    (dict(block_h=12), "block_h"), (dict(block_h=4), "block_h"),  # block_h 4: fewer than 16 MMA columns
    (dict(max_q_len=5), "max_q_len"), (dict(block_n=24), "block_n"),
    (dict(tokens_per_split=0), "tokens_per_split"),
    (dict(kv_indptr=torch.tensor([0, 5, 14], dtype=torch.int32)), "not both"), (dict(pv_dot="fp32"), "pv_dot"),
    (dict(qk_dot="fp8"), "q_fp8"),  # fp8 dots on a bf16 cache, and without q_fp8
    (dict(workspace=FusedServingWorkspace.allocate(1, 16, 2, "cpu")), "workspace is for"),
])
def test_bad_calls_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        fused_decode_serving(**{**small_call(qk_dot="fp16", pv_dot="fp16"), **change})
