"""MLA decode in Gluon for Hopper (sm_90): issue 11's kernel family, first step.

Why Gluon (docs/perf.md, "Issue 11"): the fused Triton kernel sits at 255 registers because
the fp8 KV tile and its fp16 V copy are staged through registers. Gluon states where each
operand lives, so here:

- Tokens on the MMA's M dimension. S^T[BN x 16] = K[BN x 640] @ Q^T[640 x 16] is an fp8 x fp8
  wgmma with both operands in shared memory (K-major, as fp8 wgmma needs); the 576 dims are
  five 128-column TMA boxes, the fifth half past the end of the row, which TMA zero-fills,
  and q is zero-padded to match.
- O^T[512 x 16] += V^T[512 x BN] @ P^T[BN x 16] as fp16 wgmma, four [128 x 16] accumulators
  (64 fp32 registers per thread in all). V^T is the same fp8 tile read transposed; how it
  reaches the MMA is the constexpr V_PATH, chosen by the V-path probe
  (scripts/gluon_probe.py): 0 `ss16` converts the box to fp16 in shared memory and the MMA
  reads both operands there; 1 `rs16` does the same and loads the A operand with
  ldmatrix.trans; 2 `rs8` loads the fp8 bytes straight into the A layout (the probe shows one
  ld.shared.u8 per element, kept for comparison); 3 `ss16a` is ss16 with one fp16 buffer per
  box and asynchronous MMAs, so converting box c + 1 overlaps the MMA of box c.
- q is quantized per (sequence, head) in the kernel (as triton_fused's fp8_dynamic).
- KV tiles come by TMA into a STAGES-deep ring, one mbarrier per stage.
- Grid (num_splits, batch). With one split the program writes the output; otherwise it writes
  a normalized partial (O / l, lse) and a second small launch (`_gd_reduce_kernel`, plain
  Triton) combines the splits.

The Gluon API used is Triton 3.6's (tma.async_copy_global_to_shared, mbarrier.expect(bar,
bytes, pred)); Triton 3.9 renamed the TMA load, so GD_UNAVAILABLE says why it cannot run
elsewhere. Gluon has no CPU interpreter: the kernel runs only on an sm_90 GPU.

Exportable module: private names start with `_gd_`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Why the Gluon kernel cannot run with this Triton (None: the API it is written for is here).
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GD_UNAVAILABLE = None
    if not triton.__version__.startswith("3.6."):
        GD_UNAVAILABLE = (f"the Gluon kernel is written for Triton 3.6's Gluon API; this is triton "
                          f"{triton.__version__} (3.9 renamed the TMA load); install triton 3.6")
except ImportError as _gd_exc:
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    GD_UNAVAILABLE = f"this Triton ({triton.__version__}) has no usable Gluon ({_gd_exc}); install triton 3.6"

GD_V_PATHS = {"ss16": 0, "rs16": 1, "rs8": 2, "ss16a": 3}
GD_BOX = 128  # columns per TMA box: 128 fp8 bytes, the widest NVMMA swizzle
GD_BOXES = 5  # 576 dims in five boxes; the fifth's columns 576..639 are TMA's zero fill
GD_V_BOXES = 4  # the 512 V dims


def _gd_no_jit(fn):
    """Stands in for gluon.jit where Gluon is missing, so this module still imports."""
    return fn


_gd_jit = gluon.jit if gluon is not None else _gd_no_jit


@_gd_jit
def _gd_pv_box(kv_box, v16_s, c, p_s, o, V_PATH: gl.constexpr, BN: gl.constexpr):
    """o[128 x 16] += (fp8 tile box c [BN x 128])^T @ P^T[BN x 16] in fp16, by V_PATH.
    V_PATH 3 returns an in-flight MMA: the caller waits for the four boxes at once."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    rows_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    if V_PATH == 2:
        a = kv_box.permute((1, 0)).load(a_l).to(gl.float16)
        o = warpgroup_mma(a, p_s, o)
    elif V_PATH == 3:
        # Box c has its own fp16 buffer, last read by the previous tile's MMAs, which every
        # warp waited for before the loop's top barrier: no barrier before the store.
        buf = v16_s.index(c)
        buf.store(kv_box.load(rows_l).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        o = warpgroup_mma(buf.permute((1, 0)), p_s, o, is_async=True)
    else:
        buf = v16_s.index(0)
        v16 = kv_box.load(rows_l).to(gl.float16)
        gl.thread_barrier()  # every warp is done with the previous box's fp16 copy
        buf.store(v16)
        fence_async_shared()
        gl.thread_barrier()
        if V_PATH == 0:
            o = warpgroup_mma(buf.permute((1, 0)), p_s, o)
        else:
            o = warpgroup_mma(buf.permute((1, 0)).load(a_l), p_s, o)
    return o


@_gd_jit
def _gd_store_box(o, c, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT: gl.constexpr):
    """Write dims [128c, 128c + 128) of the output (bf16) or of this split's partial (fp32)."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    d = c * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, o_l))
    h = gl.arange(0, 16, layout=gl.SliceLayout(0, o_l))
    val = o * (scale / l_safe)[None, :]
    if SPLIT:
        gl.store(PART_O + ((b * num_splits + split) * 16 + h[None, :]) * 512 + d[:, None], val)
    else:
        gl.store(OUT + (b * 16 + h[None, :]) * 512 + d[:, None], val.to(gl.bfloat16))


@_gd_jit
def _gd_decode_kernel(
    kv_desc, Q, KV_SCALE, KV_INDPTR, OUT, PART_O, PART_LSE, sm_scale_log2, num_splits,
    BN: gl.constexpr, STAGES: gl.constexpr, V_PATH: gl.constexpr, SPLIT: gl.constexpr,
):
    split = gl.program_id(0)
    b = gl.program_id(1)
    lo = gl.load(KV_INDPTR + b)
    hi = gl.load(KV_INDPTR + b + 1)
    tiles = gl.cdiv(hi - lo, BN)
    per_split = gl.cdiv(tiles, num_splits)
    n_tiles = gl.maximum(gl.minimum(tiles - split * per_split, per_split), 0)
    start = lo + split * per_split * BN
    end = gl.minimum(hi, start + n_tiles * BN)

    kv_l: gl.constexpr = kv_desc.layout
    kv_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * 5, BN, 128], kv_l)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()  # the initialized barriers are visible to TMA (the async proxy)
    # Start the ring before q is quantized, so the first tiles are in flight meanwhile.
    for s in gl.static_range(STAGES - 1):
        _gd_issue_tile(kv_desc, kv_s, bars, s, start + s * BN, s < n_tiles)

    # q: [16 x 640] fp8 in shared memory (five [16 x 128] boxes), scale per head.
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, 16, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    amax = gl.full([16], 1e-12, gl.float32, gl.SliceLayout(1, q_l))
    for c in gl.static_range(5):
        mask = (c * 128 + qd[None, :] < 576) & (qh[:, None] < 16)
        x = gl.load(Q + (b * 16 + qh[:, None]) * 576 + c * 128 + qd[None, :], mask=mask, other=0.0)
        amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), 1))
    q_scale = amax / 448.0
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    q_s = gl.allocate_shared_memory(gl.float8e4nv, [5, 16, 128], q_sl)
    for c in gl.static_range(5):
        mask = (c * 128 + qd[None, :] < 576) & (qh[:, None] < 16)
        x = gl.load(Q + (b * 16 + qh[:, None]) * 576 + c * 128 + qd[None, :], mask=mask, other=0.0)
        q_s.index(c).store((x.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()

    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    kv_scale = gl.load(KV_SCALE)
    col_scale = gl.convert_layout(q_scale, gl.SliceLayout(0, s_l)) * (kv_scale * sm_scale_log2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    p_s = gl.allocate_shared_memory(gl.float16, [BN, 16], p_sl)
    v16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if V_PATH == 3:
        v16_s = gl.allocate_shared_memory(gl.float16, [4, BN, 128], v16_sl)
    else:
        v16_s = gl.allocate_shared_memory(gl.float16, [1, BN, 128], v16_sl)

    m_i = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(0, s_l))
    l_i = gl.zeros([16], gl.float32, gl.SliceLayout(0, s_l))
    o0 = gl.zeros([128, 16], gl.float32, o_l)
    o1 = gl.zeros([128, 16], gl.float32, o_l)
    o2 = gl.zeros([128, 16], gl.float32, o_l)
    o3 = gl.zeros([128, 16], gl.float32, o_l)
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        # Refill the stage tile i - 1 used: every warp has finished with it.
        gl.thread_barrier()
        nxt = i + STAGES - 1
        _gd_issue_tile(kv_desc, kv_s, bars, nxt % STAGES, start + nxt * BN, nxt < n_tiles)

        base = stage * 5
        s_acc = gl.zeros([BN, 16], gl.float32, s_l)
        for c in gl.static_range(5):
            s_acc = warpgroup_mma(kv_s.index(base + c), q_s.index(c).permute((1, 0)), s_acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=[s_acc])

        tok = start + i * BN + rows
        s_acc = gl.where((tok < end)[:, None], s_acc * col_scale[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_acc, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s_acc - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        gl.thread_barrier()  # the previous tile's P^T has been read by every MMA
        p_s.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()

        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
        o0 = _gd_pv_box(kv_s.index(base + 0), v16_s, 0, p_s, o0 * alpha_o, V_PATH, BN)
        o1 = _gd_pv_box(kv_s.index(base + 1), v16_s, 1, p_s, o1 * alpha_o, V_PATH, BN)
        o2 = _gd_pv_box(kv_s.index(base + 2), v16_s, 2, p_s, o2 * alpha_o, V_PATH, BN)
        o3 = _gd_pv_box(kv_s.index(base + 3), v16_s, 3, p_s, o3 * alpha_o, V_PATH, BN)
        if V_PATH == 3:  # the converts of boxes 1-3 overlapped the MMAs of the boxes before
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=[o0, o1, o2, o3])

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    # An empty split (more splits than its sequence has tiles) writes lse = -inf, O = 0.
    l_safe = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(0, o_l))
    scale = gl.full([16], 1.0, gl.float32, gl.SliceLayout(0, o_l)) * kv_scale
    _gd_store_box(o0, 0, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    _gd_store_box(o1, 1, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    _gd_store_box(o2, 2, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    _gd_store_box(o3, 3, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    if SPLIT:
        h = gl.arange(0, 16, layout=gl.SliceLayout(0, s_l))
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(PART_LSE + (b * num_splits + split) * 16 + h, lse)


@_gd_jit
def _gd_issue_tile(kv_desc, kv_s, bars, stage, row, pred):
    """TMA the [BN x 576] tile at `row` into ring stage `stage` (five boxes, one barrier)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, 5 * kv_desc.block_type.nbytes, pred)
    for c in gl.static_range(5):
        tma.async_copy_global_to_shared(kv_desc, [row, c * 128], bar, kv_s.index(stage * 5 + c), pred)


