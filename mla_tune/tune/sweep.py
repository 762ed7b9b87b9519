"""The sweep: every (shape, candidate) through the correctness gate, then successive halving
over timing rungs (mla_tune/tune/search.py) within a time budget (sweep_schedule.py), into
an append-only results file, then the dispatch table.

The main process plans, schedules and records; it never runs a kernel and never starts
CUDA (a cheap name query refuses another GPU before any worker starts; the platform comes
from the first worker). Each device has one worker process (mla_tune.tune.worker); a candidate
that kills its worker is recorded as "crashed", one that runs past its limit is killed and
recorded as "timeout", and a fresh worker takes the next step. Records are appended one
fsynced line per finished step, so a killed sweep resumes where it stopped; a lock file
keeps two sweeps off one table.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import mla_tune
from mla_tune import gpu as gpu_mod
from mla_tune.backends import dedupe_key, get_backend, platform_refusal
from mla_tune.core import Shape, Variant
from mla_tune.errors import MlaTuneError
from mla_tune.tables.table import STATUSES
from mla_tune.tune import timing
from mla_tune.tune.compile_pool import plan_jobs
from mla_tune.tune.config import Config, expand_space, load_config
from mla_tune.tune.progress import Progress, print_plan, say, summarize
from mla_tune.tune.results import (
    SCHEMA,
    ResultsError,
    ResultsWriter,
    SweepLock,
    lock_path_for,
    move_aside,
    read_results,
    repair_tail,
    results_path_for,
)
from mla_tune.tune.runner import DeviceRunner, Shared
from mla_tune.tune.schedule import (
    BudgetClock,
    CostModel,
    FittedPlan,
    assign_shapes,
    cost_model_for,
    fit_plan,
)
from mla_tune.tune.worker import (
    GATE_MARGIN,
    WorkerGone,
    WorkerHandle,
    WorkerTimeout,
    precompile,
    probe_platform,
)

DEFAULT_CANDIDATE_TIMEOUT_S = 120.0


class SweepError(MlaTuneError, ValueError):
    """The sweep cannot start or go on; the message says what was found and what to do."""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C: the workers are stopped, what was recorded is kept; str() says how to resume."""


@dataclass
class SweepSummary:
    counts: dict[str, int]
    timed: int  # candidates that went through the timer in this run (ok + pruned)
    elapsed_s: float
    table_path: Path | None
    results_path: Path
    winners: dict[str, dict]  # "4x1024" -> {"variant": ..., "median_us": ...}
    dry_run: bool = False
    plan: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # shape -> backend -> variants
    unavailable: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    estimate_s: float | None = None
    rung_plan: dict[str, list[int]] = field(default_factory=dict)  # shape -> candidates per rung
    compile_drops: dict[str, dict[str, str]] = field(default_factory=dict)  # shape -> variant -> reason
    stopped: bool = False  # the budget's hard deadline stopped the sweep: run it again to resume


@dataclass
class Planned:
    """Where the candidates come from: the plan per shape and what planning found."""

    plan: dict[Shape, list[Variant]]
    unavailable: dict[str, str]
    listed_anyway: dict[str, str]
    duplicates: int  # candidates dropped because another had the same dedupe key
    # dropped by the compile check (mla_tune/xcompile): shape -> variant -> reason
    compile_drops: dict[str, dict[str, str]] = field(default_factory=dict)
    compile: dict | None = None  # the check's summary, for the results header


