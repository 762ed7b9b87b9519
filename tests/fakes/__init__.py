"""Helpers shared by the fakes: the tiny fake backends of the sweep's tests (CPU, fast),
registered through MLA_TUNE_EXTRA_BACKENDS so that spawned worker processes find them too,
and the engine fakes' check of a subclass's overrides."""

import inspect
import io
import os
from unittest import mock

from rich.console import Console

EXTRA_BACKENDS = ",".join(f"{name}=tests.fakes.{name}" for name in (
    "fake_ok", "fake_wrong", "fake_raise", "fake_crash", "fake_hang", "fake_nogpu", "fake_poison", "fake_oom"))


def registered(backends: str = EXTRA_BACKENDS):
    """Register fake backends for this process and, through the environment, its workers;
    the old environment comes back when the `with` block ends."""
    from mla_tune.backends import EXTRA_BACKENDS_ENV

    return mock.patch.dict(os.environ, {EXTRA_BACKENDS_ENV: backends})


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


def _names(fn) -> list[str]:
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_overrides(cls, base, hooks, init=None) -> None:
    """An engine fake's refusal of a subclass whose override of one of base's `hooks` takes
    other arguments (__init__'s are `init`'s: what the engine passes it)."""
    for hook in hooks:
        if hook not in cls.__dict__:
            continue
        want = _names(init if hook == "__init__" else base.__dict__[hook])
        got = _names(cls.__dict__[hook])
        if got != want:
            raise TypeError(f"{cls.__name__}.{hook} takes {got}; {base.__name__}.{hook} takes {want}")
