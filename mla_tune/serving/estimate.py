"""The serving table's eager estimate: each variant's time at a call's own batch and lengths.

- Each variant's time is interpolated between the family's *points* (its eager picks'
  measured times at every timed batch and kv bucket), log-log in both (`interpolate`).
- A variant whose backend owns a *schedule model* (a `<backend module>_schedule` module
  beside the backend: backends.schedule_module) is then estimated by that model, which
  replays the backend's own schedule for the call's lengths (`model.estimate(call)`, with
  the `Call` below): the steps a backend's time takes where its programs or chunks
  overflow the SMs, and in ragged batches, which the interpolation between uniform points
  cannot see. A model may also give the lookup a quantity to interpolate instead of the
  time (`point_rate`: the "rates" grid). Models run in the registry's order of their
  backends (backends.BACKEND_MODULES), then by variant name; each sees the estimates
  so far.
- `fit_models` fits every backend's models for a family when the table is built.
- Where a C compiler is found, the interpolation runs in C (`_Dense`), and where every
  model of a family also gives a C estimate (`native_estimate`), the family's whole
  estimate and its fastest variant are one C call (`_Compiled`: `Estimator.pick`, and
  `pick_lengths`, a DecodePlan step's, which also copies the host lengths in and takes
  their mean); the Python steps stay for a machine without a compiler and give the same
  picks (tests/test_native_replays.py).

Nothing here names a backend. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mla_tune import native
from mla_tune.backends import capabilities, known_backends, schedule_module
from mla_tune.core import Variant

_KV_STEPS_PER_OCTAVE = 64  # the eager pick's memo: lengths within ~1% share one estimate
# The schedule models run only where they can change the pick, to save host time (each
# replays a schedule, a heap operation per chunk or program): where their variant's
# interpolated time is within MODEL_WINDOW x the best (each model's `estimate` says
# against what; FlashInfer's also limits the chunks it deals). Rescoring docs/data/verify
# without the window (scripts/rescore_ablation.py) changes no run's verdict (the pooled
# p95 moves by under 0.1 point).
MODEL_WINDOW = 1.5


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
# A point holds the variants the sweep timed there (a batch-edge point: its bucket's
# finalists), so a variant missing at one is imputed from the points around it rather than
# dropped where those weigh enough; with no weight required at all, a variant left out of
# a point (usually slow there) is imputed from far away: rescoring docs/data/verify with 0 (scripts/rescore_ablation.py), the runs within
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


def _kv_step(mean_kv_len: float) -> tuple[int, float]:
    """(step, length): a mean length taken to ~1% (_KV_STEPS_PER_OCTAVE), the step the
    memos key on and the length the estimate is made at."""
    step = round(math.log2(max(mean_kv_len, 1.0)) * _KV_STEPS_PER_OCTAVE)
    return step, 2.0 ** (step / _KV_STEPS_PER_OCTAVE)


def uniform_length(mean_kv_len: float) -> int:
    """The whole length `Estimator.at_uniform` computes at for a mean length."""
    return max(int(round(_kv_step(mean_kv_len)[1])), 1)


def _present(variants: Sequence[Variant], values: Sequence[float]) -> dict[Variant, float]:
    """{variant: value} of the C results, leaving out the NANs (a variant with none)."""
    return {v: t for v, t in zip(variants, values, strict=True) if t == t}


class _Grid:
    """A family's points (times or rates) with what `interpolate` sorts on every call
    sorted once, and `_at_batch` memoized per (measured batch, length) in `memo`: the
    eager lookup's `interpolate`, in fewer steps (the same arithmetic). Where a C compiler
    is found (mla_tune/native.py) the points are also laid out densely (`_dense`) and
    `interpolate` runs in C (`_NATIVE_SOURCE`): the same steps, with a missing variant's
    ratio over the variants in common summed in the variants' order (Python sums it in a
    set's order), so the two agree to rounding (tests/test_native_replays.py)."""

    __slots__ = ("points", "batches", "kvs", "past", "memo", "dense")

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
        lib = _native() if self.batches else None
        self.dense = _Dense(self, lib) if lib is not None else None

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
        if self.dense is not None:
            return self.dense(batch, kv_len)
        return _blend([(w, self.at_batch(b, kv_len)) for b, w in _bracket(self.batches, batch)])


