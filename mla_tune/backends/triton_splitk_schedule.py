"""The own split-K serving kernel's schedule model: its programs dealt to the SMs at a call's
own lengths, and the variant's time over that schedule (the serving lookup's estimate).

The kernel (kernels/flash_decode.py, `flash_decode_serving`) deals each sequence's KV into
splits by a rule of the batch's lengths (kernels/split_rule.py replays it), and runs one
program per split and head tile. Its time steps where the programs overflow a wave of the
SMs and, in a ragged batch, where rounding each sequence's share up leaves a few long
programs: steps that the interpolation between grid points cannot see (a uniform batch
between two points whose programs pass a wave of the slots takes a wave longer).

`splitk_schedule` deals the call's programs (each split item once per head tile), in
launch order, to the least-loaded of `slots` program slots (SMs x programs resident per
SM, the occupancy), and returns the most-loaded slot's load: its tokens plus, per
program, `item_tokens`, a program's fixed cost (loading q, writing its partial result for
the combine) in tokens. Without it a bigger split budget always looks faster, though a
few programs past a wave each cost a second program's fixed cost on their SM.

`SplitKModel` takes a variant's time as overhead + rate x makespan: its fixed overhead,
occupancy and item cost are fitted when the table is built (`fit`: leave-one-out over the
variant's grid points; the occupancy capped by `occupancy_cap`), the rate is interpolated
between the points like the times are (`point_rate`), and the makespan is the call's own.
A variant with max_splits 1 runs one program per sequence, so a ragged batch waits for its
longest: the same model covers it.

The reduction that follows adds up each sequence's splits in a loop of `reduce_steps`
steps, and a ragged batch's long sequence makes the longest loop: a cost the rate,
interpolated between uniform points, does not see. Where a table holds a family's
measured cost per reduction step (the calibration `reduce_step_us`, measured by
serving/calibrate.py), the estimate adds it for each step the call's longest loop takes
beyond a uniform batch of its mean length.

The schedule-model protocol (`fit`, `load`, `load_calibration`, the model's `estimate`,
`point_rate` and `as_dict`) is the backends' (backends/__init__.py); the serving lookup
(serving/estimate.py) calls it without knowing which backend it models.
Python and numpy, with the replays and the model's estimate also in C (mla_tune/native.py;
the same numbers); nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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
from mla_tune.kernels.split_rule import (
    REDUCE_SPLITS_PER_STEP,
    SPLIT_WAVE_FILL,
    WIDE_REDUCE_PROGRAMS,
    batch_share,
    reduce_splits_per_step,
    serving_splits,
    split_items,
)
from mla_tune.xcompile.resources import CUDA_SMEM_RESERVED_PER_CTA, cuda_ctas_per_sm


def splitk_schedule(kv_lens: Sequence[int], heads: int, q_len: int, params: Mapping, occupancy: int,
                    sm_count: int, item_tokens: float = 0.0) -> tuple[float, int]:
    """(makespan, reduce steps) of the call, from one replay of the split rule: the load
    (tokens, plus item_tokens per program) of the most-loaded of sm_count x occupancy
    program slots when the call's split items, each run by heads // block_h programs (one
    per head tile, neighbours in launch order), are dealt program by program to the
    least-loaded slot, as the hardware's block scheduler runs them (programs beyond the
    slots wait for the first to finish; past EXACT_WAVES waves, the mean load plus half the
    longest item), and the steps of the reduction's longest loop (`reduce_steps`).
    kv_lens may be a numpy int64 array, which a caller replaying several
    variants for one call makes once: the replay is then vectorized (`_schedule_array`),
    with the same result as the per-sequence replay of split_rule.serving_splits."""
    if isinstance(kv_lens, np.ndarray):
        return _schedule_array(kv_lens, heads, q_len, params, occupancy, sm_count, item_tokens)
    splits = serving_splits(kv_lens, q_len, heads, **_rule(params, sm_count))
    items = split_items(kv_lens, splits)
    return (_deal(items, max(heads // int(params["block_h"]), 1), occupancy, sm_count, item_tokens),
            _steps(kv_lens, splits, q_len, heads))


def _schedule_array(lens: np.ndarray, heads: int, q_len: int, params: Mapping, occupancy: int,
                    sm_count: int, item_tokens: float) -> tuple[float, int]:
    """splitk_schedule over an int64 array: split_rule.serving_splits' rule in numpy (the
    same float64 share, n * budget / total, exact below 2**53), its items as a repeat, dealt
    by makespan.deal (what `_deal` does over a list); or all of it in C (`_NATIVE_SOURCE`, mla_tune/native.py: the same
    arithmetic) where a C compiler is found. tests/test_native_replays.py checks the C, the
    numpy and the loop against each other."""
    rule = _rule(params, sm_count)
    max_splits, block_n, batch = rule["max_splits"], rule["block_n"], int(lens.shape[0])
    tiles = max(heads // rule["block_h"], 1)
    budget, share_round = batch_share(batch, q_len, max_splits, rule["split_budget"], tiles, rule["sm_count"])
    lib = _native()
    if lib is not None:
        lens = np.ascontiguousarray(lens, dtype=np.int64)  # what the C reads
        span, steps = ctypes.c_double(), ctypes.c_int64()
        lib.sk_schedule(native.address(lens), lens.shape[0], max_splits, block_n, budget, share_round,
                        rule["tokens_per_split"], tiles, max(sm_count * occupancy, 1), float(item_tokens),
                        reduce_splits_per_step(batch, q_len, heads), EXACT_WAVES, ctypes.byref(span),
                        ctypes.byref(steps))
        return span.value, steps.value
    total = max(int(lens.sum()), 1)
    if max_splits > 1:
        want = np.floor(lens * budget / total + share_round + 1e-4).astype(np.int64)
        want = np.maximum(np.minimum(want, -(-lens // rule["tokens_per_split"])), 1)
        per = -(-lens // want)  # cdiv(n, want)
        split = np.maximum(-(-per // block_n), 1) * block_n
    else:
        split = np.maximum(-(-lens // block_n), 1) * block_n
    live = lens > 0
    if not live.all():
        lens, split = lens[live], split[live]
    if lens.shape[0] == 0:
        return 0.0, 0
    full, rest = np.divmod(lens, split)
    counts = full + (rest > 0)
    most = int(counts.max())
    per_step = reduce_splits_per_step(batch, q_len, heads)
    steps = -(-most // per_step) if most > 1 else 0
    items = np.repeat(split, counts)
    ends = np.cumsum(counts) - 1
    cut = rest > 0
    items[ends[cut]] = rest[cut]
    return deal(items, tiles, max(sm_count * occupancy, 1), float(item_tokens)), steps


# _schedule_array in C, the same arithmetic step by step (IEEE doubles, no contraction:
# mla_tune/native.py), with makespan.deal's dealing (native.DEAL_C).
_NATIVE_SOURCE = native.DEAL_C + native.ESTIMATE_H + r"""
#include <stdlib.h>
#include <math.h>

