"""The Gluon kernels, captured as `mla-tune compile` does, compile for sm_90 with the installed
Triton (3.9 in CI; 3.6: /work/venv36/bin/python -m pytest) without a GPU: gluon_fused's decode
(launches, shared memory, PTX) and serving kernel (no spills, within an H200 block's smem)."""

import re

import pytest
import torch
import triton

from mla_tune.backends import gluon_fused, gluon_fused_schedule
from mla_tune.core import QK_DIM, V_DIM, CallSpec, Shape, Variant
from mla_tune.kernels import gluon_decode, gluon_serving
from mla_tune.xcompile.resources import SMEM_PER_SM
from tests.helpers import run_outside_the_interpreter

pytestmark = pytest.mark.skipif(gluon_decode.gluon is None,
                                reason=f"no Gluon in this Triton: {gluon_decode.GD_UNAVAILABLE}")

META = torch.device("meta")
H200_BLOCK_SMEM = 232448  # 227 KB: what one sm_90 block may allocate

CASES = [
    # tables/H200.yaml's most frequent winner (six shapes): the decode and the reduce launch
    ("gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=rs8)", Shape(64, 8192)),
    # warp specialization with two consumers: every renamed builtin (TMA load, CTA barrier,
    # shared-memory reinterpret) and gl.warp_specialize
    ("gluon_fused(block_n=64,kv=fp8,num_splits=2,num_stages=3,q=fp8_dynamic,v_path=ss16,ws=2)", Shape(4, 1024)),
    # the small shapes' levers: the winner's kernel with q loaded once, first; bf16 partials
    # combined by the spin barrier in the one launch
    ("gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,q_load=first,v_path=rs8)",
     Shape(64, 8192)),
    ("gluon_fused(block_n=64,kv=fp8,num_splits=16,num_stages=2,part=bf16,q=fp8_dynamic,q_load=first,reduce=spin,"
     "v_path=ss16)", Shape(4, 1024)),
]

# (spec, variant) of the serving kernel: two binaries, to keep CI short; the GPU matrix of
# tests/test_serving_correctness.py runs the rest.
SERVING_CASES = [
    (CallSpec("fp8", 64, 128, max_q_len=2, mixed_q_len=True, graph=True, return_lse=True),
     "gluon_fused(block_h=16,kv=fp8,max_splits=8,num_stages=2,q=fp8_dynamic,split_budget=40,"
     "tokens_per_split=512,v_halves=1)"),
    (CallSpec("bf16", 128, 64, max_q_len=4, mixed_q_len=True, return_lse=True),
     "gluon_fused(block_h=8,kv=bf16,max_splits=4,num_stages=2,q=bf16,tokens_per_split=256,"
     "v_halves=2)"),
]
SERVING_IDS = ["fp8-page64-h128-q2-lse", "bf16-page128-h64-q4-lse-halves"]


