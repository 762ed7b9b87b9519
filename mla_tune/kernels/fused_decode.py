"""One-launch MLA decode: split-K flash-decode whose splits reduce themselves.

Why this family exists (docs/perf.md has the numbers): at 16 heads the seed's design puts
the heads on the MMA's M dimension (M = 16: mma.sync only) and reads every KV tile twice
(once as K, once as V), with a second launch for the split reduction. Here:

- `TOK_M`: the tokens go on M. S^T = K_tile @ Q^T is [BLOCK_N, 16] and O^T += V^T @ P^T is
  [512, 16], so M is BLOCK_N (or 512) and Hopper's wgmma applies with N = 16. The heads-on-M
  orientation stays available (`TOK_M=False`) for comparison.
- The KV tile is loaded once; its first 512 columns serve as K and, transposed, as V.
- fp8 KV: per-tensor kv scale folded into the softmax scale and the output; q can be
  quantized in the kernel with a per-(sequence, head) amax (`Q_FP8`), which needs no second
  launch and no host sync, and then the QK dot runs fp8 x fp8.
- MXFP4 KV (block-32 E2M1 + E8M0, `KV_FMT=2`) is dequantized with integer bit operations
  straight into the dot dtype, split into even and odd dims (a byte's two nibbles), so
  nothing is interleaved: q is read as its even and odd dims and the output written back
  strided (see `_fu_mx_dequant`).
- KV tiles are read through pointers (`LOAD=0`) or TMA tensor descriptors over the whole
  cache, made on the device (`LOAD=1`, needs `triton.set_allocator`) or on the host
  (`LOAD=2`, `triton.tools.tensor_descriptor.TensorDescriptor`).
- One launch. Split grid (`_fu_decode_kernel`, num_splits x batch programs): each program
  writes a partial (O / l, lse); then either the last program of a sequence to arrive
  reduces all splits (`REDUCE=1`, an arrival counter it resets itself, so there is no memset
  per call) or every program of the sequence waits at a per-sequence barrier and reduces a
  slice of the 512 output dims (`REDUCE=2`; the runner allows it only when the whole grid
  fits on the GPU at once, which a spin-wait needs). `REDUCE=0` is num_splits = 1: the
  program writes the output itself.
- V split (`V_SPLIT=2`, the split grid with bf16 / fp8 KV): two programs per (split,
  sequence), side by side in the first grid dimension. Each reads the whole tile and
  computes S (the same code on the same data in both, so the softmax statistics and lse are
  bit-identical), but converts and multiplies only its 256 of the 512 V dims, which halves
  the V copy's registers; the second read of the tile is meant to hit in L2. Reductions run
  per (sequence, V half). `V_SPLIT=1` is the kernel as it was (the same code path).
- Persistent grid (`_fu_persistent_kernel`, a fixed number of programs): the tokens of all
  sequences are cut into equal contiguous ranges, one per program; a program walks its
  range sequence by sequence, writes the output of a sequence it holds whole, and
  otherwise a partial that the last of that sequence's programs to arrive reduces.
- The serving call (`fused_decode_serving`, `_fu_serving_kernel`, the call shape of
  flash_decode_serving): contiguous or paged KV, head tiles, q_len up to 4 packed with the
  heads on the MMA's N columns, splits per sequence counted on the device, last-arriving
  reduction; a separate kernel, so the leaderboard kernel's code and speed stay as they were.

Exportable module: private names start with `_fu_`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_tune.core import SM_SCALE, V_DIM
from mla_tune.kernels.launch import jit_launch
from mla_tune.kernels.serving_runner import check_serving_launch, serving_workspace

# Dot operand dtype codes (constexpr ints: they travel through every Triton version).
FU_DOT_CODES = {"fp16": 0, "bf16": 1, "fp8": 2}
# The dot code of "fp8" over a float8_e4m3fnuz cache (gfx942's fp8): the fp8 a dot casts to
# follows the KV's dtype, as the AMD backend cannot convert fnuz to OCP e4m3 (fu_dot_code).
FU_DOT_FP8_FNUZ = 3
FU_KV_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
FU_REDUCE_CODES = {"none": 0, "last": 1, "spin": 2}
FU_LOAD_CODES = {"ptr": 0, "tma": 1, "tma_host": 2}


@triton.jit
def _fu_cast(x, CODE: tl.constexpr):
    if CODE == 0:
        return x.to(tl.float16)
    elif CODE == 1:
        return x.to(tl.bfloat16)
    elif CODE == 2:
        return x.to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4b8)


@triton.jit
def _fu_fp8_max(CODE: tl.constexpr):
    """The largest finite value of the fp8 the dot code CODE casts to (e4m3 448, fnuz 240)."""
    if CODE == 3:
        return 240.0
    else:
        return 448.0


@triton.jit
def _fu_p_scale(CODE: tl.constexpr):
    """What an fp8 PV dot scales P (at most 1) by, into the fp8's normal range and below
    its largest value: 256 for e4m3 (max 448), 128 for fnuz (max 240)."""
    if CODE == 3:
        return 128.0
    else:
        return 256.0


def fu_dot_code(dot: str, kv: torch.Tensor) -> int:
    """The kernels' constexpr for dot dtype `dot` ("fp16" | "bf16" | "fp8") over cache `kv`:
    an fp8 dot casts to the cache's own fp8 (e4m3fn, or e4m3fnuz on gfx942)."""
    if dot == "fp8" and kv.dtype == torch.float8_e4m3fnuz:
        return FU_DOT_FP8_FNUZ
    return FU_DOT_CODES[dot]


