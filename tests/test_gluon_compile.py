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
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import triton

from mla_tune.backends import gluon_fused
from mla_tune.core import QK_DIM, Shape, Variant
from mla_tune.kernels import gluon_decode

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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, tests.test_gluon_compile as t; print(json.dumps(t.compile_cases()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["variant"]: r["launches"] for r in json.loads(done.stdout.strip().splitlines()[-1])}


def test_this_triton_has_every_name_the_kernel_calls():
    assert gluon_decode.GD_UNAVAILABLE is None, gluon_decode.GD_UNAVAILABLE
    reason = gluon_fused.unavailable_reason()
    if not torch.cuda.is_available():  # the CPU machine: the GPU is what is missing, not the version
        assert reason == "gluon_fused needs an NVIDIA sm_90 GPU (Gluon has no CPU interpreter)"
        assert triton.__version__ not in reason


@pytest.mark.parametrize("text, shape", CASES, ids=["table-winner", "ws2"])
def test_the_backends_launch_compiles_for_sm90(compiled, text, shape):
    variant = Variant.parse(text)
    launches = compiled[text]
    assert [launch.get("error") for launch in launches] == [None, None]
    # num_splits > 1: the decode, then the reduce launch
    assert [launch["name"] for launch in launches] == ["_gd_decode_kernel", "_gd_reduce_kernel"]
    decode, reduce = launches
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
