"""What a model's call declares beyond its cell, and every path honouring it: the softmax scale,
the optional LSE (natural log, (total_q, heads) float32, as vLLM merges it), an fp8 cache kept
as uint8 bytes (CallSpec.cache_dtype) and kv_scale as a Python float."""

import math
import sys

import numpy as np
import pytest
import torch

from mla_tune import problem, runtime
from mla_tune.backends import capabilities, get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as DSV3
from mla_tune.core import SM_SCALE, CallSpec, Shape, Variant
from mla_tune.kernels import flash_decode, fused_decode
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder, decode
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.serving.table import FamilyKey
from tests.helpers import FAKE_H200 as H200
from tests.helpers import VENDOR_MODULES, cpu_table, serving_call, vendor_fakes

STRICT = problem.RULES["strict"]


def _scaled_and_not(out: torch.Tensor, ref_scaled: torch.Tensor, ref_default: torch.Tensor, what: str) -> None:
    out = out[: ref_scaled.shape[0]].float()
    assert bool(torch.isfinite(out).all()), f"{what}: NaN or an unwritten element"
    at_scale = problem.check(out, ref_scaled, STRICT)
    assert at_scale.passed, f"{what}: against the reference at the model's scale: {at_scale.reason}"
    ignored = problem.check(out, ref_default, STRICT)
    assert not ignored.passed, f"{what}: also matches the leaderboard's scale, so the test could not see it ignored"


def test_deepseek_v3_scale_is_the_models():
    mscale = 0.1 * 1.0 * math.log(40) + 1  # YaRN: mscale_all_dim 1.0, factor 40
    assert DSV3 == pytest.approx(mscale**2 / math.sqrt(128 + 64))
    assert DSV3 == pytest.approx(0.1352, abs=5e-4)
    assert DSV3 / SM_SCALE == pytest.approx(3.24, abs=0.01)


def test_the_serving_tables_key_leaves_out_the_calls_own_facts():
    plain = CallSpec("fp8", page_size=64, heads=128, max_q_len=2, mixed_q_len=True)
    model = CallSpec("fp8", page_size=64, heads=128, max_q_len=2, mixed_q_len=True, sm_scale=DSV3,
                     return_lse=True, cache_dtype="uint8")
    assert FamilyKey.of(model) == FamilyKey.of(plain)


@pytest.mark.parametrize("kv, facts, says", [
    *[("bf16", {"sm_scale": bad}, "sm_scale must be a positive finite float")
      for bad in (0.0, -0.1, float("nan"), float("inf"), True, "0.13")],
    ("bf16", {"cache_dtype": "uint8"}, "use kv_format='fp8'"),
    ("fp8", {"cache_dtype": "int8"}, "cache_dtype must be one of")])
def test_callspec_refuses_a_scale_that_is_no_softmax_scale_and_uint8_bytes_of_anything_but_fp8(kv, facts, says):
    with pytest.raises(ValueError, match=says):
        CallSpec(kv, **facts)


def test_decode_passes_the_scale_to_its_decoders_spec():
    inp = serving.make_input([2, 1], [40, 9], 16, 0, "bf16", seed=6)
    out = decode(inp.q, inp.qo_indptr, inp.kv, kv_indptr=inp.kv_indptr, max_q_len=2, sm_scale=DSV3)
    _scaled_and_not(out, inp.reference(sm_scale=DSV3), inp.reference(), "decode")


def _leaderboard_variant(name: str, shape: Shape, kv: str) -> Variant:
    if name == "triton":
        return get_backend(name).default_variant(shape, sm_count=4, kv=kv, q="bf16")
    if name == "flashmla":
        return Variant.make("flashmla", kv=kv, q="bf16" if kv == "bf16" else "fp8_dynamic")
    space = {"kv": [kv]} if name == "flashinfer" else {"kv": [kv], "num_splits": [2], "block_n": [32]}
    # not reduce=spin (the interpreter runs programs one by one); fp16 dots (its fp8/bf16 ones differ)
    return next(v for v in get_backend(name).candidates(shape, space, H200)
                if v.get("reduce") != "spin" and v.get("qk_dot", "fp16") == "fp16"
                and v.get("pv_dot", "fp16") == "fp16")


@pytest.mark.parametrize("name,kv", [(name, kv) for name in ("triton", "triton_fused", "flashinfer")
                                     for kv in ("bf16", "fp8")] + [("flashmla", "bf16")])
