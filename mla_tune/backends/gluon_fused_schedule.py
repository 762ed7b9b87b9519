"""gluon_fused's serving schedule model: its programs dealt to the SMs at a call's own
lengths, and the variant's time over that schedule (the serving lookup's estimate).

The serving kernel (kernels/gluon_serving.py) splits each sequence on the device by its
own length: want = clamp(cdiv(len, tokens_per_split), 1, max_splits) splits of whole
64-token tiles (or, with a batch budget, the sequence's share of split_budget splits over
the batch's tokens, clamped the same way), cdiv(tiles, want) tiles each. Each split runs
heads // block_h x v_halves programs. A ragged batch's long sequence is cut into at most
max_splits items, so with a small cap its few long programs make the call wait: a step
that the interpolation between uniform points cannot see.

`gluon_schedule` replays that rule and deals the programs to sm_count x occupancy slots
(makespan.deal); `GluonModel` is the makespan model over it (makespan.MakespanModel:
overhead + rate x makespan, fitted per variant, its occupancy at most what the kernel's
shared memory leaves room for). The reduction that follows is not modelled: its cost is
in the points' times. The replay is numpy, and C for the lookup (mla_tune/native.py; the
same numbers). Nothing here imports torch; tests/test_gluon_serving.py checks the rule
and the shared memory against the kernel's own (gs_num_splits, gs_smem_bytes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mla_tune import native
from mla_tune.backends.makespan import (
    DEFAULT_SMEM_PER_SM,
    EXACT_WAVES,
    MakespanModel,
    deal,
    fit_models,
    load_model,
)

TILE = 64  # tokens per tile: the kernel's GS_BN
BOXES, BOX = 9, 64  # 576 columns as 64-column boxes: the kernel's GS_BOXES, GS_BOX


def gluon_splits(lens: np.ndarray, max_splits: int, tokens_per_split: int, split_budget: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(splits, tokens per split) of each sequence (int64 arrays), the kernel's rule
    (gluon_serving.gs_num_splits); 0 splits for an empty sequence."""
    lens = np.asarray(lens, dtype=np.int64)
    tiles = -(-lens // TILE)
    want = -(-lens // tokens_per_split)
    if split_budget > 0:
        total = int(lens.sum())
        want = np.minimum(want, (lens * split_budget + total // 2) // max(total, 1))
    want = np.clip(want, 1, max_splits)
    per = -(-tiles // want)
    splits = np.where(lens > 0, -(-tiles // np.maximum(per, 1)), 0)
    return splits, per * TILE


def gluon_schedule(kv_lens: Sequence[int], heads: int, params: Mapping, occupancy: int, sm_count: int,
                   item_tokens: float = 0.0) -> float:
    """The makespan of the call's programs: each sequence's splits (`gluon_splits`), the last
    holding what is left, each run by heads // block_h x v_halves programs, dealt to
    sm_count x occupancy slots with item_tokens' fixed cost each (makespan.deal)."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    lens = lens[lens > 0]
    if lens.shape[0] == 0:
        return 0.0
    splits, per = gluon_splits(lens, int(params["max_splits"]), int(params["tokens_per_split"]),
                               int(params.get("split_budget", 0)))
    items = np.repeat(per, splits)
    ends = np.cumsum(splits) - 1
    items[ends] = lens - (splits - 1) * per
    return deal(items, _programs(heads, params), max(sm_count * occupancy, 1), float(item_tokens))


def _programs(heads: int, params: Mapping) -> int:
    """Programs per split: head tiles x V halves."""
    return max(heads // int(params["block_h"]), 1) * int(params.get("v_halves", 1))


def smem_bytes(rows: int, num_stages: int, fp8: bool) -> int:
    """The kernel's shared memory per program (gluon_serving.gs_smem_bytes): the KV ring, q,
    P^T, the barriers and 256 B."""
    elem = 1 if fp8 else 2
    return num_stages * BOXES * TILE * BOX * elem + BOXES * rows * BOX * elem + TILE * rows * 2 + 8 * num_stages + 256


def occupancy_cap(variant, q_len: int, smem_per_sm: int = 0) -> int:
    """The most programs of this variant one SM can hold by its shared memory at q_len new
    tokens (block_h x next_pow2(q_len) rows) in smem_per_sm bytes (0:
    makespan.DEFAULT_SMEM_PER_SM), at least 1."""
    rows = int(variant.get("block_h")) * (1 << max(q_len - 1, 0).bit_length())
    need = smem_bytes(rows, int(variant.get("num_stages") or 2), variant.get("kv") == "fp8")
    return max(1, (smem_per_sm or DEFAULT_SMEM_PER_SM) // need)


# gluon_schedule and GluonModel.estimate in C, the same arithmetic (IEEE doubles, no
# contraction: mla_tune/native.py), with makespan.deal's dealing (native.DEAL_C).
_NATIVE_SOURCE = native.DEAL_C + native.ESTIMATE_H + r"""
#include <stdlib.h>
#include <math.h>

static void split_of(int64_t len, int64_t total, int64_t max_splits, int64_t tps, int64_t budget,
                     int64_t *splits, int64_t *per) {
    int64_t tiles = (len + 63) / 64, want = (len + tps - 1) / tps;
    if (budget > 0) {
        int64_t t = total > 1 ? total : 1, share = (len * budget + total / 2) / t;
        if (share < want) want = share;
    }
    if (want < 1) want = 1;
    if (want > max_splits) want = max_splits;
    int64_t p = (tiles + want - 1) / want;
    if (p < 1) p = 1;
    *splits = (tiles + p - 1) / p;
    *per = p * 64;
}

/* gluon_schedule's makespan over n lengths (in *span): 0, or -1 where its buffer cannot be
   had. Each live sequence's splits are taken once (buf); where its programs need dealing
   they go to greedy_runs as runs: its full splits', then its last's. */
int gl_schedule(const int64_t *lens, int64_t n, int64_t max_splits, int64_t tps, int64_t budget, int64_t programs,
                int64_t slots, double item, int64_t exact_waves, double *span) {
    int64_t total = 0, n_items = 0, tokens = 0, longest = 0, live = 0;
    for (int64_t s = 0; s < n; s++) total += lens[s];
    /* each sequence's splits and tokens per split (2 x n), then the runs (2 a sequence) and
       greedy_runs' buffer (3 x slots) */
    void *buf = malloc((size_t)(2 * n) * sizeof(int64_t) + (size_t)(2 * n + 3 * slots) * sizeof(run_t));
    if (buf == NULL) return -1;
    int64_t *splits = buf, *per = splits + n;
    for (int64_t s = 0; s < n; s++) {
        int64_t len = lens[s];
        if (len <= 0) { splits[s] = 0; continue; }
        split_of(len, total, max_splits, tps, budget, &splits[s], &per[s]);
        int64_t first = splits[s] > 1 ? per[s] : len, last = len - (splits[s] - 1) * per[s];
        if (first > longest) longest = first;
        if (last > longest) longest = last;
        n_items += splits[s];
        tokens += len;
        live++;
    }
    if (live == 0) { *span = 0.0; free(buf); return 0; }
    if (deal_short(n_items, programs, slots, exact_waves, tokens, longest, item, span)) { free(buf); return 0; }
    run_t *runs = (run_t *)(per + n);
    int64_t nr = 0;
    for (int64_t s = 0; s < n; s++) {
        if (splits[s] == 0) continue;
        nr = add_run(runs, nr, (double)per[s] + item, (splits[s] - 1) * programs);
        nr = add_run(runs, nr, (double)(lens[s] - (splits[s] - 1) * per[s]) + item, programs);
    }
    *span = greedy_runs(runs, nr, slots, runs + 2 * n);
    free(buf);
    return 0;
}

/* GluonModel.estimate (not raw) as an est_model_fn; p: GluonModel.native_estimate's layout */
double gl_model_estimate(const double *p, int64_t v, const est_call_t *c) {
    double mine = c->interp[v];
    if (isnan(mine) || mine >= c->window * c->interp_min) return NAN;
    int64_t occupancy = (int64_t)p[0], sm = (int64_t)p[2], max_splits = (int64_t)p[4], tps = (int64_t)p[5];
    int64_t budget = (int64_t)p[6], programs = (int64_t)p[7], exact_waves = (int64_t)p[9];
    double overhead = p[1], item = p[3];
    int64_t slots = sm * occupancy;
    if (slots < 1) slots = 1;
    double rate = c->rates[v];
    if (isnan(rate)) {  /* the rate of the interpolated time at a uniform batch of the mean */
        int64_t b = c->batch;
        int64_t *u = malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t));
        if (u == NULL) return NAN;
        for (int64_t i = 0; i < b; i++) u[i] = c->uniform_len;
        double uspan;
        gl_schedule(u, b, max_splits, tps, budget, programs, slots, item, exact_waves, &uspan);
        free(u);
        rate = mine > overhead && uspan > 0 ? (mine - overhead) / uspan : NAN;
    }
    if (isnan(rate) || rate == 0.0) return NAN;
    double span;
    if (gl_schedule(c->lens, c->n, max_splits, tps, budget, programs, slots, item, exact_waves, &span) != 0)
        return NAN;
    double t = overhead + rate * span;
    double floor_t = p[8] * mine;
    return t >= floor_t ? t : floor_t;
}
"""
_I64, _F64 = ctypes.c_int64, ctypes.c_double
_native = native.Library("gluon_schedule", _NATIVE_SOURCE, {
    "gl_schedule": (ctypes.c_int, (ctypes.c_void_p, _I64, _I64, _I64, _I64, _I64, _I64, _F64, _I64,
                                   ctypes.POINTER(_F64)))})


@dataclass(frozen=True)
class GluonModel(MakespanModel):
    """A gluon_fused serving variant's makespan model (makespan.MakespanModel) over
    `gluon_schedule`; no reduction steps."""

    def schedule(self, key, kv_lens: Sequence[int]) -> tuple[float, int]:
        """(makespan, 0): gluon_schedule (its reduction is not modelled)."""
        return gluon_schedule(kv_lens, key.heads, self.params, self.occupancy, self.sm_count, self.item_tokens), 0

    def replay(self, call) -> tuple[float, int, int]:
        """(makespan, 0, 0) for the call's lengths, in one C call where a C compiler is found."""
        lens = call.lengths()
        lib = _native()
        if lib is None:
            return self.schedule(call.key, lens)[0], 0, 0
        p = self.params
        span = ctypes.c_double()
        lens = np.ascontiguousarray(lens, dtype=np.int64)
        lib.gl_schedule(native.address(lens), lens.shape[0], int(p["max_splits"]), int(p["tokens_per_split"]),
                        int(p.get("split_budget", 0)), _programs(call.key.heads, p),
                        max(self.sm_count * self.occupancy, 1), float(self.item_tokens), EXACT_WAVES,
                        ctypes.byref(span))
        return span.value, 0, 0

    def native_estimate(self, key, calibration: Mapping) -> tuple[int, np.ndarray] | None:
        """(the address of `estimate`'s C function, its params) for the family's compiled
        estimate (serving/estimate.py), or None without a C compiler."""
        lib = _native()
        if lib is None:
            return None
        p = self.params
        params = np.asarray([self.occupancy, self.overhead_us, self.sm_count, float(self.item_tokens),
                             int(p["max_splits"]), int(p["tokens_per_split"]), int(p.get("split_budget", 0)),
                             _programs(key.heads, p), self.floor, EXACT_WAVES], dtype=np.float64)
        return ctypes.cast(lib.gl_model_estimate, ctypes.c_void_p).value, params


def fit(key, variants: Sequence, points: Mapping, cells: Mapping, platform: Mapping,
        interpolate: Callable) -> list[GluonModel]:
    """Each serving variant's GluonModel (makespan.fit_models: leave-one-out over its
    points), the occupancy at most occupancy_cap at the family's q_len; `cells` is not used.
    The leaderboard's variants (no tokens_per_split) get none."""
    serving = [v for v in variants if v.get("tokens_per_split") is not None]
    return fit_models(GluonModel, lambda v, smem: occupancy_cap(v, key.q_len, smem), key, serving, points,
                      platform, interpolate)


def load(entry: Mapping, variant, key, check) -> GluonModel:
    """A model from its table entry (as_dict's fields; `check`: the table's field checks)."""
    return load_model(GluonModel, "gluon_fused", entry, variant, check)
