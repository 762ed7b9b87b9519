"""The serving table from serving-sweep records: one shard's, or several merged.

`build_table` turns the records (serving_results.Records) into a ServingTable: every family
of the config, each cell's winner (its runner-up beside it), each batch bucket's CUDA-graph
pick, and every other cell left out with its reason (a config rule, no candidate, the gate,
the budget, a shard not merged). `merge` reads several results files of one config and GPU
(the shards of a sweep) and writes one table. Provenance: date, config path and hash, the
GPU, versions, rule, timing protocol, call flags, gate probes, search, candidates per
family, the backends skipped and why, the results files.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable
from pathlib import Path

from mla_tune import gpu
from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.serving.cells import SweepPlan, edge_batch, plan_sweep
from mla_tune.serving.config import ServingConfig, load_serving_config
from mla_tune.serving.estimate import fit_models
from mla_tune.serving.results import Records, read_records
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    load_serving_table,
    write_serving_table,
)


class ServingSweepError(MlaTuneError, RuntimeError):
    """The serving sweep cannot go on; the message says what to do."""


# ------------------------------------------------------------------ the eager pick
NEIGHBOUR_WEIGHT = 0.5  # an adjacent batch bucket's say in a cell's eager pick, beside the cell's 1
EDGE_WEIGHT = 1.0  # the bucket's smallest batch (search.batch_edge): inside the span, as the cell


def timed_cells(records: Records, min_samples: int) -> dict[tuple, dict[str, float]]:
    """{(family, batch, kv_len): {variant: median us}} of every candidate timed with at least
    `min_samples` samples (a cell's last rung and the graph stage's cross timings); where a
    variant was timed twice, the median of more samples."""
    best: dict[tuple, dict[str, tuple[int, float]]] = {}
    for (key, batch, kv_len, variant, samples), step in records.steps.items():
        if samples >= min_samples and step.get("status") == "ok":
            cell = best.setdefault((key, batch, kv_len), {})
            if variant not in cell or samples > cell[variant][0]:
                cell[variant] = (samples, float(step["time"]["median_us"]))
    return {k: {v: t for v, (_s, t) in cell.items()} for k, cell in best.items()}


def eager_pick(times: dict[int, dict[str, float]], batch: int, batch_buckets: list[int],
               edge: dict[str, float] | None = None) -> str | None:
    """A cell's eager pick from {batch bucket: {variant: us}} at its kv bucket: among the
    variants timed at the cell, the one whose regret (log of time over the best there) is
    smallest on average over the cell (weight 1), the adjacent batch buckets that were
    measured (NEIGHBOUR_WEIGHT each, where the variant was timed) and, given `edge` (the
    finalists' times at the bucket's smallest batch, search.batch_edge), that edge
    (EDGE_WEIGHT; then only variants timed there compete). A call of 41 sequences runs the
    bucket of 48's pick: one backend's outlier at exactly 48 (FlashInfer's split packing is
    not monotone in the batch, so 48's time can be far from 41's) must not decide alone, and
    a backend whose time stays flat down to 41 (FlashMLA) must not win the bucket on its
    top batch alone. Ties go to the faster at the cell."""
    here = times.get(batch) or {}
    if not here:
        return None
    i = batch_buckets.index(batch)
    near = [(times.get(batch_buckets[j]) or {}, NEIGHBOUR_WEIGHT) for j in (i - 1, i + 1) if 0 <= j < len(batch_buckets)]
    edge = {v: t for v, t in (edge or {}).items() if v in here}
    if edge:
        near.append((edge, EDGE_WEIGHT))
    scored = []
    for variant, t in here.items():
        if edge and variant not in edge:
            continue
        num, den = math.log(t / min(here.values())), 1.0
        for other, weight in near:
            if variant in other:
                num += weight * math.log(other[variant] / min(other.values()))
                den += weight
        scored.append((num / den, t, variant))
    return min(scored)[2]


# ------------------------------------------------------------------ the table
def build_table(cfg: ServingConfig, plan: SweepPlan, records: Records, gpu_name: str,
                provenance: dict, missing_reason: str, sm_count: int = 0, smem_per_sm: int = 0) -> ServingTable:
    """The serving table from the records: every family of the config, its cells and graph
    picks as recorded, every other cell left out with its reason."""
    families: dict[FamilyKey, Family] = {}
    timed = timed_cells(records, cfg.search.rungs[-1])
    for key, fam_plan in plan.families.items():
        fam = Family(key)
        fam.left_out = [dict(c) for c in fam_plan.left_out]
        ruled = {(c["batch"], c["kv_len"]) for c in fam_plan.left_out}
        gated = any(g.get("ok") for (k, _), g in records.gates.items() if k == key)
        for batch in cfg.batch_buckets:
            for kv_len in cfg.kv_buckets:
                if (batch, kv_len) in ruled:
                    continue
                rec = records.cells.get((key, batch, kv_len))
                if rec is not None and rec.get("status") == "ok":
                    fam.cells[(batch, kv_len)] = _cell(cfg, timed, key, batch, kv_len, rec)
                    continue
                if rec is not None:
                    reason = rec["reason"]
                elif not fam_plan.candidates:
                    reason = "no backend offers a candidate here: " + "; ".join(
                        f"{b}: {why}" for b, why in fam_plan.skipped.items())
                elif not gated and any(k == key for k, _ in records.gates):
                    reason = "no candidate passed the gate"
                else:
                    reason = missing_reason
                fam.left_out.append({"batch": batch, "kv_len": kv_len, "reason": reason})
            g = records.graphs.get((key, batch))
            if g is not None:
                fam.graph[batch] = GraphPick(batch, Variant.parse(g["variant"]), float(g["worst_regret"]),
                                             int(g["worst_kv_len"]))
        fam.points = _points(cfg, timed, key, {c.variant for c in fam.cells.values()})
        fam.models = _fit_models(fam, timed, sm_count, smem_per_sm)
        families[key] = fam
    return ServingTable(gpu_name, provenance, list(cfg.batch_buckets), list(cfg.kv_buckets), families)


def _fit_models(fam: Family, timed: dict, sm_count: int, smem_per_sm: int) -> dict:
    """The family's schedule models (estimate.fit_models) from its points and its timed
    cells at uniform lengths (`timed_cells`' entries of its key, the ragged mixes left out):
    the build's and the refit's one rule."""
    cells = {(b, k): times for (key, b, k), times in timed.items() if key == fam.key and k > 0}
    return fit_models(fam.key, fam.points, cells, {"sm_count": sm_count, "smem_per_sm": smem_per_sm})


def _cell(cfg: ServingConfig, timed: dict, key: FamilyKey, batch: int, kv_len: int, rec: dict) -> Cell:
    """The cell's eager pick (eager_pick over the last rung's and the graph stage's timings
    at this kv bucket and the adjacent batch buckets, and the edge stage's at the bucket's
    smallest batch with search.batch_edge); the search's winner where nothing was
    timed with the last rung's samples (a test's short search)."""
    times = {b: timed.get((key, b, kv_len), {}) for b in cfg.batch_buckets}
    edge = edge_batch(cfg.batch_buckets, batch) if cfg.search.batch_edge else None
    pick = eager_pick(times, batch, list(cfg.batch_buckets),
                      timed.get((key, edge, kv_len)) if edge is not None else None)
    if pick is None or pick == rec["winner"]:
        return Cell(batch, kv_len, Variant.parse(rec["winner"]), float(rec["time_us"]), rec.get("runner_up"))
    runner_up = {"variant": rec["winner"], "time_us": float(rec["time_us"])}
    return Cell(batch, kv_len, Variant.parse(pick), times[batch][pick], runner_up)


def _points(cfg: ServingConfig, timed: dict, key: FamilyKey, picks: set[Variant]) -> dict:
    """The eager picks' times at every timed batch bucket (and, with search.batch_edge, each
    bucket's smallest batch) and kv bucket: what the runtime interpolates (serving_table.
    interpolate). Only the family's cell picks: a plan builds those, and no other variant."""
    batches = set(cfg.batch_buckets)
    if cfg.search.batch_edge:
        batches |= {e for b in cfg.batch_buckets if (e := edge_batch(cfg.batch_buckets, b)) is not None}
    names = {str(v): v for v in picks}
    points = {}
    for (k, batch, kv_len), times in timed.items():
        if k != key or batch not in batches or kv_len not in cfg.kv_buckets:
            continue
        here = {names[v]: t for v, t in times.items() if v in names}
        if here:
            points[(batch, kv_len)] = here
    return points


