"""Recorded Triton launches, replayed without Triton's JIT launch path (host time only).

`fn[grid](*args, **kwargs)` costs tens of microseconds of host time per launch (binding,
specializing every argument, the cache key, the global-value check, launch metadata,
the hook chain), ~45 us on the H200's host. A decode step calls the same kernels once per
layer (61 in DeepSeek-V3) with the same arguments except the layer's q, KV cache and KV
scale, so the own serving runners record their launches at a step's first layer and make
only Triton's final launcher call for the others. A recorded region must launch all its
device work through `jit_launch`: a torch op in it would not be replayed.

Read in Triton 3.6.0 and 3.9.0 (runtime/jit.py `JITFunction.run`, compiler/compiler.py
`CompiledKernel`, backends/nvidia/driver.py `CudaLauncher`), whose JIT path ends in

    kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
               launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args.values())

and returns `kernel` (the CompiledKernel). `bound_args` holds every parameter of the
kernel in signature order, constexprs included, defaults applied. A replay makes that one
call with the recorded values (tensors as their addresses), the chosen tensors substituted,
the current stream, and no launch metadata or hooks (None: the launcher then calls no
hook). What stays correct:
- a substituted tensor must look like the one recorded to everything the compile and the
  recorded arguments specialized on: dtype, shape (the launchers derive ints such as
  total_q, the grid and the KV_OFF64 constexpr from shapes), strides, the 16-byte
  alignment of its data_ptr (Triton specializes pointers on it), and the device;
  otherwise `LaunchReplay.matches` is False and the caller takes the JIT path again;
- never under TRITON_INTERPRET (no compiled kernel), never while a launch hook is set (a
  profiler: those launches go through the JIT path, which calls it);
- if this Triton's JIT launch is not the call above (its source is checked once), nothing
  is recorded: one warning, and every launch stays on the JIT path.
Triton options read at a JIT launch (knobs.runtime.debug, instrumentation) are taken as
they were at recording: set them before the first step.

Exportable module (`_ln_` prefix for private names).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings

import triton
from triton.runtime.jit import JITFunction

from mla_tune.core import tensor_sig, tensor_sig_and_ptr

# JITFunction.run's binding and final launch, whitespace removed (Triton 3.6.0 and 3.9.0).
_ln_JIT_BIND = "bound_args,specialization,options=binder(*args,**kwargs)"
_ln_JIT_LAUNCH = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,"
                  "launch_metadata,knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,"
                  "*bound_args.values())")


@functools.lru_cache(maxsize=1)
def replay_unsupported() -> str | None:
    """Why this process cannot replay launches (None: it can); checked once."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set (the interpreter compiles nothing)"
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "launch_enter_hook"):
        return f"triton {triton.__version__} has no triton.knobs launch hooks"
    try:
        source = "".join(inspect.getsource(JITFunction.run).split())
    except (OSError, TypeError) as exc:
        return f"the source of triton {triton.__version__}'s JITFunction.run is not readable ({exc})"
    if _ln_JIT_BIND not in source or _ln_JIT_LAUNCH not in source:
        return (f"triton {triton.__version__}'s JITFunction.run does not launch as 3.6 / 3.9 do "
                "(kernel.run(grid, stream, function, packed_metadata, ..., *bound_args.values()))")
    return None


_ln_warned: set[str] = set()


def _ln_warn_once(reason: str) -> None:
    if reason not in _ln_warned:
        _ln_warned.add(reason)
        warnings.warn(f"mla_tune: Triton launches stay on the JIT path: {reason}", stacklevel=3)


def hooks_idle() -> bool:
    """No launch hook is set: Triton 3.6+ keeps them as HookChains (empty unless a profiler
    added one), older Triton as None or a callable."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class RecordedLaunch:
    """One JIT launch as `jit_launch` saw it: the compiled kernel, the grid and the bound
    argument values in the kernel's signature order."""

    __slots__ = ("compiled", "grid", "values", "get_stream", "device")

    def __init__(self, compiled, grid, values, get_stream, device):
        self.compiled, self.grid, self.values = compiled, grid, values
        self.get_stream, self.device = get_stream, device


def jit_launch(fn, grid, record, /, *args, **kwargs):
    """`fn[grid](*args, **kwargs)`, Triton's JIT launch; with `record` (a list) also appends
    what a replay needs: a RecordedLaunch, or None when this launch cannot be replayed
    (the interpreter, a callable grid, an unexpected Triton). Returns fn[grid]'s result."""
    compiled = fn[grid](*args, **kwargs)
    if record is not None:
        record.append(_ln_record(fn, grid, compiled, args, kwargs))
    return compiled


