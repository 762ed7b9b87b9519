"""Fake aiter.ops.quant: the per-tensor fp8 quantizers (pybind ops: positional arguments only)."""

import torch
from aiter import _state, dtypes
from aiter._checks import need, need_tensor


def _check(out, input, scale):
    need_tensor("out", out)
    # the C++ op accepts this arch's fp8 (dtypes.fp8) or int8 only
    need(out.dtype in (dtypes.fp8, torch.int8), f"not support output type: {out.dtype}")
    need_tensor("input", input)
    need(input.dtype in (torch.bfloat16, torch.float16), f"input must be fp16/bf16, got {input.dtype}")
    need(tuple(out.shape) == tuple(input.shape), f"out {tuple(out.shape)} != input {tuple(input.shape)}")
    need_tensor("scale", scale, dtype=torch.float32)
    need(scale.numel() == 1, f"scale must hold one value (per tensor), got {tuple(scale.shape)}")


def _quant(out, input, scale):
    qmax = torch.finfo(out.dtype).max if out.dtype.is_floating_point else 127
    out.copy_((input.float() / scale.float()).clamp(-qmax, qmax).to(out.dtype))


def static_per_tensor_quant(out, input, scale, /):
    _check(out, input, scale)
    _state.calls["static_per_tensor_quant"] += 1
    _quant(out, input, scale)


def dynamic_per_tensor_quant(out, input, scale, /):
    _check(out, input, scale)
    _state.calls["dynamic_per_tensor_quant"] += 1
    qmax = torch.finfo(out.dtype).max if out.dtype.is_floating_point else 127
    scale.copy_((input.float().abs().amax() / qmax).reshape(scale.shape))
    _quant(out, input, scale)
