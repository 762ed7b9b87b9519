"""The backend registry: one module per backend, looked up by name, imported lazily.

A backend module defines (see backends/torch_bmm.py for the smallest one):

    NAME: str
    CAPABILITIES: mla_tune.core.Capabilities
        What it can serve and needs, in one record (its KV formats and q modes, whether its
        leaderboard runner reads ragged batches, its serving layouts, page sizes, heads,
        q_len range, graph safety, the platforms it runs on, its vendor distribution,
        whether its kernels precompile, whether it is the baseline). The sweep, the
        dispatcher, the runtime and the export read this record (through `capabilities`
        and the helpers below) instead of facts spread over files. Required for the
        built-in backends; a plugin backend without one gets `PLUGIN_CAPABILITIES` (any
        KV format and q mode, no ragged batches, no serving call, nothing precompiled).
    def unavailable_reason() -> str | None
        None when the backend can run here, else one sentence saying why not (a missing
        library, a GPU it cannot use). CAPABILITIES.platforms is checked before it.
    def candidates(shape: Shape, space: dict, platform) -> list[Variant]
        The variants it offers for `shape`, from its search-space section of a config
        (`space`) and the platform (mla_tune.gpu.Platform: name, arch, is_hip, sm_count).
        Their `kv` and `q` are among CAPABILITIES.kv_formats and q_modes.
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

The serving call, required when CAPABILITIES.serving is True (docs/architecture.md, "The
serving call"):
    def default_serving_variant(spec: CallSpec, platform) -> Variant
        A good variant for `spec` on `platform` without any timing; its `kv` is
        spec.kv_format.
    def build_serving(variant: Variant, spec: CallSpec, device) -> runner
        validate(variant) first; refuses (ValueError, one sentence with the fix) a spec
        CAPABILITIES.refusal(spec) refuses and a variant whose kv is not spec.kv_format.
        runner(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None,
        seq_lens=None, q_lens_host=None, kv_lens_host=None) -> (total_q, heads, 512) bf16.

Optional members (absent: the defaults in brackets):
    def serving_candidates(spec: CallSpec, space: dict, platform) -> list[Variant]
        The serving variants it offers for a family of the serving sweep, from its section
        of a serving config (mla_tune/serving/sweep.py). [its default_serving_variant]
    SPACE_KEYS: tuple[str, ...]
        The keys its config section may hold; config.py refuses any other. [not checked]
    def compile_shape(variant, shape, sm_count) -> Shape
        A small stand-in for `shape` that compiles exactly the kernels `shape` uses, for
        the precompile pool (mla_tune/tune/compile_pool.py) of a backend whose
        CAPABILITIES.precompile is True. [compile_pool.default_compile_shape]
    def warmup(variant, shape, device, inputs) -> None
        Warm its caches for `variant` at `shape`. [build, then call once on `inputs`]
    def dedupe_key(variant, shape, platform) -> Hashable
        Two candidates of one shape with equal keys run the same kernel (an option the
        compiler ignores on this platform, a cap that gives the same metadata): the sweep
        keeps the first offered and drops the rest. [the variant itself]
    def vendor_drift_note(tuned: str | None, here: str | None) -> str
        For a backend with CAPABILITIES.vendor: a clause for the runtime's warning that
        the vendor distribution's version differs from the table's (`tuned`, the version
        present `here`, None when not installed), ending "; ", or "" (drift_note). [""]
    def batch_split_budget(waves: float, sm_count: int, head_tiles: int) -> int
        Its serving variants (with max_splits, block_h, tokens_per_split) take a batch
        budget of splits, split_budget: the budget of `waves` waves of `sm_count` SMs over
        `head_tiles` head tiles (`mla-tune time scan --budget-waves`). [no budget variants]
    def serving_q_reference(variant: Variant) -> str
        How its serving kernel quantizes an fp8 q, as the q format the serving gate's
        reference reads under `reference_q: variant` (serving/gate.py reference_q_format):
        "fp8" per tensor, "fp8_row" per (new token, head) row (serving.inputs
        quantize_fp8_rows), or "bf16". Asked only for variants with an fp8 q mode. ["fp8"]

A schedule model, optional, for the serving lookup (mla_tune/serving/estimate.py): a module
beside the backend's own, named `<its module>_schedule` (backends/triton_splitk_schedule.py,
backends/gluon_fused_schedule.py, backends/flashinfer_mla_schedule.py,
backends/flash_mla_schedule.py; the first two share backends/makespan.py, the last two
backends/linear_schedule.py), torch-free (the serving table loads it), defining
    def fit(key, variants, points, cells, platform, interpolate) -> list[model]
        The models of one serving family (key: heads, q_len) for its point variants of
        this backend, from their points ({(batch, kv_len): {Variant: us}}), every timed
        cell ({(batch, kv_len): {variant name: us}}), platform ({sm_count, smem_per_sm})
        and the lookup's interpolate(points, batch, kv_len).
    def load(entry, variant, key, check) -> model
        A model from its table entry (its as_dict()); `check` is the table's field
        checker (check.fail(msg), check.number(name, v), check.positive_int(name, v)).
    def load_calibration(raw, check) -> dict   [optional: the family's calibration of the
        backend, e.g. its reduction's measured cost per step]
and a model: `variant`, `estimate(call, raw=False) -> float | None` (the variant's time for
an estimate.Call, or None to keep the interpolation), `as_dict()`, and optionally
`point_rate(key, batch, kv_len, us)` (what the lookup interpolates instead of the time) and
`native_estimate(key, calibration) -> (address, params) | None` (the same estimate as a C
function of mla_tune/native.py's `est_model_fn` type, and the float64 params array it
reads: where every model of a family has one, the lookup runs the family's estimate in one
C call).

Every variant carries the parameters `kv` (the KV format it reads: bf16, fp8, mxfp4) and
`q` (bf16, fp8_dynamic, fp8_static), so the runtime checks its inputs generically.
Backend modules and the kernels they use are *exportable* (see mla_tune/export/__init__.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from mla_tune.core import KV_FORMATS, Q_MODES, Capabilities

# name -> module; the order is the order of preference when times tie, and among the
# serving backends the Decoder's order when no backend is named (serving_backends()).
BACKEND_MODULES = {
    "triton": "mla_tune.backends.triton_splitk",
    "triton_fused": "mla_tune.backends.triton_fused",
    "gluon_fused": "mla_tune.backends.gluon_fused",
    "torch": "mla_tune.backends.torch_bmm",
    "aiter": "mla_tune.backends.aiter_mla",
    "flashinfer": "mla_tune.backends.flashinfer_mla",
    "flashmla": "mla_tune.backends.flash_mla",
}

# What a plugin (or test) backend without CAPABILITIES is taken to do: the formats it may
# read are unknown, so any; nothing it has not declared (ragged batches, the serving call,
# precompiling, being the baseline) is assumed.
PLUGIN_CAPABILITIES = Capabilities(kv_formats=KV_FORMATS, q_modes=Q_MODES)


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


SCHEDULE_SUFFIX = "_schedule"


def schedule_module(name: str) -> ModuleType | None:
    """Backend `name`'s schedule model (the module beside its own, named with
    SCHEDULE_SUFFIX: see this module's docstring), imported; None where it has none or the
    name is unknown."""
    module = _modules().get(name)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module + SCHEDULE_SUFFIX)
    except ModuleNotFoundError:  # its package is not there
        return None
    return importlib.import_module(module + SCHEDULE_SUFFIX) if found is not None else None


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


def capabilities(name: str) -> Capabilities:
    """Backend `name`'s CAPABILITIES (PLUGIN_CAPABILITIES for a plugin that declares none).

    An unknown name raises UnknownBackend; a module that does not import raises its
    ImportError; a built-in backend without the record, or a record that is not a
    Capabilities, raises TypeError (a bug in that module)."""
    module = get_backend(name)
    caps = getattr(module, "CAPABILITIES", None)
    if caps is None:
        if name in BACKEND_MODULES:
            raise TypeError(f"built-in backend {name!r} ({module.__name__}) declares no "
                            "CAPABILITIES; every built-in backend must")
        return PLUGIN_CAPABILITIES
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{module.__name__}.CAPABILITIES is a {type(caps).__name__}, not a "
                        "mla_tune.core.Capabilities")
    return caps


def declared_capabilities() -> dict[str, Capabilities]:
    """name -> CAPABILITIES of every known backend whose module imports here, in the
    registry's order. A module that does not import is left out: it cannot run here, and
    the sweep and the runtime report it by name where they use it."""
    out = {}
    for name in known_backends():
        try:
            out[name] = capabilities(name)
        except ImportError:
            continue
    return out


def serving_backends() -> list[str]:
    """The backends with a serving call (CAPABILITIES.serving) that import here, in the
    registry's order (BACKEND_MODULES, then the MLA_TUNE_EXTRA_BACKENDS plugins): the
    serving Decoder's order of preference when no backend is named, so a new backend's
    line in the registry is its place there too."""
    return [name for name, caps in declared_capabilities().items() if caps.serving]


def baseline_backend() -> str:
    """The one backend whose CAPABILITIES.baseline is True: the reference every sweep times
    in full and every table row cites (its time is a row's baseline_us)."""
    found = [name for name, caps in declared_capabilities().items() if caps.baseline]
    if len(found) != 1:
        raise TypeError(f"exactly one backend must declare CAPABILITIES.baseline, found "
                        f"{', '.join(found) or 'none'}")
    return found[0]


def ragged_backends(names=None) -> frozenset[str]:
    """The backends among `names` (None: every known one that imports) whose leaderboard
    runners read kv_indptr per sequence (CAPABILITIES.ragged), so that a ragged batch may
    be sent to them; any other assumes a uniform batch."""
    caps = declared_capabilities() if names is None else {n: capabilities(n) for n in names}
    return frozenset(name for name, c in caps.items() if c.ragged)


def vendor_distributions() -> tuple[str, ...]:
    """The distributions (pip names) of the vendor libraries the backends wrap, from their
    CAPABILITIES.vendor, in the registry's order: what a table's provenance records the
    versions of, besides torch and triton."""
    return tuple(dict.fromkeys(c.vendor for c in declared_capabilities().values() if c.vendor))


def drift_note(distribution: str, tuned: str | None, here: str | None) -> str:
    """What the first backend (registry order) whose CAPABILITIES.vendor is `distribution`
    and that has the optional `vendor_drift_note` hook says about that distribution's
    version moving from `tuned` (the table's) to `here` (None: not installed); "" when
    no such backend has the hook."""
    for name, caps in declared_capabilities().items():
        hook = getattr(get_backend(name), "vendor_drift_note", None) if caps.vendor == distribution else None
        if hook is not None:
            return hook(tuned, here)
    return ""


def platform_refusal(name: str, platform) -> str | None:
    """None when backend `name`'s CAPABILITIES.platforms include `platform` (a
    mla_tune.gpu.Platform, matched by its tags) or the platform is the plain CPU, else one
    sentence saying where it runs."""
    caps = capabilities(name)
    if caps.runs_on(platform.tags) or platform.name == "cpu":
        # the CPU (tests, the interpreter): a GPU backend's own unavailable_reason() says
        # why it cannot run here, and a CPU fake of its vendor library may stand in
        return None
    where = " or ".join("/".join(option) for option in caps.platforms) or "no platform"
    return f"it runs on {where}, not on {platform.name} ({'/'.join(sorted(platform.tags))})"