static int64_t split_of(int64_t len, int64_t total, int64_t max_splits, int64_t block_n, int64_t budget,
                        double share_round, int64_t tokens_per_split) {
    int64_t per = len;
    if (max_splits > 1) {
        double share = (double)(len * budget) / (double)total;
        int64_t want = (int64_t)floor(share + share_round + 1e-4);
        int64_t cap = (len + tokens_per_split - 1) / tokens_per_split;
        if (want > cap) want = cap;
        if (want < 1) want = 1;
        per = (len + want - 1) / want;
    }
    int64_t blocks = (per + block_n - 1) / block_n;
    return (blocks < 1 ? 1 : blocks) * block_n;
}

/* splitk_schedule's (makespan, reduce steps) over n lengths (in *span, *steps): 0, or -1
   where its buffer cannot be had. Each live sequence's split is taken once (buf); where its
   programs need dealing they go to greedy_runs as runs: its full splits', then its rest's. */
int sk_schedule(const int64_t *lens, int64_t n, int64_t max_splits, int64_t block_n, int64_t budget,
                double share_round, int64_t tokens_per_split, int64_t tiles, int64_t slots, double item_tokens,
                int64_t per_step, int64_t exact_waves, double *span, int64_t *steps) {
    int64_t most = 0, n_items = 0, longest = 0, tokens = 0, live = 0, total = 0;
    for (int64_t s = 0; s < n; s++) total += lens[s];
    if (total < 1) total = 1;
    /* the splits (n), then the runs (2 a sequence) and greedy_runs' buffer (3 x slots) */
    void *buf = malloc((size_t)n * sizeof(int64_t) + (size_t)(2 * n + 3 * slots) * sizeof(run_t));
    if (buf == NULL) return -1;
    int64_t *split = buf;
    for (int64_t s = 0; s < n; s++) {
        int64_t len = lens[s];
        if (len <= 0) { split[s] = 0; continue; }
        int64_t sp = split[s] = split_of(len, total, max_splits, block_n, budget, share_round, tokens_per_split);
        int64_t full = len / sp, rest = len % sp, counts = full + (rest > 0);
        int64_t item = full > 0 ? sp : rest;
        if (counts > most) most = counts;
        if (item > longest) longest = item;
        n_items += counts;
        tokens += len;
        live++;
    }
    if (live == 0) { *span = 0.0; *steps = 0; free(buf); return 0; }
    *steps = most > 1 ? (most + per_step - 1) / per_step : 0;
    if (deal_short(n_items, tiles, slots, exact_waves, tokens, longest, item_tokens, span)) { free(buf); return 0; }
    run_t *runs = (run_t *)(split + n);
    int64_t nr = 0;
    for (int64_t s = 0; s < n; s++) {
        if (split[s] == 0) continue;
        int64_t len = lens[s], full = len / split[s], rest = len % split[s];
        nr = add_run(runs, nr, (double)split[s] + item_tokens, full * tiles);
        if (rest > 0) nr = add_run(runs, nr, (double)rest + item_tokens, tiles);
    }
    *span = greedy_runs(runs, nr, slots, runs + 2 * n);
    free(buf);
    return 0;
}

