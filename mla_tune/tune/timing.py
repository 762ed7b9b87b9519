"""The one place that times a call, the way the leaderboard's harness does.

The leaderboard synchronizes, flushes L2 with a 64 GB `torch.randn`, records an event,
calls the submission, records, synchronizes. That flush keeps the GPU busy for tens of
milliseconds after the CPU queued it, so the whole submission is queued before the start
event runs: the figure is the GPU time of the submission's kernels back to back, and
Python and launch overhead stay hidden unless the call synchronizes.

`time_call` emulates that faithfully and cheaply: per sample it flushes L2 by writing a
buffer several times its size, queues `torch.cuda._sleep` long enough to cover the call's
host time, then records start, calls, records end. Samples are queued back to back and
read after one synchronize; the median is the figure, p10/p90 the spread. `wall_time`
is the second figure: the call's wall time with nothing queued (what an eager serving
loop without CUDA graphs pays).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# H200: 60 MB of L2 (MI355X: 4 MB L2 per XCD plus a 256 MB Infinity Cache); 512 MB is
# several times either, so nothing of the previous call survives the write.
FLUSH_BYTES = 512 << 20
_SLEEP_CYCLES_PER_US = 2000  # ~2 GHz SM clock; only needs to be roughly right


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative noise of this figure."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "median_us": round(self.median_us, 3),
            "p10_us": round(self.p10_us, 3),
            "p90_us": round(self.p90_us, 3),
            "samples": self.samples,
        }


PROTOCOL = {
    "name": "leaderboard-emulation",
    "flush_bytes": FLUSH_BYTES,
    "queued_ahead": "torch.cuda._sleep covering the call's host time",
    "statistic": "median of CUDA-event samples",
}
CPU_PROTOCOL = {
    "name": "cpu-wall-clock",
    "statistic": "median of time.perf_counter samples around each call",
    "note": "no GPU: a stand-in for tests, not the leaderboard protocol",
}


def _quantiles(samples: list[float]) -> Timing:
    ordered = sorted(samples)
    n = len(ordered)
    return Timing(
        median_us=statistics.median(ordered),
        p10_us=ordered[int(0.1 * (n - 1))],
        p90_us=ordered[int(round(0.9 * (n - 1)))],
        samples=n,
    )


def wall_time(fn: Callable[[], object], reps: int = 20) -> Timing:
    """The call's wall time, synchronized on both sides, nothing queued (microseconds)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(samples)


def time_call(fn: Callable[[], object], reps: int = 40, warmup: int = 3) -> Timing:
    """GPU time of fn() per call under the leaderboard protocol (microseconds)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    host = wall_time(fn, reps=3).median_us
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    ahead_us = max(200.0, 3.0 * host)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    torch.cuda.synchronize()
    for start, end in events:
        flush.fill_(1.0)
        hold_gpu(ahead_us)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    del flush
    return _quantiles([start.elapsed_time(end) * 1000.0 for start, end in events])


def cpu_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> Timing:
    """Wall-clock microseconds per call on the CPU (the stand-in when there is no GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(samples)


def timers(has_gpu: bool) -> tuple[Callable[..., Timing], Callable[..., Timing]]:
    """(the ranking timer, the wall-time timer) for this machine: the leaderboard
    emulation and the synchronized wall time on a GPU, the CPU stand-in for both without."""
    return (time_call, wall_time) if has_gpu else (cpu_time, cpu_time)


def protocol(has_gpu: bool) -> dict:
    return dict(PROTOCOL if has_gpu else CPU_PROTOCOL)


def hold_gpu(us: float) -> None:
    """Queue a GPU sleep of about `us` microseconds on the current stream: work queued
    behind it waits, so the host's launches of it are not on the GPU's clock."""
    torch.cuda._sleep(int(us * _SLEEP_CYCLES_PER_US))


def host_round(fn: Callable[[], object], calls: int) -> float:
    """Host us per call of `calls` calls of fn back to back, the GPU held busy ahead (100 us
    a call) so that no call waits for it; synchronizes after."""
    hold_gpu(calls * 100)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def host_time(fn: Callable[[], object], calls: int = 50, rounds: int = 7) -> Timing:
    """Host time per call (microseconds): `calls` calls back to back with the GPU held busy
    ahead by a queued sleep, so that no call waits for the GPU; the median over `rounds`.
    What an engine's Python pays per call when it runs eagerly (no CUDA graph)."""
    fn()
    torch.cuda.synchronize()
    return _quantiles([host_round(fn, calls) for _ in range(rounds)])
