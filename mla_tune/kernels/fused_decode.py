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
- MXFP4 KV (block-32 E2M1 + E8M0) is dequantized in registers (`KV_FMT=2`).
- One launch: each program writes a partial (O / l, lse); then either the last program of
  a sequence to arrive reduces all splits (`REDUCE=1`, an arrival counter it resets itself,
  so there is no memset per call) or every program of the sequence waits at a per-sequence
  barrier and reduces a slice of the 512 output dims (`REDUCE=2`; the runner allows it only
  when the whole grid fits on the GPU at once, which a spin-wait needs). `REDUCE=0` is
  num_splits = 1: the program writes the output itself.

Exportable module: private names start with `_fu_`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Dot operand dtype codes (constexpr ints: they travel through every Triton version).
FU_DOT_CODES = {"fp16": 0, "bf16": 1, "fp8": 2}
FU_KV_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
FU_REDUCE_CODES = {"none": 0, "last": 1, "spin": 2}


@triton.jit
def _fu_cast(x, CODE: tl.constexpr):
    if CODE == 0:
        return x.to(tl.float16)
    elif CODE == 1:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _fu_e2m1(codes):
    """E2M1 4-bit codes (int32, 0..15) to fp32 values: sign bit 3, exponent bits 2:1, mantissa bit 0."""
    mag = codes & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    normal = tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m)
    val = tl.where(e == 0, 0.5 * m, normal)
    return tl.where((codes & 8) != 0, -val, val)