/* greedy_runs over n programs' work (in launch order, equal neighbours made runs) and
   `slots` slots, the largest work where n <= slots: makespan.greedy_makespan for the tests'
   direct check of the dealing; NAN where its buffer cannot be had */
double sk_deal(const double *work, int64_t n, int64_t slots) {
    run_t *runs = malloc((size_t)(n + 3 * slots + 1) * sizeof(run_t));
    if (runs == NULL) return NAN;
    int64_t nr = 0;
    for (int64_t i = 0; i < n; i++) nr = add_run(runs, nr, work[i], 1);
    double span = greedy_runs(runs, nr, slots, runs + nr);
    free(runs);
    return span;
}

/* SplitKModel's replay for one call in one C call: out[0] the makespan and out[1] the
   reduction's steps (sk_schedule), out[2] the steps of a uniform batch of `batch`
   sequences of uniform_len tokens (uniform_reduce_steps). The model's constants are
   k[0..5]: max_splits, block_n, tokens_per_split, tiles, slots, exact_waves; item_tokens
   is `item`. */
/* uniform_reduce_steps: the reduction's steps for `batch` sequences of uniform_len tokens */
static int64_t uniform_steps(int64_t batch, int64_t uniform_len, int64_t max_splits, int64_t block_n,
                             int64_t budget, double share_round, int64_t tokens_per_split, int64_t per_step) {
    int64_t total = batch * uniform_len;
    if (total < 1) total = 1;
    int64_t split = uniform_len > 0
        ? split_of(uniform_len, total, max_splits, block_n, budget, share_round, tokens_per_split) : 0;
    int64_t most = split ? (uniform_len + split - 1) / split : 0;
    return batch >= 1 && most > 1 ? (most + per_step - 1) / per_step : 0;
}

/* split_rule.reduce_splits_per_step */
static int64_t per_step_of(int64_t batch, int64_t q_len, int64_t heads, int64_t wide_programs) {
    return batch * q_len * heads * 4 <= wide_programs ? 64 : 16;
}

int sk_replay(const int64_t *k, double item, const int64_t *lens, int64_t n, int64_t batch, int64_t budget,
              double share_round, int64_t per_step, int64_t uniform_len, double *out) {
    double span;
    int64_t steps;
    int rc = sk_schedule(lens, n, k[0], k[1], budget, share_round, k[2], k[3], k[4], item, per_step, k[5],
                         &span, &steps);
    out[0] = span;
    out[1] = (double)steps;
    out[2] = (double)uniform_steps(batch, uniform_len, k[0], k[1], budget, share_round, k[2], per_step);
    return rc;
}

