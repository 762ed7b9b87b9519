"""The precompile pool: right stand-ins, isolated jobs, a non-blocking API, no orphans."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

from mla_tune import gpu
from mla_tune.backends import EXTRA_BACKENDS_ENV, get_backend
from mla_tune.core import NUM_HEADS, QK_DIM, Shape, Variant
from mla_tune.tune import compile_pool
from mla_tune.tune.compile_pool import CompileJob, compile_shape_for, plan_jobs
from mla_tune.tune.config import expand_space, load_config
from tests.fakes.fake_warmup import MARKERS_ENV
from tests.helpers import runnable_backends

ROOT = Path(__file__).resolve().parent.parent
LEADERBOARD = ROOT / "configs" / "leaderboard.yaml"


# ------------------------------------------------------------------- launch keys
# Triton's kernel key (every argument's specialization, options), from its own binder, never
# compiled; meta-device tensors make the real 256 x 8192 shapes cost no memory.
def _meta_inputs(shape: Shape, big: tuple[str, ...] = ()):
    meta, total = torch.device("meta"), shape.total_kv
    kv_data = {"bf16": torch.empty((total, 1, QK_DIM), dtype=torch.bfloat16, device=meta),
               "fp8": (torch.empty((total, 1, QK_DIM), dtype=torch.float8_e4m3fn, device=meta),
                       torch.empty(1, dtype=torch.float32, device=meta)),
               "mxfp4": (torch.empty((total, 1, QK_DIM // 2), dtype=torch.uint8, device=meta),
                         torch.empty((total, 18), dtype=torch.uint8, device=meta))}
    if big:  # what the pool does for ROCm (compile_pool._rehome_large), on meta tensors
        kv_data = compile_pool._rehome_large(kv_data, big, meta)
    q = torch.empty((shape.batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=meta)
    indptr = torch.empty(shape.batch + 1, dtype=torch.int32, device=meta)
    return q, kv_data, indptr, indptr


class _HipSpecialization(BaseBackend):
    """ROCm Triton's pointer rule (buffer ops on): 'S' when the storage fits in 2 GiB."""

    supports_native_tensor_specialization = False

    @staticmethod
    def get_tensor_specialization(arg, **kwargs):
        ret = BaseBackend.get_tensor_specialization(arg, **kwargs)
        return ret + "S" if arg.untyped_storage().size() <= 2**31 - 1 else ret


class LaunchKeys:
    """Patches Triton's launch path to record each launch's key instead of running it."""

    def __init__(self, monkeypatch, backend_cls=BaseBackend):
        self.keys: list[tuple] = []
        self._jit: dict = {}
        self._backend = backend_cls
        monkeypatch.setattr(KernelInterface, "__getitem__", lambda kernel, grid: self._record(kernel))

    def _record(self, kernel):
        def launch(*args, **kwargs):
            if kernel.fn not in self._jit:
                options = getattr(kernel, "kwargs", {})  # InterpretedFunction keeps jit's arguments
                dns = getattr(kernel, "do_not_specialize", options.get("do_not_specialize"))
                self._jit[kernel.fn] = JITFunction(kernel.fn, do_not_specialize=dns)
            jf = self._jit[kernel.fn]
            bind = create_function_from_signature(jf.signature, jf.params, self._backend)
            _, specialization, options = bind(*args, **kwargs)
            self.keys.append((kernel.fn.__name__, repr(specialization), repr(sorted(options.items()))))
        return launch

    def of(self, variant: Variant, shape: Shape, big: tuple[str, ...] = ()) -> list[tuple]:
        self.keys = []
        if variant.get("q") == "fp8_static":
            variant = variant.with_params(q_amax=6.0)
        runner = get_backend(variant.backend).build(variant, shape, torch.device("meta"))
        runner(*_meta_inputs(shape, big))
        return self.keys


def _candidates(config_path: Path, platform, backends) -> list[tuple[Variant, Shape]]:
    config = load_config(config_path)
    return list(dict.fromkeys((v, shape) for name in backends for shape in config.shapes
                              for grid in expand_space(config.backends[name])
                              for v in get_backend(name).candidates(shape, grid, platform)))


