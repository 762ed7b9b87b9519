"""A fake that answers the negated reference: every element is off, so the gate rejects it."""

import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant

NAME = "fake_wrong"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")]


def build(variant: Variant, shape: Shape, device):
    def run_fake_wrong(q, kv_data, qo_indptr, kv_indptr):
        ref = problem.reference((q, kv_data, qo_indptr, kv_indptr, None))
        return (-ref - 1.0).to(torch.bfloat16)

    return run_fake_wrong