# `_Grid.interpolate` in C over a dense layout of the points (`_Dense`): `interpolate`'s
# steps (_bracket, _at_batch, _blend) one for one, in IEEE doubles without contraction
# (mla_tune/native.py), NAN for a variant a point lacks or the call leaves out.
_NATIVE_SOURCE = native.ESTIMATE_H + native.LIST_C + r"""

typedef struct {
    const double *t;        /* [nb][mk][nv] times, NAN where the point lacks the variant */
    const double *slope;    /* [nb][nv] slope past the last length, NAN where none */
    const int64_t *kvs;     /* [nb][mk] lengths, sorted; nk[b] of them used */
    const int64_t *nk;      /* [nb] */
    const int64_t *batches; /* [nb] sorted */
    int64_t nb, mk, nv;
    double min_w;
} grid_t;

/* _bracket: the grid points around x (their indices) and weights; returns their count */
static int bracket(const int64_t *g, int64_t n, double x, int64_t *at, double *w) {
    int64_t i = 0;
    while (i < n && (double)g[i] < x) i++;  /* bisect_left */
    if (i < n && (double)g[i] == x) { at[0] = i; w[0] = 1.0; return 1; }
    if (i == 0 || i == n) { at[0] = i < n ? i : n - 1; w[0] = 1.0; return 1; }
    double lo = (double)g[i - 1], hi = (double)g[i];
    double f = log(x / lo) / log(hi / lo);
    at[0] = i - 1; w[0] = 1.0 - f; at[1] = i; w[1] = f;
    return 2;
}

/* _blend of m rows (m <= 2) with weights w into out */
static void blend(const double *const *rows, const double *w, int m, int64_t nv, double min_w, double *out) {
    for (int64_t v = 0; v < nv; v++) {
        if (m == 1) { out[v] = rows[0][v]; continue; }
        int have = 0;
        double have_w = 0.0;
        for (int j = 0; j < m; j++) if (!isnan(rows[j][v])) { have++; have_w += w[j]; }
        if (have == 0 || (have < m && have_w < min_w - 1e-12)) { out[v] = NAN; continue; }
        double total = 0.0;
        int ok = 1;
        for (int j = 0; j < m && ok; j++) {
            if (!isnan(rows[j][v])) { total += w[j] * log(rows[j][v]); continue; }
            double num = 0.0, den = 0.0;
            for (int h = 0; h < m; h++) {
                if (isnan(rows[h][v])) continue;
                double r = 0.0;
                int64_t common = 0;
                for (int64_t c = 0; c < nv; c++) {
                    if (c == v || isnan(rows[j][c]) || isnan(rows[h][c])) continue;
                    r += log(rows[j][c] / rows[h][c]);
                    common++;
                }
                if (common) {
                    num = num + w[h] * (log(rows[h][v]) + r / (double)common);
                    den = den + w[h];
                }
            }
            if (den == 0.0) ok = 0;
            else total += w[j] * num / den;
        }
        out[v] = ok ? exp(total) : NAN;
    }
}

/* _at_batch at the measured batch b */
static void at_batch(const grid_t *g, int64_t b, double kv, double *out) {
    int64_t nk = g->nk[b];
    const int64_t *kvs = g->kvs + b * g->mk;
    const double *t = g->t + b * g->mk * g->nv;
    if (nk >= 2 && kv > (double)kvs[nk - 1]) {
        const double *t1 = t + (nk - 1) * g->nv, *s = g->slope + b * g->nv;
        double ratio = kv / (double)kvs[nk - 1];
        for (int64_t v = 0; v < g->nv; v++) out[v] = isnan(s[v]) ? NAN : t1[v] * pow(ratio, s[v]);
        return;
    }
    int64_t at[2];
    double w[2];
    int m = bracket(kvs, nk, kv, at, w);
    const double *rows[2] = {t + at[0] * g->nv, t + at[m - 1] * g->nv};
    blend(rows, w, m, g->nv, g->min_w, out);
}

/* interpolate: out[nv] (scratch: 2 x nv doubles) */
void grid_interpolate(const grid_t *g, double batch, double kv, double *scratch, double *out) {
    int64_t at[2];
    double w[2];
    int m = bracket(g->batches, g->nb, batch, at, w);
    for (int j = 0; j < m; j++) at_batch(g, at[j], kv, scratch + j * g->nv);
    const double *rows[2] = {scratch, scratch + (m - 1) * g->nv};
    blend(rows, w, m, g->nv, g->min_w, out);
}

/* Estimator.estimates and `fastest` for one call, compiled (`_Compiled`): the three grids
   (NULL: none) over the family's variants, then each model's C estimate in order; out (the
   family's own buffers, so that a call passes only what changes): interp, rates, buckets
   and est, nv each, scratch 2 x nv. Returns the fastest variant's index (ties to the first:
   the variants are in name order), -1 where none is estimated; f->best_allowed: the fastest
   among those whose `allowed` byte is set (-1: none, or allowed NULL). */
typedef struct {
    const grid_t *times, *rates, *buckets;
    int64_t nm, nv;
    const int64_t *model_variant;
    const int64_t *model_fn;      /* est_model_fn addresses */
    const int64_t *model_params;  /* const double * addresses */
    double window;
    double *scratch, *interp, *rates_out, *buckets_out, *est;
    int64_t best_allowed;
    double kv_steps;              /* _KV_STEPS_PER_OCTAVE */
    double mean;                  /* family_step's: the lengths' mean, as Python's sum / len */
} family_t;

int64_t family_estimate(family_t *f, const int64_t *lens, int64_t n, int64_t batch, double kv,
                        int64_t uniform_len, int64_t calibrated, const uint8_t *allowed) {
    int64_t nv = f->nv;
    double *scratch = f->scratch, *interp = f->interp, *rates = f->rates_out, *buckets = f->buckets_out;
    double *est = f->est;
    f->best_allowed = -1;
    grid_interpolate(f->times, (double)batch, kv, scratch, interp);
    double lo = NAN;
    for (int64_t v = 0; v < nv; v++) {
        est[v] = interp[v];
        if (!isnan(interp[v]) && (isnan(lo) || interp[v] < lo)) lo = interp[v];
    }
    if (isnan(lo)) return -1;
    if (f->nm > 0) {
        for (int64_t v = 0; v < nv; v++) rates[v] = buckets[v] = NAN;
        if (f->rates) grid_interpolate(f->rates, (double)batch, kv, scratch, rates);
        if (f->buckets) grid_interpolate(f->buckets, (double)batch, kv, scratch, buckets);
        est_call_t call = {lens, n, batch, uniform_len, calibrated, nv, kv, f->window, lo, interp, rates, buckets,
                           est};
        for (int64_t m = 0; m < f->nm; m++) {
            est_model_fn fn = (est_model_fn)(intptr_t)f->model_fn[m];
            double t = fn((const double *)(intptr_t)f->model_params[m], f->model_variant[m], &call);
            if (!isnan(t)) est[f->model_variant[m]] = t;
        }
    }
    int64_t best = -1, ok = -1;
    for (int64_t v = 0; v < nv; v++) {
        if (isnan(est[v])) continue;
        if (best < 0 || est[v] < est[best]) best = v;
        if (allowed && allowed[v] && (ok < 0 || est[v] < est[ok])) ok = v;
    }
    f->best_allowed = ok;
    return best;
}

/* family_estimate for a step of n > 0 sequences of these lengths (`_Compiled.pick_lengths`):
   their mean, taken to ~1% as _kv_step takes it (the grids' length) and as a whole length
   (uniform_length), calibrated; Python's arithmetic step by step (its int sum, true
   division, math.log2, round half to even, 2.0 ** x) */
int64_t family_step(family_t *f, const int64_t *lens, int64_t n, int64_t batch, const uint8_t *allowed) {
    int64_t total = 0;
    for (int64_t s = 0; s < n; s++) total += lens[s];
    double mean = (double)total / (double)n;
    f->mean = mean;
    double step = nearbyint(log2(mean > 1.0 ? mean : 1.0) * f->kv_steps);
    double kv = pow(2.0, step / f->kv_steps);
    double whole = nearbyint(kv);
    return family_estimate(f, lens, n, batch, kv, whole > 1.0 ? (int64_t)whole : 1, 1, allowed);
}

/* family_step over a Python list of lengths, copied into buf (cap int64s) first; -2 where
   the list cannot be read so (more than cap items, or one not an int of 64 bits) */
int64_t family_step_list(family_t *f, PyObject *list, int64_t *buf, int64_t cap, int64_t batch,
                         const uint8_t *allowed) {
    int64_t n = ints_of_list(list, buf, cap);
    if (n < 1) return -2;
    return family_step(f, buf, n, batch, allowed);
}
"""


