"""The Gluon serving kernel's launches (on meta tensors, compiled in a child process) compile
for sm_90 without a GPU, without spills, within an H200 block's shared memory. Under Triton
3.6: `/work/venv36/bin/python -m pytest -q tests/test_gluon_serving_compile.py`."""

from __future__ import annotations

import pytest
import torch
import triton

from mla_tune.backends import gluon_fused, gluon_fused_schedule
from mla_tune.core import QK_DIM, V_DIM, CallSpec, Variant
from mla_tune.kernels import gluon_serving
from mla_tune.xcompile.resources import SMEM_PER_SM
from tests.helpers import run_outside_the_interpreter

pytestmark = pytest.mark.skipif(gluon_serving.gluon is None,
                                reason=f"no Gluon in this Triton: {gluon_serving.GS_UNAVAILABLE}")

META = torch.device("meta")
H200_BLOCK_SMEM = 232448  # 227 KB: what one sm_90 block may allocate

# (spec, variant): two binaries, to keep CI short; tests/test_gluon_serving_gpu.py runs the rest.
CASES = [
    (CallSpec("fp8", 64, 128, max_q_len=2, mixed_q_len=True, graph=True, return_lse=True),
     "gluon_fused(block_h=16,kv=fp8,max_splits=8,num_stages=2,q=fp8_dynamic,split_budget=40,tokens_per_split=512,"
     "v_halves=1)"),
    (CallSpec("bf16", 128, 64, max_q_len=4, mixed_q_len=True, return_lse=True),
     "gluon_fused(block_h=8,kv=bf16,max_splits=4,num_stages=2,q=bf16,tokens_per_split=256,v_halves=2)"),
]
IDS = ["fp8-page64-h128-q2-lse", "bf16-page128-h64-q4-lse-halves"]


def compile_cases() -> list[dict]:
    """Each case's launches at batch 3 on meta tensors, compiled for sm_90: their records."""
    from mla_tune.xcompile import capture, check, targets

    facts, batch = check.facts_for("H200"), 3
    results = []
    for spec, text in CASES:
        total_q = batch * spec.max_q_len
        dtype = torch.bfloat16 if spec.kv_format == "bf16" else torch.float8_e4m3fn
        q = torch.empty((total_q, spec.heads, QK_DIM), dtype=torch.bfloat16, device=META)
        qo_indptr = torch.empty(batch + 1, dtype=torch.int32, device=META)
        scale = torch.empty(1, dtype=torch.float32, device=META) if spec.kv_format == "fp8" else None
        kv = torch.empty((40, spec.page_size, QK_DIM), dtype=dtype, device=META)
        layout = dict(block_table=torch.empty((batch, 12), dtype=torch.int32, device=META),
                      seq_lens=torch.empty(batch, dtype=torch.int32, device=META))
        with capture.recording(facts) as launches:
            result = gluon_fused.build_serving(Variant.parse(text), spec, META)(q, qo_indptr, kv, scale, **layout)
        out = result[0] if spec.return_lse else result
        assert tuple(out.shape) == (total_q, spec.heads, V_DIM)
        records = []
        for x in launches:
            record = targets.compile_bound(targets.bind(x.kernel, x.grid, x.args, x.kwargs, targets.target_for(facts)),
                                           facts.lds_bytes)
            records.append({"grid": list(x.grid), **{k: record.get(k) for k in (
                "kernel", "error", "registers", "scratch", "spill_loads", "lds", "mma_ops", "ctas_per_sm")}})
        results.append(records)
    return results


@pytest.fixture(scope="module")
def compiled() -> list[list[dict]]:
    return run_outside_the_interpreter("tests.test_gluon_serving_compile", "compile_cases", timeout=900)


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_the_serving_launches_compile_for_sm90_without_spills(compiled, index):
    spec, text = CASES[index]
    p = Variant.parse(text).p
    records = compiled[index]
    assert [r["error"] for r in records] == [None] * len(records)
    # one split writes the output: no reduction launch
    names = ["_gs_serving_kernel"] + (["_gs_reduce_kernel"] if p["max_splits"] > 1 else [])
    assert [r["kernel"] for r in records] == names
    decode = records[0]
    assert decode["grid"] == [spec.heads // p["block_h"] * p["v_halves"], p["max_splits"], 3]
    assert decode["scratch"] == 0 and decode["spill_loads"] == 0, decode  # no register spills
    rows = p["block_h"] * triton.next_power_of_2(spec.max_q_len)
    # the compiler's shared memory is the module's figure (3.6: up to its slack more), within an H200 block's
    estimate = gluon_serving.gs_smem_bytes(rows, p["num_stages"], spec.kv_format == "fp8")
    assert estimate <= decode["lds"] <= estimate + gluon_serving.GS_SMEM_SLACK <= H200_BLOCK_SMEM
    assert any(op.startswith("wgmma.mma_async") for op in decode["mma_ops"]), decode["mma_ops"]
    # the schedule model's occupancy cap is what an SM holds of the compiled kernel (registers too)
    assert decode["ctas_per_sm"] == gluon_fused_schedule.occupancy_cap(Variant.parse(text), spec.max_q_len, SMEM_PER_SM["sm_90"])
    for reduce in records[1:]:
        assert reduce["grid"] == [3, spec.max_q_len, spec.heads] and reduce["scratch"] == 0
