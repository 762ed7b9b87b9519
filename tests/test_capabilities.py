"""Each backend's CAPABILITIES, declared once and read wherever a rule needs a fact about it (a
field, a hook), never its name: made-up backends follow the fact, today's keep their behaviour."""

import ast
import itertools
import re
from importlib import metadata

import pytest
import yaml

from mla_tune import gpu, runtime
from mla_tune.backends import (
    BACKEND_MODULES,
    PLUGIN_CAPABILITIES,
    aiter_mla,
    baseline_backend,
    capabilities,
    drift_note,
    get_backend,
    known_backends,
    platform_refusal,
    ragged_backends,
    vendor_distributions,
)
from mla_tune.core import KV_FORMATS, Q_MODES, CallSpec, Capabilities, Shape, Variant
from mla_tune.serving.time_picks import vendor_backends, with_budget
from mla_tune.tune.config import (
    ConfigError,
    config_from_dict,
    default_precompile,
    expand_space,
    load_config,
)
from mla_tune.tune.sweep import plan_candidates, run_sweep
from mla_tune.xcompile import check as xcheck
from mla_tune.xcompile.capture import captured
from tests.fakes import capture
from tests.helpers import REPO as ROOT
from tests.helpers import cpu_table, register_backends

CPU = gpu.Platform("cpu", "cpu", "cpu", False, 0)
PLATFORMS = {name: gpu.fake_platform(name) for name in gpu.KNOWN_GPUS} | {"cpu": CPU}


def _config(backends: dict):
    return config_from_dict({"name": "caps", "rule": "leaderboard", "check_seeds": [1, 2], "calibration_seeds": [3],
                             "timing": {"reps": 3, "prune_reps": 2, "prune_factor": 2},
                             "shapes": [{"batch": 2, "kv_len": 64}], "backends": backends})


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """plugins({name: (Capabilities arguments or None, extra source)}): made-up backends."""
    return lambda specs: register_backends(tmp_path, monkeypatch, {
        name: (f"CAPABILITIES = Capabilities({caps})\n" if caps is not None else "") + extra
        for name, (caps, extra) in specs.items()})


# ------------------------------------------------------------------ the records themselves
@pytest.mark.parametrize("name", list(BACKEND_MODULES))
def test_every_builtin_backend_declares_a_record_its_candidates_and_validate_agree_with(name):
    module = get_backend(name)
    caps = capabilities(name)
    assert isinstance(module.CAPABILITIES, Capabilities) and caps is module.CAPABILITIES
    assert set(caps.kv_formats) <= set(KV_FORMATS) and set(caps.q_modes) <= set(Q_MODES)
    assert caps.kv_formats and caps.q_modes and caps.platforms
    offered = []
    for config_path in ("configs/leaderboard.yaml", "configs/mi355x.yaml"):
        config = load_config(ROOT / config_path)
        if name not in config.backends:
            continue
        for platform in PLATFORMS.values():
            if not caps.runs_on(platform.tags):
                continue
            offered += [v for shape in config.shapes[:2] for grid in expand_space(config.backends[name])
                        for v in module.candidates(shape, grid, platform)]
    for variant in set(offered):
        assert variant.get("kv") in caps.kv_formats and variant.get("q") in caps.q_modes, (name, str(variant))
        ready = variant.with_params(q_amax=6.0) if variant.get("q") == "fp8_static" else variant
        module.validate(ready)
        for kv in set(KV_FORMATS) - set(caps.kv_formats):  # a format it does not declare is refused
            with pytest.raises(ValueError):
                module.validate(ready.with_params(kv=kv))
        for q in set(Q_MODES) - set(caps.q_modes):
            with pytest.raises(ValueError):
                module.validate(variant.with_params(q=q))
    keys = getattr(module, "SPACE_KEYS", None)
    for key, declared, every in (("kv", caps.kv_formats, KV_FORMATS), ("q", caps.q_modes, Q_MODES)):
        for value in set(every) - set(declared):  # nor may a config ask for one
            if keys is None or key in keys:
                with pytest.raises(ConfigError, match=f"backend {name} does not offer {key}={value}; its "):
                    _config({name: {key: [value]}})