# ---------------------------------------------------------------------------- plan
def plan_candidates(config: Config, platform: gpu_mod.Platform, planning_only: bool = False) -> Planned:
    """Every backend's candidates per shape, deduplicated by the backends' `dedupe_key`.

    A backend that cannot run here is recorded once with its reason, not an error: one
    whose CAPABILITIES.platforms do not include `platform` (the GPU planned for, in a dry
    run too), then one whose own unavailable_reason() says why not. For a dry run for an
    absent GPU (`planning_only`) the latter's candidates are still listed, so the plan
    shows what the real sweep would try.
    """
    plan: dict[Shape, list[Variant]] = {shape: [] for shape in config.shapes}
    unavailable: dict[str, str] = {}
    listed_anyway: dict[str, str] = {}
    duplicates = 0
    seen: dict[Shape, set] = {shape: set() for shape in config.shapes}
    for name, space in config.backends.items():
        try:
            backend = get_backend(name)
            refusal = platform_refusal(name, platform)
            reason = None if refusal else backend.unavailable_reason()
        except ImportError as exc:  # a backend module that does not import cannot run
            unavailable[name] = f"its module does not import ({type(exc).__name__}: {exc})"
            continue
        if refusal:  # not even planned: this GPU is not one it is written for
            unavailable[name] = refusal
            continue
        if reason and not planning_only:
            unavailable[name] = reason
            continue
        problems = []
        for shape in config.shapes:
            try:
                offered = [v for grid in expand_space(space) for v in backend.candidates(shape, grid, platform)]
                keys = set()
                for variant in offered:
                    key = dedupe_key(backend, variant, shape, platform)
                    if key in keys or variant in seen[shape]:
                        duplicates += 1
                        continue
                    keys.add(key)
                    seen[shape].add(variant)
                    plan[shape].append(variant)
            except Exception as exc:  # reported per backend; the other shapes still sweep
                problems.append(f"candidates({shape}) raised {type(exc).__name__}: {exc}")
        if reason:
            listed_anyway[name] = reason
        if problems:
            unavailable[name] = "; ".join(problems)
    return Planned(plan, unavailable, listed_anyway, duplicates)


def _plan_dict(plan: dict[Shape, list[Variant]]) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for shape, variants in plan.items():
        per = out.setdefault(str(shape), {})
        for v in variants:
            per.setdefault(v.backend, []).append(str(v))
    return out


def compile_check(planned: Planned, gpu: str, console: Console, jobs: int | None = None) -> None:
    """Cross-compile the plan's own kernels for `gpu` (mla_tune/xcompile) and drop from
    `planned` the candidates that do not compile, exceed its LDS or duplicate another's
    binary, each with its reason; a check that cannot run is a warning, not a stop."""
    from mla_tune.xcompile.check import apply_drops, check_plan
    from mla_tune.xcompile.report import drop_lines, summary_lines

    try:
        report = check_plan(planned.plan, gpu, jobs)
    except Exception as exc:  # the sweep goes on with the plan as it was
        console.print(f"[yellow]compile check[/]: not run ({escape(f'{type(exc).__name__}: {exc}')}); "
                      "the plan is not pruned")
        return
    planned.plan = apply_drops(planned.plan, report)
    planned.compile_drops = report["drops"]
    planned.compile = {k: report[k] for k in ("target", "triton", "image_triton", "wall_s", "compiled", "cached")}
    planned.compile.update(binaries=len(report["binaries"]),
                           errors=sum(1 for b in report["binaries"] if not b.get("ok")),
                           capture_errors=len(report["capture_errors"]), dropped=report["drops"])
    for line in summary_lines(report) + drop_lines(report):
        console.out(line, highlight=False)


def compile_processes(planning_only: bool = False) -> int:
    """The compile pool's size; planning for an absent GPU assumes a GPU host's 8."""
    return 8 if planning_only else max(1, min(8, (os.cpu_count() or 2) - 1))


def earlier_results(results_path: Path, gpu: str) -> list[Path]:
    """This GPU's results files, newest first: the current one, those moved aside, then the
    committed tables/GPU.results.jsonl (for a sweep written elsewhere with --out)."""
    aside = sorted(results_path.parent.glob(results_path.name + ".*.old"), reverse=True)
    committed = Path("tables") / f"{gpu}.results.jsonl"
    return [results_path, *aside] + ([committed] if committed.resolve() != results_path.resolve() else [])


def _fit(config: Config, planned: Planned, costs: CostModel, n_devices: int, has_gpu: bool,
         startup_s: float, planning_only: bool = False) -> FittedPlan:
    s = config.search
    return fit_plan(planned.plan, s.rungs, s.keep, s.min_keep, costs, config.budget_s, n_devices,
                    config.precompile, compile_processes(planning_only), startup_s=startup_s,
                    with_compile=has_gpu)


