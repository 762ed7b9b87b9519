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
from aiter._checks import need, need_int, need_pow2, need_tensor, paged_attend

# (q dtype, kv dtype) with a persistent assembly kernel at 16 heads, 576/512, q_len 1
_PERSISTENT_PAIRS = ((dtypes.fp8, dtypes.fp8), (dtypes.bf16, dtypes.fp8), (dtypes.bf16, dtypes.bf16))


def _need_type(ok, message):
    # compile_ops checks the arguments against the pybind doc's annotations (TypeError); the
    # real one checks only a process's first call, the fake every call
    if not ok:
        raise TypeError(message)


def _need_optional_tensor(name, value):
    _need_type(value is None or isinstance(value, torch.Tensor),
               f"mla_decode_stage1_asm_fwd: {name} needs to be Optional[torch.Tensor] but got {type(value)}")


def stage1(args: dict) -> None:
    Q, KV, output = args["Q"], args["KV"], args["output"]
    qo_indptr, kv_indptr, kv_indices, kv_last = (args["qo_indptr"], args["kv_indptr"], args["kv_page_indices"],
                                                  args["kv_last_page_lens"])
    work_meta_data, work_indptr, work_info_set = args["work_meta_data"], args["work_indptr"], args["work_info_set"]
    split_data, split_lse, lse = args["splitData"], args["splitLse"], args["lse"]
    q_scale, kv_scale = args["q_scale"], args["kv_scale"]
    max_seqlen_q, page_size, nhead_kv = args["max_seqlen_q"], args["page_size"], args["nhead_kv"]
    softmax_scale = args["softmax_scale"]
    for name in ("max_seqlen_q", "page_size", "nhead_kv"):
        need_int(name, args[name])
    _need_type(isinstance(softmax_scale, float),
               f"mla_decode_stage1_asm_fwd: softmax_scale needs to be <class 'float'> but got {type(softmax_scale)}")
    for name in ("num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set", "q_scale", "kv_scale",
                 "lse"):
        _need_optional_tensor(name, args[name])
    # C++ runs the persistent kernels when num_kv_splits_indptr is None
    need(args["num_kv_splits_indptr"] is None,
         "the fake covers the persistent stage 1 only: num_kv_splits_indptr None and a work list "
         "from get_mla_metadata_v1 (the non-persistent one needs aiter.mla's own Triton stage 2)")
    need(lse is None, "the fake covers lse=None only")
    need_pow2("page_size", page_size)
    need(nhead_kv == 1, "mla_decode_stage1_asm_fwd:only support num_kv_heads==1 for now")
    need_tensor("Q", Q, dim=3)
    need(Q.is_contiguous(), "mla_decode_stage1_asm_fwd:only support Q.is_contiguous() for now")
    total_q, heads = Q.shape[0], Q.shape[1]
    need(heads == 16 and max_seqlen_q == 1 and Q.shape[2] == 576,
         f"the fake covers persistent decode at 16 heads, q_len 1, 576 wide; got Q {tuple(Q.shape)}, "
         f"max_seqlen_q {max_seqlen_q}")
    need_tensor("KV", KV, dim=4)
    need(KV.shape[1] == page_size and KV.shape[2] == nhead_kv,
         f"KV must be [num_pages, page_size={page_size}, nhead_kv=1, 576], got {tuple(KV.shape)}")
    need(KV.shape[3] == Q.shape[2], "mla_decode_stage1_asm_fwd:only support head_size == KV.size(3) for now")
    need(KV.stride()[1:] == (nhead_kv * 576, 576, 1),
         f"KV's inner dims must be dense (strides (*, {nhead_kv * 576}, 576, 1)), got {KV.stride()}")
    need_tensor("output", output, dtype=dtypes.bf16, shape=(total_q, heads, 512))
    need(output.is_contiguous(), f"output must be dense (contiguous), got strides {output.stride()}")
    bs = qo_indptr.shape[0] - 1 if isinstance(qo_indptr, torch.Tensor) else -1
    _checks.need_indptrs(bs, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_last_page_lens=kv_last,
                         kv_page_indices=kv_indices)
    need(qo_indptr.tolist() == list(range(bs + 1)), f"qo_indptr must be arange(bs + 1) at q_len 1, got "
         f"{qo_indptr.tolist()[:8]}")
    pair = (Q.dtype, KV.dtype)
    need(pair in _PERSISTENT_PAIRS, f"mla_decode_stage1_asm_fwd: cannot find suitable kernel (no persistent kernel "
         f"for Q {Q.dtype} with KV {KV.dtype})")
    _checks.need_scales("Q", Q.dtype, q_scale, KV.dtype, kv_scale, "the kernel would read an unset scale")

    need(work_meta_data is not None and work_indptr is not None and work_info_set is not None,
         "the persistent stage 1 needs work_meta_data, work_indptr and work_info_set")
    built = _checks.need_work_list(work_meta_data, work_indptr, work_info_set, kv_indptr, page_size, Q.dtype,
                                   KV.dtype)
    rows = built["partial_rows"] * max_seqlen_q
    for name, t, width in (("splitData", split_data, 512), ("splitLse", split_lse, 1)):
        need_tensor(name, t, dtype=torch.float32, dim=4)
        need(t.shape[0] >= rows and tuple(t.shape[1:]) == (1, heads, width),
             f"{name} must be fp32 [>= {rows} partial rows, 1, {heads}, {width}] for this work list "
             f"(mla_decode_fwd sizes it reduce_partial_map.size(0) * max_seqlen_q), got {tuple(t.shape)}")
        need(t.is_contiguous(), f"{name} must be contiguous")

    _state.calls["mla_decode_stage1_asm_fwd"] += 1
    _state.last_call = {"mode": "persistent", "stage1": "asm", "entry": "mla_decode_stage1_asm_fwd",
                        "q_dtype": Q.dtype, "kv_dtype": KV.dtype, "reduced": False, "sm_scale": softmax_scale}
    out = paged_attend(Q, q_scale, KV, kv_scale, qo_indptr, kv_indptr, kv_indices, kv_last, page_size, softmax_scale)
    _state.partials[split_data.data_ptr()] = {
        "out": out, "lse": split_lse.data_ptr(), "reduce": built["reduce"], "max_seqlen_q": max_seqlen_q,
        "total_q": total_q,
    }
    output.fill_(float("nan"))


