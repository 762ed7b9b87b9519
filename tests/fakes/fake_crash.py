"""A fake that kills its process like a segfault (exit code 139), at batch 2 only."""

import os
import sys

from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_crash"
candidates = one_variant(NAME, batch=2)


def build(variant: Variant, shape: Shape, device):
    def run_fake_crash(q, kv_data, qo_indptr, kv_indptr):
        print("fake_crash: simulating a segfault", file=sys.stderr, flush=True)
        os._exit(139)

    return run_fake_crash
