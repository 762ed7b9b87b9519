"""Tiny fake backends for the sweep's tests (CPU, fast), registered through
MLA_TUNE_EXTRA_BACKENDS so that spawned worker processes find them too."""

import contextlib
import io
import os

from rich.console import Console

FAKES = ("fake_ok", "fake_wrong", "fake_raise", "fake_crash", "fake_hang", "fake_nogpu", "fake_poison",
         "fake_oom")
EXTRA_BACKENDS = ",".join(f"{name}=tests.fakes.{name}" for name in FAKES)


@contextlib.contextmanager
def registered(backends: str = EXTRA_BACKENDS):
    """Register fake backends for this process and, through the environment, its workers;
    the old value comes back afterwards."""
    from mla_tune.backends import EXTRA_BACKENDS_ENV

    old = os.environ.get(EXTRA_BACKENDS_ENV)
    os.environ[EXTRA_BACKENDS_ENV] = backends
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EXTRA_BACKENDS_ENV, None)
        else:
            os.environ[EXTRA_BACKENDS_ENV] = old


def capture() -> tuple[Console, io.StringIO]:
    """A wide console writing into a buffer, for tests that read what the sweep printed."""
    buf = io.StringIO()
    return Console(file=buf, width=250), buf


def unavailable_reason() -> str | None:
    """The tiny fakes' own (each imports it): they run anywhere."""
    return None


def one_variant(name: str, batch: int | None = None):
    """A fake's `candidates`: one bf16 variant of backend `name`, at batch `batch` only if given."""
    from mla_tune.core import Shape, Variant

    def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
        return [Variant.make(name, kv="bf16", q="bf16")] if batch in (None, shape.batch) else []

    return candidates
