"""A fake whose `ignored` option changes nothing: its dedupe_key says so, and the sweep's
planner must collapse the candidates that differ only there."""

from mla_tune.core import Shape, Variant
from tests.fakes import unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_dup"


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16", num_splits=n, ignored=i)
            for n in space.get("num_splits", [1, 2]) for i in space.get("ignored", [0, 1])]


def dedupe_key(variant: Variant, shape: Shape, platform):
    return variant.get("num_splits")


def build(variant: Variant, shape: Shape, device):
    raise RuntimeError("fake_dup is for planning only")
