"""Fake flashinfer.mla (0.6.18.post1): BatchMLAPagedAttentionWrapper on the CPU."""

import math

import torch

from mla_tune.core import SM_SCALE
from mla_tune.problem import reference

# class-wide call records, reset whenever the fake is installed afresh
calls = {"init": 0, "plan": 0, "run": 0}
last_run = {}


def _need(condition, message):
    if not condition:
        raise ValueError(message)


def _check(name, t, shape, dtype):
    _need(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _need(tuple(t.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    _need(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _need(t.stride(-1) == 1, f"{name} must have unit stride in its last dim (strides {t.stride()})")


class BatchMLAPagedAttentionWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        _need(isinstance(float_workspace_buffer, torch.Tensor), "float_workspace_buffer must be a tensor")
        _need(backend in ("auto", "fa2", "fa3", "cutlass"), f"unknown backend {backend!r}")
        _need(backend != "cutlass", "the cutlass MLA backend runs on SM100/SM110 only")
        calls["init"] += 1
        self.device = float_workspace_buffer.device
        self._backend = "fa3" if backend == "auto" else backend
        self._planned = False

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        supported = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
        _need(kv_data_type in supported, f"MLA kv_data_type {kv_data_type} is not supported")
        if kv_data_type == torch.float8_e4m3fn:
            _need(self._backend in ("fa2", "fa3"), "FP8 kv_data_type for MLA needs the fa2 or fa3 backend")
            _need(q_data_type == torch.bfloat16, "FP8 kv_data_type for MLA currently only supports q_data_type=torch.bfloat16")
            _need(head_dim_ckv == 512 and head_dim_kpe in (0, 64), "FP8 KV MLA needs head_dim_ckv=512, head_dim_kpe 0/64")
        batch = qo_indptr.shape[0] - 1
        for name, t, size in (("qo_indptr", qo_indptr, batch + 1), ("kv_indptr", kv_indptr, batch + 1),
                              ("kv_len_arr", kv_len_arr, batch), ("kv_indices", kv_indices, None)):
            _need(isinstance(t, torch.Tensor) and t.dim() == 1, f"{name} must be a 1-D tensor")
            # the JIT module is specialised on qo_indptr's dtype; run() checks kv_indices is int32
            _need(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _need(size is None or t.shape[0] == size, f"{name} must have {size} entries, got {t.shape[0]}")
        _need(isinstance(page_size, int) and page_size >= 1, f"page_size must be a positive int, got {page_size!r}")
        _need(isinstance(sm_scale, float), f"sm_scale must be a float, got {sm_scale!r}")
        calls["plan"] += 1
        # plan() copies the index arrays to the host (a device sync on a GPU)
        self._kv_indptr = kv_indptr.tolist()
        self._kv_indices = kv_indices.tolist()
        self._kv_len = kv_len_arr.tolist()
        self._num_heads, self._page_size, self._sm_scale = num_heads, page_size, sm_scale
        self._dims = (head_dim_ckv, head_dim_kpe)
        self._q_data_type, self._kv_data_type = q_data_type, kv_data_type
        self._planned = True

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None,
        kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        return_lse_base_on_e: bool = False,
        o_scale: float | None = None,
        *,
        ckv_scale: float | None = None,
        ckv_scale_arr: torch.Tensor | None = None,
        kpe_scale: float | None = None,
    ):
        _need(self._planned, "run() before plan()")
        _need(o_scale is None, "o_scale is only supported with the cutlass backend for now.")
        batch, heads = len(self._kv_len), self._num_heads
        d_ckv, d_kpe = self._dims
        _check("q_nope", q_nope, (batch, heads, d_ckv), self._q_data_type)
        _check("q_pe", q_pe, (batch, heads, d_kpe), self._q_data_type)
        _need(ckv_cache.dim() == 3 and kpe_cache.dim() == 3, "ckv/kpe caches must be [num_pages, page_size, dim]")
        pages = ckv_cache.shape[0]
        _check("ckv_cache", ckv_cache, (pages, self._page_size, d_ckv), self._kv_data_type)
        _check("kpe_cache", kpe_cache, (pages, self._page_size, d_kpe), self._kv_data_type)
        if self._kv_data_type == torch.float8_e4m3fn:
            _need((ckv_scale is None) != (ckv_scale_arr is None), "Exactly one of ckv_scale or ckv_scale_arr is required when kv_data_type is FP8.")
            _need(kpe_scale is not None, "kpe_scale is required when kv_data_type is FP8.")
            for name, value in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale)):
                if value is not None:
                    _need(math.isfinite(float(value)) and float(value) > 0, f"{name} must be a finite positive value")
        else:
            _need(ckv_scale is None and ckv_scale_arr is None and kpe_scale is None,
                  "ckv_scale / ckv_scale_arr / kpe_scale are only valid when kv_data_type is FP8.")
        if out is None:
            out = torch.empty_like(q_nope)
        else:
            _check("out", out, q_nope.shape, q_nope.dtype)
        calls["run"] += 1
        last_run.update(q_nope_stride=q_nope.stride(), ckv_stride=ckv_cache.stride(),
                        ckv_ptr=ckv_cache.data_ptr(), out_ptr=out.data_ptr())

        keys = torch.cat((ckv_cache.float() * float(ckv_scale or 1.0), kpe_cache.float() * float(kpe_scale or 1.0)), dim=-1)
        tokens, indptr = [], [0]
        for b in range(batch):
            ids = torch.tensor(self._kv_indices[self._kv_indptr[b]:self._kv_indptr[b + 1]], dtype=torch.long)
            seq = keys[ids].reshape(-1, keys.shape[-1])[: self._kv_len[b]]
            tokens.append(seq)
            indptr.append(indptr[-1] + seq.shape[0])
        q32 = torch.cat((q_nope.float(), q_pe.float()), dim=-1) * (self._sm_scale / SM_SCALE)
        data = (q32, {"bf16": torch.cat(tokens).unsqueeze(1)}, torch.arange(batch + 1, dtype=torch.int32),
                torch.tensor(indptr, dtype=torch.int32), None)
        out.copy_(reference(data, "bf16", "bf16").to(out.dtype))
        if return_lse:
            return out, torch.zeros(q_nope.shape[:2], dtype=torch.float32)
        return out
