"""The serving reference (mla_tune/serving/inputs.py) and the serving kernels against it
(interpreter: fp16 dots), outputs and scratch poisoned with NaN, unowned page slots NaN."""

from dataclasses import replace

import pytest
import torch

from mla_tune import problem
from mla_tune.kernels import flash_decode as flash_decode_module
from mla_tune.kernels.flash_decode import (
    FlashDecodeServingWorkspace,
    fill_splits,
    flash_decode,
    flash_decode_serving,
)
from mla_tune.kernels.fused_decode import FusedServingWorkspace, fused_decode_serving
from mla_tune.kernels.split_rule import (
    REDUCE_SPLITS_PER_STEP,
    launch_items,
    serving_splits,
    split_items,
)
from mla_tune.serving import inputs as serving
from tests.helpers import assert_close, ragged_input, refill, rel_l2

# Each serving kernel: its launcher, its workspace, the partials its reduction reads, and the
# options the tests fix (split-K: no split budget and no SM count unless given).
KERNELS = {
    "splitk": (flash_decode_serving, FlashDecodeServingWorkspace,
               ("part_out", "part_lse", "q_amax"), dict(split_budget=0, sm_count=0)),
    "fused": (fused_decode_serving, FusedServingWorkspace, ("part_o", "part_lse"), {}),
}


def dot_options(kernel: str, device: str, q_fp8: bool = False) -> dict:
    """bf16 dots on a GPU, fp16 under the interpreter (its bf16 dot is wrong); fp8 q goes with
    an fp8 QK dot in the fused kernel."""
    dot = "bf16" if device == "cuda" else "fp16"
    if kernel == "splitk":
        return dict(dot_dtype=dot)
    if q_fp8:
        return dict(q_fp8=True, qk_dot="fp8", pv_dot="fp16")
    return dict(q_fp8=False, qk_dot=dot, pv_dot=dot)


def _launch(inp: serving.ServingInput, device: str, *, max_splits: int, kernel: str = "splitk",
            q_fp8: bool = False, workspace=None, out=None, **launch):
    """One launch into poisoned buffers (bf16 q unless the fused kernel's q_fp8); the output."""
    serve, workspace_type, partials, fixed = KERNELS[kernel]
    if workspace is None:
        workspace = workspace_type.allocate(inp.q.shape[0], inp.q.shape[1], max_splits, device,
                                            max_q_len=max(inp.q_lens))
    for name in partials:
        getattr(workspace, name).fill_(float("nan"))  # the reduction reads only what was written
    if out is None:
        out = torch.empty((*inp.q.shape[:2], 512), dtype=torch.bfloat16, device=device)
    out.fill_(float("nan"))  # every element must be written
    launch = {"num_warps": 4, "num_stages": 1, **fixed, **launch, **dot_options(kernel, device, q_fp8)}
    returned = serve(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout,
                     max_q_len=max(inp.q_lens), max_splits=max_splits, workspace=workspace,
                     **launch)
    return returned if kernel == "splitk" else out  # the fused launcher returns its kernel


