"""How the sweep shares out its work and its time.

`assign_shapes` says which device runs which shape. The rest is the budget: what a
candidate costs (`CostModel`, from an earlier results file for this GPU when there is one,
else the documented `DEFAULT_COSTS`, then corrected by what this sweep measures), what a
plan will cost (`estimate`), how a plan is cut to fit `budget_s` (`fit_plan`: fewer samples
first, down to a floor, then fewer candidates), and the clock the running sweep checks
before it starts or promotes a candidate (`BudgetClock`).
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.backends import baseline_backend
from mla_tune.core import Shape, Variant

WALL_SAMPLES_MAX = 20  # the last rung's wall-time figure takes min(samples, this)
STARTUP_S = 12.0  # start a worker (import torch, start CUDA), measure copy bandwidth
COMPILE_JOB_S = 1.0  # one precompile job (variant, shape class) in one process (a guess until
# a results file's precompile note measures it)
RESERVE_S = 3.0  # kept back for writing the table and stopping workers
SAMPLE_FLOOR = (2, 3, 5)  # fewest samples at rung 0, a middle rung, the last rung


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


def wall_samples(rungs: tuple[int, ...], rung: int) -> int:
    return min(rungs[-1], WALL_SAMPLES_MAX) if rung == len(rungs) - 1 else 0


def compile_class(shape: Shape) -> tuple[int, int]:
    """What a first-call (JIT) cost is paid once per, with the variant: Triton and the
    vendor JITs specialize on each dimension being 1, a multiple of 16, or other."""
    def cls(n: int) -> int:
        return 1 if n == 1 else 16 if n % 16 == 0 else 0
    return cls(shape.batch), cls(shape.kv_len)


# ------------------------------------------------------------------------- costs
WARMUP_CALLS = 5  # calls a step makes besides its samples (warm-up, host-time probe)


@dataclass(frozen=True)
class BackendCost:
    """Seconds, per candidate step on one device."""

    rung0_s: float  # build + the gate + round trip, at rung 0 (the timed calls not included)
    step_s: float  # build + round trip at a later rung (the timed calls not included)
    sample_s: float  # one timing sample's overhead besides the call (L2 flush, queued sleep)
    first_s: float  # extra on a (variant, compile class)'s first call: a JIT compile

    def step(self, rung: int, samples: int, wall: int, call_s: float = 0.0) -> float:
        """A step's seconds; `call_s` is the candidate's own time per call where known."""
        calls = samples + wall + WARMUP_CALLS
        return (self.rung0_s if rung == 0 else self.step_s) + calls * (self.sample_s + call_s)


# The last H200 sweep (tables/H200.results.jsonl, 939 candidates): a Triton candidate's
# quick look 5-40 ms, its full timing 20-200 ms; FlashInfer's first call per variant and
# shape class JIT-compiles for 14-20 s; triton_fused compiled in the timed worker at
# kv_len 8192 (1.3-2.2 s). Backends not listed take "*".
DEFAULT_COSTS = {
    "*": BackendCost(0.03, 0.01, 0.0005, 0.0),
    "torch": BackendCost(0.1, 0.02, 0.001, 0.0),
    "triton": BackendCost(0.01, 0.005, 0.0004, 0.0),
    "triton_fused": BackendCost(0.01, 0.005, 0.0004, 1.0),
    "flashinfer": BackendCost(0.02, 0.01, 0.0004, 18.0),
    "flashmla": BackendCost(0.03, 0.01, 0.0004, 0.3),
    "aiter": BackendCost(0.03, 0.01, 0.0005, 0.5),
}


class CostModel:
    """Per-backend costs: a prior (measured from an earlier results file, or the
    defaults) that this sweep's own steps replace once a backend has a few of them."""

    MIN_OBSERVED = 3

    def __init__(self, prior: dict[str, BackendCost], basis: str, compile_job_s: float = COMPILE_JOB_S):
        self.prior = prior
        self.basis = basis
        self.compile_job_s = compile_job_s
        self._fixed: dict[tuple[str, bool], list[float]] = {}  # (backend, rung 0?) -> seconds
        self._first: dict[str, list[float]] = {}

    def cost(self, backend: str) -> BackendCost:
        prior = self.prior.get(backend) or self.prior.get("*") or DEFAULT_COSTS["*"]
        r0 = self._fixed.get((backend, True), [])
        later = self._fixed.get((backend, False), [])
        first = self._first.get(backend, [])
        return BackendCost(
            statistics.median(r0) if len(r0) >= self.MIN_OBSERVED else prior.rung0_s,
            statistics.median(later) if len(later) >= self.MIN_OBSERVED else prior.step_s,
            prior.sample_s,
            statistics.mean(first) if len(first) >= 2 else prior.first_s,
        )

    def observe(self, backend: str, rung: int, calls: int, elapsed_s: float, first_call: bool,
                call_s: float = 0.0) -> None:
        """One finished step of `calls` timed calls: its fixed cost (elapsed less the calls)
        joins the running figures; a first call's excess over the usual goes to first_s."""
        fixed = max(0.0, elapsed_s - (calls + WARMUP_CALLS) * (self.cost(backend).sample_s + call_s))
        if first_call:
            usual = self.cost(backend).rung0_s if rung == 0 else self.cost(backend).step_s
            self._first.setdefault(backend, []).append(max(0.0, fixed - usual))
            if fixed > 3 * usual + 0.5:
                return  # a JIT, not the usual cost
        self._fixed.setdefault((backend, rung == 0), []).append(fixed)


