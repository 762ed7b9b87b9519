"""The serving sweep's plan: families and their candidates, cells, units, shards, and an
estimate of its GPU time (what `--dry-run` prints).

A *cell* is (family, batch bucket, kv bucket); a *unit* is one family's batch bucket: its
kv cells, searched in increasing kv order, then its cross stage (the CUDA-graph pick of
that bucket, which needs every kv cell of the bucket) and, with search.batch_edge, its edge
stage (each kv cell's finalists at the bucket's smallest batch). Units are the sweep's order and its
shards: `--shard i/n` takes units i, i+n, i+2n, ... (1-based) of the deterministic order
(families as the config lists them, batch buckets increasing), so that a shard's graph
picks need no other shard. Cells a config rule leaves out are never planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mla_tune.backends import capabilities, get_backend, platform_refusal
from mla_tune.core import CallSpec, Variant
from mla_tune.serving.call import why_not
from mla_tune.serving.config import KV_BYTES_PER_TOKEN, ServingConfig
from mla_tune.serving.table import FamilyKey


@dataclass
class FamilyPlan:
    key: FamilyKey
    spec: CallSpec
    candidates: list[Variant]  # in the order offered (backends as the config lists them)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it offers nothing
    left_out: list[dict] = field(default_factory=list)  # {batch, kv_len, reason} by config rule

    def per_backend(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self.candidates:
            counts[v.backend] = counts.get(v.backend, 0) + 1
        return counts


@dataclass(frozen=True)
class Unit:
    index: int  # in the deterministic order of all units (0-based)
    key: FamilyKey
    batch: int
    kv_lens: tuple[int, ...]  # the cells planned (those no rule leaves out), increasing


@dataclass
class SweepPlan:
    families: dict[FamilyKey, FamilyPlan]
    units: list[Unit]  # this shard's
    all_units: int
    shard: tuple[int, int]

    @property
    def cells(self) -> int:
        return sum(len(u.kv_lens) for u in self.units)


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): the second of four shards (1-based)."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be i/n with 1 <= i <= n, like 1/2, got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard must be i/n with 1 <= i <= n, like 1/2, got {text!r}")
    return i, n


def backend_offer(name: str, spec: CallSpec, grids: list[dict], platform) -> list[Variant]:
    """Backend `name`'s serving candidates for `spec`: its serving_candidates over each grid
    of its space (in order, without repeats), then its default serving variant (what runs
    without a table) if the space lacks it: the fallback always competes, so a table never
    picks worse than it where it was measured (verify found the split-K default 1.5x faster
    than every searched variant at fp8 KV, 128 heads, q_len 4). A backend without
    serving_candidates offers its default alone (the vendors' until they define their own)."""
    module = get_backend(name)
    offer = getattr(module, "serving_candidates", None)
    out: list[Variant] = []
    if offer is not None:
        for grid in grids:
            out += offer(spec, dict(grid), platform)
    return list(dict.fromkeys([*out, module.default_serving_variant(spec, platform)]))


def family_plan(cfg: ServingConfig, key: FamilyKey, platform, check_available: bool = True) -> FamilyPlan:
    """A family's candidates on `platform`. A backend is skipped, with its reason, when its
    capability record refuses the spec or the platform, or (check_available) when it cannot
    run here (a missing library, no GPU); a dry run plans for a GPU it does not have and so
    asks only the records."""
    spec = cfg.spec(key)
    plan = FamilyPlan(key, spec, [])
    for name, grids in cfg.backends.items():
        if check_available:
            reason = why_not(name, spec, platform)
        else:
            reason = capabilities(name).refusal(spec) or platform_refusal(name, platform)
        if reason is not None:
            plan.skipped[name] = reason
            continue
        offered = backend_offer(name, spec, grids, platform)
        if not offered:
            plan.skipped[name] = "its serving space offers nothing for this family"
        plan.candidates += [v for v in offered if v not in plan.candidates]
    for batch in cfg.batch_buckets:
        for kv_len in cfg.kv_buckets:
            reason = cfg.left_out_reason(key, batch, kv_len)
            if reason is not None:
                plan.left_out.append({"batch": batch, "kv_len": kv_len, "reason": reason})
    return plan


def plan_sweep(cfg: ServingConfig, platform, shard: tuple[int, int] = (1, 1),
               check_available: bool = True) -> SweepPlan:
    families = {key: family_plan(cfg, key, platform, check_available) for key in cfg.families}
    units: list[Unit] = []
    for key, fam in families.items():
        out = {(c["batch"], c["kv_len"]) for c in fam.left_out}
        for batch in cfg.batch_buckets:
            kv_lens = tuple(kv for kv in cfg.kv_buckets if (batch, kv) not in out)
            if kv_lens:
                units.append(Unit(len(units), key, batch, kv_lens))
    i, n = shard
    return SweepPlan(families, [u for u in units if u.index % n == i - 1], len(units), shard)


# ------------------------------------------------------------------ the cost model
# Rough H200 figures for the dry run's estimate, calibrated on the two GPU runs (docs/perf.md,
# "The serving sweep's first GPU run" and "The serving table: the full sweep"). The first (one
# 128-head family, no pruning) showed what the old model missed: the other candidates of a
# first rung ran a median 8x the cell's best at long contexts (own 16-row tiles at 128 heads),
# where the model priced every candidate at the best's speed (4x optimistic). Now a
# first-rung candidate over PRUNE_FACTOR x the best costs only its build and a 2-call probe;
# the full sweep (714 cells, 25 candidates at most) timed 15,499 measurements and pruned
# 5,929: about half of a first rung is timed, at ~2x the best on average, and a measurement
# costs ~20 ms besides its kernel's calls (the runner's build, FlashInfer's plan, 3 warm-up
# and 3 synchronized wall-time calls, the 512 MB flush buffer, the host). A timing sample
# adds the L2 flush (~0.17 ms) and the queued sleep that hides the host (>= 0.2 ms) to the
# kernel; the best kernel reads its KV at ~3 TB/s after ~10 us. A Triton compile of one
# kernel set ~4 s on one core (split across the gate workers), loading it from the disk
# cache in the timing process ~0.3 s; a cell's input ~1 GB/50 ms. (Each shard runs the
# whole gate: --devices N adds (N - 1) x the gate's time to the GPU-minutes.)
SAMPLE_OVERHEAD_US = 400.0
MEASURE_OVERHEAD_S = 0.02
PROBE_OVERHEAD_S = 0.002
KERNEL_FIXED_US = 10.0
KV_BYTES_PER_US = 3.0e6
FIRST_RUNG_TIMED = 0.5  # the share of a first rung's candidates within PRUNE_FACTOR of the best
FIRST_RUNG_TIMED_RATIO = 2.0  # their mean time over the best's
PRUNED_RATIO = 8.0  # a pruned candidate's time over the best's (median of the first run)
LATER_RUNG_RATIO = 1.3  # later rungs hold the near-best
COMPILE_S = 4.0
CACHE_LOAD_S = 0.3
GATE_CALL_S = 0.05
INPUT_BYTES_PER_S = 20e9
_SEEDS_PER_CELL = 2  # neighbours' winners carried to the last rung besides the kept share


def kernel_us(key: FamilyKey, batch: int, kv_len: int) -> float:
    """The cell's best kernel time as the model sees it (KV bytes at the read rate)."""
    return KERNEL_FIXED_US + batch * kv_len * KV_BYTES_PER_TOKEN[key.kv_format] / KV_BYTES_PER_US


# Variant parameters the own kernels take as runtime arguments (do_not_specialize).
RUNTIME_PARAMS = ("tokens_per_split", "split_budget")


def compile_key(variant: Variant) -> tuple:
    """What a Triton compile depends on: the variant without its RUNTIME_PARAMS."""
    return (variant.backend, tuple((k, v) for k, v in variant.params if k not in RUNTIME_PARAMS))


def first_rung_timed(cfg: ServingConfig, candidates: int) -> int:
    """How many of a first rung's candidates the model expects timed (the rest pruned)."""
    return min(candidates, max(cfg.search.min_keep, math.ceil(FIRST_RUNG_TIMED * candidates)))


def rung_sizes(cfg: ServingConfig, candidates: int) -> list[int]:
    """Candidates per rung: all at the first (the timed share of them and the pruned
    rest), then the kept share of those timed."""
    sizes = [candidates]
    for i, _ in enumerate(cfg.search.rungs[1:]):
        n = first_rung_timed(cfg, candidates) if i == 0 else sizes[-1]
        sizes.append(min(n, max(cfg.search.min_keep, math.ceil(cfg.search.keep * n)) + _SEEDS_PER_CELL))
    return sizes


def measurement_s(key: FamilyKey, batch: int, kv_len: int, samples: int, ratio: float = 1.0,
                  layers: int = 0) -> float:
    """One measurement of `samples` samples of a candidate `ratio` x the cell's best; with
    `layers` (search.step_layers), each sample and warm-up call a step of that many kernels
    (the graph's capture counted as two warm-up calls more)."""
    k = ratio * kernel_us(key, batch, kv_len) * max(layers, 1)
    warm = 6 + (2 if layers else 0)
    return MEASURE_OVERHEAD_S + (samples * (SAMPLE_OVERHEAD_US + k) + warm * k) / 1e6


def cell_s(cfg: ServingConfig, key: FamilyKey, batch: int, kv_len: int, candidates: int) -> float:
    """A cell's search: a first rung (a share timed, the rest probed and pruned), then the
    later rungs over the kept share."""
    sizes, rungs = rung_sizes(cfg, candidates), cfg.search.rungs
    timed = first_rung_timed(cfg, candidates)
    k = kernel_us(key, batch, kv_len)
    layers = cfg.search.step_layers
    seconds = timed * measurement_s(key, batch, kv_len, rungs[0], FIRST_RUNG_TIMED_RATIO, layers)
    seconds += (candidates - timed) * (PROBE_OVERHEAD_S + 2 * PRUNED_RATIO * k * max(layers, 1) / 1e6)
    seconds += sum(n * measurement_s(key, batch, kv_len, s, LATER_RUNG_RATIO, layers)
                   for n, s in zip(sizes[1:], rungs[1:], strict=True))
    return seconds


def estimate(cfg: ServingConfig, plan: SweepPlan, gate_workers: int | None = None) -> dict:
    """Seconds of GPU-machine time by stage for this plan (the cost model above)."""
    workers = max(1, cfg.gate_workers if gate_workers is None else gate_workers)
    mine = {u.key for u in plan.units}
    gate = compile_s = load_s = cells_s = cross_s = edge_s = inputs_s = 0.0
    for key in mine:
        fam = plan.families[key]
        compiles = len({compile_key(v) for v in fam.candidates})
        compile_s += compiles * COMPILE_S / workers
        gate += len(fam.candidates) * GATE_CALL_S / workers
        load_s += compiles * CACHE_LOAD_S
    last, layers = cfg.search.rungs[-1], cfg.search.step_layers
    for unit in plan.units:
        fam = plan.families[unit.key]
        last_size = rung_sizes(cfg, len(fam.candidates))[-1]
        union = min(len(fam.candidates), 2 * cfg.search.cross_top)
        # the union and the last rung, which the union mostly holds (the H200's sweep of
        # 2026-12-03: 25 variants of a last rung missing from the union over 1212 edge cells)
        at_edge = max(union, last_size)
        edge = edge_batch(cfg.batch_buckets, unit.batch) if cfg.search.batch_edge else None
        if unit.kv_lens:  # the ragged mix: the whole union, at about the mean kv bucket
            mean_kv = sum(unit.kv_lens) // len(unit.kv_lens)
            cross_s += union * measurement_s(unit.key, unit.batch, mean_kv, last, LATER_RUNG_RATIO, layers)
            inputs_s += 0.01 + unit.batch * mean_kv * KV_BYTES_PER_TOKEN[unit.key.kv_format] / INPUT_BYTES_PER_S
        for kv_len in unit.kv_lens:
            cells_s += cell_s(cfg, unit.key, unit.batch, kv_len, len(fam.candidates))
            # the union's members not already in this cell's last rung
            cross_s += max(0, union - last_size + 1) * measurement_s(unit.key, unit.batch, kv_len, last,
                                                                     LATER_RUNG_RATIO, layers)
            inputs_s += 2 * (0.01 + unit.batch * kv_len * KV_BYTES_PER_TOKEN[unit.key.kv_format]
                             / INPUT_BYTES_PER_S)
            if edge is not None:  # the union and the last rung at the bucket's smallest batch
                edge_s += at_edge * measurement_s(unit.key, edge, kv_len, last, LATER_RUNG_RATIO, layers)
                inputs_s += 0.01 + edge * kv_len * KV_BYTES_PER_TOKEN[unit.key.kv_format] / INPUT_BYTES_PER_S
    parts = {"gate_and_compile": gate + compile_s, "cache_loads": load_s, "cells": cells_s,
             "cross": cross_s, "edge": edge_s, "inputs": inputs_s}
    parts["total"] = sum(parts.values())
    return {k: round(v, 1) for k, v in parts.items()}


def edge_batch(batch_buckets, batch: int) -> int | None:
    """The smallest batch that looks up bucket `batch` (the bucket below plus one), or None
    where that is the bucket itself (the first bucket, or one right after its neighbour).
    An eager call of any batch from there to `batch` runs the cell's pick, and backends scale
    differently inside the span: on the H200 FlashMLA ran 83 x 1003 (fp8, 16 heads) in about
    its time at 96 while split-K ran 21% faster than it there (2026-12-01)."""
    buckets = sorted(batch_buckets)
    i = buckets.index(batch)
    if i == 0 or buckets[i - 1] + 1 >= batch:
        return None
    return buckets[i - 1] + 1


def left_out_summary(fam: FamilyPlan) -> list[str]:
    """The family's left-out cells, one entry per run of batch buckets that leave out the same
    kv buckets: 'batch 48, 56, 64, 80: kv 32768, 65536'."""
    by_batch: dict[int, list[int]] = {}
    for c in fam.left_out:
        by_batch.setdefault(c["batch"], []).append(c["kv_len"])
    runs: list[tuple[list[int], list[int]]] = []
    for b, kvs in sorted(by_batch.items()):
        if runs and runs[-1][1] == kvs:
            runs[-1][0].append(b)
        else:
            runs.append(([b], kvs))
    return [f"batch {', '.join(map(str, bs))}: kv {', '.join(map(str, kvs))}" for bs, kvs in runs]
