"""Plain-text and JSON views of a serving table, and of two serving tables' diff.

`mla-tune show` and `mla-tune diff` on a serving table (tables/GPU.serving.yaml,
mla_tune/serving/table.py). The text follows tables/render.py's rules (no line over the
width, numbers never broken, every variant in full on lines that say whose it is) and uses
its helpers. A family holds an eager pick per (batch bucket, kv bucket) and a graph pick
per batch bucket, far more than fit as full variants in a grid, so:

- each family's picks print as a grid of short labels (A, B, ...: one per distinct variant
  in the family, the most used first): a row per batch bucket, a column per kv bucket,
  then the bucket's graph pick, its worst regret over the kv buckets, and what chose it (the
  sweep, recorded verify runs, or engine loops: serving/repick.py). `-` marks a cell
  the config left out (its reason follows the grid), `.` a cell with neither a pick nor a
  reason. Kv columns that do not fit the width go to a second grid. With `times`
  (`show --times`) a grid of the eager picks' times follows in the same layout.
- under the grid, each label's variant in full, on lines that start with the family's tag
  and the label (`  fp8/p64/h16/q1 A  triton(block_n=32,...`), so
  `mla-tune show --table tables/H200.serving.yaml | grep tokens_per_split=128` finds the
  lines and each says whose variant it is.

The diff compares each family cell by cell and graph pick by graph pick, and counts the
point entries (a variant's time at a point, what the eager lookup interpolates) added,
removed and changed, and names a changed calibration: a table swept again can keep every
pick and still estimate differently. A time change is
flagged by the leaderboard diff's rule (tables/diff.py: outside the larger of the recorded
spreads and the tie tolerance); a serving table records no spread per cell, so its noise is
the tie tolerance. The JSON views hold every cell; the text lists the changed ones.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mla_tune.fileio import MAX_YAML_BYTES
from mla_tune.tables.diff import flag_text, noise, time_change
from mla_tune.tables.render import clip, grid, share, us, variant_lines, wrap

if TYPE_CHECKING:  # table_kind, which the leaderboard's show calls, needs no serving table code
    from mla_tune.serving.table import Family, FamilyKey, ServingTable

LEFT_OUT, NO_PICK = "-", "."
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
_SCHEMA_LINE = re.compile(r"^schema:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


# ------------------------------------------------------------------ which table is it
def table_kind(path: str | Path) -> str | None:
    """"serving" when the file's top-level `schema:` says serving/..., "leaderboard" for any
    other readable file (its own loader then names what is wrong with it), None when the
    file cannot be read (the loader says why). Reads the text, not the YAML, so choosing a
    loader costs no second parse of a large table."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_YAML_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = _SCHEMA_LINE.search(text)
    if found is None:
        return "leaderboard"
    try:
        schema = yaml.safe_load(found.group(1))
    except yaml.YAMLError:
        return "leaderboard"
    return "serving" if isinstance(schema, str) and schema.startswith("serving/") else "leaderboard"


