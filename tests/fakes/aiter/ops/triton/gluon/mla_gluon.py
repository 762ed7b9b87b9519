"""Fake aiter.ops.triton.gluon.mla_gluon at 0.1.20.post1: AITER's Gluon MLA decode.

The signature and the checks of the real wrapper (gfx950 only; 16 heads; head dims 512 + 64;
bf16 q; bf16 or e4m3fn KV; kv_scale a Python float), computed in fp32 on the CPU and
written into `o`. Absent from 0.1.11 (it appeared in 0.1.18; until 0.1.19.post2 fp8 KV
needed batch 1), so importing it under that release fails as the real import would.
"""

import torch
from aiter import _state
from aiter._checks import attend, keywords_past, need, need_tensor

if not _state.new_api:
    raise ModuleNotFoundError(f"No module named 'aiter.ops.triton.gluon.mla_gluon' (AITER {_state.release})")


@keywords_past(4)  # q_nope, q_pe, kv_c, o; the rest by keyword
def mla_gluon(
    q_nope,
    q_pe,
    kv_c,
    o,
    page_table,
    seq_info,
    sm_scale,
    k_pe=None,
    kv_pe_offset=512,
    use_2d_view=True,
    kv_scale=1.0,
    min_kv_seq_len=1,
    return_lse=False,
    has_pe=True,
    attn_sink=None,
):
    need(_state.arch.startswith("gfx950"), f"mla_gluon requires gfx950 (CDNA4), got {_state.arch}")
    need(k_pe is None and kv_pe_offset == 512 and has_pe and attn_sink is None,
         "the fake covers the shared 576-wide KV row (k_pe=None, kv_pe_offset=512) only")
    need_tensor("q_nope", q_nope, dtype=torch.bfloat16, dim=3)
    batch = q_nope.shape[0]
    need(tuple(q_nope.shape) == (batch, 16, 512), f"q_nope must be [batch, 16, 512], got {tuple(q_nope.shape)}")
    need_tensor("q_pe", q_pe, dtype=torch.bfloat16, shape=(batch, 16, 64))
    need(q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1, "q_nope and q_pe need a unit last stride")
    need_tensor("kv_c", kv_c, dim=2)
    need(kv_c.dtype in (torch.bfloat16, torch.float8_e4m3fn),
         f"mla_gluon[bh16*] requires kv_c.dtype in (bfloat16, float8_e4m3fn), got {kv_c.dtype}")
    need(kv_c.shape[1] == 576 and kv_c.stride(1) == 1, f"kv_c must be [N, 576] with unit last stride, got {tuple(kv_c.shape)}")
    need_tensor("o", o, dtype=torch.bfloat16, shape=(batch, 16, 512))
    need(o.is_contiguous(), "o must be dense: with one split the kernel writes it through a view")
    need(isinstance(sm_scale, float), f"sm_scale must be a float, got {sm_scale!r}")
    need(isinstance(kv_scale, float), f"kv_scale is a kernel scalar: a Python float, got {type(kv_scale).__name__}")
    need(not use_2d_view, "the fake covers the flattened layout (use_2d_view=False) only")
    need_tensor("page_table", page_table, dtype=torch.int32, dim=1)
    need_tensor("seq_info", seq_info, dtype=torch.int32, shape=(batch + 1,))
    bounds = seq_info.tolist()
    need(min(b - a for a, b in zip(bounds, bounds[1:], strict=False)) >= min_kv_seq_len,
         f"min_kv_seq_len={min_kv_seq_len} is above the shortest sequence")
    _state.calls["mla_gluon"] += 1
    _state.last_call = {"mode": "gluon", "kv_dtype": kv_c.dtype}
    q32 = torch.cat([q_nope.float(), q_pe.float()], dim=-1)
    tokens = kv_c[page_table[: bounds[-1]].long()].float() * kv_scale
    o.copy_(attend(q32, tokens, bounds, sm_scale).to(o.dtype))
    return o, None