/* split_rule.fill_splits, the same arithmetic */
static int64_t fill_splits(int64_t split_budget, int64_t batch, int64_t tiles, int64_t max_splits, int64_t sm,
                           double wave_fill) {
    int64_t s = split_budget / batch;
    if (s < 1) s = 1;
    if (sm <= 0 || s >= max_splits) {
        int64_t m = max_splits > 1 ? max_splits : 1;
        return s < m ? s : m;
    }
    int64_t per = batch * tiles, best = s;
    double best_fill = (double)(per * s) / (double)(sm * ((per * s + sm - 1) / sm));
    for (int64_t k = s; k <= max_splits; k++) {
        double f = (double)(per * k) / (double)(sm * ((per * k + sm - 1) / sm));
        if (f >= wave_fill) return k;
        if (f > best_fill + 1e-12) { best = k; best_fill = f; }
    }
    return best;
}

/* split_rule.batch_share: the split budget (and *share, the share's rounding) of a batch of n sequences */
static int64_t budget_of(int64_t n, int64_t q_len, int64_t max_splits, int64_t split_budget, int64_t tiles,
                         int64_t sm, double wave_fill, double *share) {
    int64_t q_len_max = 1;
    while (q_len_max < q_len) q_len_max <<= 1;
    int64_t budget = (n * q_len * max_splits) / q_len_max;
    if (budget < 1) budget = 1;
    *share = 0.5;
    if (split_budget > 0 && max_splits > 1) {
        int64_t launched = n * fill_splits(split_budget, n, tiles, max_splits, sm, wave_fill);
        if (launched < n) launched = n;
        if (launched < budget) budget = launched;
        *share = 1.0 - 2e-4;
    }
    return budget;
}