class _GridC(ctypes.Structure):
    _fields_ = [("t", ctypes.c_void_p), ("slope", ctypes.c_void_p), ("kvs", ctypes.c_void_p),
                ("nk", ctypes.c_void_p), ("batches", ctypes.c_void_p), ("nb", ctypes.c_int64),
                ("mk", ctypes.c_int64), ("nv", ctypes.c_int64), ("min_w", ctypes.c_double)]


class _FamilyC(ctypes.Structure):
    _fields_ = [("times", ctypes.c_void_p), ("rates", ctypes.c_void_p), ("buckets", ctypes.c_void_p),
                ("nm", ctypes.c_int64), ("nv", ctypes.c_int64), ("model_variant", ctypes.c_void_p),
                ("model_fn", ctypes.c_void_p), ("model_params", ctypes.c_void_p), ("window", ctypes.c_double),
                ("scratch", ctypes.c_void_p), ("interp", ctypes.c_void_p), ("rates_out", ctypes.c_void_p),
                ("buckets_out", ctypes.c_void_p), ("est", ctypes.c_void_p), ("best_allowed", ctypes.c_int64),
                ("kv_steps", ctypes.c_double), ("mean", ctypes.c_double)]


_I64 = ctypes.c_int64
_native = native.Library("serving_interpolate", _NATIVE_SOURCE, {
    "grid_interpolate": (None, (ctypes.POINTER(_GridC), ctypes.c_double, ctypes.c_double, ctypes.c_void_p,
                                ctypes.c_void_p)),
    "family_estimate": (_I64, (ctypes.c_void_p, ctypes.c_void_p, _I64, _I64, ctypes.c_double, _I64, _I64,
                               ctypes.c_void_p)),
    "family_step": (_I64, (ctypes.c_void_p, ctypes.c_void_p, _I64, _I64, ctypes.c_void_p)),
    "family_step_list": (_I64, (ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p, _I64, _I64, ctypes.c_void_p))},
    python_api=True)


