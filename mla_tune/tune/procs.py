"""Child processes that die with the sweep: no orphans after kill -9.

A spawned worker or compile process calls `die_with_parent()` first thing. On Linux it asks
the kernel (prctl PR_SET_PDEATHSIG) to SIGKILL it when its parent goes, however the parent
goes, kill -9 included; then it checks that the parent is still the one that started it,
since a parent that died before the prctl call would never deliver the signal.

The kernel sends the signal when the *thread* that started the child exits, so a process
that must outlive a helper thread is started from a thread that lives as long as it.

Ctrl-C in a terminal sends SIGINT to the whole process group, children included. The sweep
decides what an interrupt means (it stops its workers and keeps what was recorded): a
worker ignores SIGINT once its own code runs, a Ctrl-C while it is still importing torch
writes its traceback to the worker's log (`sigint_held`), and the sweep's own Ctrl-C in that
moment is held, not dropped, and raised when the child has started.
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
def sigint_held(stderr_to: str | os.PathLike | None = None) -> Iterator[None]:
    """Start child processes in the block without losing this process's Ctrl-C and without
    a child's traceback on the terminal.

    - A SIGINT that arrives in the block is only noted, and this process's handler gets it
      when the block ends (the default one raises KeyboardInterrupt there). Ignoring
      SIGINT for the block, so that a child inherits it ignored, would drop it: the
      disposition is the whole process's.
    - With `stderr_to` (the child's log), file descriptor 2 points there for the block, so a
      child that a terminal's Ctrl-C (sent to the whole group) stops while it still
      imports torch writes its traceback to its log, not to the terminal. The child's own
      code then ignores SIGINT (worker_main's first lines): the sweep decides.

    Only the main thread may change a handler: elsewhere SIGINT is left as it is."""
    main = threading.current_thread() is threading.main_thread()
    noted: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum)) if main else None
    saved = None
    if stderr_to is not None:
        sys.stderr.flush()
        fd = os.open(stderr_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        saved = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
        if main:
            # None: a handler not set from Python, which cannot be put back; SIG_DFL stands in
            signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)
            if noted and callable(old):
                old(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
            elif noted and (old is None or old == signal.SIG_DFL):
                raise KeyboardInterrupt