def test_the_registry_reads_builtin_and_plugin_records_alike_and_a_plugin_without_one_is_conservative(
        plugins, monkeypatch):
    """And a second baseline, or a built-in backend without a record, is a loud error."""
    assert [n for n in BACKEND_MODULES if capabilities(n).baseline] == ["torch"]
    assert ragged_backends() == frozenset({"triton"})
    assert ragged_backends(["torch", "triton_fused"]) == frozenset()
    assert set(vendor_distributions()) == {capabilities(n).vendor for n in ("aiter", "flashinfer", "flashmla")}
    assert None not in vendor_distributions()
    for name in ("triton", "triton_fused", "gluon_fused", "torch"):
        assert capabilities(name).vendor is None  # torch and triton are recorded anyway
    for name in BACKEND_MODULES:
        assert default_precompile(name) is capabilities(name).precompile
    assert _config({"triton": {"precompile": False}}).precompile == {"triton": False}  # config wins
    plugins({
        "plain": (None, "PRECOMPILE = True\n"),  # the old flag is no longer read
        "ragged_one": ('kv_formats=("bf16",), ragged=True, precompile=True, '
                       'vendor="acme-mla", platforms=(("hip", "gfx950"),)', ""),
    })
    caps = capabilities("plain")
    assert caps is PLUGIN_CAPABILITIES
    assert caps.kv_formats == KV_FORMATS and caps.q_modes == Q_MODES
    assert not (caps.ragged or caps.serving or caps.precompile or caps.baseline or caps.vendor)
    assert all(caps.runs_on(p.tags) for p in PLATFORMS.values())
    assert "plain" in known_backends() and default_precompile("plain") is False
    assert caps.refusal(CallSpec("bf16")) == "it serves the leaderboard's call only (no build_serving)"
    assert ragged_backends() == frozenset({"triton", "ragged_one"})  # "plain" not among them
    assert "acme-mla" in vendor_distributions() and baseline_backend() == "torch"
    assert default_precompile("ragged_one")
    assert _config({"torch": {}, "triton": {}, "ragged_one": {}}).precompile == {
        "torch": False, "triton": True, "ragged_one": True}
    assert platform_refusal("ragged_one", PLATFORMS["MI355X"]) is None
    assert platform_refusal("ragged_one", PLATFORMS["H200"]) == "it runs on hip/gfx950, not on H200 (cuda/sm_90)"
    plugins({"other_base": ('kv_formats=("bf16",), baseline=True', "")})
    with pytest.raises(TypeError, match="exactly one backend must declare CAPABILITIES.baseline, "
                                        "found torch, other_base"):
        baseline_backend()
    monkeypatch.delattr(get_backend("torch"), "CAPABILITIES")
    with pytest.raises(TypeError, match="built-in backend 'torch' .* declares no CAPABILITIES"):
        capabilities("torch")