class _Dense:
    """A _Grid's points as the C `grid_interpolate` reads them (the arrays kept alive here),
    and calling it: `interpolate`'s {variant: us} for (batch, kv_len)."""

    __slots__ = ("variants", "arrays", "struct", "scratch", "out", "fn", "args")

    def __init__(self, grid: _Grid, lib, variants: list[Variant] | None = None):
        if variants is None:
            variants = sorted({v for times in grid.points.values() for v in times}, key=str)
        index = {v: i for i, v in enumerate(variants)}
        nb, nv = len(grid.batches), len(variants)
        mk = max(len(k) for k in grid.kvs.values())
        t = np.full((nb, mk, nv), np.nan)
        kvs = np.zeros((nb, mk), dtype=np.int64)
        slope = np.full((nb, nv), np.nan)
        for i, b in enumerate(grid.batches):
            for j, k in enumerate(grid.kvs[b]):
                kvs[i, j] = k
                for v, us in grid.points[(b, k)].items():
                    t[i, j, index[v]] = us
            for v, s in (grid.past[b][2] if b in grid.past else {}).items():
                slope[i, index[v]] = s
        nk = np.asarray([len(grid.kvs[b]) for b in grid.batches], dtype=np.int64)
        batches = np.asarray(grid.batches, dtype=np.int64)
        self.variants, self.arrays = variants, (t, slope, kvs, nk, batches)
        self.struct = _GridC(t.ctypes.data, slope.ctypes.data, kvs.ctypes.data, nk.ctypes.data,
                             batches.ctypes.data, nb, mk, nv, MIN_MEASURED_WEIGHT)
        self.scratch, self.out = np.empty(2 * nv), np.empty(nv)
        self.fn = lib.grid_interpolate
        self.args = (ctypes.byref(self.struct), self.scratch.ctypes.data, self.out.ctypes.data)

    def __call__(self, batch: int, kv_len: float) -> dict[Variant, float]:
        ref, scratch, out = self.args
        self.fn(ref, float(batch), float(kv_len), scratch, out)
        return _present(self.variants, self.out.tolist())