@triton.jit
def _fu_mx_dequant(pk, sc, DT: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """MXFP4 tile to the dot dtype, split into even and odd dims (no interleave, no table).

    pk: [BN, NB, 16] packed bytes (int32, 0..255; even dim in the low nibble), sc: [BN, NB]
    E8M0 bytes. Returns (even, odd), each [BN, NB * 16]: dims 2j and 2j + 1 of the NB blocks.
    E2M1 code s|e1 e0|m goes to fp32 bits s<<31 | (e1 e0 m)<<22: the exponent field is e and
    the top mantissa bit m, which reads as E2M1 x 2^-126 (e = 0, m = 1 is the subnormal
    2^-127 = 0.5 x 2^-126). So value = bits x 2^126 x 2^(scale - 127), two exact multiplies;
    the power of two is built from the scale's bits (byte 0: the subnormal 2^-127).
    """
    f = tl.where(sc > 0, sc << 23, 1 << 22).to(tl.float32, bitcast=True)[:, :, None]
    lo = ((pk << 28) & -2147483648) | ((pk << 22) & 0x01C00000)
    hi = ((pk << 24) & -2147483648) | ((pk << 18) & 0x01C00000)
    ev = _fu_cast((lo.to(tl.float32, bitcast=True) * 8.507059173023462e37) * f, DT)
    od = _fu_cast((hi.to(tl.float32, bitcast=True) * 8.507059173023462e37) * f, DT)
    return tl.reshape(ev, (BN, W)), tl.reshape(od, (BN, W))


@triton.jit
def _fu_attend(
    Q, KV, desc_n, desc_r, b, lo, hi, kv_scale, sm_scale_log2,
    Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr, TOK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LOAD: tl.constexpr,
):
    """Online softmax of sequence b's 16 heads over tokens [lo, hi) of a bf16 / fp8 cache.

    Returns (acc [16, 512] = sum p v, unnormalized; m [16]; l [16]) in the log2 domain.
    LOAD 0 reads through pointers (rows past hi clamped to hi - 1); LOAD 1/2 through tensor
    descriptors over the whole [total_kv, 576] cache (TMA): rows past hi belong to the next
    sequence (or are zeros past total_kv) and are masked out of the softmax like the others.
    """
    heads = tl.arange(0, 16)
    dn = tl.arange(0, 512)
    dr = tl.arange(0, 64)
    rows = tl.arange(0, BLOCK_N)
    qn = tl.load(Q + (b * 16 + heads[:, None]) * 576 + dn[None, :]).to(tl.float32)
    qr = tl.load(Q + (b * 16 + heads[:, None]) * 576 + 512 + dr[None, :]).to(tl.float32)
    if Q_FP8:
        # Per-(sequence, head) dynamic scale: computed here, so no extra launch or sync.
        amax = tl.maximum(tl.max(tl.abs(qn), axis=1), tl.max(tl.abs(qr), axis=1))
        q_scale = tl.maximum(amax, 1e-12) / _fu_fp8_max(QK_DOT)
        qn = qn / q_scale[:, None]
        qr = qr / q_scale[:, None]
        col_scale = q_scale * (kv_scale * sm_scale_log2)
    else:
        col_scale = tl.full([16], 1.0, tl.float32) * (kv_scale * sm_scale_log2)
    qn = _fu_cast(qn, QK_DOT)
    qr = _fu_cast(qr, QK_DOT)

    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    if TOK_M:
        acc = tl.zeros([512, 16], tl.float32)
        qnt = tl.trans(qn)
        qrt = tl.trans(qr)
    else:
        acc = tl.zeros([16, 512], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + rows
        if LOAD == 0:
            # Clamped rows stay in bounds without a load mask (which would cost vector width).
            tok_c = tl.minimum(tok, hi - 1)
            kn_raw = tl.load(KV + tok_c[:, None] * 576 + dn[None, :])
            kr_raw = tl.load(KV + tok_c[:, None] * 576 + 512 + dr[None, :])
        else:
            kn_raw = desc_n.load([start, 0])
            kr_raw = desc_r.load([start, 512])
        kn = _fu_cast(kn_raw, QK_DOT)
        kr = _fu_cast(kr_raw, QK_DOT)
        if PV_DOT == QK_DOT:
            v = kn
        else:
            v = _fu_cast(kn_raw, PV_DOT)
        valid = tok < hi
        if TOK_M:
            s = tl.dot(kn, qnt) + tl.dot(kr, qrt)  # [BLOCK_N, 16]
            s = s * col_scale[None, :]
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if PV_DOT >= 2:  # fp8 (either flavour)
                p = p * _fu_p_scale(PV_DOT)  # into fp8's normal range; undone after the loop
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), _fu_cast(p, PV_DOT))
        else:
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))  # [16, BLOCK_N]
            s = s * col_scale[:, None]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_DOT >= 2:  # fp8 (either flavour)
                p = p * _fu_p_scale(PV_DOT)
            acc = acc * alpha[:, None] + tl.dot(_fu_cast(p, PV_DOT), v)
        m_i = m_new
    if TOK_M:
        acc = tl.trans(acc)  # [16, 512]
    if PV_DOT >= 2:  # fp8 (either flavour)
        acc = acc / _fu_p_scale(PV_DOT)
    return acc, m_i, l_i


@triton.jit
def _fu_attend_vh(
    Q, KV, desc_n, desc_r, b, lo, hi, half, kv_scale, sm_scale_log2,
    Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr, TOK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LOAD: tl.constexpr,
):
    """_fu_attend for V half `half` (0 or 1): the scores over all 576 dims (the nope part as
    two 256-column halves, always summed in the same order, so both halves get the same
    bits), the PV product over dims [256 * half, 256 * half + 256) only.

    Returns (acc [16, 256] = sum p v over this half's dims, unnormalized; m [16]; l [16]).
    LOAD 1/2 read the nope part through [BLOCK_N, 256] descriptors.
    """
    heads = tl.arange(0, 16)
    dh = tl.arange(0, 256)
    dr = tl.arange(0, 64)
    rows = tl.arange(0, BLOCK_N)
    q_row = Q + (b * 16 + heads[:, None]) * 576
    qa = tl.load(q_row + dh[None, :]).to(tl.float32)
    qb = tl.load(q_row + 256 + dh[None, :]).to(tl.float32)
    qr = tl.load(q_row + 512 + dr[None, :]).to(tl.float32)
    if Q_FP8:
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(qa), axis=1), tl.max(tl.abs(qb), axis=1)),
                          tl.max(tl.abs(qr), axis=1))
        q_scale = tl.maximum(amax, 1e-12) / _fu_fp8_max(QK_DOT)
        qa = qa / q_scale[:, None]
        qb = qb / q_scale[:, None]
        qr = qr / q_scale[:, None]
        col_scale = q_scale * (kv_scale * sm_scale_log2)
    else:
        col_scale = tl.full([16], 1.0, tl.float32) * (kv_scale * sm_scale_log2)
    qa = _fu_cast(qa, QK_DOT)
    qb = _fu_cast(qb, QK_DOT)
    qr = _fu_cast(qr, QK_DOT)

    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    if TOK_M:
        acc = tl.zeros([256, 16], tl.float32)
        qa = tl.trans(qa)
        qb = tl.trans(qb)
        qr = tl.trans(qr)
    else:
        acc = tl.zeros([16, 256], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + rows
        if LOAD == 0:
            tok_c = tl.minimum(tok, hi - 1)
            ka_raw = tl.load(KV + tok_c[:, None] * 576 + dh[None, :])
            kb_raw = tl.load(KV + tok_c[:, None] * 576 + 256 + dh[None, :])
            kr_raw = tl.load(KV + tok_c[:, None] * 576 + 512 + dr[None, :])
        else:
            ka_raw = desc_n.load([start, 0])
            kb_raw = desc_n.load([start, 256])
            kr_raw = desc_r.load([start, 512])
        ka = _fu_cast(ka_raw, QK_DOT)
        kb = _fu_cast(kb_raw, QK_DOT)
        kr = _fu_cast(kr_raw, QK_DOT)
        # Only this half's V dims are converted (a branch, not a select: one cast runs).
        if half == 0:
            v = _fu_cast(ka_raw, PV_DOT)
        else:
            v = _fu_cast(kb_raw, PV_DOT)
        valid = tok < hi
        if TOK_M:
            s = tl.dot(ka, qa) + tl.dot(kb, qb) + tl.dot(kr, qr)  # [BLOCK_N, 16]
            s = s * col_scale[None, :]
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if PV_DOT >= 2:  # fp8 (either flavour)
                p = p * _fu_p_scale(PV_DOT)  # into fp8's normal range; undone after the loop
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), _fu_cast(p, PV_DOT))
        else:
            s = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb)) + tl.dot(qr, tl.trans(kr))
            s = s * col_scale[:, None]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_DOT >= 2:  # fp8 (either flavour)
                p = p * _fu_p_scale(PV_DOT)
            acc = acc * alpha[:, None] + tl.dot(_fu_cast(p, PV_DOT), v)
        m_i = m_new
    if TOK_M:
        acc = tl.trans(acc)  # [16, 256]
    if PV_DOT >= 2:  # fp8 (either flavour)
        acc = acc / _fu_p_scale(PV_DOT)
    return acc, m_i, l_i


