"""How the sweep shares out its work and its time: which device runs which shape
(`assign_shapes`), and how many timing reps the time budget leaves (`Budget`)."""

from __future__ import annotations

import statistics
import time

from rich.console import Console

from mla_tune.config import Config
from mla_tune.core import Shape, Variant

BASELINE_BACKEND = "torch"  # always timed in full (never pruned): every table row cites it


def assign_shapes(pending: dict[Shape, list[Variant]], n_devices: int):
    """Share shapes out between devices (a shape stays on one device), largest work first
    to the least-loaded device; one device keeps the config's order."""
    work = [(shape, vs) for shape, vs in pending.items() if vs]
    if n_devices == 1:
        return [work]
    shares: list[list] = [[] for _ in range(n_devices)]
    load = [0] * n_devices
    for shape, vs in sorted(work, key=lambda item: -item[0].total_kv * len(item[1])):
        i = load.index(min(load))
        shares[i].append((shape, vs))
        load[i] += shape.total_kv * len(vs)
    return shares


class Budget:
    """Watches the projected sweep time; past the config's budget_s it lowers the timing
    reps of the candidates still to run (never the correctness gate) and says so.

    The projection is the median time per finished candidate times the candidates left
    (over the devices working in parallel). A median, not a mean: one-off costs such as
    a vendor library's first JIT compile (~15 s per FlashInfer variant) would otherwise
    inflate the projection many times over. The first H200 sweep (2026-11-30), projecting
    with the mean, cut reps from 30 to 3 while the whole sweep took 181 s of its 540 s.
    """

    MIN_REPS = 3

    def __init__(self, config: Config, started: float, n_pending: int, console: Console,
                 parallel: int = 1):
        self.reps = config.timing.reps
        self.prune_reps = config.timing.prune_reps
        self.budget_s = config.budget_s
        self.started = started
        self.phase_start = time.monotonic()
        self.n_pending = n_pending
        self.console = console
        self.parallel = max(1, parallel)
        self.done = 0
        self.durations: list[float] = []
        self.reduced = False
        self.notes: list[str] = []

    def note_done(self, elapsed_s: float | None = None) -> str | None:
        """Count one finished candidate (that took elapsed_s); returns a note when it just
        cut the reps."""
        self.done += 1
        now = time.monotonic()
        self.durations.append(
            elapsed_s if elapsed_s is not None else (now - self.phase_start) / self.done
        )
        if self.done != 5 and (self.done < 5 or self.done % 10):
            return None
        per_candidate = statistics.median(self.durations)
        remaining = (self.n_pending - self.done) * per_candidate / self.parallel
        projected = now - self.started + remaining
        if self.done == 5:
            budget = f" (budget {self.budget_s:.0f} s)" if self.budget_s else ""
            self.console.print(f"estimated total: {projected:.0f} s{budget}")
        if self.budget_s and projected > self.budget_s and remaining > 0:
            left = max(0.0, self.budget_s - (now - self.started))
            reps = max(self.MIN_REPS, int(self.reps * left / remaining))
            if reps < self.reps:
                note = (
                    f"projected {projected:.0f} s exceeds the budget of {self.budget_s:.0f} s: "
                    f"timing reps cut from {self.reps} to {reps} for the remaining candidates "
                    "(the correctness gate still runs in full; records carry timing_reps)"
                )
                self.console.print(f"[yellow]budget[/]: {note}")
                self.notes.append(note)
                self.reps = reps
                self.reduced = True
                return note
        return None
