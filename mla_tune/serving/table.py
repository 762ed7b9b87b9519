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
  an eager call instead takes the variant estimated fastest at its own batch and lengths:
  interpolated between the points (`interpolate`); our split-K kernel's as a fitted
  overhead plus its interpolated rate times the call's own schedule (`SplitKModel`,
  serving/splitk_cost.py), plus the measured cost of the reduction steps a long sequence
  adds (`reduce_step_us`), never far under the interpolation (SPLITK_FLOOR), and
  FlashInfer's from a model over its schedule for the call's lengths (`VendorModel`,
  serving/vendor_cost.py), since both step inside a bucket where their programs overflow the
  SMs, and in ragged batches. The cell is what a table
  without points uses;
- a CUDA graph cannot depend on kv_len (the lengths are data), so each batch bucket also has
  one *graph pick*: the variant whose worst regret over the family's kv buckets is smallest
  (a worst case, not a mean: a pick tuned for long contexts can lose badly at short ones).

Split counts are not table entries: a variant carries its rule (max_splits,
tokens_per_split), which the kernel applies to each sequence on the device.

Schema `serving/5` (the only one read: a table of an older schema is refused with the
command that rebuilds it), top level: `schema`, `gpu`, `provenance`, `batch_buckets`,
`kv_buckets`, `families`. A family is `{key: {kv_format, page_size, heads, q_len}, cells:
[...], graph: [...], left_out: [...], variants: [...], points: [...], flashinfer_model?,
splitk_models?, reduce_step_us?}`; `variants` lists the family's eager picks and a point
`{batch, kv_len, us: {index in variants: median us}}` holds the ones the sweep timed there
with its last rung's samples; `flashinfer_model` is `{variant, sm_count, features, coef,
fit_error_p90}`; a split-K model `{variant, occupancy, overhead_us, item_tokens, sm_count,
fit_error}`; `reduce_step_us` maps the splits the split-K reduction adds per step (16, or
64 in its wide grid) to the measured cost of a step in us (tune/serving_calibrate.py); a
cell `{batch, kv_len, variant, time_us, runner_up?}`; a graph pick `{batch, variant, worst_regret,
worst_kv_len}` (worst_kv_len 0: the sweep's ragged mix for the bucket); a left-out cell
`{batch, kv_len, reason}`. Loading never executes anything from the file
(fileio.read_yaml) and every error names the file, the family and the field.
Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_tune.backends import known_backends
from mla_tune.core import CallSpec, Variant
from mla_tune.fileio import FlowMap, atomic_write_text, dump_yaml, read_yaml
from mla_tune.kernels.split_rule import REDUCE_SPLITS_PER_STEP, reduce_splits_per_step
from mla_tune.serving.splitk_cost import is_splitk, lengths, splitk_schedule, uniform_reduce_steps
from mla_tune.serving.vendor_cost import (
    FLASHINFER_FEATURES,
    flashinfer_mla_features,
    flashinfer_mla_works_per_cluster,
    predict,
)
from mla_tune.tables.table import TableError, check_variant_field

SERVING_SCHEMA = "serving/5"
_KEY_FIELDS = ("kv_format", "page_size", "heads", "q_len")


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


@dataclass(frozen=True)
class Cell:
    batch: int
    kv_len: int
    variant: Variant
    time_us: float
    runner_up: dict | None = None  # {variant, time_us}


@dataclass(frozen=True)
class GraphPick:
    batch: int
    variant: Variant
    worst_regret: float  # max over the kv buckets (and the ragged mix) of time / best there - 1
    worst_kv_len: int  # where that worst case is; 0: the bucket's ragged mix


@dataclass
class Family:
    key: FamilyKey
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)
    graph: dict[int, GraphPick] = field(default_factory=dict)
    left_out: list[dict] = field(default_factory=list)  # {batch, kv_len, reason}
    # (batch, kv_len) -> {variant: median us}: the eager picks' times where the sweep timed them
    points: dict[tuple[int, int], dict[Variant, float]] = field(default_factory=dict)
    flashinfer: VendorModel | None = None  # FlashInfer's time over its replayed schedule
    splitk: dict[Variant, SplitKModel] = field(default_factory=dict)  # our split-K variants' schedules
    # splits the reduction adds per step (16 or 64) -> us per step, measured (serving_calibrate)
    reduce_step_us: dict[int, float] = field(default_factory=dict)


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


# ------------------------------------------------------------------ interpolation
_KV_STEPS_PER_OCTAVE = 64  # the eager pick's memo: lengths within ~1% share one estimate
# The schedule models run only where they can change the pick, to save host time (each
# replays a schedule, a heap operation per chunk or program): FlashInfer's where its
# interpolated time is within MODEL_WINDOW x the best other's and it deals at most
# MODEL_WORKS chunks per cluster (its time steps where its chunks just overflow the
# clusters; more chunks cost more host time and step less), a split-K variant's where its
# interpolated time is within MODEL_WINDOW x the best. Rescoring docs/data/verify with
# either limit removed (scripts/rescore_ablation.py) changes no run's verdict (the pooled
# p95 moves by under 0.1 point).
MODEL_WINDOW = 1.5
MODEL_WORKS = 3.0
# A split-K model's estimate stays at least this fraction of the variant's interpolated
# time: the model may say a call is slower than its uniform neighbours (a wave that
# overflows, a ragged batch's long sequence), but not much faster, since a replay that
# shortens the longest item (a split rule that cuts a sequence finer than the grid's points
# did) does not shorten the call in proportion. Rescoring docs/data/verify without it
# (scripts/rescore_ablation.py), the odd seeds' pooled p95 goes from 0.86% to 0.93% (no
# run's verdict changes).
SPLITK_FLOOR = 0.9


def _bracket(grid: list[int], x: float) -> list[tuple[int, float]]:
    """The grid points around x with their weights, linear in log x; one point (weight 1)
    at or below the grid's first, or on a point."""
    i = bisect.bisect_left(grid, x)
    if i < len(grid) and grid[i] == x:
        return [(grid[i], 1.0)]
    if i == 0 or i == len(grid):
        return [(grid[min(i, len(grid) - 1)], 1.0)]
    lo, hi = grid[i - 1], grid[i]
    w = math.log(x / lo) / math.log(hi / lo)
    return [(lo, 1.0 - w), (hi, w)]


def _at_batch(points: Mapping[tuple[int, int], Mapping[Variant, float]], batch: int,
              kv_len: float) -> dict[Variant, float]:
    """Each variant's time at a measured batch and length kv_len: log-log between the kv
    buckets around it; past the last measured one, extended along the last two buckets'
    slope (clamped to [0, 1]: time grows with the length, at most in proportion)."""
    kvs = sorted(k for b, k in points if b == batch)
    if kv_len > kvs[-1] and len(kvs) >= 2:
        k0, k1 = kvs[-2], kvs[-1]
        t0, t1 = points[(batch, k0)], points[(batch, k1)]
        slope = {v: min(max(math.log(t1[v] / t0[v]) / math.log(k1 / k0), 0.0), 1.0) for v in t0.keys() & t1.keys()}
        return {v: t1[v] * (kv_len / k1) ** s for v, s in slope.items()}
    return _blend([(w, points[(batch, k)]) for k, w in _bracket(kvs, kv_len)])


# A variant competes where the points that timed it carry at least this much of the weight.
# A batch-edge point holds its cell's best 3 only, so a variant missing there is imputed
# from the points around it rather than dropped where those weigh enough; with no weight
# required at all, a variant left out of an edge point (usually slow there) is imputed from
# far away: rescoring docs/data/verify with 0 (scripts/rescore_ablation.py), the runs within
# p95 5% / max 15% drop from 33 of 33 to 28 (even seeds) and from 32 of 34 to 29 (odd seeds).
MIN_MEASURED_WEIGHT = 0.5


def _blend(weighted: Sequence[tuple[float, Mapping[Variant, float]]]) -> dict[Variant, float]:
    """The weighted mean in log time of each variant's times at the points around a call
    ((weight, {variant: us}) each). A variant missing at a point takes its time there from
    the points that timed it, scaled by how the variants timed at both compare (their mean
    log ratio); it is left out where the points that timed it weigh less than
    MIN_MEASURED_WEIGHT, or where no other variant was timed at both."""
    if len(weighted) == 1:
        return dict(weighted[0][1])
    if len(weighted) == 2 and weighted[0][1].keys() == weighted[1][1].keys():  # none missing: the same sums
        (w0, t0), (w1, t1) = weighted
        log = math.log
        return {v: math.exp(w0 * log(t) + w1 * log(t1[v])) for v, t in t0.items()}
    out = {}
    for v in set().union(*(times for _, times in weighted)):
        have = [(w, times) for w, times in weighted if v in times]
        if len(have) < len(weighted) and sum(w for w, _ in have) < MIN_MEASURED_WEIGHT - 1e-12:
            continue
        total = 0.0
        for w, times in weighted:
            if v in times:
                total += w * math.log(times[v])
                continue
            num = den = 0.0
            for w2, other in have:  # v at this point, by the variants timed at both
                common = (times.keys() & other.keys()) - {v}
                if common:
                    ratio = sum(math.log(times[c] / other[c]) for c in common) / len(common)
                    num, den = num + w2 * (math.log(other[v]) + ratio), den + w2
            if den == 0.0:
                break
            total += w * num / den
        else:
            out[v] = math.exp(total)
    return out


def interpolate(points: Mapping[tuple[int, int], Mapping[Variant, float]], batch: int,
                kv_len: float) -> dict[Variant, float]:
    """Each variant's estimated time for `batch` sequences at mean length `kv_len` from its
    times at the measured points (batch, kv_len) around it, log-log in both (`_at_batch`
    for the length; `_blend` for a variant some of those points lack). Beyond the measured
    batches, the nearest one's."""
    batches = sorted({b for b, _ in points})
    if not batches:
        return {}
    return _blend([(w, _at_batch(points, b, kv_len)) for b, w in _bracket(batches, batch)])


class _Grid:
    """A family's points (times or rates) with what `interpolate` sorts on every call
    sorted once, and `_at_batch` memoized per (measured batch, length) in `memo`: the
    eager lookup's `interpolate`, in fewer steps (the same arithmetic)."""

    __slots__ = ("points", "batches", "kvs", "past", "memo")

    def __init__(self, points: Mapping[tuple[int, int], Mapping[Variant, float]], memo: dict):
        self.points = points
        self.batches = sorted({b for b, _ in points})
        self.kvs = {b: sorted(k for bb, k in points if bb == b) for b in self.batches}
        # per batch of two or more lengths: the last length, its times and each variant's
        # slope past it, as _at_batch computes them
        self.past: dict[int, tuple[int, Mapping[Variant, float], dict[Variant, float]]] = {}
        for b, kvs in self.kvs.items():
            if len(kvs) >= 2:
                k0, k1 = kvs[-2], kvs[-1]
                t0, t1 = points[(b, k0)], points[(b, k1)]
                self.past[b] = (k1, t1, {v: min(max(math.log(t1[v] / t0[v]) / math.log(k1 / k0), 0.0), 1.0)
                                         for v in t0.keys() & t1.keys()})
        self.memo = memo  # the table's: cleared with it

    def at_batch(self, batch: int, kv_len: float) -> dict[Variant, float]:
        key = (self, batch, kv_len)
        out = self.memo.get(key)
        if out is None:
            kvs = self.kvs[batch]
            if kv_len > kvs[-1] and len(kvs) >= 2:
                k1, t1, slope = self.past[batch]
                out = {v: t1[v] * (kv_len / k1) ** s for v, s in slope.items()}
            else:
                out = _blend([(w, self.points[(batch, k)]) for k, w in _bracket(kvs, kv_len)])
            self.memo[key] = out
        return out

    def interpolate(self, batch: int, kv_len: float) -> dict[Variant, float]:
        if not self.batches:
            return {}
        return _blend([(w, self.at_batch(b, kv_len)) for b, w in _bracket(self.batches, batch)])


@dataclass(frozen=True)
class VendorModel:
    """A vendor variant's time as a linear model over its replayed schedule
    (serving/vendor_cost.py): FlashInfer's, fitted to its times over the family's grid."""

    variant: Variant
    coef: tuple[float, ...]
    sm_count: int
    fit_error_p90: float  # relative error at the grid cells it was fitted on

    def time_us(self, key: FamilyKey, kv_lens: Sequence[int]) -> float:
        return predict(self.coef, flashinfer_mla_features(kv_lens, key.heads, key.q_len, self.sm_count))


@dataclass(frozen=True)
class SplitKModel:
    """A split-K variant's time as overhead_us + rate x its makespan for the call's lengths
    (serving/splitk_cost.py); the rate is interpolated between the points, each point's
    (time - overhead_us) / makespan at its uniform lengths. occupancy (programs resident per
    SM, at most what its KV stages leave room for: splitk_cost.occupancy_cap), overhead_us
    and item_tokens (a program's fixed cost, in tokens) are fitted when the table is built
    (serving_build), leaving each of the variant's points out in turn; fit_error is the
    median relative error that left."""

    variant: Variant
    occupancy: int
    overhead_us: float
    sm_count: int
    fit_error: float
    item_tokens: int = 0

    def makespan(self, key: FamilyKey, kv_lens: Sequence[int]) -> float:
        return self.schedule(key, kv_lens)[0]

    def schedule(self, key: FamilyKey, kv_lens: Sequence[int]) -> tuple[float, int]:
        """(makespan, steps of the reduction's longest loop): splitk_cost.splitk_schedule."""
        return splitk_schedule(kv_lens, key.heads, key.q_len, dict(self.variant.params), self.occupancy,
                               self.sm_count, self.item_tokens)

    def rate(self, time_us: float, span: float) -> float | None:
        """(time - overhead) / makespan at a point; None where the time is not over the
        overhead or the makespan is 0."""
        return (time_us - self.overhead_us) / span if time_us > self.overhead_us and span > 0 else None


def splitk_rates(points: Mapping[tuple[int, int], Mapping[Variant, float]], models: Mapping[Variant, SplitKModel],
                 key: FamilyKey) -> dict[tuple[int, int], dict[Variant, float]]:
    """Each point's SplitKModel.rate of the variants with a model: what the lookup
    interpolates for them."""
    rates: dict[tuple[int, int], dict[Variant, float]] = {}
    for (batch, kv_len), times in points.items():
        for v, t in times.items():
            m = models.get(v)
            if m is not None and (r := m.rate(t, m.makespan(key, [kv_len] * batch))) is not None:
                rates.setdefault((batch, kv_len), {})[v] = r
    return rates


def fastest(estimates: Mapping[Variant, float], allowed: Callable[[Variant], bool] | None = None) -> Variant | None:
    """The variant estimated fastest among those `allowed` accepts (all by default); ties go
    to the first name, so the pick does not depend on order. None where none is left."""
    best = None
    for v, t in estimates.items():
        if allowed is not None and not allowed(v):
            continue
        if best is None or t < best[0] or (t == best[0] and str(v) < str(best[1])):
            best = (t, v)
    return best[1] if best is not None else None


# ------------------------------------------------------------------ the table
@dataclass
class ServingTable:
    gpu: str
    provenance: dict
    batch_buckets: list[int]
    kv_buckets: list[int]
    families: dict[FamilyKey, Family]
    path: Path | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def family(self, spec: CallSpec) -> Family | None:
        return self.families.get(FamilyKey.of(spec))

    def lookup(self, spec: CallSpec, batch: int, mean_kv_len: float | None = None,
               graph: bool = False, kv_lens: Sequence[int] | None = None) -> Variant | None:
        """The variant for a call (no timing):
        - graph=True, or no mean length given: the graph pick of the batch's bucket;
        - else, where the family has points: the variant estimated
          fastest at the call's own batch and lengths (`_estimates`): `interpolate` over the
          points, memoized per (batch, kv_len to ~1%); a split-K variant's from its
          SplitKModel and FlashInfer's from its model, over their schedules for `kv_lens`
          (the call's lengths; without them, `batch` sequences of the mean);
        - else (no points, or no variant estimated around the call: `_blend`) the cell of
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
        chosen = fastest(self._estimates(family, batch, mean_kv_len, kv_lens)) if family.points else None
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

    def prepare(self, spec: CallSpec) -> None:
        """The eager lookup's one-off work for the spec's family, so that none is left for a
        step: each interpolation grid (the split-K rates need a makespan per point) and one
        estimate through every replay (the vectorized paths' first call)."""
        family = self.family(spec)
        if family is None or not family.points:
            return
        for kind in ("times", "rates", "buckets"):
            self._grid(kind, family)
        for batch in (1, self.batch_buckets[-1]):
            self._estimates(family, batch, 4096.0, [4096] * batch)

    def estimates(self, spec: CallSpec, batch: int, mean_kv_len: float,
                  kv_lens: Sequence[int] | None = None) -> dict[Variant, float]:
        """Every point variant's estimated time (us) for the call, as `lookup` weighs them."""
        family = self.family(spec)
        if family is None or not family.points:
            return {}
        return self._estimates(family, batch, mean_kv_len, kv_lens)

    def _estimates(self, family: Family, batch: int, mean_kv_len: float,
                   kv_lens: Sequence[int] | None) -> dict[Variant, float]:
        if ("versions", family.key) not in self._derived:
            self._derived[("versions", family.key)] = True
            self._warn_versions(family)
        est = dict(self._interpolated("times", family, batch, mean_kv_len))
        lens = kv_lens if kv_lens is not None else [max(int(round(mean_kv_len)), 1)] * batch
        replay = None  # the lengths as the replays take them (an int64 array), made once where one runs
        if family.splitk and est:
            # Our split-K variants within MODEL_WINDOW of the best: the interpolated rate times
            # the call's own schedule (a heap operation per split: host time), plus the
            # measured cost of each step the reduction's longest loop takes beyond a uniform
            # batch's (the rates are uniform batches'; a ragged batch's long sequence has
            # most of the splits); at least SPLITK_FLOOR x the interpolated time.
            rates = None  # interpolated where a variant is near the best, once
            near = MODEL_WINDOW * min(est.values())
            for v, m in family.splitk.items():
                if est.get(v, math.inf) >= near:
                    continue
                if rates is None:
                    rates = self._interpolated("rates", family, batch, mean_kv_len)
                if rate := self._rate(family, m, rates, est, batch, mean_kv_len):
                    if replay is None:
                        replay = lengths(lens)
                    est[v] = max(self._splitk_time(family, m, rate, batch, mean_kv_len, replay, kv_lens is not None),
                                 SPLITK_FLOOR * est[v])
        model = family.flashinfer
        if model is None:
            return est
        if model.variant not in est:
            # A batch-edge point holds its cell's best 3 only, so FlashInfer missing there says
            # little; the batch buckets' points, which time every finalist, stand in.
            coarse = self._interpolated("buckets", family, batch, mean_kv_len).get(model.variant)
            if coarse is None:
                return est
            est[model.variant] = coarse
        if len(est) < 2:
            return est
        # The model replays FlashInfer's schedule, a heap operation per chunk. It runs only
        # where FlashInfer's interpolated time is near the best other's, and where it deals
        # at most MODEL_WORKS chunks per cluster: FlashInfer's steps are where its chunks just
        # overflow the clusters, and more chunks cost more host time and step less.
        mine = est[model.variant]
        other = min(t for v, t in est.items() if v != model.variant)
        if max(mine, other) < MODEL_WINDOW * min(mine, other):
            if replay is None:
                replay = lengths(lens)
            if flashinfer_mla_works_per_cluster(replay, family.key.heads, family.key.q_len, model.sm_count) <= MODEL_WORKS:
                est[model.variant] = model.time_us(family.key, replay)
        return est

    def _warn_versions(self, family: Family) -> None:
        """Warn once per vendor distribution whose scheduler a family's model replays (its
        backend's CAPABILITIES.vendor) where the installed version is not the one the
        table's provenance records, as the leaderboard runtime warns (runtime/__init__.py).
        A distribution not installed here is not warned about: its picks cannot run here,
        and the plan says so."""
        from importlib import metadata

        from mla_tune.backends import capabilities

        tuned = self.provenance.get("versions") or {}
        models = [m.variant for m in ([family.flashinfer] if family.flashinfer else [])] + list(family.splitk)
        for variant in models:
            dist = capabilities(variant.backend).vendor
            if not dist or dist not in tuned or ("versions", dist) in self._derived:
                continue
            try:
                here = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            self._derived[("versions", dist)] = True
            if here != tuned[dist]:
                warnings.warn(f"serving table {self.path}: provenance.versions.{dist} is {tuned[dist]} but this "
                              f"process has {here}; the lookup replays its scheduler as the table's version "
                              "ran it, so its estimates may have moved: re-run the serving sweep "
                              "(mla-tune sweep --config configs/serving.yaml) to refresh the table", stacklevel=4)

    def splitk_estimates(self, spec: CallSpec, kv_lens: Sequence[int], reduce: bool = True) -> dict[Variant, float]:
        """Each split-K model's estimate (us) for a call of these lengths, whether or not it
        is near the best: its overhead plus its interpolated rate times the call's makespan,
        plus (with `reduce`) the reduction steps beyond a uniform batch's at the family's
        reduce_step_us. What the lookup weighs for the variants it models."""
        family = self.family(spec)
        if family is None or not family.splitk or not kv_lens:
            return {}
        batch, mean = len(kv_lens), sum(kv_lens) / len(kv_lens)
        rates = self._interpolated("rates", family, batch, mean)
        times = self._interpolated("times", family, batch, mean)
        replay = lengths(kv_lens)
        return {v: self._splitk_time(family, m, rate, batch, mean, replay, reduce)
                for v, m in family.splitk.items() if (rate := self._rate(family, m, rates, times, batch, mean))}

    def _rate(self, family: Family, model: SplitKModel, rates: Mapping[Variant, float],
              times: Mapping[Variant, float], batch: int, mean_kv_len: float) -> float | None:
        """The variant's rate interpolated between the points; where the rates cannot be
        blended (the points around the call share no split-K variant, so a point lacking
        this one cannot be imputed) but its time can (the vendors' times bridge them), the
        rate of that interpolated time at a uniform batch of the mean, so that the model
        still sees the call's own schedule (a long sequence the interpolated time is blind
        to). None: no estimate."""
        rate = rates.get(model.variant)
        if rate is not None or model.variant not in times:
            return rate
        span = self._at_uniform("span", family, model, batch, mean_kv_len,
                                lambda n: model.schedule(family.key, [n] * batch)[0])
        return model.rate(times[model.variant], span)

    def _splitk_time(self, family: Family, model: SplitKModel, rate: float, batch: int, mean_kv_len: float,
                     lens: Sequence[int], reduce: bool) -> float:
        span, steps = model.schedule(family.key, lens)
        t = model.overhead_us + rate * span
        step_us = family.reduce_step_us.get(reduce_splits_per_step(batch, family.key.q_len, family.key.heads), 0.0)
        if reduce and step_us:
            t += step_us * max(steps - self._uniform_steps(family, model, batch, mean_kv_len), 0)
        return t

    def _uniform_steps(self, family: Family, model: SplitKModel, batch: int, mean_kv_len: float) -> int:
        """The reduction steps of `batch` sequences of the mean length (to ~1%), memoized."""
        return self._at_uniform("steps", family, model, batch, mean_kv_len,
                                lambda n: uniform_reduce_steps(batch, n, family.key.heads, family.key.q_len,
                                                               dict(model.variant.params), model.sm_count))

    def _at_uniform(self, kind: str, family: Family, model: SplitKModel, batch: int, mean_kv_len: float,
                    compute: Callable[[int], Any]) -> Any:
        """compute(length) for a uniform batch of the mean length, the length taken to ~1%
        and the result memoized per (kind, family, variant, batch, length)."""
        step = round(math.log2(max(mean_kv_len, 1.0)) * _KV_STEPS_PER_OCTAVE)
        memo_key = (kind, family.key, model.variant, batch, step)
        if memo_key not in self._memo:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            self._memo[memo_key] = compute(max(int(round(2.0 ** (step / _KV_STEPS_PER_OCTAVE))), 1))
        return self._memo[memo_key]

    def _interpolated(self, kind: str, family: Family, batch: int, mean_kv_len: float) -> dict[Variant, float]:
        """`interpolate` over the family's points ("times"), its split-K rates ("rates") or
        its batch buckets' points alone ("buckets"), memoized per (batch, kv_len to ~1%)."""
        step = round(math.log2(max(mean_kv_len, 1.0)) * _KV_STEPS_PER_OCTAVE)
        memo_key = (kind, family.key, batch, step)
        if memo_key not in self._memo:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            self._memo[memo_key] = self._grid(kind, family).interpolate(batch, 2.0 ** (step / _KV_STEPS_PER_OCTAVE))
        return self._memo[memo_key]

    def _grid(self, kind: str, family: Family) -> _Grid:
        """The points `_interpolated` reads, as a _Grid made once per (kind, family)."""
        grid = self._memo.get(("grid", kind, family.key))
        if grid is None:  # made again after the memo is cleared (its at_batch results live there)
            if kind == "times":
                points = family.points
            else:
                if (kind, family.key) not in self._derived:
                    if kind == "rates":
                        derived = splitk_rates(family.points, family.splitk, family.key)
                    else:
                        buckets = set(self.batch_buckets)
                        derived = {pt: times for pt, times in family.points.items() if pt[0] in buckets}
                    self._derived[(kind, family.key)] = derived
                points = self._derived[(kind, family.key)]
            grid = self._memo[("grid", kind, family.key)] = _Grid(points, self._memo)
        return grid

    def as_dict(self) -> dict:
        families = []
        for key in sorted(self.families):
            fam = self.families[key]
            families.append({
                "key": key.as_dict(),
                "cells": [_cell_dict(c) for _, c in sorted(fam.cells.items())],
                "graph": [{"batch": g.batch, "variant": str(g.variant),
                           "worst_regret": round(g.worst_regret, 4), "worst_kv_len": g.worst_kv_len}
                          for _, g in sorted(fam.graph.items())],
                "left_out": sorted(fam.left_out, key=lambda c: (c["batch"], c["kv_len"])),
                **_points_dict(fam.points),
                **_model_dict(fam.flashinfer),
                **_splitk_dict(fam.splitk),
                **({"reduce_step_us": FlowMap(sorted(fam.reduce_step_us.items()))} if fam.reduce_step_us else {}),
            })
        return {"schema": SERVING_SCHEMA, "gpu": self.gpu, "provenance": self.provenance,
                "batch_buckets": list(self.batch_buckets), "kv_buckets": list(self.kv_buckets),
                "families": families}


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


def _model_dict(model: VendorModel | None) -> dict:
    if model is None:
        return {}
    return {"flashinfer_model": {"variant": str(model.variant), "sm_count": model.sm_count,
                                 "features": list(FLASHINFER_FEATURES),
                                 "coef": [float(f"{c:.6g}") for c in model.coef],
                                 "fit_error_p90": round(model.fit_error_p90, 4)}}


def _splitk_dict(models: Mapping[Variant, SplitKModel]) -> dict:
    if not models:
        return {}
    return {"splitk_models": [FlowMap(variant=str(m.variant), occupancy=m.occupancy,
                                      overhead_us=round(m.overhead_us, 3), item_tokens=m.item_tokens,
                                      sm_count=m.sm_count, fit_error=round(m.fit_error, 4))
                              for m in sorted(models.values(), key=lambda m: str(m.variant))]}


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
    unknown = set(raw) - {"key", "cells", "graph", "left_out", "variants", "points", "flashinfer_model",
                          "splitk_models", "reduce_step_us"}
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
        if runner_up is not None and not isinstance(runner_up, dict):
            raise TableError(f"{at}: runner_up must be a mapping or absent")
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
        family.graph[batch] = GraphPick(batch, variant,
                                        _number(at, "worst_regret", entry.get("worst_regret")), worst_kv)
    for i, entry in enumerate(_entries(where, raw, "left_out")):
        at = f"{where}, left_out {i}"
        bucketed(at, entry, True)
        if not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
            raise TableError(f"{at}: a left-out cell must say why (reason)")
        family.left_out.append(dict(entry))
    family.points = _points(where, raw, kv_buckets, known, check_params, family.key)
    family.flashinfer = _model(where, raw.get("flashinfer_model"), known, check_params, family.key)
    family.splitk = _splitk_models(where, raw, known, check_params, family.key)
    family.reduce_step_us = _reduce_steps(where, raw.get("reduce_step_us"))
    return family


def _reduce_steps(where: str, raw: Any) -> dict[int, float]:
    if raw is None:
        return {}
    at = f"{where}, reduce_step_us"
    if not isinstance(raw, dict) or not set(raw) <= set(REDUCE_SPLITS_PER_STEP):
        raise TableError(f"{at} must map splits per reduction step ({' or '.join(map(str, REDUCE_SPLITS_PER_STEP))}) "
                         f"to us per step, got {raw!r:.80}")
    return {k: _number(at, f"[{k}]", v) for k, v in sorted(raw.items())}


def _splitk_models(where: str, raw: dict, known: list[str], check_params: bool,
                   key: FamilyKey) -> dict[Variant, SplitKModel]:
    models: dict[Variant, SplitKModel] = {}
    for i, entry in enumerate(_entries(where, raw, "splitk_models")):
        at = f"{where}, splitk_models[{i}]"
        fields = {"variant", "occupancy", "overhead_us", "item_tokens", "sm_count", "fit_error"}
        if set(entry) != fields:
            raise TableError(f"{at} must be a mapping of {', '.join(sorted(fields))}")
        variant = check_variant_field(at, "variant", entry, known, check_params)
        _match_family(at, variant, key)
        if not is_splitk(variant):
            raise TableError(f"{at}: the model is our split-K kernel's schedule, but variant is {variant}")
        if variant in models:
            raise TableError(f"{at}: a second model for {variant}")
        models[variant] = SplitKModel(variant, _positive_int(at, "occupancy", entry["occupancy"]),
                                      _number(at, "overhead_us", entry["overhead_us"]),
                                      _positive_int(at, "sm_count", entry["sm_count"]),
                                      _number(at, "fit_error", entry["fit_error"]),
                                      _positive_int(at, "item_tokens", entry["item_tokens"], minimum=0))
    return models


def _model(where: str, raw: Any, known: list[str], check_params: bool, key: FamilyKey) -> VendorModel | None:
    if raw is None:
        return None
    at = f"{where}, flashinfer_model"
    if not isinstance(raw, dict) or set(raw) != {"variant", "sm_count", "features", "coef", "fit_error_p90"}:
        raise TableError(f"{at} must be a mapping of variant, sm_count, features, coef, fit_error_p90")
    variant = check_variant_field(at, "variant", raw, known, check_params)
    _match_family(at, variant, key)
    if variant.backend != "flashinfer":
        raise TableError(f"{at}: the model is FlashInfer's schedule, but variant is {variant}")
    if raw["features"] != list(FLASHINFER_FEATURES):
        raise TableError(f"{at}: features {raw['features']!r:.120} are not this mla-tune's "
                         f"{list(FLASHINFER_FEATURES)}; re-build the table (serving_sweep merge)")
    coef = raw["coef"]
    if not isinstance(coef, list) or len(coef) != len(FLASHINFER_FEATURES):
        raise TableError(f"{at}: coef must be a list of {len(FLASHINFER_FEATURES)} numbers")
    for i, c in enumerate(coef):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
            raise TableError(f"{at}: coef[{i}] must be a finite number, got {c!r:.40}")
    return VendorModel(variant, tuple(float(c) for c in coef), _positive_int(at, "sm_count", raw["sm_count"]),
                       _number(at, "fit_error_p90", raw["fit_error_p90"]))


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
    return ServingTable(gpu, provenance, batch_buckets, kv_buckets, families, path)