def test_build_takes_the_models_scale(name, kv, monkeypatch):
    """build(..., sm_scale=) of every backend that runs on the CPU (torch's: the runtime's, below)."""
    if name in VENDOR_MODULES:
        vendor_fakes.install(monkeypatch, VENDOR_MODULES[name])
    shape = Shape(2, 128)
    data = problem.generate_input(shape.batch, shape.kv_len, seed=7, device="cpu")
    variant = _leaderboard_variant(name, shape, kv)
    out = get_backend(name).build(variant, shape, "cpu", sm_scale=DSV3)(*data[:4])
    q_format = "fp8" if variant.get("q") == "fp8_dynamic" else "bf16"
    _scaled_and_not(out, problem.reference(data, q_format, kv, sm_scale=DSV3),
                    problem.reference(data, q_format, kv), f"{name} build {kv}")


def test_fp8_static_q_composes_with_the_models_scale(monkeypatch):
    """The model's scale changes neither the calibration nor the quantized static q."""
    q_amax = 1.1 * float(serving.make_input([1, 1], [33, 90], 16, 16, "fp8", seed=8).q.abs().amax())
    out, _, inp, _ = serving_call(monkeypatch, "triton", "fp8", [1, 1], [33, 90], 8,
                                  dict(q="fp8_static", q_amax=q_amax), host=False)
    _scaled_and_not(out, inp.reference("fp8_static", q_amax, sm_scale=DSV3),
                    inp.reference("fp8_static", q_amax), "triton fp8_static")


