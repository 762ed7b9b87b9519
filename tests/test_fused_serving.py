"""The fused one-launch family on the serving call (fused_decode_serving) against
mla_tune/serving/inputs.py's fp32 reference, with the call shape of flash_decode_serving.

CPU: Triton's interpreter with fp16 dots over a sample of layout {contiguous, paged 1, 16,
64} x heads {16, 128} x q_len {1, 2, 4} x KV {bf16, fp8} that covers every pair of
factors; GPU-marked: the full matrix under the strict rule, a CUDA-graph replay with new
lengths and block tables, and sync debug mode "error". Every run poisons the output and
the partials with NaN first; paged caches hold NaN in every slot no sequence owns.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mla_tune import problem
from mla_tune.kernels.fused_decode import FusedServingWorkspace, fused_decode_serving
from mla_tune.serving import inputs as serving

LAYOUTS = (0, 1, 16, 64)  # 0: contiguous; else the page size
HEADS = (16, 128)
Q_LENS = (1, 2, 4)
KV_FORMATS = ("bf16", "fp8")


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


def _row_quantized_reference(inp: serving.ServingInput) -> torch.Tensor:
    """The reference with q quantized as the kernel does under q_fp8: e4m3 per (new token,
    head) row, scale amax / 448 (serving/inputs.py's fp8 q is per tensor; written here, serving.py
    being another helper's file)."""
    q = inp.q.float()
    scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    q8 = (q / scale).to(torch.float8_e4m3fn).float() * scale
    return serving.reference(q8, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, l2: float = 1e-2, strict: bool = True) -> None:
    assert bool(torch.isfinite(out).all()), f"{what}: an element is NaN or was never written"
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < l2, f"{what}: relative L2 error {err:.4f}"
    if strict:
        result = problem.check(out, ref, problem.RULES["strict"])
        assert result.passed, f"{what}: strict: {result.reason}"


# (layout, heads, q_len, kv, kv_lens, block_n, block_h, max_splits, tokens_per_split):
# every pair of (layout, heads, q_len, kv) values appears (test below); lengths 1, 17,
# 63, 64, 65 and 3000; one, several and max_splits splits (1 = no reduction); tiles
# shorter, equal and longer than a page; head tiles of 4 to 64.
CPU_CASES = [
    (0, 16, 1, "bf16", [3000, 1, 17], 64, 16, 8, 512),
    (0, 128, 2, "fp8", [65, 1], 32, 32, 4, 32),
    (0, 16, 4, "fp8", [63, 4, 64], 16, 4, 1, 1),
    (1, 128, 1, "bf16", [17, 64], 16, 64, 2, 32),
    (1, 16, 2, "fp8", [3000, 1, 65], 64, 8, 4, 256),
    (1, 128, 4, "bf16", [18, 5], 16, 16, 3, 8),
    (16, 16, 1, "fp8", [1, 63, 65, 17], 32, 16, 4, 16),
    (16, 128, 2, "bf16", [64, 2], 16, 32, 2, 48),
    (16, 16, 4, "bf16", [65, 17, 4], 16, 8, 8, 16),
    (64, 128, 1, "fp8", [65, 1], 32, 16, 4, 32),
    (64, 16, 2, "bf16", [3000, 17, 64], 64, 16, 16, 256),
    (64, 128, 4, "fp8", [17, 63], 16, 16, 2, 16),
]


def test_cpu_sample_covers_every_pair_of_factors():
    factors = [LAYOUTS, HEADS, Q_LENS, KV_FORMATS]
    for i, j in itertools.combinations(range(4), 2):
        seen = {(case[i], case[j]) for case in CPU_CASES}
        assert seen == set(itertools.product(factors[i], factors[j])), (i, j)
    assert {1, 17, 63, 64, 65, 3000} <= {n for case in CPU_CASES for n in case[4]}


@pytest.mark.parametrize("layout,heads,q_len,kv,kv_lens,block_n,block_h,max_splits,tokens_per_split", CPU_CASES)
def test_fused_serving_matches_reference_on_a_covering_sample(
    layout, heads, q_len, kv, kv_lens, block_n, block_h, max_splits, tokens_per_split, device
):
    inp = serving.make_input(_q_lens(kv_lens, q_len), kv_lens, heads, layout, kv, seed=17, device=device)
    assert max(inp.q_lens) == q_len
    out = _launch(inp, device, max_splits=max_splits, tokens_per_split=tokens_per_split,
                  block_n=block_n, block_h=block_h)
    _assert_close(out, inp.reference(), f"layout {layout} heads {heads} q_len {q_len} {kv}")


@pytest.mark.parametrize("layout,q_len", [(0, 1), (64, 2)])
def test_fused_serving_fp8_q_and_fp8_dot(layout, q_len, device):
    """q quantized in the kernel per (new token, head), QK dot fp8 x fp8. On the CPU the
    interpreter rounds some fp32 -> fp8 casts wrongly (a carry into the exponent), so the
    bound there is the error of fp8 q itself, not the strict rule (GPU tests apply it)."""
    inp = serving.make_input(_q_lens([65, 17, 1], q_len), [65, 17, 1], 16, layout, "fp8", seed=5, device=device)
    out = _launch(inp, device, max_splits=4, tokens_per_split=16, block_n=16, block_h=16, q_fp8=True)
    on_gpu = device == "cuda"
    _assert_close(out, _row_quantized_reference(inp), "fp8 q", l2=1e-2 if on_gpu else 8e-2, strict=on_gpu)


@pytest.mark.parametrize("page_size,heads,block_n,block_h", [(128, 64, 32, 16), (8, 32, 16, 8)])
def test_fused_serving_other_page_sizes_heads_and_q_len_3(page_size, heads, block_n, block_h, device):
    """Pages larger and smaller than a tile, 32 and 64 heads, q_len 3 (padded to 4 rows)."""
    kv_lens = [200, 3, 130]
    inp = serving.make_input([3, 3, 2], kv_lens, heads, page_size, "fp8", seed=9, device=device)
    out = _launch(inp, device, max_splits=4, tokens_per_split=48, block_n=block_n, block_h=block_h)
    _assert_close(out, inp.reference(), f"page {page_size} heads {heads} q_len 3")


def test_a_sequence_of_length_0_is_left_untouched(device):
    """A CUDA graph's padding slot (seq_len 0): no program of it writes anything."""
    inp = serving.make_input([2, 1, 2], [70, 5, 33], 16, 16, "bf16", seed=12, device=device)
    ref = inp.reference()
    inp.seq_lens[1] = 0
    out = _launch(inp, device, max_splits=4, tokens_per_split=16, block_n=16, block_h=8)
    assert bool(out[2].isnan().all())  # sequence 1's one new token
    keep = torch.tensor([0, 1, 3, 4], device=device)
    _assert_close(out[keep], ref[keep], "the other sequences")


def test_the_reduction_resets_its_counters_so_a_workspace_serves_new_calls(device):
    """What a CUDA graph replay does: the same buffers, refilled with other lengths,
    q_lens and block tables, and no allocation or host read between the calls."""
    first = serving.make_input([2, 1, 2], [40, 1, 100], 16, 16, "fp8", seed=21, device=device)
    workspace = FusedServingWorkspace.allocate(6, 16, 4, device)
    out = torch.empty((5, 16, 512), dtype=torch.bfloat16, device=device)
    kwargs = dict(max_splits=4, tokens_per_split=16, block_n=16, block_h=8, workspace=workspace, out=out)
    _launch(first, device, **kwargs)
    _assert_close(out, first.reference(), "first call")
    assert int(workspace.count.abs().sum()) == 0
    second = serving.make_input([1, 2, 2], [90, 3, 2], 16, 16, "fp8", seed=22, device=device)
    first.q.copy_(second.q)
    first.qo_indptr.copy_(second.qo_indptr)
    first.seq_lens.copy_(second.seq_lens)
    first.block_table.zero_()
    first.block_table[:, : second.block_table.shape[1]].copy_(second.block_table)
    first.kv.view(torch.uint8)[: second.kv.shape[0]].copy_(second.kv.view(torch.uint8))
    first.kv_scale.copy_(second.kv_scale)
    _launch(first, device, **kwargs)
    _assert_close(out, second.reference(), "second call")
    assert int(workspace.count.abs().sum()) == 0


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(block_h=12), "block_h"),
        (dict(block_h=4), "block_h"),  # 4 heads x 1 new token: fewer than 16 MMA columns
        (dict(max_q_len=5), "max_q_len"),
        (dict(block_n=24), "block_n"),
        (dict(tokens_per_split=0), "tokens_per_split"),
        (dict(kv_indptr="both"), "not both"),
        (dict(qk_dot="fp8"), "q_fp8"),  # fp8 dots on a bf16 cache, and without q_fp8
        (dict(pv_dot="fp32"), "pv_dot"),
        (dict(workspace="small"), "workspace is for"),
    ],
)
def test_bad_calls_are_refused_by_name(change, message):
    inp = serving.make_input([1, 1], [5, 9], 16, 16, "bf16", seed=1)
    kwargs = dict(inp.layout, max_q_len=1, max_splits=2, tokens_per_split=4, block_n=16, block_h=16,
                  num_warps=4, num_stages=1, qk_dot="fp16", pv_dot="fp16")
    kwargs.update(change)
    if change.get("kv_indptr") == "both":
        kwargs["kv_indptr"] = torch.tensor([0, 5, 14], dtype=torch.int32)
    if change.get("workspace") == "small":
        kwargs["workspace"] = FusedServingWorkspace.allocate(1, 16, 2, "cpu")
    out = torch.empty((2, 16, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        fused_decode_serving(inp.q, inp.qo_indptr, inp.kv, None, out, **kwargs)


# ------------------------------------------------------------------------------ GPU
GPU_KV_LENS = [3000, 1, 17, 63, 64, 65, 1000, 129]


def _gpu_block_h(heads: int, q_len: int) -> int:
    """16 MMA columns (q_len rounded up to a power of two, times heads) per program."""
    q_p2 = 1 << (q_len - 1).bit_length()
    return min(heads, 16 // q_p2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("kv", KV_FORMATS)
def test_fused_serving_full_matrix_on_gpu(layout, heads, q_len, kv, device):
    inp = serving.make_input(_q_lens(GPU_KV_LENS, q_len), GPU_KV_LENS, heads, layout, kv, seed=31, device=device)
    # (q_fp8, max_splits, tokens_per_split, block_n, block_h): one split (the direct write),
    # up to 16 with a doubled head tile, and fp8 q (fp8 KV only) at up to 8; each a compile.
    plans = [(False, 1, 1, 64, _gpu_block_h(heads, q_len)),
             (False, 16, 64, 32, min(heads, 2 * _gpu_block_h(heads, q_len)))]
    if kv == "fp8":
        plans.append((True, 8, 256, 64, _gpu_block_h(heads, q_len)))
    for q_fp8, max_splits, tokens_per_split, block_n, block_h in plans:
        ref = _row_quantized_reference(inp) if q_fp8 else inp.reference()
        out = _launch(inp, device, max_splits=max_splits, tokens_per_split=tokens_per_split,
                      block_n=block_n, block_h=block_h, q_fp8=q_fp8, num_stages=2)
        torch.cuda.synchronize()
        _assert_close(out, ref, f"layout {layout} heads {heads} q_len {q_len} {kv} q_fp8 {q_fp8} "
                                f"splits {max_splits} block_h {block_h}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", [0, 64])
def test_fused_serving_graph_replays_new_lengths_without_syncing(layout, device):
    """Captured once at the maxima, replayed with other lengths, q_lens and block tables;
    the call itself never synchronizes (sync debug mode "error" would raise)."""
    heads, max_q, kv_format = 128, 2, "fp8"
    static = serving.make_input(serving.GRAPH_Q_LENS, serving.GRAPH_KV_LENS, heads, layout, kv_format,
                                seed=41, device=device)
    workspace = FusedServingWorkspace.allocate(static.q.shape[0], heads, 16, device)
    out = torch.empty((static.q.shape[0], heads, 512), dtype=torch.bfloat16, device=device)
    kwargs = dict(max_q_len=max_q, max_splits=16, tokens_per_split=128, block_n=64, block_h=8,
                  num_warps=4, num_stages=2, q_fp8=False, qk_dot="bf16", pv_dot="bf16", workspace=workspace)

    def call():
        fused_decode_serving(static.q, static.qo_indptr, static.kv, static.kv_scale, out,
                             **static.layout, **kwargs)

    graph = serving.capture_without_sync(call)
    for seed, new in serving.refill_for_replays(static, max_q, heads, kv_format, device):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out[: new.q.shape[0]], new.reference(), f"replay seed {seed}")
        assert int(workspace.count.abs().sum()) == 0