/* SplitKModel.estimate (not raw) as an est_model_fn; p: SplitKModel.native_estimate's layout */
double sk_model_estimate(const double *p, int64_t v, const est_call_t *c) {
    double mine = c->interp[v];
    if (isnan(mine) || mine >= c->window * c->interp_min) return NAN;
    int64_t occupancy = (int64_t)p[0], sm = (int64_t)p[2], max_splits = (int64_t)p[4], block_n = (int64_t)p[5];
    int64_t tps = (int64_t)p[6], block_h = (int64_t)p[7], split_budget = (int64_t)p[8];
    int64_t heads = (int64_t)p[9], q_len = (int64_t)p[10], exact_waves = (int64_t)p[14];
    double overhead = p[1], item = p[3];
    int64_t tiles = heads / block_h;
    if (tiles < 1) tiles = 1;
    int64_t slots = sm * occupancy;
    if (slots < 1) slots = 1;
    int64_t n = c->n;
    double share;
    int64_t budget = budget_of(n, q_len, max_splits, split_budget, tiles, sm, p[15], &share);
    int64_t wide = (int64_t)p[16], per_step = per_step_of(n, q_len, heads, wide);
    double rate = c->rates[v];
    if (isnan(rate)) {  /* the rate of the interpolated time at a uniform batch of the mean */
        int64_t b = c->batch;
        double ushare;
        int64_t ub = budget_of(b, q_len, max_splits, split_budget, tiles, sm, p[15], &ushare);
        int64_t *u = malloc((size_t)(b > 0 ? b : 1) * sizeof(int64_t));
        if (u == NULL) return NAN;
        for (int64_t i = 0; i < b; i++) u[i] = c->uniform_len;
        double uspan;
        int64_t usteps;
        sk_schedule(u, b, max_splits, block_n, ub, ushare, tps, tiles, slots, item, per_step_of(b, q_len, heads, wide),
                    exact_waves, &uspan, &usteps);
        free(u);
        rate = mine > overhead && uspan > 0 ? (mine - overhead) / uspan : NAN;
    }
    if (isnan(rate) || rate == 0.0) return NAN;
    double span;
    int64_t steps;
    if (sk_schedule(c->lens, n, max_splits, block_n, budget, share, tps, tiles, slots, item, per_step, exact_waves,
                    &span, &steps) != 0) return NAN;
    double t = overhead + rate * span;
    double step_us = per_step_of(c->batch, q_len, heads, wide) == 16 ? p[11] : p[12];
    if (c->calibrated && step_us != 0.0) {
        int64_t extra = steps - uniform_steps(c->batch, c->uniform_len, max_splits, block_n, budget, share, tps,
                                              per_step);
        t += step_us * (double)(extra > 0 ? extra : 0);
    }
    double floor_t = p[13] * mine;
    return t >= floor_t ? t : floor_t;
}
"""
_I64, _F64 = ctypes.c_int64, ctypes.c_double
_native = native.Library("splitk_schedule", _NATIVE_SOURCE, {
    "sk_schedule": (ctypes.c_int, (ctypes.c_void_p, _I64, _I64, _I64, _I64, _F64, _I64, _I64, _I64, _F64, _I64,
                                   _I64, ctypes.POINTER(_F64), ctypes.POINTER(_I64))),
    "sk_replay": (ctypes.c_int, (ctypes.c_void_p, _F64, ctypes.c_void_p, _I64, _I64, _I64, _F64, _I64, _I64,
                                 ctypes.c_void_p)),
    "sk_deal": (_F64, (ctypes.c_void_p, _I64, _I64))})


def reduce_steps(kv_lens: Sequence[int], heads: int, q_len: int, params: Mapping, sm_count: int) -> int:
    """The steps of the reduction's longest loop: the most splits of one sequence over the
    splits the reduction adds per step (split_rule.reduce_splits_per_step: 16, or 64 in
    the wide grid of small batches). 0 for one split per sequence (max_splits 1: no
    reduction). A ragged batch's long sequence takes most of its splits, and the
    reduction waits for it: it takes more steps than a uniform batch of the same tokens."""
    return _steps(kv_lens, serving_splits(kv_lens, q_len, heads, **_rule(params, sm_count)), q_len, heads)


def uniform_reduce_steps(batch: int, kv_len: int, heads: int, q_len: int, params: Mapping, sm_count: int) -> int:
    """`reduce_steps` of `batch` sequences of kv_len tokens each, without a pass over them."""
    if batch < 1:
        return 0
    split = serving_splits([kv_len], q_len, heads, **_rule(params, sm_count), batch=batch, total=batch * kv_len)[0]
    return _steps([kv_len], [split], q_len, heads, batch)


def _rule(params: Mapping, sm_count: int) -> dict:
    """A variant's split rule, as serving_splits takes it."""
    return {"max_splits": int(params["max_splits"]), "tokens_per_split": int(params["tokens_per_split"]),
            "block_n": int(params["block_n"]), "block_h": int(params["block_h"]),
            "split_budget": int(params.get("split_budget", 0)), "sm_count": sm_count}


