"""The serving gate's reference for kernels that quantize q per (new token, head) row: the
fp8_row q format (quantize_fp8_rows), checked against a plain row-by-row torch quantization,
and the gate's choice of it through the backends' serving_q_reference hook."""

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import flash_mla, get_backend, gluon_fused, triton_fused, triton_splitk
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, QK_DIM, CallSpec, Variant
from mla_tune.gpu import fake_platform
from mla_tune.serving.config import GateSpec
from mla_tune.serving.gate import GateJob, gate_one, reference_q_format, variant_q_format
from mla_tune.serving.inputs import make_input, quantize_fp8_rows, reference, reference_q
from tests.helpers import register_backends, unavailable

STRICT = problem.RULES["strict"]
H200 = fake_platform("H200")
VARIANT_GATE = GateSpec((1, 17, 64, 65, 300), 77, 2, 0.5, (11, 12), reference_q="variant")
EXACT_GATE = GateSpec((1, 17, 64, 65, 300), 77, 2, 0.5, (11, 12), reference_q="exact")


def _plain_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row in plain torch, as the kernel reads it: amax = max(1e-12, max |row|) in
    fp32, scale = amax / 448, e4m3fn of row / scale saturated at 448."""
    flat = q.reshape(-1, q.shape[-1]).to(torch.float32)
    q8 = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((flat.shape[0], 1), dtype=torch.float32)
    floor, fp8_max = torch.tensor(1e-12, dtype=torch.float32), torch.tensor(448.0, dtype=torch.float32)
    for i, row in enumerate(flat):
        scale = torch.maximum(row.abs().max(), floor) / fp8_max
        q8[i] = torch.clamp(row / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
        scales[i] = scale
    return q8.reshape(q.shape), scales.reshape(*q.shape[:-1], 1)


@pytest.mark.parametrize("tokens,heads", [(1, 16), (1, 128), (3, 128), (7, 16)])
def test_row_quantization_is_the_plain_per_row_one_bit_for_bit(tokens, heads):
    gen = torch.Generator().manual_seed(tokens * 1000 + heads)
    q = torch.randn((tokens, heads, QK_DIM), generator=gen).to(torch.bfloat16)
    q[0, heads // 2] = 0  # an all-zero row
    q[-1, 1] *= 3000.0  # a large row beside normal ones
    q[-1, 0] *= 1e-16  # a row below the amax floor
    q8, scale = quantize_fp8_rows(q)
    want8, want_scale = _plain_rows(q)
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8))  # e4m3fn: 1 byte, the same bits
    assert torch.equal(scale, want_scale)  # (tokens, heads, 1); the zero row's is 1e-12 / 448
    qf = reference_q(q, "fp8_row")
    assert torch.equal(qf, want8.float() * want_scale)
    # every row is its own: the large row moves no other row's q (per tensor, it does)
    assert torch.equal(reference_q(q[:, 2:], "fp8_row"), qf[:, 2:])
    assert not torch.equal(reference_q(q[:, 2:], "fp8"), reference_q(q, "fp8")[:, 2:])


def test_the_per_row_reference_reads_the_row_quantized_q_and_differs_from_the_per_tensor_one():
    """The per-row reference is the reference on the plainly row-quantized q. One large row: a
    per-row kernel (the per-row reference in bf16) passes against the per-row reference,
    fails by more than the strict rule against the per-tensor one, and is nearer bf16 q."""
    inp = make_input([1, 2, 1, 2], [1, 17, 65, 300], 16, 64, "fp8", seed=9)
    inp.q[1, 5] *= 64.0
    exact, by_row, by_tensor = (inp.reference(f, sm_scale=CORE_DEEPSEEK_V3_SCALE) for f in ("bf16", "fp8_row", "fp8"))
    want8, want_scale = _plain_rows(inp.q)
    assert torch.equal(by_row, reference(want8.float() * want_scale, inp.qo_indptr, inp.kv, inp.kv_scale,
                                         **inp.layout, sm_scale=CORE_DEEPSEEK_V3_SCALE))
    with pytest.raises(ValueError, match="fp8_row"):
        inp.reference("fp8_rows")
    kernel = by_row.to(torch.bfloat16)
    assert problem.check(kernel, by_row, STRICT, margin=0.5).passed
    against_tensor = problem.check(kernel, by_tensor, STRICT)
    assert not against_tensor.passed and against_tensor.mismatch > 2 * STRICT.allowance
    assert float((by_row - exact).abs().mean()) < float((by_tensor - exact).abs().mean())


HOOK_NAME = "qref_probe"
# A serving backend whose call is the per-row-q reference in bf16; its hook answers `ref`.
HOOK_BODY = '''
import torch
from mla_tune.serving.inputs import reference

def serving_q_reference(variant):
    return variant.get("ref")

def build_serving(variant, spec, device):
    def run(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None, seq_lens=None,
            q_lens_host=None, kv_lens_host=None):
        out = reference(q, qo_indptr, kv, kv_scale, kv_indptr=kv_indptr, block_table=block_table,
                        seq_lens=seq_lens, q_format="fp8_row", sm_scale=spec.sm_scale)
        return out.to(torch.bfloat16)
    return run
'''


def test_the_gate_reads_q_as_each_backend_or_its_hook_quantizes_it_and_judges_by_it(tmp_path, monkeypatch):
    g8, g16 = (gluon_fused.default_serving_variant(CallSpec(kv, 64, 16, 2, mixed_q_len=True), H200)
               for kv in ("fp8", "bf16"))
    assert reference_q_format(g8, VARIANT_GATE) == "fp8_row"
    assert reference_q_format(g16, VARIANT_GATE) == "bf16"
    assert reference_q_format(g8, EXACT_GATE) == "bf16"  # exact: the q quantization counts
    t8 = [v for v in triton_splitk.serving_candidates(CallSpec("fp8", 64, 16, 1), {"q": ["fp8_dynamic"]}, H200)
          if v.get("q") == "fp8_dynamic"]
    assert t8 and {reference_q_format(v, VARIANT_GATE) for v in t8} == {"fp8"}
    f8 = [v for v in triton_fused.serving_candidates(CallSpec("fp8", 64, 16, 2, mixed_q_len=True),
                                                     {"q": ["fp8_dynamic"], "qk_dot": ["fp8"]}, H200)
          if v.get("q") == "fp8_dynamic"]  # fused_decode.py quantizes q per (new token, head) row
    assert f8 and {reference_q_format(v, VARIANT_GATE) for v in f8} == {"fp8_row"}
    for q in ("fp8_dynamic", "fp8_static"):
        assert reference_q_format(Variant.make(flash_mla.NAME, kv="fp8", q=q), VARIANT_GATE) == "fp8"
    assert reference_q_format(Variant.make(flash_mla.NAME, kv="bf16", q="bf16"), VARIANT_GATE) == "bf16"
    # the engine loop's check reads q as the pick quantizes it, whatever the gate's setting
    fm8 = Variant.make(flash_mla.NAME, kv="fp8", q="fp8_dynamic")
    assert [variant_q_format(v) for v in (g8, g16, f8[0], t8[0], fm8)] == ["fp8_row", "bf16", "fp8_row", "fp8", "fp8"]
    register_backends(tmp_path, monkeypatch, {HOOK_NAME: HOOK_BODY})  # a backend with a hook

    def probe(ref: str, q: str = "fp8_dynamic") -> Variant:
        return Variant.make(HOOK_NAME, kv="fp8", q=q, ref=ref)

    for ref in ("fp8_row", "fp8", "bf16"):
        assert reference_q_format(probe(ref), VARIANT_GATE) == ref
    assert reference_q_format(probe("fp8_row", q="bf16"), VARIANT_GATE) == "bf16"  # bf16 q: no hook
    with pytest.raises(ValueError, match=r"qref_probe.*serving_q_reference.*'fp8_static'.*bf16, fp8, fp8_row"):
        reference_q_format(probe("fp8_static"), VARIANT_GATE)
    # The gate at DeepSeek-V3's scale: passes against the hook's per-row reference, not per tensor.
    spec = CallSpec("fp8", 64, 16, 2, mixed_q_len=True, sm_scale=CORE_DEEPSEEK_V3_SCALE)
    passed = gate_one(GateJob(spec, str(probe("fp8_row")), VARIANT_GATE, STRICT, "cpu"))
    assert passed["ok"], passed
    failed = gate_one(GateJob(spec, str(probe("fp8")), VARIANT_GATE, STRICT, "cpu"))
    assert not failed["ok"] and failed["reason"].startswith("ragged probe"), failed


# ------------------------------------------------------------------ on the H200
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gluon_fused", "triton_fused"])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 2), (128, 4)])
def test_the_fused_kernels_pass_the_gate_against_the_per_row_reference(backend, heads, q_len):
    """The fused kernels' fp8-q serving variants (gluon_fused's default; triton_fused's default
    with q=fp8_dynamic, its fp8 S dot and an fp16 P V dot) at DeepSeek-V3's scale pass the gate of
    configs/serving.yaml (fp8_row) and, on a ragged call, the strict rule per row."""
    from mla_tune.serving.config import load_serving_config

    module = get_backend(backend)  # gluon_fused's reason covers its serving kernel's (GS_UNAVAILABLE)
    if reason := module.unavailable_reason():
        unavailable(reason)
    cfg = load_serving_config("configs/serving.yaml")
    assert cfg.gate.reference_q == "variant"
    spec = CallSpec("fp8", 64, heads, q_len, mixed_q_len=True, graph=True, sm_scale=CORE_DEEPSEEK_V3_SCALE)
    variant = module.default_serving_variant(spec, H200)
    if backend == "triton_fused":
        variant = variant.with_params(q="fp8_dynamic", qk_dot="fp8", pv_dot="fp16")
    assert reference_q_format(variant, cfg.gate) == "fp8_row"
    gated = gate_one(GateJob(spec, str(variant), cfg.gate, cfg.rule, "cuda"))
    assert gated["ok"], gated
    kv_lens = [1, 17, 3000, 64, 65, 129, 2, 4133]
    inp = make_input([min(q_len, n) for n in kv_lens], kv_lens, heads, 64, "fp8", seed=77, device="cuda")
    refs = {f: inp.reference(f, sm_scale=spec.sm_scale) for f in ("fp8_row", "fp8", "bf16")}
    # triton_fused with fp8 P as well: nearer the per-row reference, off it by P's own rounding
    others = [variant.with_params(pv_dot="fp8")] if backend == "triton_fused" else []
    for v in [variant, *others]:
        out = module.build_serving(v, spec, "cuda")(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
        torch.cuda.synchronize()
        checks = {f: problem.check(out, ref, STRICT, margin=cfg.gate.margin) for f, ref in refs.items()}
        gate = f"; gate {gated['checks']}" if v is variant else ""
        print(f"{v}: share off strict against q as fp8_row / fp8 per tensor / bf16: "
              + " / ".join(f"{c.mismatch:.2%}" for c in checks.values()) + gate)
        assert checks["fp8_row"].mismatch < checks["fp8"].mismatch / 4, checks
        assert checks["fp8_row"].passed or v is not variant, checks  # the gated variant: strict per row
