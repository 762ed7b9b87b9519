"""A fake that answers the negated reference: every element is off, so the gate rejects it."""

import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_wrong"
candidates = one_variant(NAME)


def build(variant: Variant, shape: Shape, device):
    def run_fake_wrong(q, kv_data, qo_indptr, kv_indptr):
        ref = problem.reference((q, kv_data, qo_indptr, kv_indptr, None))
        return (-ref - 1.0).to(torch.bfloat16)

    return run_fake_wrong
