"""The sweep's worker process: the only place kernels run.

One worker per device, started with multiprocessing "spawn" (a forked CUDA context is
unusable), talking to the sweep over a pipe. Messages in: ("candidate", payload),
("bandwidth",), ("stop",). Messages out: ("ready", platform dict) once, then one
("result", record) per candidate or ("bandwidth", GB/s). The worker's stdout and stderr
go to a log file, so when it dies the sweep can quote its last lines.

A candidate is: build, run on every check seed against the fp32 reference (the gate,
at most half the rule's allowance), a quick timing to prune the hopeless, then the full
timing. Whatever the candidate raises becomes a "failed" record naming the exception; a
CUDA error that poisons the context makes the worker exit after reporting, so the sweep
starts a fresh one.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from mla_tune import calibration, gpu, problem, timing
from mla_tune.backends import get_backend
from mla_tune.compile_pool import compile_shape_for, precompile  # noqa: F401 (moved; re-exported until callers move)
from mla_tune.core import Shape, Variant
from mla_tune.procs import die_with_parent

GATE_MARGIN = 0.5  # the gate demands at most half the rule's allowance (PROBLEM.md)
CPU_PROTOCOL = {
    "name": "cpu-wall-clock",
    "statistic": "median of time.perf_counter samples around each call",
    "note": "no GPU: a stand-in for tests, not the leaderboard protocol",
}
_POISON_MARKERS = ("CUDA error", "illegal memory access", "HIP error", "device-side assert")


def device_for(index: int, has_gpu: bool) -> torch.device:
    return torch.device(f"cuda:{index}") if has_gpu else torch.device("cpu")


# ------------------------------------------------------------------------- timers
def _timing_of(samples: list[float]) -> timing.Timing:
    ordered = sorted(samples)
    n = len(ordered)
    return timing.Timing(
        median_us=statistics.median(ordered),
        p10_us=ordered[int(0.1 * (n - 1))],
        p90_us=ordered[int(round(0.9 * (n - 1)))],
        samples=n,
    )


def cpu_time(fn, reps: int, warmup: int = 1) -> timing.Timing:
    """Wall-clock microseconds per call on the CPU (the stand-in when there is no GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _timing_of(samples)


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

    def __init__(self, shape: Shape, check_seeds: list[int], calibration_seeds: list[int], device):
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
        (mla_tune.calibration; None: the generator, on seeds the gate never checks on)."""
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


def run_candidate(payload: dict, state: ShapeState | None, device, has_gpu: bool):
    """One candidate end to end; returns (record fields, the shape state to keep)."""
    shape = Shape(payload["shape"]["batch"], payload["shape"]["kv_len"])
    variant = Variant.parse(payload["variant"])
    record = {
        "variant": str(variant), "backend": variant.backend, "params": variant.p,
        "status": "failed", "reason": "", "checks": [], "time": None, "wall": None,
        "calibration": None,
    }
    if state is None or state.shape != shape:
        _release(state)
        state = None
        try:
            state = ShapeState(shape, payload["check_seeds"], payload["calibration_seeds"], device)
        except Exception as exc:  # recorded: the candidate cannot be judged without inputs
            record["reason"] = f"setting up inputs for {shape} failed: {_error_text(exc)}"
            record["restart_worker"] = _poisons_context(exc)
            _release(None)
            return record, None
    rule = problem.Rule(**payload["rule"])
    try:
        if variant.get("q") == "fp8_static":
            record["calibration"] = state.calibration(payload.get("calibration"))
            variant = variant.with_params(q_amax=record["calibration"]["q_amax"])
            record.update(variant=str(variant), params=variant.p)
        runner = get_backend(variant.backend).build(variant, shape, device)
        failures = []
        for seed, data, ref in state.seeds:
            out = runner(*data[:4]).clone()  # the runner reuses its output buffer
            result = problem.check(out, ref, rule, margin=GATE_MARGIN)
            record["checks"].append({
                "seed": seed, "mismatch": result.mismatch,
                "max_abs_err": result.max_abs_err if result.max_abs_err != float("inf") else None,
                "passed": result.passed,
            })
            if not result.passed:
                failures.append(f"seed {seed}: {result.reason}")
        if failures:
            record.update(status="rejected", reason="; ".join(failures))
            return record, state
        q, kv_data, qo_indptr, kv_indptr, _ = state.seeds[0][1]

        def call():
            return runner(q, kv_data, qo_indptr, kv_indptr)

        timer = timing.time_call if has_gpu else cpu_time
        quick = timer(call, reps=payload["prune_reps"])
        threshold = payload.get("prune_threshold_us")
        if threshold is not None and quick.median_us > threshold:
            record.update(
                status="pruned", time=quick.as_dict(),
                reason=f"quick median {quick.median_us:.1f} us > {threshold:.1f} us "
                f"(prune_factor x best so far)",
            )
            return record, state
        full = timer(call, reps=payload["reps"])
        wall = timing.wall_time(call, reps=payload["wall_reps"]) if has_gpu else cpu_time(
            call, reps=payload["wall_reps"]
        )
        record.update(status="ok", time=full.as_dict(), wall=wall.as_dict())
    except Exception as exc:  # recorded as "failed" with the exception's type and message
        record.update(status="failed", reason=_error_text(exc))
        record["restart_worker"] = _poisons_context(exc)
        if type(exc).__name__ == "OutOfMemoryError":
            gc.collect()
            torch.cuda.empty_cache()
    return record, state


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
    print(f"[mla-tune worker pid {os.getpid()} device {device_index}]", flush=True)
    has_gpu = torch.cuda.is_available()
    if has_gpu:
        torch.cuda.set_device(device_index)
    platform = gpu.detect(device_index if has_gpu else None)
    device = device_for(device_index, has_gpu)
    conn.send(("ready", dataclasses.asdict(platform)))
    state = None
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the sweep is gone (killed): nobody left to report to
            return
        if message[0] == "stop":
            return
        if message[0] == "bandwidth":
            conn.send(("bandwidth", measure_copy_bandwidth(device) if has_gpu else None))
        elif message[0] == "candidate":
            record, state = run_candidate(message[1], state, device, has_gpu)
            conn.send(("result", record))
            if record.get("restart_worker"):
                print(f"exiting after a context-poisoning error: {record['reason']}", flush=True)
                os._exit(3)  # skip CUDA teardown on a broken context
        else:
            raise ValueError(f"worker got an unknown message {message[0]!r}")


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
        self._proc.start()
        child.close()
        self._conn = parent

    def wait_ready(self) -> None:
        kind, payload = self._receive(self.START_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"worker {self.device} greeted with {kind!r}, not 'ready'")
        self.platform = gpu.Platform(**payload)

    def request(self, message: tuple, timeout_s: float) -> tuple:
        """Send one message and wait for the answer; raises WorkerGone or WorkerTimeout."""
        if not self.alive:
            self.reap()
            self.start()
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # it died between candidates: _receive reports how
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> tuple:
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
        return self.request(("bandwidth",), 300.0)[1]

    def wait_exit(self, timeout_s: float = 30.0) -> None:
        """Let a worker that announced its exit finish exiting, so the next candidate
        starts on a fresh one rather than racing the old one's death."""
        if self._proc is not None:
            self._proc.join(timeout_s)
        self.reap()

    def reap(self) -> None:
        """Kill (if still running) and forget the process."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self) -> None:
        if self.alive:
            try:
                self._conn.send(("stop",))
                self._proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self.reap()