# ------------------------------------------------------------------ names and labels
def label_name(index: int) -> str:
    """A, B, ..., Z, a, ..., z, then AA, AB, ...: the index-th label."""
    if index < len(_LETTERS):
        return _LETTERS[index]
    return _LETTERS[index // len(_LETTERS) - 1] + _LETTERS[index % len(_LETTERS)]


def _labels(variants: Iterable[str]) -> dict[str, str]:
    """A label per distinct variant text, the most frequent first (ties by text)."""
    counts = Counter(variants)
    ordered = sorted(counts, key=lambda v: (-counts[v], v))
    return {v: label_name(i) for i, v in enumerate(ordered)}


def _mapping(value: Any) -> Mapping:
    return value if isinstance(value, Mapping) else {}


# ------------------------------------------------------------------ show: the view
def _family_view(family: Family, provenance: Mapping, refused: Mapping[str, str]) -> dict:
    candidates = _mapping(_mapping(provenance.get("candidates")).get(str(family.key)))
    return {
        "key": family.key.as_dict(), "name": str(family.key), "tag": family.key.tag,
        "candidates": dict(candidates), "gate_refused": dict(refused),
        "cells": [{"batch": c.batch, "kv_len": c.kv_len, "variant": str(c.variant),
                   "time_us": round(c.time_us, 3),
                   **({"runner_up": c.runner_up} if c.runner_up else {})}
                  for _, c in sorted(family.cells.items())],
        "graph": [{"batch": g.batch, "variant": str(g.variant),
                   "worst_regret": round(g.worst_regret, 4), "worst_kv_len": g.worst_kv_len,
                   **({"chosen_on": dict(g.chosen_on)} if g.chosen_on else {})}
                  for _, g in sorted(family.graph.items())],
        "left_out": sorted((dict(c) for c in family.left_out), key=lambda c: (c["batch"], c["kv_len"])),
        "points": len(family.points),
    }


def show_view(table: ServingTable, path: str | Path) -> dict:
    """What `mla-tune show` prints for a serving table, as data (`--json`): provenance,
    buckets, and per family its key, candidate counts, eager picks (cells), graph picks,
    left-out cells and how many points it timed."""
    from mla_tune.serving.table import gate_refused

    view = {"path": str(path), "kind": "serving", "gpu": table.gpu, "provenance": table.provenance,
            "batch_buckets": list(table.batch_buckets), "kv_buckets": list(table.kv_buckets),
            "families": [_family_view(table.families[k], table.provenance, gate_refused(table, k))
                         for k in sorted(table.families)]}
    # free fields (provenance, reasons, runner-ups) hold what YAML read: an unquoted date
    # becomes its text, so the view is plain JSON
    return json.loads(json.dumps(view, default=str))


# ------------------------------------------------------------------ show: the text
def _fitting_grids(headers: Sequence[str], rows: Sequence[Sequence[str]], fixed: int, tail: int,
                   width: int, left: int = 1) -> list[str]:
    """grid() of the rows, with the middle columns (between the first `fixed` and the last
    `tail`) split over as few grids as fit `width`; the tail columns go with the last."""
    middle = len(headers) - fixed - tail
    for per in range(middle, 0, -1):
        out: list[str] = []
        starts = list(range(0, middle, per))
        for n, start in enumerate(starts):
            cols = list(range(fixed)) + [fixed + i for i in range(start, min(start + per, middle))]
            if n == len(starts) - 1:
                cols += list(range(fixed + middle, len(headers)))
            out += grid([headers[i] for i in cols], ([r[i] for i in cols] for r in rows), left=left)
        if max(map(len, out)) <= width or per == 1:
            return out
    return grid(headers, rows, left=left)


def _left_out_lines(family: dict, width: int) -> list[str]:
    cells = family["left_out"]
    if not cells:
        return []
    first = cells[0]
    text = (f"{LEFT_OUT}: {len(cells)} cell(s) left out by the config, e.g. {first['batch']}x"
            f"{first['kv_len']}: {clip(first.get('reason'), 200)}")
    return wrap("  ", text, width)


def _times_lines(family: dict, batch_buckets: Sequence[int], kv_buckets: Sequence[int],
                 width: int) -> list[str]:
    """The eager picks' measured times (us) in the picks grid's layout."""
    times = {(c["batch"], c["kv_len"]): c["time_us"] for c in family["cells"]}
    left = {(c.get("batch"), c.get("kv_len")) for c in family["left_out"]}
    rows = [[str(b), *(us(times[(b, k)]) if (b, k) in times else LEFT_OUT if (b, k) in left else NO_PICK
                       for k in kv_buckets)] for b in batch_buckets]
    return [f"  the eager picks' times (us), {family['tag']}:",
            *_fitting_grids(["batch", *map(str, kv_buckets)], rows, 1, 0, width, left=0)]


def _family_lines(family: dict, batch_buckets: Sequence[int], kv_buckets: Sequence[int],
                  width: int, times: bool = False) -> list[str]:
    from mla_tune.serving.table import chosen_by

    picks = {(c["batch"], c["kv_len"]): c["variant"] for c in family["cells"]}
    graph = {g["batch"]: g for g in family["graph"]}
    left = {(c.get("batch"), c.get("kv_len")) for c in family["left_out"]}
    labels = _labels([*picks.values(), *(g["variant"] for g in graph.values())])
    counts = (f"{len(picks)} eager picks, {len(family['left_out'])} left out, {len(graph)} graph "
              f"picks, {len(labels)} distinct variants, {family['points']} timed points")
    lines = [*wrap("", f"{family['name']} ({family['tag']}): {counts}", width)]
    if family["candidates"]:
        offered = ", ".join(f"{clip(b, 40)} {clip(n, 10)}" for b, n in family["candidates"].items())
        lines += wrap("  candidates: ", offered, width, sep=", ")
    for variant, reason in family["gate_refused"].items():  # the sweep's gate: never a pick
        lines += wrap("  refused by the gate: ", f"{variant}: {reason}", width)
    rows = []
    missing = 0
    for batch in batch_buckets:
        row = [str(batch)]
        for kv in kv_buckets:
            if (batch, kv) in picks:
                row.append(labels[picks[(batch, kv)]])
            else:
                row.append(LEFT_OUT if (batch, kv) in left else NO_PICK)
                missing += (batch, kv) not in left
        pick = graph.get(batch)
        row += ([labels[pick["variant"]], share(pick["worst_regret"]), chosen_by(_mapping(pick.get("chosen_on")))]
                if pick else [NO_PICK, "-", "-"])
        rows.append(row)
    lines += _fitting_grids(["batch", *map(str, kv_buckets), "graph", "worst", "by"], rows, 1, 3, width, left=0)
    if times:
        lines += _times_lines(family, batch_buckets, kv_buckets, width)
    lines += _left_out_lines(family, width)
    if missing:
        lines.append(f"  {NO_PICK}: {missing} cell(s) with no pick and no reason: the fallback serves them")
    width_label = max((len(x) for x in labels.values()), default=1)
    for variant, label in labels.items():
        lines += variant_lines(f"  {family['tag']} {label.ljust(width_label)}  ", variant, width)
    return lines


def _provenance_lines(prov: Mapping, width: int) -> list[str]:
    gpu, config, rule = _mapping(prov.get("gpu")), _mapping(prov.get("config")), _mapping(prov.get("rule"))
    protocol, search = _mapping(prov.get("protocol")), _mapping(prov.get("search"))
    versions = ", ".join(f"{clip(k, 60)} {clip(v, 60)}" for k, v in _mapping(prov.get("versions")).items() if v)
    tuned = clip(prov.get("date") or "-", 60)
    if prov.get("mla_tune_version"):
        tuned += f" with mla-tune {clip(prov['mla_tune_version'], 40)}"
    repicked = "; ".join(  # the graph picks re-chosen after the sweep (serving/repick.py)
        f"{clip(done.get('replaced'), 10)} re-chosen on {len(done.get('reports') or ())} {what}"
        for what, done in (("verify reports", _mapping(prov.get("graph_repick"))),
                           ("engine loops", _mapping(prov.get("graph_repick_steps")))) if done)
    lines = ["provenance:"]
    for key, text, sep in (
        ("device", f"{clip(gpu.get('device_name') or '-', 80)} ({clip(gpu.get('arch') or '-', 40)}, "
                   f"{clip(gpu.get('sm_count') or '-', 10)} SMs), driver {clip(gpu.get('driver') or '-', 60)}"
                   if gpu else "-", " "),
        ("versions", versions or "-", ", "),
        ("tuned", tuned, " "),
        ("config", f"{clip(config.get('path') or '-', 200)} {clip(config.get('name') or '', 80)} "
                   f"(hash {clip(config.get('hash') or '-', 200)[:12]})", " "),
        ("rule", f"{clip(rule.get('name'), 40)} rtol={clip(rule.get('rtol'), 20)} atol={clip(rule.get('atol'), 20)} "
                 f"allowance={clip(rule.get('allowance'), 20)}", " "),
        ("timing", f"{clip(protocol.get('name') or '-', 60)}; {clip(protocol.get('statistic') or '-', 80)}", " "),
        ("search", ", ".join(f"{clip(k, 40)} {clip(v, 60)}" for k, v in search.items()) or "-", ", "),
        *((("models", f"fitted again {clip(refit.get('date') or '-', 40)} from "
                      f"{', '.join(clip(r, 80) for r in refit.get('results') or ()) or '-'}", " "),)
          if (refit := _mapping(prov.get("models_refit"))) else ()),
        *((("graph picks", repicked, "; "),) if repicked else ()),
    ):
        lines += wrap(f"  {key}: ", " ".join(text.split()), width, sep=sep)
    return lines


LEGEND = ("Each grid: a row per batch bucket, a column per kv bucket; a letter is the family's "
          "eager pick there, its variant under the grid; graph: the batch bucket's CUDA-graph pick, "
          "worst: its largest regret over the kv buckets (a pick chosen on engine loops: its step "
          "over the fastest's there), by: what chose it (the sweep, recorded verify runs, or engine "
          "loops); -: left out, .: no pick. "
          "--times adds each family's grid of times; --json prints every cell with its time "
          "and runner-up.")


def show_lines(table: ServingTable, path: str | Path, width: int, times: bool = False) -> list[str]:
    """`mla-tune show` of a serving table: what it holds, a line per family, each family's
    grid of picks (with `times`, and of their times) with its variants, the provenance, a
    legend."""
    view = show_view(table, path)
    about = f"serving table for {clip(view['gpu'], 40)}, {len(view['families'])} families"
    lines = [f"{clip(path)}: {about}"]
    if len(lines[0]) > width:
        lines = [*wrap("", f"{clip(path)}:", width, sep="/"), about]
    lines += wrap("batch buckets: ", " ".join(map(str, view["batch_buckets"])), width)
    lines += wrap("kv buckets: ", " ".join(map(str, view["kv_buckets"])), width)
    summary = [[f["name"], str(len(f["cells"])), str(len(f["left_out"])), str(len(f["graph"])),
                str(len({c["variant"] for c in f["cells"]} | {g["variant"] for g in f["graph"]})),
                str(f["points"])] for f in view["families"]]
    lines += grid(["family", "eager", "left out", "graph", "variants", "points"], summary)
    for family in view["families"]:
        lines.append("")
        lines += _family_lines(family, view["batch_buckets"], view["kv_buckets"], width, times)
    lines.append("")
    lines += _provenance_lines(_mapping(view["provenance"]), width)
    lines += wrap("", LEGEND, width)
    return lines


# ------------------------------------------------------------------ diff
def _cell_status(key: tuple[int, int], old: Family, new: Family) -> str | None:
    a, b = old.cells.get(key), new.cells.get(key)
    if a is not None and b is not None:
        return "same pick" if a.variant == b.variant else "pick changed"
    gone = {(c.get("batch"), c.get("kv_len")) for c in (new if a is not None else old).left_out}
    if a is not None:
        return "left out in new" if key in gone else "only in old"
    if b is not None:
        return "left out in old" if key in gone else "only in new"
    return None


def _family_diff(key: FamilyKey, old: Family | None, new: Family | None) -> dict:
    from mla_tune.serving.table import Family

    status = "in both" if old and new else "only in new" if old is None else "only in old"
    old, new = old or Family(key), new or Family(key)
    share_ = noise()  # no spread is recorded per cell: the tie tolerance
    cells = []
    for cell_key in sorted(old.cells.keys() | new.cells.keys()):
        a, b = old.cells.get(cell_key), new.cells.get(cell_key)
        change, flagged = time_change(a and a.time_us, b and b.time_us, share_)
        cells.append({"batch": cell_key[0], "kv_len": cell_key[1],
                      "old_pick": a and str(a.variant), "new_pick": b and str(b.variant),
                      "old_us": a and a.time_us, "new_us": b and b.time_us,
                      "change": None if change is None else round(change, 4),
                      "noise": None if change is None else round(share_, 4), "flagged": flagged,
                      "status": _cell_status(cell_key, old, new)})
    graph = []
    for batch in sorted(old.graph.keys() | new.graph.keys()):
        a, b = old.graph.get(batch), new.graph.get(batch)
        graph.append({"batch": batch, "old_pick": a and str(a.variant), "new_pick": b and str(b.variant),
                      "old_worst_regret": a and round(a.worst_regret, 4),
                      "new_worst_regret": b and round(b.worst_regret, 4),
                      "new_chosen_by": b and b.chosen_by,
                      "status": ("only in new" if a is None else "only in old" if b is None else
                                 "same pick" if a.variant == b.variant else "pick changed")})
    return {"family": str(key), "key": key.as_dict(), "tag": key.tag, "status": status,
            "cells": cells, "graph": graph, "points": _points_diff(old, new, share_),
            "calibration": (None if old.calibration == new.calibration
                            else {"old": old.calibration, "new": new.calibration})}


def _points_diff(old: Family, new: Family, share_: float) -> dict:
    """The point entries (a variant's time at a (batch, kv) point, what the eager lookup
    interpolates) in the new table only, in the old only, and in both with a time change
    outside the noise; `of`: the new table's entries."""
    a = {(p, v): t for p, times in old.points.items() for v, t in times.items()}
    b = {(p, v): t for p, times in new.points.items() for v, t in times.items()}
    changed = sum(time_change(a[k], b[k], share_)[1] for k in a.keys() & b.keys())
    return {"added": len(b.keys() - a.keys()), "removed": len(a.keys() - b.keys()), "changed": changed,
            "of": len(b)}


def _points_text(points: dict) -> str:
    return f"+{points['added']} -{points['removed']} ~{points['changed']} of {points['of']}"


def diff_serving(old: ServingTable, new: ServingTable) -> dict:
    """Two serving tables compared: per family (in either), every cell's old and new pick
    and time, the change and whether it is outside the noise, and every graph pick's old
    and new variant and worst regret, and what chose the new one (see the module docstring)."""
    keys = sorted(old.families.keys() | new.families.keys())
    return {"kind": "serving", "old_gpu": old.gpu, "new_gpu": new.gpu, "noise": round(noise(), 4),
            "batch_buckets": {"old": list(old.batch_buckets), "new": list(new.batch_buckets)},
            "kv_buckets": {"old": list(old.kv_buckets), "new": list(new.kv_buckets)},
            "families": [_family_diff(k, old.families.get(k), new.families.get(k)) for k in keys]}


def _changed(family: dict) -> tuple[list[dict], list[dict]]:
    cells = [c for c in family["cells"] if c["status"] != "same pick" or c["flagged"]]
    return cells, [g for g in family["graph"] if g["status"] != "same pick"]


def _estimates_changed(family: dict) -> bool:
    """Whether what the eager lookup reads besides the cells changed: points or calibration."""
    p = family["points"]
    return bool(p["added"] or p["removed"] or p["changed"] or family["calibration"])


def _family_diff_lines(family: dict, width: int) -> list[str]:
    cells, graph = _changed(family)
    used = [v for row in (*cells, *graph) for v in (row["old_pick"], row["new_pick"]) if v]
    labels = _labels(used)
    lines = wrap("", f"{family['family']} ({family['tag']}): {len(cells)} of {len(family['cells'])} "
                     f"cells and {len(graph)} of {len(family['graph'])} graph picks changed; point "
                     f"entries {_points_text(family['points'])}", width)
    for side in ("old", "new") if family["calibration"] else ():
        text = json.dumps(family["calibration"][side], sort_keys=True, separators=(",", ":"))
        lines += wrap(f"  {side} calibration: ", text, width)
    if cells:
        rows = [[f"{c['batch']}x{c['kv_len']}", labels.get(c["old_pick"], "-"), labels.get(c["new_pick"], "-"),
                 us(c["old_us"]), us(c["new_us"]), "-" if c["change"] is None else f"{c['change']:+.1%}",
                 flag_text(c["change"], c["flagged"]), c["status"]]
                for c in cells]
        lines += ["  " + line for line in grid(["cell", "old", "new", "old us", "new us", "change", "flag",
                                                "pick"], rows, left=3)]
    if graph:
        rows = [[str(g["batch"]), labels.get(g["old_pick"], "-"), labels.get(g["new_pick"], "-"),
                 share(g["old_worst_regret"]), share(g["new_worst_regret"]), g["new_chosen_by"] or "-",
                 g["status"]] for g in graph]
        lines += ["  " + line for line in grid(["graph", "old", "new", "old worst", "new worst", "new by", "pick"],
                                               rows, left=3)]
    width_label = max((len(x) for x in labels.values()), default=1)
    for variant, label in labels.items():
        lines += variant_lines(f"  {family['tag']} {label.ljust(width_label)}  ", variant, width)
    return lines


def serving_diff_lines(diff: dict, old_path: str | Path, new_path: str | Path, width: int) -> list[str]:
    """The text view of diff_serving: totals, a line per family, then each family that
    changed: its changed cells and graph picks (labels as in show) and their variants."""
    families = diff["families"]
    changed = {f["family"]: _changed(f) for f in families}
    n_cells = sum(len(f["cells"]) for f in families)
    n_picks = sum(c["status"] != "same pick" for f in families for c in f["cells"])
    n_flagged = sum(c["flagged"] for f in families for c in f["cells"])
    n_graph = sum(len(f["graph"]) for f in families)
    n_graph_changed = sum(len(g) for _, g in changed.values())
    one_side = sum(f["status"] != "in both" for f in families)
    points = {k: sum(f["points"][k] for f in families) for k in ("added", "removed", "changed", "of")}
    calibrated = sum(bool(f["calibration"]) for f in families)
    lines = [*wrap("old: ", clip(old_path), width), *wrap("new: ", clip(new_path), width)]
    lines += wrap("", f"serving tables for {clip(diff['old_gpu'], 40)} and {clip(diff['new_gpu'], 40)}: "
                      f"{len(families)} families ({one_side} in one table only), {n_cells} cells: {n_picks} "
                      f"with another pick (or in one table only), {n_flagged} with a time change outside "
                      f"the noise ({share(diff['noise'])}: a serving table records no spread); {n_graph} "
                      f"graph picks: {n_graph_changed} changed; point entries (what the eager "
                      f"lookup interpolates: + new, - gone, ~ a time change outside the noise) "
                      f"{_points_text(points)}; calibration changed in {calibrated} families; times "
                      f"in us", width)
    for name in ("batch_buckets", "kv_buckets"):
        if diff[name]["old"] != diff[name]["new"]:
            lines += wrap(f"{name.replace('_', ' ')}: ", f"old {' '.join(map(str, diff[name]['old']))}; "
                                                         f"new {' '.join(map(str, diff[name]['new']))}", width)
    rows = [[f["family"], f["status"], str(len(changed[f["family"]][0])), str(len(changed[f["family"]][1]))]
            for f in families]
    lines += grid(["family", "table", "cells changed", "graph changed"], rows, left=2)
    for family in families:
        if family["status"] == "in both" and (any(changed[family["family"]]) or _estimates_changed(family)):
            lines.append("")
            lines += _family_diff_lines(family, width)
    return lines
