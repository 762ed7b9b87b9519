"""Tasks over killable worker processes: the serving sweep's gate and timing.

A `TaskPool` holds `size` workers of `tune/worker.py` (spawned, SIGINT ignored, dying with
the sweep, output in a log file), each owned by one thread of this process that starts,
asks and restarts it, so a worker never outlives the thread that started it unnoticed
(procs.die_with_parent); leaving the pool on an exception (Ctrl-C) kills them at once. A task is a `worker.Task` (a function by name, its arguments);
each worker runs one at a time, so a crash or a hang names its own task and costs only it:

    ok        the function returned: `value`
    failed    it raised: `error` names the exception (the worker goes on)
    crashed   its worker died: `error` says how, `tail` holds the log's last lines
    timeout   it ran past its limit: its worker was killed

A worker whose task lost the CUDA context exits after answering; the next task starts a
fresh one. `call` runs one task on the first worker (the serving sweep's timing, in order);
`run` runs many, at most one per worker at a time, yielding each as it finishes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_tune.tune.worker import (
    Task,
    TaskResult,
    WorkerGone,
    WorkerHandle,
    WorkerTimeout,
    signal_name,
)


@dataclass(frozen=True)
class Outcome:
    """What became of one task."""

    status: str  # ok | failed | crashed | timeout
    value: Any = None
    error: str = ""
    tail: str = ""  # crashed: the worker log's last lines


class TaskPool:
    """`size` workers on `device` (an index; the GPU the worker selects), logs at
    `log_stem`.worker-I.log. Use as a context manager: on leaving, the workers are stopped
    (killed if an exception, Ctrl-C included, is leaving)."""

    def __init__(self, size: int, log_stem: Path, device: int = 0):
        if size < 1:
            raise ValueError(f"a task pool needs at least one worker, got {size}")
        log_stem = Path(log_stem)
        self.handles = [WorkerHandle(device, log_stem.with_name(f"{log_stem.name}.worker-{i}.log"))
                        for i in range(size)]
        self._inboxes: list[queue.Queue] = [queue.Queue() for _ in self.handles]
        self._threads = [threading.Thread(target=self._serve, args=(h, box), daemon=True,
                                          name=f"mla-tune-pool-{i}")
                         for i, (h, box) in enumerate(zip(self.handles, self._inboxes, strict=True))]
        self._started = False

    @property
    def size(self) -> int:
        return len(self.handles)

    def __enter__(self) -> TaskPool:
        for t in self._threads:
            t.start()
        self._started = True
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)

    def close(self, kill: bool = False) -> None:
        """Stop every worker (kill: at once, the tasks in flight are lost) and its thread."""
        if kill:
            for h in self.handles:
                h.reap()
        for box in self._inboxes:
            box.put(None)
        if self._started:
            for t in self._threads:
                t.join(30)

    # ------------------------------------------------------------------ the threads
    @staticmethod
    def _serve(handle: WorkerHandle, inbox: queue.Queue) -> None:
        try:
            while True:
                item = inbox.get()
                if item is None:
                    return
                task, timeout_s, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        outcome = _ask(handle, task, timeout_s)
                    except Exception as exc:  # the pool was closed under it (Ctrl-C): no traceback
                        outcome = Outcome("crashed", error=f"its worker was stopped ({type(exc).__name__})")
                    future.set_result(outcome)
        finally:
            handle.stop()

    def submit(self, task: Task, timeout_s: float, worker: int = 0) -> Future:
        """Queue `task` on worker `worker`; the future's result is its Outcome."""
        future: Future = Future()
        self._inboxes[worker].put((task, timeout_s, future))
        return future

    def call(self, task: Task, timeout_s: float) -> Outcome:
        """One task on the first worker, waited for."""
        return self.submit(task, timeout_s).result()

    def run(self, tasks: Iterable[Task], timeout_s: float | Callable[[], float],
            stop: Callable[[], bool] = lambda: False) -> Iterator[tuple[int, Outcome]]:
        """(index in `tasks`, outcome) for each task as it finishes, one per worker at a
        time; once `stop()` is true no further task starts (those in flight finish).
        `timeout_s` may be a function, asked as each task starts (a budget's cut)."""
        pending = list(enumerate(tasks))
        free = list(range(self.size))
        flying: dict[Future, tuple[int, int]] = {}
        while (pending and not stop()) or flying:
            while pending and free and not stop():
                index, task = pending.pop(0)
                worker = free.pop(0)
                limit = timeout_s() if callable(timeout_s) else timeout_s
                flying[self.submit(task, limit, worker)] = (index, worker)
            if not flying:
                break
            done, _ = wait(flying, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: flying[f][0]):
                index, worker = flying.pop(future)
                free.append(worker)
                yield index, future.result()


def _ask(handle: WorkerHandle, task: Task, timeout_s: float) -> Outcome:
    """One task through one worker: its outcome, whatever became of the worker."""
    try:
        result: TaskResult = handle.request(task, timeout_s)
    except WorkerTimeout:
        handle.reap()
        return Outcome("timeout", error=f"ran past the {timeout_s:.0f} s limit; its worker was killed")
    except WorkerGone as gone:
        return Outcome("crashed", error=f"its worker died ({signal_name(gone.exitcode)}) while running it; "
                       f"the worker log {handle.log_path} holds its last output", tail=gone.tail)
    if result.restart_worker:
        handle.wait_exit()
    if result.error is not None:
        return Outcome("failed", error=result.error)
    return Outcome("ok", result.value)
