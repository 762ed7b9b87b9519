"""What the split-K and gluon_fused schedule models share: a variant's time as a fixed
overhead plus a rate times the makespan of its programs dealt to the SMs, fitted per
variant when the serving table is built.

A backend's schedule module (backends/__init__.py: the schedule-model protocol) subclasses
`MakespanModel` with its own `schedule` (the makespan of its split rule at a call's
lengths) and `replay` (the same for the lookup's Call, in C where it can), and calls
`fit_models` and `load_model` from its `fit` and `load`. `greedy_makespan` is the dealing
both replays share in numpy. Nothing here names a backend. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

OCCUPANCIES = (1, 2, 3, 4)  # programs resident per SM that a fit may choose
OVERHEAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # fixed overhead, as a fraction of the fastest point's time
ITEM_TOKENS = (0, 32, 64, 128, 256)  # a program's fixed cost in tokens that a fit may choose
# Past this many waves of programs the makespan is taken as the mean load plus half the
# longest item (greedy dealing ends within one item of the mean): the exact dealing costs
# a heap operation per program, and a long batch on a per-sequence cap makes thousands.
EXACT_WAVES = 3
FIT_MIN_POINTS = 6  # a variant's model is fitted where it has this many points
# An SM's shared memory where the sweep's results header does not record it (smem_per_sm):
# Hopper's, 228 KiB (H100, H200).
DEFAULT_SMEM_PER_SM = 228 * 1024


def greedy_makespan(work: np.ndarray, slots: int):
    """The most-loaded slot's load when `work` (positive, in launch order) is dealt one by
    one to the least-loaded of `slots` slots: what a heap gives, a block of programs at a
    time. The first `slots` take an empty slot each; then a block of up to `slots` programs
    takes the smallest loads in order, which is the dealing's own choice while no program
    of the block ends before the load the next one takes (checked: a prefix minimum); past
    the first program that would, the block is cut there and the next block starts from
    the loads so far. A block cut short (few programs) is followed by a few programs dealt
    through the heap, so a batch of many short programs does not take a block per program."""
    n = int(work.shape[0])
    if n <= slots:
        return work.max()
    loads = np.sort(work[:slots])
    i = slots
    while i < n:
        m = min(slots, n - i)
        taken = loads[:m]
        ends = taken + work[i:i + m]
        ok = taken[1:] <= np.minimum.accumulate(ends)[:-1]
        k = m if ok.all() else int(np.argmin(ok)) + 1  # the programs dealt as the block says
        loads = np.sort(np.concatenate((loads[k:], ends[:k])))
        i += k
        if k < 16 and i < n:  # a block cut short: the next programs through the heap
            heap = loads.tolist()
            heapq.heapify(heap)
            replace = heapq.heapreplace
            for w in work[i:i + 64].tolist():
                replace(heap, heap[0] + w)
            i += min(64, n - i)
            loads = np.sort(np.asarray(heap, dtype=loads.dtype))
    return loads[-1]


def deal(items: np.ndarray, tiles: int, slots: int, item_tokens: float) -> float:
    """The makespan of split items (tokens each, in launch order), each run by `tiles`
    programs (neighbours in launch order) of item_tokens' fixed cost, over `slots` program
    slots: the longest program where all fit in one wave; past EXACT_WAVES waves the mean
    load plus half the longest program; else the greedy dealing."""
    if items.shape[0] == 0:
        return 0.0
    longest = float(items.max())
    programs = int(items.shape[0]) * tiles
    if programs <= slots:
        return longest + item_tokens
    if programs > EXACT_WAVES * slots:
        return (float(items.sum()) + item_tokens * items.shape[0]) * tiles / slots + (longest + item_tokens) / 2
    work = np.repeat(items + item_tokens, tiles) if tiles > 1 else items + item_tokens
    return float(greedy_makespan(work.astype(np.float64), slots))


@dataclass(frozen=True)
class MakespanModel:
    """A variant's time as overhead_us + rate x its makespan for the call's lengths; the rate
    is interpolated between the points, each point's (time - overhead_us) / makespan at its
    uniform lengths (`point_rate`). occupancy (programs resident per SM), overhead_us and
    item_tokens (a program's fixed cost, in tokens) are fitted when the table is built
    (`fit_models`), leaving each of the variant's points out in turn; fit_error is the
    median relative error that left. A subclass gives `schedule(key, kv_lens) -> (makespan,
    reduction steps)` and `replay(call) -> (makespan, reduction steps, a uniform batch's
    steps)`, and may add a cost per reduction step (`step_cost`)."""

    # An estimate stays at least this fraction of the variant's interpolated time (0: no
    # floor). A subclass sets one where a rescore ablation shows its backend needs it
    # (scripts/rescore_ablation.py): triton_splitk_schedule.SPLITK_FLOOR.
    floor: ClassVar[float] = 0.0
    variant: object  # mla_tune.core.Variant
    occupancy: int
    overhead_us: float
    sm_count: int
    fit_error: float
    item_tokens: int = 0
    params: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "params", dict(self.variant.params))

    def schedule(self, key, kv_lens: Sequence[int]) -> tuple[float, int]:
        raise NotImplementedError

    def replay(self, call) -> tuple[float, int, int]:
        raise NotImplementedError

    def step_cost(self, call, steps: int, uniform: int) -> float:
        """What the call's reduction steps beyond a uniform batch's add (us): none here."""
        return 0.0

    def makespan(self, key, kv_lens: Sequence[int]) -> float:
        return self.schedule(key, kv_lens)[0]

    def rate(self, time_us: float, span: float) -> float | None:
        """(time - overhead) / makespan at a point; None where the time is not over the
        overhead or the makespan is 0."""
        return (time_us - self.overhead_us) / span if time_us > self.overhead_us and span > 0 else None

    def point_rate(self, key, batch: int, kv_len: int, time_us: float) -> float | None:
        """What the lookup interpolates for this variant instead of its time: the rate at a
        point of `batch` sequences of kv_len tokens that took time_us."""
        return self.rate(time_us, self.makespan(key, [kv_len] * batch))

    def estimate(self, call, raw: bool = False) -> float | None:
        """The variant's time for `call` (serving/estimate.py's Call): overhead plus the
        interpolated rate times the call's own makespan, plus `step_cost`, at least
        `floor` x its interpolated time. It runs only where the interpolated time is
        within call.window of the best (host time: a replay per call); None elsewhere, or
        where no rate can be interpolated. raw: no window and no floor (the model's own
        estimate, for calibration)."""
        mine = call.interp.get(self.variant)
        if not raw and (mine is None or mine >= call.window * call.interp_min()):
            return None
        rate = call.interpolated("rates").get(self.variant)
        if rate is None and mine is not None:
            # The rates cannot be blended here (the points around the call share no variant
            # with a model) but the time can: the rate of that time at a uniform batch of the
            # mean, so that the model still sees the call's own schedule.
            span = call.uniform("span", self, lambda n: self.schedule(call.key, [n] * call.batch)[0])
            rate = self.rate(mine, span)
        if not rate:
            return None
        span, steps, uniform = self.replay(call)
        t = self.overhead_us + rate * span
        t += self.step_cost(call, steps, uniform)
        return t if raw else max(t, self.floor * mine)

    def as_dict(self) -> dict:
        return {"variant": str(self.variant), "occupancy": self.occupancy, "overhead_us": round(self.overhead_us, 3),
                "item_tokens": self.item_tokens, "sm_count": self.sm_count, "fit_error": round(self.fit_error, 4)}


def fit_models(model: type[MakespanModel], cap: Callable[[object, int], int], key, variants: Sequence,
               points: Mapping, platform: Mapping, interpolate: Callable) -> list[MakespanModel]:
    """Each variant's `model`: the item cost, occupancy and overhead (a fraction of its
    fastest point's time) whose leave-one-out estimates of its points are best, each point
    estimated from the others as the lookup would (`interpolate`, the lookup's; the mean
    absolute log error; the first of equals, so the smallest item cost, occupancy and
    overhead), the occupancy at most cap(variant, platform's smem_per_sm). None without the
    GPU's SM count (platform's sm_count 0). Variants with fewer than FIT_MIN_POINTS points
    get none."""
    sm_count, smem_per_sm = int(platform.get("sm_count") or 0), int(platform.get("smem_per_sm") or 0)
    if sm_count <= 0:
        return []
    models = []
    for variant in variants:
        mine = {pt: times[variant] for pt, times in points.items() if variant in times}
        if len(mine) < FIT_MIN_POINTS:
            continue
        fastest, best = min(mine.values()), None
        occupancies = [o for o in OCCUPANCIES if o <= cap(variant, smem_per_sm)]
        for item_tokens, occupancy in itertools.product(ITEM_TOKENS, occupancies):
            shape = model(variant, occupancy, 0.0, sm_count, 0.0, item_tokens)
            spans = {(b, k): shape.makespan(key, [k] * b) for b, k in mine}  # the overhead leaves them
            for fraction in OVERHEAD_FRACTIONS:
                candidate = dataclasses.replace(shape, overhead_us=fraction * fastest)
                rates = {pt: {variant: r} for pt, t in mine.items()
                         if (r := candidate.rate(t, spans[pt])) is not None}
                errors = []
                for (b, k), t in mine.items():  # each point from the others, as the lookup estimates
                    rate = interpolate({q: r for q, r in rates.items() if q != (b, k)}, b, k).get(variant)
                    if rate is not None:
                        errors.append(abs(math.log((candidate.overhead_us + rate * spans[(b, k)]) / t)))
                if errors and (best is None or sum(errors) / len(errors) < best[0] - 1e-12):
                    best = (sum(errors) / len(errors), candidate, sorted(errors))
        if best is not None:
            _, chosen, errors = best
            models.append(dataclasses.replace(chosen, fit_error=math.exp(errors[len(errors) // 2]) - 1.0))
    return models


MODEL_FIELDS = frozenset({"variant", "occupancy", "overhead_us", "item_tokens", "sm_count", "fit_error"})


def load_model(model: type[MakespanModel], what: str, entry: Mapping, variant, check) -> MakespanModel:
    """A `model` from its table entry (as_dict's fields; `check`: the table's field checks,
    which raise its error naming the file, family and entry); `what` names it in the error."""
    if set(entry) != MODEL_FIELDS:
        check.fail(f"a {what} model is a mapping of backend, {', '.join(sorted(MODEL_FIELDS))}")
    return model(variant, check.positive_int("occupancy", entry["occupancy"]),
                 check.number("overhead_us", entry["overhead_us"]),
                 check.positive_int("sm_count", entry["sm_count"]),
                 check.number("fit_error", entry["fit_error"]),
                 check.positive_int("item_tokens", entry["item_tokens"], minimum=0))
