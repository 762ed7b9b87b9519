"""Fake aiter.ops.attention: the persistent-mode metadata functions and the two ops under
mla_decode_fwd's persistent path (mla_decode_stage1_asm_fwd, mla_reduce_v1) of each build
faked (0.1.11 and f3be04a12: 0.1.20.post1's less what they lack, _checks.older).

Signatures, buffer-size formulas and builder checks follow ROCm/aiter as read at v0.1.11
(c4a3ff2a04), f3be04a12a and v0.1.20.post1 (de07f3885e): aiter/ops/attention.py,
csrc/include/rocm_ops.hpp, csrc/kernels/mla/metadata.cu, metadata/v1_0_device.cuh,
csrc/py_itfs_cu/asm_mla.cu and csrc/kernels/mla/reduce.cu, with the CU count taken from
the fake's configuration instead of the device. The two ops are
compile_ops stubs whose pybind declarations name every argument (py::arg), so the real
ones take keywords; in the real package their exported wrapper shows (*args, **kwargs) to
inspect.signature and the names live in the torch op schema (torch.ops.aiter.<name>),
while the fake's functions carry the stub's signature directly.
"""

import math

import torch
from aiter import _asm, _checks, _state, dtypes
from aiter._checks import keywords_past, need, need_pow2, need_tensor, need_type, older


