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
"""

from __future__ import annotations

import torch

from mla_tune.core import (
    CORE_HEADS,
    NUM_HEADS,
    NUM_KV_HEADS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    Capabilities,
    Shape,
    Variant,
    check_param_choice,
    check_param_names,
    check_q_amax,
    vendor_is_cpu_fake,
)
from mla_tune.kernels.q_quant import QQuantizer

NAME = "flashmla"

_FM_PAGE = 64  # FlashMLA's only page (block) size
_FM_PAIRS = {"bf16": ("bf16",), "fp8": ("fp8_dynamic", "fp8_static")}  # KV -> q modes with a kernel

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    q_modes=("bf16", "fp8_dynamic", "fp8_static"),
    serving=True,
    contiguous=False,  # 64-token pages only (a contiguous uniform batch is viewed as pages)
    page_sizes=(_FM_PAGE,),
    heads=CORE_HEADS,
    max_q_len=4,
    mixed_q_len=False,  # q is (batch, q_len, heads, 576): one q_len per call
    graph_safe=True,  # its split schedule is computed on the device from seq_lens
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
    check_param_names(variant, ("kv", "q", "q_amax"), ("kv", "q"))
    kv = check_param_choice(variant, "kv", tuple(_FM_PAIRS))
    q = check_param_choice(variant, "q", ("bf16", "fp8_dynamic", "fp8_static"))
    if q not in _FM_PAIRS[kv]:
        raise ValueError(
            f"flashmla: q={q} is not allowed with kv={kv}: FlashMLA's dense decode reads bf16 q "
            "with bf16 KV, or fp8 q (fp8_dynamic / fp8_static) with fp8 KV"
        )
    check_q_amax(variant)


def _fm_validate(variant: Variant, shape: Shape) -> None:
    validate(variant)
    if shape.kv_len % _FM_PAGE:
        raise ValueError(
            f"{variant}: FlashMLA reads 64-token pages, and kv_len {shape.kv_len} is not a "
            "multiple of 64; use another backend for this shape"
        )


def build(variant: Variant, shape: Shape, device):
    _fm_validate(variant, shape)
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
                softmax_scale=SM_SCALE, causal=False, is_fp8_kvcache=True, use_legacy=True,
                descale_q=q_scale, descale_k=kv_scale,
            )
        else:
            out, _lse = flash_mla.flash_mla_with_kvcache(
                q.view(batch, 1, NUM_HEADS, QK_DIM), pages, block_table, cache_seqlens, V_DIM,
                sched, softmax_scale=SM_SCALE, causal=False, is_fp8_kvcache=False, use_legacy=True,
            )
        return out.view(batch, NUM_HEADS, V_DIM)

    # fp8_static: the quantizer counts q elements beyond the calibrated q_amax on the device
    # (the runtime's q_saturation() sums these counters; nothing here syncs)
    run_flash_mla.q_saturation = quantize.saturated if variant.get("q") == "fp8_static" else None
    return run_flash_mla


# Precompile (mla_tune/tune/compile_pool.py): the first call JIT-builds (or loads) the vendor's
# module and Triton kernels into on-disk caches; the default stand-in compiles the same ones.
PRECOMPILE = True

# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = ("kv", "q")