def reduce(args: dict) -> None:
    partial_output, partial_lse = args["partial_output"], args["partial_lse"]
    final_output, final_lse, num_kv_splits = args["final_output"], args["final_lse"], args["num_kv_splits"]
    need_tensor("partial_output", partial_output)
    need_tensor("partial_lse", partial_lse)
    need(partial_output.dtype == partial_lse.dtype == torch.float32,
         "mla_reduce_v1: partial_out and partial_lse must be float32!")
    need_int("max_seqlen_q", args["max_seqlen_q"])
    if _state.new_api:
        # 0.1.16+: the LDS of the reduction is sized for num_kv_splits splits per tile
        need_int("num_kv_splits", num_kv_splits)
        need(num_kv_splits >= _state.cu_num, f"num_kv_splits={num_kv_splits} is below the splits the metadata may "
             f"hold ({_state.cu_num}): pass get_mla_decode_fwd_max_splits(...)")
    for name in ("reduce_indptr", "reduce_partial_map"):
        need_tensor(name, args[name], dtype=torch.int32, dim=1)
    need(final_lse is None, "the fake covers final_lse=None only")
    stash = _state.partials.get(partial_output.data_ptr())
    need(stash is not None, "mla_reduce_v1: these partials were not written by mla_decode_stage1_asm_fwd "
         "(run stage 1 first, into this splitData)")
    need(stash["lse"] == partial_lse.data_ptr(), "partial_lse is not the splitLse stage 1 wrote")
    final_map = args["reduce_final_map"]
    given = (args["reduce_indptr"].data_ptr(), final_map.data_ptr() if final_map is not None else None,
             args["reduce_partial_map"].data_ptr())
    need(given == stash["reduce"], "the reduce buffers are not the ones get_mla_metadata_v1 filled with stage 1's "
         "work list")
    need(args["max_seqlen_q"] == stash["max_seqlen_q"], "max_seqlen_q differs from stage 1's")
    need_tensor("final_output", final_output, dtype=dtypes.bf16, shape=(stash["total_q"], 16, 512))
    need(final_output.is_contiguous(), "final_output must be dense")
    _state.calls["mla_reduce_v1"] += 1
    _state.last_call = dict(_state.last_call, reduced=True, num_kv_splits=num_kv_splits)
    final_output.copy_(stash["out"].to(final_output.dtype))
