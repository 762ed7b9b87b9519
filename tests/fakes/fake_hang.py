"""A fake whose runner never returns, at batch 2 only: the sweep must kill it."""

from __future__ import annotations

import time

from mla_tune.core import Shape, Variant
from tests.group_b_support import plain_candidates, runs_here

NAME = "fake_hang"
unavailable_reason = runs_here
candidates = plain_candidates(NAME, batch=2)


def build(variant: Variant, shape: Shape, device):
    def run_fake_hang(q, kv_data, qo_indptr, kv_indptr):
        while True:
            time.sleep(1.0)

    return run_fake_hang
