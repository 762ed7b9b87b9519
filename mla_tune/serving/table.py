"""The serving table (`tables/NAME.serving.yaml`): tuned picks for an engine's decode calls.

The leaderboard table (tables/table.py) knows 8 exact shapes. An engine's calls differ in
every step, so the serving table is keyed the way engines capture and batch their calls:

- a *family* is matched exactly: what changes the kernel or its correctness (KV format,
  page size, heads, q_len);
- the batch goes up to the smallest *batch bucket* at or above it (engines pad a batch to
  their CUDA-graph capture sizes); above the largest bucket, the largest;
- eager calls take the *kv bucket* nearest (in log scale) to the batch's mean length;
- where the table holds the eager picks' measured times (the family's *points*: every
  timed batch bucket, each bucket's smallest batch with search.batch_edge, and kv bucket),
  an eager call instead takes the variant estimated fastest at its own batch and lengths
  (serving/estimate.py): interpolated between the points, and, for a variant whose backend
  owns a schedule model (the family's *models*, fitted when the table is built), that
  model's estimate over its backend's schedule for the call's own lengths. The cell is what
  a table without points uses;
- a CUDA graph cannot depend on kv_len (the lengths are data), so each batch bucket also has
  one *graph pick*: the variant whose worst regret over the family's kv buckets is smallest
  (a worst case, not a mean: a pick tuned for long contexts can lose badly at short ones),
  or, where recorded verify runs show another variant clearly better over that bucket's
  uniform and ragged shapes, that one (serving/repick.py: `mla-tune verify --rescore
  REPORTS --repick-graph OUT`).

Split counts are not table entries: a variant carries its rule (max_splits,
tokens_per_split), which the kernel applies to each sequence on the device.

Schema `serving/6` (the only one read: a table of an older schema is refused with the
command that rebuilds it), top level: `schema`, `gpu`, `provenance`, `batch_buckets`,
`kv_buckets`, `families`. A family is `{key: {kv_format, page_size, heads, q_len}, cells:
[...], graph: [...], left_out: [...], variants: [...], points: [...], models?: [...],
calibration?: {...}}`; `variants` lists the family's eager picks and a point `{batch,
kv_len, us: {index in variants: median us}}` holds the ones the sweep timed there with its
last rung's samples; a model is `{backend, variant, ...}`, the rest of its fields its
backend's schedule module's (backends.schedule_module: `load` reads them); `calibration`
maps a backend to what its schedule module's `load_calibration` reads (the split-K
reduction's measured cost per step, serving/calibrate.py); a cell `{batch, kv_len,
variant, time_us, runner_up?}`; a graph pick `{batch, variant, worst_regret, worst_kv_len,
chosen_on?}` (worst_kv_len 0: the sweep's ragged mix for the bucket, or a ragged shape;
chosen_on: the pick was chosen on recorded verify runs, or on engine loops, whose report
names it then lists as engine_loops, an optional key added in serving/6 on 2026-12-06 that
an mla-tune of before then refuses; serving/repick.py); a left-out cell
`{batch, kv_len, reason}`. `provenance.entry_counts` (written since 2026-12-05, optional at
load) counts the families and, over all of them, each part's entries (ENTRY_PARTS): it sits
above the families, so a file cut between entries, or entries removed by hand, is refused at
load rather than read as a smaller table. `provenance.gate_refused` (written since 2026-12-06,
optional) maps a family to the variants the sweep's gate refused and why (gate_refused): a
graph pick's re-choice takes none of them. Loading never executes anything from the file
(fileio.read_yaml) and every error names the file, the family and the field.
Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_tune.backends import known_backends, schedule_module
from mla_tune.core import CallSpec, Variant
from mla_tune.fileio import FlowMap, atomic_write_text, dump_yaml, read_yaml
from mla_tune.serving.estimate import Estimator, fastest, model_order
from mla_tune.tables.table import TableError, check_variant_field

SERVING_SCHEMA = "serving/6"
# A graph pick chosen on recorded verify runs says so (serving/repick.py): how many reports
# and shapes, its geomean regret there, and the sweep's pick with its geomean regret there.
CHOSEN_ON_FIELDS = ("reports", "shapes", "geomean_regret", "sweep_pick", "sweep_geomean_regret")
# A pick chosen on engine loops (repick_graph_on_steps) adds the loops' report names: the
# protocol graph picks are judged by, which a re-choice on verify runs leaves alone.
CHOSEN_ON_LOOPS = "engine_loops"
_KEY_FIELDS = ("kv_format", "page_size", "heads", "q_len")
# The parts of a family whose entries provenance.entry_counts counts (calibration: its
# backends' fields), beside the families themselves.
ENTRY_PARTS = ("cells", "graph", "left_out", "variants", "points", "models", "calibration")


@dataclass(frozen=True, order=True)
class FamilyKey:
    """What a serving call must match exactly: these change the kernel or its correctness."""

    kv_format: str
    page_size: int  # 0: contiguous KV
    heads: int
    q_len: int  # the call's max_q_len

    @classmethod
    def of(cls, spec: CallSpec) -> FamilyKey:
        return cls(spec.kv_format, spec.page_size, spec.heads, spec.max_q_len)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in _KEY_FIELDS}

    def __str__(self) -> str:
        layout = "contiguous" if self.page_size == 0 else f"page {self.page_size}"
        return f"{self.kv_format} KV, {layout}, {self.heads} heads, q_len {self.q_len}"

    @property
    def tag(self) -> str:
        """The family in a few characters: fp8/p64/h16/q1 (page 0, contiguous KV:
        fp8/contig/h16/q1)."""
        page = "contig" if self.page_size == 0 else f"p{self.page_size}"
        return f"{self.kv_format}/{page}/h{self.heads}/q{self.q_len}"


@dataclass(frozen=True)
class Cell:
    batch: int
    kv_len: int
    variant: Variant
    time_us: float
    runner_up: dict | None = None  # {variant, time_us}

    @property
    def runner_up_variant(self) -> Variant | None:
        """The runner-up's variant (parsed where the entry holds its text), None without one."""
        variant = (self.runner_up or {}).get("variant")
        return Variant.parse(variant) if isinstance(variant, str) else variant


