"""q to fp8 in one or two launches, for backends whose kernels take fp8 q (FlashMLA's).

Per-tensor quantization as the leaderboard's reference does it, without a host sync:
- static: scale = q_amax / fp8_max fixed at build time; one launch, which also adds the
  number of elements beyond q_amax (clamped, so the answer is off) to a device counter,
  `QQuantizer.saturated`: calibration can be wrong for real traffic, and this says so
  without a sync (mla_tune.runtime's `q_saturation()` reads it later);
- dynamic: scale = bf16(amax(|q|) / fp8_max) from this call's q; two launches (per-row
  amax partials, then every program reduces the partials and quantizes its row), which
  reproduces `mla_tune.problem.quantize_fp8` value for value (a tiny negative value that
  rounds to zero gives +0 where torch gives -0; no dot can tell them apart).
Torch ops would take 3 (static) to 7 (dynamic) launches of ~2-3 us each on the GPU.
`q_range_count` is the count alone, one tiny launch, for kernels that quantize q inside
(the triton backend's): the runtime launches it before them only when asked to check.

Exportable module: see docs/architecture.md (`_qq_` prefix for private names).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_tune.core import NUM_HEADS, QK_DIM
from mla_tune.kernels.flash_decode import (
    fp8_min_exponent,
    q_amax_partials,
    quantize_q_e4m3,
    round_to_mantissa,
)
from mla_tune.kernels.launch import jit_launch

_qq_BLOCK = 1024
_qq_AMAX_CHUNK = 128


@triton.jit
def _qq_quantize_kernel(
    Q, Out, Scale, Partial, Saturated, batch, static_scale, q_amax, fp8_max,
    DYNAMIC: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
    ROW: tl.constexpr, BLOCK: tl.constexpr, AMAX_CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    beyond = tl.zeros([BLOCK], dtype=tl.int32)
    if DYNAMIC:
        acc = tl.zeros([AMAX_CHUNK], dtype=tl.float32)
        for i in range(0, batch, AMAX_CHUNK):
            offs_a = i + tl.arange(0, AMAX_CHUNK)
            acc = tl.maximum(acc, tl.load(Partial + offs_a, mask=offs_a < batch, other=0.0))
        amax = tl.maximum(tl.max(acc, axis=0), 1e-12)
        scale = round_to_mantissa(amax / fp8_max, 7, -119)  # bf16, as problem.quantize_fp8
    else:
        scale = static_scale
    if b == 0:
        tl.store(Scale, scale)
    for i in range(0, ROW, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < ROW
        x = tl.load(Q + b * ROW + offs, mask=mask, other=0.0)
        # Exact e4m3 values in fp32, so the cast below only changes the storage format.
        y = quantize_q_e4m3(x, scale, fp8_max, FP8_MIN_EXP, DYNAMIC)
        tl.store(Out + b * ROW + offs, y.to(Out.dtype.element_ty), mask=mask)
        if not DYNAMIC:
            beyond += (tl.abs(x.to(tl.float32)) > q_amax).to(tl.int32)
    if not DYNAMIC:
        n = tl.sum(beyond, axis=0)
        tl.atomic_add(Saturated, n.to(tl.int64), mask=n > 0)


@triton.jit
def _qq_range_kernel(Q, Count, q_amax, ROW: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    beyond = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, ROW, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(Q + b * ROW + offs, mask=offs < ROW, other=0.0).to(tl.float32)
        beyond += (tl.abs(x) > q_amax).to(tl.int32)
    n = tl.sum(beyond, axis=0)
    tl.atomic_add(Count, n.to(tl.int64), mask=n > 0)


def q_range_count(q: torch.Tensor, q_amax: float, count: torch.Tensor) -> torch.Tensor:
    """Add to `count` ((1,) int64 on q's device) the number of elements of q, (batch, 16,
    576) bf16 contiguous, with |q| > q_amax; one launch, no sync. Returns `count`."""
    if q.dim() != 3 or tuple(q.shape[1:]) != (NUM_HEADS, QK_DIM) or not q.is_contiguous():
        raise ValueError(f"q_range_count needs contiguous (batch, {NUM_HEADS}, {QK_DIM}) q, got {tuple(q.shape)}")
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != q.device:
        raise ValueError(f"q_range_count needs a (1,) int64 count on {q.device}, got {count.dtype} "
                         f"x {count.numel()} on {count.device}")
    _qq_range_kernel[(q.shape[0],)](q, count, float(q_amax), ROW=NUM_HEADS * QK_DIM, BLOCK=_qq_BLOCK,
                                    num_warps=4)
    return count


class QQuantizer:
    """Quantizes (batch, 16, 576) bf16 q into buffers it owns: `q8` and `scale` (1,) fp32.

    mode "fp8_static" needs q_amax (calibrated offline); values beyond it are clamped, and
    counted into `saturated` ((1,) int64, on the device, summed over calls; zero it to
    restart). mode "fp8_dynamic" computes the scale from each call's q, on the device.
    """

    def __init__(self, mode: str, batch: int, device, fp8_dtype: torch.dtype, q_amax: float | None = None):
        if mode not in ("fp8_static", "fp8_dynamic"):
            raise ValueError(f"q quantization mode must be fp8_static or fp8_dynamic, got {mode!r}")
        if mode == "fp8_static" and not (isinstance(q_amax, (int, float)) and q_amax > 0):
            raise ValueError(f"fp8_static needs a positive q_amax (calibrated by the sweep), got {q_amax!r}")
        self.dynamic = mode == "fp8_dynamic"
        self.batch = batch
        self.fp8_max = float(torch.finfo(fp8_dtype).max)
        self.q_amax = float(q_amax) if q_amax else 0.0
        self.static_scale = self.q_amax / self.fp8_max if q_amax else 1.0
        self.fp8_min_exp = fp8_min_exponent(fp8_dtype)
        self.q8 = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=fp8_dtype, device=device)
        self.scale = torch.full((1,), self.static_scale, dtype=torch.float32, device=device)
        self.partial = torch.empty((batch,), dtype=torch.float32, device=device)
        self.saturated = torch.zeros((1,), dtype=torch.int64, device=device)

    def __call__(self, q: torch.Tensor, record: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q8, scale), buffers of this quantizer. record: a list to which each launch
        appends what replays it (kernels/launch.py); the launches are the same without it."""
        if q.shape[0] != self.batch or not q.is_contiguous() or q.dtype != torch.bfloat16:
            raise ValueError(
                f"QQuantizer was built for contiguous bf16 q of batch {self.batch}; "
                f"got {q.dtype} {tuple(q.shape)}"
            )
        row = NUM_HEADS * QK_DIM
        if self.dynamic:
            q_amax_partials(q, self.partial, record)
        jit_launch(
            _qq_quantize_kernel, (self.batch,), record,
            q, self.q8, self.scale, self.partial, self.saturated, self.batch, self.static_scale,
            self.q_amax, self.fp8_max,
            DYNAMIC=self.dynamic, FP8_MIN_EXP=self.fp8_min_exp,
            ROW=row, BLOCK=_qq_BLOCK, AMAX_CHUNK=_qq_AMAX_CHUNK, num_warps=4,
        )
        return self.q8, self.scale
