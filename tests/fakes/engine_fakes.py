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
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
ENGINES = ("vllm", "sglang")
_spec = importlib.util.spec_from_file_location("vendor_fakes", FAKES_DIR / "vendor_fakes.py")
_vendor_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vendor_fakes)


def install(monkeypatch, *engines: str) -> dict:
    for name in engines:
        if name not in ENGINES:
            raise ValueError(f"no engine fake for {name!r}; fakes exist for {', '.join(ENGINES)}")
    return {name: _vendor_fakes.load(monkeypatch, name, drop=(f"mla_tune.integrations.{name}",))
            for name in engines or ENGINES}
