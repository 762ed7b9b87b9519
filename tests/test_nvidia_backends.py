"""The FlashInfer and FlashMLA backends: on the CPU through tests/fakes, on the H200 (`-m gpu`)
with the real libraries."""

import inspect
import sys

import pytest
import torch

from mla_tune import gpu, problem
from mla_tune.backends import flash_mla, flashinfer_mla
from mla_tune.core import Shape, Variant
from tests.helpers import expected_output, vendor_fakes

SHAPE = Shape(3, 128)  # two 64-token FlashMLA pages per sequence
STRICT = problem.RULES["strict"]
CALIBRATION_SEEDS = range(11, 19)  # as in configs/*.yaml
H200, MI355X, A100 = (gpu.fake_platform(name) for name in ("H200", "MI355X", "A100"))
VARIANTS = [
    *(Variant.make("flashinfer", kernel=k, kv=kv, q="bf16") for k in ("fa3", "fa2") for kv in ("bf16", "fp8")),
    *(Variant.make("flashmla", kv=kv, q=q)
      for kv, q in (("bf16", "bf16"), ("fp8", "fp8_dynamic"), ("fp8", "fp8_static")))]
_BACKENDS = {"flashinfer": flashinfer_mla, "flashmla": flash_mla}


@pytest.fixture
def fakes(monkeypatch):
    return vendor_fakes.install(monkeypatch, "flashinfer", "flash_mla")


@pytest.fixture
def data():
    return problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=5, device="cpu")


def _names(fn):
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _static(variant, shape=SHAPE, device="cpu"):
    """fp8_static variants get q_amax from a calibration input, as the sweep does."""
    if variant.get("q") != "fp8_static":
        return variant
    amax = max(float(problem.generate_input(shape.batch, shape.kv_len, seed=s, device=device)[0].abs().amax())
               for s in CALIBRATION_SEEDS)
    return variant.with_params(q_amax=amax)


# ----------------------------------------------------------- FlashInfer and FlashMLA
def test_the_fakes_have_flashinfer_0_6_18s_and_flash_mla_1_0_0s_signatures_and_count_as_available(
        fakes, monkeypatch):
    """Where the import fails, the unavailable reasons name the missing library."""
    wrapper = fakes["flashinfer"].mla.BatchMLAPagedAttentionWrapper
    empty = inspect.Parameter.empty
    pk, kw = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"
    assert [n for n, _, _ in _names(wrapper.plan)] == [
        "self", "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
        "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type", "use_profiler"]
    assert _names(wrapper.run)[-4:] == [("o_scale", pk, None), ("ckv_scale", kw, None),
                                        ("ckv_scale_arr", kw, None), ("kpe_scale", kw, None)]
    assert _names(wrapper.__init__)[1:3] == [("float_workspace_buffer", pk, empty), ("use_cuda_graph", pk, False)]
    assert fakes["flashinfer"].__version__ == "0.6.18.post1"
    fm = fakes["flash_mla"]
    names = [n for n, _, _ in _names(fm.flash_mla_with_kvcache)]
    assert names[:6] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata"]
    assert names[-5:] == ["enable_batch_invariant", "use_legacy", "kv_format", "descale_q", "descale_k"]
    assert [n for n, _, _ in _names(fm.get_mla_decoding_metadata)] == [
        "seqlens_k", "num_q_tokens_per_head_k", "h_k", "h_q", "is_fp8_kvcache", "topk", "use_legacy"]
    assert fm.__version__ == "1.0.0" and fm.has_legacy()
    assert flashinfer_mla.unavailable_reason() is None and flash_mla.unavailable_reason() is None
    for module in ("flashinfer", "flash_mla"):
        monkeypatch.setitem(sys.modules, module, None)  # makes the import raise ImportError
    assert flashinfer_mla.unavailable_reason().startswith("FlashInfer cannot be imported")
    assert flash_mla.unavailable_reason().startswith("FlashMLA cannot be imported")


