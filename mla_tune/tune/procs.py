"""Child processes that die with the sweep: no orphans after kill -9.

A spawned worker or compile process calls `die_with_parent()` first thing. On Linux it asks
the kernel (prctl PR_SET_PDEATHSIG) to SIGKILL it when its parent goes, however the parent
goes, kill -9 included; then it checks that the parent is still the one that started it,
since a parent that died before the prctl call would never deliver the signal.

The kernel sends the signal when the *thread* that started the child exits, so a process
that must outlive a helper thread is started from a thread that lives as long as it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys

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
