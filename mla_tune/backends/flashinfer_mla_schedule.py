"""FlashInfer's MLA schedule model: its schedule replayed on the host, and a linear model of
its time over it (the serving lookup's estimate for a FlashInfer variant).

FlashInfer's MLA `plan` (its C++ scheduler, `MLAPlan` in include/flashinfer/attention/
scheduler.cuh; the same algorithm in the 0.6 releases the H200 runs) splits each
sequence's KV into chunks of one length for the whole batch, kv_len_limit, about
total / clusters rounded up to 256 tokens, and deals the chunks in sequence order to
the least-loaded of the SMs' clusters. So its time steps where the chunks just overflow
the clusters: a few SMs run a second chunk, and the call takes about a chunk longer.

`flashinfer_mla_features` replays that dealing and returns what the time depends on; `fit`
fits `FLASHINFER_FEATURES` to FlashInfer's times over the family's grid (`fit_linear`,
weighted by 1 / time), and `VendorModel.estimate` predicts FlashInfer's time at the call's
own lengths: between grid points FlashInfer's time steps where interpolating its grid
times cannot see it. The schedule-model protocol is the backends' (backends/__init__.py).
Python and numpy, with the replays and the model's estimate also in C (mla_tune/native.py;
the same numbers); nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mla_tune import native
from mla_tune.backends.linear_schedule import (  # noqa: F401 (fit_linear, predict, relative_errors: re-exported)
    FIT_MIN_CELLS,
    WINDOW_C,
    LinearModel,
    fit_linear,
    fit_model,
    load_model,
    predict,
    relative_errors,
)

FLASHINFER_FEATURES = ("one", "makespan", "max_works", "merge_ctas", "batch", "max_merge")
_CTA_TILE_Q = 64
_SLOTS = 1 << 12  # clusters per GPU, at most (the heap's key packs the cluster's index)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_limit(per_cluster: int) -> int:
    """FlashInfer's kv_len_limit from ceil(total kv / clusters)."""
    if per_cluster <= 8:
        return 32
    if per_cluster <= 16:
        return 64
    if per_cluster <= 32:
        return 128
    if per_cluster <= 64:
        return 192
    return _ceil_div(per_cluster, 256) * 256


