"""The backend registry: one module per backend, looked up by name, imported lazily.

A backend module defines (see backends/torch_bmm.py for the smallest one):

    NAME: str
    def unavailable_reason() -> str | None
        None when the backend can run here, else one sentence saying why not.
    def candidates(shape: Shape, space: dict, platform) -> list[Variant]
        The variants it offers for `shape`, from its search-space section of a config
        (`space`) and the platform (mla_tune.gpu.Platform: name, arch, is_hip, sm_count).
    def validate(variant: Variant) -> None
        Raise ValueError, one sentence naming the parameter, the bad value and the allowed
        values, for a missing, unknown or ill-typed/ill-valued parameter (or a combination
        no shape can run). Pure checks of names and values: no device, no vendor import, no
        shape (shape-dependent checks stay in build). load_table calls it on every variant
        of a table, so a hand edit fails at load; build calls it first, so the rules live in
        one place. Every variant candidates() offers passes it (fp8_static ones once the
        sweep has added q_amax). Optional for plugin backends (then only build checks).
    def build(variant: Variant, shape: Shape, device) -> Runner
        A callable runner(q, kv_data, qo_indptr, kv_indptr) -> (batch, 16, 512) bf16 that
        owns its buffers (it allocates nothing per call; its output buffer is reused, so
        copy it before the next call if you keep it). Vendor imports happen here, lazily.
        A runner of a q=fp8_static variant that counts, on the device, the q elements
        beyond its q_amax exposes that (1,) int64 counter as `runner.q_saturation`
        (flashmla's does, for free); the runtime sums these (Runtime.q_saturation).

Optional members (absent: the defaults in brackets):
    SPACE_KEYS: tuple[str, ...]
        The keys its config section may hold; config.py refuses any other. [not checked]
    PRECOMPILE: bool
        Its kernels compile on first use into an on-disk cache (Triton, vendor JITs), so the
        sweep warms them in mla_tune/tune/compile_pool.py before timing. [False]
    def compile_shape(variant, shape, sm_count) -> Shape
        A small stand-in for `shape` that compiles exactly the kernels `shape` uses.
        [compile_pool.default_compile_shape]
    def warmup(variant, shape, device, inputs) -> None
        Warm its caches for `variant` at `shape`. [build, then call once on `inputs`]
    def dedupe_key(variant, shape, platform) -> Hashable
        Two candidates of one shape with equal keys run the same kernel (an option the
        compiler ignores on this platform, a cap that gives the same metadata): the sweep
        keeps the first offered and drops the rest. [the variant itself]

Every variant carries the parameters `kv` (the KV format it reads: bf16, fp8, mxfp4) and
`q` (bf16, fp8_dynamic, fp8_static), so the runtime checks its inputs generically.
Backend modules and the kernels they use are *exportable* (see mla_tune/export/__init__.py).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

# name -> module; the order is the order of preference when times tie.
BACKEND_MODULES = {
    "triton": "mla_tune.backends.triton_splitk",
    "triton_fused": "mla_tune.backends.triton_fused",
    "gluon_fused": "mla_tune.backends.gluon_fused",
    "torch": "mla_tune.backends.torch_bmm",
    "aiter": "mla_tune.backends.aiter_mla",
    "flashinfer": "mla_tune.backends.flashinfer_mla",
    "flashmla": "mla_tune.backends.flash_mla",
}


# Extra backends for tests and plugins: "name=package.module,name2=package.module2". Read on
# every lookup so that worker processes, which inherit the environment, see them too.
EXTRA_BACKENDS_ENV = "MLA_TUNE_EXTRA_BACKENDS"


class UnknownBackend(ValueError):
    pass


def _modules() -> dict[str, str]:
    modules = dict(BACKEND_MODULES)
    for item in filter(None, os.environ.get(EXTRA_BACKENDS_ENV, "").split(",")):
        name, sep, module = item.partition("=")
        if not sep or not name.strip() or not module.strip():
            raise ValueError(f"{EXTRA_BACKENDS_ENV} entry {item!r} is not name=module.path")
        modules[name.strip()] = module.strip()
    return modules


def known_backends() -> list[str]:
    return list(_modules())


def dedupe_key(backend: ModuleType, variant, shape, platform):
    """The backend's `dedupe_key` hook for this candidate, or the variant itself."""
    hook = getattr(backend, "dedupe_key", None)
    return variant if hook is None else (variant.backend, hook(variant, shape, platform))


def get_backend(name: str) -> ModuleType:
    """The backend module called `name`; an unknown name fails with the list of known ones."""
    modules = _modules()
    if name not in modules:
        raise UnknownBackend(f"unknown backend {name!r}; known backends: {', '.join(modules)}")
    return importlib.import_module(modules[name])