@dataclass(frozen=True)
class GraphPick:
    batch: int
    variant: Variant
    worst_regret: float  # max over the kv buckets (and the ragged mix) of time / best there - 1
    worst_kv_len: int  # where that worst case is; 0: the bucket's ragged mix
    # Where the pick was chosen on recorded verify runs or engine loops (serving/repick.py)
    # instead of the sweep's cells: {reports, shapes, geomean_regret, sweep_pick,
    # sweep_geomean_regret, engine_loops?}
    chosen_on: dict | None = None

    @property
    def chosen_by(self) -> str:
        return chosen_by(self.chosen_on)


def chosen_by(chosen_on: Mapping | None) -> str:
    """What chose a graph pick, from its chosen_on: "sweep" (none), "loops" (engine loops:
    CHOSEN_ON_LOOPS), else "runs" (recorded verify runs)."""
    return "sweep" if not chosen_on else "loops" if CHOSEN_ON_LOOPS in chosen_on else "runs"


@dataclass
class Family:
    key: FamilyKey
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)
    graph: dict[int, GraphPick] = field(default_factory=dict)
    left_out: list[dict] = field(default_factory=list)  # {batch, kv_len, reason}
    # (batch, kv_len) -> {variant: median us}: the eager picks' times where the sweep timed them
    points: dict[tuple[int, int], dict[Variant, float]] = field(default_factory=dict)
    # variant -> its backend's schedule model (serving/estimate.py), in the order they apply
    models: dict[Variant, Any] = field(default_factory=dict)
    # backend -> its schedule module's calibration (the split-K reduction's cost per step)
    calibration: dict[str, dict] = field(default_factory=dict)