@triton.jit
def _gd_reduce_kernel(PART_O, PART_LSE, OUT, num_splits, NS: tl.constexpr):
    """out[b, h] = sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m) over the splits (log2 lse)."""
    bh = tl.program_id(0)
    s = tl.arange(0, NS)
    d = tl.arange(0, 512)
    b = bh // 16
    h = bh % 16
    lse = tl.load(PART_LSE + (b * num_splits + s) * 16 + h, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s < num_splits, tl.exp2(lse - m), 0.0)
    o = tl.load(PART_O + ((b * num_splits + s[:, None]) * 16 + h) * 512 + d[None, :],
                mask=(s < num_splits)[:, None], other=0.0)
    tl.store(OUT + bh * 512 + d, (tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)).to(tl.bfloat16))


def gd_reduce(part_o, part_lse, out, num_splits: int):
    """Combine num_splits partials per (sequence, head) into out (batch, 16, 512) bf16."""
    batch = out.shape[0]
    _gd_reduce_kernel[(batch * 16,)](part_o, part_lse, out, num_splits,
                                     NS=max(2, triton.next_power_of_2(num_splits)))


def gd_kv_descriptor(kv, block_n: int):
    """Host TMA descriptor over the whole (total_kv, 576) fp8 cache, [block_n x 128] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    return TensorDescriptor.from_tensor(kv, [block_n, GD_BOX], layout)


def gluon_decode(q, kv_desc, kv_scale, kv_indptr, out, part_o, part_lse, *, num_splits: int,
                 block_n: int, num_stages: int, v_path: str, sm_scale_log2: float):
    """Launch the decode (and the split reduction when num_splits > 1); buffers come from the
    caller. q (batch, 16, 576) bf16; kv_desc from gd_kv_descriptor; kv_scale (1,) fp32;
    part_o (>= batch*num_splits*16*512) fp32; part_lse (>= batch*num_splits*16) fp32.
    Returns the compiled decode kernel (for its register report)."""
    if GD_UNAVAILABLE is not None:
        raise RuntimeError(GD_UNAVAILABLE)
    batch = q.shape[0]
    split = num_splits > 1
    compiled = _gd_decode_kernel[(num_splits, batch)](
        kv_desc, q, kv_scale, kv_indptr, out, part_o, part_lse, sm_scale_log2, num_splits,
        BN=block_n, STAGES=num_stages, V_PATH=GD_V_PATHS[v_path], SPLIT=split, num_warps=4,
    )
    if split:
        gd_reduce(part_o, part_lse, out, num_splits)
    return compiled
