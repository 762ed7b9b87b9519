"""The serving call of MLA decode: inputs in every layout an engine uses, and its reference.

An engine calls decode with q `(total_q, heads, 576)` and `qo_indptr` (each sequence
brings q_len >= 1 new tokens, more than one under speculative decoding), and a KV cache
either contiguous (`(total_kv, 1, 576)` with `kv_indptr`, the leaderboard's layout) or
paged (`(num_pages, page_size, 576)` with a `block_table (batch, max_pages)` int32 and
`seq_lens (batch,)` int32), in bf16 or per-tensor-scaled fp8. A sequence's KV already holds
its new tokens, so new token i (0-based) of q_len attends to the first
seq_len - (q_len - 1 - i) tokens.

`make_input` builds such a call from a seed, with the pages shuffled through the cache and
every slot no sequence owns filled with NaN (a kernel that reads one shows it); `reference`
is fp32 attention reading the layout as given. Not exportable: test and tuning side only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, fp8_dtype_for
from mla_tune.problem import dequantize_fp8, quantize_fp8

LAYOUT_CONTIGUOUS = 0  # page_size 0 stands for the contiguous layout


@dataclass
class ServingInput:
    """One serving call's tensors, plus host copies of the lengths for the reference."""

    q: torch.Tensor  # (total_q, heads, 576) bf16
    qo_indptr: torch.Tensor  # (batch + 1,) int32
    kv: torch.Tensor  # (total_kv, 1, 576) contiguous or (num_pages, page_size, 576) paged
    kv_scale: torch.Tensor | None  # (1,) fp32 for fp8 KV
    kv_indptr: torch.Tensor | None  # contiguous layout only
    block_table: torch.Tensor | None  # paged layout only
    seq_lens: torch.Tensor | None  # paged layout only
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int  # 0: contiguous

    @property
    def layout(self) -> dict:
        """The KV layout's keyword arguments, as `flash_decode_serving` takes them."""
        if self.page_size == LAYOUT_CONTIGUOUS:
            return {"kv_indptr": self.kv_indptr}
        return {"block_table": self.block_table, "seq_lens": self.seq_lens}

    def reference(self, q_format: str = "bf16", q_amax: float | None = None,
                  sm_scale: float = SM_SCALE, return_lse: bool = False):
        return reference(self.q, self.qo_indptr, self.kv, self.kv_scale, **self.layout,
                         q_format=q_format, q_amax=q_amax, sm_scale=sm_scale, return_lse=return_lse)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x viewed as integers of its width: indexing fp8 tensors is not implemented
    everywhere (CUDA index kernels), moving their bits is."""
    return x.view({1: torch.uint8, 2: torch.int16}[x.element_size()])


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def make_input(
    q_lens: list[int],
    kv_lens: list[int],
    heads: int,
    page_size: int,
    kv_format: str,
    seed: int,
    device="cpu",
    spare_pages: int = 3,
    extra_table_width: int = 2,
) -> ServingInput:
    """A serving call: sequence b brings q_lens[b] new tokens and holds kv_lens[b] tokens
    (new ones included, so kv_lens[b] >= q_lens[b] >= 1). page_size 0 is the contiguous
    layout; otherwise the pages are shuffled through a cache with `spare_pages` unused
    pages, and the block table is `extra_table_width` pages wider than the longest
    sequence needs (a CUDA graph's static width); unused slots and entries point at NaN."""
    if len(q_lens) != len(kv_lens) or not q_lens:
        raise ValueError(f"need one q_len per kv_len, got {q_lens} and {kv_lens}")
    if any(not 1 <= q <= n for q, n in zip(q_lens, kv_lens, strict=True)):
        raise ValueError(f"need 1 <= q_len <= kv_len per sequence, got {q_lens} and {kv_lens}")
    if kv_format not in ("bf16", "fp8"):
        raise ValueError(f"kv_format must be bf16 or fp8, got {kv_format!r}")
    if page_size < 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be 0 (contiguous) or a power of two, got {page_size}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    batch = len(q_lens)
    q = torch.randn((sum(q_lens), heads, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    tokens = torch.randn((sum(kv_lens), QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv_scale = None
    if kv_format == "fp8":
        tokens, kv_scale = quantize_fp8(tokens)
    qo_indptr = torch.tensor(_offsets(q_lens), dtype=torch.int32, device=device)
    kv_starts = _offsets(kv_lens)
    if page_size == LAYOUT_CONTIGUOUS:
        kv_indptr = torch.tensor(kv_starts, dtype=torch.int32, device=device)
        return ServingInput(q, qo_indptr, tokens.reshape(-1, 1, QK_DIM), kv_scale, kv_indptr,
                            None, None, list(q_lens), list(kv_lens), 0)

    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + spare_pages + 1
    order = torch.randperm(num_pages, generator=gen, device=device)
    poison_page = int(order[-1])  # what unused block-table entries point at
    width = max(pages_per_seq) + extra_table_width
    table = torch.full((batch, width), poison_page, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    # Token j of sequence b lives in page table[b, j // page_size] at slot j % page_size.
    seq_of = torch.repeat_interleave(torch.arange(batch, device=device),
                                     torch.tensor(kv_lens, device=device))
    pos = torch.arange(len(seq_of), device=device) - torch.tensor(kv_starts[:-1], device=device)[seq_of]
    slots = table[seq_of, pos // page_size].long() * page_size + pos % page_size
    cache = torch.full((num_pages * page_size, QK_DIM), float("nan"), dtype=torch.bfloat16, device=device)
    cache = cache.to(tokens.dtype)
    _bits(cache)[slots] = _bits(tokens)
    cache = cache.view(num_pages, page_size, QK_DIM)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return ServingInput(q, qo_indptr, cache, kv_scale, None, table, seq_lens,
                        list(q_lens), list(kv_lens), page_size)


def _sequence_tokens(kv, kv_indptr, block_table, seq_lens, b: int) -> torch.Tensor:
    """Sequence b's cached tokens in order, (seq_len, 576), in the cache's dtype."""
    if kv_indptr is not None:
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        return kv.reshape(-1, QK_DIM)[lo:hi]
    seq_len, page_size = int(seq_lens[b]), kv.shape[1]
    pages = block_table[b, : -(-seq_len // page_size)].long()
    return _bits(kv)[pages].view(kv.dtype).reshape(-1, QK_DIM)[:seq_len]


# The q formats `reference` reads q in (q_format): bf16 as given; fp8 per tensor (this call's
# amax, problem.quantize_fp8); fp8 per (new token, head) row (quantize_fp8_rows); fp8 with a
# fixed q_amax (fp8_static).
Q_FORMATS = ("bf16", "fp8", "fp8_row", "fp8_static")
# The per-row quantization of the own fused kernels (kernels/gluon_serving.py, gluon_decode.py
# and fused_decode.py, their q prologue): amax starts at this floor, scale = amax / 448, e4m3fn.
ROW_AMAX_FLOOR = 1e-12
ROW_FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (..., 576) in float8_e4m3fn with one fp32 scale per row of its last dimension (a
    serving q's (new token, head)), as the own fused kernels quantize q in the kernel: amax =
    max(1e-12, max |row| in fp32), scale = amax / 448 in fp32, q8 = e4m3fn(q / scale)
    rounded to nearest even and saturated at +-448. An all-zero row is zeros with scale
    1e-12 / 448. Returns (q8, scale (..., 1) float32); q8 x scale is the q whose scores
    the kernel computes (its MMA takes q8, and the scores are multiplied by the scale). The
    kernel's fp32 divisions are Triton's default `/` (div.full.f32
    on NVIDIA, within 2 ulp, not correctly rounded), these are IEEE: an element within an ulp
    of an fp8 rounding tie may land one fp8 step apart on the GPU."""
    fp8_max = torch.finfo(ROW_FP8_DTYPE).max
    qf = q.to(torch.float32)
    scale = qf.abs().amax(dim=-1, keepdim=True).clamp_min(ROW_AMAX_FLOOR) / fp8_max
    return (qf / scale).clamp(-fp8_max, fp8_max).to(ROW_FP8_DTYPE), scale


def reference_q(q: torch.Tensor, q_format: str = "bf16", q_amax: float | None = None) -> torch.Tensor:
    """q in fp32 as `reference` reads it, as a kernel of that q mode multiplies it with K:
    bf16 as is, fp8 per tensor (dynamic: this call's amax, as problem.quantize_fp8; static:
    a fixed q_amax, values beyond it clamped), or fp8 per (new token, head) row (fp8_row:
    quantize_fp8_rows, the own fused kernels' q)."""
    if q_format == "bf16":
        return q.to(torch.float32)
    if q_format == "fp8":
        return dequantize_fp8(*quantize_fp8(q))
    if q_format == "fp8_row":
        return dequantize_fp8(*quantize_fp8_rows(q))
    if q_format == "fp8_static" and q_amax:
        dtype = fp8_dtype_for(q.device)
        fp8_max = torch.finfo(dtype).max
        scale = q_amax / fp8_max
        return (q.float() / scale).clamp(-fp8_max, fp8_max).to(dtype).float() * scale
    raise ValueError(f"q_format must be bf16, fp8, fp8_row or fp8_static (with q_amax), got {q_format!r}")


def reference(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    kv_indptr: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    q_format: str = "bf16",
    q_amax: float | None = None,
    sm_scale: float = SM_SCALE,
    return_lse: bool = False,
):
    """fp32 MLA decode attention of the serving call, (total_q, heads, 512): each new token
    over its sequence's tokens up to and including itself, q read as reference_q(q,
    q_format, q_amax), KV dequantized with kv_scale, scores scaled by sm_scale (the model's softmax scale). return_lse: (out, lse), lse the
    natural-log log-sum-exp of each (new token, head)'s scaled scores, (total_q, heads)."""
    if (kv_indptr is None) == (block_table is None and seq_lens is None):
        raise ValueError("give kv_indptr (contiguous KV) or block_table and seq_lens (paged KV)")
    qf = reference_q(q, q_format, q_amax)
    q_bounds = qo_indptr.tolist()
    out = torch.empty((q.shape[0], q.shape[1], V_DIM), dtype=torch.float32, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    for b in range(len(q_bounds) - 1):
        q0, q1 = q_bounds[b], q_bounds[b + 1]
        k = _sequence_tokens(kv, kv_indptr, block_table, seq_lens, b).to(torch.float32)
        if kv_scale is not None:
            k = k * kv_scale.to(torch.float32)
        q_len, seq_len = q1 - q0, k.shape[0]
        scores = torch.einsum("lhd,sd->lhs", qf[q0:q1], k) * sm_scale
        # new token i sees tokens [0, seq_len - (q_len - 1 - i))
        limit = seq_len - q_len + 1 + torch.arange(q_len, device=q.device)
        seen = torch.arange(seq_len, device=q.device)[None, :] < limit[:, None]
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        out[q0:q1] = torch.softmax(scores, dim=-1) @ k[:, :V_DIM]
        lse[q0:q1] = torch.logsumexp(scores, dim=-1)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ CUDA-graph capture
def capture_without_sync(call) -> torch.cuda.CUDAGraph:
    """Compile `call` outside the graph, then run it once and capture it under sync debug
    mode "error": a call that synchronizes raises here instead of being captured."""
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return graph