def _dry_run(config: Config, gpu: str, out: Path, results_path: Path, console: Console,
             devices: list[int], check: bool = False) -> SweepSummary:
    quick = gpu_mod.quick_device_name()
    found = gpu_mod.detect() if quick in (None, "cpu") or os.environ.get(gpu_mod.FAKE_PLATFORM_ENV) \
        else probe_platform(devices[0])
    absent = found.name != gpu
    platform = gpu_mod.fake_platform(gpu) if absent else found
    if absent and gpu not in gpu_mod.KNOWN_GPUS:
        say(console, "", f"warning: {gpu} is neither this machine's GPU nor one mla-tune knows "
                         f"({', '.join(gpu_mod.KNOWN_GPUS)}): the plan assumes an unknown CUDA GPU of "
                         f"{platform.sm_count} SMs; check the name, or plan on the GPU itself")
    planned = plan_candidates(config, platform, planning_only=absent)
    if check:
        compile_check(planned, gpu, console)
    costs = cost_model_for(results_path, earlier_results(results_path, gpu))
    from mla_tune.tune.schedule import STARTUP_S

    fitted = _fit(config, planned, costs, len(devices), platform.has_gpu, STARTUP_S, planning_only=absent)
    where = f"planned for {gpu}; this machine has {found.device_name}" if absent else found.device_name
    print_plan(config, gpu, where, out, results_path, devices, planned, fitted, costs, console)
    if not check and gpu in gpu_mod.KNOWN_GPUS:
        say(console, "  ", f"compile check: not run; --compile-check on (or `mla-tune compile --gpu {gpu}`) "
                           "cross-compiles the plan and drops what fails")
    return SweepSummary(
        counts=dict.fromkeys(STATUSES, 0), timed=0, elapsed_s=0.0, table_path=None,
        results_path=results_path, winners={}, dry_run=True, plan=_plan_dict(fitted.plan),
        unavailable={**planned.unavailable,
                     **{k: f"{r} (candidates listed for planning)" for k, r in planned.listed_anyway.items()}},
        notes=fitted.notes, estimate_s=fitted.estimate.seconds,
        rung_plan={str(s): p.rung_counts for s, p in fitted.estimate.shapes.items()},
        compile_drops=planned.compile_drops,
    )


# ---------------------------------------------------------------------------- sweep
def run_sweep(config_path, gpu: str, out: Path | None = None, dry_run: bool = False,
              force: bool = False, devices: list[int] | None = None, fresh: bool = False,
              console: Console | None = None,
              candidate_timeout_s: float | None = None, budget_s: float | None = None,
              compile_check: bool | None = None) -> SweepSummary:
    """Sweep the config's shapes on this machine's GPU(s) and write tables/<gpu>.yaml.
    budget_s, when given, replaces the config's. compile_check: cross-compile the plan first
    and drop what fails (`compile_check`); None means on for a sweep on a GPU, off for a dry
    run."""
    console = console or Console()
    config = load_config(config_path)
    if budget_s is not None:
        config = dataclasses.replace(config, budget_s=float(budget_s))
    default_out = Path("tables") / f"{gpu}.yaml"
    out = Path(out) if out is not None else default_out
    results_path = results_path_for(out)
    devices = list(devices) if devices else [0]
    if len(set(devices)) != len(devices) or min(devices) < 0:
        raise SweepError(f"devices must be distinct non-negative indices, got {devices}")
    if dry_run:
        return _dry_run(config, gpu, out, results_path, console, devices, bool(compile_check))
    if not force:
        _refuse_other_gpu_early(gpu)
    timeout = candidate_timeout_s or config.candidate_timeout_s or DEFAULT_CANDIDATE_TIMEOUT_S
    lock = SweepLock(lock_path_for(out))
    try:
        lock.acquire()
    except ResultsError as exc:
        raise SweepError(str(exc)) from None
    if lock.warning:
        console.print(f"[yellow]warning[/]: {escape(lock.warning)}")
    # the command that resumes this sweep: the same options, less --fresh
    resume = f"mla-tune sweep --gpu {gpu} --config {config.path}"
    resume += "" if out == default_out else f" --out {out}"
    resume += " --force" if force else ""
    resume += "" if devices == [0] else f" --devices {','.join(map(str, devices))}"
    resume += "" if budget_s is None else f" --budget {budget_s:g}"
    resume += "" if candidate_timeout_s is None else f" --candidate-timeout {candidate_timeout_s:g}"
    try:
        summary = _sweep(config, gpu, out, results_path, force, devices, fresh, console, timeout,
                         compile_check is not False)
    except KeyboardInterrupt:
        message = (f"interrupted: the workers are stopped and every finished step is kept in "
                   f"{results_path}; resume with: {resume}")
        console.print(escape(message), soft_wrap=True)
        raise SweepInterrupted(message) from None
    finally:
        lock.release()
    if summary.stopped:
        console.print(escape(f"stopped at the budget: every finished step is kept in {results_path}; resume "
                             f"with: {resume} (a larger --budget times what is left)"), soft_wrap=True)
    return summary