# ------------------------------------------------------------------ bucket rules
def batch_bucket(buckets: list[int], batch: int) -> int:
    """The smallest bucket >= batch (engines pad up to a capture size); the largest above all."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[min(i, len(buckets) - 1)]


def kv_bucket(buckets: list[int], kv_len: float) -> int:
    """The bucket nearest to kv_len in log scale (each bucket serves the lengths between the
    geometric midpoints with its neighbours); the end buckets serve everything beyond."""
    if kv_len <= buckets[0]:
        return buckets[0]
    i = bisect.bisect_left(buckets, kv_len)
    if i == len(buckets):
        return buckets[-1]
    lo, hi = buckets[i - 1], buckets[i]
    return lo if kv_len < math.sqrt(lo * hi) else hi


def gate_refused(table: ServingTable, key: FamilyKey) -> dict[str, str]:
    """The variants the sweep's correctness gate refused for family `key`, each with the
    gate's reason: provenance.gate_refused (by family, as str(key)), {} where it has none. A
    graph pick is never one of them (serving/repick.py)."""
    return _gate_refusals(table.path, table.provenance).get(str(key), {})


def _gate_refusals(where: Any, provenance: Mapping) -> dict[str, dict[str, str]]:
    """provenance.gate_refused, checked ({} where absent): load_serving_table's check, and
    gate_refused's for a table made in memory."""
    refused = provenance.get("gate_refused") or {}
    if not (isinstance(refused, dict) and all(
            isinstance(family, str) and isinstance(by, dict)
            and all(isinstance(v, str) and isinstance(r, str) for v, r in by.items())
            for family, by in refused.items())):
        raise TableError(f"{where}: provenance.gate_refused must map variants to reasons, per family "
                         "(mla-tune sweep writes it), or be absent")
    return refused


def kv_bucket_edges(buckets: list[int]) -> list[float]:
    """The lengths where kv_bucket moves to the next bucket (its geometric midpoints):
    kv_bucket(buckets, x) == buckets[bisect.bisect_right(edges, x)] for every x, one bisect
    where a step looks a bucket up many times."""
    return [math.sqrt(lo * hi) for lo, hi in zip(buckets[:-1], buckets[1:], strict=True)]


def choose_graph_pick(times: Mapping[Variant, Mapping[int, float]],
                      best: Mapping[int, float]) -> tuple[Variant, float, int] | None:
    """(variant, worst regret, kv_len of the worst case) of the variant whose largest regret
    over the kv buckets in `best` (kv_len -> the best time measured there; the sweep adds
    its ragged mix as kv_len 0) is smallest.
    Only variants timed at every one of those kv buckets compete; ties go to the first
    offered. None when no variant was timed everywhere."""
    chosen = None
    for variant, by_kv in times.items():
        if any(kv not in by_kv for kv in best):
            continue
        regret, worst_kv = max((by_kv[kv] / best[kv] - 1.0, kv) for kv in best)
        if chosen is None or regret < chosen[1]:
            chosen = (variant, regret, worst_kv)
    return chosen