@triton.jit
def _fu_emit_vh(acc, m_i, l_i, b, slot, half, OUT, PART_O, PART_LSE, v_scale, DIRECT: tl.constexpr):
    """_fu_emit for V half `half`: dims [256 * half, 256 * half + 256) of the output (DIRECT)
    or of the partial at slot; both halves write the same lse."""
    heads = tl.arange(0, 16)
    dims = half * 256 + tl.arange(0, 256)
    if DIRECT:
        out = acc * (v_scale / l_i)[:, None]
        tl.store(OUT + (b * 16 + heads[:, None]) * 512 + dims[None, :], out.to(tl.bfloat16))
    else:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        tl.store(PART_O + (slot * 16 + heads[:, None]) * 512 + dims[None, :], acc / l_safe[:, None])
        tl.store(PART_LSE + slot * 16 + heads, tl.where(has, m_i + tl.log2(l_safe), float("-inf")))


@triton.jit
def _fu_mx_load(KV, SC, SC_STRIDE, desc, tok_c, start, B0: tl.constexpr, NB: tl.constexpr,
                BLOCK_N: tl.constexpr, LOAD: tl.constexpr):
    """Packed bytes [BLOCK_N, NB, 16] (int32) and E8M0 scales [BLOCK_N, NB] of blocks B0.."""
    blk = tl.arange(0, NB)
    if LOAD == 0:
        byte = tl.arange(0, 16)
        pk = tl.load(KV + tok_c[:, None, None] * 288 + (B0 + blk)[None, :, None] * 16 + byte[None, None, :])
    else:
        pk = desc.load([start, B0, 0])
    sc = tl.load(SC + tok_c[:, None] * SC_STRIDE + (B0 + blk)[None, :])
    return pk.to(tl.int32) & 0xFF, sc.to(tl.int32) & 0xFF


