"""Fake aiter.mla: mla_decode_fwd with the real signature and contract of each build faked.

It enforces what the real call path checks or silently depends on (aiter/mla.py,
csrc/py_itfs_cu/asm_mla.cu, hsa/gfx950/mla/mla_asm.csv) and computes the answer on the CPU
with mla_tune.serving.inputs' fp32 reference (causal among a sequence's new tokens), writing it into `o`
as the real one does; every sequence brings max_seqlen_q new tokens.
"""

import functools
import os

import torch
from aiter import _checks, _state, dtypes
from aiter._checks import keywords_past, need, need_int, need_pow2, need_tensor, older, paged_attend

# (q dtype, kv dtype) -> modes with an assembly kernel for 16 heads, 576/512, qlen 1
_KERNELS = {
    (dtypes.fp8, dtypes.fp8): ("nonpersistent", "persistent"),
    (dtypes.bf16, dtypes.fp8): ("persistent",),
    (dtypes.bf16, dtypes.bf16): ("nonpersistent", "persistent"),
}
_PERSISTENT_BUFFERS = ("work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")
# Non-persistent kernels beyond 16 heads / one query (hsa/gfx9*/mla/mla_asm.csv and the
# dispatch in csrc/py_itfs_cu/asm_mla.cu at v0.1.11; v0.1.20.post1 has the same for these
# heads): (q dtype, kv dtype) -> {heads: the largest q_len (max_seqlen_q) with a kernel}.
# 16 heads pad q_len 3 to 4 (bf16 also 5-8 to 8); 32, 64 and 128 heads have "qSeqLen 0"
# kernels that take any q_len (16 here: what the fake checks up to).
_NONPERSISTENT_QLEN = {
    (dtypes.bf16, dtypes.bf16): {16: 8, 32: 16, 64: 16, 128: 16},
    (dtypes.fp8, dtypes.fp8): {16: 4, 128: 16},
}
# 0.1.18+ (#4144): at or above AITER_MLA_DECODE_PERSISTENT_MAX_BATCH (default 32; <= 0
# turns the gate off), a gfx950 bf16 x bf16, 16-head, q_len 1 persistent call that leaves
# num_kv_splits to AITER runs non-persistent. Read once per process, as AITER reads it.
_PERSISTENT_MAX_BATCH_DEFAULT = 32


@functools.lru_cache(maxsize=1)
def _persistent_mla_decode_max_batch():
    try:
        return int(os.getenv("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", _PERSISTENT_MAX_BATCH_DEFAULT))
    except (TypeError, ValueError):
        return _PERSISTENT_MAX_BATCH_DEFAULT


def _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q_dtype, kv_dtype):
    """0.1.18+: whether a persistent request without num_kv_splits stays persistent."""
    if not (_state.arch.startswith("gfx950") and q_dtype == kv_dtype == dtypes.bf16 and nhead == 16
            and max_seqlen_q == 1):
        return True
    max_batch = _persistent_mla_decode_max_batch()
    return max_batch <= 0 or bs < max_batch


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,  # 1.0 / (qk_head_dim**0.5)
    logit_cap=0.0,
    num_kv_splits=None,  # for experts only!!!
    num_kv_splits_indptr=None,  # for experts only!!!
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode=False,
    return_logits=False,
    return_lse=False,
    g_kv_indptr=None,
    cp_world_size=1,
    cp_rank=0,
    causal=True,
):
    need(g_kv_indptr is None and cp_world_size == 1 and cp_rank == 0, "the fake covers no context parallelism")
    # read on every call, like the real one; it applies to fp8 persistent calls with page 1
    use_opus = os.environ.get("AITER_MLA_USE_OPUS", "0") == "1"
    keep_persistent = (work_meta_data is None or num_kv_splits is not None or not isinstance(q, torch.Tensor)
                       or _use_persistent_mla_decode(qo_indptr.shape[0] - 1, q.shape[1], max_seqlen_q,
                                                     q.dtype, kv_buffer.dtype))
    return _decode(**locals())


