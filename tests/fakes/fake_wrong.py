"""A fake that answers the negated reference: every element is off, so the gate rejects it."""

from __future__ import annotations

import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant
from tests.group_b_support import plain_candidates, runs_here

NAME = "fake_wrong"
unavailable_reason = runs_here
candidates = plain_candidates(NAME)


def build(variant: Variant, shape: Shape, device):
    def run_fake_wrong(q, kv_data, qo_indptr, kv_indptr):
        ref = problem.reference((q, kv_data, qo_indptr, kv_indptr, None))
        return (-ref - 1.0).to(torch.bfloat16)

    return run_fake_wrong
