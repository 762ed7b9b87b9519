"""FlashMLA's dense decode (package sgl-flash-mla, module `flash_mla`, NVIDIA SM90).

Written against sgl-flash-mla 1.0.0 (flash_mla/flash_mla_interface.py). Dense decoding lives
on its legacy side only (`use_legacy=True`), with two kernels: bf16 q x bf16 KV, and fp8 q
x fp8 KV with per-tensor `descale_q` / `descale_k` (fp32, shape (1,)). There is no bf16 q x
fp8 KV kernel, so fp8 variants quantize q on every call, with a scale computed on the
device (fp8_dynamic) or calibrated by the sweep (fp8_static, `q_amax`).

FlashMLA pages are 64 tokens (`page_block_size must be 64`). The leaderboard's cache is one
contiguous (total_kv, 1, 576) tensor, so it is viewed as (total_kv / 64, 64, 1, 576) with
block_table[b] = the pages of sequence b (an arange), which needs kv_len % 64 == 0.

The split-KV schedule (`get_mla_decoding_metadata`) is computed once in `build` and reused;
FlashMLA allocates its own output per call (its API takes no `out`), and the runner
returns that tensor, reshaped, rather than paying a copy.

Serving call (`build_serving`), as read in sgl-flash-mla 1.0.0's wheel (flash_mla_interface.py)
and the sources it builds (sgl-project/FlashMLA branch `sgl`: csrc/api/dense_decode.h,
csrc/sm90/decode/dense/splitkv_mla.cuh, csrc/extension/sm90/dense_fp8/*):
- paged KV of 64-token pages only, read through block_table + seq_lens as given; no
  contiguous layout (a contiguous cache is not cut into pages of a sequence's own);
- q is (batch, s_q, h_q, 576): one q_len per call (total_q / batch), any h_q (rows are
  s_q x h_q packed into 64-row tiles); `causal=True` masks new token i to the first
  seq_len - (s_q - 1 - i) tokens in both kernels (get_mask_len in splitkv_mla.cuh,
  col_limit_right in the fp8 flash_fwd_mla_kernel.h), our reference's alignment;
- the schedule is computed on the device from seq_lens by get_mla_decoding_metadata (one
  small launch per call, its own for dense fp8), so nothing is read on the host and a CUDA
  graph can hold the call; FlashMLA still allocates its output and split scratch per call
  (torch.empty: the caching allocator, or the graph's pool when captured), so the runner
  returns FlashMLA's output tensor, not a buffer of its own;
- fp8 KV needs fp8 q: q is quantized by kernels/q_quant.QQuantizer (per tensor, on the
  device), as the leaderboard build does. The fp8 kernel also rounds the softmax
  probabilities to fp8 before P.V (flash_fwd_mla_kernel.h), so it is less exact than the
  bf16 path.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
    CORE_HEADS,
    NUM_HEADS,
    NUM_KV_HEADS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    CallSpec,
    Capabilities,
    Shape,
    Variant,
    check_serving_layout,
    check_serving_spec,
    tensor_sig,
    vendor_is_cpu_fake,
)
from mla_tune.kernels.launch import LaunchReplay
from mla_tune.kernels.q_quant import QQuantizer

NAME = "flashmla"

_FM_PAGE = 64  # FlashMLA's only page (block) size
_FM_PAIRS = {"bf16": ("bf16",), "fp8": ("fp8_dynamic", "fp8_static")}  # KV -> q modes with a kernel

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    q_modes=("bf16", "fp8_dynamic", "fp8_static"),
    serving=True,
    contiguous=False,  # 64-token pages only (the leaderboard's uniform batch is viewed as pages)
    page_sizes=(_FM_PAGE,),
    heads=CORE_HEADS,  # any h_q: s_q x h_q rows share 64-row tiles
    max_q_len=4,  # the range tested here; the kernels take longer s_q too
    mixed_q_len=False,  # q is (batch, q_len, heads, 576): one q_len per call
    graph_safe=True,  # its split schedule is computed on the device from seq_lens
    lse=True,  # softmax_lse, natural log, (batch, h_q, s_q): viewed as (total_q, heads)
    platforms=(("cuda", "sm_90"),),
    vendor="sgl-flash-mla",
    precompile=True,
)


def unavailable_reason() -> str | None:
    try:
        import flash_mla
    except (ImportError, RuntimeError, OSError) as exc:
        return f"FlashMLA cannot be imported ({type(exc).__name__}: {exc}); install sgl-flash-mla (mla-tune[nvidia])."
    if not hasattr(flash_mla, "get_mla_decoding_metadata"):
        return "This flash_mla has no get_mla_decoding_metadata; install sgl-flash-mla 1.0.0."
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is not None and not has_legacy():
        return "This flash_mla was built without its legacy kernels, which hold dense decoding."
    if vendor_is_cpu_fake(flash_mla):
        return None
    if torch.version.hip or not torch.cuda.is_available():
        return "FlashMLA needs an NVIDIA GPU, and this process sees none."
    if torch.cuda.get_device_capability() != (9, 0):
        return "FlashMLA's dense decode kernels run on SM90 (Hopper) only."
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """bf16 x bf16 and fp8 x fp8 variants from the `flashmla:` config section, on SM90,
    for kv_len a multiple of the 64-token page."""
    if platform.is_hip or platform.arch != "sm_90" or shape.kv_len % _FM_PAGE:
        return []
    kvs = space.get("kv", ["bf16", "fp8"])
    qs = space.get("q", ["bf16", "fp8_dynamic", "fp8_static"])
    for key, values, known in (("kv", kvs, ("bf16", "fp8")), ("q", qs, ("bf16", "fp8_dynamic", "fp8_static"))):
        if not isinstance(values, list) or any(v not in known for v in values):
            raise ValueError(f"flashmla search space: {key} must be a list of {', '.join(known)}, got {values!r}")
    return [Variant.make(NAME, kv=kv, q=q) for kv in kvs for q in qs if q in _FM_PAIRS[kv]]


def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter, or a (q, KV) pair FlashMLA has no
    kernel for (names and values only; _fm_validate adds the 64-token page rule)."""
    check_variant_rules(variant, PARAM_RULES[NAME])  # names, choices, q_amax: backends/params.py
    kv, q = variant.get("kv"), variant.get("q")
    if q not in _FM_PAIRS[kv]:
        raise ValueError(
            f"flashmla: q={q} is not allowed with kv={kv}: FlashMLA's dense decode reads bf16 q "
            "with bf16 KV, or fp8 q (fp8_dynamic / fp8_static) with fp8 KV"
        )


