"""MLA decode for the serving call in Gluon, sm_90 (issue 31): the engines' layouts.

The serving call (mla_tune/serving/call.py): q (total_q, heads, 576) bf16 with qo_indptr
(each sequence brings 1 to max_q_len new tokens, causal among themselves), KV either
contiguous (total_kv, 1, 576) with kv_indptr or paged (num_pages, page_size, 576) with
block_table and seq_lens, in bf16 or fp8 e4m3 with a per-tensor kv_scale. Built on the
leaderboard kernel's scheme (kernels/gluon_decode.py), with these differences:

- Tokens on the MMA's M dimension (BN = 64, one warpgroup), the MMA's N dimension the
  ROWS = BLOCK_H x Q_LEN_MAX (q row r is head r % BLOCK_H of the tile, new token
  r // BLOCK_H), 16 or 32 of them. S^T[BN x ROWS] = K[BN x 576] @ Q^T[576 x ROWS] in
  nine 64-column boxes (576 = 9 x 64: no zero fill), fp8 x fp8 for fp8 KV (q quantized in
  the kernel per (new token, head), amax / 448, as gluon_fused's), bf16 x bf16 for bf16 KV.
- O^T[512 x ROWS] += V^T[512 x BN] @ P^T[BN x ROWS] as eight [64 x ROWS] accumulators: for
  bf16 KV straight from the ring slot (the box read transposed), P^T bf16; for fp8 KV the
  box's bytes loaded into the A operand's registers and converted to fp16 (gluon_decode's
  `rs8`), P^T fp16. V_HALVES 2: two programs per (head tile, split, sequence), each with four
  of the eight accumulators (both compute S, so both softmaxes are identical).
- A tile of BN tokens is one TMA round of nine boxes over a 2-D descriptor of the cache's
  rows; paged KV needs PAGE_SIZE a multiple of BN (64, 128): a tile lies in one page,
  read through the block table (the next tile's page is loaded one iteration ahead).
  Rows past the sequence (another sequence's, a poisoned page's NaN, TMA's zero fill past
  the cache) are masked out of S, and a tile that ends past the sequence has its V rows
  there zeroed in shared memory before the PV MMAs (0 x NaN would be NaN).
- Splits per sequence computed on the device from its length (gs_num_splits, the same
  integer rule in both launches): want = clamp(cdiv(seq_len, tokens_per_split), 1,
  MAX_SPLITS), or with a batch budget of B splits (split_budget > 0) the sequence's share of
  them, clamp(round(seq_len x B / the batch's tokens), 1, that), so that the batch's grid
  stays about as large at any length; tiles per split cdiv(tiles, want), splits
  cdiv(tiles, that): no split is empty. The grid is (head tiles x V_HALVES, MAX_SPLITS, batch), from the host's batch and
  the variant only; programs past their sequence's splits, and sequences of length 0 (a
  padded CUDA-graph slot), exit. One split writes the output (and the LSE); several write
  normalized fp32 partials and log2-sum-exps into the workspace, at row (split x capacity +
  new token) x heads + head, and `_gs_reduce_kernel` (plain Triton) combines them.

Nothing on the host reads a device tensor; the workspace is sized from the caller's
maximum new tokens (GluonServingWorkspace.allocate), and the TMA descriptor is made once
per cache tensor (kept in the workspace), so a CUDA graph can hold the call.
Gluon has no CPU interpreter: this kernel runs only on an sm_90 GPU; the reduction is plain
Triton and runs under the interpreter. Exportable module: private names start with `_gs_`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, check_serving_layout
from mla_tune.kernels.gluon_decode import (
    GD_UNAVAILABLE,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from mla_tune.kernels.serving_runner import check_serving_q, check_serving_result

# Gluon comes through kernels/gluon_decode.py's guarded import (None there where this Triton
# has none; GD_UNAVAILABLE says why), so an export carries one copy of it.
GS_UNAVAILABLE = GD_UNAVAILABLE
# The renamed builtins by whichever name this Triton has (as gluon_decode's: the TMA load is
# 3.9's tma.async_load, 3.6's async_copy_global_to_shared; the CTA barrier 3.6's
# gl.thread_barrier, 3.9's gl.barrier).
_gs_tma_load = None if tma is None else (getattr(tma, "async_load", None)
                                         or getattr(tma, "async_copy_global_to_shared", None))
_gs_cta_barrier = None if gl is None else (getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None))

GS_BN = 64  # tokens per tile: the MMA's M, one warpgroup
GS_BOX = 64  # columns per TMA box; 576 = 9 boxes, 512 V dims = 8
GS_BOXES = QK_DIM // GS_BOX
GS_V_BOXES = V_DIM // GS_BOX
GS_ROWS = (16, 32)  # BLOCK_H x next_pow2(max_q_len): the MMA's N (64 spills at bf16 KV under Triton 3.6)
GS_MAX_Q_LEN = 4
GS_PAGE_SIZES = (64, 128)  # a tile in one page (0, the contiguous layout, too)
GS_MAX_SPLITS = 64
# Accumulator registers per thread (fp32): 8 / V_HALVES boxes of [64 x ROWS] over 128 threads.
GS_MAX_ACC_REGS = 128
GS_SMEM_LIMIT = 232448  # an sm_90 block's shared memory (227 KB)
GS_SMEM_SLACK = 512  # what the compilers allocate beyond gs_smem_bytes (Triton 3.6: 256 B more at 32 rows)
GS_REDUCE_SPLITS = 8  # splits the reduction reads per step


def _gs_no_jit(fn):
    """Stands in for gluon.jit where Gluon is missing, so this module still imports."""
    return fn


_gs_jit = gluon.jit if gluon is not None else _gs_no_jit
_gs_constexpr_fn = gluon.constexpr_function if gluon is not None else _gs_no_jit
# The runtime ints that change with the call (block-table width, the workspace's capacity) and
# the variant's split length: not specialized, so no value of theirs compiles a new binary.
_GS_NO_SPECIALIZE = ["bt_stride", "tokens_per_split", "cap", "split_budget"]
_gs_jit_serving = gluon.jit(do_not_specialize=_GS_NO_SPECIALIZE) if gluon is not None else _gs_no_jit


def gs_acc_regs(rows: int, v_halves: int) -> int:
    """fp32 accumulator registers per thread of one program: (8 / v_halves) x 64 x rows / 128."""
    return GS_V_BOXES // v_halves * GS_BOX * rows // 128


def gs_smem_bytes(rows: int, num_stages: int, fp8: bool) -> int:
    """Shared memory the kernel allocates: the KV ring (stages x 9 boxes of 64 x 64), q (9
    boxes of rows x 64), P^T (64 x rows, 16-bit), the barriers and 256 B: Triton 3.9's
    figure; 3.6 allocates 256 B more at 32 rows (tests/test_gluon_compile.py)."""
    elem = 1 if fp8 else 2
    return (num_stages * GS_BOXES * GS_BN * GS_BOX * elem + GS_BOXES * rows * GS_BOX * elem
            + GS_BN * rows * 2 + 8 * num_stages + 256)


def gs_num_splits(seq_len: int, max_splits: int, tokens_per_split: int, split_budget: int = 0,
                  total: int = 0) -> int:
    """The split count of a sequence of seq_len tokens (the kernels' rule, for tests and
    plans): want = clamp(cdiv(seq_len, tokens_per_split), 1, max_splits) splits of whole
    tiles, cdiv(tiles, want) tiles each; 0 for an empty sequence. split_budget > 0: want is
    the sequence's share of that many splits over the batch's `total` tokens, rounded to the
    nearest ((seq_len x budget + total // 2) // total), clamped the same way."""
    if seq_len <= 0:
        return 0
    tiles = -(-seq_len // GS_BN)
    want = -(-seq_len // tokens_per_split)
    if split_budget > 0:
        want = min(want, (seq_len * split_budget + total // 2) // max(total, 1))
    want = min(max(want, 1), max_splits)
    per = -(-tiles // want)
    return -(-tiles // per)


def gs_check_variant(rows: int, v_halves: int, num_stages: int, fp8: bool, max_splits: int) -> None:
    """Refuse (ValueError naming the fix) a tile the kernel cannot hold: rows outside
    GS_ROWS, accumulators over GS_MAX_ACC_REGS registers, a ring over shared memory."""
    if rows not in GS_ROWS:
        raise ValueError(f"block_h x next_pow2(max_q_len) must be one of {GS_ROWS}, got {rows}")
    if v_halves not in (1, 2):
        raise ValueError(f"v_halves must be 1 or 2, got {v_halves}")
    if gs_acc_regs(rows, v_halves) > GS_MAX_ACC_REGS:
        raise ValueError(f"{rows} rows x {GS_V_BOXES // v_halves} V boxes need {gs_acc_regs(rows, v_halves)} "
                         f"accumulator registers per thread, over {GS_MAX_ACC_REGS}; use v_halves=2 or fewer rows")
    if not fp8 and rows == 32 and v_halves == 1:
        raise ValueError("bf16 KV at 32 rows with every V dim in one program spills registers (Triton 3.6 and "
                         "3.9); use v_halves=2 or 16 rows")
    smem = gs_smem_bytes(rows, num_stages, fp8)
    if smem + GS_SMEM_SLACK > GS_SMEM_LIMIT:
        raise ValueError(f"{num_stages} stages of {'fp8' if fp8 else 'bf16'} KV at {rows} rows need {smem} B of "
                         f"shared memory (and up to {GS_SMEM_SLACK} B more), over the {GS_SMEM_LIMIT} B of an "
                         "sm_90 block; use fewer stages")
    if not 1 <= max_splits <= GS_MAX_SPLITS:
        raise ValueError(f"max_splits must be 1 to {GS_MAX_SPLITS}, got {max_splits}")


@_gs_constexpr_fn
def _gs_mma_layout(rows, k):
    """The wgmma accumulator layout of a [64 x rows] tile, one warpgroup (instruction K `k`)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, k])


@_gs_constexpr_fn
def _gs_nvmma_smem(inner_bytes, bits):
    """An NVMMA shared layout for 2-D tiles whose rows are `inner_bytes` long."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, inner_bytes), element_bitwidth=bits, rank=2)


@_gs_jit
def _gs_tile_row(BT_ROW, kv_lo, t, ok, BN: gl.constexpr, PAGE: gl.constexpr):
    """The cache row where tile t of the sequence starts (0 where not ok: never loaded)."""
    if PAGE == 0:
        row = kv_lo + t * BN
    else:
        tok0 = t * BN
        page = gl.load(BT_ROW + tok0 // PAGE, mask=ok, other=0)
        row = page * PAGE + tok0 % PAGE
    return row


@_gs_jit
def _gs_budget_share(KV_INDPTR, SEQ_LENS, seq_len, want, split_budget, batch, PAGE: gl.constexpr):
    """min(want, the sequence's share of split_budget splits over the batch's tokens, rounded
    to the nearest), in int64 as gs_num_splits computes it."""
    if PAGE == 0:
        total = (gl.load(KV_INDPTR + batch) - gl.load(KV_INDPTR)).to(gl.int64)
    else:
        c_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        total = gl.to_tensor(0).to(gl.int64)
        for c0 in range(0, batch, 512):
            idx = c0 + gl.arange(0, 512, layout=c_l)
            total += gl.sum(gl.load(SEQ_LENS + idx, mask=idx < batch, other=0).to(gl.int64), 0)
    share = (seq_len.to(gl.int64) * split_budget + total // 2) // gl.maximum(total, 1)
    return gl.minimum(want.to(gl.int64), share).to(gl.int32)


@_gs_jit
def _gs_issue_tile(kv_desc, kv_s, bars, stage, row, pred, NB: gl.constexpr):
    """TMA the [BN x 576] tile at cache row `row` into ring stage `stage` (nine boxes, one barrier)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, NB * kv_desc.block_type.nbytes, pred)
    for c in gl.static_range(NB):
        _gs_tma_load(kv_desc, [row, c * 64], bar, kv_s.index(stage * NB + c), pred)


@_gs_jit
def _gs_zero_tail(kv_s, base, tok0, seq_len, vbox0, NVB: gl.constexpr, BN: gl.constexpr):
    """Zero the V rows at or past seq_len of this program's V boxes of the tile in ring slot
    `base` (the bytes there may be NaN), for the PV MMAs that read them from shared memory."""
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tok = tok0 + gl.arange(0, BN, layout=gl.SliceLayout(1, z_l))
    keep = (tok < seq_len)[:, None]
    for j in gl.static_range(NVB):
        box = kv_s.index(base + vbox0 + j)
        v = box.load(z_l)
        box.store(gl.where(keep, v.to(gl.float32), 0.0).to(v.dtype))
    fence_async_shared()
    _gs_cta_barrier()


@_gs_jit
def _gs_pv(kv_s, base, vbox, p_s, o, FP8: gl.constexpr, ROWS: gl.constexpr):
    """o[64 x ROWS] += (V box `vbox` of the tile [BN x 64])^T @ P^T[BN x ROWS]. bf16: the box
    read transposed from shared memory, asynchronous (the caller waits); fp8: its bytes into
    the A operand's registers as fp16, synchronous."""
    box = kv_s.index(base + vbox)
    if FP8:
        o_l: gl.constexpr = _gs_mma_layout(ROWS, 16)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        a = box.permute((1, 0)).load(a_l).to(gl.float16)
        o = warpgroup_mma(a, p_s, o)
    else:
        o = warpgroup_mma(box.permute((1, 0)), p_s, o, is_async=True)
    return o


@_gs_jit
def _gs_store_box(o, j, vbox0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                  H: gl.constexpr, BLOCK_H: gl.constexpr, ROWS: gl.constexpr, MAX_SPLITS: gl.constexpr):
    """Write dims [64 (vbox0 + j), + 64) of the rows' output (bf16; one split) or of this
    split's fp32 partial (several)."""
    o_l: gl.constexpr = _gs_mma_layout(ROWS, 16)
    d = (vbox0 + j) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, o_l))
    head = ht * BLOCK_H + r % BLOCK_H
    val = o * (scale / l_safe)[None, :]
    mask = valid[None, :] & (d[:, None] < 512)
    if MAX_SPLITS == 1:
        gl.store(OUT + ((tok_q * H + head) * 512)[None, :] + d[:, None], val.to(gl.bfloat16), mask=mask)
    else:
        if num_splits == 1:
            gl.store(OUT + ((tok_q * H + head) * 512)[None, :] + d[:, None], val.to(gl.bfloat16), mask=mask)
        else:
            row = (split * cap + tok_q) * H + head
            gl.store(PART_O + (row * 512)[None, :] + d[:, None], val, mask=mask)


@_gs_jit_serving
def _gs_serving_kernel(
    kv_desc, Q, QO_INDPTR, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, OUT, PART_O, PART_LSE, LSE,
    bt_stride, tokens_per_split, cap, split_budget, sm_scale_log2,
    H: gl.constexpr, BLOCK_H: gl.constexpr, Q_LEN_MAX: gl.constexpr, STAGES: gl.constexpr,
    PAGE: gl.constexpr, FP8: gl.constexpr, V_HALVES: gl.constexpr, MAX_SPLITS: gl.constexpr,
    WITH_LSE: gl.constexpr,
):
    BN: gl.constexpr = 64
    NB: gl.constexpr = 9  # boxes of 64 columns per token row
    NVB: gl.constexpr = 8 // V_HALVES  # this program's V boxes
    ROWS: gl.constexpr = BLOCK_H * Q_LEN_MAX
    ht = gl.program_id(0) // V_HALVES
    half = gl.program_id(0) % V_HALVES
    split = gl.program_id(1)
    b = gl.program_id(2)
    if PAGE == 0:
        kv_lo = gl.load(KV_INDPTR + b)
        seq_len = gl.load(KV_INDPTR + b + 1) - kv_lo
    else:
        kv_lo = 0
        seq_len = gl.load(SEQ_LENS + b)
    # The split rule (gs_num_splits); a padded slot (seq_len 0) has no split.
    tiles = gl.cdiv(seq_len, BN)
    want = gl.cdiv(seq_len, tokens_per_split)
    if split_budget > 0:
        want = _gs_budget_share(KV_INDPTR, SEQ_LENS, seq_len, want, split_budget, gl.num_programs(2), PAGE)
    want = gl.minimum(gl.maximum(want, 1), MAX_SPLITS)
    per = gl.cdiv(tiles, gl.maximum(want, 1))
    num_splits = gl.where(seq_len > 0, gl.cdiv(tiles, gl.maximum(per, 1)), 0)
    if split < num_splits:
        t0 = split * per
        n_tiles = gl.minimum(per, tiles - t0)
        bt_row = BLOCK_TABLE + b.to(gl.int64) * bt_stride

        kv_l: gl.constexpr = kv_desc.layout
        kv_s = gl.allocate_shared_memory(kv_desc.dtype, [STAGES * NB, BN, 64], kv_l)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        # Start the ring before q is read, so the first tiles are in flight meanwhile.
        for s in gl.static_range(STAGES - 1):
            row = _gs_tile_row(bt_row, kv_lo, t0 + s, s < n_tiles, BN, PAGE)
            _gs_issue_tile(kv_desc, kv_s, bars, s, row, s < n_tiles, NB)
        row_next = _gs_tile_row(bt_row, kv_lo, t0 + STAGES - 1, STAGES - 1 < n_tiles, BN, PAGE)

        # q: ROWS x 576 in nine [ROWS x 64] boxes; row r is head ht * BLOCK_H + r % BLOCK_H of
        # new token r // BLOCK_H (rows past the sequence's q_len are zeros, never stored).
        q_start = gl.load(QO_INDPTR + b)
        q_len = gl.load(QO_INDPTR + b + 1) - q_start
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_l))
        qd = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
        q_ok = (qr // BLOCK_H < q_len)[:, None] & (qd[None, :] < 64)
        q_ptr = Q + (((q_start + qr // BLOCK_H).to(gl.int64) * H + ht * BLOCK_H + qr % BLOCK_H) * 576)[:, None] \
            + qd[None, :]
        s_l: gl.constexpr = _gs_mma_layout(ROWS, 32 if FP8 else 16)
        o_l: gl.constexpr = _gs_mma_layout(ROWS, 16)
        if FP8:
            q_sl: gl.constexpr = _gs_nvmma_smem(64, 8)
            q_s = gl.allocate_shared_memory(gl.float8e4nv, [NB, ROWS, 64], q_sl)
            amax = gl.full([ROWS], 1e-12, gl.float32, gl.SliceLayout(1, q_l))
            for c in gl.static_range(NB):
                x = gl.load(q_ptr + c * 64, mask=q_ok, other=0.0)
                amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), 1))
            q_scale = amax / 448.0
            for c in gl.static_range(NB):
                x = gl.load(q_ptr + c * 64, mask=q_ok, other=0.0)
                q_s.index(c).store((x.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
            kv_scale = gl.load(KV_SCALE)
            col_scale = gl.convert_layout(q_scale, gl.SliceLayout(0, s_l)) * (kv_scale * sm_scale_log2)
            p_dtype: gl.constexpr = gl.float16
        else:
            q_sl: gl.constexpr = _gs_nvmma_smem(128, 16)
            q_s = gl.allocate_shared_memory(gl.bfloat16, [NB, ROWS, 64], q_sl)
            for c in gl.static_range(NB):
                q_s.index(c).store(gl.load(q_ptr + c * 64, mask=q_ok, other=0.0))
            kv_scale = 1.0
            col_scale = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(0, s_l)) * sm_scale_log2
            p_dtype: gl.constexpr = gl.bfloat16
        fence_async_shared()
        _gs_cta_barrier()

        p_sl: gl.constexpr = _gs_nvmma_smem(ROWS * 2, 16)
        p_s = gl.allocate_shared_memory(p_dtype, [BN, ROWS], p_sl)
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        # New token i of q_len sees the first seq_len - (q_len - 1 - i) tokens (rows past
        # q_len see the sequence; they are never stored).
        r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_l))
        q_idx = gl.minimum(r_s // BLOCK_H, q_len - 1)
        limit = seq_len - q_len + 1 + q_idx
        vbox0 = half * NVB

        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, s_l))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(0, s_l))
        o0 = gl.zeros([64, ROWS], gl.float32, o_l)
        o1 = gl.zeros([64, ROWS], gl.float32, o_l)
        o2 = gl.zeros([64, ROWS], gl.float32, o_l)
        o3 = gl.zeros([64, ROWS], gl.float32, o_l)
        o4 = gl.zeros([64, ROWS], gl.float32, o_l)
        o5 = gl.zeros([64, ROWS], gl.float32, o_l)
        o6 = gl.zeros([64, ROWS], gl.float32, o_l)
        o7 = gl.zeros([64, ROWS], gl.float32, o_l)
        for i in range(n_tiles):
            stage = i % STAGES
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            # Refill the stage tile i - 1 used: every warp has finished with it.
            _gs_cta_barrier()
            nxt = i + STAGES - 1
            _gs_issue_tile(kv_desc, kv_s, bars, nxt % STAGES, row_next, nxt < n_tiles, NB)
            row_next = _gs_tile_row(bt_row, kv_lo, t0 + nxt + 1, nxt + 1 < n_tiles, BN, PAGE)

            base = stage * NB
            tok0 = (t0 + i) * BN
            s_acc = gl.zeros([BN, ROWS], gl.float32, s_l)
            for c in gl.static_range(NB):
                s_acc = warpgroup_mma(kv_s.index(base + c), q_s.index(c).permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma_wait(num_outstanding=0, deps=[s_acc])
            tok = tok0 + rows
            s_acc = gl.where(tok[:, None] < limit[None, :], s_acc * col_scale[None, :], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s_acc, 0))
            # A row may see none of a tile's tokens (the causal mask): keep its exp2 finite.
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_ref)
            p = gl.exp2(s_acc - m_ref[None, :])
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            _gs_cta_barrier()  # the previous tile's P^T has been read by every MMA
            p_s.store(p.to(p_dtype))
            fence_async_shared()
            _gs_cta_barrier()
            if tok0 + BN > seq_len:  # rows past the sequence: zero their V (NaN x 0 is NaN)
                _gs_zero_tail(kv_s, base, tok0, seq_len, vbox0, NVB, BN)

            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
            o0 = _gs_pv(kv_s, base, vbox0 + 0, p_s, o0 * alpha_o, FP8, ROWS)
            o1 = _gs_pv(kv_s, base, vbox0 + 1, p_s, o1 * alpha_o, FP8, ROWS)
            o2 = _gs_pv(kv_s, base, vbox0 + 2, p_s, o2 * alpha_o, FP8, ROWS)
            o3 = _gs_pv(kv_s, base, vbox0 + 3, p_s, o3 * alpha_o, FP8, ROWS)
            if V_HALVES == 1:
                o4 = _gs_pv(kv_s, base, 4, p_s, o4 * alpha_o, FP8, ROWS)
                o5 = _gs_pv(kv_s, base, 5, p_s, o5 * alpha_o, FP8, ROWS)
                o6 = _gs_pv(kv_s, base, 6, p_s, o6 * alpha_o, FP8, ROWS)
                o7 = _gs_pv(kv_s, base, 7, p_s, o7 * alpha_o, FP8, ROWS)
                if not FP8:
                    o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                        num_outstanding=0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
            else:
                if not FP8:
                    o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=[o0, o1, o2, o3])

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        # A row that saw none of this split's tokens (the causal mask) has l = 0: zeros, lse -inf.
        l_safe = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(0, o_l))
        scale = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(0, o_l)) * kv_scale
        r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(0, o_l))
        tok_q = (q_start + r_o // BLOCK_H).to(gl.int64)
        valid = r_o // BLOCK_H < q_len
        _gs_store_box(o0, 0, vbox0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                      H, BLOCK_H, ROWS, MAX_SPLITS)
        _gs_store_box(o1, 1, vbox0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                      H, BLOCK_H, ROWS, MAX_SPLITS)
        _gs_store_box(o2, 2, vbox0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                      H, BLOCK_H, ROWS, MAX_SPLITS)
        _gs_store_box(o3, 3, vbox0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                      H, BLOCK_H, ROWS, MAX_SPLITS)
        if V_HALVES == 1:
            _gs_store_box(o4, 4, 0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                          H, BLOCK_H, ROWS, MAX_SPLITS)
            _gs_store_box(o5, 5, 0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                          H, BLOCK_H, ROWS, MAX_SPLITS)
            _gs_store_box(o6, 6, 0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                          H, BLOCK_H, ROWS, MAX_SPLITS)
            _gs_store_box(o7, 7, 0, l_safe, scale, ht, split, tok_q, valid, OUT, PART_O, cap, num_splits,
                          H, BLOCK_H, ROWS, MAX_SPLITS)
        if half == 0:
            # log2-sum-exp of the scaled scores (both halves have the same; half 0 writes it)
            lse2 = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            s_tok = (q_start + r_s // BLOCK_H).to(gl.int64)
            s_head = ht * BLOCK_H + r_s % BLOCK_H
            s_valid = r_s // BLOCK_H < q_len
            if num_splits == 1:
                if WITH_LSE:
                    gl.store(LSE + s_tok * H + s_head, lse2 * 0.6931471805599453, mask=s_valid)
            else:
                if MAX_SPLITS > 1:
                    gl.store(PART_LSE + (split * cap + s_tok) * H + s_head, lse2, mask=s_valid)


@triton.jit(do_not_specialize=_GS_NO_SPECIALIZE[1:])
def _gs_reduce_kernel(QO_INDPTR, KV_INDPTR, SEQ_LENS, PART_O, PART_LSE, OUT, LSE, tokens_per_split, cap,
                      split_budget,
                      H: tl.constexpr, MAX_SPLITS: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr,
                      D: tl.constexpr, WITH_LSE: tl.constexpr):
    """out[token, head] = sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m) over the splits the
    serving kernel wrote for (sequence b, its new token q_idx, head): one program each; a
    sequence of one split (the kernel wrote the output) or of none returns at once."""
    b = tl.program_id(0)
    q_idx = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QO_INDPTR + b)
    if q_idx >= tl.load(QO_INDPTR + b + 1) - q_start:
        return
    if PAGE == 0:
        seq_len = tl.load(KV_INDPTR + b + 1) - tl.load(KV_INDPTR + b)
    else:
        seq_len = tl.load(SEQ_LENS + b)
    tiles = tl.cdiv(seq_len, 64)
    want = tl.cdiv(seq_len, tokens_per_split)
    if split_budget > 0:  # the serving kernel's _gs_budget_share
        if PAGE == 0:
            total = (tl.load(KV_INDPTR + tl.num_programs(0)) - tl.load(KV_INDPTR)).to(tl.int64)
        else:
            total = tl.zeros([], dtype=tl.int64)
            for c0 in range(0, tl.num_programs(0), 512):
                idx = c0 + tl.arange(0, 512)
                total += tl.sum(tl.load(SEQ_LENS + idx, mask=idx < tl.num_programs(0), other=0).to(tl.int64), 0)
        share = (seq_len.to(tl.int64) * split_budget + total // 2) // tl.maximum(total, 1)
        want = tl.minimum(want.to(tl.int64), share).to(tl.int32)
    want = tl.minimum(tl.maximum(want, 1), MAX_SPLITS)
    per = tl.cdiv(tiles, tl.maximum(want, 1))
    num_splits = tl.where(seq_len > 0, tl.cdiv(tiles, tl.maximum(per, 1)), 0)
    if num_splits <= 1:
        return
    tok = (q_start + q_idx).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    # Split 0 holds token 0, which every new token sees: the first chunk's max is finite.
    m = float("-inf")
    wsum = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        live = s < num_splits
        row = (s.to(tl.int64) * cap + tok) * H + h
        lse = tl.load(PART_LSE + row, mask=live, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        parts = tl.load(PART_O + row[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        wsum = wsum * alpha + tl.sum(w, axis=0)
        m = m_new
    tl.store(OUT + (tok * H + h) * D + offs_d, (acc / wsum).to(tl.bfloat16))
    if WITH_LSE:
        tl.store(LSE + tok * H + h, (m + tl.log2(wsum)) * 0.6931471805599453)


# TMA descriptors one workspace keeps (one per cache tensor: an engine's layers).
GS_MAX_DESCRIPTORS = 1024


@dataclass
class GluonServingWorkspace:
    """Scratch for `gluon_serving`, sized from the caller's maxima (never from the data):
    fp32 partial outputs and log2-sum-exps at (split, new token, head) for max_splits splits
    of max_total_q new tokens (none with max_splits 1), and the TMA descriptors made so far,
    by cache tensor (address, shape, dtype)."""

    max_total_q: int
    heads: int
    max_splits: int
    part_o: torch.Tensor
    part_lse: torch.Tensor
    descriptors: dict  # (address, rows, dtype) -> TMA descriptor

    # written before they are read in every call: a plan's runners may share them (SharedScratch)
    SHARED = ("part_o", "part_lse")

    @classmethod
    def allocate(cls, max_total_q: int, heads: int, max_splits: int, device,
                 max_q_len: int = 1) -> GluonServingWorkspace:
        rows = max_splits * max_total_q * heads if max_splits > 1 else 1
        return cls(max_total_q, heads, max_splits,
                   torch.empty((rows, V_DIM) if max_splits > 1 else (1,), dtype=torch.float32, device=device),
                   torch.empty((rows,), dtype=torch.float32, device=device), {})

    def fits(self, total_q: int, heads: int, max_splits: int, max_q_len: int = 1) -> bool:
        return self.max_total_q >= total_q and self.heads == heads and self.max_splits == max_splits

    def descriptor(self, kv2d: torch.Tensor):
        """The TMA descriptor over the cache's rows (kv2d: (rows, 576)), [64 x 64] boxes,
        made the first time this tensor is seen (past GS_MAX_DESCRIPTORS, made per call)."""
        key = (kv2d.data_ptr(), kv2d.shape[0], kv2d.dtype)
        desc = self.descriptors.get(key)
        if desc is None:
            desc = gs_kv_descriptor(kv2d)
            if len(self.descriptors) < GS_MAX_DESCRIPTORS:
                self.descriptors[key] = desc
        return desc


def gs_kv_descriptor(kv2d: torch.Tensor):
    """Host TMA descriptor over a (rows, 576) bf16 or fp8 cache, [64 x 64] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bits = 8 * kv2d.element_size()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, GS_BOX * kv2d.element_size()),
                                  element_bitwidth=bits, rank=2)
    return TensorDescriptor.from_tensor(kv2d, [GS_BN, GS_BOX], layout)


def gluon_serving(q, qo_indptr, kv, kv_scale, out, *, kv_indptr=None, block_table=None, seq_lens=None,
                  max_q_len: int, block_h: int, max_splits: int, tokens_per_split: int, num_stages: int,
                  v_halves: int = 1, split_budget: int = 0, sm_scale: float = SM_SCALE,
                  workspace: GluonServingWorkspace | None = None, record: list | None = None,
                  lse: torch.Tensor | None = None) -> torch.Tensor:
    """MLA decode attention for the serving call on sm_90; writes and returns `out`.

    The call's tensors as `flash_decode_serving` takes them (kernels/flash_decode.py): q
    (total_q, heads, 576) bf16 and qo_indptr (batch + 1,) int32, 1 <= q_len <= max_q_len <=
    4, causal among the new tokens; contiguous KV (kv_indptr) or paged KV of 64 or 128
    tokens a page (block_table, seq_lens), bf16 or fp8 e4m3 with a (1,) fp32 kv_scale;
    out (total_q, heads, 512) bf16; lse None or (total_q, heads) float32, natural log.
    block_h x next_pow2(max_q_len) must be 16 or 32 (gs_check_variant). Splits per
    sequence: gs_num_splits(seq_len, max_splits, tokens_per_split, split_budget, the batch's
    tokens), on the device (split_budget 0: no batch budget).
    workspace: GluonServingWorkspace.allocate(max_total_q, heads, max_splits). record must
    be None (the launches are not replayed directly). Nothing here reads a device tensor or
    allocates once a workspace is given and its cache's descriptor made."""
    if GS_UNAVAILABLE is not None:
        raise RuntimeError(GS_UNAVAILABLE)
    page_size = check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens)
    if page_size and page_size not in GS_PAGE_SIZES:
        raise ValueError(f"the Gluon serving kernel reads pages of {', '.join(map(str, GS_PAGE_SIZES))} tokens "
                         f"(a tile in one page) or contiguous KV, not pages of {page_size}")
    batch = qo_indptr.shape[0] - 1
    total_q, heads = check_serving_q(q, qo_indptr, max_q_len, GS_MAX_Q_LEN)
    if block_h < 1 or heads % block_h:
        raise ValueError(f"block_h must divide the heads ({heads}), got {block_h}")
    fp8 = kv.dtype != torch.bfloat16
    if fp8 and (kv.dtype != torch.float8_e4m3fn or kv_scale is None):
        raise ValueError(f"the Gluon serving kernel reads bfloat16 KV, or float8_e4m3fn KV with a (1,) fp32 "
                         f"kv_scale; got {kv.dtype}, scale {kv_scale}")
    check_serving_result(out, lse, total_q, heads)
    if tokens_per_split < 1:
        raise ValueError(f"tokens_per_split must be >= 1, got {tokens_per_split}")
    if isinstance(split_budget, bool) or not isinstance(split_budget, int) or not 0 <= split_budget < 2**31:
        raise ValueError(f"split_budget must be an integer >= 0 (0: no batch budget), got {split_budget!r}")
    if record is not None:
        raise ValueError("the Gluon serving launches are not recorded for replay: pass record=None")
    rows = block_h * triton.next_power_of_2(max_q_len)
    gs_check_variant(rows, v_halves, num_stages, fp8, max_splits)
    if workspace is None:
        workspace = GluonServingWorkspace.allocate(total_q, heads, max_splits, q.device)
    elif not workspace.fits(total_q, heads, max_splits):
        raise ValueError(f"workspace is for {workspace.max_total_q} new tokens x {workspace.heads} heads x "
                         f"{workspace.max_splits} splits, not {total_q} x {heads} x {max_splits}; allocate one "
                         "with GluonServingWorkspace.allocate(max_total_q, heads, max_splits, device)")
    kv2d = kv.view(-1, QK_DIM)
    if kv2d.data_ptr() % 16:
        raise ValueError("the KV cache must start 16-byte aligned for TMA")
    desc = workspace.descriptor(kv2d)
    # Unused pointers get a harmless stand-in (never read under the other layout).
    dummy = qo_indptr
    bt = block_table if page_size else dummy
    kv_ptrs = (kv_indptr, dummy, dummy) if page_size == 0 else (dummy, bt, seq_lens)
    lse_arg = lse if lse is not None else workspace.part_lse
    q_len_max = triton.next_power_of_2(max_q_len)
    common = dict(H=heads, MAX_SPLITS=max_splits, PAGE=page_size, WITH_LSE=lse is not None)
    _gs_serving_kernel[(heads // block_h * v_halves, max_splits, batch)](
        desc, q, qo_indptr, kv_scale if fp8 else workspace.part_lse, *kv_ptrs, out, workspace.part_o,
        workspace.part_lse, lse_arg, block_table.stride(0) if page_size else 0, tokens_per_split,
        workspace.max_total_q, split_budget, sm_scale * math.log2(math.e),
        BLOCK_H=block_h, Q_LEN_MAX=q_len_max, STAGES=num_stages, FP8=fp8, V_HALVES=v_halves,
        num_warps=4, **common,
    )
    if max_splits > 1:
        gs_reduce(qo_indptr, workspace, out, lse, kv_indptr=kv_indptr, seq_lens=seq_lens, max_q_len=max_q_len,
                  tokens_per_split=tokens_per_split, split_budget=split_budget)
    return out


def gs_reduce(qo_indptr, workspace: GluonServingWorkspace, out, lse=None, *, kv_indptr=None, seq_lens=None,
              max_q_len: int, tokens_per_split: int, split_budget: int = 0) -> None:
    """Combine the partials the serving kernel left in `workspace` into out (and lse): for
    each sequence of more than one split (gs_num_splits of its length from kv_indptr or
    seq_lens, with the workspace's max_splits and split_budget), each new token and head. Plain
    Triton (runs under the interpreter); reads nothing on the host."""
    batch, heads = qo_indptr.shape[0] - 1, workspace.heads
    paged = kv_indptr is None
    stand_in = qo_indptr  # the other layout's pointer, never read
    _gs_reduce_kernel[(batch, max_q_len, heads)](
        qo_indptr, stand_in if paged else kv_indptr, seq_lens if paged else stand_in, workspace.part_o,
        workspace.part_lse, out, lse if lse is not None else workspace.part_lse, tokens_per_split,
        workspace.max_total_q, split_budget, H=heads, MAX_SPLITS=workspace.max_splits, PAGE=int(paged), BLOCK_S=GS_REDUCE_SPLITS,
        D=V_DIM, WITH_LSE=lse is not None, num_warps=4,
    )
