"""The serving sweep's correctness gate: each candidate once per family, on two probes.

A serving kernel does not change with the batch or the lengths (they are read on the
device; the grid is sized from maxima), so one gate per (family, candidate) stands for
every cell of the family. The probes, against mla_tune.serving.reference (fp32; with
`reference_q: exact`, bf16 q: the exact answer, so a q quantization counts as the kernel's
error):
- ragged: the config's kv lengths (1, 17, 63, 64, 65 and a tail such as 3000: one token,
  tile and page edges, a long sequence beside short ones), q_len cycling down from the
  family's max where the family mixes q_lens (else every sequence at the max, kv lengths
  raised to it);
- tail: a uniform batch at a length that ends inside a tile, a page and a split.
(`reference_q: variant` instead quantizes the reference's q as the candidate's q mode does,
the convention of scripts/engine_loop.py: per tensor, or as its backend's
serving_q_reference hook says (reference_q_format); the gate then judges the kernel, not the
price of its q mode.) Each must keep the failing share under margin x the rule's allowance (problem.check).

Gating compiles every kernel, so with `workers` > 0 it runs in that many of the sweep's
killable worker processes (tune/pool.py's TaskPool over tune/worker.py; Triton's disk
cache then serves the timing): each worker gates one candidate at a time, so a crash, a
hang past the limit or a lost CUDA context costs only its own candidate, recorded with
the reason, and a fresh worker takes the next.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from triton.errors import TritonError

from mla_tune import problem
from mla_tune.backends import get_backend
from mla_tune.core import CallSpec, Variant
from mla_tune.problem import Rule
from mla_tune.serving.config import GateSpec
from mla_tune.serving.inputs import ServingInput, make_input
from mla_tune.tune.pool import Outcome, TaskPool
from mla_tune.tune.worker import Task

# What building or running a candidate may raise that judges the candidate, not the sweep:
# a refusal (ValueError), a CUDA or vendor error (RuntimeError, torch.OutOfMemoryError
# included), a Triton compile or resource error, an assertion in a kernel launcher, a
# vendor library that does not import.
RUN_ERRORS = (ValueError, RuntimeError, TritonError, AssertionError, ImportError)


@dataclass(frozen=True)
class GateJob:
    spec: CallSpec
    variant: str
    gate: GateSpec
    rule: Rule
    device: str


def error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def probe_lengths(spec: CallSpec, gate: GateSpec) -> list[tuple[str, list[int], list[int], int]]:
    """(label, q_lens, kv_lens, seed) of the two probes for a family."""
    top = spec.max_q_len
    if spec.mixed_q_len:
        ragged_kv = list(gate.ragged_kv_lens)
        ragged_q = [min(top - i % top, n) for i, n in enumerate(ragged_kv)]
    else:
        ragged_kv = [max(n, top) for n in gate.ragged_kv_lens]
        ragged_q = [top] * len(ragged_kv)
    tail_kv = [max(gate.tail_kv_len, top)] * gate.tail_batch
    return [("ragged", ragged_q, ragged_kv, gate.seeds[0]),
            ("tail", [top] * gate.tail_batch, tail_kv, gate.seeds[1])]


@functools.lru_cache(maxsize=2)
def _probe_inputs(spec: CallSpec, gate: GateSpec, device: str) -> tuple[tuple[str, ServingInput], ...]:
    """A family's probe inputs, made once per process."""
    return tuple((label, make_input(q_lens, kv_lens, spec.heads, spec.page_size, spec.kv_format,
                                    seed=seed, device=device))
                 for label, q_lens, kv_lens, seed in probe_lengths(spec, gate))


# What a backend's serving_q_reference hook may answer: the q formats of serving.reference
# that need no calibration (fp8_static's q_amax is the variant's, not the gate's).
HOOK_Q_FORMATS = ("bf16", "fp8", "fp8_row")


def reference_q_format(variant: Variant, gate: GateSpec) -> str:
    """The q the gate's reference reads: bf16, the exact answer (reference_q: exact, and any
    variant with bf16 q), or q quantized as the variant's q mode does (reference_q: variant):
    then the gate judges the kernel, not the price of its q mode. An fp8 q mode is read as
    its backend's optional `serving_q_reference(variant)` hook says (gluon_fused's and
    triton_fused's answer fp8_row: their kernels quantize q per (new token, head) row),
    else per tensor ("fp8", problem.quantize_fp8's scale, the convention of the vendor
    tests)."""
    if gate.reference_q != "variant":
        return "bf16"
    return variant_q_format(variant)


def variant_q_format(variant: Variant) -> str:
    """The q format of serving.reference that reads q as `variant`'s q mode quantizes it:
    bf16 for bf16 q; for an fp8 q mode its backend's `serving_q_reference(variant)` hook's
    answer, else "fp8" (per tensor). What reference_q: variant gates against, and what
    scripts/engine_loop.py checks a step against."""
    if not str(variant.get("q", "bf16")).startswith("fp8"):
        return "bf16"
    hook = getattr(get_backend(variant.backend), "serving_q_reference", None)
    if hook is None:
        return "fp8"
    q_format = hook(variant)
    if q_format not in HOOK_Q_FORMATS:
        raise ValueError(f"backend {variant.backend!r}: serving_q_reference({variant}) returned {q_format!r}; "
                         f"it must return one of {', '.join(HOOK_Q_FORMATS)} (serving.inputs.Q_FORMATS)")
    return q_format