# ------------------------------------------------------------------ refusals
def test_refusal_says_in_one_sentence_why_a_call_is_not_served_and_the_own_kernels_serve_their_matrix():
    """The vendors' records: tests/test_vendor_serving.py."""
    caps = Capabilities(kv_formats=("bf16", "fp8", "mxfp4"), serving_kv_formats=("bf16", "fp8"), serving=True,
                        contiguous=False, page_sizes=(64,), heads=(16, 128), max_q_len=2, graph_safe=False,
                        host_lengths=True)
    ok = CallSpec("fp8", page_size=64, heads=128, max_q_len=2, host_lengths=True)
    assert caps.refusal(ok) is None
    cases = {
        CallSpec("mxfp4", 64, host_lengths=True): "it reads bf16, fp8 KV, not mxfp4",
        CallSpec("bf16", 0, host_lengths=True): "it reads paged KV (pages of 64 tokens), not the contiguous layout",
        CallSpec("bf16", 16, host_lengths=True): "it reads pages of 64 tokens, not pages of 16",
        CallSpec("bf16", 64, heads=32, host_lengths=True): "it serves 16, 128 heads, not 32",
        CallSpec("bf16", 64, max_q_len=4, host_lengths=True): "it serves q_len up to 2, not 4",
        CallSpec("bf16", 64, mixed_q_len=True, host_lengths=True):
            "it needs every sequence of a call to bring the same number of new tokens",
        CallSpec("bf16", 64, graph=True, host_lengths=True):
            "its call synchronizes or allocates, so it cannot be captured in a CUDA graph",
        CallSpec("bf16", 64): "it plans from the lengths on the host each step; pass them (host_lengths)",
    }
    for spec, message in cases.items():
        assert caps.refusal(spec) == message, spec
    # the Gluon serving kernel reads a 64-token tile from one page: pages of 64 or 128, or contiguous
    assert capabilities("gluon_fused").refusal(CallSpec("fp8", 64, heads=128, max_q_len=4)) is None
    # the own kernels serve the whole matrix the issue asks for, in a graph
    for name, page_size, heads in itertools.product(("triton", "triton_fused"), (0, 1, 16, 64), (16, 128)):
        spec = CallSpec("fp8", page_size, heads, max_q_len=4, mixed_q_len=True, graph=True)
        assert capabilities(name).refusal(spec) is None, (name, spec)


def test_a_backend_with_the_serving_call_declares_it_and_its_default_variant_fits_the_spec():
    serving = {n: get_backend(n) for n in BACKEND_MODULES if hasattr(get_backend(n), "build_serving")}
    declared = {n for n in BACKEND_MODULES if capabilities(n).serving}
    assert set(serving) == declared
    for name, module in serving.items():
        caps = capabilities(name)
        assert callable(getattr(module, "default_serving_variant", None)), name
        platform = next(p for p in PLATFORMS.values() if caps.runs_on(p.tags))
        specs = [CallSpec(kv, page, heads, host_lengths=caps.host_lengths)
                 for kv in (caps.serving_kv_formats or caps.kv_formats)
                 for page in ((0,) if caps.contiguous else ()) + caps.page_sizes[:2] for heads in caps.heads[:2]]
        for spec in specs:
            assert caps.refusal(spec) is None, (name, spec)
            variant = module.default_serving_variant(spec, platform)
            assert variant.backend == name and variant.get("kv") == spec.kv_format, (name, spec, str(variant))
            module.validate(variant)
            refused = CallSpec(spec.kv_format, spec.page_size, heads=7, host_lengths=spec.host_lengths)
            with pytest.raises(ValueError, match=re.escape(caps.refusal(refused))):
                module.build_serving(variant, refused, "cpu")


# ------------------------------------------------------------------ who reads the records
DRIFT_HOOK = '''
def vendor_drift_note(tuned, here):
    return f"{NAME} says {tuned} -> {here} moved its kernels; "
'''


