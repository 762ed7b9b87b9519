"""FlashInfer's MLA decode (`BatchMLAPagedAttentionWrapper`, NVIDIA) as sweep candidates.

Written against flashinfer-python 0.6.18.post1 (flashinfer/mla/_core.py). The contiguous
cache (total_kv, 1, 576) is read as 1-token pages with no copy: `ckv = kv[..., :512]` and
`kpe = kv[..., 512:]` are strided views, which the kernels accept since they read
stride(0) and stride(1) of each cache and of q_nope / q_pe (csrc/batch_mla_*run.cu).

`plan()` copies the index arrays to the host (a sync) and JIT-compiles the kernel, so it runs
once in `build`; the runner calls only `run()`, into an output buffer it owns.

fp8 KV: FlashInfer takes its per-tensor KV scales as Python floats, and reading the
leaderboard's device-side scale on every call would sync. So the runner plans with scales
of 1.0 and folds the KV scale in on the device instead: q is multiplied by it (scores are
q . (s k)) and so is the output (values are s v); two tiny elementwise kernels, no sync.
FlashInfer's fp8-KV path needs bf16 q (no fp8 q x fp8 KV kernel) and an SM90 GPU.
"""

from __future__ import annotations

import torch

from mla_tune.core import (
    CORE_HEADS,
    CORE_PAGE_SIZES,
    KV_LORA_RANK,
    NUM_HEADS,
    QK_DIM,
    QK_ROPE_DIM,
    SM_SCALE,
    V_DIM,
    Capabilities,
    Shape,
    Variant,
    check_param_choice,
    check_param_names,
    vendor_is_cpu_fake,
)

NAME = "flashinfer"

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    serving=True,
    contiguous=True,  # read as 1-token pages
    page_sizes=CORE_PAGE_SIZES,
    heads=CORE_HEADS,
    max_q_len=4,
    mixed_q_len=True,
    graph_safe=True,  # its run; its plan() reads the lengths on the host
    host_lengths=True,
    platforms=(("cuda",),),
    vendor="flashinfer-python",
    precompile=True,
)

_FI_BACKENDS = ("fa3", "fa2")
# flashinfer's recommended float workspace for split-k partial results
_FI_WORKSPACE_BYTES = 128 << 20


def unavailable_reason() -> str | None:
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:
        return f"FlashInfer cannot be imported ({type(exc).__name__}: {exc}); install flashinfer-python (mla-tune[nvidia])."
    if vendor_is_cpu_fake(flashinfer):
        return None
    if torch.version.hip or not torch.cuda.is_available():
        return "FlashInfer needs an NVIDIA GPU, and this process sees none."
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """{backend: [fa3, fa2], kv: [bf16, fp8]} from the `flashinfer:` config section.

    The variant names FlashInfer's backend `kernel` (Variant.make's first argument is
    already called `backend`). fa3 and the fp8-KV path exist for SM90 only; q is always
    bf16 (q_nope/q_pe views).
    """
    if platform.is_hip or not platform.has_gpu:
        return []
    backends = space.get("backend", list(_FI_BACKENDS))
    kvs = space.get("kv", ["bf16", "fp8"])
    for key, values, known in (("backend", backends, _FI_BACKENDS), ("kv", kvs, ("bf16", "fp8"))):
        if not isinstance(values, list) or any(v not in known for v in values):
            raise ValueError(f"flashinfer search space: {key} must be a list of {', '.join(known)}, got {values!r}")
    sm90 = platform.arch == "sm_90"
    out = []
    for backend in backends:
        for kv in kvs:
            if (backend == "fa3" or kv == "fp8") and not sm90:
                continue
            out.append(Variant.make(NAME, kernel=backend, kv=kv, q="bf16"))
    return out


def validate(variant: Variant) -> None:
    """kernel (FlashInfer's backend) fa3 or fa2; FlashInfer MLA reads bf16 q with bf16 or
    fp8 KV. Which GPU runs fa3 and fp8 KV is candidates()' business."""
    check_param_names(variant, ("kernel", "kv", "q"), ("kernel", "kv", "q"))
    check_param_choice(variant, "kernel", _FI_BACKENDS)
    check_param_choice(variant, "kv", ("bf16", "fp8"))
    check_param_choice(variant, "q", ("bf16",))


def build(variant: Variant, shape: Shape, device):
    validate(variant)
    backend, kv_format = variant.get("kernel"), variant.get("kv")
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    device = torch.device(device)
    batch, total_kv = shape.batch, shape.total_kv
    kv_dtype = torch.bfloat16 if kv_format == "bf16" else torch.float8_e4m3fn

    def i32(values):
        return values.to(device=device, dtype=torch.int32)

    workspace = torch.empty(_FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    wrapper.plan(
        qo_indptr=i32(torch.arange(batch + 1)),
        kv_indptr=i32(torch.arange(batch + 1) * shape.kv_len),  # in pages = tokens
        kv_indices=i32(torch.arange(total_kv)),
        kv_len_arr=i32(torch.full((batch,), shape.kv_len)),
        num_heads=NUM_HEADS, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
        page_size=1, causal=False, sm_scale=SM_SCALE,
        q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
    )
    out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
    fp8 = kv_format == "fp8"
    q_scaled = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=device) if fp8 else None
    scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if fp8 else {}

    def run_flashinfer_mla(q, kv_data, qo_indptr, kv_indptr):
        kv, kv_scale = (kv_data["fp8"] if fp8 else (kv_data["bf16"], None))
        if q.shape[0] != batch or kv.shape[0] != total_kv:
            raise ValueError(
                f"this FlashInfer runner was planned for {shape} (batch {batch}, {total_kv} KV "
                f"tokens); got batch {q.shape[0]} with {kv.shape[0]} tokens: build one for that shape"
            )
        if fp8:
            q = torch.mul(q, kv_scale, out=q_scaled)  # fold the KV scale into the scores
        wrapper.run(
            q[:, :, :KV_LORA_RANK], q[:, :, KV_LORA_RANK:],
            kv[:, :, :KV_LORA_RANK], kv[:, :, KV_LORA_RANK:],
            out=out, **scales,
        )
        if fp8:
            out.mul_(kv_scale)  # ... and into the values
        return out

    return run_flashinfer_mla


# Precompile (mla_tune/tune/compile_pool.py): plan() JIT-builds (or loads) FlashInfer's MLA module
# into its on-disk cache.
PRECOMPILE = True


def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """One small shape for all: the module FlashInfer builds is named by its kernel backend,
    dtypes and head dims (flashinfer/jit/attention), never by batch or length, and the
    runner launches no Triton kernel."""
    return Shape(1, 64)

# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = ("backend", "kv")
