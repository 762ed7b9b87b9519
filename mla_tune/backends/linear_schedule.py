"""What the vendor schedule models share: a vendor kernel's time as a linear model over
features of its own schedule for the call's lengths, fitted to its times over the family's
grid when the serving table is built.

A vendor backend's schedule module (backends/__init__.py: the schedule-model protocol)
replays its vendor's scheduler on the host and subclasses `LinearModel` with its
`FEATURES`, `features(key, kv_lens)` and, where it runs only sometimes, `applies`; its
`fit` and `load` call `fit_model` and `load_model`. backends/flashinfer_mla_schedule.py
(FlashInfer's chunk dealing) and backends/flash_mla_schedule.py (FlashMLA's split
partitions) do. `WINDOW_C` is the lookup's window rule in C, for their C estimates.
Nothing here names a backend. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

FIT_MIN_CELLS = 24  # a model is fitted where its variant was timed at this many cells or more


def predict(coef: Sequence[float], features: Sequence[float]) -> float:
    """coef . features, added left to right as the C estimates add them (Python 3.12's sum()
    of floats compensates its rounding, which would differ from them in the last place)."""
    t = 0.0
    for c, f in zip(coef, features, strict=True):
        t = t + c * f
    return t


def fit_linear(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Least squares of times on rows, each row weighted by 1 / its time (relative error),
    columns scaled to unit size and a tiny ridge, so a column that never varies (no merges
    at any cell) gets 0 instead of breaking the solve. Needs len(rows) >= 2 x columns."""
    n, m = len(rows), len(rows[0]) if rows else 0
    if n < 2 * m or m == 0:
        raise ValueError(f"fit_linear needs at least {2 * max(m, 1)} rows, got {n}")
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(m)]
    a = [[r[j] / scale[j] / t for j in range(m)] for r, t in zip(rows, times, strict=True)]
    ata = [[sum(a[k][i] * a[k][j] for k in range(n)) for j in range(m)] for i in range(m)]
    atb = [sum(a[k][i] for k in range(n)) for i in range(m)]  # the weighted targets t / t are all 1
    ridge = 1e-9 * max(sum(ata[i][i] for i in range(m)), 1e-30)
    for i in range(m):
        ata[i][i] += ridge
    x = _solve(ata, atb)
    return [x[j] / scale[j] for j in range(m)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small symmetric system)."""
    m = len(b)
    a = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, m):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, m + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * m
    for r in range(m - 1, -1, -1):
        if abs(a[r][r]) < 1e-300:
            continue
        x[r] = (a[r][m] - sum(a[r][c] * x[c] for c in range(r + 1, m))) / a[r][r]
    return x


def relative_errors(coef: Sequence[float], rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    return sorted(abs(predict(coef, r) / t - 1.0) for r, t in zip(rows, times, strict=True) if t > 0)


@dataclass(frozen=True)
class LinearModel:
    """A vendor kernel's time as coef . FEATURES of its schedule for the call's lengths,
    fitted to its times over the family's grid. A subclass names its FEATURES and WHAT (the
    vendor, for errors) and gives `features(key, kv_lens)`, and `applies(key, kv_lens)`
    where the model should stand aside (host time)."""

    FEATURES: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "a vendor"
    variant: object  # mla_tune.core.Variant
    coef: tuple[float, ...]
    sm_count: int
    fit_error_p90: float  # relative error at the grid cells it was fitted on

    def features(self, key, kv_lens: Sequence[int]) -> list[float]:
        raise NotImplementedError

    def applies(self, key, kv_lens) -> bool:
        return True

    def time_us(self, key, kv_lens: Sequence[int]) -> float:
        return predict(self.coef, self.features(key, kv_lens))

    def estimate(self, call, raw: bool = False) -> float | None:
        """The vendor's time for `call` (serving/estimate.py's Call). Where the call's
        estimates lack it (a batch-edge point holds its cell's best 3 only, so the vendor
        missing there says little), the batch buckets' interpolation stands in. The model
        replaces that where the vendor's time and the best other's are within call.window
        of each other and the model `applies` (host time: a replay per call). None where
        nothing estimates it. raw: the model's time, everywhere."""
        key = call.key
        if raw:
            return self.time_us(key, call.lengths())
        est = call.est
        mine = est.get(self.variant)
        if mine is None:
            mine = call.interpolated("buckets").get(self.variant)
            if mine is None:
                return None
        others = [t for v, t in est.items() if v != self.variant]
        if others:
            other = min(others)
            if max(mine, other) < call.window * min(mine, other):
                lens = call.lengths()
                if self.applies(key, lens):
                    return self.time_us(key, lens)
        return mine

    def as_dict(self) -> dict:
        return {"variant": str(self.variant), "sm_count": self.sm_count, "features": list(self.FEATURES),
                "coef": [float(f"{c:.6g}") for c in self.coef], "fit_error_p90": round(self.fit_error_p90, 4)}


