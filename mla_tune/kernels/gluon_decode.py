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
  (scripts/gluon_probe.py at 9401329): 0 `ss16` converts the box to fp16 in shared memory and
  the MMA reads both operands there; 1 `rs16` does the same and loads the A operand with
  ldmatrix.trans; 2 `rs8` loads the fp8 bytes straight into the A layout (the probe shows one
  ld.shared.u8 per element, kept for comparison); 3 `ss16a` is ss16 with one fp16 buffer per
  box and asynchronous MMAs, so converting box c + 1 overlaps the MMA of box c.
- q is quantized per (sequence, head) in the kernel (as triton_fused's fp8_dynamic).
- KV tiles come by TMA into a STAGES-deep ring, one mbarrier per stage.
- Grid (num_splits x V_HALVES, batch). With one split the program writes the output;
  otherwise it writes a normalized partial (O / l, lse) and the splits are combined by the
  constexpr REDUCE: 0 a second small launch (`_gd_reduce_kernel`, plain Triton); 1 the last
  program of a sequence to arrive (an arrival counter it resets itself, so no memset per
  call); 2 every program of the sequence waits at a sense-reversing spin barrier, then
  reduces its own slice of the dims. REDUCE 2 needs the whole grid resident at once, so
  `gluon_decode` refuses it when the grid exceeds sm_count x the CTAs per SM that the
  kernel's shared memory allows (`gd_ctas_per_sm`).
- V_HALVES 2 (small batches, few tiles per program): two programs per (split, sequence),
  side by side in the first grid dimension. Each loads the whole tile and computes S (so the
  softmax statistics, hence lse, are bit-identical in both), but runs the PV MMAs and writes
  the output or partial for only its two of the four 128-column V boxes. The second read of
  the tile is meant to hit in L2.
- WS (warp specialization, `gl.warp_specialize`; docs/perf.md "Issue 11, third step"): 0 one
  warpgroup loads and consumes, issuing tile i + STAGES - 1 at the top of iteration i. 1 a
  loader partition of one warp (24 registers) refills slot s as soon as its consumer
  releases it (a second mbarrier ring, `empty`), so the default warpgroup (232 registers)
  only waits, computes and releases. 2 adds a second consumer warpgroup (a worker
  partition, 240 registers): the default one takes the even tiles, the worker the odd ones,
  each with its own (m, l, O^T); the worker leaves its state in the ring slot of its last
  tile and the default one merges it before the (unchanged) epilogue. The q prologue and the
  epilogue run in the default warps outside the specialized region; the kernel issues the
  first STAGES tiles itself. ws 2 needs 168 registers x 12 warps: one CTA per SM.

The Gluon API is Triton 3.6's (mbarrier.expect(bar, bytes, pred), gl.warp_specialize([(fn,
args), ...], worker_warps, worker_regs)), with three names that later Tritons renamed taken
through aliases chosen by feature detection (the compatibility block below): the TMA load
(3.6 tma.async_copy_global_to_shared, 3.9 tma.async_load), the CTA barrier (gl.thread_barrier,
gl.barrier) and the shared-memory reinterpret (._reinterpret, .reinterpret). Each pair has
the same arguments and emits the same IR, so on 3.6 the kernel compiles to the binary it did
before the aliases (tests/test_gluon_compile.py compiles it for sm_90 under 3.6 and 3.9).
GD_UNAVAILABLE says what is missing where a Triton has neither name. Gluon has no CPU
interpreter: the kernel runs only on an sm_90 GPU.

