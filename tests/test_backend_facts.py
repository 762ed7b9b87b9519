"""Rules read a fact a backend declares (a CAPABILITIES field, a hook), not its name: made-up
backends follow the fact, today's keep their behaviour."""

from __future__ import annotations

import pytest

from mla_tune import backends, runtime
from mla_tune.backends import aiter_mla, drift_note, triton_splitk
from mla_tune.core import Shape, Variant
from mla_tune.gpu import fake_platform
from mla_tune.serving.time_picks import vendor_backends, with_budget
from mla_tune.xcompile import check as xcheck
from mla_tune.xcompile.capture import captured
from tests.helpers import cpu_table, register_backends


@pytest.fixture
def add_backends(tmp_path, monkeypatch):
    """add_backends({name: (Capabilities arguments, extra source)}): made-up backends (no rule
    knows their names), registered by tests.helpers.register_backends."""
    return lambda specs: register_backends(tmp_path, monkeypatch, {
        name: f"CAPABILITIES = Capabilities({caps})\n{extra}"
        for name, (caps, extra) in specs.items()})


# ------------------------------------------------ the runtime's version-drift note
DRIFT_HOOK = '''
def vendor_drift_note(tuned, here):
    return f"{NAME} says {tuned} -> {here} moved its kernels; "
'''


def test_the_drift_note_comes_from_the_hook_of_the_backend_wrapping_that_distribution(add_backends, tmp_path):
    add_backends({
        "drifty": ('kv_formats=("bf16",), vendor="drifty-lib"', DRIFT_HOOK),
        "hook_no_vendor": ('kv_formats=("bf16",)', DRIFT_HOOK),  # the hook alone says nothing
        "vendor_no_hook": ('kv_formats=("bf16",), vendor="quiet-lib"', ""),
    })
    assert drift_note("drifty-lib", "1.0", "2.0") == "drifty says 1.0 -> 2.0 moved its kernels; "
    assert drift_note("quiet-lib", "1.0", "2.0") == ""
    assert drift_note("hook_no_vendor", "1.0", "2.0") == ""
    with pytest.warns(UserWarning) as record:
        runtime.load(table=cpu_table(tmp_path, versions={"drifty-lib": "1.0", "quiet-lib": "3.0"}), device="cpu")
    messages = [str(w.message) for w in record]
    assert any("provenance.versions.drifty-lib is 1.0 but this process has not installed; "
               "drifty says 1.0 -> None moved its kernels; timings may have moved" in m for m in messages)
    assert any("provenance.versions.quiet-lib is 3.0 but this process has not installed; timings may "
               "have moved" in m for m in messages)
    # aiter keeps its binary note and the other versions get none
    aiter = backends.capabilities("aiter").vendor
    assert drift_note(aiter, "0.1.11", "0.1.20") == aiter_mla.aiter_drift_note("0.1.11", "0.1.20") != ""
    assert drift_note(aiter, "0.1.13", "0.1.14") == ""  # one binary era
    for name in ("torch", "triton", backends.capabilities("flashinfer").vendor,
                 backends.capabilities("flashmla").vendor):
        assert drift_note(name, "1.0", "2.0") == ""
    assert drift_note(aiter, "0.1.11", None) == ""  # not installed here: nothing to compare


# ------------------------------------------------ which candidates mla-tune compile captures
CAPTURE_BUILD = '''
def build(variant, shape, device):
    raise ValueError(f"{NAME} was built by the capture")
'''


def test_the_compile_check_captures_own_precompiled_kernels_not_vendor_or_plain_ones(add_backends, monkeypatch):
    add_backends({
        "own_jit": ('kv_formats=("bf16",), precompile=True', CAPTURE_BUILD),
        "wrapped": ('kv_formats=("bf16",), precompile=True, vendor="some-lib"', CAPTURE_BUILD),
        "eager": ('kv_formats=("bf16",)', CAPTURE_BUILD),
    })
    assert [n for n in backends.BACKEND_MODULES if captured(n)] == ["triton", "triton_fused", "gluon_fused"]
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


def test_the_vendor_rows_of_a_mix_are_the_serving_backends_that_wrap_a_vendor_for_this_gpu(add_backends):
    h200, mi355x = fake_platform("H200"), fake_platform("MI355X")
    assert vendor_backends(h200) == ["flashinfer", "flashmla"] and vendor_backends(mi355x) == ["aiter"]
    sm90 = 'platforms=(("cuda", "sm_90"),)'
    add_backends({
        "new_vendor": (f'kv_formats=("bf16",), serving=True, vendor="new-lib", {sm90}', SERVING_PAIR),
        "amd_vendor": ('kv_formats=("bf16",), serving=True, vendor="amd-lib", platforms=(("hip",),)',
                       SERVING_PAIR),
        "no_serving": (f'kv_formats=("bf16",), vendor="lb-lib", {sm90}', ""),
        "own_kernel": (f'kv_formats=("bf16",), serving=True, {sm90}', SERVING_PAIR),
    })
    assert vendor_backends(h200) == ["flashinfer", "flashmla", "new_vendor"]
    assert vendor_backends(mi355x) == ["aiter", "amd_vendor"]


def test_budget_variants_come_from_a_backends_batch_split_budget_hook(add_backends):
    add_backends({"budgeted": ('kv_formats=("bf16",)', BUDGET_HOOK), "unbudgeted": ('kv_formats=("bf16",)', "")})
    split = dict(kv="bf16", q="bf16", block_h=16, max_splits=8, tokens_per_split=512)
    made = with_budget(Variant.make("budgeted", **split), 2, 128, sm_count=100, heads=64)
    assert made == Variant.make("budgeted", **{**split, "tokens_per_split": 128, "split_budget": 200 * 1000 + 4})
    assert with_budget(Variant.make("unbudgeted", **split), 2, 128, 100, 64) is None
    assert with_budget(Variant.make("budgeted", **{**split, "max_splits": 1}), 2, 128, 100, 64) is None
    # today's: triton's budget (its own rule), none for gluon_fused though its serving form
    # takes split_budget (it has no hook: its budgets are its serving_candidates' own)
    triton = Variant.make("triton", **split, block_n=64, num_warps=8, num_stages=2, dot_dtype="bf16")
    assert with_budget(triton, 2, 128, 100, 64).get("split_budget") == triton_splitk.batch_split_budget(2, 100, 4)
    gluon = Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_h=16, max_splits=8,
                         tokens_per_split=512, num_stages=2, v_halves=1)
    assert with_budget(gluon, 2, 128, 100, 64) is None
