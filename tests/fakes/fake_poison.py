"""A fake that raises the error a broken CUDA context gives, at batch 1 only: recorded as
failed, and its worker must exit so that the next candidate gets a fresh one."""

from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_poison"
candidates = one_variant(NAME, batch=1)


def build(variant: Variant, shape: Shape, device):
    def run_fake_poison(q, kv_data, qo_indptr, kv_indptr):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    return run_fake_poison