Exportable module: private names start with `_gd_`.
"""

from __future__ import annotations

import torch
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

    # The compatibility block: each renamed builtin by whichever name this Triton has (3.6's
    # first, except the TMA load: 3.9 keeps 3.6's name as a stub that raises), the same call
    # in the kernel either way.
    _gd_smem_desc = gl.shared_memory_descriptor
    _gd_tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    _gd_cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
    _gd_smem_reinterpret = getattr(_gd_smem_desc, "_reinterpret", None) or getattr(_gd_smem_desc, "reinterpret", None)
    _gd_missing = [name for name, found in (("tma.async_load or tma.async_copy_global_to_shared", _gd_tma_load),
                                            ("gl.thread_barrier or gl.barrier", _gd_cta_barrier),
                                            ("shared_memory_descriptor._reinterpret or .reinterpret",
                                             _gd_smem_reinterpret),
                                            ("gl.warp_specialize", getattr(gl, "warp_specialize", None)))
                   if found is None]
    GD_UNAVAILABLE = None
    if _gd_missing:
        GD_UNAVAILABLE = (f"this Triton's Gluon ({triton.__version__}) lacks {', '.join(_gd_missing)}, which the "
                          "Gluon kernel calls; install triton 3.6 (run on the H200) or 3.9 (compiled for sm_90)")
except (ImportError, AttributeError) as _gd_exc:
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    _gd_tma_load = _gd_cta_barrier = _gd_smem_reinterpret = None
    GD_UNAVAILABLE = f"this Triton ({triton.__version__}) has no usable Gluon ({_gd_exc}); install triton 3.6"

GD_V_PATHS = {"ss16": 0, "rs16": 1, "rs8": 2, "ss16a": 3}
GD_BOX = 128  # columns per TMA box: 128 fp8 bytes, the widest NVMMA swizzle
GD_BOXES = 5  # 576 dims in five boxes; the fifth's columns 576..639 are TMA's zero fill
GD_V_BOXES = 4  # the 512 V dims
GD_REDUCE_CODES = {"launch": 0, "last": 1, "spin": 2}
# The q prologue (constexpr Q_LOAD): "twice" reads q after the ring is started, once for the
# per-head amax and again to quantize; "first" loads its five boxes into registers before
# anything waits (the KV_INDPTR loads, the ring) and quantizes those, one global read.
GD_Q_LOADS = {"twice": 0, "first": 1}
# The partials' element type (the part_o buffer's): fp32, or bf16 for half the bytes.
GD_PART_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GD_MAX_INKERNEL_SPLITS = 64  # in-kernel reductions: slices of at least 4 dims per split
# sm_90: 228 KB of shared memory per SM, 1 KB of it reserved per resident CTA (CUDA
# occupancy rules); a 4-warp CTA uses at most 255 x 128 registers, so registers always
# allow 2 CTAs per SM and shared memory is what limits residency (every configuration
# uses > 76 KB, so at most 2).
GD_SMEM_PER_SM = 233472
GD_SMEM_PER_CTA_RESERVED = 1024
GD_CTAS_PER_SM_BY_REGS = 2
# Warp specialization (constexpr WS): 0 none; 1 a loader partition of one warp (24 registers)
# feeding the ring, the 4-warp default partition consumes; 2 the loader warp and a second
# consumer warpgroup (a worker partition) taking the odd tiles. Registers are allocated per
# warpgroup (setmaxnreg): the kernel is launched with maxnreg GD_WS_MAXNREG[ws] per thread
# over 4 x 32 x (1 + worker warpgroups) threads and Triton's AllocateWarpGroups pass gives
# the default partition what the workers (GD_WS_WORKER_REGS) leave: ws 1: 128 x 8 warps, the
# loader warpgroup 24, the default 232 (the file holds 2 CTAs per SM, as for ws 0); ws 2:
# 168 x 12 warps, 240 / 24, the default 240 (1 CTA per SM).
GD_WS_MODES = (0, 1, 2)
GD_WS_MAXNREG = {0: None, 1: 128, 2: 168}
GD_WS_WORKER_REGS = {0: (), 1: (24,), 2: (240, 24)}
GD_WS_CTAS_PER_SM_BY_REGS = {0: GD_CTAS_PER_SM_BY_REGS, 1: 2, 2: 1}


def _gd_no_jit(fn):
    """Stands in for gluon.jit where Gluon is missing, so this module still imports."""
    return fn


_gd_jit = gluon.jit if gluon is not None else _gd_no_jit
_gd_constexpr_fn = gluon.constexpr_function if gluon is not None else _gd_no_jit


@_gd_constexpr_fn
def _gd_reduce_layout(ns, w):
    """Blocked layout over a [ns splits, 16 heads, w dims] fp32 tile for 4 warps: up to 4
    consecutive dims per thread, lanes along the dims first, then heads, then splits."""
    vec = min(4, w)
    tw = min(32, w // vec)
    th = min(16, 32 // tw)
    wh = min(4, 16 // th)
    return gl.BlockedLayout([1, 1, vec], [32 // (tw * th), th, tw], [4 // wh, wh, 1], [2, 1, 0])


@_gd_constexpr_fn
def _gd_ws_mode(ws):
    """The kernel's warp-specialization mode: WS, or 0 where it is None (see the kernel)."""
    ws = 0 if ws is None else ws
    assert ws in GD_WS_MODES, f"WS must be one of {GD_WS_MODES}, got {ws}"
    return ws


@_gd_constexpr_fn
def _gd_q_load_mode(q_load):
    """The kernel's q prologue (GD_Q_LOADS): Q_LOAD, or 0 where it is None (a signature that
    predates it, as for WS)."""
    q_load = 0 if q_load is None else q_load
    assert q_load in (0, 1), f"Q_LOAD must be 0 or 1 (GD_Q_LOADS), got {q_load}"
    return q_load


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
        _gd_cta_barrier()
        o = warpgroup_mma(buf.permute((1, 0)), p_s, o, is_async=True)
    else:
        buf = v16_s.index(0)
        v16 = kv_box.load(rows_l).to(gl.float16)
        _gd_cta_barrier()  # every warp is done with the previous box's fp16 copy
        buf.store(v16)
        fence_async_shared()
        _gd_cta_barrier()
        if V_PATH == 0:
            o = warpgroup_mma(buf.permute((1, 0)), p_s, o)
        else:
            o = warpgroup_mma(buf.permute((1, 0)).load(a_l), p_s, o)
    return o


