"""Fake flashinfer.mla (0.6.18.post1): BatchMLAPagedAttentionWrapper on the CPU.

What plan() keeps, as the real one does (flashinfer/mla/_core.py, MLAPlan in
data/include/flashinfer/attention/scheduler.cuh): the host copies of qo_indptr, kv_indptr and
kv_len_arr, and kv_indices by reference (run() reads its contents then). Request b's new
tokens are q rows qo_indptr[b]..qo_indptr[b+1]; its pages start at kv_indices[kv_indptr[b]]
and number ceil(kv_len[b] / page_size) (kv_indptr[b + 1] is never read, so rows of a block
table with a fixed stride work); with causal=True new token i sees the first
kv_len - (q_len - 1 - i) tokens (logits_mask_ in mla_hopper.cuh). The answer is
mla_tune.serving.inputs' fp32 reference at plan()'s sm_scale (a float, as plan() declares it);
run(return_lse=True) returns (out, lse) with lse (q rows, heads) float32 in base 2 unless
return_lse_base_on_e (MLAParams.return_lse_base_on_e: the wrapper passes False by
default), into `lse` when given (checked as out is).
"""

import math

import torch

from mla_tune.serving.inputs import reference

_FAKE_SMS = 132  # the H200's; MLAPlan launches one cluster per SM or per two

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
        # plan() copies the indptrs to the host (a device sync on a GPU); kv_indices it keeps
        self._qo_indptr = qo_indptr.tolist()
        self._kv_indptr = kv_indptr.tolist()
        self._kv_indices_buf = kv_indices
        self._kv_len = kv_len_arr.tolist()
        q_lens = [b - a for a, b in zip(self._qo_indptr, self._qo_indptr[1:], strict=False)]
        _need(min(q_lens) >= 0, "qo_indptr must be non-decreasing")
        for b, n in enumerate(self._kv_len):
            _need(self._kv_indptr[b] + -(-n // page_size) <= kv_indices.shape[0],
                  f"request {b}'s {-(-n // page_size)} pages run past kv_indices ({kv_indices.shape[0]})")
        self._num_heads, self._page_size, self._sm_scale = num_heads, page_size, sm_scale
        self._causal = causal
        self._dims = (head_dim_ckv, head_dim_kpe)
        self._q_data_type, self._kv_data_type = q_data_type, kv_data_type
        # MLAPlanInfo: num_blks_x (the cluster size: 2 when the mean q_len x heads > 64),
        # num_blks_y (clusters), then workspace offsets
        cluster = 2 if sum(q_lens) * num_heads // max(len(q_lens), 1) > 64 else 1
        self._plan_info = [cluster, _FAKE_SMS // cluster]
        self._q_lens = q_lens
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
        heads, total_q = self._num_heads, self._qo_indptr[-1]
        d_ckv, d_kpe = self._dims
        _need(q_nope.dim() == 3 and q_nope.shape[0] >= total_q and q_nope.shape[1] == heads,
              f"q_nope must be [>= {total_q}, {heads}, {d_ckv}] as planned, got {tuple(q_nope.shape)}")
        rows = q_nope.shape[0]
        _check("q_nope", q_nope, (rows, heads, d_ckv), self._q_data_type)
        _check("q_pe", q_pe, (rows, heads, d_kpe), self._q_data_type)
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
        if return_lse:
            if lse is None:
                lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
            else:
                _check("lse", lse, q_nope.shape[:2], torch.float32)
        calls["run"] += 1
        last_run.update(q_nope_stride=q_nope.stride(), ckv_stride=ckv_cache.stride(),
                        ckv_ptr=ckv_cache.data_ptr(), out_ptr=out.data_ptr(), sm_scale=self._sm_scale,
                        return_lse=return_lse, return_lse_base_on_e=return_lse_base_on_e)

        keys = torch.cat((ckv_cache.float() * float(ckv_scale or 1.0), kpe_cache.float() * float(kpe_scale or 1.0)), dim=-1)
        indices = self._kv_indices_buf.tolist()  # read at run time, as the kernel does
        tokens = []
        for b, n in enumerate(self._kv_len):
            start = self._kv_indptr[b]
            ids = torch.tensor(indices[start:start + -(-n // self._page_size)], dtype=torch.long)
            tokens.append(keys[ids].reshape(-1, keys.shape[-1])[:n])
        q32 = torch.cat((q_nope.float(), q_pe.float()), dim=-1)[:total_q]
        qo_indptr = self._qo_indptr
        if not self._causal:  # every new token sees its whole sequence: one query per row
            tokens = [t for t, n in zip(tokens, self._q_lens, strict=True) for _ in range(n)]
            qo_indptr = list(range(total_q + 1))
        kv_indptr = torch.tensor([0] + [t.shape[0] for t in tokens]).cumsum(0).to(torch.int32)
        ref, ref_lse = reference(q32, torch.tensor(qo_indptr, dtype=torch.int32), torch.cat(tokens).unsqueeze(1),
                                 kv_indptr=kv_indptr, sm_scale=self._sm_scale, return_lse=True)
        out[:total_q].copy_(ref.to(out.dtype))
        if return_lse:
            lse[:total_q].copy_(ref_lse if return_lse_base_on_e else ref_lse * math.log2(math.e))
            return out, lse
        return out
