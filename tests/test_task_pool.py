"""The task pool (mla_tune/tune/pool.py): a task that raises, crashes its worker, hangs or
loses its context costs only itself; the next runs on a fresh worker."""

import os
import time

from mla_tune.tune.pool import TaskPool
from mla_tune.tune.worker import Task

HERE = "tests.test_task_pool"


def pid(context) -> int:
    return os.getpid()


def fail(context, text: str) -> None:
    raise ValueError(text)


def crash(context) -> None:
    os._exit(7)


def hang(context) -> None:
    time.sleep(600)


def lose_context(context) -> int:
    context.restart = True
    return os.getpid()


def remember(context, value):
    """The value the previous task of this worker left, then leave this one."""
    before = context.cache.get("value")
    context.cache["value"] = value
    return before


def test_a_raise_a_crash_a_hang_and_a_lost_context_cost_only_their_own_task(tmp_path):
    with TaskPool(2, tmp_path / "pool") as pool:
        both = list(pool.run([Task(f"{HERE}:pid"), Task(f"{HERE}:pid")], 60))
        assert sorted(i for i, _ in both) == [0, 1] and len({o.value for _, o in both}) == 2

        def on(worker: int, name: str, *args, limit: float = 60):
            return pool.submit(Task(f"{HERE}:{name}", args), limit, worker).result()

        first = on(0, "pid").value
        failed = on(0, "fail", "bad value")
        assert (failed.status, failed.error) == ("failed", "ValueError: bad value")
        assert on(0, "pid").value == first  # a raise costs nothing else
        assert [on(0, "remember", n).value for n in (1, 2)] == [None, 1]  # the cache lives with its worker
        crashed = on(0, "crash")
        assert crashed.status == "crashed" and "exit code 7" in crashed.error
        assert "pool.worker-0.log" in crashed.error
        after_crash = on(0, "pid").value
        assert after_crash != first  # a fresh worker
        lost = on(1, "lose_context")
        assert lost.status == "ok" and on(1, "pid").value != lost.value  # it answered, then its worker ended
        hung = on(0, "hang", limit=2)
        assert hung.status == "timeout" and "2 s limit" in hung.error
        assert on(0, "pid").value not in (first, after_crash)
        seen: list[int] = []
        for index, _ in pool.run([Task(f"{HERE}:pid")] * 4, 60, stop=lambda: bool(seen)):
            seen.append(index)
        assert 1 <= len(seen) <= 2  # those in flight when stop() turned true finish; no more start
    assert (tmp_path / "pool.worker-0.log").exists()
