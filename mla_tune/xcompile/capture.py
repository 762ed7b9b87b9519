"""The Triton launches a candidate makes, captured from its backend's real launch path.

Each candidate is built with `backend.build(variant, shape, torch.device("meta"))` and called
once with meta tensors at the real shape (no memory, real storage sizes), while
`triton.runtime.jit.KernelInterface.__getitem__` records `(kernel, grid, args, kwargs)`
instead of launching. What the capture changes for a target it is not running on:
- fp8 caches are float8_e4m3fn, or float8_e4m3fnuz on gfx942 (what the leaderboard feeds
  it there; the split-K backend's `fp8_dtype_for` is made to say the same);
- an fp8_static variant gets q_amax 6.0 (the sweep calibrates it; only its value changes);
- gluon_fused is let past its "no sm_90 GPU / Triton 3.6 here" refusals (backend
  `unavailable_reason`, kernels `GD_UNAVAILABLE`) and told the target's SM count, so its
  launch is captured; whether it compiles with this Triton is the compile's answer.
Also captured, outside any plan: kernels/q_quant.py's quantizer (static, dynamic) and
range count at each batch, which FlashMLA's fp8 runners and the runtime's q check launch.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from unittest import mock

import torch
from triton.runtime.jit import JITFunction, KernelInterface

from mla_tune.backends import capabilities, get_backend
from mla_tune.core import NUM_HEADS, QK_DIM, Shape, Variant
from mla_tune.gpu import GpuFacts

STATIC_Q_AMAX = 6.0
META = torch.device("meta")


@dataclass
class Launch:
    kernel: object  # the JITFunction
    grid: object
    args: tuple
    kwargs: dict


@dataclass
class Item:
    """What one capture launched: a candidate at a shape, or a q_quant entry (backend
    "q_quant"); `error` says why the capture itself failed (then `launches` is empty)."""

    shape: Shape
    backend: str
    label: str
    launches: list
    error: str | None = None


def captured(backend: str) -> bool:
    """Whether the compile check captures and compiles `backend`'s candidates: its kernels
    compile on first use (CAPABILITIES.precompile) and are its own, not a vendor library's
    (no CAPABILITIES.vendor: the vendor builds and ships those). Today triton, triton_fused
    and gluon_fused; torch precompiles nothing, aiter, flashinfer and flashmla wrap vendors."""
    caps = capabilities(backend)
    return caps.precompile and not caps.vendor


def fp8_dtype(facts: GpuFacts) -> torch.dtype:
    return torch.float8_e4m3fnuz if facts.arch.startswith("gfx942") else torch.float8_e4m3fn


def meta_inputs(shape: Shape, fp8: torch.dtype):
    """(q, kv_data, qo_indptr, kv_indptr) on the meta device at `shape`, every KV format."""
    total = shape.total_kv
    kv_data = {
        "bf16": torch.empty((total, 1, QK_DIM), dtype=torch.bfloat16, device=META),
        "fp8": (torch.empty((total, 1, QK_DIM), dtype=fp8, device=META),
                torch.empty(1, dtype=torch.float32, device=META)),
        "mxfp4": (torch.empty((total, 1, QK_DIM // 2), dtype=torch.uint8, device=META),
                  torch.empty((total, 18), dtype=torch.uint8, device=META)),
    }
    q = torch.empty((shape.batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=META)
    indptr = torch.empty(shape.batch + 1, dtype=torch.int32, device=META)
    return q, kv_data, indptr, indptr


_JIT_OF: dict = {}


def as_jit(kernel):
    """The JITFunction of a launched kernel: itself, or under TRITON_INTERPRET (the tests'
    CPU interpreter) a JITFunction made from the interpreted one's function and jit
    arguments, for binding (compiling needs a process without the interpreter: check.py)."""
    if isinstance(kernel, JITFunction):
        return kernel
    if kernel.fn not in _JIT_OF:
        _JIT_OF[kernel.fn] = JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))
    return _JIT_OF[kernel.fn]


@contextlib.contextmanager
def recording(facts: GpuFacts):
    """Within: Triton launches are recorded into the yielded list instead of running, and
    the backends see the target as described in the module docstring."""
    launches: list[Launch] = []

    def getitem(kernel, grid):
        return lambda *args, **kwargs: launches.append(Launch(as_jit(kernel), grid, args, kwargs))

    import mla_tune.backends.gluon_fused as gluon_fused
    import mla_tune.backends.triton_splitk as triton_splitk
    import mla_tune.kernels.gluon_decode as gluon_decode

    fp8 = fp8_dtype(facts)
    patches = ((triton_splitk, "fp8_dtype_for", lambda device=None: fp8),
               (gluon_fused, "unavailable_reason", lambda: None),
               (gluon_fused, "device_sm_count", lambda device=None: facts.sm_count),
               (gluon_decode, "GD_UNAVAILABLE", None))
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(KernelInterface, "__getitem__", getitem))
        for module, name, value in patches:
            if hasattr(module, name):  # a name the module no longer has needs no stand-in
                stack.enter_context(mock.patch.object(module, name, value))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # kernels/launch.py's "cannot record" note: nothing ran
        yield launches


def capture_candidate(variant: Variant, shape: Shape, facts: GpuFacts, launches: list) -> Item:
    """The launches `variant` makes at `shape` (inside `recording`, whose list is `launches`)."""
    launches.clear()
    label = str(variant)
    if variant.get("q") == "fp8_static" and variant.get("q_amax") is None:
        variant = variant.with_params(q_amax=STATIC_Q_AMAX)
    try:
        runner = get_backend(variant.backend).build(variant, shape, META)
        runner(*meta_inputs(shape, fp8_dtype(facts)))
    except Exception as exc:  # reported as this candidate's capture error
        return Item(shape, variant.backend, label, [], f"capture failed: {type(exc).__name__}: {exc}")
    return Item(shape, variant.backend, label, list(launches))


def capture_q_quant(shape: Shape, facts: GpuFacts, launches: list) -> list[Item]:
    """kernels/q_quant.py's launches at `shape`'s batch: QQuantizer static and dynamic, and
    q_range_count (they do not depend on kv_len)."""
    from mla_tune.kernels.q_quant import QQuantizer, q_range_count

    fp8 = fp8_dtype(facts)
    batch = shape.batch
    q = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=META)
    items = []
    for label, run in (
        ("q_quant(q=fp8_static)", lambda: QQuantizer("fp8_static", batch, META, fp8, STATIC_Q_AMAX)(q)),
        ("q_quant(q=fp8_dynamic)", lambda: QQuantizer("fp8_dynamic", batch, META, fp8)(q)),
        ("q_quant(range_count)", lambda: q_range_count(q, STATIC_Q_AMAX,
                                                       torch.empty(1, dtype=torch.int64, device=META))),
    ):
        launches.clear()
        try:
            run()
            items.append(Item(shape, "q_quant", label, list(launches)))
        except Exception as exc:
            items.append(Item(shape, "q_quant", label, [], f"capture failed: {type(exc).__name__}: {exc}"))
    return items
