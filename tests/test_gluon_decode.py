"""The Gluon decode (issue 11): its backend's parameters and guard on the CPU, the kernel
itself on the H200 (`pytest -m gpu`, Triton 3.6). Gluon has no CPU interpreter, so the
kernel's correctness is only checked there; the split reduction launch is plain Triton and
runs under the interpreter here."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import gluon_fused
from mla_tune.core import Shape, Variant
from mla_tune.kernels import gluon_decode
from tests.helpers import expected_output

BASE = dict(kv="fp8", q="fp8_dynamic", block_n=64, num_stages=3, num_splits=1, v_path="ss16")


def _variant(**params) -> Variant:
    return Variant.make("gluon_fused", **{**BASE, **params})


def test_validate_accepts_the_base_and_names_each_bad_parameter():
    gluon_fused.validate(_variant())
    gluon_fused.validate(_variant(block_n=128, num_stages=2, v_path="rs8", num_splits=4))
    for params, match in [
        (dict(block_n=32), r"block_n=32 is not allowed; allowed: 64, 128"),
        (dict(v_path="ss8t"), r"v_path=ss8t is not allowed; allowed: ss16, rs16, rs8, ss16a"),
        (dict(kv="bf16"), r"kv=bf16 is not allowed; allowed: fp8"),
        (dict(q="bf16"), r"q=bf16 is not allowed"),
        (dict(num_stages=1), r"num_stages=1 is not allowed"),
        (dict(num_splits=0), r"num_splits=0 is not allowed"),
        (dict(num_warps=4), r"unknown parameter num_warps"),
        (dict(block_n=128, num_stages=3), r"needs 293144 B of shared memory .* use fewer stages"),
        (dict(num_stages=4, v_path="ss16a"), r"needs 241952 B of shared memory"),
    ]:
        with pytest.raises(ValueError, match=match):
            gluon_fused.validate(_variant(**params))
    with pytest.raises(ValueError, match="missing parameter v_path"):
        gluon_fused.validate(Variant.make("gluon_fused", **{k: v for k, v in BASE.items() if k != "v_path"}))


def test_shared_memory_estimate_matches_the_compilers_figures():
    # ptxas/Triton 3.6 offline compiles (scripts/gluon_probe.py --decode, docs/perf.md)
    assert gluon_fused._gf_smem_bytes(64, 3) == 151832
    assert gluon_fused._gf_smem_bytes(64, 4) == 192800
    assert gluon_fused._gf_smem_bytes(128, 2) == 211216
    assert gluon_fused._gf_smem_bytes(64, 3, "ss16a") == 200984
    assert gluon_fused._gf_smem_bytes(64, 2, "ss16a") == 160016


def test_candidates_pass_validate_and_never_split_past_the_tiles():
    for shape, max_splits in [(Shape(4, 1024), 16), (Shape(1, 17), 1), (Shape(256, 8192), 32)]:
        found = gluon_fused.candidates(shape, {}, None)
        assert found and len(found) == len(set(found))
        for v in found:
            gluon_fused.validate(v)
        assert max(v.get("num_splits") for v in found) == max_splits
    wide = gluon_fused.candidates(Shape(4, 1024), {"block_n": [64, 128], "num_stages": [2, 3, 4]}, None)
    assert {(v.get("block_n"), v.get("num_stages"), v.get("v_path")) for v in wide} == {
        (64, 2, "ss16"), (64, 3, "ss16"), (64, 4, "ss16"), (128, 2, "ss16"),
        (64, 2, "rs16"), (64, 3, "rs16"), (64, 4, "rs16"), (128, 2, "rs16"),
        (64, 2, "ss16a"), (64, 3, "ss16a")}  # shared memory rules out the others
    with pytest.raises(ValueError, match=r"unknown search-space keys \['tok_m'\]"):
        gluon_fused.candidates(Shape(4, 1024), {"tok_m": [True]}, None)


def test_unavailable_reason_says_why_the_kernel_cannot_run_here():
    reason = gluon_fused.unavailable_reason()
    if gluon_decode.GD_UNAVAILABLE is not None:
        assert reason == gluon_decode.GD_UNAVAILABLE and "triton 3.6" in reason
    elif not torch.cuda.is_available():
        assert reason == "gluon_fused needs an NVIDIA sm_90 GPU (Gluon has no CPU interpreter)"
    if reason is not None:  # always here on the CPU; on the H200 the GPU tests build it
        with pytest.raises(ValueError, match=r"gluon_fused cannot run here: "):
            gluon_fused.build(_variant(), Shape(1, 64), "cpu")


def test_the_module_imports_without_gluon_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # the import raises
    path = Path(gluon_decode.__file__)
    spec = importlib.util.spec_from_file_location("gluon_decode_without_gluon", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.gluon is None
    assert module.GD_UNAVAILABLE.startswith("this Triton (")
    assert "has no usable Gluon" in module.GD_UNAVAILABLE and module.GD_UNAVAILABLE.endswith("install triton 3.6")
    with pytest.raises(RuntimeError, match="no usable Gluon"):
        module.gluon_decode(None, None, None, None, None, None, None, num_splits=1, block_n=64,
                            num_stages=3, v_path="ss16", sm_scale_log2=1.0)


def test_the_modules_pass_the_exporters_rules_beside_every_backend():
    from mla_tune.backends import BACKEND_MODULES
    from mla_tune.export_ast import module_closure, prepare_modules

    roots = [(module, name) for name, module in BACKEND_MODULES.items()]
    modules = module_closure(roots + [("mla_tune.backends.gluon_fused", "gluon_fused")])
    assert "mla_tune.kernels.gluon_decode" in [m.name for m in modules]
    hoisted = prepare_modules(modules)  # refuses a name collision or a vendor import at top level
    assert not any("gluon" in line for line in hoisted)  # the guarded import stays in its try


def test_the_split_reduction_combines_partials_by_their_lse(device):
    batch, splits = 2, 3
    gen = torch.Generator().manual_seed(3)
    part_o = torch.randn(batch, splits, 16, 512, generator=gen)
    lse = torch.randn(batch, splits, 16, generator=gen) * 4
    lse[1, 2] = float("-inf")  # an empty split
    out = torch.empty(batch, 16, 512, dtype=torch.bfloat16, device=device)
    gluon_decode.gd_reduce(part_o.to(device).flatten(), lse.to(device).flatten(), out, splits)
    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=1)  # 2^lse, normalized over splits
    ref = (w[..., None] * part_o).sum(1)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- H200
def _gpu_skip() -> str | None:
    return gluon_fused.unavailable_reason()


GPU_VARIANTS = [
    dict(block_n=64, num_stages=3, v_path="ss16"),
    dict(block_n=64, num_stages=4, v_path="rs16"),
    dict(block_n=64, num_stages=2, v_path="rs8"),
    dict(block_n=128, num_stages=2, v_path="ss16"),
    dict(block_n=64, num_stages=3, v_path="ss16a"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("params", GPU_VARIANTS, ids=lambda p: f"{p['block_n']}-{p['num_stages']}-{p['v_path']}")
@pytest.mark.parametrize("kv_len", [1, 17, 1024, 3000])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_gluon_decode_matches_the_reference_under_strict(batch, kv_len, params):
    if _gpu_skip():
        pytest.skip(_gpu_skip())
    shape = Shape(batch, kv_len)
    data = problem.generate_input(batch, kv_len, seed=batch * 31 + kv_len, device="cuda")
    tiles = -(-kv_len // params["block_n"])
    for splits in sorted({1, min(tiles, max(1, 128 // batch)), min(tiles, 3)}):
        variant = _variant(num_splits=splits, **params)
        run = gluon_fused.build(variant, shape, "cuda")
        first = run(*data[:4]).clone()
        result = problem.check(first, expected_output(data, variant), problem.RULES["strict"])
        assert result.passed, f"{variant} at {shape}: {result.reason}"
        assert torch.equal(first, run(*data[:4])), f"{variant}: a second call differs"


@pytest.mark.gpu
@pytest.mark.parametrize("v_path", ["ss16", "rs16", "rs8", "ss16a"])
def test_gluon_decode_ragged_batch_with_empty_splits(v_path):
    if _gpu_skip():
        pytest.skip(_gpu_skip())
    data = problem.generate_ragged_input([1, 17, 3000, 64, 130], seed=9, device="cuda")
    variant = _variant(num_splits=4, v_path=v_path)
    run = gluon_fused.build(variant, Shape(5, 3000), "cuda")
    result = problem.check(run(*data[:4]), expected_output(data, variant), problem.RULES["strict"])
    assert result.passed, f"{variant}: {result.reason}"
