"""One measurement of the serving sweep: a candidate's serving call at a cell, timed.

A `MeasureJob` says everything the measurement needs (the family's CallSpec, the cell's
lengths and input seed, the variant, the samples, a probe's pruning bound), so it runs
the same in either place:
- in a worker process of tune/worker.py (`measure_task`, a Task), the default: a
  candidate that crashes, hangs or loses the CUDA context costs only its own step; the
  timer and the probe are named ("mla_tune.tune.timing:time_call"), as a fresh process
  imports them;
- in the sweep's own process (`measure`), with the timer and the probe passed as
  callables: the tests' made-up timers, which read a TimedCall's variant and cell.
Either way the worker (or the sweep) keeps one cell's input at a time, made once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from mla_tune.backends import get_backend
from mla_tune.core import CallSpec, Variant
from mla_tune.serving.gate import RUN_ERRORS, error_text, poisons_context, run_call
from mla_tune.serving.inputs import ServingInput, make_input
from mla_tune.serving.table import FamilyKey
from mla_tune.tune import timing
from mla_tune.tune.worker import resolve

# At a cell's first rung, a candidate whose one-call probe is over this many times the best
# median measured so far in the cell is recorded as pruned instead of timed: on the H200 a
# 128-head cell's slowest own candidates ran 35 ms against FlashMLA's 0.27 ms, and their
# warm-up, wall-time and samples were most of the sweep's time (docs/perf.md).
PRUNE_FACTOR = 4.0

# The timers by name, for a worker process: the leaderboard protocol on a GPU, the CPU
# stand-in without one; the probe (GPU only) is this module's event_probe.
GPU_TIMER = "mla_tune.tune.timing:time_call"
CPU_TIMER = "mla_tune.tune.timing:cpu_time"
GPU_PROBE = "mla_tune.serving.measure:event_probe"
MEASURE_TASK = "mla_tune.serving.measure:measure_task"


@dataclass
class TimedCall:
    """What the timer times: one serving call of `variant` at a cell. Tests' timers read
    variant, family, batch and kv_len to return made-up times. `layers`: the calls one
    timing runs (1; a LayeredStep's N), which `layer_timer` divides by."""

    layers: ClassVar[int] = 1

    variant: Variant
    family: FamilyKey
    batch: int
    kv_len: int
    runner: Callable
    inp: ServingInput

    def __call__(self):
        return run_call(self.runner, self.inp)


# The most KV copies a LayeredStep's layers take (layer_copies)
LAYERED_KV_BYTES = 32 << 30


def layer_copies(inp: ServingInput, layers: int) -> tuple[list, list]:
    """(qs, kvs): `layers` copies of the input's q and KV cache, one per layer of a step (an
    engine's layers each read their own cache); refused past LAYERED_KV_BYTES (a ValueError:
    a measurement records it as its failure)."""
    need = layers * inp.kv.nbytes
    if need > LAYERED_KV_BYTES:
        raise ValueError(f"{layers} layers need {need / 2**30:.1f} GiB of KV copies, over "
                         f"{LAYERED_KV_BYTES >> 30} GiB: give fewer layers or shorter lengths")
    return [inp.q.clone() for _ in range(layers)], [inp.kv.clone() for _ in range(layers)]


class LayeredStep:
    """One decode step of a TimedCall's runner as an engine runs it: the step's shared work
    once (serving/call.runner_step, here, when it is made), then each layer over its own copy
    of q and of the KV cache (`copies`: layer_copies'), back to back, its output copied out
    (as the next op reads it). Calling it runs the step: on a GPU a CUDA graph of the layers,
    captured here and replayed; on the CPU the layers themselves. `out`: the last layer's
    output; `layers`: how many; the TimedCall's variant, family, batch, kv_len, runner and inp
    as its own (the timers and checks read them). A timer's figure over it, divided by
    `layers` (`per_layer`), is a layer's time in a step: timing.time_call flushes the L2
    before each step, as the rest of a model's step would; the layers run back to back."""

    def __init__(self, call: TimedCall, copies: tuple[list, list], device: str):
        from mla_tune.serving.call import runner_step
        from mla_tune.serving.inputs import capture_without_sync

        self.variant, self.family, self.batch, self.kv_len = call.variant, call.family, call.batch, call.kv_len
        self.runner, self.inp = call.runner, call.inp
        self._qs, self._kvs = copies
        self.layers, self._scale = len(self._qs), self.inp.kv_scale
        self._layer = runner_step(self.runner, self.inp.qo_indptr, **self.inp.layout, q_lens_host=self.inp.q_lens,
                                  kv_lens_host=self.inp.kv_lens)
        got = self._layer(self._qs[0], self._kvs[0], self._scale)
        got = got[0] if isinstance(got, tuple) else got
        self.out = torch.empty_like(got).copy_(got)
        self._graph = capture_without_sync(self._step) if str(device) != "cpu" else None

    def _step(self) -> None:
        for q, kv in zip(self._qs, self._kvs, strict=True):
            got = self._layer(q, kv, self._scale)
            self.out.copy_(got[0] if isinstance(got, tuple) else got)

    def __call__(self):
        if self._graph is not None:
            self._graph.replay()
        else:
            self._step()
        return self.out


def as_step(call: TimedCall, copies: tuple[list, list] | None, device: str) -> TimedCall | LayeredStep:
    """`call` as the protocol times it: a LayeredStep over `copies` (layer_copies') where
    given (search.step_layers), else the call itself."""
    return LayeredStep(call, copies, device) if copies is not None else call


def per_layer(t: timing.Timing, layers: int) -> timing.Timing:
    """A step's timing as one of its `layers` layers' (every figure over `layers`)."""
    return timing.Timing(t.median_us / layers, t.p10_us / layers, t.p90_us / layers, t.samples)


def layer_timer(timer: Callable) -> Callable:
    """`timer` (timer(call, samples) -> Timing) per layer: a LayeredStep's figures over its
    layers, a TimedCall's as they are."""
    def timed(call, samples: int) -> timing.Timing:
        return per_layer(timer(call, samples), call.layers)
    return timed


def event_probe(call) -> float:
    """One warm call's GPU time (us) by CUDA events: no L2 flush (a warm cache flatters the
    candidate, so a pruning decision errs towards keeping it) and no host time: a sleep
    queued ahead covers twice the warm call's host time (at most 5 ms: a first call that
    compiled), so the start event fires with the call's kernels already queued. Without it
    a vendor's host-side schedule (FlashMLA's metadata, FlashInfer's plan: 100-200 us) sat
    inside the probe, and the sweep of 2026-11-30 pruned FlashMLA and FlashInfer (over 4x
    the best) in cells they win."""
    t0 = time.perf_counter()
    call()
    host_us = (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timing.hold_gpu(min(max(100.0, 2.0 * host_us), 5000.0))
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


@dataclass(frozen=True)
class MeasureJob:
    """One step: `variant` at the cell (family, batch, kv_len) on inputs of `kv_lens`
    (seed `seed`), `samples` samples; with `prune_over`, a probe first, and pruned when
    one call takes longer (us). `timer` and `probe` name the functions a worker uses. With
    `layers`, the probe and the samples time a LayeredStep of that many layers, per layer."""

    spec: CallSpec
    family: FamilyKey
    batch: int
    kv_len: int
    kv_lens: tuple[int, ...]
    seed: int
    variant: str
    samples: int
    device: str
    prune_over: float | None = None
    timer: str = CPU_TIMER
    probe: str = ""
    layers: int = 0  # > 0: timed as a layer of a LayeredStep of this many (search.step_layers)


def cell_input(job: MeasureJob, cache: dict) -> ServingInput:
    """The cell's input, made once and kept until another cell's is asked for (the large
    ones take GBs: one at a time)."""
    cell = (job.family, job.batch, job.kv_len, job.kv_lens, job.seed)
    if cache.get("cell") != cell:
        cache.clear()
        key = job.family
        cache["input"] = make_input([key.q_len] * job.batch, list(job.kv_lens), key.heads, key.page_size,
                                    key.kv_format, seed=job.seed, device=job.device)
        cache["cell"] = cell
    return cache["input"]


def measure(job: MeasureJob, cache: dict, timer: Callable, probe: Callable | None) -> dict:
    """The step record's outcome: status ok with `time`, pruned with `probe_us` and a
    reason, or failed with `error` (plus `poisoned` when the error lost the CUDA context)."""
    variant = Variant.parse(job.variant)
    try:
        runner = get_backend(variant.backend).build_serving(variant, job.spec, job.device)
        inp = cell_input(job, cache)
        if job.layers and len(cache.get("copies", ([], []))[0]) != job.layers:
            cache["copies"] = layer_copies(inp, job.layers)  # the cell's, for its candidates
        call = as_step(TimedCall(variant, job.family, job.batch, job.kv_len, runner, inp),
                       cache["copies"] if job.layers else None, job.device)
        if job.prune_over is not None and probe is not None:
            probe_us = probe(call) / call.layers
            if probe_us > job.prune_over:
                what = "one call" if call.layers == 1 else "a layer of the step"
                return {"status": "pruned", "probe_us": round(probe_us, 3),
                        "reason": f"{what} took {probe_us:.1f} us, over {PRUNE_FACTOR:g}x the cell's best so far"}
        return {"status": "ok", "time": layer_timer(timer)(call, job.samples).as_dict()}
    except RUN_ERRORS as exc:
        out = {"status": "failed", "error": error_text(exc)}
        if poisons_context(exc):
            out["poisoned"] = True
        elif type(exc).__name__ == "OutOfMemoryError":
            cache.clear()
            torch.cuda.empty_cache()
        return out


def measure_task(context, job: MeasureJob) -> dict:
    """measure() in a worker process (a tune/worker.py Task): the timer and probe by name,
    the worker's cache for the cell's input; a lost CUDA context ends the worker after it
    answers."""
    cache = context.cache.setdefault("serving_cell", {})
    out = measure(job, cache, resolve(job.timer), resolve(job.probe) if job.probe else None)
    if out.pop("poisoned", False):
        context.restart = True
    return out