def test_candidates_follow_the_platform_and_build_refuses_what_the_library_cannot_run(fakes, data):
    """FlashInfer's fa3 and fp8 KV need SM90 and a runner refuses another shape; FlashMLA needs
    SM90, whole 64-token pages and a q_amax for fp8_static."""
    space = {"backend": ["fa3", "fa2"], "kv": ["bf16", "fp8"]}
    assert [str(v) for v in flashinfer_mla.candidates(SHAPE, space, H200)] == [
        "flashinfer(kernel=fa3,kv=bf16,q=bf16)", "flashinfer(kernel=fa3,kv=fp8,q=bf16)",
        "flashinfer(kernel=fa2,kv=bf16,q=bf16)", "flashinfer(kernel=fa2,kv=fp8,q=bf16)"]
    assert flashinfer_mla.candidates(SHAPE, space, MI355X) == []
    assert flashinfer_mla.candidates(SHAPE, space, A100) == [
        Variant.make("flashinfer", kernel="fa2", kv="bf16", q="bf16")]  # fa3 and fp8 KV need SM90
    with pytest.raises(ValueError, match="backend must be a list of fa3, fa2"):
        flashinfer_mla.candidates(SHAPE, {"backend": ["cutlass"]}, H200)
    runner = flashinfer_mla.build(Variant.make("flashinfer", kernel="fa2", kv="bf16", q="bf16"), Shape(2, 128), "cpu")
    with pytest.raises(ValueError, match="planned for 2x128"):
        runner(*data[:4])
    space = {"kv": ["bf16", "fp8"], "q": ["bf16", "fp8_dynamic", "fp8_static"]}
    assert [str(v) for v in flash_mla.candidates(Shape(4, 1024), space, H200)] == [
        "flashmla(kv=bf16,q=bf16)", "flashmla(kv=fp8,q=fp8_dynamic)", "flashmla(kv=fp8,q=fp8_static)"]
    for shape, platform in ((Shape(4, 1000), H200), (Shape(4, 1024), MI355X), (Shape(4, 1024), A100)):
        assert flash_mla.candidates(shape, space, platform) == [], (shape, platform.name)
    with pytest.raises(ValueError, match="kv_len 96 is not a multiple of 64"):
        flash_mla.build(Variant.make("flashmla", kv="bf16", q="bf16"), Shape(2, 96), "cpu")
    with pytest.raises(ValueError, match="q_amax"):
        flash_mla.build(Variant.make("flashmla", kv="fp8", q="fp8_static"), SHAPE, "cpu")
    with pytest.raises(ValueError, match="bf16 q with bf16 KV, or fp8 q"):
        flash_mla.build(Variant.make("flashmla", kv="fp8", q="bf16"), SHAPE, "cpu")


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_each_vendor_plans_once_in_build_runs_into_its_buffer_and_matches_the_reference(fakes, data, variant):
    """FlashInfer plans and FlashMLA schedules once, in build; each call runs the kernel alone,
    into the runner's bf16 output buffer (FlashInfer's on views of the cache, no copy)."""
    flashinfer = variant.backend == "flashinfer"
    calls = fakes["flashinfer"].mla.calls if flashinfer else fakes["flash_mla"].calls
    variant = _static(variant)
    runner = _BACKENDS[variant.backend].build(variant, SHAPE, "cpu")
    assert calls["plan" if flashinfer else "get_mla_decoding_metadata"] == 1
    first = runner(*data[:4]).clone()
    out = runner(*data[:4])
    assert calls == ({"init": 1, "plan": 1, "run": 2} if flashinfer
                     else {"get_mla_decoding_metadata": 1, "flash_mla_with_kvcache": 2})
    assert torch.equal(first, out) and out.dtype == torch.bfloat16
    result = problem.check(out, expected_output(data, variant), STRICT)
    assert result.passed, result.reason
    if flashinfer:
        last, kv = fakes["flashinfer"].mla.last_run, data[1][variant.get("kv")]
        assert out.data_ptr() == last["out_ptr"]
        assert last["ckv_stride"] == (576, 576, 1)  # a view of the (total_kv, 1, 576) cache
        assert last["ckv_ptr"] == (kv if variant.get("kv") == "bf16" else kv[0]).data_ptr()
        if variant.get("kv") == "bf16":
            assert last["q_nope_stride"] == (16 * 576, 576, 1)


