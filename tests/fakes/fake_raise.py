"""A fake whose build raises, like a kernel that does not compile: recorded as failed."""

from mla_tune.core import Shape, Variant
from tests.fakes import one_variant, unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_raise"
candidates = one_variant(NAME)


def build(variant: Variant, shape: Shape, device):
    raise RuntimeError("fake_raise: this variant does not compile (simulated)")