def _geometry(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """(cluster size, clusters, q tile rows, q tiles per sequence, kv_len_limit)."""
    packed = q_len * heads
    cluster = 2 if packed > _CTA_TILE_Q else 1
    clusters = max(sm_count // cluster, 1)
    tile = _CTA_TILE_Q * cluster
    q_tiles = _ceil_div(packed, tile)
    limit = _chunk_limit(max(_ceil_div(sum(int(n) for n in kv_lens) * q_tiles, clusters), 1))
    return cluster, clusters, tile, q_tiles, limit


def flashinfer_mla_works_per_cluster(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> float:
    """How many chunks FlashInfer deals per cluster, on average (O(batch), no dealing);
    kv_lens may be a numpy int64 array."""
    if isinstance(kv_lens, np.ndarray):  # the same integers, without a Python loop
        lib = _native()
        if lib is not None:
            lens = np.ascontiguousarray(kv_lens, dtype=np.int64)
            return lib.fi_works(native.address(lens), lens.shape[0], heads, q_len, sm_count)
        total = int(kv_lens.sum())
        _, clusters, _, q_tiles, limit = _geometry((total,), heads, q_len, sm_count)
        return int(np.maximum(-(-kv_lens // limit), 1).sum()) * q_tiles / clusters
    _, clusters, _, q_tiles, limit = _geometry(kv_lens, heads, q_len, sm_count)
    return sum(max(_ceil_div(int(n), limit), 1) for n in kv_lens) * q_tiles / clusters


def flashinfer_mla_features(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> list[float]:
    """[1, makespan, most works on one cluster, merge CTAs, batch, largest merge] of
    FlashInfer's MLA schedule for these lengths (every sequence with q_len new tokens):
    - makespan: the most-loaded cluster's cost, each chunk costing 2 x its q tile plus
      its tokens (FlashInfer's own cost function);
    - merge CTAs: the CTAs that merge split chunks; largest merge: the most partial rows
      one merge CTA reads (partial chunks x rows per CTA).
    In C where a C compiler is found (`_NATIVE_SOURCE`: the same integers, dealt as
    tests/test_native_replays.py's chunk-by-chunk replay deals them)."""
    lens = np.ascontiguousarray(kv_lens, dtype=np.int64)
    lib = _native()
    if lib is not None:
        out = (ctypes.c_int64 * 4)()
        if lib.fi_features(native.address(lens), lens.shape[0], heads, q_len, sm_count, out) == 0:
            return [1.0, float(out[0]), float(out[1]), float(out[2]), float(len(kv_lens)), float(out[3])]
    packed = q_len * heads
    cluster, clusters, tile, q_tiles, limit = _geometry((int(lens.sum()),), heads, q_len, sm_count)
    full, rest = np.divmod(lens, limit)
    merge_ctas = max_merge = 0
    split = lens > limit
    if split.any():  # the merge CTAs of each split sequence, once per q tile
        ctas = np.maximum(lens[split] * cluster // limit, 1)
        chunks = full[split] + (rest[split] > 0)
        merge_ctas = q_tiles * int(ctas.sum())
        for t in range(q_tiles):
            rows = min(tile, packed - t * tile)
            max_merge = max(max_merge, int((chunks * -(-rows // ctas)).max()))
    # Each sequence's chunks in launch order, once per q tile: `full` of kv_len_limit
    # tokens, then the rest (an empty sequence deals one chunk of no tokens); each costs
    # 2 x its q tile plus its tokens, in units of _SLOTS (the heap's key packs the
    # cluster's index below them).
    has_last = (rest > 0) | (full == 0)
    counts = full + has_last
    cost = np.repeat(np.full(lens.shape[0], (2 * tile + limit) * _SLOTS, dtype=np.int64), counts)
    ends = np.cumsum(counts) - 1
    cost[ends[has_last]] = (2 * tile + rest[has_last]) * _SLOTS
    if q_tiles > 1:
        starts = ends + 1 - counts
        seq = np.repeat(np.arange(lens.shape[0]), counts * q_tiles)
        at = np.arange(seq.shape[0]) - np.repeat(np.cumsum(counts * q_tiles) - counts * q_tiles, counts * q_tiles)
        cost = cost[starts[seq] + at % counts[seq]]
    cost = cost.tolist()
    # The clusters' loads as one heap of ints, load * _SLOTS + cluster: the least loaded,
    # ties to the lower index, as FlashInfer's MinHeap. The first `clusters` chunks take
    # clusters 0, 1, ... in turn (each finds an empty one, the lowest index first).
    first = min(clusters, len(cost))
    heap = [c + i for i, c in enumerate(cost[:first])] + list(range(first, clusters))
    works = [1] * first + [0] * (clusters - first)
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for c in cost[first:]:
        top = heap[0]
        works[top % _SLOTS] += 1
        replace(heap, top + c)
    makespan = max(heap) // _SLOTS
    return [1.0, float(makespan), float(max(works)), float(merge_ctas), float(len(kv_lens)), float(max_merge)]


# flashinfer_mla_features' schedule in C (mla_tune/native.py): FlashInfer's dealing, chunk by
# chunk, to the least-loaded cluster (its key packs the index below the load, as above).
_NATIVE_SOURCE = native.HEAP_C + native.ESTIMATE_H + WINDOW_C + r"""
#include <stdlib.h>
#include <string.h>
#define SLOTS 4096

#define CLUSTER_KEY(k) (k)
HEAP_OPS(keys, int64_t, CLUSTER_KEY)  /* keys_sift_down, keys_push: a heap of the clusters' keys */

/* _geometry and _chunk_limit: the cluster size, clusters, q tile rows, q tiles, kv_len_limit */
static void geometry(const int64_t *lens, int64_t n, int64_t heads, int64_t q_len, int64_t sm_count,
                     int64_t *g) {
    int64_t packed = q_len * heads, total = 0;
    int64_t cluster = packed > 64 ? 2 : 1, clusters = sm_count / cluster;
    if (clusters < 1) clusters = 1;
    int64_t tile = 64 * cluster, q_tiles = (packed + tile - 1) / tile;
    for (int64_t s = 0; s < n; s++) total += lens[s];
    int64_t per = (total * q_tiles + clusters - 1) / clusters, limit;
    if (per < 1) per = 1;
    if (per <= 8) limit = 32;
    else if (per <= 16) limit = 64;
    else if (per <= 32) limit = 128;
    else if (per <= 64) limit = 192;
    else limit = (per + 255) / 256 * 256;
    g[0] = cluster; g[1] = clusters; g[2] = tile; g[3] = q_tiles; g[4] = limit; g[5] = packed;
}

double fi_works(const int64_t *lens, int64_t n, int64_t heads, int64_t q_len, int64_t sm_count) {
    int64_t g[6], chunks = 0;
    geometry(lens, n, heads, q_len, sm_count, g);
    for (int64_t s = 0; s < n; s++) {
        int64_t c = (lens[s] + g[4] - 1) / g[4];
        chunks += c < 1 ? 1 : c;
    }
    return (double)(chunks * g[3]) / (double)g[1];
}

/* The clusters' keys (load * SLOTS + cluster) in three places whose least is the least key:
   `q` the keys not dealt to yet (ascending, taken from its front), `fifo` the keys dealt to
   since, where they came in ascending order (appended at its back), `heap` those that did
   not; `works` each cluster's chunks. Each place holds at most `clusters` keys. */
typedef struct {
    int64_t *q, *fifo, *heap, *works;
    int64_t a, nq, b, nf, nh, clusters;
} fi_loads_t;

/* one chunk of `cost` (in the keys' units) dealt to the least-loaded cluster (the least key:
   ties to the lower index, as FlashInfer's MinHeap) */
static void fi_deal(fi_loads_t *d, int64_t cost) {
    int64_t x = d->a < d->nq ? d->q[d->a] : INT64_MAX, y = d->b < d->nf ? d->fifo[d->b] : INT64_MAX;
    int64_t key;
    if (d->nh > 0 && d->heap[0] < x && d->heap[0] < y) {
        key = d->heap[0];
        if (d->nf == d->b || key + cost >= d->fifo[d->nf - 1]) {  /* it leaves the heap for the queue */
            d->heap[0] = d->heap[--d->nh];
            if (d->nh > 0) keys_sift_down(d->heap, d->nh);
        } else {
            d->works[key % SLOTS]++;
            d->heap[0] = key + cost;
            keys_sift_down(d->heap, d->nh);
            return;
        }
    } else if (x < y) {
        key = d->q[d->a++];
    } else {
        key = d->fifo[d->b++];
        if (d->b == d->nf) d->b = d->nf = 0;  /* the queue emptied: it starts again at its buffer's front */
    }
    d->works[key % SLOTS]++;
    key += cost;
    if (d->nf > d->b && key < d->fifo[d->nf - 1]) {  /* out of order: into the heap */
        keys_push(d->heap, d->nh++, key);
        return;
    }
    if (d->nf == d->clusters) {  /* at the buffer's end: the queue moved to its front */
        memmove(d->fifo, d->fifo + d->b, (size_t)(d->nf - d->b) * sizeof(int64_t));
        d->nf -= d->b;
        d->b = 0;
    }
    d->fifo[d->nf++] = key;
}

/* flashinfer_mla_features' integer features (out: makespan, max works, merge CTAs, max
   merge): 0, or -1 where its buffers cannot be had */
int fi_features(const int64_t *lens, int64_t n, int64_t heads, int64_t q_len, int64_t sm_count, int64_t *out) {
    int64_t g[6];
    geometry(lens, n, heads, q_len, sm_count, g);
    int64_t cluster = g[0], clusters = g[1], tile = g[2], q_tiles = g[3], limit = g[4], packed = g[5];
    int64_t *buf = calloc((size_t)(4 * clusters), sizeof(int64_t));
    if (buf == NULL) return -1;
    fi_loads_t d = {buf, buf + clusters, buf + 2 * clusters, buf + 3 * clusters, 0, clusters, 0, 0, 0, clusters};
    for (int64_t i = 0; i < clusters; i++) d.q[i] = i;  /* empty clusters, by index */
    int64_t merge_ctas = 0, max_merge = 0;
    int64_t full_cost = (2 * tile + limit) * SLOTS;
    for (int64_t s = 0; s < n; s++) {
        int64_t len = lens[s], full = len / limit, rest = len % limit;
        if (len > limit) {
            int64_t ctas = len * cluster / limit, chunks = full + (rest > 0);
            if (ctas < 1) ctas = 1;
            for (int64_t t = 0; t < q_tiles; t++) {
                int64_t rows = packed - t * tile;
                if (rows > tile) rows = tile;
                int64_t m = chunks * ((rows + ctas - 1) / ctas);
                merge_ctas += ctas;
                if (m > max_merge) max_merge = m;
            }
        }
        int64_t last = (rest > 0 || full == 0) ? (2 * tile + rest) * SLOTS : 0;
        for (int64_t t = 0; t < q_tiles; t++) {
            for (int64_t j = 0; j < full; j++) fi_deal(&d, full_cost);
            if (last) fi_deal(&d, last);
        }
    }
    int64_t top = d.a < d.nq ? d.q[d.nq - 1] : 0, most = 0;
    if (d.nf > d.b && d.fifo[d.nf - 1] > top) top = d.fifo[d.nf - 1];
    for (int64_t i = 0; i < d.nh; i++) if (d.heap[i] > top) top = d.heap[i];
    for (int64_t i = 0; i < clusters; i++) if (d.works[i] > most) most = d.works[i];
    out[0] = top / SLOTS;
    out[1] = most;
    out[2] = merge_ctas;
    out[3] = max_merge;
    free(buf);
    return 0;
}

/* VendorModel.estimate (not raw) as an est_model_fn; p: sm_count, heads, q_len, MODEL_WORKS,
   then the coefficients of FLASHINFER_FEATURES (one, makespan, max_works, merge_ctas, batch,
   max_merge) */
double fi_model_estimate(const double *p, int64_t v, const est_call_t *c) {
    double mine;
    int in = linear_window(v, c, &mine);
    if (in <= 0) return in < 0 ? NAN : mine;
    int64_t sm = (int64_t)p[0], heads = (int64_t)p[1], q_len = (int64_t)p[2];
    if (!(fi_works(c->lens, c->n, heads, q_len, sm) <= p[3])) return mine;
    int64_t f[4];
    if (fi_features(c->lens, c->n, heads, q_len, sm, f) != 0) return NAN;
    double feats[6] = {1.0, (double)f[0], (double)f[1], (double)f[2], (double)c->n, (double)f[3]};
    double t = 0.0;
    for (int i = 0; i < 6; i++) t = t + p[4 + i] * feats[i];
    return t;
}
"""
_I64 = ctypes.c_int64
_native = native.Library("flashinfer_schedule", _NATIVE_SOURCE, {
    "fi_works": (ctypes.c_double, (ctypes.c_void_p, _I64, _I64, _I64, _I64)),
    "fi_features": (ctypes.c_int, (ctypes.c_void_p, _I64, _I64, _I64, _I64, ctypes.POINTER(_I64)))})


# ------------------------------------------------------------------ the model
# The model replays FlashInfer's schedule, a heap operation per chunk. It runs only where
# FlashInfer deals at most MODEL_WORKS chunks per cluster: its steps are where its chunks
# just overflow the clusters, and more chunks cost more host time and step less. Rescoring
# docs/data/verify without the limit (scripts/rescore_ablation.py) changes no run's verdict.
MODEL_WORKS = 3.0


@dataclass(frozen=True)
class VendorModel(LinearModel):
    """FlashInfer's time as a linear model over its replayed schedule (FLASHINFER_FEATURES),
    fitted to its times over the family's grid; it replays only where FlashInfer deals at
    most MODEL_WORKS chunks per cluster."""

    FEATURES = FLASHINFER_FEATURES
    WHAT = "FlashInfer"

    def features(self, key, kv_lens: Sequence[int]) -> list[float]:
        return flashinfer_mla_features(kv_lens, key.heads, key.q_len, self.sm_count)

    def applies(self, key, kv_lens) -> bool:
        return flashinfer_mla_works_per_cluster(kv_lens, key.heads, key.q_len, self.sm_count) <= MODEL_WORKS

    def native_estimate(self, key, calibration) -> tuple[int, np.ndarray] | None:
        """(the address of `estimate`'s C function, its params) for the family's compiled
        estimate (serving/estimate.py), or None without a C compiler. calibration: unused
        (FlashInfer's model has none)."""
        lib = _native()
        if lib is None:
            return None
        params = np.asarray([self.sm_count, key.heads, key.q_len, MODEL_WORKS, *self.coef], dtype=np.float64)
        return ctypes.cast(lib.fi_model_estimate, ctypes.c_void_p).value, params


def fit(key, variants: Sequence, points: Mapping, cells: Mapping, platform: Mapping,
        interpolate: Callable) -> list[VendorModel]:
    """FlashInfer's model (linear_schedule.fit_model: its last-rung times at the family's
    aligned cells, where exactly one FlashInfer variant is among the eager picks). `points`
    and `interpolate` are not used."""
    return fit_model(VendorModel, key, variants, cells, platform)


def load(entry: Mapping, variant, key, check) -> VendorModel:
    """A model from its table entry (as_dict's fields; `check`: the table's field checks)."""
    return load_model(VendorModel, entry, variant, check)
