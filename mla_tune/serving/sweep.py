"""The serving sweep: tune the serving table (tables/GPU.serving.yaml) from a serving config.

    mla-tune sweep --config configs/serving.yaml --gpu H200 [--out tables/H200.serving.yaml]
        [--shard i/n] [--devices 0,1] [--budget S] [--candidate-timeout S] [--fresh] [--force]
        [--dry-run]
    mla-tune sweep --config configs/serving.yaml --gpu H200 [--out tables/H200.serving.yaml]
        --merge RESULTS.jsonl,RESULTS.jsonl,...

Stages (cells.py plans them, results.py records them):
1. Gate: each family's candidates once, on a ragged and a tail probe (gate.py), in
   config gate_workers worker processes.
2. Cells, unit by unit (a family's batch bucket), kv buckets increasing: successive halving
   over the gated candidates (tune/search.py's promote, the leaderboard's: search.rungs
   samples per rung, keep the best `keep` share, at least min_keep), the neighbouring
   cells' winners (same family, adjacent batch or kv bucket, already measured) first and
   carried to the last rung. The winner is the cell's
   pick for eager calls (lookup by the kv bucket of the mean length). A cell is timed on
   its bucket's length, or with search.cell_lengths `spread` on lengths spread over those
   the bucket serves (cell_kv_lens).
3. Cross, per unit: the union of each kv cell's best `cross_top` timed at every kv cell of
   the bucket and on the bucket's ragged mix (ragged_probe_lengths: lengths drawn
   log-uniform over the bucket's kv range, recorded as kv_len 0); the CUDA-graph pick
   (table.choose_graph_pick) is the one whose worst regret over those is smallest:
   a graph cannot depend on kv_len, and an engine's batch is rarely uniform (on the H200
   a graph pick chosen on uniform cells alone ran 1.4x FlashMLA's step on 500-4000 token
   lengths, docs/perf.md).
4. Edge, per unit, with search.batch_edge: the cross stage's union, and every variant the
   cell timed in its last rung, timed at every kv cell at the smallest batch the bucket
   serves (cells.edge_batch: the bucket below plus one, uniform at the cell's lengths,
   rungs[-1] samples), so that the edge's points hold what the bucket's do; a cell's eager
   pick weighs that edge beside the cell (build.eager_pick), since eager calls of any batch
   in the bucket's span run it, and the eager lookup interpolates between them. A CUDA graph runs at the bucket's batch: its
   pick ignores the edge.
Every measurement is appended to the results file as it is made, so a killed sweep resumes
where it stopped; `budget_s` (the leaderboard's clock, tune/schedule.py's BudgetClock)
stops timing cleanly between measurements (the table is still written, the cells not
reached left out with the reason), and a measurement in a worker still running at 108% of
it is killed. A shard (`--shard i/n`) takes every n-th unit and writes its own results
file; `--merge` builds one table from several; `--devices` runs one shard per GPU, each
in its own process, and merges.

Each measurement (measure.py) runs in a killable worker process of tune/worker.py (a
TaskPool of one, tune/pool.py), so a candidate that crashes, hangs past
--candidate-timeout or loses the CUDA context costs only its own step, recorded as
crashed, timeout or failed. The timer is injectable: by name for the worker (GPU:
timing.time_call, the leaderboard protocol; CPU: timing.cpu_time), or as a callable,
which times in this process (the tests' made-up timers, under Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mla_tune import gpu
from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.serving.build import ServingSweepError, merge, write_table
from mla_tune.serving.cells import (
    SweepPlan,
    Unit,
    edge_batch,
    estimate,
    left_out_summary,
    parse_shard,
    plan_sweep,
)
from mla_tune.serving.config import ServingConfig, load_serving_config
from mla_tune.serving.gate import (
    GATE_TIMEOUT_S,
    ContextLost,
    GateJob,
    device_index,
    probe_lengths,
    run_gates,
)
from mla_tune.serving.measure import (
    CPU_TIMER,
    GPU_PROBE,
    GPU_TIMER,
    MEASURE_TASK,
    PRUNE_FACTOR,
    MeasureJob,
    TimedCall,
    event_probe,
    measure,
)
from mla_tune.serving.results import SCHEMA, Recorder, Records, results_path_for
from mla_tune.serving.table import FamilyKey, choose_graph_pick
from mla_tune.tables.render import fitting
from mla_tune.tune import search as halving
from mla_tune.tune import timing
from mla_tune.tune.pool import TaskPool
from mla_tune.tune.progress import eta_s
from mla_tune.tune.results import SweepLock, move_aside, results_lock_path
from mla_tune.tune.schedule import BudgetClock
from mla_tune.tune.worker import Task, resolve

__all__ = ["PRUNE_FACTOR", "RAGGED_PROBE_KV", "Sweeper", "TimedCall", "cell_kv_lens", "dry_run", "event_probe",
           "merge", "ragged_probe_lengths", "run_serving_sweep", "sweep_from_cli"]

Timer = Callable[..., timing.Timing]  # timer(call, reps) -> Timing
Probe = Callable[[TimedCall], float]  # probe(call) -> one call's GPU time, us
# A measurement is a build, at most one compile, warm-up and samples: a step still running
# after this long hangs, and its worker is killed (the leaderboard sweep's limit).
MEASURE_TIMEOUT_S = 120.0


class _BudgetSpent(Exception):
    pass


def _family(key: FamilyKey) -> dict:
    return key.as_dict()


def _callable(fn):
    """A timer or probe given by name, or as itself."""
    return resolve(fn) if isinstance(fn, str) and fn else (fn or None)


# The kv_len under which the cross stage records a bucket's ragged mix (kv buckets are >= 1).
RAGGED_PROBE_KV = 0


def ragged_probe_lengths(batch: int, kv_lens) -> list[int]:
    """The ragged mix a batch bucket's graph candidates are also timed on: `batch` lengths
    drawn log-uniform from the smallest to the largest of the bucket's kv cells (so its
    cache fits where the bucket's largest cell did), fixed per batch and kv range."""
    lo, hi = min(kv_lens), max(kv_lens)
    rng = random.Random(cell_seed(batch, RAGGED_PROBE_KV) + hi)
    return [min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))) for _ in range(batch)]