def test_the_fakes_reject_what_flashinfer_and_flash_mla_reject(fakes, data):
    wrapper = fakes["flashinfer"].mla.BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.uint8), backend="fa3")
    i32 = torch.int32
    plan = dict(qo_indptr=torch.arange(4, dtype=i32), kv_indptr=torch.arange(4, dtype=i32) * 128,
                kv_indices=torch.arange(384, dtype=i32), kv_len_arr=torch.full((3,), 128, dtype=i32),
                num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=False, sm_scale=0.04,
                q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="only supports q_data_type=torch.bfloat16"):
        wrapper.plan(**{**plan, "q_data_type": torch.float8_e4m3fn})
    with pytest.raises(ValueError, match="must be int32"):
        wrapper.plan(**{**plan, "kv_indices": torch.arange(384)})
    wrapper.plan(**plan)
    q, kv8 = data[0], data[1]["fp8"][0]
    views = (q[:, :, :512], q[:, :, 512:], kv8[:, :, :512], kv8[:, :, 512:])
    with pytest.raises(ValueError, match="kpe_scale is required"):
        wrapper.run(*views, ckv_scale=1.0)
    with pytest.raises(TypeError):  # the scales are keyword-only
        wrapper.run(*views, None, None, False, None, None, None, False, None, 1.0)
    wrapper.run(*views, ckv_scale=1.0, kpe_scale=1.0)
    fm = fakes["flash_mla"]
    q, kv = data[0].view(3, 1, 16, 576), data[1]["bf16"]
    seqlens = torch.full((3,), 128, dtype=torch.int32)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    sched = fm.get_mla_metadata()[0]

    def call(cache, block_table=table, **kwargs):
        return fm.flash_mla_with_kvcache(q, cache, block_table, seqlens, 512, sched, **kwargs)

    with pytest.raises(RuntimeError, match="page_block_size must be 64"):
        call(kv.view(12, 32, 1, 576), use_legacy=True)
    with pytest.raises(RuntimeError, match="block_table must have dtype torch.int32"):
        call(kv.view(6, 64, 1, 576), table.long(), use_legacy=True)
    kv8, scale = data[1]["fp8"]
    with pytest.raises(RuntimeError, match="same dtype"):  # no bf16 q x fp8 KV kernel
        call(kv8.view(6, 64, 1, 576), is_fp8_kvcache=True, use_legacy=True, descale_q=scale, descale_k=scale)
    with pytest.raises(AssertionError, match="use_legacy=True"):
        call(kv.view(6, 64, 1, 576))
    out, _ = call(kv.view(6, 64, 1, 576), use_legacy=True)
    assert out.shape == (3, 1, 16, 512)


# ------------------------------------------------------------- the real thing
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [Shape(b, n) for b in (4, 32) for n in (1024, 8192)], ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_real_library_passes_the_strict_rule_on_the_h200(variant, shape):
    """strict (rtol = atol = 0.01) is tighter than the leaderboard's rule (0.1) at the same
    allowance: passing it passes both."""
    backend = _BACKENDS[variant.backend]
    assert backend.unavailable_reason() is None, backend.unavailable_reason()
    assert variant in backend.candidates(shape, {}, gpu.detect())  # offered here, by default
    runner = backend.build(_static(variant, shape=shape, device="cuda"), shape, "cuda")
    for seed in (1001, 2002):
        data = problem.generate_input(shape.batch, shape.kv_len, seed=seed, device="cuda")
        out = runner(*data[:4])
        torch.cuda.synchronize()
        result = problem.check(out, problem.reference(data), STRICT)  # the leaderboard's reference
        assert result.passed, f"{variant} at {shape}, seed {seed}: {result.reason}"

