"""A fake whose runner never returns, at batch 2 only: the sweep must kill it."""

import time

from mla_tune.core import Shape, Variant

NAME = "fake_hang"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")] if shape.batch == 2 else []


def build(variant: Variant, shape: Shape, device):
    def run_fake_hang(q, kv_data, qo_indptr, kv_indptr):
        while True:
            time.sleep(1.0)

    return run_fake_hang