def _decode(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size,
            nhead_kv, sm_scale, logit_cap, num_kv_splits, num_kv_splits_indptr, work_meta_data, work_indptr,
            work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map, q_scale, kv_scale,
            intra_batch_mode, return_logits, return_lse, use_opus=False, keep_persistent=True, **_unfaked):
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    # v0.1.10.post2 put page_size and nhead_kv after max_seqlen_q: an old positional call
    # lands sm_scale here
    need_pow2("page_size (pass sm_scale and what follows by keyword)", page_size)
    need_int("max_seqlen_q", max_seqlen_q)
    need(max_seqlen_q >= 1, f"max_seqlen_q must be >= 1, got {max_seqlen_q}")
    bs = _checks.need_paged(("q", "kv_buffer", "o", "kv_indices"), q, kv_buffer, o, page_size, nhead_kv,
                            max_seqlen_q, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens)
    heads = q.shape[1]
    need(sm_scale is None or isinstance(sm_scale, float), f"sm_scale must be a float, got {sm_scale!r}")

    # 0.1.18+: the #4144 gate may turn a persistent request into a non-persistent call
    # (ignoring the work list) without a word
    persistent = work_meta_data is not None and keep_persistent
    # Python picks the mode from work_meta_data, C++ from num_kv_splits_indptr
    need(not (persistent and num_kv_splits_indptr is not None),
         "never pass num_kv_splits_indptr with work_meta_data: Python and C++ would disagree on the mode")
    mode = "persistent" if persistent else "nonpersistent"
    pair = (q.dtype, kv_buffer.dtype)
    if persistent or (heads, max_seqlen_q) == (16, 1):
        need(heads == 16 and max_seqlen_q == 1, "the fake covers persistent decode at 16 heads, q_len 1")
        need(mode in _KERNELS.get(pair, ()), f"no {mode} MLA decode kernel for q {q.dtype} with KV {kv_buffer.dtype}")
    else:
        longest = _NONPERSISTENT_QLEN.get(pair, {}).get(heads, 0)
        need(max_seqlen_q <= longest, f"no nonpersistent MLA decode kernel for q {q.dtype} with KV "
             f"{kv_buffer.dtype} at {heads} heads, max_seqlen_q {max_seqlen_q}")
    _checks.need_scales("q", q.dtype, q_scale, kv_buffer.dtype, kv_scale,
                        "v0.1.11 leaves it uninitialised otherwise")

    if persistent:
        if _state.new_api and num_kv_splits is not None:
            # 0.1.16+: mla_reduce_v1 sizes its LDS from num_kv_splits; fewer than the
            # builder can write per tile would overflow it
            need_int("num_kv_splits", num_kv_splits)
            need(num_kv_splits >= _state.cu_num, f"num_kv_splits={num_kv_splits} is below the splits the "
                 f"metadata may hold ({_state.cu_num}): pass get_mla_decode_fwd_max_splits(...)")
        for name in _PERSISTENT_BUFFERS:
            need_tensor(name, locals()[name])
        _checks.need_work_list(work_meta_data, work_indptr, work_info_set, kv_indptr, page_size, q.dtype,
                               kv_buffer.dtype)
    elif num_kv_splits_indptr is not None:
        need_int("num_kv_splits", num_kv_splits)
        bounds = kv_indptr.tolist()
        longest = max((b - a for a, b in zip(bounds, bounds[1:], strict=False)), default=0) * page_size
        # stage 2 reads at most ceil(kv_len / block) splits (get_meta_param and mgc in
        # aiter/mla.py): blocks of 128 tokens for fp8 q, 64 for bf16
        cap = -(-longest // (128 if q.dtype == dtypes.fp8 else 64))
        need(1 <= num_kv_splits <= cap, f"num_kv_splits={num_kv_splits} is past what stage 2 reads at kv_len "
             f"{longest} (1..{cap}): the extra splits are left unreduced")
        need_tensor("num_kv_splits_indptr", num_kv_splits_indptr, dtype=torch.int32, shape=(bs + 1,))
        expected = list(range(0, (bs + 1) * num_kv_splits, num_kv_splits))
        need(num_kv_splits_indptr.tolist() == expected, "num_kv_splits_indptr must be arange(0, (bs+1)*n, n)")

    stage1 = "asm"
    if (use_opus and persistent and _state.arch.startswith("gfx950") and q.dtype == kv_buffer.dtype == dtypes.fp8
            and page_size == 1 and q_scale is not None and kv_scale is not None):
        stage1 = "opus"
        _state.calls["mla_decode_fwd_opus_stage1"] += 1
    _state.calls["mla_decode_fwd"] += 1
    _state.last_call = {"mode": mode, "stage1": stage1, "q_dtype": q.dtype, "kv_dtype": kv_buffer.dtype,
                        "num_kv_splits": num_kv_splits, "intra_batch_mode": intra_batch_mode}

    out = paged_attend(q, q_scale, kv_buffer, kv_scale, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       page_size, sm_scale)
    o.copy_(out.to(o.dtype))
    return out.unsqueeze(1), None


if not _state.new_api:  # 0.1.11 and f3be04a12: no context parallelism, no `causal`, no gate, no OPUS
    mla_decode_fwd = older(mla_decode_fwd, "g_kv_indptr", "cp_world_size", "cp_rank", "causal", body=_decode)
# q, kv_buffer and o positionally; the rest by keyword (mla-tune's rule, _checks.keywords_past)
mla_decode_fwd = keywords_past(3)(mla_decode_fwd)
