"""Graph picks chosen on recorded verify runs, no GPU:

    mla-tune verify --table tables/H200.serving.yaml --rescore REPORTS... --repick-graph OUT

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
docs/data/verify (docs/perf.md, the decision log). Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.serving.rescore import check_protocol, read_report, report_paths
from mla_tune.serving.table import FamilyKey, GraphPick, ServingTable, batch_bucket, kv_bucket

MARGIN = 0.03  # a new pick's geomean regret must be under (1 - MARGIN) x the current pick's
MIN_SHAPES = 6  # a bucket is re-chosen only on at least this many recorded shapes


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
    changes = []
    for (key, bucket), offered_rows in sorted(shapes.items()):
        current = table.families[key].graph.get(bucket)
        if current is None:
            continue
        rows = [(r, f) for r, f, offered in offered_rows if str(current.variant) in offered]
        if len(rows) < min_shapes:
            continue
        everywhere = set.intersection(*(set(f) for _, f in rows))
        if not everywhere:
            continue
        score = {v: _geomean([f[v] for _, f in rows]) for v in everywhere}
        best = min(sorted(score), key=score.__getitem__)
        was = str(current.variant)
        if best == was or (was in score and not score[best] < (1.0 - margin) * score[was]):
            continue
        worst = max(rows, key=lambda row: row[1][best])
        record = worst[0]
        worst_kv = 0 if record["kind"] == "ragged" else kv_bucket(table.kv_buckets, record["mean_kv_len"])
        was_score = round(score[was] - 1.0, 4) if was in score else None
        table.families[key].graph[bucket] = GraphPick(
            bucket, Variant.parse(best), worst[1][best] - 1.0, worst_kv,
            {"reports": len(paths), "shapes": len(rows), "geomean_regret": round(score[best] - 1.0, 4),
             "sweep_pick": was, "sweep_geomean_regret": was_score})
        changes.append({"family": str(key), "batch": bucket, "was": was, "now": best, "shapes": len(rows),
                        "was_geomean_regret": was_score, "geomean_regret": round(score[best] - 1.0, 4)})
        was_text = "not timed at every shape" if was_score is None else f"{100 * was_score:.1f}%"
        log(f"  {key}, batch {bucket}: {was} ({was_text}) -> {best} ({100 * (score[best] - 1.0):.1f}%), "
            f"{len(rows)} shapes")
    table.provenance = {**table.provenance, "graph_repick": {
        "reports": [p.name for p in paths], "margin": margin, "min_shapes": min_shapes, "replaced": len(changes)}}
    table.estimator.clear()
    return changes
