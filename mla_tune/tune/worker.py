"""The sweep's worker process: the only place kernels run.

One worker per device, started with multiprocessing "spawn" (a forked CUDA context is
unusable), talking to the sweep over a pipe with the small frozen dataclasses below:
in, `Step` (one candidate at one rung), `Task` (a named function, the serving sweep's
gate and timing), `MeasureBandwidth` and `Stop`; out, `Ready` once, then one `StepResult`
per step, a `TaskResult` per task or a `Bandwidth`. The worker's stdout and stderr go to a
log file, so when it dies the sweep can quote its last lines. `tune/pool.py` runs Tasks
over several such workers.

A step is: build; at rung 0, run every check seed against the fp32 reference (the gate,
at most half the rule's allowance); then the rung's timing samples, and at the last rung
the wall-time figure too. Whatever the candidate raises becomes a "failed" result naming
the exception; a CUDA error that poisons the context makes the worker exit after
reporting, so the sweep starts a fresh one.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_tune import gpu, problem
from mla_tune.backends import get_backend
from mla_tune.core import Shape, Variant
from mla_tune.tune import calibration, timing
from mla_tune.tune.compile_pool import (  # noqa: F401 (moved; re-exported until callers move)
    compile_shape_for,
    precompile,
    signal_name,
)
from mla_tune.tune.procs import die_with_parent, sigint_held

GATE_MARGIN = 0.5  # the gate demands at most half the rule's allowance (PROBLEM.md)
_POISON_MARKERS = ("CUDA error", "illegal memory access", "HIP error", "device-side assert")


# ----------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Step:
    """Run `variant` on `shape`: the gate when `gate`, then `samples` timing samples, and
    `wall_samples` wall-time samples when it is the candidate's last rung."""

    shape: Shape
    variant: str
    rung: int
    samples: int
    wall_samples: int
    gate: bool
    rule: problem.Rule
    check_seeds: tuple[int, ...]
    calibration_seeds: tuple[int, ...]
    calibration: dict | None = None  # the config's q calibration source (mla_tune.tune.calibration)


@dataclass(frozen=True)
class Task:
    """Run `function` ("package.module:name", importable in a fresh process) as
    function(context, *args) in the worker; the answer is a TaskResult. The function
    returns something picklable; it sets `context.restart` when its process must not run
    anything else (a CUDA error that lost the context), and may keep state for the next
    task of the same kind in `context.cache`."""

    function: str
    args: tuple = ()


@dataclass
class TaskContext:
    """What a task function gets besides its arguments."""

    device: Any  # torch.device
    has_gpu: bool
    platform: gpu.Platform
    cache: dict = field(default_factory=dict)
    restart: bool = False


@dataclass(frozen=True)
class TaskResult:
    """A task's return value, or `error` (its exception, in words) when it raised;
    `restart_worker`: the worker exits after sending this."""

    value: Any = None
    error: str | None = None
    restart_worker: bool = False


def resolve(function: str):
    """The function a Task names ("package.module:name")."""
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


def run_task(task: Task, context: TaskContext) -> TaskResult:
    """One task in this process: its value, or the exception in words (the worker and
    its other tasks go on, unless the error lost the CUDA context)."""
    context.restart = False
    try:
        value = resolve(task.function)(context, *task.args)
    except Exception as exc:  # the task's failure, reported; the worker goes on
        return TaskResult(error=_error_text(exc), restart_worker=_poisons_context(exc))
    return TaskResult(value, restart_worker=context.restart)


@dataclass(frozen=True)
class MeasureBandwidth:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    platform: gpu.Platform


@dataclass(frozen=True)
class Bandwidth:
    gbps: float | None


@dataclass(frozen=True)
class StepResult:
    """What one step found; also the sweep's own verdict when the worker could not answer
    (crashed, timeout). `variant` is the variant as built (fp8_static gains its q_amax)."""

    variant: str
    status: str = "failed"
    reason: str = ""
    checks: tuple = ()
    time: dict | None = None
    wall: dict | None = None
    calibration: dict | None = None
    stderr_tail: str | None = None
    restart_worker: bool = False

    def fields(self) -> dict:
        """The record fields (results-file format) this result contributes."""
        v = Variant.parse(self.variant)
        out = {
            "variant": self.variant, "backend": v.backend, "params": v.p, "status": self.status,
            "reason": self.reason, "checks": list(self.checks), "time": self.time,
            "wall": self.wall, "calibration": self.calibration,
        }
        if self.stderr_tail is not None:
            out["stderr_tail"] = self.stderr_tail
        return out


