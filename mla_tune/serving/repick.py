"""Graph picks chosen on recorded runs, no GPU: verify runs, or engine loops.

    mla-tune verify --table tables/H200.serving.yaml --rescore REPORTS... --repick-graph OUT
    mla-tune verify --table tables/H200.serving.yaml --engine-loop REPORTS... --repick-graph OUT

A batch bucket's graph pick is the one variant its CUDA graph runs at every length. The
sweep chooses it on its uniform cells (serving/table.py's choose_graph_pick: the smallest
worst regret over the kv buckets and one ragged mix). A verify report (`mla-tune verify
--json`) times every candidate that survives its probe at random uniform shapes and ragged
mixes, the lengths engines bring. `repick_graph` replaces a bucket's pick with the variant
whose geomean regret over the reports' shapes in that bucket is smallest, where:

- the variant was timed (its final or short rung: rescore's times) at every one of those
  shapes, as choose_graph_pick asks of a variant at every kv bucket;
- the bucket has at least MIN_SHAPES shapes;
- its geomean regret there is under (1 - MARGIN) x the current pick's, or the current pick
  was not timed at all of them.

A run that timed the current pick nowhere (at no shape of any family: its config did not
offer it, as the runs before a backend joined the sweep) cannot judge it, so its shapes are
left out of that bucket's choice.

A replaced pick records `chosen_on` (table.CHOSEN_ON_FIELDS): the reports and shapes it
was chosen on, its geomean regret there, and the sweep's pick with its own. Its
worst_regret is its largest regret over those shapes and worst_kv_len the kv bucket of
that shape's mean length (0 for a ragged mix). The table's provenance gains
`graph_repick` (the reports' names, MARGIN and MIN_SHAPES, the picks replaced).

Choose on one half of the recorded runs and judge the result on the other (`mla-tune
verify --rescore OTHER_HALF --judge graph`): the chosen picks look better on the shapes
they were chosen on than they are. MARGIN and MIN_SHAPES were chosen that way on
docs/data/verify (docs/perf.md, the decision log).

A verify run times each candidate as one flushed call (or a layer of a step, the table's
protocol), which is not what a graph pick costs an engine: its graph replays every layer of
a step back to back, and a backend that plans on the host (FlashInfer) does so before each
replay. `scripts/engine_loop.py --table T --variants "V1;V2" --out DIR` times each
candidate as the bucket's graph pick in a decode loop like an engine's (61 layers, lengths
growing every step, the plan's update before each replay) and writes ENGINE_REPORT;
`repick_graph_on_steps` re-chooses the picks of the buckets such loops timed, on their
step times (the same MARGIN; no MIN_SHAPES: each loop is many steps of one mix). Its picks
record `chosen_on` as above (shapes: the loops) with the loops' report names
(table.CHOSEN_ON_LOOPS), and the provenance `graph_repick_steps`; `repick_graph` leaves
such a pick alone (an engine's step is what a graph pick is for). Neither takes a variant
the sweep's gate refused for the family (table.gate_refused): a loop checks each step at the
rule's full allowance, the gate at its margin.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.serving.rescore import check_protocol, read_report, report_paths
from mla_tune.serving.table import (
    CHOSEN_ON_LOOPS,
    FamilyKey,
    GraphPick,
    ServingTable,
    batch_bucket,
    gate_refused,
    kv_bucket,
)
from mla_tune.serving.verify import VerifyError

MARGIN = 0.03  # a new pick's geomean regret must be under (1 - MARGIN) x the current pick's
MIN_SHAPES = 6  # a bucket is re-chosen only on at least this many recorded shapes
# scripts/engine_loop.py's report: its 'report' field, and the fields repick_graph_on_steps reads
ENGINE_REPORT = "mla-tune engine loop/1"
ENGINE_FIELDS = ("gpu", "kv_format", "page_size", "heads", "q_len", "layers", "lens", "buckets")


def _times(record: dict) -> dict[str, float]:
    """Each timed variant's regret factor (time / best) at a recorded shape: the final
    round's time where it has one, else the short rung's."""
    best = record.get("best_us")
    if not best:
        return {}
    times = {**(record.get("short_us") or {}), **(record.get("final_us") or {})}
    return {v: float(t) / best for v, t in times.items() if t}


def _geomean(factors: Sequence[float]) -> float:
    return math.exp(sum(math.log(f) for f in factors) / len(factors))


def repick_graph(table: ServingTable, reports: Sequence[str | Path], *, margin: float = MARGIN,
                 min_shapes: int = MIN_SHAPES, log: Callable[[str], None] = print) -> list[dict]:
    """Re-choose the table's graph picks on the reports (see the module), in place; returns
    the picks replaced: {family, batch, was, now, shapes, was_geomean_regret,
    geomean_regret}."""
    paths = report_paths(list(reports))
    shapes: dict[tuple[FamilyKey, int], list[tuple[dict, dict[str, float]]]] = {}
    for path in paths:
        report = read_report(path)
        check_protocol(table, report, path)
        records = [(r, _times(r)) for r in report["shapes"]]
        offered = frozenset(v for _, factors in records for v in factors)  # what the run timed anywhere
        for record, factors in records:
            key = FamilyKey(**record["family"])
            if key in table.families and factors:
                bucket = batch_bucket(table.batch_buckets, record["batch"])
                shapes.setdefault((key, bucket), []).append((record, factors, offered))
    changes, told = [], set()
    for (key, bucket), offered_rows in sorted(shapes.items()):
        current = table.families[key].graph.get(bucket)
        if current is None:
            continue
        if current.chosen_by == "loops":  # an engine's step chose it
            log(f"  {key}, batch {bucket}: {current.variant} was chosen on engine loops; left")
            continue
        rows = [(r, f) for r, f, offered in offered_rows if str(current.variant) in offered]
        if len(rows) < min_shapes:
            continue
        was = str(current.variant)
        everywhere = _gated(table, key, set.intersection(*(set(f) for _, f in rows)), was, told, log)
        if not everywhere:
            continue
        score = {v: _geomean([f[v] for _, f in rows]) for v in everywhere}
        best = min(sorted(score), key=score.__getitem__)
        if best == was or (was in score and not score[best] < (1.0 - margin) * score[was]):
            continue
        worst = max(rows, key=lambda row: row[1][best])
        record = worst[0]
        worst_kv = 0 if record["kind"] == "ragged" else kv_bucket(table.kv_buckets, record["mean_kv_len"])
        changes.append(_replace(table, key, bucket, best, score, worst[1][best] - 1.0, worst_kv,
                                len(paths), len(rows), log))
    table.provenance = {**table.provenance, "graph_repick": {
        "reports": [p.name for p in paths], "margin": margin, "min_shapes": min_shapes, "replaced": len(changes)}}
    table.estimator.clear()
    return changes


def _gated(table: ServingTable, key: FamilyKey, timed: set[str], was: str, told: set,
           log: Callable[[str], None]) -> set[str]:
    """The timed variants that may become a pick of family `key`: those the sweep's gate did
    not refuse (table.gate_refused; the current pick `was` stays, to be compared). Says once
    per family and variant which were left out."""
    refused = gate_refused(table, key)
    for v in sorted(timed & refused.keys() - {was}):
        if (key, v) not in told:
            told.add((key, v))
            log(f"  {key}: {v} was refused by the sweep's gate ({refused[v]}); not a candidate")
    return {v for v in timed if v not in refused or v == was}


def _replace(table: ServingTable, key: FamilyKey, bucket: int, best: str, score: dict[str, float],
             worst_regret: float, worst_kv: int, reports: int, shapes: int, log: Callable[[str], None],
             loops: list[str] | None = None) -> dict:
    """Make `best` the bucket's graph pick, chosen on `shapes` recordings of `reports` runs
    (score: each candidate's geomean time over the fastest's there; loops: the engine
    loops' report names, where they were the runs); returns the change."""
    was = str(table.families[key].graph[bucket].variant)
    was_score = round(score[was] - 1.0, 4) if was in score else None
    table.families[key].graph[bucket] = GraphPick(
        bucket, Variant.parse(best), worst_regret, worst_kv,
        {"reports": reports, "shapes": shapes, "geomean_regret": round(score[best] - 1.0, 4),
         "sweep_pick": was, "sweep_geomean_regret": was_score, **({CHOSEN_ON_LOOPS: loops} if loops else {})})
    was_text = "not timed at every shape" if was_score is None else f"{100 * was_score:.1f}%"
    log(f"  {key}, batch {bucket}: {was} ({was_text}) -> {best} ({100 * (score[best] - 1.0):.1f}%), "
        f"{shapes} shapes")
    return {"family": str(key), "batch": bucket, "was": was, "now": best, "shapes": shapes,
            "was_geomean_regret": was_score, "geomean_regret": round(score[best] - 1.0, 4)}


def read_engine_report(path: str | Path) -> dict:
    """An engine-loop report (scripts/engine_loop.py --out DIR: DIR/engine_loop.json); a
    VerifyError names what is wrong."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerifyError(f"{path}: no such engine-loop report; write one with "
                          "`python scripts/engine_loop.py --table T --variants ... --out DIR`") from None
    except (OSError, ValueError) as exc:
        raise VerifyError(f"{path}: not an engine-loop report (JSON): {exc}") from exc
    if not isinstance(report, dict) or report.get("report") != ENGINE_REPORT:
        raise VerifyError(f"{path}: not an engine-loop report (its 'report' field is not {ENGINE_REPORT!r}; "
                          "scripts/engine_loop.py --out writes one)")
    missing = [f for f in ENGINE_FIELDS if f not in report]
    if missing:
        raise VerifyError(f"{path}: the engine-loop report lacks {', '.join(missing)}")
    if not isinstance(report["buckets"], list):
        raise VerifyError(f"{path}: the engine-loop report's buckets must be a list of rows")
    for row in report["buckets"]:
        steps = row.get("steps_ms") if isinstance(row, dict) else None
        if not (isinstance(steps, dict) and steps and isinstance(row.get("bucket"), int)
                and all(isinstance(t, (int, float)) and t > 0 for t in steps.values())):
            raise VerifyError(f"{path}: a bucket's row needs its batch (bucket) and each variant's positive "
                              f"ms per step (steps_ms), got {row!r:.200}")
        for text in steps:
            try:
                Variant.parse(text)
            except ValueError as exc:
                raise VerifyError(f"{path}: batch {row['bucket']}: {exc}") from None
    return report


def repick_graph_on_steps(table: ServingTable, reports: Sequence[str | Path], *, margin: float = MARGIN,
                          log: Callable[[str], None] = print) -> list[dict]:
    """Re-choose graph picks on engine-loop reports (ENGINE_REPORT), in place: per family
    and batch bucket a report timed, the variant whose geomean step time over the reports'
    loops (each over the fastest there) is smallest replaces the pick where that is under
    (1 - margin) x the current pick's; a bucket whose current pick some loop did not time
    is left. Every report must come from the table's GPU. Returns the picks replaced."""
    rows: dict[tuple[FamilyKey, int], list[tuple[str, dict[str, float]]]] = {}  # (report, time / fastest)
    names = []
    for path in map(Path, reports):
        report = read_engine_report(path)
        if report["gpu"] != table.gpu:
            raise VerifyError(f"{path} was timed on {report['gpu']} ({report.get('device')}), the table is "
                              f"for {table.gpu}: re-choose its graph picks on loops timed on {table.gpu}")
        key = FamilyKey(report["kv_format"], report["page_size"], report["heads"], report["q_len"])
        if key not in table.families:
            raise VerifyError(f"{path} times {key}, which the table has no family for")
        names.append(path.name)
        for row in report["buckets"]:
            if row["bucket"] not in table.families[key].graph:
                raise VerifyError(f"{path}: batch {row['bucket']} is not a batch bucket of {key}'s graph picks "
                                  f"({sorted(table.families[key].graph)})")
            fastest = min(row["steps_ms"].values())
            rows.setdefault((key, row["bucket"]), []).append(
                (path.name, {v: t / fastest for v, t in row["steps_ms"].items()}))
    changes, told = [], set()
    for (key, bucket), named in sorted(rows.items()):
        loops = [factors for _, factors in named]
        was = str(table.families[key].graph[bucket].variant)
        everywhere = _gated(table, key, set.intersection(*(set(f) for f in loops)), was, told, log)
        if was not in everywhere:
            log(f"  {key}, batch {bucket}: its pick {was} was not timed in every loop; left")
            continue
        score = {v: _geomean([f[v] for f in loops]) for v in everywhere}
        best = min(sorted(score), key=score.__getitem__)
        if best == was or not score[best] < (1.0 - margin) * score[was]:
            continue
        timed_in = list(dict.fromkeys(name for name, _ in named))  # the reports that timed this bucket
        changes.append(_replace(table, key, bucket, best, score, max(f[best] for f in loops) - 1.0, 0,
                                len(timed_in), len(loops), log, loops=timed_in))
    table.provenance = {**table.provenance, "graph_repick_steps": {
        "reports": names, "margin": margin, "replaced": len(changes)}}
    table.estimator.clear()
    return changes
