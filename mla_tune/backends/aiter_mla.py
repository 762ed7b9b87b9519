"""AITER's MLA decode (AMD ROCm, `aiter.mla.mla_decode_fwd`) as sweep candidates.

Four modes. Non-persistent: AITER's split-KV assembly kernel plus a Triton reduction, with
`num_kv_splits` chosen by the variant. Persistent: a work list built once by
`get_mla_metadata_v1` (here, in `build`, never per call) that spreads KV blocks over the
CUs, tuned by `max_split_per_batch`, `kv_granularity`, `fast_mode` and `intra_batch`; on an
AITER that has it (0.1.20+), `opus=true` runs the fp8 OPUS stage 1 instead of the assembly
one. Direct: the persistent work list, with mla_decode_fwd's wrapper skipped: the runner calls
`aiter.mla_decode_stage1_asm_fwd` and `aiter.mla_reduce_v1` itself, into partial buffers
made once in `build` (the wrapper allocates them on every call), as the amd-mixed-mla
contest's fastest entries did; offered where the installed AITER's signatures of the two
ops are readable and have what it passes (`lse` before `q_scale` and `num_kv_splits` in
the reduction are used where present). Gluon: AITER's Gluon MLA decode
(`aiter.ops.triton.gluon.mla_gluon`, gfx950, 0.1.18+), bf16 q over fp8 or bf16 KV, which
picks its own split count.

AITER has assembly kernels for these (q, KV) pairs only (hsa/<arch>/mla/mla_asm.csv, 16
heads, 576/512, one query per sequence): fp8 x fp8 in both modes, bf16 x bf16 in both,
bf16 q x fp8 KV in persistent mode only; nothing for fp8 q x bf16 KV or for MXFP4 KV. The
KV cache is read as 1-token pages, the layout AITER validates (bf16 paths are wrong at
page > 1, AITER issues #2996 / #3095).

Signatures moved between AITER releases (see docs/amd.md), so every argument past the first
few tensors is passed by keyword (the quant ops excepted: pybind functions without argument
names), and the gate checks the signatures this file calls, not the version string: builds
from AITER's main carry versions like `0.1.dev123+g...`. AITER's compile_ops wrappers show
(*args, **kwargs) to inspect.signature; their names are read from the torch op schema
(`torch.ops.aiter.<name>`) that AITER registers from the same Python stub.

The #4144 gate (0.1.18+: mla_decode_fwd runs a gfx950 bf16 x bf16 persistent call at batch
>= AITER_MLA_DECODE_PERSISTENT_MAX_BATCH, default 32, non-persistent when num_kv_splits is
None; AITER reads the variable once per process) never fires on this file's calls:
persistent calls pass num_kv_splits wherever AITER has get_mla_decode_fwd_max_splits
(0.1.16+), and `build` refuses the one case it cannot keep persistent. aiter_provenance
records what the installed build does (`amd-aiter-persistent-gate`).

Serving call (`build_serving`), as read at ROCm/aiter v0.1.11 and v0.1.20.post1 (aiter/mla.py,
csrc/py_itfs_cu/asm_mla.cu, hsa/gfx9{42,50}/mla/mla_asm.csv, op_tests/test_mla.py); no AMD
GPU ran it here, only the CPU fake:
- the non-persistent kernels only: their split layout comes from num_kv_splits_indptr and
  the lengths on the device, while a persistent work list is built for one call's lengths
  and its heads-128 fp8 kernel (`..._msk0_ps`) has no causal mask;
- q is read as batch blocks of max_seqlen_q rows (`stride_Q = Q.stride(0) * max_seqlen_q`),
  so every sequence brings the same q_len (total_q / batch); kernels exist for 16 heads at
  q_len 1, 2, 4 (3 padded to 4) and for 128 heads at any q_len ("qSeqLen 0"), bf16 x bf16
  and fp8 x fp8 (none for bf16 q x fp8 KV without a work list); AITER's op test covers
  (16 heads: q_len 1, 2, 4) and (128 heads: q_len 1, 2) against a bottom-right causal
  reference (tril(diagonal=s_k - s_q)), our alignment;
- 1-token pages only (bf16 paths are wrong at larger pages, AITER #2996 / #3095):
  contiguous KV passes the call's kv_indptr with kv_indices = arange(rows of the cache),
  which holds for any kv_indptr as tokens lie in order; paged-1 KV packs the block table's
  live entries into kv_indices on the device (cumsum of seq_lens, a scatter), no host read;
- num_kv_splits is the variant's (default 1): stage 2 reduces min(n, cdiv(kv_pages, mgc))
  splits per sequence (_fwd_kernel_stage2_asm), and whether stage 1 leaves the splits past
  a short sequence's end empty is in its binaries, so one split is the choice that is
  right for every length.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import re
import warnings
from pathlib import Path

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
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
    vendor_is_cpu_fake,
)

NAME = "aiter"

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    q_modes=("bf16", "fp8_dynamic", "fp8_static"),
    ragged=False,
    serving=True,  # non-persistent kernels, bf16 x bf16 or fp8 q x fp8 KV
    contiguous=True,  # read as 1-token pages (kv_page_indices)
    page_sizes=(1,),  # bf16 paths are wrong at larger pages (AITER #2996 / #3095)
    heads=(16, 128),  # the non-persistent kernels of both dtype pairs (mla_asm.csv)
    max_q_len=4,
    mixed_q_len=False,  # q rows are read as batch x max_seqlen_q
    graph_safe=True,  # no host read with the split indptr given; its scratch is torch.empty
    platforms=(("hip", "gfx942"), ("hip", "gfx950")),
    vendor="amd-aiter",
    precompile=True,
)

# The releases whose Python signatures were read from ROCm/aiter tags. Outside them (or
# with no readable version) AITER is still used when its signatures have what this file
# calls, with a warning.
_AI_VERIFIED = ((0, 1, 10, 2), (0, 1, 20, 1))
_AI_VERIFIED_TEXT = "0.1.10.post2 to 0.1.20.post1"
_AI_INSTALL = ("install amd-aiter 0.1.10.post2 or later, a ROCm build from AMD's wheel index or "
               "from source (docs/amd.md); where AITER cannot change (a contest's runner), export "
               "without it: mla-tune export --only triton,torch")
# Kernel binaries (hsa/gfx9*/mla/*.co) changed at these releases: the fp8 persistent
# kernel (LSE) at 0.1.12, the fp8 non-persistent kernel at 0.1.16, the fp8 rebuild and the
# gfx950 bf16 persistent switch at 0.1.17, 64-bit KV offsets at 0.1.19.post2. Timings tuned
# in one era say little about another.
_AI_BINARY_CHANGES = ((0, 1, 12, 0), (0, 1, 16, 0), (0, 1, 17, 0), (0, 1, 19, 2))

# What this file calls, by name. mla_decode_fwd's first eight have kept their order since
# 0.1.4; this file passes the first three positionally and the rest by keyword.
_AI_DECODE_POSITIONAL = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices",
                         "kv_last_page_lens", "max_seqlen_q")
_AI_REQUIRED = {
    "mla_decode_fwd": (
        "page_size", "nhead_kv", "sm_scale", "logit_cap", "num_kv_splits", "num_kv_splits_indptr",
        "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "q_scale", "kv_scale", "intra_batch_mode"),
    "get_mla_metadata_info_v1": (
        "batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse",
        "fast_mode", "num_kv_splits", "intra_batch_mode"),
    "get_mla_metadata_v1": (
        "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k",
        "num_heads_k", "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr",
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "page_size", "kv_granularity",
        "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "max_split_per_batch", "intra_batch_mode",
        "dtype_q", "dtype_kv"),
}
# The direct mode's two ops (aiter/ops/attention.py, pybind names in csrc/include/rocm_ops.hpp):
# their leading tensors, passed positionally, and what is passed by keyword. 0.1.12 adds
# `lse` to stage 1 before q_scale, 0.1.16 a required num_kv_splits to the reduction.
_AI_DIRECT_OPS = {
    "mla_decode_stage1_asm_fwd": (("Q", "KV"), (
        "qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_lens", "num_kv_splits_indptr",
        "work_meta_data", "work_indptr", "work_info_set", "max_seqlen_q", "page_size", "nhead_kv",
        "softmax_scale", "splitData", "splitLse", "output", "q_scale", "kv_scale")),
    "mla_reduce_v1": (("partial_output", "partial_lse"), (
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "max_seqlen_q", "final_output")),
}
# mla_decode_fwd's #4144 gate (0.1.18+), found in its source
_AI_GATE_MARKS = ("_use_persistent_mla_decode", "AITER_MLA_DECODE_PERSISTENT_MAX_BATCH")
_AI_GATE_RELEASE = (0, 1, 18, 0)
_AI_GLUON_MODULE = "aiter.ops.triton.gluon.mla_gluon"
_AI_GLUON_PARAMS = ("q_nope", "q_pe", "kv_c", "o", "page_table", "seq_info", "sm_scale",
                    "kv_pe_offset", "use_2d_view", "kv_scale", "min_kv_seq_len")
_AI_OPUS_ENV = "AITER_MLA_USE_OPUS"  # read by mla_decode_fwd on every call (0.1.20+)

_AI_MODES = ("nonpersistent", "persistent", "direct", "gluon")
# The parameters every variant may carry (q_amax: fp8_static only) and each mode's own (opus
# is optional: absent means the assembly stage 1) are PARAM_RULES["aiter"] in
# backends/params.py, one ParamForm per mode: a new mode adds its form there.
# (q is fp8, KV format) -> modes with a kernel for that pair.
_AI_PAIRS = {
    (True, "fp8"): ("nonpersistent", "persistent", "direct"),
    (False, "fp8"): ("persistent", "direct", "gluon"),
    (False, "bf16"): ("nonpersistent", "persistent", "direct", "gluon"),
}
_AI_WORK_LIST_MODES = ("persistent", "direct")  # the modes built on get_mla_metadata_v1
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
    "mode": ["nonpersistent", "persistent", "direct"],
    "num_kv_splits": [1, 2, 4, 8, 16],
    "max_split_per_batch": [-1, 1, 2, 4, 8],
    "kv_granularity": [16],
    "fast_mode": [False, True],
    "intra_batch": [True],
    "opus": [False],
}


# ------------------------------------------------------------------- the gate
def _ai_release(text: str) -> tuple[int, int, int, int] | None:
    """'0.1.10.post2' -> (0, 1, 10, 2); a dev release of X sorts just before X
    ('0.1.21.dev4+g12ab' -> (0, 1, 21, -1)); None when there is no X.Y.Z to read."""
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?(\.?dev\d*)?", str(text).strip())
    if not match:
        return None
    major, minor, micro, post, dev = match.groups()
    return int(major), int(minor), int(micro), -1 if dev and not post else int(post or 0)


def aiter_binary_era(version: str | None) -> int | None:
    """How many of AITER's kernel-binary changes `version` has (0..4), or None when that
    cannot be told: an unreadable version, or a dev build next to a change."""
    release = _ai_release(version or "")
    if release is None:
        return None
    if release[3] < 0:  # a dev build lies somewhere after the previous micro release
        low = (*release[:2], release[2] - 1, 0)
        if any(low < change <= release[:3] + (0,) for change in _AI_BINARY_CHANGES):
            return None
    return sum(change <= release for change in _AI_BINARY_CHANGES)


def aiter_drift_note(tuned: str | None, here: str | None) -> str:
    """A sentence for the runtime's version-drift warning: whether AITER's kernel binaries
    differ between the AITER a table was tuned with and the one present."""
    era_tuned, era_here = aiter_binary_era(tuned), aiter_binary_era(here)
    if here is None:
        return ""
    if era_tuned is None or era_here is None:
        return ("cannot tell whether AITER's kernel binaries differ (they changed at 0.1.12, "
                "0.1.16, 0.1.17 and 0.1.19.post2); ")
    if era_tuned != era_here:
        return "AITER's kernel binaries differ between these builds; "
    return ""


# The optional hook backends.drift_note reads for this backend's CAPABILITIES.vendor: the
# runtime's version-drift warning for amd-aiter says whether the kernel binaries differ.
vendor_drift_note = aiter_drift_note


def _ai_params(fn, op_name: str | None = None) -> dict | None:
    """fn's parameters by name, or None when its signature cannot be read. A wrapper that
    shows only (*args, **kwargs), as AITER's compile_ops ops do, is read from the torch op
    schema AITER registered for `op_name` (torch.ops.aiter.<op_name>) when there is one."""
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if op_name is not None and (params is None or all(p.kind in variadic for p in params.values())):
        schema_params = _ai_schema_params(op_name)
        if schema_params is not None:
            return schema_params
    return params


def _ai_schema_params(op_name: str) -> dict | None:
    """The arguments of torch.ops.aiter.<op_name>'s schema as inspect parameters, or None."""
    try:
        packet = getattr(torch.ops.aiter, op_name)
        arguments = packet.default._schema.arguments
        kinds = {True: inspect.Parameter.KEYWORD_ONLY, False: inspect.Parameter.POSITIONAL_OR_KEYWORD}
        return {a.name: inspect.Parameter(a.name, kinds[bool(a.kwarg_only)]) for a in arguments}
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _ai_accepts(params: dict | None, name: str) -> bool:
    if params is None:
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _ai_source_has(fn, text: str) -> bool | None:
    try:
        return text in inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _ai_features(aiter) -> dict:
    """What the imported AITER offers, read from its signatures: `missing` lists what this
    file needs and cannot find; the rest say which optional paths it has."""
    missing = []
    mla = importlib.import_module(aiter.__name__ + ".mla")
    calls = {"mla_decode_fwd": getattr(mla, "mla_decode_fwd", None),
             "get_mla_metadata_info_v1": getattr(aiter, "get_mla_metadata_info_v1", None),
             "get_mla_metadata_v1": getattr(aiter, "get_mla_metadata_v1", None)}
    found = {}
    for name, fn in calls.items():
        params = _ai_params(fn, name) if callable(fn) else None
        found[name] = params
        if params is None:
            missing.append(f"{name} (absent or unreadable)")
            continue
        lacking = [n for n in _AI_REQUIRED[name] if not _ai_accepts(params, n)]
        if lacking:
            missing.append(f"{name}({', '.join(lacking)})")
    decode = found["mla_decode_fwd"]
    if decode is not None and tuple(decode)[:8] != _AI_DECODE_POSITIONAL:
        missing.append(f"mla_decode_fwd positional order ({', '.join(_AI_DECODE_POSITIONAL)})")
    if getattr(getattr(aiter, "dtypes", None), "fp8", None) is None:
        missing.append("aiter.dtypes.fp8")

    opus_op = callable(getattr(aiter, "mla_decode_fwd_opus_stage1", None))
    opus_read = _ai_source_has(calls["mla_decode_fwd"], _AI_OPUS_ENV)
    gluon = None
    try:
        gluon = getattr(importlib.import_module(_AI_GLUON_MODULE), "mla_gluon", None)
    except Exception:  # noqa: BLE001  (absent before 0.1.18, or a Triton without Gluon)
        gluon = None
    gluon_params = _ai_params(gluon) if callable(gluon) else None
    has_gluon = gluon_params is not None and all(n in gluon_params for n in _AI_GLUON_PARAMS)
    # 0.1.18 to 0.1.19.post2 assert batch_size == 1 for fp8 KV (regime bh16bn128)
    fp8_batch_one = _ai_source_has(gluon, "requires batch_size=1") if has_gluon else None
    direct = _ai_direct_features(aiter)
    gate_marks = [_ai_source_has(calls["mla_decode_fwd"], mark) for mark in _AI_GATE_MARKS]
    return {
        "missing": missing,
        # 0.1.16+: the info call sizes buffers for a split cap; passing it earlier is a TypeError
        "info_split_cap": _ai_accepts(found["get_mla_metadata_info_v1"], "max_split_per_batch"),
        "max_splits": callable(getattr(aiter, "get_mla_decode_fwd_max_splits", None)),
        # 0.1.20+: mla_decode_fwd reads AITER_MLA_USE_OPUS per call (`causal` came with it)
        "opus": opus_op and (opus_read if opus_read is not None else _ai_accepts(decode, "causal")),
        "gluon": has_gluon,
        "gluon_fp8_any_batch": has_gluon and fp8_batch_one is False,
        # #4144 (0.1.18+): None when mla_decode_fwd's source cannot be read
        "persistent_gate": True if any(gate_marks) else None if None in gate_marks else False,
        **direct,
    }


