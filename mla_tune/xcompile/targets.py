"""A captured launch bound for a target GPU and compiled for it, as Triton's JIT would.

`bind` reproduces `JITFunction.run`'s path up to the compile with the TARGET's backend
(`make_backend(GPUTarget(...))`) instead of the active driver's: the target's binder
specializes every argument (16-byte alignment, and on AMD the buffer-op pointer range of a
tensor whose storage is at most 2 GiB), `_pack_args` makes the signature, constexprs,
attributes and options, and `triton.compile(ASTSource(...), target=..., options=...)`
compiles them (GluonASTSource for a Gluon kernel, as its JIT does). HIP-only launch
options (waves_per_eu, matrix_instr_nonkdim, kpack) are dropped for CUDA, where
candidates() never adds them. Read in Triton 3.6.0 and 3.9.0;
3.6's knobs have no `fpsan_homomorphic_casts`, which is passed only where it exists.

A binary's key is the SHA-256 of the Triton version, the target, the source's hash (the
kernel and every function it calls, its signature, constexprs and attributes) and the
options' hash: what Triton's own cache keys on, plus its version.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from mla_tune.gpu import GpuFacts
from mla_tune.xcompile.resources import amd_resources, cuda_resources

HIP_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
RESOURCES_VERSION = 1  # bump when resources.py reads a field differently: cached records go stale


def target_for(facts: GpuFacts) -> GPUTarget:
    """Triton's compile target of a GPU: ("hip", "gfx950", 64) or ("cuda", 90, 32)."""
    arch = facts.arch.split(":")[0]
    if facts.is_hip:
        return GPUTarget("hip", arch, facts.warp_size)
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise ValueError(f"{facts.device_name}: arch {facts.arch!r} is not an sm_NN CUDA arch")
    return GPUTarget("cuda", int(arch[3:]), facts.warp_size)


@dataclass
class Bound:
    """One launch bound for a target: what triton.compile takes, its key, and what the
    launch passes besides the binary (grid and plain argument values)."""

    name: str
    src: ASTSource
    options: object
    target: GPUTarget
    key: str
    launch: tuple  # (grid, the non-tensor, non-constexpr argument values)


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return type(value).__name__


def _binding(kernel, args: tuple, kwargs: dict, target: GPUTarget):
    backend = make_backend(target)
    kw = dict(kwargs)
    kw.update(debug=bool(kw.get("debug", getattr(kernel, "debug", None))), instrumentation_mode="")
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9, not 3.6
        kw["fpsan_homomorphic_casts"] = False
    if target.backend == "cuda":
        for name in HIP_ONLY_OPTIONS:
            kw.pop(name, None)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3.9's TRITON_DEFAULT_FP_FUSION notice, on every bind
        bound, specialization, options = binder(*args, **kw)
    return backend, kw, bound, specialization, options


def specialization(kernel, args: tuple, kwargs: dict, target: GPUTarget) -> list:
    """What the target's binder makes of each argument: (type, attribute) per parameter."""
    return _binding(kernel, args, kwargs, target)[3]


def bind(kernel, grid, args: tuple, kwargs: dict, target: GPUTarget) -> Bound:
    """Bind one captured launch `kernel[grid](*args, **kwargs)` for `target`."""
    backend, kw, bound, specialization, options = _binding(kernel, args, kwargs, target)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # as GluonJITFunction.create_binder does
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(kernel, signature, constexprs, attrs)
    parts = [triton.__version__, repr(target), src.hash(), options.hash(), str(RESOURCES_VERSION)]
    text = "|".join(parts + ([source.__name__] if source is not ASTSource else []))
    key = hashlib.sha256(text.encode()).hexdigest()
    if callable(grid):
        grid = grid(bound)
    constexpr_names = {kernel.params[i].name for i in range(len(kernel.params)) if kernel.params[i].is_constexpr}
    values = tuple(_plain(v) for name, v in bound.items()
                   if name not in constexpr_names and not hasattr(v, "data_ptr"))
    return Bound(kernel.fn.__name__, src, options, target, key, (tuple(grid), values))


@contextlib.contextmanager
def _stderr_to(path: str):
    """The process's fd 2 into `path` (MLIR's diagnostics are written there by C++)."""
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def first_error_line(exc: BaseException, stderr: str) -> str:
    """The compiler's first error line: MLIR's first `error:` diagnostic, else the
    exception's own last line (a front-end CompilationError ends with its cause)."""
    for line in stderr.splitlines():
        if "error:" in line:
            return line.strip()
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def compile_binary(b: Bound):
    """triton.compile of a bound launch for its target (the compiled kernel: asm, metadata)."""
    return triton.compile(b.src, target=b.target, options=b.options.__dict__)


def compile_bound(b: Bound, lds_limit: int) -> dict:
    """Compile `b` (in a fresh Triton cache, so ptxas's log is written) and read what the
    binary uses; a compile error is a record with ok False and the first error line."""
    t0 = time.monotonic()
    record = {"key": b.key, "kernel": b.name, "triton": triton.__version__,
              "target": f"{b.target.backend}:{b.target.arch}", "ok": False, "error": None}
    with tempfile.TemporaryDirectory(prefix="mla-tune-xc-") as tmp:
        env = {"TRITON_CACHE_DIR": os.path.join(tmp, "cache"), "TRITON_DUMP_PTXAS_LOG": "1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        out, err_path = io.StringIO(), os.path.join(tmp, "stderr")
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(out), _stderr_to(err_path):
                warnings.simplefilter("ignore")
                compiled = compile_binary(b)
        except Exception as exc:  # the compiler's error is the result, not a crash
            with open(err_path) as f:
                record["error"] = first_error_line(exc, f.read())
            record["compile_s"] = round(time.monotonic() - t0, 2)
            return record
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    meta = compiled.metadata
    shared, warps = int(getattr(meta, "shared", 0) or 0), int(meta.num_warps)
    arch = f"sm_{b.target.arch}" if b.target.backend == "cuda" else b.target.arch
    if b.target.backend == "hip":
        record.update(amd_resources(compiled.asm["amdgcn"], shared, warps, arch))
    else:
        record.update(cuda_resources(out.getvalue(), compiled.asm["ptx"], shared, warps, arch))
    record.update(ok=True, over_lds=shared > lds_limit, compile_s=round(time.monotonic() - t0, 2))
    return record
