"""The `mla-tune` command line: sweep, export, show, diff, report, verify, compile, time.

Commands are thin: they parse options, call the module that does the work, and turn
mla-tune's own errors (MlaTuneError: TableError, ExportError, ConfigError, SweepError, ...)
into one red line and exit 1. Any other exception is a bug in mla-tune and keeps its
traceback. Reading commands (show, diff) import neither torch nor a backend.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mla_tune import __version__
from mla_tune.errors import MlaTuneError
from mla_tune.locate import GPU_NAME, config_path

app = typer.Typer(rich_markup_mode="rich", no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]})

# A GPU name becomes a file name (tables/NAME.yaml): letters, digits, '-' and '_' only.
_GPU_NAME = GPU_NAME


@contextmanager
def _domain_errors() -> Iterator[None]:
    try:
        yield
    except MlaTuneError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None


def _usage_error(message: str) -> typer.Exit:
    """A bad option value: one red line and exit 2 (typer's own errors draw a box)."""
    typer.secho(f"error: {message}", fg="red", err=True)
    return typer.Exit(2)


def _check_gpu(value: str | None) -> str | None:
    if value is not None and not _GPU_NAME.fullmatch(value):
        raise _usage_error(f"--gpu {value!r} is not a GPU name; use letters, digits, '-' and '_' "
                           "only, like H200 or MI355X")
    return value


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mla-tune {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print mla-tune's version and exit.")] = False,
) -> None:
    """Offline autotuner for MLA decode attention: sweep a GPU, review its table, export it."""


def _table_path(gpu: str | None, table: Path | None) -> Path:
    if table is not None:
        return table
    if not gpu:
        raise _usage_error("name the GPU with --gpu NAME or a table file with --table PATH")
    from mla_tune import locate  # $MLA_TUNE_TABLES, ./tables, the packaged tables

    path = locate.find_table(gpu)
    if path is None:
        dirs = locate.table_dirs()
        here = locate.available()
        same = [name for name in here if name.lower() == gpu.lower()]
        where = (str(dirs[0][1] / f"{gpu}.yaml") if len(dirs) == 1 else
                 f"{gpu}.yaml in {locate.searched_text(gpu)}")
        hint = (f"did you mean --gpu {same[0]}?" if same else
                f"tables here: {', '.join(here)}" if here else "no tables there: set "
                f"{locate.ENV_TABLES} to a folder of tables or pass --table PATH")
        raise MlaTuneError(f"no table {where} for --gpu {gpu} ({hint}); make one with "
                           f"`mla-tune sweep --gpu {gpu}`")
    return path


def _same_gpu(table: Path, tuned: str, gpu: str) -> None:
    """--gpu and --table both given: the table must be the GPU's."""
    if tuned != gpu:
        raise MlaTuneError(f"table {table} is for {tuned}, not {gpu}; pass the right --table or --gpu")


def _prior_for_show(gpu: str | None, table: Path | None) -> Path | None:
    """For `show --gpu NAME` with no table for NAME but a prior (configs/priors/NAME.yaml, what
    `mla-tune export --gpu NAME` writes before any sweep): the prior's path, said on stderr."""
    if table is not None or not gpu:
        return None
    from mla_tune import locate
    from mla_tune.tables.prior import find_prior

    if locate.find_table(gpu) is not None:
        return None
    prior = find_prior(gpu)
    if prior is not None:
        typer.echo(f"no table for {gpu} yet (make one with `mla-tune sweep --gpu {gpu}`); showing its "
                   f"prior {prior}: choices made without measuring", err=True)
    return prior


def _list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise _usage_error(f"{what} must be a comma-separated list, got {text!r}")
    return items


def _print_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


_GpuOption = Annotated[str | None, typer.Option(
    callback=_check_gpu, help="The GPU whose table to use: GPU.yaml (e.g. H200) from "
    "$MLA_TUNE_TABLES, ./tables or the packaged tables, first found.")]
_TableOption = Annotated[Path | None, typer.Option(
    help="A table file to use instead of tables/GPU.yaml.")]
_JsonOption = Annotated[bool, typer.Option(
    "--json", help="Print JSON for scripts instead of the text view.")]


class CompileCheck(str, Enum):
    """sweep --compile-check: the cross-compile check before a sweep, on, off or auto."""

    auto = "auto"
    on = "on"
    off = "off"


@app.command()
def sweep(
    gpu: Annotated[str, typer.Option(
        callback=_check_gpu, help="The GPU to tune, by its canonical name (H200, MI355X).")],
    config: Annotated[Path | None, typer.Option(
        help="The sweep config: its shapes, correctness rule and search space; the default is "
             "the GPU's own (configs/leaderboard.yaml for H200 and H100, configs/mi355x.yaml for "
             "MI355X and MI300X).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Where to write the table; the default is tables/GPU.yaml.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Plan the sweep and print the plan without running anything.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Sweep even when the GPU here is not the one --gpu names.")] = False,
    devices: Annotated[str | None, typer.Option(
        help="Comma-separated GPU indices to spread the sweep over, e.g. 0,1.")] = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Move earlier results aside and start over instead of resuming.")] = False,
    candidate_timeout: Annotated[float | None, typer.Option(
        help="Seconds one candidate may run before its worker is killed and it is recorded as a "
             "timeout; the default is the config's candidate_timeout_s, else 120.")] = None,
    budget: Annotated[float | None, typer.Option(
        help="Seconds this sweep may take, instead of the config's budget_s. A sweep the budget "
             "stops exits 3 and resumes with the same command (a larger --budget times what is "
             "left; a candidate still running at the budget's end is not recorded).")] = None,
    compile_check: Annotated[CompileCheck, typer.Option(
        "--compile-check", case_sensitive=False,
        help="Cross-compile the plan's own kernels for the GPU first and drop the candidates that "
             "do not compile, exceed its shared memory or duplicate another's binary (as `mla-tune "
             "compile` does): on, off, or auto (on for a sweep on a GPU, off for --dry-run).")] = CompileCheck.auto,
    shard: Annotated[str | None, typer.Option(
        help="A serving config: sweep only shard i of n (every n-th unit from the i-th), e.g. 1/2, "
             "into its own results file.")] = None,
    merge: Annotated[str | None, typer.Option(
        help="A serving config: build the table from these comma-separated results files (the "
             "shards' ones) instead of sweeping.")] = None,
    refit: Annotated[Path | None, typer.Option(
        help="With --merge: keep this serving table's cells, points, graph picks and calibration "
             "and fit only its schedule models again from the results it was built from (after a "
             "backend's schedule model changes; no GPU); writes --out, else the table itself.")] = None,
) -> None:
    """Sweep every candidate kernel per shape on this GPU and write its dispatch table.

    A serving config (configs/serving.yaml: families, batch and kv buckets) runs the serving
    sweep instead and writes tables/GPU.serving.yaml (mla_tune/serving/sweep.py); with it,
    --shard i/n sweeps one shard and --merge builds the table from the shards' results."""
    if candidate_timeout is not None and not candidate_timeout > 0:
        raise _usage_error(f"--candidate-timeout must be a positive number of seconds, got {candidate_timeout}")
    if dry_run and (fresh or candidate_timeout is not None):
        raise _usage_error("--dry-run prints the plan and runs nothing: --fresh and --candidate-timeout apply "
                           "to a sweep that runs; drop them, or drop --dry-run")
    # passed only when given, so run_sweep's own defaults (the config's limits) apply otherwise
    timeout = {} if candidate_timeout is None else {"candidate_timeout_s": candidate_timeout}
    if budget is not None and not budget > 0:
        raise _usage_error(f"--budget must be a positive number of seconds, got {budget}")
    if budget is not None:
        timeout["budget_s"] = budget
    if compile_check is not CompileCheck.auto:
        timeout["compile_check"] = compile_check is CompileCheck.on
    device_list = None
    if devices is not None:
        try:
            device_list = [int(d) for d in _list(devices, "--devices")]
        except ValueError:
            raise _usage_error(f"--devices must be GPU indices like 0,1, got {devices!r}") from None
        if len(set(device_list)) != len(device_list) or min(device_list) < 0:
            raise _usage_error(f"--devices must be distinct GPU indices (0 or more) like 0,1, got {devices!r}")
    if config is None:  # the GPU's own search space (gpu.KNOWN_GPUS)
        from mla_tune.gpu import default_config

        config = Path(default_config(gpu))
    config = config_path(config)  # configs/NAME.yaml, else the packaged copy (mla_tune/locate.py)
    if refit is not None and merge is None:
        raise _usage_error("--refit fits a table's models again from its results: give them with --merge")
    with _domain_errors():
        from mla_tune.serving.config import is_serving_config

        if refit is not None:
            from mla_tune.serving.build import refit_models

            refit_models(refit, [Path(m) for m in _list(merge, "--merge")], out=out)
            return

        if is_serving_config(config):  # a serving grid (configs/serving.yaml): its own sweep
            from mla_tune.serving.sweep import sweep_from_cli

            code = sweep_from_cli(config, gpu, out=out, dry_run=dry_run, force=force,
                                  devices=device_list, fresh=fresh, budget=budget, shard=shard,
                                  merge_results=[Path(m) for m in _list(merge, "--merge")] if merge else None,
                                  candidate_timeout=candidate_timeout)
            if code:
                raise typer.Exit(code)
            return
        if shard is not None or merge is not None:
            raise _usage_error("--shard and --merge are for a serving config (configs/serving.yaml)")
        from mla_tune.tune.sweep import SweepInterrupted, run_sweep

        try:
            summary = run_sweep(config, gpu, out=out, dry_run=dry_run, force=force, devices=device_list,
                                fresh=fresh, **timeout)
        except SweepInterrupted:  # run_sweep printed how to resume; no "Aborted!" after it
            raise typer.Exit(130) from None
        if getattr(summary, "stopped", False):  # the budget stopped it (run_sweep said how to resume)
            raise typer.Exit(3)


@app.command("compile")
def compile_(
    gpu: Annotated[str, typer.Option(
        callback=_check_gpu, help="The GPU to compile for, by its canonical name (H200, MI355X); "
                                  "its architecture comes from mla_tune/gpu.py's KNOWN_GPUS.")],
    config: Annotated[Path | None, typer.Option(
        help="The sweep config whose plan to compile; the default is the GPU's own, as for "
             "sweep.")] = None,
    triton_python: Annotated[str | None, typer.Option(
        "--triton", help="Compile under this Python instead (one with the target image's Triton "
                         "and mla_tune installed, e.g. a venv's bin/python); its JSON is read back.")] = None,
    jobs: Annotated[int | None, typer.Option(
        help="Compiler processes; the default is this machine's CPU count.")] = None,
    as_json: _JsonOption = False,
    as_markdown: Annotated[bool, typer.Option(
        "--markdown", help="Print a Markdown section (for docs/compile.md) instead of the text view.")] = False,
    users: Annotated[bool, typer.Option(
        "--users", help="List under each binary every candidate that launches it.")] = False,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Compile everything again instead of reusing and keeping results by "
                           "binary key in $MLA_TUNE_CACHE/compile (default ~/.cache/mla-tune/compile).")] = False,
) -> None:
    """Cross-compile every distinct kernel binary of the sweep's plan for a GPU, without it.

    The launches are captured from the backends' real launch path at the real shapes (on the
    meta device) and compiled with Triton for the GPU's architecture. Per binary it prints ok
    or the compiler's first error line, registers, scratch (spills), shared memory, MMA count,
    occupancy and how many candidates use it, then the candidates a sweep drops: those that do
    not compile, exceed the GPU's shared memory, or duplicate another's binary. Exits 1 when a
    binary does not compile or a candidate's launches could not be captured."""
    if jobs is not None and jobs < 1:
        raise _usage_error(f"--jobs must be a positive number of processes, got {jobs}")
    if as_json and as_markdown:
        raise _usage_error("--json and --markdown are two views of one report: pass one")
    if users and (as_json or as_markdown):
        raise _usage_error("--users lists each binary's candidates in the text view (--json holds them "
                           "already; --markdown has no such list): drop --users, or --json/--markdown")
    if config is None:
        from mla_tune.gpu import default_config

        config = Path(default_config(gpu))
    config = config_path(config)
    with _domain_errors():
        from mla_tune.xcompile.check import check_plan, facts_for, run_in

        facts_for(gpu)  # an unknown GPU is refused before anything is captured

        def progress(text: str) -> None:
            typer.echo(f"  {text}", err=True)

        if triton_python:
            report = run_in(triton_python, gpu, jobs, not no_cache, config=config, log=progress)
        else:
            from mla_tune.gpu import fake_platform
            from mla_tune.tune.config import load_config
            from mla_tune.tune.sweep import plan_candidates

            planned = plan_candidates(load_config(config), fake_platform(gpu), planning_only=True)
            report = check_plan(planned.plan, gpu, jobs, not no_cache, log=progress)
            report["config"] = str(config)
    from mla_tune.xcompile.report import markdown, text_lines

    if as_json:
        _print_json(report)
    elif as_markdown:
        command = f"mla-tune compile --gpu {gpu} --config {config}" + (
            f" --triton {triton_python}" if triton_python else "")
        typer.echo(markdown(report, command), nl=False)
    else:
        for line in text_lines(report, users):
            typer.echo(line)
    failed = sum(1 for b in report["binaries"] if not b.get("ok")) + len(report["capture_errors"])
    if failed:
        typer.secho(f"error: {failed} binaries or captures failed for {gpu} (listed above)", fg="red", err=True)
        raise typer.Exit(1)


