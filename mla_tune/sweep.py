"""The sweep: every (shape, candidate) through the correctness gate and the timer, into an
append-only results file, then the dispatch table.

The main process plans, schedules and records; it never runs a kernel and never starts
CUDA (the platform comes from the first worker). Each device has one worker process
(mla_tune.worker); a candidate that kills its worker is recorded as "crashed", one that
runs past its limit is killed and recorded as "timeout", and a fresh worker takes the next
candidate. Records are appended one fsynced line at a time, so a killed sweep resumes
where it stopped; a lock file keeps two sweeps off one table.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

import mla_tune
from mla_tune import gpu as gpu_mod
from mla_tune import timing
from mla_tune.backends import get_backend
from mla_tune.compile_pool import plan_jobs
from mla_tune.config import Config, expand_space, load_config
from mla_tune.core import Shape, Variant
from mla_tune.errors import MlaTuneError
from mla_tune.results import (
    SCHEMA,
    STATUSES,
    ResultsError,
    ResultsWriter,
    SweepLock,
    candidate_key,
    lock_path_for,
    move_aside,
    read_results,
    repair_tail,
    results_path_for,
)
from mla_tune.sweep_report import print_plan, progress_bar, summarize
from mla_tune.sweep_schedule import BASELINE_BACKEND, Budget, assign_shapes
from mla_tune.worker import (
    CPU_PROTOCOL,
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


# ---------------------------------------------------------------------------- plan
def plan_candidates(config: Config, platform: gpu_mod.Platform, planning_only: bool = False):
    """(plan {shape: [variants]}, unavailable {backend: reason}, listed_anyway {backend: reason}).

    A backend that cannot run here is recorded once with its reason, not an error. For a
    dry run for an absent GPU (`planning_only`) its candidates are still listed, so the
    plan shows what the real sweep would try.
    """
    plan: dict[Shape, list[Variant]] = {shape: [] for shape in config.shapes}
    unavailable: dict[str, str] = {}
    listed_anyway: dict[str, str] = {}
    for name, space in config.backends.items():
        try:
            backend = get_backend(name)
            reason = backend.unavailable_reason()
        except ImportError as exc:  # a backend module that does not import cannot run
            unavailable[name] = f"its module does not import ({type(exc).__name__}: {exc})"
            continue
        if reason and not planning_only:
            unavailable[name] = reason
            continue
        problems = []
        for shape in config.shapes:
            try:
                offered = [
                    v for grid in expand_space(space) for v in backend.candidates(shape, grid, platform)
                ]
            except Exception as exc:  # reported per backend; the other shapes still sweep
                problems.append(f"candidates({shape}) raised {type(exc).__name__}: {exc}")
                continue
            for variant in offered:
                if variant not in plan[shape]:
                    plan[shape].append(variant)
        if reason:
            listed_anyway[name] = reason
        if problems:
            unavailable[name] = "; ".join(problems)
    return plan, unavailable, listed_anyway


def _plan_dict(plan: dict[Shape, list[Variant]]) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for shape, variants in plan.items():
        per = out.setdefault(str(shape), {})
        for v in variants:
            per.setdefault(v.backend, []).append(str(v))
    return out


def _dry_run(config: Config, gpu: str, out: Path, results_path: Path, console: Console,
             devices: list[int]) -> SweepSummary:
    found = probe_platform(devices[0]) if torch.cuda.is_available() else gpu_mod.detect()
    absent = found.name != gpu
    platform = gpu_mod.fake_platform(gpu) if absent else found
    plan, unavailable, listed = plan_candidates(config, platform, planning_only=absent)
    where = f"planned for {gpu}; this machine has {found.device_name}" if absent else found.device_name
    print_plan(config, gpu, where, out, results_path, devices, plan, unavailable, listed, console)
    return SweepSummary(
        counts=dict.fromkeys(STATUSES, 0), timed=0, elapsed_s=0.0, table_path=None,
        results_path=results_path, winners={}, dry_run=True, plan=_plan_dict(plan),
        unavailable={**unavailable, **{k: f"{r} (candidates listed for planning)" for k, r in listed.items()}},
    )


# ---------------------------------------------------------------------------- sweep
def run_sweep(config_path, gpu: str, out: Path | None = None, dry_run: bool = False,
              force: bool = False, devices: list[int] | None = None, fresh: bool = False,
              console: Console | None = None,
              candidate_timeout_s: float | None = None) -> SweepSummary:
    """Sweep the config's shapes on this machine's GPU(s) and write tables/<gpu>.yaml."""
    console = console or Console()
    config = load_config(config_path)
    out = Path(out) if out is not None else Path("tables") / f"{gpu}.yaml"
    results_path = results_path_for(out)
    devices = list(devices) if devices else [0]
    if len(set(devices)) != len(devices) or min(devices) < 0:
        raise SweepError(f"devices must be distinct non-negative indices, got {devices}")
    if dry_run:
        return _dry_run(config, gpu, out, results_path, console, devices)
    timeout = candidate_timeout_s or config.candidate_timeout_s or DEFAULT_CANDIDATE_TIMEOUT_S
    lock = SweepLock(lock_path_for(out))
    try:
        lock.acquire()
    except ResultsError as exc:
        raise SweepError(str(exc)) from None
    if lock.warning:
        console.print(f"[yellow]warning[/]: {escape(lock.warning)}")
    try:
        return _sweep(config, gpu, out, results_path, force, devices, fresh, console, timeout)
    finally:
        lock.release()


def _open_results(results_path: Path, config: Config, fresh: bool, console: Console):
    if fresh and results_path.exists():
        moved = move_aside(results_path)
        console.print(escape(f"--fresh: moved the old results to {moved}"))
    try:
        header, records, warnings = read_results(results_path)
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
            devices: list[int]) -> dict:
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
        "protocol": timing.PROTOCOL if platform.has_gpu else CPU_PROTOCOL,
        "copy_bandwidth_gbps": bandwidth,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"path": str(config.path), "hash": config.hash, "name": config.name,
                   "content": config.raw},
        "rule": config.rule.as_dict(),
        "gate": {"margin": GATE_MARGIN, "check_seeds": config.check_seeds,
                 "calibration_seeds": config.calibration_seeds},
        "timing": {"reps": config.timing.reps, "prune_reps": config.timing.prune_reps,
                   "prune_factor": config.timing.prune_factor, "budget_s": config.budget_s},
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


def _sweep(config: Config, gpu: str, out: Path, results_path: Path, force: bool,
           devices: list[int], fresh: bool, console: Console, timeout: float) -> SweepSummary:
    started = time.monotonic()
    header, old_records = _open_results(results_path, config, fresh, console)
    log_dir = results_path.parent
    workers = [WorkerHandle(d, log_dir / f"{out.stem}.worker{d}.log") for d in devices]
    stop = threading.Event()
    writer = None
    try:
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
        platforms = [w.platform for w in workers]
        _check_platform(platforms, gpu, force, header)
        platform = platforms[0]
        plan, unavailable, _ = plan_candidates(config, platform)
        for name, reason in unavailable.items():
            console.print(f"[yellow]{name}[/] unavailable: {escape(reason)}")
        if header is None:
            bandwidth = workers[0].bandwidth()
            header = _header(config, gpu, platform, bandwidth, unavailable, devices)
        writer = ResultsWriter(results_path)
        if results_path.stat().st_size == 0:
            writer.append(header)
        done = {candidate_key(r["shape"], r["variant"]) for r in old_records}
        pending = {
            shape: [v for v in variants if (shape.batch, shape.kv_len, str(v)) not in done]
            for shape, variants in plan.items()
        }
        n_pending = sum(len(v) for v in pending.values())
        n_total = n_pending + len(done)
        console.print(escape(
            f"sweep {config.name} on {platform.device_name}: {n_total} candidates over "
            f"{len(config.shapes)} shapes, {len(done)} already recorded, {n_pending} to run"
        ))
        if platform.has_gpu and n_pending:
            _precompile(config, pending, devices[0], timeout, console)
        budget = Budget(config, started, n_pending, console, parallel=len(devices))
        with progress_bar(console) as progress:
            shared = _Shared(config, timeout, writer, budget, progress, stop, console)
            shared.task = progress.add_task("candidates", total=n_total, completed=len(done))
            runners = [
                DeviceRunner(w, shapes, shared, old_records)
                for w, shapes in zip(workers, assign_shapes(pending, len(workers)), strict=True)
            ]
            threads = [threading.Thread(target=r.run, daemon=True) for r in runners]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        new_records = shared.records
        errors = [r.error for r in runners if r.error is not None]
        if errors:
            raise errors[0]
    finally:
        stop.set()
        if writer is not None:
            writer.close()
        for w in workers:
            w.stop()
    records = old_records + new_records
    winners = summarize(records, console)
    table_path = _write_table(header, records, config, out, console)
    counts = dict.fromkeys(STATUSES, 0)
    for r in new_records:
        counts[r["status"]] += 1
    return SweepSummary(
        counts=counts, timed=counts["ok"] + counts["pruned"], elapsed_s=time.monotonic() - started,
        table_path=table_path, results_path=results_path, winners=winners,
        unavailable=header.get("unavailable", {}), notes=budget.notes,
    )


@dataclass
class _Shared:
    """What the device threads share; `lock` guards the writer, records and budget."""

    config: Config
    timeout: float
    writer: ResultsWriter
    budget: Budget
    progress: Progress
    stop: threading.Event
    console: Console
    task: int = 0
    records: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DeviceRunner:
    """Runs one device's shapes through its worker, one candidate at a time."""

    def __init__(self, worker: WorkerHandle, shapes, shared: _Shared, old_records: list[dict]):
        self.worker = worker
        self.shapes = shapes
        self.shared = shared
        self.old_records = old_records
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for shape, variants in self.shapes:
                self._shape(shape, variants)
        except BaseException as exc:  # handed to the main thread, which re-raises it
            self.error = exc

    def _best(self, shape: Shape) -> float | None:
        times = [
            r["time"]["median_us"] for r in self.old_records
            if r["status"] == "ok" and r["shape"] == {"batch": shape.batch, "kv_len": shape.kv_len}
        ]
        return min(times) if times else None

    def _shape(self, shape: Shape, variants: list[Variant]) -> None:
        sh, config = self.shared, self.shared.config
        best = self._best(shape)
        for variant in variants:
            if sh.stop.is_set():
                return
            with sh.lock:
                reps, prune_reps, reduced = sh.budget.reps, sh.budget.prune_reps, sh.budget.reduced
            prune = best is not None and variant.backend != BASELINE_BACKEND
            payload = {
                "shape": {"batch": shape.batch, "kv_len": shape.kv_len}, "variant": str(variant),
                "check_seeds": config.check_seeds, "calibration_seeds": config.calibration_seeds,
                "calibration": config.calibration.as_dict(),
                "rule": config.rule.as_dict(), "reps": reps, "prune_reps": prune_reps,
                "wall_reps": min(reps, 20),
                "prune_threshold_us": best * config.timing.prune_factor if prune else None,
            }
            t0 = time.monotonic()
            fields = self._run_one(variant, payload)
            if sh.stop.is_set():
                return  # interrupted: the kill was ours, not the candidate's
            record = {
                "kind": "candidate", "shape": payload["shape"], **fields,
                "elapsed_s": round(time.monotonic() - t0, 3), "device": self.worker.device,
                "timing_reps": reps, "budget_reduced": reduced,
            }
            with sh.lock:
                sh.writer.append(record)
                sh.records.append(record)
                note = sh.budget.note_done(record["elapsed_s"])
                if note:  # the header is already written: the cut goes on record as a note
                    sh.writer.append({"kind": "note", "budget": note, "timing_reps": sh.budget.reps})
                sh.progress.advance(sh.task)
            if record["status"] == "ok":
                median = record["time"]["median_us"]
                best = median if best is None else min(best, median)
            elif record["status"] != "pruned":
                sh.progress.console.print(
                    escape(f"{record['status']}: {shape} {record['variant']}: {record['reason']}")
                )

    def _run_one(self, variant: Variant, payload: dict) -> dict:
        base = {
            "variant": str(variant), "backend": variant.backend, "params": variant.p,
            "checks": [], "time": None, "wall": None, "calibration": None,
        }
        timeout = self.shared.timeout
        try:
            _kind, fields = self.worker.request(("candidate", payload), timeout)
        except WorkerTimeout:
            self.worker.reap()
            return {**base, "status": "timeout",
                    "reason": f"ran past the {timeout:.0f} s limit; its worker was killed"}
        except WorkerGone as gone:
            return {**base, "status": "crashed", "stderr_tail": gone.tail,
                    "reason": f"its worker died ({signal_name(gone.exitcode)}) while running it; "
                    f"the worker log {self.worker.log_path} holds its last output"}
        if fields.pop("restart_worker", False):
            self.worker.wait_exit()
        return fields