def test_every_candidate_compiles_at_its_stand_in_exactly_the_kernels_of_its_shape_h200_and_rocm(monkeypatch):
    stub = types.ModuleType("flash_mla")  # a stub: the runner reaches its Triton q quantizer (q_quant.py)
    stub.get_mla_metadata = lambda *a, **k: (types.SimpleNamespace(), None)
    stub.get_mla_decoding_metadata = lambda *a, **k: (None, None)
    stub.flash_mla_with_kvcache = lambda q, *a, **k: (torch.empty((*q.shape[:3], 512), device=q.device), None)
    monkeypatch.setitem(sys.modules, "flash_mla", stub)
    h200 = gpu.fake_platform("H200")
    pairs = _candidates(LEADERBOARD, h200, ("triton", "triton_fused", "flashmla"))
    assert len(pairs) > 500
    keys = LaunchKeys(monkeypatch)
    for variant, shape in pairs:
        standin = compile_shape_for(shape, variant, h200.sm_count)
        assert standin.total_kv <= 2048, (variant, shape, standin)  # small: at most 2048 tokens
        real = keys.of(variant, shape)
        # FlashMLA's bf16 path is all vendor code; every other candidate launches Triton
        assert real or str(variant) == "flashmla(kv=bf16,q=bf16)", f"{variant} launched no Triton kernel"
        assert keys.of(variant, standin) == real, f"{variant} at {shape} vs its stand-in {standin}"
    # on ROCm a cache over 2 GiB is kept in a large storage, so that its pointer specializes alike
    keys = LaunchKeys(monkeypatch, _HipSpecialization)
    mi355x = gpu.fake_platform("MI355X")
    pairs = _candidates(ROOT / "configs" / "mi355x.yaml", mi355x, ("triton",))
    sample = [(v, s) for v, s in pairs if s == Shape(256, 8192)][::7] + [(v, s) for v, s in pairs][:: 97]
    assert any(v.get("kv") == "bf16" and s == Shape(256, 8192) for v, s in sample)
    for variant, shape in sample:
        (job,) = plan_jobs([(variant, shape)], mi355x.sm_count, hip=True)
        assert job.big_kv == (("bf16",) if shape == Shape(256, 8192) else ())
        assert keys.of(variant, job.shape, job.big_kv) == keys.of(variant, shape), (variant, shape)
    bf16 = next(v for v, s in sample if v.get("kv") == "bf16" and s == Shape(256, 8192))
    assert keys.of(bf16, Shape(1, 1)) != keys.of(bf16, Shape(256, 8192))  # the check can fail


def test_a_shape_class_stand_in_cannot_run_the_splits_compile_shape_for_keeps_one_job_per_stand_in():
    """The shape-class stand-in of 4 x 8192 (2 x 64) cannot run 8 splits of 64 tokens; a job is
    one per variant and stand-in, and remembers the real shapes."""
    variant = Variant.parse("triton_fused(block_n=64,kv=fp8,num_splits=8,num_stages=3,num_warps=4,"
                            "pv_dot=fp16,q=fp8_dynamic,qk_dot=fp8,reduce=last,tok_m=true)")
    with pytest.raises(ValueError, match="more splits than tiles"):
        get_backend("triton_fused").build(variant, compile_pool.default_compile_shape(Shape(4, 8192)), "meta")
    assert compile_shape_for(Shape(4, 8192), variant, 132) == Shape(1, 512)
    # without a variant: the default, each dimension kept in its Triton specialization class
    assert compile_shape_for(Shape(256, 8192)) == Shape(16, 64)
    assert compile_shape_for(Shape(4, 1024)) == Shape(2, 64)
    assert compile_shape_for(Shape(1, 1000)) == Shape(1, 17)
    v = Variant.parse("triton(block_n=32,dot_dtype=fp16,kv=fp8,num_splits=4,num_stages=1,num_warps=4,q=bf16)")
    jobs = plan_jobs([(v, Shape(4, 1024)), (v, Shape(256, 8192)), (str(v), Shape(32, 1024))], 132, hip=False)
    assert jobs == [CompileJob(str(v), Shape(1, 1), (Shape(4, 1024), Shape(256, 8192), Shape(32, 1024)))]


