"""The compile check (mla_tune/xcompile, `mla-tune compile`): capture, resource parsing, the
cache, the plan's drops, and (CI's acceptance) every distinct binary of the MI355X plan and a
sample of the H200 plan cross-compiled with the installed Triton, without a GPU."""

import sys
import time

import pytest
import torch
import triton
from rich.console import Console

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.core import Shape, Variant
from mla_tune.problem import generate_input
from mla_tune.tune.config import load_config
from mla_tune.tune.sweep import plan_candidates, run_sweep
from mla_tune.xcompile import check as xcheck
from mla_tune.xcompile.capture import capture_candidate, recording
from mla_tune.xcompile.resources import amd_resources, code_sha, cuda_resources
from mla_tune.xcompile.targets import bind, first_error_line, specialization, target_for
from tests.helpers import REPO as ROOT
from tests.helpers import invoke

MI355X_CONFIG = ROOT / "configs" / "mi355x.yaml"
LEADERBOARD = ROOT / "configs" / "leaderboard.yaml"
TINY = ROOT / "tests" / "data" / "xcompile_tiny.yaml"
SPLITK = Variant.parse("triton(block_n=32,dot_dtype=fp16,kv=fp8,num_splits=4,num_stages=2,num_warps=4,q=bf16)")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(xcheck.CACHE_ENV, str(tmp_path / "cache"))


# ------------------------------------------------------------------ gpu facts
def test_every_known_gpu_has_a_compile_target_and_its_own_config():
    assert gpu.KNOWN_GPUS["MI355X"].config == "mi355x.yaml" and gpu.default_config("MI355X") == "configs/mi355x.yaml"
    assert gpu.default_config("H200") == "configs/leaderboard.yaml" == gpu.default_config("B200")
    for name, facts in gpu.KNOWN_GPUS.items():
        assert (ROOT / "configs" / facts.config).is_file(), name
        target = target_for(facts)
        assert (target.backend == "hip") == facts.is_hip and target.warp_size == facts.warp_size
    assert target_for(gpu.KNOWN_GPUS["H200"]).arch == 90 and gpu.KNOWN_GPUS["MI300X"].lds_bytes == 65536


# ------------------------------------------------------------------ capture
def test_capture_finds_the_launches_of_the_backends_real_path():
    facts = gpu.KNOWN_GPUS["MI355X"]
    with recording(facts) as launches:
        item = capture_candidate(SPLITK, Shape(256, 8192), facts, launches)
        one = capture_candidate(SPLITK.with_params(num_splits=1), Shape(4, 1024), facts, launches)
    assert item.error is None and [ln.kernel.fn.__name__ for ln in item.launches] == [
        "_fd_stage1_kernel", "_fd_stage2_kernel"]
    assert tuple(item.launches[0].grid)[:2] == (256, 4)  # a program per (sequence, split)
    assert [ln.kernel.fn.__name__ for ln in one.launches] == ["_fd_stage1_kernel"]  # no reduction
    # the KV cache reaches the kernel at its real size: 256 x 8192 bf16 tokens pass 2 GiB, so on
    # AMD its pointer loses the buffer-op range attribute ("S"), and the binary differs
    target = target_for(facts)
    bf16 = SPLITK.with_params(kv="bf16", dot_dtype="bf16")
    with recording(facts) as launches:
        big = capture_candidate(bf16, Shape(256, 8192), facts, launches).launches[0]
        small = capture_candidate(bf16, Shape(4, 8192), facts, launches).launches[0]
    kv = [p.name for p in big.kernel.params].index("KV")
    assert "S" not in specialization(big.kernel, big.args, big.kwargs, target)[kv][1]
    assert "S" in specialization(small.kernel, small.args, small.kwargs, target)[kv][1]
    # Gluon, captured for sm_90 on a machine without it (its launches: tests/test_gluon_compile.py)
    h200 = gpu.KNOWN_GPUS["H200"]
    gluon = Variant.parse("gluon_fused(block_n=64,kv=fp8,num_splits=8,num_stages=2,q=fp8_dynamic,v_path=rs8)")
    with recording(h200) as launches:
        item = capture_candidate(gluon, Shape(32, 8192), h200, launches)
    assert item.error is None, item.error
    first = item.launches[0]
    types = [t for t, _ in specialization(first.kernel, first.args, first.kwargs, target_for(h200))]
    assert any("tensordesc" in str(t) for t in types), types  # the TMA descriptor's own type
    # compiled from Gluon's own source class, as its JIT does (plain ASTSource fails under 3.6)
    bound = bind(first.kernel, first.grid, first.args, first.kwargs, target_for(h200))
    assert type(bound.src).__name__ == "GluonASTSource"