def test_the_versions_and_their_drift_notes_come_from_the_vendors_and_hooks_the_records_name(
        plugins, monkeypatch, tmp_path):
    plugins({
        "drifty": ('kv_formats=("bf16",), vendor="drifty-lib"', DRIFT_HOOK),
        "hook_no_vendor": ('kv_formats=("bf16",)', DRIFT_HOOK),  # the hook alone says nothing
        "vendor_no_hook": ('kv_formats=("bf16",), vendor="quiet-lib"', ""),
        "acme": ('kv_formats=("bf16",), vendor="acme-mla"', ""),
    })
    # the drift note: the hook of the backend wrapping that distribution
    assert drift_note("drifty-lib", "1.0", "2.0") == "drifty says 1.0 -> 2.0 moved its kernels; "
    assert drift_note("quiet-lib", "1.0", "2.0") == ""
    assert drift_note("hook_no_vendor", "1.0", "2.0") == ""
    versions = {"drifty-lib": "1.0", "quiet-lib": "3.0", "triton": "3.6.0", "sgl-flash-mla": "1.0.0"}
    with pytest.warns(UserWarning) as record:
        runtime.load(table=cpu_table(tmp_path, versions=versions), device="cpu")
    messages = "\n".join(str(w.message) for w in record)  # no expected text spans two warnings
    assert f"provenance.versions.triton is 3.6.0 but this process has {gpu.detect().versions['triton']}" in messages
    assert "provenance.versions.sgl-flash-mla is 1.0.0 but this process has not installed" in messages
    assert ("provenance.versions.drifty-lib is 1.0 but this process has not installed; "
            "drifty says 1.0 -> None moved its kernels; timings may have moved") in messages
    assert "provenance.versions.quiet-lib is 3.0 but this process has not installed; timings may have moved" in messages
    # aiter keeps its binary note and the other versions get none
    aiter = capabilities("aiter").vendor
    assert drift_note(aiter, "0.1.11", "0.1.20") == aiter_mla.aiter_drift_note("0.1.11", "0.1.20") != ""
    for name in ("torch", "triton", capabilities("flashinfer").vendor, capabilities("flashmla").vendor):
        assert drift_note(name, "1.0", "2.0") == ""
    assert drift_note(aiter, "0.1.11", None) == ""  # not installed here: nothing to compare
    # software versions: each vendor the records name, where installed
    installed = {"acme-mla": "2.0", vendor_distributions()[0]: "1.5"}

    def version(dist):
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(metadata, "version", version)
    versions = gpu.software_versions()
    assert {"python", "torch", "triton", "cuda", "hip"} <= set(versions)
    assert versions["acme-mla"] == "2.0" and versions[vendor_distributions()[0]] == "1.5"
    assert not set(vendor_distributions()) - set(installed) & set(versions)  # absent ones are left out
    fields = runtime.version_fields()
    assert fields[:4] == ("torch", "triton", "cuda", "hip")
    assert {"acme-mla", "acme-mla-commit", *vendor_distributions()} <= set(fields)


def test_the_runtime_the_sweep_and_its_dry_run_name_a_backend_whose_record_excludes_the_platform(tmp_path):
    # on the plain CPU a GPU backend's own reason speaks (a CPU fake of a vendor may stand in)
    reason = get_backend("gluon_fused").unavailable_reason()
    assert reason and runtime.backend_unavailable("gluon_fused", CPU) == reason
    assert runtime.backend_unavailable("gluon_fused", PLATFORMS["MI355X"]).startswith(
        "it runs on cuda/sm_90, not on MI355X")
    assert runtime.backend_unavailable("torch", CPU) is None
    assert runtime.backend_unavailable("aiter", PLATFORMS["H200"]).startswith(
        "it runs on hip/gfx942 or hip/gfx950, not on H200")
    # the sweep skips it, with that reason
    config = _config({"torch": {}, "triton": {}, "gluon_fused": {}})
    planned = plan_candidates(config, CPU)
    assert planned.unavailable == {"gluon_fused": reason}
    assert {v.backend for v in planned.plan[Shape(2, 64)]} == {"torch", "triton"}
    # planning for an absent GPU lists a backend that only lacks that GPU, not one never written for it
    planned = plan_candidates(_config({"torch": {}, "flashmla": {}}), PLATFORMS["MI355X"], planning_only=True)
    assert planned.unavailable["flashmla"].startswith("it runs on cuda/sm_90, not on MI355X")
    assert "flashmla" not in planned.listed_anyway
    # a dry run names them in its summary
    raw = yaml.safe_load((ROOT / "configs" / "mi355x.yaml").read_text())
    raw["shapes"] = raw["shapes"][:1]
    config = tmp_path / "mi.yaml"
    config.write_text(yaml.safe_dump(raw))
    console, buf = capture()
    summary = run_sweep(config, "H200", out=tmp_path / "H200.yaml", dry_run=True, console=console)
    assert summary.unavailable["aiter"].startswith("it runs on hip/gfx942 or hip/gfx950, not on H200")
    assert all("aiter" not in per for per in summary.plan.values())
    assert "aiter" in buf.getvalue() and "gfx950" in buf.getvalue()


