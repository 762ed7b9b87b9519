"""A fake whose build raises, like a kernel that does not compile: recorded as failed."""

from __future__ import annotations

from mla_tune.core import Shape, Variant
from tests.group_b_support import plain_candidates, runs_here

NAME = "fake_raise"
unavailable_reason = runs_here
candidates = plain_candidates(NAME)


def build(variant: Variant, shape: Shape, device):
    raise RuntimeError("fake_raise: this variant does not compile (simulated)")
