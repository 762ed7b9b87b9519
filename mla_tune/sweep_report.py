"""What the sweep prints: the dry run's plan, the progress bar, the summary table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mla_tune.config import Config
from mla_tune.core import Shape, Variant
from mla_tune.sweep_schedule import BASELINE_BACKEND


def print_plan(config: Config, gpu: str, where: str, out: Path, results_path: Path,
               devices: list[int], plan: dict[Shape, list[Variant]], unavailable: dict[str, str],
               listed: dict[str, str], console: Console) -> None:
    """The dry run's report: what the sweep would run, per shape and backend."""
    console.print(f"[bold]dry run[/]: config {config.name} ({config.path}, hash {config.hash[:12]})")
    console.print(escape(f"  GPU {gpu} ({where}); devices {devices}; rule {config.rule.name}"))
    console.print(escape(f"  table -> {out}; results -> {results_path}"))
    console.print(f"  {len(config.shapes)} shapes: {', '.join(str(s) for s in config.shapes)}")
    total = 0
    for shape, variants in plan.items():
        counts: dict[str, int] = {}
        for v in variants:
            counts[v.backend] = counts.get(v.backend, 0) + 1
        total += len(variants)
        text = ", ".join(f"{b} {n}" + (" (not runnable here)" if b in listed else "") for b, n in counts.items())
        console.print(escape(f"  {shape}: {len(variants)} candidates ({text or 'none'})"))
    for name, reason in listed.items():
        console.print(f"  [yellow]{name}[/]: unavailable on this machine ({escape(reason)}); "
                      f"its candidates are listed for {gpu}, marked not runnable here")
    for name, reason in unavailable.items():
        console.print(f"  [red]{name}[/]: unavailable: {escape(reason)}")
    compiled = {str(v) for vs in plan.values() for v in vs if config.precompile.get(v.backend)}
    console.print(f"  {total} candidates in all; {len(compiled)} distinct variants to precompile")


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
    )


def summarize(records: list[dict], console: Console) -> dict[str, dict]:
    """Print the end-of-sweep summary (per shape: winner, time, runner-up, baseline, counts,
    then each winner's full variant) as plain text that fits the width, with the same rules
    as `mla-tune show` (mla_tune.render); return {shape text: {variant, median_us}}."""
    from mla_tune.render import line_width, summary_lines

    lines, winners = summary_lines(records, BASELINE_BACKEND, line_width())
    for line in lines:
        console.out(line, highlight=False)
    return winners
