"""A deliberately wrong serving backend for the serving sweep's tests (registered through
MLA_TUNE_EXTRA_BACKENDS as `wrong_serving`): its runner returns zeros, fast. It has no
serving_candidates, so the sweep offers its default serving variant; the gate must reject
it, and it must never become a pick."""

import torch

from mla_tune.core import CORE_HEADS, CORE_PAGE_SIZES, V_DIM, CallSpec, Capabilities, Variant

NAME = "wrong_serving"
CAPABILITIES = Capabilities(kv_formats=("bf16", "fp8"), serving=True, page_sizes=CORE_PAGE_SIZES,
                            heads=CORE_HEADS, max_q_len=4, mixed_q_len=True, graph_safe=True)


def unavailable_reason() -> str | None:
    return None


def validate(variant: Variant) -> None:
    if variant.backend != NAME or set(variant.p) != {"kv", "q"}:
        raise ValueError(f"{NAME}: {variant} is not a {NAME} variant (kv, q)")


def candidates(shape, space, platform) -> list[Variant]:
    return []


def build(variant, shape, device):
    raise ValueError(f"{NAME} has no leaderboard call")


def default_serving_variant(spec: CallSpec, platform) -> Variant:
    return Variant.make(NAME, kv=spec.kv_format, q="bf16")


def build_serving(variant: Variant, spec: CallSpec, device):
    validate(variant)
    out = torch.zeros((64, spec.heads, V_DIM), dtype=torch.bfloat16, device=device)

    def run_wrong(q, qo_indptr, kv, kv_scale, **layout):
        if q.shape[0] > out.shape[0]:
            return torch.zeros((q.shape[0], spec.heads, V_DIM), dtype=torch.bfloat16, device=device)
        return out[: q.shape[0]]

    return run_wrong