def device_for(index: int, has_gpu: bool) -> torch.device:
    return torch.device(f"cuda:{index}") if has_gpu else torch.device("cpu")


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch and clocks
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000.0
    del src, dst
    torch.cuda.empty_cache()
    return round(2 * nbytes * reps / seconds / 1e9, 1)


# ------------------------------------------------------------------- per shape state
class ShapeState:
    """Inputs and references for one shape on one device, shared by all its candidates."""

    def __init__(self, shape: Shape, check_seeds, calibration_seeds, device):
        self.shape = shape
        self.device = device
        self.calibration_seeds = list(calibration_seeds)
        self.seeds = []  # (seed, data, reference)
        for seed in check_seeds:
            data = problem.generate_input(shape.batch, shape.kv_len, seed, device=device)
            self.seeds.append((seed, data, problem.reference(data)))
        self._calibration: dict | None = None

    def calibration(self, spec: dict | None = None) -> dict:
        """fp8_static's q_amax for this shape from the config's calibration source `spec`
        (mla_tune.tune.calibration; None: the generator, on seeds the gate never checks on)."""
        if self._calibration is None:
            self._calibration = calibration.calibrate(spec, self.shape, self.calibration_seeds,
                                                      self.device)
        return self._calibration


def _release(state: ShapeState | None) -> None:
    """Drop a shape's inputs before the next shape allocates (256x8192 inputs are GBs)."""
    if state is not None:
        state.seeds.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error_text(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    if len(message) > 500:
        message = message[:500] + "..."
    return f"{type(exc).__name__}: {message}"


def _poisons_context(exc: BaseException) -> bool:
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or any(m in text for m in _POISON_MARKERS)


def _gate(runner, state: ShapeState, rule: problem.Rule) -> tuple[list[dict], list[str]]:
    checks, failures = [], []
    for seed, data, ref in state.seeds:
        out = runner(*data[:4]).clone()  # the runner reuses its output buffer
        result = problem.check(out, ref, rule, margin=GATE_MARGIN)
        checks.append({
            "seed": seed, "mismatch": result.mismatch,
            "max_abs_err": result.max_abs_err if result.max_abs_err != float("inf") else None,
            "passed": result.passed,
        })
        if not result.passed:
            failures.append(f"seed {seed}: {result.reason}")
    return checks, failures


def run_step(step: Step, state: ShapeState | None, device, has_gpu: bool):
    """One candidate at one rung; returns (StepResult, the shape state to keep)."""
    variant = Variant.parse(step.variant)
    if state is None or state.shape != step.shape:
        _release(state)
        state = None
        try:
            state = ShapeState(step.shape, step.check_seeds, step.calibration_seeds, device)
        except Exception as exc:  # recorded: the candidate cannot be judged without inputs
            _release(None)
            return StepResult(step.variant, reason=f"setting up inputs for {step.shape} failed: "
                              f"{_error_text(exc)}", restart_worker=_poisons_context(exc)), None
    calibration, checks = None, []
    try:
        if variant.get("q") == "fp8_static" and variant.get("q_amax") is None:
            calibration = state.calibration(step.calibration)
            variant = variant.with_params(q_amax=calibration["q_amax"])
        runner = get_backend(variant.backend).build(variant, step.shape, device)
        if step.gate:
            checks, failures = _gate(runner, state, step.rule)
            if failures:
                return StepResult(str(variant), "rejected", "; ".join(failures), tuple(checks),
                                  calibration=calibration), state
        q, kv_data, qo_indptr, kv_indptr, _ = state.seeds[0][1]

        def call():
            return runner(q, kv_data, qo_indptr, kv_indptr)

        timer, wall_timer = timing.timers(has_gpu)
        measured = timer(call, reps=step.samples)
        wall = wall_timer(call, reps=step.wall_samples) if step.wall_samples else None
        return StepResult(str(variant), "ok", "", tuple(checks), measured.as_dict(),
                          wall.as_dict() if wall else None, calibration), state
    except Exception as exc:  # recorded as "failed" with the exception's type and message
        if type(exc).__name__ == "OutOfMemoryError":
            gc.collect()
            torch.cuda.empty_cache()
        return StepResult(str(variant), "failed", _error_text(exc), tuple(checks),
                          calibration=calibration, restart_worker=_poisons_context(exc)), state


# ---------------------------------------------------------------------- the process
def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log


def worker_main(device_index: int, conn, log_path: str) -> None:
    die_with_parent()  # no orphan when the sweep is killed with -9
    _redirect_output(log_path)
    # Ctrl-C reaches the whole process group: the sweep, not its workers, decides what
    # an interrupt means (it stops them and keeps what was recorded).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"[mla-tune worker pid {os.getpid()} device {device_index}]", flush=True)
    has_gpu = torch.cuda.is_available()
    if has_gpu:
        torch.cuda.set_device(device_index)
    platform = gpu.detect(device_index if has_gpu else None)
    device = device_for(device_index, has_gpu)
    conn.send(Ready(platform))
    state = None
    context = TaskContext(device, has_gpu, platform)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the sweep is gone (killed): nobody left to report to
            return
        if isinstance(message, Stop):
            return
        if isinstance(message, MeasureBandwidth):
            conn.send(Bandwidth(measure_copy_bandwidth(device) if has_gpu else None))
        elif isinstance(message, Step):
            result, state = run_step(message, state, device, has_gpu)
            conn.send(result)
            if result.restart_worker:
                print(f"exiting after a context-poisoning error: {result.reason}", flush=True)
                os._exit(3)  # skip CUDA teardown on a broken context
        elif isinstance(message, Task):
            result = run_task(message, context)
            conn.send(result)
            if result.restart_worker:
                print(f"exiting after a context-poisoning error in {message.function}: "
                      f"{result.error or 'the task said so'}", flush=True)
                os._exit(3)
        else:
            raise ValueError(f"worker got an unknown message {message!r}")


def _probe(device_index: int) -> gpu.Platform:
    return gpu.detect(device_index)


def probe_platform(device_index: int = 0) -> gpu.Platform:
    """The platform, detected in a short spawned process so this one never starts CUDA."""
    if not torch.cuda.is_available():
        return gpu.detect()
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_probe, (device_index,))