@app.command()
def export(
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="The submission file to write; an existing file is replaced only "
                               "if it is an earlier submission.")],
    gpu: _GpuOption = None,
    table: _TableOption = None,
    only: Annotated[str | None, typer.Option(
        help="Comma-separated backends the file may use, e.g. triton,torch.")] = None,
) -> None:
    """Write a table as one self-contained leaderboard submission file.

    With --gpu and no table for that GPU, the GPU's prior (configs/priors/GPU.yaml: untuned
    choices, never measured) is written instead where there is one, and the file says so.
    """
    backends = _list(only, "--only")
    with _domain_errors():
        from mla_tune.export import ExportError, export_submission
        from mla_tune.tables.prior import find_prior
        from mla_tune.tables.table import load_table

        prior = find_prior(gpu) if gpu and table is None else None
        try:
            path = _table_path(gpu, table)
        except MlaTuneError:
            if prior is None:
                raise
            path = prior  # no table for this GPU: its prior, said to be one
        loaded = load_table(path)
        if gpu and loaded.gpu != gpu:
            raise ExportError(f"table {path} is for {loaded.gpu}, not {gpu}; pass the right --table or --gpu")
        written = export_submission(path, output, only_backends=backends)
    typer.echo(f"wrote {written}: {len(loaded.rows)} shapes from {path}"
               + (f", backends limited to {', '.join(backends)}" if backends else ""))
    if loaded.is_prior:
        typer.echo(f"{path} is a PRIOR, not a measurement: untuned choices, never timed on the "
                   f"{loaded.gpu}; `mla-tune show --table {path}` lists them, `mla-tune sweep --gpu "
                   f"{loaded.gpu}` on that GPU makes a measured table")


