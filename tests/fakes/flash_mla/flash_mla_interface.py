"""Fake flash_mla.flash_mla_interface (sgl-flash-mla 1.0.0), dense legacy decoding only.

q is (batch, s_q, h_q, d) with any s_q and h_q; with causal=True new token i sees the first
seq_len - (s_q - 1 - i) tokens (get_mask_len in csrc/sm90/decode/dense/splitkv_mla.cuh,
col_limit_right in the fp8 extension's flash_fwd_mla_kernel.h); causal is ignored at s_q 1,
as the library does. The answer is mla_tune.serving.inputs' fp32 reference, at `softmax_scale`
(a float, or None for d ** -0.5, as the library takes it), and softmax_lse is its natural-log
log-sum-exp, (batch, h_q, s_q) float32, as the library returns it (its kernels compute
scale_softmax * max + log(sum); vLLM's FlashMLA backend merges it as base e).
"""

import dataclasses

import torch

from mla_tune.serving.inputs import reference

calls = {"get_mla_decoding_metadata": 0, "flash_mla_with_kvcache": 0}
last_call = {}  # the last flash_mla_with_kvcache's softmax_scale
# a schedule's id (written in its tile_scheduler_metadata[0, 0], so that a copy of the
# metadata, as the real one would be, still names it) -> what the schedule was made for
_schedules = {}


def _need(condition, message):
    if not condition:
        raise RuntimeError(message)


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    config: object | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    return FlashMLASchedMeta(), None


def get_mla_decoding_metadata(
    seqlens_k: torch.Tensor,
    num_q_tokens_per_head_k: int,
    h_k: int,
    h_q: int | None = None,
    is_fp8_kvcache: bool = False,
    topk: int | None = None,
    use_legacy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _need(isinstance(seqlens_k, torch.Tensor) and seqlens_k.dim() == 1, "seqlens_k must be a 1-D tensor")
    _need(seqlens_k.dtype == torch.int32, "seqlens_k must have dtype int32")
    _need(h_k == 1, "num_heads_k must be 1 (MQA)")
    dense_fp8 = is_fp8_kvcache and topk is None
    assert use_legacy or not dense_fp8, "dense fp8 decoding exists only on the legacy side"
    calls["get_mla_decoding_metadata"] += 1
    batch = seqlens_k.shape[0]
    meta = torch.zeros((8, 8), dtype=torch.int32)
    splits = torch.arange(batch + 1, dtype=torch.int32)
    meta[0, 0] = len(_schedules) + 1
    _schedules[int(meta[0, 0])] = {"fp8": dense_fp8, "seqlens": seqlens_k.tolist(),
                                   "num_q_tokens_per_head_k": num_q_tokens_per_head_k}
    return meta, splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool | None = None,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: str | None = None,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    sched = tile_scheduler_metadata
    assert isinstance(sched, FlashMLASchedMeta), "tile_scheduler_metadata must be of type FlashMLASchedMeta"
    assert num_splits is None, "num_splits must be None"
    _need(indices is None, "the fake covers dense decoding only")
    is_fp8_kvcache = bool(is_fp8_kvcache)
    assert use_legacy, "Dense MLA decoding was removed from the current kernels; pass use_legacy=True"
    assert kv_format is None, "kv_format does not apply to dense decoding"
    _need(q.dim() == 4 and k_cache.dim() == 4, "q must be (b, s_q, h_q, d) and k_cache (blocks, page, h_k, d)")
    batch, s_q, h_q, d = q.shape
    _need(q.stride(-1) == 1, "Expected q.stride(-1) == 1")
    _need(k_cache.shape[1] == 64, "Currently page_block_size must be 64")
    _need(k_cache.shape[2] == 1 and k_cache.shape[3] == d and d in (576, 512),
          f"kcache must have shape (num_blocks, 64, 1, {d}), got {tuple(k_cache.shape)}")
    _need(k_cache.stride(1) == d and k_cache.stride(3) == 1, "each page block in the KV cache must be contiguous")
    _need(q.dtype == k_cache.dtype, "query and key must have the same dtype")
    _need(head_dim_v == 512, "head_dim_v must be 512")
    for name, t, dim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        _need(isinstance(t, torch.Tensor) and t.dim() == dim, f"{name} must be a {dim}-D tensor")
        _need(t.dtype == torch.int32, f"{name} must have dtype torch.int32")
        _need(t.shape[0] == batch, f"{name} must have batch_size rows")
    _need(block_table.stride(-1) == 1, "Expected block_table.stride(-1) == 1")
    if is_fp8_kvcache:
        _need(q.dtype == torch.float8_e4m3fn, "dense fp8 decoding reads fp8 (e4m3fn) q and KV")
        _need(sched.tile_scheduler_metadata is not None,
              "dense fp8 decoding needs metadata from get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True)")
        _need(descale_q is not None and descale_k is not None, "Expected descale_q.has_value() && descale_k.has_value()")
        for name, t in (("descale_q", descale_q), ("descale_k", descale_k)):
            _need(t.dtype == torch.float32 and tuple(t.shape) == (1,), f"{name} must be fp32 of shape (1,)")
    else:
        _need(q.dtype == torch.bfloat16, "q must have dtype ScalarType::BFloat16")
        assert descale_q is None and descale_k is None, "descale_q/descale_k apply to the dense fp8 path only"
    if sched.tile_scheduler_metadata is None:  # the bf16 path schedules on its first call
        sched.tile_scheduler_metadata, sched.num_splits = get_mla_decoding_metadata(
            cache_seqlens, s_q * h_q, 1, h_q, False, None, True)
    made = _schedules.get(int(sched.tile_scheduler_metadata[0, 0]))
    _need(made is not None, "tile_scheduler_metadata was not made by get_mla_decoding_metadata")
    _need(made["fp8"] == is_fp8_kvcache, "the schedule was made for the other (bf16 / fp8) kernel")
    _need(made["seqlens"] == cache_seqlens.tolist(), "the schedule was made for other sequence lengths")
    _need(made["num_q_tokens_per_head_k"] == s_q * h_q, "the schedule was made for another head count")
    _need(softmax_scale is None or (isinstance(softmax_scale, float) and softmax_scale > 0),
          f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
    calls["flash_mla_with_kvcache"] += 1
    last_call.update(softmax_scale=softmax_scale)

    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    q32 = q.float() * (descale_q.float() if is_fp8_kvcache else 1.0)
    kv_scale = descale_k.float() if is_fp8_kvcache else None
    pages = k_cache[:, :, 0, :]  # (blocks, 64, d): the layout mla_tune.serving.inputs reads
    if causal or s_q == 1:
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * s_q
        table, lengths = block_table, cache_seqlens
    else:  # every new token sees the whole sequence: each row its own one-token query
        qo_indptr = torch.arange(batch * s_q + 1, dtype=torch.int32)
        table = block_table.repeat_interleave(s_q, dim=0)
        lengths = cache_seqlens.repeat_interleave(s_q)
    out, lse = reference(q32.reshape(batch * s_q, h_q, d), qo_indptr, pages, kv_scale, block_table=table,
                         seq_lens=lengths, sm_scale=scale, return_lse=True)
    out = out.to(torch.bfloat16).view(batch, s_q, h_q, head_dim_v)
    return out, lse.view(batch, s_q, h_q).transpose(1, 2).contiguous()
