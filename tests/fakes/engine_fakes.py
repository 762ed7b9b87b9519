"""Install the CPU fakes of the serving engines (vllm, sglang) for one test:

    engine_fakes.install(monkeypatch, "vllm")
    from mla_tune.integrations import vllm as backend   # imported fresh, against the fake

Each fake is loaded by path into sys.modules (tests/fakes never goes on sys.path, so the
vendor fakes beside them stay out of reach), and mla_tune's module for that engine is
dropped first so it binds to the fake; monkeypatch restores both when the test ends.
"""

from tests.fakes import vendor_fakes

ENGINES = ("vllm", "sglang")


def install(monkeypatch, *engines: str) -> dict:
    for name in engines:
        if name not in ENGINES:
            raise ValueError(f"no engine fake for {name!r}; fakes exist for {', '.join(ENGINES)}")
    return {name: vendor_fakes.load(monkeypatch, name, drop=(f"mla_tune.integrations.{name}",))
            for name in engines or ENGINES}
