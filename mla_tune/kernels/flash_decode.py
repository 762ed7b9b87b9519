"""Split-K flash-decode for MLA: one Triton kernel family reading bf16 or fp8 KV.

Stage 1 runs one program per (sequence, split): all 16 heads together, so each KV tile
is read from memory once and serves every head. The tile is loaded once as [BLOCK_N, 512]
+ [BLOCK_N, 64]; the 512 part is both the key (scores) and the value (output), since MLA's
values are the first 512 dims of the same latent. Sequence bounds come from kv_indptr on
the device, so ragged batches need no host sync, and kv_len is never a compile-time value:
one compile serves every shape. Softmax is online, in fp32, in the log2 domain.

Scales commute with the dots (per-tensor), so they are folded rather than applied per
element: sm_scale * log2(e) * q_scale * kv_scale multiplies the scores and kv_scale the
output. Stage 2 merges the splits with their log-sum-exps; with one split, stage 1 writes
the bf16 output itself (one launch).

q modes: "bf16" uses q as is; "fp8_dynamic" quantizes q per tensor on the device every
call, exactly as `mla_tune.problem.quantize_fp8` does (scale = bf16(amax / fp8_max), the
quotient rounded to bf16, clamped, cast) so it reproduces the leaderboard's reference;
"fp8_static" uses a fixed scale (q_amax / fp8_max, calibrated offline) and clamps values
beyond it. Quantized q is cast to the dot dtype, which holds every fp8 value exactly.

Two launch paths share these helpers: `flash_decode`, the leaderboard's call (contiguous KV,
16 heads, one new token, the split count given by the host), and `flash_decode_serving`,
the serving call (contiguous or paged KV, any head count in tiles, q_len new tokens per
sequence causal among themselves, split counts computed on the device, CUDA-graph safe;
`mla_tune/serving/inputs.py` has its inputs and reference). The leaderboard path keeps its own
kernel, which its table was timed with; moving it to the serving kernel waits on a side-by-side
timing on the 8 shapes (scripts/bench_layouts.py at 9401329 was that benchmark).

Exportable module: see docs/architecture.md (imports, `_fd_` prefix, no import-time work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_tune.core import (
    KV_LORA_RANK,
    NUM_HEADS,
    QK_DIM,
    QK_ROPE_DIM,
    SM_SCALE,
    V_DIM,
    device_sm_count,
)
from mla_tune.kernels.launch import jit_launch
from mla_tune.kernels.serving_runner import check_serving_launch, serving_workspace
from mla_tune.kernels.split_rule import (
    REDUCE_SPLITS_PER_STEP,
    fill_splits,
    launch_items,
    most_items,
    reduce_splits_per_step,
)

_fd_LOG2E = 1.4426950408889634
_fd_Q_MODES = {"bf16": 0, "fp8_static": 1, "fp8_dynamic": 2}
_fd_DOT_DTYPES = {"fp16": tl.float16, "bf16": tl.bfloat16}
_fd_HIP_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Stage 1's score-dot chunk counts (QK_SPLIT; a chunk of 512 / c dims is a dot's K >= 16).
_fd_QK_SPLITS = (1, 2, 4, 8)
# Stage 1 reduces the per-sequence q amax partials in chunks of this many.
_fd_AMAX_CHUNK = 128
# Sequences per step of the serving schedule's loop.
_fd_SCHED_CHUNK = 128
# The serving reduction's programs: (sequence, new token, head) with all 512 columns and
# 16 splits per step; or, while the 4x wider grid stays within 2048 programs,
# a quarter of the columns and 64 splits per step (a long sequence in a ragged batch
# takes most of the batch's budget: hundreds of splits). On the H200 the wide grid took
# the 56k-among-3k mix from 98 to 81 us (192 programs), was even at 2048-2304 programs
# and lost 27% at 16384 (128 heads x 32 sequences: 229 -> 294 us). The rule is
# split_rule.reduce_splits_per_step, which the cost model replays.
# The serving stage 1's grid: a program per (head tile, split item) up to
# _fd_ONE_ITEM_CTAS programs; past that _fd_GRID_CTAS programs (about 16 per SM of an
# H200), each running its items in turn. Most of a large grid idles (it is sized for the
# budget, the batch may use few items) and an idle program still reads the lengths: on
# the H200 256 x 512 at 16 heads took 237 us with 16640 programs, 182 with 2048 that loop;
# 32 x 4000 at 128 heads 214 us with 4160 programs, 229 with 2048 that loop.
_fd_ONE_ITEM_CTAS = 8192
_fd_GRID_CTAS = 2048
@triton.jit
def _fd_q_amax_kernel(Q, Partial, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Partial[b] = max |q[b]|: per-sequence partials that every stage-1 program reduces,
    so the per-tensor q scale costs one small launch and no host sync."""
    b = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROW, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(Q + b * ROW + offs, mask=offs < ROW, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.store(Partial + b, tl.max(acc, axis=0))


@triton.jit
def round_to_mantissa(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round fp32 y to MANT_BITS mantissa bits, nearest-even (subnormals below 2**MIN_EXP
    share its ulp; MIN_EXP - MANT_BITS must stay above -127): the value a cast to a narrower float gives, computed in fp32 because
    Triton's interpreter casts fp32 to fp8 wrongly when the mantissa carries into the
    exponent (127.04 -> 64), and this way CPU tests run the same code as the GPU."""
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP) - MANT_BITS
    ulp = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    # Adding 1.5 * 2**23 makes the fp32 adder round to an integer, nearest-even; the
    # scaled value is < 2**9 and both scalings are exact powers of two.
    return ((y * inv_ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def quantize_q_e4m3(x, scale, fp8_max, FP8_MIN_EXP: tl.constexpr, ROUND_BF16: tl.constexpr):
    """q / scale clamped and rounded to e4m3 (returned in fp32: every e4m3 value is exact
    in fp16 and bf16, so the dot sees exactly the fp8 operand)."""
    y = x.to(tl.float32) / scale
    if ROUND_BF16:  # torch divides bf16 by a bf16 scale: the quotient is rounded to bf16
        # MIN_EXP -119 keeps the bit tricks in range; anything that small becomes 0 in fp8.
        y = round_to_mantissa(y, 7, -119)
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    return round_to_mantissa(y, 3, FP8_MIN_EXP)


# batch is runtime, never specialized: one compile serves every batch size.
# V_SPLIT and QK_SPLIT (both 1: the kernel as it was, the same code) trade work for
# registers, for AMD's register file (the H200's plan never sets them):
# - V_SPLIT 2: two programs per split, side by side in the grid's second dimension. Both
#   read the whole tile and compute the scores (the same code on the same data, so the
#   softmax statistics are bit-identical and one writes the lse); each multiplies and
#   writes only its half of the 512 value columns: half the accumulator, the tile read
#   twice (the second read meant to hit in L2).
# - QK_SPLIT c > 1: the 512-dim score dot as a batched dot over c chunks of 512 / c dims
#   (the warps share the chunks, so each holds 1 / c of q instead of all of it), summed
#   over the chunks; the value columns are a second load of the tile (from L1 or L2).
@triton.jit(do_not_specialize=["batch"])
def _fd_stage1_kernel(
    Q, KV, KV_SCALE, KV_INDPTR, Q_AMAX, batch, q_static_scale, fp8_max, qk_scale,
    Out, PartOut, PartLse,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    Q_MODE: tl.constexpr, FP8_MIN_EXP: tl.constexpr, KV_SCALED: tl.constexpr,
    AMAX_CHUNK: tl.constexpr,
    H: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, D_QK: tl.constexpr,
    V_SPLIT: tl.constexpr = 1, QK_SPLIT: tl.constexpr = 1,
):
    pid_b = tl.program_id(0)
    if V_SPLIT == 1:
        pid_s = tl.program_id(1)
    else:
        pid_s = tl.program_id(1) // 2
        half = tl.program_id(1) % 2
    seq_start = tl.load(KV_INDPTR + pid_b)
    kv_len = tl.load(KV_INDPTR + pid_b + 1) - seq_start
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    if V_SPLIT == 1:
        offs_o = offs_d  # the value (output) columns this program computes
    else:
        offs_v = tl.arange(0, D_NOPE // 2)
        offs_o = half * (D_NOPE // 2) + offs_v
    if QK_SPLIT > 1:
        # [QK_SPLIT, 1, chunk] column offsets of the chunks (q's [chunk, head, dim] and the
        # tile's [chunk, dim, token] operands)
        offs_c = (tl.arange(0, QK_SPLIT)[:, None, None] * (D_NOPE // QK_SPLIT)
                  + tl.arange(0, D_NOPE // QK_SPLIT)[None, None, :])
    q_row = Q + pid_b.to(tl.int64) * H * D_QK + offs_h[:, None] * D_QK
    if QK_SPLIT > 1:
        q_nope = tl.load(Q + pid_b.to(tl.int64) * H * D_QK + offs_h[None, :, None] * D_QK + offs_c)
    elif V_SPLIT == 1:
        q_nope = tl.load(q_row + offs_d[None, :])
    else:
        # The nope part as two halves of 256 dims (q_nope, q_nope_b), summed in one order.
        q_nope = tl.load(q_row + offs_v[None, :])
        q_nope_b = tl.load(q_row + D_NOPE // 2 + offs_v[None, :])
    q_rope = tl.load(q_row + D_NOPE + offs_r[None, :])

    score_scale = qk_scale  # sm_scale * log2(e), times whatever scales are folded in
    if Q_MODE == 1:
        q_nope = quantize_q_e4m3(q_nope, q_static_scale, fp8_max, FP8_MIN_EXP, False)
        if QK_SPLIT == 1:
            if V_SPLIT == 2:  # the second half
                q_nope_b = quantize_q_e4m3(q_nope_b, q_static_scale, fp8_max, FP8_MIN_EXP, False)
        q_rope = quantize_q_e4m3(q_rope, q_static_scale, fp8_max, FP8_MIN_EXP, False)
        score_scale = score_scale * q_static_scale
    elif Q_MODE == 2:
        amax_acc = tl.zeros([AMAX_CHUNK], dtype=tl.float32)
        for i in range(0, batch, AMAX_CHUNK):
            offs_a = i + tl.arange(0, AMAX_CHUNK)
            amax_acc = tl.maximum(amax_acc, tl.load(Q_AMAX + offs_a, mask=offs_a < batch, other=0.0))
        amax = tl.maximum(tl.max(amax_acc, axis=0), 1e-12)
        q_scale = round_to_mantissa(amax / fp8_max, 7, -119)  # bf16, as problem.quantize_fp8
        q_nope = quantize_q_e4m3(q_nope, q_scale, fp8_max, FP8_MIN_EXP, True)
        if QK_SPLIT == 1:
            if V_SPLIT == 2:  # the second half
                q_nope_b = quantize_q_e4m3(q_nope_b, q_scale, fp8_max, FP8_MIN_EXP, True)
        q_rope = quantize_q_e4m3(q_rope, q_scale, fp8_max, FP8_MIN_EXP, True)
        score_scale = score_scale * q_scale
    q_nope = q_nope.to(DOT_DTYPE)
    if QK_SPLIT == 1:
        if V_SPLIT == 2:  # the second half
            q_nope_b = q_nope_b.to(DOT_DTYPE)
    q_rope = q_rope.to(DOT_DTYPE)
    kv_scale = 1.0
    if KV_SCALED:
        kv_scale = tl.load(KV_SCALE)
        score_scale = score_scale * kv_scale

    m_i = tl.full([H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([H], dtype=tl.float32)
    acc = tl.zeros([H, D_NOPE // V_SPLIT], dtype=tl.float32)
    kv_seq = KV + seq_start.to(tl.int64) * D_QK  # total_kv * 576 may pass 2**31
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        tok = kv_seq + offs_n[:, None] * D_QK
        if QK_SPLIT > 1:
            kv_c = tl.load(kv_seq + offs_n[None, None, :] * D_QK + tl.permute(offs_c, (0, 2, 1)),
                           mask=valid[None, None, :], other=0.0).to(DOT_DTYPE)
            scores = tl.sum(tl.dot(q_nope, kv_c), axis=0)
            kv_nope = tl.load(tok + offs_o[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        elif V_SPLIT == 1:
            # One load of the latent: keys for the scores and values for the output.
            kv_nope = tl.load(tok + offs_d[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        else:
            kv_a = tl.load(tok + offs_v[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
            kv_b = tl.load(tok + D_NOPE // 2 + offs_v[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        kv_rope = tl.load(tok + D_NOPE + offs_r[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        if QK_SPLIT > 1:
            scores = tl.dot(q_rope, tl.trans(kv_rope), acc=scores)
        elif V_SPLIT == 1:
            scores = tl.dot(q_nope, tl.trans(kv_nope))
            scores = tl.dot(q_rope, tl.trans(kv_rope), acc=scores)
        else:
            scores = tl.dot(q_nope, tl.trans(kv_a))
            scores = tl.dot(q_nope_b, tl.trans(kv_b), acc=scores)
            scores = tl.dot(q_rope, tl.trans(kv_rope), acc=scores)
            # this program's value columns (a branch: one of the halves is used)
            if half == 0:
                kv_nope = kv_a
            else:
                kv_nope = kv_b
        scores = tl.where(valid[None, :], scores * score_scale, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv_nope)
        m_i = m_new

    # An empty split (more splits than blocks) has l_i == 0: write zeros and lse = -inf.
    has_tokens = l_i > 0.0
    out = acc * (kv_scale / tl.where(has_tokens, l_i, 1.0))[:, None]
    if NUM_SPLITS == 1:
        o_ptr = Out + pid_b.to(tl.int64) * H * D_NOPE + offs_h[:, None] * D_NOPE + offs_o[None, :]
        tl.store(o_ptr, out.to(tl.bfloat16))
    else:
        row = (pid_b.to(tl.int64) * NUM_SPLITS + pid_s) * H + offs_h
        tl.store(PartOut + row[:, None] * D_NOPE + offs_o[None, :], out)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        if V_SPLIT == 1:
            tl.store(PartLse + row, lse)
        else:  # both halves hold the same lse: the first writes it
            tl.store(PartLse + row, lse, mask=(offs_h * 0 + half) == 0)


@triton.jit
def _fd_stage2_kernel(
    PartOut, PartLse, Out,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    smask = offs_s < NUM_SPLITS
    row = (pid_b * NUM_SPLITS + offs_s) * H + pid_h
    lse = tl.load(PartLse + row, mask=smask, other=float("-inf"))
    # Split 0 always holds tokens (kv_len >= 1), so the max is finite and empty splits
    # (lse = -inf) get weight exp2(-inf) = 0.
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    parts = tl.load(PartOut + row[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(Out + (pid_b * H + pid_h) * D + offs_d, out.to(tl.bfloat16))


@dataclass
class FlashDecodeWorkspace:
    """Scratch for `flash_decode`, sized for `batch` sequences and `num_splits` splits:
    per-split partial outputs (fp32) and log2-sum-exps, and the q amax partials."""

    batch: int
    num_splits: int
    part_out: torch.Tensor
    part_lse: torch.Tensor
    q_amax: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, num_splits: int, device) -> FlashDecodeWorkspace:
        splits = num_splits if num_splits > 1 else 0  # one split writes the output directly
        return cls(
            batch,
            num_splits,
            torch.empty((batch, splits, NUM_HEADS, V_DIM), dtype=torch.float32, device=device),
            torch.empty((batch, max(splits, 1), NUM_HEADS), dtype=torch.float32, device=device),
            torch.empty((batch,), dtype=torch.float32, device=device),
        )

    def fits(self, batch: int, num_splits: int) -> bool:
        return self.batch >= batch and self.num_splits == num_splits


def fp8_min_exponent(dtype: torch.dtype) -> int:
    """Exponent of the smallest normal of the e4m3 flavour q is quantized to."""
    if dtype == torch.float8_e4m3fn:
        return -6
    if dtype == torch.float8_e4m3fnuz:  # bias 8 instead of 7
        return -7
    raise ValueError(f"q fp8 dtype must be float8_e4m3fn or float8_e4m3fnuz, got {dtype}")


def q_amax_partials(q: torch.Tensor, partial: torch.Tensor, record: list | None = None):
    """partial[r] = max |q[r]| for each row r of q (a contiguous (rows, heads, 576) bf16
    tensor), one launch (the first of an fp8_dynamic q scale; the quantizing kernel reduces
    the partials). record: as flash_decode_serving's."""
    return jit_launch(_fd_q_amax_kernel, (q.shape[0],), record, q, partial, ROW=q.shape[1] * q.shape[2],
                      BLOCK=1024, num_warps=4)


def flash_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
    *,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    dot_dtype: str,
    q_mode: str = "bf16",
    q_scale: float | None = None,
    q_fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    workspace: FlashDecodeWorkspace | None = None,
    hip_options: dict | None = None,
    sm_scale: float = SM_SCALE,
    v_split: int = 1,
    qk_split: int = 1,
) -> torch.Tensor:
    """MLA decode attention over a bf16 or fp8 latent KV cache; writes and returns `out`.

    q: (batch, 16, 576) bf16, contiguous. kv: (total_kv, 1, 576) (or (total_kv, 576)),
    bf16 or 1-byte fp8; kv_scale: (1,) fp32 dequant scale for fp8 KV, None for bf16.
    kv_indptr: (batch + 1,) int32 on the device (ragged lengths >= 1 are fine; only the
    device reads it). out: (batch, 16, 512) bf16, contiguous.
    num_splits: splits per sequence (1 = single launch); block_n: tokens per tile (>= 16,
    power of two); dot_dtype: "fp16" | "bf16", the tl.dot operand type (fp32 accumulate).
    q_mode: "bf16" | "fp8_dynamic" (per-tensor amax on the device, every call) |
    "fp8_static" (needs q_scale = q_amax / fp8_max); q_fp8_dtype: the fp8 format q is
    quantized to (`mla_tune.core.fp8_dtype_for(device)`).
    workspace: from FlashDecodeWorkspace.allocate(batch, num_splits, device); without it
    one is allocated per call. hip_options: waves_per_eu, matrix_instr_nonkdim, kpack,
    passed to the stage-1 launch (ROCm only). v_split (1 | 2) and qk_split (1 | 2 | 4 | 8)
    trade work for registers (stage 1's comment): two programs per split that each
    multiply half of the value columns; the score dot in chunks shared by the warps.
    Nothing here syncs with the device.
    """
    batch = q.shape[0]
    if q.dim() != 3 or tuple(q.shape[1:]) != (NUM_HEADS, QK_DIM) or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bf16 (batch, {NUM_HEADS}, {QK_DIM}), got {q.dtype} {tuple(q.shape)}")
    if kv.shape[-1] != QK_DIM or not kv.is_contiguous():
        raise ValueError(f"kv must be contiguous (total_kv, 1, {QK_DIM}), got {tuple(kv.shape)}")
    kv_scaled = kv.dtype != torch.bfloat16
    if kv_scaled and (kv.element_size() != 1 or kv_scale is None):
        raise ValueError(f"kv must be bf16, or fp8 with a (1,) fp32 kv_scale; got {kv.dtype}, scale {kv_scale}")
    if tuple(out.shape) != (batch, NUM_HEADS, V_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 ({batch}, {NUM_HEADS}, {V_DIM}) tensor, got {tuple(out.shape)}")
    if kv_indptr.shape != (batch + 1,) or kv_indptr.dtype != torch.int32:
        raise ValueError(f"kv_indptr must be int32 of shape ({batch + 1},), got {kv_indptr.dtype} {tuple(kv_indptr.shape)}")
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"need num_splits >= 1 and block_n a power of two >= 16; got {num_splits}, {block_n}")
    if v_split not in (1, 2):
        raise ValueError(f"v_split must be 1 or 2 (stage-1 programs per split), got {v_split!r}")
    if qk_split not in _fd_QK_SPLITS:
        raise ValueError(f"qk_split must be one of {', '.join(map(str, _fd_QK_SPLITS))} (chunks of the "
                         f"score dot), got {qk_split!r}")
    if dot_dtype not in _fd_DOT_DTYPES:
        raise ValueError(f"dot_dtype must be one of {', '.join(_fd_DOT_DTYPES)}, got {dot_dtype!r}")
    if q_mode not in _fd_Q_MODES:
        raise ValueError(f"q_mode must be one of {', '.join(_fd_Q_MODES)}, got {q_mode!r}")
    if q_mode == "fp8_static" and not (q_scale is not None and q_scale > 0):
        raise ValueError("q_mode fp8_static needs q_scale = q_amax / fp8_max > 0")
    if workspace is None:
        workspace = FlashDecodeWorkspace.allocate(batch, num_splits, q.device)
    elif not workspace.fits(batch, num_splits):
        raise ValueError(
            f"workspace is for batch {workspace.batch} x {workspace.num_splits} splits, not "
            f"{batch} x {num_splits}; allocate one with FlashDecodeWorkspace.allocate"
        )
    extra = {k: v for k, v in (hip_options or {}).items() if v is not None}
    unknown = set(extra) - set(_fd_HIP_OPTIONS)
    if unknown:
        raise ValueError(f"unknown hip_options {sorted(unknown)}; known: {', '.join(_fd_HIP_OPTIONS)}")

    fp8_min_exp = fp8_min_exponent(q_fp8_dtype)
    if q_mode == "fp8_dynamic":
        _fd_q_amax_kernel[(batch,)](q, workspace.q_amax, ROW=NUM_HEADS * QK_DIM, BLOCK=1024, num_warps=4)
    _fd_stage1_kernel[(batch, num_splits * v_split)](
        q, kv, kv_scale if kv_scaled else workspace.q_amax, kv_indptr, workspace.q_amax, batch,
        float(q_scale or 1.0), float(torch.finfo(q_fp8_dtype).max), float(sm_scale * _fd_LOG2E),
        out, workspace.part_out, workspace.part_lse,
        NUM_SPLITS=num_splits, BLOCK_N=block_n, DOT_DTYPE=_fd_DOT_DTYPES[dot_dtype],
        Q_MODE=_fd_Q_MODES[q_mode], FP8_MIN_EXP=fp8_min_exp, KV_SCALED=kv_scaled, AMAX_CHUNK=_fd_AMAX_CHUNK,
        H=NUM_HEADS, D_NOPE=KV_LORA_RANK, D_ROPE=QK_ROPE_DIM, D_QK=QK_DIM, V_SPLIT=v_split, QK_SPLIT=qk_split,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    if num_splits > 1:
        _fd_stage2_kernel[(batch, NUM_HEADS)](
            workspace.part_out, workspace.part_lse, out,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            H=NUM_HEADS, D=V_DIM, num_warps=4,
        )
    return out


def flash_decode_num_splits(batch: int, kv_len: int, sm_count: int, block_n: int) -> int:
    """A split count that fills about one wave of `sm_count` SMs without splits shorter
    than a tile: a power of two up to 32 (the heuristic the fallback variant uses)."""
    want = max(1, math.ceil(sm_count / max(batch, 1)))
    splits = min(triton.next_power_of_2(want), 32, max(1, kv_len // block_n))
    return max(1, splits)


# ------------------------------------------------------------------------------------------
# The serving call: paged or contiguous KV, any head count, q_len >= 1, splits chosen per
# sequence on the device. A sequence's q_len new tokens and a tile of BLOCK_H heads share
# one program, packed as q_len x BLOCK_H rows of the MMA (row = token * BLOCK_H + head), so
# the new tokens read the sequence's KV once. The batch's splits are a budget of
# MAX_SPLITS per sequence (per new token / next_pow2(max_q_len), so scratch stays bounded
# by the new tokens), shared by the sequences in proportion to their lengths, each at
# least one split and at most one per tokens_per_split. A uniform batch splits as a
# per-sequence cap would (MAX_SPLITS each); one long sequence among short ones borrows
# their share and spreads over the SMs. A batch budget (split_budget > 0, a runtime
# argument) sets the whole batch's splits instead, shared rounding up: a uniform batch
# then splits by its size, not its length, so its time does not step inside a kv bucket
# (the host raises that share where it would leave the SMs' waves under-filled: fill_splits).
# Every stage-1 program computes that schedule from the lengths on the device and finds
# its (sequence, split); the grid is sized for the most splits the rule can make, programs
# past the batch's count exit, and stage 2 reads the counts and offsets stage 1 wrote:
# nothing is read on the host, so the call can be captured in a CUDA graph and replayed
# with new lengths and block tables.


@triton.jit
def _fd_seq_len(KV_INDPTR, SEQ_LENS, idx, mask, PAGE_SIZE: tl.constexpr):
    """The KV lengths of sequences idx (0 where masked). The other layout's pointer is a
    float stand-in: both branches are typed, so each ends in int32."""
    if PAGE_SIZE == 0:
        lens = (tl.load(KV_INDPTR + idx + 1, mask=mask, other=0)
                - tl.load(KV_INDPTR + idx, mask=mask, other=0)).to(tl.int32)
    else:
        lens = tl.load(SEQ_LENS + idx, mask=mask, other=0).to(tl.int32)
    return lens


@triton.jit
def _fd_split_len(seq_len, total, budget, share_round, tokens_per_split, BLOCK_N: tl.constexpr,
                  MAX_SPLITS: tl.constexpr):
    """The split length of sequences of seq_len tokens in a batch of `total` tokens with
    `budget` splits: floor(seq_len * budget / total + share_round) splits (share_round 0.5:
    the nearest; 1 - 2e-4 under a batch budget: rounding up, so no split is longer than
    total / budget; at most budget + batch in all), at least 1 and at most
    cdiv(seq_len, tokens_per_split), each whole tiles; with MAX_SPLITS 1 one split (there
    is no scratch for partials). Splits: cdiv(seq_len, split_len)."""
    share = (seq_len.to(tl.float32) * budget.to(tl.float32)) / tl.maximum(total, 1).to(tl.float32)
    # 1e-4: a uniform batch's share is budget / batch exactly, whatever float32 rounds
    want = tl.minimum(tl.floor(share + share_round + 1e-4).to(tl.int32), tl.cdiv(seq_len, tokens_per_split))
    want = tl.maximum(want, 1)
    if MAX_SPLITS == 1:
        want = tl.minimum(want, 1)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, want), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _fd_split_counts(KV_INDPTR, SEQ_LENS, idx, batch, total, budget, share_round, tokens_per_split,
                     PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """The split counts of sequences idx (0 past the batch and for a sequence of 0 tokens,
    a padded graph slot): what stage 1's schedule and stage 2's reduction go by."""
    lens = _fd_seq_len(KV_INDPTR, SEQ_LENS, idx, idx < batch, PAGE_SIZE)
    return tl.where(lens > 0, tl.cdiv(lens, _fd_split_len(lens, total, budget, share_round, tokens_per_split, BLOCK_N,
                                                          MAX_SPLITS)), 0)


@triton.jit(do_not_specialize=["batch", "total_q", "tokens_per_split", "split_budget", "bt_stride"])
def _fd_serving_stage1_kernel(
    Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
    batch, total_q, tokens_per_split, split_budget, bt_stride, q_static_scale, fp8_max, qk_scale,
    Out, PartOut, PartLse, SplitCount, SplitOff, Lse,
    H: tl.constexpr, BLOCK_H: tl.constexpr, Q_LEN_MAX: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    Q_MODE: tl.constexpr, FP8_MIN_EXP: tl.constexpr, KV_SCALED: tl.constexpr, KV_OFF64: tl.constexpr,
    AMAX_CHUNK: tl.constexpr, SCHED_CHUNK: tl.constexpr, D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr, D_QK: tl.constexpr, ITEM_LOOP: tl.constexpr, WITH_LSE: tl.constexpr = False,
):
    # WITH_LSE: Lse (total_q, H) float32 receives each (new token, head)'s log-sum-exp in
    # natural log, from here for a one-split sequence, else from stage 2. Without it Lse is
    # None (a constexpr): the kernel's signature and code are those without the option.
    # Head tiles of one (sequence, split) are neighbours in launch order: they read the
    # same KV tiles at about the same time, so all but the first find them in L2.
    pid_h = tl.program_id(0)
    prog = tl.program_id(1)
    progs = tl.num_programs(1)
    # The schedule, from the lengths (a few KiB, read from L2): the batch's total, then
    # for each of the program's items (the batch's item-th split, counted over the
    # sequences in order; items prog, prog + progs, ...) the sequence it falls in (how
    # many sequences end at or before it) and where that sequence's splits start.
    # MAX_SPLITS per sequence when every sequence brings next_pow2(max_q_len) new tokens.
    budget = tl.maximum((tl.load(QO_INDPTR + batch) * MAX_SPLITS) // Q_LEN_MAX, 1)
    # A batch budget (split_budget > 0, batch x s from the host's fill_splits): that many
    # splits for the whole batch (a wave or a few of the SMs), shared by length rounding up,
    # so a uniform batch runs s splits each whatever its length and no sequence of a ragged
    # batch runs splits longer than the batch's mean. Rounding down gave a 28-sequence mix of
    # 771 to 63472 tokens (budget 112) splits of up to 8896 tokens against a mean of 5271,
    # and it ran 48% behind the best candidate on the H200; rounding up: at most 5248.
    share_round = 0.5
    if split_budget > 0:
        budget = tl.minimum(budget, tl.maximum(split_budget, batch))
        share_round = 1.0 - 2e-4
    if prog >= budget + batch:  # past any schedule (a graph's grid sized for padding)
        return
    total = 0
    for c0 in range(0, batch, SCHED_CHUNK):
        idx = c0 + tl.arange(0, SCHED_CHUNK)
        total += tl.sum(_fd_seq_len(KV_INDPTR, SEQ_LENS, idx, idx < batch, PAGE_SIZE), axis=0)
    # A sequence takes at most cdiv(seq_len, tokens_per_split) splits: the batch's items
    # are at most this many (the grid may hold fewer programs, each then runs several).
    n_items = tl.minimum(budget, total // tokens_per_split) + batch
    if (pid_h == 0) & (prog == 0):
        # Each sequence's split count and first item, for stage 2.
        done = 0
        for c0 in range(0, batch, SCHED_CHUNK):
            idx = c0 + tl.arange(0, SCHED_CHUNK)
            counts = _fd_split_counts(KV_INDPTR, SEQ_LENS, idx, batch, total, budget, share_round,
                                      tokens_per_split, PAGE_SIZE, BLOCK_N, MAX_SPLITS)
            ends = done + tl.cumsum(counts, axis=0)
            tl.store(SplitCount + idx, counts, mask=idx < batch)
            tl.store(SplitOff + idx, ends - counts, mask=idx < batch)
            done += tl.sum(counts, axis=0)
    # ITEM_LOOP (the grid capped below the items): each program runs its items in turn. A
    # loop around the attention costs registers (about 7% at 64 rows on the H200), so a
    # grid of one program per item stays without it.
    if ITEM_LOOP:
        for item in range(prog, n_items, progs):
            _fd_serving_item(
                Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
                batch, total_q, tokens_per_split, bt_stride, q_static_scale, fp8_max, qk_scale,
                Out, PartOut, PartLse, Lse, pid_h, item, total, budget, share_round,
                H, BLOCK_H, Q_LEN_MAX, MAX_SPLITS, BLOCK_N, PAGE_SIZE, DOT_DTYPE, Q_MODE,
                FP8_MIN_EXP, KV_SCALED, KV_OFF64, AMAX_CHUNK, SCHED_CHUNK, D_NOPE, D_ROPE, D_QK, WITH_LSE,
            )
    else:
        if prog < n_items:
            _fd_serving_item(
                Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
                batch, total_q, tokens_per_split, bt_stride, q_static_scale, fp8_max, qk_scale,
                Out, PartOut, PartLse, Lse, pid_h, prog, total, budget, share_round,
                H, BLOCK_H, Q_LEN_MAX, MAX_SPLITS, BLOCK_N, PAGE_SIZE, DOT_DTYPE, Q_MODE,
                FP8_MIN_EXP, KV_SCALED, KV_OFF64, AMAX_CHUNK, SCHED_CHUNK, D_NOPE, D_ROPE, D_QK, WITH_LSE,
            )


@triton.jit
def _fd_serving_item(
    Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
    batch, total_q, tokens_per_split, bt_stride, q_static_scale, fp8_max, qk_scale,
    Out, PartOut, PartLse, Lse, pid_h, item, total, budget, share_round,
    H: tl.constexpr, BLOCK_H: tl.constexpr, Q_LEN_MAX: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    Q_MODE: tl.constexpr, FP8_MIN_EXP: tl.constexpr, KV_SCALED: tl.constexpr, KV_OFF64: tl.constexpr,
    AMAX_CHUNK: tl.constexpr, SCHED_CHUNK: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr,
    D_QK: tl.constexpr, WITH_LSE: tl.constexpr,
):
    """The batch's item-th split: the sequence it falls in (how many sequences end at or
    before it) and where that sequence's splits start, then its attention; nothing past
    the batch's last split."""
    pid_b = 0
    first = 0  # the first item of sequence pid_b
    done = 0  # items of the sequences before the chunk
    for c0 in range(0, batch, SCHED_CHUNK):
        idx = c0 + tl.arange(0, SCHED_CHUNK)
        counts = _fd_split_counts(KV_INDPTR, SEQ_LENS, idx, batch, total, budget, share_round,
                                  tokens_per_split, PAGE_SIZE, BLOCK_N, MAX_SPLITS)
        before = done + tl.cumsum(counts, axis=0) <= item
        pid_b += tl.sum(before.to(tl.int32), axis=0)
        first += tl.sum(tl.where(before, counts, 0), axis=0)
        done += tl.sum(counts, axis=0)
    if pid_b < batch:
        _fd_serving_split(
            Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
            total_q, tokens_per_split, bt_stride, q_static_scale, fp8_max, qk_scale,
            Out, PartOut, PartLse, Lse, pid_h, item, pid_b, item - first, total, budget, share_round, batch,
            H, BLOCK_H, Q_LEN_MAX, MAX_SPLITS, BLOCK_N, PAGE_SIZE, DOT_DTYPE, Q_MODE,
            FP8_MIN_EXP, KV_SCALED, KV_OFF64, AMAX_CHUNK, D_NOPE, D_ROPE, D_QK, WITH_LSE,
        )


@triton.jit
def _fd_serving_split(
    Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, Q_AMAX,
    total_q, tokens_per_split, bt_stride, q_static_scale, fp8_max, qk_scale,
    Out, PartOut, PartLse, Lse, pid_h, item, pid_b, pid_s, total, budget, share_round, batch,
    H: tl.constexpr, BLOCK_H: tl.constexpr, Q_LEN_MAX: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    Q_MODE: tl.constexpr, FP8_MIN_EXP: tl.constexpr, KV_SCALED: tl.constexpr, KV_OFF64: tl.constexpr,
    AMAX_CHUNK: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, D_QK: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """Split pid_s of sequence pid_b, the batch's item-th, for head tile pid_h: its
    output rows (one split; WITH_LSE, their natural-log LSE too) or its partials and
    log2-sum-exps (several)."""
    seq_len = _fd_seq_len(KV_INDPTR, SEQ_LENS, pid_b, pid_b < batch, PAGE_SIZE)
    split_len = _fd_split_len(seq_len, total, budget, share_round, tokens_per_split, BLOCK_N, MAX_SPLITS)
    num_splits = tl.cdiv(seq_len, split_len)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    ROWS: tl.constexpr = BLOCK_H * Q_LEN_MAX
    offs_row = tl.arange(0, ROWS)
    q_idx = offs_row // BLOCK_H  # which of the sequence's new tokens the row belongs to
    q_start = tl.load(QO_INDPTR + pid_b)
    q_len = tl.load(QO_INDPTR + pid_b + 1) - q_start
    # Row r is head pid_h * BLOCK_H + r % BLOCK_H of new token q_start + q_idx: one int64
    # base per program and small int32 offsets per row (as cheap as the 16-head kernel).
    row_off = q_idx * H + offs_row % BLOCK_H
    first_row = q_start.to(tl.int64) * H + pid_h * BLOCK_H
    # q_len is at least 1, so with one row per head every row is a real new token.
    row_ok = (q_idx < q_len) | (Q_LEN_MAX == 1)
    # New token i of q_len sees the first seq_len - (q_len - 1 - i) tokens: the cache
    # already holds the new tokens, each attends to itself and those before it.
    limit = seq_len - q_len + 1 + q_idx
    offs_d = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    q_row = Q + first_row * D_QK + row_off[:, None] * D_QK
    q_nope = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    score_scale = qk_scale
    if Q_MODE == 1:
        q_nope = quantize_q_e4m3(q_nope, q_static_scale, fp8_max, FP8_MIN_EXP, False)
        q_rope = quantize_q_e4m3(q_rope, q_static_scale, fp8_max, FP8_MIN_EXP, False)
        score_scale = score_scale * q_static_scale
    elif Q_MODE == 2:
        amax_acc = tl.zeros([AMAX_CHUNK], dtype=tl.float32)
        for i in range(0, total_q, AMAX_CHUNK):
            offs_a = i + tl.arange(0, AMAX_CHUNK)
            amax_acc = tl.maximum(amax_acc, tl.load(Q_AMAX + offs_a, mask=offs_a < total_q, other=0.0))
        amax = tl.maximum(tl.max(amax_acc, axis=0), 1e-12)
        q_scale = round_to_mantissa(amax / fp8_max, 7, -119)
        q_nope = quantize_q_e4m3(q_nope, q_scale, fp8_max, FP8_MIN_EXP, True)
        q_rope = quantize_q_e4m3(q_rope, q_scale, fp8_max, FP8_MIN_EXP, True)
        score_scale = score_scale * q_scale
    q_nope = q_nope.to(DOT_DTYPE)
    q_rope = q_rope.to(DOT_DTYPE)
    kv_scale = 1.0
    if KV_SCALED:
        kv_scale = tl.load(KV_SCALE)
        score_scale = score_scale * kv_scale

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_NOPE], dtype=tl.float32)
    if PAGE_SIZE == 0:
        kv_seq = KV + tl.load(KV_INDPTR + pid_b).to(tl.int64) * D_QK
    bt_row = BLOCK_TABLE + pid_b.to(tl.int64) * bt_stride
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        if PAGE_SIZE == 0:
            tok = kv_seq + offs_n[:, None] * D_QK
        elif PAGE_SIZE >= BLOCK_N:
            # Tiles are BLOCK_N-aligned, so one page holds the tile: one int64 base and
            # int32 offsets, the contiguous layout's addressing.
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            tile = KV + (page * PAGE_SIZE + n0 % PAGE_SIZE) * D_QK
            tok = tile + tl.arange(0, BLOCK_N)[:, None] * D_QK
        else:
            # A gather per token; int64 offsets (more registers) only for a cache of
            # 2**31 elements or more.
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=valid, other=0)
            if KV_OFF64:
                page = page.to(tl.int64)
            tok = KV + (page * PAGE_SIZE + offs_n % PAGE_SIZE)[:, None] * D_QK
        kv_nope = tl.load(tok + offs_d[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        kv_rope = tl.load(tok + D_NOPE + offs_r[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q_nope, tl.trans(kv_nope))
        scores = tl.dot(q_rope, tl.trans(kv_rope), acc=scores)
        if Q_LEN_MAX == 1:
            scores = tl.where(valid[None, :], scores * score_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the tile has a token
            m_ref = m_new
        else:
            seen = valid[None, :] & (offs_n[None, :] < limit[:, None])
            scores = tl.where(seen, scores * score_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row may see none of a tile's tokens (the causal mask): keep its exp2 finite.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv_nope)
        m_i = m_new

    # Every row sees token 0 and each split is non-empty, yet a row may see none of a
    # late split's tokens (the causal mask): l_i == 0 there, written as zeros, lse -inf.
    has_tokens = l_i > 0.0
    out = acc * (kv_scale / tl.where(has_tokens, l_i, 1.0))[:, None]
    if num_splits == 1:
        o_ptr = Out + first_row * D_NOPE + row_off[:, None] * D_NOPE + offs_d[None, :]
        tl.store(o_ptr, out.to(tl.bfloat16), mask=row_ok[:, None])
        if WITH_LSE:  # one split holds token 0, which every row sees: l_i > 0; log2 -> natural log
            tl.store(Lse + first_row + row_off, (m_i + tl.log2(tl.where(has_tokens, l_i, 1.0))) * 0.6931471805599453,
                     mask=row_ok)
    else:
        # Partials are (item, new token, head) rows: the item's Q_LEN_MAX x H of them.
        part_row = (tl.cast(item, tl.int64) * Q_LEN_MAX) * H + pid_h * BLOCK_H
        part_off = q_idx * H + offs_row % BLOCK_H
        tl.store(PartOut + part_row * D_NOPE + part_off[:, None] * D_NOPE + offs_d[None, :], out,
                 mask=row_ok[:, None])
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + part_row + part_off, lse, mask=row_ok)


@triton.jit
def _fd_serving_stage2_kernel(
    QO_INDPTR, SplitCount, SplitOff, PartOut, PartLse, Out, Lse,
    H: tl.constexpr, Q_LEN_MAX: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
    D_SLICE: tl.constexpr, WITH_LSE: tl.constexpr = False,
):
    # WITH_LSE: the slice at d0 0 also writes the merged log-sum-exp, natural log, to Lse
    # (None without it, a constexpr: the code without the option).
    # One program per (sequence, new token, head, slice of D): with slices, a long
    # sequence's hundreds of splits are a short loop of wide chunks.
    pid_b = tl.program_id(0)
    q_idx = tl.program_id(1)
    pid_h = tl.program_id(2) // (D // D_SLICE)
    d0 = (tl.program_id(2) % (D // D_SLICE)) * D_SLICE
    q_start = tl.load(QO_INDPTR + pid_b)
    num_splits = tl.load(SplitCount + pid_b)
    # Past the sequence's new tokens, one split (stage 1 wrote the output) or an empty
    # sequence: nothing to do.
    if (q_idx >= tl.load(QO_INDPTR + pid_b + 1) - q_start) | (num_splits <= 1):
        return
    first = tl.load(SplitOff + pid_b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d0 + tl.arange(0, D_SLICE)
    # An online softmax over chunks of BLOCK_S splits.
    # Split 0 holds token 0, which every new token sees: the first chunk's max is finite.
    m = float("-inf")
    wsum = 0.0
    acc = tl.zeros([D_SLICE], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        smask = s0 + offs_s < num_splits
        row = ((first + s0 + offs_s).to(tl.int64) * Q_LEN_MAX + q_idx) * H + pid_h
        lse = tl.load(PartLse + row, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        parts = tl.load(PartOut + row[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * weight[:, None], axis=0)
        wsum = wsum * alpha + tl.sum(weight, axis=0)
        m = m_new
    q_tok = (q_start + q_idx).to(tl.int64)
    tl.store(Out + (q_tok * H + pid_h) * D + offs_d, (acc / wsum).to(tl.bfloat16))
    if WITH_LSE:
        if d0 == 0:  # the splits' LSEs are log2 units of the scores: m + log2(sum), times ln 2
            tl.store(Lse + q_tok * H + pid_h, (m + tl.log2(wsum)) * 0.6931471805599453)


@dataclass
class FlashDecodeServingWorkspace:
    """Scratch for `flash_decode_serving`, sized from the caller's maxima (never from the
    data): partial outputs and log2-sum-exps per (split item, new token, head) for the most
    split items a call of at most max_total_q new tokens is launched for
    (split_rule.most_items: max_splits x new tokens / next_pow2(max_q_len), plus one per
    sequence; with a batch budget, what its split_budget, block_h and sm_count launch, far
    fewer), next_pow2(max_q_len) tokens each; q amax partials; each sequence's split count
    and first item."""

    max_total_q: int
    heads: int
    max_splits: int
    q_len_max: int
    part_out: torch.Tensor
    part_lse: torch.Tensor
    q_amax: torch.Tensor
    split_count: torch.Tensor
    split_off: torch.Tensor
    max_items: int = 0  # the most split items its partials hold (0: max_splits 1, none)

    # written before they are read in every call: a plan's runners may share them (SharedScratch)
    SHARED = ("part_out", "part_lse")

    @classmethod
    def allocate(cls, max_total_q: int, heads: int, max_splits: int, device, max_q_len: int = 1, *,
                 split_budget: int = 0, block_h: int = 0, sm_count: int = 0) -> FlashDecodeServingWorkspace:
        """Scratch for calls of at most max_total_q new tokens; with split_budget > 0 and the
        launch's block_h and sm_count (its SMs, as the launch resolves them), only for calls
        with that batch budget (flash_decode_serving refuses a call of more items)."""
        q_len_max = triton.next_power_of_2(max(max_q_len, 1))
        # One split writes the output directly: no partials.
        items = 0
        if max_splits > 1:
            items = most_items(max_total_q, max_splits, q_len_max, split_budget if block_h else 0,
                               max(heads // block_h, 1) if block_h else 1, sm_count)
        slots = q_len_max * items
        return cls(
            max_total_q,
            heads,
            max_splits,
            q_len_max,
            torch.empty((slots, heads, V_DIM), dtype=torch.float32, device=device),
            torch.empty((max(slots, 1), heads), dtype=torch.float32, device=device),
            torch.empty((max_total_q,), dtype=torch.float32, device=device),
            torch.empty((max_total_q,), dtype=torch.int32, device=device),
            torch.empty((max_total_q,), dtype=torch.int32, device=device),
            items,
        )

    def fits(self, total_q: int, heads: int, max_splits: int, max_q_len: int = 1) -> bool:
        return (self.max_total_q >= total_q and self.heads == heads and self.max_splits == max_splits
                and self.q_len_max >= max_q_len)


def flash_decode_serving(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    out: torch.Tensor,
    *,
    kv_indptr: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    max_q_len: int,
    max_splits: int,
    tokens_per_split: int,
    block_n: int,
    block_h: int,
    num_warps: int,
    num_stages: int,
    dot_dtype: str,
    split_budget: int = 0,
    sm_count: int | None = None,
    q_mode: str = "bf16",
    q_scale: float | None = None,
    q_fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    workspace: FlashDecodeServingWorkspace | None = None,
    hip_options: dict | None = None,
    sm_scale: float = SM_SCALE,
    record: list | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA decode attention for the serving call; writes and returns `out`.

    q: (total_q, heads, 576) bf16; qo_indptr: (batch + 1,) int32, sequence b's new tokens
    are q[qo_indptr[b]:qo_indptr[b + 1]] (1 <= q_len <= max_q_len), causal among
    themselves. KV (bf16, or 1-byte fp8 with a (1,) fp32 kv_scale), either contiguous:
    kv (total_kv, 1, 576) with kv_indptr (batch + 1,) int32; or paged: kv (num_pages,
    page_size, 576) with block_table (batch, max_pages) int32 and seq_lens (batch,) int32.
    A sequence's KV includes its new tokens (seq_len >= q_len; a seq_len of 0, a padded
    CUDA-graph slot, leaves its rows of out untouched). out: (total_q, heads, 512)
    bf16. The batch's splits are a budget of max_splits per sequence (max_splits x new
    tokens / next_pow2(max_q_len)), shared in proportion to the lengths: sequence b runs in
    about clamp(round(seq_len * budget / sum(seq_lens)), 1, cdiv(seq_len, tokens_per_split))
    splits of whole tiles, counted on the device (a uniform batch: min(max_splits,
    cdiv(seq_len, tokens_per_split)) each; max_splits 1: one split each, whatever the
    lengths). split_budget > 0 caps that budget for the whole batch at max(split_budget,
    batch) splits (per head tile), shared rounding up: a uniform batch then runs
    min(floor(split_budget / batch), max_splits, cdiv(seq_len, tokens_per_split)) splits
    each, so the grid stays about one wave of the SMs at any length (a per-sequence rule
    steps at every multiple of tokens_per_split: H200, 2026-12-01); where that share
    leaves the waves under-filled the batch runs more splits instead: the budget launched
    is batch x fill_splits(...) (on the host from the batch size, so a recorded launch or a
    graph keeps it; sm_count None: the device's SMs, 0: the plain share). Past
    _fd_ONE_ITEM_CTAS programs, _fd_GRID_CTAS that run several splits each.
    block_h: heads per program (divides heads; block_h *
    next_pow2(max_q_len) >= 16 rows for the MMA). Other options as `flash_decode`.
    q_mode "fp8_dynamic" takes its per-tensor amax over all of q, rows past
    qo_indptr[-1] (a graph's padding) included: keep those rows zero or in range.
    workspace: FlashDecodeServingWorkspace.allocate(max_total_q, heads, max_splits,
    max_q_len=max_q_len), with split_budget, block_h and sm_count as given here for scratch
    sized to the batch budget.
    Nothing here reads a device tensor or allocates once a workspace is given.
    record: a list to which each launch appends what replays it (kernels/launch.py); the
    launches are the same with and without it.
    lse: a contiguous (total_q, heads) float32 tensor that receives each (new token, head)'s
    log-sum-exp of its scaled scores, in natural log (the engines' convention), written by
    stage 1 for a one-split sequence and by stage 2 otherwise (the kernels' WITH_LSE); None:
    not computed, and the kernels are the ones compiled without it.
    """
    page_size = check_serving_launch(
        q, qo_indptr, kv, kv_scale, out, kv_indptr=kv_indptr, block_table=block_table,
        seq_lens=seq_lens, max_q_len=max_q_len, q_len_limit=16, block_h=block_h,
        max_splits=max_splits, tokens_per_split=tokens_per_split, block_n=block_n, lse=lse)
    batch = qo_indptr.shape[0] - 1
    total_q, heads = q.shape[0], q.shape[1]
    q_len_max = triton.next_power_of_2(max_q_len)  # rows of the MMA come in powers of two
    kv_scaled = kv.dtype != torch.bfloat16
    if dot_dtype not in _fd_DOT_DTYPES or q_mode not in _fd_Q_MODES:
        raise ValueError(f"dot_dtype must be one of {', '.join(_fd_DOT_DTYPES)} and q_mode one of "
                         f"{', '.join(_fd_Q_MODES)}; got {dot_dtype!r}, {q_mode!r}")
    if q_mode == "fp8_static" and not (q_scale is not None and q_scale > 0):
        raise ValueError("q_mode fp8_static needs q_scale = q_amax / fp8_max > 0")
    if isinstance(split_budget, bool) or not isinstance(split_budget, int) or not 0 <= split_budget < 2**31:
        raise ValueError(f"split_budget must be an integer >= 0 (0: max_splits per sequence), got {split_budget!r}")
    tiles = heads // block_h
    launched = split_budget  # the kernel's batch budget (with max_splits 1 none applies)
    if split_budget > 0 and max_splits > 1:  # the wave-filling share, as a budget of s per sequence
        sms = device_sm_count(q.device) if sm_count is None else sm_count
        launched = batch * fill_splits(split_budget, batch, tiles, max_splits, sms)
    # Items: at most the budget plus one per sequence (split_rule.launch_items). A program per
    # item, or past _fd_ONE_ITEM_CTAS programs _fd_GRID_CTAS of them that loop over the items.
    items = launch_items(batch, total_q, max_splits, q_len_max, launched)
    workspace = serving_workspace(workspace, FlashDecodeServingWorkspace, total_q, heads, max_splits, q.device,
                                  max_q_len=max_q_len)
    if max_splits > 1 and items > workspace.max_items:
        raise ValueError(f"workspace holds the partials of {workspace.max_items} split items; this call is "
                         f"launched for {items} (split_budget {split_budget}, block_h {block_h}): allocate it "
                         "with FlashDecodeServingWorkspace.allocate(..., split_budget=, block_h=, sm_count=) as "
                         "the launch takes them, or without a split_budget")
    extra = {k: v for k, v in (hip_options or {}).items() if v is not None}
    unknown = set(extra) - set(_fd_HIP_OPTIONS)
    if unknown:
        raise ValueError(f"unknown hip_options {sorted(unknown)}; known: {', '.join(_fd_HIP_OPTIONS)}")

    fp8_min_exp = fp8_min_exponent(q_fp8_dtype)
    if q_mode == "fp8_dynamic":
        q_amax_partials(q, workspace.q_amax, record)
    # Unused pointers get a harmless stand-in (never read under the other layout).
    dummy = workspace.q_amax
    seq_ptrs = (kv_indptr, dummy, dummy) if page_size == 0 else (dummy, block_table, seq_lens)
    bt_stride = block_table.stride(0) if page_size else 0
    item_loop = tiles * items > _fd_ONE_ITEM_CTAS
    programs = min(items, max(_fd_GRID_CTAS // tiles, 1)) if item_loop else items
    jit_launch(
        _fd_serving_stage1_kernel, (tiles, programs), record,
        q, qo_indptr, kv, kv_scale if kv_scaled else dummy, *seq_ptrs, workspace.q_amax,
        batch, total_q, tokens_per_split, launched, bt_stride,
        float(q_scale or 1.0), float(torch.finfo(q_fp8_dtype).max), float(sm_scale * _fd_LOG2E),
        out, workspace.part_out, workspace.part_lse, workspace.split_count, workspace.split_off, lse,
        H=heads, BLOCK_H=block_h, Q_LEN_MAX=q_len_max, MAX_SPLITS=max_splits, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DOT_DTYPE=_fd_DOT_DTYPES[dot_dtype], Q_MODE=_fd_Q_MODES[q_mode],
        FP8_MIN_EXP=fp8_min_exp, KV_SCALED=kv_scaled, KV_OFF64=kv.numel() >= 2**31,
        AMAX_CHUNK=_fd_AMAX_CHUNK, SCHED_CHUNK=_fd_SCHED_CHUNK, D_NOPE=KV_LORA_RANK,
        D_ROPE=QK_ROPE_DIM, D_QK=QK_DIM, ITEM_LOOP=item_loop, WITH_LSE=lse is not None,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    if max_splits > 1:
        per_step = reduce_splits_per_step(batch, max_q_len, heads)
        slices = per_step // REDUCE_SPLITS_PER_STEP[0]  # the wide grid: 4 programs per row, a quarter of D each
        jit_launch(
            _fd_serving_stage2_kernel, (batch, max_q_len, heads * slices), record,
            qo_indptr, workspace.split_count, workspace.split_off, workspace.part_out,
            workspace.part_lse, out, lse, H=heads, Q_LEN_MAX=q_len_max, BLOCK_S=per_step,
            D=V_DIM, D_SLICE=V_DIM // slices, WITH_LSE=lse is not None, num_warps=4,
        )
    return out