def _ai_direct_features(aiter) -> dict:
    """Whether the direct mode can run: both ops present, their signatures readable (from
    the function or the torch op schema), leading with the tensors it passes by position and
    taking every keyword it passes; a reduction that takes num_kv_splits (0.1.16+) also
    needs get_mla_decode_fwd_max_splits for its value. Also which of the optional
    arguments (stage 1's `lse`, the reduction's `num_kv_splits`) the signatures have."""
    found = {}
    for name, (leading, keywords) in _AI_DIRECT_OPS.items():
        fn = getattr(aiter, name, None)
        params = _ai_params(fn, name) if callable(fn) else None
        if (params is None or tuple(params)[:len(leading)] != leading
                or not all(_ai_accepts(params, n) for n in keywords)):
            return {"direct": False, "direct_lse": False, "direct_reduce_splits": False}
        found[name] = params
    reduce_splits = "num_kv_splits" in found["mla_reduce_v1"]
    max_splits = callable(getattr(aiter, "get_mla_decode_fwd_max_splits", None))
    return {"direct": not reduce_splits or max_splits,
            "direct_lse": "lse" in found["mla_decode_stage1_asm_fwd"],
            "direct_reduce_splits": reduce_splits}


def _ai_version(aiter_module) -> str | None:
    """The version of the aiter actually imported: its own _version.py (setuptools_scm
    writes it into every build), else its __version__, else the amd-aiter distribution."""
    try:
        return str(importlib.import_module("aiter._version").__version__)
    except (ImportError, AttributeError):
        pass
    if getattr(aiter_module, "__version__", None):
        return str(aiter_module.__version__)
    from importlib import metadata

    try:
        return metadata.version("amd-aiter")
    except metadata.PackageNotFoundError:
        return None


