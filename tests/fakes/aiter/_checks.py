"""Checks the fake shares: what AITER's C++ TORCH_CHECKs and Python asserts enforce."""

import torch


class FakeAiterError(RuntimeError):
    """What the real AITER raises (RuntimeError from TORCH_CHECK / asserts) for a bad call."""


def need(condition, message):
    if not condition:
        raise FakeAiterError(message)


def need_tensor(name, t, dtype=None, dim=None, shape=None):
    need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        need(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    if dim is not None:
        need(t.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        need(tuple(t.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def need_int(name, value):
    need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")


def need_pow2(name, value):
    need_int(name, value)
    need(value > 0 and value & (value - 1) == 0, f"{name} Must be power of 2! (got {value})")


def attend(q32, kv_tokens32, token_indptr, sm_scale, qo_indptr=None):
    """fp32 attention via mla_tune.serving.reference: q (total_q, H, 576), tokens (n, 576);
    sequence b's new tokens are q[qo_indptr[b]:qo_indptr[b+1]] (default one each), causal
    among themselves (bottom-right aligned, as AITER's op test's tril(diagonal=s_k - s_q))."""
    from mla_tune.serving import reference

    bs = len(token_indptr) - 1
    if qo_indptr is None:
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
    return reference(q32, qo_indptr, kv_tokens32.reshape(-1, 1, kv_tokens32.shape[-1]),
                     kv_indptr=torch.tensor(token_indptr, dtype=torch.int32), sm_scale=sm_scale)
