"""`mla-tune verify --rescore`: a serving table's picks scored on recorded verify runs, no GPU.

    mla-tune verify --table tables/H200.serving.yaml --rescore docs/data/verify
        [--rescore more.json ...] [--max-p95 0.05] [--max-regret 0.15] [--judge eager]
        [--json rescore.json]

Each --rescore is a report or a folder of them (its *.json and *.json.gz, in name order).

A verify report (`mla-tune verify --json`, plain or gzipped) holds, at each held-out shape,
the time of every candidate that survived its probe: `short_us` (the short rung) and
`final_us` (the final round, which decides `best`). Rescoring looks each shape up in the
table given (another table, or the same after a change to the lookup) and reads its
picks' times from the report:

- a pick in the shape's final round: its final time, as verify measures it;
- a pick only in the short rung: its short time (SHORT_SAMPLES samples, one pass; the
  per-shape lines mark it `~`);
- a pick the probe pruned (over PRUNE_FACTOR x the best probe), or not among the shape's
  candidates: not measured there. Its regret is unknown, it is left out of the statistics
  and it fails the run: only the GPU can say.

Best stays the report's; the fallback's regret is the report's (the fallback does not
depend on the table). A pick whose run failed or whose output was outside the rule in the
recorded run fails the rescore as it failed the run (verify's verdict).

A shape recorded in more than one report (verify again at the same seed, with a table of
the same buckets: the same family, batch and lengths) is summarized across its recordings
(`repeats`): how many name the same best variant in every recording, and the shapes whose
eager regret is over STEADY_OVER in every one, a miss of the lookup rather than of one
run's timing.

Beside them, how far the table's own points agree with the recorded times (`agreement`),
where the lookup adds nothing of its own: at a uniform shape of a point's batch whose
length is within POINT_NEAR below a point's (the kernels' steps come past a length, not
before it), each variant of the point in the shape's final round, its time relative to the
fastest of them, against the same ratio of the point's times. The same relative difference
between two recordings of a shape says how far one run agrees with another. A lookup whose
estimates rest on the points cannot pick closer than the points agree.

What it is for: choosing between tables and lookup rules offline on measurements already
paid for, over many more shapes than one GPU run times. It is not a verify: a table is
accepted on `mla-tune verify` at fresh seeds on the GPU (a rule tuned on the recorded
shapes looks better on them than it is: choose a rule on one half of the recorded runs and
judge it on the other, as tests/test_rescore_committed_table.py judges the committed table
on the odd seeds).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path

from mla_tune.backends import known_backends
from mla_tune.core import CallSpec, Variant
from mla_tune.fileio import read_maybe_gzipped
from mla_tune.serving.table import FamilyKey, ServingTable, load_serving_table
from mla_tune.serving.verify import (
    VERIFY_SCHEMA,
    VerifyError,
    check_json_path,
    emit,
    pct_text,
    regret_stats,
    shape_text,
    summarize,
    summary_lines,
    verdict_of,
)
from mla_tune.tables.render import fitting

RESCORE_SCHEMA = "serving-rescore/1"
SHOW_OVER = 0.05  # per-shape lines: the eager regrets over this, and the picks not measured
STEADY_OVER = 0.01  # a shape recorded several times: its eager regret over this in every recording
POINT_NEAR = 0.02  # agreement: a shape's length within this fraction below a point's


def read_report(path: str | Path) -> dict:
    """A verify report (--json), plain or gzipped; a VerifyError names what is wrong."""
    path = Path(path)
    try:
        report = json.loads(read_maybe_gzipped(path))
    except FileNotFoundError:
        raise VerifyError(f"{path}: no such verify report; write one with `mla-tune verify --json PATH`") from None
    except (OSError, ValueError, EOFError) as exc:
        raise VerifyError(f"{path}: not a verify report (JSON, or gzipped JSON): {exc}") from exc
    if not isinstance(report, dict) or report.get("schema") != VERIFY_SCHEMA:
        raise VerifyError(f"{path}: schema is {report.get('schema') if isinstance(report, dict) else None!r}, "
                          f"rescore reads {VERIFY_SCHEMA!r} (mla-tune verify --json)")
    if not isinstance(report.get("shapes"), list):
        raise VerifyError(f"{path}: the report has no shapes list")
    return report


def check_protocol(table: ServingTable, report: dict, path: str | Path) -> None:
    """Refuse a verify report whose candidates were timed under another protocol than the
    table's points (search.step_layers: a layer of an N-layer step, or 0, one flushed call):
    its times and the table's cannot be weighed together."""
    def said(n: int) -> str:
        return f"as a layer of a {n}-layer step" if n else "as one flushed call"
    layers = int((table.provenance.get("search") or {}).get("step_layers", 0))
    timed = int((report.get("protocol") or {}).get("step_layers", 0))
    if timed != layers:
        raise VerifyError(f"{path} timed each candidate {said(timed)}, the table's points were timed "
                          f"{said(layers)} (its config's search.step_layers): the regrets would mix two "
                          "protocols; use reports of the table's protocol (mla-tune verify of it)")


