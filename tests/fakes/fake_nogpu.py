"""A fake that is unavailable without a GPU, like a vendor backend: it must land in the
header's "unavailable" map, and a dry run for an absent GPU still lists its candidates."""

from mla_tune.core import Shape, Variant

NAME = "fake_nogpu"


def unavailable_reason() -> str | None:
    return "fake_nogpu needs a GPU; this machine has none"


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16", num_splits=s) for s in (1, 2)]


def build(variant: Variant, shape: Shape, device):
    raise RuntimeError("fake_nogpu cannot run here")