def _refuse_other_gpu_early(gpu: str) -> None:
    """Refuse a sweep for another GPU from the device's name alone, before a worker starts."""
    text = gpu_mod.quick_device_name()
    if text is None:
        return  # cannot tell cheaply: the worker's platform check decides
    if text == "cpu":
        if gpu != "cpu":
            raise SweepError(f"this machine has no GPU (cpu), not {gpu}; run on an {gpu} or pass "
                             "--force (the table then records cpu as its GPU)")
        return
    name = gpu_mod.canonical_gpu_name(text)
    recognized = gpu_mod.canonical_name_known(text)
    if recognized and name != gpu:
        raise SweepError(f"this machine has an {text} ({name}), not {gpu}; run on an {gpu} or pass "
                         f"--force (the table then records {name} as its GPU)")


def _open_results(results_path: Path, config: Config, fresh: bool, console: Console):
    if fresh and results_path.exists():
        moved = move_aside(results_path)
        console.print(escape(f"--fresh: moved the old results to {moved}"))
    try:
        header, records, warnings = read_results(results_path, kinds=("candidate", "step", "rung"))
    except ResultsError as exc:
        raise SweepError(str(exc)) from None
    for warning in warnings:
        console.print(f"[yellow]warning[/]: {escape(warning)}")
    if header is not None and header.get("config", {}).get("hash") != config.hash:
        old = header.get("config", {})
        raise SweepError(
            f"{results_path} was made with another config ({old.get('path')}, hash "
            f"{str(old.get('hash'))[:12]}); {config.path} has hash {config.hash[:12]}. Pass --fresh "
            "to move the old results aside (kept, with a timestamp suffix) and start over"
        )
    if warnings:
        repair_tail(results_path)
    return header, records


def _header(config: Config, gpu: str, platform: gpu_mod.Platform, bandwidth, unavailable,
            devices: list[int], fitted: FittedPlan, costs: CostModel, compiled: dict | None = None) -> dict:
    return {
        "kind": "header",
        "schema": SCHEMA,
        "mla_tune_version": mla_tune.__version__,
        "gpu": platform.name,
        "requested_gpu": gpu,
        "forced": platform.name != gpu,
        "platform": {
            "device_name": platform.device_name, "arch": platform.arch, "driver": platform.driver,
            "versions": platform.versions, "sm_count": platform.sm_count, "is_hip": platform.is_hip,
        },
        "protocol": timing.protocol(platform.has_gpu),
        "copy_bandwidth_gbps": bandwidth,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"path": str(config.path), "hash": config.hash, "name": config.name,
                   "content": config.raw},
        "rule": config.rule.as_dict(),
        "gate": {"margin": GATE_MARGIN, "check_seeds": config.check_seeds,
                 "calibration_seeds": config.calibration_seeds},
        "timing": {"reps": fitted.rungs[-1], "prune_reps": fitted.rungs[0],
                   "prune_factor": config.timing.prune_factor, "budget_s": config.budget_s},
        "search": {
            "rungs": list(fitted.rungs), "configured_rungs": list(config.search.rungs),
            "keep": config.search.keep, "min_keep": config.search.min_keep,
            "estimate_s": round(fitted.estimate.seconds, 1), "basis": costs.basis,
            "fits": fitted.fits, "notes": fitted.notes,
            "planned": {str(s): len(vs) for s, vs in fitted.plan.items()},
            "dropped": {str(s): [str(v) for v in vs] for s, vs in fitted.dropped.items()},
        },
        "compile": compiled,  # the compile check's summary and drops (None: not run)
        "unavailable": unavailable,
        "devices": devices,
    }


def _check_platform(platforms: list[gpu_mod.Platform], gpu: str, force: bool, header) -> None:
    for p in platforms:
        if p.name != gpu and not force:
            what = "no GPU (cpu)" if not p.has_gpu else f"an {p.device_name} ({p.name})"
            raise SweepError(
                f"this machine has {what}, not {gpu}; run on an {gpu} or pass --force "
                f"(the table then records {p.name} as its GPU)"
            )
    if header is not None and header.get("gpu") != platforms[0].name:
        raise SweepError(
            f"the results file was measured on {header.get('gpu')}, this machine is "
            f"{platforms[0].name}; results from two GPUs cannot be mixed: pass --fresh"
        )


