"""AITER's MLA decode (AMD ROCm, `aiter.mla.mla_decode_fwd`) as sweep candidates.

Two modes. Non-persistent: AITER's split-KV assembly kernel plus a Triton reduction, with
`num_kv_splits` chosen by the variant. Persistent: a work list built once by
`get_mla_metadata_v1` (here, in `build`, never per call) that spreads KV blocks over the
CUs, tuned by `max_split_per_batch`, `kv_granularity`, `fast_mode` and `intra_batch`.

AITER has kernels for these (q, KV) pairs only (hsa/<arch>/mla/mla_asm.csv, 16 heads,
576/512, one query per sequence): fp8 x fp8 in both modes, bf16 x bf16 in both, bf16 q x
fp8 KV in persistent mode only; nothing for fp8 q x bf16 KV or for MXFP4 KV. The KV cache
is read as 1-token pages, the layout AITER validates (bf16 paths are wrong at page > 1,
AITER issues #2996 / #3095).

Signatures moved between AITER releases (see docs/amd.md), so every argument after
`max_seqlen_q` is passed by keyword, and a release outside the verified range is refused.
"""

from __future__ import annotations

import importlib
import re

import torch

from mla_tune.core import (
    NUM_HEADS,
    NUM_KV_HEADS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    Shape,
    Variant,
    check_param_choice,
    check_param_int,
    check_param_names,
    check_q_amax,
    vendor_is_cpu_fake,
)

NAME = "aiter"

# Releases whose Python signatures were read from ROCm/aiter tags. From v0.1.10.post2 on,
# mla_decode_fwd takes page_size/nhead_kv and get_mla_metadata_v1 takes kv_last_page_lens;
# every keyword used below keeps its name up to v0.1.20.post1.
_AI_SUPPORTED = (
    "0.1.10.post2", "0.1.10.post3", "0.1.11", "0.1.11.post1", "0.1.12", "0.1.13",
    "0.1.14", "0.1.15", "0.1.16", "0.1.17", "0.1.18", "0.1.19", "0.1.20", "0.1.20.post1",
)
_AI_MIN_VERSION = (0, 1, 10, 2)
_AI_MAX_VERSION = (0, 1, 20, 1)
# get_mla_metadata_info_v1 gained max_split_per_batch in v0.1.16; passing it earlier is a TypeError.
_AI_INFO_SPLIT_CAP_SINCE = (0, 1, 16, 0)

_AI_MODES = ("nonpersistent", "persistent")
# The parameters every variant may carry (q_amax: fp8_static only), and each mode's own.
_AI_COMMON_PARAMS = ("kv", "q", "mode", "q_amax")
_AI_MODE_PARAMS = {
    "nonpersistent": ("num_kv_splits",),
    "persistent": ("kv_granularity", "max_split_per_batch", "fast_mode", "intra_batch"),
}
# (q is fp8, KV format) -> modes with a kernel for that pair.
_AI_PAIRS = {
    (True, "fp8"): ("nonpersistent", "persistent"),
    (False, "fp8"): ("persistent",),
    (False, "bf16"): ("nonpersistent", "persistent"),
}
# The non-persistent reduction reads at most ceil(kv_len / block) splits per sequence: 128
# tokens per split for fp8 q and 64 for bf16 (get_meta_param / mgc in aiter/mla.py). More
# splits only add empty work, so candidates stop there and build refuses beyond it.
_AI_SPLIT_BLOCK = {True: 128, False: 64}
# The intra-batch metadata builder gives each sequence min(kv_len // 196, ...) splits on
# gfx950 (metadata/v1_0_device.cuh): below 196 tokens that is zero and the builder divides
# by it. On gfx942 it always writes 16 splits, overflowing buffers sized for fewer.
_AI_INTRA_MIN_KV = 196
_AI_GFX942_INTRA_SPLITS = 16
_AI_AMAX_FLOOR = 1e-12  # an all-zero q would otherwise give a zero scale and NaN