@app.command()
def show(
    gpu: _GpuOption = None,
    table: _TableOption = None,
    serving: Annotated[bool, typer.Option(
        "--serving", help="With --gpu: show the GPU's serving table (GPU.serving.yaml) instead "
                          "of its leaderboard table.")] = False,
    times: Annotated[bool, typer.Option(
        "--times", help="A serving table: under each family's grid of picks, the grid of their "
                        "measured times in us.")] = False,
    as_json: _JsonOption = False,
) -> None:
    """Show a dispatch table: each shape's winner and its evidence, then its
    provenance.

    The text fits the terminal (80 columns in a pipe) and prints each winner's
    full variant on lines that start with its shape, so `grep num_splits=16`
    finds it. Variants are checked against the backends' parameter rules as data
    (backends/params.py), with the messages export gives; the rules over several
    parameters are left to the runtime and the export, so show never imports
    torch.

    A serving table (--serving, or --table tables/GPU.serving.yaml) shows its
    families, its batch and kv buckets, and per family a grid of its picks, a
    letter per variant: the eager pick of each (batch bucket, kv bucket) and the
    graph pick of each batch bucket, then each letter's variant in full on lines
    that start with the family's tag (mla_tune/serving/render.py). Where a
    leaderboard table has a serving table beside it, the last line says so.
    """
    from mla_tune.serving.render import table_kind
    from mla_tune.tables.render import line_width

    with _domain_errors():
        if serving and table is None:
            from mla_tune import locate

            if not gpu:
                raise _usage_error("--serving needs the GPU: pass --gpu NAME (or the file with --table PATH)")
            path = locate.table_path(gpu, serving=True)
        else:
            path = _prior_for_show(gpu, table) or _table_path(gpu, table)
        kind = table_kind(path)
        if serving and kind != "serving":
            raise _usage_error(f"--serving shows a serving table, and {path} is not one: give the serving "
                               "table's path with --table, or --gpu NAME --serving")
        if times and kind != "serving":
            raise _usage_error("--times shows a serving table's measured times; a leaderboard table's are "
                               "in its rows already")
        if kind == "serving":
            _show_serving(path, as_json, times, gpu if table is not None else None)
            return
        from mla_tune.tables.table import load_table

        loaded = load_table(path, check_params=False)
        if gpu and table is not None:
            _same_gpu(table, loaded.gpu, gpu)
    if as_json:
        _print_json({"path": str(path), **loaded.as_dict()})
        return
    from mla_tune.tables.render import table_lines, wrap

    for line in table_lines(loaded, line_width()):
        typer.echo(line)
    beside = path.with_name(path.name[: -len(".yaml")] + ".serving.yaml") if path.name.endswith(".yaml") else None
    if beside is not None and beside.is_file():
        how = f"--gpu {gpu} --serving" if gpu and table is None else f"--table {beside}"
        for line in wrap("", f"A serving table sits beside it: `mla-tune show {how}` shows it.", line_width()):
            typer.echo(line)


