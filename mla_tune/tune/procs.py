"""Child processes that die with the sweep: no orphans after kill -9.

A spawned worker or compile process calls `die_with_parent()` first thing. On Linux it asks
the kernel (prctl PR_SET_PDEATHSIG) to SIGKILL it when its parent goes, however the parent
goes, kill -9 included; then it checks that the parent is still the one that started it,
since a parent that died before the prctl call would never deliver the signal.

The kernel sends the signal when the *thread* that started the child exits, so a process
that must outlive a helper thread is started from a thread that lives as long as it.

Ctrl-C in a terminal sends SIGINT to the whole process group, children included. The sweep
decides what an interrupt means (it stops its workers and keeps what was recorded), so a
child started inside `sigint_ignored()` inherits SIGINT ignored from its first instruction:
a Ctrl-C while it is still importing torch prints no traceback of its own. The sweep's own
Ctrl-C in that moment is held, not dropped, and raised when the child has started.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Make this process die when its parent does; returns whether the kernel will see to
    it (False off Linux, where only the parent's own cleanup stops it).

    parent_pid: the pid that started this process; by default multiprocessing's record of
    it. If the parent is already gone (this process was re-parented), exit at once.
    """
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if parent_pid is None:
        parent = mp.parent_process()
        parent_pid = parent.pid if parent is not None else None
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # orphaned before the prctl took hold: nobody is left to report to
    return armed


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Start child processes in the block with SIGINT ignored (a spawned Python keeps an
    ignored SIGINT ignored) and blocked (the mask is inherited too: `unblock_sigint` in the
    child's first lines), without losing this process's own Ctrl-C: SIGINT is blocked here
    for the block, so one that arrives meanwhile stays pending (Linux never discards a
    blocked signal, even an ignored one) and reaches the restored handler as the block
    ends. Only the main thread may change a handler: elsewhere this does nothing, and the
    child ignores SIGINT once its own code runs (worker_main's first lines)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    can_block = hasattr(signal, "pthread_sigmask")
    if can_block:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if can_block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending Ctrl-C is raised here


def unblock_sigint() -> None:
    """In a child started inside `sigint_ignored()`, once it ignores SIGINT itself: take
    SIGINT off the mask it inherited (a pending one is discarded, being ignored)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
