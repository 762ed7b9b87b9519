"""Checks the fake shares: what AITER's C++ TORCH_CHECKs and Python asserts enforce, the
keyword rule mla-tune holds itself to, and the fp32 answer every entry point writes."""

import functools
import inspect

import torch
from aiter import _state, dtypes


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


def need_type(ok, message):
    """What compile_ops raises (TypeError) for an argument unlike the pybind doc's annotation;
    the real one checks only a process's first call, the fake every call."""
    if not ok:
        raise TypeError(message)


def need_int(name, value):
    need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")


def need_pow2(name, value):
    need_int(name, value)
    need(value > 0 and value & (value - 1) == 0, f"{name} Must be power of 2! (got {value})")


def check_scale(name, scale):
    need_tensor(name, scale, dtype=torch.float32)
    need(tuple(scale.shape) == (1,), f"{name} must be a per-tensor fp32 [1] dequant scale, got {tuple(scale.shape)}")


def need_paged(names, q, kv, o, page_size, nhead_kv, max_seqlen_q, qo_indptr, kv_indptr, kv_indices,
               kv_last_page_lens):
    """What both paged entry points check of q, KV, output and page indices (`names`), bs returned.
    The kernels address KV and output from their base pointers and outer strides only, and find
    sequence b's q rows at b * max_seqlen_q (asm_mla.cu: stride_Q = Q.stride(0) * max_seqlen_q)."""
    q_name, kv_name, o_name, indices_name = names
    need(nhead_kv == 1, f"nhead_kv must be 1, got {nhead_kv!r}")
    need_tensor(q_name, q, dim=3)
    need(q.is_contiguous(), f"{q_name} must be contiguous")
    need(q.shape[2] == 576, f"{q_name} must be [total_q, heads, 576], got {tuple(q.shape)}")
    need_tensor(kv_name, kv, dim=4)
    need(kv.shape[1] == page_size and kv.shape[2] == nhead_kv,
         f"{kv_name} must be [num_pages, page_size={page_size}, nhead_kv=1, 576], got {tuple(kv.shape)}")
    need(kv.shape[3] == q.shape[2], f"{kv_name}.size(3) must equal {q_name}'s head size")
    need(kv.stride()[1:] == (nhead_kv * 576, 576, 1),
         f"{kv_name}'s inner dims must be dense (strides (*, {nhead_kv * 576}, 576, 1)), got {kv.stride()}")
    need_tensor(o_name, o, dtype=dtypes.bf16, shape=(q.shape[0], q.shape[1], 512))
    need(o.is_contiguous(), f"{o_name} must be dense (contiguous), got strides {o.stride()}")
    bs = qo_indptr.shape[0] - 1 if isinstance(qo_indptr, torch.Tensor) else -1
    for name, t, size in (("qo_indptr", qo_indptr, bs + 1), ("kv_indptr", kv_indptr, bs + 1),
                          ("kv_last_page_lens", kv_last_page_lens, bs), (indices_name, kv_indices, None)):
        need_tensor(name, t, dim=1)
        need(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        need(size is None or t.shape[0] == size, f"{name} must have {size} entries, got {t.shape[0]}")
    need(qo_indptr.tolist() == [b * max_seqlen_q for b in range(bs + 1)],
         f"qo_indptr must be arange(bs + 1) * max_seqlen_q ({max_seqlen_q} new tokens per sequence), "
         f"got {qo_indptr.tolist()[:8]}")
    return bs


def need_scales(q_name, q_dtype, q_scale, kv_dtype, kv_scale, unset):
    """fp8 q needs both per-tensor scales, fp8 KV its own (else `unset`); bf16 takes none."""
    if q_dtype == dtypes.fp8:
        need(q_scale is not None and kv_scale is not None, f"fp8 {q_name} needs both q_scale and kv_scale")
        check_scale("q_scale", q_scale)
    else:
        need(q_scale is None, f"q_scale given for a bf16 {q_name}")
    if kv_dtype == dtypes.fp8:
        need(kv_scale is not None, f"fp8 KV needs kv_scale ({unset})")
        check_scale("kv_scale", kv_scale)
    else:
        need(kv_scale is None, "kv_scale given for a bf16 KV cache")


def need_work_list(work_meta_data, work_indptr, work_info_set, kv_indptr, page_size, q_dtype, kv_dtype):
    """What get_mla_metadata_v1 built work_meta_data for, checked against the call; returned."""
    built = _state.metadata.get(work_meta_data.data_ptr())
    need(built is not None, "work_meta_data was not filled by get_mla_metadata_v1")
    need(work_meta_data.tolist() == [work_indptr.data_ptr(), work_info_set.data_ptr()],
         "work_meta_data points at other buffers than work_indptr / work_info_set (swapped?)")
    need(built["kv_indptr"] == kv_indptr.tolist(), "metadata was built for other kv lengths")
    need(built["page_size"] == page_size, "metadata was built for another page size")
    for key, actual in (("dtype_q", q_dtype), ("dtype_kv", kv_dtype)):
        need(built[key] in (None, actual), f"metadata was built for {key}={built[key]}, call has {actual}")
    return built


def keywords_past(count: int):
    """Refuse a call that passes more than the first `count` arguments positionally.

    Stricter than AITER, which takes these positionally too: its signatures moved between
    builds (page_size at 0.1.10.post2, `lse` before `q_scale` and `num_kv_splits` before
    `final_output` later), so a positional caller silently feeds one argument into
    another's slot. mla-tune passes everything past the first few tensors by keyword, and
    every fake entry point holds it to that. The wrapped function keeps its signature."""

    def wrap(fn):
        leading = list(inspect.signature(fn).parameters)[:count]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > count:
                shown = ", ".join(leading) if leading else "nothing"
                raise TypeError(
                    f"{fn.__name__}: {len(args)} positional arguments; the fake takes {shown} "
                    "positionally and the rest by keyword only (AITER's signatures moved "
                    "between builds, so a positional argument can land in another's slot)")
            return fn(*args, **kwargs)

        return call

    return wrap


def older(fn, *dropped, body=None):
    """fn as an older build declares it: a function whose signature (for inspect.signature,
    and for inspect.unwrap, which stops here) is fn's without `dropped`, those left at their
    defaults; `body`, if given, runs instead of fn, taking every argument by keyword."""
    sig = inspect.signature(fn)
    old = sig.replace(parameters=[p for name, p in sig.parameters.items() if name not in dropped])

    def call(*args, **kwargs):
        bound = old.bind(*args, **kwargs)
        bound.apply_defaults()
        return (body or fn)(**bound.arguments)

    call.__name__, call.__qualname__, call.__signature__ = fn.__name__, fn.__qualname__, old
    return call


def attend(q32, kv_tokens32, token_indptr, sm_scale, qo_indptr=None):
    """fp32 attention via mla_tune.serving.reference: q (total_q, H, 576), tokens (n, 576);
    sequence b's new tokens are q[qo_indptr[b]:qo_indptr[b+1]] (default one each), causal
    among themselves (bottom-right aligned, as AITER's op test's tril(diagonal=s_k - s_q))."""
    from mla_tune.serving.inputs import reference

    if qo_indptr is None:
        qo_indptr = torch.arange(len(token_indptr), dtype=torch.int32)
    return reference(q32, qo_indptr, kv_tokens32.reshape(-1, 1, kv_tokens32.shape[-1]),
                     kv_indptr=torch.tensor(token_indptr, dtype=torch.int32), sm_scale=sm_scale)


def paged_attend(q, q_scale, kv_buffer, kv_scale, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                 page_size, sm_scale):
    """The fp32 answer of a paged MLA decode call: q and the pages dequantized by their
    per-tensor scales, sequence b's tokens gathered from its pages (the last one holding
    kv_last_page_lens[b] tokens). (total_q, H, 512) fp32."""
    q32 = q.float() * (q_scale.float() if q_scale is not None else 1.0)
    pages = kv_buffer.float() * (kv_scale.float() if kv_scale is not None else 1.0)
    pages = pages.reshape(kv_buffer.shape[0], page_size, -1)
    page_bounds, last = kv_indptr.tolist(), kv_last_page_lens.tolist()
    tokens, token_indptr = [], [0]
    for b in range(len(page_bounds) - 1):
        ids = kv_indices[page_bounds[b]:page_bounds[b + 1]].long()
        seq = pages[ids].reshape(-1, pages.shape[-1])[: (len(ids) - 1) * page_size + last[b]]
        tokens.append(seq)
        token_indptr.append(token_indptr[-1] + seq.shape[0])
    scale = sm_scale if sm_scale is not None else 1.0 / (576 ** 0.5)
    return attend(q32, torch.cat(tokens), token_indptr, scale, qo_indptr)