def report_paths(paths: list[str | Path]) -> list[Path]:
    """The reports named: each a file, or a folder's *.json and *.json.gz in name order;
    a report named twice (a file and its folder, say) is refused."""
    out: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
            if not found:
                raise VerifyError(f"{path}: a folder with no verify reports (*.json, *.json.gz) in it")
            out += found
        else:
            out.append(path)
    seen: dict[Path, Path] = {}
    for path in out:
        if path.resolve() in seen:
            raise VerifyError(f"{path} is given twice (also as {seen[path.resolve()]}): a report counted twice "
                              "would pass as a second recording of its shapes; name each report once")
        seen[path.resolve()] = path
    return out


def _time(record: dict, variant: str) -> tuple[float | None, str | None]:
    """(us, where) of a variant at a recorded shape: 'final', 'short', or (None, None)."""
    for where in ("final", "short"):
        t = (record.get(f"{where}_us") or {}).get(variant)
        if t is not None:
            return float(t), where
    return None, None


def rescore_shape(table: ServingTable, record: dict, unrunnable: Collection[str] = ()) -> dict:
    """The recorded shape with the table's picks as its eager and graph roles: roles,
    from_table, regret (None where not measured), `measured` ('final', 'short' or None).
    `unrunnable`: backends the picks are scored without, as a DecodePlan on a machine
    without them steps (ServingTable.plan_pick); their picks' stand-ins run instead."""
    r = copy.deepcopy(record)
    key = FamilyKey(**r["family"])
    spec = CallSpec(key.kv_format, key.page_size, key.heads, key.q_len)
    fallback = record["roles"]["fallback"]
    r["recorded_roles"] = dict(record["roles"])
    r["measured"] = {"fallback": "final"}
    kv_lens = r["kv_lens"] if isinstance(r["kv_lens"], list) else [r["kv_lens"]] * r["batch"]
    def runs(v: Variant) -> bool:
        return v.backend not in unrunnable

    looks = (table.plan_pick(spec, r["batch"], runs, r["mean_kv_len"], kv_lens),
             table.plan_pick(replace(spec, graph=True), r["batch"], runs))
    for role, looked in zip(("eager", "graph"), looks, strict=True):
        variant = str(looked) if looked is not None else fallback  # no pick: the fallback runs
        r["roles"][role] = variant
        r["from_table"][role] = looked is not None
        if variant == fallback:
            r["regret"][role], r["measured"][role] = record["regret"]["fallback"], "final"
            continue
        t, where = _time(record, variant)
        best = record.get("best_us")
        r["regret"][role] = t / best - 1.0 if t is not None and best else None
        r["measured"][role] = where
    return r


def rescore(table: str | Path | ServingTable, reports: list[str | Path], *, max_p95: float | None = None,
            max_regret: float | None = None, judge: str = "eager", json_path: str | Path | None = None,
            unrunnable: Collection[str] = (), log: Callable[[str], None] = print) -> dict:
    """Score the table's picks on recorded verify reports (see the module); returns the
    report (what --json writes) with exit_code 0 (passed or not judged) or 1 (failed).
    `unrunnable`: backends to score the table without (rescore_shape). Its lines are fitted
    to the width (tables.render.fitting)."""
    log = fitting(log)
    if judge not in ("eager", "graph", "both"):
        raise VerifyError(f"--judge must be eager, graph or both, got {judge!r}")
    check_json_path(json_path)
    if not reports:
        raise VerifyError("--rescore needs at least one verify report (mla-tune verify --json PATH)")
    unknown = sorted(set(unrunnable) - set(known_backends()))
    if unknown:
        raise VerifyError(f"--unrunnable {', '.join(unknown)}: not a backend; the backends are "
                          f"{', '.join(known_backends())}")
    table = table if isinstance(table, ServingTable) else load_serving_table(table)
    records, per_report = [], []
    for path in report_paths(reports):
        report = read_report(path)
        if report.get("device", {}).get("name") not in (None, table.gpu):
            log(f"warning: {path} was measured on {report['device']['name']}; the table is for {table.gpu}")
        check_protocol(table, report, path)
        mine = [rescore_shape(table, r, unrunnable) for r in report["shapes"]]
        for r in mine:
            r["report"] = str(path)
        per_report.append({"path": str(path), "seed": (report.get("options") or {}).get("seed"),
                           "eager": regret_stats([r["regret"]["eager"] for r in mine
                                                  if r["regret"]["eager"] is not None])})
        records += mine
    roles = ("eager", "graph") if judge == "both" else (judge,)
    unmeasured = [(r, role) for r in records for role in ("eager", "graph") if r["regret"][role] is None]
    measured = [r for r in records if all(r["regret"][role] is not None for role in ("eager", "graph"))]
    summary = summarize(measured)
    verdict = verdict_of(summary, measured, max_p95, max_regret, judge, False)
    for r, role in unmeasured:
        if role in roles:
            verdict["reasons"].append(f"{Path(r['report']).name} shape {r['index']}: the {role} pick "
                                      f"{r['roles'][role]} was not measured there (pruned, or not a candidate)")
    verdict["failed"] = bool(verdict["reasons"])
    out = {"schema": RESCORE_SCHEMA, "table": {"path": str(table.path), "gpu": table.gpu,
                                               "config_hash": (table.provenance.get("config") or {}).get("hash")},
           "reports": per_report, "shapes": records, "summary": summary, "verdict": verdict,
           "unmeasured": len(unmeasured), "unrunnable": sorted(unrunnable)}
    groups = _groups(records)
    out["repeats"], out["agreement"] = repeats(groups), agreement(table, records, groups)
    out["exit_code"] = 1 if verdict["failed"] else 0
    return emit(out, rescore_lines(out), json_path, log)


