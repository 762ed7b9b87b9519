"""The precompile pool: kernels compiled and vendor JITs built before the timed workers
need them, so that a timed worker loads each one from an on-disk cache.

What a backend says (optional members of its module, see backends/__init__.py):
- `CAPABILITIES.precompile`: its kernels are compiled on first use into an on-disk cache
  (Triton, FlashInfer's and AITER's JITs), so warming them in a pool pays (the config's
  per-backend `precompile` flag defaults to it).
- `compile_shape(variant, shape, sm_count) -> Shape`: a small stand-in for `shape` that
  compiles exactly the kernels `shape` uses. Absent: `default_compile_shape`.
- `warmup(variant, shape, device, inputs)`: what warms its caches. Absent: build the
  variant at the stand-in shape and call it once on `inputs` (that shape's inputs).

The pool is a few spawned processes fed one job at a time. Each job has its own time limit:
a job that hangs is killed with its process, one that kills its process is recorded as
crashed, and a fresh process takes the next job, so one bad job costs only itself.
`start(jobs)` returns at once (the sweep starts its timed workers meanwhile);
`handle.wait(deadline)` returns a `CompileReport` with each job's status and seconds.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.backends import get_backend
from mla_tune.core import QK_DIM, Shape, Variant
from mla_tune.tune.procs import die_with_parent

# A placeholder q scale for fp8_static variants: the kernel takes the scale as a float
# argument, which Triton never specializes, so any value compiles the same kernel.
_PLACEHOLDER_Q_AMAX = 6.0
# ROCm Triton marks a pointer whose storage fits in 2 GiB ("buffer ops", AMD backend's
# is_within_2gb); a stand-in for a larger cache must keep its cache in a larger storage.
_HIP_BUFFER_LIMIT = 2**31 - 1
# Bytes per KV token of each format in the leaderboard's kv_data (problem.kv_data).
_KV_BYTES_PER_TOKEN = {"bf16": 2 * QK_DIM, "fp8": QK_DIM, "mxfp4": QK_DIM // 2}
START_TIMEOUT_S = 180.0  # a compile process's start: import torch and triton, start CUDA
_START_FAILURES_ALLOWED = 3  # consecutive processes that never started before giving up
_INPUTS_KEPT = 4  # stand-in inputs a process keeps for its next jobs
# A stand-in over this many KV tokens (a backend whose stand-in is the real shape: GBs of
# inputs) is the only input a process keeps.
_SMALL_INPUT_TOKENS = 1 << 16


# --------------------------------------------------------------------------- plan
def default_compile_shape(shape: Shape) -> Shape:
    """A stand-in in the same Triton specialization class per dimension (== 1, a multiple
    of 16, other), for backends that do not say better: integer launch arguments derived
    from batch or kv_len then specialize alike. kv_len 64 keeps 64-token pages whole."""

    def standin(n: int, multiple_of_16: int, other: int) -> int:
        return 1 if n == 1 else multiple_of_16 if n % 16 == 0 else other

    return Shape(standin(shape.batch, 16, 2), standin(shape.kv_len, 64, 17))


def compile_shape_for(shape: Shape, variant: Variant | str | None = None,
                      sm_count: int | None = None) -> Shape:
    """The stand-in shape that compiles what `variant` uses at `shape` (the backend's
    `compile_shape`, else the class-preserving default). sm_count: the GPU's SM count
    (None when unknown: a backend whose kernels depend on it then returns `shape`)."""
    if variant is None:
        return default_compile_shape(shape)
    variant = Variant.parse(variant) if isinstance(variant, str) else variant
    hook = getattr(get_backend(variant.backend), "compile_shape", None)
    return hook(variant, shape, sm_count) if hook is not None else default_compile_shape(shape)


def _big_kv_formats(shape: Shape) -> tuple[str, ...]:
    """KV formats whose cache at `shape` exceeds ROCm Triton's 2 GiB buffer limit."""
    return tuple(f for f, n in _KV_BYTES_PER_TOKEN.items() if shape.total_kv * n > _HIP_BUFFER_LIMIT)


