"""Install the CPU fakes of the serving engines (vllm, sglang) for one test.

    engine_fakes.install(monkeypatch, "vllm")
    from mla_tune.integrations import vllm as backend   # imported fresh, against the fake

Each fake is loaded by path into sys.modules (tests/fakes never goes on sys.path, so the
vendor fakes beside them stay out of reach), and mla_tune's module for that engine is
dropped first so it binds to the fake; monkeypatch restores both when the test ends.
Load this module by path, e.g.
    spec = importlib.util.spec_from_file_location("engine_fakes", FAKES_DIR / "engine_fakes.py")
"""

import importlib.util
import sys
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
ENGINES = ("vllm", "sglang")


def install(monkeypatch, *engines: str) -> dict:
    loaded = {}
    for name in engines or ENGINES:
        if name not in ENGINES:
            raise ValueError(f"no engine fake for {name!r}; fakes exist for {', '.join(ENGINES)}")
        ours = f"mla_tune.integrations.{name}"
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".") or k == ours]:
            monkeypatch.delitem(sys.modules, key)
        before = set(sys.modules)
        init = FAKES_DIR / name / "__init__.py"
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        finally:
            for key in set(sys.modules) - before:
                monkeypatch.setitem(sys.modules, key, sys.modules.pop(key))
        loaded[name] = module
    return loaded