def _show_serving(path: Path, as_json: bool, times: bool, gpu: str | None = None) -> None:
    """Show the serving table at `path`; `gpu` (--gpu beside --table): the table must be its."""
    from mla_tune.serving.render import show_lines, show_view
    from mla_tune.serving.table import load_serving_table
    from mla_tune.tables.render import line_width

    loaded = load_serving_table(path, check_params=False)
    if gpu:
        _same_gpu(path, loaded.gpu, gpu)
    if as_json:
        _print_json(show_view(loaded, path))
        return
    for line in show_lines(loaded, path, line_width(), times):
        typer.echo(line)


@app.command()
def diff(
    old: Annotated[Path, typer.Argument(help="The earlier table file.")],
    new: Annotated[Path, typer.Argument(help="The later table file.")],
    as_json: _JsonOption = False,
) -> None:
    """Compare two tables shape by shape: winner changes and time changes beyond
    the noise.

    A time change is flagged when it is larger than the noise both tables
    record: the bigger of the two rows' spreads (p90-p10 over the median), at
    least the tie tolerance.

    Two serving tables compare per family, cell by cell (batch bucket x kv
    bucket) and graph pick by graph pick: pick changed, time changed beyond the
    noise (a serving table records no spread, so the tie tolerance). The text
    lists the changed cells; --json has every one. A leaderboard table and a
    serving table do not compare.
    """
    from mla_tune.serving.render import table_kind
    from mla_tune.tables.render import line_width

    with _domain_errors():
        kinds = {table_kind(old), table_kind(new)} - {None}  # None: unreadable, its loader says why
        if len(kinds) == 2:
            which = {p: table_kind(p) for p in (old, new)}
            from mla_tune.serving.table import load_serving_table
            from mla_tune.tables.table import load_table

            for path, kind in which.items():  # a file that is not a table of its kind: its own error
                (load_serving_table if kind == "serving" else load_table)(path, check_params=False)
            raise MlaTuneError(f"cannot diff {old} (a {which[old]} table) against {new} (a {which[new]} "
                               "table); diff two leaderboard tables (GPU.yaml) or two serving tables "
                               "(GPU.serving.yaml)")
        if kinds == {"serving"}:
            from mla_tune.serving.render import diff_serving, serving_diff_lines
            from mla_tune.serving.table import load_serving_table

            serving_diff = diff_serving(load_serving_table(old, check_params=False),
                                        load_serving_table(new, check_params=False))
            if as_json:
                _print_json({"old": str(old), "new": str(new), **serving_diff})
                return
            for line in serving_diff_lines(serving_diff, old, new, line_width()):
                typer.echo(line)
            return
        from mla_tune.tables.diff import diff_lines, diff_tables
        from mla_tune.tables.table import load_table

        before, after = load_table(old, check_params=False), load_table(new, check_params=False)
    changes = diff_tables(before, after)
    if as_json:
        _print_json({"old": str(old), "new": str(new), "shapes": changes})
        return
    for line in diff_lines(changes, old, new, line_width()):
        typer.echo(line)