_AI_DEFAULT_SPACE = {
    "kv": ["fp8", "bf16"],
    "q": ["fp8_static", "fp8_dynamic", "bf16"],
    "mode": list(_AI_MODES),
    "num_kv_splits": [1, 2, 4, 8, 16],
    "max_split_per_batch": [-1, 8, 16, 32],
    "kv_granularity": [16],
    "fast_mode": [False, True],
    "intra_batch": [True, False],
}


# ------------------------------------------------------------------------ version
def _ai_release(text: str) -> tuple[int, int, int, int]:
    """'0.1.10.post2' -> (0, 1, 10, 2); dev and local suffixes are ignored."""
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", text.strip())
    if not match:
        raise ValueError(f"cannot read AITER version {text!r}")
    major, minor, micro, post = match.groups()
    return int(major), int(minor), int(micro), int(post or 0)


def _ai_version(aiter_module) -> str:
    """The version of the aiter actually imported: its own _version.py (setuptools_scm
    writes it into every build), else its __version__, else the amd-aiter distribution."""
    try:
        return importlib.import_module("aiter._version").__version__
    except (ImportError, AttributeError):
        pass
    if getattr(aiter_module, "__version__", None):
        return aiter_module.__version__
    from importlib import metadata

    try:
        return metadata.version("amd-aiter")
    except metadata.PackageNotFoundError as exc:
        raise ValueError(
            "cannot tell which AITER release is imported (no aiter/_version.py, no "
            "aiter.__version__, no amd-aiter distribution); reinstall amd-aiter"
        ) from exc


def _ai_checked_version(aiter_module) -> tuple[int, int, int, int]:
    text = _ai_version(aiter_module)
    release = _ai_release(text)
    if not _AI_MIN_VERSION <= release <= _AI_MAX_VERSION:
        raise ValueError(
            f"AITER {text} is not supported: its MLA signatures were not verified; "
            f"install one of {', '.join(_AI_SUPPORTED)}"
        )
    return release


# --------------------------------------------------------------------- protocol
def unavailable_reason() -> str | None:
    try:
        import aiter
        import aiter.mla  # noqa: F401  (a ROCm-less import can succeed with a truncated namespace)
    except (ImportError, RuntimeError, OSError) as exc:
        return f"AITER cannot be imported ({type(exc).__name__}: {exc}); install amd-aiter on a ROCm machine."
    if not vendor_is_cpu_fake(aiter) and not (torch.version.hip and torch.cuda.is_available()):
        return "AITER needs a ROCm GPU, and this process sees none."
    try:
        _ai_checked_version(aiter)
    except ValueError as exc:
        return f"{exc}."
    return None


def _ai_space_list(space: dict, key: str, allowed=None) -> list:
    values = space.get(key, _AI_DEFAULT_SPACE[key])
    if not isinstance(values, list):
        raise ValueError(f"aiter search space: {key} must be a list, got {values!r}")
    if allowed is not None:
        unknown = [v for v in values if v not in allowed]
        if unknown:
            raise ValueError(f"aiter search space: {key} has {unknown}; known: {', '.join(allowed)}")
    return values