# ------------------------------------------------------------------ resources
AMDGCN = """\
_fd_stage1_kernel:
; %bb.0:
\ts_load_dwordx2 s[2:3], s[0:1], 0x0
\tv_mfma_f32_16x16x32_bf16 a[0:3], v[4:7], v[8:11], a[0:3]   ; comment
\tv_mfma_f32_16x16x32_bf16 a[4:7], v[4:7], v[12:15], a[4:7]
.LBB0_2:
\ts_endpgm
   .amdhsa_private_segment_fixed_size 0
   ; NumVgprs: 256
   ; NumAgprs: 80
   ; TotalNumVgprs: 336
   ; Occupancy: 1
    .agpr_count:     80
    .private_segment_fixed_size: 72
    .sgpr_count:     44
    .vgpr_count:     336
"""
PTXAS_LOG = """\
ptxas info    : Compiling entry function '_fd_stage1_kernel' for 'sm_90a'
ptxas info    : Function properties for _fd_stage1_kernel
    152 bytes stack frame, 160 bytes spill stores, 152 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 152 bytes cumulative stack size
"""
PTX = """\
.visible .entry _fd_stage1_kernel(
\t.param .u64 _fd_stage1_kernel_param_0
)
{
\t.loc\t1 71 16
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};
\twgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%f5}, %rd1, %rd2, 1, 1, 1;
\tret;
}
"""


def test_resources_are_read_from_a_recorded_listing_and_ptxas_log_and_the_first_error_line_from_mlir():
    amd = amd_resources(AMDGCN, shared=36864, num_warps=4, arch="gfx950")
    assert (amd["vgprs"], amd["arch_vgprs"], amd["agprs"], amd["sgprs"], amd["scratch"]) == (336, 256, 80, 44, 72)
    assert amd["mma"] == 2 and amd["mma_ops"] == {"v_mfma_f32_16x16x32_bf16": 2}
    assert amd["waves_per_simd"] == 1 == amd["llvm_occupancy"]  # 512 // 336
    assert amd_resources(AMDGCN.replace("336", "128"), 36864, 4, "gfx950")["waves_per_simd"] == 4
    # LDS bounds it too: 160 KiB holds 4 workgroups of 40 KiB, 4 x 4 waves over 4 SIMDs
    assert amd_resources(AMDGCN.replace("336", "64"), 40960, 4, "gfx950")["waves_per_simd"] == 4
    cuda = cuda_resources(PTXAS_LOG, PTX, shared=53248, num_warps=4, arch="sm_90")
    assert (cuda["registers"], cuda["scratch"], cuda["spill_loads"], cuda["stack"]) == (255, 160, 152, 152)
    assert cuda["mma"] == 2 and cuda["ctas_per_sm"] == 2 and cuda["warps_per_sm"] == 8  # 65536 / (256 x 32 x 4)
    assert cuda_resources(PTXAS_LOG.replace("255", "96"), PTX, 53248, 4, "sm_90")["ctas_per_sm"] == 4  # smem
    # the same instructions under other metadata and comments are the same code, not other code
    assert code_sha(AMDGCN, ";") == code_sha(AMDGCN.replace("; comment", "").replace("336", "340"), ";")
    assert code_sha(AMDGCN, ";") != code_sha(AMDGCN.replace("a[4:7], v[4:7]", "a[4:7], v[5:8]"), ";")
    # a failed compile's first line: MLIR's diagnostic, else the exception's cause
    stderr = ("loc(...): warning: x\n/m/fused_decode.py:71:16: error: Unsupported conversion from "
              "'f8E4M3FNUZ' to 'f8E4M3FN'\nmore\n")
    assert first_error_line(RuntimeError("PassManager::run failed"), stderr).startswith(
        "/m/fused_decode.py:71:16: error: Unsupported conversion")
    assert first_error_line(ValueError("at 3:4:\n  x = 1\nunsupported tensor index"), "") == \
        "ValueError: unsupported tensor index"


# ------------------------------------------------------------------ cache and drops
def test_a_duplicate_binary_is_dropped_and_a_second_check_reads_the_cache():
    """Real compiles (in a process without the tests' interpreter): waves_per_eu=1 gives gfx950
    the same code as 0, so the second candidate is dropped; then every binary is cached."""
    base = SPLITK.with_params(dot_dtype="bf16", matrix_instr_nonkdim=16, waves_per_eu=0, num_splits=1)
    twin = base.with_params(waves_per_eu=1)
    plan = {Shape(4, 1024): [base, twin]}
    first = xcheck.check_plan(plan, "MI355X", jobs=2, q_quant=False)
    assert first["compiled"] == 2 and first["cached"] == 0  # stage 1 twice (other options)
    assert all(b["ok"] for b in first["binaries"]), first["binaries"]
    assert list(first["drops"]["4x1024"]) == [str(twin)]
    assert first["drops"]["4x1024"][str(twin)].startswith(f"compiles to the same code and launches as {base}")
    again = xcheck.check_plan(plan, "MI355X", jobs=2, q_quant=False)
    assert again["compiled"] == 0 and again["cached"] == 2 and again["drops"] == first["drops"]
    assert [b["sha"] for b in again["binaries"]] == [b["sha"] for b in first["binaries"]]