def _ai_checked(aiter) -> dict:
    """The features of the imported AITER; raises ValueError naming what is missing.
    A version outside the verified releases, or none, only warns."""
    version = _ai_version(aiter)
    shown = f"AITER {version}" if version else "AITER (no readable version)"
    features = _ai_features(aiter)
    if features["missing"]:
        raise ValueError(f"{shown} lacks what mla-tune calls: {'; '.join(features['missing'])}; "
                         f"{_AI_INSTALL}")
    release = _ai_release(version or "")
    if release is None or not _AI_VERIFIED[0] <= release <= _AI_VERIFIED[1]:
        warnings.warn(
            f"{shown} is not among the releases whose MLA API was read ({_AI_VERIFIED_TEXT}); its "
            "signatures have everything mla-tune calls, so it is used: the sweep's correctness "
            "gate is the check", stacklevel=3)
    return features


# ------------------------------------------------------------------ provenance
def _ai_git_head(git: Path) -> str | None:
    """The commit a .git directory (or a worktree's .git file) has checked out."""
    if git.is_file():
        text = git.read_text(errors="replace").strip()
        if not text.startswith("gitdir:"):
            return None
        git = (git.parent / text.split(":", 1)[1].strip()).resolve()
    head = (git / "HEAD").read_text(errors="replace").strip() if (git / "HEAD").is_file() else ""
    if re.fullmatch(r"[0-9a-f]{40}", head):
        return head
    if not head.startswith("ref:"):
        return None
    ref = head.split(":", 1)[1].strip()
    common = git
    if (git / "commondir").is_file():  # a linked worktree keeps its refs in the main .git
        common = (git / (git / "commondir").read_text().strip()).resolve()
    for base in (git, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip() or None
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text(errors="replace").splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    return None


def aiter_provenance() -> dict:
    """{"amd-aiter": version, "amd-aiter-commit": sha} for the aiter this process would
    import, found without importing it (an import JIT-loads kernels): its _version.py,
    else the distribution's version; the commit from a `+g<sha>` in the version, the
    distribution's direct_url.json (pip install from git), or a .git next to the package."""
    import importlib.util
    from importlib import metadata

    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {}
    package = Path(list(spec.submodule_search_locations)[0])
    version = None
    version_file = package / "_version.py"
    if version_file.is_file():
        text = version_file.read_text(errors="replace")
        match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.M)
        if match:
            version = match.group(1)
        else:  # a computed version (the test fake reads its environment)
            import runpy

            version = runpy.run_path(str(version_file)).get("__version__")
    dist = None
    try:
        dist = metadata.distribution("amd-aiter")
    except metadata.PackageNotFoundError:
        pass
    if version is None and dist is not None:
        version = dist.version
    out = {"amd-aiter": str(version) if version else "unknown"}
    commit = None
    match = re.search(r"[+.]g([0-9a-f]{7,40})\b", str(version or ""))
    if match:
        commit = match.group(1)
    if commit is None and dist is not None:
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "{}")
            commit = (direct.get("vcs_info") or {}).get("commit_id")
        except (ValueError, OSError):
            pass
    if commit is None and (package.parent / ".git").exists():
        try:
            commit = _ai_git_head(package.parent / ".git")
        except OSError:
            commit = None
    if commit:
        out["amd-aiter-commit"] = commit
    out["amd-aiter-persistent-gate"] = aiter_persistent_gate(version)
    return out


