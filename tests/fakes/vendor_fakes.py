"""Install the CPU fakes of the vendor libraries (aiter, flashinfer, flash_mla).

In a test (restored when the test ends):

    vendor_fakes.install(monkeypatch, "aiter", cu_num=256)
    import aiter            # the fake, v0.1.11

For a worker subprocess (a sweep worker, `mla-tune sweep` run by a test):

    env = vendor_fakes.subprocess_env("aiter")
    subprocess.run([...], env=env)

`subprocess_env` puts this folder first on PYTHONPATH, so every fake here becomes importable
in the child (the fakes are only ever imported by name). The backends treat a fake as
runnable on the CPU (each fake sets MLA_TUNE_CPU_FAKE), but their `candidates` still ask
for the platform a real library needs: plan CPU sweeps with gpu.fake_platform("MI355X") for
aiter and gpu.fake_platform("H200") for flashinfer / flashmla.
"""

import importlib.util
import os
import sys
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
PACKAGES = ("aiter", "flashinfer", "flash_mla")


def _settings_env(cu_num: int | None, arch: str | None) -> dict[str, str]:
    env = {}
    if cu_num is not None:
        env["MLA_TUNE_FAKE_AITER_CU_NUM"] = str(int(cu_num))
    if arch is not None:
        env["MLA_TUNE_FAKE_AITER_ARCH"] = arch
    return env


def _check(packages) -> tuple[str, ...]:
    packages = tuple(packages) or PACKAGES
    unknown = [p for p in packages if p not in PACKAGES]
    if unknown:
        raise ValueError(f"no fake for {unknown}; fakes exist for {', '.join(PACKAGES)}")
    return packages


def install(monkeypatch, *packages: str, cu_num: int | None = None, arch: str | None = None):
    """Import fresh copies of the named fakes (default: all) into sys.modules for one test.

    Fresh every time, so call counters and metadata registries start empty. `cu_num` and
    `arch` configure the fake AITER's GPU (default 256 CUs, gfx950: an MI355X). Returns the
    top-level fake modules as a dict.
    """
    for key, value in _settings_env(cu_num, arch).items():
        monkeypatch.setenv(key, value)
    return {name: load(monkeypatch, name) for name in _check(packages)}


def load(monkeypatch, name: str, drop=()):
    """Import the fake package `name` fresh from this folder, by path, into sys.modules (its
    old modules, and those named in `drop`, removed first); monkeypatch undoes it all."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".") or k in drop]:
        monkeypatch.delitem(sys.modules, key)
    before = set(sys.modules)
    init = FAKES_DIR / name / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # imports every submodule of the fake eagerly
    finally:
        for key in set(sys.modules) - before:
            monkeypatch.setitem(sys.modules, key, sys.modules.pop(key))
    return module


def subprocess_env(*packages: str, base: dict | None = None, cu_num: int | None = None,
                   arch: str | None = None) -> dict[str, str]:
    """An environment for a child process in which the fakes are importable."""
    _check(packages)
    env = dict(os.environ if base is None else base)
    parts = [str(FAKES_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(_settings_env(cu_num, arch))
    return env