# Where in its step a spread cell's first length sits (the golden ratio's fraction): the
# lengths avoid the bucket's own length, a power of two where every split rule steps.
SPREAD_PHASE = 0.618


def cell_kv_lens(batch: int, kv_len: int, mode: str = "aligned") -> list[int]:
    """The lengths a (batch, kv_len) cell is timed on (config search.cell_lengths).

    `aligned`: every sequence at kv_len. `spread`: the lengths an eager call of the cell
    may bring (a mean length that rounds to this kv bucket, log-nearest: kv_len x 2^u, u in
    [-1/2, 1/2)), one per sequence at u = -1/2 + (i + SPREAD_PHASE) / batch, increasing.
    Aligned, a bucket's length is exactly where split rules step: on the H200 the 64-row
    split-K tile with a split per 512 tokens ran 8 x 512 (fp8, 128 heads, q_len 4) on one
    split per sequence in 65.5 us and 7 x 609 on two in 56.2 us, so cells timed aligned
    picked variants that lose at the lengths engines bring (2026-12-01)."""
    if mode == "aligned":
        return [kv_len] * batch
    if mode != "spread":
        raise ValueError(f"cell lengths {mode!r}: expected aligned or spread")
    return [max(1, round(kv_len * 2.0 ** (-0.5 + (i + SPREAD_PHASE) / batch))) for i in range(batch)]


def cell_seed(batch: int, kv_len: int) -> int:
    """The cell's input seed: fixed per cell, so every candidate and every resume times the
    same data."""
    return 1_000_003 * batch + kv_len