# ------------------------------------------------------------------ the table
@dataclass
class ServingTable:
    gpu: str
    provenance: dict
    batch_buckets: list[int]
    kv_buckets: list[int]
    families: dict[FamilyKey, Family]
    path: Path | None = None
    estimator: Estimator = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.estimator = Estimator(self)

    def family(self, spec: CallSpec) -> Family | None:
        return self.families.get(FamilyKey.of(spec))

    def lookup(self, spec: CallSpec, batch: int, mean_kv_len: float | None = None,
               graph: bool = False, kv_lens: Sequence[int] | None = None) -> Variant | None:
        """The variant for a call (no timing):
        - graph=True, or no mean length given: the graph pick of the batch's bucket;
        - else, where the family has points: the variant estimated fastest at the call's
          own batch and lengths (serving/estimate.py: interpolated over the points,
          memoized per (batch, kv_len to ~1%), and each schedule model's estimate over its
          backend's schedule for `kv_lens`, the call's lengths; without them, `batch`
          sequences of the mean);
        - else (no points, or no variant estimated around the call) the cell of
          its batch and kv buckets. A cell a config rule left out (a batch of
          26 at 51k tokens fits, its bucket's 32 x 65536 does not) gives way to the largest
          smaller batch bucket's cell at the same kv bucket: the call's own batch lies
          between the two, while the bucket's own cells at other lengths were tuned for
          another balance of work. Else the batch bucket's measured cell nearest in log
          kv_len, else its graph pick.
        None when the family is not in the table or the bucket has nothing: the caller runs
        its fallback."""
        family = self.family(spec)
        if family is None:
            return None
        bucket = batch_bucket(self.batch_buckets, batch)
        pick = family.graph.get(bucket)
        if graph or mean_kv_len is None:
            return pick.variant if pick is not None else None
        chosen = fastest(self.estimator.estimates(family, batch, mean_kv_len, kv_lens)) if family.points else None
        if chosen is not None:
            return chosen
        kv = kv_bucket(self.kv_buckets, mean_kv_len)
        cell = family.cells.get((bucket, kv))
        if cell is None:  # left out: a smaller batch bucket at this kv, else the bucket's nearest kv
            below = [b for (b, k) in family.cells if k == kv and b < bucket]
            near = [k for (b, k) in family.cells if b == bucket]
            if below:
                cell = family.cells[(max(below), kv)]
            elif near:
                cell = family.cells[(bucket, min(near, key=lambda k: (abs(math.log(k / kv)), k)))]
        if cell is not None:
            return cell.variant
        return pick.variant if pick is not None else None

    def plan_pick(self, spec: CallSpec, batch: int, runs: Callable[[Variant], bool],
                  mean_kv_len: float | None = None, kv_lens: Sequence[int] | None = None) -> Variant | None:
        """What a DecodePlan for `spec` that can run only the variants `runs` accepts steps
        with (serving/decode_plan.py, pick): the lookup's pick where it runs; else the
        fastest estimate that runs, else the cell's runner-up where it runs; None where the
        plan runs its default (no family, no pick, or none of these runs). With every
        variant running, `lookup`'s pick. For scoring a table as a machine without some
        backends would run it (`mla-tune verify --rescore --unrunnable`)."""
        family = self.family(spec)
        if family is None:
            return None
        mean = None if spec.graph else mean_kv_len
        pick, runnable = None, None
        if mean is not None and family.points:
            pick, runnable = self.estimator.pick(family, batch, mean, kv_lens, self.estimator.allowed(family, runs))
        if pick is None:
            pick = self.lookup(spec, batch, mean, graph=spec.graph, kv_lens=kv_lens)
        if pick is None or runs(pick):
            return pick
        if runnable is not None or mean is None:
            return runnable
        cell = family.cells.get((batch_bucket(self.batch_buckets, batch), kv_bucket(self.kv_buckets, mean)))
        runner_up = cell.runner_up_variant if cell is not None else None
        return runner_up if runner_up is not None and runs(runner_up) else None

    def prepare(self, spec: CallSpec) -> None:
        """The eager lookup's one-off work for the spec's family (Estimator.prepare), so
        that none is left for a step."""
        family = self.family(spec)
        if family is not None:
            self.estimator.prepare(family)

    def estimates(self, spec: CallSpec, batch: int, mean_kv_len: float,
                  kv_lens: Sequence[int] | None = None) -> dict[Variant, float]:
        """Every point variant's estimated time (us) for the call, as `lookup` weighs them."""
        family = self.family(spec)
        if family is None or not family.points:
            return {}
        return self.estimator.estimates(family, batch, mean_kv_len, kv_lens)

    def model_estimates(self, spec: CallSpec, kv_lens: Sequence[int], calibrated: bool = True) -> dict[Variant, float]:
        """Each schedule model's own estimate (us) for a call of these lengths, whether or
        not it is near the best (Estimator.model_estimates)."""
        family = self.family(spec)
        if family is None:
            return {}
        return self.estimator.model_estimates(family, kv_lens, calibrated)

    def as_dict(self) -> dict:
        families = []
        for key in sorted(self.families):
            fam = self.families[key]
            families.append({
                "key": key.as_dict(),
                "cells": [_cell_dict(c) for _, c in sorted(fam.cells.items())],
                "graph": [{"batch": g.batch, "variant": str(g.variant),
                           "worst_regret": round(g.worst_regret, 4), "worst_kv_len": g.worst_kv_len,
                           **({"chosen_on": FlowMap(g.chosen_on)} if g.chosen_on else {})}
                          for _, g in sorted(fam.graph.items())],
                "left_out": sorted(fam.left_out, key=lambda c: (c["batch"], c["kv_len"])),
                **_points_dict(fam.points),
                **_models_dict(fam.models),
                **_calibration_dict(fam.calibration),
            })
        provenance = _provenance_dict(self.provenance)
        provenance["entry_counts"] = entry_counts(families)  # above the families in the file
        return {"schema": SERVING_SCHEMA, "gpu": self.gpu, "provenance": provenance,
                "batch_buckets": list(self.batch_buckets), "kv_buckets": list(self.kv_buckets),
                "families": families}