class _Compiled:
    """A family's whole eager estimate in one C call (`family_estimate`): its three grids laid
    out over the family's variants (name order), and each model's C estimate (a model's
    `native_estimate(key, calibration)`: its C function and params). Made by
    Estimator.prepare where every model of the family has one and a C compiler is found;
    `Estimator.pick` then runs it instead of `estimates` and `fastest` (the same picks:
    tests/test_native_replays.py)."""

    __slots__ = ("variants", "keep", "struct", "out", "address", "fn", "step_fn", "step_list_fn", "lens")

    def __init__(self, estimator: Estimator, family, lib, natives: list):
        variants = sorted({v for times in family.points.values() for v in times}, key=str)
        index = {v: i for i, v in enumerate(variants)}
        grids = []
        for kind in ("times", "rates", "buckets"):
            grid = estimator.grid(kind, family)
            grids.append(_Dense(grid, lib, variants) if grid.batches else None)
        models = list(family.models)
        order = np.asarray([index[v] for v in models], dtype=np.int64)
        fns = np.asarray([fn for fn, _ in natives], dtype=np.int64)
        params = [p for _, p in natives]
        param_ptrs = np.asarray([p.ctypes.data for p in params], dtype=np.int64)
        self.variants = variants
        self.keep = (grids, order, fns, params, param_ptrs)
        nv = len(variants)
        # scratch (2 x nv), then interp, rates, buckets and est (nv each): the struct points
        # at them, so a call passes only its lengths, batch, length and mask
        self.out = np.empty(6 * nv)
        base = self.out.ctypes.data
        self.struct = _FamilyC(*(ctypes.addressof(g.struct) if g is not None else None for g in grids),
                               len(models), nv, order.ctypes.data, fns.ctypes.data,
                               param_ptrs.ctypes.data, MODEL_WINDOW, base, base + 16 * nv, base + 24 * nv,
                               base + 32 * nv, base + 40 * nv, -1, float(_KV_STEPS_PER_OCTAVE))
        self.address = ctypes.addressof(self.struct)
        self.fn, self.step_fn, self.step_list_fn = lib.family_estimate, lib.family_step, lib.family_step_list
        self.lens = native.IntBuffer()  # the call's lengths, copied in once per call

    def mask(self, allowed: Callable[[Variant], bool]) -> np.ndarray:
        """`allowed` as the C call reads it: a byte per variant."""
        return np.asarray([bool(allowed(v)) for v in self.variants], dtype=np.uint8)

    def __call__(self, batch: int, kv: float, kv_lens: Sequence[int] | None, mean_kv_len: float,
                 uniform_len: int, mask_address: int | None = None) -> tuple[Variant | None, Variant | None]:
        """The pick and the fastest variant the mask at `mask_address` allows (an `Allowed`'s;
        None without one) for a call of these lengths (kv_lens; None: `batch` sequences of the
        mean, uncalibrated, as `Call.lengths` says) at the grids' length kv. The estimates
        stay in `out`'s last nv values until the next call."""
        n = self.lens.fill(kv_lens if kv_lens is not None else [max(int(round(mean_kv_len)), 1)] * batch)
        return self._picked(self.fn(self.address, self.lens.address, n, batch, kv, uniform_len,
                                    int(kv_lens is not None), mask_address))

    def pick_lengths(self, batch: int, kv_lens: Sequence[int], mask_address: int | None = None
                     ) -> tuple[Variant | None, Variant | None]:
        """`Estimator.pick(family, batch, sum(kv_lens) / len(kv_lens), kv_lens, allowed)`'s
        pick and fastest allowed variant (`mask_address`: an `Allowed`'s address, or None)
        for a step whose lengths are on the host (one or more), the mean and its steps taken
        in the same C call: a DecodePlan's step."""
        lens = self.lens
        best = (self.step_list_fn(self.address, kv_lens, lens.address, lens.capacity, batch, mask_address)
                if type(kv_lens) is list else -2)
        if best == -2:  # not a list of ints that fits the buffer: copied in by fill (which grows it,
            n = lens.fill(kv_lens)  # so its address is read after)
            best = self.step_fn(self.address, lens.address, n, batch, mask_address)
        return self._picked(best)

    @property
    def last_mean(self) -> float:
        """The mean of the lengths of the last `pick_lengths` call (their sum / their count,
        as Python's int arithmetic gives it), from the same C call."""
        return self.struct.mean

    def estimates_left(self) -> dict[Variant, float]:
        """The estimates (us) the last call left in `out`, a variant with none left out."""
        values = self.out[-len(self.variants):].tolist()
        return {v: t for v, t in zip(self.variants, values, strict=True) if t == t}

    def _picked(self, best: int) -> tuple[Variant | None, Variant | None]:
        """(the pick, the fastest allowed) of a C call that returned `best` (-1: none)."""
        ok = self.struct.best_allowed
        return (self.variants[best] if best >= 0 else None), (self.variants[ok] if ok >= 0 else None)