@_gd_jit
def _gd_store_box(o, c, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT: gl.constexpr):
    """Write dims [128c, 128c + 128) of the output (bf16) or of this split's partial (fp32 or
    bf16, as PART_O is)."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    d = c * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, o_l))
    h = gl.arange(0, 16, layout=gl.SliceLayout(0, o_l))
    val = o * (scale / l_safe)[None, :]
    if SPLIT:  # fp32 or bf16 partials: the buffer's type
        gl.store(PART_O + ((b * num_splits + split) * 16 + h[None, :]) * 512 + d[:, None],
                 val.to(PART_O.dtype.element_ty))
    else:
        gl.store(OUT + (b * 16 + h[None, :]) * 512 + d[:, None], val.to(gl.bfloat16))


@_gd_jit
def _gd_q_box(Q, b, c: gl.constexpr):
    """q[b, :, 128c : 128c + 128] as [16 x 128] bf16 (box 4's columns past 576 read as 0)."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qh = gl.arange(0, 16, layout=gl.SliceLayout(1, q_l))
    qd = gl.arange(0, 128, layout=gl.SliceLayout(0, q_l))
    mask = (c * 128 + qd[None, :] < 576) & (qh[:, None] < 16)
    return gl.load(Q + (b * 16 + qh[:, None]) * 576 + c * 128 + qd[None, :], mask=mask, other=0.0)


@_gd_jit
def _gd_tile(kv_s, base, q_s, p_s, v16_s, col_scale, tok0, rows, end, half, m_i, l_i, o0, o1, o2, o3,
             BN: gl.constexpr, V_PATH: gl.constexpr, V_HALVES: gl.constexpr):
    """One [BN x 576] tile in ring slots base .. base + 4 (tokens tok0 + rows, rows = 0 .. BN - 1):
    S^T by fp8 wgmma, the online softmax over the tokens, P^T fp16 into p_s, then the PV MMAs
    of the V boxes this program multiplies. Returns the updated (m_i, l_i, o0, o1, o2, o3)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    s_acc = gl.zeros([BN, 16], gl.float32, s_l)
    for c in gl.static_range(5):
        s_acc = warpgroup_mma(kv_s.index(base + c), q_s.index(c).permute((1, 0)), s_acc, is_async=True)
    s_acc = warpgroup_mma_wait(num_outstanding=0, deps=[s_acc])

    tok = tok0 + rows
    s_acc = gl.where((tok < end)[:, None], s_acc * col_scale[None, :], float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_acc, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s_acc - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    m_i = m_new
    _gd_cta_barrier()  # the previous tile's P^T has been read by every MMA
    p_s.store(p.to(gl.float16))
    fence_async_shared()
    _gd_cta_barrier()

    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
    if V_HALVES == 1:
        o0 = _gd_pv_box(kv_s.index(base + 0), v16_s, 0, p_s, o0 * alpha_o, V_PATH, BN)
        o1 = _gd_pv_box(kv_s.index(base + 1), v16_s, 1, p_s, o1 * alpha_o, V_PATH, BN)
        o2 = _gd_pv_box(kv_s.index(base + 2), v16_s, 2, p_s, o2 * alpha_o, V_PATH, BN)
        o3 = _gd_pv_box(kv_s.index(base + 3), v16_s, 3, p_s, o3 * alpha_o, V_PATH, BN)
        if V_PATH == 3:  # the converts of boxes 1-3 overlapped the MMAs of the boxes before
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=[o0, o1, o2, o3])
    else:  # this half's two V boxes: 2 * half and 2 * half + 1
        o0 = _gd_pv_box(kv_s.index(base + 2 * half), v16_s, 0, p_s, o0 * alpha_o, V_PATH, BN)
        o1 = _gd_pv_box(kv_s.index(base + 2 * half + 1), v16_s, 1, p_s, o1 * alpha_o, V_PATH, BN)
        if V_PATH == 3:
            o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=[o0, o1])
    return m_i, l_i, o0, o1, o2, o3


@_gd_jit
def _gd_alloc_v16(BN: gl.constexpr, V_PATH: gl.constexpr, V_HALVES: gl.constexpr):
    """The fp16 V box buffer(s) of one consumer: one per V box it multiplies for ss16a, else one
    (rs8 never touches it and the compiler drops it)."""
    v16_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if V_PATH == 3:
        v16_s = gl.allocate_shared_memory(gl.float16, [4 // V_HALVES, BN, 128], v16_sl)
    else:
        v16_s = gl.allocate_shared_memory(gl.float16, [1, BN, 128], v16_sl)
    return v16_s


@_gd_jit
def _gd_decode_kernel(
    kv_desc, Q, KV_SCALE, KV_INDPTR, OUT, PART_O, PART_LSE, sm_scale_log2, num_splits, COUNT, FLAG,
    BN: gl.constexpr, STAGES: gl.constexpr, V_PATH: gl.constexpr, SPLIT: gl.constexpr,
    REDUCE: gl.constexpr, V_HALVES: gl.constexpr, NS: gl.constexpr, WS: gl.constexpr = 0,
    Q_LOAD: gl.constexpr = 0,
):
    # An offline compile whose signature predates WS (scripts/gluon_probe.py --decode at
    # 9401329) binds it to None, not to its default: that is the kernel without warp
    # specialization.
    WSM: gl.constexpr = _gd_ws_mode(WS)
    QLM: gl.constexpr = _gd_q_load_mode(Q_LOAD)
    if V_HALVES == 1:
        split = gl.program_id(0)
        half = 0
    else:  # the two halves of a (split, sequence) are neighbours in launch order
        split = gl.program_id(0) // V_HALVES
        half = gl.program_id(0) % V_HALVES
    b = gl.program_id(1)
    if QLM == 1:  # q's five boxes first: their HBM round trip overlaps KV_INDPTR's and the ring's
        x0 = _gd_q_box(Q, b, 0)
        x1 = _gd_q_box(Q, b, 1)
        x2 = _gd_q_box(Q, b, 2)
        x3 = _gd_q_box(Q, b, 3)
        x4 = _gd_q_box(Q, b, 4)
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
    if WSM != 0:  # the consumers' releases of the ring slots, which the loader waits for
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty.index(s), count=1)
    fence_async_shared()  # the initialized barriers are visible to TMA (the async proxy)
    # Start the ring before q is quantized, so the first tiles are in flight meanwhile (with a
    # loader partition every stage is free at first: fill them all).
    for s in gl.static_range(STAGES - 1 if WSM == 0 else STAGES):
        _gd_issue_tile(kv_desc, kv_s, bars, s, start + s * BN, s < n_tiles)

    # q: [16 x 640] fp8 in shared memory (five [16 x 128] boxes), scale per head. Q_LOAD 0 reads
    # q twice here (the amax, then the quantization); 1 quantizes the boxes loaded above. The
    # same arithmetic either way, so the two give bit-identical q.
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    q_s = gl.allocate_shared_memory(gl.float8e4nv, [5, 16, 128], q_sl)
    amax = gl.full([16], 1e-12, gl.float32, gl.SliceLayout(1, q_l))
    if QLM == 1:
        amax = gl.maximum(amax, gl.max(gl.abs(x0.to(gl.float32)), 1))
        amax = gl.maximum(amax, gl.max(gl.abs(x1.to(gl.float32)), 1))
        amax = gl.maximum(amax, gl.max(gl.abs(x2.to(gl.float32)), 1))
        amax = gl.maximum(amax, gl.max(gl.abs(x3.to(gl.float32)), 1))
        amax = gl.maximum(amax, gl.max(gl.abs(x4.to(gl.float32)), 1))
        q_scale = amax / 448.0
        q_s.index(0).store((x0.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
        q_s.index(1).store((x1.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
        q_s.index(2).store((x2.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
        q_s.index(3).store((x3.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
        q_s.index(4).store((x4.to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
    else:
        for c in gl.static_range(5):
            amax = gl.maximum(amax, gl.max(gl.abs(_gd_q_box(Q, b, c).to(gl.float32)), 1))
        q_scale = amax / 448.0
        for c in gl.static_range(5):
            q_s.index(c).store((_gd_q_box(Q, b, c).to(gl.float32) / q_scale[:, None]).to(gl.float8e4nv))
    if WSM != 0:  # the consumers read the q scale here (a worker partition takes no tensors)
        qs_s = gl.allocate_shared_memory(gl.float32, [16], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        qs_s.store(q_scale)
    fence_async_shared()
    _gd_cta_barrier()

    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    kv_scale = gl.load(KV_SCALE)
    if WSM == 0:
        col_scale = gl.convert_layout(q_scale, gl.SliceLayout(0, s_l)) * (kv_scale * sm_scale_log2)
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        p_s = gl.allocate_shared_memory(gl.float16, [BN, 16], p_sl)
        v16_s = _gd_alloc_v16(BN, V_PATH, V_HALVES)

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
            _gd_cta_barrier()
            nxt = i + STAGES - 1
            _gd_issue_tile(kv_desc, kv_s, bars, nxt % STAGES, start + nxt * BN, nxt < n_tiles)
            m_i, l_i, o0, o1, o2, o3 = _gd_tile(kv_s, stage * 5, q_s, p_s, v16_s, col_scale, start + i * BN, rows,
                                                end, half, m_i, l_i, o0, o1, o2, o3, BN, V_PATH, V_HALVES)
    elif WSM == 1:
        # One loader warp (24 registers) keeps the ring full; this warpgroup only consumes.
        m_i, l_i, o0, o1, o2, o3 = gl.warp_specialize([
            (_gd_ws_consume, (kv_s, q_s, qs_s, bars, empty, KV_SCALE, sm_scale_log2, start, end, n_tiles, half,
                              0, 1, BN, STAGES, V_PATH, V_HALVES)),
            (_gd_ws_loader, (kv_desc, kv_s, bars, empty, start, n_tiles, BN, STAGES)),
        ], [1], [24])
    else:  # WSM == 2
        # Two consumer warpgroups take alternate tiles, each with its own (m, l, O^T); the
        # worker one hands its state over in the ring slot of its own last tile, which no later
        # tile uses, and the default one merges it (_gd_ws_hand_over_views).
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(done.index(0), count=1)
        fence_async_shared()
        _gd_cta_barrier()
        m_i, l_i, o0, o1, o2, o3 = gl.warp_specialize([
            (_gd_ws_consume_merge, (kv_s, q_s, qs_s, bars, empty, done, KV_SCALE, sm_scale_log2, start, end,
                                    n_tiles, half, BN, STAGES, V_PATH, V_HALVES)),
            (_gd_ws_consume_hand_over, (kv_s, q_s, qs_s, bars, empty, done, KV_SCALE, sm_scale_log2, start, end,
                                        n_tiles, half, BN, STAGES, V_PATH, V_HALVES)),
            (_gd_ws_loader, (kv_desc, kv_s, bars, empty, start, n_tiles, BN, STAGES)),
        ], [4, 1], [240, 24])  # GD_WS_WORKER_REGS[2]: the second consumer warpgroup, the loader warp
        mbarrier.invalidate(done.index(0))

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
        if WSM != 0:
            mbarrier.invalidate(empty.index(s))

    # An empty split (more splits than its sequence has tiles) writes lse = -inf, O = 0.
    l_safe = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(0, o_l))
    scale = gl.full([16], 1.0, gl.float32, gl.SliceLayout(0, o_l)) * kv_scale
    if V_HALVES == 1:
        _gd_store_box(o0, 0, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
        _gd_store_box(o1, 1, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
        _gd_store_box(o2, 2, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
        _gd_store_box(o3, 3, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    else:
        _gd_store_box(o0, 2 * half, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
        _gd_store_box(o1, 2 * half + 1, l_safe, scale, b, split, OUT, PART_O, num_splits, SPLIT)
    if SPLIT:
        # Both V halves store the same lse (the same S and softmax code on the same data):
        # each half's reducer then reads it after its own half's arrivals.
        h = gl.arange(0, 16, layout=gl.SliceLayout(0, s_l))
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(PART_LSE + (b * num_splits + split) * 16 + h, lse)
        if REDUCE != 0:
            _gd_reduce_in_kernel(PART_O, PART_LSE, OUT, COUNT, FLAG, b, split, half, num_splits,
                                 REDUCE, V_HALVES, NS)


@_gd_jit
def _gd_ws_loader(kv_desc, kv_s, bars, empty, start, n_tiles, BN: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition (one warp): the kernel issued tiles 0 .. STAGES - 1; tile i goes
    into slot i % STAGES once the consumer of tile i - STAGES has released it. empty[s]
    completes one phase per release; the k-th refill of a slot waits for phase k - 1."""
    for i in range(STAGES, n_tiles):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        _gd_issue_tile(kv_desc, kv_s, bars, stage, start + i * BN, True)


@_gd_jit
def _gd_ws_consume(kv_s, q_s, qs_s, bars, empty, KV_SCALE, sm_scale_log2, start, end, n_tiles, half,
                   FIRST: gl.constexpr, STEP: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                   V_PATH: gl.constexpr, V_HALVES: gl.constexpr):
    """A consumer warpgroup: tiles FIRST, FIRST + STEP, ... of the program, each waited for in
    the ring, computed as in the kernel without a loader, then released to the loader.
    Returns (m, l, o0, o1, o2, o3) of those tiles (l = 0, m = -inf if it had none)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    col_scale = qs_s.load(gl.SliceLayout(0, s_l)) * (gl.load(KV_SCALE) * sm_scale_log2)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
    p_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    p_s = gl.allocate_shared_memory(gl.float16, [BN, 16], p_sl)
    v16_s = _gd_alloc_v16(BN, V_PATH, V_HALVES)
    m_i = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(0, s_l))
    l_i = gl.zeros([16], gl.float32, gl.SliceLayout(0, s_l))
    o0 = gl.zeros([128, 16], gl.float32, o_l)
    o1 = gl.zeros([128, 16], gl.float32, o_l)
    o2 = gl.zeros([128, 16], gl.float32, o_l)
    o3 = gl.zeros([128, 16], gl.float32, o_l)
    for i in range(FIRST, n_tiles, STEP):
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        m_i, l_i, o0, o1, o2, o3 = _gd_tile(kv_s, stage * 5, q_s, p_s, v16_s, col_scale, start + i * BN, rows,
                                            end, half, m_i, l_i, o0, o1, o2, o3, BN, V_PATH, V_HALVES)
        # Every warp's generic reads of the slot (the V path) come before the loader's TMA
        # rewrites it (async proxy): fence, warpgroup barrier, one arrival.
        fence_async_shared()
        _gd_cta_barrier()
        mbarrier.arrive(empty.index(stage))
    return m_i, l_i, o0, o1, o2, o3


@_gd_jit
def _gd_ws_hand_over_views(kv_s, n_tiles, BN: gl.constexpr, STAGES: gl.constexpr):
    """WS 2: where the worker consumer leaves its state, as fp32 views of the fp8 ring. Its last
    tile is the last odd index (n_tiles >= 2), in slot `slot`; no later tile maps to that slot
    (the next would be that index + STAGES >= n_tiles), so once the worker has read the slot
    it is scratch: O^T boxes c = 0..3 at [128 x 16] entry slot * 5 * BN / 64 + c (8 KB each),
    m and l after them (64-byte rows slot * 10 * BN + 512 and + 1)."""
    last = (n_tiles - 2) // 2 * 2 + 1
    slot = last % STAGES
    o_view = _gd_smem_reinterpret(kv_s, gl.float32, [STAGES * 5 * BN // 64, 128, 16],
                                  gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ml_view = _gd_smem_reinterpret(kv_s, gl.float32, [STAGES * 10 * BN, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return o_view, ml_view, slot * (5 * BN // 64), slot * 10 * BN + 512


@_gd_jit
def _gd_ws_consume_hand_over(kv_s, q_s, qs_s, bars, empty, done, KV_SCALE, sm_scale_log2, start, end, n_tiles,
                             half, BN: gl.constexpr, STAGES: gl.constexpr, V_PATH: gl.constexpr,
                             V_HALVES: gl.constexpr):
    """WS 2's worker consumer: the odd tiles, then (if it had any) its (m, l, O^T) into its last
    tile's ring slot for the default partition, and one arrival on `done`."""
    m_i, l_i, o0, o1, o2, o3 = _gd_ws_consume(kv_s, q_s, qs_s, bars, empty, KV_SCALE, sm_scale_log2, start, end,
                                              n_tiles, half, 1, 2, BN, STAGES, V_PATH, V_HALVES)
    if n_tiles >= 2:
        o_view, ml_view, o_at, ml_at = _gd_ws_hand_over_views(kv_s, n_tiles, BN, STAGES)
        # Every warp of this partition read its last slot (the tile's release barrier above).
        ml_view.index(ml_at).store(m_i)
        ml_view.index(ml_at + 1).store(l_i)
        o_view.index(o_at).store(o0)
        o_view.index(o_at + 1).store(o1)
        if V_HALVES == 1:
            o_view.index(o_at + 2).store(o2)
            o_view.index(o_at + 3).store(o3)
        _gd_cta_barrier()  # every warp's stores, then one (release) arrival
        mbarrier.arrive(done.index(0))


@_gd_jit
def _gd_ws_merge_box(o, o_view, at, a0, a1):
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    return o * a0[None, :] + o_view.index(at).load(o_l) * a1[None, :]


@_gd_jit
def _gd_ws_consume_merge(kv_s, q_s, qs_s, bars, empty, done, KV_SCALE, sm_scale_log2, start, end, n_tiles, half,
                         BN: gl.constexpr, STAGES: gl.constexpr, V_PATH: gl.constexpr, V_HALVES: gl.constexpr):
    """WS 2's default consumer: the even tiles, then the worker consumer's state merged in
    (the two partial softmaxes rescaled to their common max). With n_tiles < 2 the worker
    had no tile and there is nothing to merge."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    m_i, l_i, o0, o1, o2, o3 = _gd_ws_consume(kv_s, q_s, qs_s, bars, empty, KV_SCALE, sm_scale_log2, start, end,
                                              n_tiles, half, 0, 2, BN, STAGES, V_PATH, V_HALVES)
    if n_tiles >= 2:  # both consumers had a tile: m_i and m1 are finite
        mbarrier.wait(done.index(0), 0)
        o_view, ml_view, o_at, ml_at = _gd_ws_hand_over_views(kv_s, n_tiles, BN, STAGES)
        m1 = ml_view.index(ml_at).load(gl.SliceLayout(0, s_l))
        l1 = ml_view.index(ml_at + 1).load(gl.SliceLayout(0, s_l))
        m = gl.maximum(m_i, m1)
        a0 = gl.exp2(m_i - m)
        a1 = gl.exp2(m1 - m)
        l_i = l_i * a0 + l1 * a1
        m_i = m
        a0 = gl.convert_layout(a0, gl.SliceLayout(0, o_l))
        a1 = gl.convert_layout(a1, gl.SliceLayout(0, o_l))
        o0 = _gd_ws_merge_box(o0, o_view, o_at, a0, a1)
        o1 = _gd_ws_merge_box(o1, o_view, o_at + 1, a0, a1)
        if V_HALVES == 1:
            o2 = _gd_ws_merge_box(o2, o_view, o_at + 2, a0, a1)
            o3 = _gd_ws_merge_box(o3, o_view, o_at + 3, a0, a1)
    return m_i, l_i, o0, o1, o2, o3


@_gd_jit
def _gd_reduce_in_kernel(PART_O, PART_LSE, OUT, COUNT, FLAG, b, split, half, num_splits,
                         REDUCE: gl.constexpr, V_HALVES: gl.constexpr, NS: gl.constexpr):
    """Combine sequence b's partials of this V half (512 / V_HALVES dims) in the kernel.

    One arrival counter (and, for REDUCE 2, one sense flag) per (sequence, V half), zero
    before the first call; each call leaves its counter at zero again. Every thread's partial
    stores come before one gpu-scope release by the CTA (barrier, then the atomic: CUTLASS's
    semaphore pattern); partials are read back through L2 (.cg), never a stale L1 line.
    REDUCE 1: the last program to arrive reduces all the half's dims. REDUCE 2: a
    sense-reversing barrier (the flag flips once per call), then program `split` reduces
    slices split, split + num_splits, ... of the half's NS slices."""
    VD: gl.constexpr = 512 // V_HALVES
    RW: gl.constexpr = VD // NS  # a [NS x 16 x RW] tile is 16 x VD fp32 elements
    idx = b * V_HALVES + half
    _gd_cta_barrier()
    if REDUCE == 1:
        arrived = gl.atomic_add(COUNT + idx, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            gl.atomic_xchg(COUNT + idx, 0, sem="relaxed")  # ready for the next call, no memset
            for d0 in range(half * VD, half * VD + VD, RW):
                _gd_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, NS, RW)
    else:
        sense = gl.atomic_add(FLAG + idx, 0, sem="relaxed")
        arrived = gl.atomic_add(COUNT + idx, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            gl.atomic_xchg(COUNT + idx, 0, sem="relaxed")
            gl.atomic_xchg(FLAG + idx, 1 - sense, sem="release")
        else:
            while gl.atomic_add(FLAG + idx, 0, sem="acquire") == sense:
                pass
        _gd_cta_barrier()
        for d0 in range(half * VD + split * RW, half * VD + VD, num_splits * RW):
            _gd_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, NS, RW)


@_gd_jit
def _gd_reduce_slice(PART_O, PART_LSE, OUT, b, num_splits, d0, NS: gl.constexpr, W: gl.constexpr):
    """out[b, :, d0:d0+W] = sum_s 2^(lse_s - m) O_s / sum_s 2^(lse_s - m), every split in one
    [NS x 16 x W] tile (a loop over splits would wait one L2 round trip per split)."""
    r_l: gl.constexpr = _gd_reduce_layout(NS, W)
    sh_l: gl.constexpr = gl.SliceLayout(2, r_l)  # [NS x 16]
    hd_l: gl.constexpr = gl.SliceLayout(0, r_l)  # [16 x W]
    s = gl.arange(0, NS, layout=gl.SliceLayout(1, sh_l))
    h = gl.arange(0, 16, layout=gl.SliceLayout(0, sh_l))
    live = s < num_splits
    row = (b * num_splits + s[:, None]) * 16 + h[None, :]
    lse = gl.load(PART_LSE + row, mask=live[:, None], other=float("-inf"), cache_modifier=".cg")
    w = gl.exp2(lse - gl.max(lse, 0)[None, :])  # an empty split has lse -inf: weight 0
    w = w / gl.sum(w, 0)[None, :]
    d = d0 + gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, r_l)))
    part = gl.load(PART_O + row[:, :, None] * 512 + d[None, None, :], mask=live[:, None, None], other=0.0,
                   cache_modifier=".cg")
    o = gl.sum(part * w[:, :, None], 0)
    ho = gl.arange(0, 16, layout=gl.SliceLayout(1, hd_l))
    do = d0 + gl.arange(0, W, layout=gl.SliceLayout(0, hd_l))
    gl.store(OUT + (b * 16 + ho[:, None]) * 512 + do[None, :], o.to(gl.bfloat16))


