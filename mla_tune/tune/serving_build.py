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
from collections.abc import Callable
from pathlib import Path

from mla_tune import gpu
from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.tables.serving_table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    load_serving_table,
    write_serving_table,
)
from mla_tune.tune.serving_config import ServingConfig, load_serving_config
from mla_tune.tune.serving_plan import SweepPlan, plan_sweep
from mla_tune.tune.serving_results import Records, read_records


class ServingSweepError(MlaTuneError, RuntimeError):
    """The serving sweep cannot go on; the message says what to do."""


# ------------------------------------------------------------------ the table
def build_table(cfg: ServingConfig, plan: SweepPlan, records: Records, gpu_name: str,
                provenance: dict, missing_reason: str) -> ServingTable:
    """The serving table from the records: every family of the config, its cells and graph
    picks as recorded, every other cell left out with its reason."""
    families: dict[FamilyKey, Family] = {}
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
                    fam.cells[(batch, kv_len)] = Cell(batch, kv_len, Variant.parse(rec["winner"]),
                                                      float(rec["time_us"]), rec.get("runner_up"))
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
        families[key] = fam
    return ServingTable(gpu_name, provenance, list(cfg.batch_buckets), list(cfg.kv_buckets), families)


def _provenance(cfg: ServingConfig, headers: list[dict], plan: SweepPlan, extra: dict) -> dict:
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
                   "cross_top": cfg.search.cross_top, "seeding": "neighbouring cells' winners"},
        "candidates": {str(k): f.per_backend() for k, f in plan.families.items()},
        "skipped_backends": {str(k): dict(f.skipped) for k, f in plan.families.items() if f.skipped},
        "results": [{"file": h.get("file"), "shard": h.get("shard")} for h in headers],
        **extra,
    }


def write_table(cfg: ServingConfig, plan: SweepPlan, records: Records, headers: list[dict], out: Path,
                gpu_name: str, missing_reason: str, extra: dict) -> ServingTable:
    table = build_table(cfg, plan, records, gpu_name, _provenance(cfg, headers, plan, extra), missing_reason)
    write_serving_table(out, table)
    return load_serving_table(out)  # what was written loads: the same checks as the runtime's



def merge(config: str | Path | ServingConfig, gpu_name: str, results: list[Path], *,
          out: str | Path | None = None, platform=None, log: Callable[[str], None] = print) -> Path:
    """One table from several results files (the shards of one config and GPU)."""
    cfg = config if isinstance(config, ServingConfig) else load_serving_config(config)
    out = Path(out) if out is not None else Path("tables") / f"{gpu_name}.serving.yaml"
    headers, records = [], Records()
    for path in results:
        header, recs, warnings = read_records(Path(path))
        for warning in warnings:
            log(f"warning: {warning}")
        if header is None:
            raise ServingSweepError(f"{path}: no such results file (or it is empty)")
        if header.get("config_hash") != cfg.hash or header.get("gpu") != gpu_name:
            raise ServingSweepError(f"{path} was swept with config hash {header.get('config_hash', '?')[:12]} on "
                                    f"{header.get('gpu')}, not {cfg.hash[:12]} on {gpu_name}: merge only the "
                                    "shards of one config and GPU")
        headers.append(header)
        for r in recs:
            records.add(r)
    platform = platform or gpu.fake_platform(gpu_name)
    plan = plan_sweep(cfg, platform, check_available=False)
    shards = sorted({tuple(h.get("shard", (1, 1))) for h in headers})
    write_table(cfg, plan, records, headers, out, gpu_name,
                f"not measured: no results file merged holds it (shards {', '.join(f'{i}/{n}' for i, n in shards)})",
                {"merged": len(headers)})
    log(f"wrote {out} from {len(headers)} results file(s)")
    return out