@dataclass(frozen=True)
class Allowed:
    """A set of variants for `Estimator.pick` (made by `Estimator.allowed`): the predicate,
    and its bytes over the compiled family's variants (None where not compiled)."""

    accepts: Callable[[Variant], bool]
    mask: np.ndarray | None = field(default=None, compare=False)
    address: int | None = field(default=None, init=False, compare=False)  # the mask's, for the C call

    def __post_init__(self):
        object.__setattr__(self, "address", None if self.mask is None else self.mask.ctypes.data)


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




def model_order(models: Mapping[Variant, Any]) -> dict[Variant, Any]:
    """The models in the order the estimate applies them: their backends' registry order,
    then by variant name."""
    rank = {name: i for i, name in enumerate(known_backends())}
    return dict(sorted(models.items(), key=lambda item: (rank.get(item[0].backend, len(rank)), str(item[0]))))


def fit_models(key, points: Mapping[tuple[int, int], Mapping[Variant, float]],
               cells: Mapping[tuple[int, int], Mapping[str, float]], platform: Mapping) -> dict[Variant, Any]:
    """Every schedule model of a family: for each backend with a schedule module among
    the family's point variants, its `fit(key, variants, points, cells, platform,
    interpolate)` (variants: that backend's point variants, by name; cells: every timed
    cell's {variant name: us} at uniform lengths; platform: {sm_count, smem_per_sm})."""
    by_backend: dict[str, set[Variant]] = {}
    for times in points.values():
        for v in times:
            by_backend.setdefault(v.backend, set()).add(v)
    models = {}
    for backend, variants in by_backend.items():
        module = schedule_module(backend)
        if module is not None:
            for m in module.fit(key, sorted(variants, key=str), points, cells, platform, interpolate):
                models[m.variant] = m
    return model_order(models)


class Call:
    """One eager call as the schedule models see it (their `estimate(call)`):
    key (the family: heads, q_len), batch, mean (kv_len), `interp` (every variant's
    interpolated time) and `interp_min()`, `est` (the estimates so far, the interpolation
    updated by the models before), window (MODEL_WINDOW), calibrated (apply the family's
    calibration: the lookup does where it has the call's lengths), `lengths()` (the
    call's lengths as an int64 array, made once: kv_lens, else batch sequences of the
    mean), `interpolated(kind)` (the "rates" grid or the batch buckets' points alone,
    "buckets"), `uniform(kind, model, compute)` (compute(length) for a uniform batch of the
    mean, memoized) and `calibration(backend)`."""

    __slots__ = ("estimator", "family", "key", "batch", "mean", "kv_lens", "interp", "est", "window",
                 "calibrated", "_lengths", "_min", "_kinds")

    def __init__(self, estimator: Estimator, family, batch: int, mean: float, kv_lens, interp: dict,
                 calibrated: bool):
        self.estimator, self.family, self.key = estimator, family, family.key
        self.batch, self.mean, self.kv_lens = batch, mean, kv_lens
        self.interp, self.est = interp, dict(interp)
        self.window, self.calibrated = MODEL_WINDOW, calibrated
        self._lengths = self._min = None
        self._kinds: dict[str, dict] = {}

    def interp_min(self) -> float:
        if self._min is None:
            self._min = min(self.interp.values())
        return self._min

    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            lens = self.kv_lens if self.kv_lens is not None else [max(int(round(self.mean)), 1)] * self.batch
            self._lengths = np.asarray(lens, dtype=np.int64)
        return self._lengths

    def interpolated(self, kind: str) -> dict[Variant, float]:
        out = self._kinds.get(kind)
        if out is None:
            out = self._kinds[kind] = self.estimator.interpolated(kind, self.family, self.batch, self.mean)
        return out

    def uniform(self, kind: str, model, compute: Callable[[int], Any]) -> Any:
        return self.estimator.at_uniform(kind, self.family, model, self.batch, self.mean, compute)

    def uniform_length(self) -> int:
        """The length `uniform` hands its compute: the mean, taken to ~1%."""
        return uniform_length(self.mean)

    def calibration(self, backend: str) -> dict:
        return self.family.calibration.get(backend, {})