# ------------------------------------------------ which candidates mla-tune compile captures
CAPTURE_BUILD = '''
def build(variant, shape, device):
    raise ValueError(f"{NAME} was built by the capture")
'''


def test_the_compile_check_captures_own_precompiled_kernels_not_vendor_or_plain_ones(plugins, monkeypatch):
    plugins({
        "own_jit": ('kv_formats=("bf16",), precompile=True', CAPTURE_BUILD),
        "wrapped": ('kv_formats=("bf16",), precompile=True, vendor="some-lib"', CAPTURE_BUILD),
        "eager": ('kv_formats=("bf16",)', CAPTURE_BUILD),
    })
    assert [n for n in BACKEND_MODULES if captured(n)] == ["triton", "triton_fused", "gluon_fused"]
    assert [n for n in ("own_jit", "wrapped", "eager") if captured(n)] == ["own_jit"]
    monkeypatch.setattr(xcheck, "interpreting", lambda: False)  # nothing reaches a compile here
    shape = Shape(2, 64)
    plan = {shape: [Variant.make(n, kv="bf16", q="bf16") for n in ("own_jit", "wrapped", "eager")]}
    report = xcheck.check_plan(plan, "H200", jobs=1, use_cache=False, q_quant=False)
    assert report["not_compiled"] == {"wrapped": 1, "eager": 1}
    assert report["capture_errors"] == [{"shape": str(shape), "label": "own_jit(kv=bf16,q=bf16)",
                                         "error": "capture failed: ValueError: own_jit was built by the capture"}]


# ------------------------------------------------ mla-tune time: vendor rows and budget variants
SERVING_PAIR = '''
def default_serving_variant(spec, platform):
    raise ValueError("not called here")

def build_serving(variant, spec, device):
    raise ValueError("not called here")
'''
BUDGET_HOOK = '''
def batch_split_budget(waves, sm_count, head_tiles):
    return int(waves * sm_count) * 1000 + head_tiles
'''


def test_the_vendor_rows_of_a_mix_and_the_budget_variants_follow_the_records_and_hooks(plugins):
    """The vendor rows: the serving backends that wrap a vendor for this GPU; budget variants:
    a backend's batch_split_budget hook."""
    h200, mi355x = PLATFORMS["H200"], PLATFORMS["MI355X"]
    assert vendor_backends(h200) == ["flashinfer", "flashmla"] and vendor_backends(mi355x) == ["aiter"]
    sm90 = 'platforms=(("cuda", "sm_90"),)'
    plugins({
        "new_vendor": (f'kv_formats=("bf16",), serving=True, vendor="new-lib", {sm90}', SERVING_PAIR),
        "amd_vendor": ('kv_formats=("bf16",), serving=True, vendor="amd-lib", platforms=(("hip",),)',
                       SERVING_PAIR),
        "no_serving": (f'kv_formats=("bf16",), vendor="lb-lib", {sm90}', ""),
        "own_kernel": (f'kv_formats=("bf16",), serving=True, {sm90}', SERVING_PAIR),
        "budgeted": ('kv_formats=("bf16",)', BUDGET_HOOK), "unbudgeted": ('kv_formats=("bf16",)', ""),
    })
    assert vendor_backends(h200) == ["flashinfer", "flashmla", "new_vendor"]
    assert vendor_backends(mi355x) == ["aiter", "amd_vendor"]
    split = dict(kv="bf16", q="bf16", block_h=16, max_splits=8, tokens_per_split=512)
    made = with_budget(Variant.make("budgeted", **split), 2, 128, sm_count=100, heads=64)
    assert made == Variant.make("budgeted", **{**split, "tokens_per_split": 128, "split_budget": 200 * 1000 + 4})
    assert with_budget(Variant.make("unbudgeted", **split), 2, 128, 100, 64) is None
    assert with_budget(Variant.make("budgeted", **{**split, "max_splits": 1}), 2, 128, 100, 64) is None
    # none for gluon_fused though its serving form takes split_budget (it has no hook: its
    # budgets are its serving_candidates' own); triton's: tests/test_time_command.py
    gluon = Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_h=16, max_splits=8,
                         tokens_per_split=512, num_stages=2, v_halves=1)
    assert with_budget(gluon, 2, 128, 100, 64) is None