def fit_model(model: type[LinearModel], key, variants: Sequence, cells: Mapping,
              platform: Mapping) -> list[LinearModel]:
    """`model` fitted to its variant's last-rung times at the family's aligned cells
    (`cells`: {(batch, kv_len): {variant name: us}}, every sequence at the cell's length),
    where exactly one variant of its backend is among the family's eager picks (`variants`).
    None without the GPU's SM count (platform's sm_count 0), or with fewer than
    FIT_MIN_CELLS cells."""
    sm_count = int(platform.get("sm_count") or 0)
    if sm_count <= 0 or len(variants) != 1:
        return []
    (variant,) = variants
    name, shape = str(variant), model(variant, (), sm_count, 0.0)
    rows, times = [], []
    for (batch, kv_len), cell in sorted(cells.items()):
        if kv_len > 0 and name in cell:
            rows.append(shape.features(key, [kv_len] * batch))
            times.append(cell[name])
    if len(rows) < FIT_MIN_CELLS:
        return []
    coef = fit_linear(rows, times)
    errors = relative_errors(coef, rows, times)
    return [model(variant, tuple(coef), sm_count, errors[int(0.9 * (len(errors) - 1))])]


def load_model(model: type[LinearModel], entry: Mapping, variant, check) -> LinearModel:
    """A `model` from its table entry (as_dict's fields; `check`: the table's field checks,
    which raise its error naming the file, family and entry)."""
    fields = ("variant", "sm_count", "features", "coef", "fit_error_p90")
    if set(entry) != set(fields):
        check.fail(f"{model.WHAT}'s model is a mapping of backend, {', '.join(fields)}")
    if entry["features"] != list(model.FEATURES):
        check.fail(f"features {entry['features']!r:.120} are not this mla-tune's {list(model.FEATURES)}; "
                   "re-build the table (mla-tune sweep --merge)")
    coef = entry["coef"]
    if not isinstance(coef, list) or len(coef) != len(model.FEATURES):
        check.fail(f"coef must be a list of {len(model.FEATURES)} numbers")
    return model(variant, tuple(check.number(f"coef[{i}]", c, minimum=None) for i, c in enumerate(coef)),
                 check.positive_int("sm_count", entry["sm_count"]),
                 check.number("fit_error_p90", entry["fit_error_p90"]))


# LinearModel.estimate's window rule as C, for a model's est_model_fn (native.ESTIMATE_H
# first): the vendor's time so far (its estimate, else its batch buckets' time) in *mine, and
# 1 where the model should replace it (within the window of the best other's), 0 where
# `mine` stands, -1 where nothing estimates it.
WINDOW_C = r"""
static int linear_window(int64_t v, const est_call_t *c, double *mine) {
    *mine = c->est[v];
    if (isnan(*mine)) {
        *mine = c->buckets[v];
        if (isnan(*mine)) return -1;
    }
    double other = NAN;
    for (int64_t i = 0; i < c->nv; i++)
        if (i != v && !isnan(c->est[i]) && (isnan(other) || c->est[i] < other)) other = c->est[i];
    if (isnan(other)) return 0;
    double hi = *mine > other ? *mine : other, lo = *mine < other ? *mine : other;
    return hi < c->window * lo ? 1 : 0;
}
"""