@app.command()
def report(
    gpu: _GpuOption = None,
    table: _TableOption = None,
    out: Annotated[Path, typer.Option(
        help="The folder to write report.md and its plots into.")] = Path("docs/report"),
    results: Annotated[Path | None, typer.Option(
        help="The sweep's results file; the default is the one next to the table "
             "(tables/GPU.results.jsonl).")] = None,
) -> None:
    """Write a Markdown report of a table with plots (needs matplotlib: the `report` extra).

    Per shape: the winner's time and share of copy bandwidth against the floor and each
    backend's best; and, from the results file, time against split count and block size.
    """
    with _domain_errors():
        from mla_tune.report import write_report

        path = _table_path(gpu, table)
        written = write_report(path, out, results_path=results)
    typer.echo(f"wrote {written}")


@app.command()
def verify(
    table: Annotated[Path, typer.Option(
        help="The serving table to verify, e.g. tables/H200.serving.yaml.")],
    config: Annotated[Path | None, typer.Option(
        help="The serving config for the candidates and left-out rules; the default is the one "
             "the table's provenance names.")] = None,
    shapes: Annotated[int, typer.Option(
        help="How many held-out uniform shapes (off the table's grid) to time.")] = 30,
    ragged: Annotated[int, typer.Option(
        help="How many ragged mixes (each sequence's length drawn on its own) to time.")] = 10,
    seed: Annotated[int, typer.Option(
        help="The seed the shapes and their inputs are drawn from.")] = 0,
    samples: Annotated[int, typer.Option(
        help="Samples per measurement in the final round (4 alternating passes).")] = 5,
    families: Annotated[str | None, typer.Option(
        help="Only the families matching these field=value terms, e.g. kv_format=fp8,heads=128.")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write the whole report (times, variants, seeds, device, versions) to this file.")] = None,
    max_p95: Annotated[float | None, typer.Option(
        help="Fail (exit 1) when the judged pick's p95 regret is over this fraction, e.g. 0.05.")] = None,
    max_regret: Annotated[float | None, typer.Option(
        help="Fail (exit 1) when the judged pick's largest regret is over this fraction, e.g. 0.15.")] = None,
    judge: Annotated[str, typer.Option(
        help="Which pick the thresholds judge: eager, graph or both.")] = "eager",
    budget: Annotated[float | None, typer.Option(
        help="Seconds the run may take; it stops between shapes (exit 3) and reports what it measured.")] = None,
    workers: Annotated[int | None, typer.Option(
        help="Processes that compile each kernel ahead of timing; the default is the config's "
             "gate_workers on a GPU, 0 (none) without one.")] = None,
    rescore: Annotated[list[Path] | None, typer.Option(
        help="No GPU: score the table's picks on recorded verify reports (--json files, plain "
             "or .gz, or a folder of them; repeat the option) instead of timing; --max-p95, --max-regret, "
             "--judge and --json apply, the shape and timing options do not. For comparing "
             "tables offline; a table is accepted on a GPU run at fresh seeds.")] = None,
    unrunnable: Annotated[list[str] | None, typer.Option(
        help="With --rescore: score the table as a DecodePlan steps on a machine where this "
             "backend cannot run (repeat the option): a pick of it is replaced by the fastest "
             "estimate that runs, else the cell's runner-up, else the fallback. For reports "
             "recorded before a backend was a candidate.")] = None,
    repick_graph: Annotated[Path | None, typer.Option(
        help="With --rescore: re-choose each batch bucket's CUDA-graph pick on those reports (the "
             "variant with the smallest geomean regret over the bucket's recorded shapes, where it "
             "beats the current pick by 3% on 6 shapes or more; mla_tune/serving/repick.py) and write "
             "the table to this path instead of scoring. Choose on one half of the reports and judge "
             "the written table on the other (--judge graph). With --engine-loop: on those loops' "
             "step times instead.")] = None,
    engine_loop: Annotated[list[Path] | None, typer.Option(
        help="With --repick-graph, no GPU: re-choose the graph picks of the buckets these engine-loop "
             "reports timed (scripts/engine_loop.py --table T --variants ... --out DIR writes "
             "DIR/engine_loop.json; repeat the option), where a variant's step is 3% faster than the "
             "current pick's over the loops. The reports must come from the table's GPU.")] = None,
) -> None:
    """Re-time a serving table's picks on this GPU at held-out shapes and print their regret.

    At each shape (log-uniform off the table's grid, and ragged mixes) the eager pick, the
    CUDA-graph pick and the fallback are timed beside the best of the family's candidates
    measured there; regret = t(pick) / t(best) - 1, summarized as geomean, p95 and max
    (mla_tune/serving/verify.py). With --rescore, no GPU: the picks are scored on the times
    recorded in earlier runs' --json reports (mla_tune/serving/rescore.py)."""
    if budget is not None and not budget > 0:
        raise _usage_error(f"--budget must be a positive number of seconds, got {budget}")
    for flag, value in (("--max-p95", max_p95), ("--max-regret", max_regret)):
        if value is not None and not 0 <= value <= 1:
            raise _usage_error(f"{flag} is a fraction (0.05 for 5%), got {value}")
    if unrunnable and not rescore:
        raise _usage_error("--unrunnable scores recorded reports: give them with --rescore")
    if engine_loop and repick_graph is None:
        raise _usage_error("--engine-loop re-chooses graph picks: give --repick-graph OUT, the table to write")
    if repick_graph is not None and bool(rescore) == bool(engine_loop):
        raise _usage_error("--repick-graph chooses on recorded runs: give verify reports with --rescore, or "
                           "engine-loop reports with --engine-loop (one of the two)")
    if repick_graph is not None:
        ignored = [flag for flag, given in (("--json", json_path is not None), ("--max-p95", max_p95 is not None),
                                           ("--max-regret", max_regret is not None)) if given]
        if ignored:
            raise _usage_error(f"--repick-graph writes a table and judges nothing: drop {', '.join(ignored)} "
                               "(judge the written table with a second verify --rescore)")
        target = Path(repick_graph)
        if target.exists() and target.resolve() == Path(table).resolve():
            raise _usage_error(f"--repick-graph {repick_graph} is the table it re-chooses from: write a new "
                               "file, and review it beside the old one (mla-tune diff)")
        with _domain_errors():
            from mla_tune.serving.repick import repick_graph as run_repick
            from mla_tune.serving.repick import repick_graph_on_steps
            from mla_tune.serving.table import load_serving_table, write_serving_table
            from mla_tune.tables.table import TableError

            if target.exists():
                try:
                    load_serving_table(target)
                except TableError:
                    raise MlaTuneError(f"{repick_graph} exists and is not a serving table: give a new path "
                                       "(--repick-graph overwrites only a serving table)") from None
            chosen = load_serving_table(table)
            if engine_loop:
                typer.echo(f"graph picks of {table}, re-chosen on the step times of {len(engine_loop)} "
                           "engine loop(s):")
                changes = repick_graph_on_steps(chosen, list(engine_loop), log=typer.echo)
            else:
                typer.echo(f"graph picks of {table}, re-chosen on the recorded shapes of {len(rescore)} "
                           "--rescore path(s):")
                changes = run_repick(chosen, list(rescore), log=typer.echo)
            written = write_serving_table(repick_graph, chosen)
            load_serving_table(written)  # what was written loads
        judge_it = (f"python scripts/engine_loop.py --table {written} --out DIR, at other lengths (--lens)"
                    if engine_loop else f"mla-tune verify --table {written} --rescore OTHER_REPORTS --judge graph")
        typer.echo(f"wrote {written}: {len(changes)} graph pick(s) replaced. Judge it on other runs: {judge_it}")
        return
    if rescore:
        with _domain_errors():
            from mla_tune.serving.rescore import rescore as run_rescore

            out = run_rescore(table, list(rescore), max_p95=max_p95, max_regret=max_regret, judge=judge,
                              json_path=json_path, unrunnable=unrunnable or (), log=typer.echo)
        if out["exit_code"]:
            raise typer.Exit(out["exit_code"])
        return
    with _domain_errors():
        if os.environ.get("TRITON_INTERPRET") != "1":
            import torch

            if not torch.cuda.is_available():
                raise MlaTuneError("verify times the picks on a CUDA GPU, and torch sees none here: run it on "
                                   "the table's GPU, or score recorded runs without one (--rescore REPORTS)")
        from mla_tune.serving.verify import run_verify

        report = run_verify(table, config=config, shapes=shapes, ragged=ragged, seed=seed, samples=samples,
                            families=families, budget_s=budget, workers=workers, max_p95=max_p95,
                            max_regret=max_regret, judge=judge, json_path=json_path, log=typer.echo)
    if report["exit_code"]:
        raise typer.Exit(report["exit_code"])


# `mla-tune time` (mla_tune/time_cli.py), last: it imports neither torch nor a backend.
from mla_tune.time_cli import register as register_time  # noqa: E402

register_time(app)


def _prose(text: str) -> str:
    """A docstring's paragraphs each on one line, blank lines between them: typer's rich help
    keeps a paragraph's line breaks, so a docstring wrapped in the source would print ragged
    lines in any terminal (every command's docstring is prose: no lists, no code)."""
    return "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines())
                       for paragraph in inspect.cleandoc(text).split("\n\n"))


def _unwrap_help(typer_app: typer.Typer) -> None:
    """Every command's help (its docstring where not given) as `_prose`, sub-commands too."""
    for info in typer_app.registered_commands:
        info.help = _prose(info.help or inspect.getdoc(info.callback) or "")
    for group in typer_app.registered_groups:
        _unwrap_help(group.typer_instance)


_unwrap_help(app)