# ------------------------------------------------------------------ one place for each fact
# Modules outside backends/ that may name built-in backends (torch and triton count, as the
# libraries too) in a comparison or a literal of names: how many places (at most), and why.
NAMED_OUTSIDE_BACKENDS = {
    "mla_tune/gpu.py": (1, "the torch and triton libraries' versions"),
    "mla_tune/export/modules.py": (1, "torch and triton, the third-party imports an export may keep"),
    "mla_tune/runtime/__init__.py": (1, "torch and triton, library versions the runtime compares"),
    "mla_tune/tables/dispatch.py": (4, "the leaderboard's fallback policy: which backend stands in, by rule"),
    "mla_tune/export/__init__.py": (3, "the export's fallback: triton's default_variant"),
    "mla_tune/tune/schedule.py": (1, "DEFAULT_COSTS: cost priors; a backend without a line takes '*'"),
}


def _backend_names(node, names: set[str]) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
    return []


def test_no_module_but_the_backends_names_a_vendor_a_ragged_set_the_baseline_or_a_backend():
    """And a comparison with a built-in backend's name, or a literal of two or more of them (an
    order, a table keyed by name), is a place a new backend must join: none but those listed."""
    vendors, baseline, backends = set(vendor_distributions()), baseline_backend(), set(known_backends())
    builtin, found, named = set(BACKEND_MODULES), [], {}
    for path in sorted((ROOT / "mla_tune").rglob("*.py")):
        name = path.relative_to(ROOT / "mla_tune").as_posix()
        if name.startswith("backends/") and name != "backends/__init__.py":
            continue  # the backends declare the facts
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"mla_tune/{name} line {getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in vendors:
                found.append(f"{where} names the vendor distribution {node.value}")
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names_backends = any(isinstance(c, ast.Constant) and c.value in backends
                                         for c in ast.walk(node.value))
                    if isinstance(target, ast.Name) and "RAGGED" in target.id.upper() and names_backends:
                        found.append(f"{where} defines a set of ragged backends ({target.id})")
                if isinstance(node.value, ast.Constant) and node.value.value == baseline:
                    found.append(f"{where} assigns the baseline's name")
            if isinstance(node, ast.Compare) and any(isinstance(side, ast.Constant) and side.value == baseline
                                                     for side in (node.left, *node.comparators)):
                found.append(f"{where} compares with the baseline's name")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == baseline):
                found.append(f"{where} looks the baseline up by name")
            if isinstance(node, ast.Compare):
                hit = any(_backend_names(side, builtin) for side in (node.left, *node.comparators))
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hit = len(_backend_names(node, builtin)) >= 2
            elif isinstance(node, ast.Dict):
                hit = sum(bool(_backend_names(k, builtin)) for k in node.keys if k is not None) >= 2
            else:
                hit = False
            if hit and name != "backends/__init__.py":
                named.setdefault(f"mla_tune/{name}", []).append(node.lineno)
    assert found == []
    over = {f: lines for f, lines in named.items()
            if len(lines) > NAMED_OUTSIDE_BACKENDS.get(f, (0, ""))[0]}
    assert not over, ("backend names outside mla_tune/backends (a capability or an optional "
                      f"backend member instead): {over}")