@pytest.mark.parametrize("waves", [1, 2])
def test_persistent_grid_stand_ins_keep_the_reduction_chunk_of_every_shape(monkeypatch, waves):
    monkeypatch.setattr(get_backend("triton_fused"), "_FU_INTERPRET_SMS", 132)  # meta device: an H200's SMs
    keys = LaunchKeys(monkeypatch)
    for kv, q, dot in (("fp8", "fp8_dynamic", "fp8"), ("bf16", "bf16", "fp16"), ("mxfp4", "bf16", "fp16")):
        for block_n in (32, 128):
            variant = Variant.make("triton_fused", kv=kv, q=q, qk_dot=dot, pv_dot="fp16", tok_m=True,
                                   block_n=block_n, num_warps=4, num_stages=3, num_splits=1, reduce="last",
                                   grid="persistent", waves=waves)
            for shape in (Shape(1, 17), Shape(4, 1024), Shape(32, 1024), Shape(256, 8192), Shape(3, 3000)):
                standin = compile_shape_for(shape, variant, 132)
                assert standin.batch == 1 and standin.total_kv <= 132 * waves * block_n
                assert keys.of(variant, standin) == keys.of(variant, shape), (variant, shape, standin)
            assert compile_shape_for(Shape(4, 1024), variant, None) == Shape(4, 1024)  # SMs unknown


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's sample")
def test_stand_ins_run_through_the_kernels_under_the_interpreter_at_the_most_splits():
    """Split-K with 32 splits of a 1-token stand-in; the one-launch kernel, tiles == splits."""
    for text, shape in (
        ("triton(block_n=32,dot_dtype=fp16,kv=fp8,num_splits=32,num_stages=1,num_warps=4,q=fp8_static)",
         Shape(64, 8192)),
        ("triton_fused(block_n=32,kv=bf16,num_splits=4,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,"
         "qk_dot=fp16,reduce=last,tok_m=true)", Shape(32, 1024)),
    ):
        (job,) = plan_jobs([(text, shape)], 132, hip=False)
        assert job.shape.total_kv <= 128
        compile_pool.run_job(job, torch.device("cpu"), {})  # raises if the stand-in cannot run


# ------------------------------------------------------------------ isolation
@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(EXTRA_BACKENDS_ENV, "fake_warmup=tests.fakes.fake_warmup,fake_raise=tests.fakes.fake_raise")
    monkeypatch.setenv(MARKERS_ENV, str(markers))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return markers


def _job(act: str, tag: str = "x", sleep_s: float = 0.0) -> CompileJob:
    variant = Variant.make("fake_warmup", kv="bf16", q="bf16", act=act, tag=tag, sleep_s=sleep_s)
    return CompileJob(str(variant), Shape(2, 17))