def gate_refusals(records: Records) -> dict[str, dict[str, str]]:
    """The gate's refusals in `records`, by family (str of its key): {variant: reason}, the
    table's provenance.gate_refused (table.gate_refused reads it)."""
    out: dict[str, dict[str, str]] = {}
    for (key, variant), r in sorted(records.gates.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        if not r.get("ok"):
            out.setdefault(str(key), {})[variant] = str(r.get("reason", ""))
    return out


def _provenance(cfg: ServingConfig, headers: list[dict], plan: SweepPlan, records: Records, extra: dict) -> dict:
    first = headers[0]
    return {
        "date": _dt.date.today().isoformat(),
        "config": {"path": str(cfg.path), "hash": cfg.hash, "name": cfg.name},
        "gpu": first.get("platform", {}),
        "versions": first.get("versions", {}),
        "rule": cfg.rule.as_dict(),
        "protocol": first.get("protocol", {}),
        "call": {"mixed_q_len": cfg.call.mixed_q_len, "host_lengths": cfg.call.host_lengths,
                 "graph": cfg.call.graph},
        "gate": {"ragged_kv_lens": list(cfg.gate.ragged_kv_lens), "tail_kv_len": cfg.gate.tail_kv_len,
                 "tail_batch": cfg.gate.tail_batch, "margin": cfg.gate.margin, "seeds": list(cfg.gate.seeds),
                 "reference": f"mla_tune.serving.reference (fp32), q: {cfg.gate.reference_q}"},
        "search": {"rungs": list(cfg.search.rungs), "keep": cfg.search.keep, "min_keep": cfg.search.min_keep,
                   "cross_top": cfg.search.cross_top, "seeding": "neighbouring cells' winners",
                   "batch_edge": cfg.search.batch_edge,
                   **({"step_layers": cfg.search.step_layers} if cfg.search.step_layers else {})},
        "candidates": {str(k): f.per_backend() for k, f in plan.families.items()},
        "skipped_backends": {str(k): dict(f.skipped) for k, f in plan.families.items() if f.skipped},
        "gate_refused": gate_refusals(records),
        "results": [{"file": h.get("file"), "shard": h.get("shard")} for h in headers],
        **extra,
    }


def write_table(cfg: ServingConfig, plan: SweepPlan, records: Records, headers: list[dict], out: Path,
                gpu_name: str, missing_reason: str, extra: dict) -> ServingTable:
    platform = headers[0].get("platform") or {}
    table = build_table(cfg, plan, records, gpu_name, _provenance(cfg, headers, plan, records, extra), missing_reason,
                        int(platform.get("sm_count") or 0), int(platform.get("smem_per_sm") or 0))
    write_serving_table(out, table)
    return load_serving_table(out)  # what was written loads: the same checks as the runtime's



def _read_results(results: list[Path], config_hash: str, gpu_name: str, log: Callable[[str], None],
                  fix: str = "merge only the shards of one config and GPU") -> tuple[list[dict], Records]:
    """(headers, records) of results files swept with this config and on this GPU; `fix`
    ends the error for a file that was not."""
    headers, records = [], Records()
    for path in results:
        header, recs, warnings = read_records(Path(path))
        for warning in warnings:
            log(f"warning: {warning}")
        if header is None:
            raise ServingSweepError(f"{path}: no such results file (or it is empty)")
        if header.get("config_hash") != config_hash or header.get("gpu") != gpu_name:
            raise ServingSweepError(f"{path} was swept with config hash {header.get('config_hash', '?')[:12]} on "
                                    f"{header.get('gpu')}, not {config_hash[:12]} on {gpu_name}: {fix}")
        headers.append(header)
        for r in recs:
            records.add(r)
    return headers, records


def merge(config: str | Path | ServingConfig, gpu_name: str, results: list[Path], *,
          out: str | Path | None = None, platform=None, log: Callable[[str], None] = print) -> Path:
    """One table from several results files (the shards of one config and GPU)."""
    cfg = config if isinstance(config, ServingConfig) else load_serving_config(config)
    out = Path(out) if out is not None else Path("tables") / f"{gpu_name}.serving.yaml"
    headers, records = _read_results(results, cfg.hash, gpu_name, log)
    shards = sorted(tuple(h.get("shard", (1, 1))) for h in headers)
    text = ", ".join(f"{i}/{n}" for i, n in shards)
    if len(set(shards)) != len(shards) or len({n for _, n in shards}) != 1:
        raise ServingSweepError(f"the results files hold shards {text}: merge the shards of one split "
                                "(one N), each once")
    missing = sorted(set(range(1, shards[0][1] + 1)) - {i for i, _ in shards})
    if missing:
        log(f"warning: shard(s) {', '.join(f'{i}/{shards[0][1]}' for i in missing)} not merged: their cells "
            "stay unmeasured in the table (sweep them with --shard I/N, then merge again)")
    platform = platform or gpu.fake_platform(gpu_name)
    plan = plan_sweep(cfg, platform, check_available=False)
    write_table(cfg, plan, records, headers, out, gpu_name,
                f"not measured: no results file merged holds it (shards {text})",
                {"merged": len(headers)})
    log(f"wrote {out} from {len(headers)} results file(s)")
    return out


def refit_models(table_path: str | Path, results: list[Path], *, out: str | Path | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """A table's schedule models fitted again from the results files it was built from, every
    other entry kept: its cells, points, graph picks and calibration (`sweep --merge RESULTS
    --refit TABLE`). For a backend's schedule model added or changed after the table was
    built and calibrated; no GPU. Its provenance gains `models_refit` (the date, the
    results files); `out` defaults to the table itself (written atomically)."""
    table = load_serving_table(table_path)
    provenance = table.provenance
    config_hash = (provenance.get("config") or {}).get("hash")
    rungs = (provenance.get("search") or {}).get("rungs")
    if not config_hash or not rungs:
        raise ServingSweepError(f"{table_path}: its provenance names no config hash or search rungs, so the "
                                "results it was built from cannot be told; re-build it with --merge")
    _, records = _read_results(results, config_hash, table.gpu, log,
                               fix=f"give the results {table_path} was built from (its provenance.results)")
    timed = timed_cells(records, int(rungs[-1]))
    platform = provenance.get("gpu") or {}
    before = sum(len(f.models) for f in table.families.values())
    for fam in table.families.values():
        fam.models = _fit_models(fam, timed, int(platform.get("sm_count") or 0),
                                 int(platform.get("smem_per_sm") or 0))
    table.provenance = {**provenance, "models_refit": {"date": _dt.date.today().isoformat(),
                                                       "results": [Path(p).name for p in results]}}
    out = Path(out) if out is not None else Path(table_path)
    write_serving_table(out, table)
    after = sum(len(f.models) for f in load_serving_table(out).families.values())
    log(f"wrote {out}: its schedule models fitted again from {len(results)} results file(s), {before} -> {after}")
    return out

