"""gfx942's fp8 (float8_e4m3fnuz) in the fused family: an fp8 dot casts to the cache's own fp8.

Triton's AMD backend cannot convert fnuz to OCP e4m3 ("Unsupported conversion from
'f8E4M3FNUZ' to 'f8E4M3FN'", xcompile.md), so the fp8 a dot casts to follows the KV's
dtype (fused_decode.fu_dot_code), and in-kernel q quantization uses that fp8's range.
"""

from __future__ import annotations

import torch

from mla_tune import problem
from mla_tune.backends import triton_fused
from mla_tune.core import Shape, Variant
from mla_tune.kernels.fused_decode import FU_DOT_CODES, FU_DOT_FP8_FNUZ, fu_dot_code


def test_an_fp8_dot_follows_the_caches_fp8():
    fn = torch.empty(4, 576, dtype=torch.float8_e4m3fn)
    fnuz = torch.empty(4, 576, dtype=torch.float8_e4m3fnuz)
    assert fu_dot_code("fp8", fn) == FU_DOT_CODES["fp8"]
    assert fu_dot_code("fp8", fnuz) == FU_DOT_FP8_FNUZ != FU_DOT_CODES["fp8"]
    for dot in ("fp16", "bf16"):
        assert fu_dot_code(dot, fnuz) == fu_dot_code(dot, fn) == FU_DOT_CODES[dot]


def _as_fnuz(data):
    """The same inputs with the fp8 cache requantized to e4m3fnuz (max 240) per tensor."""
    kv8, scale = data[1]["fp8"]
    values = kv8.float() * scale
    fnuz_scale = values.abs().amax().reshape(1) / torch.finfo(torch.float8_e4m3fnuz).max
    kv_fnuz = (values / fnuz_scale).to(torch.float8_e4m3fnuz)
    return (data[0], {**data[1], "fp8": (kv_fnuz, fnuz_scale.float())}, *data[2:])


def test_fused_decode_reads_an_fnuz_cache_with_fp8_dots(device):
    # fp8 q x fp8 K, and fp8 P x fp8 V (P scaled into the fp8's range: 256 would overflow
    # fnuz's 240). At these tiny sizes fp8 dots are a few percent off even with e4m3fn
    # (about 0.05 to 0.09 here): the fnuz cache must do as well as the e4m3fn one.
    ocp = problem.generate_ragged_input([17, 40], seed=5, device=device)
    fnuz = _as_fnuz(ocp)
    for q, qk_dot, pv_dot in (("fp8_dynamic", "fp8", "fp16"), ("bf16", "fp16", "fp8"), ("fp8_dynamic", "fp8", "fp8")):
        variant = Variant.make("triton_fused", kv="fp8", q=q, qk_dot=qk_dot, pv_dot=pv_dot, tok_m=True,
                               block_n=16, num_warps=4, num_stages=1, num_splits=1, reduce="none")
        run = triton_fused.build(variant, Shape(2, 40), device)
        errs = []
        for data in (ocp, fnuz):
            ref = problem.reference(data, q_format="bf16", kv_format="fp8")
            errs.append(float((run(*data[:4]).float() - ref).norm() / ref.norm()))
        assert errs[1] < min(0.1, 1.5 * errs[0] + 0.01), f"{variant}: relative L2 error e4m3fn {errs[0]:.4f}, fnuz {errs[1]:.4f}"
