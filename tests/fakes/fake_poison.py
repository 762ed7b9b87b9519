"""A fake that raises the error a broken CUDA context gives, at batch 1 only: recorded as
failed, and its worker must exit so that the next candidate gets a fresh one."""

from mla_tune.core import Shape, Variant

NAME = "fake_poison"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")] if shape.batch == 1 else []


def build(variant: Variant, shape: Shape, device):
    def run_fake_poison(q, kv_data, qo_indptr, kv_indptr):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    return run_fake_poison