@triton.jit
def _fu_attend_mx(
    Q, KV, SC, SC_STRIDE, desc_n, desc_r, b, lo, hi, sm_scale_log2,
    DOT: tl.constexpr, TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOAD: tl.constexpr,
):
    """Like _fu_attend for an MXFP4 cache, with the dims split into even and odd halves.

    A packed byte holds dims 2j (low nibble) and 2j + 1 (high nibble), so the kernel never
    interleaves: q is loaded as its even and odd dims, the scores are the sum of the two
    half dots, and the output comes back as (acc_even, acc_odd), [16, 256] each.
    """
    heads = tl.arange(0, 16)
    dh = tl.arange(0, 256)
    drh = tl.arange(0, 32)
    rows = tl.arange(0, BLOCK_N)
    qrow = Q + (b * 16 + heads[:, None]) * 576
    qe = _fu_cast(tl.load(qrow + 2 * dh[None, :]), DOT)
    qo = _fu_cast(tl.load(qrow + 2 * dh[None, :] + 1), DOT)
    qre = _fu_cast(tl.load(qrow + 512 + 2 * drh[None, :]), DOT)
    qro = _fu_cast(tl.load(qrow + 513 + 2 * drh[None, :]), DOT)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    if TOK_M:
        acc_e = tl.zeros([256, 16], tl.float32)
        acc_o = tl.zeros([256, 16], tl.float32)
        qe = tl.trans(qe)
        qo = tl.trans(qo)
        qre = tl.trans(qre)
        qro = tl.trans(qro)
    else:
        acc_e = tl.zeros([16, 256], tl.float32)
        acc_o = tl.zeros([16, 256], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + rows
        tok_c = tl.minimum(tok, hi - 1)
        pk, sc = _fu_mx_load(KV, SC, SC_STRIDE, desc_n, tok_c, start, 0, 16, BLOCK_N, LOAD)
        ke, ko = _fu_mx_dequant(pk, sc, DOT, BLOCK_N, 256)
        pk, sc = _fu_mx_load(KV, SC, SC_STRIDE, desc_r, tok_c, start, 16, 2, BLOCK_N, LOAD)
        kre, kro = _fu_mx_dequant(pk, sc, DOT, BLOCK_N, 32)
        valid = tok < hi
        if TOK_M:
            s = tl.dot(ke, qe) + tl.dot(ko, qo) + tl.dot(kre, qre) + tl.dot(kro, qro)  # [BN, 16]
            s = s * sm_scale_log2
            s = tl.where(valid[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            pc = _fu_cast(p, DOT)
            acc_e = acc_e * alpha[None, :] + tl.dot(tl.trans(ke), pc)
            acc_o = acc_o * alpha[None, :] + tl.dot(tl.trans(ko), pc)
        else:
            s = tl.dot(qe, tl.trans(ke)) + tl.dot(qo, tl.trans(ko)) + tl.dot(qre, tl.trans(kre)) + tl.dot(qro, tl.trans(kro))
            s = s * sm_scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pc = _fu_cast(p, DOT)
            acc_e = acc_e * alpha[:, None] + tl.dot(pc, ke)
            acc_o = acc_o * alpha[:, None] + tl.dot(pc, ko)
        m_i = m_new
    if TOK_M:
        acc_e = tl.trans(acc_e)
        acc_o = tl.trans(acc_o)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _fu_store(PTR, row, acc, W: tl.constexpr, STEP: tl.constexpr, OFF: tl.constexpr, TO_BF16: tl.constexpr):
    """PTR[row, h, OFF + STEP * d] = acc[h, d] for a [16, W] tile (rows of 16 x 512)."""
    heads = tl.arange(0, 16)
    ptr = PTR + (row * 16 + heads[:, None]) * 512 + OFF + STEP * tl.arange(0, W)[None, :]
    if TO_BF16:
        tl.store(ptr, acc.to(tl.bfloat16))
    else:
        tl.store(ptr, acc)


@triton.jit
def _fu_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, v_scale, W: tl.constexpr, NS_P2: tl.constexpr):
    """out[b, :, d0:d0+W] = sum_j w_j * part_j / sum_j w_j, w_j = 2^(lse_j - max lse).

    All splits are loaded in one [NS_P2, 16, W] tile: a loop over splits would wait one L2
    round trip per split (measured: ~15 us of a 20 us call at 16 splits, docs/perf.md).
    """
    heads = tl.arange(0, 16)
    dims = d0 + tl.arange(0, W)
    js = tl.arange(0, NS_P2)
    live = js < num_splits
    part_id = b * num_splits + js
    lse = tl.load(PART_LSE + part_id[:, None] * 16 + heads[None, :], mask=live[:, None],
                  other=float("-inf"), cache_modifier=".cg")
    w = tl.exp2(lse - tl.max(lse, axis=0)[None, :])  # an empty split has lse -inf: weight 0
    part = tl.load(
        PART_O + (part_id[:, None, None] * 16 + heads[None, :, None]) * 512 + dims[None, None, :],
        mask=live[:, None, None], other=0.0, cache_modifier=".cg",
    )
    acc = tl.sum(part * w[:, :, None], axis=0)
    out = acc * (v_scale / tl.sum(w, axis=0))[:, None]
    tl.store(OUT + (b * 16 + heads[:, None]) * 512 + dims[None, :], out.to(tl.bfloat16))


@triton.jit
def _fu_reduce_range(PART_O, PART_LSE, OUT, b, slot0, n, v_scale, RCH: tl.constexpr, W: tl.constexpr):
    """out[b] from the n partials in slots slot0 .. slot0 + n - 1 (persistent grid).

    n is data-dependent (ragged pieces), so the partials are read RCH at a time as one
    [RCH, 16, W] tile per 512/W dim slice (the host picks RCH near the typical n).
    """
    heads = tl.arange(0, 16)
    mx = tl.full([16], float("-inf"), tl.float32)
    for c in range(0, n, RCH):
        js = c + tl.arange(0, RCH)
        lse = tl.load(PART_LSE + (slot0 + js)[:, None] * 16 + heads[None, :], mask=(js < n)[:, None],
                      other=float("-inf"), cache_modifier=".cg")
        mx = tl.maximum(mx, tl.max(lse, axis=0))
    for d0 in range(0, 512, W):
        dims = d0 + tl.arange(0, W)
        acc = tl.zeros([16, W], tl.float32)
        den = tl.zeros([16], tl.float32)
        for c in range(0, n, RCH):
            js = c + tl.arange(0, RCH)
            live = js < n
            lse = tl.load(PART_LSE + (slot0 + js)[:, None] * 16 + heads[None, :], mask=live[:, None],
                          other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(lse - mx[None, :])
            part = tl.load(
                PART_O + ((slot0 + js)[:, None, None] * 16 + heads[None, :, None]) * 512 + dims[None, None, :],
                mask=live[:, None, None], other=0.0, cache_modifier=".cg",
            )
            acc += tl.sum(part * w[:, :, None], axis=0)
            den += tl.sum(w, axis=0)
        out = acc * (v_scale / den)[:, None]
        tl.store(OUT + (b * 16 + heads[:, None]) * 512 + dims[None, :], out.to(tl.bfloat16))


@triton.jit
def _fu_emit(
    acc, acc_o, m_i, l_i, b, slot, OUT, PART_O, PART_LSE, v_scale,
    DIRECT: tl.constexpr, EO: tl.constexpr,
):
    """Write a finished piece: the output itself (DIRECT) or its partial (O / l, lse) at slot.

    EO: acc / acc_o hold the even / odd dims (MXFP4); otherwise acc is all 512 (acc_o unused).
    """
    if DIRECT:
        inv = v_scale / l_i
        if EO:
            _fu_store(OUT, b, acc * inv[:, None], 256, 2, 0, True)
            _fu_store(OUT, b, acc_o * inv[:, None], 256, 2, 1, True)
        else:
            _fu_store(OUT, b, acc * inv[:, None], 512, 1, 0, True)
    else:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        if EO:
            _fu_store(PART_O, slot, acc / l_safe[:, None], 256, 2, 0, False)
            _fu_store(PART_O, slot, acc_o / l_safe[:, None], 256, 2, 1, False)
        else:
            _fu_store(PART_O, slot, acc / l_safe[:, None], 512, 1, 0, False)
        tl.store(PART_LSE + slot * 16 + tl.arange(0, 16), lse)


# num_splits is not specialized: one compiled kernel serves every split count.
@triton.jit(do_not_specialize=["num_splits", "total_kv"])
def _fu_decode_kernel(
    Q, KV, KV_SCALE, SC, SC_STRIDE, KV_INDPTR, OUT, PART_O, PART_LSE, COUNT, FLAG, KV_DN, KV_DR,
    total_kv, num_splits, sm_scale_log2,
    KV_FMT: tl.constexpr, Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
    TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, REDUCE: tl.constexpr, NS_P2: tl.constexpr,
    LOAD: tl.constexpr, V_SPLIT: tl.constexpr = 1,
):
    if V_SPLIT == 2:
        _fu_decode_vh(Q, KV, KV_SCALE, KV_INDPTR, OUT, PART_O, PART_LSE, COUNT, FLAG, KV_DN, KV_DR,
                      total_kv, num_splits, sm_scale_log2, KV_FMT, Q_FP8, QK_DOT, PV_DOT, TOK_M, BLOCK_N,
                      REDUCE, NS_P2, LOAD)
    else:  # V_SPLIT 1: the kernel as it was
        pid_s = tl.program_id(0)
        b = tl.program_id(1)
        seq_lo = tl.load(KV_INDPTR + b)
        seq_hi = tl.load(KV_INDPTR + b + 1)
        # Splits are whole tiles, so only a split's last tile is partial.
        chunk = tl.cdiv(tl.cdiv(seq_hi - seq_lo, num_splits), BLOCK_N) * BLOCK_N
        lo = seq_lo + pid_s * chunk
        hi = tl.minimum(lo + chunk, seq_hi)
        if LOAD == 1:
            if KV_FMT == 2:
                desc_n = tl.make_tensor_descriptor(KV, [total_kv, 18, 16], [288, 16, 1], [BLOCK_N, 16, 16])
                desc_r = tl.make_tensor_descriptor(KV, [total_kv, 18, 16], [288, 16, 1], [BLOCK_N, 2, 16])
            else:
                desc_n = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 512])
                desc_r = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 64])
        else:
            desc_n = KV_DN
            desc_r = KV_DR
        if KV_FMT == 1:
            kv_scale = tl.load(KV_SCALE)
        else:
            kv_scale = 1.0
        if KV_FMT == 2:
            acc, acc_o, m_i, l_i = _fu_attend_mx(Q, KV, SC, SC_STRIDE, desc_n, desc_r, b, lo, hi, sm_scale_log2,
                                                 QK_DOT, TOK_M, BLOCK_N, LOAD)
        else:
            acc, m_i, l_i = _fu_attend(Q, KV, desc_n, desc_r, b, lo, hi, kv_scale, sm_scale_log2,
                                       Q_FP8, QK_DOT, PV_DOT, TOK_M, BLOCK_N, LOAD)
            acc_o = acc
        v_scale = kv_scale
        if REDUCE == 0:
            _fu_emit(acc, acc_o, m_i, l_i, b, b, OUT, PART_O, PART_LSE, v_scale, True, KV_FMT == 2)
        else:
            part = pid_s + b * num_splits
            _fu_emit(acc, acc_o, m_i, l_i, b, part, OUT, PART_O, PART_LSE, v_scale, False, KV_FMT == 2)
            # Every thread's partial stores happen before the release below (CUTLASS's
            # semaphore pattern: barrier, then one gpu-scope release by the CTA).
            tl.debug_barrier()
            if REDUCE == 1:
                arrived = tl.atomic_add(COUNT + b, 1, sem="acq_rel")
                if arrived == num_splits - 1:
                    tl.atomic_xchg(COUNT + b, 0)  # ready for the next call, no memset
                    for d0 in range(0, 512, 512 // NS_P2):
                        _fu_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, v_scale, 512 // NS_P2, NS_P2)
            else:
                # Sense-reversing barrier: the flag flips once per call, the count resets.
                sense = tl.atomic_add(FLAG + b, 0, sem="relaxed")
                arrived = tl.atomic_add(COUNT + b, 1, sem="acq_rel")
                if arrived == num_splits - 1:
                    tl.atomic_xchg(COUNT + b, 0, sem="relaxed")
                    tl.atomic_xchg(FLAG + b, 1 - sense, sem="release")
                else:
                    while tl.atomic_add(FLAG + b, 0, sem="acquire") == sense:
                        pass
                tl.debug_barrier()
                # Each program reduces its own 512 / NS_P2 dims (all of them when num_splits is a
                # power of two, which the split plans use).
                for d0 in range(pid_s * (512 // NS_P2), 512, num_splits * (512 // NS_P2)):
                    _fu_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, v_scale, 512 // NS_P2, NS_P2)


@triton.jit
def _fu_decode_vh(
    Q, KV, KV_SCALE, KV_INDPTR, OUT, PART_O, PART_LSE, COUNT, FLAG, KV_DN, KV_DR,
    total_kv, num_splits, sm_scale_log2,
    KV_FMT: tl.constexpr, Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
    TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, REDUCE: tl.constexpr, NS_P2: tl.constexpr,
    LOAD: tl.constexpr,
):
    """_fu_decode_kernel's body for V_SPLIT 2 (bf16 / fp8 KV): program (2 * split + half, b).
    Counters and flags are per (sequence, half): index 2 * b + half."""
    pid_s = tl.program_id(0) // 2
    half = tl.program_id(0) % 2
    b = tl.program_id(1)
    seq_lo = tl.load(KV_INDPTR + b)
    seq_hi = tl.load(KV_INDPTR + b + 1)
    chunk = tl.cdiv(tl.cdiv(seq_hi - seq_lo, num_splits), BLOCK_N) * BLOCK_N
    lo = seq_lo + pid_s * chunk
    hi = tl.minimum(lo + chunk, seq_hi)
    if LOAD == 1:
        desc_n = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 256])
        desc_r = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 64])
    else:
        desc_n = KV_DN
        desc_r = KV_DR
    if KV_FMT == 1:
        kv_scale = tl.load(KV_SCALE)
    else:
        kv_scale = 1.0
    acc, m_i, l_i = _fu_attend_vh(Q, KV, desc_n, desc_r, b, lo, hi, half, kv_scale, sm_scale_log2,
                                  Q_FP8, QK_DOT, PV_DOT, TOK_M, BLOCK_N, LOAD)
    if REDUCE == 0:
        _fu_emit_vh(acc, m_i, l_i, b, b, half, OUT, PART_O, PART_LSE, kv_scale, True)
    else:
        _fu_emit_vh(acc, m_i, l_i, b, pid_s + b * num_splits, half, OUT, PART_O, PART_LSE, kv_scale, False)
        tl.debug_barrier()  # every thread's partial stores before the one gpu-scope release
        idx = b * 2 + half
        if REDUCE == 1:
            arrived = tl.atomic_add(COUNT + idx, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                tl.atomic_xchg(COUNT + idx, 0)  # ready for the next call, no memset
                for d0 in range(half * 256, half * 256 + 256, 512 // NS_P2):
                    _fu_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, kv_scale, 512 // NS_P2, NS_P2)
        else:
            sense = tl.atomic_add(FLAG + idx, 0, sem="relaxed")
            arrived = tl.atomic_add(COUNT + idx, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                tl.atomic_xchg(COUNT + idx, 0, sem="relaxed")
                tl.atomic_xchg(FLAG + idx, 1 - sense, sem="release")
            else:
                while tl.atomic_add(FLAG + idx, 0, sem="acquire") == sense:
                    pass
            tl.debug_barrier()
            # Program pid_s reduces slices pid_s, pid_s + num_splits, ... of the half's NS_P2.
            for d0 in range(half * 256 + pid_s * (256 // NS_P2), half * 256 + 256, num_splits * (256 // NS_P2)):
                _fu_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, kv_scale, 256 // NS_P2, NS_P2)


@triton.jit(do_not_specialize=["total_kv", "batch"])
def _fu_persistent_kernel(
    Q, KV, KV_SCALE, SC, SC_STRIDE, KV_INDPTR, OUT, PART_O, PART_LSE, COUNT, KV_DN, KV_DR,
    total_kv, batch, sm_scale_log2,
    KV_FMT: tl.constexpr, Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
    TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOAD: tl.constexpr, RCH: tl.constexpr, RW: tl.constexpr,
):
    """Program p takes tokens [base + p * chunk, base + (p + 1) * chunk) of the whole batch.

    Sequence b's pieces come from programs first(b) .. last(b) (first = (lo_b - base) //
    chunk), a run that only moves forward with b, so slot b + p is unique per (b, p): at
    most batch + programs - 1 partial slots. A sequence a program holds whole is written
    directly; a split one is reduced by its last arriving piece (counter reset by it).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    base = tl.load(KV_INDPTR)
    total = tl.load(KV_INDPTR + batch) - base
    chunk = tl.cdiv(tl.cdiv(total, nprog), BLOCK_N) * BLOCK_N
    t0 = base + pid * chunk
    t1 = tl.minimum(t0 + chunk, base + total)
    if LOAD == 1:
        if KV_FMT == 2:
            desc_n = tl.make_tensor_descriptor(KV, [total_kv, 18, 16], [288, 16, 1], [BLOCK_N, 16, 16])
            desc_r = tl.make_tensor_descriptor(KV, [total_kv, 18, 16], [288, 16, 1], [BLOCK_N, 2, 16])
        else:
            desc_n = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 512])
            desc_r = tl.make_tensor_descriptor(KV, [total_kv, 576], [576, 1], [BLOCK_N, 64])
    else:
        desc_n = KV_DN
        desc_r = KV_DR
    if KV_FMT == 1:
        kv_scale = tl.load(KV_SCALE)
    else:
        kv_scale = 1.0
    # The sequence holding token t0: how many sequences end at or before it.
    b = pid * 0
    for c in range(0, batch, 1024):
        idx = c + tl.arange(0, 1024)
        ends = tl.load(KV_INDPTR + 1 + idx, mask=idx < batch, other=2147483647)
        b += tl.sum((ends <= t0).to(tl.int32), axis=0)
    pos = t0
    while (pos < t1) & (b < batch):
        seq_lo = tl.load(KV_INDPTR + b)
        seq_hi = tl.load(KV_INDPTR + b + 1)
        lo = tl.maximum(pos, seq_lo)
        hi = tl.minimum(t1, seq_hi)
        if hi > lo:
            if KV_FMT == 2:
                acc, acc_o, m_i, l_i = _fu_attend_mx(Q, KV, SC, SC_STRIDE, desc_n, desc_r, b, lo, hi,
                                                     sm_scale_log2, QK_DOT, TOK_M, BLOCK_N, LOAD)
            else:
                acc, m_i, l_i = _fu_attend(Q, KV, desc_n, desc_r, b, lo, hi, kv_scale, sm_scale_log2,
                                           Q_FP8, QK_DOT, PV_DOT, TOK_M, BLOCK_N, LOAD)
                acc_o = acc
            first = (seq_lo - base) // chunk
            n = (seq_hi - 1 - base) // chunk - first + 1
            if n == 1:
                _fu_emit(acc, acc_o, m_i, l_i, b, b, OUT, PART_O, PART_LSE, kv_scale, True, KV_FMT == 2)
            else:
                _fu_emit(acc, acc_o, m_i, l_i, b, b + pid, OUT, PART_O, PART_LSE, kv_scale, False, KV_FMT == 2)
                tl.debug_barrier()
                arrived = tl.atomic_add(COUNT + b, 1, sem="acq_rel")
                if arrived == n - 1:
                    tl.atomic_xchg(COUNT + b, 0)  # ready for the next call, no memset
                    _fu_reduce_range(PART_O, PART_LSE, OUT, b, b + first, n, kv_scale, RCH, RW)
        pos = tl.maximum(pos, hi)
        b += 1


def fu_persistent_slots(batch: int, programs: int) -> int:
    """Partial slots the persistent grid may write (see _fu_persistent_kernel)."""
    return batch + programs


def fu_host_descriptors(kv, kv_fmt: str, block_n: int, nope_cols: int = 512):
    """Host-side TMA descriptors (nope part, rope part) over the whole cache (LOAD=2); the
    nope boxes are nope_cols wide (256 for v_split 2, which loads the two halves apart)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = kv.shape[0]
    if kv_fmt == "mxfp4":
        shape, strides = [rows, 18, 16], [288, 16, 1]
        return (TensorDescriptor(kv, shape, strides, [block_n, 16, 16]),
                TensorDescriptor(kv, shape, strides, [block_n, 2, 16]))
    shape, strides = [rows, 576], [576, 1]
    return (TensorDescriptor(kv, shape, strides, [block_n, nope_cols]),
            TensorDescriptor(kv, shape, strides, [block_n, 64]))


def fused_decode(
    q, kv, kv_scale, mx_scales, kv_indptr, out, part_o, part_lse, count, flag, *,
    num_splits: int, kv_fmt: str, q_fp8: bool, qk_dot: str, pv_dot: str, tok_m: bool,
    block_n: int, reduce: str, num_warps: int, num_stages: int, sm_scale_log2: float,
    load: str = "ptr", programs: int = 0, v_split: int = 1,
):
    """Launch the one-launch decode; buffers come from the caller (nothing allocated here).

    q (batch, 16, 576) bf16; kv: (total_kv, 576) bf16 / fp8 or (total_kv, 288) packed
    MXFP4 bytes (uint8); kv_scale: (1,) fp32 (fp8) or any tensor; mx_scales (rows, >=18) E8M0
    bytes (mxfp4) or any tensor; part_o (>= slots*16*512) fp32, part_lse (>= slots*16) fp32,
    count and flag (>= batch) int32, zero before first use. slots = batch*num_splits for the
    split grid; `programs` > 0 picks the persistent grid with that many programs (slots =
    fu_persistent_slots(batch, programs); num_splits and reduce are then ignored).
    load: ptr | tma (device descriptors: the caller has set triton's allocator) | tma_host.
    v_split 2: two programs per (split, sequence), each converting and multiplying half the V
    dims (the split grid, bf16 / fp8 KV, num_splits <= 128); count and flag then need
    >= 2 * batch elements, and reduce "spin" a grid of batch * num_splits * 2 programs that
    the GPU holds at once (the caller's check, as for v_split 1).
    Returns the compiled kernel (for its PTX and register report).
    """
    batch = q.shape[0]
    if v_split not in (1, 2):
        raise ValueError(f"v_split must be 1 or 2, got {v_split}")
    if v_split == 2 and (kv_fmt == "mxfp4" or programs > 0 or num_splits > 128):
        raise ValueError("v_split 2 runs the split grid (programs 0) with bf16 or fp8 KV and at most 128 "
                         f"splits; got kv {kv_fmt}, programs {programs}, num_splits {num_splits}")
    sc_stride = mx_scales.stride(0) if kv_fmt == "mxfp4" else 0
    if load == "tma_host":
        desc_n, desc_r = fu_host_descriptors(kv, kv_fmt, block_n, 512 // v_split)
    else:
        desc_n = desc_r = kv
    consts = dict(
        KV_FMT=FU_KV_CODES[kv_fmt], Q_FP8=q_fp8, QK_DOT=fu_dot_code(qk_dot, kv), PV_DOT=fu_dot_code(pv_dot, kv),
        TOK_M=tok_m, BLOCK_N=block_n, LOAD=FU_LOAD_CODES[load], num_warps=num_warps, num_stages=num_stages,
    )
    if programs > 0:
        # Reduction tile [RCH, 16, RW]: RCH near the usual pieces per sequence, 8K elements.
        per_seq = -(-programs // max(batch, 1)) + 1
        rch = min(32, max(2, triton.next_power_of_2(per_seq)))
        return _fu_persistent_kernel[(programs,)](
            q, kv, kv_scale, mx_scales, sc_stride, kv_indptr, out, part_o, part_lse, count, desc_n, desc_r,
            kv.shape[0], batch, sm_scale_log2, RCH=rch, RW=8192 // (16 * rch), **consts,
        )
    red = reduce if num_splits > 1 else "none"
    if v_split == 2:
        consts["V_SPLIT"] = 2  # left out for 1: the launch is exactly the one before v_split
    return _fu_decode_kernel[(num_splits * v_split, batch)](
        q, kv, kv_scale, mx_scales, sc_stride, kv_indptr, out, part_o, part_lse, count, flag, desc_n, desc_r,
        kv.shape[0], num_splits, sm_scale_log2,
        REDUCE=FU_REDUCE_CODES[red], NS_P2=max(2, triton.next_power_of_2(num_splits)), **consts,
    )


# ------------------------------------------------------------------------------------------
# The serving call (mla_tune/serving/inputs.py has its inputs and reference): contiguous or paged
# KV, any head count, q_len >= 1 new tokens per sequence, splits counted on the device.
# A separate kernel, so the leaderboard kernel above keeps its code and speed.
#
# MMA mapping: tokens stay on M (TOK_M, the family's choice: M = BLOCK_N lets Hopper's
# wgmma run) and the N dimension carries ROWS = Q_LEN_MAX x BLOCK_H query rows, row =
# new-token index x BLOCK_H + head. S^T = K_tile @ Q^T is [BLOCK_N, ROWS]; O^T += V^T @ P^T
# is [512, ROWS]. A sequence's new tokens thus share one read of each KV tile, and the
# causal mask among them is a per-column limit on the token index. Rows on N rather than M
# keep M = BLOCK_N >= 64 whatever q_len and the head tile are (rows on M would need 64 rows,
# i.e. block_h * q_len >= 64, for wgmma).
#
# Grid: (heads / BLOCK_H, max_splits, batch). Sequence b gets clamp(cdiv(seq_len,
# tokens_per_split), 1, max_splits) splits of whole tiles, computed here from its length;
# programs past that count exit. The splits reduce themselves: the last program of a
# (sequence, head tile) to arrive (an arrival counter that it resets) combines the
# partials. The spin barrier of the leaderboard kernel is not offered: programs that exit
# early and a grid sized from the caller's maxima give no guarantee that a sequence's
# programs are resident together, which a spin-wait needs.


@triton.jit
def _fu_sv_reduce(PART_O, PART_LSE, OUT, LSE, q_start, q_len, num_splits, h0, v_scale,
                  H: tl.constexpr, BLOCK_H: tl.constexpr, MAX_SPLITS: tl.constexpr,
                  NS_P2: tl.constexpr, W: tl.constexpr, WITH_LSE: tl.constexpr):
    """out[q_start + i, h0:h0+BLOCK_H] = sum_j w_j part_j / sum_j w_j for i < q_len; with
    WITH_LSE, LSE[q_start + i, h0:h0+BLOCK_H] = the merged log-sum-exp in natural log.

    Partial rows are (new token, split, head); the splits of one slice load as one tile.
    """
    heads = tl.arange(0, BLOCK_H)
    js = tl.arange(0, NS_P2)
    live = js < num_splits
    for i in range(0, q_len):
        row = ((q_start + i).to(tl.int64) * MAX_SPLITS + js[:, None]) * H + h0 + heads[None, :]
        lse = tl.load(PART_LSE + row, mask=live[:, None], other=float("-inf"), cache_modifier=".cg")
        # Split 0 holds token 0, which every new token sees: the max is finite.
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - m[None, :])
        inv = v_scale / tl.sum(w, axis=0)
        if WITH_LSE:  # log2 units -> natural log
            tl.store(LSE + (q_start + i).to(tl.int64) * H + h0 + heads,
                     (m + tl.log2(tl.sum(w, axis=0))) * 0.6931471805599453)
        o_row = ((q_start + i).to(tl.int64) * H + h0 + heads) * 512
        for d0 in range(0, 512, W):
            dims = d0 + tl.arange(0, W)
            part = tl.load(PART_O + row[:, :, None] * 512 + dims[None, None, :], mask=live[:, None, None],
                           other=0.0, cache_modifier=".cg")
            acc = tl.sum(part * w[:, :, None], axis=0)
            tl.store(OUT + o_row[:, None] + dims[None, :], (acc * inv[:, None]).to(tl.bfloat16))


@triton.jit(do_not_specialize=["tokens_per_split", "bt_stride"])
def _fu_serving_kernel(
    Q, QO_INDPTR, KV, KV_SCALE, KV_INDPTR, BLOCK_TABLE, SEQ_LENS, OUT, PART_O, PART_LSE, COUNT, LSE,
    tokens_per_split, bt_stride, sm_scale_log2,
    H: tl.constexpr, BLOCK_H: tl.constexpr, Q_LEN_MAX: tl.constexpr, MAX_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr, QK_DOT: tl.constexpr,
    PV_DOT: tl.constexpr, BLOCK_N: tl.constexpr, NS_P2: tl.constexpr, RW: tl.constexpr,
    KV_OFF64: tl.constexpr, WITH_LSE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    if PAGE_SIZE == 0:
        seq_lo = tl.load(KV_INDPTR + b)
        seq_len = tl.load(KV_INDPTR + b + 1) - seq_lo
    else:
        seq_len = tl.load(SEQ_LENS + b)
    want = tl.minimum(tl.maximum(tl.cdiv(seq_len, tokens_per_split), 1), MAX_SPLITS)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, want), BLOCK_N), 1) * BLOCK_N
    num_splits = tl.cdiv(seq_len, split_len)
    # seq_len 0 (a CUDA graph's padding slot): no splits, nothing written.
    if pid_s >= num_splits:
        return
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    ROWS: tl.constexpr = BLOCK_H * Q_LEN_MAX
    r = tl.arange(0, ROWS)
    q_idx = r // BLOCK_H
    h0 = pid_h * BLOCK_H
    q_start = tl.load(QO_INDPTR + b)
    q_len = tl.load(QO_INDPTR + b + 1) - q_start
    # With one row per head every row is a real new token (q_len >= 1): no mask.
    row_ok = (q_idx < q_len) | (Q_LEN_MAX == 1)
    # New token i of q_len sees the first seq_len - (q_len - 1 - i) tokens.
    limit = seq_len - q_len + 1 + q_idx
    row_off = (q_idx * H + r % BLOCK_H) * 576
    q_base = Q + (q_start.to(tl.int64) * H + h0) * 576
    dn = tl.arange(0, 512)
    dr = tl.arange(0, 64)
    qn = tl.load(q_base + row_off[:, None] + dn[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qr = tl.load(q_base + row_off[:, None] + 512 + dr[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if KV_FP8:
        kv_scale = tl.load(KV_SCALE)
    else:
        kv_scale = 1.0
    if Q_FP8:
        # Per-(new token, head) dynamic scale, as the leaderboard kernel's per-(sequence, head).
        amax = tl.maximum(tl.max(tl.abs(qn), axis=1), tl.max(tl.abs(qr), axis=1))
        q_scale = tl.maximum(amax, 1e-12) / _fu_fp8_max(QK_DOT)
        qn = qn / q_scale[:, None]
        qr = qr / q_scale[:, None]
        col_scale = q_scale * (kv_scale * sm_scale_log2)
    else:
        col_scale = tl.full([ROWS], 1.0, tl.float32) * (kv_scale * sm_scale_log2)
    qnt = tl.trans(_fu_cast(qn, QK_DOT))
    qrt = tl.trans(_fu_cast(qr, QK_DOT))

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([512, ROWS], tl.float32)
    rows = tl.arange(0, BLOCK_N)
    if PAGE_SIZE == 0:
        kv_seq = KV + seq_lo.to(tl.int64) * 576
    bt_row = BLOCK_TABLE + b.to(tl.int64) * bt_stride
    for start in range(lo, hi, BLOCK_N):
        tok = start + rows
        # Rows past hi are clamped to hi - 1 (in bounds, no load mask) and masked below.
        tok_c = tl.minimum(tok, hi - 1)
        if PAGE_SIZE == 0:
            ptr = kv_seq + tok_c[:, None] * 576
        elif PAGE_SIZE >= BLOCK_N:
            # Tiles are BLOCK_N-aligned, so one page holds the tile.
            page = tl.load(bt_row + start // PAGE_SIZE).to(tl.int64)
            ptr = KV + (page * PAGE_SIZE + start % PAGE_SIZE) * 576 + (tok_c - start)[:, None] * 576
        else:
            page = tl.load(bt_row + tok_c // PAGE_SIZE)
            if KV_OFF64:
                page = page.to(tl.int64)
            ptr = KV + (page * PAGE_SIZE + tok_c % PAGE_SIZE)[:, None] * 576
        kn_raw = tl.load(ptr + dn[None, :])
        kr_raw = tl.load(ptr + 512 + dr[None, :])
        kn = _fu_cast(kn_raw, QK_DOT)
        kr = _fu_cast(kr_raw, QK_DOT)
        if PV_DOT == QK_DOT:
            v = kn
        else:
            v = _fu_cast(kn_raw, PV_DOT)
        s = tl.dot(kn, qnt) + tl.dot(kr, qrt)  # [BLOCK_N, ROWS]
        if Q_LEN_MAX == 1:
            # One new token sees the whole sequence, and every tile holds a token: the
            # leaderboard kernel's mask and a finite max.
            s = tl.where(tok[:, None] < hi, s * col_scale[None, :], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_ref = m_new
        else:
            seen = (tok[:, None] < hi) & (tok[:, None] < limit[None, :])
            s = tl.where(seen, s * col_scale[None, :], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            # A row may see none of a tile's tokens (the causal mask): keep its exp2 finite.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if PV_DOT >= 2:  # fp8 (either flavour)
            p = p * _fu_p_scale(PV_DOT)  # into fp8's normal range; undone below
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), _fu_cast(p, PV_DOT))
        m_i = m_new
    out_t = tl.trans(acc)  # [ROWS, 512]
    if PV_DOT >= 2:  # fp8 (either flavour)
        out_t = out_t / _fu_p_scale(PV_DOT)

    # A row may see none of a late split's tokens: l_i = 0, written as zeros with lse -inf.
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    if num_splits == 1:
        o_ptr = OUT + (q_start.to(tl.int64) * H + h0) * 512 + (q_idx * H + r % BLOCK_H)[:, None] * 512
        tl.store(o_ptr + dn[None, :], (out_t * (kv_scale / l_safe)[:, None]).to(tl.bfloat16),
                 mask=row_ok[:, None])
        if WITH_LSE:  # every row sees token 0: l_i > 0; log2 units -> natural log
            tl.store(LSE + q_start.to(tl.int64) * H + h0 + q_idx * H + r % BLOCK_H,
                     (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=row_ok)
    else:
        # Partial rows are (new token, split, head).
        p_base = (q_start.to(tl.int64) * MAX_SPLITS + pid_s) * H + h0
        p_off = q_idx * (MAX_SPLITS * H) + r % BLOCK_H
        tl.store(PART_O + p_base * 512 + p_off[:, None] * 512 + dn[None, :], out_t / l_safe[:, None],
                 mask=row_ok[:, None])
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(PART_LSE + p_base + p_off, lse, mask=row_ok)
        # All the program's partial stores before one gpu-scope release (as in the
        # leaderboard kernel's REDUCE=1).
        tl.debug_barrier()
        counter = COUNT + b * (H // BLOCK_H) + pid_h
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            tl.atomic_xchg(counter, 0)  # ready for the next call, no memset
            _fu_sv_reduce(PART_O, PART_LSE, OUT, LSE, q_start, q_len, num_splits, h0, kv_scale,
                          H, BLOCK_H, MAX_SPLITS, NS_P2, RW, WITH_LSE)


@dataclass
class FusedServingWorkspace:
    """Scratch for `fused_decode_serving`, sized from the caller's maxima (never from the
    data): per-(new token, split, head) partial outputs and log2-sum-exps, and one arrival
    counter per (sequence, head tile) (a batch has at most as many sequences as new tokens).
    The counters start at zero and every reduction resets its own."""

    max_total_q: int
    heads: int
    max_splits: int
    part_o: torch.Tensor
    part_lse: torch.Tensor
    count: torch.Tensor

    # written before they are read in every call: a plan's runners may share them (SharedScratch)
    SHARED = ("part_o", "part_lse")

    @classmethod
    def allocate(cls, max_total_q: int, heads: int, max_splits: int, device,
                 max_q_len: int = 1) -> FusedServingWorkspace:
        # max_q_len: the split-K workspace's argument; partials here are per new token.
        del max_q_len
        splits = max_splits if max_splits > 1 else 0  # one split writes the output directly
        return cls(
            max_total_q,
            heads,
            max_splits,
            torch.empty((max_total_q, splits, heads, V_DIM), dtype=torch.float32, device=device),
            torch.empty((max_total_q, max(splits, 1), heads), dtype=torch.float32, device=device),
            torch.zeros((max_total_q * heads,), dtype=torch.int32, device=device),
        )

    def fits(self, total_q: int, heads: int, max_splits: int, max_q_len: int = 1) -> bool:
        return self.max_total_q >= total_q and self.heads == heads and self.max_splits == max_splits


def fused_decode_serving(
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
    q_fp8: bool = False,
    qk_dot: str,
    pv_dot: str,
    workspace: FusedServingWorkspace | None = None,
    sm_scale: float = SM_SCALE,
    lse: torch.Tensor | None = None,
    record: list | None = None,
):
    """The one-launch decode for the serving call; writes `out` (the call shape of
    flash_decode_serving, with this family's dot and q options).

    q: (total_q, heads, 576) bf16; qo_indptr: (batch + 1,) int32, sequence b's new tokens
    are q[qo_indptr[b]:qo_indptr[b + 1]] (1 <= q_len <= max_q_len <= 4), causal among
    themselves. KV (bf16, or 1-byte fp8 with a (1,) fp32 kv_scale), contiguous: kv
    (total_kv, 1, 576) with kv_indptr (batch + 1,) int32; or paged: kv (num_pages,
    page_size, 576) with block_table (batch, max_pages) int32 and seq_lens (batch,) int32.
    A sequence's KV includes its new tokens. out: (total_q, heads, 512) bf16. Sequence b
    runs in clamp(cdiv(seq_len, tokens_per_split), 1, max_splits) splits, counted on the
    device; the last split to finish reduces. block_h: heads per program (a power of two
    dividing heads, block_h * next_pow2(max_q_len) >= 16 MMA columns). q_fp8: q quantized
    in the kernel with a per-(new token, head) amax (goes with qk_dot fp8, which needs fp8
    KV); qk_dot / pv_dot: fp16 | bf16 | fp8 (pv fp8 needs fp8 KV).
    workspace: FusedServingWorkspace.allocate(max_total_q, heads, max_splits); with it,
    nothing here reads a device tensor or allocates. Returns the compiled kernel.
    sm_scale: the softmax scale, a runtime argument (one compile serves every value).
    lse: a contiguous (total_q, heads) float32 tensor that receives each (new token, head)'s
    log-sum-exp of its scaled scores, in natural log (the engines' convention); None: not
    computed.
    record: a list to which the launch appends what replays it (kernels/launch.py); the
    launch is the same with and without it.
    """
    page_size = check_serving_launch(
        q, qo_indptr, kv, kv_scale, out, kv_indptr=kv_indptr, block_table=block_table,
        seq_lens=seq_lens, max_q_len=max_q_len, q_len_limit=4, block_h=block_h,
        max_splits=max_splits, tokens_per_split=tokens_per_split, block_n=block_n, lse=lse)
    batch = qo_indptr.shape[0] - 1
    total_q, heads = q.shape[0], q.shape[1]
    q_len_max = triton.next_power_of_2(max_q_len)
    kv_fp8 = kv.dtype != torch.bfloat16
    if qk_dot not in FU_DOT_CODES or pv_dot not in FU_DOT_CODES:
        raise ValueError(f"qk_dot and pv_dot must be one of {', '.join(FU_DOT_CODES)}; got {qk_dot!r}, {pv_dot!r}")
    if (qk_dot == "fp8") != q_fp8 or ("fp8" in (qk_dot, pv_dot) and not kv_fp8):
        raise ValueError("qk_dot fp8 goes with q_fp8 (and only with it), and fp8 dots need an fp8 KV cache")
    workspace = serving_workspace(workspace, FusedServingWorkspace, total_q, heads, max_splits, q.device)
    ns_p2 = max(2, triton.next_power_of_2(max_splits))
    # Reduction tiles of [splits, block_h, RW], about 8K elements.
    rw = max(16, min(512, 8192 // (ns_p2 * block_h)))
    dummy = workspace.count  # stands in for the other layout's pointers (never read)
    seq_ptrs = (kv_indptr, dummy, dummy) if page_size == 0 else (dummy, block_table, seq_lens)
    return jit_launch(
        _fu_serving_kernel, (heads // block_h, max_splits, batch), record,
        q, qo_indptr, kv, kv_scale if kv_fp8 else dummy, *seq_ptrs, out,
        workspace.part_o, workspace.part_lse, workspace.count, lse if lse is not None else workspace.part_lse,
        tokens_per_split, block_table.stride(0) if page_size else 0, float(sm_scale * 1.4426950408889634),
        H=heads, BLOCK_H=block_h, Q_LEN_MAX=q_len_max, MAX_SPLITS=max_splits, PAGE_SIZE=page_size,
        KV_FP8=kv_fp8, Q_FP8=q_fp8, QK_DOT=fu_dot_code(qk_dot, kv), PV_DOT=fu_dot_code(pv_dot, kv),
        BLOCK_N=block_n, NS_P2=ns_p2, RW=rw, KV_OFF64=kv.numel() >= 2**31, WITH_LSE=lse is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
