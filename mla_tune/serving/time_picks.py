"""`mla-tune time mix`, `time scan` and `time points`: serving candidates checked and timed
at chosen lengths, for a look at one batch or one bucket, or at a table's own points;
`mla-tune verify` judges a table.

mix: a serving table's picks at one batch of given lengths, beside the vendors. Prints
the table's cell for the batch and mean length as swept (at a grid point with equal
lengths, the same shape timed at sweep time), then runs the table's eager pick (the lookup
for the batch and its lengths) and graph pick, each vendor's default serving variant that
can run here, and any extra variants, on one input: each checked against the fp32
reference under the config's rule and timed; prints us, the ratio to the fastest that
passes, and the check.

scan: every candidate the serving config offers a family (the gate is not run: each call is
checked against the fp32 reference under the config's rule instead), plus, with
budget_waves, each split-K candidate again under a batch split budget of W waves of the SMs
(flash_decode_serving's split_budget), on uniform batches at `points` lengths spread
log-evenly over a kv bucket (K x 2^u, u from -1/2 to 1/2: the lengths an eager call looks
the bucket up for), or at given lengths, for each batch size; or on one ragged mix. Prints,
per candidate, the regret to the fastest at each shape and the worst, so a split rule that
steps inside a bucket shows up as a large worst regret.

points: a sample of a serving table's points (a family's batch and kv bucket, where the
table holds two or more variants' swept times), each on one uniform input: every variant
checked against the fp32 reference, then timed as a sweep step times it (built just before,
its samples in one block), then the same runners in alternating passes, twice (verify's
final round: verify.alternating_passes' order). Prints each variant's four times and, over all
the points, how far each pair of the four disagrees on how the variants compare
(rescore.relative_differences: median and p90), and each backend's median ratio of its
passes' time to the table's: whether the table's points hold on this machine, how much of
a disagreement is the protocol's, and whether one backend's times moved as a whole. With
`write`, every point of the chosen families is timed in one round of passes only, and the
table is written with those times as its points' (the lookup's interpolation and its
schedule models' rates read them), the cells and the models' fitted shapes as they were.

Timing: timing.time_call on a GPU (the leaderboard protocol: L2 flushed, CUDA events,
median of `reps`); on the CPU (Triton's interpreter, for tests) wall clock, meaningless.
mix with `layers` N also times each role as an engine's decode step runs it (`LayeredStep`:
N back-to-back layers, each over its own copy of q and the KV cache, the step's shared work
once, captured in a CUDA graph and replayed, the same timer, its L2 flush before each step):
us per layer, the last layer's output checked. scan and points with `layers` N time every
candidate that way instead of the flushed call (points' --write then writes those times).
"""

from __future__ import annotations

import datetime
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.serving.table import FamilyKey