def get_mla_metadata_info_v1(
    batch_size: int,
    max_seqlen_qo: int,
    num_head_qo: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    is_sparse: bool,
    fast_mode: bool = True,
    num_kv_splits: int = 32,
    intra_batch_mode: bool = False,
    max_split_per_batch: int = -1,
):
    assert num_head_qo % 16 == 0
    _state.calls["get_mla_metadata_info_v1"] += 1
    cu_num = _state.cu_num  # 0.1.20: get_mla_decode_fwd_max_splits, CUs x occupancy 1 here
    wide = num_head_qo == 16 or (num_head_qo == 128 and kv_dtype == q_dtype == dtypes.fp8)
    tiles = math.ceil(max_seqlen_qo * num_head_qo / (128 if wide else 16))
    batch_size = batch_size * max_seqlen_qo if is_sparse else batch_size
    tile_cnt = batch_size * tiles
    if fast_mode:
        max_work = (batch_size + cu_num - 1) * tiles
        max_split_tiles = min(batch_size + cu_num - 1, (cu_num - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * cu_num
    if max_split_per_batch > 0:  # 0.1.20: a global budget shared by every tile
        max_split_tiles = max(max_split_tiles, tile_cnt + min(cu_num, max_split_per_batch * batch_size))
    if intra_batch_mode:
        max_work = max_split_tiles = tile_cnt * num_kv_splits
    return ((2, torch.uint64), (cu_num + 1, torch.int32), ((max_work, 8), torch.int32),
            (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))


def get_mla_decode_fwd_max_splits(num_head_qo: int, max_seqlen_qo: int, q_dtype: torch.dtype,
                                  kv_dtype: torch.dtype) -> int:
    """0.1.16+: CUs x occupancy (1 for 16 heads), the LDS bound mla_reduce_v1 needs."""
    return _state.cu_num


def mla_decode_fwd_opus_stage1(*args, **kwargs) -> None:
    """0.1.20+: the OPUS fp8 stage 1; mla_decode_fwd calls it under AITER_MLA_USE_OPUS=1
    (the fake computes every stage 1 in mla._decode and only records which one ran)."""
    raise _checks.FakeAiterError("the fake runs OPUS through mla_decode_fwd only")


_TYPES = {  # what compile_ops checks against the stub's annotations before calling C++
    "num_heads_per_head_k": int, "num_heads_k": int, "is_causal": bool, "page_size": int,
    "kv_granularity": int, "max_seqlen_qo": int, "uni_seqlen_qo": int, "fast_mode": bool,
    "topk": int, "max_split_per_batch": int, "intra_batch_mode": bool,
}


def get_mla_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_heads_per_head_k: int,
    num_heads_k: int,
    is_causal: bool,
    work_metadata_ptrs: torch.Tensor,
    work_info_set: torch.Tensor,
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    page_size: int = 1,
    kv_granularity: int = 16,
    max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1,
    fast_mode: bool = True,
    topk: int = -1,
    max_split_per_batch: int = -1,
    intra_batch_mode: bool = False,
    is_cp_round_robin: bool = False,
    mla_version: int = 0,  # MlaVersion.V32.value
    dtype_q_nope: torch.dtype | None = None,
    dtype_q_rope: torch.dtype | None = None,
    dtype_kv_nope: torch.dtype | None = None,
    dtype_kv_rope: torch.dtype | None = None,
    dtype_q: torch.dtype | None = None,
    dtype_kv: torch.dtype | None = None,
) -> None:
    need(not is_cp_round_robin and mla_version == 0, "the fake covers DeepSeek V3.2 MLA without CP only")
    args = dict(locals())
    for name in ("dtype_q_nope", "dtype_q_rope", "dtype_kv_nope", "dtype_kv_rope", "dtype_q", "dtype_kv"):
        need_type(args[name] is None or isinstance(args[name], torch.dtype),
                  f"get_mla_metadata_v1: {name} needs to be Optional[torch.dtype]")
    for name, kind in _TYPES.items():
        need_type(isinstance(args[name], kind),
                  f"get_mla_metadata_v1: {name} needs to be {kind} but got {type(args[name])}")
    # dtype_q / dtype_kv are legacy aliases filling the nope and rope dtypes left unset
    dtype_q = next((d for d in (dtype_q, dtype_q_nope, dtype_q_rope) if d is not None), None)
    dtype_kv = next((d for d in (dtype_kv, dtype_kv_nope, dtype_kv_rope) if d is not None), None)
    need_pow2("kv_granularity", kv_granularity)
    need_pow2("page_size", page_size)
    for name, t in (("seqlens_qo_indptr", seqlens_qo_indptr), ("seqlens_kv_indptr", seqlens_kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens)):
        need_tensor(name, t, dim=1)
        need(t.dtype == torch.int32, f"get_mla_metadata_v1: {name}'s element type should be int!")
        need(t.stride(0) == 1, f"get_mla_metadata_v1: {name} should be continuous!")
    batch = seqlens_kv_indptr.shape[0] - 1
    need(num_heads_k * num_heads_per_head_k == 16, "the fake covers 16 query heads only")
    need(num_heads_k == 1, "nhead_kv must be 1")
    cu_num = _state.cu_num
    need_tensor("work_metadata_ptrs", work_metadata_ptrs, dtype=torch.uint64, shape=(2,))
    need_tensor("work_indptr", work_indptr, dtype=torch.int32, shape=(cu_num + 1,))
    need_tensor("work_info_set", work_info_set, dtype=torch.int32, dim=2)
    need(work_info_set.shape[1] == 8, f"work_info_set rows hold 8 int32, got {tuple(work_info_set.shape)}")
    need_tensor("reduce_indptr", reduce_indptr, dtype=torch.int32, shape=(batch + 1,))
    need_tensor("reduce_final_map", reduce_final_map, dtype=torch.int32, shape=(batch, 2))
    need_tensor("reduce_partial_map", reduce_partial_map, dtype=torch.int32, dim=1)

    bounds = seqlens_kv_indptr.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if fast_mode:
        work_rows = batch + cu_num - 1
        partial_rows = min(batch + cu_num - 1, (cu_num - 1) * 2)
    elif intra_batch_mode:
        need(max_split_per_batch >= 1, "intra_batch_mode uses max_split_per_batch as the split "
             f"count; {max_split_per_batch} splits cannot be built")
        # splits per sequence in metadata/v1_0_device.cuh (get_local_splits)
        splits = [16 if _state.arch.startswith("gfx942") else
                  min(n // 196, -(-cu_num // batch), max_split_per_batch) for n in lengths]
        need(min(splits) >= 1, "integer division by zero in the v1_0 builder: a sequence shorter than 196 "
             f"tokens gets zero splits (kv lengths {lengths[:4]})")
        work_rows = partial_rows = sum(splits)
    else:
        work_rows = partial_rows = batch * cu_num
    need(work_info_set.shape[0] >= work_rows,
         f"work_info_set holds {work_info_set.shape[0]} rows but the builder writes {work_rows}: "
         "size it with get_mla_metadata_info_v1 for the same mode and split count")
    need(reduce_partial_map.shape[0] >= partial_rows,
         f"reduce_partial_map holds {reduce_partial_map.shape[0]} entries but the builder writes {partial_rows}")

    _state.calls["get_mla_metadata_v1"] += 1
    work_indptr.zero_()
    work_info_set.zero_()
    reduce_indptr.copy_(torch.arange(batch + 1, dtype=torch.int32))
    reduce_final_map.zero_()
    reduce_partial_map.zero_()
    # like the real builder: two pointers, to work_indptr and to work_info_set
    work_metadata_ptrs.copy_(torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()], dtype=torch.uint64))
    _state.metadata[work_metadata_ptrs.data_ptr()] = {
        "kv_indptr": bounds, "dtype_q": dtype_q, "dtype_kv": dtype_kv, "page_size": page_size,
        # what mla_decode_stage1_asm_fwd and mla_reduce_v1 must be given with this work list
        "partial_rows": partial_rows,
        "reduce": (reduce_indptr.data_ptr(), reduce_final_map.data_ptr(), reduce_partial_map.data_ptr()),
    }


def mla_decode_stage1_asm_fwd(
    Q: torch.Tensor,
    KV: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_kv_splits_indptr: torch.Tensor | None,
    work_meta_data: torch.Tensor | None,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    page_size: int,
    nhead_kv: int,
    softmax_scale: float,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    g_kv_indptr: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    valid_split_count: torch.Tensor | None = None,
    use_valid_split_count_reduce: int = 0,
    causal: bool = True,
) -> None:
    need(g_kv_indptr is None and cp_world_size == 1 and cp_rank == 0, "the fake covers no context parallelism")
    need(valid_split_count is None and use_valid_split_count_reduce == 0,
         "valid_split_count is scratch for gfx1250's packed kernels; the fake covers gfx94x / gfx950")
    _asm.stage1(**locals())


def mla_reduce_v1(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    num_kv_splits: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    _asm.reduce(**locals())


if not _state.new_api:  # what 0.1.11 and f3be04a12 lack (see _state.py)
    get_mla_metadata_info_v1 = older(get_mla_metadata_info_v1, "max_split_per_batch")
    get_mla_metadata_v1 = older(get_mla_metadata_v1, "is_cp_round_robin", "mla_version",
                                "dtype_q_nope", "dtype_q_rope", "dtype_kv_nope", "dtype_kv_rope")
    mla_decode_stage1_asm_fwd = older(
        mla_decode_stage1_asm_fwd, "lse", "g_kv_indptr", "cp_world_size", "cp_rank",
        "valid_split_count", "use_valid_split_count_reduce", "causal")
    mla_reduce_v1 = older(mla_reduce_v1, "num_kv_splits", body=_asm.reduce)
    del get_mla_decode_fwd_max_splits, mla_decode_fwd_opus_stage1  # not before 0.1.16 / 0.1.20
# the leading tensors, whose order never moved, positionally; the rest by keyword (_checks.keywords_past)
_LEADING = {"get_mla_metadata_info_v1": 0, "get_mla_metadata_v1": 2, "mla_decode_stage1_asm_fwd": 2,
            "mla_reduce_v1": 2, "get_mla_decode_fwd_max_splits": 0}
for _name, _count in _LEADING.items():
    if _name in globals():
        globals()[_name] = keywords_past(_count)(globals()[_name])