def _fm_validate(variant: Variant, shape: Shape) -> None:
    validate(variant)
    if shape.kv_len % _FM_PAGE:
        raise ValueError(
            f"{variant}: FlashMLA reads 64-token pages, and kv_len {shape.kv_len} is not a "
            "multiple of 64; use another backend for this shape"
        )


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out at softmax scale `sm_scale`
    (FlashMLA's softmax_scale)."""
    _fm_validate(variant, shape)
    sm_scale = float(sm_scale)
    import flash_mla

    device = torch.device(device)
    batch, kv_len, total_kv = shape.batch, shape.kv_len, shape.total_kv
    pages_per_seq, num_pages = kv_len // _FM_PAGE, total_kv // _FM_PAGE
    fp8 = variant.get("kv") == "fp8"
    block_table = torch.arange(num_pages, dtype=torch.int32).view(batch, pages_per_seq).to(device)
    cache_seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    sched = flash_mla.get_mla_metadata()[0]
    sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
        cache_seqlens, NUM_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, h_q=NUM_HEADS,
        is_fp8_kvcache=fp8, use_legacy=True,
    )
    # One launch (static scale) or two (dynamic), instead of 3-7 torch ops per call.
    quantize = QQuantizer(variant.get("q"), batch, device, torch.float8_e4m3fn, variant.get("q_amax")) if fp8 else None

    def run_flash_mla(q, kv_data, qo_indptr, kv_indptr):
        kv, kv_scale = kv_data["fp8"] if fp8 else (kv_data["bf16"], None)
        if q.shape[0] != batch or kv.shape[0] != total_kv:
            raise ValueError(
                f"this FlashMLA runner was built for {shape} (batch {batch}, {total_kv} KV "
                f"tokens); got batch {q.shape[0]} with {kv.shape[0]} tokens: build one for that shape"
            )
        pages = kv.view(num_pages, _FM_PAGE, NUM_KV_HEADS, QK_DIM)
        if fp8:
            q8, q_scale = quantize(q)
            out, _lse = flash_mla.flash_mla_with_kvcache(
                q8.view(batch, 1, NUM_HEADS, QK_DIM), pages, block_table, cache_seqlens, V_DIM, sched,
                softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True, use_legacy=True,
                descale_q=q_scale, descale_k=kv_scale,
            )
        else:
            out, _lse = flash_mla.flash_mla_with_kvcache(
                q.view(batch, 1, NUM_HEADS, QK_DIM), pages, block_table, cache_seqlens, V_DIM,
                sched, softmax_scale=sm_scale, causal=False, is_fp8_kvcache=False, use_legacy=True,
            )
        return out.view(batch, NUM_HEADS, V_DIM)

    # fp8_static: the quantizer counts q elements beyond the calibrated q_amax on the device
    # (the runtime's q_saturation() sums these counters; nothing here syncs)
    run_flash_mla.q_saturation = quantize.saturated if variant.get("q") == "fp8_static" else None
    return run_flash_mla



# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = ("kv", "q")


# ------------------------------------------------------------------------ serving call
def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """bf16 q over bf16 KV; q quantized per call on the device (fp8_dynamic) over fp8 KV,
    the only q FlashMLA's fp8 kernel reads. Nothing here depends on the platform."""
    _fm_serving_check(spec)
    return Variant.make(NAME, kv=spec.kv_format, q="bf16" if spec.kv_format == "bf16" else "fp8_dynamic")


def _fm_serving_check(spec: CallSpec, variant: Variant | None = None) -> None:
    check_serving_spec(NAME, spec, CAPABILITIES, variant)


class _FmQuantizer:
    """QQuantizer for (total_q, heads, 576) q: per-tensor quantization is blind to how q is
    cut into rows, so q is read as (total_q * heads / 16) rows of (16, 576) (heads are
    multiples of 16). One set of buffers, grown (at least doubling) when a call brings more
    rows than any before; a call of fewer rows uses views of them."""

    def __init__(self, mode: str, q_amax, device):
        self.mode, self.q_amax, self.device = mode, q_amax, device
        self.saturated = torch.zeros((1,), dtype=torch.int64, device=device)  # fp8_static's count
        self.base: QQuantizer | None = None
        self.views: dict[int, QQuantizer] = {}

    def for_rows(self, rows: int) -> QQuantizer:
        """The quantizer of `rows` rows of (16, 576) (views of the shared buffers)."""
        quantize = self.views.get(rows)
        if quantize is None:
            if self.base is None or rows > self.base.batch:
                capacity = max(rows, 2 * self.base.batch) if self.base is not None else rows
                self.base = QQuantizer(self.mode, capacity, self.device, torch.float8_e4m3fn, self.q_amax)
                self.base.saturated = self.saturated
                self.views = {}
            quantize = copy.copy(self.base)  # shares scale and counter; row buffers cut to `rows`
            quantize.batch, quantize.q8, quantize.partial = rows, self.base.q8[:rows], self.base.partial[:rows]
            self.views[rows] = quantize
        return quantize

    def __call__(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = q.shape[0] * q.shape[1] // NUM_HEADS
        q8, scale = self.for_rows(rows)(q.view(rows, NUM_HEADS, QK_DIM))
        return q8.view(q.shape), scale


class _FmOps(NamedTuple):
    """FlashMLA's dense legacy ops (OpOverloads), called directly: see _fm_direct_ops."""

    decode_bf16: Any
    decode_fp8: Any
    schedule_bf16: Any
    schedule_fp8: Any


def _fm_direct_ops() -> _FmOps | None:
    """FlashMLA's dense decode ops as OpOverloads (bf16 decode, fp8 decode, bf16 schedule,
    fp8 schedule), or None where this flash_mla has no `get_ops` or one is missing (then
    flash_mla_with_kvcache and get_mla_decoding_metadata are called). For dense legacy
    decoding with a schedule from get_mla_decoding_metadata, sgl-flash-mla 1.0.0's
    flash_mla_with_kvcache only asserts its arguments and calls `dense_decode_fwd` (bf16)
    or `fwd_kvcache_mla_fp8` (fp8) of get_ops(use_legacy=True) with them, in this order,
    and get_mla_decoding_metadata(..., use_legacy=True) returns the tuple of
    `get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q, is_fp8_kvcache,
    topk)` (bf16: is_fp8_kvcache False, topk None) or, for dense fp8,
    `get_mla_decoding_metadata_dense_fp8(seqlens_k, num_q_tokens_per_head_k, h_k)`
    (flash_mla_interface.py); calling the op skips the wrapper's host time and changes
    nothing else (the op checks shapes and dtypes itself)."""
    try:
        from flash_mla.flash_mla_interface import get_ops

        legacy = get_ops(True)
        return _FmOps(legacy.dense_decode_fwd.default, legacy.fwd_kvcache_mla_fp8.default,
                      legacy.get_mla_decoding_metadata.default, legacy.get_mla_decoding_metadata_dense_fp8.default)
    except (ImportError, AttributeError, RuntimeError):
        return None


def build_serving(variant: Variant, spec: CallSpec, device):
    """A runner(q, qo_indptr, kv, kv_scale, *, block_table, seq_lens) -> (total_q, heads,
    512) bf16 for calls of `spec` (paged KV of 64-token pages, one q_len per call): it
    computes FlashMLA's schedule on the device from seq_lens every call and reads no device
    tensor on the host, so a CUDA graph can hold it. The output is FlashMLA's own tensor
    (it takes no `out`), a new one per call outside a graph.

    `runner.step(qo_indptr, *, block_table, seq_lens, q_lens_host=None, ...)` returns the
    step's per-layer call `layer(q, kv, kv_scale)`: the schedule is computed once per step
    (eager: at the step when its q_len is known, from q_lens_host or max_q_len 1, else at
    the first layer; spec.graph: at the first layer, and again at the first layer captured
    in a CUDA graph, so that the graph computes each replay's schedule itself and the
    step's update enqueues nothing), the first layer is checked in full, later layers whose
    q, kv and kv_scale look as the first's did (core.tensor_sig) call FlashMLA's op
    directly, with fp8 q quantized by replayed launches (kernels/launch.py). The softmax
    scale is spec.sm_scale; with spec.return_lse a call returns (out, lse): FlashMLA's
    softmax_lse (natural log, (batch, h_q, s_q)) as (total_q, heads) float32."""
    validate(variant)
    _fm_serving_check(spec, variant)
    import flash_mla

    device = torch.device(device)
    heads, fp8 = spec.heads, spec.kv_format == "fp8"
    scale, with_lse = float(spec.sm_scale), spec.return_lse
    quantize = _FmQuantizer(variant.get("q"), variant.get("q_amax"), device) if fp8 else None
    ops = _fm_direct_ops()

    def check(q, qo_indptr, kv, kv_indptr, block_table, seq_lens) -> int:
        """The call's q_len, after checking its shapes and dtypes."""
        page_size = check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens)
        batch, total_q = qo_indptr.shape[0] - 1, q.shape[0]
        if page_size != _FM_PAGE:
            raise ValueError(f"flashmla reads paged KV of {_FM_PAGE}-token pages (block_table + seq_lens); "
                             f"got {'contiguous KV' if page_size == 0 else f'pages of {page_size}'}")
        if q.dim() != 3 or q.shape[1] != heads or q.shape[2] != QK_DIM or q.dtype != torch.bfloat16:
            raise ValueError(f"flashmla: this runner serves bf16 q of {heads} heads, (total_q, {heads}, "
                             f"{QK_DIM}); got {q.dtype} {tuple(q.shape)}")
        if (kv.dtype == torch.float8_e4m3fn) != fp8 or (not fp8 and kv.dtype != torch.bfloat16):
            raise ValueError(f"flashmla: this runner reads {spec.kv_format} KV "
                             f"({'float8_e4m3fn' if fp8 else 'bfloat16'}), got {kv.dtype}")
        # One q_len per call, from the shapes: FlashMLA's q is (batch, q_len, heads, 576).
        q_len = total_q // batch
        if q_len * batch != total_q or not 1 <= q_len <= spec.max_q_len:
            raise ValueError(f"flashmla needs every sequence to bring the same q_len (1..{spec.max_q_len}); "
                             f"{total_q} new tokens over {batch} sequences is not that")
        return q_len

    fixed: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def schedule(seq_lens, q_len: int):
        """FlashMLA's split schedule (tile metadata, split counts): one launch on the device.
        With spec.graph, copied into buffers this runner keeps per shape, so that the layers
        read it from the same addresses every step; a graph step launches it in its first
        captured layer (_FmStep), so the graph recomputes it at each replay. An eager
        runner's layers read it as made (two copies fewer a step: 14-34 us of host time on
        an H100's host, docs/perf.md 3.2)."""
        rows = q_len * heads // NUM_KV_HEADS
        if ops is None:
            meta, splits = flash_mla.get_mla_decoding_metadata(
                seq_lens, rows, NUM_KV_HEADS, h_q=heads, is_fp8_kvcache=fp8, use_legacy=True)
        elif fp8:
            meta, splits = ops.schedule_fp8(seq_lens, rows, NUM_KV_HEADS)
        else:
            meta, splits = ops.schedule_bf16(seq_lens, rows, NUM_KV_HEADS, heads, False, None)
        if not spec.graph:
            return meta, splits
        key = (tuple(meta.shape), meta.dtype, tuple(splits.shape), splits.dtype)
        if key not in fixed:
            fixed[key] = (torch.empty_like(meta), torch.empty_like(splits))
        meta_buf, splits_buf = fixed[key]
        meta_buf.copy_(meta)
        splits_buf.copy_(splits)
        return meta_buf, splits_buf

    def attend(q4, pages, block_table, seq_lens, sched, q_len, q_scale=None, kv_scale=None):
        """FlashMLA's decode of q4 (batch, q_len, heads, 576), bf16 or fp8, with `sched`:
        (total_q, heads, 512) out, or (out, lse (total_q, heads)) with spec.return_lse."""
        meta, splits = sched
        if ops is not None:
            if fp8:
                result = ops.decode_fp8(q4, pages, V_DIM, seq_lens, block_table, scale, q_len > 1, meta, splits,
                                        q_scale, kv_scale)
            else:
                result = ops.decode_bf16(q4, pages, V_DIM, seq_lens, block_table, scale, q_len > 1, meta, splits)
        else:
            holder = flash_mla.get_mla_metadata()[0]
            holder.tile_scheduler_metadata, holder.num_splits = meta, splits
            extra = {"descale_q": q_scale, "descale_k": kv_scale} if fp8 else {}
            result = flash_mla.flash_mla_with_kvcache(
                q4, pages, block_table, seq_lens, V_DIM, holder, softmax_scale=scale, causal=q_len > 1,
                is_fp8_kvcache=fp8, use_legacy=True, **extra)
        rows = q4.shape[0] * q_len
        out = result[0].view(rows, heads, V_DIM)
        if not with_lse:
            return out
        # softmax_lse is (batch, h_q, s_q): a view at s_q 1, one copy otherwise
        return out, result[1].transpose(1, 2).reshape(rows, heads)

    def run_flash_mla_serving(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None,
                              seq_lens=None, q_lens_host=None, kv_lens_host=None):
        q_len = check(q, qo_indptr, kv, kv_indptr, block_table, seq_lens)
        batch = qo_indptr.shape[0] - 1
        sched = schedule(seq_lens, q_len)
        pages = kv.unsqueeze(2)  # (num_pages, 64, 1, 576)
        if fp8:
            q8, q_scale = quantize(q)
            out = attend(q8.view(batch, q_len, heads, QK_DIM), pages, block_table, seq_lens, sched, q_len,
                         q_scale, kv_scale)
        else:
            out = attend(q.view(batch, q_len, heads, QK_DIM), pages, block_table, seq_lens, sched, q_len)
        return out

    def step(qo_indptr, *, kv_indptr=None, block_table=None, seq_lens=None, q_lens_host=None,
             kv_lens_host=None):
        q_len = None
        if q_lens_host is not None and len(q_lens_host) and len(set(q_lens_host)) == 1:
            q_len = int(q_lens_host[0])
        elif spec.max_q_len == 1:
            q_len = 1
        return _FmStep(check, schedule, attend, quantize, heads, qo_indptr, kv_indptr, block_table,
                       seq_lens, q_len, graph=spec.graph)

    run_flash_mla_serving.step = step
    run_flash_mla_serving.q_saturation = quantize.saturated if variant.get("q") == "fp8_static" else None
    return run_flash_mla_serving


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA is not set up)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _FmStep:
    """The per-layer call of one FlashMLA step (build_serving's runner.step).

    Eager, the schedule is launched when the step is made (once per step, before its
    layers). With `graph` (a graph spec) nothing is launched then: the first layer launches
    it, and the first layer run while a CUDA graph captures launches it again, inside the
    capture, so that each replay computes its schedule from the seq_lens of its own step
    (written in place by the engine) into the fixed buffers its layers read. An engine's
    update before a replay then enqueues nothing, as a graph of FlashMLA's own calls holds
    their get_mla_decoding_metadata. Only the step's first capture holds it: a second graph
    is captured after an update of its own (docs/serving.md)."""

    def __init__(self, check, schedule, attend, quantize, heads, qo_indptr, kv_indptr, block_table,
                 seq_lens, q_len, graph: bool = False):
        self.check, self.schedule, self.attend, self.quantize = check, schedule, attend, quantize
        self.heads, self.qo_indptr, self.kv_indptr = heads, qo_indptr, kv_indptr
        self.block_table, self.seq_lens = block_table, seq_lens
        self.batch = qo_indptr.shape[0] - 1
        self.sched = (schedule(seq_lens, q_len) if q_len is not None and seq_lens is not None and not graph
                      else None)
        self.q_len, self.sigs, self.rows, self.q_replay, self.q8_view = q_len, None, 0, None, None
        self.uncaptured = graph  # no layer of this step has run in a capture yet

    def first(self, q, kv, kv_scale) -> None:
        """A layer unlike the step's last checked one: check it in full, (re)schedule when
        its q_len is not the scheduled one."""
        q_len = self.check(q, self.qo_indptr, kv, self.kv_indptr, self.block_table, self.seq_lens)
        if self.sched is None or q_len != self.q_len:
            self.sched, self.q_len = self.schedule(self.seq_lens, q_len), q_len
        self.sigs = (tensor_sig(q), tensor_sig(kv), tensor_sig(kv_scale))
        self.rows = q.shape[0] * self.heads // NUM_HEADS
        self.q_replay = None

    def __call__(self, q, kv, kv_scale=None):
        if self.uncaptured and _capturing():  # the capture's first layer: its schedule joins the graph
            self.sched, self.sigs, self.uncaptured = None, None, False
        if (tensor_sig(q), tensor_sig(kv), tensor_sig(kv_scale)) != self.sigs:
            self.first(q, kv, kv_scale)
        q_len, batch = self.q_len, self.batch
        pages = kv.unsqueeze(2)  # (num_pages, 64, 1, 576)
        if self.quantize is None:
            return self.attend(q.view(batch, q_len, self.heads, QK_DIM), pages, self.block_table, self.seq_lens,
                               self.sched, q_len)
        rows = q.view(self.rows, NUM_HEADS, QK_DIM)
        replay = self.q_replay
        if replay is None or not replay.try_launch((rows,)):
            record = []
            quantize = self.quantize.for_rows(self.rows)
            q8, q_scale = quantize(rows, record=record)
            self.q_replay = LaunchReplay.build(record, (rows,))
            self.q8_view = (q8.view(batch, q_len, self.heads, QK_DIM), q_scale)
        q8, q_scale = self.q8_view
        return self.attend(q8, pages, self.block_table, self.seq_lens, self.sched, q_len, q_scale, kv_scale)
