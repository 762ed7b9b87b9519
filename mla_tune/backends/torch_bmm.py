"""The baseline: cuBLAS batched matmuls over the bf16 cache, softmax in fp32.

Always available wherever torch runs; every table records its time as the baseline.
Uniform batches only (one bmm over batch x kv_len); the runtime never sends it a ragged
batch, and a KV cache that does not divide into the batch is refused.
"""

from __future__ import annotations

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
    NUM_HEADS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    Capabilities,
    Shape,
    Variant,
)

NAME = "torch"

CAPABILITIES = Capabilities(
    kv_formats=("bf16",),
    platforms=(("cuda",), ("hip",), ("cpu",)),
    baseline=True,  # the reference implementation every sweep times
)


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")]


def validate(variant: Variant) -> None:
    """The torch backend reads bf16 q and bf16 KV only, and has no other parameter."""
    check_variant_rules(variant, PARAM_RULES[NAME])  # backends/params.py


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out at softmax scale `sm_scale`."""
    validate(variant)

    def run_torch_bmm(q, kv_data, qo_indptr, kv_indptr):
        kv = kv_data["bf16"]
        batch = q.shape[0]
        if kv.shape[0] % batch:
            raise ValueError("torch baseline: total_kv is not batch x kv_len (ragged batch)")
        kv = kv.view(batch, kv.shape[0] // batch, QK_DIM)
        scores = torch.bmm(q.view(batch, NUM_HEADS, QK_DIM), kv.transpose(1, 2))
        probs = torch.softmax(scores.float() * sm_scale, dim=-1).to(torch.bfloat16)
        return torch.bmm(probs, kv[:, :, :V_DIM])

    return run_torch_bmm


# Its search-space section in a config takes no keys (config.py refuses any).
SPACE_KEYS = ()