def _precompile(config: Config, pending, device: int, timeout: float, console: Console) -> None:
    # (variant, real shape) pairs: the pool picks each one's stand-in and dedupes them
    jobs = plan_jobs(
        (v, shape) for shape, vs in pending.items() for v in vs if config.precompile.get(v.backend)
    )
    if not jobs:
        return
    processes = max(1, min(8, (os.cpu_count() or 2) - 1))
    t0 = time.monotonic()
    limit = timeout * max(1, math.ceil(len(jobs) / processes))
    errors = precompile(jobs, device, True, processes, limit, job_timeout_s=timeout)
    console.print(
        f"precompiled {len(jobs)} (variant, stand-in shape) jobs in {processes} processes, "
        f"{time.monotonic() - t0:.0f} s; {len(errors)} did not compile or run there "
        "(not fatal: the timed run records why)"
    )
    for where, error in sorted(errors.items())[:3]:  # a sample, so the count is not a mystery
        console.print(escape(f"  e.g. {where}: {error[:300]}"))


def _write_table(header: dict, records: list[dict], config: Config, out: Path, console: Console):
    from mla_tune import table as table_module  # written alongside; imported when needed

    table = table_module.table_from_results(header, records, config)
    table_module.write_table(out, table)
    console.print(escape(f"table written: {out}"))
    return out


def signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