def _start_workers(devices: list[int], out: Path, log_dir: Path) -> list[WorkerHandle]:
    workers = [WorkerHandle(d, log_dir / f"{out.stem}.worker{d}.log") for d in devices]
    for w in workers:  # start them all, then wait: each takes seconds to import torch
        w.launch()
    for w in workers:
        try:
            w.wait_ready()
        except (WorkerGone, WorkerTimeout) as exc:
            tail = getattr(exc, "tail", "") or "(nothing)"
            raise SweepError(
                f"the worker for device {w.device} did not start ({exc}); the end of its "
                f"log {w.log_path}:\n{tail}"
            ) from None
    return workers


def _resumed_plan(header: dict, planned: Planned, config: Config, costs: CostModel,
                  n_devices: int, has_gpu: bool) -> FittedPlan:
    """The plan a resumed sweep continues: the first run's rungs, less what it dropped."""
    search = header.get("search")
    if not search:  # an older results file: halving over what is left, no cut
        return _fit(config, planned, costs, n_devices, has_gpu, 0.0)
    dropped = {Shape(*map(int, s.split("x"))): set(texts) for s, texts in search.get("dropped", {}).items()}
    plan = {s: [v for v in vs if str(v) not in dropped.get(s, ())] for s, vs in planned.plan.items()}
    fitted = fit_plan(plan, tuple(search["rungs"]), config.search.keep, config.search.min_keep, costs,
                      None, n_devices, config.precompile, compile_processes(), with_compile=has_gpu)
    fitted.dropped = {s: [Variant.parse(t) for t in texts] for s, texts in dropped.items()}
    return fitted


def _sweep(config: Config, gpu: str, out: Path, results_path: Path, force: bool,
           devices: list[int], fresh: bool, console: Console, timeout: float,
           check: bool = True) -> SweepSummary:
    started = time.monotonic()
    header, old_records = _open_results(results_path, config, fresh, console)
    earlier = earlier_results(results_path, gpu)
    costs = cost_model_for(results_path, earlier[1:] if header is None else earlier)
    workers: list[WorkerHandle] = []
    shared: Shared | None = None
    try:
        workers = _start_workers(devices, out, results_path.parent)
        platforms = [w.platform for w in workers]
        _check_platform(platforms, gpu, force, header)
        platform = platforms[0]
        planned = plan_candidates(config, platform)
        if check and platform.has_gpu and platform.name in gpu_mod.KNOWN_GPUS:
            compile_check(planned, platform.name, console, jobs=min(16, os.cpu_count() or 1))
        for name, reason in planned.unavailable.items():
            console.print(f"[yellow]{name}[/] unavailable: {escape(reason)}")
        if header is None:
            bandwidth = workers[0].bandwidth()
            fitted = _fit(config, planned, costs, len(devices), platform.has_gpu, time.monotonic() - started)
            header = _header(config, gpu, platform, bandwidth, planned.unavailable, devices, fitted, costs,
                             planned.compile)
        else:
            fitted = _resumed_plan(header, planned, config, costs, len(devices), platform.has_gpu)
        for note in fitted.notes:
            console.print(f"[yellow]budget[/]: {escape(note)}")
        writer = ResultsWriter(results_path)
        if results_path.stat().st_size == 0:
            writer.append(header)
        clock = BudgetClock(config.budget_s, started, costs)
        shared = Shared(config, tuple(fitted.rungs), timeout, writer, clock, costs, console,
                        Progress(console, fitted, old_records, len(devices)))
        console.print(escape(
            f"sweep {config.name} on {platform.device_name}: {shared.progress.total} candidates over "
            f"{len(config.shapes)} shapes, {shared.progress.resumed} already recorded; rungs "
            f"{list(fitted.rungs)} samples; estimated "
            f"{fitted.estimate.seconds:.0f} s ({costs.basis})"
            + (f", budget {config.budget_s:.0f} s" if config.budget_s else "")))
        if platform.has_gpu:
            _precompile(config, fitted, old_records, devices[0], timeout, clock, writer, console,
                        platform.sm_count)
        runners = [DeviceRunner(w, shapes, shared, old_records, fitted)
                   for w, shapes in zip(workers, assign_shapes(fitted.plan, len(workers)), strict=True)]
        _run_devices(runners, shared)
    finally:
        if shared is not None:
            shared.stop.set()
            with shared.lock:
                shared.writer.close()
            shared.progress.close()
        for w in workers:
            w.reap() if shared is not None and shared.interrupted else w.stop()
    return _finish(header, old_records + shared.records, config, out, results_path, started, shared, console)