class Sweeper:
    """Runs one shard's plan against a Recorder (see the module docstring).

    With a `pool` (tune/pool.py), every measurement runs in its worker process and
    `timer` and `probe` are names ("module:function"); without, in this process, and they
    are callables (the tests' made-up timers)."""

    def __init__(self, cfg: ServingConfig, plan: SweepPlan, recorder: Recorder, *, timer: Timer | str,
                 device, clock: BudgetClock, log: Callable[[str], None] = print, gate_workers: int | None = None,
                 probe: Probe | str | None = None, pool: TaskPool | None = None,
                 timeout_s: float = MEASURE_TIMEOUT_S, log_stem: Path | None = None,
                 gate_timeout_s: float = GATE_TIMEOUT_S):
        if pool is not None and not (isinstance(timer, str) and (probe is None or isinstance(probe, str))):
            raise ValueError("a sweep that times in worker processes takes its timer and probe by name "
                             "('package.module:function'), not as objects")
        self.cfg, self.plan, self.rec = cfg, plan, recorder
        self.timer, self.device, self.clock, self.log = timer, str(device), clock, log
        self.probe = probe  # None: every first-rung candidate is timed in full
        self.pool, self.timeout_s, self.log_stem = pool, timeout_s, log_stem
        self.gate_timeout_s = gate_timeout_s  # a gate's limit in a gate worker process
        self.gate_workers = cfg.gate_workers if gate_workers is None else gate_workers
        self.passed: dict[FamilyKey, list[Variant]] = {}
        self._cache: dict = {}  # in this process: the cell's input (measure.cell_input)
        self._ragged: dict[tuple, list[int]] = {}  # (family, batch) -> its ragged mix's lengths
        self.stopped = False
        self.started = time.monotonic()
        self.timed = 0  # measurements made by this process (not replayed)

    # ------------------------------------------------------------------ gate
    def gate(self) -> None:
        keys = list(dict.fromkeys(u.key for u in self.plan.units))
        jobs = []
        for key in keys:
            spec = self.plan.families[key].spec
            for v in self.plan.families[key].candidates:
                if (key, str(v)) not in self.rec.records.gates:
                    jobs.append(GateJob(spec, str(v), self.cfg.gate, self.cfg.rule, self.device))
        if jobs:
            where = (f"{self.gate_workers} worker process(es), each gate limited to {self.gate_timeout_s:g} s"
                     if self.gate_workers else "in this process, without a time limit: gate_workers > 0 "
                     "gates in killable worker processes")
            self.log(f"gate: {len(jobs)} candidate(s) over {len(keys)} famil{'y' if len(keys) == 1 else 'ies'}"
                     f" ({where})")
        done = 0
        stem = None if self.log_stem is None else self.log_stem.with_name(self.log_stem.name + ".gate")
        for job, out in run_gates(jobs, self.gate_workers, stop=self._over_budget, log_stem=stem,
                                  timeout_s=lambda: self.clock.timeout(self.gate_timeout_s)):
            key = FamilyKey.of(job.spec)
            if not out["ok"] and out["reason"].startswith("timeout:") and self.clock.past_hard_deadline():
                continue  # killed by the budget, not its own limit: not recorded, gated on resume
            out = {k: v for k, v in out.items() if k != "poisoned"}
            self.rec.append({"kind": "gate", "family": _family(key), "variant": job.variant, **out})
            done += 1
            if not out["ok"]:
                self.log(f"  gate rejects {job.variant} for {key}: {out['reason']}")
        for key in keys:
            fam = self.plan.families[key]
            self.passed[key] = [v for v in fam.candidates
                                if self.rec.records.gates.get((key, str(v)), {}).get("ok")]
            self.log(f"gate: {key}: {len(self.passed[key])} of {len(fam.candidates)} candidates pass")
        if done < len(jobs):
            raise _BudgetSpent  # run() stops and says how to resume

    def _over_budget(self) -> bool:
        return self.clock.left() <= 0

    # ------------------------------------------------------------------ measurements
    def _kv_lens(self, key: FamilyKey, batch: int, kv_len: int) -> list[int]:
        if kv_len == RAGGED_PROBE_KV:
            return self._ragged[(key, batch)]
        return cell_kv_lens(batch, kv_len, self.cfg.search.cell_lengths)

    def _drop_input(self) -> None:
        """Free the cell's input here (a worker replaces its own at the next cell)."""
        self._cache.clear()

    def measure(self, key: FamilyKey, batch: int, kv_len: int, variant: Variant, samples: int) -> float:
        """The median (us) of `samples` samples of `variant` at the cell: the recorded one,
        else measured now and recorded. inf when it failed to run."""
        step = self.rec.records.steps.get(Records.step_key(key, batch, kv_len, str(variant), samples))
        if step is None:
            if self._over_budget():
                raise _BudgetSpent
            step = self._time(key, batch, kv_len, variant, samples)
        return step["time"]["median_us"] if step["status"] == "ok" else math.inf

    def measure_or_prune(self, key: FamilyKey, batch: int, kv_len: int, variant: Variant, samples: int,
                         best: float) -> float:
        """measure(), unless a probe says the candidate is over PRUNE_FACTOR x `best` (the
        best median of the cell so far): then it is recorded as pruned (inf)."""
        step = self.rec.records.steps.get(Records.step_key(key, batch, kv_len, str(variant), samples))
        if step is None and self.probe is not None and best < math.inf:
            if self._over_budget():
                raise _BudgetSpent
            step = self._time(key, batch, kv_len, variant, samples, prune_over=PRUNE_FACTOR * best)
            return step["time"]["median_us"] if step["status"] == "ok" else math.inf
        return self.measure(key, batch, kv_len, variant, samples)

    def _time(self, key: FamilyKey, batch: int, kv_len: int, variant: Variant, samples: int,
              prune_over: float | None = None) -> dict:
        record = {"kind": "step", "family": _family(key), "batch": batch, "kv_len": kv_len,
                  "variant": str(variant), "samples": samples}
        job = MeasureJob(self.plan.families[key].spec, key, batch, kv_len, tuple(self._kv_lens(key, batch, kv_len)),
                         cell_seed(batch, kv_len), str(variant), samples, self.device, prune_over,
                         self.timer if isinstance(self.timer, str) else "",
                         self.probe if isinstance(self.probe, str) else "", self.cfg.search.step_layers)
        if self.pool is None:
            out = measure(job, self._cache, _callable(self.timer), _callable(self.probe))
        else:
            outcome = self.pool.call(Task(MEASURE_TASK, (job,)), self.clock.timeout(self.timeout_s))
            if outcome.status == "timeout" and self.clock.past_hard_deadline():
                raise _BudgetSpent  # killed by the budget, not its own limit: not recorded, run on resume
            out = outcome.value if outcome.status == "ok" else {"status": outcome.status, "error": outcome.error}
            if outcome.status != "ok":
                self.log(f"  {outcome.status}: {variant} at batch {batch}, kv {kv_len}: {outcome.error}")
        poisoned = out.pop("poisoned", False)
        record.update(out)
        self.rec.append(record)
        if poisoned:
            raise ContextLost(f"the CUDA context was lost timing {variant} at batch {batch}, kv {kv_len} "
                              f"({record['error']}); it is recorded as failed: run the sweep again to resume")
        if record["status"] == "ok":
            self.timed += 1
        return record

    # ------------------------------------------------------------------ search
    def neighbour_winners(self, key: FamilyKey, batch: int, kv_len: int) -> list[Variant]:
        """Winners of the adjacent cells (batch and kv buckets, either side) already
        recorded, among this family's gated candidates, in a fixed order."""
        bb, kb = self.cfg.batch_buckets, self.cfg.kv_buckets
        i, j = bb.index(batch), kb.index(kv_len)
        near = [(bb[i - 1], kv_len) if i > 0 else None, (batch, kb[j - 1]) if j > 0 else None,
                (bb[i + 1], kv_len) if i + 1 < len(bb) else None, (batch, kb[j + 1]) if j + 1 < len(kb) else None]
        out = []
        for cell in filter(None, near):
            record = self.rec.records.cells.get((key, *cell))
            if record and record.get("status") == "ok":
                winner = Variant.parse(record["winner"])
                if winner in self.passed[key] and winner not in out:
                    out.append(winner)
        return out

    def search_cell(self, key: FamilyKey, batch: int, kv_len: int) -> dict:
        recorded = self.rec.records.cells.get((key, batch, kv_len))
        if recorded is not None:
            return recorded
        s = self.cfg.search
        seeds = self.neighbour_winners(key, batch, kv_len)
        order = seeds + [v for v in self.passed[key] if v not in seeds]
        rank = {v: i for i, v in enumerate(order)}
        by_text = {str(v): v for v in order}
        entrants, sizes, times = order, [], {}
        for r, samples in enumerate(s.rungs):
            sizes.append(len(entrants))
            if r == 0:  # the seeds first, in full; the rest may be pruned by a probe
                times, best = {}, math.inf
                for v in entrants:
                    times[v] = (self.measure(key, batch, kv_len, v, samples) if v in seeds
                                else self.measure_or_prune(key, batch, kv_len, v, samples, best))
                    best = min(best, times[v])
            else:
                times = {v: self.measure(key, batch, kv_len, v, samples) for v in entrants}
            timed = [halving.Timed(str(v), v.backend, times[v], rank[v]) for v in entrants if times[v] < math.inf]
            ranked = [by_text[t.text] for t in halving.ranked(timed)]
            if r == len(s.rungs) - 1 or not ranked:
                break
            kept, _, _ = halving.promote(timed, s.keep, s.min_keep, baseline=None,
                                         carried=[str(v) for v in seeds], each_backend=False)
            entrants = sorted((by_text[t] for t in kept), key=lambda v: rank[v])
        record = {"kind": "cell", "family": _family(key), "batch": batch, "kv_len": kv_len,
                  "seeds": [str(v) for v in seeds], "entrants": sizes}
        if not ranked:
            errors = [self.rec.records.steps[Records.step_key(key, batch, kv_len, str(v), s.rungs[0])].get("error", "")
                      for v in order[:1]] if order else []
            reason = ("no candidate passed the gate" if not order
                      else f"every candidate failed to run (first: {errors[0] if errors else '?'})")
            return self.rec.append({**record, "status": "failed", "reason": reason}, durable=True)
        winner = ranked[0]
        record.update(status="ok", winner=str(winner), time_us=times[winner],
                      top=[str(v) for v in ranked[:s.cross_top]])
        if len(ranked) > 1:
            record["runner_up"] = {"variant": str(ranked[1]), "time_us": times[ranked[1]]}
        return self.rec.append(record, durable=True)

    def cross(self, unit: Unit) -> dict | None:
        """The unit's CUDA-graph pick (recorded), over its cells that have a winner and the
        bucket's ragged mix over their kv range."""
        recorded = self.rec.records.graphs.get((unit.key, unit.batch))
        if recorded is not None:
            return recorded
        cells, ok, union = self._finalists(unit)
        if not ok:
            return None
        last = self.cfg.search.rungs[-1]
        times: dict[Variant, dict[int, float]] = {}
        best: dict[int, float] = {}
        for kv in ok:
            for v in union:
                t = self.measure(unit.key, unit.batch, kv, v, last)
                if t < math.inf:
                    times.setdefault(v, {})[kv] = t
            best[kv] = min([cells[kv]["time_us"], *(t[kv] for t in times.values() if kv in t)])
        ragged = self._ragged[(unit.key, unit.batch)] = ragged_probe_lengths(unit.batch, ok)
        for v in union:
            t = self.measure(unit.key, unit.batch, RAGGED_PROBE_KV, v, last)
            if t < math.inf:
                times.setdefault(v, {})[RAGGED_PROBE_KV] = t
        ragged_times = [t[RAGGED_PROBE_KV] for t in times.values() if RAGGED_PROBE_KV in t]
        if ragged_times:
            best[RAGGED_PROBE_KV] = min(ragged_times)
        chosen = choose_graph_pick(times, best)
        if chosen is None:
            return None
        variant, regret, worst_kv = chosen
        return self.rec.append({"kind": "graph", "family": _family(unit.key), "batch": unit.batch,
                                "variant": str(variant), "worst_regret": round(regret, 6),
                                "worst_kv_len": worst_kv, "union": [str(v) for v in union], "kv_lens": ok,
                                "ragged_kv_lens": ragged},
                               durable=True)

    def _finalists(self, unit: Unit) -> tuple[dict, list[int], list[Variant]]:
        """(the unit's cell records by kv_len, the kv_lens of those with a winner, the union
        of their records' `top`, each kv cell's best cross_top, in order)."""
        cells = {kv: self.rec.records.cells.get((unit.key, unit.batch, kv)) for kv in unit.kv_lens}
        ok = [kv for kv, c in cells.items() if c is not None and c.get("status") == "ok"]
        return cells, ok, list(dict.fromkeys(Variant.parse(t) for kv in ok for t in cells[kv]["top"]))

    def edge(self, unit: Unit) -> int | None:
        """With search.batch_edge, the unit's finalists (the cross stage's union) and each
        cell's variants timed in its last rung, at every kv cell with a winner, at the
        bucket's smallest batch (cells.edge_batch): recorded steps at that batch and the
        cell's kv_len, resumed like any other. Returns that batch, or None where nothing
        was measured or found."""
        batch = edge_batch(self.cfg.batch_buckets, unit.batch) if self.cfg.search.batch_edge else None
        if batch is None:
            return None
        _cells, ok, union = self._finalists(unit)
        last = self.cfg.search.rungs[-1]
        steps = self.rec.records.steps
        for kv in ok:
            # the cell's last rung too: a variant the edge lacks is left out of the estimates
            # near the edge, where the edge weighs most (estimate.MIN_MEASURED_WEIGHT)
            timed = [v for v in self.plan.families[unit.key].candidates
                     if steps.get(Records.step_key(unit.key, unit.batch, kv, str(v), last), {}).get("status") == "ok"]
            for variant in dict.fromkeys([*union, *timed]):
                self.measure(unit.key, batch, kv, variant, last)
            self._drop_input()
        return batch if ok and union else None

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        try:
            self.gate()
            total = self.plan.cells
            done = searched = 0
            for unit in self.plan.units:
                if self.stopped:
                    break
                for kv_len in unit.kv_lens:
                    began = time.monotonic()
                    replayed = (unit.key, unit.batch, kv_len) in self.rec.records.cells
                    cell = self.search_cell(unit.key, unit.batch, kv_len)
                    done += 1
                    searched += not replayed
                    self._progress(done, total, searched, unit, kv_len, cell, time.monotonic() - began)
                self._drop_input()
                pick = self.cross(unit)
                if pick is not None:
                    where = pick["worst_kv_len"] or "the ragged mix"
                    self.log(f"  graph pick, {unit.key}, batch {unit.batch}: {pick['variant']} "
                             f"(worst regret {pick['worst_regret']:.1%} at kv {where})")
                self._drop_input()
                edge = self.edge(unit)
                if edge is not None:
                    self.log(f"  edge, {unit.key}, batch {unit.batch}: finalists timed at batch {edge}")
        except _BudgetSpent:
            self.stopped = True
            self.log(f"budget spent after {time.monotonic() - self.started:.0f} s: stopping; run the "
                     "same command again (without --fresh) to resume")
        finally:
            self._drop_input()

    def _progress(self, done: int, total: int, searched: int, unit: Unit, kv_len: int, cell: dict,
                  seconds: float) -> None:
        """One line per cell: its winner, its time and the runner-up's, elapsed and ETA
        (tune/progress.eta_s: this run's pace over the cells it searched, gate included)."""
        where = f"[{done}/{total}] {unit.key} | batch {unit.batch} kv {kv_len}:"
        if cell.get("status") != "ok":
            self.log(f"{where} left out: {cell.get('reason')}")
            return
        runner = ""
        if cell.get("runner_up"):
            runner = f", runner-up +{cell['runner_up']['time_us'] / cell['time_us'] - 1:.1%}"
        elapsed = time.monotonic() - self.started
        eta = eta_s(elapsed, searched, total - done)
        self.log(f"{where} {cell['winner']} {cell['time_us']:.1f} us ({cell['entrants'][0]} candidates"
                 f"{runner}) {seconds:.1f} s, elapsed {elapsed:.0f} s"
                 + (f", ETA {eta:.0f} s" if eta is not None else ""))