def _steps(kv_lens: Sequence[int], splits: Sequence[int], q_len: int, heads: int, batch: int | None = None) -> int:
    """Steps of the longest reduction loop; 0 where every sequence runs one split (max_splits
    1 always does: its one split writes the output)."""
    most = max((-(-int(n) // s) for n, s in zip(kv_lens, splits, strict=True) if s), default=0)
    per_step = reduce_splits_per_step(len(kv_lens) if batch is None else batch, q_len, heads)
    return -(-most // per_step) if most > 1 else 0


def _deal(items: list[int], tiles: int, occupancy: int, sm_count: int, item_tokens: float) -> float:
    if not items:
        return 0.0
    slots = max(sm_count * occupancy, 1)
    programs = len(items) * tiles
    if programs <= slots:
        return max(items) + item_tokens
    if programs > EXACT_WAVES * slots:  # many waves: the slots even out, within one item
        return (sum(items) + item_tokens * len(items)) * tiles / slots + (max(items) + item_tokens) / 2
    loads = [0.0] * slots
    replace = heapq.heapreplace
    for w in items:
        w += item_tokens
        for _ in range(tiles):
            replace(loads, loads[0] + w)
    return max(loads)


# A fit may choose an occupancy only up to what an SM can hold of the variant's stage-1
# kernel: the grid cells alone cannot tell occupancies apart where every cell's programs
# fit in one wave (a batch budget), and an occupancy the SM cannot hold makes a batch past
# that wave look twice as fast as it runs (67 x 6194 tokens, bf16, 16 heads: estimated 144
# us at occupancy 3, measured 216, docs/perf.md 2.3). The kernel is register-bound: compiled
# for sm_90 by Triton 3.6, every split-K variant of the committed serving table takes 186 to
# 255 registers a thread, 10 or 8 warps an SM, so two CTAs of 4 warps and one of 8
# (tests/test_splitk_cost.py compiles them, on the CPU for sm_90 and on the H200). Shared
# memory bounds it too, by one KV tile of block_n tokens x 576 columns x 2 bytes (Triton
# keeps less than its num_stages tiles resident: 55 KiB at block_n 32, 92 KiB at 64).
# (Triton 3.9 compiles one of them to 178, the same CTAs.)
SPLITK_REGISTERS = 186  # registers a thread, the fewest of the stage-1 kernels Triton 3.6 compiles


def occupancy_cap(variant, smem_per_sm: int = 0) -> int:
    """The most stage-1 programs of this split-K variant one SM holds: what SPLITK_REGISTERS
    registers a thread leave for its num_warps warps (xcompile.resources.cuda_ctas_per_sm's
    rule), and what one KV tile (block_n x 576 x 2 bytes, plus the CTA's reserved KiB)
    leaves of smem_per_sm bytes (0: DEFAULT_SMEM_PER_SM); at least 1."""
    by_regs = cuda_ctas_per_sm(SPLITK_REGISTERS, 0, int(variant.get("num_warps") or 4), "sm_90")
    tile = int(variant.get("block_n")) * 576 * 2 + CUDA_SMEM_RESERVED_PER_CTA
    return max(1, min(by_regs, (smem_per_sm or DEFAULT_SMEM_PER_SM) // tile))


# ------------------------------------------------------------------ the model
# A split-K estimate stays at least this fraction of the variant's interpolated time
# (SplitKModel.floor): the model may say a call is slower than its uniform neighbours (a
# wave that overflows, a ragged batch's long sequence), but not much faster, since a replay
# that shortens the longest item (a split rule that cuts a sequence finer than the grid's
# points did) does not shorten the call in proportion. Without it, the rescore of the
# recorded runs that time split-K but not gluon_fused (docs/data/verify/h200-*,
# scripts/rescore_ablation.py SplitKModel.floor=0) takes the odd seeds' eager geomean regret
# from 0.15% to 0.17%; no other corpus or verdict moves.
SPLITK_FLOOR = 0.9


@dataclass(frozen=True)
class SplitKModel(MakespanModel):
    """A split-K variant's makespan model (makespan.MakespanModel): its makespan is
    `splitk_schedule`'s, its occupancy at most what an SM holds of its kernel
    (occupancy_cap), and where the table holds the family's measured cost per reduction
    step (the calibration) the estimate adds it for each step the call's longest loop
    takes beyond a uniform batch of its mean (`step_cost`)."""

    floor: ClassVar[float] = SPLITK_FLOOR

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "_replay_consts", None)  # replay's constants, laid out at its first call

    def native_estimate(self, key, calibration: Mapping) -> tuple[int, np.ndarray] | None:
        """(the address of `estimate`'s C function, its params) for the family's compiled
        estimate (serving/estimate.py), or None without a C compiler. calibration: the
        family's calibration of this backend (`load_calibration`'s)."""
        lib = _native()
        if lib is None:
            return None
        rule = _rule(self.params, self.sm_count)
        steps = (calibration or {}).get("reduce_step_us", {})
        narrow, wide = REDUCE_SPLITS_PER_STEP
        params = np.asarray([self.occupancy, self.overhead_us, self.sm_count, float(self.item_tokens),
                             rule["max_splits"], rule["block_n"], rule["tokens_per_split"], rule["block_h"],
                             rule["split_budget"], key.heads, key.q_len, float(steps.get(narrow, 0.0)),
                             float(steps.get(wide, 0.0)), self.floor, EXACT_WAVES, SPLIT_WAVE_FILL, WIDE_REDUCE_PROGRAMS],
                            dtype=np.float64)
        return ctypes.cast(lib.sk_model_estimate, ctypes.c_void_p).value, params

    def replay(self, call) -> tuple[float, int, int]:
        """(makespan, reduction steps) for the call's lengths (`schedule`) and the
        reduction steps of a uniform batch of its mean (`uniform_reduce_steps` at the
        estimator's uniform length, call.uniform_length()): in one C call where a C
        compiler is found, with the model's constants laid out once."""
        key, lens = call.key, call.lengths()
        uniform_len = call.uniform_length()
        lib = _native()
        if lib is None:
            span, steps = self.schedule(key, lens)
            return span, steps, uniform_reduce_steps(call.batch, uniform_len, key.heads, key.q_len, self.params,
                                                     self.sm_count)
        consts = self._replay_consts
        if consts is None or consts[0] != (key.heads, key.q_len):
            rule = _rule(self.params, self.sm_count)
            tiles = max(key.heads // rule["block_h"], 1)
            k = np.asarray([rule["max_splits"], rule["block_n"], rule["tokens_per_split"], tiles,
                            max(self.sm_count * self.occupancy, 1), EXACT_WAVES], dtype=np.int64)
            out = np.zeros(3)
            consts = ((key.heads, key.q_len), rule, tiles, k, k.ctypes.data, out, out.ctypes.data, lib.sk_replay)
            object.__setattr__(self, "_replay_consts", consts)
        _, rule, tiles, _, k_ptr, out, out_ptr, fn = consts
        batch = int(lens.shape[0])
        budget, share_round = batch_share(batch, key.q_len, rule["max_splits"], rule["split_budget"], tiles,
                                          rule["sm_count"])
        fn(k_ptr, float(self.item_tokens), native.address(lens), batch, call.batch, budget, share_round,
           reduce_splits_per_step(batch, key.q_len, key.heads), uniform_len, out_ptr)
        span, steps, uniform = out.tolist()
        return span, int(steps), int(uniform)

    def schedule(self, key, kv_lens: Sequence[int]) -> tuple[float, int]:
        """(makespan, steps of the reduction's longest loop): splitk_schedule."""
        return splitk_schedule(kv_lens, key.heads, key.q_len, self.params, self.occupancy, self.sm_count,
                               self.item_tokens)

    def reduction_steps(self, key, kv_lens: Sequence[int]) -> int:
        """The steps of the reduction's longest loop for these lengths (what calibrate.py
        probes): the second half of `schedule`."""
        return self.schedule(key, kv_lens)[1]

    def step_cost(self, call, steps: int, uniform: int) -> float:
        """The calibrated cost of each reduction step the call's longest loop takes beyond a
        uniform batch's (with call.calibrated; 0 without a calibration)."""
        step_us = call.calibration(self.variant.backend).get("reduce_step_us", {}).get(
            reduce_splits_per_step(call.batch, call.key.q_len, call.key.heads), 0.0)
        return step_us * max(steps - uniform, 0) if call.calibrated and step_us else 0.0


def fit(key, variants: Sequence, points: Mapping, cells: Mapping, platform: Mapping,
        interpolate: Callable) -> list[SplitKModel]:
    """Each variant's SplitKModel (makespan.fit_models: leave-one-out over its points), the
    occupancy at most occupancy_cap(variant, platform's smem_per_sm); `cells` is not used."""
    return fit_models(SplitKModel, occupancy_cap, key, variants, points, platform, interpolate)


def load(entry: Mapping, variant, key, check) -> SplitKModel:
    """A model from its table entry (as_dict's fields; `check`: the table's field checks,
    which raise its error naming the file, family and entry)."""
    return load_model(SplitKModel, "split-K", entry, variant, check)


def load_calibration(raw: Any, check) -> dict:
    """The family's calibration of this backend: {reduce_step_us: {splits per step (16 or
    64): us per step}} (serving/calibrate.py measures it)."""
    if not isinstance(raw, dict) or set(raw) != {"reduce_step_us"}:
        check.fail("the split-K calibration is {reduce_step_us: {splits per step: us}}")
    steps = raw["reduce_step_us"]
    if not isinstance(steps, dict) or not set(steps) <= set(REDUCE_SPLITS_PER_STEP):
        check.fail(f"reduce_step_us must map splits per reduction step "
                   f"({' or '.join(map(str, REDUCE_SPLITS_PER_STEP))}) to us per step, got {steps!r:.80}")
    return {"reduce_step_us": {k: check.number(f"reduce_step_us[{k}]", v) for k, v in sorted(steps.items())}}
