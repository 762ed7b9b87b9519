"""A fake whose build raises, like a kernel that does not compile: recorded as failed."""

from mla_tune.core import Shape, Variant

NAME = "fake_raise"


def unavailable_reason() -> str | None:
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16")]


def build(variant: Variant, shape: Shape, device):
    raise RuntimeError("fake_raise: this variant does not compile (simulated)")