def parse_ints(text: str, what: str) -> list[int]:
    """'25,28,32' -> [25, 28, 32]; positive integers only, else refused naming `what`."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise MlaTuneError(f"{what}: {text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise MlaTuneError(f"{what}: every value must be >= 1, got {text!r}")
    return out


def parse_lens(text: str, what: str = "--lens") -> list[int]:
    """'4501,2796,56221' or '1024*128' (128 sequences of 1024 tokens), mixed freely."""
    out = []
    for item in text.split(","):
        length, _, count = item.partition("*")
        try:
            out += [int(length)] * (int(count) if count else 1)
        except ValueError:
            raise MlaTuneError(f"{what}: {item!r} is not LEN or LEN*N (positive integers)") from None
    if not out or min(out) < 1:
        raise MlaTuneError(f"{what}: every length must be >= 1, got {text!r}")
    return out


def bucket_lengths(bucket: int, points: int) -> list[int]:
    """`points` lengths log-evenly over the lengths that look up `bucket` (x 2^-1/2 to 2^1/2),
    rounded up: the first sits on the bucket's lower edge (its geometric midpoint with the
    bucket below), inside it."""
    return sorted({max(1, math.ceil(bucket * 2.0 ** (-0.5 + i / points))) for i in range(points)})


def vendor_backends(platform) -> list[str]:
    """The backends `mla-tune time mix` times beside a table's picks: those with a serving
    call that wrap a vendor library (CAPABILITIES.serving and vendor) and are written for
    `platform` (backends.platform_refusal: on the plain CPU, every one), in the registry's
    order. On an H200: flashinfer, flashmla; on an MI355X: aiter."""
    from mla_tune.backends import declared_capabilities, platform_refusal

    return [name for name, caps in declared_capabilities().items()
            if caps.serving and caps.vendor and platform_refusal(name, platform) is None]


def with_budget(variant: Variant, waves: float, tokens: int, sm_count: int, heads: int) -> Variant | None:
    """The split-K serving variant under a batch budget of `waves` waves of the SMs over its
    head tiles, with a split per at least `tokens` tokens: for a backend whose module has
    the optional `batch_split_budget(waves, sm_count, head_tiles)` hook (triton's), and a
    variant that splits (max_splits > 1); else None."""
    from mla_tune.backends import get_backend

    p = variant.p
    budget_of = getattr(get_backend(variant.backend), "batch_split_budget", None)
    if budget_of is None or p.get("max_splits", 1) <= 1:
        return None
    budget = budget_of(waves, sm_count, heads // p["block_h"])
    return Variant.make(variant.backend, **{**p, "split_budget": budget, "tokens_per_split": tokens})


def _shown(lens: list[int]) -> str:
    """The lengths, or their first 8 and the count."""
    return str(lens) if len(lens) <= 8 else f"{lens[:8]}... ({len(lens)})"


def layered_us(call, layers: int, reps: int, device: str, ref, rule, timer: Callable) -> float:
    """us per layer of a LayeredStep of `layers` layers of `call` (a measure.TimedCall):
    timer(step, reps)'s median per layer (measure.layer_timer); the last layer's output
    (its input is the call's own) checked against `ref` under `rule`."""
    from mla_tune import problem
    from mla_tune.serving.measure import LayeredStep, layer_copies, layer_timer

    step = LayeredStep(call, layer_copies(call.inp, layers), device)
    us = layer_timer(timer)(step, reps).median_us
    if not problem.check(step.out[:ref.shape[0]], ref, rule).passed:
        raise MlaTuneError(f"the last of {layers} layers answered outside the rule")
    return us


def time_mix(table_path: str | Path, key: FamilyKey, kv_lens: list[int], *, config: str | Path | None = None,
             variants: list[Variant] = (), reps: int = 30, seed: int = 1, device: str = "cuda",
             layers: int = 0, log: Callable[[str], None] = print) -> list[dict]:
    """`mla-tune time mix` (see the module): returns a row per role (eager, graph, each
    vendor, extra1...): role, variant, us (None when it did not run), ratio to the fastest
    that passed, passed, error; with layers > 0 also layer_us (layered_us: None where it
    did not run, layer_error then says why) and layer_ratio."""
    import torch

    from mla_tune import gpu, problem
    from mla_tune.backends import get_backend
    from mla_tune.serving.call import why_not
    from mla_tune.serving.gate import reference_q_format, run_call
    from mla_tune.serving.inputs import make_input
    from mla_tune.serving.measure import TimedCall
    from mla_tune.serving.table import batch_bucket, kv_bucket, load_serving_table
    from mla_tune.serving.verify import resolve_config
    from mla_tune.tune.time_variants import first_line, timer_for

    table = load_serving_table(table_path)
    cfg = resolve_config(table, config)
    spec = cfg.spec(key)
    q_lens = [min(key.q_len, n) for n in kv_lens]
    mean = sum(kv_lens) / len(kv_lens)
    roles: dict[str, Variant] = {}
    for role, v in (("eager", table.lookup(spec, len(kv_lens), mean, kv_lens=kv_lens)),
                    ("graph", table.lookup(spec, len(kv_lens), graph=True))):
        if v is not None:
            roles[role] = v
    platform = gpu.detect()
    skipped = {}
    for name in vendor_backends(platform):
        skipped[name] = why_not(name, spec, platform)
        if skipped[name] is None:
            roles[name] = get_backend(name).default_serving_variant(spec, platform)
    for i, v in enumerate(variants):
        roles[f"extra{i + 1}"] = v

    timer = timer_for(device)
    inp = make_input(q_lens, kv_lens, key.heads, key.page_size, key.kv_format, seed=seed, device=device)
    refs: dict[str, torch.Tensor] = {}
    rows = []
    for role, v in roles.items():
        row = dict(role=role, variant=str(v), us=None, ratio=None, passed=False, error=None)
        try:
            runner = get_backend(v.backend).build_serving(v, spec, device)
            q_format = reference_q_format(v, cfg.gate)
            if q_format not in refs:
                refs[q_format] = inp.reference(q_format)
            row["passed"] = problem.check(run_call(runner, inp), refs[q_format], cfg.rule).passed
            row["us"] = timer(lambda r=runner: run_call(r, inp), reps=reps).median_us
            if layers:
                row.update(layer_us=None, layer_ratio=None, layer_error=None)
                try:
                    row["layer_us"] = layered_us(TimedCall(v, key, len(kv_lens), round(mean), runner, inp),
                                                 layers, reps, device, refs[q_format], cfg.rule, timer)
                except Exception as exc:  # noqa: BLE001 - the layered time is a column, its failure a note
                    row["layer_error"] = first_line(exc)
            del runner
        except Exception as exc:  # noqa: BLE001 - one role that cannot run is a row, not the end
            row["error"] = first_line(exc)
        rows.append(row)
        if device != "cpu":
            torch.cuda.empty_cache()
    best = min((r["us"] for r in rows if r["passed"]), default=math.nan)
    log(f"{key}: {len(kv_lens)} sequences, kv_lens {_shown(kv_lens)} (mean {mean:.0f}), q_lens {_shown(q_lens)}")
    family = table.family(spec)
    where = (batch_bucket(table.batch_buckets, len(kv_lens)), kv_bucket(table.kv_buckets, mean))
    cell = family.cells.get(where) if family is not None else None
    if cell is not None:  # at a grid point with equal lengths: the same shape, timed by the sweep
        log(f"the table's cell {cell.batch} x {cell.kv_len}: {cell.variant}, {cell.time_us:.1f} us as swept")
    for name, reason in skipped.items():
        if reason is not None:
            log(f"{name}: not timed, it cannot serve this here: {reason}")
    best_layer = min((r["layer_us"] for r in rows if r["passed"] and r.get("layer_us")), default=math.nan)
    if layers:
        log(f"layer us: each role as {layers} back-to-back layers of one step (their own KV copies"
            f"{', a CUDA graph' if device != 'cpu' else ''}; the L2 flushed before the step only), per layer")
    log(f"{'role':>8} {'us':>9} {'x best':>7} {'check':>6}" + (f" {'layer us':>9} {'x best':>7}" if layers else "")
        + "  variant")
    for r in rows:
        if r["us"] is None:
            log(f"{r['role']:>8} {'error':>9} {'':>7} {'':>6}" + (" " * 18 if layers else "")
                + f"  {r['variant']}: {r['error']}")
            continue
        r["ratio"] = r["us"] / best
        layered = ""
        if layers and r.get("layer_us") is not None:
            r["layer_ratio"] = r["layer_us"] / best_layer
            layered = f" {r['layer_us']:9.1f} {r['layer_ratio']:7.3f}"
        elif layers:
            layered = f" {'error':>9} {'':>7}"
        note = f" (layers: {r['layer_error']})" if r.get("layer_error") else ""
        log(f"{r['role']:>8} {r['us']:9.1f} {r['ratio']:7.3f} {'ok' if r['passed'] else 'FAIL':>6}{layered}"
            f"  {r['variant']}{note}")
    return rows


def check_scan_args(batches: list[int] | None, bucket: int | None, lengths: list[int] | None,
                    mix: list[int] | None, points: int = 8) -> None:
    """`batches` with `bucket` or `lengths` (not both), or `mix` alone; else refused by name."""
    if mix is None and ((bucket is None) == (lengths is None) or batches is None):
        raise MlaTuneError("give --batch with --bucket (its lengths are scanned) or --lengths (not both), "
                           "or --mix alone")
    if mix is not None and (bucket is not None or lengths is not None or batches is not None):
        raise MlaTuneError("--mix is one ragged batch: give it without --batch, --bucket or --lengths")
    if points < 1:
        raise MlaTuneError(f"--points must be at least 1, got {points}")


def scan_lengths(config: str | Path, key: FamilyKey, *, batches: list[int] | None = None,
                 bucket: int | None = None, lengths: list[int] | None = None, mix: list[int] | None = None,
                 points: int = 8, budget_waves: list[float] = (), budget_tokens: list[int] = (128,),
                 backends: list[str] | None = None, reps: int = 20, device: str = "cuda",
                 layers: int | None = None, json_path: str | Path | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """`mla-tune time scan` (see the module). Give `batches` with `bucket` (its lengths are
    scanned) or `lengths`, or `mix` alone (one ragged batch). Returns (and writes to
    json_path) {family, batches, lengths, shapes, protocol, times: {variant: {shape: us}}};
    with layers > 0 each time is us per layer of a step of that many layers (layered_us),
    with 0 one flushed call's; None: the config's search.step_layers."""
    import torch

    from mla_tune import gpu, problem
    from mla_tune.backends import get_backend
    from mla_tune.serving.cells import family_plan
    from mla_tune.serving.config import load_serving_config
    from mla_tune.serving.gate import reference_q_format, run_call
    from mla_tune.serving.inputs import make_input
    from mla_tune.serving.measure import TimedCall
    from mla_tune.tune.time_variants import first_line, timer_for

    check_scan_args(batches, bucket, lengths, mix, points)
    cfg = load_serving_config(config)
    layers = cfg.search.step_layers if layers is None else layers
    platform = gpu.detect()
    plan = family_plan(cfg, key, platform)
    variants = [v for v in plan.candidates if backends is None or v.backend in backends]
    if not variants:
        raise MlaTuneError(f"the config {config} offers {key} no candidate"
                           + (f" of {','.join(backends)}" if backends else ""))
    for w in budget_waves:
        for tokens in budget_tokens:
            made = (with_budget(c, w, tokens, platform.sm_count or 4, key.heads) for c in list(variants))
            variants += [v for v in made if v is not None and v not in variants]
    if mix is not None:  # one ragged batch
        batches, lengths = [len(mix)], []
        shapes = [f"mix{len(mix)}~{sum(mix) // len(mix)}"]
        shape_lens = {shapes[0]: mix}
    else:
        lengths = lengths if lengths is not None else bucket_lengths(bucket, points)
        shapes = [f"{b}x{n}" for b in batches for n in lengths]
        shape_lens = {f"{b}x{n}": [n] * b for b in batches for n in lengths}
    times: dict[str, dict[str, float]] = {str(v): {} for v in variants}
    runners = {}
    timer = timer_for(device)
    for shape in shapes:
        lens = shape_lens[shape]
        inp = make_input([min(key.q_len, n) for n in lens], lens, key.heads, key.page_size,
                         key.kv_format, seed=sum(lens), device=device)
        refs = {}
        for v in variants:
            try:
                if v not in runners:
                    runners[v] = get_backend(v.backend).build_serving(v, plan.spec, device)
                q_format = reference_q_format(v, cfg.gate)
                if q_format not in refs:
                    refs[q_format] = inp.reference(q_format)
                ok = problem.check(run_call(runners[v], inp), refs[q_format], cfg.rule).passed
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
                log(f"  {v}: {first_line(exc)}")
                continue
            if not ok:
                log(f"  {v}: fails the check at {shape}")
            elif layers:
                try:
                    times[str(v)][shape] = layered_us(
                        TimedCall(v, key, len(lens), sum(lens) // len(lens), runners[v], inp), layers, reps, device,
                        refs[q_format], cfg.rule, timer)
                except Exception as exc:  # noqa: BLE001 - reported, as a candidate that cannot run
                    log(f"  {v}: {layers} layers at {shape}: {first_line(exc)}")
            else:
                times[str(v)][shape] = timer(lambda r=runners[v], x=inp: run_call(r, x), reps=reps).median_us
        del inp, refs
        if device != "cpu":
            torch.cuda.empty_cache()
    best = {n: min((t[n] for t in times.values() if n in t), default=math.nan) for n in shapes}
    protocol = f"a layer of a {layers}-layer step" if layers else "one flushed call"
    log(f"{key}: batches {batches}, lengths {lengths}; times: {protocol}")
    log("best us: " + " ".join(f"{best[n]:.1f}" for n in shapes))
    rows = []
    for name, t in times.items():
        if len(t) == len(shapes):
            regrets = [t[n] / best[n] - 1 for n in shapes]
            rows.append((max(regrets), name, regrets))
    for worst, name, regrets in sorted(rows)[:12]:
        log(f"worst {100 * worst:5.1f}%  " + " ".join(f"{100 * r:5.1f}" for r in regrets) + f"  {name}")
    out = {"family": str(key), "batches": batches, "lengths": lengths, "shapes": shapes, "protocol": protocol,
           "times": times}
    if json_path is not None:
        from mla_tune.fileio import atomic_write_text

        atomic_write_text(json_path, json.dumps(out, indent=1) + "\n")
    return out


def time_points(table_path: str | Path, *, families: str | None = None, points: int = 24, seed: int = 0,
                samples: int = 5, passes: int = 4, config: str | Path | None = None, budget: float | None = None,
                workers: int | None = None, write: str | Path | None = None, device: str = "cuda",
                layers: int | None = None, json_path: str | Path | None = None,
                log: Callable[[str], None] = print) -> dict:
    """`mla-tune time points` (see the module). With workers > 0 (None: the config's
    gate_workers on a GPU, 0 on the CPU) the variants go through the config's gate in that
    many processes first, which compiles them (as verify does); one the gate rejects is not
    timed. With `write`, every point of the chosen families is timed, in one round of
    alternating passes only, and the table is written there with those times as its points'
    (`_write_points`); its variants are then checked at each point only where the gate did
    not run (as the sweep: the gate admits, the cells are timed). With layers > 0 every time
    is a layer's of a LayeredStep of that many layers (the point's KV copied once for all
    its variants), and the protocol says so; None: the config's search.step_layers, the
    protocol the table's points were timed under. Returns (and writes to
    json_path) {table, device, protocol, points: [{family, batch, kv_len, variants:
    {variant: {table, passes[, fresh, again]}}, failed}], summary: {comparison: spread},
    by_backend: {backend: {n, median of passes / table}}, written}."""
    from mla_tune import gpu
    from mla_tune.serving.gate import GateJob, run_gates
    from mla_tune.serving.rescore import relative_differences, spread_of
    from mla_tune.serving.table import load_serving_table
    from mla_tune.serving.verify import resolve_config, select_families

    for name, value in (("--points", points), ("--samples", samples), ("--passes", passes)):
        if value < 1:
            raise MlaTuneError(f"{name} must be >= 1, got {value}")
    table = load_serving_table(table_path)
    cfg = resolve_config(table, config)
    layers = cfg.search.step_layers if layers is None else layers
    least = 1 if write is not None else 2  # a comparison needs two variants; a rewrite, every point
    chosen = [(key, batch, kv) for key in select_families(table, families)
              for batch, kv in sorted(table.families[key].points) if len(table.families[key].points[(batch, kv)]) >= least]
    if not chosen:
        raise MlaTuneError(f"serving table {table_path} has no point of {least} or more variants in "
                           f"{families or 'any family'}: nothing to time")
    if write is None:
        chosen = sorted(random.Random(seed).sample(chosen, min(points, len(chosen))),
                        key=lambda c: (str(c[0]), c[1], c[2]))
    began, where = time.monotonic(), gpu.detect().name or device
    workers = (cfg.gate_workers if device != "cpu" else 0) if workers is None else workers
    rejected = {}
    if workers > 0:
        jobs = {(key, v): GateJob(cfg.spec(key), str(v), cfg.gate, cfg.rule, str(device))
                for key, batch, kv in chosen for v in table.families[key].points[(batch, kv)]}
        log(f"gate: {len(jobs)} variants in {workers} processes (compiles them)")
        which = {id(job): key_variant for key_variant, job in jobs.items()}
        for job, out in run_gates(list(jobs.values()), workers):
            if not out["ok"]:
                rejected[which[id(job)]] = f"the gate rejected it: {out['reason']}"
    log(f"{len(chosen)} points of {table_path} on {where}: " + (
        f"all in {passes} alternating passes of {samples} samples (as verify's final round), to write {write}"
        if write is not None else
        f"each variant built and timed at once ({samples * passes} samples, as the sweep), then all in "
        f"{passes} alternating passes of {samples} samples, twice (as verify's final round)"))
    rows = []
    for i, (key, batch, kv) in enumerate(chosen):
        if budget is not None and time.monotonic() - began > budget:
            log(f"--budget {budget:g} s spent: {len(chosen) - i} points not timed")
            break
        rows.append(_time_point(cfg, table, key, batch, kv, seed * 1000 + i, samples, passes, rejected,
                                compare=write is None, check=write is None or workers == 0, device=device,
                                layers=layers))
        _point_lines(rows[-1], key.tag, log)
        if rows[-1].pop("lost_context", False):
            log(f"the CUDA context was lost at this point: {len(chosen) - i - 1} points not timed (nothing after "
                "it can run in this process); what was timed before is kept")
            rows.pop()
            break
    compare = {"table ~ passes": ("table", "passes"), "fresh ~ passes": ("fresh", "passes"),
               "passes ~ again": ("passes", "again"), "table ~ fresh": ("table", "fresh")}
    summary = {}
    for name, (a, b) in compare.items():
        diffs = []
        for row in rows:
            got = {v: t for v, t in row["variants"].items() if a in t and b in t}
            diffs += relative_differences({v: t[a] for v, t in got.items()}, {v: t[b] for v, t in got.items()})
        summary[name] = spread_of(diffs)
    log("relative times (|log ratio to the point's fastest| apart), median / p90 (pairs):")
    for name, s in summary.items():
        shown = f"{s['median']:.1%} / {s['p90']:.1%} ({s['pairs']})" if s["pairs"] else "no pairs"
        log(f"  {name:<15} {shown}")
    ratios: dict[str, list[float]] = {}
    for row in rows:
        for v, t in row["variants"].items():
            ratios.setdefault(Variant.parse(v).backend, []).append(t["passes"] / t["table"])
    by_backend = {b: {"n": len(x), "median": statistics.median(x)} for b, x in sorted(ratios.items())}
    if by_backend:
        log("passes / table per backend, median (n): " + ", ".join(
            f"{b} {s['median']:.3f} ({s['n']})" for b, s in by_backend.items()))
    protocol = {"samples": samples, "passes": passes, "timer": "time_call" if device != "cpu" else "cpu_time",
                **({"layers": layers} if layers else {})}
    out = {"table": str(table_path), "device": where, "protocol": protocol, "points": rows, "summary": summary,
           "by_backend": by_backend, "written": None}
    if write is not None:
        out["written"] = _write_points(table, table_path, write, rows, chosen, where, protocol, log)
    if json_path is not None:
        from mla_tune.fileio import atomic_write_text

        atomic_write_text(json_path, json.dumps(out, indent=1) + "\n")
    return out


def _time_point(cfg, table, key: FamilyKey, batch: int, kv: int, seed: int, samples: int, passes: int,
                rejected: dict, *, compare: bool, check: bool, device: str, layers: int = 0) -> dict:
    """One point of `time_points`: its row, each variant checked against the reference (where
    `check`), then (compare) timed as a sweep step, then all in a round of alternating passes
    (and, compare, a second round in the reverse order); with layers > 0 each timed as a
    layer of a LayeredStep. An error that loses the CUDA context ends the point with
    `lost_context` in its row."""
    import torch

    from mla_tune import problem
    from mla_tune.backends import get_backend
    from mla_tune.serving.gate import poisons_context, reference_q_format, run_call
    from mla_tune.serving.inputs import make_input
    from mla_tune.serving.measure import TimedCall, as_step, layer_copies, layer_timer
    from mla_tune.serving.verify import alternating_passes
    from mla_tune.tune.time_variants import first_line, timer_for

    timer = layer_timer(timer_for(device))  # a LayeredStep's figures per layer
    spec, swept = cfg.spec(key), table.families[key].points[(batch, kv)]
    inp = make_input([key.q_len] * batch, [kv] * batch, key.heads, key.page_size, key.kv_format, seed=seed,
                     device=device)
    refs, row = {}, {"family": key.as_dict(), "batch": batch, "kv_len": kv, "variants": {}, "failed": {}}
    fresh, runners = {}, {}
    try:
        copies = layer_copies(inp, layers) if layers else None
    except ValueError as exc:
        row["failed"] = {str(v): str(exc) for v in swept}
        return row
    for v in sorted(swept, key=swept.get):
        if (key, v) in rejected:
            row["failed"][str(v)] = rejected[(key, v)]
            continue
        try:  # built just before it is timed, its samples in one block: as a sweep step
            runner = get_backend(v.backend).build_serving(v, spec, device)
            q_format = reference_q_format(v, cfg.gate)
            if check and q_format not in refs:
                refs[q_format] = inp.reference(q_format)
            if check and not problem.check(run_call(runner, inp), refs[q_format], cfg.rule).passed:
                row["failed"][str(v)] = f"fails the {cfg.rule.name} check"
                continue
            call = as_step(TimedCall(v, key, batch, kv, runner, inp), copies, device)
            if compare:
                fresh[v] = timer(call, samples * passes).median_us
            runners[v] = call
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            row["failed"][str(v)] = first_line(exc)
            if poisons_context(exc):  # nothing after it can run
                row["lost_context"] = True
                runners.clear()
                break
    calls = dict(runners)

    def failed(v, exc):
        row["failed"][str(v)] = first_line(exc)
        if poisons_context(exc):
            row["lost_context"] = True
            raise exc
    try:
        rounds = [alternating_passes(calls, timer, samples, passes, on_error=failed)]
        if compare:
            rounds.append(alternating_passes(dict(reversed(list(calls.items()))), timer, samples, passes,
                                             on_error=failed))
    except Exception:  # noqa: BLE001 - the context was lost (failed re-raised it): the row says so
        runners.clear()
    for v in runners:
        if str(v) not in row["failed"]:
            row["variants"][str(v)] = {"table": swept[v], "passes": statistics.median(rounds[0][v])}
            if compare:
                row["variants"][str(v)].update(fresh=fresh[v], again=statistics.median(rounds[1][v]))
    calls = runners = inp = refs = copies = None  # the point's input and runners go before the next's
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def _write_points(table, table_path: str | Path, out: str | Path, rows: list[dict], chosen: list[tuple],
                  device: str, protocol: dict, log: Callable[[str], None]) -> dict:
    """`table` (the one loaded from table_path, changed here) written to `out` with each timed
    variant's passes time as its point's time, for the families whose every chosen point was
    timed (a family cut short by the budget keeps all its times: its points are not mixed);
    a variant not run here
    keeps its time, the cells their swept times, and the schedule models their fitted
    shapes (their rates come from the points). The provenance says what was timed again,
    where and how (`points_retimed`: a record per run, appended to the given table's)."""
    from mla_tune.serving.table import write_serving_table

    wanted = Counter(key for key, _batch, _kv in chosen)
    done = Counter(FamilyKey(**row["family"]) for row in rows)
    whole = {key for key, n in wanted.items() if done[key] == n}
    timed = kept = points = 0
    for row in rows:
        key = FamilyKey(**row["family"])
        if key not in whole:
            continue
        point = table.families[key].points[(row["batch"], row["kv_len"])]
        for v, t in row["variants"].items():
            point[Variant.parse(v)] = round(t["passes"], 3)
        timed, kept, points = timed + len(row["variants"]), kept + len(row["failed"]), points + 1
    short = sorted(str(k) for k in wanted if k not in whole)
    # one record per run, after those of the runs the table came from (a long run split by family)
    earlier = table.provenance.get("points_retimed", [])
    earlier = [earlier] if isinstance(earlier, dict) else list(earlier)  # one record, before lists
    table.provenance = {**table.provenance, "points_retimed": [*earlier, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device,
        "from": str(table_path), **protocol, "families": sorted(str(k) for k in whole), "points": points,
        "variant_times": timed, "kept": kept}]}
    write_serving_table(out, table)
    log(f"wrote {out}: {timed} variant times at {points} points of {len(whole)} families timed again; {kept} "
        "kept as swept (not run here)" + (f"; not reached in full, so left as swept: {'; '.join(short)}"
                                           if short else ""))
    return {"path": str(out), "families": len(whole), "points": points, "variant_times": timed, "kept": kept,
            "left": short}


def _point_lines(row: dict, family: str, log: Callable[[str], None]) -> None:
    """A point's variants: the table's us, then as a sweep step, in passes and again ('-'
    where not timed so)."""
    log(f"{family} batch {row['batch']} kv {row['kv_len']}: {'table':>8} {'fresh':>8} {'passes':>8} "
        f"{'again':>8}")
    for v, t in row["variants"].items():
        cols = " ".join(f"{t[c]:8.1f}" if c in t else f"{'-':>8}" for c in ("table", "fresh", "passes", "again"))
        log(f"  {Variant.parse(v).backend:<12} {cols}  {v}")
    for v, why in row["failed"].items():
        log(f"  {Variant.parse(v).backend:<12} not timed: {why}  {v}")
