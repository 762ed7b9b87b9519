"""A fake whose runner runs out of device memory: recorded as failed, the sweep goes on."""

import torch

from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_oom"
candidates = one_variant(NAME)


def build(variant: Variant, shape: Shape, device):
    def run_fake_oom(q, kv_data, qo_indptr, kv_indptr):
        raise torch.cuda.OutOfMemoryError("fake_oom: CUDA out of memory. Tried to allocate 512.00 GiB (simulated)")

    return run_fake_oom
