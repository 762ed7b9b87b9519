"""`mla-tune verify`: re-time a serving table's picks at shapes it was not tuned at.

    mla-tune verify --table tables/H200.serving.yaml [--shapes 30] [--ragged 10] [--seed 0]
        [--samples 5] [--families heads=128,kv_format=fp8] [--json verify.json]
        [--max-p95 0.05] [--max-regret 0.15] [--budget 170] [--workers N]

Held-out shapes (deterministic from --seed; families round-robin over the table's, so
each appears): a *uniform* shape is `batch` sequences of one kv_len, a *ragged mix* is
`batch` sequences of kv_lens drawn each on its own. The batch is log-uniform over the
integers 1 (2 for a mix) .. the largest batch bucket, each kv_len log-uniform over the
smallest .. the largest kv bucket. Off the grid: a uniform shape's kv_len is never a kv
bucket and its batch never a batch bucket where the range holds another integer (drawn
again until so), so no uniform shape is a cell the sweep measured; a mix's mean length
is whatever its draws make it. A shape whose cache the config leaves out (its left_out
rules, on the shape's total tokens) is drawn again.

At each shape, on this GPU:
- the *eager pick* (ServingTable.lookup with the shape's batch, mean length and lengths:
  the estimated fastest of a table with points, else the cell of the batch bucket and
  the kv bucket of the mean length), the *graph pick* (its batch bucket's) and the *fallback* (runtime.decode's
  Decoder default for the spec: what runs without a table);
- every candidate of the family's config space on this platform (serving_plan.family_plan)
  that passes the config's gate (the gate the table's sweep ran, run again here for every
  candidate: one the gate rejects could not be the table's pick, so it does not compete
  for best; e.g. FlashMLA's fp8 kernel at q_len 4, within the rule but not its margin),
  the picks first: a one-call probe (CUDA events) over 4x the best probe so far prunes it
  (serving_sweep.PRUNE_FACTOR), the rest get a short rung (SHORT_SAMPLES samples);
- the final round: the short rung's best FINAL_TOP and the three roles, timed in
  FINAL_PASSES passes of `--samples` samples each, the order rotated and reversed from
  pass to pass (on the H200 a measurement's place in a back-to-back series moves it by up
  to 10%); a variant's time is the median of its pass medians;
- best = the fastest of the final round whose output passes the config's rule against
  mla_tune.serving.reference at this shape (the reference's q as the gate quantizes it);
  the picks and the fallback are checked there too. Regret = t(role) / t(best) - 1: >= 0
  for a role within the rule (the roles are in the final round); a role outside it fails
  the run whatever its regret, one that does not run has regret inf.
- where the table has no eager pick (the shape's cell is left out, e.g. batch 26 x 51k
  tokens rounds up to the cell 32 x 65536, over the cache limit), the eager role is the
  fallback, as in runtime.plan.DecodePlan.pick; the per-shape table marks it `*`.

Summary per role (eager, graph, fallback) over the uniform shapes, the mixes and all:
geomean (of 1 + regret, minus 1), p95 (nearest rank: the ceil(0.95 n)-th smallest), max.
The thresholds judge the eager pick (or --judge graph / both) over all shapes; an output
outside the rule fails the run too.

GPU cost (H200; the timer is timing.time_call, ~4 ms + (7 + samples) calls a measurement):
per shape ~0.5-2 s: probes (2 calls each, the slow own candidates at 128 heads ~35 ms
each), the short rung (~5 ms + 10 calls per surviving candidate), the final round
(4 passes x <= 6 variants x ~(5 ms + 12 calls)), the input and the reference; before
that, the gate of every candidate of each family in `--workers` processes, which compiles
them (244 candidates over the 12 families of configs/serving.yaml: about a minute). The run prints its elapsed time and each
shape's seconds; `--budget` stops between shapes.

The timer, probe, device and platform are injectable (tests: a made-up timer, the CPU,
Triton's interpreter).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_tune import gpu, problem
from mla_tune.backends import get_backend
from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import atomic_write_text
from mla_tune.serving.call import Decoder
from mla_tune.serving.cells import family_plan
from mla_tune.serving.config import ServingConfig, load_serving_config
from mla_tune.serving.gate import (
    RUN_ERRORS,
    GateJob,
    error_text,
    poisons_context,
    reference_q_format,
    run_call,
    run_gates,
)
from mla_tune.serving.inputs import ServingInput, make_input
from mla_tune.serving.measure import as_step, layer_copies, layer_timer
from mla_tune.serving.sweep import PRUNE_FACTOR, TimedCall, event_probe
from mla_tune.serving.table import FamilyKey, ServingTable, load_serving_table
from mla_tune.tables.render import fitting
from mla_tune.tune import timing

VERIFY_SCHEMA = "serving-verify/1"
SHORT_SAMPLES = 3  # the short rung: enough to rank, not to judge
FINAL_TOP = 3  # the short rung's best carried to the final round beside the three roles
FINAL_PASSES = 4  # alternating passes of the final round
DRAW_TRIES = 10_000
ROLES = ("eager", "graph", "fallback")
KINDS = ("uniform", "ragged", "all")


class VerifyError(MlaTuneError, ValueError):
    """verify cannot run as asked; the message says what to do."""


@dataclass(frozen=True)
class HeldOutShape:
    index: int
    kind: str  # "uniform" or "ragged"
    key: FamilyKey
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    seed: int  # the input's

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def mean_kv_len(self) -> float:
        return sum(self.kv_lens) / len(self.kv_lens)

    def kv_text(self) -> str:
        if self.kind == "uniform":
            return str(self.kv_lens[0])
        return f"ragged {self.mean_kv_len:.0f} ({min(self.kv_lens)}..{max(self.kv_lens)})"


# ------------------------------------------------------------------ held-out shapes
def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], each n weighted log((n + 1) / n): log-uniform."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def _off_grid(rng: random.Random, lo: int, hi: int, grid: list[int]) -> int:
    """_log_uniform, drawn again while it is a grid value (when [lo, hi] holds another)."""
    if hi - lo + 1 <= sum(lo <= g <= hi for g in grid):
        return _log_uniform(rng, lo, hi)
    while True:
        n = _log_uniform(rng, lo, hi)
        if n not in grid:
            return n


def select_families(table: ServingTable, text: str | None) -> list[FamilyKey]:
    """The table's families, or those matching every field of `text`
    ('kv_format=fp8,heads=128'; a field given twice matches either value)."""
    keys = list(table.families)
    if not text:
        return keys
    wanted: dict[str, set[str]] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = term.partition("=")
        if name not in ("kv_format", "page_size", "heads", "q_len") or not value:
            raise VerifyError(f"--families takes field=value terms of kv_format, page_size, heads, q_len "
                              f"(e.g. kv_format=fp8,heads=128), got {term!r}")
        wanted.setdefault(name, set()).add(value.strip())
    keys = [k for k in keys if all(str(getattr(k, n)) in vs for n, vs in wanted.items())]
    if not keys:
        raise VerifyError(f"--families {text!r} matches none of the table's families: "
                          + "; ".join(key.tag for key in table.families))
    return keys


def draw_shapes(table: ServingTable, cfg: ServingConfig, families: list[FamilyKey], uniform: int,
                ragged: int, seed: int) -> tuple[list[HeldOutShape], int]:
    """(the held-out shapes, how many draws the config's left_out rules sent back); see the
    module docstring. Deterministic from `seed`."""
    rng = random.Random(seed)
    bb, kb = table.batch_buckets, table.kv_buckets
    shapes, redrawn = [], 0
    for i in range(uniform + ragged):
        key = families[i % len(families)]
        kind = "uniform" if i < uniform else "ragged"
        spec = cfg.spec(key)
        kv_lo = max(kb[0], key.q_len)
        for _ in range(DRAW_TRIES):
            if kind == "uniform":
                batch = _off_grid(rng, 1, bb[-1], bb)
                kv_lens = [_off_grid(rng, kv_lo, max(kb[-1], kv_lo), kb)] * batch
            else:
                batch = _log_uniform(rng, min(2, bb[-1]), bb[-1])
                kv_lens = [_log_uniform(rng, kv_lo, max(kb[-1], kv_lo)) for _ in range(batch)]
            if cfg.left_out_reason(key, 1, sum(kv_lens)) is None:
                break
            redrawn += 1
        else:
            raise VerifyError(f"{DRAW_TRIES} draws for {key} all left out by the config's rules")
        if kind == "ragged" and spec.mixed_q_len:
            q_lens = [rng.randint(1, key.q_len) for _ in kv_lens]
        else:
            q_lens = [key.q_len] * batch
        shapes.append(HeldOutShape(i, kind, key, tuple(q_lens), tuple(kv_lens), rng.getrandbits(31)))
    return shapes, redrawn


# ------------------------------------------------------------------ statistics
def regret_stats(regrets: list[float]) -> dict:
    """n, geomean (of 1 + regret, minus 1), p95 (nearest rank) and max; a failed run is inf."""
    if not regrets:
        return {"n": 0, "geomean": None, "p95": None, "max": None}
    ordered = sorted(regrets)
    finite = all(math.isfinite(r) for r in ordered)
    geo = math.expm1(statistics.fmean(math.log1p(r) for r in ordered)) if finite else math.inf
    return {"n": len(ordered), "geomean": geo, "p95": ordered[math.ceil(0.95 * len(ordered)) - 1],
            "max": ordered[-1]}


def summarize(records: list[dict]) -> dict:
    """{role: {kind: regret_stats}} over the measured shapes."""
    out = {}
    for role in ROLES:
        out[role] = {}
        for kind in KINDS:
            values = [r["regret"][role] for r in records if kind in ("all", r["kind"])]
            out[role][kind] = regret_stats(values)
    return out


def alternating_passes(calls: Mapping, timer: Callable, samples: int, passes: int = FINAL_PASSES,
                       on_error: Callable[[Any, BaseException], None] | None = None,
                       sit_out: Collection = ()) -> dict:
    """{key: [each pass's median]} of `calls` ({key: call}) timed in turns, the final round's
    order: pass p starts at the p-th call and every other pass runs backwards, so a drift or
    a position effect (docs/perf.md 6.1) falls on each call alike; `samples` samples a turn
    (timer(call, samples).median_us). A call that raises one of RUN_ERRORS goes to
    on_error(key, exc) (which may raise) and sits out the passes after (re-raised without
    on_error); the keys in `sit_out` keep their turn in the order but are not timed."""
    out: dict = {v: [] for v in calls}
    names, dead = list(calls), set(sit_out)
    for p in range(passes):
        turn = names[p % len(names):] + names[:p % len(names)] if names else []
        for v in reversed(turn) if p % 2 else turn:
            if v in dead:
                continue
            try:
                out[v].append(timer(calls[v], samples).median_us)
            except RUN_ERRORS as exc:
                if on_error is None:
                    raise
                dead.add(v)
                on_error(v, exc)
    return out


def pct_text(x: float | None) -> str:
    """A regret as a percentage for the reports ("-": not measured; "failed": its run failed)."""
    if x is None:
        return "-"
    return "failed" if not math.isfinite(x) else f"{x:.1%}"


# ------------------------------------------------------------------ the verifier
@dataclass
class Verifier:
    table: ServingTable
    cfg: ServingConfig
    timer: Callable[..., timing.Timing]
    probe: Callable[[TimedCall], float] | None
    device: torch.device
    platform: gpu.Platform
    samples: int = 5
    log: Callable[[str], None] = print
    candidates: dict[FamilyKey, list] = field(default_factory=dict)
    fallbacks: dict[FamilyKey, Variant | None] = field(default_factory=dict)
    rejected: dict[FamilyKey, set] = field(default_factory=dict)  # by the gate (prepare)

    def prepare(self, keys: list[FamilyKey], workers: int, stop: Callable[[], bool]) -> dict:
        """Each family's candidates on this platform and its fallback; with workers > 0,
        every candidate through the config's gate (the one the table's sweep ran) in that
        many processes, which compiles them too (Triton's disk cache then serves this
        process). A candidate the gate rejects cannot be the table's pick, so it does not
        compete for "best" either: verify judges the lookup over what the sweep admitted.
        Returns what the gate found."""
        jobs, seen = [], set()
        for key in keys:
            spec = self.cfg.spec(key)
            plan = family_plan(self.cfg, key, self.platform)
            self.candidates[key] = plan.candidates
            try:
                self.fallbacks[key] = Decoder(spec, device=self.device).variant
            except ValueError as exc:
                self.log(f"  no fallback for {key}: {' '.join(str(exc).split())}")
                self.fallbacks[key] = None
            family = self.table.families[key]
            picks = [c.variant for c in family.cells.values()] + [g.variant for g in family.graph.values()]
            for v in [*plan.candidates, *filter(None, [self.fallbacks[key]]), *picks]:
                if (key, v) not in seen:
                    seen.add((key, v))
                    jobs.append(GateJob(spec, str(v), self.cfg.gate, self.cfg.rule, str(self.device)))
        if workers <= 0 or not jobs:
            return {"kernels": 0}
        began = time.monotonic()
        self.log(f"gate: {len(jobs)} candidates over {len(keys)} families in {workers} processes "
                 "(the table's gate; compiles them too)")
        failed = {}
        for job, out in run_gates(jobs, workers, stop=stop):
            if not out["ok"]:
                failed[job.variant] = out["reason"]
                self.rejected.setdefault(FamilyKey.of(job.spec), set()).add(Variant.parse(job.variant))
        seconds = time.monotonic() - began
        self.log(f"gate: done in {seconds:.1f} s" + (f"; {len(failed)} rejected (they do not compete for best): "
                                                     + "; ".join(f"{v}: {r}" for v, r in failed.items())
                                                     if failed else ""))
        return {"kernels": len(jobs), "seconds": round(seconds, 1), "gate_failed": failed}

    def _call(self, variant: Variant, shape: HeldOutShape, inp: ServingInput, copies=None):
        """The variant's TimedCall on `inp`; with `copies` (the config's search.step_layers),
        a LayeredStep of it over them (measure.as_step; verify_shape's timer takes it per layer)."""
        runner = get_backend(variant.backend).build_serving(variant, self.cfg.spec(shape.key), self.device)
        return as_step(TimedCall(variant, shape.key, shape.batch, round(shape.mean_kv_len), runner, inp),
                       copies, str(self.device))

    def verify_shape(self, shape: HeldOutShape) -> dict:
        key, spec = shape.key, self.cfg.spec(shape.key)
        inp = make_input(list(shape.q_lens), list(shape.kv_lens), key.heads, key.page_size, key.kv_format,
                         seed=shape.seed, device=self.device)
        fallback = self.fallbacks[key]
        looked = {"eager": self.table.lookup(spec, shape.batch, shape.mean_kv_len, kv_lens=shape.kv_lens),
                  "graph": self.table.lookup(spec, shape.batch, graph=True)}
        roles = {**{r: v or fallback for r, v in looked.items()}, "fallback": fallback}
        from_table = {r: looked[r] is not None for r in looked}
        failed: dict[str, str] = {}
        probes, short, pruned = {}, {}, []
        # the table's protocol (its config's search.step_layers): each time a layer's of a step
        layers = self.cfg.search.step_layers
        copies = layer_copies(inp, layers) if layers else None
        timer = layer_timer(self.timer)
        # probe and short rung, one candidate at a time (its runner goes before the next:
        # a split-K runner's workspace at 128 heads and 1024 rows is GBs)
        best_probe = math.inf
        rejected = self.rejected.get(key, set())
        order = list(dict.fromkeys([*filter(None, roles.values()),
                                    *(v for v in self.candidates[key] if v not in rejected)]))
        for v in order:
            call = None  # the previous candidate's runner goes now
            try:
                call = self._call(v, shape, inp, copies)
                if self.probe is not None:
                    probes[v] = self.probe(call) / call.layers
                    if probes[v] > PRUNE_FACTOR * best_probe and v not in roles.values():
                        pruned.append(v)
                        continue
                    best_probe = min(best_probe, probes[v])
                short[v] = timer(call, SHORT_SAMPLES).median_us
            except RUN_ERRORS as exc:
                self._failed(failed, v, shape, exc)
        call = None
        ranked = sorted(short, key=short.get)
        final = list(dict.fromkeys([*filter(None, roles.values()), *ranked[:FINAL_TOP]]))
        calls = {}
        for v in final:
            try:
                calls[v] = self._call(v, shape, inp, copies)
            except RUN_ERRORS as exc:
                self._failed(failed, v, shape, exc)
        passes = alternating_passes(calls, timer, self.samples,
                                    on_error=lambda v, exc: self._failed(failed, v, shape, exc),
                                    sit_out=[v for v in calls if str(v) in failed])
        times = {v: statistics.median(ts) for v, ts in passes.items() if ts and str(v) not in failed}
        checks = self._checks(inp, calls, times, roles)
        correct = [v for v in sorted(times, key=times.get)
                   if checks.get(str(v), {}).get("passed") and v not in rejected]
        best = correct[0] if correct else None
        del calls
        regret = {}
        for role, v in roles.items():
            t = times.get(v, math.inf) if v is not None else math.inf
            regret[role] = t / times[best] - 1.0 if best is not None and math.isfinite(t) else math.inf
        return {
            "index": shape.index, "kind": shape.kind, "family": key.as_dict(), "batch": shape.batch,
            "kv_lens": list(shape.kv_lens) if shape.kind == "ragged" else shape.kv_lens[0],
            "q_lens": list(shape.q_lens) if len(set(shape.q_lens)) > 1 else shape.q_lens[0],
            "mean_kv_len": round(shape.mean_kv_len, 1), "input_seed": shape.seed,
            "roles": {r: str(v) if v is not None else None for r, v in roles.items()},
            "from_table": from_table,
            "best": str(best) if best is not None else None,
            "best_us": round(times[best], 3) if best is not None else None,
            "regret": regret,
            "final_us": {str(v): round(t, 3) for v, t in sorted(times.items(), key=lambda kv: kv[1])},
            "final_passes_us": {str(v): [round(t, 3) for t in ts] for v, ts in passes.items()},
            "short_us": {str(v): round(t, 3) for v, t in sorted(short.items(), key=lambda kv: kv[1])},
            "probe_us": {str(v): round(t, 3) for v, t in probes.items()},
            "pruned": [str(v) for v in pruned], "failed": failed, "checks": checks,
            "candidates": len(order),
        }

    def _failed(self, failed: dict, variant: Variant, shape: HeldOutShape, exc: BaseException) -> None:
        """Record why `variant` did not run; a lost CUDA context ends the run (nothing after
        it could run), an out-of-memory error gives back the cached blocks first."""
        failed[str(variant)] = error_text(exc)
        if poisons_context(exc):
            raise VerifyError(f"the CUDA context was lost running {variant} at shape {shape.index} "
                              f"({shape.key.tag}, batch {shape.batch}): {error_text(exc)}") from exc
        if type(exc).__name__ == "OutOfMemoryError":
            torch.cuda.empty_cache()

    def _checks(self, inp: ServingInput, calls: dict, times: dict, roles: dict) -> dict:
        """The roles' outputs and the final round's in time order up to the first that passes
        (the best), against the fp32 reference under the config's rule (full allowance)."""
        refs: dict[str, torch.Tensor] = {}
        out: dict[str, dict] = {}

        def check(v: Variant) -> bool:
            if str(v) in out:
                return out[str(v)]["passed"]
            q_format = reference_q_format(v, self.cfg.gate)
            if q_format not in refs:
                refs[q_format] = inp.reference(q_format)
            try:
                result = problem.check(run_call(calls[v].runner, inp), refs[q_format], self.cfg.rule)
                out[str(v)] = {"passed": result.passed, "mismatch": round(result.mismatch, 6),
                               "reason": result.reason}
            except RUN_ERRORS as exc:
                if poisons_context(exc):
                    raise VerifyError(f"the CUDA context was lost checking {v}: {error_text(exc)}") from exc
                out[str(v)] = {"passed": False, "mismatch": 1.0, "reason": error_text(exc)}
            return out[str(v)]["passed"]

        for v in dict.fromkeys(filter(None, roles.values())):
            if v in times:
                check(v)
        for v in sorted(times, key=times.get):
            if check(v):
                break
        return out


# ------------------------------------------------------------------ the run
def resolve_config(table: ServingTable, config: str | Path | None) -> ServingConfig:
    """--config, else the config the table's provenance names (as given to the sweep:
    relative to here, else to the table's repository)."""
    if config is not None:
        return load_serving_config(config)
    named = (table.provenance.get("config") or {}).get("path")
    if not named:
        raise VerifyError(f"serving table {table.path} names no config in its provenance; pass --config")
    for where in (Path(named), Path(table.path or ".").resolve().parent.parent / named):
        if where.exists():
            return load_serving_config(where)
    raise VerifyError(f"serving table {table.path} was swept with config {named}, which is not here; "
                      "pass --config PATH")


def run_verify(table: str | Path | ServingTable, *, config: str | Path | ServingConfig | None = None,
               shapes: int = 30, ragged: int = 10, seed: int = 0, samples: int = 5,
               families: str | None = None, budget_s: float | None = None, workers: int | None = None,
               max_p95: float | None = None, max_regret: float | None = None, judge: str = "eager",
               json_path: str | Path | None = None, timer=None, probe=None, device=None, platform=None,
               log: Callable[[str], None] = print) -> dict:
    """Verify a serving table (see the module docstring); returns the report (what --json
    writes) with report["exit_code"]: 0 passed or not judged, 1 failed, 3 stopped by the
    budget. Its lines are fitted to the width (tables.render.fitting)."""
    started = time.monotonic()
    log = fitting(log)
    check_json_path(json_path)
    if shapes < 0 or ragged < 0 or shapes + ragged == 0:
        raise VerifyError(f"--shapes and --ragged must be >= 0 and not both 0, got {shapes} and {ragged}")
    if samples < 1:
        raise VerifyError(f"--samples must be >= 1, got {samples}")
    if judge not in ("eager", "graph", "both"):
        raise VerifyError(f"--judge must be eager, graph or both, got {judge!r}")
    table = table if isinstance(table, ServingTable) else load_serving_table(table)
    if not table.families:
        raise VerifyError(f"serving table {table.path} has no families")
    cfg = config if isinstance(config, ServingConfig) else resolve_config(table, config)
    platform = platform or gpu.detect()
    device = torch.device(device or ("cuda" if platform.has_gpu else "cpu"))
    timer = timer or (timing.time_call if platform.has_gpu else timing.cpu_time)
    if probe is None and platform.has_gpu:
        probe = event_probe
    workers = (cfg.gate_workers if platform.has_gpu else 0) if workers is None else workers
    swept_hash = (table.provenance.get("config") or {}).get("hash")
    if swept_hash and swept_hash != cfg.hash:
        log(f"warning: {cfg.path} (hash {cfg.hash[:12]}) is not the config the table was swept with "
            f"({swept_hash[:12]}): candidates and rules may differ")
    if table.gpu != platform.name:
        log(f"warning: the table is for {table.gpu}; this is {platform.name} ({platform.device_name})")
    keys = select_families(table, families)
    held_out, redrawn = draw_shapes(table, cfg, keys, shapes, ragged, seed)
    deadline = started + budget_s if budget_s else math.inf
    log(f"verify {table.path} on {platform.device_name}: {shapes} uniform shapes and {ragged} ragged mixes "
        f"over {len(keys)} families (seed {seed}, {samples} samples x {FINAL_PASSES} passes)")
    verifier = Verifier(table, cfg, timer, probe, device, platform, samples, log)
    compiled = verifier.prepare(list(dict.fromkeys(s.key for s in held_out)), workers,
                                stop=lambda: time.monotonic() > deadline)
    records, stopped = [], False
    for shape in held_out:
        if time.monotonic() > deadline:
            stopped = True
            log(f"budget spent after {time.monotonic() - started:.0f} s: {len(records)} of {len(held_out)} shapes")
            break
        began = time.monotonic()
        record = verifier.verify_shape(shape)
        record["seconds"] = round(time.monotonic() - began, 2)
        records.append(record)
        log(_progress(len(records), len(held_out), shape, record, time.monotonic() - started))
    summary = summarize(records)
    verdict = verdict_of(summary, records, max_p95, max_regret, judge, stopped)
    report = {
        "schema": VERIFY_SCHEMA,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "table": {"path": str(table.path), "gpu": table.gpu, "date": table.provenance.get("date")},
        "config": {"path": str(cfg.path), "hash": cfg.hash, "swept_hash": swept_hash},
        "device": {"name": platform.name, "device_name": platform.device_name, "arch": platform.arch,
                   "sm_count": platform.sm_count, "driver": platform.driver, "torch_device": str(device)},
        "versions": {k: str(v) for k, v in platform.versions.items()},
        "protocol": {**timing.protocol(platform.has_gpu), "short_samples": SHORT_SAMPLES, "final_top": FINAL_TOP,
                     "final_passes": FINAL_PASSES, "samples": samples, "prune_factor": PRUNE_FACTOR,
                     "probe": probe is not None,
                     **({"step_layers": cfg.search.step_layers} if cfg.search.step_layers else {})},
        "options": {"shapes": shapes, "ragged": ragged, "seed": seed, "families": [str(k) for k in keys],
                    "budget_s": budget_s, "workers": workers, "max_p95": max_p95, "max_regret": max_regret,
                    "judge": judge},
        "redrawn_left_out": redrawn, "compile": compiled, "shapes": records, "summary": summary,
        "verdict": verdict, "stopped": stopped, "seconds": round(time.monotonic() - started, 1),
    }
    report["exit_code"] = 1 if verdict["failed"] else 3 if stopped else 0
    return emit(report, report_lines(report), json_path, log)


def check_json_path(json_path: str | Path | None) -> None:
    """Refuse, before any work, a --json path that cannot be written: a folder, or a file whose
    nearest existing folder is not a writable folder (the write makes the folders below it);
    else the report would be lost after the run."""
    if json_path is None:
        return
    path = Path(json_path).absolute()
    if path.is_dir():
        raise VerifyError(f"--json {json_path} is a folder: give a file path, e.g. {path / 'verify.json'}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise VerifyError(f"--json {json_path}: cannot write into {folder} (not a writable folder); "
                          "give a path in a writable folder")


def emit(report: dict, lines: list[str], json_path: str | Path | None, log: Callable[[str], None]) -> dict:
    """Log the report's lines and write it as JSON (atomically) where asked; returns it."""
    for line in lines:
        log(line)
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(_jsonable(report), indent=1) + "\n")
        log(f"wrote {json_path}")
    return report


def shape_text(r: dict) -> str:
    """A recorded shape as batch x kv_len: '123x1145', ragged '43x~10058' (its mean)."""
    return f"{r['batch']}x{r['kv_lens']}" if r["kind"] == "uniform" else f"{r['batch']}x~{r['mean_kv_len']:.0f}"


def _jsonable(x):
    """inf (a role that failed to run) as the string 'inf': JSON has no infinity."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def verdict_of(summary: dict, records: list[dict], max_p95, max_regret, judge: str, stopped: bool) -> dict:
    """The run's verdict (failed or not, and why) from its summary and records, against the
    limits on the judged picks; verify and rescore judge by it."""
    bad_checks = [(r["index"], v, c["reason"]) for r in records for v, c in r["checks"].items()
                  if not c["passed"] and v in r["roles"].values()]
    reasons = [f"shape {i}: {v} is outside the rule ({why})" for i, v, why in bad_checks]
    for r in records:
        if r["best"] is None:
            reasons.append(f"shape {r['index']}: no candidate ran within the rule there")
            continue
        for role, v in r["roles"].items():
            if v is None or v in r["failed"]:
                why = r["failed"].get(v, "") if v else "no variant: the table and the Decoder have none"
                reasons.append(f"shape {r['index']}: the {role} pick {v} did not run ({why})")
    judged = []
    for role in (("eager", "graph") if judge == "both" else (judge,)):
        stats = summary[role]["all"]
        for name, limit in (("p95", max_p95), ("max", max_regret)):
            if limit is None or stats["n"] == 0:
                continue
            judged.append(f"{role} {name} {pct_text(stats[name])} <= {limit:.1%}")
            if not stats[name] <= limit:
                reasons.append(f"{role} pick's {name} regret {pct_text(stats[name])} is over {limit:.1%}")
    return {"failed": bool(reasons), "reasons": reasons, "judged": judged, "partial": stopped,
            "checks": sum(len(r["checks"]) for r in records), "checks_failed": len(bad_checks)}


def _progress(done: int, total: int, shape: HeldOutShape, r: dict, elapsed: float) -> str:
    def name(v):
        return Variant.parse(v).backend if v else "none"

    return (f"[{done}/{total}] {shape.key.tag} batch {shape.batch} kv {shape.kv_text()}: eager "
            f"{name(r['roles']['eager'])} +{pct_text(r['regret']['eager'])}, graph +{pct_text(r['regret']['graph'])}, "
            f"fallback +{pct_text(r['regret']['fallback'])}; best {name(r['best'])} "
            f"{r['best_us'] if r['best_us'] is not None else '-'} us ({r['candidates']} candidates, "
            f"{len(r['pruned'])} pruned) {r['seconds']:.1f} s, elapsed {elapsed:.0f} s")


def summary_lines(summary: dict) -> list[str]:
    """The regret table: geomean, p95, max and n per role and kind."""
    lines = ["regret = t(role) / t(best measured) - 1      geomean     p95     max    n"]
    for role in ROLES:
        for kind in KINDS:
            s = summary[role][kind]
            label = f"{role + (' pick' if role != 'fallback' else ''):<14} {kind:<8}"
            lines.append(f"{label:<43} {pct_text(s['geomean']):>9} {pct_text(s['p95']):>7} {pct_text(s['max']):>7} {s['n']:>4}")
    return lines


def report_lines(report: dict) -> list[str]:
    """The per-shape table, the summary and the verdict, as printed."""
    def name(v, table=True):
        return ("none" if v is None else Variant.parse(v).backend) + ("" if table else "*")

    lines = ["", f"{'#':>3} {'family':<17} {'shape':<12} {'eager pick':<13} {'regret':>7} {'graph':>7}  best"]
    for r in report["shapes"]:
        key = FamilyKey(**r["family"])
        lines.append(f"{r['index']:>3} {key.tag:<17} {shape_text(r):<12} "
                     f"{name(r['roles']['eager'], r['from_table']['eager']):<13} {pct_text(r['regret']['eager']):>7} "
                     f"{pct_text(r['regret']['graph']):>7}  {name(r['best'])}")
    lines.append("(shape: batch x kv_len, ~ the mean of a ragged mix; each shape's fallback regret is in --json)")
    missed = sum(not r["from_table"]["eager"] for r in report["shapes"])
    lines += [f"(* the table has no pick there, its cell left out or missing: the fallback runs; "
              f"{missed} of {len(report['shapes'])} eager picks)", ""]
    lines += summary_lines(report["summary"])
    v = report["verdict"]
    lines.append(f"correctness: {v['checks']} outputs checked against the reference, "
                 f"{v['checks_failed']} of the picks' outside the rule")
    partial = " (partial: the budget stopped it)" if report["stopped"] else ""
    if v["failed"]:
        lines.append("FAIL" + partial + ": " + "; ".join(v["reasons"]))
    elif v["judged"]:
        lines.append("PASS" + partial + ": " + ", ".join(v["judged"]))
    else:
        lines.append("not judged (no --max-p95 / --max-regret)" + partial)
    shape_s = sum(r["seconds"] for r in report["shapes"])
    lines.append(f"elapsed {report['seconds']:.1f} s: compile {report['compile'].get('seconds', 0):.1f} s, "
                 f"{len(report['shapes'])} shapes {shape_s:.1f} s "
                 f"({shape_s / max(1, len(report['shapes'])):.2f} s each)")
    return lines