def _checked(inp: serving.ServingInput, device: str, what: str, **launch):
    """A split-K _launch into a new workspace sized to its budget, checked against the reference
    and its split counts and items against the host replay (split_rule.serving_splits)."""
    workspace = FlashDecodeServingWorkspace.allocate(
        inp.q.shape[0], inp.q.shape[1], launch["max_splits"], device, max_q_len=max(inp.q_lens),
        split_budget=launch.get("split_budget", 0), block_h=launch["block_h"], sm_count=launch.get("sm_count", 0))
    assert_close(_launch(inp, device, workspace=workspace, **launch), inp.reference(), 1e-2, what)
    splits = serving_splits(inp.kv_lens, max(inp.q_lens), inp.q.shape[1], **launch)
    counts = workspace.split_count[:len(inp.kv_lens)].tolist()
    assert counts == [-(-n // s) for n, s in zip(inp.kv_lens, splits, strict=True)], what
    assert launch["max_splits"] == 1 or sum(counts) <= workspace.max_items, what
    items = split_items(inp.kv_lens, splits)
    assert sum(items) == sum(inp.kv_lens) and len(items) == sum(counts), what
    return workspace


# ------------------------------------------------------------------------ reference
@pytest.mark.parametrize("kv_lens", [[40, 40, 40], [1, 17, 40]])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("q_format", ["bf16", "fp8"])
def test_reference_equals_the_leaderboard_reference_on_its_layout(kv_lens, kv, q_format):
    data = ragged_input(kv_lens, seed=5, device="cpu")
    q, kv_data, qo_indptr, kv_indptr, _config = data  # the leaderboard's call as a serving one:
    cache, kv_scale = (kv_data["bf16"], None) if kv == "bf16" else kv_data["fp8"]
    ours = serving.reference(q, qo_indptr, cache, kv_scale, kv_indptr=kv_indptr, q_format=q_format)
    torch.testing.assert_close(ours, problem.reference(data, q_format, kv), rtol=1e-5, atol=1e-5)


def test_reference_new_tokens_are_causal():
    """New token i of q_len attends like a one-token query over the sequence cut after it."""
    inp = serving.make_input([3], [20], heads=4, page_size=0, kv_format="bf16", seed=3)
    out = inp.reference()
    tokens = inp.kv.reshape(-1, 576)
    for i in range(3):
        visible = 20 - (2 - i)
        alone = serving.reference(
            inp.q[i : i + 1], torch.tensor([0, 1], dtype=torch.int32), tokens[:visible].reshape(-1, 1, 576),
            kv_indptr=torch.tensor([0, visible], dtype=torch.int32))
        torch.testing.assert_close(out[i : i + 1], alone, rtol=1e-6, atol=1e-6)
    # and the cut matters: token 0 differs from token 0 seeing everything
    full = serving.reference(inp.q[:1], torch.tensor([0, 1], dtype=torch.int32), inp.kv,
                             kv_indptr=torch.tensor([0, 20], dtype=torch.int32))
    assert (out[:1] - full).abs().max() > 1e-3


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_paged_input_holds_the_same_tokens_shuffled(page_size, kv):
    contiguous = serving.make_input([1, 2, 2], [5, 70, 17], 16, 0, kv, seed=11)
    paged = serving.make_input([1, 2, 2], [5, 70, 17], 16, page_size, kv, seed=11)
    pages = paged.block_table[:, : -(-70 // page_size)]
    if page_size > 1:  # page order is shuffled, not the identity
        assert not torch.equal(pages[1].sort().values, pages[1])
    assert bool(paged.kv.float().isnan().any())  # unused slots are poisoned
    torch.testing.assert_close(paged.reference(), contiguous.reference(), rtol=0, atol=0)


# --------------------------------------------------------------------- the kernel
def test_kernel_reproduces_flash_decode_on_the_leaderboard_call(device):
    """A batch of one sequence splits as the old kernel: the same sums, bit for bit."""
    for kv_len, splits in ((100, 4), (3000, 4), (17, 1)):
        q, kv_data, qo_indptr, kv_indptr, _cfg = ragged_input([kv_len], seed=8, device=device)
        kv, kv_scale = kv_data["fp8"]
        common = dict(block_n=16, num_warps=4, num_stages=1, **dot_options("splitk", device))
        old = torch.empty((1, 16, 512), dtype=torch.bfloat16, device=device)
        flash_decode(q, kv, kv_scale, kv_indptr, old, num_splits=splits, **common)
        new = torch.full_like(old, float("nan"))
        flash_decode_serving(q, qo_indptr, kv, kv_scale, new, kv_indptr=kv_indptr, max_q_len=1,
                             max_splits=4, tokens_per_split=-(-kv_len // splits), block_h=16, **common)
        torch.testing.assert_close(new, old, rtol=0, atol=0, msg=f"kv_len {kv_len}")


@pytest.mark.parametrize("q_len, kv_len, max_splits, tps, budget, sms, expect", [
    (1, 300, 4, 64, 0, 0, 4),     # no budget: the per-sequence rule,
    (2, 300, 4, 100, 0, 0, 3),    # min(max_splits, cdiv(kv_len, tokens_per_split))
    (1, 90, 4, 16, 0, 0, 3),      # 90 tokens in 4 splits of 16-token tiles: 32 each, so 3
    (1, 65, 4, 64, 0, 0, 2),      # as many items as the kernel's bound, total // 64 + batch
    (1, 609, 8, 64, 16, 0, 5),    # 16 // 3 = 5 splits each at any length where tokens_per_split allows
    (1, 512, 8, 64, 16, 0, 5),    # ... the same on the power of two, where the per-sequence rule steps
    (1, 300, 8, 64, 16, 0, 5),    # cdiv(300, 64) = 5 still allows it
    (1, 90, 8, 64, 16, 0, 2),     # cdiv(90, 64) = 2 caps it
    (2, 609, 8, 64, 7, 0, 2),     # q_len 2: the budget is the whole batch's, 7 // 3 = 2
    (1, 609, 8, 64, 2, 0, 1),     # a budget under the batch: one split each, never none
    (1, 609, 8, 64, 4, 8, 5),     # 8 SMs: fill_splits raises 1 split each to 5
])
def test_a_uniform_batch_splits_by_the_per_sequence_rule_or_by_its_budget_not_its_length(
        device, q_len, kv_len, max_splits, tps, budget, sms, expect):
    """Equal lengths: splits of whole tiles, min(max_splits, cdiv(kv_len, tokens_per_split))
    each; a split_budget caps the batch's: floor(budget / batch) each, or with an SM count
    fill_splits' share (budget 4 on 8 SMs: 5 each fill 15 of 16 programs)."""
    inp = serving.make_input([q_len] * 3, [kv_len] * 3, 16, 16, "fp8", seed=13, device=device)
    workspace = _checked(inp, device, f"q_len {q_len}, budget {budget}", max_splits=max_splits, block_n=16,
                         tokens_per_split=tps, block_h=16 // q_len, split_budget=budget, sm_count=sms)
    assert workspace.split_count[:3].tolist() == [expect] * 3


def test_fill_splits_raises_a_share_that_leaves_the_waves_idle():
    """floor(budget / batch) where its programs fill >= 80% of their waves, else the fewest
    more that do, capped at max_splits; no SM count: the plain share."""
    assert fill_splits(17, 8, 8, 17, 132) == 2      # 128 programs of 132: kept
    assert fill_splits(17, 6, 8, 17, 132) == 5      # 96 of 132 (73%) -> 240 of 264 (91%)
    assert fill_splits(17, 7, 8, 17, 132) == 2      # 112 of 132 (85%): kept
    assert fill_splits(132, 30, 1, 64, 132) == 4    # 120 of 132: kept (the sawtooth fix stands)
    assert fill_splits(17, 24, 8, 17, 132) == 2     # a budget under the batch: 1 each fills 73%
    assert fill_splits(17, 6, 8, 17, 0) == 2        # no SM count (the CPU): the plain share
    assert fill_splits(7, 3, 1, 4, 132) == 4        # nothing fills: the best fill within max_splits
    assert fill_splits(40, 2, 1, 8, 132) == 8       # the share is past max_splits: capped
    assert fill_splits(4, 3, 1, 8, 8) == 5           # 3 programs of 8 -> 15 of 16
    for batch in range(1, 70):                       # never fewer than the share, never past the cap
        s = fill_splits(17, batch, 8, 17, 132)
        assert max(1, min(17, 17 // batch)) <= s <= 17


@pytest.mark.parametrize("lens,page,heads,q_len,max_splits,tps,block_n,block_h,budget,sms", [
    ([1, 17, 600, 45, 0], 16, 16, 1, 8, 64, 32, 16, 0, 0),        # no budget; a padded slot of 0
    ([5, 60, 33, 52, 17, 28], 16, 32, 4, 17, 16, 16, 4, 17, 132),  # 8 head tiles, q_len 4
    ([700, 1, 17], 1, 16, 1, 1, 1, 64, 16, 0, 0),                  # max_splits 1
], ids=["no-budget", "budget-q4", "one-split"])
def test_the_host_replay_of_the_split_rule_is_what_the_kernel_runs(
        device, lens, page, heads, q_len, max_splits, tps, block_n, block_h, budget, sms):
    """kernels/split_rule.serving_splits gives the split counts stage 1 writes; max_splits 1
    has no scratch for partials: one split per sequence, never borrowed."""
    live = [n for n in lens if n]
    inp = serving.make_input([min(q_len, n) for n in live], live, heads, page, "bf16", seed=5,
                             device=device)
    kw = dict(max_splits=max_splits, tokens_per_split=tps, block_n=block_n, block_h=block_h,
              split_budget=budget, sm_count=sms)
    workspace = _checked(inp, device, "split rule", **kw)
    assert all(s == 0 for n, s in zip(lens, serving_splits(lens, q_len, heads, **kw), strict=True) if n == 0)
    if max_splits == 1:
        assert workspace.part_out.numel() == 0
        assert workspace.split_count[:len(live)].tolist() == [1] * len(live)


def test_a_ragged_batch_shares_its_budget_by_length_rounding_up_into_scratch_sized_for_it(device):
    """No split past the mean, at most budget + batch splits; a long sequence borrows the short
    ones' splits, each at least one. The scratch holds the most items any batch launches under
    the budget (split_rule.most_items); a call it cannot hold is refused before any launch."""
    lens = [350, 250, 100, 700]
    inp = serving.make_input([1] * 4, lens, 16, 0, "bf16", seed=16, device=device)
    kw = dict(max_splits=32, tokens_per_split=16, block_n=16, block_h=16)
    counts = _checked(inp, device, "ragged batch budget", **kw, split_budget=8).split_count[:4].tolist()
    # 8 (2 per sequence) over 1400 tokens, a mean split of 175: shares 2, 1.43, 0.57, 4 ->
    # 2, 2, 1, 4 splits of 176, 128, 112, 176 tokens (rounding down: 2, 1, 1, 4, one of 250).
    assert counts == [2, 2, 1, 4]  # 9 <= 8 + 4 splits, none past the mean (176: whole tiles)
    inp = serving.make_input([1, 1, 1, 1], [2000, 40, 17, 1], 16, 0, "bf16", seed=18, device=device)
    # 20 over 2058 tokens: 2000 -> ceil(19.4) = 20 splits of 100 -> 112-token tiles, 18 of
    # them; 40, 17 and 1 -> one each.
    workspace = _checked(inp, device, "one long sequence, budget 20", **kw, split_budget=20)
    assert workspace.split_count[:4].tolist() == [18, 1, 1, 1]
    # No budget, so 4 x 32 = 128 over 2058 tokens: 2000 -> round(124.4) splits of 17 ->
    # 32-token tiles, 63 of them; 40 -> 2 splits; 17 and 1 -> one each.
    workspace = _checked(inp, device, "one long sequence, no budget", **kw)
    assert workspace.split_count[:4].tolist() == [63, 2, 1, 1]
    assert workspace.split_off[:4].tolist() == [0, 63, 65, 66]
    with pytest.raises(ValueError, match="split_budget must be an integer >= 0"):
        _launch(inp, device, **kw, split_budget=-1)
    plain = FlashDecodeServingWorkspace.allocate(256, 128, 64, "meta")  # 256 sequences, 128 heads
    tight = FlashDecodeServingWorkspace.allocate(256, 128, 64, "meta", split_budget=66, block_h=16, sm_count=132)
    assert plain.part_out.shape == ((64 + 1) * 256, 128, 512)  # max_splits per sequence, plus one each
    assert tight.max_items == max(launch_items(b, 256, 64, 1, b * fill_splits(66, b, 8, 64, 132))
                                  for b in range(1, 257)) == 512  # 256 sequences, one split each (+1)
    assert tight.part_out.shape == (512, 128, 512)  # 0.125 GiB of fp32 where plain takes 4.06 GiB
    workspace = FlashDecodeServingWorkspace.allocate(4, 16, 32, device, split_budget=8, block_h=16)
    assert workspace.max_items == 8 + 4 < 32 * 4
    with pytest.raises(ValueError, match="holds the partials of 12 split items; this call is launched for 132"):
        _launch(inp, device, workspace=workspace, **kw)


@pytest.fixture
def launches(monkeypatch):
    """The (grid, kwargs) of every launch of flash_decode's jit_launch."""
    seen, launch = [], flash_decode_module.jit_launch

    def spy(fn, grid, record, *args, **kwargs):
        seen.append((grid, kwargs))
        return launch(fn, grid, record, *args, **kwargs)

    monkeypatch.setattr(flash_decode_module, "jit_launch", spy)
    return seen


def test_a_grid_smaller_than_the_items_runs_them_in_turn(device, monkeypatch, launches):
    """Past _fd_ONE_ITEM_CTAS programs, each runs several split items: the same counts and answer."""
    inp = serving.make_input([2, 1, 2, 1], [200, 40, 100, 5], 16, 16, "fp8", seed=15, device=device)
    ref = inp.reference()
    counts = []
    monkeypatch.setattr(flash_decode_module, "_fd_GRID_CTAS", 6)  # 2 head tiles: 3 programs each
    for one_item in (8192, 6):
        monkeypatch.setattr(flash_decode_module, "_fd_ONE_ITEM_CTAS", one_item)
        workspace = FlashDecodeServingWorkspace.allocate(6, 16, 4, device, max_q_len=2)
        out = _launch(inp, device, max_splits=4, tokens_per_split=32, block_n=16, block_h=8,
                      workspace=workspace)
        assert_close(out, ref, 1e-2, f"one program per item up to {one_item}")
        counts.append((workspace.split_count[:4].tolist(), workspace.split_off[:4].tolist()))
    assert counts[0] == counts[1]
    stage1 = [(grid, kwargs.get("ITEM_LOOP")) for grid, kwargs in launches if len(grid) == 2]
    assert stage1 == [((2, 4 * 6 // 2 + 4), False), ((2, 3), True)]  # the budget's items, then the cap's
    assert sum(counts[1][0]) > 3  # more items than the small grid's programs


@pytest.mark.parametrize("wide", [True, False])
def test_the_reduction_runs_in_narrow_and_wide_grids(device, monkeypatch, launches, wide):
    """Stage 2 over all columns or a quarter of them per program: the same answer either way."""
    if not wide:  # the narrow grid's splits per step, whatever the grid's size
        monkeypatch.setattr(flash_decode_module, "reduce_splits_per_step", lambda *args: REDUCE_SPLITS_PER_STEP[0])
    inp = serving.make_input([2, 1, 2], [200, 17, 130], 16, 64, "bf16", seed=16, device=device)
    out = _launch(inp, device, max_splits=32, tokens_per_split=16, block_n=16, block_h=8)
    assert_close(out, inp.reference(), 1e-2, f"wide {wide}")
    assert launches[-1][0] == (3, 2, 16 * (4 if wide else 1))


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_workspace_serves_new_lengths_block_tables_and_an_empty_padding_slot(device, kernel):
    """A graph replay: the same buffers refilled with other lengths, q_lens and tables, then
    with a padding slot (seq_len 0) whose rows stay NaN while every other sequence is right;
    the fused reduction resets its arrival counters after each call."""
    first = serving.make_input([2, 1, 2], [40, 1, 100], 16, 16, "fp8", seed=21, device=device)
    workspace = KERNELS[kernel][1].allocate(6, 16, 4, device, max_q_len=2)
    out = torch.empty((5, 16, 512), dtype=torch.bfloat16, device=device)
    kwargs = dict(kernel=kernel, max_splits=4, tokens_per_split=16, block_n=16, block_h=8,
                  workspace=workspace, out=out)

    def counters_are_reset() -> bool:  # split-K has none
        return kernel == "splitk" or int(workspace.count.abs().sum()) == 0

    _launch(first, device, **kwargs)
    assert_close(out, first.reference(), 1e-2, "first call")
    assert counters_are_reset()
    second = serving.make_input([1, 2, 2], [90, 3, 2], 16, 16, "fp8", seed=22, device=device)
    refill(first, second)
    assert _launch(first, device, **kwargs).data_ptr() == out.data_ptr()
    ref = second.reference()
    assert_close(out, ref, 1e-2, "second call")
    assert counters_are_reset()
    first.seq_lens[1] = 0
    _launch(first, device, **kwargs)
    padding = torch.tensor([False, True, True, False, False], device=device)  # slot 1's 2 new tokens
    assert bool(out[padding].isnan().all())
    assert_close(out[~padding], ref[~padding], 1e-2, "live sequences")
    assert counters_are_reset()


def test_padded_new_token_rows_leave_the_schedule_alone(device):
    """Padding rows past qo_indptr[-1] (many more split items) exit; the live rows are right."""
    inp = serving.make_input([1, 1, 1], [300, 20, 700], 16, 16, "bf16", seed=24, device=device)
    q = torch.cat([inp.q, torch.zeros((9, 16, inp.q.shape[2]), dtype=inp.q.dtype, device=device)])
    workspace = FlashDecodeServingWorkspace.allocate(12, 16, 4, device)
    out = _launch(replace(inp, q=q), device, max_splits=4, tokens_per_split=16, block_n=16, block_h=16,
                  workspace=workspace, sm_count=None)  # None: the device's SMs
    assert_close(out[:3], inp.reference(), 1e-2, "live rows")
    assert bool(out[3:].isnan().all())  # padding rows untouched
    # Budget 12 over 1020 tokens: 300 -> 4 splits (cap cdiv(300, 16) = 19), 20 -> 1, 700 -> 8.
    assert workspace.split_count[:3].tolist() == [4, 1, 8]


SMALL = serving.make_input([1, 1], [5, 9], 16, 16, "bf16", seed=1)
_BOTH_BAD = [
    (dict(block_h=12), "block_h"), (dict(block_h=4), "block_h"),  # block_h 4: under 16 MMA rows
    (dict(block_n=24), "block_n"), (dict(tokens_per_split=0), "tokens_per_split"),
    (dict(kv_indptr=torch.tensor([0, 5, 14], dtype=torch.int32)), "not both"),
    *[(dict(lse=lse), r"lse must be a contiguous float32 \(2, 16\) tensor")  # wrong shape, dtype, layout
      for lse in (torch.empty((3, 16)), torch.empty((2, 16), dtype=torch.bfloat16), torch.empty((16, 2)).t())],
]
BAD_CALLS = [("splitk", *bad) for bad in _BOTH_BAD + [
    (dict(max_q_len=0), "max_q_len"), (dict(q_mode="fp8_static"), "q_scale"),
    (dict(dot_dtype="fp32"), "dot_dtype"),
    (dict(workspace=FlashDecodeServingWorkspace.allocate(1, 16, 2, "cpu")), "workspace is for"),
    (dict(kv=torch.zeros((2, 24, 576), dtype=torch.bfloat16)), "page_size"),
    (dict(block_table=SMALL.block_table.long()), "block_table"),
]] + [("fused", *bad) for bad in _BOTH_BAD + [
    (dict(max_q_len=5), "max_q_len"), (dict(pv_dot="fp32"), "pv_dot"),
    (dict(qk_dot="fp8"), "q_fp8"),  # fp8 dots on a bf16 cache, and without q_fp8
    (dict(workspace=FusedServingWorkspace.allocate(1, 16, 2, "cpu")), "workspace is for"),
]]


@pytest.mark.parametrize("kernel,change,message", BAD_CALLS)
def test_bad_calls_are_refused_by_name(kernel, change, message):
    """SMALL's call of the kernel's serving launcher on the CPU, with one bad argument."""
    call = dict(q=SMALL.q, qo_indptr=SMALL.qo_indptr, kv=SMALL.kv, kv_scale=None, **SMALL.layout,
                out=torch.empty((2, 16, 512), dtype=torch.bfloat16), max_q_len=1, max_splits=2, tokens_per_split=4,
                block_n=16, block_h=16, num_warps=4, num_stages=1, **dot_options(kernel, "cpu"))
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel][0](**{**call, **change})


# ------------------------------------------------------------- the fused kernel alone
@pytest.mark.parametrize("page,heads,q_lens,kv_lens,tps,block_n,block_h,q_fp8,seed", [
    (0, 16, [1, 1, 1], [65, 17, 1], 16, 16, 16, True, 5),
    (64, 16, [2, 1, 1], [65, 17, 1], 16, 16, 16, True, 5),
    (128, 64, [3, 3, 2], [100, 3, 70], 48, 32, 16, False, 9),
    (8, 32, [3, 3, 2], [100, 3, 70], 48, 16, 8, False, 9),
], ids=["fp8-q-contiguous-q1", "fp8-q-page64-q2", "page128-h64-q3", "page8-h32-q3"])
def test_fused_serving_fp8_q_and_fp8_dot_other_page_sizes_heads_and_q_len_3(
        device, page, heads, q_lens, kv_lens, tps, block_n, block_h, q_fp8, seed):
    """q_fp8: q quantized per (new token, head), QK dot fp8 x fp8; the interpreter rounds some
    fp32 -> fp8 casts wrongly, so the CPU bound is the error of fp8 q itself. Pages larger and
    smaller than a tile, 32 and 64 heads, q_len 3 (padded to 4 rows)."""
    inp = serving.make_input(q_lens, kv_lens, heads, page, "fp8", seed=seed, device=device)
    out = _launch(inp, device, kernel="fused", max_splits=4, tokens_per_split=tps, block_n=block_n,
                  block_h=block_h, q_fp8=q_fp8)
    ref = inp.reference("fp8_row" if q_fp8 else "bf16")  # fp8_row: q as the kernel quantizes it
    if q_fp8 and device != "cuda":
        err = rel_l2(out, ref)
        assert bool(torch.isfinite(out).all()) and err < 8e-2, f"fp8 q: {err:.4f}"
    else:
        assert_close(out, ref, 1e-2, f"page {page} heads {heads} q_lens {q_lens}")