class Estimator:
    """A table's eager estimates, with what they memoize: the interpolation grids per
    family, their results per (batch, kv_len to ~1%), the uniform-batch quantities the
    models ask for. `table`: the ServingTable (its batch buckets, provenance and path)."""

    def __init__(self, table):
        self.table = table
        self._memo: dict = {}
        self._derived: dict = {}
        self._grids: dict = {}

    def clear(self) -> None:
        """Forget every memoized result (after a family's points or models change)."""
        self._memo.clear()
        self._derived.clear()
        self._grids.clear()

    def prepare(self, family) -> None:
        """The one-off work for a family, so that none is left for a call: each
        interpolation grid (the rates need a model replay per point) and one estimate
        through every model (the replays' first call, which builds or loads their C
        library: mla_tune/native.py)."""
        if not family.points:
            return
        for kind in ("times", "rates", "buckets"):
            self.grid(kind, family)
        for batch in (1, self.table.batch_buckets[-1]):
            self.estimates(family, batch, 4096.0, [4096] * batch)
        self.compiled(family)

    def compiled(self, family, own: bool = False) -> _Compiled | None:
        """The family's compiled estimate (`_Compiled`), made once; None where a model has no
        C estimate or no C compiler is found (`pick` then runs the Python estimate).
        own=True: a new one for the caller alone, its buffers its own (a DecodePlan's, so that
        plans stepped on different threads share none); a `_Compiled` serves one thread."""
        key = ("compiled", family.key)
        if key not in self._derived or own:
            lib = _native()
            natives = []
            for variant, model in family.models.items():
                make = getattr(model, "native_estimate", None)
                made = make(family.key, family.calibration.get(variant.backend, {})) if make else None
                if made is None:
                    break
                natives.append(made)
            ok = lib is not None and len(natives) == len(family.models) and bool(family.points)
            made = _Compiled(self, family, lib, natives) if ok else None
            if own:
                return made
            self._derived[key] = made
        return self._derived[key]

    def pick(self, family, batch: int, mean_kv_len: float, kv_lens: Sequence[int] | None,
             allowed: Allowed | None = None, compiled: _Compiled | None = None
             ) -> tuple[Variant | None, Variant | None]:
        """(`fastest(estimates(...))`, `fastest(estimates, allowed)` where `allowed` is given,
        else None): in one C call where the family is compiled (`compiled`; a caller's own,
        `compiled(family, own=True)`, where given), else through `estimates`. `allowed` is
        `self.allowed(family, ...)`'s, made once."""
        self._warn_versions_once(family)
        compiled = compiled if compiled is not None else self.compiled(family)
        if compiled is None:
            est = self.estimates(family, batch, mean_kv_len, kv_lens)
            return fastest(est), None if allowed is None else fastest(est, allowed.accepts)
        kv = _kv_step(mean_kv_len)[1]
        mask = None if allowed is None else allowed.mask
        if mask is not None and len(mask) != len(compiled.variants):
            raise ValueError("this allowed set was made for another family; make it with allowed(family, ...)")
        return compiled(batch, kv, kv_lens, mean_kv_len, max(int(round(kv)), 1),
                        None if allowed is None else allowed.address)

    def allowed(self, family, accepts: Callable[[Variant], bool]) -> Allowed:
        """The variants `accepts` takes, for `pick`'s fastest allowed one: as the compiled
        estimate reads them (a byte per variant) where the family is compiled."""
        compiled = self.compiled(family)
        return Allowed(accepts, compiled.mask(accepts) if compiled is not None else None)

    def estimates(self, family, batch: int, mean_kv_len: float, kv_lens: Sequence[int] | None) -> dict[Variant, float]:
        """Every point variant's estimated time (us): interpolated, then each model's
        estimate where it gives one (see the module)."""
        self._warn_versions_once(family)
        interp = self.interpolated("times", family, batch, mean_kv_len)
        if not family.models:
            return dict(interp)
        call = Call(self, family, batch, mean_kv_len, kv_lens, interp, kv_lens is not None)
        est = call.est
        for v, model in family.models.items():
            t = model.estimate(call)
            if t is not None:
                est[v] = t
        return est

    def model_estimates(self, family, kv_lens: Sequence[int], calibrated: bool = True) -> dict[Variant, float]:
        """Each model's own estimate (`estimate(call, raw=True)`: no window, no floor) for a
        call of these lengths, with or without the family's calibration: what
        serving/calibrate.py compares its probes with."""
        if not family.models or not kv_lens:
            return {}
        batch, mean = len(kv_lens), sum(kv_lens) / len(kv_lens)
        call = Call(self, family, batch, mean, kv_lens, self.interpolated("times", family, batch, mean), calibrated)
        return {v: t for v, m in family.models.items() if (t := m.estimate(call, raw=True)) is not None}

    def _warn_versions_once(self, family) -> None:
        """`_warn_versions` at a family's first estimate."""
        if ("versions", family.key) not in self._derived:
            self._derived[("versions", family.key)] = True
            self._warn_versions(family)

    def _warn_versions(self, family) -> None:
        """Warn once per vendor distribution whose scheduler a family's model replays (its
        backend's CAPABILITIES.vendor) where the installed version is not the one the
        table's provenance records, as the leaderboard runtime warns (runtime/__init__.py).
        A distribution not installed here is not warned about: its picks cannot run here,
        and the plan says so."""
        from importlib import metadata

        tuned = self.table.provenance.get("versions") or {}
        for variant in family.models:
            dist = capabilities(variant.backend).vendor
            if not dist or dist not in tuned or ("versions", dist) in self._derived:
                continue
            try:
                here = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            self._derived[("versions", dist)] = True
            if here != tuned[dist]:
                warnings.warn(f"serving table {self.table.path}: provenance.versions.{dist} is {tuned[dist]} but "
                              f"this process has {here}; the lookup replays its scheduler as the table's version "
                              "ran it, so its estimates may have moved: re-run the serving sweep "
                              "(mla-tune sweep --config configs/serving.yaml) to refresh the table", stacklevel=5)

    def at_uniform(self, kind: str, family, model, batch: int, mean_kv_len: float,
                   compute: Callable[[int], Any]) -> Any:
        """compute(length) for a uniform batch of the mean length, the length taken to ~1%
        and the result memoized per (kind, family, variant, batch, length)."""
        step, kv = _kv_step(mean_kv_len)
        memo_key = (kind, family.key, model.variant, batch, step)
        if memo_key not in self._memo:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            self._memo[memo_key] = compute(max(int(round(kv)), 1))
        return self._memo[memo_key]

    def interpolated(self, kind: str, family, batch: int, mean_kv_len: float) -> dict[Variant, float]:
        """`interpolate` over the family's points ("times"), its models' point rates
        ("rates") or its batch buckets' points alone ("buckets"), memoized per (batch,
        kv_len to ~1%). The result is shared: do not change it."""
        step, kv = _kv_step(mean_kv_len)
        memo_key = (kind, family.key, batch, step)
        if memo_key not in self._memo:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            self._memo[memo_key] = self.grid(kind, family).interpolate(batch, kv)
        return self._memo[memo_key]

    def derived(self, kind: str, family) -> dict[tuple[int, int], dict[Variant, float]]:
        """The points a derived grid interpolates: "rates" (each model's point_rate at each
        point of its variant) or "buckets" (the points at the batch buckets)."""
        if (kind, family.key) not in self._derived:
            if kind == "rates":
                derived = point_rates(family.points, family.models, family.key)
            else:
                buckets = set(self.table.batch_buckets)
                derived = {pt: times for pt, times in family.points.items() if pt[0] in buckets}
            self._derived[(kind, family.key)] = derived
        return self._derived[(kind, family.key)]

    def grid(self, kind: str, family) -> _Grid:
        """The points `interpolated` reads, as a _Grid made once per (kind, family) (by
        `prepare`), kept when the memo of results is emptied for its size: making one
        again costs milliseconds (the rates replay every point), a stall in a step."""
        grid = self._grids.get((kind, family.key))
        if grid is None:
            points = family.points if kind == "times" else self.derived(kind, family)
            grid = self._grids[(kind, family.key)] = _Grid(points, self._memo)
        return grid


def point_rates(points: Mapping[tuple[int, int], Mapping[Variant, float]], models: Mapping[Variant, Any],
                key) -> dict[tuple[int, int], dict[Variant, float]]:
    """Each point's rate (`model.point_rate`) of the variants whose model has one: what the
    lookup interpolates for them instead of their times."""
    rates: dict[tuple[int, int], dict[Variant, float]] = {}
    for (batch, kv_len), times in points.items():
        for v, t in times.items():
            m = models.get(v)
            rate = getattr(m, "point_rate", None)
            if rate is not None and (r := rate(key, batch, kv_len, t)) is not None:
                rates.setdefault((batch, kv_len), {})[v] = r
    return rates
