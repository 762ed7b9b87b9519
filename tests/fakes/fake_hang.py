"""A fake whose runner never returns, at batch 2 only: the sweep must kill it."""

import time

from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_hang"
candidates = one_variant(NAME, batch=2)


def build(variant: Variant, shape: Shape, device):
    def run_fake_hang(q, kv_data, qo_indptr, kv_indptr):
        while True:
            time.sleep(1.0)

    return run_fake_hang
