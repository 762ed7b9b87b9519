"""A fake whose runner runs out of device memory: recorded as failed, the sweep goes on."""

import torch

from mla_tune.core import Shape, Variant

NAME = "fake_oom"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")]


def build(variant: Variant, shape: Shape, device):
    def run_fake_oom(q, kv_data, qo_indptr, kv_indptr):
        raise torch.cuda.OutOfMemoryError("fake_oom: CUDA out of memory. Tried to allocate 512.00 GiB (simulated)")

    return run_fake_oom
