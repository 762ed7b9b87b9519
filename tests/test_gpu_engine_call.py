"""The engine's call on the H200 at DeepSeek-V3's scale through FlashMLA, FlashInfer and the own
kernels: output (strict; relative L2 5e-2 for FlashMLA's fp8 kernel, which rounds P to fp8) and
LSE against the fp32 reference; a uint8 fp8 cache through a plan. The output without the LSE is
checked at this scale by test_serving_correctness.py's GPU matrix."""

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import capabilities, get_backend, platform_refusal
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec, Shape
from mla_tune.gpu import detect
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder
from mla_tune.serving.decode_plan import DecodePlan
from tests.helpers import row_quantized_q, unavailable

pytestmark = pytest.mark.gpu
DSV3 = CORE_DEEPSEEK_V3_SCALE
KV_LENS = [1, 17, 64, 65, 300, 3000]


def _decoder(name: str, spec: CallSpec) -> Decoder:
    """The backend's Decoder for spec on this GPU: a declared non-case (capabilities, platforms)
    skips; a backend that cannot run here goes through `unavailable` (a failure in require
    mode); any other refusal of the Decoder fails the test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        declared = capabilities(name).refusal(spec) or platform_refusal(name, detect())
        reason = get_backend(name).unavailable_reason()
    except ImportError as exc:
        unavailable(f"{name}: its module cannot be imported ({exc})")
    if declared is not None:
        pytest.skip(f"{name} declares it does not serve this spec here: {declared}")
    if reason is not None:
        unavailable(f"{name}: {reason}")
    return Decoder(spec, backend=name, device="cuda")


CASES = [(n, kv, 1) for n in ("triton", "triton_fused", "flashmla", "flashinfer") for kv in ("bf16", "fp8")]
CASES += [("triton", kv, 2) for kv in ("bf16", "fp8")]


@pytest.mark.parametrize("name,kv,q_len", CASES, ids=[f"{n}-{k}-q{q}" for n, k, q in CASES])
def test_deepseek_scale_and_lse_through_each_backend(name, kv, q_len):
    """q_len 2: split-K with 64-token splits, its LSE from one split (stage 1) and from several
    (stage 2's merge)."""
    spec = CallSpec(kv, page_size=64, heads=128, max_q_len=q_len, mixed_q_len=q_len > 1, sm_scale=DSV3,
                    return_lse=True, host_lengths=name == "flashinfer")
    if not capabilities(name).lse:
        pytest.skip(f"{name} declares no LSE")
    decoder = _decoder(name, spec)
    if q_len > 1:
        decoder = Decoder(spec, variant=decoder.variant.with_params(tokens_per_split=64), device="cuda")
    q_lens = [1, 2, 2, 1, 2, 2] if q_len > 1 else [1] * len(KV_LENS)
    inp = serving.make_input(q_lens, KV_LENS, 128, 64, kv, seed=5, device="cuda")
    out, got_lse = decoder(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout,
                           q_lens_host=inp.q_lens, kv_lens_host=inp.kv_lens)
    torch.cuda.synchronize()
    q_format = {"bf16": "bf16", "fp8_dynamic": "fp8", "fp8_static": "fp8_static"}[decoder.variant.get("q")]
    ref, ref_lse = inp.reference(q_format, decoder.variant.get("q_amax"), sm_scale=DSV3, return_lse=True)
    loose = name == "flashmla" and kv == "fp8"
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < (5e-2 if loose else 1e-2), f"relative L2 error {err:.4f}"
    if not loose:
        assert problem.check(out.float(), ref, problem.RULES["strict"]).passed
    assert problem.check(out.float(), inp.reference(q_format, decoder.variant.get("q_amax")),
                         problem.RULES["strict"]).passed is False, "the answer ignores the scale"
    assert tuple(got_lse.shape) == (inp.q.shape[0], 128) and got_lse.dtype == torch.float32
    assert float((got_lse - ref_lse).abs().max()) < 5e-2


@pytest.mark.parametrize("backend", ["triton", "triton_fused", "flashmla"])
def test_a_uint8_cache_through_a_plan(backend):
    spec = CallSpec("fp8", page_size=64, heads=128, max_q_len=1, sm_scale=DSV3, cache_dtype="uint8")
    _decoder(backend, spec)
    plan = DecodePlan(spec, max_batch=8, backend=backend, device="cuda")
    inp = serving.make_input([1] * len(KV_LENS), KV_LENS, 128, 64, "fp8", seed=6, device="cuda")
    picked = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    for _ in range(2):  # the second call replays what the first recorded (own kernels)
        out = plan.run(inp.q, inp.kv.view(torch.uint8), float(inp.kv_scale))
    torch.cuda.synchronize()
    q_format = "fp8" if picked.get("q") == "fp8_dynamic" else "bf16"
    ref = inp.reference(q_format, sm_scale=DSV3)
    assert float((out.float() - ref).norm() / ref.norm()) < 5e-2


def test_gluon_fused_build_takes_the_scale():
    gluon = get_backend("gluon_fused")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if gluon.unavailable_reason() is not None:
        unavailable(f"gluon_fused: {gluon.unavailable_reason()}")
    shape = Shape(4, 1024)
    variant = gluon.candidates(shape, {}, detect())[0]
    data = problem.generate_input(shape.batch, shape.kv_len, seed=9, device="cuda")
    out = gluon.build(variant, shape, "cuda", sm_scale=DSV3)(*data[:4])
    torch.cuda.synchronize()
    # q quantized as the kernel does, per (sequence, head): per tensor fails strict at this scale
    rowwise = (row_quantized_q(data[0]), *data[1:])  # fp32 q: reference("bf16", ...) takes it as is
    ref = problem.reference(rowwise, "bf16", "fp8", sm_scale=DSV3)
    assert problem.check(out, ref, problem.RULES["strict"]).passed
    assert not problem.check(out, problem.reference(rowwise, "bf16", "fp8"), problem.RULES["strict"]).passed
