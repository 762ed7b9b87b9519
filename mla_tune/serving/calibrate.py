"""Measure what a serving table's split-K model cannot see from uniform grid points: the cost
of each step of the reduction's longest loop (a family's calibration `reduce_step_us`).

    python -m mla_tune.serving.calibrate --table tables/H200.serving.yaml
        [--out PATH] [--families kv_format=bf16,heads=16] [--reps 20] [--rounds 3] [--dry-run]

Our split-K kernel's reduction adds up each sequence's splits, 16 a step (64 in the wide
grid of small batches; kernels/split_rule.reduce_splits_per_step), so a ragged batch's long
sequence, which takes most of the splits, is the reduction's critical path. The rates a
table interpolates come from uniform batches, whose sequences run few splits each, so
without this cost the lookup estimates a ragged batch with one long sequence short.
Rescoring docs/data/verify without the table's reduce_step_us (scripts/rescore_ablation.py),
the even seeds' runs within p95 5% / max 15% drop from 33 of 33 to 30 (the odd seeds' stay
32 of 34).

For each family with split-K models (schedule models with `reduction_steps`:
backends/triton_splitk_schedule.py) and each of the two grids that a batch bucket of two
or more sequences reaches, one probe: a batch of one TAIL_KV_LEN sequence and the rest of
SHORT_KV_LEN, and a uniform batch of the same tokens (so the same mean and interpolation),
each run by the model whose reduction takes the most steps more on the tail, checked
against the fp32 reference under the config's rule, and timed in `rounds` alternating
passes of `reps` samples under the leaderboard protocol. The cost per step is what the
model misses on the tail beyond what it misses on the uniform batch, over the steps more:

    ((t_tail - est_tail) - (t_uniform - est_uniform)) / (steps_tail - steps_uniform)

(at least 0; est without the reduction's term). It is written into the table's family as
its calibration of the model's backend, `calibration: {triton: {reduce_step_us: {splits per
step: us}}}`, with the probes in its provenance (`reduce_calibration`); the model adds it
per step a call's longest loop takes beyond a uniform batch's. The table is rewritten atomically; nothing else
in it changes. `mla-tune verify` at fresh seeds is what accepts the result.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import FlowMap
from mla_tune.kernels.split_rule import REDUCE_SPLITS_PER_STEP, reduce_splits_per_step
from mla_tune.serving.table import (
    FamilyKey,
    ServingTable,
    load_serving_table,
    write_serving_table,
)

TAIL_KV_LEN = 57344  # the tail: inside the 64k bucket, hundreds of splits on a per-sequence rule
SHORT_KV_LEN = 1024  # the rest of the batch


class CalibrateError(MlaTuneError, ValueError):
    """A calibration that cannot run: the message names the problem and the fix."""


@dataclass(frozen=True)
class ReduceProbe:
    key: FamilyKey
    per_step: int  # splits the reduction adds per step at this batch: 16 or 64
    variant: Variant
    tail: tuple[int, ...]  # one long sequence, the rest short
    uniform: tuple[int, ...]  # the same tokens, as even as integers allow
    steps: tuple[int, int]  # the reduction's longest loop: (uniform, tail)

    def __str__(self) -> str:
        return (f"{self.key}: {len(self.tail)} sequences ({self.per_step} splits a step), "
                f"reduction steps {self.steps[0]} -> {self.steps[1]}, {self.variant}")


def plan_probes(table: ServingTable, keys: list[FamilyKey] | None = None, tail_kv_len: int = TAIL_KV_LEN,
                short_kv_len: int = SHORT_KV_LEN) -> list[ReduceProbe]:
    """A probe per family with split-K models and per reduction grid: the smallest batch
    bucket of the narrow grid (16 splits a step), the largest of the wide one (64), at
    least two sequences; the model whose reduction takes the most steps more on the tail
    (the first by name of equals) among the models that estimate both batches (a model
    knows only the batches its variant was timed at). None where no model's does."""
    probes = []
    for key in keys if keys is not None else sorted(table.families):
        family = table.families[key]
        for per_step in REDUCE_SPLITS_PER_STEP:
            batches = [b for b in table.batch_buckets
                       if b >= 2 and reduce_splits_per_step(b, key.q_len, key.heads) == per_step]
            models = {v: m for v, m in family.models.items() if hasattr(m, "reduction_steps")}
            if not models or not batches:
                continue
            batch = min(batches) if per_step == 16 else max(batches)
            tail = (tail_kv_len,) + (short_kv_len,) * (batch - 1)
            each, extra = divmod(sum(tail), batch)
            uniform = (each + 1,) * extra + (each,) * (batch - extra)
            best = None
            estimates = [table.estimator.model_estimates(family, list(lens), calibrated=False)
                         for lens in (uniform, tail)]
            for v in sorted(models, key=str):
                model = models[v]
                if any(e.get(v) is None for e in estimates):
                    continue
                steps = (model.reduction_steps(key, uniform), model.reduction_steps(key, tail))
                if steps[1] > steps[0] and (best is None or steps[1] - steps[0] > best[1][1] - best[1][0]):
                    best = (v, steps)
            if best is not None:
                probes.append(ReduceProbe(key, per_step, best[0], tail, uniform, best[1]))
    return probes


