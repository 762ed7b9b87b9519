"""Refuse a subclass whose override of a base-class hook takes other arguments."""

import inspect


def _names(fn) -> list[str]:
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_overrides(cls, base, hooks) -> None:
    for hook in hooks:
        if hook not in cls.__dict__:
            continue
        want, got = _names(base.__dict__[hook]), _names(cls.__dict__[hook])
        if got != want:
            raise TypeError(f"{cls.__name__}.{hook} takes {got}; {base.__name__}.{hook} takes {want}")
