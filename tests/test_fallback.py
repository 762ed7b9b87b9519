"""The fallback honours the table's correctness rule at short lengths (kv_len 1, 2, 17, 63),
in the runtime and in the exported file, from one policy (mla_tune.tables.dispatch); the split
count comes from the device, not a literal."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from mla_tune import core, runtime
from mla_tune.backends import triton_splitk
from mla_tune.core import Shape, Variant
from mla_tune.export import export_submission
from mla_tune.problem import RULES, check, generate_input, reference
from mla_tune.tables.dispatch import DISPATCH_FALLBACKS, dispatch_fallback
from tests.helpers import cpu_table, exported_outputs

ROOT = Path(__file__).resolve().parents[1]
STRICT = RULES["strict"]
SHORT = (1, 2, 17, 63)


def _strict_table(tmp_path) -> Path:
    return cpu_table(tmp_path, "strict.yaml", edit=lambda data: data["provenance"].update(rule=STRICT.as_dict()))


def test_the_policy_per_rule_and_backend_and_why_strict_needs_its_own():
    strict = dispatch_fallback("triton", "strict", triton_splitk.default_variant)(Shape(2, 17))
    assert (strict.get("kv"), strict.get("q")) == ("fp8", "fp8_dynamic")
    loose = dispatch_fallback("triton", "leaderboard", triton_splitk.default_variant)(Shape(2, 17))
    assert (loose.get("kv"), loose.get("q")) == ("fp8", "bf16")
    # which would fail strict: bf16 q reads the scores the reference computes from fp8 q, and
    # 17 tokens do not average that away (the H200 measured 12.9% of elements off at 2 x 17)
    data = generate_input(2, 17, seed=117, device="cpu")
    out = triton_splitk.build(loose, Shape(2, 17), "cpu")(*data[:4])
    result = check(out, reference(data), STRICT)
    assert not result.passed and result.mismatch > 0.05
    assert check(out, reference(data), RULES["leaderboard"]).passed
    # a rule the policy does not know is served as the tightest it knows
    assert dispatch_fallback("triton", "custom", triton_splitk.default_variant)(Shape(2, 17)) == strict
    torch_strict = dispatch_fallback("torch", "strict")
    assert torch_strict(Shape(2, 512)) == Variant.make("torch", kv="bf16", q="bf16")
    with pytest.raises(ValueError, match=r"no fallback passes the strict rule at 2x17: the torch fallback "
                                         r"\(q bf16, KV bf16\) passes from kv_len 512 on; make the triton"):
        torch_strict(Shape(2, 17))
    assert dispatch_fallback("torch", "leaderboard")(Shape(2, 1)).get("kv") == "bf16"
    assert set(DISPATCH_FALLBACKS) == {"triton", "torch"}


@pytest.mark.parametrize("kv_len", SHORT)
def test_the_strict_fallback_passes_strict_at_short_lengths(kv_len):
    """Against the gate's reference (fp8 q x fp8 KV, the leaderboard's), under strict."""
    variant = dispatch_fallback("triton", "strict", triton_splitk.default_variant)(Shape(2, kv_len))
    runner = triton_splitk.build(variant, Shape(2, kv_len), "cpu")
    for seed in (1, 2):
        data = generate_input(2, kv_len, seed=100 * seed + kv_len, device="cpu")
        result = check(runner(*data[:4]), reference(data), STRICT)
        assert result.passed, f"{variant} at 2x{kv_len}, seed {seed}: {result.reason}"


def test_a_strict_runtime_and_its_export_fall_back_to_what_passes_strict(tmp_path):
    table = _strict_table(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt = runtime.load(table=table, device="cpu")
    assert rt.dispatcher.variant_for(2, 17).get("q") == "fp8_dynamic"
    data = generate_input(2, 17, seed=5, device="cpu")
    with pytest.warns(UserWarning, match="a shape the table lacks"):
        out = rt.custom_kernel(data)
    assert check(out, reference(data), STRICT).passed
    # the export of the same table: its fallback passes strict at the short lengths
    path = export_submission(table, tmp_path / "strict_sub.py")
    text = path.read_text()
    assert "_export_fallback = dispatch_fallback('triton', 'strict', _default_variant_triton)" in text
    cases = [generate_input(2, kv_len, seed=30 + kv_len, device="cpu") for kv_len in SHORT]
    outs, misses = exported_outputs(tmp_path, "strict_sub", cases)
    for out, case in zip(outs, cases, strict=True):
        result = check(out, reference(case), STRICT)
        assert result.passed, f"2x{case[0].shape[0]}: {result.reason}"
    assert misses == [[2, 1], [2, 2], [2, 17], [2, 63]]


def test_the_sm_count_is_asked_of_the_device_once(monkeypatch):
    assert core.device_sm_count() == 0 and core.device_sm_count("cpu") == 0  # no GPU here
    asked = []

    class Props:
        multi_processor_count = 77

    def props(index):
        asked.append(index)
        return Props()

    core._core_sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    try:
        assert core.device_sm_count() == 77 and core.device_sm_count("cuda:0") == 77
        assert core.device_sm_count(1) == 77
        assert asked == [0, 1]  # cached per device
        # the default variant sizes its splits from it: 77 SMs / batch 4 -> 32 splits at 8192
        assert triton_splitk.default_variant(Shape(4, 8192)).get("num_splits") == 32
        assert triton_splitk.default_variant(Shape(64, 8192)).get("num_splits") == 2
    finally:
        core._core_sm_count.cache_clear()


def test_no_module_hard_codes_an_sm_count():
    """An H200's 132 SMs are stated once, in gpu.KNOWN_GPUS (the GPUs a sweep can be planned
    for); every other module, backends and kernels included, asks the device or a Platform."""
    for path in sorted((ROOT / "mla_tune").rglob("*.py")):
        name = path.relative_to(ROOT / "mla_tune").as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b132\b", line):
                in_table = name == "gpu.py" and re.match(
                    r'\s+"[A-Z0-9]+": GpuFacts\("[^"]+", "\w+", (True|False), \d+, \d+, \d+, [^()]*\),$', line)
                assert in_table, f"mla_tune/{name} line {lineno} names 132 SMs: {line.strip()}"