def aiter_persistent_gate(version: str | None) -> str:
    """What AITER's #4144 gate does to this file's persistent calls, by the build's version:
    the gate came with 0.1.18 (mla_decode_fwd runs a gfx950 bf16 x bf16 persistent call at
    batch >= AITER_MLA_DECODE_PERSISTENT_MAX_BATCH non-persistent when num_kv_splits is
    None); every persistent call here passes num_kv_splits where AITER has
    get_mla_decode_fwd_max_splits (0.1.16+), which skips the gate, and `build` refuses the
    case it could not keep persistent, so a table's persistent variant ran persistent."""
    release = _ai_release(version or "")
    if release is None or (release[:3] == _AI_GATE_RELEASE[:3] and release[3] < 0):
        return "unknown build (persistent calls pass num_kv_splits where AITER has get_mla_decode_fwd_max_splits)"
    if release >= _AI_GATE_RELEASE:
        return "bypassed (persistent calls pass num_kv_splits)"
    return "absent (before 0.1.18)"


# --------------------------------------------------------------------- protocol
def unavailable_reason() -> str | None:
    try:
        import aiter
        import aiter.mla  # noqa: F401  (a ROCm-less import can succeed with a truncated namespace)
    except (ImportError, RuntimeError, OSError) as exc:
        return (f"AITER cannot be imported ({type(exc).__name__}: {exc}); {_AI_INSTALL} "
                "on a ROCm machine.")
    if not vendor_is_cpu_fake(aiter) and not (torch.version.hip and torch.cuda.is_available()):
        return "AITER needs a ROCm GPU, and this process sees none."
    try:
        _ai_checked(aiter)
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
            raise ValueError(f"aiter search space: {key} has {unknown}; known: {', '.join(map(str, allowed))}")
    return values