@dataclass(frozen=True)
class CompileJob:
    """One warm-up: `variant` at the stand-in `shape`, for the real shapes in `for_shapes`.
    big_kv: formats whose real cache exceeds 2 GiB (ROCm: kept in a large storage)."""

    variant: str
    shape: Shape
    for_shapes: tuple[Shape, ...] = ()
    big_kv: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.variant} at {self.shape}"


def plan_jobs(pairs, sm_count: int | None = None, hip: bool | None = None) -> list[CompileJob]:
    """One job per distinct (variant, stand-in) of the (variant, real shape) pairs, ordered
    by stand-in (neighbouring jobs share inputs), then variant. hip: whether Triton
    compiles for ROCm (default: this torch's build)."""
    hip = bool(torch.version.hip) if hip is None else hip
    jobs: dict[tuple, list[Shape]] = {}
    for variant, shape in pairs:
        variant = Variant.parse(variant) if isinstance(variant, str) else variant
        big = _big_kv_formats(shape) if hip else ()
        key = (str(variant), compile_shape_for(shape, variant, sm_count), big)
        jobs.setdefault(key, []).append(shape)
    return [
        CompileJob(text, standin, tuple(shapes), big)
        for (text, standin, big), shapes in sorted(
            jobs.items(), key=lambda kv: (kv[0][1].total_kv, kv[0][1].batch, kv[0][2], kv[0][0]))
    ]


# ------------------------------------------------------------------------ results
@dataclass
class JobResult:
    job: CompileJob
    status: str  # ok | failed | timeout | crashed | not_run
    error: str = ""
    elapsed_s: float = 0.0


@dataclass
class CompileReport:
    results: list[JobResult]
    elapsed_s: float  # from start() to the end of the pool, the whole of compile's cost
    processes: int
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def errors(self) -> dict[str, str]:
        """{"variant at shape": why} for every job that did not finish ok."""
        return {str(r.job): f"{r.status}: {r.error}" for r in self.results if r.status != "ok"}


# ------------------------------------------------------------------- the process
def _error_text(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:500]}{'...' if len(message) > 500 else ''}"


def default_warmup(variant: Variant, shape: Shape, device, inputs) -> None:
    """Build `variant` at `shape` and call it once: Triton compiles (or loads) its kernels,
    a vendor library JIT-builds (or loads) its module."""
    get_backend(variant.backend).build(variant, shape, device)(*inputs[:4])


def _rehome_large(kv_data: dict, big: tuple[str, ...], device) -> dict:
    """Put the `big` formats' caches at the start of a storage over 2 GiB, so ROCm Triton
    specializes their pointer as it does the real (larger) cache's."""
    out = dict(kv_data)
    for fmt in big:
        entry = kv_data[fmt]
        tensor = entry[0] if isinstance(entry, tuple) else entry
        storage = torch.empty(_HIP_BUFFER_LIMIT + 1, dtype=torch.uint8, device=device)
        moved = storage[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        out[fmt] = (moved, *entry[1:]) if isinstance(entry, tuple) else moved
    return out


def _inputs_for(job: CompileJob, device, kept: dict) -> tuple:
    key = (job.shape, job.big_kv)
    if key not in kept:
        while len(kept) >= _INPUTS_KEPT or kept and job.shape.total_kv > _SMALL_INPUT_TOKENS:
            kept.pop(next(iter(kept)))
        data = problem.generate_input(job.shape.batch, job.shape.kv_len, 0, device=device)
        if job.big_kv and torch.version.hip:
            data = (data[0], _rehome_large(data[1], job.big_kv, device), *data[2:])
        kept[key] = data
    return kept[key]


def run_job(job: CompileJob, device, kept: dict) -> None:
    """Warm one job's kernels in this process (raises what the backend raises)."""
    variant = Variant.parse(job.variant)
    if variant.get("q") == "fp8_static":
        variant = variant.with_params(q_amax=_PLACEHOLDER_Q_AMAX)
    hook = getattr(get_backend(variant.backend), "warmup", None) or default_warmup
    hook(variant, job.shape, device, _inputs_for(job, device, kept))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _compile_main(conn, device_index: int, has_gpu: bool, parent_pid: int, log_path: str | None) -> None:
    die_with_parent(parent_pid)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable()  # a segfault leaves a traceback in the log
    if has_gpu:
        torch.cuda.set_device(device_index)
    device = torch.device(f"cuda:{device_index}") if has_gpu else torch.device("cpu")
    kept: dict = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] != "job":
            return
        job = message[1]
        try:
            run_job(job, device, kept)
            conn.send(("done", "ok", ""))
        except Exception as exc:  # reported as this job's failure; the timed run says more
            conn.send(("done", "failed", _error_text(exc)))


