"""What the sweep prints: the dry run's plan, the progress, the summary table."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from mla_tune.backends import baseline_backend
from mla_tune.core import Shape
from mla_tune.tables.render import MAX_WIDTH, MIN_WIDTH, wrap
from mla_tune.tune.config import Config


def say(console: Console, lead: str, text: str, head: str = "", style: str = "") -> None:
    """`lead` + `head` + `text` as plain lines of at most the console's width (80 to 200),
    broken at spaces, continuation lines indented two more (tables.render.wrap); `head`
    (a name) in rich's `style` on the first line. No markup in `text` is read."""
    width = max(MIN_WIDTH, min(MAX_WIDTH, console.width))
    for i, line in enumerate(wrap(lead, head + text, width)):
        if i == 0 and head and style:
            rest = line[len(lead) + len(head):]
            console.print(f"{escape(lead)}[{style}]{escape(head)}[/]{escape(rest)}", soft_wrap=True)
        else:
            console.print(escape(line), soft_wrap=True)


def print_plan(config: Config, gpu: str, where: str, out: Path, results_path: Path,
               devices: list[int], planned, fitted, costs, console: Console) -> None:
    """The dry run's report: candidates per shape and backend, per rung, and the estimate."""
    say(console, "", f": config {config.name} ({config.path}, hash {config.hash[:12]})", "dry run", "bold")
    say(console, "  ", f"GPU {gpu} ({where}); devices {devices}; rule {config.rule.name}")
    say(console, "  ", f"table -> {out}; results -> {results_path}")
    say(console, "  ", f"{len(config.shapes)} shapes: {', '.join(str(s) for s in config.shapes)}")
    rungs = list(fitted.rungs)
    say(console, "  ", f"search: rungs {rungs} samples, keep {config.search.keep:g} per rung "
                       f"(at least {config.search.min_keep}, plus each backend's best and the baseline)")
    total = 0
    for shape, variants in planned.plan.items():
        kept = fitted.plan.get(shape, [])
        counts: dict[str, int] = {}
        for v in kept:
            counts[v.backend] = counts.get(v.backend, 0) + 1
        total += len(kept)
        text = ", ".join(f"{b} {n}" + ("*" if b in planned.listed_anyway else "")
                         for b, n in counts.items())
        plan = fitted.estimate.shapes.get(shape)
        per_rung = " -> ".join(str(n) for n in plan.rung_counts) if plan else "0"
        cut = f", {len(variants) - len(kept)} dropped for the budget" if len(kept) != len(variants) else ""
        say(console, "  ", f"{shape}: {len(kept)} candidates ({text or 'none'}){cut}; per rung {per_rung}")
    for name, reason in planned.listed_anyway.items():
        say(console, "  ", f": unavailable on this machine ({reason}); its candidates are listed for {gpu}, "
                           "marked * (not runnable here)", name, "yellow")
    for name, reason in planned.unavailable.items():
        say(console, "  ", f": unavailable: {reason}", name, "red")
    compiled = {str(v) for vs in fitted.plan.values() for v in vs if config.precompile.get(v.backend)}
    dupes = f"; {planned.duplicates} duplicates collapsed" if planned.duplicates else ""
    compiled_out = sum(len(per) for per in getattr(planned, "compile_drops", {}).values())
    dupes += f"; {compiled_out} dropped by the compile check" if compiled_out else ""
    say(console, "  ", f"{total} candidates in all{dupes}; {len(compiled)} distinct variants to precompile")
    for note in fitted.notes:
        say(console, "  ", f": {note}", "budget", "yellow")
    e = fitted.estimate
    budget = config.budget_s
    verdict = ("no budget set" if budget is None else
               f"fits the budget of {budget:.0f} s" if e.seconds <= budget else
               f"does NOT fit the budget of {budget:.0f} s")
    say(console, "  ", f"estimated {e.seconds:.0f} s: start {e.startup_s:.0f} s, compile {e.compile_s:.0f} s, "
                       f"first calls {e.first_calls_s:.0f} s, candidates {e.candidates_s:.0f} s; {verdict}")
    say(console, "  ", f"estimate basis: {costs.basis}")


def eta_s(elapsed_s: float, done_here: int, left: int, estimate_s: float | None = None) -> float | None:
    """Seconds left at this run's pace (its elapsed time per item it did, times the items
    left); before it did any, the estimate less the time elapsed (None without one). Both
    sweeps' progress lines use it: the leaderboard's per candidate, the serving one's per cell."""
    if done_here <= 0:
        return None if estimate_s is None else max(0.0, estimate_s - elapsed_s)
    return elapsed_s / done_here * max(0, left)


class Progress:
    """The sweep's progress: a bar on a terminal; without one, a plain line per shape and
    rung (candidates done, best so far, elapsed, ETA), which a log file keeps readable."""

    def __init__(self, console: Console, fitted, old_records: list[dict], n_devices: int):
        self.console = console
        self.started = time.monotonic()
        self.total = sum(len(vs) for vs in fitted.plan.values())
        planned = {(s.batch, s.kv_len) for s in fitted.plan}
        self.done = sum(1 for r in old_records if r.get("kind", "candidate") == "candidate"
                        and (r["shape"]["batch"], r["shape"]["kv_len"]) in planned)
        self.resumed = self.done
        self.estimate_s = fitted.estimate.seconds
        self._bar = None
        if console.is_terminal:
            self._bar = RichProgress(TextColumn("candidates"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=console)
            self._task = self._bar.add_task("candidates", total=self.total, completed=self.done)
            self._bar.start()

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)

    def print(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)

    def eta_s(self) -> float:
        return eta_s(time.monotonic() - self.started, self.done - self.resumed, self.total - self.done,
                     self.estimate_s)

    def shape_line(self, shape: Shape, search, rung: int, n_rungs: int) -> None:
        best = search.best()
        best_text = f"best {best[0]:.1f} us {best[1]}" if best else "no candidate passed yet"
        self.print(escape(
            f"{shape}: rung {rung + 1}/{n_rungs} done; {self.done}/{self.total} candidates done; "
            f"{best_text}; elapsed {time.monotonic() - self.started:.0f} s, ETA {self.eta_s():.0f} s"))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def summarize(records: list[dict], console: Console) -> dict[str, dict]:
    """Print the end-of-sweep summary (per shape: winner, time, runner-up, baseline, counts,
    then each winner's full variant) as plain text that fits the width, with the same rules
    as `mla-tune show` (mla_tune.tables.render); return {shape text: {variant, median_us}}."""
    from mla_tune.tables.render import line_width, summary_lines

    lines, winners = summary_lines(records, baseline_backend(), line_width())
    for line in lines:
        console.out(line, highlight=False)
    return winners
