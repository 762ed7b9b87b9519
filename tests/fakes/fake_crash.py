"""A fake that kills its process like a segfault (exit code 139), at batch 2 only."""

import os
import sys

from mla_tune.core import Shape, Variant

NAME = "fake_crash"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")] if shape.batch == 2 else []


def build(variant: Variant, shape: Shape, device):
    def run_fake_crash(q, kv_data, qo_indptr, kv_indptr):
        print("fake_crash: simulating a segfault", file=sys.stderr, flush=True)
        os._exit(139)

    return run_fake_crash