def _header(cfg: ServingConfig, platform, shard: tuple[int, int], path: Path, gpu_name: str) -> dict:
    return {"kind": "header", "schema": SCHEMA, "file": str(path), "config_path": str(cfg.path),
            "config_hash": cfg.hash, "gpu": gpu_name, "shard": list(shard),
            "platform": {"name": platform.name, "device_name": platform.device_name, "arch": platform.arch,
                         "sm_count": platform.sm_count, "smem_per_sm": platform.smem_per_sm,
                         "driver": platform.driver},
            "versions": {k: str(v) for k, v in platform.versions.items()}, "protocol": timing.protocol(platform.has_gpu),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


# ------------------------------------------------------------------ entry points
def run_serving_sweep(config: str | Path | ServingConfig, gpu_name: str, *, out: str | Path | None = None,
                      shard: tuple[int, int] = (1, 1), budget_s: float | None = None, fresh: bool = False,
                      platform=None, device=None, timer: Timer | str | None = None,
                      gate_workers: int | None = None, log: Callable[[str], None] = print,
                      probe: Probe | str | None = None, isolate: bool | None = None,
                      candidate_timeout_s: float | None = None) -> dict:
    """Sweep (or resume) one shard; write the table unless sharded. Returns a summary:
    results path, table path (None for a shard), cells done, stopped, seconds.

    timer, probe: by name ("module:function"; default: the leaderboard protocol and the
    event probe on a GPU, the CPU stand-in without one) or as callables. isolate (default:
    whether the timer is a name): time every candidate in a killable worker process, each
    limited to candidate_timeout_s (default MEASURE_TIMEOUT_S, cut to the budget left)."""
    cfg = config if isinstance(config, ServingConfig) else load_serving_config(config)
    platform = platform or gpu.detect()
    device = device or ("cuda" if platform.has_gpu else "cpu")
    timer = timer or (GPU_TIMER if platform.has_gpu else CPU_TIMER)
    if probe is None and platform.has_gpu:
        probe = GPU_PROBE
    isolate = isinstance(timer, str) if isolate is None else isolate
    out = Path(out) if out is not None else Path("tables") / f"{gpu_name}.serving.yaml"
    results = results_path_for(out, shard)
    log_stem = results.with_name(results.name.removesuffix(".results.jsonl"))
    budget = budget_s if budget_s is not None else cfg.budget_s
    started = time.monotonic()
    plan = plan_sweep(cfg, platform, shard)
    with SweepLock(results_lock_path(results)) as lock:
        if lock.warning:
            log(f"warning: {lock.warning}")
        if fresh and results.exists():
            log(f"moved {results} aside to {move_aside(results)}")
        recorder = Recorder(results, _header(cfg, platform, shard, results, gpu_name), log=log)
        try:
            log(f"serving sweep {cfg.name} on {platform.device_name} ({gpu_name}), shard {shard[0]}/{shard[1]}: "
                f"{len(plan.units)} of {plan.all_units} units, {plan.cells} cells"
                + (f", resuming {results}" if recorder.resumed else f", results in {results}")
                + (f", budget {budget:.0f} s" if budget else "")
                + (f"; candidates timed in a worker process (log {log_stem}.worker-0.log)" if isolate else ""))
            with (TaskPool(1, log_stem, device_index(device)) if isolate else contextlib.nullcontext()) as pool:
                sweeper = Sweeper(cfg, plan, recorder, timer=timer, device=device,
                                  clock=BudgetClock(budget, started), log=log, gate_workers=gate_workers,
                                  probe=probe, pool=pool, timeout_s=candidate_timeout_s or MEASURE_TIMEOUT_S,
                                  log_stem=log_stem, gate_timeout_s=candidate_timeout_s or GATE_TIMEOUT_S)
                sweeper.run()
        finally:
            recorder.close()
        seconds = time.monotonic() - started
        mine = {(u.key, u.batch, kv) for u in plan.units for kv in u.kv_lens}
        done = sum(1 for cell, r in recorder.records.cells.items() if cell in mine and r.get("status") == "ok")
        summary = {"results": results, "table": None, "stopped": sweeper.stopped, "timed": sweeper.timed,
                   "cells": done, "seconds": round(seconds, 1)}
        if shard == (1, 1):
            reason = ("not measured: the sweep stopped at its budget; run it again (without --fresh) to resume"
                      if sweeper.stopped else "not measured")
            write_table(cfg, plan, recorder.records, [recorder.header], out, gpu_name, reason,
                        {"sweep": {"budget_s": budget, "seconds": round(seconds, 1), "stopped": sweeper.stopped}})
            summary["table"] = out
            log(f"wrote {out}" + (" (partial: the budget stopped it)" if sweeper.stopped else ""))
        else:
            shards = ",".join(str(results_path_for(out, (i, shard[1]))) for i in range(1, shard[1] + 1))
            log(f"shard {shard[0]}/{shard[1]} recorded in {results}; once every shard is done: mla-tune sweep "
                f"--config {cfg.path} --gpu {gpu_name} --out {out} --merge {shards}")
    return summary


def dry_run(cfg: ServingConfig, gpu_name: str, shard: tuple[int, int] = (1, 1),
            gate_workers: int | None = None, log: Callable[[str], None] = print) -> dict:
    """Print the plan (families, candidates, cells, left-out cells, a GPU-time estimate)
    for `gpu_name` without running anything, each line fitted to the terminal's width
    (tables.render.fitting: 80 in a pipe); returns the estimate."""
    log = fitting(log)
    platform = gpu.fake_platform(gpu_name)
    plan = plan_sweep(cfg, platform, shard, check_available=False)
    log(f"serving sweep {cfg.name} ({cfg.path}, hash {cfg.hash[:12]}) planned for {gpu_name} "
        f"({platform.sm_count} SMs), rule {cfg.rule.name}, shard {shard[0]}/{shard[1]}, cells timed on "
        f"{cfg.search.cell_lengths} lengths"
        + (", finalists also at each batch bucket's smallest batch" if cfg.search.batch_edge else ""))
    for key, fam in plan.families.items():
        cells = sum(len(u.kv_lens) for u in plan.units if u.key == key)
        per = ", ".join(f"{b} {n}" for b, n in fam.per_backend().items()) or "none"
        log(f"  {key}: {len(fam.candidates)} candidates ({per}); {cells} cells here, "
            f"{len(fam.left_out)} left out by rule")
        for backend, why in fam.skipped.items():
            log(f"      {backend} skipped: {why}")
        for line in left_out_summary(fam):
            log(f"      left out {line}")
    first = plan.families[cfg.families[0]]
    log("gate probes (" + str(first.key) + "): " + "; ".join(
        f"{label}: q_lens {q}, kv_lens {kv}" for label, q, kv, _ in probe_lengths(first.spec, cfg.gate)))
    est = estimate(cfg, plan, gate_workers)
    log(f"{len(plan.units)} units, {plan.cells} cells; estimated GPU time {est['total'] / 60:.1f} min "
        f"(gate and compile {est['gate_and_compile']:.0f} s, cache loads {est['cache_loads']:.0f} s, cells "
        f"{est['cells']:.0f} s, cross {est['cross']:.0f} s, edge {est['edge']:.0f} s, inputs {est['inputs']:.0f} s; "
        "a rough cost model, mla_tune/serving/cells.py)")
    for rule in cfg.left_out:
        match = ", ".join(f"{name} in {list(values)}" for name, values in rule.match) or "every family"
        log(f"left out by rule ({match}): cells over {rule.condition} {rule.limit}: {rule.why}")
    return est


_print_plan = dry_run  # sweep_from_cli's dry_run flag shadows the function


def _shard_process(config: str, gpu_name: str, out: str, shard: tuple[int, int], budget: float | None,
                   fresh: bool, candidate_timeout_s: float | None) -> None:
    """One device's shard, in its own spawned process (CUDA_VISIBLE_DEVICES set by the
    parent): exit 0 done, 3 stopped by the budget, 1 an mla-tune error (printed)."""
    try:
        summary = run_serving_sweep(config, gpu_name, out=out, shard=shard, budget_s=budget, fresh=fresh,
                                    candidate_timeout_s=candidate_timeout_s)
    except (MlaTuneError, ValueError, ContextLost) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(1)
    sys.exit(3 if summary["stopped"] else 0)


def _spread_over_devices(config: Path, gpu_name: str, out: Path, devices: list[int], budget: float | None,
                         fresh: bool, candidate_timeout_s: float | None) -> int:
    """One shard per GPU, each its own spawned process that sees only its GPU
    (CUDA_VISIBLE_DEVICES) and writes its own results file; then merge them into the
    table. Returns the exit code (3: a shard stopped at its budget; resumable)."""
    n = len(devices)
    ctx = mp.get_context("spawn")
    procs = []
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for i, dev in enumerate(devices, start=1):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(dev)  # what the spawned process starts with
            proc = ctx.Process(target=_shard_process, name=f"mla-tune-shard-{i}-of-{n}",
                               args=(str(config), gpu_name, str(out), (i, n), budget, fresh, candidate_timeout_s))
            proc.start()
            procs.append(proc)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        for proc in procs:
            proc.join()
    except KeyboardInterrupt:
        for proc in procs:
            proc.kill()
        raise
    codes = [proc.exitcode for proc in procs]
    if any(codes):
        print(f"error: shard exit codes {codes}; run the same command again (without --fresh) to resume",
              file=sys.stderr)
        return 3 if set(codes) <= {0, 3} else 1
    merge(config, gpu_name, [results_path_for(out, (i, n)) for i in range(1, n + 1)], out=out)
    return 0


def sweep_from_cli(config: Path, gpu_name: str, *, out: Path | None = None, dry_run: bool = False,
                   force: bool = False, devices: list[int] | None = None, fresh: bool = False,
                   budget: float | None = None, shard: str | None = None, merge_results: list[Path] | None = None,
                   candidate_timeout: float | None = None) -> int:
    """`mla-tune sweep` with a serving config (cli.py's hook); returns its exit code (3:
    stopped by the budget, resumable). An mla-tune error or a bad value is one line on
    stderr and 1. shard "i/n": sweep every n-th unit from the i-th into its own results
    file; merge_results: build the table from those files (the shards), sweeping nothing."""
    out = Path(out) if out is not None else Path("tables") / f"{gpu_name}.serving.yaml"
    try:
        parts = parse_shard(shard or "1/1")
        if budget is not None and not budget > 0:
            raise ValueError(f"--budget must be a positive number of seconds, got {budget}")
        cfg = load_serving_config(config)
        if merge_results:
            if dry_run or devices or shard:
                raise ValueError("--merge builds the table from shards' results files: it takes no "
                                 "--dry-run, --devices or --shard")
            merge(cfg, gpu_name, merge_results, out=out)
            return 0
        if dry_run:
            ignored = [name for name, given in (("--budget", budget is not None), ("--devices", devices),
                                                ("--fresh", fresh), ("--candidate-timeout", candidate_timeout))
                       if given]
            if ignored:
                raise ValueError(f"{', '.join(ignored)}: a serving dry run prints the plan of --shard and runs "
                                 "nothing, so it would ignore them; drop them, or drop --dry-run")
            _print_plan(cfg, gpu_name, parts)
            return 0
        if devices:
            if shard:
                raise ValueError("--devices runs one shard per GPU itself: pass --devices or --shard, not both")
            if not force:
                _refuse_other_gpu(gpu.detect(), gpu_name)
            return _spread_over_devices(Path(config), gpu_name, out, devices, budget, fresh, candidate_timeout)
        platform = gpu.detect()
        if not force:
            _refuse_other_gpu(platform, gpu_name)
        summary = run_serving_sweep(cfg, gpu_name, out=out, shard=parts, budget_s=budget, fresh=fresh,
                                    platform=platform, candidate_timeout_s=candidate_timeout)
    except (MlaTuneError, ValueError, ContextLost) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 3 if summary["stopped"] else 0


def _refuse_other_gpu(platform, gpu_name: str) -> None:
    if platform.name != gpu_name:
        raise ServingSweepError(f"this machine's GPU is {platform.name} ({platform.device_name}), not "
                                f"{gpu_name}; run on a {gpu_name} or pass --force")