def measure(probe: ReduceProbe, cfg, device, timer: Callable, reps: int, rounds: int) -> dict[str, float]:
    """{'uniform': us, 'tail': us}: the probe's variant on both batches, each checked
    against the fp32 reference under the config's rule (a wrong answer is an error), then
    timed in `rounds` alternating passes of `reps` samples; the median of the passes. With
    the config's search.step_layers N (the protocol the table's points were timed under),
    each timed as a layer of a LayeredStep of N layers."""
    from mla_tune import problem
    from mla_tune.backends import get_backend
    from mla_tune.serving.gate import reference_q_format, run_call
    from mla_tune.serving.inputs import make_input
    from mla_tune.serving.measure import TimedCall, as_step, layer_copies, layer_timer

    key = probe.key
    spec = cfg.spec(key)
    layers = cfg.search.step_layers
    runner = get_backend(probe.variant.backend).build_serving(probe.variant, spec, device)
    calls = {}
    for name, lens in (("uniform", probe.uniform), ("tail", probe.tail)):
        inp = make_input([min(key.q_len, n) for n in lens], list(lens), key.heads, key.page_size,
                         key.kv_format, seed=len(lens) + lens[0], device=device)
        ref = inp.reference(reference_q_format(probe.variant, cfg.gate))
        result = problem.check(run_call(runner, inp), ref, cfg.rule)
        if not result.passed:
            raise CalibrateError(f"{probe.variant} fails the {cfg.rule.name} check on the {name} batch of "
                                 f"{key}: {result.reason}; the table's pick is wrong here, re-run the sweep")
        calls[name] = as_step(TimedCall(probe.variant, key, len(lens), round(sum(lens) / len(lens)), runner, inp),
                              layer_copies(inp, layers) if layers else None, str(device))
    timer = layer_timer(timer)
    passes: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (("uniform", "tail") if r % 2 == 0 else ("tail", "uniform")):
            passes[name].append(timer(calls[name], reps).median_us)
    return {name: statistics.median(ts) for name, ts in passes.items()}


def step_cost(table: ServingTable, cfg, probe: ReduceProbe, times: dict[str, float]) -> dict:
    """The probe's cost per reduction step (see the module) and what it was computed from."""
    spec = cfg.spec(probe.key)
    est = {name: table.model_estimates(spec, list(lens), calibrated=False).get(probe.variant)
           for name, lens in (("uniform", probe.uniform), ("tail", probe.tail))}
    if None in est.values():
        raise CalibrateError(f"the table's model of {probe.variant} ({probe.key}) estimates no time at "
                             f"{len(probe.tail)} sequences; re-build the table (serving_sweep merge)")
    missed = (times["tail"] - est["tail"]) - (times["uniform"] - est["uniform"])
    return FlowMap(family=str(probe.key), per_step=probe.per_step, batch=len(probe.tail),
                   variant=str(probe.variant), steps=list(probe.steps),
                   us=FlowMap((k, round(v, 2)) for k, v in times.items()),
                   estimate_us=FlowMap((k, round(v, 2)) for k, v in est.items()),
                   step_us=round(max(missed / (probe.steps[1] - probe.steps[0]), 0.0), 3))