def _record(key, kernel="_fd_stage1_kernel", ok=True, lds=4096, sha="s", **more):
    return {"key": key, "kernel": kernel, "ok": ok, "error": None if ok else "k.py:1:2: error: no",
            "lds": lds, "over_lds": lds > 163840, "sha": sha, "vgprs": 100, "num_warps": 4, **more}


def test_drops_are_recorded_with_their_reason():
    s = Shape(4, 1024)
    records = {"a": _record("a"), "b": _record("b"), "bad": _record("bad", ok=False),
               "big": _record("big", lds=204800), "other": _record("other", sha="t")}
    launch = ((4, 2), (4, 0.1))
    items = [(s, "v1", [("a", launch)]), (s, "v2", [("b", launch)]), (s, "v3", [("bad", launch)]),
             (s, "v4", [("big", launch)]), (s, "v5", [("other", launch)]),
             (s, "v6", [("a", ((4, 8), (4, 0.1)))]),  # same code, another grid: not a duplicate
             (Shape(32, 1024), "v2", [("b", launch)])]  # the same at another shape: kept
    drops = xcheck.plan_drops(items, records, "MI355X", 163840)
    assert set(drops) == {"4x1024"} and set(drops["4x1024"]) == {"v2", "v3", "v4"}
    assert drops["4x1024"]["v2"].startswith("compiles to the same code and launches as v1")
    assert drops["4x1024"]["v3"] == (f"_fd_stage1_kernel does not compile for MI355X with Triton "
                                     f"{triton.__version__}: k.py:1:2: error: no")
    assert "needs 204800 B of shared memory (LDS), more than MI355X's 163840 B" in drops["4x1024"]["v4"]


def test_the_dry_run_plans_without_the_checks_drops_and_prints_why(monkeypatch, tmp_path):
    planned = plan_candidates(load_config(MI355X_CONFIG), gpu.fake_platform("MI355X"), planning_only=True)
    shape = next(iter(planned.plan))
    victim = next(v for v in planned.plan[shape] if v.backend == "triton")
    report = {"gpu": "MI355X", "target": "hip:gfx950", "triton": "3.9.0", "image_triton": "3.6.0",
              "version_note": None, "lds_limit": 163840, "jobs": 1, "compiled": 1, "cached": 0, "wall_s": 1.0,
              "not_compiled": {}, "binaries": [], "capture_errors": [],
              "drops": {str(shape): {str(victim): "it is the test's victim"}}}
    seen = []
    monkeypatch.setattr(xcheck, "check_plan", lambda plan, name, jobs=None: seen.append(name) or report)
    console = Console(record=True, width=80)
    summary = run_sweep(MI355X_CONFIG, "MI355X", out=tmp_path / "MI355X.yaml", dry_run=True,
                        compile_check=True, console=console)
    assert seen == ["MI355X"] and summary.compile_drops == report["drops"]
    assert str(victim) not in summary.plan[str(shape)]["triton"]
    text = console.export_text()
    assert f"dropped: {shape} {victim}" in text and "test's victim" in text
    plain = run_sweep(MI355X_CONFIG, "MI355X", out=tmp_path / "MI355X.yaml", dry_run=True, console=console)
    assert seen == ["MI355X"] and str(victim) in plain.plan[str(shape)]["triton"]  # off by default


@pytest.mark.parametrize("args, code, says, never", [
    (["sweep", "--gpu", "MI355X", "--dry-run"], 0, ["mi355x", "aiter"], []),
    (["sweep", "--gpu", "H200", "--dry-run"], 0, ["config leaderboard"], ["aiter"]),
    (["compile", "--gpu", "B999"], 1, ["MI355X", "KNOWN_GPUS"], []),
], ids=["mi355x-plans-aiter", "h200-plans-no-aiter", "compile-refuses-an-unknown-gpu"])
def test_the_gpu_picks_its_config_and_compile_names_the_known_gpus(args, code, says, never):
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert all(s in result.output for s in says) and not any(s in result.output for s in never)


