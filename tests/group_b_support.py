"""What the sweep's fake backends (tests/fakes/fake_*.py) share."""

from __future__ import annotations

from mla_tune.core import Shape, Variant


def runs_here() -> str | None:
    """unavailable_reason() of a fake that runs anywhere."""
    return None


def plain_candidates(name: str, batch: int | None = None):
    """candidates() of a fake offering one NAME(kv=bf16,q=bf16) variant, at `batch` only if given."""

    def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
        return [Variant.make(name, kv="bf16", q="bf16")] if batch in (None, shape.batch) else []

    return candidates
