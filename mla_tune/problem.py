"""The MLA decode problem as the leaderboard poses it: inputs, quantizers, reference, check.

Input generation follows the leaderboard's `generate_input` step for step (one generator,
q drawn before the bf16 KV, then quantized), so a seed gives the same tensors on the same
device. The reference is fp32 attention over the dequantized operands and honours ragged
`kv_indptr`; `check` is the leaderboard's rule (at most a share of elements outside
`atol + rtol * |ref|`, no NaN), with the tolerance a named, recorded parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_tune.core import (
    KV_LORA_RANK,
    MXFP4_BLOCK,
    NUM_HEADS,
    NUM_KV_HEADS,
    QK_DIM,
    QK_ROPE_DIM,
    SM_SCALE,
    V_DIM,
    Shape,
    fp8_dtype_for,
)

# E2M1 magnitudes in code order: code 0b0000..0b0111; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes: round to nearest (ties go to the smaller).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_EMAX = 2  # 6.0 = 1.5 * 2**2


# ---------------------------------------------------------------------------- fp8
def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype | None = None):
    """Dynamic per-tensor fp8: scale = amax(|x|) / fp8_max; returns (fp8 tensor, scale (1,))."""
    dtype = fp8_dtype or fp8_dtype_for(x.device)
    finfo = torch.finfo(dtype)
    amax = x.abs().amax().clamp(min=1e-12)
    scale = amax / finfo.max
    y = (x / scale).clamp(min=finfo.min, max=finfo.max).to(dtype)
    return y, scale.to(torch.float32).reshape(1)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32) * scale.to(torch.float32)


# -------------------------------------------------------------------------- MXFP4
def quantize_mxfp4(x: torch.Tensor):
    """OCP MX block-32 E2M1 with E8M0 scales.

    x: (..., N) with N a multiple of 32. Returns (packed uint8 (..., N // 2), scales uint8
    (rows, N // 32)) where rows is the product of the leading dims. Per block,
    exponent = floor(log2(amax)) - 2 (so amax lands in [4, 8) before clamping to 6),
    stored as exponent + 127; an all-zero block stores exponent -127 (byte 0).
    """
    *lead, n = x.shape
    if n % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {MXFP4_BLOCK}, got {n}")
    blocks = x.reshape(-1, n // MXFP4_BLOCK, MXFP4_BLOCK).to(torch.float32)
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - E2M1_EMAX
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127.0))
    exponent = exponent.clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    codes = torch.bucketize(scaled.abs().clamp(max=6.0), mids).to(torch.uint8)
    codes = codes | ((scaled < 0).to(torch.uint8) << 3)
    codes = codes.reshape(*lead, n)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + 127).to(torch.uint8).reshape(-1, n // MXFP4_BLOCK)
    return packed.contiguous(), scales.contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_mxfp4, in fp32: packed (..., N // 2), scales (>= rows, >= N // 32).

    Only the first rows x (N // 32) entries of `scales` are read, since AITER's quantizer
    may pad it.
    """
    packed = packed.view(torch.uint8)
    *lead, half = packed.shape
    n = half * 2
    rows = packed.numel() // half
    lo = packed & 0x0F
    hi = packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*lead, n)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    mag = table[(codes & 0x7).long()]
    values = torch.where((codes & 0x8) != 0, -mag, mag)
    exps = scales.view(torch.uint8)[:rows, : n // MXFP4_BLOCK].to(torch.float32) - 127.0
    blocks = values.reshape(rows, n // MXFP4_BLOCK, MXFP4_BLOCK) * torch.exp2(exps).unsqueeze(-1)
    return blocks.reshape(*lead, n)


# -------------------------------------------------------------------------- inputs
def make_config(batch: int, kv_len: int) -> dict:
    return {
        "batch_size": batch,
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "qk_head_dim": QK_DIM,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_DIM,
        "v_head_dim": V_DIM,
        "q_seq_len": 1,
        "kv_seq_len": kv_len,
        "sm_scale": SM_SCALE,
    }


def kv_data(kv_bf16: torch.Tensor) -> dict:
    """The leaderboard's kv_data of a bf16 KV cache (total_kv, 1, 576): bf16, fp8 (KV and
    scale) and mxfp4 (packed codes and scales)."""
    total_kv = kv_bf16.shape[0]
    packed, scales = quantize_mxfp4(kv_bf16)
    return {
        "bf16": kv_bf16,
        "fp8": quantize_fp8(kv_bf16),
        "mxfp4": (packed.view(total_kv, NUM_KV_HEADS, QK_DIM // 2), scales),
    }


def generate_input(batch: int, kv_len: int, seed: int, device="cuda"):
    """The leaderboard's input tuple (q, kv_data, qo_indptr, kv_indptr, config)."""
    Shape(batch, kv_len)  # validates
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn((batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn(
        (batch * kv_len, NUM_KV_HEADS, QK_DIM), dtype=torch.bfloat16, device=device, generator=gen
    )
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
    kv_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * kv_len
    return q, kv_data(kv), qo_indptr, kv_indptr, make_config(batch, kv_len)


# ----------------------------------------------------------------------- reference
def dequantized_kv(kv_data: dict, kv_format: str) -> torch.Tensor:
    """The KV cache in fp32, (total_kv, 576), as a kernel reading `kv_format` sees it."""
    if kv_format == "bf16":
        return kv_data["bf16"].reshape(-1, QK_DIM).to(torch.float32)
    if kv_format == "fp8":
        buf, scale = kv_data["fp8"]
        return dequantize_fp8(buf.reshape(-1, QK_DIM), scale)
    if kv_format == "mxfp4":
        packed, scales = kv_data["mxfp4"]
        return dequantize_mxfp4(packed.reshape(-1, QK_DIM // 2), scales)
    raise ValueError(f"unknown KV format {kv_format!r}; known: bf16, fp8, mxfp4")


def reference(data, q_format: str = "fp8", kv_format: str = "fp8", sm_scale: float = SM_SCALE) -> torch.Tensor:
    """fp32 attention, per sequence as kv_indptr says. Returns (batch, 16, 512) fp32.

    The default (fp8 q from a dynamic per-tensor scale, fp8 KV) is the leaderboard's own
    reference math; ("bf16", "bf16") is the exact answer on the bf16 source of truth.
    sm_scale: the softmax scale (the leaderboard's 1/sqrt(576) by default; a model's own).
    """
    q, kv_data, _qo_indptr, kv_indptr, _config = data
    if q_format == "fp8":
        q8, q_scale = quantize_fp8(q)
        qf = dequantize_fp8(q8, q_scale)
    elif q_format == "bf16":
        qf = q.to(torch.float32)
    else:
        raise ValueError(f"unknown q format {q_format!r}; known: bf16, fp8")
    kv = dequantized_kv(kv_data, kv_format)
    bounds = kv_indptr.tolist()
    lengths = {b - a for a, b in zip(bounds, bounds[1:], strict=False)}
    batch = q.shape[0]
    if len(lengths) == 1:  # uniform: one batched matmul
        n = lengths.pop()
        k = kv[: batch * n].view(batch, n, QK_DIM)
        scores = torch.bmm(qf, k.transpose(1, 2)) * sm_scale
        return torch.bmm(torch.softmax(scores, dim=-1), k[:, :, :V_DIM])
    out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.float32, device=q.device)
    for b in range(batch):
        k = kv[bounds[b] : bounds[b + 1]]
        scores = (qf[b] @ k.T) * sm_scale
        out[b] = torch.softmax(scores, dim=-1) @ k[:, :V_DIM]
    return out


# --------------------------------------------------------------------------- check
@dataclass(frozen=True)
class Rule:
    """A correctness rule: elements fail |out - ref| > atol + rtol * |ref|; pass while the
    failing share stays at most `allowance` and nothing is NaN."""

    name: str
    rtol: float
    atol: float
    allowance: float = 0.05

    def as_dict(self) -> dict:
        return {"name": self.name, "rtol": self.rtol, "atol": self.atol, "allowance": self.allowance}


RULES = {
    # the leaderboard since 2026-03-18
    "leaderboard": Rule("leaderboard", rtol=0.1, atol=0.1),
    # fp8-KV-grade accuracy (the leaderboard's rule until 2026-03-17)
    "strict": Rule("strict", rtol=0.01, atol=0.01),
}


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"unknown correctness rule {name!r}; known: {', '.join(RULES)}")
    return RULES[name]


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    mismatch: float  # share of elements outside the tolerance
    max_abs_err: float
    has_nan: bool
    reason: str

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "mismatch": self.mismatch,
            "max_abs_err": self.max_abs_err,
            "has_nan": self.has_nan,
            "reason": self.reason,
        }


def check(out: torch.Tensor, ref: torch.Tensor, rule: Rule, margin: float = 1.0) -> CheckResult:
    """Compare out with ref under rule; `margin` < 1 demands a smaller failing share
    (the sweep uses 0.5: at most half the allowance).

    NaN must agree: the fp32 reference is NaN exactly where the inputs hold a NaN (an fp8
    byte 0x7F in the KV cache poisons its sequence), and an output must be NaN there too.
    A finite output where the reference is NaN hides bad inputs, and fails whatever share
    of the elements it is; a NaN where the reference is finite fails too; elements NaN in
    both agree."""
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, 1.0, float("inf"), False, f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    outf = out.to(torch.float32)
    reff = ref.to(torch.float32)
    out_nan, ref_nan = torch.isnan(outf), torch.isnan(reff)
    has_nan = bool(out_nan.any())
    diff = (outf - reff).abs()
    both_nan = out_nan & ref_nan
    bad = ~(diff <= rule.atol + rule.rtol * reff.abs()) & ~both_nan  # a NaN in one of them is bad
    mismatch = float(bad.float().mean())
    max_err = float(torch.nan_to_num(diff[~both_nan], nan=float("inf")).max()) if bool((~both_nan).any()) else 0.0
    limit = rule.allowance * margin
    hidden = int((ref_nan & ~out_nan).sum())
    if hidden:
        return CheckResult(False, mismatch, max_err, has_nan, (
            f"the reference is NaN at {hidden} elements where the output is finite: a NaN in the "
            "inputs (an fp8 KV byte 0x7F) vanished instead of reaching the output"))
    if bool((out_nan & ~ref_nan).any()):
        return CheckResult(False, mismatch, max_err, True, "output holds NaN")
    if mismatch > limit:
        reason = (
            f"{mismatch:.2%} of elements outside rtol={rule.rtol} atol={rule.atol} "
            f"(limit {limit:.2%}); max abs err {max_err:.3g}"
        )
        return CheckResult(False, mismatch, max_err, False, reason)
    return CheckResult(True, mismatch, max_err, False, "ok")