@functools.lru_cache(maxsize=4)
def _references(spec: CallSpec, gate: GateSpec, device: str, q_format: str) -> tuple[torch.Tensor, ...]:
    """The probes' fp32 references, q read as q_format, at the family's softmax scale."""
    return tuple(inp.reference(q_format, sm_scale=spec.sm_scale) for _, inp in _probe_inputs(spec, gate, device))


def run_call(runner, inp: ServingInput) -> torch.Tensor:
    """One serving call of `runner` on `inp`, lengths on the host too (backends that plan
    there need them; the others ignore them)."""
    return runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout,
                  q_lens_host=inp.q_lens, kv_lens_host=inp.kv_lens)


# Errors after which the CUDA context is lost: nothing else runs in that process.
POISON_MARKERS = ("CUDA error", "illegal memory access", "HIP error", "device-side assert",
                  "unspecified launch failure")


def poisons_context(exc: BaseException) -> bool:
    return type(exc).__name__ == "AcceleratorError" or any(m in str(exc) for m in POISON_MARKERS)


def gate_one(job: GateJob) -> dict:
    """The gate record's fields for one (family, candidate): ok, reason, checks, seconds,
    and poisoned (the CUDA context of this process is lost)."""
    start = time.perf_counter()
    variant = Variant.parse(job.variant)
    checks = []

    def outcome(ok: bool, reason: str, poisoned: bool = False) -> dict:
        out = {"ok": ok, "reason": reason, "checks": checks, "seconds": round(time.perf_counter() - start, 3)}
        return {**out, "poisoned": True} if poisoned else out

    try:
        runner = get_backend(variant.backend).build_serving(variant, job.spec, job.device)
        refs = _references(job.spec, job.gate, job.device, reference_q_format(variant, job.gate))
        for (label, inp), ref in zip(_probe_inputs(job.spec, job.gate, job.device), refs, strict=True):
            result = problem.check(run_call(runner, inp), ref, job.rule, margin=job.gate.margin)
            checks.append({"probe": label, "mismatch": round(result.mismatch, 6),
                           "max_abs_err": round(min(result.max_abs_err, 1e30), 6)})
            if not result.passed:
                return outcome(False, f"{label} probe: {result.reason}")
    except RUN_ERRORS as exc:
        return outcome(False, error_text(exc), poisons_context(exc))
    return outcome(True, "ok")


def gate_task(context, job: GateJob) -> dict:
    """gate_one in a worker process (a tune/worker.py Task): a lost CUDA context ends the
    worker after it answers."""
    out = gate_one(job)
    if out.pop("poisoned", False):
        context.restart = True
    return out


class ContextLost(RuntimeError):
    """The sweep's own CUDA context is lost (gating in-process): rerun to resume."""


# A gate builds and compiles one candidate and runs two small probes: minutes at most,
# unless it hangs (a kernel waiting on itself); then its worker is killed at this limit.
GATE_TIMEOUT_S = 600.0


def run_gates(jobs: list[GateJob], workers: int, stop: Callable[[], bool] = lambda: False,
              log_stem: Path | None = None,
              timeout_s: float | Callable[[], float] = GATE_TIMEOUT_S) -> Iterator[tuple[GateJob, dict]]:
    """(job, outcome) for each job, as they finish: in this process (workers 0; a job
    that loses the CUDA context is reported, then ContextLost is raised), or in a TaskPool
    of `workers` worker processes (logs at `log_stem`.worker-I.log, by default in the
    temporary folder). A job whose worker dies is recorded as crashed, one past
    `timeout_s` as a timeout; the others go on. `stop()` true: no further job starts."""
    if workers <= 0:
        for job in jobs:
            if stop():
                return
            out = gate_one(job)
            yield job, out
            if out.get("poisoned"):
                raise ContextLost(f"the CUDA context was lost gating {job.variant} ({out['reason']}); "
                                  "its gate is recorded as failed: run the sweep again to resume")
        return
    if log_stem is None:
        log_stem = Path(tempfile.gettempdir()) / f"mla-tune-gate-{os.getpid()}"
    tasks = [Task("mla_tune.serving.gate:gate_task", (job,)) for job in jobs]
    with TaskPool(min(workers, max(1, len(jobs))), log_stem, device_index(jobs[0].device) if jobs else 0) as pool:
        for index, outcome in pool.run(tasks, timeout_s, stop):
            yield jobs[index], (outcome.value if outcome.status == "ok" else _lost(outcome))


def _lost(outcome: Outcome) -> dict:
    """The gate record of a job that did not answer (its worker crashed or hung) or whose
    gate function raised."""
    what = {"crashed": "crashed: ", "timeout": "timeout: "}.get(outcome.status, "")
    out = {"ok": False, "reason": f"{what}{outcome.error}", "checks": [], "seconds": 0.0}
    if outcome.tail:
        out["stderr_tail"] = outcome.tail
    return out


def device_index(device: str) -> int:
    """The GPU index of a device text ("cuda:1" -> 1; "cuda", "cpu" -> 0)."""
    _, _, index = str(device).partition(":")
    return int(index) if index.isdigit() else 0
