"""Fake aiter.ops.quant: the per-tensor fp8 quantizers (pybind ops: positional arguments only)."""

import torch
from aiter import _state, dtypes
from aiter._checks import need, need_tensor


def _quant(op, out, input, scale, dynamic=False):
    need_tensor("out", out)
    # the C++ op accepts this arch's fp8 (dtypes.fp8) or int8 only
    need(out.dtype in (dtypes.fp8, torch.int8), f"not support output type: {out.dtype}")
    need_tensor("input", input)
    need(input.dtype in (torch.bfloat16, torch.float16), f"input must be fp16/bf16, got {input.dtype}")
    need(tuple(out.shape) == tuple(input.shape), f"out {tuple(out.shape)} != input {tuple(input.shape)}")
    need_tensor("scale", scale, dtype=torch.float32)
    need(scale.numel() == 1, f"scale must hold one value (per tensor), got {tuple(scale.shape)}")
    _state.calls[op] += 1
    qmax = torch.finfo(out.dtype).max if out.dtype.is_floating_point else 127
    if dynamic:
        scale.copy_((input.float().abs().amax() / qmax).reshape(scale.shape))
    out.copy_((input.float() / scale.float()).clamp(-qmax, qmax).to(out.dtype))


def static_per_tensor_quant(out, input, scale, /):
    _quant("static_per_tensor_quant", out, input, scale)


def dynamic_per_tensor_quant(out, input, scale, /):
    _quant("dynamic_per_tensor_quant", out, input, scale, dynamic=True)