def calibrate(table_path: str | Path, *, config: str | Path | None = None, out: str | Path | None = None,
              families: str | None = None, reps: int = 20, rounds: int = 3, dry_run: bool = False,
              timer=None, device=None, platform=None, measure_fn: Callable = measure,
              tail_kv_len: int = TAIL_KV_LEN, short_kv_len: int = SHORT_KV_LEN,
              log: Callable[[str], None] = print) -> dict:
    """Run the probes (see the module) and write the table with each family's
    reduce_step_us to `out` (default: the table itself). Returns {"probes": [...], "path"}."""
    from mla_tune.serving.verify import resolve_config, select_families

    if reps < 1 or rounds < 1:
        raise CalibrateError(f"--reps and --rounds must be >= 1, got {reps} and {rounds}")
    table = load_serving_table(table_path)
    cfg = resolve_config(table, config)
    probes = plan_probes(table, select_families(table, families), tail_kv_len, short_kv_len)
    log(f"calibrate {table.path}: {len(probes)} probes (a tail of {tail_kv_len} tokens among "
        f"{short_kv_len}-token sequences, beside the uniform batch of the same tokens)")
    for p in probes:
        log(f"  {p}")
    if dry_run or not probes:
        return {"probes": [], "path": None}
    import torch

    from mla_tune import gpu
    from mla_tune.tune import timing

    platform = platform or gpu.detect()
    if table.gpu != platform.name:
        raise CalibrateError(f"the table is for {table.gpu}; this is {platform.name} ({platform.device_name}): "
                             "calibrate on the table's GPU")
    device = torch.device(device or ("cuda" if platform.has_gpu else "cpu"))
    timer = timer or (timing.time_call if platform.has_gpu else timing.cpu_time)
    results = []
    for i, probe in enumerate(probes, 1):
        times = measure_fn(probe, cfg, device, timer, reps, rounds)
        results.append(step_cost(table, cfg, probe, times))
        r = results[-1]
        log(f"  [{i}/{len(probes)}] {probe.key}, {probe.per_step} a step: uniform {r['us']['uniform']:.1f} us "
            f"(est {r['estimate_us']['uniform']:.1f}), tail {r['us']['tail']:.1f} (est {r['estimate_us']['tail']:.1f}) "
            f"-> {r['step_us']:.2f} us a step")
    for probe, r in zip(probes, results, strict=True):
        family = table.families[probe.key]
        mine = family.calibration.get(probe.variant.backend, {})
        steps = {**mine.get("reduce_step_us", {}), probe.per_step: r["step_us"]}
        family.calibration = {**family.calibration, probe.variant.backend: {**mine, "reduce_step_us": steps}}
    table.provenance["reduce_calibration"] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": platform.device_name, "tail_kv_len": tail_kv_len, "short_kv_len": short_kv_len,
        "reps": reps, "rounds": rounds, "probes": results}
    path = write_serving_table(out or table.path, table)
    log(f"wrote {path}")
    return {"probes": results, "path": str(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_tune.serving.calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--table", type=Path, required=True, help="The serving table, e.g. tables/H200.serving.yaml.")
    p.add_argument("--config", type=Path, help="The serving config (default: the one the table names).")
    p.add_argument("--out", type=Path, help="Write the calibrated table here (default: over --table).")
    p.add_argument("--families", help="Only the families matching these field=value terms, e.g. heads=16.")
    p.add_argument("--reps", type=int, default=20, help="Samples per timing pass.")
    p.add_argument("--rounds", type=int, default=3, help="Alternating timing passes per batch.")
    p.add_argument("--dry-run", action="store_true", help="Print the probes only (no GPU).")
    args = p.parse_args(argv)
    try:
        calibrate(args.table, config=args.config, out=args.out, families=args.families, reps=args.reps,
                  rounds=args.rounds, dry_run=args.dry_run)
    except MlaTuneError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