def _run_devices(runners: list[DeviceRunner], shared: Shared) -> None:
    threads = [threading.Thread(target=r.run, daemon=True) for r in runners]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        shared.interrupted = True
        shared.stop.set()
        for r in runners:
            r.worker.reap()  # the step in flight is lost, not recorded: it runs again on resume
        raise
    errors = [r.error for r in runners if r.error is not None]
    if errors:
        raise errors[0]


def _finish(header: dict, records: list[dict], config: Config, out: Path, results_path: Path,
            started: float, shared: Shared, console: Console) -> SweepSummary:
    finals = [r for r in records if r.get("kind", "candidate") == "candidate"]
    winners = summarize(finals, console)
    skipped = _skipped_at_rung0(records)
    if skipped:
        console.print(escape(f"budget: {sum(skipped.values())} candidate(s) of {len(skipped)} shape(s) were "
                             "skipped at rung 0 to fit the budget and never timed (the table counts them, "
                             "candidates.skipped); a resume (the same command; a larger --budget gives it "
                             "room) times them and decides those shapes' rungs again"), soft_wrap=True)
    table_path = _write_table(header, finals, config, out, console, skipped)
    counts = dict.fromkeys(STATUSES, 0)
    for r in shared.records:
        if r.get("kind") == "candidate":
            counts[r["status"]] += 1
    return SweepSummary(
        counts=counts, timed=counts["ok"] + counts["pruned"], elapsed_s=time.monotonic() - started,
        table_path=table_path, results_path=results_path, winners=winners,
        unavailable=header.get("unavailable", {}), notes=list(header.get("search", {}).get("notes", [])),
        estimate_s=header.get("search", {}).get("estimate_s"), stopped=shared.budget_spent,
    )


def _precompile(config: Config, fitted: FittedPlan, old_records: list[dict], device: int,
                timeout: float, clock: BudgetClock, writer: ResultsWriter, console: Console,
                sm_count: int | None = None) -> None:
    started_shapes = {(r["shape"]["batch"], r["shape"]["kv_len"]) for r in old_records}
    # (variant, real shape) pairs: the pool picks each one's stand-in and dedupes them
    jobs = plan_jobs(
        ((v, shape) for shape, vs in fitted.plan.items()
         if (shape.batch, shape.kv_len) not in started_shapes
         for v in vs if config.precompile.get(v.backend)),
        sm_count,
    )
    if not jobs:
        return
    processes = compile_processes()
    t0 = time.monotonic()
    # its own limit, cut to a generous multiple of the planned compile time and to the budget
    limit = timeout * max(1, math.ceil(len(jobs) / processes))
    if config.budget_s:
        limit = min(limit, max(30.0, 2 * fitted.estimate.compile_s), max(5.0, 0.5 * clock.left()))
    errors = precompile(jobs, device, True, processes, limit, job_timeout_s=timeout)
    writer.append({"kind": "note", "precompile": {"jobs": len(jobs), "processes": processes,
                                                  "seconds": round(time.monotonic() - t0, 1)}})
    console.print(
        f"precompiled {len(jobs)} (variant, stand-in shape) jobs in {processes} processes, "
        f"{time.monotonic() - t0:.0f} s; {len(errors)} did not compile or run there "
        "(not fatal: the timed run records why)"
    )
    for where, error in sorted(errors.items())[:3]:  # a sample, so the count is not a mystery
        console.print(escape(f"  e.g. {where}: {error[:300]}"))


def _skipped_at_rung0(records: list[dict]) -> dict[str, int]:
    """"BxK" -> candidates the running clock skipped at rung 0 (each shape's last rung-0 decision)."""
    last = {}
    for r in records:
        if r.get("kind") == "rung" and r.get("rung") == 0:
            last[f"{r['shape']['batch']}x{r['shape']['kv_len']}"] = len(r.get("skipped") or [])
    return {shape: n for shape, n in last.items() if n}


def _write_table(header: dict, records: list[dict], config: Config, out: Path, console: Console,
                 skipped: dict[str, int] | None = None):
    from mla_tune.tables import table as table_module  # written alongside; imported when needed

    table = table_module.table_from_results(header, records, config)
    for row in table["rows"]:
        n = (skipped or {}).get(f"{row['batch']}x{row['kv_len']}")
        if n:
            row["candidates"]["skipped"] = n
    table_module.write_table(out, table)
    console.print(escape(f"table written: {out}"))
    return out