# ------------------------------------------------------------------------ the pool
@dataclass
class _Slot:
    proc: mp.process.BaseProcess
    conn: object
    spawned_at: float
    ready: bool = False
    job: CompileJob | None = None
    job_started: float = 0.0


class CompileHandle:
    """A running pool: `done()`, `wait(deadline)`, `stop()`; see `start`."""

    def __init__(self, jobs: list[CompileJob], device_index: int, has_gpu: bool, processes: int,
                 job_timeout_s: float, log_path: Path | None, start_timeout_s: float):
        self.jobs = list(jobs)
        self.processes = max(1, min(processes, len(self.jobs) or 1))
        self._device_index = device_index
        self._has_gpu = has_gpu
        self._job_timeout_s = job_timeout_s
        self._log_path = str(log_path) if log_path else None
        self._start_timeout_s = start_timeout_s
        self._pending = deque(self.jobs)
        self._results: dict[CompileJob, JobResult] = {}
        self._notes: list[str] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._ended: float | None = None
        self._last_start_failure = ""
        # The manager thread starts every process, so they die with it (PR_SET_PDEATHSIG
        # fires when the starting thread exits): it outlives all of them.
        self._thread = threading.Thread(target=self._manage, name="mla-tune-compile", daemon=True)
        self._thread.start()

    # -- the caller's side
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, deadline: float | None = None) -> CompileReport:
        """Wait until every job has finished, or until time.monotonic() reaches `deadline`
        (then the pool is stopped and unfinished jobs are `not_run`)."""
        while self._thread.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._notes.append("stopped at the caller's deadline")
                self.stop()
                break
            self._thread.join(0.2 if left is None else min(0.2, left))
        return self.report()

    def finished(self) -> list[JobResult]:
        """The jobs finished so far (each names its variant and the real shapes it warmed),
        so the sweep can time those candidates while the rest compile."""
        return list(self._results.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> CompileReport:
        ended = self._ended if self._ended is not None else time.monotonic()
        results = [self._results.get(j) or JobResult(j, "not_run", "the pool stopped first") for j in self.jobs]
        return CompileReport(results, round(ended - self._started, 3), self.processes, list(self._notes))

    # -- the manager thread
    def _spawn(self) -> _Slot:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_compile_main, name="mla-tune-compile", daemon=True,
            args=(child, self._device_index, self._has_gpu, os.getpid(), self._log_path),
        )
        proc.start()
        child.close()
        return _Slot(proc, parent, time.monotonic())

    def _finish(self, slot: _Slot, status: str, error: str) -> None:
        job = slot.job
        self._results[job] = JobResult(job, status, error, round(time.monotonic() - slot.job_started, 4))
        slot.job = None

    @staticmethod
    def _kill(slot: _Slot) -> None:
        if slot.proc.is_alive():
            slot.proc.kill()
        slot.proc.join(10)
        slot.conn.close()

    def _manage(self) -> None:
        slots: list[_Slot] = []
        start_failures = 0
        try:
            while (self._pending or any(s.job for s in slots)) and not self._stop.is_set():
                busy = sum(1 for s in slots if s.job is not None)
                while len(slots) < min(self.processes, busy + len(self._pending)):
                    slots.append(self._spawn())
                for slot in slots:
                    if slot.ready and slot.job is None and self._pending:
                        slot.job, slot.job_started = self._pending.popleft(), time.monotonic()
                        try:
                            slot.conn.send(("job", slot.job))
                        except OSError:  # it has just died: _poll records the job as crashed
                            pass
                wait_connections([s.conn for s in slots] + [s.proc.sentinel for s in slots], 0.1)
                now = time.monotonic()
                for slot in list(slots):
                    gone = self._poll(slot, now)
                    if gone is None:
                        continue
                    slots.remove(slot)
                    self._kill(slot)
                    if gone == "never started":
                        start_failures += 1
                    if start_failures >= _START_FAILURES_ALLOWED:
                        reason = (f"{start_failures} compile processes in a row did not start (the last: "
                                  f"{self._last_start_failure}){self._log_hint()}")
                        self._notes.append(reason)
                        while self._pending:
                            job = self._pending.popleft()
                            self._results[job] = JobResult(job, "not_run", reason)
                    elif gone == "started":
                        start_failures = 0
        except Exception as exc:  # the pool's own failure: every job left is reported not_run with it
            self._notes.append(f"the compile pool stopped on {_error_text(exc)}")
            raise
        finally:
            for slot in slots:
                if slot.job is not None:
                    self._finish(slot, "not_run", "the pool was stopped while it ran")
                self._kill(slot)
            self._ended = time.monotonic()

    def _poll(self, slot: _Slot, now: float) -> str | None:
        """Take the slot's messages; None while it may go on, else why it must go
        ("never started", or "started" for one that ran jobs and died or hung)."""
        try:
            while slot.conn.poll():
                kind, *rest = slot.conn.recv()
                if kind == "ready":
                    slot.ready = True
                elif kind == "done" and slot.job is not None:
                    self._finish(slot, rest[0], rest[1])
        except (EOFError, OSError):
            pass  # it died: reported below with its exit code
        if not slot.proc.is_alive():
            if slot.job is not None:
                slot.proc.join(1)
                self._finish(slot, "crashed", f"its compile process died ({signal_name(slot.proc.exitcode)}) "
                             f"while warming it{self._log_hint()}")
            if not slot.ready:
                slot.proc.join(1)
                self._last_start_failure = f"{signal_name(slot.proc.exitcode)} before it was ready"
                return "never started"
            return "started"
        if slot.job is not None and now - slot.job_started > self._job_timeout_s:
            self._finish(slot, "timeout", f"ran past the {self._job_timeout_s:.0f} s limit; its process was killed")
            return "started"
        if not slot.ready and now - slot.spawned_at > self._start_timeout_s:
            self._last_start_failure = f"not ready within {self._start_timeout_s:.0f} s"
            return "never started"
        return None

    def _log_hint(self) -> str:
        return f"; its output is in {self._log_path}" if self._log_path else ""