def entry_counts(families: list[dict]) -> dict[str, int]:
    """How many families the file's `families` list holds and, over them all, each part's
    entries (ENTRY_PARTS; a family's calibration: its backends' fields): what
    provenance.entry_counts states. The families are as_dict's, or a loaded file's once
    checked."""
    def size(family: dict, part: str) -> int:
        if part == "calibration":
            return sum(len(fields) for fields in (family.get(part) or {}).values())
        return len(family.get(part) or ())
    return {"families": len(families), **{part: sum(size(f, part) for f in families) for part in ENTRY_PARTS}}


def _provenance_dict(provenance: Any, key: str = "") -> Any:
    """The provenance as written: a `probes` list (serving/calibrate.py's) one probe a line,
    as calibrate writes it, so that a table read and written again keeps its layout."""
    if isinstance(provenance, dict):
        return {k: _provenance_dict(v, k) for k, v in provenance.items()}
    if key == "probes" and isinstance(provenance, list) and all(isinstance(v, dict) for v in provenance):
        return [FlowMap((k, FlowMap(v) if isinstance(v, dict) else v) for k, v in item.items()) for item in provenance]
    return provenance


def _cell_dict(cell: Cell) -> dict:
    out = {"batch": cell.batch, "kv_len": cell.kv_len, "variant": str(cell.variant),
           "time_us": round(cell.time_us, 3)}
    if cell.runner_up:
        out["runner_up"] = cell.runner_up
    return out


def _points_dict(points: Mapping[tuple[int, int], Mapping[Variant, float]]) -> dict:
    if not points:
        return {}
    variants = sorted({v for times in points.values() for v in times}, key=str)
    index = {v: i for i, v in enumerate(variants)}
    return {"variants": [str(v) for v in variants],
            "points": [FlowMap(batch=b, kv_len=k,
                               us=FlowMap(sorted((index[v], round(t, 3)) for v, t in points[(b, k)].items())))
                       for b, k in sorted(points)]}


def _models_dict(models: Mapping[Variant, Any]) -> dict:
    if not models:
        return {}
    out = []
    for v, m in models.items():
        out.append({"backend": v.backend, **m.as_dict()})
    return {"models": out}


def _calibration_dict(calibration: Mapping[str, dict]) -> dict:
    if not calibration:
        return {}
    return {"calibration": {backend: {name: FlowMap(sorted(value.items())) if isinstance(value, dict) else value
                                      for name, value in fields.items()}
                            for backend, fields in sorted(calibration.items())}}


def write_serving_table(path: str | Path, table: ServingTable) -> Path:
    header = (f"# mla-tune serving table for {table.gpu} (schema {SERVING_SCHEMA}); written by "
              "mla-tune, reviewed by people: see mla_tune/serving/table.py\n")
    return atomic_write_text(path, header + dump_yaml(table.as_dict()))


# ------------------------------------------------------------------ loading
def _positive_ints(where: str, name: str, value: Any) -> list[int]:
    ok = (isinstance(value, list) and value
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
          and value == sorted(set(value)))
    if not ok:
        raise TableError(f"{where}: {name} must be a non-empty increasing list of positive "
                         f"integers, got {value!r:.80}")
    return list(value)