def _ai_split_cap(kv_len: int, q_fp8: bool) -> int:
    return -(-kv_len // _AI_SPLIT_BLOCK[q_fp8])


def _ai_installed_features() -> dict:
    """The optional paths of the AITER this process can import; none when it cannot (a
    dry run on a machine without AITER plans only what every supported AITER has)."""
    try:
        import aiter

        return _ai_features(aiter)
    except Exception:  # noqa: BLE001  (no aiter, or one that fails to import)
        return {"gluon": False, "gluon_fp8_any_batch": False, "opus": False, "direct": False}


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """Variants from the `aiter:` config section; only on a ROCm (HIP) platform. The
    persistent (and direct) knobs are deduplicated by the metadata they give at this shape,
    and the direct mode, the Gluon and the OPUS kernels are offered only where the
    installed AITER has them."""
    if not platform.is_hip:
        return []
    kvs = _ai_space_list(space, "kv", ("bf16", "fp8"))
    qs = _ai_space_list(space, "q", ("bf16", "fp8_dynamic", "fp8_static"))
    modes = _ai_space_list(space, "mode", _AI_MODES)
    opus_values = _ai_space_list(space, "opus", (False, True))
    gfx950 = platform.arch.startswith("gfx950")
    wanted = "gluon" in modes or "direct" in modes or True in opus_values
    features = _ai_installed_features() if wanted else {}
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
                elif mode == "gluon":
                    # gfx950 only; fp8 KV at batch > 1 needs 0.1.20+ (bh16bn128)
                    fp8_ok = shape.batch == 1 or features.get("gluon_fp8_any_batch")
                    if gfx950 and features.get("gluon") and (kv == "bf16" or fp8_ok):
                        out.append(Variant.make(NAME, **base))
                elif mode == "direct":
                    if features.get("direct"):
                        out.extend(Variant.make(NAME, **base, **params)
                                   for params in _ai_persistent_params(space, shape, platform))
                else:
                    # OPUS: gfx950, fp8 q and fp8 KV, 1-token pages (aiter/mla.py)
                    opus_ok = gfx950 and q_fp8 and kv == "fp8" and features.get("opus")
                    for params in _ai_persistent_params(space, shape, platform):
                        for opus in opus_values:
                            if opus and not opus_ok:
                                continue
                            out.append(Variant.make(NAME, **base, **params, **({"opus": True} if opus else {})))
    return list(dict.fromkeys(out))


def _ai_persistent_key(shape: Shape, cu_num: int, gfx942: bool, fast: bool, intra: bool,
                       cap: int) -> tuple:
    """What the metadata builder does with these knobs at this shape: knobs with equal
    keys build the same work list, so only the first is offered."""
    if fast:
        # v1_2: a global split budget of min(CUs, cap * batch); -1 means all CUs up to
        # 0.1.20 and a workload-aware budget after (#4899, #5212), so it stays apart
        return ("fast", "auto") if cap == -1 else ("fast", min(cu_num, cap * shape.batch) if cu_num else cap)
    if intra:
        # v1_0: every sequence gets min(kv_len // 196, ceil(CUs / batch), cap) splits
        if gfx942:
            return ("intra", _AI_GFX942_INTRA_SPLITS)
        if not cu_num:
            return ("intra", cap)
        return ("intra", min(shape.kv_len // _AI_INTRA_MIN_KV, -(-cu_num // shape.batch), cap))
    return ("v1_1",)  # the cost-heap builder ignores the cap


def _ai_persistent_params(space: dict, shape: Shape, platform) -> list[dict]:
    """Persistent knobs without duplicates: fast_mode ignores intra_batch, the default
    builder (neither) ignores max_split_per_batch, and caps past what the shape can use give
    the same metadata as the largest useful one (see _ai_persistent_key)."""
    gfx942 = platform.arch.startswith("gfx942")
    cu_num = int(getattr(platform, "sm_count", 0) or 0)
    combos, seen = [], set()
    for granularity in _ai_space_list(space, "kv_granularity"):
        for fast in _ai_space_list(space, "fast_mode"):
            intra_options = [False] if fast else _ai_space_list(space, "intra_batch")
            for intra in intra_options:
                for cap in _ai_space_list(space, "max_split_per_batch"):
                    if intra and (cap < 1 or shape.kv_len < _AI_INTRA_MIN_KV):
                        continue
                    if intra and gfx942 and cap < _AI_GFX942_INTRA_SPLITS:
                        continue
                    key = (granularity, *_ai_persistent_key(shape, cu_num, gfx942, fast, intra, cap))
                    if key in seen:
                        continue
                    seen.add(key)
                    combos.append({
                        "kv_granularity": granularity, "fast_mode": fast,
                        "intra_batch": intra, "max_split_per_batch": cap,
                    })
    return combos


# ------------------------------------------------------------------------- build
def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter, or a (q, KV, mode) with no AITER
    kernel (names and values only; _ai_validate adds what depends on the shape)."""
    # names, each mode's own parameters, choices, bounds and q_amax: backends/params.py
    check_variant_rules(variant, PARAM_RULES[NAME])
    mode, kv, q = variant.get("mode"), variant.get("kv"), variant.get("q")
    q_fp8 = q != "bf16"
    if mode not in _AI_PAIRS.get((q_fp8, kv), ()):
        raise ValueError(
            f"aiter: mode={mode} is not allowed with q={q} and kv={kv}: AITER has no {mode} kernel "
            f"for {'fp8' if q_fp8 else 'bf16'} q with {kv} KV; pairs with kernels: fp8/fp8 and "
            "bf16/bf16 (all three), bf16/fp8 (persistent, direct); gluon takes bf16 q only"
        )
    if mode not in _AI_WORK_LIST_MODES:
        return
    cap = variant.get("max_split_per_batch")
    if variant.get("intra_batch") and cap < 1:
        raise ValueError(f"aiter: max_split_per_batch={cap} is not allowed with intra_batch=true; "
                         "intra_batch needs max_split_per_batch >= 1 (the splits per sequence it writes)")
    if variant.get("opus") and not (q_fp8 and kv == "fp8"):
        raise ValueError(f"aiter: opus=true is not allowed with q={q} and kv={kv}: AITER's OPUS "
                         "kernel reads fp8 q and fp8 KV only")


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


def _ai_persistent_buffers(aiter, variant: Variant, shape: Shape, features, indptrs, dtypes, device):
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
    if features["info_split_cap"]:
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
    if features["max_splits"]:
        fixed["num_kv_splits"] = _ai_max_splits(aiter, q_dtype, kv_dtype)
    return fixed


def _ai_max_splits(aiter, q_dtype, kv_dtype) -> int:
    """AITER's bound on the splits per tile its metadata may hold (0.1.16+): the LDS size
    mla_reduce_v1 needs, and the num_kv_splits that keeps a persistent call persistent."""
    return aiter.get_mla_decode_fwd_max_splits(num_head_qo=NUM_HEADS, max_seqlen_qo=1, q_dtype=q_dtype,
                                               kv_dtype=kv_dtype)


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


def _ai_gluon_runner(variant: Variant, shape: Shape, device, sm_scale: float):
    """AITER's Gluon MLA decode over 1-token pages. It takes the KV scale as a Python float,
    so the fp8 scale is folded into q (scores) and into o (values) on the device instead of
    read back to the host on every call."""
    from aiter.ops.triton.gluon.mla_gluon import mla_gluon

    batch, total_kv = shape.batch, shape.total_kv
    kv_format = variant.get("kv")
    kv_indices = torch.arange(total_kv, device=device, dtype=torch.int32)
    out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
    q_scaled = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=device)

    def run_aiter_gluon(q, kv_data, _qo_indptr, kv_indptr):
        kv, kv_scale = _ai_call_kv(kv_data, kv_format, q, shape)
        q_in = q if kv_scale is None else torch.mul(q, kv_scale, out=q_scaled)
        mla_gluon(
            q_in[..., :V_DIM], q_in[..., V_DIM:], kv.view(total_kv, QK_DIM), out, page_table=kv_indices,
            seq_info=kv_indptr, sm_scale=sm_scale, kv_pe_offset=V_DIM, use_2d_view=False, kv_scale=1.0,
            min_kv_seq_len=shape.kv_len,
        )
        if kv_scale is not None:
            out.mul_(kv_scale)
        return out

    return run_aiter_gluon


def _ai_sm_scale(sm_scale) -> float:
    """The softmax scale as the Python float AITER's ops demand (compile_ops refuses an int)."""
    if (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale)
            or sm_scale <= 0):
        raise ValueError(f"aiter: sm_scale must be a positive finite float (the model's softmax scale), "
                         f"got {sm_scale!r}")
    return float(sm_scale)


def _ai_call_kv(kv_data, kv_format: str, q, shape: Shape):
    """(kv, kv_scale) of a leaderboard call's kv_data, after checking the call is the shape
    the runner was built for."""
    kv_entry = kv_data[kv_format]
    kv, kv_scale = (kv_entry, None) if kv_format == "bf16" else kv_entry
    if q.shape[0] != shape.batch or kv.shape[0] != shape.total_kv:
        raise ValueError(
            f"this AITER runner was built for {shape} (batch {shape.batch}, {shape.total_kv} KV tokens); "
            f"got batch {q.shape[0]} with {kv.shape[0]} tokens: build one for that shape"
        )
    return kv, kv_scale


def _ai_direct_runner(aiter, features, shape: Shape, kv_format: str, quantize, indices, out, work,
                      sm_scale: float):
    """The direct mode's runner: stage 1 over the work list, then the reduction, into
    partial buffers allocated here once (mla_decode_fwd sizes them
    reduce_partial_map.size(0) x max_seqlen_q rows and allocates them on every call).
    Everything past the two leading tensors of each op goes by keyword; `lse` (None: no
    LSE wanted) and the reduction's `num_kv_splits` only where the signature has them."""
    qo_indptr, kv_indptr, kv_indices, kv_last = indices
    rows = work["reduce_partial_map"].shape[0]  # x max_seqlen_q, which is 1
    device = out.device
    split_data = torch.empty((rows, 1, NUM_HEADS, V_DIM), dtype=torch.float32, device=device)
    split_lse = torch.empty((rows, 1, NUM_HEADS, 1), dtype=torch.float32, device=device)
    stage1_extra = {"lse": None} if features["direct_lse"] else {}
    reduce_extra = {"num_kv_splits": work["num_kv_splits"]} if features["direct_reduce_splits"] else {}
    stage1_op, reduce_op = aiter.mla_decode_stage1_asm_fwd, aiter.mla_reduce_v1
    total_kv = shape.total_kv

    def run_aiter_direct(q, kv_data, _qo_indptr, _kv_indptr):
        kv, kv_scale = _ai_call_kv(kv_data, kv_format, q, shape)
        q_in, q_scale = (q, None) if quantize is None else quantize(q)
        # the work list was built from the runner's own indptrs, for this shape
        stage1_op(
            q_in, kv.view(total_kv, 1, NUM_KV_HEADS, QK_DIM),
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_page_indices=kv_indices, kv_last_page_lens=kv_last,
            num_kv_splits_indptr=None, work_meta_data=work["work_meta_data"], work_indptr=work["work_indptr"],
            work_info_set=work["work_info_set"], max_seqlen_q=1, page_size=1, nhead_kv=NUM_KV_HEADS,
            softmax_scale=sm_scale, splitData=split_data, splitLse=split_lse, output=out,
            q_scale=q_scale, kv_scale=kv_scale, **stage1_extra,
        )
        reduce_op(
            split_data, split_lse, reduce_indptr=work["reduce_indptr"], reduce_final_map=work["reduce_final_map"],
            reduce_partial_map=work["reduce_partial_map"], max_seqlen_q=1, final_output=out, **reduce_extra,
        )
        return out

    return run_aiter_direct


def build(variant: Variant, shape: Shape, device, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out for `shape`, with every buffer,
    index array and work list made here; `sm_scale` (the model's softmax scale) goes to
    every AITER call."""
    _ai_validate(variant, shape)
    sm_scale = _ai_sm_scale(sm_scale)
    import aiter
    from aiter.mla import mla_decode_fwd

    features = _ai_checked(aiter)
    device = torch.device(device)
    mode = variant.get("mode")
    if mode == "gluon":
        if not features["gluon"]:
            raise ValueError(f"{variant}: this AITER has no Gluon MLA decode ({_AI_GLUON_MODULE}, "
                             "0.1.18+); install a newer amd-aiter or drop mode gluon")
        if variant.get("kv") == "fp8" and shape.batch > 1 and not features["gluon_fp8_any_batch"]:
            raise ValueError(f"{variant}: this AITER's Gluon decode reads fp8 KV at batch 1 only "
                             "(0.1.18 to 0.1.19.post2); install 0.1.20 or later")
        return _ai_gluon_runner(variant, shape, device, sm_scale)
    if mode == "direct" and not features["direct"]:
        raise ValueError(f"{variant}: this AITER's mla_decode_stage1_asm_fwd / mla_reduce_v1 lack what the "
                         "direct mode passes, or their signatures cannot be read (neither from the function "
                         "nor from torch.ops.aiter); drop mode direct or use mode persistent")
    opus = bool(variant.get("opus"))
    if opus and not features["opus"]:
        raise ValueError(f"{variant}: this AITER has no OPUS MLA kernel (mla_decode_fwd_opus_stage1, "
                         "0.1.20+); install a newer amd-aiter or drop opus")
    batch, total_kv = shape.batch, shape.total_kv
    kv_format, q_mode = variant.get("kv"), variant.get("q")
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
            aiter, variant, shape, features, (qo_indptr, kv_indptr, kv_last),
            (q_dtype, kv_dtype), device,
        )
    if mode == "direct":
        return _ai_direct_runner(aiter, features, shape, kv_format, quantize,
                                 (qo_indptr, kv_indptr, kv_indices, kv_last), out, fixed, sm_scale)
    persistent = mode == "persistent"
    if persistent and features["persistent_gate"] and "num_kv_splits" not in fixed and q_mode == kv_format == "bf16":
        raise ValueError(f"{variant}: this AITER's mla_decode_fwd may run it non-persistent (#4144: gfx950 bf16 "
                         "at batch >= AITER_MLA_DECODE_PERSISTENT_MAX_BATCH when num_kv_splits is None) and has no "
                         "get_mla_decode_fwd_max_splits to pass a split count that keeps it persistent; use mode "
                         "direct")
    # mla_decode_fwd reads AITER_MLA_USE_OPUS on every fp8 persistent call (0.1.20+): pin it
    # to the variant's choice, whatever the process environment says
    opus_env = "1" if opus else "0"
    pin_opus = persistent and features["opus"] and q_mode != "bf16" and kv_format == "fp8"

    def run_aiter_mla(q, kv_data, call_qo_indptr, call_kv_indptr):
        kv, kv_scale = _ai_call_kv(kv_data, kv_format, q, shape)
        q_in, q_scale = (q, None) if quantize is None else quantize(q)
        before = os.environ.get(_AI_OPUS_ENV) if pin_opus else None
        if pin_opus:
            os.environ[_AI_OPUS_ENV] = opus_env
        try:
            mla_decode_fwd(
                q_in, kv.view(total_kv, 1, NUM_KV_HEADS, QK_DIM), out,
                # persistent work lists were built from these exact indptrs
                qo_indptr=qo_indptr if persistent else call_qo_indptr,
                kv_indptr=kv_indptr if persistent else call_kv_indptr,
                kv_indices=kv_indices, kv_last_page_lens=kv_last, max_seqlen_q=1,
                page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=sm_scale, logit_cap=0.0,
                q_scale=q_scale, kv_scale=kv_scale, **fixed,
            )
        finally:
            if pin_opus:
                if before is None:
                    os.environ.pop(_AI_OPUS_ENV, None)
                else:
                    os.environ[_AI_OPUS_ENV] = before
        return out

    return run_aiter_mla


def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """The real shape: AITER's Triton reduction specializes on launch arguments this project
    has not audited, and its split caps depend on kv_len, so no smaller stand-in is known
    to compile the same kernels."""
    return shape


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = tuple(_AI_DEFAULT_SPACE)


# ------------------------------------------------------------------------ serving call
_AI_SERVING_MODE = "nonpersistent"


def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """Non-persistent, one split per sequence (right at every length, see the module
    docstring); bf16 q over bf16 KV, q quantized per call on the device (fp8_dynamic) over
    fp8 KV, the only q AITER's non-persistent fp8 kernels read."""
    _ai_serving_check(spec)
    q = "bf16" if spec.kv_format == "bf16" else "fp8_dynamic"
    return Variant.make(NAME, kv=spec.kv_format, q=q, mode=_AI_SERVING_MODE, num_kv_splits=1)


def _ai_serving_check(spec: CallSpec, variant: Variant | None = None) -> None:
    check_serving_spec(NAME, spec, CAPABILITIES, variant)
    if variant is None:
        return
    if variant.get("mode") != _AI_SERVING_MODE:
        raise ValueError(f"aiter: {variant} is a mode={variant.get('mode')} variant; the serving call runs "
                         "AITER's non-persistent kernels (a persistent work list is built for one call's "
                         "lengths); use mode=nonpersistent")


class _AiServingQuantizer:
    """q (total_q, heads, 576) bf16 to fp8 per tensor into buffers it owns, grown (at least
    doubling) when a call brings more rows than any before; AITER's ops when it has them,
    else torch (scaling in fp32 before the one rounding). No host sync."""

    def __init__(self, aiter, q_mode: str, q_amax, heads: int, fp8_dtype, device):
        self.heads, self.fp8_dtype, self.device = heads, fp8_dtype, device
        self.dynamic = q_mode == "fp8_dynamic"
        self.fp8_max = float(torch.finfo(fp8_dtype).max)
        self.scale = torch.empty((1,), dtype=torch.float32, device=device)
        if not self.dynamic:
            self.scale.fill_(float(q_amax) / self.fp8_max)
        self.vendor = getattr(aiter, "dynamic_per_tensor_quant" if self.dynamic else "static_per_tensor_quant", None)
        self.q8 = self.tmp = None

    def __call__(self, q):
        rows = q.shape[0]
        if self.q8 is None or rows > self.q8.shape[0]:
            capacity = max(rows, 2 * self.q8.shape[0]) if self.q8 is not None else rows
            self.q8 = torch.empty((capacity, self.heads, QK_DIM), dtype=self.fp8_dtype, device=self.device)
            if self.vendor is None:
                self.tmp = torch.empty((capacity, self.heads, QK_DIM), dtype=torch.float32, device=self.device)
        q8 = self.q8[:rows]
        if self.vendor is not None:
            self.vendor(q8, q, self.scale)  # pybind ops: positional arguments only
            return q8, self.scale
        if self.dynamic:
            amax = q.abs().amax().reshape(1).to(torch.float32)  # stays on the device
            torch.div(amax.clamp_(min=_AI_AMAX_FLOOR), self.fp8_max, out=self.scale)
        tmp = torch.div(q, self.scale, out=self.tmp[:rows])
        tmp.clamp_(-self.fp8_max, self.fp8_max)
        q8.copy_(tmp)
        return q8, self.scale


def build_serving(variant: Variant, spec: CallSpec, device):
    """A runner(q, qo_indptr, kv, kv_scale, *, kv_indptr | block_table + seq_lens) -> out
    for calls of `spec` (contiguous or 1-token-page KV, one q_len per call) through AITER's
    non-persistent mla_decode_fwd: its index arrays are built on the device into buffers the
    runner owns (grown, at least doubling, with the batch, the block table and the new
    tokens, never from the data), and nothing is read on the host; spec.sm_scale goes to
    AITER as the softmax scale."""
    validate(variant)
    _ai_serving_check(spec, variant)
    import aiter
    from aiter.mla import mla_decode_fwd

    _ai_checked(aiter)
    device = torch.device(device)
    heads, q_mode, splits = spec.heads, variant.get("q"), variant.get("num_kv_splits")
    sm_scale = _ai_sm_scale(getattr(spec, "sm_scale", SM_SCALE))  # the model's softmax scale
    fp8_dtype = aiter.dtypes.fp8
    kv_dtype = torch.bfloat16 if spec.kv_format == "bf16" else fp8_dtype
    quantize = None
    if q_mode != "bf16":
        quantize = _AiServingQuantizer(aiter, q_mode, variant.get("q_amax"), heads, fp8_dtype, device)
    buf: dict = {}

    def grown(name, size, make):
        """buf[name], made again by make(capacity) when it holds fewer than `size` entries."""
        if name not in buf or buf[name].shape[0] < size:
            old = buf[name].shape[0] if name in buf else 0
            buf[name] = make(max(size, 2 * old))
        return buf[name]

    def i32(n, fill=None):
        if fill is None:
            return torch.empty((n,), dtype=torch.int32, device=device)
        return torch.full((n,), fill, dtype=torch.int32, device=device)

    def run_aiter_serving(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None,
                          seq_lens=None, q_lens_host=None, kv_lens_host=None):
        page_size = check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens)
        batch, total_q = qo_indptr.shape[0] - 1, q.shape[0]
        if page_size not in (0, 1):
            raise ValueError(f"aiter reads contiguous KV or pages of 1 token, not pages of {page_size}")
        if q.dim() != 3 or q.shape[1] != heads or q.shape[2] != QK_DIM or q.dtype != torch.bfloat16:
            raise ValueError(f"aiter: this runner serves bf16 q of {heads} heads, (total_q, {heads}, "
                             f"{QK_DIM}); got {q.dtype} {tuple(q.shape)}")
        if kv.dtype != kv_dtype:
            raise ValueError(f"aiter: this runner reads {spec.kv_format} KV ({kv_dtype}), got {kv.dtype}")
        q_len = total_q // batch
        if q_len * batch != total_q or not 1 <= q_len <= spec.max_q_len:
            raise ValueError(f"aiter needs every sequence to bring the same q_len (1..{spec.max_q_len}); "
                             f"{total_q} new tokens over {batch} sequences is not that")
        out = grown("out", total_q, lambda n: torch.empty((n, heads, V_DIM), dtype=torch.bfloat16,
                                                          device=device))[:total_q]
        split_indptr = grown("splits", batch + 1, lambda n: torch.arange(n, dtype=torch.int32,
                                                                         device=device) * splits)
        kv_last = grown("last", batch, lambda n: i32(n, 1))[:batch]  # every 1-token page is full
        rows = kv.shape[0] * kv.shape[1]
        kv_buffer = kv.view(rows, 1, NUM_KV_HEADS, QK_DIM)
        if page_size == 0:
            pages_indptr = kv_indptr
            kv_indices = grown("arange", rows, lambda n: torch.arange(n, dtype=torch.int32, device=device))[:rows]
        else:
            # sequence b's pages block_table[b, :seq_len] packed at pages_indptr[b], on the
            # device: live entries scatter to their place, the rest to one trash slot
            width = block_table.shape[1]
            cells = batch * width
            pages_indptr = grown("indptr", batch + 1, lambda n: i32(n, 0))[: batch + 1]
            torch.cumsum(seq_lens, 0, dtype=torch.int32, out=pages_indptr[1:])
            cols = grown("cols", width, lambda n: torch.arange(n, dtype=torch.int32, device=device))[:width]
            pos = grown("pos", cells, lambda n: torch.empty((n,), dtype=torch.int64, device=device))
            pos = pos[:cells].view(batch, width)
            dead = grown("dead", cells, lambda n: torch.empty((n,), dtype=torch.bool, device=device))
            dead = dead[:cells].view(batch, width)
            torch.add(pages_indptr[:batch].unsqueeze(1), cols.unsqueeze(0), out=pos)
            torch.ge(cols.unsqueeze(0), seq_lens.unsqueeze(1), out=dead)
            pos.masked_fill_(dead, cells)
            kv_indices = grown("indices", cells + 1, i32)[: cells + 1]
            kv_indices.scatter_(0, pos.view(-1), block_table.reshape(-1))
        q_in, q_scale = (q, None) if quantize is None else quantize(q)
        mla_decode_fwd(
            q_in, kv_buffer, out, qo_indptr=qo_indptr, kv_indptr=pages_indptr, kv_indices=kv_indices,
            kv_last_page_lens=kv_last, max_seqlen_q=q_len,
            page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=sm_scale, logit_cap=0.0,
            num_kv_splits=splits, num_kv_splits_indptr=split_indptr[: batch + 1],
            q_scale=q_scale, kv_scale=kv_scale,
        )
        return out

    return run_aiter_serving