def measured_costs(path: Path) -> tuple[dict[str, BackendCost], int] | None:
    """Per-backend costs measured from an earlier results file of this GPU, with the number
    of records they come from; None when it has none usable. Steps with `samples` (this
    format) give the fixed costs directly; an older file's ok/pruned records are the full
    and the quick timing, from which the per-sample cost is derived."""
    try:
        lines = path.read_text().splitlines()
        header = json.loads(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    timing = header.get("timing") or {}
    reps, prune = timing.get("reps") or 30, timing.get("prune_reps") or 5
    per: dict[str, dict[str, list]] = {}
    seen: set = set()
    used = 0
    compile_job_s = None
    for line in lines[1:]:
        try:
            r = json.loads(line)
            if r.get("kind") == "note" and isinstance(r.get("precompile"), dict):
                pc = r["precompile"]
                compile_job_s = float(pc["seconds"]) * int(pc["processes"]) / max(1, int(pc["jobs"]))
                continue
            backend, elapsed = r["backend"], float(r["elapsed_s"])
            shape = Shape(int(r["shape"]["batch"]), int(r["shape"]["kv_len"]))
        except (ValueError, KeyError, TypeError):
            continue
        if r.get("kind") not in ("candidate", "step") or r.get("status") not in ("ok", "pruned"):
            continue
        if "samples" in r and r["samples"] is None:
            continue  # a cut, not a step: it cost nothing
        key = (r["variant"].split("q_amax")[0], compile_class(shape))
        first = key not in seen
        seen.add(key)
        d = per.setdefault(backend, {"r0": [], "later": [], "quick": [], "full": [], "first": []})
        used += 1
        if "samples" in r:
            n = int(r["samples"]) + int(r.get("wall_samples") or 0) + WARMUP_CALLS
            call_s = float((r.get("time") or {}).get("median_us") or 0.0) * 1e-6
            d["r0" if r.get("rung") == 0 else "later"].append((elapsed - n * call_s, n))
        else:
            d["quick" if r["status"] == "pruned" else "full"].append(elapsed)
        d["first"].append((first, elapsed))
    if not used:
        return None
    costs = {}
    for backend, d in per.items():
        base = DEFAULT_COSTS.get(backend, DEFAULT_COSTS["*"])
        sample_s = base.sample_s
        if d["quick"] and d["full"]:  # old format: full = quick + reps + wall samples
            extra = statistics.median(d["full"]) - statistics.median(d["quick"])
            sample_s = max(1e-5, extra / (reps + min(reps, WALL_SAMPLES_MAX)))
        r0 = [e - n * sample_s for e, n in d["r0"]] or [e - prune * sample_s for e in d["quick"]]
        later = [e - n * sample_s for e, n in d["later"]]
        rung0_s = max(0.0, statistics.median(r0)) if r0 else base.rung0_s
        step_s = max(0.0, statistics.median(later)) if later else rung0_s / 2
        usual = statistics.median(e for _, e in d["first"])
        excess = [max(0.0, e - usual) for first, e in d["first"] if first]
        costs[backend] = BackendCost(rung0_s, step_s, sample_s, statistics.mean(excess) if excess else 0.0)
    if compile_job_s is not None:
        costs["compile_job_s"] = compile_job_s
    return costs, used


def cost_model_for(results_path: Path, earlier: list[Path]) -> CostModel:
    """The cost model for a sweep writing `results_path`: measured from the first of
    `earlier` (this GPU's results files) that has usable records, else the defaults."""
    for path in earlier:
        if path.exists():
            found = measured_costs(path)
            if found:
                costs, n = found
                job_s = costs.pop("compile_job_s", COMPILE_JOB_S)
                return CostModel({**DEFAULT_COSTS, **costs}, f"measured from {path} ({n} records)", job_s)
    return CostModel(dict(DEFAULT_COSTS), "defaults (DEFAULT_COSTS in mla_tune/tune/schedule.py; "
                     "no earlier results file for this GPU)")


# ----------------------------------------------------------------------- the plan
def survivors_after(n: int, n_backends: int, keep: float, min_keep: int) -> int:
    """At most how many of n timed candidates a rung promotes: the best fraction, never
    fewer than min_keep, plus one per backend (its best) and the baseline."""
    return min(n, max(min_keep, math.ceil(keep * n)) + n_backends)


@dataclass
class ShapePlan:
    rung_counts: list[int]
    seconds: float


def shape_plan(variants: list[Variant], rungs: tuple[int, ...], keep: float, min_keep: int,
               costs: CostModel) -> ShapePlan:
    """Candidates per rung and the seconds one shape takes (first calls not included)."""
    by_backend: dict[str, int] = {}
    for v in variants:
        by_backend[v.backend] = by_backend.get(v.backend, 0) + 1
    counts = [len(variants)]
    for _ in rungs[1:]:
        counts.append(survivors_after(counts[-1], len(by_backend), keep, min_keep))
    seconds = 0.0
    for backend, n in by_backend.items():
        c = costs.cost(backend)
        share = n / len(variants)
        for rung, samples in enumerate(rungs):
            seconds += counts[rung] * share * c.step(rung, samples, wall_samples(rungs, rung))
    return ShapePlan(counts, seconds)


@dataclass
class Estimate:
    seconds: float
    shapes: dict[Shape, ShapePlan]
    startup_s: float
    compile_s: float
    first_calls_s: float
    candidates_s: float


def first_call_keys(plan: dict[Shape, list[Variant]]) -> dict[str, int]:
    keys: dict[str, set] = {}
    for shape, variants in plan.items():
        for v in variants:
            keys.setdefault(v.backend, set()).add((str(v), compile_class(shape)))
    return {b: len(k) for b, k in keys.items()}


def compile_jobs(plan: dict[Shape, list[Variant]], precompile: dict[str, bool]) -> int:
    return len({(str(v), compile_class(s)) for s, vs in plan.items() for v in vs if precompile.get(v.backend)})


def estimate(plan: dict[Shape, list[Variant]], rungs, keep, min_keep, costs: CostModel,
             n_devices: int, precompile: dict[str, bool], processes: int,
             startup_s: float = STARTUP_S, with_compile: bool = True) -> Estimate:
    shapes = {s: shape_plan(vs, rungs, keep, min_keep, costs) for s, vs in plan.items() if vs}
    compile_s = compile_jobs(plan, precompile) * costs.compile_job_s / max(1, processes) if with_compile else 0.0
    first = sum(n * costs.cost(b).first_s for b, n in first_call_keys(plan).items())
    work = sum(p.seconds for p in shapes.values())
    devices = max(1, n_devices)
    total = startup_s + compile_s + (work + first) / devices + RESERVE_S
    return Estimate(total, shapes, startup_s, compile_s, first / devices, work / devices)


@dataclass
class FittedPlan:
    plan: dict[Shape, list[Variant]]
    rungs: tuple[int, ...]
    estimate: Estimate
    dropped: dict[Shape, list[Variant]] = field(default_factory=dict)
    fits: bool = True
    notes: list[str] = field(default_factory=list)


def shrink_rungs(rungs: tuple[int, ...], scale: float) -> tuple[int, ...]:
    """The rungs' sample counts times `scale`, never below SAMPLE_FLOOR."""
    out = []
    for i, n in enumerate(rungs):
        floor = SAMPLE_FLOOR[0] if i == 0 else SAMPLE_FLOOR[2] if i == len(rungs) - 1 else SAMPLE_FLOOR[1]
        out.append(min(n, max(floor, round(n * scale))))
    return tuple(out)


def _family(variant: Variant) -> tuple:
    """Candidates one backend offers for one format pair form a family; the cut keeps at
    least one of each, so every backend and format stays represented."""
    return variant.backend, str(variant.get("kv")), str(variant.get("q"))


def fit_plan(plan: dict[Shape, list[Variant]], rungs: tuple[int, ...], keep: float, min_keep: int,
             costs: CostModel, budget_s: float | None, n_devices: int, precompile: dict[str, bool],
             processes: int, startup_s: float = STARTUP_S, with_compile: bool = True) -> FittedPlan:
    """Cut the plan to fit budget_s: first the samples per rung (down to SAMPLE_FLOOR), then
    candidates, deterministically: never the baseline, never a family's last member, the
    largest family first, a seeded subsample within it."""

    def est(p, r):
        return estimate(p, r, keep, min_keep, costs, n_devices, precompile, processes, startup_s, with_compile)

    first = est(plan, rungs)
    if budget_s is None or first.seconds <= budget_s:
        return FittedPlan(plan, rungs, first)
    notes = []
    for scale in (0.75, 0.5, 0.35, 0.25, 0.0):
        smaller = shrink_rungs(rungs, scale)
        e = est(plan, smaller)
        if e.seconds <= budget_s or scale == 0.0:
            break
    if smaller != rungs:
        notes.append(f"samples per rung cut from {list(rungs)} to {list(smaller)} to fit the budget")
    if e.seconds <= budget_s:
        return FittedPlan(plan, smaller, e, notes=notes)

    # Families per shape, each in a seeded order; the tail of the largest is dropped first.
    families: dict[tuple, list[Variant]] = {}
    baseline = baseline_backend()  # always timed in full (never cut): every table row cites it
    for shape, variants in plan.items():
        for v in variants:
            if v.backend != baseline:
                families.setdefault((shape, _family(v)), []).append(v)
    for key, members in families.items():
        random.Random(f"{key[0]}/{key[1]}").shuffle(members)
    heap = [(-len(m), str(k[0]), str(k[1]), k) for k, m in families.items() if len(m) > 1]
    heapq.heapify(heap)
    dropped: dict[Shape, list[Variant]] = {}
    kept = {shape: list(variants) for shape, variants in plan.items()}
    gone: set = set()
    total = sum(len(vs) for vs in plan.values())
    while e.seconds > budget_s and heap:
        over = (e.seconds - budget_s) / max(1e-9, e.seconds - e.startup_s - RESERVE_S)
        n_drop = max(1, math.ceil(total * min(1.0, over) * 0.9))
        for _ in range(n_drop):
            if not heap:
                break
            _n, _s, _f, key = heapq.heappop(heap)
            victim = families[key].pop()
            gone.add((key[0], victim))
            dropped.setdefault(key[0], []).append(victim)
            total -= 1
            if len(families[key]) > 1:
                heapq.heappush(heap, (-len(families[key]), str(key[0]), str(key[1]), key))
        kept = {shape: [v for v in variants if (shape, v) not in gone] for shape, variants in plan.items()}
        e = est(kept, smaller)
    for scale in (1.0, 0.75, 0.5, 0.35):  # give the samples back where the cut freed the time
        grown = shrink_rungs(rungs, scale)
        if grown != smaller and est(kept, grown).seconds <= budget_s:
            smaller, e = grown, est(kept, grown)
            notes[0:1] = [] if grown == rungs else [
                f"samples per rung cut from {list(rungs)} to {list(grown)} to fit the budget"]
            break
    n = sum(len(v) for v in dropped.values())
    notes.append(f"{n} of {n + total} candidates dropped to fit the budget (a seeded subsample "
                 "of the largest families; the baseline and one of each backend's formats kept)")
    fits = e.seconds <= budget_s
    if not fits:
        notes.append(f"the plan still needs about {e.seconds:.0f} s at one candidate per family; "
                     f"the budget of {budget_s:.0f} s will stop it early")
    return FittedPlan(kept, smaller, e, dropped, fits, notes)


# ------------------------------------------------------------------------ the clock
class BudgetClock:
    """The running sweep's deadline (started + budget_s, less a reserve for writing the
    table) and each shape's share of what is left."""

    def __init__(self, budget_s: float | None, started: float, costs: CostModel | None = None):
        self.budget_s = budget_s
        self.started = started
        self.costs = costs
        self.deadline = math.inf if budget_s is None else started + budget_s - min(RESERVE_S, 0.05 * budget_s)
        # a candidate still running at this point is killed (the 10% over budget_s allowed)
        self.hard_deadline = math.inf if budget_s is None else started + 1.08 * budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, limit_s: float) -> float:
        """A candidate's time limit: its own, cut to what the budget has left."""
        return max(0.5, min(limit_s, self.hard_deadline - time.monotonic()))

    def past_hard_deadline(self) -> bool:
        """Whether the hard deadline has come: a candidate killed for its time now was cut by
        the budget, not by its own limit, so it is not recorded (a resume runs it)."""
        return time.monotonic() >= self.hard_deadline - 0.05

    def shape_deadline(self, shape_s: float, remaining_s: float) -> float:
        """This shape's share of the time left, by its part of the work still planned."""
        if math.isinf(self.deadline):
            return math.inf
        share = shape_s / remaining_s if remaining_s > 0 else 1.0
        return time.monotonic() + max(0.0, self.left()) * min(1.0, share)