def test_another_python_runs_the_check_and_its_json_is_read_back():
    """--triton PYTHON (here this one): a subprocess computes the report; the parent prints it."""
    result = invoke("compile", "--gpu", "H200", "--config", TINY, "--triton", sys.executable, "--jobs", 2)
    assert result.exit_code == 0, result.output
    assert f"Triton {triton.__version__}" in result.output and "_fd_stage1_kernel" in result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    bad = invoke("compile", "--gpu", "H200", "--config", TINY, "--triton", "/nonexistent/py")
    assert bad.exit_code == 1 and "--triton /nonexistent/py" in bad.output


# ------------------------------------------------------------------ CI's acceptance
def test_every_distinct_binary_of_the_mi355x_plan_compiles_for_gfx950():
    """Every CI run: the whole MI355X plan (configs/mi355x.yaml), no sample, 2 processes."""
    t0 = time.monotonic()
    planned = plan_candidates(load_config(MI355X_CONFIG), gpu.fake_platform("MI355X"), planning_only=True)
    report = xcheck.check_plan(planned.plan, "MI355X", jobs=2)
    failed = [(b["kernel"], b["error"], b["users"][0]) for b in report["binaries"] if not b["ok"]]
    assert not failed and not report["capture_errors"], (failed, report["capture_errors"][:3])
    assert report["cached"] == 0 and report["compiled"] == len(report["binaries"]) > 50
    own = sum(len([v for v in vs if v.backend == "triton"]) for vs in planned.plan.values())
    users = {(s, label) for b in report["binaries"] for s, label in b["users"] if label.startswith("triton(")}
    assert len(users) == own  # every candidate of the plan was captured
    assert not any(b["over_lds"] for b in report["binaries"])
    print(f"MI355X: {len(report['binaries'])} binaries in {time.monotonic() - t0:.0f} s")


# One triton / triton_fused candidate in 80 per shape and every fourth gluon_fused one at one
# shape, with q_quant: each kernel family of the H200 plan, not its whole space.
H200_SAMPLE_EVERY = 80


def test_a_sample_of_the_h200_plan_compiles_for_sm_90_triton_and_gluon():
    planned = plan_candidates(load_config(LEADERBOARD), gpu.fake_platform("H200"), planning_only=True)
    plan = {}
    for shape, variants in planned.plan.items():
        own = [v for v in variants if v.backend in ("triton", "triton_fused")]
        gluon = [v for v in variants if v.backend == "gluon_fused"]
        plan[shape] = own[::H200_SAMPLE_EVERY] + (gluon[::4] if shape == Shape(256, 8192) else [])
    assert any(v.backend == "gluon_fused" for vs in plan.values() for v in vs)
    report = xcheck.check_plan(plan, "H200", jobs=2, q_quant=True)
    failed = [(b["kernel"], b["error"]) for b in report["binaries"] if not b["ok"]]
    assert not failed and not report["capture_errors"], (failed[:3], report["capture_errors"][:3])
    kernels = {b["kernel"] for b in report["binaries"]}
    assert {"_fd_stage1_kernel", "_gd_decode_kernel", "_qq_quantize_kernel"} <= kernels
    assert any(b["kernel"].startswith("_fu") for b in report["binaries"])


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_on_the_gpu_the_cross_compile_is_the_code_the_jit_launches():
    """On an H200 or MI355X (`python -m pytest -m gpu tests/test_xcompile.py`): the binaries the
    check compiles from a meta-device capture have the instructions of those Triton's JIT
    compiles for a real launch of the same candidates, stage 1 and the reduction."""
    name = gpu.detect().name
    assert name in gpu.KNOWN_GPUS, f"{name} is not in gpu.KNOWN_GPUS"
    shape, variants = Shape(4, 1024), [SPLITK, SPLITK.with_params(kv="bf16", dot_dtype="bf16")]
    report = xcheck.check_plan({shape: variants}, name, jobs=2, use_cache=False, q_quant=False)
    assert all(b["ok"] for b in report["binaries"])
    ours = {b["sha"] for b in report["binaries"]}
    facts = gpu.KNOWN_GPUS[name]
    with recording(facts) as launches:
        kernels = {ln.kernel for v in variants for ln in capture_candidate(v, shape, facts, launches).launches}
    q, kv_data, qo_indptr, kv_indptr, _ = generate_input(shape.batch, shape.kv_len, seed=1)
    for v in variants:
        get_backend("triton").build(v, shape, "cuda")(q, kv_data, qo_indptr, kv_indptr)
    torch.cuda.synchronize()
    listing, comment = ("amdgcn", ";") if torch.version.hip else ("ptx", "//")
    jit = set()
    for kernel in kernels:  # the JIT's compiled kernels, kept per device by the JITFunction
        for cache in kernel.device_caches.values():
            jit |= {code_sha(k.asm[listing], comment) for k in cache[0].values()}
    assert ours <= jit, (len(ours - jit), len(ours))