def compile_cases() -> dict:
    """Each case's launches compiled for the H200 (the decode's with their PTX, the serving
    kernel's at batch 3 as compile_bound's records). The interpreter's jit functions cannot be
    compiled, so the tests run this in a child process without TRITON_INTERPRET."""
    from mla_tune import gpu
    from mla_tune.xcompile import capture, targets

    facts = gpu.KNOWN_GPUS["H200"]
    target = targets.target_for(facts)
    decode, serving = {}, []
    with capture.recording(facts) as recorded:
        for text, shape in CASES:
            item = capture.capture_candidate(Variant.parse(text), shape, facts, recorded)
            launches = [] if item.error is None else [{"name": "capture", "error": item.error}]
            for launch in item.launches:
                try:
                    b = targets.bind(launch.kernel, launch.grid, launch.args, launch.kwargs, target)
                    compiled = targets.compile_binary(b)
                except Exception as exc:  # the compiler's own message is the test's failure message
                    launches.append({"name": launch.kernel.fn.__name__, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                launches.append({"name": b.name, "grid": list(b.launch[0]), "shared": compiled.metadata.shared,
                                 "ptx": compiled.asm["ptx"], "cubin_bytes": len(compiled.asm["cubin"])})
            decode[text] = launches
        batch = 3
        for spec, text in SERVING_CASES:
            recorded.clear()
            q = _meta(batch * spec.max_q_len, spec.heads, QK_DIM, dtype=torch.bfloat16)
            fp8 = spec.kv_format == "fp8"
            kv = _meta(40, spec.page_size, QK_DIM, dtype=torch.float8_e4m3fn if fp8 else q.dtype)
            scale = _meta(1, dtype=torch.float32) if fp8 else None
            layout = dict(block_table=_meta(batch, 12), seq_lens=_meta(batch))
            runner = gluon_fused.build_serving(Variant.parse(text), spec, META)
            result = runner(q, _meta(batch + 1), kv, scale, **layout)
            out = result[0] if spec.return_lse else result
            assert tuple(out.shape) == (q.shape[0], spec.heads, V_DIM)
            keys = ("kernel", "error", "registers", "scratch", "spill_loads", "lds", "mma_ops", "ctas_per_sm")
            records = [targets.compile_bound(targets.bind(x.kernel, x.grid, x.args, x.kwargs, target), facts.lds_bytes)
                       for x in recorded]
            serving.append([{"grid": list(x.grid), **{k: r.get(k) for k in keys}}
                            for x, r in zip(recorded, records, strict=True)])
    return {"decode": decode, "serving": serving}


def _meta(*shape: int, dtype=torch.int32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_outside_the_interpreter("tests.test_gluon_compile", "compile_cases", timeout=900)


@pytest.mark.parametrize("text, shape", CASES, ids=["table-winner", "ws2", "q-first", "one-launch-bf16-parts"])
def test_the_backends_launch_compiles_for_sm90(compiled, text, shape):
    variant = Variant.parse(text)
    launches = compiled["decode"][text]
    assert [launch.get("error") for launch in launches] == [None] * len(launches)
    one_launch = variant.p.get("reduce") == "spin"
    expected = ["_gd_decode_kernel"] if one_launch else ["_gd_decode_kernel", "_gd_reduce_kernel"]
    assert [launch["name"] for launch in launches] == expected
    decode, reduce = launches[0], launches[-1]
    assert decode["grid"] == [variant.p["num_splits"], shape.batch]
    p = {**gluon_fused.GF_LATER_DEFAULTS, **variant.p}
    # the shared memory the compiler allocated is the kernel module's figure (the spin check's)
    assert decode["shared"] == gluon_decode.gd_smem_bytes(p["block_n"], p["num_stages"], p["v_path"], 1, p["ws"])
    ptx = decode["ptx"]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # the MMAs and the TMA loads
    if p["ws"]:
        assert "setmaxnreg" in ptx  # the partitions' register budgets
    assert decode["cubin_bytes"] > 0 and reduce["cubin_bytes"] > 0  # ptxas assembled both


def _first(ptx: str, opcode: str) -> int:
    """The line number of the first instruction starting with `opcode` (predicated or not)."""
    return next(i for i, line in enumerate(ptx.splitlines())
                if re.match(r"(@!?%p\d+\s+)?" + re.escape(opcode), line.strip()))


def test_q_loaded_first_is_issued_before_the_kv_indptr_loads_and_bf16_partials_are_16_bit_stores(compiled):
    """q_load=first: q's box loads (16-byte ld.global.v4) come first, so their round trip runs
    while KV_INDPTR's does; with twice (the winner) they wait behind the ring's first TMA
    copies, which wait for KV_INDPTR. part=bf16: each of the 64 partial O values a thread holds
    is rounded to bf16 and stored as 16 bits, where the fp32 winner stores 64 32-bit values."""
    twice, first = (compiled["decode"][text][0]["ptx"] for text, _ in CASES[0:3:2])
    for ptx in (twice, first):
        assert _first(ptx, "ld.global.b32") < _first(ptx, "cp.async.bulk.tensor")  # the indptr before the ring
    assert _first(twice, "cp.async.bulk.tensor") < _first(twice, "ld.global.v4")
    assert _first(first, "ld.global.v4") < _first(first, "ld.global.b32")
    fp32, bf16 = (compiled["decode"][CASES[i][0]][0]["ptx"] for i in (0, 3))
    count = lambda ptx, op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))  # noqa: E731
    assert (count(fp32, "st.global.b32"), count(fp32, "st.global.b16")) == (64, 0)
    assert (count(bf16, "st.global.b16"), count(bf16, "cvt.rn.bf16.f32")) == (64, 64)


@pytest.mark.parametrize("index", range(len(SERVING_CASES)), ids=SERVING_IDS)
def test_the_serving_launches_compile_for_sm90_without_spills(compiled, index):
    spec, text = SERVING_CASES[index]
    p = Variant.parse(text).p
    records = compiled["serving"][index]
    assert [r["error"] for r in records] == [None] * len(records)
    names = ["_gs_serving_kernel"] + (["_gs_reduce_kernel"] if p["max_splits"] > 1 else [])
    assert [r["kernel"] for r in records] == names
    decode = records[0]
    assert decode["grid"] == [spec.heads // p["block_h"] * p["v_halves"], p["max_splits"], 3]
    assert decode["scratch"] == 0 and decode["spill_loads"] == 0, decode  # no register spills
    rows = p["block_h"] * triton.next_power_of_2(spec.max_q_len)
    # the compiler's shared memory is the module's figure (3.6: up to its slack more), within
    # an H200 block's
    estimate = gluon_serving.gs_smem_bytes(rows, p["num_stages"], spec.kv_format == "fp8")
    assert estimate <= decode["lds"] <= estimate + gluon_serving.GS_SMEM_SLACK <= H200_BLOCK_SMEM
    assert any(op.startswith("wgmma.mma_async") for op in decode["mma_ops"]), decode["mma_ops"]
    # the schedule model's occupancy cap is what an SM holds of the compiled kernel (registers too)
    assert decode["ctas_per_sm"] == gluon_fused_schedule.occupancy_cap(
        Variant.parse(text), spec.max_q_len, SMEM_PER_SM["sm_90"])
    for reduce in records[1:]:
        assert reduce["grid"] == [3, spec.max_q_len, spec.heads] and reduce["scratch"] == 0