def log_tail(path: Path, offset: int, lines: int = 12) -> str:
    """The last lines a worker wrote to its log since `offset` (its last candidate)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


# ------------------------------------------------------- the sweep's end of the pipe
class WorkerGone(RuntimeError):
    """The worker process died; carries its exit code and its last log lines."""

    def __init__(self, exitcode: int | None, tail: str):
        super().__init__(f"worker exited ({exitcode})")
        self.exitcode = exitcode
        self.tail = tail


class WorkerTimeout(RuntimeError):
    """The worker did not answer within the limit."""


class WorkerHandle:
    """The sweep's handle on one device's worker: start, ask, kill, restart."""

    START_TIMEOUT_S = 600.0  # import torch, start CUDA, maybe JIT-load vendor libraries

    def __init__(self, device: int, log_path: Path):
        self.device = device
        self.log_path = Path(log_path)
        self.platform: gpu.Platform | None = None
        self._proc = None
        self._conn = None
        self._offset = 0
        # reap runs in the device's runner thread (a crash, a timeout) and in the main thread
        # (Ctrl-C) at once: one of them kills and closes, the other finds nothing left
        self._reap_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._proc = ctx.Process(
            target=worker_main, args=(self.device, child, str(self.log_path)),
            name=f"mla-tune-worker{self.device}", daemon=True,
        )
        with sigint_held(self.log_path):  # a Ctrl-C while it starts is the sweep's to handle
            self._proc.start()
            child.close()
            self._conn = parent

    def wait_ready(self) -> None:
        message = self._receive(self.START_TIMEOUT_S)
        if not isinstance(message, Ready):
            raise RuntimeError(f"worker {self.device} greeted with {message!r}, not Ready")
        self.platform = message.platform

    def request(self, message, timeout_s: float):
        """Send one message and wait for the answer; raises WorkerGone or WorkerTimeout."""
        if not self.alive:
            self.reap()
            self.start()
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            self._conn.send(message)
        except OSError:
            pass  # it died between candidates: _receive reports how
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        proc, conn = self._proc, self._conn
        while True:
            if conn.poll(0.05):
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    break
            if not proc.is_alive():
                if conn.poll(0):  # it answered, then exited
                    continue
                break
            if time.monotonic() > deadline:
                raise WorkerTimeout(f"no answer within {timeout_s:.0f} s")
        proc.join(10)
        code = proc.exitcode
        self.reap()
        raise WorkerGone(code, log_tail(self.log_path, self._offset))

    def bandwidth(self) -> float | None:
        return self.request(MeasureBandwidth(), 300.0).gbps

    def wait_exit(self, timeout_s: float = 30.0) -> None:
        """Let a worker that announced its exit finish exiting, so the next candidate
        starts on a fresh one rather than racing the old one's death."""
        if self._proc is not None:
            self._proc.join(timeout_s)
        self.reap()

    def reap(self) -> None:
        """Kill (if still running) and forget the process; safe from two threads at once."""
        with self._reap_lock:
            proc, self._proc = self._proc, None
            conn, self._conn = self._conn, None
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        if self.alive:
            try:
                self._conn.send(Stop())
                self._proc.join(10)
            except OSError:
                pass
        self.reap()