def test_a_hang_or_crash_costs_only_itself_and_a_deadline_stops_the_pool_keeping_the_rest(fake_env, tmp_path):
    # the bad ones first, one per process, so their replacements start together
    jobs = [_job("hang", "h"), _job("exit", "e"), _job("segv", "s"), _job("raise", "r")]
    jobs += [_job("ok", f"ok{i}") for i in range(5)]
    t0 = time.monotonic()
    handle = compile_pool.start(jobs, has_gpu=False, processes=3, job_timeout_s=3.0, log_path=tmp_path / "compile.log")
    report = handle.wait(time.monotonic() + 90)
    wall = time.monotonic() - t0
    status = {Variant.parse(r.job.variant).get("tag"): r for r in report.results}
    assert {k: r.status for k, r in status.items()} == {"h": "timeout", "e": "crashed", "s": "crashed", "r": "failed",
                                                         **{f"ok{i}": "ok" for i in range(5)}}
    assert "exit code 7" in status["e"].error and "SIGSEGV" in status["s"].error
    assert "compile.log" in status["s"].error
    assert "3 s limit" in status["h"].error and 3.0 <= status["h"].elapsed_s < 10
    assert "does not compile" in status["r"].error
    ran = sorted(p.name.split("-")[0] for p in fake_env.iterdir())
    assert ran == [f"ok{i}" for i in range(5)]  # each ok job ran once, after the hang and crashes
    assert all(r.elapsed_s >= 0 for r in report.results)
    assert report.elapsed_s <= wall + 0.001 and wall < 60  # elapsed_s is rounded to ms
    assert set(report.errors()) == {str(status[k].job) for k in "hesr"}
    assert "Segmentation fault" in (tmp_path / "compile.log").read_text()  # faulthandler's trace
    # precompile, the blocking form over (variant, real shape) pairs: what failed, by "variant at shape"
    bad = "fake_raise(kv=bf16,q=bf16)"
    pairs = [(_job("ok").variant, Shape(2, 17)), (bad, Shape(2, 17))]
    errors = compile_pool.precompile(pairs, device_index=0, has_gpu=False, processes=2, timeout_s=120)
    assert list(errors) == [f"{bad} at 2x17"] and "does not compile" in errors[f"{bad} at 2x17"]
    # start returns at once, and a deadline stops the pool keeping the finished jobs
    jobs = [_job("ok", "quick")] + [_job("ok", f"slow{i}", sleep_s=30.0) for i in range(3)]
    t0 = time.monotonic()
    handle = compile_pool.start(jobs, has_gpu=False, processes=1, job_timeout_s=120)
    assert time.monotonic() - t0 < 2.0 and not handle.done()
    while not handle.finished():
        assert time.monotonic() - t0 < 60
        time.sleep(0.1)
    assert [r.job for r in handle.finished()] == [jobs[0]]  # what the sweep may time already
    assert any(p.name.startswith("quick") for p in fake_env.iterdir())
    report = handle.wait(time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 70 and handle.done()
    assert [r.status for r in report.results] == ["ok", "not_run", "not_run", "not_run"]
    assert report.notes == ["stopped at the caller's deadline"]


# -------------------------------------------------------------------- orphans
_PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mla_tune.tune import compile_pool
    from mla_tune.tune.compile_pool import CompileJob
    from mla_tune.core import Shape, Variant
    from mla_tune.tune.worker import WorkerHandle

    worker = WorkerHandle(0, Path(sys.argv[1]))
    worker.launch()
    hang = str(Variant.make("fake_warmup", kv="bf16", q="bf16", act="hang", tag="h", sleep_s=0.0))
    pool = compile_pool.start([CompileJob(hang, Shape(2, 17))], has_gpu=False, processes=1, job_timeout_s=600)
    worker.wait_ready()
    print(worker._proc.pid, flush=True)
    time.sleep(600)
""")


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # neither gone nor a zombie
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_the_sweep_takes_its_worker_and_compile_processes_with_it(fake_env, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path / "w.log")],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while len(_children(parent.pid) - {worker_pid}) < 1:  # the compile process is up too
            assert time.monotonic() < deadline
            time.sleep(0.1)
        children = _children(parent.pid)
        assert worker_pid in children and len(children) >= 2
        # multiprocessing's resource tracker is no sweep process: it exits on its own
        tracked = {p for p in children if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()}
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in tracked) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in tracked if _alive(p)], "orphans left behind"
    finally:
        if parent.poll() is None:
            parent.kill()


# ----------------------------------------------------------------------- GPU
_TIMED_FIRST_CALLS = textwrap.dedent("""
    import json, sys, time
    import torch
    from mla_tune import problem
    from mla_tune.backends import get_backend
    from mla_tune.core import Shape, Variant

    out = {}
    for text, batch, kv_len in json.loads(sys.argv[1]):
        variant, shape = Variant.parse(text), Shape(batch, kv_len)
        if variant.get("q") == "fp8_static":
            variant = variant.with_params(q_amax=6.0)
        data = problem.generate_input(batch, kv_len, 0, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        get_backend(variant.backend).build(variant, shape, "cuda")(*data[:4])
        torch.cuda.synchronize()
        out[f"{text} at {shape}"] = time.perf_counter() - t0
        del data
    print(json.dumps(out))
""")


@pytest.mark.gpu
def test_after_the_pool_a_fresh_process_compiles_nothing_at_the_real_shapes(tmp_path, monkeypatch):
    """After the pool, a fresh process calling sampled candidates at their real shapes adds
    no Triton cache entry, and no first call (FlashInfer's JIT included) takes seconds."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    platform = gpu.detect(0)
    names = runnable_backends(("triton", "triton_fused", "flashinfer", "flashmla"))
    pairs = _candidates(LEADERBOARD, platform, names)
    ends = (Shape(4, 1024), Shape(256, 8192))  # every vendor variant at the smallest and largest shape
    sample = list(dict.fromkeys(
        pairs[::9] + [(v, s) for v, s in pairs if v.backend in ("flashinfer", "flashmla") and s in ends]))
    jobs = plan_jobs(sample, platform.sm_count)
    report = compile_pool.start(jobs, device_index=0, has_gpu=True, processes=8, job_timeout_s=300).wait()
    assert report.counts() == {"ok": len(jobs)}, report.errors()
    print(f"pool: {len(jobs)} jobs for {len(sample)} candidates in {report.elapsed_s:.1f} s")
    cache = tmp_path / "triton-cache"
    before = {p.name for p in cache.iterdir()}
    args = [[str(v), s.batch, s.kv_len] for v, s in sample]
    done = subprocess.run([sys.executable, "-c", _TIMED_FIRST_CALLS, json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first_calls = json.loads(done.stdout.strip().splitlines()[-1])
    new = {p.name for p in cache.iterdir()} - before
    assert not new, f"{len(new)} kernels compiled at the real shapes"
    slowest = sorted(first_calls.items(), key=lambda kv: -kv[1])[:5]
    print("slowest first calls (s):", slowest)
    assert slowest[0][1] < 3.0, slowest
