"""The serving kernels as tests/test_serving_layouts.py and tests/test_serving_runner.py launch
them: each one's launcher and workspace, its dots on the CPU and GPU, and one small call."""

import torch

from mla_tune.kernels.flash_decode import FlashDecodeServingWorkspace, flash_decode_serving
from mla_tune.kernels.fused_decode import FusedServingWorkspace, fused_decode_serving
from mla_tune.serving import inputs as serving

# Each serving kernel: its launcher, its workspace, the partials its reduction reads, and the
# options the tests fix (split-K: no split budget and no SM count unless given).
KERNELS = {
    "splitk": (flash_decode_serving, FlashDecodeServingWorkspace,
               ("part_out", "part_lse", "q_amax"), dict(split_budget=0, sm_count=0)),
    "fused": (fused_decode_serving, FusedServingWorkspace, ("part_o", "part_lse"), {}),
}


def dot_options(kernel: str, device: str, q_fp8: bool = False) -> dict:
    """bf16 dots on a GPU, fp16 under the interpreter (its bf16 dot is wrong); the fused
    kernel's fp8 q goes with an fp8 QK dot, as the H200 table's picks."""
    dot = "bf16" if device == "cuda" else "fp16"
    if kernel == "splitk":
        return dict(dot_dtype=dot)
    if q_fp8:
        return dict(q_fp8=True, qk_dot="fp8", pv_dot="fp16")
    return dict(q_fp8=False, qk_dot=dot, pv_dot=dot)


SMALL = serving.make_input([1, 1], [5, 9], 16, 16, "bf16", seed=1)


def small_call(**launch) -> dict:
    """SMALL's arguments for a serving launcher, with `launch` (its dot_options) added."""
    return dict(q=SMALL.q, qo_indptr=SMALL.qo_indptr, kv=SMALL.kv, kv_scale=None, **SMALL.layout,
                out=torch.empty((2, 16, 512), dtype=torch.bfloat16), max_q_len=1, max_splits=2,
                tokens_per_split=4, block_n=16, block_h=16, num_warps=4, num_stages=1, **launch)