def _groups(records: list[dict]) -> list[list[dict]]:
    """The records of each shape recorded more than once (the same family, batch, q_lens and
    kv_lens), in report order."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        lengths = tuple(r["kv_lens"]) if isinstance(r["kv_lens"], list) else r["kv_lens"]
        q_lens = tuple(r["q_lens"]) if isinstance(r.get("q_lens"), list) else r.get("q_lens")
        key = (tuple(sorted(r["family"].items())), r["batch"], q_lens, lengths)
        groups.setdefault(key, []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def repeats(repeated: list[list[dict]]) -> dict | None:
    """The shapes recorded in more than one report (`_groups`' records of each), across
    their recordings: how many shapes and recordings, at how many every recording names
    the same best, and the shapes whose eager regret is over STEADY_OVER in every
    recording (report paths, the eager pick, the regrets in report order and each
    recording's best); None when no shape is recorded twice."""
    if not repeated:
        return None
    steady = [{"reports": [r["report"] for r in g], "index": g[0]["index"],
               "family": g[0]["family"], "batch": g[0]["batch"], "kind": g[0]["kind"],
               "kv_lens": g[0]["kv_lens"], "mean_kv_len": g[0]["mean_kv_len"], "eager": g[0]["roles"]["eager"],
               "regrets": [r["regret"]["eager"] for r in g], "best": [r["best"] for r in g]}
              for g in repeated
              if all(r["regret"]["eager"] is not None and r["regret"]["eager"] > STEADY_OVER for r in g)]
    return {"shapes": len(repeated), "recordings": sorted({len(g) for g in repeated}),
            "same_best": sum(len({r["best"] for r in g}) == 1 for g in repeated), "steady_over": STEADY_OVER,
            "steady": sorted(steady, key=lambda x: -min(x["regrets"]))}


def relative_differences(times: Mapping, against: Mapping) -> list[float]:
    """|log(t_v / t_ref) - log(a_v / a_ref)| for each key v of both `times` and `against`
    ({variant: us} each) but ref, the fastest of them in `times`: how far two measurements
    of the same calls disagree on how they compare."""
    common = [v for v in times if v in against]
    if len(common) < 2:
        return []
    ref = min(common, key=times.get)
    return [abs(math.log(times[v] / times[ref]) - math.log(against[v] / against[ref])) for v in common if v != ref]


def spread_of(diffs: list[float]) -> dict:
    """pairs, median and p90 (nearest rank) of relative differences (None without any)."""
    ordered = sorted(diffs)
    return {"pairs": len(ordered), "median": statistics.median(ordered) if ordered else None,
            "p90": ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else None}


def agreement(table: ServingTable, records: list[dict], repeated: list[list[dict]]) -> dict:
    """The table's points against the recorded final rounds (see the module): at each uniform
    shape of a point's batch and a length within POINT_NEAR below the point's, the relative
    differences of the point's variants (`relative_differences`); and between the recordings
    of a shape recorded more than once (`repeated`: `_groups`' records of each; each pair of
    recordings). The shapes and the pairs counted, the median and p90 of each."""
    points, shapes = [], 0
    for r in records:
        family = table.families.get(FamilyKey(**r["family"]))
        if r["kind"] != "uniform" or family is None:
            continue
        kv = r["kv_lens"]
        near = [k for b, k in family.points if b == r["batch"] and k * (1.0 - POINT_NEAR) <= kv <= k]
        if near:
            point = family.points[(r["batch"], min(near))]
            diffs = relative_differences(r.get("final_us") or {}, {str(v): t for v, t in point.items()})
            shapes += bool(diffs)
            points += diffs
    again = []
    for group in repeated:
        again += [d for i, a in enumerate(group) for b in group[i + 1:]
                  for d in relative_differences(a.get("final_us") or {}, b.get("final_us") or {})]
    return {"near": POINT_NEAR, "shapes": shapes, "points": spread_of(points), "recorded_again": spread_of(again)}


def _agreement_lines(agree: dict) -> list[str]:
    """agreement() in two lines."""
    pts, again = agree["points"], agree["recorded_again"]

    def spread(s: dict) -> str:
        return f"median {s['median']:.1%}, p90 {s['p90']:.1%} ({s['pairs']} pairs)" if s["pairs"] else "no pairs"
    return ["", f"relative times, the table's points against the final rounds at {agree['shapes']} uniform shapes "
                f"within {agree['near']:.0%} below a point: {spread(pts)}",
            f"the same between two recordings of one shape: {spread(again)}"]


def _shape_head(label: str, r: dict, eager: str, name: Callable[[str | None], str]) -> str:
    """A per-shape line's start: its report's label, the shape (index, family, batch x kv)
    and its eager pick's backend."""
    return f"  {label:<4}#{r['index']:<4}{FamilyKey(**r['family']).tag:<17} {shape_text(r):<12} {name(eager):<12}"


def _repeat_lines(rep: dict | None, name: Callable[[str | None], str], label: Mapping[str, str]) -> list[str]:
    """repeats() in lines: the counts, then a line per steady miss (its smallest regret first)."""
    if rep is None:
        return []
    times = "/".join(map(str, rep["recordings"]))
    lines = ["", f"{rep['shapes']} shapes recorded {times} times each: the same best in every recording at "
             f"{rep['same_best']}; eager regret over {rep['steady_over']:.0%} in every recording at "
             f"{len(rep['steady'])} (at its first report's label):"]
    for s in rep["steady"]:
        best = "/".join(dict.fromkeys(name(b) for b in s["best"]))
        lines.append(f"{_shape_head(label[s['reports'][0]], s, s['eager'], name)} "
                     f"{' / '.join(pct_text(x) for x in s['regrets'])}; best {best}")
    return lines


def rescore_lines(out: dict) -> list[str]:
    """The reports (labelled R1, R2, ...) with their eager regrets, the shapes worth a look,
    the summary, the repeats, the agreement and the verdict."""
    def name(v: str | None) -> str:
        return Variant.parse(v).backend if v else "none"

    shapes = out["shapes"]
    label = {rep["path"]: f"R{i}" for i, rep in enumerate(out["reports"], start=1)}
    lines = [f"rescore {out['table']['path']} on {len(out['reports'])} verify report(s), {len(shapes)} shapes "
             f"(recorded times: no GPU; a table is accepted on mla-tune verify at fresh seeds)"]
    if out["unrunnable"]:
        lines.append(f"scored as a plan steps where {', '.join(out['unrunnable'])} cannot run: "
                     "their picks' stand-ins run instead")
    lines += ["", "the reports, each with its eager picks' regret:"]
    for rep in out["reports"]:
        s, file = rep["eager"], Path(rep["path"]).name
        lines.append(f"  {label[rep['path']]:<4}{file:<36} seed {rep['seed']!s:<4} p95 {pct_text(s['p95']):>6} "
                     f"max {pct_text(s['max']):>6} n {s['n']}")
    lines += ["", f"eager regret over {SHOW_OVER:.0%}, or a pick not measured (~: a short-rung time), "
                  "at batch x kv_len (~: a ragged mix's mean):"]
    for r in shapes:
        reg = r["regret"]["eager"]
        if reg is not None and reg <= SHOW_OVER:
            continue
        what = "not measured" if reg is None else f"+{pct_text(reg)}" + ("~" if r["measured"]["eager"] == "short" else "")
        lines.append(f"{_shape_head(label[r['report']], r, r['roles']['eager'], name)} {what:>7}; "
                     f"best {name(r['best'])}")
    lines += [""] + summary_lines(out["summary"])
    lines += _repeat_lines(out.get("repeats"), name, label)
    lines += _agreement_lines(out["agreement"])
    if out["unmeasured"]:
        lines.append(f"{out['unmeasured']} role(s) at {len(shapes)} shapes not measured in the reports "
                     "(left out of the statistics)")
    v = out["verdict"]
    if v["failed"]:
        lines.append("FAIL: " + "; ".join(v["reasons"]))
    elif v["judged"]:
        lines.append("PASS (on recorded times): " + ", ".join(v["judged"]))
    else:
        lines.append("not judged (no --max-p95 / --max-regret)")
    return lines