def _ai_split_cap(kv_len: int, q_fp8: bool) -> int:
    return -(-kv_len // _AI_SPLIT_BLOCK[q_fp8])


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """Variants from the `aiter:` config section; only on a ROCm (HIP) platform."""
    if not platform.is_hip:
        return []
    kvs = _ai_space_list(space, "kv", ("bf16", "fp8"))
    qs = _ai_space_list(space, "q", ("bf16", "fp8_dynamic", "fp8_static"))
    modes = _ai_space_list(space, "mode", _AI_MODES)
    gfx942 = platform.arch.startswith("gfx942")
    out: list[Variant] = []
    for kv in kvs:
        for q in qs:
            q_fp8 = q != "bf16"
            for mode in modes:
                if mode not in _AI_PAIRS.get((q_fp8, kv), ()):
                    continue
                base = {"kv": kv, "q": q, "mode": mode}
                if mode == "nonpersistent":
                    cap = _ai_split_cap(shape.kv_len, q_fp8)
                    for n in _ai_space_list(space, "num_kv_splits"):
                        if 1 <= n <= cap:
                            out.append(Variant.make(NAME, num_kv_splits=n, **base))
                    continue
                for params in _ai_persistent_params(space, shape, gfx942):
                    out.append(Variant.make(NAME, **base, **params))
    return out


def _ai_persistent_params(space: dict, shape: Shape, gfx942: bool) -> list[dict]:
    """Persistent knobs without duplicates: fast_mode ignores intra_batch, and the default
    builder (neither) ignores max_split_per_batch, so those combinations appear once."""
    combos = []
    for granularity in _ai_space_list(space, "kv_granularity"):
        for fast in _ai_space_list(space, "fast_mode"):
            intra_options = [False] if fast else _ai_space_list(space, "intra_batch")
            for intra in intra_options:
                for cap in _ai_space_list(space, "max_split_per_batch"):
                    if not fast and not intra and cap != -1:
                        continue
                    if intra and (cap < 1 or shape.kv_len < _AI_INTRA_MIN_KV):
                        continue
                    if intra and gfx942 and cap < _AI_GFX942_INTRA_SPLITS:
                        continue
                    combos.append({
                        "kv_granularity": granularity, "fast_mode": fast,
                        "intra_batch": intra, "max_split_per_batch": cap,
                    })
    return combos


# ------------------------------------------------------------------------- build
def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter, or a (q, KV, mode) with no AITER
    kernel (names and values only; _ai_validate adds what depends on the shape)."""
    every = (*_AI_COMMON_PARAMS, *(n for names in _AI_MODE_PARAMS.values() for n in names))
    check_param_names(variant, every, ("kv", "q", "mode"))
    mode = check_param_choice(variant, "mode", _AI_MODES)
    kv = check_param_choice(variant, "kv", ("bf16", "fp8"))
    q = check_param_choice(variant, "q", ("bf16", "fp8_dynamic", "fp8_static"))
    own = _AI_MODE_PARAMS[mode]
    stray = [n for n in variant.p if n not in (*_AI_COMMON_PARAMS, *own)]
    if stray:
        raise ValueError(f"aiter: {', '.join(stray)} is not a parameter of mode={mode}, which "
                         f"takes {', '.join(own)}")
    check_param_names(variant, every, ("kv", "q", "mode", *own))
    q_fp8 = q != "bf16"
    if mode not in _AI_PAIRS.get((q_fp8, kv), ()):
        raise ValueError(
            f"aiter: mode={mode} is not allowed with q={q} and kv={kv}: AITER has no {mode} kernel "
            f"for {'fp8' if q_fp8 else 'bf16'} q with {kv} KV; pairs with kernels: fp8/fp8 and "
            "bf16/bf16 (both modes), bf16/fp8 (persistent)"
        )
    check_q_amax(variant)
    if mode == "nonpersistent":
        check_param_int(variant, "num_kv_splits")
        return
    check_param_int(variant, "kv_granularity", power_of_two=True)
    cap = check_param_int(variant, "max_split_per_batch", allowed_too=(-1,))
    check_param_choice(variant, "fast_mode", (True, False))
    if check_param_choice(variant, "intra_batch", (True, False)) and cap < 1:
        raise ValueError(f"aiter: max_split_per_batch={cap} is not allowed with intra_batch=true; "
                         "intra_batch needs max_split_per_batch >= 1 (the splits per sequence it writes)")


def _ai_validate(variant: Variant, shape: Shape) -> None:
    validate(variant)
    q_fp8 = variant.get("q") != "bf16"
    if variant.get("mode") == "nonpersistent":
        n, cap = variant.get("num_kv_splits"), _ai_split_cap(shape.kv_len, q_fp8)
        if not 1 <= n <= cap:
            raise ValueError(f"{variant}: num_kv_splits must be an int in 1..{cap} at kv_len {shape.kv_len}")
        return
    if variant.get("intra_batch") and shape.kv_len < _AI_INTRA_MIN_KV:
        raise ValueError(
            f"{variant}: intra_batch needs max_split_per_batch >= 1 and kv_len >= "
            f"{_AI_INTRA_MIN_KV} (AITER's builder gives zero splits below that)"
        )


def _ai_persistent_buffers(aiter, variant: Variant, shape: Shape, release, indptrs, dtypes, device):
    """Size the six work buffers with get_mla_metadata_info_v1 and fill them once."""
    qo_indptr, kv_indptr, kv_last = indptrs
    q_dtype, kv_dtype = dtypes
    fast, intra = bool(variant.get("fast_mode")), bool(variant.get("intra_batch"))
    cap = variant.get("max_split_per_batch")
    info_kwargs = dict(
        batch_size=shape.batch, max_seqlen_qo=1, num_head_qo=NUM_HEADS, q_dtype=q_dtype,
        kv_dtype=kv_dtype, is_sparse=False, fast_mode=fast,
        # intra-batch buffers hold num_kv_splits rows per sequence; the builder writes `cap`
        num_kv_splits=cap if intra else 32, intra_batch_mode=intra,
    )
    if release >= _AI_INFO_SPLIT_CAP_SINCE:
        info_kwargs["max_split_per_batch"] = cap
    info = aiter.get_mla_metadata_info_v1(**info_kwargs)
    work = [torch.empty(size, dtype=dtype, device=device) for size, dtype in info]
    aiter.get_mla_metadata_v1(
        seqlens_qo_indptr=qo_indptr, seqlens_kv_indptr=kv_indptr, kv_last_page_lens=kv_last,
        num_heads_per_head_k=NUM_HEADS // NUM_KV_HEADS, num_heads_k=NUM_KV_HEADS, is_causal=True,
        # the builder takes work_info_set before work_indptr; the info list has them swapped
        work_metadata_ptrs=work[0], work_info_set=work[2], work_indptr=work[1],
        reduce_indptr=work[3], reduce_final_map=work[4], reduce_partial_map=work[5],
        page_size=1, kv_granularity=variant.get("kv_granularity"), max_seqlen_qo=1,
        uni_seqlen_qo=1, fast_mode=fast, max_split_per_batch=cap, intra_batch_mode=intra,
        dtype_q=q_dtype, dtype_kv=kv_dtype,
    )
    fixed = dict(
        work_meta_data=work[0], work_indptr=work[1], work_info_set=work[2],
        reduce_indptr=work[3], reduce_final_map=work[4], reduce_partial_map=work[5],
        intra_batch_mode=intra,
    )
    # From v0.1.16 the reduction sizes its LDS from num_kv_splits, and from v0.1.18 a None
    # there lets AITER silently fall back to non-persistent for bf16 at batch >= 32; passing
    # the value AITER itself would pick keeps the variant what it says it is.
    max_splits = getattr(aiter, "get_mla_decode_fwd_max_splits", None)
    if max_splits is not None:
        fixed["num_kv_splits"] = max_splits(NUM_HEADS, 1, q_dtype, kv_dtype)
    return fixed


def _ai_q_quantizer(aiter, q_mode: str, q_amax, batch: int, fp8_dtype, device):
    """Returns quantize(q) -> (q8, scale), writing into buffers allocated here; no host sync."""
    fp8_max = float(torch.finfo(fp8_dtype).max)
    q8 = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=fp8_dtype, device=device)
    scale = torch.empty((1,), dtype=torch.float32, device=device)
    if q_mode == "fp8_static":
        scale.fill_(float(q_amax) / fp8_max)
        # AITER's pybind ops take positional arguments only (no py::arg names)
        vendor = getattr(aiter, "static_per_tensor_quant", None)
    else:
        vendor = getattr(aiter, "dynamic_per_tensor_quant", None)
    # the torch fallback scales in fp32 before the single rounding to fp8
    tmp = None if vendor else torch.empty((batch, NUM_HEADS, QK_DIM), dtype=torch.float32, device=device)

    def quantize(q):
        if vendor is not None:
            vendor(q8, q, scale)
            return q8, scale
        if q_mode == "fp8_dynamic":
            amax = q.abs().amax().reshape(1).to(torch.float32)  # stays on the device
            torch.div(amax.clamp_(min=_AI_AMAX_FLOOR), fp8_max, out=scale)
        torch.div(q, scale, out=tmp)
        tmp.clamp_(-fp8_max, fp8_max)
        q8.copy_(tmp)
        return q8, scale

    return quantize


def build(variant: Variant, shape: Shape, device):
    _ai_validate(variant, shape)
    import aiter
    from aiter.mla import mla_decode_fwd

    release = _ai_checked_version(aiter)
    device = torch.device(device)
    batch, total_kv = shape.batch, shape.total_kv
    kv_format, q_mode, mode = variant.get("kv"), variant.get("q"), variant.get("mode")
    fp8_dtype = aiter.dtypes.fp8
    q_dtype = torch.bfloat16 if q_mode == "bf16" else fp8_dtype
    kv_dtype = torch.bfloat16 if kv_format == "bf16" else fp8_dtype

    def i32(values):
        return values.to(device=device, dtype=torch.int32)

    qo_indptr = i32(torch.arange(batch + 1))
    kv_indptr = i32(torch.arange(batch + 1) * shape.kv_len)
    kv_indices = i32(torch.arange(total_kv))  # page i is token i (1-token pages)
    kv_last = i32(torch.ones(batch))  # every 1-token page is full
    out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
    quantize = None
    if q_mode != "bf16":
        quantize = _ai_q_quantizer(aiter, q_mode, variant.get("q_amax"), batch, fp8_dtype, device)

    if mode == "nonpersistent":
        n = variant.get("num_kv_splits")
        fixed = dict(num_kv_splits=n, num_kv_splits_indptr=i32(torch.arange(batch + 1) * n))
    else:
        fixed = _ai_persistent_buffers(
            aiter, variant, shape, release, (qo_indptr, kv_indptr, kv_last),
            (q_dtype, kv_dtype), device,
        )
    persistent = mode == "persistent"

    def run_aiter_mla(q, kv_data, call_qo_indptr, call_kv_indptr):
        kv_entry = kv_data[kv_format]
        kv, kv_scale = (kv_entry, None) if kv_format == "bf16" else kv_entry
        if q.shape[0] != batch or kv.shape[0] != total_kv:
            raise ValueError(
                f"this AITER runner was built for {shape} (batch {batch}, {total_kv} KV tokens); "
                f"got batch {q.shape[0]} with {kv.shape[0]} tokens: build one for that shape"
            )
        q_in, q_scale = (q, None) if quantize is None else quantize(q)
        mla_decode_fwd(
            q_in, kv.view(total_kv, 1, NUM_KV_HEADS, QK_DIM), out,
            # persistent work lists were built from these exact indptrs
            qo_indptr if persistent else call_qo_indptr,
            kv_indptr if persistent else call_kv_indptr,
            kv_indices, kv_last, 1,
            page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=SM_SCALE, logit_cap=0.0,
            q_scale=q_scale, kv_scale=kv_scale, **fixed,
        )
        return out

    return run_aiter_mla


# Precompile (mla_tune/compile_pool.py): AITER JIT-builds its modules into an on-disk cache on
# first use.
PRECOMPILE = True


def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """The real shape: AITER's Triton reduction specializes on launch arguments this project
    has not audited, and its split caps depend on kv_len, so no smaller stand-in is known
    to compile the same kernels."""
    return shape


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = tuple(_AI_DEFAULT_SPACE)