def signal_name(code: int | None) -> str:
    """How a process ended, in words: 'SIGSEGV', 'exit code 139' (the compile pool's and
    the sweep's workers, tune/worker.py re-exports it)."""
    if code is not None and code < 0:
        import signal

        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def start(jobs: list[CompileJob], *, device_index: int = 0, has_gpu: bool = True,
          processes: int | None = None, job_timeout_s: float = 120.0,
          log_path: Path | None = None, start_timeout_s: float = START_TIMEOUT_S) -> CompileHandle:
    """Start warming `jobs` (from `plan_jobs`) in `processes` spawned processes and return
    at once. Each job may take `job_timeout_s` from the moment its process takes it."""
    if processes is None:
        processes = max(1, min(8, (os.cpu_count() or 2) - 1))
    return CompileHandle(jobs, device_index, has_gpu, processes, job_timeout_s, log_path, start_timeout_s)


def precompile(jobs, device_index: int, has_gpu: bool, processes: int, timeout_s: float, *,
               job_timeout_s: float | None = None, sm_count: int | None = None) -> dict[str, str]:
    """Blocking: warm (variant, real shape) pairs (or CompileJobs) and return
    {"variant at shape": why} for those that did not finish ok (not fatal: the timed run
    records why). timeout_s bounds the whole pool, job_timeout_s each job."""
    jobs = list(jobs)
    if jobs and not isinstance(jobs[0], CompileJob):
        jobs = plan_jobs(jobs, sm_count)
    if not jobs:
        return {}
    handle = start(jobs, device_index=device_index, has_gpu=has_gpu, processes=processes,
                   job_timeout_s=job_timeout_s or timeout_s)
    return handle.wait(time.monotonic() + timeout_s).errors()