def _positive_int(where: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise TableError(f"{where}: {name} must be {what}, got {value!r:.20}")
    return value


def _number(where: str, name: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise TableError(f"{where}: {name} must be a finite number >= {minimum}, got {value!r:.40}")
    return float(value)


def _key(where: str, raw: Any) -> FamilyKey:
    if not isinstance(raw, dict) or set(raw) != set(_KEY_FIELDS):
        raise TableError(f"{where}: key must be a mapping of exactly {', '.join(_KEY_FIELDS)}, "
                         f"got {raw!r:.120}")
    try:
        spec = CallSpec(raw["kv_format"], raw["page_size"], raw["heads"], raw["q_len"])
    except (ValueError, TypeError) as exc:
        raise TableError(f"{where}: key: {exc}") from exc
    return FamilyKey.of(spec)


def _entries(where: str, raw: dict, name: str) -> list:
    value = raw.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise TableError(f"{where}: {name} must be a list of mappings")
    return value


def _family(path: Path, index: int, raw: Any, batch_buckets: list[int], kv_buckets: list[int],
            known: list[str], check_params: bool) -> Family:
    where = f"serving table {path}, family {index}"
    if not isinstance(raw, dict):
        raise TableError(f"{where} must be a mapping with key, cells, graph, left_out")
    unknown = set(raw) - {"key", "cells", "graph", "left_out", "variants", "points", "models", "calibration"}
    if unknown:
        raise TableError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    family = Family(_key(where, raw.get("key")))
    where = f"serving table {path}, family {index} ({family.key})"

    def bucketed(at: str, entry: dict, need_kv: bool) -> tuple[int, int | None]:
        batch = entry.get("batch")
        if batch not in batch_buckets:
            raise TableError(f"{at}: batch {batch!r:.20} is not one of the batch_buckets {batch_buckets}")
        if not need_kv:
            return batch, None
        kv_len = entry.get("kv_len")
        if kv_len not in kv_buckets:
            raise TableError(f"{at}: kv_len {kv_len!r:.20} is not one of the kv_buckets {kv_buckets}")
        return batch, kv_len

    for i, entry in enumerate(_entries(where, raw, "cells")):
        at = f"{where}, cell {i}"
        batch, kv_len = bucketed(at, entry, True)
        if (batch, kv_len) in family.cells:
            raise TableError(f"{at}: a second cell for batch {batch}, kv_len {kv_len}")
        variant = check_variant_field(at, "variant", {"variant": entry.get("variant")}, known, check_params)
        _match_family(at, variant, family.key)
        runner_up = entry.get("runner_up")
        if runner_up is not None:
            if not (isinstance(runner_up, dict) and set(runner_up) == {"variant", "time_us"}):
                raise TableError(f"{at}: runner_up must be a mapping of variant and time_us, or absent")
            check_variant_field(at, "runner_up", runner_up, known, check_params)
            _number(f"{at}, runner_up", "time_us", runner_up["time_us"])
        family.cells[(batch, kv_len)] = Cell(batch, kv_len, variant,
                                             _number(at, "time_us", entry.get("time_us")), runner_up)
    for i, entry in enumerate(_entries(where, raw, "graph")):
        at = f"{where}, graph pick {i}"
        batch, _ = bucketed(at, entry, False)
        if batch in family.graph:
            raise TableError(f"{at}: a second graph pick for batch {batch}")
        variant = check_variant_field(at, "variant", {"variant": entry.get("variant")}, known, check_params)
        _match_family(at, variant, family.key)
        worst_kv = entry.get("worst_kv_len")
        if worst_kv not in kv_buckets and worst_kv != 0:  # 0: the bucket's ragged mix
            raise TableError(f"{at}: worst_kv_len {worst_kv!r:.20} is neither one of the kv_buckets "
                             "nor 0 (the ragged mix)")
        chosen_on = entry.get("chosen_on")
        if chosen_on is not None and not (isinstance(chosen_on, dict)
                                          and set(chosen_on) - {CHOSEN_ON_LOOPS} == set(CHOSEN_ON_FIELDS)
                                          and isinstance(loops := chosen_on.get(CHOSEN_ON_LOOPS, []), list)
                                          and all(isinstance(n, str) for n in loops)):
            raise TableError(f"{at}: chosen_on must be a mapping of {', '.join(CHOSEN_ON_FIELDS)} "
                             f"(and {CHOSEN_ON_LOOPS}, a list of report names; serving/repick.py writes it), "
                             "or absent")
        family.graph[batch] = GraphPick(batch, variant,
                                        _number(at, "worst_regret", entry.get("worst_regret")), worst_kv,
                                        dict(chosen_on) if chosen_on is not None else None)
    for i, entry in enumerate(_entries(where, raw, "left_out")):
        at = f"{where}, left_out {i}"
        bucketed(at, entry, True)
        if not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
            raise TableError(f"{at}: a left-out cell must say why (reason)")
        family.left_out.append(dict(entry))
    family.points = _points(where, raw, kv_buckets, known, check_params, family.key)
    family.models = _models(where, raw, known, check_params, family.key)
    family.calibration = _calibration(where, raw.get("calibration"))
    return family


class _Check:
    """The field checks a schedule module's `load` gets: each error a TableError naming the
    file, the family and the entry (`where`)."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, message: str):
        raise TableError(f"{self.where}: {message}")

    def number(self, name: str, value: Any, minimum: float | None = 0.0) -> float:
        if minimum is None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                self.fail(f"{name} must be a finite number, got {value!r:.40}")
            return float(value)
        return _number(self.where, name, value, minimum)

    def positive_int(self, name: str, value: Any, minimum: int = 1) -> int:
        return _positive_int(self.where, name, value, minimum)


def _models(where: str, raw: dict, known: list[str], check_params: bool, key: FamilyKey) -> dict[Variant, Any]:
    models: dict[Variant, Any] = {}
    for i, entry in enumerate(_entries(where, raw, "models")):
        at = f"{where}, models[{i}]"
        backend = entry.get("backend")
        module = schedule_module(backend) if isinstance(backend, str) else None
        if module is None:
            raise TableError(f"{at}: backend {backend!r:.40} has no schedule model in this mla-tune "
                             "(backends.schedule_module); re-build the table (mla-tune sweep --merge)")
        fields = {k: v for k, v in entry.items() if k != "backend"}
        variant = check_variant_field(at, "variant", fields, known, check_params)
        _match_family(at, variant, key)
        if variant.backend != backend:
            raise TableError(f"{at}: a {backend} model, but variant is {variant}")
        if variant in models:
            raise TableError(f"{at}: a second model for {variant}")
        models[variant] = module.load(fields, variant, key, _Check(at))
    return model_order(models)


def _calibration(where: str, raw: Any) -> dict[str, dict]:
    if raw is None:
        return {}
    at = f"{where}, calibration"
    if not isinstance(raw, dict):
        raise TableError(f"{at} must map backends to their calibration")
    out = {}
    for backend, fields in raw.items():
        read = getattr(schedule_module(backend) if isinstance(backend, str) else None, "load_calibration", None)
        if read is None:
            raise TableError(f"{at}: backend {backend!r:.40} has no calibration in this mla-tune; "
                             "re-build the table (mla-tune sweep --merge)")
        out[backend] = read(fields, _Check(f"{at}.{backend}"))
    return out


def _points(where: str, raw: dict, kv_buckets: list[int], known: list[str], check_params: bool,
            key: FamilyKey) -> dict[tuple[int, int], dict[Variant, float]]:
    names = raw.get("variants", [])
    if not isinstance(names, list):
        raise TableError(f"{where}: variants must be a list of variant strings")
    variants = []
    for i, name in enumerate(names):
        at = f"{where}, variants[{i}]"
        variant = check_variant_field(at, "variant", {"variant": name}, known, check_params)
        _match_family(at, variant, key)
        variants.append(variant)
    points: dict[tuple[int, int], dict[Variant, float]] = {}
    for i, entry in enumerate(_entries(where, raw, "points")):
        at = f"{where}, point {i}"
        batch, kv_len, us = _positive_int(at, "batch", entry.get("batch")), entry.get("kv_len"), entry.get("us")
        if kv_len not in kv_buckets:
            raise TableError(f"{at}: kv_len {kv_len!r:.20} is not one of the kv_buckets {kv_buckets}")
        if (batch, kv_len) in points:
            raise TableError(f"{at}: a second point for batch {batch}, kv_len {kv_len}")
        if not isinstance(us, dict) or not us:
            raise TableError(f"{at}: us must map indexes into variants to times in us")
        times = {}
        for j, t in us.items():
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(variants):
                raise TableError(f"{at}: us has key {j!r:.20}, not an index into the family's "
                                 f"{len(variants)} variants")
            if _number(at, f"us[{j}]", t) == 0:
                raise TableError(f"{at}: us[{j}] is 0; a measured time is positive")
            times[variants[j]] = float(t)
        points[(batch, kv_len)] = times
    return points


def _match_family(where: str, variant: Variant, key: FamilyKey) -> None:
    if variant.get("kv") != key.kv_format:
        raise TableError(f"{where}: {variant} reads kv={variant.get('kv')}, but the family's "
                         f"KV format is {key.kv_format}")


def load_serving_table(path: str | Path, check_params: bool = True) -> ServingTable:
    """Read and check a serving table; every error is a TableError naming file, family, field."""
    path = Path(path)
    raw = read_yaml(path, "serving table", TableError,
                    missing_hint="make one with `mla-tune sweep --config configs/serving.yaml`, "
                                 "or pass the path of an existing file")
    where = f"serving table {path}"
    if not isinstance(raw, dict):
        raise TableError(f"{where} must be a mapping (schema, gpu, provenance, batch_buckets, "
                         "kv_buckets, families)")
    if raw.get("schema") != SERVING_SCHEMA and isinstance(raw.get("rows"), list):
        raise TableError(f"{where} is a leaderboard table (schema {raw.get('schema')!r:.40}, per-shape "
                         "winners), not a serving table; pass a serving table (tables/NAME.serving.yaml)")
    if raw.get("schema") != SERVING_SCHEMA:
        raise TableError(f"{where}: schema is {raw.get('schema')!r:.40}, this mla-tune reads {SERVING_SCHEMA!r}; "
                         "rebuild it with this version (mla-tune sweep --config configs/serving.yaml "
                         "--gpu NAME resumes from its results file)")
    gpu = raw.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise TableError(f"{where}: gpu must name the GPU the table was tuned on")
    provenance = raw.get("provenance") or {}
    if not isinstance(provenance, dict):
        raise TableError(f"{where}: provenance must be a mapping")
    batch_buckets = _positive_ints(where, "batch_buckets", raw.get("batch_buckets"))
    kv_buckets = _positive_ints(where, "kv_buckets", raw.get("kv_buckets"))
    if not isinstance(raw.get("families"), list):
        raise TableError(f"{where}: families must be a list")
    known = known_backends()
    families: dict[FamilyKey, Family] = {}
    for i, item in enumerate(raw["families"]):
        family = _family(path, i, item, batch_buckets, kv_buckets, known, check_params)
        if family.key in families:
            raise TableError(f"{where}, family {i}: a second family for {family.key}")
        families[family.key] = family
    stated = provenance.get("entry_counts")
    if stated is not None:
        held = entry_counts(raw["families"])
        if not isinstance(stated, dict) or set(stated) != set(held):
            raise TableError(f"{where}: provenance.entry_counts must map {', '.join(held)} to counts "
                             "(mla-tune writes it), or be absent")
        wrong = [f"{part} {held[part]} (stated {stated[part]!r:.20})" for part in held
                 if isinstance(stated[part], bool) or stated[part] != held[part]]
        if wrong:
            raise TableError(f"{where}: holds {', '.join(wrong)}, not what its provenance.entry_counts "
                             "states: the file was cut short or entries were removed; restore it (git) or "
                             "build it again (mla-tune sweep --config configs/serving.yaml --merge RESULTS)")
    _gate_refusals(where, provenance)
    return ServingTable(gpu, provenance, batch_buckets, kv_buckets, families, path)