@_gd_jit
def _gd_issue_tile(kv_desc, kv_s, bars, stage, row, pred):
    """TMA the [BN x 576] tile at `row` into ring stage `stage` (five boxes, one barrier)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, 5 * kv_desc.block_type.nbytes, pred)
    for c in gl.static_range(5):
        _gd_tma_load(kv_desc, [row, c * 128], bar, kv_s.index(stage * 5 + c), pred)


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


def gd_ws_smem_extra(block_n: int, num_stages: int, v_path: str, v_halves: int = 1, ws: int = 0) -> int:
    """Shared memory a warp-specialized kernel (ws 1, 2) allocates beyond ws 0's. ws 1: the
    release barriers (8 B a stage, padded to 16), the q scale (64 B), 4 B of partition state.
    ws 2: the second consumer's P^T and fp16 V box(es), the release barriers (8 B a stage, 16
    more with an odd count), and 336 B of q scale, hand-over barrier, captures and state (its
    hand-over itself reuses a ring slot). Fitted to Triton 3.6's figures at 2 to 5 stages
    (tests/test_gluon_decode.py pins them)."""
    if ws == 0:
        return 0
    bars = 8 * num_stages + 8 * (num_stages % 2)
    if ws == 1:
        return bars + 64 + 4
    v16_boxes = GD_V_BOXES // v_halves if v_path == "ss16a" else 0 if v_path == "rs8" else 1
    return block_n * 16 * 2 + v16_boxes * block_n * GD_BOX * 2 + bars + 8 * (num_stages % 2) + 336


def gd_smem_bytes(block_n: int, num_stages: int, v_path: str, v_halves: int = 1, ws: int = 0) -> int:
    """Shared memory the decode kernel allocates: the fp8 ring, q, P^T, the fp16 V box(es;
    ss16a: one per V box the program multiplies), the barriers, and 256 B the compiler adds
    (backends/gluon_fused.py's _gf_smem_bytes is the same figure for v_halves 1, checked
    against ptxas there); plus gd_ws_smem_extra for the warp-specialized kernels."""
    # rs8 never touches its one fp16 box buffer, and the compiler drops it.
    v16_boxes = GD_V_BOXES // v_halves if v_path == "ss16a" else 0 if v_path == "rs8" else 1
    return (num_stages * GD_BOXES * block_n * GD_BOX + GD_BOXES * 16 * GD_BOX + block_n * 16 * 2
            + v16_boxes * block_n * GD_BOX * 2 + 8 * num_stages + 256
            + gd_ws_smem_extra(block_n, num_stages, v_path, v_halves, ws))


def gd_ctas_per_sm(block_n: int, num_stages: int, v_path: str, v_halves: int = 1, ws: int = 0) -> int:
    """Decode CTAs one SM holds at once: shared memory bound (GD_SMEM_PER_SM), and registers
    (GD_WS_CTAS_PER_SM_BY_REGS: ws 2's 12 warps at 168 registers take the whole file)."""
    smem = gd_smem_bytes(block_n, num_stages, v_path, v_halves, ws) + GD_SMEM_PER_CTA_RESERVED
    return min(GD_SMEM_PER_SM // smem, GD_WS_CTAS_PER_SM_BY_REGS[ws])


def gd_check_launch(batch: int, num_splits: int, *, block_n: int, num_stages: int, v_path: str,
                    reduce: str = "launch", v_halves: int = 1, sm_count: int | None = None, ws: int = 0) -> None:
    """Refuse (ValueError, with the fix) a reduction, V split or warp specialization this
    kernel cannot run: an unknown mode, in-kernel reduction past GD_MAX_INKERNEL_SPLITS
    splits, or a spin barrier over a grid that the GPU cannot hold resident at once (the
    spinning programs would wait for programs that never start)."""
    if reduce not in GD_REDUCE_CODES:
        raise ValueError(f"reduce must be one of {', '.join(GD_REDUCE_CODES)}; got {reduce!r}")
    if v_halves not in (1, 2):
        raise ValueError(f"v_halves must be 1 or 2, got {v_halves}")
    if ws not in GD_WS_MODES:
        raise ValueError(f"ws must be one of {', '.join(map(str, GD_WS_MODES))} (0 none, 1 a loader warp, 2 a "
                         f"loader warp and two consumer warpgroups), got {ws!r}")
    if reduce == "launch" or num_splits == 1:
        return
    if num_splits > GD_MAX_INKERNEL_SPLITS:
        raise ValueError(f"reduce={reduce!r} supports at most {GD_MAX_INKERNEL_SPLITS} splits, got "
                         f"{num_splits}; use reduce='launch'")
    if reduce == "spin":
        if not sm_count:
            raise ValueError("reduce='spin' needs sm_count (the GPU's SMs) to check that the grid is resident")
        per_sm = gd_ctas_per_sm(block_n, num_stages, v_path, v_halves, ws)
        programs = batch * num_splits * v_halves
        if programs > sm_count * per_sm:
            raise ValueError(
                f"reduce='spin' needs the whole grid resident at once: {batch} x {num_splits} splits x "
                f"{v_halves} V halves = {programs} programs > {sm_count} SMs x {per_sm} CTAs per SM "
                f"(block_n {block_n}, {num_stages} stages, v_path {v_path}, ws {ws}); use reduce='last' or "
                "fewer splits")


def gluon_decode(q, kv_desc, kv_scale, kv_indptr, out, part_o, part_lse, *, num_splits: int,
                 block_n: int, num_stages: int, v_path: str, sm_scale_log2: float,
                 reduce: str = "launch", v_halves: int = 1, count=None, flag=None,
                 sm_count: int | None = None, ws: int = 0, q_load: str = "twice"):
    """Launch the decode (and, with reduce "launch", the split reduction when num_splits > 1);
    buffers come from the caller. q (batch, 16, 576) bf16; kv_desc from gd_kv_descriptor;
    kv_scale (1,) fp32; part_o (>= batch*num_splits*16*512) fp32 or bf16 (GD_PART_DTYPES:
    the partials are stored and read in its type); part_lse
    (>= batch*num_splits*16) fp32.
    reduce: "launch" (a second launch), "last" (the last split to arrive reduces; needs
    count) or "spin" (a spin barrier, then every split reduces a slice; needs count, flag and
    sm_count, and a grid the GPU holds at once: gd_check_launch). count and flag: int32,
    >= batch * v_halves elements, zero before the first call (each call leaves them ready for
    the next). v_halves 2: two programs per (split, sequence), each multiplying half the V
    dims. ws: warp specialization (GD_WS_MODES; 1 a loader warp, 2 also a second consumer
    warpgroup), launched with GD_WS_MAXNREG[ws] registers per thread. q_load: the q prologue
    (GD_Q_LOADS). Returns the compiled decode kernel (for its register report)."""
    if GD_UNAVAILABLE is not None:
        raise RuntimeError(GD_UNAVAILABLE)
    batch = q.shape[0]
    split = num_splits > 1
    gd_check_launch(batch, num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path,
                    reduce=reduce, v_halves=v_halves, sm_count=sm_count, ws=ws)
    if q_load not in GD_Q_LOADS:
        raise ValueError(f"q_load must be one of {', '.join(GD_Q_LOADS)}; got {q_load!r}")
    if split and part_o.dtype not in GD_PART_DTYPES.values():
        raise ValueError(f"part_o must be float32 or bfloat16 (GD_PART_DTYPES), not {part_o.dtype}")
    red = GD_REDUCE_CODES[reduce] if split else 0
    if red:
        need = batch * v_halves
        for name, buf in (("count", count), ("flag", flag if red == 2 else count)):
            if buf is None or buf.dtype != torch.int32 or buf.numel() < need:
                raise ValueError(f"reduce={reduce!r} needs {name}: a zeroed int32 tensor of >= {need} elements")
    # The counters are never touched by the "launch" reduction: kv_indptr stands in for them.
    count = count if red else kv_indptr
    flag = flag if red == 2 else count
    # ws 0 and q_load "twice" launch exactly as before their constexprs existed (the defaults).
    ws_options = dict(WS=ws, maxnreg=GD_WS_MAXNREG[ws]) if ws else {}
    if GD_Q_LOADS[q_load]:
        ws_options["Q_LOAD"] = GD_Q_LOADS[q_load]
    compiled = _gd_decode_kernel[(num_splits * v_halves, batch)](
        kv_desc, q, kv_scale, kv_indptr, out, part_o, part_lse, sm_scale_log2, num_splits, count, flag,
        BN=block_n, STAGES=num_stages, V_PATH=GD_V_PATHS[v_path], SPLIT=split, REDUCE=red,
        V_HALVES=v_halves, NS=max(2, triton.next_power_of_2(num_splits)) if red else 2, num_warps=4,
        **ws_options,
    )
    if split and not red:
        gd_reduce(part_o, part_lse, out, num_splits)
    return compiled
