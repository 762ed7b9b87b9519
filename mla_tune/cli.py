"""The `mla-tune` command line: sweep, export, show. Commands are thin: they parse options,
call the module that does the work, and turn its domain errors (ValueError subclasses:
TableError, ExportError, ConfigError, the sweep's refusals) into one red line and exit 1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table as RichTable

app = typer.Typer(rich_markup_mode="rich", no_args_is_help=True)


@contextmanager
def _domain_errors() -> Iterator[None]:
    try:
        yield
    except ValueError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None


def _table_path(gpu: str | None, table: Path | None) -> Path:
    if table is not None:
        return table
    if not gpu:
        raise typer.BadParameter("name the GPU with --gpu NAME or a table file with --table PATH")
    return Path("tables") / f"{gpu}.yaml"


def _list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise typer.BadParameter(f"{what} must be a comma-separated list, got {text!r}")
    return items


@app.command()
def sweep(
    gpu: Annotated[str, typer.Option(help="The GPU to tune, by canonical name (H200, MI355X).")],
    config: Annotated[Path, typer.Option(help="The sweep config: shapes, rule, search space.")] = Path(
        "configs/leaderboard.yaml"),
    out: Annotated[Path | None, typer.Option(help="Where to write the table; default tables/GPU.yaml.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Plan the sweep and print it without running anything.")] = False,
    force: Annotated[bool, typer.Option(help="Sweep even when the GPU here is not the one named by --gpu.")] = False,
    devices: Annotated[str | None, typer.Option(help="Comma-separated GPU indices to spread the sweep over, e.g. 0,1.")] = None,
    fresh: Annotated[bool, typer.Option(help="Move earlier results aside and start over instead of resuming.")] = False,
    candidate_timeout: Annotated[float | None, typer.Option(
        help="Seconds one candidate may run before its worker is killed and it is recorded as a "
             "timeout; default: the config's candidate_timeout_s, else 120.")] = None,
) -> None:
    """Sweep every candidate kernel per shape on this GPU and write its dispatch table."""
    if candidate_timeout is not None and not candidate_timeout > 0:
        raise typer.BadParameter(f"--candidate-timeout must be a positive number of seconds, got {candidate_timeout}")
    # passed only when given, so run_sweep's own default (the config's limit) applies otherwise
    timeout = {} if candidate_timeout is None else {"candidate_timeout_s": candidate_timeout}
    device_list = None
    if devices is not None:
        try:
            device_list = [int(d) for d in _list(devices, "--devices")]
        except ValueError:
            raise typer.BadParameter(f"--devices must be GPU indices like 0,1, got {devices!r}") from None
    with _domain_errors():
        from mla_tune.sweep import run_sweep

        run_sweep(config, gpu, out=out, dry_run=dry_run, force=force, devices=device_list, fresh=fresh,
                  **timeout)


@app.command()
def export(
    output: Annotated[Path, typer.Option("--output", "-o", help="The submission file to write.")],
    gpu: Annotated[str | None, typer.Option(help="The GPU whose table to export (tables/GPU.yaml).")] = None,
    table: Annotated[Path | None, typer.Option(help="A table file to export instead of tables/GPU.yaml.")] = None,
    only: Annotated[str | None, typer.Option(help="Comma-separated backends the file may use, e.g. triton,torch.")] = None,
) -> None:
    """Write a table as one self-contained leaderboard submission file."""
    from mla_tune.export import export_submission
    from mla_tune.table import load_table

    path = _table_path(gpu, table)
    backends = _list(only, "--only")
    with _domain_errors():
        loaded = load_table(path)
        if gpu and loaded.gpu != gpu:
            raise ValueError(f"table {path} is for {loaded.gpu}, not {gpu}; pass the right --table or --gpu")
        written = export_submission(path, output, only_backends=backends)
    Console(soft_wrap=True).print(f"wrote {escape(str(written))}: {len(loaded.rows)} shapes from {escape(str(path))}"
                                  + (f", backends limited to {', '.join(backends)}" if backends else ""))


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


@app.command()
def show(
    gpu: Annotated[str | None, typer.Option(help="Show tables/GPU.yaml for this GPU.")] = None,
    table: Annotated[Path | None, typer.Option(help="Show this table file instead.")] = None,
) -> None:
    """Show a dispatch table: each shape's winner and its evidence, then its provenance."""
    from mla_tune.table import load_table

    path = _table_path(gpu, table)
    with _domain_errors():
        loaded = load_table(path)
    view = RichTable(title=f"{escape(str(path))} ({loaded.gpu}), times in us")
    for name in ("shape", "winner", "time", "spread", "runner-up", "baseline", "speedup",
                 "floor share", "tried/rejected"):
        view.add_column(name, overflow="fold")
    notes = []
    for shape, row in sorted(loaded.rows.items()):
        counts = row["candidates"]
        runner = row["runner_up"]
        if row["winner"] is None:
            winner = "[red]none (see below)[/]"
            notes.append(f"[red]{shape}: no winner[/]: {escape(row['reason'])}; the fallback serves it")
        else:
            winner = escape(row["winner"]["variant"])
        speedup = (f"{row['baseline_us'] / row['time_us']:.2f}x"
                   if row["winner"] and row["baseline_us"] else "-")
        view.add_row(
            str(shape), winner, _us(row["time_us"]), _share(row["spread"]),
            f"{_us(runner['time_us'])} {escape(runner['variant'])}" if runner else "-",
            _us(row["baseline_us"]), speedup, _share(row["floor_share"]),
            f"{counts.get('tried', 0)}/{counts.get('rejected', 0)}",
        )
    prov = loaded.provenance
    rule, config = prov["rule"], prov["config"]
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
    lines = [
        f"device: {prov['device_name']} ({prov['arch']}), driver {prov['driver'] or '-'}",
        f"versions: {versions}",
        f"tuned: {prov['date']} with mla-tune {prov['mla_tune_version']}",
        f"config: {config.get('path')} (hash {config.get('hash')})",
        f"rule: {rule.get('name')} rtol={rule.get('rtol')} atol={rule.get('atol')} "
        f"allowance={rule.get('allowance')}",
        f"timing: {prov['protocol'].get('name', '-')}; copy bandwidth "
        f"{prov['copy_bandwidth_gbps'] or '-'} GB/s",
    ]
    console = Console()
    console.print(view)
    for note in notes:
        console.print(note)
    console.print(Panel(escape("\n".join(lines)), title="provenance"))