# ------------------------------------------------------------ one compile for every scale
def _bind_keys(monkeypatch, launch, capture_module, args_list) -> list[str]:
    """Each launch's JIT cache key (specialization + options) for an sm_90 target."""
    jit = pytest.importorskip("triton.runtime.jit")
    compiler = pytest.importorskip("triton.compiler.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    if not hasattr(jit, "create_function_from_signature"):
        pytest.skip("this Triton has no create_function_from_signature")
    captured = []
    monkeypatch.setattr(capture_module, "jit_launch",
                        lambda fn, grid, record, *args, **kwargs: captured.append((fn, args, kwargs)))
    for kwargs in args_list:
        launch(**kwargs)
    target = compiler.make_backend(backends.GPUTarget("cuda", 90, 32))
    keys = []
    for fn, args, kwargs in captured:
        jf = fn if isinstance(fn, jit.JITFunction) else jit.JITFunction(fn.fn)
        binder = jit.create_function_from_signature(jf.signature, jf.params, target)
        _bound, specialization, options = binder(*args, **{**kwargs, "debug": False})
        keys.append(f"{jf.fn.__name__}:{specialization}{options}")
    return keys


@pytest.mark.parametrize("module,serve,dots", [
    (flash_decode, flash_decode.flash_decode_serving, dict(dot_dtype="fp16", sm_count=4)),
    (fused_decode, fused_decode.fused_decode_serving, dict(qk_dot="fp16", pv_dot="fp16")),
], ids=["splitk", "fused"])
def test_two_scales_bind_to_one_compiled_kernel(monkeypatch, module, serve, dots):
    inp = serving.make_input([1, 1], [5, 9], 16, 16, "bf16", seed=1)
    out = torch.empty((2, 16, 512), dtype=torch.bfloat16)
    common = dict(max_q_len=1, max_splits=2, tokens_per_split=4, block_n=16, block_h=16, num_warps=4, num_stages=1)

    def launch(**changes):  # sm_scale, and block_n where it changes
        serve(inp.q, inp.qo_indptr, inp.kv, None, out, **inp.layout, **dots, **{**common, **changes})

    keys = _bind_keys(monkeypatch, launch, module,
                      [{"sm_scale": SM_SCALE}, {"sm_scale": DSV3}, {"sm_scale": DSV3, "block_n": 32}])
    per_call = len(keys) // 3
    first, second, other = keys[:per_call], keys[per_call:2 * per_call], keys[2 * per_call:]
    assert first == second, "a new softmax scale specialized the kernel (a recompile per value)"
    assert first != other, "the key did not see a constexpr change, so it shows nothing"


def test_the_leaderboard_runtime_takes_the_scale_from_the_config(tmp_path):
    """custom_kernel passes config["sm_scale"] to the builds, its repeat path included."""
    rt = runtime.load(table=cpu_table(tmp_path), device="cpu")
    data = problem.generate_input(1, 8, seed=1, device="cpu")  # a torch row
    model = (*data[:4], {**data[4], "sm_scale": DSV3})
    ref_model, ref_board = (problem.reference(model, "bf16", "bf16", sm_scale=DSV3),
                            problem.reference(model, "bf16", "bf16"))
    for _ in range(2):  # the second call takes the repeat path
        _scaled_and_not(rt.custom_kernel(model).clone(), ref_model, ref_board, "custom_kernel at the model's scale")
    assert data[4]["sm_scale"] == SM_SCALE  # the leaderboard's config: its own scale
    out = rt.custom_kernel(data)  # same tensors, the leaderboard's config: not the model's runner
    assert problem.check(out.float(), ref_board, STRICT).passed
    assert rt.scaled(DSV3) is rt.scaled(DSV3)  # one dispatcher per scale


# ------------------------------------------------------------------ the LSE
def _assert_lse(lse: torch.Tensor, ref_lse: torch.Tensor, what: str) -> None:
    assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(ref_lse.shape), \
        f"{what}: lse {lse.dtype} {tuple(lse.shape)}, expected float32 {tuple(ref_lse.shape)}"
    err = float((lse - ref_lse).abs().max())
    # scores of bf16 operands: about 1e-2 absolute at these sizes; a base-2 LSE would be
    # off by a factor 1.44 (several units), one at the leaderboard's scale by 3x
    assert err < 5e-2, f"{what}: max |lse - reference| = {err:.4f}"


# Split-K (triton): kv_len 1 and 17 run in one split (stage 1 writes out and LSE), 300 in several
# (stage 2 merges them), all in one at max_splits 1; triton_fused splits the long sequences, so
# its reduction's LSE runs too. (backend, kv, q_len, max_splits: None for the default's)
LSE_CASES = [("triton", "bf16", 1, 4), ("triton", "fp8", 1, 4), ("triton", "bf16", 2, 4), ("triton", "fp8", 2, 4),
             ("triton", "bf16", 2, 1), ("triton_fused", "bf16", 2, 4), ("triton_fused", "fp8", 1, 4),
             ("flashmla", "bf16", 2, None), ("flashmla", "fp8", 1, None), ("flashinfer", "bf16", 2, None),
             ("flashinfer", "fp8", 1, None)]


@pytest.mark.parametrize("name,kv,q_len,max_splits", LSE_CASES,
                         ids=[f"{n}-{k}-q{q}-s{s}" for n, k, q, s in LSE_CASES])
def test_each_declared_backend_returns_the_references_lse_at_the_models_scale(name, kv, q_len, max_splits,
                                                                              monkeypatch):
    """And the serving call's answer is at the model's scale, not the leaderboard's."""
    assert capabilities(name).lse is True  # the record says who returns it
    mixed = name != "flashmla" and q_len > 1
    if name == "triton":
        q_lens, kv_lens, seed = [1, q_len, q_len], [1, 17, 300], 13
    else:
        q_lens, kv_lens, seed = [q_len, 1 if mixed else q_len, q_len], [70, 5 if mixed else 9, 130], 11
    params = dict(max_splits=max_splits, tokens_per_split=64 if name == "triton" else 32) if max_splits else None
    (out, lse), variant, inp, runner = serving_call(monkeypatch, name, kv, q_lens, kv_lens, seed, params,
                                                    host=name != "triton", mixed_q_len=mixed, return_lse=True)
    q_format = {"bf16": "bf16", "fp8_dynamic": "fp8"}[variant.get("q")]
    ref, ref_lse = inp.reference(q_format, sm_scale=DSV3, return_lse=True)
    what = f"{name} {kv} q_len {q_len} max_splits {max_splits}"
    _assert_lse(lse, ref_lse, what)
    assert float((out.float() - ref).abs().max()) < 0.05
    _scaled_and_not(out, ref, inp.reference(q_format), what)
    if name == "triton":
        counts = runner.workspace.split_count[:3].tolist()
        assert counts[:2] == [1, 1] and (counts[2] > 1) == (max_splits > 1), counts  # both branches ran
        # at the leaderboard's scale the LSE is another: the scale reaches it
        assert float((lse - inp.reference(return_lse=True)[1]).abs().max()) > 0.5
    if name == "flashmla":
        assert sys.modules["flash_mla.flash_mla_interface"].last_call["softmax_scale"] == DSV3
    if name == "flashinfer":
        run = sys.modules["flashinfer.mla"].last_run
        assert run["return_lse_base_on_e"] is True and run["sm_scale"] == DSV3


def test_a_plan_with_return_lse_returns_out_and_lse_per_layer():
    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, mixed_q_len=True, sm_scale=DSV3, return_lse=True)
    assert Decoder(spec).backend == "triton"  # the first of the preference order returns it
    inp = serving.make_input([2, 1, 2], [40, 3, 90], 16, 16, "bf16", seed=12)
    plan = _plan(spec, inp)
    ref, ref_lse = inp.reference(sm_scale=DSV3, return_lse=True)
    for _layer in range(2):  # the second layer replays what the first recorded (on a GPU)
        out, lse = plan.run(inp.q, inp.kv)
        _assert_lse(lse, ref_lse, "plan.run")
        assert float((out.float() - ref).abs().max()) < 0.05
    # both in plan.outputs: out at its start, the LSE buffer after it (256-byte aligned)
    base, out_bytes = plan.outputs.buffer.data_ptr(), plan.max_total_q * 16 * 512 * 2
    assert (out.data_ptr(), lse.data_ptr()) == (base, base + -(-out_bytes // 256) * 256)


# --------------------------------------------------------- a uint8 cache, a float kv_scale
SPEC = CallSpec("fp8", page_size=16, heads=16, max_q_len=1, sm_scale=DSV3)
BYTES = CallSpec("fp8", page_size=16, heads=16, max_q_len=1, sm_scale=DSV3, cache_dtype="uint8")


def _plan(spec: CallSpec, inp: serving.ServingInput, **kwargs) -> DecodePlan:
    plan = DecodePlan(spec, max_batch=4, **kwargs)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    return plan


def _close(out, inp):
    result = problem.check(out.float(), inp.reference(sm_scale=DSV3), STRICT)
    assert result.passed, result.reason


@pytest.mark.parametrize("backend", ["triton", "triton_fused"])
def test_a_uint8_cache_is_read_as_fp8_where_declared_and_refused_by_every_path_where_not(backend):
    """Declared (cache_dtype='uint8'): kv_scale may be a tensor, a Python float or a float
    subclass (as an engine's config may hold). Undeclared: the plan, the Decoder and the
    runners beneath, called directly, refuse it, and the right cache still runs after."""
    inp = serving.make_input([1, 1, 1], [3, 40, 77], 16, 16, "fp8", seed=21)
    plan = _plan(BYTES, inp, backend=backend)
    raw, scale = inp.kv.view(torch.uint8), float(inp.kv_scale)
    for kv_scale in (inp.kv_scale, scale, np.float64(scale)):
        for run in (plan.run, plan.run_checked):
            _close(run(inp.q, raw, kv_scale).clone(), inp)
    with pytest.raises(ValueError, match="uint8 tensor of fp8 bytes"):
        plan.run(inp.q, inp.kv, inp.kv_scale)  # the spec said bytes
    with pytest.raises(ValueError, match="positive and finite"):
        plan.run(inp.q, raw, -1.0)
    undeclared = _plan(SPEC, inp, backend=backend)
    for run in (undeclared.run, undeclared.run_checked):
        with pytest.raises(ValueError, match="cache_dtype='uint8'"):
            run(inp.q, raw, inp.kv_scale)
    decoder = Decoder(SPEC, backend=backend)
    with pytest.raises(ValueError, match="cache_dtype='uint8'"):
        decoder(inp.q, inp.qo_indptr, raw, inp.kv_scale, **inp.layout)
    with pytest.raises(ValueError, match="kv is uint8"):
        decoder.runner(inp.q, inp.qo_indptr, raw, inp.kv_scale, **inp.layout)
    _close(undeclared.run(inp.q, inp.kv, inp.kv_scale).clone(), inp)
    kept = decoder.inputs.scale(scale)
    assert kept.dtype == torch.float32 and tuple(kept.shape) == (1,)
    assert decoder.inputs.scale(scale) is kept
    _close(decoder(inp.q, inp.qo_indptr, inp.kv, scale, **inp.layout).clone(), inp)
    with pytest.raises(ValueError, match="kv must be bf16"):  # a bf16 plan refuses an fp8 cache
        _plan(CallSpec("bf16", page_size=16, heads=16), inp).run(inp.q, inp.kv, inp.kv_scale)