@triton.jit
def _fu_mxfp4_tile(KV, SC, tok, SC_STRIDE, BN: tl.constexpr, COL0: tl.constexpr, NCOL: tl.constexpr):
    """Dequantize columns [COL0, COL0 + NCOL) of the given tokens from MXFP4 to fp32."""
    pk = tl.load(KV + tok[:, None] * 288 + (COL0 // 2 + tl.arange(0, NCOL // 2))[None, :])
    pk = pk.to(tl.int32) & 0xFF
    vals = tl.join(_fu_e2m1(pk & 0xF), _fu_e2m1(pk >> 4))  # even index in the low nibble
    vals = tl.reshape(vals, (BN, NCOL // 32, 32))
    exps = tl.load(SC + tok[:, None] * SC_STRIDE + (COL0 // 32 + tl.arange(0, NCOL // 32))[None, :])
    scale = tl.exp2(exps.to(tl.float32) - 127.0)
    return tl.reshape(vals * scale[:, :, None], (BN, NCOL))


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


# num_splits is not specialized: one compiled kernel serves every split count.
@triton.jit(do_not_specialize=["num_splits"])
def _fu_decode_kernel(
    Q, KV, KV_SCALE, SC, SC_STRIDE, KV_INDPTR, OUT, PART_O, PART_LSE, COUNT, FLAG,
    num_splits, sm_scale_log2,
    KV_FMT: tl.constexpr, Q_FP8: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
    TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, REDUCE: tl.constexpr, NS_P2: tl.constexpr,
):
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    seq_lo = tl.load(KV_INDPTR + b)
    seq_hi = tl.load(KV_INDPTR + b + 1)
    # Splits are whole tiles, so only a split's last tile is partial.
    chunk = tl.cdiv(tl.cdiv(seq_hi - seq_lo, num_splits), BLOCK_N) * BLOCK_N
    lo = seq_lo + pid_s * chunk
    hi = tl.minimum(lo + chunk, seq_hi)

    heads = tl.arange(0, 16)
    dn = tl.arange(0, 512)
    dr = tl.arange(0, 64)
    rows = tl.arange(0, BLOCK_N)
    qn = tl.load(Q + (b * 16 + heads[:, None]) * 576 + dn[None, :]).to(tl.float32)
    qr = tl.load(Q + (b * 16 + heads[:, None]) * 576 + 512 + dr[None, :]).to(tl.float32)
    if KV_FMT == 1:
        kv_scale = tl.load(KV_SCALE)
    else:
        kv_scale = 1.0
    if Q_FP8:
        # Per-(sequence, head) dynamic scale: computed here, so no extra launch or sync.
        amax = tl.maximum(tl.max(tl.abs(qn), axis=1), tl.max(tl.abs(qr), axis=1))
        q_scale = tl.maximum(amax, 1e-12) / 448.0
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
        # Clamped rows stay in bounds without a load mask (which would cost vector width).
        tok_c = tl.minimum(tok, hi - 1)
        if KV_FMT == 2:
            kn_raw = _fu_mxfp4_tile(KV, SC, tok_c, SC_STRIDE, BLOCK_N, 0, 512)
            kr_raw = _fu_mxfp4_tile(KV, SC, tok_c, SC_STRIDE, BLOCK_N, 512, 64)
        else:
            kn_raw = tl.load(KV + tok_c[:, None] * 576 + dn[None, :])
            kr_raw = tl.load(KV + tok_c[:, None] * 576 + 512 + dr[None, :])
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
            if PV_DOT == 2:
                p = p * 256.0  # into fp8's normal range; undone after the loop
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), _fu_cast(p, PV_DOT))
        else:
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))  # [16, BLOCK_N]
            s = s * col_scale[:, None]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_DOT == 2:
                p = p * 256.0
            acc = acc * alpha[:, None] + tl.dot(_fu_cast(p, PV_DOT), v)
        m_i = m_new

    if TOK_M:
        acc = tl.trans(acc)  # [16, 512]
    if PV_DOT == 2:
        acc = acc / 256.0
    v_scale = kv_scale
    if REDUCE == 0:
        out = acc * (v_scale / l_i)[:, None]
        tl.store(OUT + (b * 16 + heads[:, None]) * 512 + dn[None, :], out.to(tl.bfloat16))
    else:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        part = pid_s + b * num_splits
        tl.store(PART_O + (part * 16 + heads[:, None]) * 512 + dn[None, :], acc / l_safe[:, None])
        tl.store(PART_LSE + part * 16 + heads, lse)
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


def fused_decode(
    q, kv, kv_scale, mx_scales, kv_indptr, out, part_o, part_lse, count, flag, *,
    num_splits: int, kv_fmt: str, q_fp8: bool, qk_dot: str, pv_dot: str, tok_m: bool,
    block_n: int, reduce: str, num_warps: int, num_stages: int, sm_scale_log2: float,
):
    """Launch the one-launch decode; buffers come from the caller (nothing allocated here).

    q (batch, 16, 576) bf16; kv: (total_kv, 576) bf16 / fp8 or (total_kv, 288) packed
    MXFP4 bytes; kv_scale: (1,) fp32 (fp8) or any tensor; mx_scales (rows, >=18) E8M0 bytes
    (mxfp4) or any tensor; part_o (>= batch*num_splits*16*512) fp32, part_lse
    (>= batch*num_splits*16) fp32, count and flag (>= batch) int32, zero before first use.
    Returns the compiled kernel (for its PTX and register report).
    """
    batch = q.shape[0]
    red = reduce if num_splits > 1 else "none"
    sc_stride = mx_scales.stride(0) if kv_fmt == "mxfp4" else 0
    return _fu_decode_kernel[(num_splits, batch)](
        q, kv, kv_scale, mx_scales, sc_stride, kv_indptr, out, part_o, part_lse, count, flag,
        num_splits, sm_scale_log2,
        KV_FMT=FU_KV_CODES[kv_fmt], Q_FP8=q_fp8, QK_DOT=FU_DOT_CODES[qk_dot],
        PV_DOT=FU_DOT_CODES[pv_dot], TOK_M=tok_m, BLOCK_N=block_n,
        REDUCE=FU_REDUCE_CODES[red], NS_P2=max(2, triton.next_power_of_2(num_splits)), num_warps=num_warps, num_stages=num_stages,
    )