def _ln_record(fn, grid, compiled, args, kwargs) -> RecordedLaunch | None:
    reason = replay_unsupported()
    if reason is not None:
        if not reason.startswith("TRITON_INTERPRET"):  # CPU tests: expected, not worth a word
            _ln_warn_once(reason)
        return None
    # A pre-run hook (JITFunction.add_pre_run_hook) runs before each JIT launch: not replayed.
    if not isinstance(fn, JITFunction) or getattr(fn, "pre_run_hooks", None) or callable(grid) \
            or not 1 <= len(grid) <= 3:
        return None
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")) or hasattr(compiled, "result"):
        _ln_warn_once(f"fn[grid](...) returned a {type(compiled).__name__}, not a compiled kernel")
        return None
    # JITFunction.run's binder: every parameter in signature order, defaults applied; the
    # other keywords (num_warps, num_stages, ...) are compile options, not arguments.
    params = fn.signature.parameters
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    grid3 = (tuple(grid) + (1, 1))[:3]
    driver = triton.runtime.driver.active
    return RecordedLaunch(compiled, grid3, list(bound.arguments.values()), driver.get_current_stream,
                          driver.get_current_device())


class LaunchReplay:
    """A step's launches (recorded by jit_launch at its first layer), replayed for the next
    layers with new tensors in the places the recorded ones held (found by identity).

        replay = LaunchReplay.build(record, (q, kv, kv_scale))   # None: cannot replay
        if not replay.try_launch((q2, kv2, s2)):                 # False: nothing launched
            ...the JIT path...

    Tensor arguments reach the launcher as their data_ptr (an int), as the C launchers of
    Triton 3.6 / 3.9 accept for pointers (getPointer / extractPointer take an int as the
    address); a tensor instead costs a data_ptr call and a cuPointerGetAttribute per
    pointer, whose check that the memory is the GPU's `try_launch` makes once (the device
    index of each substituted tensor). The recorded tensors are kept, so their addresses
    stay theirs; a caller that keeps a replay across steps must see that its fixed tensors
    are the same objects at the same addresses (kernels/serving_runner.OwnServingStep does).
    """

    __slots__ = ("sigs", "launches", "get_stream", "device", "kept")

    def __init__(self, sigs, launches, get_stream, device, kept):
        self.sigs, self.launches, self.get_stream, self.device = sigs, launches, get_stream, device
        self.kept = kept  # the recorded launches: their tensors stay alive

    @classmethod
    def build(cls, record: list, tensors: tuple) -> LaunchReplay | None:
        """None when a launch was not recordable, when a tensor of `tensors` reached a launch
        other than as itself (a view of it would keep the recorded layer's data), or when
        none of them reached any launch."""
        if not record or any(r is None for r in record) or any(r.device != record[0].device for r in record):
            return None
        bases = {t.untyped_storage().data_ptr() for t in tensors if t is not None}
        launches, found = [], set()
        for rec in record:
            values, subs = list(rec.values), []
            for i, value in enumerate(values):
                slot = next((s for s, t in enumerate(tensors) if value is t and t is not None), None)
                if slot is not None:
                    subs.append((i, slot))
                    found.add(slot)
                elif hasattr(value, "untyped_storage"):
                    if value.untyped_storage().data_ptr() in bases:
                        return None  # a view of a substituted tensor: it would not follow the layer
                    values[i] = value.data_ptr()
            c = rec.compiled
            launches.append((c.run, rec.grid, c.function, c.packed_metadata, values, tuple(subs)))
        if not found:
            return None
        return cls(tuple(tensor_sig(t) for t in tensors), launches, record[0].get_stream, record[0].device,
                   tuple(record))

    def matches(self, tensors: tuple) -> bool:
        """The tensors look as the recorded ones did to the compile and the recorded
        arguments (core.tensor_sig), and no launch hook is set."""
        return tuple(map(tensor_sig, tensors)) == self.sigs and hooks_idle()

    def try_launch(self, tensors: tuple) -> bool:
        """If `matches(tensors)`: launch every recorded kernel on the current stream with
        `tensors` in their places and return True; else launch nothing and return False.
        Graph capture records these launches as it does the JIT's: the capture stream is
        the current stream."""
        ptrs = []
        for t, sig in zip(tensors, self.sigs, strict=True):
            if t is None:
                if sig is not None:
                    return False
                ptrs.append(None)
                continue
            now, ptr = tensor_sig_and_ptr(t)
            if now != sig:
                return False
            ptrs.append(ptr)
        if not hooks_idle():
            return False
        stream = self.get_stream(self.device)
        for run, (g0, g1, g2), function, packed, values, subs in self.launches:
            for i, slot in subs:
                values[i] = ptrs[slot]
            run(g0, g1, g2, stream, function, packed, None, None, None, *values)
        return True
