"""What the fake's mla_decode_stage1_asm_fwd and mla_reduce_v1 check and compute (their
signatures per build are in aiter/ops/attention.py).

Persistent mode only, 16 heads, q_len 1: the stage 1 that mla_decode_fwd runs over a work
list from get_mla_metadata_v1, then the reduction of its partials. The real stage 1 writes
each work item's partial output and LSE into splitData / splitLse (an unsplit item straight
into `output`), and mla_reduce_v1 merges the partials into final_output. The fake computes
the whole answer in fp32 at stage 1, keeps it under splitData's address, fills `output`
with NaN (not final until reduced) and writes the answer at the reduction, so skipping the
reduction, or reducing other buffers than stage 1 wrote, fails the check.
The fp32 numerics say nothing about the accuracy of AITER's kernels: no accuracy evidence.
"""

import torch
from aiter import _checks, _state, dtypes
from aiter._checks import need, need_int, need_pow2, need_tensor, need_type, paged_attend
from aiter.mla import _KERNELS


def stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, num_kv_splits_indptr,
           work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv, softmax_scale,
           splitData, splitLse, output, lse, q_scale, kv_scale, **_unfaked) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("page_size", page_size), ("nhead_kv", nhead_kv)):
        need_int(name, value)
    need_type(isinstance(softmax_scale, float), "mla_decode_stage1_asm_fwd: softmax_scale needs to be "
              f"<class 'float'> but got {type(softmax_scale)}")
    for name in ("num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set", "q_scale", "kv_scale",
                 "lse"):
        value = locals()[name]
        need_type(value is None or isinstance(value, torch.Tensor), f"mla_decode_stage1_asm_fwd: {name} "
                  f"needs to be Optional[torch.Tensor] but got {type(value)}")
    # C++ runs the persistent kernels when num_kv_splits_indptr is None
    need(num_kv_splits_indptr is None,
         "the fake covers the persistent stage 1 only: num_kv_splits_indptr None and a work list "
         "from get_mla_metadata_v1 (the non-persistent one needs aiter.mla's own Triton stage 2)")
    need(lse is None, "the fake covers lse=None only")
    need_pow2("page_size", page_size)
    _checks.need_paged(("Q", "KV", "output", "kv_page_indices"), Q, KV, output, page_size, nhead_kv,
                       max_seqlen_q, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens)
    total_q, heads = Q.shape[0], Q.shape[1]
    need(heads == 16 and max_seqlen_q == 1, "the fake covers persistent decode at 16 heads, q_len 1; got Q "
         f"{tuple(Q.shape)}, max_seqlen_q {max_seqlen_q}")
    pair = (Q.dtype, KV.dtype)
    need("persistent" in _KERNELS.get(pair, ()), "mla_decode_stage1_asm_fwd: cannot find suitable kernel "
         f"(no persistent kernel for Q {Q.dtype} with KV {KV.dtype})")
    _checks.need_scales("Q", Q.dtype, q_scale, KV.dtype, kv_scale, "the kernel would read an unset scale")

    need(work_meta_data is not None and work_indptr is not None and work_info_set is not None,
         "the persistent stage 1 needs work_meta_data, work_indptr and work_info_set")
    built = _checks.need_work_list(work_meta_data, work_indptr, work_info_set, kv_indptr, page_size, Q.dtype,
                                   KV.dtype)
    rows = built["partial_rows"] * max_seqlen_q
    for name, t, width in (("splitData", splitData, 512), ("splitLse", splitLse, 1)):
        need_tensor(name, t, dtype=torch.float32, dim=4)
        need(t.shape[0] >= rows and tuple(t.shape[1:]) == (1, heads, width),
             f"{name} must be fp32 [>= {rows} partial rows, 1, {heads}, {width}] for this work list "
             f"(mla_decode_fwd sizes it reduce_partial_map.size(0) * max_seqlen_q), got {tuple(t.shape)}")
        need(t.is_contiguous(), f"{name} must be contiguous")

    _state.calls["mla_decode_stage1_asm_fwd"] += 1
    _state.last_call = {"mode": "persistent", "stage1": "asm", "entry": "mla_decode_stage1_asm_fwd",
                        "q_dtype": Q.dtype, "kv_dtype": KV.dtype, "reduced": False, "sm_scale": softmax_scale}
    out = paged_attend(Q, q_scale, KV, kv_scale, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens,
                       page_size, softmax_scale)
    _state.partials[splitData.data_ptr()] = {
        "out": out, "lse": splitLse.data_ptr(), "reduce": built["reduce"], "max_seqlen_q": max_seqlen_q,
        "total_q": total_q,
    }
    output.fill_(float("nan"))


def reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map, max_seqlen_q,
           final_output, final_lse, num_kv_splits=None) -> None:
    need_tensor("partial_output", partial_output)
    need_tensor("partial_lse", partial_lse)
    need(partial_output.dtype == partial_lse.dtype == torch.float32,
         "mla_reduce_v1: partial_out and partial_lse must be float32!")
    need_int("max_seqlen_q", max_seqlen_q)
    if _state.new_api:
        # 0.1.16+: the LDS of the reduction is sized for num_kv_splits splits per tile
        need_int("num_kv_splits", num_kv_splits)
        need(num_kv_splits >= _state.cu_num, f"num_kv_splits={num_kv_splits} is below the splits the metadata may "
             f"hold ({_state.cu_num}): pass get_mla_decode_fwd_max_splits(...)")
    need_tensor("reduce_indptr", reduce_indptr, dtype=torch.int32, dim=1)
    need_tensor("reduce_partial_map", reduce_partial_map, dtype=torch.int32, dim=1)
    need(final_lse is None, "the fake covers final_lse=None only")
    stash = _state.partials.get(partial_output.data_ptr())
    need(stash is not None, "mla_reduce_v1: these partials were not written by mla_decode_stage1_asm_fwd "
         "(run stage 1 first, into this splitData)")
    need(stash["lse"] == partial_lse.data_ptr(), "partial_lse is not the splitLse stage 1 wrote")
    given = (reduce_indptr.data_ptr(), reduce_final_map.data_ptr() if reduce_final_map is not None else None,
             reduce_partial_map.data_ptr())
    need(given == stash["reduce"], "the reduce buffers are not the ones get_mla_metadata_v1 filled with stage 1's "
         "work list")
    need(max_seqlen_q == stash["max_seqlen_q"], "max_seqlen_q differs from stage 1's")
    need_tensor("final_output", final_output, dtype=dtypes.bf16, shape=(stash["total_q"], 16, 512))
    need(final_output.is_contiguous(), "final_output must be dense")
    _state.calls["mla_reduce_v1"] += 1
    _state.last_call = dict(_state.last_call, reduced=True, num_kv_splits=num_kv_splits)
    final_output.copy_(stash["out"].to(final_output.dtype))
