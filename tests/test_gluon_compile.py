"""gluon_fused compiles for sm_90 with the installed Triton, on a machine without a GPU.

The launch is captured from the backend's real path: `build(variant, shape, meta)` and one
call with meta tensors at the real shape, while `KernelInterface.__getitem__` records each
launch instead of running it. Each launch is then bound as `JITFunction.run` binds it and
compiled by `triton.compile` for `GPUTarget("cuda", 90, 32)` (ptxas ships in Triton's wheel).
CI runs this with Triton 3.9; the same file runs under the contest's Triton 3.6 with
`/work/venv36/bin/python -m pytest -q tests/test_gluon_compile.py`. Compiling is not running:
only 3.6 has run the kernel on an H200 (docs/perf.md).
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from unittest import mock

import pytest
import torch
import triton

from mla_tune.backends import gluon_fused
from mla_tune.core import QK_DIM, Shape, Variant
from mla_tune.kernels import gluon_decode
from tests.helpers import run_outside_the_interpreter

pytestmark = pytest.mark.skipif(gluon_decode.gluon is None,
                                reason=f"no Gluon in this Triton: {gluon_decode.GD_UNAVAILABLE}")

META = torch.device("meta")
H200_SMS = 132

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


def capture_launches(variant: Variant, shape: Shape) -> list[tuple]:
    """(kernel, grid, args, kwargs) of every launch one call of the built runner makes."""
    launches: list[tuple] = []

    def record(kernel, grid):
        return lambda *args, **kwargs: launches.append((kernel, grid, args, kwargs))

    with mock.patch.object(triton.runtime.jit.KernelInterface, "__getitem__", record), \
            mock.patch.object(gluon_fused, "unavailable_reason", lambda: None), \
            mock.patch.object(gluon_fused, "device_sm_count", lambda device: H200_SMS):  # no sm_90 GPU here
        runner = gluon_fused.build(variant, shape, META)
        kv = torch.empty((shape.total_kv, 1, QK_DIM), dtype=torch.float8_e4m3fn, device=META)
        q = torch.empty((shape.batch, 16, QK_DIM), dtype=torch.bfloat16, device=META)
        indptr = torch.empty(shape.batch + 1, dtype=torch.int32, device=META)
        runner(q, {"fp8": (kv, torch.empty(1, dtype=torch.float32, device=META))}, indptr, indptr)
    return launches


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """triton.compile of one captured launch for sm_90, bound as JITFunction.run binds it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": False, "instrumentation_mode": ""}
    if "fpsan_homomorphic_casts" in inspect.getsource(type(kernel).run):  # 3.9's run adds it, 3.6's does not
        kwargs["fpsan_homomorphic_casts"] = False
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = (GluonASTSource if kernel.is_gluon() else ASTSource)(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def compile_cases() -> list[dict]:
    """Each case's launches, compiled: what the tests assert on. Needs a process without
    TRITON_INTERPRET (the suite's conftest sets it, and the interpreter's jit functions cannot
    be compiled), so the tests run it in a child process."""
    results = []
    for text, shape in CASES:
        launches = []
        for kernel, grid, args, kwargs in capture_launches(Variant.parse(text), shape):
            start = time.perf_counter()
            try:
                compiled = compile_sm90(kernel, args, kwargs)
            except Exception as exc:  # the compiler's own message is the test's failure message
                launches.append({"name": kernel.fn.__name__, "error": f"{type(exc).__name__}: {exc}"})
                continue
            print(f"{text} {kernel.fn.__name__}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
            launches.append({"name": kernel.fn.__name__, "grid": list(grid), "shared": compiled.metadata.shared,
                             "ptx": compiled.asm["ptx"], "cubin_bytes": len(compiled.asm["cubin"])})
        results.append({"variant": text, "launches": launches})
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    return {r["variant"]: r["launches"]
            for r in run_outside_the_interpreter("tests.test_gluon_compile", "compile_cases", timeout=600)}


def test_this_triton_has_every_name_the_kernel_calls():
    assert gluon_decode.GD_UNAVAILABLE is None, gluon_decode.GD_UNAVAILABLE
    reason = gluon_fused.unavailable_reason()
    if not torch.cuda.is_available():  # the CPU machine: the GPU is what is missing, not the version
        assert reason == "gluon_fused needs an NVIDIA sm_90 GPU (Gluon has no CPU interpreter)"
        assert triton.__version__ not in reason


@pytest.mark.parametrize("text, shape", CASES, ids=["table-winner", "ws2", "q-first", "one-launch-bf16-parts"])
def test_the_backends_launch_compiles_for_sm90(compiled, text, shape):
    variant = Variant.parse(text)
    launches = compiled[text]
    assert [launch.get("error") for launch in launches] == [None] * len(launches)
    # num_splits > 1: the decode, then the reduce launch, unless the splits combine in the kernel
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


def test_q_loaded_first_is_issued_before_the_kv_indptr_loads_and_the_ring(compiled):
    """q_load=first: q's box loads (16-byte ld.global.v4) come first, so their round trip runs
    while KV_INDPTR's does; with twice (the winner) they wait behind the ring's first TMA
    copies, which wait for KV_INDPTR."""
    twice, first = (compiled[text][0]["ptx"] for text, _ in CASES[0:3:2])
    for ptx in (twice, first):
        assert _first(ptx, "ld.global.b32") < _first(ptx, "cp.async.bulk.tensor")  # the indptr before the ring
    assert _first(twice, "cp.async.bulk.tensor") < _first(twice, "ld.global.v4")
    assert _first(first, "ld.global.v4") < _first(first, "ld.global.b32")


def test_bf16_partials_are_stored_as_16_bit_values(compiled):
    """part=bf16: each of the 64 partial O values a thread holds is rounded to bf16 and
    stored as 16 bits, where the fp32 winner stores 64 32-bit values."""
    fp32, bf16 = compiled[CASES[0][0]][0]["ptx"], compiled[CASES[3][0]][0]["ptx"]
    count = lambda ptx, op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))  # noqa: E731
    assert (count(fp32, "st.global.b32"), count(fp32, "st.global.b16")) == (64, 0)
    assert (count(bf16, "st.global.b16"), count(bf16, "cvt.rn.bf16.f32")) == (64, 64)
